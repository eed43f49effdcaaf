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

The layers accepted are ``DynamicLayer`` and ``StaticLayer`` (``DynamicCache``, ``StaticCache``, their offloaded
forms) and their sliding-window forms (Mistral, Gemma 2/3, Starcoder2), also past the window: a sliding layer keeps
the gate's tensors in a second layer of its own class (`EnergyGateSlidingWindowMixin`), cropped and rolled as the keys
are, and the gate reads the latest keys' state, which is all its causal statistics and filters need. What cannot work
past the window (window statistics, which re-bias every earlier key; a filter history longer than the window) is
refused when the window drops what it needs. A layer that alters keys (quantised) is refused, as are keys written
into a gated layer without the gate's data (PEFT prefix tuning's virtual tokens: the gate cannot continue a cache it
did not fill).

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
        pending = self._take_staged_gate()
        new = key_states.shape[-2]
        if self.is_initialized:  # new keys in the cache's dtype (under autocast, or continued outside it)
            key_states, value_states = as_dtype(key_states, self.keys.dtype), as_dtype(value_states, self.values.dtype)
        if isinstance(self, StaticLayer):
            self._write_static(*pending, new=new, device=key_states.device)
        else:
            self._write_dynamic(*pending, new=new)
        return super().update(key_states, value_states, *args, **kwargs)

    def _take_staged_gate(self) -> tuple:
        pending, self._pending_gate = self._pending_gate, None
        if pending is None:
            raise ValueError(
                "keys were written into an energy-gated layer of the KV cache without the gate's data (e.g. PEFT "
                "prefix tuning's virtual tokens): energy-gated attention can only continue a cache it filled itself"
            )
        return pending

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

    def holds_acting_bias(self) -> bool:
        """Whether any key was written with a non-zero bias (a gate whose α was not 0); read on the host."""
        return self.key_bias is not None and bool(self.key_bias.any())

    def returned_key_bias(self, keys: torch.Tensor) -> torch.Tensor:
        """The bias of the keys the last ``update`` returned (``keys``): the whole gated layer's (a static layer's
        keys are its whole length too; window statistics may hold more)."""
        key_bias = self.key_bias
        return key_bias if key_bias.shape[-1] == keys.shape[-2] else key_bias[..., : keys.shape[-2]]

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


class EnergyGatedStaticLayer(EnergyGateCacheLayerMixin, StaticLayer):
    """A ``StaticLayer`` with the energy gate's per-key bias and state, allocated at their first write."""


