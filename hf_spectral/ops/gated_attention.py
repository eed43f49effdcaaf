"""Attention with an additive per-key logit bias (the energy gate's log g_j) through transformers' backends.

softmax_j(q_i·k_j·scale + bias_j) is the attention whose probabilities are gated by g_j and renormalised. Each
backend of ``transformers``' ``ALL_ATTENTION_FUNCTIONS`` gets the bias in the form it runs fastest:

* ``eager``: the bias is added to the scores (the returned probabilities are the gated, renormalised ones);
* ``flex_attention``: a ``score_mod`` adds ``bias[b, h, kv_idx]`` (no extra channel), with transformers' compiled
  flex kernel and the ``BlockMask`` its mask interface builds;
* ``sdpa``: a decoding step (one query) gets the bias as SDPA's additive mask, at the model's head size; longer
  calls (training, a prefill) get it *folded* into one more channel of queries and keys, q' = [q, 1/scale, …],
  k' = [k, bias, 0…], v' = [v, 0…], so that q'·k'·scale = q·k·scale + bias and the fused causal kernel stays in use
  (a float mask of T × T would lose it). On CUDA the folded head is padded to a multiple of 8 channels, the shape the
  flash and memory-efficient kernels accept, so SDPA never falls back to its math kernel;
* any other backend: the folded head.

The KV cache keeps keys and values at the model's head size, and each key's bias and gate state in a cache layer of
the gate's own (``gate_cache.py``).

Shapes: B batch, H query heads, Hk key/value heads (grouped-query attention when H > Hk), T positions, D head size.
"""

import torch
from torch import nn
from transformers.integrations.flex_attention import compile_friendly_flex_attention, repeat_kv
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import logging

from .precision import as_dtype, at_least_float32, full_precision

try:  # flex_attention is missing from old or stripped-down torch builds
    from torch.nn.attention.flex_attention import BlockMask
except ImportError:  # pragma: no cover - depends on the torch build
    BlockMask = ()

logger = logging.get_logger(__name__)

FUSED_KERNEL_ALIGNMENT = 8  # channels: flash and memory-efficient SDPA on CUDA need head sizes divisible by 8


# ----------------------------------------------------------------------------------------------------------------
# Folding the bias into queries, keys and values
# ----------------------------------------------------------------------------------------------------------------


def fused_kernel_alignment(device: torch.device) -> int:
    """The multiple of channels a folded head is padded to on ``device``: 8 on CUDA, 1 elsewhere."""
    return FUSED_KERNEL_ALIGNMENT if torch.device(device).type == "cuda" else 1


