"""Properties of the routers and of running an operator on its routed tokens only (hf_spectral/ops/routing.py)."""

import math

import pytest
import torch
from torch.nn import functional as F

from hf_spectral.ops import routing as ops


def _random(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# --- routing ----------------------------------------------------------------------------------------------------


def test_threshold_routes_follow_the_spec_boundaries():
    entropy = torch.tensor([0.1, 0.5, 0.50001, 0.7, 0.9, 0.9001])
    assert ops.threshold_routes(entropy, [0.5]).tolist() == [0, 0, 1, 1, 1, 1]
    assert ops.threshold_routes(entropy, [0.5, 0.9]).tolist() == [0, 1, 1, 1, 1, 2]
    with pytest.raises(ValueError):
        ops.threshold_routes(entropy, [0.1, 0.2, 0.3])


def test_straight_through_gate_is_one_forward_and_passes_the_gradient():
    logits = torch.tensor([[0.3, -0.2, 1.0]], requires_grad=True)
    probabilities = torch.softmax(logits, -1)
    routes = probabilities.argmax(-1)
    gate = ops.straight_through_gate(probabilities, routes)
    assert gate.item() == 1.0
    gate.sum().backward()
    expected = torch.autograd.grad(torch.softmax(logits, -1)[0, 2], logits)[0]
    torch.testing.assert_close(logits.grad, expected)


def test_one_hot_gates_equal_the_straight_through_gate_on_the_chosen_operator():
    probabilities = torch.softmax(_random(4, 3, seed=32).float(), -1)
    routes = torch.tensor([0, 2, 1, 2])
    gates = ops.one_hot_gates(probabilities, routes, 3)
    torch.testing.assert_close(gates.sum(-1), torch.ones(4))
    torch.testing.assert_close(gates.gather(-1, routes[:, None])[:, 0], ops.straight_through_gate(probabilities, routes))


def test_usage_entropy_penalty_is_zero_for_balanced_and_log_k_for_collapsed_usage():
    balanced = torch.eye(3)[torch.tensor([0, 1, 2, 0, 1, 2])][None]
    assert ops.usage_entropy_penalty(balanced).item() == pytest.approx(0.0, abs=1e-6)
    collapsed = torch.eye(3)[torch.zeros(6, dtype=torch.long)][None]
    assert ops.usage_entropy_penalty(collapsed).item() == pytest.approx(math.log(3), abs=1e-6)
    valid = torch.tensor([[True, True, True, False, False, False]])  # padding excluded from the usage
    assert ops.usage_entropy_penalty(balanced, valid).item() == pytest.approx(0.0, abs=1e-6)


def test_router_probabilities_are_float32_and_hard_routes_take_the_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 0.5]], dtype=torch.bfloat16)
    probabilities = ops.router_probabilities(logits)
    assert probabilities.dtype == torch.float32
    torch.testing.assert_close(probabilities.sum(-1), torch.ones(2))
    assert ops.hard_routes(probabilities).tolist() == [1, 0]
    assert ops.soft_routes(probabilities).tolist() == [1, 0]


def test_routing_fractions_count_valid_tokens_only():
    routes = torch.tensor([[0, 1, 1, 0], [1, 1, 0, 0]])
    valid = torch.tensor([[True, True, True, True], [False, False, True, True]])
    torch.testing.assert_close(ops.routing_fractions(routes, None, 2), torch.tensor([0.5, 0.5]))
    torch.testing.assert_close(ops.routing_fractions(routes, valid, 2), torch.tensor([4 / 6, 2 / 6]))


# --- running an operator on its routed tokens only --------------------------------------------------------------


def test_routed_layout_lists_each_rows_routed_positions_first_in_order():
    selected = torch.tensor([[False, True, False, True, True, False], [True, False, False, False, False, False]])
    index, valid = ops.routed_layout(selected, capacity=3)
    assert index[0].tolist() == [1, 3, 4] and valid[0].tolist() == [True, True, True]
    assert index[1, 0].item() == 0 and valid[1].tolist() == [True, False, False]
    full_index, full_valid = ops.routed_layout(selected, capacity=6)
    assert sorted(full_index[0].tolist()) == list(range(6))  # a permutation: nothing lost at capacity T
    assert full_valid.sum(1).tolist() == [3, 1]


@pytest.mark.parametrize("capacity", [3, 6])
def test_gather_then_scatter_replaces_exactly_the_routed_rows_and_routes_gradients(capacity):
    selected = torch.tensor([[False, True, False, True, True, False], [True, False, False, False, False, False]])
    x = _random(2, 6, 4, seed=40).float().requires_grad_()
    base = _random(2, 6, 4, seed=41).float()
    index, valid = ops.routed_layout(selected, capacity)
    gathered = ops.gather_routed(x, index)
    assert gathered.shape == (2, capacity, 4)
    out = ops.scatter_routed(base, selected, index, 2.0 * gathered)
    torch.testing.assert_close(out[selected], 2.0 * x[selected])
    assert torch.equal(out[~selected], base[~selected])
    out.sum().backward()
    torch.testing.assert_close(x.grad, 2.0 * selected[..., None].float().expand_as(x))  # unrouted rows get none


