"""The theory applied to trained models (the only part of ``hf_spectral.rmt`` that imports torch).

* ``attention_pooling_weights``: the effective pooling weights of a model's attention, i.e. the attention
  probabilities averaged over queries, per layer and head (eager attention; for EGA-GPT these are the gated,
  renormalised probabilities Â, since the gate is folded into the logits before the softmax).
* ``estimate_position_correlation``: an estimate R̂ of the position-correlation matrix from labelled data.
* ``fit_rmt_pooling``: installs the top eigenvector of R̂ as the fixed weights of a ``SequencePooling`` head in
  ``rmt_optimal`` mode (EGA-GPT's ``classifier_pooling="rmt_optimal"``, and any model with the same head).
* ``attention_pooling_report``: α/κ of each layer's effective weights against R (given or estimated), next to
  mean, harmonic and optimal pooling.

Batches, for every tool here: any mapping (a dict, or the ``BatchEncoding`` that transformers' tokenizers and data
collators such as ``DataCollatorWithPadding`` yield) with ``input_ids``, optionally ``attention_mask`` and
``labels``; a tensor of input ids; or a tuple/list of tensors as a ``TensorDataset`` yields it: ``(input_ids,)``,
``(input_ids, labels)`` or ``(input_ids, attention_mask, labels)``. A ``DataLoader`` or a list of batches both work.

Positions are indexed by *real* tokens (the t-th non-padding token of a sequence), as ``SequencePooling`` does, so
left and right padding give the same result.

Estimator of R (``estimate_position_correlation``). With h_t^(n) ∈ R^C the chosen token states (by default the
input embeddings, see its ``states`` argument) and Y_n the label (one-hot for classes, the value for a scalar
target):

1. centre each position over sequences: h̃_t^(n) = h_t^(n) − h̄_t (h̄_t: mean over the sequences that have
   position t; this removes position-embedding offsets, which carry no label information);
2. signal direction u: top left singular vector of the cross-covariance Σ_{n,t} h̃_t^(n) (Y_n − Ȳ)ᵀ; for two
   classes this is the class-mean difference direction of the centred states;
3. per-position signal x_t^(n) = h̃_t^(n) · u (the theory's ξ_t‖μ‖ plus noise along u);
4. R̂ = normalised second moment: M_st = mean over sequences having both positions of x_s x_t, R̂ = D^{-1/2} M D^{-1/2}
   with D = diag(M). Multiplying x by the label sign (y = ±1), as one might to make the signal's mean visible,
   leaves this second moment unchanged since y² = 1; the labels enter through u. A position whose x has no
   variance (e.g. a fixed BOS token) gets an identity row (an independent position, weight 0 in w* whenever
   λ_max(R̂) > 1). With variable lengths M is estimated pairwise and, if needed, projected back onto the
   positive semi-definite cone before normalising.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from ..evaluation import evaluation_mode
from ..ops.pooling import SequencePooling, classifier_attention_mask
from ..ops.positions import token_positions
from .generative import validate_correlation_matrix
from .pooling import (
    PoolingSNR,
    harmonic_causal_weights,
    mean_pooling_weights,
    optimal_pooling_weights,
    pooling_snr,
)

__all__ = [
    "AttentionPoolingWeights",
    "attention_pooling_weights",
    "PositionCorrelationEstimate",
    "estimate_position_correlation",
    "RMTPoolingFit",
    "fit_rmt_pooling",
    "attention_pooling_report",
]

LABEL_KEYS = ("labels", "label")


def _device(model) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:  # pragma: no cover - a model without parameters
        return torch.device("cpu")


def _as_mapping(batch) -> Mapping:
    """A batch as a mapping of model inputs. Accepted: any mapping (a dict, the ``BatchEncoding`` of transformers'
    tokenizers and collators), a tensor of input ids, or a tuple/list as a ``TensorDataset`` yields it:
    ``(input_ids,)``, ``(input_ids, labels)`` or ``(input_ids, attention_mask, labels)``."""
    if isinstance(batch, Mapping):
        return batch
    if torch.is_tensor(batch):
        return {"input_ids": batch}
    if isinstance(batch, (tuple, list)) and 1 <= len(batch) <= 3 and all(torch.is_tensor(t) for t in batch):
        names = {1: ("input_ids",), 2: ("input_ids", "labels"), 3: ("input_ids", "attention_mask", "labels")}
        return dict(zip(names[len(batch)], batch))
    raise ValueError(
        "expected batches that are mappings (dict, BatchEncoding: input_ids, attention_mask, labels, ...), tensors of "
        "input ids, or tuples (input_ids[, attention_mask], labels) of tensors; got "
        f"{type(batch).__name__}" + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
    )


def _split_batch(batch, model):
    """(model inputs without labels, labels or None), tensors moved to the model's device. For a model with the
    shared pooling head, a batch without an attention mask gets the one that head builds from
    ``config.pad_token_id``, so that these tools index the real tokens the model attends to and pools, not its
    padding (other models run the batch as it is)."""
    device = _device(model)
    batch = _as_mapping(batch)
    labels = next((batch[k] for k in LABEL_KEYS if k in batch), None)
    inputs = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in batch.items() if k not in LABEL_KEYS}
    if inputs.get("attention_mask") is None and isinstance(getattr(model, "pooling", None), SequencePooling):
        mask = classifier_attention_mask(type(model).__name__, inputs.get("input_ids"), inputs.get("inputs_embeds"),
                                         None, getattr(getattr(model, "config", None), "pad_token_id", None))
        if mask is not None:
            inputs["attention_mask"] = mask
    return inputs, labels


def _batches(dataloader, max_batches):
    for index, batch in enumerate(dataloader):
        if max_batches is not None and index >= max_batches:
            return
        yield batch


@contextmanager
def _unfitted_heads_allowed(model):
    """Let unfitted ``rmt_optimal`` heads run while measuring: these tools read states and attentions, not the
    head's output (and fitting needs the model's states before there are weights)."""
    with ExitStack() as stack:
        for module in model.modules():
            if callable(getattr(module, "unfitted_allowed", None)):
                stack.enter_context(module.unfitted_allowed())
        yield


@contextmanager
def _eager_attention(model):
    """Run with the eager attention path (the only one that returns probabilities), restoring the previous one."""
    config = getattr(model, "config", None)
    previous = getattr(config, "_attn_implementation", None)
    if previous == "eager":
        yield
        return
    if not hasattr(model, "set_attn_implementation"):
        raise ValueError(
            f"{type(model).__name__} uses attention {previous!r}; load it with attn_implementation='eager' to "
            "read attention probabilities"
        )
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def _align_real_tokens(states: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T, ...) -> (B, T, ...) with the t-th real token of each row moved to slot t; returns it and the (B, T)
    bool mask of filled slots. Works for left and right padding."""
    batch, length = states.shape[:2]
    if mask is None:
        return states, torch.ones(batch, length, dtype=torch.bool, device=states.device)
    mask = mask.to(states.device).bool()
    positions = token_positions(mask)
    aligned = states.new_zeros(states.shape)
    rows = torch.arange(batch, device=states.device)[:, None].expand(batch, length)
    aligned[rows[mask], positions[mask]] = states[mask]
    filled = torch.arange(length, device=states.device)[None] < mask.sum(-1, keepdim=True)
    return aligned, filled


