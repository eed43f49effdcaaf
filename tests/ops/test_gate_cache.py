"""The KV cache layers of energy-gated attention (hf_spectral/ops/gate_cache.py): keys at the head size, each key's
bias and gate state beside it, kept in step through every operation a cache undergoes."""

import copy
import pickle

import pytest
import torch
from transformers import DynamicCache, GPT2Config, StaticCache
from transformers.cache_utils import (
    DynamicLayer,
    DynamicSlidingWindowLayer,
    StaticLayer,
    StaticSlidingWindowLayer,
)

from hf_spectral.ops.gate_cache import EnergyGateCacheLayerMixin, gated_cache_layer, update_gated_cache


class _Cache:
    def __init__(self, *layers):
        self.layers = list(layers)
        self.layer_class_to_replicate = None

    def update(self, key, value, layer_idx, *args, **kwargs):
        return self.layers[layer_idx].update(key, value, *args, **kwargs)


def _written(generator, batch=2, heads=3, new=4, dim=6, state=3, features=2):
    """Random keys, values and gate data of ``new`` positions."""
    return (
        torch.randn(batch, heads, new, dim, generator=generator),
        torch.randn(batch, heads, new, dim, generator=generator),
        torch.randn(batch, heads, new, generator=generator),
        torch.randn(batch, heads, new, state, generator=generator),
        torch.randn(batch, heads, new, features, generator=generator),
    )


def _fill(layer, steps=(4, 1, 1), seed=0):
    """Write ``steps`` chunks into ``layer``; return the gated layer that replaced it and the full keys, values,
    bias, state and features written."""
    generator = torch.Generator().manual_seed(seed)
    cache = _Cache(layer)
    chunks = [_written(generator, new=new) for new in steps]
    for chunk in chunks:
        update_gated_cache(cache, 0, *chunk)
    return cache.layers[0], [torch.cat(parts, dim=2) for parts in zip(*chunks)]


@pytest.mark.parametrize("layer_class", [DynamicLayer, StaticLayer])
def test_keys_stay_at_the_head_size_with_their_bias_and_state_beside_them(layer_class):
    layer = layer_class() if layer_class is DynamicLayer else layer_class(max_cache_len=9)
    layer, (keys, values, bias, state, features) = _fill(layer)
    assert isinstance(layer, EnergyGateCacheLayerMixin) and isinstance(layer, layer_class)
    length = keys.shape[2]
    assert layer.keys.shape[-1] == 6 and layer.key_bias.dtype == layer.gate_state.dtype == torch.float32
    for stored, written in ((layer.keys, keys), (layer.values, values), (layer.key_bias, bias),
                            (layer.gate_state, state), (layer.gate_features, features)):
        assert torch.equal(stored[:, :, :length], written)


def test_the_gate_data_follow_the_keys_through_beam_reordering_cropping_and_batch_selection():
    layer, written = _fill(DynamicLayer())

    def holds(rows, length=6):
        stored = (layer.keys, layer.values, layer.key_bias, layer.gate_state, layer.gate_features)
        for tensor, full in zip(stored, written):
            assert torch.equal(tensor, full[rows, :, :length])

    layer.reorder_cache(torch.tensor([1, 1]))
    holds([1, 1])
    layer.crop(-2)
    holds([1, 1], length=4)
    layer.batch_repeat_interleave(2)
    holds([1, 1, 1, 1], length=4)
    layer.batch_select_indices(torch.tensor([0, 3]))
    holds([1, 1], length=4)
    layer.reset()
    assert layer.key_bias is layer.gate_state is layer.gate_features is None


def test_a_static_layer_reads_its_latest_keys_at_its_on_device_length():
    """The state of the last ``positions`` keys, gathered at the device-side length; positions before the first key
    read as zeros and not as tokens. A dynamic layer reads the same keys by slicing."""
    dynamic, (_, _, _, state, features) = _fill(DynamicLayer(), steps=(4,))
    static, _ = _fill(StaticLayer(max_cache_len=9), steps=(4,))
    token_mask = torch.tensor([[False, True, True, True, True, True], [True] * 6])  # 4 cached + 2 new
    for positions in (1, 3, 6, None):
        for layer in (dynamic, static):
            past_state, past_features, valid = layer.gate_past(positions, 2, token_mask)
            read = 4 if positions is None else min(positions, 4)
            if layer is static and positions is not None and positions > 4:  # gathered before the first key
                padding = positions - 4
                assert not past_state[:, :, :padding].any() and not valid[:, :padding].any()
                past_state, past_features, valid = (t[:, :, padding:] if t.ndim == 4 else t[:, padding:]
                                                    for t in (past_state, past_features, valid))
            assert torch.equal(past_state, state[:, :, 4 - read :]) and torch.equal(past_features,
                                                                                   features[:, :, 4 - read :])
            assert torch.equal(valid, token_mask[:, 4 - read :])
    # without a padding mask a static layer still says which gathered positions hold keys (a count of 0 is no past)
    assert dynamic.gate_past(3, 2, None)[2] is None
    assert torch.equal(static.gate_past(6, 2, None)[2], torch.tensor([[False] * 2 + [True] * 6] * 2))
    fresh = gated_cache_layer(_Cache(StaticLayer(max_cache_len=9)), 0)  # before its first write: no past
    past_state, past_features, valid = fresh.gate_past(1, 2, token_mask[:, 4:])
    assert past_state is None and past_features is None and torch.equal(valid, token_mask[:, 4:])


