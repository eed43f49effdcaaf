"""Attention with a per-key logit bias (hf_spectral/ops/gated_attention.py) against gating and renormalising the
attention probabilities the long way, on every backend."""

import math

import pytest
import torch
from torch import nn
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, StaticLayer, StaticSlidingWindowLayer

from tests.helpers import INDUCTOR_ISA_FORCED, INDUCTOR_SKIP_REASON
from hf_spectral.ops.gated_attention import (
    attention_with_key_bias,
    cached_gate_state,
    cached_length,
    fold_bias_into_kv,
    folded_attention,
    folded_head_size,
    pad_query_for_bias,
    replace_folded_bias,
)


class _Attention(nn.Module):
    is_causal = True

    def __init__(self, groups=1):
        super().__init__()
        self.num_key_value_groups = groups


def _inputs(batch=2, heads=4, kv_heads=2, length=6, dim=8, dtype=torch.float64, seed=2):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, length, dim, generator=generator, dtype=dtype)
    k, v = (torch.randn(batch, kv_heads, length, dim, generator=generator, dtype=dtype) for _ in range(2))
    gate = torch.rand(batch, kv_heads, length, generator=generator, dtype=dtype) * 0.98 + 0.01
    return q, k, v, gate


def _gated_the_long_way(q, k, v, gate, valid=None):
    """A_ij g_j / Σ_k A_ik g_k with A the causal softmax attention (grouped-query heads share a key head's gate)."""
    groups = q.shape[1] // k.shape[1]
    k, v, gate = (t.repeat_interleave(groups, dim=1) for t in (k, v, gate))
    length = q.shape[2]
    allowed = torch.ones(length, length, dtype=torch.bool).tril()[None, None]
    if valid is not None:
        allowed = allowed & valid[:, None, None, :]
    scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~allowed, -math.inf)
    gated = torch.softmax(scores, -1) * gate[:, :, None, :]
    probabilities = gated / gated.sum(-1, keepdim=True)
    return (probabilities @ v).transpose(1, 2), probabilities


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_bias_equals_gating_and_renormalising_the_attention(backend, groups):
    q, k, v, gate = _inputs(kv_heads=4 // groups)
    expected, probabilities = _gated_the_long_way(q, k, v, gate)
    module = _Attention(groups)
    out, weights = attention_with_key_bias(module, backend, q, k, v, gate.log(), None, q.shape[-1] ** -0.5)
    torch.testing.assert_close(out, expected)
    if backend == "eager":
        torch.testing.assert_close(weights, probabilities)


@pytest.mark.skipif(INDUCTOR_ISA_FORCED, reason=INDUCTOR_SKIP_REASON)
def test_flex_attention_adds_the_bias_in_a_score_mod():
    """One small compiled case (float32: the CPU flex kernel), with grouped-query heads."""
    q, k, v, gate = _inputs(dtype=torch.float32)
    expected, _ = _gated_the_long_way(q, k, v, gate)
    out, _ = attention_with_key_bias(_Attention(2), "flex_attention", q, k, v, gate.log(), None, 8**-0.5)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_padding_masks_reach_every_backend_that_needs_them():
    q, k, v, gate = _inputs()
    valid = torch.ones(2, 6, dtype=torch.bool)
    valid[0, :2] = False
    expected, _ = _gated_the_long_way(q, k, v, gate, valid)
    allowed = torch.ones(6, 6, dtype=torch.bool).tril()[None, None] & valid[:, None, None, :]
    additive = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, torch.finfo(torch.float64).min)
    for mask in (allowed, additive):
        for backend in ("eager", "sdpa"):
            out, _ = attention_with_key_bias(_Attention(2), backend, q, k, v, gate.log(), mask, 8**-0.5)
            torch.testing.assert_close(out[1:], expected[1:])
            torch.testing.assert_close(out[0, 2:], expected[0, 2:])


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_folded_keys_from_a_cache_give_the_same_attention(backend):
    """Keys and values folded with the bias and some per-key state (as a KV cache holds them)."""
    q, k, v, gate = _inputs()
    expected, _ = _gated_the_long_way(q, k, v, gate)
    aux = torch.randn(2, 2, 6, 3, dtype=torch.float64)
    key, value = fold_bias_into_kv(k, v, gate.log(), aux)
    assert key.shape[-1] == value.shape[-1] == 8 + 3  # equal head sizes: what the fused SDPA kernels need
    torch.testing.assert_close(value[..., 8:], aux)
    out, _ = folded_attention(_Attention(2), backend, q, key, value, 8, None, 8**-0.5)
    torch.testing.assert_close(out, expected)


def test_folded_heads_are_padded_for_the_fused_cuda_kernels():
    assert folded_head_size(64, 1, torch.device("cpu")) == 65
    assert folded_head_size(64, 0, "cpu") == 65
    assert folded_head_size(64, 1, "cuda") == 72
    assert folded_head_size(64, 9, "cuda") == 80
    q, k, v, gate = _inputs()
    key, value = fold_bias_into_kv(k, v, gate.log(), None, width=16)
    query = pad_query_for_bias(q, 16, 8**-0.5)
    assert query.shape[-1] == key.shape[-1] == value.shape[-1] == 16
    # the query's channels after the bias channel meet the keys' zeros: their value does not enter the scores
    assert torch.all(query[..., 8:] == 1 / 8**-0.5) and torch.all(key[..., 9:] == 0) and torch.all(value[..., 8:] == 0)
    scores = query @ key.repeat_interleave(2, 1).transpose(-1, -2) * 8**-0.5
    expected = q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 8**-0.5 + gate.log().repeat_interleave(2, 1)[:, :, None]
    torch.testing.assert_close(scores, expected)