def _grow(array: np.ndarray, length: int, axis: int) -> np.ndarray:
    if array.shape[axis] >= length:
        return array
    pad = [(0, 0)] * array.ndim
    pad[axis] = (0, length - array.shape[axis])
    return np.pad(array, pad)


# ----------------------------------------------------------------------------------------------------------------
# Effective pooling weights of attention
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class AttentionPoolingWeights:
    """Attention probabilities averaged over queries.

    ``head_weights[l, h, t]``: weight of key position t (real-token index) in layer l, head h: for each sequence
    the softmax rows of its real queries are averaged (a vector summing to 1 over its keys), then averaged over
    sequences (zero past a sequence's length, so the result still sums to 1). ``layer_weights`` averages heads.
    """

    layer_weights: np.ndarray
    head_weights: np.ndarray
    n_sequences: int

    def snr(self, R) -> list[PoolingSNR]:
        """α/κ of each layer's weights against R (weights truncated to R's size)."""
        R = validate_correlation_matrix(R)
        T = min(R.shape[0], self.layer_weights.shape[1])
        return [pooling_snr(w[:T], R[:T, :T]) for w in self.layer_weights]


def attention_pooling_weights(model, dataloader, *, max_batches: int | None = None) -> AttentionPoolingWeights:
    """Effective pooling weights of every attention layer of ``model`` on the batches of ``dataloader``.

    Runs ``model(**batch, output_attentions=True)`` with eager attention (switched temporarily if the model uses
    another kernel), in eval mode, without gradients. Batches are mappings (dicts, ``BatchEncoding``), tensors of input
    ids or ``(input_ids[, attention_mask], labels)`` tuples; ``labels`` are ignored.
    """
    sums, count = None, 0
    with evaluation_mode(model), _eager_attention(model), _unfitted_heads_allowed(model):
        for batch in _batches(dataloader, max_batches):
            inputs, _ = _split_batch(batch, model)
            attentions = model(**inputs, output_attentions=True).attentions
            if not attentions:
                raise ValueError(f"{type(model).__name__} returned no attentions with output_attentions=True")
            mask = inputs.get("attention_mask")
            probs = torch.stack([a.float() for a in attentions], dim=1)  # (B, L, H, Tq, Tk)
            batch_size, length = probs.shape[0], probs.shape[-1]
            if mask is None:
                mask = torch.ones(batch_size, length, dtype=torch.bool, device=probs.device)
            mask = mask[:, -length:].to(probs.device).bool()
            queries = mask[:, None, None, :, None].to(probs.dtype)
            # average each sequence's real query rows; padded keys already have probability 0
            per_sequence = (probs * queries).sum(-2) / mask.sum(-1).clamp(min=1)[:, None, None, None]
            aligned, _ = _align_real_tokens(per_sequence.permute(0, 3, 1, 2), mask)  # (B, T, L, H)
            total = aligned.sum(0).permute(1, 2, 0).cpu().double().numpy()  # (L, H, T)
            sums = total if sums is None else _grow(sums, total.shape[-1], 2) + _grow(total, sums.shape[-1], 2)
            count += batch_size
    if sums is None:
        raise ValueError("the dataloader yielded no batches")
    heads = sums / count
    return AttentionPoolingWeights(layer_weights=heads.mean(axis=1), head_weights=heads, n_sequences=count)


