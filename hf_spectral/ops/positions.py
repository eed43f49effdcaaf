"""Positions and padding of new tokens after a KV cache whose length may be a tensor.

A ``DynamicCache`` knows its length on the host (an ``int``); a ``StaticCache`` keeps it as a tensor on the device,
and reading that (``int(...)``) makes a decoding step wait for the device and breaks a compiled graph. Code that
needs the new positions' columns of a padding mask, or their position ids, therefore indexes with the tensor where
it is one, and checks or shortcuts that read values on the host run only where that is free.
"""

import torch


def token_positions(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) 0/1 or bool padding mask -> index of each token among the real tokens of its row (0 at padding): the
    positions generate() gives, which left padding does not shift."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def new_positions(per_position: torch.Tensor, past_length: int | torch.Tensor, length: int) -> torch.Tensor:
    """The columns of the ``length`` new positions, ``past_length`` … ``past_length + length - 1``, of a
    (batch, ≥ past + new) tensor (a padding mask, running counts of tokens); ``past_length`` may be a 0-dim tensor,
    indexed on its device without a host read."""
    if isinstance(past_length, torch.Tensor):
        return per_position[:, past_length + torch.arange(length, device=per_position.device)]
    return per_position[:, past_length : past_length + length]


def host_reads_are_free(tensor: torch.Tensor) -> bool:
    """Whether reading a value of ``tensor`` on the host costs nothing: a CPU tensor outside ``torch.compile``. On an
    accelerator the read would wait for the device; under compilation it would break the graph."""
    return tensor.device.type == "cpu" and not torch.compiler.is_compiling()


def host_length(past_length: int | torch.Tensor | None) -> int | None:
    """``past_length`` as an ``int`` where reading it costs nothing (an ``int``; a CPU tensor outside a compiled
    graph), else ``None``: for checks and shortcuts that may be skipped on a device or under ``torch.compile``."""
    if not isinstance(past_length, torch.Tensor):
        return past_length
    return int(past_length) if host_reads_are_free(past_length) else None


def padding_of_causal_mask(mask: torch.Tensor, length: int | torch.Tensor | None = None) -> torch.Tensor:
    """The (batch, keys) bool padding (True at tokens) of a causal 4D ``attention_mask`` (batch, 1, queries, keys),
    bool (True = seen) or additive (0 = seen): its last query row, which sees every earlier token; the first
    ``length`` columns (cached + new positions) where that is an ``int``, all of them otherwise (a ``StaticCache``'s
    length on a device or in a compiled graph: the columns after the new positions then read as padding).

    The gates and CHIAR's routing take the padding from this row, so the mask must be causal plus padding: where
    reading it is free (CPU, outside a compiled graph), any other mask — block-diagonal masks of packed sequences,
    a sliding window that hides earlier tokens — is refused rather than read as padding."""
    allowed = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0  # (batch, queries, keys)
    length = host_length(length)
    if length is not None:
        if allowed.shape[-1] < length:
            raise ValueError(
                f"the 4D attention_mask covers {allowed.shape[-1]} keys, but the call sees {length} (cached + new "
                "positions): give the mask a column for every key"
            )
        allowed = allowed[..., :length]
    tokens = allowed[:, -1]
    queries = allowed.shape[-2]
    seen = tokens.any(0).nonzero() if host_reads_are_free(allowed) else None
    # The new positions end at the last column the last query sees (a StaticCache's mask is wider).
    end = (length if length is not None else int(seen.max()) + 1) if seen is not None and len(seen) else 0
    if end >= queries > 0:
        query_positions = torch.arange(end - queries, end)
        causal = torch.arange(end)[None, :] <= query_positions[:, None]
        rows = allowed[..., :end]
        wrong = (rows != (tokens[:, None, :end] & causal)).any(-1)  # (batch, queries)
        # A padding query's row may also be left fully open (mask builders that keep every softmax row non-empty).
        wrong &= tokens[:, query_positions] | ~rows.all(-1)
        if bool(wrong.any()):
            raise ValueError(
                "a 4D attention_mask must be causal plus padding: the energy gates and CHIAR-Former's routing read "
                "the padding from its last row, and this mask hides other keys from some token (packed sequences' "
                "block-diagonal masks, sliding windows). Pass the 2D padding mask, with one sequence per row"
            )
    return tokens


def fixed_cache_width(cache) -> int | None:
    """The key slots of a cache whose size is fixed ahead (a ``StaticCache``: its widest layer's ``max_cache_len``),
    ``None`` for a cache that grows (``DynamicCache``) or no cache."""
    if cache is None or not getattr(cache, "is_compileable", False):
        return None
    widths = [getattr(layer, "max_cache_len", None) for layer in getattr(cache, "layers", ())]
    widths = [width for width in widths if isinstance(width, int)]
    return max(widths) if widths else None


def mask_width_is_valid(width: int, past_length: int, length: int, cache) -> bool:
    """Whether a 2D padding mask of ``width`` columns fits ``past_length`` cached and ``length`` new positions: exactly
    those, or, for a cache of fixed size, its every slot (`keep_padding_mask_for_generate`)."""
    return width == past_length + length or (width == fixed_cache_width(cache) and past_length + length <= width)


def keep_padding_mask_for_generate(attention_mask=None, cache=None, **kwargs):
    """``create_masks_for_generate`` of the models whose forward needs the 2D padding mask itself: hands it through,
    for a cache of fixed size padded with zeros to the cache's width.

    For a ``StaticCache`` generate() builds the attention backend's mask ahead of the forward: a 4D tensor, or a
    flex_attention ``BlockMask``, from which the padding cannot be read back. The energy gates' statistics and
    CHIAR-Former's routing skip padding, and the forwards of EGA-GPT, CHIAR-Former and retrofitted models build the
    backend's mask from the 2D one themselves (with transformers' mask functions, inside a compiled graph too). The
    zero columns are the cache's empty slots: the mask has the same shape at every decoding step, as the stock
    models' 4D mask has, so that a compiled decoding step is one graph (a growing mask is recompiled for at the step
    that fills the cache, where transformers' padding of a shorter mask stops being needed)."""
    width = fixed_cache_width(cache)
    if (
        isinstance(attention_mask, torch.Tensor)
        and attention_mask.ndim == 2
        and width is not None
        and attention_mask.shape[-1] < width
    ):
        attention_mask = torch.nn.functional.pad(attention_mask, (0, width - attention_mask.shape[-1]))
    return attention_mask


__all__ = ["fixed_cache_width", "host_length", "host_reads_are_free", "keep_padding_mask_for_generate",
           "mask_width_is_valid", "new_positions", "padding_of_causal_mask", "token_positions"]
