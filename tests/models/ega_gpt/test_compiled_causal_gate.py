import os

import pytest
import torch

from hf_spectral.models.ega_gpt import compiled_causal_gate
from hf_spectral.models.ega_gpt.compiled_causal_gate import CompiledCausalGate, compiled_library
from hf_spectral.models.ega_gpt.energy_gate import (
    DerivedTensors,
    EnergyGate,
    caching_derived_tensors,
    causal_zscore,
    causal_zscore_step,
    log_gate_bias,
)
from tests.helpers import perturb_after
from tests.models.ega_gpt.test_modeling_ega_gpt import VOCAB, padded_batch, tiny_model

needs_compiler = pytest.mark.skipif(
    compiled_causal_gate._compiler() is None, reason="the compiled causal gate needs a C compiler"
)


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """An empty kernel cache folder and no library loaded yet in this process."""
    monkeypatch.setattr(compiled_causal_gate, "_loaded", {})
    monkeypatch.setenv("HF_SPECTRAL_KERNEL_CACHE", str(tmp_path / "kernels"))
    return tmp_path / "kernels"


@pytest.fixture
def compiled_calls(monkeypatch):
    """Records ("step" | "prefill", rows shape) for every call of the compiled gate."""
    calls = []
    for name in ("step", "prefill"):
        original = getattr(CompiledCausalGate, name)

        def counting(self, rows, *args, _original=original, _name=name):
            calls.append((_name, tuple(rows.shape)))
            return _original(self, rows, *args)

        monkeypatch.setattr(CompiledCausalGate, name, counting)
    return calls


def random_gate(heads, head_dim, scales, seed):
    generator = torch.Generator().manual_seed(seed)
    gate = EnergyGate(heads * head_dim, heads, projections=scales)
    with torch.no_grad():
        for parameter in (gate.tau, gate.alpha, gate.mix_logits):
            parameter.normal_(0, 1.5, generator=generator)
    return gate, generator


def expected_rows(rows, bias, mean, m2, heads, head_dim, width):
    """``rows`` with the bias (B, H, T) and, unless None, the moments (B, H, S, T) written where the C code writes them."""
    batch, length, _ = rows.shape
    expected = rows.clone()
    scales = None if mean is None else mean.shape[2]
    qkv = expected[..., : 3 * heads * (head_dim + width)].view(batch, length, 3, heads, head_dim + width)
    qkv[:, :, 1, :, head_dim] = bias.transpose(1, 2)
    if mean is not None:
        qkv[:, :, 2, :, head_dim : head_dim + scales] = mean.permute(0, 3, 1, 2)
        qkv[:, :, 2, :, head_dim + scales : head_dim + 2 * scales] = m2.permute(0, 3, 1, 2)
    return expected


@needs_compiler
@pytest.mark.parametrize("scales", [1, 2, 4])
def test_compiled_step_computes_what_the_torch_step_computes(scales):
    batch, heads, head_dim, past = 3, 4, 8, 6
    width = 2 * scales  # running means and M2s
    gate, generator = random_gate(heads, head_dim, scales, seed=scales)
    block = heads * (head_dim + width)
    rows = torch.randn(batch, 1, 3 * block + heads * scales, generator=generator)
    values = torch.randn(batch, heads, past, head_dim + width, generator=generator)
    values[..., head_dim + scales :] = values[..., head_dim + scales :].abs() * past  # M2 ≥ 0

    energy = rows[:, 0, 3 * block :].view(batch, heads, scales, 1)
    moments = values[:, :, -1, head_dim:]
    z, mean, m2 = causal_zscore_step(energy, past, moments[..., :scales, None], moments[..., scales:, None], gate.eps)
    bias, _ = log_gate_bias(z, gate.tau, gate.alpha, gate.mix_logits)
    expected = expected_rows(rows, bias, mean, m2, heads, head_dim, width)

    padded = torch.cat([values, torch.randn(batch, heads, 3, head_dim + width, generator=generator)], 2)  # static
    CompiledCausalGate(compiled_library(), gate.constants(), heads, head_dim, width, gate.eps).step(rows, padded, past)
    torch.testing.assert_close(rows, expected, atol=2e-6, rtol=1e-6)


