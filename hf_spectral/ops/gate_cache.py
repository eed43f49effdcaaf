"""The KV cache of energy-gated attention: keys and values at the model's head size, and beside them, per key, the
gate's logit bias and the state a later step continues from.

A gated attention layer replaces its layer of a transformers cache by the gated form of that layer's class at its
first write (`gated_cache_layer`), which holds what the layer held and three more tensors position for position
beside the keys, kept in step with them by its methods, so that beam search, cropping, batch selection, offloading,
``StaticCache`` and ``cache_implementation="static"`` need nothing special in ``generate()``:

* ``key_bias`` (B, Hk, T) float32: the log-gate bias of every cached key, which the attention adds to its scores;
* ``gate_state`` (B, Hk, T, F) float32 whatever the activation dtype: the running count, mean and M2 after each key
  (causal statistics) or its raw energies (window statistics); ``None`` for a gate without statistics;
* ``gate_features`` (B, Hk, T, F') in the activation dtype: what the filter energies (conv, Morlet, Daubechies)
  read back of earlier inputs; ``None`` for linear energies.

The layers accepted are those that keep every key as written, at its position: ``DynamicLayer`` and ``StaticLayer``
(``DynamicCache``, ``StaticCache``, their offloaded forms), and their sliding-window forms as long as the window
drops no key (the gate's statistics count every earlier token). A layer that alters or moves keys (quantised, or a
window past its size) is refused, as are keys written into a gated layer without the gate's data (PEFT prefix
tuning's virtual tokens: the gate cannot continue a cache it did not fill).

Shapes: B batch, Hk key/value heads, T cached positions.
"""

import torch
from transformers.cache_utils import (
    CacheLayerMixin,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    StaticLayer,
    StaticSlidingWindowLayer,
)

from .precision import as_dtype, at_least_float32