def test_gathered_query_mask_is_causal_skips_padding_and_never_empty():
    key_valid = torch.tensor([[False, True, True, True, True]])
    slots = torch.tensor([[0, 2, 4]])
    allowed = ops.gathered_query_mask(slots, None, key_valid, 5, is_causal=True)[0, 0]
    assert allowed.tolist() == [
        [True, False, False, False, False],  # a padding query reads only its own slot
        [False, True, True, False, False],
        [False, True, True, True, True],
    ]
    bidirectional = ops.gathered_query_mask(torch.tensor([[2]]), None, key_valid, 5, is_causal=False)[0, 0]
    assert bidirectional.tolist() == [[False, True, True, True, True]]
    # No padding: the causal staircase alone; a static cache's empty tail (slots past key_valid) is never read.
    causal = ops.gathered_query_mask(torch.tensor([[1, 3]]), None, None, 4, is_causal=True)[0, 0]
    assert causal.tolist() == [[True, True, False, False], [True, True, True, True]]
    tail = ops.gathered_query_mask(torch.tensor([[1]]), None, torch.ones(1, 2, dtype=torch.bool), 4, False)[0, 0]
    assert tail.tolist() == [[True, True, False, False]]
    assert ops.gathered_query_mask(torch.tensor([[1]]), None, None, 4, is_causal=False) is None
    # Layout rows past a row's count read every key (their outputs are dropped; softmax stays finite).
    invalid = ops.gathered_query_mask(slots, torch.tensor([[True, True, False]]), key_valid, 5, True)[0, 0]
    assert invalid[2].all() and invalid[:2].tolist() == allowed[:2].tolist()


def _dense_block_mask(block_mask, query_length, key_length):
    """Evaluate a BlockMask element by element: True where its blocks are visited and its mask_mod allows the pair."""
    dense = torch.zeros(block_mask.kv_num_blocks.shape[0], query_length, key_length, dtype=torch.bool)
    size_q, size_kv = block_mask.BLOCK_SIZE
    q = torch.arange(query_length)[:, None]
    kv = torch.arange(key_length)[None]
    for b in range(dense.shape[0]):
        visited = torch.zeros(query_length, key_length, dtype=torch.bool)
        partial = torch.zeros_like(visited)
        for counts, indices, is_full in (
            (block_mask.kv_num_blocks, block_mask.kv_indices, False),
            (block_mask.full_kv_num_blocks, block_mask.full_kv_indices, True),
        ):
            for qb in range(counts.shape[2]):
                for j in range(int(counts[b, 0, qb])):
                    kb = int(indices[b, 0, qb, j])
                    rows, cols = slice(qb * size_q, (qb + 1) * size_q), slice(kb * size_kv, (kb + 1) * size_kv)
                    (visited if is_full else partial)[rows, cols] = True
        allowed = block_mask.mask_mod(torch.tensor(b), torch.tensor(0), q, kv)
        dense[b] = visited | (partial & allowed)
    return dense


@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("padded", [False, True])
def test_block_mask_of_gathered_queries_equals_the_boolean_mask_and_skips_blocks(is_causal, padded):
    generator = torch.Generator().manual_seed(42)
    length, block = 64, 8
    selected = torch.rand(2, length, generator=generator) < 0.5
    selected[0, -1] = True  # the last token routed: some block must reach the last key
    key_valid = None
    if padded:
        key_valid = torch.ones(2, length, dtype=torch.bool)
        key_valid[1, :9] = False
        selected[1, :9] = False
    index, valid = ops.routed_layout(selected, capacity=length)
    block_mask = ops.gathered_query_block_mask(index, valid, key_valid, length, is_causal, block_size=block)
    dense = _dense_block_mask(block_mask, length, length)
    expected = ops.gathered_query_mask(index, valid, key_valid, length, is_causal)
    expected = torch.ones(2, length, length, dtype=torch.bool) if expected is None else expected[:, 0]
    assert torch.equal(dense[valid], expected[valid])
    assert not dense[~valid].any()  # layout rows past a row's count: no block visited, nothing read
    visited_blocks = block_mask.kv_num_blocks.sum() + block_mask.full_kv_num_blocks.sum()
    assert visited_blocks < 2 * (length // block) ** 2  # blocks of unrouted queries (and the future) skipped
    if is_causal and not padded:
        assert block_mask.full_kv_num_blocks.sum() > 0  # blocks wholly in the past evaluate no mask


@pytest.mark.parametrize("padded", [False, True])
def test_gathered_queries_of_packed_rows_read_only_their_own_document(padded):
    """Packed rows: a query reads no key before its document's first slot; the block mask equals the boolean one and
    skips the key blocks before each block's earliest document."""
    generator = torch.Generator().manual_seed(3)
    length, block = 64, 8
    starts = torch.tensor([[0] * 5 + [5] * 30 + [35] * 29, [0] * 40 + [40] * 24])
    selected = torch.rand(2, length, generator=generator) < 0.5
    selected[:, -1] = True
    key_valid = None
    if padded:  # (packed rows come without padding; the two conditions still combine)
        key_valid = torch.ones(2, length, dtype=torch.bool)
        key_valid[1, 60:] = False
    index, valid = ops.routed_layout(selected, capacity=length)
    query_starts = starts.gather(1, index)
    mask = ops.gathered_query_mask(index, valid, key_valid, length, True, query_starts)[:, 0]
    keys = torch.arange(length)
    for b in range(2):
        for q in range(int(valid[b].sum())):
            slot, start = int(index[b, q]), int(query_starts[b, q])
            expected = (keys <= slot) & (keys >= start)
            if key_valid is not None:
                expected = (expected & key_valid[b]) | (keys == slot)
            assert torch.equal(mask[b, q], expected)
    block_mask = ops.gathered_query_block_mask(index, valid, key_valid, length, True, block, query_starts)
    dense = _dense_block_mask(block_mask, length, length)
    assert torch.equal(dense[valid], mask[valid])
    unpacked = ops.gathered_query_block_mask(index, valid, key_valid, length, True, block)
    assert block_mask.kv_num_blocks.sum() + block_mask.full_kv_num_blocks.sum() < (
        unpacked.kv_num_blocks.sum() + unpacked.full_kv_num_blocks.sum()
    )  # key blocks before a block's documents are skipped