@needs_compiler
@pytest.mark.parametrize("with_state", [True, False], ids=["cache", "no cache"])
@pytest.mark.parametrize("scales", [1, 2, 4])
def test_compiled_prefill_computes_what_the_torch_gate_computes(scales, with_state):
    batch, heads, head_dim, length = 3, 4, 8, 11
    width = 2 * scales if with_state else 1
    gate, generator = random_gate(heads, head_dim, scales, seed=10 + scales)
    block = heads * (head_dim + width)
    rows = 3.0 * torch.randn(batch, length, 3 * block + heads * scales, generator=generator) + 2.0

    energy = rows[..., 3 * block :].view(batch, length, heads, scales).permute(0, 2, 3, 1)
    z, mean, m2 = causal_zscore(energy)
    bias, _ = log_gate_bias(z, gate.tau, gate.alpha, gate.mix_logits)
    expected = expected_rows(rows, bias, mean if with_state else None, m2, heads, head_dim, width)

    CompiledCausalGate(compiled_library(), gate.constants(), heads, head_dim, width, gate.eps).prefill(rows)
    torch.testing.assert_close(rows, expected, atol=1e-5, rtol=1e-5)


@needs_compiler
@pytest.mark.parametrize("variant", ["EGA-1", "EGA-2", "EGA-4"])
def test_inference_forward_takes_the_compiled_gate_and_equals_the_torch_code(variant, compiled_calls, monkeypatch):
    model = tiny_model(variant)
    ids = padded_batch()[0][:, 5:]
    with torch.no_grad():
        compiled = model(ids).logits
        assert [name for name, _ in compiled_calls] == ["prefill"] * model.config.num_hidden_layers
        monkeypatch.setenv("HF_SPECTRAL_COMPILED_KERNELS", "0")
        torch_code = model(ids).logits
    assert len(compiled_calls) == model.config.num_hidden_layers
    torch.testing.assert_close(compiled, torch_code, atol=1e-5, rtol=0)


@needs_compiler
def test_the_compiled_gate_is_causal(compiled_calls):
    model = tiny_model("EGA-2")
    ids = padded_batch()[0][:, 3:]
    with torch.no_grad():
        reference = model(ids).logits
        for position in (2, 7):
            changed = model(perturb_after(ids, position, VOCAB)).logits
            assert torch.equal(changed[:, : position + 1], reference[:, : position + 1])
            assert not torch.allclose(changed[:, position + 1 :], reference[:, position + 1 :])
    assert len(compiled_calls) == 3 * model.config.num_hidden_layers


@needs_compiler
def test_training_padding_and_other_energies_take_the_torch_code(compiled_calls):
    ids, mask = padded_batch()
    model = tiny_model("EGA-1")
    model(ids[:, 5:], labels=ids[:, 5:]).loss.backward()  # autograd: the C code has no backward
    assert model.model.h[0].attn.energy_gate.alpha.grad is not None
    with torch.no_grad():
        model(ids, attention_mask=mask)  # padding
        tiny_model("EGA-C")(ids[:, 5:])  # energies the C code does not compute
        tiny_model("EGA-1", energy_normalization="window")(ids[:, 5:])
        tiny_model("EGA-1").to(torch.bfloat16)(ids[:, 5:])
    model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)  # padded generation
    assert compiled_calls == []


@needs_compiler
@pytest.mark.parametrize("cache_implementation", [None, "static"], ids=["dynamic cache", "static cache"])
@pytest.mark.parametrize("variant", ["EGA-1", "EGA-2", "EGA-4"])
def test_generation_takes_the_compiled_gate_and_equals_the_uncached_forward(
    variant, cache_implementation, compiled_calls, monkeypatch
):
    model = tiny_model(variant)
    ids = padded_batch()[0][:, 5:]
    out = model.generate(ids, max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True,
                         cache_implementation=cache_implementation)
    layers = model.config.num_hidden_layers
    assert compiled_calls == [("prefill", (3, 9, compiled_calls[0][1][-1]))] * layers + [
        ("step", (3, 1, compiled_calls[0][1][-1]))
    ] * (5 * layers)
    monkeypatch.setenv("HF_SPECTRAL_COMPILED_KERNELS", "0")  # the reference: the torch code, uncached
    with torch.no_grad():
        full = model(out.sequences).logits
    for step, logits in enumerate(out.logits):
        torch.testing.assert_close(logits, full[:, ids.shape[1] - 1 + step], atol=1e-5, rtol=0)


