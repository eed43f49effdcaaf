"""Attention with an additive per-key logit bias (the energy gate's log g_j) through transformers' backends.

softmax_j(q_i·k_j·scale + bias_j) is the attention whose probabilities are gated by g_j and renormalised. Each
backend of ``transformers``' ``ALL_ATTENTION_FUNCTIONS`` gets the bias in the form it runs fastest:

* ``eager``: the bias is added to the scores (the returned probabilities are the gated, renormalised ones);
* ``flex_attention``: a ``score_mod`` adds ``bias[b, h, kv_idx]`` (no extra channel), with transformers' compiled
  flex kernel and the ``BlockMask`` its mask interface builds;
* ``sdpa`` (and any other backend): the bias is *folded* into one more channel of queries and keys,
  q' = [q, 1/scale, …], k' = [k, bias, 0…], v' = [v, 0…], so that q'·k'·scale = q·k·scale + bias and the fused
  causal kernel stays in use. On CUDA the folded head is padded to a multiple of 8 channels, the shape the flash
  and memory-efficient kernels accept, so SDPA never falls back to its math kernel.

The KV cache stores keys and values folded: each key keeps its bias in channel ``head_dim`` and the gate's
per-key state (``EnergyGate`` ``aux``) in the value channels after ``head_dim`` (their attention outputs are
discarded). Beam search, cropping, left padding and ``StaticCache`` then need nothing special (a ``StaticCache``'s
length stays on the device: ``cached_gate_state`` gathers at it); a cache that drops or alters keys (sliding window
past its window, quantisation) is refused by ``cached_length``.

Shapes: B batch, H query heads, Hk key/value heads (grouped-query attention when H > Hk), T positions, D head size.
"""

import torch
from torch import nn
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, StaticLayer, StaticSlidingWindowLayer
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
    key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor, aux: torch.Tensor | None = None, width: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """k' = [k, bias, 0…], v' = [v, aux, 0…], both ``width`` channels (default: the smallest that holds them).

    Args:
        key, value: (B, Hk, T, D).
        bias: (B, Hk, T) per-key logit bias; a longer one (window statistics re-bias every cached key) gives its
            last T.
        aux: optional (B, Hk, T, P) per-key state the KV cache must remember (raw energies, filter history).
    """
    head_dim = key.shape[-1]
    if aux is not None and aux.dtype != value.dtype:  # a cast would scramble float32 state packed in 16-bit channels
        raise ValueError(
            f"the gate state for the KV cache is {aux.dtype} but the values are {value.dtype}: ask the gate for "
            "`aux_dtype=value.dtype`"
        )
    extra = 0 if aux is None else aux.shape[-1]
    width = width or folded_head_size(head_dim, extra, key.device)
    if bias.shape[-1] != key.shape[-2]:
        bias = bias[..., -key.shape[-2] :]
    key = torch.cat([key, _zero_padded(as_dtype(bias, key.dtype).unsqueeze(-1), width - head_dim)], dim=-1)
    if aux is None:
        return key, _zero_padded(value, width)
    return key, torch.cat([value, _zero_padded(aux, width - head_dim)], dim=-1)


def no_static_cache_init_shape(model) -> None:
    """``_get_static_cache_init_shape`` of energy-gated models: ``None``, so that generate() lets a ``StaticCache``
    allocate each layer at its first write. (With ``prefill_chunk_size`` it would otherwise allocate every layer at
    the model's head size, where a gated layer stores its keys and values folded, wider by the bias and gate state.)"""
    return None


def _cache_layer(cache, layer_idx: int):
    """Layer ``layer_idx`` of a KV cache, or ``None`` (no cache, or a layer it has not created yet)."""
    return cache.layers[layer_idx] if cache is not None and layer_idx < len(cache.layers) else None


def stored_dtype(cache, layer_idx: int, dtype: torch.dtype) -> torch.dtype:
    """The dtype layer ``layer_idx`` of a KV cache holds its keys and values in: that of the values already written,
    else ``dtype`` (what this call computes). The gate state is packed in that dtype's layout (`pack_state`: two
    16-bit channels per float32 value), so new keys and values go into a cache filled in another dtype (under
    ``torch.autocast``, continued outside it, or the reverse) cast to the cache's dtype, as the packed state is."""
    layer = _cache_layer(cache, layer_idx)
    return layer.values.dtype if getattr(layer, "is_initialized", False) else dtype


