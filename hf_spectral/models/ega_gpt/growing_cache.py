"""A ``DynamicCache`` that appends in place: EGA-GPT's default KV cache.

``DynamicLayer.update`` concatenates, so every decoding step copies the whole cache of every layer: at batch 32 on
CPU that copy is about half of a small GPT's generation time (GPT-2 and EGA-GPT alike). ``GrowingLayer`` keeps the
keys and values at the front of larger buffers and writes each update into the spare room behind them; what it
returns, and what ``layer.keys`` / ``layer.values`` hold, are views of the filled front, shaped exactly as a
``DynamicLayer``'s tensors. Everything else of ``DynamicLayer`` (cropping, beam reordering, batch selection and
repetition, reset) is inherited: those replace ``keys`` / ``values`` by tensors of their own, which the next update
copies into a buffer again (as the concatenation would have).

In-place appends have two consequences the concatenation does not: a view returned before a ``crop`` sees the
positions written after it, and autograd cannot keep a view whose buffer is written later; so updates whose states
require gradients concatenate instead (a cache filled under autograd is a fresh tensor each step, as before).
"""

import functools

import torch
from transformers import PreTrainedConfig
from transformers.cache_utils import DynamicCache, DynamicLayer


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` that appends into spare room instead of concatenating.

    Args:
        reserve: the number of positions the first buffer holds (e.g. ``generate()``'s maximum length); later
            buffers double. 0: the first buffer holds exactly the first update.
    """

    def __init__(self, reserve: int = 0):
        super().__init__()
        if reserve < 0:
            raise ValueError(f"reserve must be >= 0, got {reserve}")
        self.reserve = reserve
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None
        self._returned: tuple = (None, None)  # the views the last update returned

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad):
            return super().update(key_states, value_states, *args, **kwargs)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.get_seq_length()
        total = length + key_states.shape[-2]
        # A decoding step after a decoding step: keys and values are still the views the last update returned.
        appending = self.keys is self._returned[0] and self.values is self._returned[1] and all(
            self._takes(buffer, new, total)
            for buffer, new in ((self._key_buffer, key_states), (self._value_buffer, value_states))
        )
        if not appending:
            self._refill(key_states, value_states, length, total)
        self._key_buffer[:, :, length:total].copy_(key_states)
        self._value_buffer[:, :, length:total].copy_(value_states)
        self.keys = self._key_buffer[:, :, :total]
        self.values = self._value_buffer[:, :, :total]
        self._returned = (self.keys, self.values)
        return self.keys, self.values

    def _refill(self, key_states, value_states, length: int, total: int) -> None:
        """Buffers that take ``total`` positions with the held keys and values at their fronts: the present ones where
        they fit (after a crop the held tensors are their fronts already; after a reorder, selection or repetition
        they are tensors of their own, copied in), else new ones (at least the reserve, at least twice the held)."""
        pairs = ((self.keys, self._key_buffer, key_states), (self.values, self._value_buffer, value_states))
        if not all(self._takes(buffer, new, total) for _, buffer, new in pairs) or any(
            self._aliases(held, buffer) for held, buffer, _ in pairs
        ):
            capacity = max(total, 2 * length, self.reserve)
            self._key_buffer, self._value_buffer = (new.new_empty(*new.shape[:2], capacity, new.shape[3])
                                                    for new in (key_states, value_states))
        for held, buffer in ((self.keys, self._key_buffer), (self.values, self._value_buffer)):
            if length and not self._is_front(held, buffer):
                buffer[:, :, :length].copy_(held)

    @staticmethod
    def _takes(buffer: torch.Tensor | None, new: torch.Tensor, total: int) -> bool:
        """Whether ``buffer`` holds ``total`` positions of states like ``new``."""
        return (buffer is not None and buffer.shape[2] >= total and buffer.dtype == new.dtype
                and buffer.device == new.device and buffer.shape[:2] == new.shape[:2]
                and buffer.shape[3] == new.shape[3])

    @staticmethod
    def _is_front(held: torch.Tensor, buffer: torch.Tensor) -> bool:
        return held.data_ptr() == buffer.data_ptr() and held.stride() == buffer.stride()

    def _aliases(self, held: torch.Tensor, buffer: torch.Tensor | None) -> bool:
        """Whether ``held`` lies in ``buffer`` elsewhere than at its front (copying it to the front could overwrite
        it); cropped fronts are fronts."""
        return (buffer is not None and held.numel() > 0 and not self._is_front(held, buffer)
                and held.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr())

    def reset(self) -> None:
        super().reset()
        self._key_buffer = self._value_buffer = None
        self._returned = (None, None)


class GrowingCache(DynamicCache):
    """A ``DynamicCache`` whose full-attention layers are ``GrowingLayer`` objects (sliding-window layers a config
    asks for stay as ``DynamicCache`` makes them).

    Args:
        config: the model's config, as for ``DynamicCache``; without one, layers are added as updates reach them.
        reserve: positions each layer's first buffer holds.
    """

    def __init__(self, config: PreTrainedConfig | None = None, reserve: int = 0):
        super().__init__(config=config)
        append_in_place(self, reserve)


def append_in_place(cache: DynamicCache, reserve: int = 0) -> DynamicCache:
    """Makes an empty ``DynamicCache``'s ``DynamicLayer`` objects (and those it adds later) ``GrowingLayer`` objects
    reserving ``reserve`` positions; returns the cache."""
    if cache.get_seq_length() > 0:
        raise ValueError("append_in_place needs an empty cache: its layers are replaced")
    cache.layers = [GrowingLayer(reserve) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    if cache.layer_class_to_replicate is DynamicLayer:
        cache.layer_class_to_replicate = functools.partial(GrowingLayer, reserve)
    return cache