@needs_compiler
@pytest.mark.parametrize(
    "settings",
    [
        dict(num_beams=3, num_return_sequences=2, do_sample=False),
        dict(do_sample=True, top_k=5, num_return_sequences=2),
    ],
    ids=["beam search", "sampling"],
)
def test_compiled_and_torch_code_generate_the_same(settings, compiled_calls, monkeypatch):
    """Beam search reorders the cache between steps, and sampling repeats the prompt's cache per sequence: the
    compiled step reads each row's state from wherever the cache put it."""
    model = tiny_model("EGA-2")
    ids = padded_batch()[0][:, 5:]

    def generate():
        torch.manual_seed(0)
        return model.generate(ids, max_new_tokens=6, output_scores=True, return_dict_in_generate=True, **settings)

    compiled = generate()
    assert any(name == "step" for name, _ in compiled_calls)
    monkeypatch.setenv("HF_SPECTRAL_COMPILED_KERNELS", "0")
    calls_before = len(compiled_calls)
    torch_code = generate()
    assert len(compiled_calls) == calls_before
    assert torch.equal(compiled.sequences, torch_code.sequences)
    for a, b in zip(compiled.scores, torch_code.scores):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@needs_compiler
def test_observed_gates_take_the_torch_code(compiled_calls):
    model = tiny_model("EGA-1")
    ids = padded_batch()[0][:, 5:]
    # gate values asked for: every pass records them, as the torch code does
    with torch.no_grad(), caching_derived_tensors():
        out = model(ids, use_cache=True, output_gate_values=True)
        recorded = model(ids[:, -1:], cache=out.cache, use_cache=True, output_gate_values=True).gate_values
    assert compiled_calls == []
    assert [g.shape for g in out.gate_values] == [(3, 3, 9)] * 2 and [g.shape for g in recorded] == [(3, 3, 1)] * 2
    # a user's hook on the gate sees every call; the other layer still takes the compiled gate
    seen = []
    model.model.h[0].attn.energy_gate.register_forward_hook(lambda module, args, output: seen.append(args[0].shape[1]))
    model.generate(ids, max_new_tokens=3, do_sample=False)
    assert seen == [9, 1, 1]
    assert [name for name, _ in compiled_calls] == ["prefill", "step", "step"]


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


def test_without_a_compiler_the_layers_keep_their_torch_code(fresh_build, monkeypatch, compiled_calls):
    monkeypatch.setenv("PATH", str(fresh_build.parent / "empty"))
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setattr(compiled_causal_gate.sysconfig, "get_config_var", lambda name: None)
    assert compiled_library() is None
    model = tiny_model("EGA-1")
    ids = padded_batch()[0][:, 5:]
    out = model.generate(ids, max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        full = model(out.sequences).logits
    torch.testing.assert_close(out.logits[-1], full[:, -2], atol=1e-5, rtol=0)
    assert compiled_calls == []


def test_a_failing_compiler_leaves_nothing_half_written(fresh_build, monkeypatch):
    monkeypatch.setenv("CC", "false")  # exits with status 1, writes nothing
    assert compiled_library() is None
    assert not fresh_build.exists() or os.listdir(fresh_build) == []


@needs_compiler
def test_the_library_is_built_once_into_the_cache_folder_and_can_be_switched_off(fresh_build, monkeypatch):
    assert compiled_library() is not None
    built = os.listdir(fresh_build)
    assert len(built) == 1 and built[0].startswith("ega_causal_gate_")
    monkeypatch.setattr(compiled_causal_gate, "_loaded", {})
    assert compiled_library() is not None
    assert os.listdir(fresh_build) == built  # reused, not rebuilt
    monkeypatch.setenv("HF_SPECTRAL_COMPILED_KERNELS", "0")
    assert compiled_library() is None