def test_sliding_window_layers_crop_the_gate_data_with_their_keys():
    """Past the window, dynamic and static: each returned key comes with its own bias, and the gate reads back the
    state and features of the keys the window keeps, the latest ones (beyond them the gate needs nothing)."""
    generator = torch.Generator().manual_seed(0)
    for layer, steps, kept in ((DynamicSlidingWindowLayer(sliding_window=5), (3, 2, 1), 4),
                               (StaticSlidingWindowLayer(max_cache_len=16, sliding_window=7), (7, 1, 1), 7)):
        cache = _Cache(layer)
        chunks = [_written(generator, new=new) for new in steps]
        for chunk in chunks:
            keys, _, key_bias = update_gated_cache(cache, 0, *chunk)
        written_keys, _, written_bias, written_state, written_features = (torch.cat(parts, 2) for parts in zip(*chunks))
        returned = keys.shape[-2]
        assert torch.equal(keys, written_keys[:, :, -returned:])  # the stock layer's keys, past the window
        assert torch.equal(key_bias, written_bias[..., -returned:])  # each key its own bias
        state, features, _ = cache.layers[0].gate_past(kept, 1, None)
        assert torch.equal(state, written_state[:, :, -kept:]) and torch.equal(features, written_features[:, :, -kept:])
        with pytest.raises(ValueError, match="sliding window keeps .* key"):  # a filter longer than the window
            cache.layers[0].gate_past(kept + 1, 1, None)


def test_layers_that_alter_keys_and_keys_without_gate_data_are_refused():
    class OtherLayer(DynamicLayer):  # e.g. a quantised layer: keys altered as they are stored
        pass

    with pytest.raises(ValueError, match="needs every key kept as written"):
        gated_cache_layer(_Cache(OtherLayer()), 0)
    # keys written by something else (PEFT prefix tuning's virtual tokens): before or after the layer is gated
    prefixed = DynamicLayer()
    prefixed.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
    with pytest.raises(ValueError, match="can only continue a cache it filled itself"):
        gated_cache_layer(_Cache(prefixed), 0)
    gated = gated_cache_layer(_Cache(DynamicLayer()), 0)
    with pytest.raises(ValueError, match="can only continue a cache it filled itself"):
        gated.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))


def test_transformers_caches_get_gated_layers_in_place_and_they_copy_and_pickle():
    generator = torch.Generator().manual_seed(0)
    dynamic = DynamicCache()  # without a config: the layer is created as its update would
    keys, values, bias, state, features = _written(generator)
    _, _, key_bias = update_gated_cache(dynamic, 1, keys, values, bias, state, features)
    assert len(dynamic.layers) == 2 and type(dynamic.layers[0]) is DynamicLayer  # only the gated layer changes
    assert torch.equal(key_bias, bias) and dynamic.get_seq_length(1) == 4
    for cache in (copy.deepcopy(dynamic), pickle.loads(pickle.dumps(dynamic))):
        assert torch.equal(cache.layers[1].key_bias, bias) and torch.equal(cache.layers[1].gate_features, features)
    # A StaticCache initialised ahead (as for torch.export): the layer keeps its tensors, at the head size
    static = StaticCache(config=GPT2Config(n_layer=1, n_head=3, n_embd=18), max_cache_len=8)
    static.early_initialization(2, 3, 6, torch.float32, torch.device("cpu"))
    allocated = static.layers[0].keys
    _, _, key_bias = update_gated_cache(static, 0, keys, values, bias, state, features)
    assert static.layers[0].keys is allocated and isinstance(static.layers[0], EnergyGateCacheLayerMixin)
    assert key_bias.shape == (2, 3, 8)
    assert torch.equal(key_bias[..., :4], bias) and not key_bias[..., 4:].any()
