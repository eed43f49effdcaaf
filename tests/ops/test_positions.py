"""The new positions' columns after a cache whose length is an int (DynamicCache) or a tensor (StaticCache)."""

import pytest
import torch

from hf_spectral.ops.positions import host_length, new_positions, padding_of_causal_mask


def test_new_positions_are_the_same_columns_for_an_int_and_a_tensor_length():
    counts = torch.arange(14).view(2, 7)
    for past in range(0, 5):
        expected = counts[:, past : past + 3]
        assert torch.equal(new_positions(counts, past, 3), expected)
        assert torch.equal(new_positions(counts, torch.tensor(past), 3), expected)


def test_a_tensor_length_traces_without_a_graph_break():
    explanation = torch._dynamo.explain(new_positions)(torch.arange(14).view(2, 7), torch.tensor(2), 3)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


def test_a_length_is_read_on_the_host_only_where_that_is_free():
    assert host_length(3) == 3 and host_length(torch.tensor(4)) == 4  # an int; a CPU tensor in eager mode
    lengths = []

    @torch.compile(backend="eager", fullgraph=True)
    def inside_a_graph(length):
        lengths.append(host_length(length))
        return length + 1

    inside_a_graph(torch.tensor(4))
    assert lengths == [None]


def test_the_padding_of_a_causal_4d_mask_is_its_last_row_and_other_masks_are_refused():
    tokens = torch.tensor([[False, True, True, True, True], [True, True, True, True, True]])
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    mask = causal[None, None] & tokens[:, None, None, :]
    assert torch.equal(padding_of_causal_mask(mask, 5), tokens)
    additive = torch.where(mask, 0.0, torch.finfo(torch.float32).min)
    assert torch.equal(padding_of_causal_mask(additive), tokens)
    # after a past of 3 positions, 2 new queries; a StaticCache's wider mask (False after the new positions)
    assert torch.equal(padding_of_causal_mask(mask[:, :, 3:], 5), tokens)
    wide = torch.nn.functional.pad(mask[:, :, 3:], (0, 4))
    assert torch.equal(padding_of_causal_mask(wide), torch.nn.functional.pad(tokens, (0, 4)))
    # two packed documents (block-diagonal) and a sliding window read as padding would be wrong: refused
    packed = mask.clone()
    packed[:, :, 2:, :2] = False
    window = mask & torch.ones(5, 5, dtype=torch.bool).triu(-1)
    for other in (packed, window):
        with pytest.raises(ValueError, match="must be causal plus padding"):
            padding_of_causal_mask(other, 5)
    with pytest.raises(ValueError, match="covers 5 keys, but the call sees 7"):
        padding_of_causal_mask(mask, 7)
