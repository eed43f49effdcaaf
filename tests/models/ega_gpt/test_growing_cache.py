import pytest
import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from hf_spectral.models.ega_gpt.growing_cache import GrowingCache, GrowingLayer, append_in_place
from tests.models.ega_gpt.test_modeling_ega_gpt import padded_batch, tiny_model


def states(length, batch=3, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 2, length, 5, generator=generator), torch.randn(batch, 2, length, 7, generator=generator)


def run_both(operations, reserve=0):
    """Applies the same updates and cache operations to a GrowingLayer and a DynamicLayer; after every update, the
    returned and held tensors must be equal. Returns both layers."""
    growing, dynamic = GrowingLayer(reserve), DynamicLayer()
    for step, operation in enumerate(operations):
        if isinstance(operation, int):
            key, value = states(operation, batch=growing.keys.shape[0] if growing.is_initialized else 3, seed=step)
            got = growing.update(key, value)
            expected = dynamic.update(key, value)
            for a, b in zip(got, expected):
                assert torch.equal(a, b)
        else:
            operation(growing)
            operation(dynamic)
        if growing.is_initialized:
            assert torch.equal(growing.keys, dynamic.keys) and torch.equal(growing.values, dynamic.values)
            assert growing.get_seq_length() == dynamic.get_seq_length()
    return growing, dynamic


def test_appends_in_place_within_the_reserve():
    layer = GrowingLayer(reserve=12)
    layer.update(*states(4))
    buffer = layer.keys.data_ptr()
    for step in range(8):
        keys, values = layer.update(*states(1, seed=step + 1))
        assert keys.data_ptr() == buffer and keys.shape == (3, 2, 5 + step, 5) and values.shape[-1] == 7
    assert layer._key_buffer.shape[2] == 12


def test_grows_and_keeps_contents_like_a_dynamic_layer():
    growing, _ = run_both([4] + [1] * 9 + [3, 1], reserve=0)
    assert growing._key_buffer.shape[2] >= growing.get_seq_length()


@pytest.mark.parametrize(
    "operation",
    [
        lambda layer: layer.crop(-3),
        lambda layer: layer.reorder_cache(torch.tensor([2, 0, 0])),
        lambda layer: layer.batch_select_indices(torch.tensor([1, 0])),
        lambda layer: layer.batch_repeat_interleave(2),
    ],
    ids=["crop", "reorder", "select", "repeat"],
)
def test_cache_operations_then_appends_equal_a_dynamic_layer(operation):
    run_both([6, 1, 1, operation, 1, 2, 1, operation, 1], reserve=16)


def test_a_view_returned_before_a_crop_keeps_its_own_positions_only():
    layer = GrowingLayer(reserve=10)
    keys, _ = layer.update(*states(5))
    before = keys.clone()
    layer.crop(-2)
    layer.update(*states(2, seed=7))
    assert torch.equal(keys[:, :, :3], before[:, :, :3])  # positions it shares with the cache: unchanged


def test_reset_empties_and_reuse_starts_over():
    layer = GrowingLayer(reserve=8)
    layer.update(*states(5))
    layer.reset()
    assert layer.get_seq_length() == 0
    key, value = states(2, seed=3)
    keys, values = layer.update(key, value)
    assert torch.equal(keys, key) and torch.equal(values, value)


def test_states_with_gradients_are_concatenated_so_autograd_sees_no_in_place_write():
    layer = GrowingLayer(reserve=16)
    first = [t.requires_grad_() for t in states(3)]
    keys, _ = layer.update(*first)
    loss = keys.square().sum()
    layer.update(*[t.requires_grad_() for t in states(1, seed=1)])
    loss.backward()  # would fail had the second update written into the tensor the first one returned
    assert torch.equal(first[0].grad, 2 * first[0].detach())
    with torch.no_grad():
        keys, _ = layer.update(*states(1, seed=2))  # and it goes on appending in place afterwards
    assert keys.shape[2] == 5 and layer._key_buffer is not None


def test_bad_arguments():
    with pytest.raises(ValueError, match="reserve"):
        GrowingLayer(reserve=-1)
    cache = DynamicCache()
    cache.update(*states(2), 0)
    with pytest.raises(ValueError, match="empty cache"):
        append_in_place(cache)


def test_cache_without_a_config_adds_growing_layers_as_updates_reach_them():
    cache = GrowingCache(reserve=6)
    cache.update(*states(2), 1)
    assert [type(layer) for layer in cache.layers] == [GrowingLayer, GrowingLayer]
    assert cache.get_seq_length(1) == 2 and cache.layers[1]._key_buffer.shape[2] == 6


def test_ega_generation_uses_it_by_default_and_keeps_a_callers_cache():
    model = tiny_model("EGA-1")
    ids, mask = padded_batch(length=8)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, return_dict_in_generate=True)
    assert all(type(layer) is GrowingLayer for layer in out.cache.layers)
    assert out.cache.layers[0]._key_buffer.shape[2] == 8 + 5 - 1  # the generation's maximum cache length
    given = DynamicCache(config=model.config)
    again = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, cache=given,
                           return_dict_in_generate=True)
    assert all(type(layer) is DynamicLayer for layer in given.layers)
    assert torch.equal(again.sequences, out.sequences)
    with torch.no_grad():
        assert isinstance(model(ids, use_cache=True).cache, GrowingCache)


@pytest.mark.parametrize(
    "settings", [{"do_sample": False}, {"do_sample": False, "num_beams": 3}, {"do_sample": True, "top_k": 8}],
    ids=["greedy", "beam", "sampling"],
)
def test_ega_generation_equals_generation_with_a_concatenating_cache(settings):
    model = tiny_model("EGA-2")
    ids, mask = padded_batch(length=8)
    results = []
    for cache in (None, DynamicCache(config=model.config)):
        torch.manual_seed(5)
        results.append(model.generate(ids, attention_mask=mask, max_new_tokens=7, cache=cache, **settings))
    assert torch.equal(results[0], results[1])