# ----------------------------------------------------------------------------------------------------------------
# Estimating R and fitting the rmt_optimal head
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class PositionCorrelationEstimate:
    """R̂ (``matrix``, T×T, a validated correlation matrix), the unit signal direction u (``direction``, C), the
    number of sequences with a token at each position (``counts``), the variance of the per-position signal
    x_t before normalisation (``variances``) and the number of sequences used."""

    matrix: np.ndarray
    direction: np.ndarray
    counts: np.ndarray
    variances: np.ndarray
    n_sequences: int


class _PoolingInputs:
    """Captures the (hidden, mask) pair a model hands to its ``.pooling`` module."""

    def __init__(self, pooling):
        self.value = None
        self.handle = pooling.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden"]
        mask = args[1] if len(args) > 1 else kwargs.get("mask")
        self.value = (hidden.detach(), None if mask is None else mask.detach())

    def close(self):
        self.handle.remove()


STATE_SOURCES = ("embeddings", "pooled")


@contextmanager
def _state_source(model, states):
    """Yields a function batch_inputs -> (states (B, T, C), mask (B, T) or None) for the chosen states."""
    if states == "pooled":
        pooling = getattr(model, "pooling", None)
        if pooling is None:
            raise ValueError(f"states='pooled' needs a model with a .pooling head; {type(model).__name__} has none")
        capture = _PoolingInputs(pooling)
        try:
            def read(inputs):
                capture.value = None
                model(**inputs)
                if capture.value is None:
                    raise ValueError(f"{type(model).__name__}.pooling was not called by the forward pass")
                return capture.value

            yield read
        finally:
            capture.close()
        return
    if states == "embeddings":
        index = 0
    elif isinstance(states, int) and not isinstance(states, bool):
        index = states
    else:
        raise ValueError(f"states must be one of {STATE_SOURCES} or a hidden_states index, got {states!r}")

    def read(inputs):
        hidden = model(**inputs, output_hidden_states=True).hidden_states
        if not hidden:
            raise ValueError(f"{type(model).__name__} returned no hidden_states")
        if not -len(hidden) <= index < len(hidden):
            raise ValueError(
                f"states={states!r} is no hidden_states index: {type(model).__name__} returns {len(hidden)} "
                f"(embeddings and one per layer: {-len(hidden)} to {len(hidden) - 1})"
            )
        return hidden[index], inputs.get("attention_mask")

    yield read


