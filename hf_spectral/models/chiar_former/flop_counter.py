"""FLOP counter of a CHIAR-Former forward pass from the routing it actually took.

FLOPs are 2 × the multiply-accumulates of the matrix products the implementation executes (projections, DCT
matrices, random-feature products, attention scores and weighted values, FFN, LM head); elementwise work
(softmax, GELU, LayerNorm, exponentials) is not counted. Attention scores are counted over the (query, key) pairs
a query may see — the valid keys at or before it in a causal model — which is the algorithmic cost, and routed
projections over the routed tokens only. Kernels compute more: SDPA with a mask computes every (query, key) pair of
the gathered layout (about twice the causal pairs), flex_attention every pair of the blocks its block mask visits,
and the gathered layout pads each row to the batch's largest routed count (to T under torch.compile and on
accelerators, where the projections then also run on T rows).
"""

import math

import torch

from ...ops.validation import check_positive_int
from .configuration_chiar_former import ChiarConfig


def _visible_keys(queries: torch.Tensor, key_valid: torch.Tensor, past_length: int, is_causal: bool) -> int:
    """Σ over the query tokens ``queries`` (B, T) bool of the number of keys each sees: the valid keys at or before
    its slot (every valid key when not causal), plus its own slot when that is padding."""
    if not bool(queries.any()):
        return 0
    if is_causal:
        seen = key_valid.long().cumsum(-1)[:, past_length:]
    else:
        seen = key_valid.long().sum(-1, keepdim=True).expand(-1, queries.shape[1])
    own_slot_invalid = ~key_valid[:, past_length:]
    return int(((seen + own_slot_invalid.long()) * queries).sum())


def _attention_flops(config: ChiarConfig, tokens: int, queries: int, pairs: int) -> tuple[int, int]:
    d = config.hidden_size
    projections = 2 * d * d * (2 * tokens + 2 * queries)  # keys/values for every token, queries/outputs for routed
    core = 2 * 2 * d * pairs  # q·k and Σ p v, summed over heads
    return projections + core, core


def _fft_flops(config: ChiarConfig, vectors: int) -> int:
    # One complex length-d FFT per vector, ≈ 5 d log2 d real FLOPs (not matrix work, counted as an estimate).
    return int(5 * vectors * config.hidden_size * math.log2(config.hidden_size))


