"""The new positions' columns after a cache whose length is an int (DynamicCache) or a tensor (StaticCache)."""

import torch

from hf_spectral.ops.positions import host_length, new_positions


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