def write_folded_kv(cache, layer_idx, key, value, bias, aux, head_dim: int, stored: torch.dtype, *args, **kwargs):
    """Fold ``bias`` and the gate state ``aux`` into the new keys/values, write them into ``cache`` in its dtype
    ``stored`` (`stored_dtype`) and return every cached key/value, folded, in the dtype of ``key`` (the call's).
    With window statistics (a ``bias`` over every cached key) the cached keys' bias channel is replaced too.
    ``args`` / ``kwargs`` go to ``cache.update``."""
    new_keys, computed = key.shape[-2], key.dtype
    key, value = fold_bias_into_kv(as_dtype(key, stored), as_dtype(value, stored), bias, aux)
    key, value = cache.update(key, value, layer_idx, *args, **kwargs)
    if bias.shape[-1] != new_keys:  # window statistics: every cached key's bias moved with the window
        key = replace_folded_bias(key, bias, head_dim)
    return as_dtype(key, computed), as_dtype(value, computed)


def projection_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a linear projection of ``x`` returns: the autocast dtype inside autocast (for ``x``'s device), else
    ``x.dtype``. (What a gate computed before the key/value projections asks its cached state to be.)"""
    if x.is_floating_point() and torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _zero_padded(tensor: torch.Tensor, channels: int) -> torch.Tensor:
    """``tensor`` with zero channels appended up to ``channels``."""
    return tensor if tensor.shape[-1] == channels else nn.functional.pad(tensor, (0, channels - tensor.shape[-1]))


def pad_query_for_bias(query: torch.Tensor, width: int, scaling: float) -> torch.Tensor:
    """q' = [q, 1/scaling, …] of ``width`` channels: the partner of ``fold_bias_into_kv``. The channels after the
    bias channel meet the keys' zeros, so they can repeat 1/scaling: one padding op per call."""
    return nn.functional.pad(query, (0, width - query.shape[-1]), value=1.0 / scaling)


def replace_folded_bias(key: torch.Tensor, bias: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Folded keys (B, Hk, T_cache, W) with the bias channel of the first ``bias.shape[-1]`` keys replaced by
    ``bias`` (B, Hk, T); out of place. (A ``StaticCache`` holds more keys than it has filled.)"""
    bias = as_dtype(bias, key.dtype)
    if bias.shape[-1] < key.shape[-2]:
        bias = torch.cat([bias, key[..., bias.shape[-1] :, head_dim]], dim=-1)
    return torch.cat([key[..., :head_dim], bias[..., None], key[..., head_dim + 1 :]], dim=-1)


def unfold_key_bias(
    key: torch.Tensor, value: torch.Tensor, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of ``fold_bias_into_kv`` for folded keys/values from a cache: (key, value, bias at least
    float32)."""
    return key[..., :head_dim], value[..., :head_dim], at_least_float32(key[..., head_dim])


# ----------------------------------------------------------------------------------------------------------------
# The KV cache's per-key gate state
# ----------------------------------------------------------------------------------------------------------------


def cached_length(layer, new: int = 0) -> int:
    """The number of keys a KV cache layer holds (before ``new`` more are written). Energy-gated layers keep per-key
    gate state in the cache, so the layer must keep every key as written, at its position: a ``DynamicLayer`` or
    ``StaticLayer`` (``DynamicCache``, ``StaticCache``, their offloaded forms), or a sliding-window layer as long as
    its window drops no key (the statistics count every earlier token). Quantised and other layers alter or move
    keys and raise."""
    if type(layer) in (DynamicLayer, StaticLayer):
        return int(layer.get_seq_length())
    if type(layer) in (DynamicSlidingWindowLayer, StaticSlidingWindowLayer):
        seen = int(layer.get_seq_length())
        if type(layer) is DynamicSlidingWindowLayer:
            dropped = seen - (layer.values.shape[-2] if layer.is_initialized else 0)
        else:  # a static window holds max_cache_len keys; its update drops the oldest once they would not fit
            dropped = max(0, seen + new - layer.max_cache_len)
        if dropped == 0:
            return seen
        raise ValueError(
            f"the KV cache's sliding window drops {dropped} key(s); energy-gated attention keeps its per-key gate "
            "state (statistics over every earlier token) in the cache and cannot continue past the window: pass "
            "`cache=transformers.DynamicCache()` (built without the config, its layers keep every key; "
            "the attention mask still applies the window). A static cache drops keys past the window too"
        )
    raise ValueError(
        f"energy-gated attention keeps per-key gate state in its KV cache and needs every key kept as written; "
        f"a {type(layer).__name__} does not: use a DynamicCache or a StaticCache"
    )


def cached_gate_state(
    cache, layer_idx: int, head_dim: int, token_mask: torch.Tensor | None, length: int, positions: int | None = None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """What an ``EnergyGate`` call on ``length`` new positions reads: ``(past_aux, valid)``.

    ``past_aux`` is the per-key gate state a layer's KV cache holds after the first ``head_dim`` value channels, for
    its cached keys, (B, Hk, P, ·), or ``None`` before the first key (or without a cache); ``valid`` is the padding
    mask of those keys and the new positions, (B, P + length), cut from ``token_mask`` (B, ≥ cached + new), or
    ``None`` without one.

    A ``StaticCache`` keeps its length on the device: only the last ``positions`` keys (the most a gate reads,
    ``EnergyGate.cached_positions``) are gathered, at tensor positions, so a decoding step never waits for the
    device (and compiles without a graph break). Positions before its first key read as zeros: a count of 0, silence
    for the filters, not a token (``valid`` is then always given, so that the gate's statistics treat a count of 0 as
    no past). ``positions=None`` (every key: window statistics) reads the length on the host.
    """
    layer = _cache_layer(cache, layer_idx)
    if getattr(layer, "is_initialized", False) and layer.keys.shape[-1] <= head_dim:
        raise ValueError(
            f"layer {layer_idx}'s KV cache holds keys of {layer.keys.shape[-1]} channels without the energy gate's "
            "folded bias and state (keys written outside the model, e.g. PEFT prefix tuning's virtual tokens): "
            "energy-gated attention can only continue a cache it filled itself"
        )
    if type(layer) is StaticLayer and layer.is_initialized and positions is not None:
        cached = layer.get_seq_length()
        slots = cached - positions + torch.arange(positions, device=cached.device)
        inside = torch.cat([slots >= 0, torch.ones(length, dtype=torch.bool, device=cached.device)])
        past = layer.values[:, :, :, head_dim:].index_select(2, slots.clamp(min=0))
        past = past.masked_fill(~inside[:positions, None], 0)  # a select, not arithmetic: packed float32 bits survive
        if token_mask is None:
            return past, inside.expand(past.shape[0], -1)
        columns = torch.cat([slots.clamp(min=0), cached + torch.arange(length, device=cached.device)])
        return past, token_mask[:, columns] & inside
    cached = 0 if layer is None else cached_length(layer, length)  # (an empty StaticLayer's is the int 0)
    if cached == 0:
        return None, None if token_mask is None else token_mask[:, :length]
    # Every cached key: slices of a cache's own length are views, and no slice at all where they cover everything.
    return layer.values[:, :, :cached, head_dim:], None if token_mask is None else token_mask[:, : cached + length]


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


def flex_attention_with_key_bias(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_bias: torch.Tensor,
    attention_mask,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """``flex_attention`` (transformers' compiled kernel) with a ``score_mod`` adding ``key_bias[b, h, kv_idx]``."""
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
    Static shapes recompile per shape instead (and run uncompiled past dynamo's recompilation limit)."""
    if not _STATIC_CPU_FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _STATIC_CPU_FLEX.append(torch.compile(flex_attention, dynamic=False))
    return _STATIC_CPU_FLEX[0]


def folded_attention(
    module: nn.Module,
    implementation: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    head_dim: int,
    attention_mask,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention over keys/values folded by ``fold_bias_into_kv`` (as a KV cache holds them): the bias channel is
    read back for eager and flex_attention; other backends get queries padded to the folded width.

    Returns (B, T, H, head_dim) and the backend's attention weights.
    """
    implementation = implementation_for_call(implementation, kwargs)
    if implementation in ("eager", "flex_attention"):
        key, value, bias = unfold_key_bias(key, value, head_dim)
        attend = eager_attention_with_key_bias if implementation == "eager" else flex_attention_with_key_bias
        return attend(module, query, key, value, bias, attention_mask, scaling, dropout, **kwargs)
    query = pad_query_for_bias(query, key.shape[-1], scaling)
    if value.shape[-1] > head_dim and value.dtype.itemsize < 4 and torch.is_grad_enabled():
        # A cache's 16-bit values carry the gate state as float32 bits, some of which read as inf or NaN: their
        # outputs are discarded, but the backward would multiply the zero gradients by them (0 · inf = NaN).
        value = _zero_padded(value[..., :head_dim], value.shape[-1])
    output, weights = ALL_ATTENTION_FUNCTIONS[implementation](
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )
    return output[..., :head_dim], weights


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
        return flex_attention_with_key_bias(module, query, key, value, key_bias, attention_mask, scaling, dropout)
    if key_bias is None:
        return ALL_ATTENTION_FUNCTIONS[implementation](
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    key, value = fold_bias_into_kv(key, value, key_bias)
    return folded_attention(
        module, implementation, query, key, value, query.shape[-1], attention_mask, scaling, dropout, **kwargs
    )


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
    "cached_gate_state",
    "cached_length",
    "eager_attention_with_key_bias",
    "flex_attention_forward",
    "flex_attention_with_key_bias",
    "fold_bias_into_kv",
    "folded_attention",
    "folded_head_size",
    "no_static_cache_init_shape",
    "pad_query_for_bias",
    "projection_dtype",
    "replace_folded_bias",
    "stored_dtype",
    "unfold_key_bias",
    "write_folded_kv",
]
