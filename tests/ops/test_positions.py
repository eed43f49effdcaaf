"""The new positions' columns after a cache whose length is an int (DynamicCache) or a tensor (StaticCache)."""

import torch

from hf_spectral.ops.positions import new_positions


def test_new_positions_are_the_same_columns_for_an_int_and_a_tensor_length():
    counts = torch.arange(14).view(2, 7)
    for past in range(0, 5):
        expected = counts[:, past : past + 3]
        assert torch.equal(new_positions(counts, past, 3), expected)
        assert torch.equal(new_positions(counts, torch.tensor(past), 3), expected)


def test_a_tensor_length_traces_without_a_graph_break():
    explanation = torch._dynamo.explain(new_positions)(torch.arange(14).view(2, 7), torch.tensor(2), 3)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
