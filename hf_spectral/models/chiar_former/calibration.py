"""Calibration of CHIAR-Former's entropy thresholds to percentiles of the entropies a model sees on data.

The authors set τ_lo / τ_hi to the 33rd / 67th percentiles of the measured spectral entropies (0.855 / 0.865 at
d = 256). Thresholds depend on the width, the data and the training state, so a fixed default is meaningless for
any other model: calibrate after (or during) training, on a sample of the training data.
"""

import copy
import itertools
import math
import numbers
import warnings
from collections.abc import Iterable, Iterator, Sequence

import torch

# 3 operators: the authors' percentiles. 2 operators (DCT / attention): τ_mid at the 75th percentile sends ≈ 25% of
# the tokens to attention, the fraction behind the authors' 62.5% attention-FLOP saving (SPEC 2.3).
DEFAULT_PERCENTILES = {3: (33.0, 67.0), 2: (75.0,)}
# Passes of the shared calibration (several routed layers) before it stops without a fixed point.
MAX_SHARED_PASSES = 10


def _as_model_inputs(batch) -> dict:
    if isinstance(batch, torch.Tensor):
        return {"input_ids": batch}
    if isinstance(batch, (list, tuple)):
        return {"input_ids": batch[0]}
    names = ("input_ids", "attention_mask", "inputs_embeds", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k")
    return {k: v for k, v in batch.items() if k in names}  # packed rows: their boundaries too


def _several_processes() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() and (
        torch.distributed.get_world_size() > 1
    )


def _pooling(across_processes: bool | None, caller: str) -> bool:
    """Whether to pool over processes. Unset in a run of several processes: no, with a warning. Pooling by default
    would leave a call made on one process alone (a plot, an analysis) waiting for the others until the process
    group's timeout; not pooling leaves processes with their own data calibrating differently, which is said."""
    if across_processes is None and _several_processes():
        warnings.warn(
            f"{caller}: this is one of {torch.distributed.get_world_size()} processes and calibrates on its own data "
            "alone, so processes reading other data set other thresholds and route the same tokens differently. "
            "Pass across_processes=True (and call it on every process) to pool the data of all, or "
            "across_processes=False where that is meant (the same data on every process, or a call on one).",
            stacklevel=3,
        )
    return bool(across_processes) and _several_processes()


@torch.no_grad()
def measure_entropies(
    model, dataloader: Iterable, max_batches: int | None = None, across_processes: bool | None = None
) -> list[torch.Tensor]:
    """Spectral entropies of the non-padding tokens at each routed layer, one 1-D tensor per routed layer.

    ``dataloader`` yields tensors of input ids, tuples whose first item is the input ids, or dicts with
    ``input_ids`` (and optionally ``attention_mask``, or the ``position_ids`` / ``cu_seq_lens_*`` of packed rows,
    whose documents are then measured apart). With ``torch.distributed`` running several processes,
    ``across_processes=True`` gives every process the entropies of all of them (in rank order): every process must
    then call it, as every process calls `Trainer.evaluate`. False: this process's batches alone; unset: the same,
    with a warning in a run of several processes.
    """
    device = next(model.parameters()).device
    collected = [[] for _ in model.config.routed_layers]
    for step, batch in enumerate(dataloader):
        if max_batches is not None and step >= max_batches:
            break
        inputs = {k: v.to(device) for k, v in _as_model_inputs(batch).items()}
        # The routed layers belong to the base model: no head runs (an unfitted pooling head may not run at all).
        outputs = model.base_model(**inputs, use_cache=False, output_routing=True)
        mask = inputs.get("attention_mask")
        for store, entropy in zip(collected, outputs.routing_entropies):
            store.append((entropy[mask.bool()] if mask is not None else entropy.flatten()).float().cpu())
    if not collected:
        raise ValueError("the model has no routed layer (`layer_operators` has no 'routed' entry)")
    batches = len(collected[0])
    entropies = [torch.cat(store) if store else torch.empty(0) for store in collected]
    if _pooling(across_processes, "measure_entropies"):
        # Processes that each read their own shard would otherwise each set other thresholds and route the same
        # tokens differently while their gradients are averaged. (Pooled before the checks below: a process that
        # raised alone would leave the others waiting in the gather.)
        gathered = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, (batches, entropies))
        batches = sum(count for count, _ in gathered)
        entropies = [torch.cat([rank[i] for _, rank in gathered]) for i in range(len(entropies))]
    if not batches:
        raise ValueError("the dataloader yielded no batches")
    if not entropies[0].numel():
        raise ValueError("the dataloader's batches hold no token: every attention_mask entry is 0")
    return entropies