def _label_matrix(labels: torch.Tensor, num_classes: int | None) -> np.ndarray:
    """One-hot rows for integer class labels (``num_classes`` columns, else this batch's largest label + 1), the
    values for float targets."""
    labels = labels.detach().cpu()
    if labels.ndim == 1 and not torch.is_floating_point(labels):
        classes = num_classes or int(labels.max()) + 1
        if labels.min() < 0 or labels.max() >= classes:
            raise ValueError(f"class labels must lie in [0, {classes}), got [{int(labels.min())}, {int(labels.max())}]")
        return torch.nn.functional.one_hot(labels.long(), classes).double().numpy()
    return labels.double().reshape(labels.shape[0], -1).numpy()


def estimate_position_correlation(model, dataloader, *, states: str | int = "embeddings",
                                  max_batches: int | None = None, min_count: int = 2,
                                  num_classes: int | None = None) -> PositionCorrelationEstimate:
    """Estimate the position-correlation matrix R̂ from labelled batches (estimator in the module docstring).

    ``states`` says which token states x_t is read from:

    * ``"embeddings"`` (default): ``hidden_states[0]``, the input embeddings (token + position). This is the
      theory's setting, a fixed table whose noise is independent across positions, so R̂ estimates the *data's*
      position correlation whatever the model has learnt; use it to fit a head at initialisation.
    * ``"pooled"``: the states the ``.pooling`` head receives. After training these carry what attention has moved
      between positions (in a causal classifier, later positions hold the label too, and R̂ spreads out); at
      initialisation, attention's causal averaging makes their noise correlated across positions, which the
      theory does not model and which pulls R̂'s top eigenvector towards late positions.
    * an int: ``hidden_states[states]``.

    Two passes over ``dataloader`` (it must be re-iterable, like a
    ``DataLoader``): the first for the per-position means and u, the second for R̂. Positions held by fewer than
    ``min_count`` sequences are dropped from the end. Class labels are integers (``num_classes`` defaults to the
    largest label + 1); float labels are used as scalar/vector targets.
    """
    if min_count < 2:
        raise ValueError(f"min_count must be >= 2 (a variance needs two sequences), got {min_count}")
    with evaluation_mode(model), _unfitted_heads_allowed(model), _state_source(model, states) as read:
        # pass 1: per-position sums and the state/label cross-moments
        sum_h = sum_hy = sum_y_t = counts = None
        n_sequences = 0
        for batch in _batches(dataloader, max_batches):
            inputs, labels = _split_batch(batch, model)
            if labels is None:
                raise ValueError("estimate_position_correlation needs labelled batches (a 'labels' entry)")
            states, mask = read(inputs)
            aligned, filled = _align_real_tokens(states.float(), mask)
            h = (aligned * filled[..., None]).cpu().double().numpy()  # (B, T, C), 0 at empty slots
            f = filled.cpu().double().numpy()  # (B, T)
            Y = _label_matrix(labels, num_classes)
            if Y.shape[0] != h.shape[0]:
                raise ValueError(f"{Y.shape[0]} labels for a batch of {h.shape[0]} sequences")
            T = h.shape[1]
            if sum_h is None:
                sum_h, counts = np.zeros((T, h.shape[2])), np.zeros(T)
                sum_hy, sum_y_t = np.zeros((h.shape[2], Y.shape[1])), np.zeros((T, Y.shape[1]))
            if Y.shape[1] != sum_hy.shape[1]:
                if torch.is_floating_point(labels):
                    raise ValueError(f"targets of width {Y.shape[1]} after targets of width {sum_hy.shape[1]}")
                # a batch with a larger class label than the batches before (e.g. a label-sorted dataset): the
                # earlier one-hot rows were 0 in the new columns
                width = max(Y.shape[1], sum_hy.shape[1])
                Y, sum_hy, sum_y_t = _grow(Y, width, 1), _grow(sum_hy, width, 1), _grow(sum_y_t, width, 1)
            sum_h, counts, sum_y_t = _grow(sum_h, T, 0), _grow(counts, T, 0), _grow(sum_y_t, T, 0)
            sum_h[:T] += h.sum(0)
            counts[:T] += f.sum(0)
            sum_hy += np.einsum("btc,bk->ck", h, Y)
            sum_y_t[:T] += f.T @ Y
            n_sequences += h.shape[0]
        if sum_h is None:
            raise ValueError("the dataloader yielded no batches")
        keep = int(np.sum(counts >= min_count))
        if keep < 1:
            raise ValueError(f"no position is held by {min_count} or more sequences")
        mean_h = sum_h / np.maximum(counts, 1)[:, None]
        cross = sum_hy - mean_h.T @ sum_y_t  # Σ_{n,t} (h_t − h̄_t) Y_nᵀ; Ȳ drops out since Σ (h_t − h̄_t) = 0
        left, singular, _ = np.linalg.svd(cross, full_matrices=False)
        if singular[0] <= 1e-12 * max(1.0, np.abs(sum_hy).max()):
            raise ValueError("the states carry no label information (zero state/label cross-covariance)")
        u = left[:, 0]

        # pass 2: second moment of the per-position signal x_t = (h_t − h̄_t)·u
        moment, pairs = np.zeros((keep, keep)), np.zeros((keep, keep))
        second_pass_sequences = 0
        for batch in _batches(dataloader, max_batches):
            inputs, _ = _split_batch(batch, model)
            states, mask = read(inputs)
            aligned, filled = _align_real_tokens(states.float(), mask)
            h = aligned.cpu().double().numpy()[:, :keep]
            f = filled.cpu().double().numpy()[:, :keep]
            T = h.shape[1]
            x = ((h - mean_h[:T]) @ u) * f
            moment[:T, :T] += x.T @ x
            pairs[:T, :T] += f.T @ f
            second_pass_sequences += h.shape[0]
    if second_pass_sequences != n_sequences:
        raise ValueError(
            f"the dataloader gave {n_sequences} sequences in the first pass over it and {second_pass_sequences} in the "
            "second: the estimate reads it twice, so it must be re-iterable with the same data (a DataLoader or a "
            "list of batches, not a generator or an iterator)"
        )
    M = moment / np.maximum(pairs, 1)
    variances = np.diag(M).copy()
    R = _normalise_second_moment(M)
    return PositionCorrelationEstimate(matrix=R, direction=u, counts=counts[:keep], variances=variances,
                                       n_sequences=n_sequences)


