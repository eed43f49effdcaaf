"""Per-token routing of CHIAR-Former (SPEC 2.1) as pure tensor functions: the threshold, hard and soft routers, the
straight-through gate, the usage-entropy penalty, and the bookkeeping that lets an operator run only on the tokens
routed to it (gather them into a static layout, build the attention masks of gathered queries, scatter back).

Routing reads only each token's own state, so a causal model stays causal. Nothing here synchronises with the
host: every shape is given by the caller (the capacity of a gathered layout is an argument, never read from data).
"""

import math

import torch
from torch.nn import functional as F

from .precision import at_least_float32

ROUTER_TYPES = ("threshold", "hard", "soft")


# ---------------------------------------------------------------------------------------------------------------
# Routers
# ---------------------------------------------------------------------------------------------------------------


def threshold_routes(entropy: torch.Tensor, thresholds: list[float]) -> torch.Tensor:
    """Operator index per token from its spectral entropy H (SPEC 2.1), operators ordered from low to high entropy,
    (...) -> (...) long.

    One threshold τ_mid: 1 (e.g. attention) if H > τ_mid, else 0 (DCT). Two thresholds τ_lo ≤ τ_hi:
    0 if H < τ_lo, 1 if τ_lo ≤ H ≤ τ_hi, 2 if H > τ_hi.
    """
    if len(thresholds) == 1:
        return (entropy > thresholds[0]).long()
    if len(thresholds) == 2:
        return (entropy >= thresholds[0]).long() + (entropy > thresholds[1]).long()
    raise ValueError(f"threshold routing takes 1 or 2 thresholds, got {len(thresholds)}")


def router_probabilities(logits: torch.Tensor) -> torch.Tensor:
    """Router probabilities p = softmax(logits) over the K operators, (..., K) -> (..., K), in at least float32 (the
    hard router's argmax and the straight-through gate should not depend on the activation dtype)."""
    return torch.softmax(at_least_float32(logits), dim=-1)


def hard_routes(probabilities: torch.Tensor) -> torch.Tensor:
    """The hard router's choice r = argmax_k p_k, (..., K) -> (...) long; trained through :func:`straight_through_gate`."""
    return probabilities.argmax(-1)


def soft_routes(probabilities: torch.Tensor) -> torch.Tensor:
    """The soft router blends every operator with weights p; its reported route is the operator of largest weight,
    (..., K) -> (...) long."""
    return probabilities.argmax(-1)


