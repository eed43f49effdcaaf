"""Attention with a per-key logit bias (hf_spectral/ops/gated_attention.py) against gating and renormalising the
attention probabilities the long way, on every backend."""

import math

import pytest
import torch
from torch import nn

from tests.helpers import INDUCTOR_ISA_FORCED, INDUCTOR_SKIP_REASON
from hf_spectral.ops.gated_attention import (
    attention_with_key_bias,
    fold_bias_into_kv,
    folded_head_size,
    key_bias_as_mask,
    pad_query_for_bias,
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


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_a_decoding_step_gets_the_bias_at_the_head_size(backend, groups):
    """One query over cached keys, as a decoding step runs: under SDPA the bias is the additive mask (no folded
    channel), with the padding of a bool or an additive mask, for grouped-query heads too."""
    q, k, v, gate = _inputs(kv_heads=4 // groups)
    valid = torch.ones(2, 6, dtype=torch.bool)
    valid[0, :2] = False
    expected, _ = _gated_the_long_way(q, k, v, gate, valid)
    allowed = valid[:, None, None, :]
    additive = torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, torch.finfo(torch.float64).min)
    for mask in (allowed, additive):
        out, _ = attention_with_key_bias(_Attention(groups), backend, q[:, :, -1:], k, v, gate.log(), mask, 8**-0.5)
        torch.testing.assert_close(out, expected[:, -1:])
    built = key_bias_as_mask(gate.log(), allowed, torch.float64)
    assert built.shape == (2, 4 // groups, 1, 6) and torch.all(built[0, :, :, :2] == torch.finfo(torch.float64).min)
    torch.testing.assert_close(built[1, :, 0], gate.log()[1])


def test_folded_heads_are_padded_for_the_fused_cuda_kernels():
    assert folded_head_size(64, 1, torch.device("cpu")) == 65
    assert folded_head_size(64, 0, "cpu") == 65
    assert folded_head_size(64, 1, "cuda") == 72
    assert folded_head_size(64, 9, "cuda") == 80
    q, k, v, gate = _inputs()
    key, value = fold_bias_into_kv(k, v, gate.log(), width=16)
    query = pad_query_for_bias(q, 16, 8**-0.5)
    assert query.shape[-1] == key.shape[-1] == value.shape[-1] == 16
    # the query's channels after the bias channel meet the keys' zeros: their value does not enter the scores
    assert torch.all(query[..., 8:] == 1 / 8**-0.5) and torch.all(key[..., 9:] == 0) and torch.all(value[..., 8:] == 0)
    scores = query @ key.repeat_interleave(2, 1).transpose(-1, -2) * 8**-0.5
    expected = q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 8**-0.5 + gate.log().repeat_interleave(2, 1)[:, :, None]
    torch.testing.assert_close(scores, expected)


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
