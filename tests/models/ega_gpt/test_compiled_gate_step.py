import os

import pytest
import torch

from hf_spectral.models.ega_gpt import compiled_gate_step
from hf_spectral.models.ega_gpt.compiled_gate_step import CausalGateStep, causal_gate_step_function
from hf_spectral.models.ega_gpt.energy_gate import (
    DerivedTensors,
    EnergyGate,
    caching_derived_tensors,
    causal_zscore_step,
    log_gate_bias,
)
from tests.models.ega_gpt.test_modeling_ega_gpt import padded_batch, tiny_model

needs_compiler = pytest.mark.skipif(
    compiled_gate_step._compiler() is None, reason="the compiled gate step needs a C compiler (CI has one)"
)


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """An empty kernel cache folder and no library loaded yet in this process."""
    monkeypatch.setattr(compiled_gate_step, "_loaded", {})
    monkeypatch.setenv("HF_SPECTRAL_KERNEL_CACHE", str(tmp_path / "kernels"))
    return tmp_path / "kernels"


@pytest.fixture
def step_calls(monkeypatch):
    """Counts calls of the compiled gate step."""
    calls = []
    original = CausalGateStep.__call__

    def counting(self, rows, values):
        calls.append(rows.shape[0])
        return original(self, rows, values)

    monkeypatch.setattr(CausalGateStep, "__call__", counting)
    return calls


@needs_compiler
@pytest.mark.parametrize("scales", [1, 2, 4])
def test_compiled_step_computes_what_the_torch_step_computes(scales):
    batch, heads, head_dim, past = 3, 4, 8, 6
    width = 2 * scales  # running means and M2s
    generator = torch.Generator().manual_seed(scales)
    gate = EnergyGate(heads * head_dim, heads, projections=scales)
    with torch.no_grad():
        for parameter in (gate.tau, gate.alpha, gate.mix_logits):
            parameter.normal_(0, 1.5, generator=generator)
    block = heads * (head_dim + width)
    rows = torch.randn(batch, 1, 3 * block + heads * scales, generator=generator)
    values = torch.randn(batch, heads, past, head_dim + width, generator=generator)
    values[..., head_dim + scales :] = values[..., head_dim + scales :].abs() * past  # M2 ≥ 0
    expected_rows = rows.clone()

    step = CausalGateStep(causal_gate_step_function(), gate.constants(), heads, head_dim, width, gate.eps)
    step(rows, values)

    energy = expected_rows[:, 0, 3 * block :].view(batch, heads, scales, 1)
    moments = values[:, :, -1, head_dim:]
    z, mean, m2 = causal_zscore_step(energy, past, moments[..., :scales, None], moments[..., scales:, None], gate.eps)
    bias, _ = log_gate_bias(z, gate.tau, gate.alpha, gate.mix_logits)
    qkv = expected_rows[:, 0, : 3 * block].view(batch, 3, heads, head_dim + width)
    qkv[:, 1, :, head_dim] = bias[..., 0]
    qkv[:, 2, :, head_dim : head_dim + scales] = mean[..., 0]
    qkv[:, 2, :, head_dim + scales :] = m2[..., 0]
    torch.testing.assert_close(rows, expected_rows, atol=2e-6, rtol=1e-6)


