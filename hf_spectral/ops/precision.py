"""The working precision of the mechanisms' statistics, exponentials, logs and sums."""

import contextlib

import torch


def as_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor.to(dtype)``, without the call where ``tensor`` has that dtype already: a cast that changes nothing
    still costs a dispatch (about a microsecond on CPU), and a cached decoding step makes many of them on tensors of
    a few hundred values."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def at_least_float32(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in float32, or float64 where it is float64: no statistic runs in 16 bits, and a float64 model
    (e.g. under ``torch.autograd.gradcheck``) keeps its precision."""
    if tensor.dtype in (torch.float32, torch.float64):
        return tensor
    return tensor.to(torch.promote_types(tensor.dtype, torch.float32))


def full_precision(tensor: torch.Tensor):
    """A block in which ``torch.autocast`` (for ``tensor``'s device) is off: inside autocast, matmul-class ops
    (``@``, ``einsum``, ``linear``) cast float32 inputs back down to 16 bits, so ``at_least_float32`` alone would give
    a float32 result of 16-bit precision. (A device without autocast, e.g. ``meta``, gets an empty block; a compiled
    graph does not ask, as torch 2.10's Dynamo cannot trace the question, and runs on a device that has autocast.)"""
    if not torch.compiler.is_compiling() and not torch.amp.is_autocast_available(tensor.device.type):
        return contextlib.nullcontext()
    return torch.autocast(tensor.device.type, enabled=False)


__all__ = ["as_dtype", "at_least_float32", "full_precision"]
