import os

import pytest
import torch

from hf_spectral.models.ega_gpt import compiled_kernels
from hf_spectral.models.ega_gpt import modeling_ega_gpt
from hf_spectral.models.ega_gpt.compiled_kernels import (
    CompiledCausalGate,
    causal_attention_at_row_positions,
    causal_attention_with_key_bias,
    compiled_library,
    decoding_attention_with_key_bias,
)
from hf_spectral.models.ega_gpt.energy_gate import (
    DerivedTensors,
    EnergyGate,
    caching_derived_tensors,
    causal_zscore,
    causal_zscore_step,
    log_gate_bias,
)
from tests.helpers import assert_causal
from tests.models.ega_gpt.test_modeling_ega_gpt import VOCAB, padded_batch, tiny_model

needs_compiler = pytest.mark.skipif(
    compiled_kernels._compiler() is None, reason="the compiled kernels need a C compiler"
)


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """An empty kernel cache folder and no library loaded yet in this process."""
    monkeypatch.setattr(compiled_kernels, "_loaded", {})
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
    compiled = CompiledCausalGate(compiled_library(), gate.constants(), heads, head_dim, width, gate.eps)
    qkv = compiled.step(rows, padded, past - 1, past)
    torch.testing.assert_close(rows, expected, atol=2e-6, rtol=1e-6)
    assert qkv.shape == (3, batch, heads, 1, head_dim + width) and qkv.is_contiguous()
    torch.testing.assert_close(qkv, rows[:, 0, : 3 * block].view(batch, 3, heads, 1, -1).transpose(0, 1), atol=0, rtol=0)
    # the moments read from a single value row (the previous step's output) instead of the cache
    again = compiled.step(rows.clone(), padded[:, :, past - 1 : past].clone(), 0, past)
    torch.testing.assert_close(again, qkv, atol=0, rtol=0)


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
        assert_causal(lambda ids: model(ids).logits, ids, (2, 7), VOCAB)
    assert len(compiled_calls) == 3 * model.config.num_hidden_layers


@needs_compiler
def test_training_padding_and_other_energies_take_the_torch_gate(compiled_calls):
    ids, mask = padded_batch()
    model = tiny_model("EGA-1")
    model(ids[:, 5:], labels=ids[:, 5:]).loss.backward()  # autograd: the compiled gate has no backward
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
    monkeypatch.setattr(compiled_kernels.sysconfig, "get_config_var", lambda name: None)
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
    assert len(built) == 1 and built[0].startswith("ega_kernels_")
    monkeypatch.setattr(compiled_kernels, "_loaded", {})
    assert compiled_library() is not None
    assert os.listdir(fresh_build) == built  # reused, not rebuilt
    monkeypatch.setenv("HF_SPECTRAL_COMPILED_KERNELS", "0")
    assert compiled_library() is None


# ---- the compiled attention (causal attention with a per-key bias, forward and backward)


def reference_attention(qkv, bias, scaling, dropped=None):
    """The long way: scores, bias, causal mask, softmax (times the dropout factors ``dropped``), values."""
    query, key, value = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    length = query.shape[2]
    scores = query @ key.transpose(-1, -2) * scaling + bias[:, :, None, :]
    scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
    probabilities = scores.softmax(-1)
    if dropped is not None:
        probabilities = probabilities * dropped
    return (probabilities @ value).transpose(1, 2)


def random_attention_inputs(batch, length, heads, head_dim, seed=0, extra_channels=2):
    """qkv as a strided view (channels beyond head_dim, like the folded projection) and a strided bias."""
    generator = torch.Generator().manual_seed(seed)
    qkv = torch.randn(batch, length, 3, heads, head_dim + extra_channels, generator=generator)[..., :head_dim]
    bias = -3 * torch.rand(batch, length, heads, generator=generator)
    bias[:, ::5] = -95.0  # far below the rest: exp underflows for these keys
    return qkv.requires_grad_(), bias.requires_grad_()