class EnergyGateSlidingWindowMixin(EnergyGateCacheLayerMixin):
    """The gated form of a sliding-window layer: the gate's bias, state and features of each key go through a second
    layer of the same class (``gate_window``), packed as the channels of its "keys", so that they are cropped, rolled
    and concatenated exactly as the keys are, past the window too. The gate needs only the latest keys' state (the
    running moments of the last one, the filter history): what the window drops it no longer needs; a gate that needs
    more (window statistics, or a filter history longer than the window) is refused when the window drops it."""

    gate_window: CacheLayerMixin | None = None
    _widths: tuple[int, int] = (0, 0)  # channels of the state and of the features in a packed entry
    _features_dtype: torch.dtype | None = None
    _returned_bias: torch.Tensor | None = None

    def _new_window(self) -> CacheLayerMixin:
        if isinstance(self, StaticSlidingWindowLayer):
            return StaticSlidingWindowLayer(max_cache_len=self.max_cache_len, sliding_window=self.max_cache_len)
        return DynamicSlidingWindowLayer(sliding_window=self.sliding_window)

    def _seen(self) -> int:
        """Keys written so far (host int: a sliding layer keeps its length on the host)."""
        if isinstance(self, StaticSlidingWindowLayer):
            return self.cumulative_length_int
        return int(self.cumulative_length)

    def _stored(self) -> torch.Tensor | None:
        """The packed entries the window keeps, oldest first (a static window's unfilled slots left out)."""
        window = self.gate_window
        if window is None or not window.is_initialized:
            return None
        kept = min(self._seen(), window.keys.shape[-2])
        return window.keys[:, :, :kept] if isinstance(window, StaticLayer) else window.keys

    def update(self, key_states, value_states, *args, **kwargs):
        pending = self._take_staged_gate()
        bias, state, features = pending
        new = key_states.shape[-2]
        if bias.shape[-1] != new:
            raise ValueError(
                "energy gates with window statistics re-bias every earlier key and cannot run with a sliding-window "
                "KV cache layer, which keeps only the latest keys; use `normalization='causal'` or 'none'"
            )
        if self.is_initialized:
            key_states, value_states = as_dtype(key_states, self.keys.dtype), as_dtype(value_states, self.values.dtype)
        parts = [bias[..., None]] + [at_least_float32(part) for part in (state, features) if part is not None]
        packed = torch.cat([as_dtype(part, parts[0].dtype) for part in parts], dim=-1)
        if self.gate_window is None:
            self.gate_window = self._new_window()
            self._widths = tuple(0 if part is None else part.shape[-1] for part in (state, features))
            self._features_dtype = None if features is None else features.dtype
        returned, _ = self.gate_window.update(packed, packed)
        self._returned_bias = returned[..., 0]
        return super(EnergyGateCacheLayerMixin, self).update(key_states, value_states, *args, **kwargs)

    def holds_acting_bias(self) -> bool:
        stored = self._stored()
        return stored is not None and bool(stored[..., 0].any())

    def returned_key_bias(self, keys: torch.Tensor) -> torch.Tensor:
        return self._returned_bias

    def gate_past(self, positions: int | None, new: int, token_mask: torch.Tensor | None):
        stored = self._stored()
        seen = self._seen() if stored is not None else 0
        if stored is None or seen == 0 or self._widths == (0, 0):
            return None, None, None if token_mask is None else token_mask[:, seen : seen + new]
        kept = stored.shape[-2]
        wanted = seen if positions is None else min(positions, seen)
        if wanted > kept:
            raise ValueError(
                f"the KV cache's sliding window keeps {kept} key(s) and the energy gate needs the state of the latest "
                f"{wanted} (its filter history or window statistics): use a gate with a shorter filter or causal "
                "statistics, or a KV cache without a sliding window"
            )
        entries = stored[:, :, kept - wanted :]
        state_width, features_width = self._widths
        state = entries[..., 1 : 1 + state_width] if state_width else None
        features = entries[..., 1 + state_width :] if features_width else None
        if features is not None:
            features = as_dtype(features, self._features_dtype)
        return state, features, None if token_mask is None else token_mask[:, seen - wanted : seen + new]

    # The window layer is a cache layer: it keeps itself in step with the keys through the same methods.
    def _apply_to_window(self, method: str, *args) -> None:
        if self.gate_window is not None and self.gate_window.is_initialized:
            getattr(self.gate_window, method)(*args)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._apply_to_window("reorder_cache", beam_idx)

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        self._apply_to_window("crop", tokens_to_remove)

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._apply_to_window("batch_repeat_interleave", repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._apply_to_window("batch_select_indices", indices)

    def reset(self) -> None:
        super().reset()
        self._apply_to_window("reset")
        self._returned_bias = None

    def offload(self):
        super().offload()
        self._apply_to_window("offload")

    def prefetch(self):
        super().prefetch()
        self._apply_to_window("prefetch")


class EnergyGatedDynamicSlidingWindowLayer(EnergyGateSlidingWindowMixin, DynamicSlidingWindowLayer):
    """A ``DynamicSlidingWindowLayer`` with the energy gate's per-key bias and state, cropped with the keys."""


class EnergyGatedStaticSlidingWindowLayer(EnergyGateSlidingWindowMixin, StaticSlidingWindowLayer):
    """A ``StaticSlidingWindowLayer`` with the energy gate's per-key bias and state, rolled with the keys."""


GATED_LAYER_CLASSES = {
    DynamicLayer: EnergyGatedDynamicLayer,
    DynamicSlidingWindowLayer: EnergyGatedDynamicSlidingWindowLayer,
    StaticLayer: EnergyGatedStaticLayer,
    StaticSlidingWindowLayer: EnergyGatedStaticSlidingWindowLayer,
}


def _refusal(layer, layer_idx: int) -> str | None:
    """Why layer ``layer_idx`` (not yet gated) cannot become an energy-gated layer, or ``None`` if it can."""
    if type(layer) not in GATED_LAYER_CLASSES:
        return (
            f"energy-gated attention keeps per-key gate state in its KV cache and needs every key kept as written; "
            f"a {type(layer).__name__} does not: use a DynamicCache or a StaticCache"
        )
    if layer.is_initialized and int(layer.get_seq_length()) > 0:
        return (
            f"layer {layer_idx}'s KV cache holds keys written without the energy gate's data (e.g. PEFT prefix "
            "tuning's virtual tokens): energy-gated attention can only continue a cache it filled itself"
        )
    return None


def can_hold_gate(cache, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` of ``cache`` is, or can become, an energy-gated layer (`gated_cache_layer`)."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        return False
    if layer_idx >= len(layers):  # `gated_cache_layer` adds it, new and empty
        return getattr(cache, "layer_class_to_replicate", None) in GATED_LAYER_CLASSES
    layer = layers[layer_idx]
    return isinstance(layer, EnergyGateCacheLayerMixin) or _refusal(layer, layer_idx) is None


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
    refusal = _refusal(layer, layer_idx)
    if refusal is not None:
        raise ValueError(refusal)
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
    return as_dtype(keys, key.dtype), as_dtype(values, value.dtype), layer.returned_key_bias(keys)


__all__ = [
    "GATED_LAYER_CLASSES",
    "EnergyGateCacheLayerMixin",
    "EnergyGateSlidingWindowMixin",
    "EnergyGatedDynamicLayer",
    "EnergyGatedDynamicSlidingWindowLayer",
    "EnergyGatedStaticLayer",
    "EnergyGatedStaticSlidingWindowLayer",
    "can_hold_gate",
    "gated_cache_layer",
    "update_gated_cache",
]
