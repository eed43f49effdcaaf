"""Pooling weights and their signal-to-noise figures α = wᵀRw, κ = ‖w‖² (SPEC 3.1-3.2).

α/κ is invariant to rescaling w, so each function states its own normalisation; positions are 0-based in code
(t = 0..T−1) and 1-based in the formulas (t = 1..T), as in the SPEC.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.special import softmax

from .generative import validate_correlation_matrix, validate_weights

__all__ = [
    "mean_pooling_weights",
    "harmonic_causal_weights",
    "causal_attention_limit_weights",
    "optimal_pooling_weights",
    "PoolingSNR",
    "pooling_snr",
    "parameter_free_causal_attention",
]


def _check_length(T, minimum=1):
    if not (isinstance(T, (int, np.integer)) and T >= minimum):
        raise ValueError(f"sequence length T must be an integer >= {minimum}, got {T!r}")


def mean_pooling_weights(T: int) -> np.ndarray:
    """w_t = 1/T (sums to 1)."""
    _check_length(T)
    return np.full(T, 1.0 / T)


def _harmonic(n):
    """H_0..H_n as an array (H_0 = 0)."""
    return np.concatenate([[0.0], np.cumsum(1.0 / np.arange(1, n + 1))])


def harmonic_causal_weights(T: int, include_self: bool = False) -> np.ndarray:
    """Limit of parameter-free causal self-attention averaged over queries (SPEC 3.2), normalised to sum 1.

    * ``include_self=False`` (the paper's convention): query i attends uniformly to its strictly earlier keys
      j < i; averaging over the T − 1 queries that have one gives w_t ∝ H_{T−1} − H_{t−1}, so w_T = 0. T ≥ 2.
    * ``include_self=True``: query i attends uniformly to keys j ≤ i (all T queries): w_t ∝ H_T − H_{t−1}. This is
      the τ → 0 case of ``causal_attention_limit_weights``; with τ > 0 the self key weighs e^τ, not 1.
    """
    _check_length(T, 1 if include_self else 2)
    H = _harmonic(T)
    t = np.arange(1, T + 1)
    w = (H[T] if include_self else H[T - 1]) - H[t - 1]
    return w / w.sum()


def causal_attention_limit_weights(T: int, tau: float = 0.0, include_self: bool = True) -> np.ndarray:
    """Large-d limit of causal attention with scores τ XᵢᵀXⱼ/d, averaged over queries, normalised to sum 1.

    For tokens of the generative model with ‖μ‖² = o(d), τXᵢᵀXⱼ/d → 0 for distinct tokens and → τ for the self
    score (‖X_i‖²/d → 1), so query i puts e^τ/(e^τ + i − 1) on itself and 1/(e^τ + i − 1) on each earlier key.
    ``include_self=False`` gives ``harmonic_causal_weights(T)`` for every τ; τ = 0 with the self key gives
    ``harmonic_causal_weights(T, include_self=True)``.
    """
    if not include_self:
        return harmonic_causal_weights(T, include_self=False)
    _check_length(T)
    if not np.isfinite(tau):
        raise ValueError(f"tau must be finite, got {tau!r}")
    earlier = np.arange(T, dtype=float)  # query i (1-based) has i − 1 earlier keys
    # Query i puts e^τ/(e^τ + i − 1) on itself and 1/(e^τ + i − 1) on each earlier key, written so that no e^±τ
    # overflows (|τ| up to the float range): divided through by e^τ for τ ≥ 0.
    if tau >= 0:
        scale = np.exp(-tau)  # ≤ 1
        own, per_query_other = 1.0 / (1.0 + earlier * scale), scale / (1.0 + earlier * scale)
    else:
        scale = np.exp(tau)  # < 1, possibly 0
        with np.errstate(divide="ignore", invalid="ignore"):
            own = np.where(earlier == 0, 1.0, scale / (scale + earlier))
            per_query_other = np.where(earlier == 0, 0.0, 1.0 / (scale + earlier))
    # key t gets its own query's share and 1/(e^τ + i − 1) from every later query i
    tail = np.concatenate([np.cumsum(per_query_other[::-1])[::-1][1:], [0.0]])
    w = own + tail
    return w / w.sum()


def optimal_pooling_weights(R) -> np.ndarray:
    """w* = unit top eigenvector of R (maximises the Rayleigh quotient α/κ = wᵀRw/‖w‖², giving λ_max(R)).

    Sign fixed so that Σ_t w_t ≥ 0. When λ_max(R) is degenerate (e.g. R = I) every unit vector of its eigenspace
    is optimal and the one returned is arbitrary. Raises ValueError if R is not a correlation matrix.
    """
    R = validate_correlation_matrix(R)
    values, vectors = np.linalg.eigh(R)
    top = vectors[:, -1]
    return top if top.sum() >= 0 else -top


@dataclass(frozen=True)
class PoolingSNR:
    """``alpha`` = wᵀRw (pooled signal variance per unit ‖μ‖²), ``kappa`` = ‖w‖² (noise scale), ``ratio`` = α/κ;
    ρ = ratio · ‖μ‖²."""

    alpha: float
    kappa: float
    ratio: float

    def rho(self, mu_norm2: float) -> float:
        return self.ratio * float(mu_norm2)


def pooling_snr(w, R) -> PoolingSNR:
    """α, κ and α/κ of weights w (length T) against a correlation matrix R (T×T, validated)."""
    R = validate_correlation_matrix(R)
    w = validate_weights(w, R.shape[0])
    alpha, kappa = float(w @ R @ w), float(w @ w)
    return PoolingSNR(alpha, kappa, alpha / kappa)


def parameter_free_causal_attention(X, tau: float = 1.0, include_self: bool = False) -> np.ndarray:
    """Measured pooling weights of parameter-free causal self-attention on token embeddings X (n, T, d).

    Scores s_ij = τ XᵢᵀXⱼ / d (queries = keys = values = X, no parameters); keys j < i (``include_self=False``)
    or j ≤ i. Each query's softmax row is averaged over the queries that have at least one key and over the n
    sequences, giving weights that sum to 1 (compare with ``causal_attention_limit_weights``).
    """
    X = np.asarray(X, dtype=float)
    if X.ndim != 3 or X.shape[1] < (1 if include_self else 2):
        raise ValueError(f"X must be (n, T, d) with T >= {1 if include_self else 2}, got shape {X.shape}")
    n, T, d = X.shape
    scores = tau * np.einsum("nid,njd->nij", X, X) / d
    allowed = np.tril(np.ones((T, T), bool), k=0 if include_self else -1)
    queries = allowed.any(axis=1)
    scores = np.where(allowed, scores, -np.inf)[:, queries]
    probs = softmax(scores, axis=-1)
    w = probs.mean(axis=(0, 1))
    return w / w.sum()