@pytest.fixture
def attention_calls(monkeypatch):
    """Records torch.is_grad_enabled() for every call of the compiled attention from an EGA layer."""
    calls = []

    def counting(qkv, bias, scaling, dropout=0.0):
        calls.append(torch.is_grad_enabled())
        return causal_attention_with_key_bias(qkv, bias, scaling, dropout)

    monkeypatch.setattr(modeling_ega_gpt, "causal_attention_with_key_bias", counting)
    return calls


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(2, 1, 2, 8), (2, 63, 3, 8), (1, 64, 2, 16), (3, 130, 2, 32), (1, 200, 1, 33)])
def test_compiled_attention_and_its_gradients_equal_the_long_way(shape, threads):
    batch, length, heads, head_dim = shape
    qkv, bias = random_attention_inputs(batch, length, heads, head_dim)
    upstream = torch.randn(batch, length, heads, head_dim, generator=torch.Generator().manual_seed(1))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = causal_attention_with_key_bias(qkv, bias.transpose(1, 2), head_dim**-0.5)
        grad_qkv, grad_bias = torch.autograd.grad((out * upstream).sum(), (qkv, bias))
    finally:
        torch.set_num_threads(previous)
    expected = reference_attention(qkv, bias.transpose(1, 2), head_dim**-0.5)
    expected_qkv, expected_bias = torch.autograd.grad((expected * upstream).sum(), (qkv, bias))
    assert out.shape == (batch, length, heads, head_dim) and out.is_contiguous()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad_qkv, expected_qkv, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(grad_bias, expected_bias, atol=2e-5, rtol=1e-4)


@needs_compiler
def test_compiled_attention_is_causal():
    qkv, bias = random_attention_inputs(2, 150, 2, 8)
    reference = causal_attention_with_key_bias(qkv, bias.transpose(1, 2), 0.3)
    for position in (0, 63, 64, 100):
        changed_qkv, changed_bias = qkv.detach().clone(), bias.detach().clone()
        changed_qkv[:, position + 1 :] += torch.randn_like(changed_qkv[:, position + 1 :])
        changed_bias[:, position + 1 :] -= 2.0
        changed = causal_attention_with_key_bias(changed_qkv, changed_bias.transpose(1, 2), 0.3)
        assert torch.equal(changed[:, : position + 1], reference[:, : position + 1])
        assert not torch.allclose(changed[:, position + 1 :], reference[:, position + 1 :])


@needs_compiler
def test_compiled_attention_dropout_drops_probabilities_and_its_backward_uses_the_same_mask():
    # values = the identity over positions, so that the output is the (dropped) probability matrix itself
    batch, length, heads, dropout = 2, 96, 2, 0.25
    generator = torch.Generator().manual_seed(0)
    qkv = torch.randn(batch, length, 3, heads, length, generator=generator)
    qkv[:, :, 2] = torch.eye(length)[None, :, None, :]
    bias = -torch.rand(batch, heads, length, generator=generator)
    torch.manual_seed(3)
    dropped = causal_attention_with_key_bias(qkv, bias, 0.1, dropout).transpose(1, 2)  # (B, H, T, T)
    probabilities = reference_attention(qkv, bias, 0.1).transpose(1, 2)
    visible = torch.ones(length, length, dtype=torch.bool).tril()
    kept = dropped != 0
    assert not kept[..., ~visible].any()
    torch.testing.assert_close(dropped[kept], probabilities[kept] / (1 - dropout), atol=1e-6, rtol=1e-5)
    assert abs(kept[..., visible].float().mean().item() - (1 - dropout)) < 0.01  # 18 624 draws
    torch.manual_seed(3)
    assert torch.equal(causal_attention_with_key_bias(qkv, bias, 0.1, dropout).transpose(1, 2), dropped)

    # the backward with the forward's mask: the long way with the recovered factors
    mask = kept.float() / (1 - dropout)
    qkv_small, bias_small = random_attention_inputs(batch, length, heads, 8)
    upstream = torch.randn(batch, length, heads, 8, generator=generator)
    torch.manual_seed(3)
    out = causal_attention_with_key_bias(qkv_small, bias_small.transpose(1, 2), 0.1, dropout)
    grads = torch.autograd.grad((out * upstream).sum(), (qkv_small, bias_small))
    expected = reference_attention(qkv_small, bias_small.transpose(1, 2), 0.1, dropped=mask)
    expected_grads = torch.autograd.grad((expected * upstream).sum(), (qkv_small, bias_small))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@needs_compiler