@needs_compiler
@pytest.mark.parametrize("variant", ["EGA-1", "EGA-2", "EGA-4"])
def test_generation_takes_the_compiled_step_and_equals_the_uncached_forward(variant, step_calls):
    model = tiny_model(variant)
    ids = padded_batch()[0][:, 5:]
    out = model.generate(ids, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        full = model(out.sequences).logits
    for step, logits in enumerate(out.logits):
        torch.testing.assert_close(logits, full[:, ids.shape[1] - 1 + step], atol=1e-5, rtol=0)
    assert len(step_calls) == 5 * model.config.num_hidden_layers  # every step after the prompt, every layer


@needs_compiler
@pytest.mark.parametrize(
    "settings",
    [
        dict(num_beams=3, num_return_sequences=2, do_sample=False),
        dict(do_sample=True, top_k=5, num_return_sequences=2),
    ],
    ids=["beam search", "sampling"],
)
def test_compiled_and_torch_decoding_generate_the_same(settings, step_calls, monkeypatch):
    """Beam search reorders the cache between steps, and sampling repeats the prompt's cache per sequence: the
    compiled step reads each row's state from wherever the cache put it."""
    model = tiny_model("EGA-2")
    ids = padded_batch()[0][:, 5:]

    def generate():
        torch.manual_seed(0)
        return model.generate(ids, max_new_tokens=6, output_scores=True, return_dict_in_generate=True, **settings)

    compiled = generate()
    assert step_calls
    monkeypatch.setenv("HF_SPECTRAL_COMPILED_KERNELS", "0")
    calls_before = len(step_calls)
    torch_code = generate()
    assert len(step_calls) == calls_before
    assert torch.equal(compiled.sequences, torch_code.sequences)
    for a, b in zip(compiled.scores, torch_code.scores):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@needs_compiler
def test_observed_gates_padding_and_other_energies_take_the_torch_step(step_calls):
    ids, mask = padded_batch()
    # left padding: the torch code's padded statistics
    model = tiny_model("EGA-1")
    model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    # energies the C code does not compute
    tiny_model("EGA-C").generate(ids[:, 5:], max_new_tokens=3, do_sample=False)
    # bfloat16
    tiny_model("EGA-1").to(torch.bfloat16).generate(ids[:, 5:], max_new_tokens=3, do_sample=False)
    assert step_calls == []

    # gate values asked for: a decoding step records them, as the torch code does
    with torch.no_grad(), caching_derived_tensors():
        out = model(ids[:, 5:], use_cache=True)
        recorded = model(ids[:, -1:], cache=out.cache, use_cache=True, output_gate_values=True).gate_values
    assert step_calls == []
    assert [g.shape for g in recorded] == [(3, 3, 1)] * 2
    # a user's hook on the gate sees every call
    seen = []
    model.model.h[0].attn.energy_gate.register_forward_hook(lambda module, args, output: seen.append(args[0].shape[1]))
    model.generate(ids[:, 5:], max_new_tokens=3, do_sample=False)
    assert seen == [9, 1, 1]
    assert len(step_calls) == 2  # the second layer, unhooked, still takes the compiled step


@needs_compiler
def test_in_place_weight_updates_inside_a_generation_rebuild_the_plans():
    model = tiny_model("EGA-1")
    ids = padded_batch()[0][:, 5:]
    with torch.no_grad(), caching_derived_tensors():
        out = model(ids, use_cache=True)
        model(ids[:, -1:], cache=out.cache, use_cache=True)
        assert model.model._decoding_plans.kept(None) is not DerivedTensors.MISSING
        model.model.h[1].attn.energy_gate.alpha.mul_(-2.0)
        assert model.model._decoding_plans.kept(None) is DerivedTensors.MISSING


def test_without_a_compiler_decoding_keeps_the_torch_code(fresh_build, monkeypatch, step_calls):
    monkeypatch.setenv("PATH", str(fresh_build.parent / "empty"))
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setattr(compiled_gate_step.sysconfig, "get_config_var", lambda name: None)
    assert causal_gate_step_function() is None
    model = tiny_model("EGA-1")
    ids = padded_batch()[0][:, 5:]
    out = model.generate(ids, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        full = model(out.sequences).logits
    torch.testing.assert_close(out.logits[-1], full[:, -2], atol=1e-5, rtol=0)
    assert step_calls == []


def test_a_failing_compiler_leaves_nothing_half_written(fresh_build, monkeypatch):
    monkeypatch.setenv("CC", "false")  # exits with status 1, writes nothing
    assert causal_gate_step_function() is None
    assert not fresh_build.exists() or os.listdir(fresh_build) == []


@needs_compiler
def test_the_library_is_built_once_into_the_cache_folder_and_can_be_switched_off(fresh_build, monkeypatch):
    assert causal_gate_step_function() is not None
    built = os.listdir(fresh_build)
    assert len(built) == 1 and built[0].startswith("ega_gate_step_")
    monkeypatch.setattr(compiled_gate_step, "_loaded", {})
    assert causal_gate_step_function() is not None
    assert os.listdir(fresh_build) == built  # reused, not rebuilt
    monkeypatch.setenv("HF_SPECTRAL_COMPILED_KERNELS", "0")
    assert causal_gate_step_function() is None
