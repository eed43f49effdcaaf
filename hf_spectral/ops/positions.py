"""Positions and padding of new tokens after a KV cache whose length may be a tensor.

A ``DynamicCache`` knows its length on the host (an ``int``); a ``StaticCache`` keeps it as a tensor on the device,
and reading that (``int(...)``) makes a decoding step wait for the device and breaks a compiled graph. Code that
needs the new positions' columns of a padding mask, or their position ids, therefore indexes with the tensor where
it is one, and checks or shortcuts that read values on the host run only where that is free.
"""

import torch


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


def keep_padding_mask_for_generate(attention_mask=None, **kwargs):
    """``create_masks_for_generate`` of the models whose forward needs the 2D padding mask itself: hands it through.

    For a ``StaticCache`` generate() builds the attention backend's mask ahead of the forward: a 4D tensor, or a
    flex_attention ``BlockMask``, from which the padding cannot be read back. The energy gates' statistics skip
    padding, and the forwards of EGA-GPT and of retrofitted models build the backend's mask from the 2D one
    themselves (with transformers' mask functions, inside a compiled graph too)."""
    return attention_mask


__all__ = ["host_length", "host_reads_are_free", "keep_padding_mask_for_generate", "new_positions"]