def straight_through_gate(probabilities: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
    """Straight-through gate of the chosen operator, g = 1 + p_r − sg(p_r): exactly 1 in the forward pass,
    ∂g/∂p_r = 1 backwards. probabilities (..., K), routes (...) -> (...).

    Multiplying only the chosen operator's output by g is what lets a hard-routed layer skip the other
    operators; it equals the dense one-hot formulation Σ_k onehot_k (1 + p_k − sg(p_k)) op_k, in value and in
    gradient, since the one-hot factor zeroes every other term. (The Gumbel-style estimator onehot − sg(p) + p
    would need every operator's output for every token, i.e. no compute saving in training.)
    """
    chosen = probabilities.gather(-1, routes[..., None])[..., 0]
    return 1.0 + chosen - chosen.detach()


def one_hot_gates(probabilities: torch.Tensor | None, routes: torch.Tensor, num_operators: int) -> torch.Tensor:
    """Dense gates (..., K) of the authors' one-hot-select formulation: onehot(route), times the straight-through
    factor 1 + p − sg(p) when router probabilities exist (hard routing)."""
    gates = F.one_hot(routes, num_operators).float()
    if probabilities is not None:
        gates = gates * (1.0 + probabilities - probabilities.detach())
    return gates


def usage_entropy_penalty(probabilities: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """log K − H(ū), ū = mean router probabilities over the (valid) tokens of the batch, probabilities (B, T, K),
    valid (B, T) bool -> scalar.

    Zero when the operators are used equally, log K when one takes everything; adding λ times it to the loss
    counters routing collapse. A training loss only: the route of a token never depends on this batch average.
    """
    if valid is None:
        usage = probabilities.reshape(-1, probabilities.shape[-1]).mean(0)
    else:
        weights = valid.to(probabilities.dtype)[..., None]
        usage = (probabilities * weights).sum((0, 1)) / weights.sum().clamp_min(1.0)
    entropy = -(usage * torch.log(usage.clamp_min(torch.finfo(usage.dtype).tiny))).sum()
    return math.log(probabilities.shape[-1]) - entropy


def routing_fractions(routes: torch.Tensor, valid: torch.Tensor | None, num_operators: int) -> torch.Tensor:
    """Fraction of the (valid) tokens routed to each operator, routes (B, T) long, valid (B, T) bool -> (K,)."""
    counts = F.one_hot(routes, num_operators).float()
    if valid is not None:
        counts = counts * valid[..., None]
        return counts.sum((0, 1)) / valid.sum().clamp_min(1)
    return counts.mean((0, 1))


# ---------------------------------------------------------------------------------------------------------------
# Running an operator on its routed tokens only
# ---------------------------------------------------------------------------------------------------------------


def routed_layout(selected: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the routed tokens of each row go in a gathered (B, capacity) layout.

    selected (B, T) bool -> (index (B, C) long, valid (B, C) bool), C = ``capacity`` ≤ T. Row b lists its selected
    positions first, in position order, then its other positions, in position order: ``index[b, i]`` is the position of
    the i-th routed token of row b for i < count_b = Σ_t selected[b, t], and ``valid[b, i] = i < count_b``. With
    C = T nothing can be lost; a smaller C must be at least max_b count_b (the caller's promise: it is not checked,
    which would synchronise with the host).
    """
    # Each position's slot from prefix counts, not a stable sort: the same order, and it exports (ONNX has no stable
    # sort); the first C slots are kept.
    counts = selected.sum(1, keepdim=True)
    selected_slot = selected.cumsum(1) - 1
    other_slot = counts + (~selected).cumsum(1) - 1
    slot = torch.where(selected, selected_slot, other_slot)
    positions = torch.arange(selected.shape[1], device=selected.device).expand_as(slot)
    order = torch.empty_like(slot).scatter_(1, slot, positions)[:, :capacity]
    valid = torch.arange(capacity, device=selected.device)[None] < counts
    return order, valid


def gather_routed(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` (B, C) of x (B, T, ...) -> (B, C, ...)."""
    expanded = index.reshape(*index.shape, *([1] * (x.ndim - 2))).expand(*index.shape, *x.shape[2:])
    return x.gather(1, expanded)


def scatter_routed(base: torch.Tensor, selected: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``base`` (B, T, d) with the rows of the selected (B, T) tokens replaced by ``values`` (B, C, d), the outputs of
    the gathered layout ``index`` (B, C) of :func:`routed_layout`. Rows of the layout past a row's count hold other
    tokens and are dropped (their gradient is zero)."""
    placed = torch.zeros_like(base).scatter(1, index[..., None].expand_as(values), values.to(base.dtype))
    return torch.where(selected[..., None], placed, base)


# ---------------------------------------------------------------------------------------------------------------
# Attention masks of gathered queries
# ---------------------------------------------------------------------------------------------------------------


def gathered_query_mask(
    query_slots: torch.Tensor,
    query_valid: torch.Tensor | None,
    key_valid: torch.Tensor | None,
    key_length: int,
    is_causal: bool,
    query_starts: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Boolean attention mask (B, 1, Q, S) of queries at key slots ``query_slots`` (B, Q) against S = ``key_length``
    keys: True where query q may read key s, i.e. s ≤ its slot (causal) and key s is not padding, and, in packed rows,
    s ≥ ``query_starts`` (B, Q), the first slot of the query's document.

    ``key_valid`` (B, ≤ S) marks real keys; slots past its length (a static cache's empty tail) are not keys. With
    padding a query also reads its own slot, so that a padding query never gets an empty row. Queries of the layout
    past a row's count (``query_valid`` False) read every key: their outputs are dropped, and a full row keeps
    softmax and its gradient finite. None when nothing is masked (bidirectional, no padding).
    """
    key_slots = torch.arange(key_length, device=query_slots.device)
    allowed = key_slots <= query_slots[..., None] if is_causal else None
    if query_starts is not None:
        after_start = key_slots >= query_starts[..., None]
        allowed = after_start if allowed is None else allowed & after_start
    if key_valid is not None:
        if key_valid.shape[1] < key_length:
            key_valid = F.pad(key_valid, (0, key_length - key_valid.shape[1]), value=False)
        real = key_valid[:, None, :key_length]
        allowed = real if allowed is None else allowed & real
        allowed = allowed | (key_slots == query_slots[..., None])
    if allowed is None:
        return None
    if query_valid is not None:
        allowed = allowed | ~query_valid[..., None]
    return allowed[:, None]


def gathered_query_block_mask(
    query_slots: torch.Tensor,
    query_valid: torch.Tensor | None,
    key_valid: torch.Tensor | None,
    key_length: int,
    is_causal: bool,
    block_size: int = 128,
    query_starts: torch.Tensor | None = None,
):
    """The mask of :func:`gathered_query_mask` as a ``flex_attention`` BlockMask, built on the device from the slots
    (no host synchronisation, no evaluation of the mask over the full (Q, S) grid).

    The slots of each row's valid queries must be increasing (the order of :func:`routed_layout`). A block of
    ``block_size`` queries then needs the key blocks up to its last valid query's slot (causal) and none when it
    holds no valid query, so the kernel skips blocks of unrouted queries and the future of each block. Key blocks
    wholly at or before the block's first slot are "full" (no mask evaluated) when the block has no invalid query and
    no key is padding. Queries past a row's count are masked out entirely here (flex_attention returns 0 for them).
    ``query_starts`` (B, Q), packed rows: a query reads no key before its document's first slot; a block then starts
    at the key block of its earliest valid query's document, and has no full blocks.
    """
    from torch.nn.attention.flex_attention import BlockMask

    batch, length = query_slots.shape
    device = query_slots.device
    q_blocks, kv_blocks = -(-length // block_size), -(-key_length // block_size)
    pad = q_blocks * block_size - length
    if query_valid is None:
        query_valid = torch.ones_like(query_slots, dtype=torch.bool)
    slots = F.pad(query_slots, (0, pad), value=0)
    valid = F.pad(query_valid, (0, pad), value=False)
    blocked_valid = valid.view(batch, q_blocks, block_size)
    any_valid, all_valid = blocked_valid.any(-1), blocked_valid.all(-1)
    if key_valid is not None:
        key_valid = F.pad(key_valid, (0, kv_blocks * block_size - key_valid.shape[1]), value=False)
        all_valid = torch.zeros_like(all_valid)  # padding keys: every block evaluates the mask
    first_block = torch.zeros_like(any_valid, dtype=torch.long)
    if query_starts is not None:
        starts = F.pad(query_starts, (0, pad), value=0)
        earliest = torch.where(valid, starts, key_length).view(batch, q_blocks, block_size).amin(-1)
        first_block = torch.where(any_valid, earliest.div(block_size, rounding_mode="floor"), 0)
        all_valid = torch.zeros_like(all_valid)  # documents begin inside blocks: every block evaluates the mask
    if is_causal:
        last = torch.where(valid, slots, -1).view(batch, q_blocks, block_size).amax(-1)
        first = torch.where(valid, slots, key_length).view(batch, q_blocks, block_size).amin(-1)
        num_blocks = torch.where(any_valid, last.div(block_size, rounding_mode="floor") + 1, 0)
        num_full = torch.where(all_valid, (first + 1).div(block_size, rounding_mode="floor"), 0)
    else:
        num_blocks = torch.where(any_valid, kv_blocks, 0)
        num_full = torch.where(all_valid, key_length // block_size, 0)
    num_blocks = torch.minimum(num_blocks, torch.full_like(num_blocks, kv_blocks))
    num_full = torch.minimum(num_full, num_blocks)
    block_ids = torch.arange(kv_blocks, device=device, dtype=torch.int32)
    full_indices = block_ids.expand(batch, 1, q_blocks, kv_blocks).contiguous()
    # Partial blocks follow the full ones; in packed rows (no full blocks) they start at the earliest document's.
    partial_start = num_full + first_block
    num_partial = (num_blocks - partial_start).clamp(min=0)
    partial_indices = (partial_start[:, None, :, None].int() + block_ids).clamp(max=kv_blocks - 1).contiguous()

    last_query, last_key = slots.shape[1] - 1, kv_blocks * block_size - 1

    def mask_mod(b, h, q, kv):
        # Kernels may evaluate indices past the padded tables (CPU kernels tile with their own block sizes): clamp
        # the lookups and refuse those pairs.
        q_index, kv_index = q.clamp(max=last_query), kv.clamp(max=last_key)
        allowed = valid[b, q_index] & (q <= last_query) & (kv < key_length)
        if is_causal:
            allowed = allowed & (kv <= slots[b, q_index])
        if key_valid is not None:
            allowed = allowed & (key_valid[b, kv_index] | (kv == slots[b, q_index]))
        if query_starts is not None:
            allowed = allowed & (kv >= starts[b, q_index])
        return allowed

    return BlockMask.from_kv_blocks(
        num_partial[:, None].int().contiguous(),
        partial_indices,
        num_full[:, None].int().contiguous(),
        full_indices,
        BLOCK_SIZE=block_size,
        mask_mod=mask_mod,
        seq_lengths=(length, key_length),
    )