def test_compiled_attention_rejects_what_it_cannot_take():
    qkv, bias = random_attention_inputs(2, 10, 2, 8)
    bias = bias.transpose(1, 2)
    with pytest.raises(ValueError, match="qkv must be"):
        causal_attention_with_key_bias(qkv[:, :, :2], bias, 0.3)
    with pytest.raises(ValueError, match="qkv must be"):
        causal_attention_with_key_bias(qkv.transpose(-1, -2), bias, 0.3)
    with pytest.raises(ValueError, match="bias must have shape"):
        causal_attention_with_key_bias(qkv, bias[:, :, :9], 0.3)
    with pytest.raises(ValueError, match="float32 CPU"):
        causal_attention_with_key_bias(qkv.double(), bias.double(), 0.3)
    with pytest.raises(ValueError, match="dropout"):
        causal_attention_with_key_bias(qkv, bias, 0.3, dropout=1.0)


@needs_compiler
def test_a_compiled_attention_that_does_not_reproduce_torch_is_not_used(monkeypatch, attention_calls):
    monkeypatch.setattr(compiled_kernels, "_loaded", {})
    original = compiled_kernels._attention_forward

    def wrong(*args, **kwargs):
        out, log_sum_exp = original(*args, **kwargs)
        return out + 1e-3, log_sum_exp

    monkeypatch.setattr(compiled_kernels, "_attention_forward", wrong)
    qkv, bias = random_attention_inputs(2, 10, 2, 8)
    assert causal_attention_with_key_bias(qkv, bias.transpose(1, 2), 0.3) is None
    model = tiny_model("EGA-1")
    ids = padded_batch()[0][:, 5:]
    loss = model(ids, labels=ids).loss
    with torch.no_grad():  # the compiled gate still runs; its biases must reach the torch attention
        logits = model(ids, use_cache=False).logits
    monkeypatch.setenv("HF_SPECTRAL_COMPILED_KERNELS", "0")
    monkeypatch.setattr(compiled_kernels, "_loaded", {})
    torch.testing.assert_close(loss, model(ids, labels=ids).loss, atol=1e-6, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(logits, model(ids, use_cache=False).logits, atol=1e-5, rtol=0)


@needs_compiler
@pytest.mark.parametrize("variant", ["EGA-1", "EGA-2", "EGA-C", "EGA-M"])
def test_training_attends_in_c_and_equals_the_torch_code(variant, attention_calls, monkeypatch):
    """Loss and every parameter's gradient through the compiled attention equal those of SDPA over the folded
    channel (the compiled attention switched off), for linear and windowed energies."""
    ids = padded_batch()[0][:, 2:]

    def loss_and_grads():
        model = tiny_model(variant).train()
        loss = model(ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    loss, grads = loss_and_grads()
    assert attention_calls == [True] * 2
    monkeypatch.setitem(compiled_kernels._loaded, "attention", None)
    torch_loss, torch_grads = loss_and_grads()
    assert len(attention_calls) == 4  # called, and declined: the kernel is off
    torch.testing.assert_close(loss, torch_loss, atol=1e-6, rtol=0)
    assert grads.keys() == torch_grads.keys() and any(".alpha" in name for name in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, torch_grads[name], atol=1e-5, rtol=1e-4, msg=name)


@needs_compiler
def test_training_with_attention_dropout_and_gradient_checkpointing(attention_calls):
    """Dropout in the compiled attention: random (a different mask per step), reproducible from torch's seed, and
    the recomputed forward of gradient checkpointing draws the same mask as the first (same gradients)."""
    ids = padded_batch()[0][:, 2:]

    def loss_and_grads(seed, checkpointing=False):
        model = tiny_model("EGA-1", attn_pdrop=0.3).train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        torch.manual_seed(seed)
        loss = model(ids, labels=ids).loss
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters() if p.grad is not None]

    loss, grads = loss_and_grads(0)
    again, grads_again = loss_and_grads(0, checkpointing=True)
    other, _ = loss_and_grads(1)
    assert len(attention_calls) >= 6 and all(attention_calls)
    assert torch.equal(loss, again) and not torch.equal(loss, other)
    for grad, grad_again in zip(grads, grads_again):
        torch.testing.assert_close(grad, grad_again, atol=1e-6, rtol=1e-5)


@needs_compiler
def test_inference_forward_attends_in_c_only_where_sdpa_would_run_unmasked(attention_calls):
    ids, mask = padded_batch()
    model = tiny_model("EGA-1")
    with torch.no_grad():
        model(ids[:, 5:])
        assert attention_calls == [False] * 2
        model(ids, attention_mask=mask)  # padding: a mask
        model.set_attn_implementation("eager")
        model(ids[:, 5:])  # eager: returns attention weights
        model.set_attn_implementation("sdpa")
        out = model(ids[:, 5:], use_cache=True)
        model(ids[:, :1], cache=out.cache)  # a cached past: a decoding step
    assert attention_calls == [False] * 4  # the prompt with a cache attends in C too


@needs_compiler
def test_training_through_the_compiled_attention_is_causal(attention_calls):
    model = tiny_model("EGA-2").train()
    ids = padded_batch()[0][:, 3:]
    assert_causal(lambda ids: model(ids).logits, ids, (2, 7), VOCAB)
    assert attention_calls and all(attention_calls)


@needs_compiler
def test_a_cache_built_with_autograd_through_the_compiled_attention_continues_like_the_torch_code(attention_calls):
    model = tiny_model("EGA-2")
    ids = padded_batch()[0][:, 3:]
    out = model(ids[:, :-1], use_cache=True)  # autograd on: the compiled attention, folded keys/values cached
    assert attention_calls == [True] * 2
    step = model(ids[:, -1:], cache=out.cache).logits[:, -1]
    torch.testing.assert_close(step, model(ids).logits[:, -1], atol=1e-5, rtol=0)


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("counts, keys", [((1, 1), 5), ((40, 0, 75), 300), ((130, 64), 200), ((200, 200), 200)])
def test_compiled_attention_at_row_positions_and_its_gradients_equal_the_long_way(counts, keys, threads):
    """Gathered queries (CHIAR's routed tokens) at ascending key slots against all keys of their row, rows with
    different query counts (one with none) in one call; with 2 threads the (row, head) pairs run in parallel."""
    heads, head_dim = 3, 16
    generator = torch.Generator().manual_seed(sum(counts))
    positions = [torch.randperm(keys, generator=generator)[:count].sort().values for count in counts]
    row_starts = torch.tensor([0, *counts]).cumsum(0)
    query = torch.randn(sum(counts), heads, head_dim, generator=generator).requires_grad_()
    key, value = (
        torch.randn(len(counts), keys, heads, head_dim, generator=generator).transpose(1, 2).requires_grad_()
        for _ in range(2)
    )
    upstream = torch.randn(sum(counts), heads, head_dim, generator=generator)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = causal_attention_at_row_positions(query, key, value, torch.cat(positions), row_starts, 0.25)
        grads = torch.autograd.grad((out * upstream).sum(), (query, key, value))
    finally:
        torch.set_num_threads(previous)
    expected = []
    for row, row_positions in enumerate(positions):
        row_query = query[row_starts[row] : row_starts[row + 1]].transpose(0, 1)  # (H, M, D)
        scores = row_query @ key[row].transpose(-1, -2) * 0.25
        hidden = torch.arange(keys)[None, None, :] > row_positions[None, :, None]
        expected.append((scores.masked_fill(hidden, float("-inf")).softmax(-1) @ value[row]).transpose(0, 1))
    expected = torch.cat(expected)
    expected_grads = torch.autograd.grad((expected * upstream).sum(), (query, key, value))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@needs_compiler
def test_compiled_attention_at_row_positions_dropout_and_its_backward_use_one_mask():
    """Values = the identity over key slots, so that each output row is its query's dropped probability row: kept
    entries are the probabilities / (1 - p), none lies after the query's slot, and the value gradient is
    out^T · upstream, which holds only if the backward redraws the forward's mask."""
    counts, keys, heads, dropout = (30, 0, 50), 64, 2, 0.3
    generator = torch.Generator().manual_seed(5)
    positions = [torch.randperm(keys, generator=generator)[:count].sort().values for count in counts]
    row_starts = torch.tensor([0, *counts]).cumsum(0)
    query = torch.randn(sum(counts), heads, keys, generator=generator)
    key = torch.randn(len(counts), heads, keys, keys, generator=generator)
    value = torch.eye(keys).expand(len(counts), heads, keys, keys).clone().requires_grad_()
    torch.manual_seed(3)
    dropped = causal_attention_at_row_positions(query, key, value, torch.cat(positions), row_starts, 0.1, dropout)
    torch.manual_seed(3)
    again = causal_attention_at_row_positions(query, key, value, torch.cat(positions), row_starts, 0.1, dropout)
    assert torch.equal(dropped, again)
    upstream = torch.randn(sum(counts), heads, keys, generator=generator)
    (grad_value,) = torch.autograd.grad((dropped * upstream).sum(), value)
    kept_fraction = []
    for row, row_positions in enumerate(positions):
        rows = slice(row_starts[row], row_starts[row + 1])
        probabilities = ((query[rows].transpose(0, 1) @ key[row].transpose(-1, -2)) * 0.1).masked_fill(
            torch.arange(keys)[None, None, :] > row_positions[None, :, None], float("-inf")
        ).softmax(-1)  # (H, M, S)
        got = dropped[rows].detach().transpose(0, 1)
        kept = got != 0
        assert not (kept & (probabilities == 0)).any()
        torch.testing.assert_close(got[kept], probabilities[kept] / (1 - dropout), atol=1e-6, rtol=1e-5)
        kept_fraction.append(kept[probabilities > 0].float())
        expected_grad = got.transpose(-1, -2) @ upstream[rows].transpose(0, 1)  # (H, S, D)
        torch.testing.assert_close(grad_value[row], expected_grad, atol=1e-5, rtol=1e-5)
    assert abs(torch.cat(kept_fraction).mean().item() - (1 - dropout)) < 0.03  # about 3 300 draws


@needs_compiler
def test_compiled_attention_at_row_positions_rejects_what_it_cannot_take():
    query, key = torch.randn(4, 2, 8), torch.randn(1, 2, 10, 8)
    positions, row_starts = torch.tensor([1, 3, 5, 9]), torch.tensor([0, 4])
    with pytest.raises(ValueError, match="ascend"):
        causal_attention_at_row_positions(query, key, key, positions.flip(0), row_starts, 0.3)
    with pytest.raises(ValueError, match="ascend"):
        causal_attention_at_row_positions(query, key, key, positions + 1, row_starts, 0.3)  # slot 10 of 10 keys
    with pytest.raises(ValueError, match="row_starts must run from 0 to 4"):
        causal_attention_at_row_positions(query, key, key, positions, torch.tensor([0, 3]), 0.3)
    with pytest.raises(ValueError, match="contiguous int64"):
        causal_attention_at_row_positions(query, key, key, positions.float(), row_starts, 0.3)
    with pytest.raises(ValueError, match="contiguous int64"):
        causal_attention_at_row_positions(query, key, key, positions, torch.tensor([0, 2, 4]), 0.3)
    with pytest.raises(ValueError, match="do not fit"):
        causal_attention_at_row_positions(query, key[..., :4], key[..., :4], positions, row_starts, 0.3)
    with pytest.raises(ValueError, match="adjacent channels"):
        causal_attention_at_row_positions(
            query.transpose(-1, -2).contiguous().transpose(-1, -2), key, key, positions, row_starts, 0.3
        )


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("length", [1, 17, 100])
def test_decoding_attention_over_a_folded_cache_equals_sdpa_over_the_folded_channels(length, threads):
    batch, heads, head_dim, width = 3, 2, 16, 2
    generator = torch.Generator().manual_seed(length)
    query = torch.randn(batch, heads, 1, head_dim + width, generator=generator)
    query[..., head_dim] = head_dim**0.5  # the folded query: 1 / scaling, then zeros
    query[..., head_dim + 1 :] = 0
    key, value = torch.randn(2, batch, length, heads, head_dim + width, generator=generator).transpose(2, 3)
    key[..., head_dim] = -4 * torch.rand(batch, heads, length, generator=generator)  # the keys' bias
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = decoding_attention_with_key_bias(query, key, value, head_dim, head_dim**-0.5)
    finally:
        torch.set_num_threads(previous)
    expected = torch.nn.functional.scaled_dot_product_attention(query, key, value, scale=head_dim**-0.5)
    assert out.shape == (batch, 1, heads, head_dim)
    torch.testing.assert_close(out, expected[..., :head_dim].transpose(1, 2), atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="not one decoding step"):
        decoding_attention_with_key_bias(query, key[..., :head_dim], value, head_dim, 0.25)


@needs_compiler
def test_generation_decodes_with_the_compiled_attention_and_equals_the_uncached_forward(monkeypatch):
    calls = []

    def counting(*args):
        calls.append(args[1].shape[2])
        return decoding_attention_with_key_bias(*args)

    monkeypatch.setattr(modeling_ega_gpt, "decoding_attention_with_key_bias", counting)
    model = tiny_model("EGA-2")
    ids = padded_batch()[0][:, 5:]
    out = model.generate(ids, max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert calls == [length for length in range(10, 14) for _ in range(model.config.num_hidden_layers)]
    with torch.no_grad():
        full = model(out.sequences).logits
    for step, logits in enumerate(out.logits):
        torch.testing.assert_close(logits, full[:, ids.shape[1] - 1 + step], atol=1e-5, rtol=0)


@needs_compiler
def test_compiled_decoding_steps_continue_a_reordered_or_cropped_cache(compiled_calls):
    """The running moments come from the cache's last key as it is now: after reordering rows (beam search) or
    cropping keys (assisted decoding), the next steps equal the uncached forward of the new sequences."""
    model = tiny_model("EGA-2")
    ids = padded_batch()[0][:, 5:]
    with torch.no_grad(), caching_derived_tensors():
        cache = model(ids[:, :6], use_cache=True).cache
        for t in (6, 7):
            model(ids[:, t : t + 1], cache=cache)
        order = torch.tensor([2, 0, 1])
        cache.reorder_cache(order)
        step = model(ids[order, 8:9], cache=cache).logits[:, -1]
        torch.testing.assert_close(step, model(torch.cat([ids[order, :8], ids[order, 8:9]], 1)).logits[:, -1],
                                   atol=1e-5, rtol=0)
        cache.crop(-2)  # 9 keys -> 7
        other = (ids[:, 7:8] + 1) % VOCAB
        step = model(other, cache=cache).logits[:, -1]
        torch.testing.assert_close(step, model(torch.cat([ids[order, :7], other], 1)).logits[:, -1], atol=1e-5, rtol=0)
    assert [name for name, _ in compiled_calls].count("step") == 4 * model.config.num_hidden_layers