def _normalise_second_moment(M: np.ndarray) -> np.ndarray:
    """Second moment -> correlation matrix: PSD projection if pairwise estimation broke it, unit diagonal,
    identity rows for positions without variance."""
    M = (M + M.T) / 2
    values, vectors = np.linalg.eigh(M)
    if values[0] < 0:
        M = (vectors * np.clip(values, 0, None)) @ vectors.T
    scale = np.diag(M).copy()
    dead = scale <= 1e-12 * max(scale.max(), 1e-300)
    root = np.sqrt(np.where(dead, 1.0, scale))
    R = M / np.outer(root, root)
    R[dead, :] = 0.0
    R[:, dead] = 0.0
    np.fill_diagonal(R, 1.0)
    return validate_correlation_matrix(np.clip(R, -1.0, 1.0), name="estimated R")


@dataclass
class RMTPoolingFit:
    """Result of ``fit_rmt_pooling``: the installed ``weights`` (unit norm, length T̂ ≤ the head's table; later
    positions get 0), the estimate it came from, the top eigenvalues of R̂ and α/κ of the installed weights,
    of mean pooling over the same positions and of the weights the head held before (None when it was unfitted)."""

    weights: np.ndarray
    estimate: PositionCorrelationEstimate
    eigenvalues: np.ndarray
    snr_optimal: PoolingSNR
    snr_mean: PoolingSNR
    snr_previous: PoolingSNR | None