def test_replacing_the_folded_bias_keeps_keys_beyond_it():
    q, k, v, gate = _inputs()
    key, _ = fold_bias_into_kv(k, v, gate.log())
    new_bias = torch.randn(2, 2, 4, dtype=torch.float64)
    replaced = replace_folded_bias(key, new_bias, 8)
    torch.testing.assert_close(replaced[..., :4, 8], new_bias)
    assert torch.equal(replaced[..., 4:, :], key[..., 4:, :]) and torch.equal(replaced[..., :8], key[..., :8])


def test_caches_that_drop_or_alter_keys_are_refused():
    keys = torch.zeros(1, 2, 5, 4)
    dynamic = DynamicLayer()
    dynamic.update(keys, keys)
    assert cached_length(dynamic) == 5
    static = StaticLayer(max_cache_len=8)
    static.update(keys, keys)
    assert cached_length(static) == 5
    window = DynamicSlidingWindowLayer(sliding_window=3)
    window.update(keys, keys)
    with pytest.raises(ValueError, match="sliding window drops 3 key"):
        cached_length(window)
    static_window = StaticSlidingWindowLayer(max_cache_len=16, sliding_window=7)  # holds 7 keys
    static_window.update(keys, keys)
    assert cached_length(static_window) == 5 and cached_length(static_window, new=2) == 5
    with pytest.raises(ValueError, match="sliding window drops 1 key"):
        cached_length(static_window, new=3)

    class OtherLayer(DynamicLayer):
        pass

    with pytest.raises(ValueError, match="needs every key kept as written"):
        cached_length(OtherLayer())


def test_gate_state_is_read_alike_from_dynamic_and_static_caches():
    """The cached keys' state after the head's channels and the padding mask of those keys and the new ones; from a
    StaticCache the last ``positions`` keys, gathered at its on-device length, positions before its first key read as
    zeros and not as tokens."""

    class Cache:
        def __init__(self, layer):
            self.layers = [layer]

    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 3, 4, 6, generator=generator)
    values = torch.randn(2, 3, 4, 6, generator=generator)
    token_mask = torch.tensor([[False, True, True, True, True, True], [True] * 6])  # 4 cached + 2 new
    dynamic, static = DynamicLayer(), StaticLayer(max_cache_len=9)
    for layer in (dynamic, static):
        layer.update(keys, values)
    for positions in (1, 3, 6, None):
        for layer in (dynamic, static):
            past, valid = cached_gate_state(Cache(layer), 0, 4, token_mask, 2, positions)
            read = 4 if type(layer) is DynamicLayer or positions is None else min(positions, 4)
            if type(layer) is StaticLayer and positions is not None and positions > 4:  # gathered before the start
                padding = positions - 4
                assert torch.equal(past[:, :, :padding], torch.zeros(2, 3, padding, 2))
                assert not valid[:, :padding].any()
                past, valid = past[:, :, padding:], valid[:, padding:]
            assert torch.equal(past, values[:, :, 4 - read :, 4:]) and torch.equal(valid, token_mask[:, 4 - read :])
    # without a padding mask a StaticCache still says which gathered positions hold keys (a count of 0 is no past)
    assert cached_gate_state(Cache(dynamic), 0, 4, None, 2, 3)[1] is None
    holds_keys = torch.tensor([[False] * 2 + [True] * 6] * 2)
    assert torch.equal(cached_gate_state(Cache(static), 0, 4, None, 2, 6)[1], holds_keys)
    # a StaticCache before its first update: no past; the mask of the new positions
    past, valid = cached_gate_state(Cache(StaticLayer(max_cache_len=9)), 0, 4, token_mask[:, 4:], 2, 1)
    assert past is None and torch.equal(valid, token_mask[:, 4:])
    assert cached_gate_state(None, 0, 4, None, 2, 1) == (None, None)


def test_output_attentions_falls_back_to_eager_with_a_warning(caplog):
    q, k, v, gate = _inputs()
    _, probabilities = _gated_the_long_way(q, k, v, gate)
    from transformers.utils import logging

    logging.warning_once.cache_clear()  # an earlier test may have had the warning already
    logging.enable_propagation()
    try:
        _, weights = attention_with_key_bias(
            _Attention(2), "sdpa", q, k, v, gate.log(), None, 8**-0.5, output_attentions=True
        )
    finally:
        logging.disable_propagation()
    torch.testing.assert_close(weights, probabilities)
    assert "runs the eager attention instead" in caplog.text


def test_folding_refuses_gate_state_of_another_dtype():
    """The state is packed for the values' dtype (float32 bits in 16-bit channels): a cast would scramble it."""
    key = value = torch.zeros(1, 2, 3, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="aux_dtype=value.dtype"):
        fold_bias_into_kv(key, value, torch.zeros(1, 2, 3), torch.zeros(1, 2, 3, 3))