def _dct_layer_flops(config: ChiarConfig, tokens: int, spectrum: bool, mixing: bool) -> int:
    """DCT work of a layer: the spectrum (routed layers, for the entropy) and / or the DCT mixing of every token.

    Matrix form, even d: one butterfly stage, so two (d/2)-wide products per output — (d/2)² multiply-adds per
    output and token for each half — plus folding C diag(f) C of each half; odd d: full d × d products."""
    d = config.hidden_size
    outputs = int(spectrum) + int(mixing)
    if config.dct_implementation == "fft":
        return _fft_flops(config, tokens) * (int(spectrum or mixing) + int(mixing))
    if d % 2 == 0:
        return outputs * tokens * d * d + (d**3 // 2 if mixing else 0)
    return outputs * 2 * tokens * d * d + (2 * d**3 if mixing else 0)


def _rbf_flops(config: ChiarConfig, batch: int, length: int, selected: int) -> int:
    d, features = config.hidden_size, config.rbf_num_features
    tokens = batch * length
    flops = 2 * tokens * d * d + 2 * tokens * d * features  # values; features xω
    if config.rbf_variant == "authors":
        flops += 2 * batch * length * length * (2 * features + d)  # softmax(φφᵀ) v over all pairs
    elif config.is_causal:
        chunk = config.rbf_chunk_size
        padded = batch * (-(-length // chunk) * chunk)
        flops += 2 * padded * features * (d + 1) * 2  # chunk sums and inter-chunk read-out
        flops += 2 * padded * chunk * (features + d + 1)  # intra-chunk scores and weighted values
    else:
        flops += 2 * tokens * features * (d + 1) * 2  # global sums and read-out
    return flops + 2 * selected * d * d  # output projection of the tokens that took the operator


def _check_arguments(config, batch_size, seq_len, routing_decisions, attention_mask, past_length, lm_head_positions):
    """Refuse arguments that would give a wrong count without an error (a negative LM head, route ids of no
    operator) or a raw broadcasting error deep inside the count (mis-shaped decisions or mask)."""
    if not isinstance(config, ChiarConfig):
        hint = " (a model? pass `model.config`)" if isinstance(getattr(config, "config", None), ChiarConfig) else ""
        raise TypeError(f"`config` must be a ChiarConfig{hint}, got {type(config).__name__}")
    check_positive_int("batch_size", batch_size)
    check_positive_int("seq_len", seq_len)
    if not isinstance(past_length, int) or isinstance(past_length, bool) or past_length < 0:
        raise ValueError(f"`past_length` must be an integer >= 0, got {past_length!r}")
    if lm_head_positions is not None and (
        not isinstance(lm_head_positions, int) or isinstance(lm_head_positions, bool)
        or not 0 <= lm_head_positions <= seq_len
    ):
        raise ValueError(
            f"`lm_head_positions` must be None or an integer in [0, seq_len={seq_len}], got {lm_head_positions!r}"
        )

    # One decision tensor per routed layer only: non-routed layers have none (a model with no routed layer: `()`).
    if routing_decisions is None:
        raise ValueError(
            "`routing_decisions` is None: a CHIAR-Former returns its routing decisions only when called with "
            "`output_routing=True`"
        )
    if not isinstance(routing_decisions, (list, tuple)):
        raise TypeError(
            "`routing_decisions` must be a tuple or list of (batch, seq_len) tensors, one per routed layer (the "
            f"model output's `routing_decisions`), got {type(routing_decisions).__name__}"
        )
    routed_layers = config.routed_layers
    if len(routing_decisions) != len(routed_layers):
        raise ValueError(
            f"`routing_decisions`: expected {len(routed_layers)} routing decisions (one per routed layer "
            f"{routed_layers}), got {len(routing_decisions)}"
        )
    num_operators = len(config.routed_operators)
    for position, (layer_idx, routes) in enumerate(zip(routed_layers, routing_decisions)):
        name = f"routing_decisions[{position}]` (layer {layer_idx})"
        if not isinstance(routes, torch.Tensor) or routes.dtype.is_floating_point or routes.dtype.is_complex or (
            routes.dtype == torch.bool
        ):
            described = routes.dtype if isinstance(routes, torch.Tensor) else type(routes).__name__
            raise TypeError(f"`{name} must be an integer tensor of operator indices, got {described}")
        if tuple(routes.shape) != (batch_size, seq_len):
            raise ValueError(
                f"`{name} must have shape (batch_size, seq_len) = ({batch_size}, {seq_len}), "
                f"got {tuple(routes.shape)}"
            )
        low, high = int(routes.min()), int(routes.max())
        if low < 0 or high >= num_operators:
            raise ValueError(
                f"`{name} must hold operator indices in [0, {num_operators}) (`config.routed_operators`="
                f"{config.routed_operators}), got values in [{low}, {high}]"
            )

    if attention_mask is not None:
        # The padding mask covers the cached positions and the new ones, as the model's forward pass requires.
        width = past_length + seq_len
        if not isinstance(attention_mask, torch.Tensor):
            raise TypeError(f"`attention_mask` must be a tensor or None, got {type(attention_mask).__name__}")
        if tuple(attention_mask.shape) != (batch_size, width):
            raise ValueError(
                f"`attention_mask` must have shape (batch_size, past_length + seq_len) = ({batch_size}, {width}), "
                f"got {tuple(attention_mask.shape)}"
            )


def count_flops(
    config: ChiarConfig,
    batch_size: int,
    seq_len: int,
    routing_decisions: tuple[torch.Tensor, ...] | list[torch.Tensor] = (),
    attention_mask: torch.Tensor | None = None,
    past_length: int = 0,
    lm_head_positions: int | None = None,
) -> dict:
    """FLOPs of one forward pass over ``batch_size`` × ``seq_len`` new tokens (after ``past_length`` cached ones).

    ``routing_decisions`` are the model output's ``routing_decisions`` (one (B, T) tensor per routed layer, returned
    by a forward called with ``output_routing=True``);
    ``attention_mask`` is the (B, past + T) padding mask given to the model. ``lm_head_positions`` counts the LM
    head over that many positions per row (None: no head). Returns ``{"attention", "attention_core", "dct",
    "rbf", "ffn", "router", "lm_head", "total", "per_layer"}``; ``per_layer`` holds one such dict per layer.
    ``router`` is the routing cost: the entropy's dot products and, for hard / soft routing, the router projection.
    Arguments that do not describe a possible forward pass of ``config`` (a shape, a route id or a count out of
    range) raise a ``ValueError`` naming the argument, a wrong type (a model instead of its config) a ``TypeError``.
    """
    _check_arguments(config, batch_size, seq_len, routing_decisions, attention_mask, past_length, lm_head_positions)
    routed_layers = config.routed_layers
    d = config.hidden_size
    tokens = batch_size * seq_len
    if attention_mask is None:
        attention_mask = torch.ones(batch_size, past_length + seq_len, dtype=torch.bool)
    key_valid = attention_mask.bool().cpu()
    all_tokens = torch.ones(batch_size, seq_len, dtype=torch.bool)
    dense_routing = config.router_type == "soft" or config.routed_execution == "dense"
    decisions = dict(zip(routed_layers, routing_decisions))

    per_layer = []
    for layer_idx, layer_op in enumerate(config.layer_operators):
        operators = config.layer_operator_set(layer_idx)
        counts = dict.fromkeys(("attention", "attention_core", "dct", "rbf", "router"), 0)
        if layer_op == "routed":
            routes = decisions[layer_idx].cpu()
            # The spectrum of every token (for the entropy) and, with DCT among the operators, the DCT mixing of
            # every token from the same products.
            counts["dct"] += _dct_layer_flops(config, tokens, spectrum=True, mixing="dct" in operators)
            counts["router"] = 2 * tokens * d  # Σ P log P of the entropy, as one dot product per token
            if config.router_type != "threshold":
                counts["router"] += 2 * tokens * (d + 1) * len(operators)
        else:
            routes = torch.zeros(batch_size, seq_len, dtype=torch.long)
        for k, operator in enumerate(operators):
            chosen = all_tokens if dense_routing else routes == k
            if operator == "attention":
                pairs = _visible_keys(chosen, key_valid, past_length, config.is_causal)
                total, core = _attention_flops(config, tokens, int(chosen.sum()), pairs)
                counts["attention"] += total
                counts["attention_core"] += core
            elif operator == "dct":
                if layer_op != "routed":  # routed layers counted it with the spectrum
                    counts["dct"] += _dct_layer_flops(config, tokens, spectrum=False, mixing=True)
            else:
                counts["rbf"] += _rbf_flops(config, batch_size, seq_len, int(chosen.sum()))
        counts["ffn"] = 2 * 2 * tokens * d * config.intermediate_size
        counts["total"] = counts["attention"] + counts["dct"] + counts["rbf"] + counts["router"] + counts["ffn"]
        per_layer.append(counts)

    summary = {key: sum(layer[key] for layer in per_layer) for key in per_layer[0]}
    summary["lm_head"] = 2 * batch_size * lm_head_positions * d * config.vocab_size if lm_head_positions else 0
    summary["total"] += summary["lm_head"]
    summary["per_layer"] = per_layer
    return summary


__all__ = ["count_flops"]
