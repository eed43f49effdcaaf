"""Positions of new tokens after a KV cache whose length may be a tensor.

A ``DynamicCache`` knows its length on the host (an ``int``); a ``StaticCache`` keeps it as a tensor on the device,
and reading that (``int(...)``) makes a decoding step wait for the device and breaks a compiled graph. Code that
needs the new positions' columns of a padding mask, or their position ids, therefore indexes with the tensor where
it is one.
"""

import torch


def new_positions(per_position: torch.Tensor, past_length: int | torch.Tensor, length: int) -> torch.Tensor:
    """The columns of the ``length`` new positions, ``past_length`` … ``past_length + length - 1``, of a
    (batch, ≥ past + new) tensor (a padding mask, running counts of tokens); ``past_length`` may be a 0-dim tensor,
    indexed on its device without a host read."""
    if isinstance(past_length, torch.Tensor):
        return per_position[:, past_length + torch.arange(length, device=per_position.device)]
    return per_position[:, past_length : past_length + length]


__all__ = ["new_positions"]