class EnergyGateCacheLayerMixin(CacheLayerMixin):
    """Mixed into a transformers cache layer class (see the module docstring)."""

    key_bias: torch.Tensor | None = None
    gate_state: torch.Tensor | None = None
    gate_features: torch.Tensor | None = None
    _pending_gate: tuple | None = None

    # -- writing -----------------------------------------------------------------------------------------------

    def update(self, key_states, value_states, *args, **kwargs):
        """The stock update, after storing what `stage_gate` staged for these keys at their positions."""
        pending, self._pending_gate = self._pending_gate, None
        if pending is None:
            raise ValueError(
                "keys were written into an energy-gated layer of the KV cache without the gate's data (e.g. PEFT "
                "prefix tuning's virtual tokens): energy-gated attention can only continue a cache it filled itself"
            )
        new = key_states.shape[-2]
        self._check_keeps_every_key(new)
        if self.is_initialized:  # new keys in the cache's dtype (under autocast, or continued outside it)
            key_states, value_states = as_dtype(key_states, self.keys.dtype), as_dtype(value_states, self.values.dtype)
        if isinstance(self, StaticLayer):
            self._write_static(*pending, new=new, device=key_states.device)
        else:
            self._write_dynamic(*pending, new=new)
        return super().update(key_states, value_states, *args, **kwargs)

    def stage_gate(self, bias: torch.Tensor, state: torch.Tensor | None, features: torch.Tensor | None) -> None:
        """Hand over the gate's data for the keys the next ``update`` writes: ``bias`` (B, Hk, T_new) float32, or
        (B, Hk, T_past + T_new) with window statistics, whose every key's bias changes with the window; ``state``
        (B, Hk, T_new, F) float32 and ``features`` (B, Hk, T_new, F'), or ``None``."""
        self._pending_gate = (at_least_float32(bias), None if state is None else at_least_float32(state), features)

    def _write_dynamic(self, bias, state, features, new: int) -> None:
        self.key_bias = bias if bias.shape[-1] != new else _appended(self.key_bias, bias, dim=-1)
        if state is not None:
            self.gate_state = _appended(self.gate_state, state, dim=-2)
        if features is not None:
            self.gate_features = _appended(self.gate_features, features, dim=-2)

    def _write_static(self, bias, state, features, new: int, device) -> None:
        if self.key_bias is None:  # allocated at the first write, at the cache's full length
            self._allocate_static(bias, state, features)
        start = self.cumulative_length.to(device)
        positions = torch.arange(new, device=device) + start
        if bias.shape[-1] != new:  # window statistics: every key's bias (the length is a host one here)
            self.key_bias[..., : bias.shape[-1]].copy_(bias)
        else:
            self.key_bias.index_copy_(2, positions, bias)
        if state is not None:
            self.gate_state.index_copy_(2, positions, state)
        if features is not None:
            self.gate_features.index_copy_(2, positions, as_dtype(features, self.gate_features.dtype))

    def _allocate_static(self, bias, state, features) -> None:
        batch, heads = bias.shape[:2]

        def zeros(*shape, dtype):
            tensor = torch.zeros(batch, heads, self.max_cache_len, *shape, dtype=dtype, device=bias.device)
            if not torch.compiler.is_compiling():  # as transformers marks the keys and values: a fixed address for compiled steps
                torch._dynamo.mark_static_address(tensor)
            return tensor

        self.key_bias = zeros(dtype=bias.dtype)
        self.gate_state = None if state is None else zeros(state.shape[-1], dtype=state.dtype)
        self.gate_features = None if features is None else zeros(features.shape[-1], dtype=features.dtype)

    def _check_keeps_every_key(self, new: int) -> None:
        if isinstance(self, DynamicSlidingWindowLayer):
            dropped = self.cumulative_length + new - (self.sliding_window - 1)
        elif isinstance(self, StaticSlidingWindowLayer):
            dropped = self.cumulative_length_int + new - self.max_cache_len
        else:
            return
        if dropped > 0 and not getattr(self, "record_past", False):
            raise ValueError(
                f"the KV cache's sliding window would drop {dropped} key(s); energy-gated attention keeps its per-key "
                "gate state (statistics over every earlier token) in the cache and cannot continue past the window: "
                "pass `cache=transformers.DynamicCache()` (built without the config, its layers keep every key; the "
                "attention mask still applies the window). A static cache drops keys past the window too"
            )

    # -- reading -----------------------------------------------------------------------------------------------

    def gate_past(self, positions: int | None, new: int, token_mask: torch.Tensor | None):
        """What the gate reads for ``new`` positions: ``(past_state, past_features, valid)``, the state and features
        of the latest ``positions`` cached keys (every key for ``None``), or ``None`` before the first key, and the
        padding mask (B, those keys + new) cut from ``token_mask`` (B, ≥ cached + new), or ``None`` without one.

        A ``StaticCache`` keeps its length on the device: the keys are gathered at tensor positions, so that a
        decoding step never waits for the device (and compiles without a graph break). Positions before its first key
        read as zeros (a count of 0, silence for the filters) and are not tokens (``valid`` is then always given, so
        that the gate's statistics read a count of 0 as no past). With ``positions=None`` the length is read on the
        host."""
        stored = (self.gate_state, self.gate_features)
        if isinstance(self, StaticLayer) and self.key_bias is not None and positions is not None:
            cached = self.cumulative_length.to(self.key_bias.device)
            slots = cached - positions + torch.arange(positions, device=cached.device)
            inside = torch.cat([slots >= 0, torch.ones(new, dtype=torch.bool, device=cached.device)])
            past = [None if tensor is None else tensor.index_select(2, slots.clamp(min=0)).masked_fill(
                ~inside[:positions, None], 0) for tensor in stored]
            if token_mask is None:
                return (*past, inside.expand(self.key_bias.shape[0], -1))
            columns = torch.cat([slots.clamp(min=0), cached + torch.arange(new, device=cached.device)])
            return (*past, token_mask[:, columns] & inside)
        cached = int(self.get_seq_length()) if self.key_bias is not None else 0
        if cached == 0 or (self.gate_state is None and self.gate_features is None):
            return None, None, None if token_mask is None else token_mask[:, cached : cached + new]
        kept = cached if positions is None else min(positions, cached)
        past = [None if tensor is None else tensor[:, :, cached - kept : cached] for tensor in stored]
        return (*past, None if token_mask is None else token_mask[:, cached - kept : cached + new])

    # -- keeping the gate's tensors in step with the keys ------------------------------------------------------

    def _gate_tensors(self) -> list[str]:
        return [name for name in ("key_bias", "gate_state", "gate_features") if getattr(self, name) is not None]

    def _apply_to_gate(self, function) -> None:
        for name in self._gate_tensors():
            setattr(self, name, function(getattr(self, name)))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._apply_to_gate(lambda tensor: tensor.index_select(0, beam_idx.to(tensor.device)))

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        if not isinstance(self, StaticLayer) and self.is_initialized:  # a static layer only moves its length
            kept = self.keys.shape[-2]
            self._apply_to_gate(lambda tensor: tensor[:, :, :kept])

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._apply_to_gate(lambda tensor: tensor.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._apply_to_gate(lambda tensor: tensor[indices, ...])

    def reset(self) -> None:
        super().reset()
        if isinstance(self, StaticLayer):
            for name in self._gate_tensors():
                getattr(self, name).zero_()
        else:
            self.key_bias = self.gate_state = self.gate_features = None
        self._pending_gate = None

    def offload(self):
        super().offload()
        if self.is_initialized:
            self._apply_to_gate(lambda tensor: tensor.to("cpu", non_blocking=True))

    def prefetch(self):
        super().prefetch()
        if self.is_initialized:
            self._apply_to_gate(lambda tensor: tensor.to(self.device, non_blocking=True))


def _appended(stored: torch.Tensor | None, added: torch.Tensor, dim: int) -> torch.Tensor:
    return added if stored is None else torch.cat([stored, as_dtype(added, stored.dtype)], dim=dim)


class EnergyGatedDynamicLayer(EnergyGateCacheLayerMixin, DynamicLayer):
    """A ``DynamicLayer`` with the energy gate's per-key bias and state."""


class EnergyGatedDynamicSlidingWindowLayer(EnergyGateCacheLayerMixin, DynamicSlidingWindowLayer):
    """A ``DynamicSlidingWindowLayer`` with the energy gate's per-key bias and state, as long as it drops no key."""


class EnergyGatedStaticLayer(EnergyGateCacheLayerMixin, StaticLayer):
    """A ``StaticLayer`` with the energy gate's per-key bias and state, allocated at their first write."""


class EnergyGatedStaticSlidingWindowLayer(EnergyGateCacheLayerMixin, StaticSlidingWindowLayer):
    """A ``StaticSlidingWindowLayer`` with the energy gate's per-key bias and state, as long as it drops no key."""


GATED_LAYER_CLASSES = {
    DynamicLayer: EnergyGatedDynamicLayer,
    DynamicSlidingWindowLayer: EnergyGatedDynamicSlidingWindowLayer,
    StaticLayer: EnergyGatedStaticLayer,
    StaticSlidingWindowLayer: EnergyGatedStaticSlidingWindowLayer,
}


def gated_cache_layer(cache, layer_idx: int):
    """Layer ``layer_idx`` of ``cache`` in its energy-gated form (see the module docstring), put in its place at a
    gated layer's first write (a ``DynamicCache`` built without a config first gets the layer, as its ``update``
    would add it)."""
    if getattr(cache, "layer_class_to_replicate", None) is not None:
        while len(cache.layers) <= layer_idx:
            cache.layers.append(cache.layer_class_to_replicate())
    layer = cache.layers[layer_idx]
    if isinstance(layer, EnergyGateCacheLayerMixin):
        return layer
    if type(layer) not in GATED_LAYER_CLASSES:
        raise ValueError(
            f"energy-gated attention keeps per-key gate state in its KV cache and needs every key kept as written; "
            f"a {type(layer).__name__} does not: use a DynamicCache or a StaticCache"
        )
    if layer.is_initialized and int(layer.get_seq_length()) > 0:
        raise ValueError(
            f"layer {layer_idx}'s KV cache holds keys written without the energy gate's data (e.g. PEFT prefix "
            "tuning's virtual tokens): energy-gated attention can only continue a cache it filled itself"
        )
    # A new object of the gated class, holding what the layer held (a static layer initialised ahead keeps its
    # tensors and their addresses): not a __class__ assignment, which torch.compile cannot trace.
    gated_class = GATED_LAYER_CLASSES[type(layer)]
    gated = gated_class.__new__(gated_class)
    gated.__dict__.update(layer.__dict__)
    cache.layers[layer_idx] = gated
    return gated


def update_gated_cache(cache, layer_idx: int, key, value, bias, state, features, *args, **kwargs):
    """Write new keys and values (B, Hk, T_new, D) with the gate's ``bias``, ``state`` and ``features`` (see
    ``EnergyGateCacheLayerMixin.stage_gate``) into ``cache``; return every cached key and value, in the dtype of
    ``key``, and the bias of every cached key (B, Hk, T_cache) float32. ``args`` / ``kwargs`` go to ``cache.update``."""
    layer = gated_cache_layer(cache, layer_idx)
    layer.stage_gate(bias, state, features)
    keys, values = cache.update(key, value, layer_idx, *args, **kwargs)
    key_bias = layer.key_bias
    if key_bias.shape[-1] != keys.shape[-2]:  # a static layer's keys are its whole length too; a window returns more
        key_bias = key_bias[..., : keys.shape[-2]]
    return as_dtype(keys, key.dtype), as_dtype(values, value.dtype), key_bias


__all__ = [
    "GATED_LAYER_CLASSES",
    "EnergyGateCacheLayerMixin",
    "EnergyGatedDynamicLayer",
    "EnergyGatedDynamicSlidingWindowLayer",
    "EnergyGatedStaticLayer",
    "EnergyGatedStaticSlidingWindowLayer",
    "gated_cache_layer",
    "update_gated_cache",
]