def fit_rmt_pooling(model, dataloader, *, states: str | int = "embeddings", max_batches: int | None = None,
                    min_count: int = 2, num_classes: int | None = None) -> RMTPoolingFit:
    """Estimate R̂ from labelled training batches and install its top eigenvector in ``model.pooling``.

    Works for any model whose ``pooling`` attribute is a ``SequencePooling`` in ``rmt_optimal`` mode (it needs
    ``mode == "rmt_optimal"`` and ``set_position_weights``), e.g. ``EGAForSequenceClassification`` built with
    ``classifier_pooling="rmt_optimal"``. The weights are a buffer, so ``save_pretrained`` keeps them. Fitting at
    initialisation and training afterwards, or fitting a trained model, both work; refitting replaces the weights.
    ``states`` chooses the token states R̂ is estimated from (``estimate_position_correlation``; default the input
    embeddings, i.e. the data's R).
    """
    pooling = getattr(model, "pooling", None)
    if pooling is None or not hasattr(pooling, "set_position_weights"):
        raise ValueError(f"{type(model).__name__} has no SequencePooling head (.pooling with set_position_weights)")
    if getattr(pooling, "mode", None) != "rmt_optimal":
        raise ValueError(
            f"{type(model).__name__}.pooling is in {getattr(pooling, 'mode', None)!r} mode; build the model with "
            "classifier_pooling='rmt_optimal' to fit RMT-optimal weights"
        )
    estimate = estimate_position_correlation(model, dataloader, states=states, max_batches=max_batches,
                                             min_count=min_count, num_classes=num_classes)
    T = min(estimate.matrix.shape[0], pooling.max_positions)
    R = estimate.matrix[:T, :T]
    fitted_before = getattr(pooling, "is_fitted", True)
    previous = pooling.position_weights.detach().cpu().double().numpy()[:T] if fitted_before else None
    weights = optimal_pooling_weights(R)
    pooling.set_position_weights(torch.as_tensor(weights, dtype=pooling.position_weights.dtype))
    return RMTPoolingFit(
        weights=weights, estimate=estimate, eigenvalues=np.linalg.eigvalsh(R)[::-1][:5],
        snr_optimal=pooling_snr(weights, R), snr_mean=pooling_snr(mean_pooling_weights(T), R),
        snr_previous=pooling_snr(previous, R) if previous is not None and np.any(previous) else None,
    )


def attention_pooling_report(model, dataloader, correlation=None, *, states: str | int = "embeddings",
                             max_batches: int | None = None) -> list[dict]:
    """α, κ, α/κ of each layer's effective attention weights against R, plus reference poolings.

    ``correlation``: a T×T matrix (e.g. the known R of a synthetic task) or None to estimate it from the same
    labelled batches (``estimate_position_correlation`` with ``states``). Rows: one per tensor of the model's
    ``attentions`` output (``pooling = "attention layer l"``: the l-th tensor, which is layer l of a model whose every
    layer attends, such as GPT-2 or EGA-GPT, but CHIAR-Former's l-th layer that records attention, see its output's
    docstring), then ``mean``, ``optimal``, ``harmonic (strictly causal)`` (for T ≥ 2) and ``harmonic (with self)``
    on the same positions.
    """
    measured = attention_pooling_weights(model, dataloader, max_batches=max_batches)
    if correlation is None:
        correlation = estimate_position_correlation(model, dataloader, states=states, max_batches=max_batches).matrix
    R = validate_correlation_matrix(correlation)
    T = min(R.shape[0], measured.layer_weights.shape[1])
    R = R[:T, :T]
    rows = []
    for index, (w, snr) in enumerate(zip(measured.layer_weights, measured.snr(R))):
        rows.append({"pooling": f"attention layer {index}", "alpha": snr.alpha, "kappa": snr.kappa,
                     "alpha_over_kappa": snr.ratio, "weight_first_quarter": float(w[: max(1, T // 4)].sum() / w[:T].sum())})
    references = {"mean": mean_pooling_weights(T), "optimal": optimal_pooling_weights(R)}
    if T >= 2:
        references["harmonic (strictly causal)"] = harmonic_causal_weights(T)
    references["harmonic (with self)"] = harmonic_causal_weights(T, include_self=True)
    for name, w in references.items():
        snr = pooling_snr(w, R)
        rows.append({"pooling": name, "alpha": snr.alpha, "kappa": snr.kappa, "alpha_over_kappa": snr.ratio,
                     "weight_first_quarter": float(np.abs(w[: max(1, T // 4)]).sum() / np.abs(w).sum())})
    return rows