# The config fields `calibrate_thresholds` may change.
_THRESHOLD_FIELDS = ("layer_thresholds", "tau_lo", "tau_mid", "tau_hi")


def _is_percentile(value) -> bool:
    """A real number (not a bool, a string or NaN) in [0, 100]."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and (
        0 <= value <= 100
    )


def _percentiles(values: torch.Tensor, percentiles: Sequence[float]) -> list[float]:
    """The percentiles of ``values``, each set in the middle of the gap between the two distinct measured values
    around it, never on a measured value. Ties are common (in the first routed layer a token's entropy depends on
    its id alone), and a threshold equal to a token's entropy would route every occurrence of that token by the
    last bit of its entropy, which another kernel (a compiled graph, a GPU) can flip. Where the percentile falls on
    a value, of the gaps just below and just above it the one whose share of values below is nearer the
    percentile. Entropies lie in [0, 1], and so do the thresholds: below the smallest value the gap reaches down to
    0, above the largest up to 1."""
    values = values.double().flatten()
    distinct, counts = torch.unique(values, return_counts=True)  # sorted
    below = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).tolist()  # values below gap i (between distinct i-1, i)
    edges = [0.0, *distinct.clamp(0, 1).tolist(), 1.0]  # gap i lies between edges[i] and edges[i + 1]

    def gap_middle(i):
        return (edges[i] + edges[i + 1]) / 2

    thresholds = []
    q = torch.tensor([p / 100.0 for p in percentiles], dtype=torch.float64)
    for p, value in zip(percentiles, torch.quantile(values, q).tolist()):
        gap = int(torch.searchsorted(distinct, torch.tensor(value, dtype=torch.float64), right=True))
        candidates = [gap - 1, gap] if gap > 0 and distinct[gap - 1] == value else [gap]
        # The outer gaps end at 0 and 1: one has no width where a measured entropy is exactly 0 or 1 (a state with
        # one DCT coefficient, a flat spectrum); the gap on the value's other side then takes the threshold.
        candidates = [i for i in candidates if edges[i] < edges[i + 1]] or candidates
        best = min(candidates, key=lambda i: abs(below[i] / len(values) - p / 100))
        thresholds.append(gap_middle(best))
    return thresholds


def set_shared_thresholds(config, values: Sequence[float]) -> None:
    """One threshold set shared by every routed layer: ``[τ_mid]`` or ``[τ_lo, τ_hi]`` (``layer_thresholds`` off)."""
    values = [float(value) for value in values]
    if len(values) == 1:
        config.tau_mid = values[0]
    else:
        config.tau_lo, config.tau_hi = values
    config.layer_thresholds = None


def calibrate_thresholds(
    model,
    dataloader: Iterable,
    percentiles: Sequence[float] | None = None,
    per_layer: bool = False,
    max_batches: int | None = None,
    across_processes: bool | None = None,
) -> dict:
    """Set the routing thresholds of ``model.config`` to percentiles of the entropies measured on ``dataloader``
    (each placed between two measured values, never on one: `_percentiles`).

    Args:
        model: a CHIAR-Former (any head) with threshold routing.
        dataloader: see :func:`measure_entropies`; it is iterated once per pass. Where several passes may run
            (several routed layers) a one-shot iterator (a generator) is first read into a list (up to
            ``max_batches`` batches), so its batches are held in memory for every pass.
        percentiles: a sequence of one value (τ_mid, 2 routed operators) or two (τ_lo, τ_hi, 3 operators) in
            [0, 100]; default 75 (≈ 25% of tokens to attention) or the authors' 33 / 67.
        per_layer: False (default): one τ set shared by all routed layers (the `tau_*` fields), the percentiles of
            the pooled entropies of every routed layer. The entropies of a routed layer after the first depend on
            how the earlier ones route, that is on the thresholds being set: the passes repeat, each measuring
            under the thresholds the last one set, until the thresholds reproduce themselves (the pooled entropies
            measured under them have them as percentiles), at most `MAX_SHARED_PASSES` passes (one pass for a
            single routed layer; a warning when they end without a fixed point). Every pass must read the same
            batches: a shuffled DataLoader without ``max_batches`` gives each pass another sample. True: one set per
            routed layer (`layer_thresholds`), calibrated layer after layer — each layer's entropies are measured
            with the earlier layers already routing by their final thresholds, so each layer hits its percentiles
            on this data.
        max_batches: stop each pass after this many batches.
        across_processes: with ``torch.distributed`` running several processes (a data-parallel run), True pools
            the entropies of every process (`measure_entropies`), so that every process sets the same thresholds
            from the data of all; every process must then call this function. False: this process's data alone (the
            same batches on every process, or a call made on one process only). Unset: this process's data alone,
            with a warning in a run of several processes (processes calibrating on different data route
            differently).

    Returns ``{"thresholds": {layer index: [τ...]}, "percentiles": [...], "passes": n}``; the model routes with the
    new thresholds from its next forward pass on (as does every model sharing this config object: copy the config
    first to calibrate one of them alone). When a pass fails, the config's thresholds are restored before the error
    propagates.
    """
    config = model.config
    if config.router_type != "threshold":
        raise ValueError(f"thresholds are calibrated for `router_type='threshold'`, not {config.router_type!r}")
    if not config.routed_layers:
        raise ValueError("the model has no routed layer (`layer_operators` has no 'routed' entry)")
    num_thresholds = len(config.routed_operators) - 1
    expected = (
        f"`percentiles` must be a sequence of {num_thresholds} real number(s) in [0, 100] for {num_thresholds + 1} "
        "routed operators"
    )
    if percentiles is None:
        percentiles = DEFAULT_PERCENTILES[num_thresholds + 1]
    # A bare number or a string would otherwise fail inside tuple() or a comparison with a raw TypeError.
    if not isinstance(percentiles, Sequence) or isinstance(percentiles, (str, bytes)):
        raise ValueError(f"{expected}, got {percentiles!r}")
    if len(percentiles) != num_thresholds or any(not _is_percentile(p) for p in percentiles):
        raise ValueError(f"{expected}, got {percentiles!r}")
    percentiles = tuple(percentiles)
    if list(percentiles) != sorted(percentiles):
        raise ValueError(f"`percentiles` must be non-decreasing, got {percentiles!r}")

    if len(config.routed_layers) > 1 and (isinstance(dataloader, Iterator) or max_batches is not None):
        # A one-shot iterator (a generator: `iter(x) is x`) would be exhausted after the first pass, and a shuffled
        # DataLoader cut at max_batches would give each pass another sample: the passes read the same batches,
        # kept. (Tested without calling `iter`, which on a DataLoader would start its workers for nothing.)
        dataloader = list(itertools.islice(dataloader, max_batches) if max_batches is not None else dataloader)

    # The fields this function sets, restored when a pass fails so that the model is not left half-calibrated.
    original = {name: copy.deepcopy(getattr(config, name)) for name in _THRESHOLD_FIELDS}
    was_training = model.training
    model.eval()
    pooled = _pooling(across_processes, "calibrate_thresholds")
    try:
        if pooled:
            # Every process starts from the first one's thresholds: the entropies of a pass are measured under them,
            # and whether a pass ends the calibration depends on them, so processes starting from their own would
            # pool entropies routed differently, or stop after different passes and wait on each other.
            start = [original[name] for name in _THRESHOLD_FIELDS]
            torch.distributed.broadcast_object_list(start, src=0)
            for name, value in zip(_THRESHOLD_FIELDS, start):
                setattr(config, name, value)
        if per_layer:
            thresholds = list(config.layer_thresholds or [None] * config.num_hidden_layers)
            for position, layer_idx in enumerate(config.routed_layers):
                entropies = measure_entropies(model, dataloader, max_batches, pooled)[position]
                thresholds[layer_idx] = _percentiles(entropies, percentiles)
                config.layer_thresholds = thresholds
            result, passes = {i: thresholds[i] for i in config.routed_layers}, len(config.routed_layers)
        else:
            config.layer_thresholds = None
            seen = [[config.tau_mid] if num_thresholds == 1 else [config.tau_lo, config.tau_hi]]
            for passes in range(1, MAX_SHARED_PASSES + 1):
                entropies = measure_entropies(model, dataloader, max_batches, pooled)
                values = _percentiles(torch.cat(entropies), percentiles)
                set_shared_thresholds(config, values)
                # Stop at a fixed point (the first routed layer's entropies do not depend on the thresholds, so one
                # routed layer needs one pass), or where the passes cycle.
                fixed = values == seen[-1] or len(config.routed_layers) == 1
                if fixed or values in seen:
                    break
                seen.append(values)
            if not fixed:
                warnings.warn(
                    f"calibrate_thresholds: the shared thresholds reached no fixed point in {passes} passes (the last "
                    f"pass set {values}, the one before {seen[-1]}): the pooled shares may miss the percentiles "
                    "slightly; per_layer=True calibrates each routed layer exactly",
                    stacklevel=2,
                )
            result = dict.fromkeys(config.routed_layers, values)
        config._validate()
    except BaseException:
        for name, value in original.items():
            setattr(config, name, value)
        raise
    finally:
        model.train(was_training)
    return {"thresholds": result, "percentiles": list(percentiles), "passes": passes}


__all__ = ["DEFAULT_PERCENTILES", "calibrate_thresholds", "measure_entropies", "set_shared_thresholds"]
