"""The working precision of the mechanisms' statistics, exponentials, logs and sums."""

import torch


def at_least_float32(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in float32, or float64 where it is float64: no statistic runs in 16 bits, and a float64 model
    (e.g. under ``torch.autograd.gradcheck``) keeps its precision."""
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


__all__ = ["at_least_float32"]