def folded_head_size(head_dim: int, extra: int, device: torch.device) -> int:
    """Channels of a folded head: ``head_dim`` plus ``extra`` ≥ 1, rounded up to a multiple of 8 on CUDA."""
    alignment = fused_kernel_alignment(device)
    return -(-(head_dim + max(1, extra)) // alignment) * alignment


def fold_bias_into_kv(
    key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """k' = [k, bias, 0…], v' = [v, 0…], both ``width`` channels (default: the smallest that holds them).

    Args:
        key, value: (B, Hk, T, D).
        bias: (B, Hk, T) per-key logit bias.
    """
    head_dim = key.shape[-1]
    width = width or folded_head_size(head_dim, 1, key.device)
    key = torch.cat([key, _zero_padded(as_dtype(bias, key.dtype).unsqueeze(-1), width - head_dim)], dim=-1)
    return key, _zero_padded(value, width)


def _zero_padded(tensor: torch.Tensor, channels: int) -> torch.Tensor:
    """``tensor`` with zero channels appended up to ``channels``."""
    return tensor if tensor.shape[-1] == channels else nn.functional.pad(tensor, (0, channels - tensor.shape[-1]))


def pad_query_for_bias(query: torch.Tensor, width: int, scaling: float) -> torch.Tensor:
    """q' = [q, 1/scaling, …] of ``width`` channels: the partner of ``fold_bias_into_kv``. The channels after the
    bias channel meet the keys' zeros, so they can repeat 1/scaling: one padding op per call."""
    return nn.functional.pad(query, (0, width - query.shape[-1]), value=1.0 / scaling)


def key_bias_as_mask(key_bias: torch.Tensor, attention_mask, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask (B, Hk, 1, Tk) of one query position: the key bias (B, Hk, Tk), with the keys
    ``attention_mask`` blocks (bool, True = attend, or additive, of (B|1, 1, 1, ≥ Tk)) at the dtype's lowest value."""
    mask = key_bias[:, :, None, :]
    if isinstance(attention_mask, torch.Tensor):
        attention_mask = attention_mask[..., -1:, : key_bias.shape[-1]]
        if attention_mask.dtype == torch.bool:
            mask = mask.masked_fill(~attention_mask, torch.finfo(dtype).min)
        else:
            mask = mask + attention_mask
    return as_dtype(mask, dtype)


def sdpa_decoding_step_with_key_bias(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_bias: torch.Tensor, attention_mask,
    scaling: float, dropout: float = 0.0,
) -> torch.Tensor:
    """SDPA for one query position (B, H, 1, D) at the head size, the key bias as its additive mask; returns
    (B, 1, H, D). The query heads that share a key/value head are that head's query rows, (B, Hk, H / Hk, D): one
    position needs no causal mask between them, so grouped-query attention repeats neither the keys nor the mask."""
    batch, heads, _, head_dim = query.shape
    kv_heads = key.shape[1]
    output = nn.functional.scaled_dot_product_attention(
        query.reshape(batch, kv_heads, heads // kv_heads, head_dim), key, value,
        attn_mask=key_bias_as_mask(key_bias, attention_mask, query.dtype), dropout_p=dropout, scale=scaling,
    )
    return output.reshape(batch, heads, 1, head_dim).transpose(1, 2)


# ----------------------------------------------------------------------------------------------------------------
# Backends
# ----------------------------------------------------------------------------------------------------------------


def _key_value_groups(module, query: torch.Tensor, key: torch.Tensor) -> int:
    return getattr(module, "num_key_value_groups", query.shape[1] // key.shape[1])


def eager_attention_with_key_bias(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_bias: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q·kᵀ·scaling + bias + mask) · v; returns (B, T, H, D) and the gated, renormalised probabilities.

    A module that asks for its scores in float32 (GPT-2's ``reorder_and_upcast_attn``, which its eager attention
    honours) gets them: 16-bit queries and keys are multiplied in float32, outside autocast."""
    groups = _key_value_groups(module, query, key)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    if getattr(module, "reorder_and_upcast_attn", False):
        with full_precision(query):
            scores = torch.matmul(at_least_float32(query), at_least_float32(key).transpose(2, 3)) * scaling
    else:
        scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if key_bias is not None:
        bias = key_bias if groups == 1 else key_bias.repeat_interleave(groups, dim=1)
        scores = scores + as_dtype(bias[:, :, None, :], scores.dtype)
    attention_mask = _additive_mask(module, attention_mask, query, key)
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = nn.functional.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
    weights = as_dtype(weights, value.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def _additive_mask(module, attention_mask, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor | None:
    """The additive (B|1, 1, Tq, Tk) float mask eager attention adds to its scores, from whatever a backend's mask
    interface built: an additive mask as it is, a bool mask (True = attend), a flex ``BlockMask`` materialised, or
    ``None`` (SDPA's causal shortcut) as the causal mask aligned to the last key."""
    q_length, kv_length = query.shape[-2], key.shape[-2]
    if isinstance(attention_mask, BlockMask):
        from torch.nn.attention.flex_attention import create_mask

        attention_mask = create_mask(attention_mask.mask_mod, query.shape[0], 1, q_length, kv_length, query.device)
    elif attention_mask is None:
        if not getattr(module, "is_causal", True) or q_length == 1:
            return None
        positions = torch.arange(kv_length, device=query.device)
        attention_mask = positions[None, :] <= positions[-q_length:, None]
        attention_mask = attention_mask[None, None]
    if attention_mask.dtype == torch.bool:
        blocked = torch.full((), torch.finfo(query.dtype).min, dtype=query.dtype, device=query.device)
        return torch.where(attention_mask, torch.zeros_like(blocked), blocked)[..., :kv_length]
    return attention_mask[..., :kv_length]


def mask_with_key_bias(module, attention_mask, query: torch.Tensor, key: torch.Tensor, key_bias: torch.Tensor):
    """The additive mask (B, H, Tq, Tk) of an eager attention call with the key bias (B, Hk, Tk) added: what a
    family's own eager attention adds to its scores (after its soft-capping and scaling), so that it runs gated."""
    mask = _additive_mask(module, attention_mask, query, key)
    groups = _key_value_groups(module, query, key)
    bias = key_bias if groups == 1 else key_bias.repeat_interleave(groups, dim=1)
    bias = as_dtype(bias[:, :, None, :], query.dtype)
    return bias if mask is None else mask + bias


def flex_attention_with_key_bias(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_bias: torch.Tensor,
    attention_mask,
    scaling: float,
    dropout: float = 0.0,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """``flex_attention`` (transformers' compiled kernel) with a ``score_mod`` adding ``key_bias[b, h, kv_idx]``
    (after soft-capping the scores, where ``softcap`` is given: Gemma 2)."""
    if dropout > 0:
        raise ValueError(
            "`flex_attention` does not support attention dropout: use it for inference (`model.eval()`) or set the "
            "attention dropout to 0"
        )
    block_mask = attention_mask if isinstance(attention_mask, BlockMask) else None
    q_length, kv_length = query.shape[-2], key.shape[-2]
    if attention_mask is None and getattr(module, "is_causal", True) and q_length > 1:
        from torch.nn.attention.flex_attention import create_block_mask

        offset = kv_length - q_length  # queries are the last q_length positions

        def causal(batch_idx, head_idx, q_idx, kv_idx):
            return kv_idx <= q_idx + offset

        block_mask = create_block_mask(causal, None, None, q_length, kv_length, device=query.device)
    score_mask = None if block_mask is not None or attention_mask is None else attention_mask[:, :, :, : key.shape[-2]]
    groups = _key_value_groups(module, query, key)
    bias = None if key_bias is None else as_dtype(key_bias, query.dtype).contiguous()  # the CPU template reads it flat

    def score_mod(score, batch_idx, head_idx, q_idx, kv_idx):
        if softcap is not None:  # as the stock flex attention: the cap first, then the bias (a gate of probabilities)
            score = softcap * torch.tanh(score / softcap)
        if bias is not None:
            score = score + bias[batch_idx, head_idx // groups, kv_idx]
        if score_mask is not None:
            score = score + score_mask[batch_idx, 0, q_idx, kv_idx]
        return score

    inputs = (query.contiguous(), key.contiguous(), value.contiguous())
    options = dict(score_mod=score_mod, block_mask=block_mask, enable_gqa=groups > 1, scale=scaling)
    if query.device.type == "cpu" and not torch.compiler.is_compiling():
        output = _static_cpu_flex_attention()(*inputs, **options)
    else:
        if query.device.type == "cpu":
            # torch 2.13's CPU flex template builds no kernel whose score_mod or mask_mod reads a tensor computed in
            # the same graph (the gate's bias, a padding mask, CHIAR's routing): a graph break makes them inputs of
            # the kernel's graph.
            torch._dynamo.graph_break()
        output = compile_friendly_flex_attention(*inputs, training=module.training, **options)
    return output.transpose(1, 2).contiguous(), None


def flex_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Plain flex_attention (no bias) for ungated layers and CHIAR-Former: on CPU outside ``torch.compile`` the
    kernel compiled for static shapes (``_static_cpu_flex_attention``), which survives changing input shapes."""
    return flex_attention_with_key_bias(module, query, key, value, None, attention_mask, scaling, dropout)


_STATIC_CPU_FLEX = []


def _static_cpu_flex_attention():
    """flex_attention compiled for static shapes, for CPU. transformers compiles it once and lets recompilations
    make shapes dynamic; with dynamic sizes, torch 2.13's CPU flex template cannot build a kernel whose score or
    mask function reads a captured tensor (the gate's bias, transformers' padding mask): the C++ does not compile.
    Static shapes recompile per shape instead (and run uncompiled past dynamo's recompilation limit).

    On a CPU without AVX-512 flex_attention runs uncompiled (torch's reference implementation, exact but unfused):
    there torch 2.13's compiled CPU kernel computes wrong values for some shapes (plain ``torch.compile
    (flex_attention)``, no mask nor score_mod: queries and keys (3, 3, 8, 8) miss the reference by 0.46 on an AVX2
    EPYC, while (1, 1, 8, 8) and (3, 3, 9, 9) match it), see docs/design.md."""
    if not _STATIC_CPU_FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        if torch.backends.cpu.get_cpu_capability().upper().startswith("AVX512"):
            flex_attention = torch.compile(flex_attention, dynamic=False)
        _STATIC_CPU_FLEX.append(flex_attention)
    return _STATIC_CPU_FLEX[0]


def attention_with_key_bias(
    module: nn.Module,
    implementation: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_bias: torch.Tensor,
    attention_mask,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """softmax(q·kᵀ·scaling + key_bias) attention through the backend ``implementation`` (a name of
    ``ALL_ATTENTION_FUNCTIONS``, or ``"eager"``).

    Args:
        query: (B, H, Tq, D); key, value: (B, Hk, Tk, D).
        key_bias: (B, Hk, Tk) float logit bias per key, or ``None`` for plain attention (ungated layers: the
            backend's own function runs, except under ``output_attentions`` where eager does).
        attention_mask: what transformers' mask interface built for the backend (4D tensor, ``BlockMask`` or None).

    Returns:
        (B, Tq, H, D) and the attention weights (eager: the gated, renormalised probabilities).
    """
    implementation = implementation_for_call(implementation, kwargs)
    if implementation == "eager":
        return eager_attention_with_key_bias(module, query, key, value, key_bias, attention_mask, scaling, dropout)
    if implementation == "flex_attention":
        return flex_attention_with_key_bias(
            module, query, key, value, key_bias, attention_mask, scaling, dropout, softcap=kwargs.get("softcap")
        )
    attend = ALL_ATTENTION_FUNCTIONS[implementation]
    if key_bias is None:
        return attend(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if implementation == "sdpa" and query.shape[-2] == 1:  # a decoding step: the bias as the additive mask
        return sdpa_decoding_step_with_key_bias(query, key, value, key_bias, attention_mask, scaling, dropout), None
    head_dim = query.shape[-1]
    key, value = fold_bias_into_kv(key, value, key_bias)
    query = pad_query_for_bias(query, key.shape[-1], scaling)
    output, weights = attend(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    return output[..., :head_dim], weights


def implementation_for_call(implementation: str | None, kwargs: dict) -> str:
    """The backend for this call: ``eager`` when attention probabilities are asked for (``output_attentions``),
    which only eager computes, as transformers' own models fall back; otherwise ``implementation``."""
    implementation = implementation or "eager"
    if kwargs.pop("output_attentions", False) and implementation != "eager":
        logger.warning_once(
            f"`{implementation}` attention does not return attention probabilities; this call with "
            "`output_attentions=True` runs the eager attention instead."
        )
        return "eager"
    return implementation


__all__ = [
    "attention_with_key_bias",
    "implementation_for_call",
    "key_bias_as_mask",
    "mask_with_key_bias",
    "sdpa_decoding_step_with_key_bias",
    "eager_attention_with_key_bias",
    "flex_attention_forward",
    "flex_attention_with_key_bias",
    "fold_bias_into_kv",
    "folded_head_size",
    "pad_query_for_bias",
]
