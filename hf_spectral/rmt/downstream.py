"""Downstream check of SPEC 3.2: ridge classification of pooled sequences, one pooling against another.

Task: the label of a sequence is y = sign(u_Rᵀξ) (``PositionCorrelation.labels``; for the prefix model, the shared
sign of the first L positions). Each pooling's vector c = Σ_t w_t e_{v_t} is computed with w rescaled to ‖w‖ = 1
(κ = 1, so the noise level and the ridge grid are the same for every pooling and only α differs). A ridge
regression of y on the training vectors (centred with the training mean, no penalty on the intercept) is fitted
with its penalty chosen on a held-out part of the training set, refitted on the whole training set and scored by
test accuracy of sign(prediction). Every pooling sees the same table, sequences and tokens for a given seed, so the
comparison is paired.
"""

from __future__ import annotations

import numpy as np

from . import theory
from .generative import PositionCorrelation, pool_tokens, sample_table, sample_tokens, validate_weights
from .pooling import pooling_snr
from .simulation import problem_sizes

__all__ = ["ridge_fit", "ridge_accuracy", "ridge_pooling_experiment", "summarise_accuracy"]

DEFAULT_RIDGES = tuple(np.logspace(-3, 2, 11))


def ridge_fit(X: np.ndarray, y: np.ndarray, ridge: float) -> tuple[np.ndarray, float]:
    """(β, b) minimising ‖Xβ + b − y‖²/n + ridge·‖β‖² (intercept unpenalised); X (n, d), y (n,)."""
    X = np.asarray(X, dtype=float)
    y = np.asarray(y, dtype=float)
    if X.ndim != 2 or y.shape != (X.shape[0],):
        raise ValueError(f"X must be (n, d) and y (n,), got {X.shape} and {y.shape}")
    if not ridge > 0:
        raise ValueError(f"ridge must be positive, got {ridge!r}")
    n, d = X.shape
    mean_x, mean_y = X.mean(axis=0), y.mean()
    Xc = X - mean_x
    if d <= n:
        beta = np.linalg.solve(Xc.T @ Xc / n + ridge * np.eye(d), Xc.T @ (y - mean_y) / n)
    else:  # the n×n dual system is cheaper when d > n
        beta = Xc.T @ np.linalg.solve(Xc @ Xc.T / n + ridge * np.eye(n), (y - mean_y) / n)
    return beta, float(mean_y - mean_x @ beta)


def ridge_accuracy(X_train, y_train, X_test, y_test, ridges=DEFAULT_RIDGES, validation_fraction: float = 0.25,
                   rng=None) -> tuple[float, float]:
    """Test accuracy of sign(ridge prediction) and the penalty chosen on a random validation split."""
    rng = np.random.default_rng(rng)
    n = len(y_train)
    if not 0 < validation_fraction < 1 or int(n * validation_fraction) < 1:
        raise ValueError(f"validation_fraction must leave both parts non-empty, got {validation_fraction!r}")
    order = rng.permutation(n)
    held, fit = order[: int(n * validation_fraction)], order[int(n * validation_fraction):]
    scores = []
    for ridge in ridges:
        beta, b = ridge_fit(X_train[fit], y_train[fit], ridge)
        scores.append(np.mean(np.sign(X_train[held] @ beta + b) == y_train[held]))
    best = float(ridges[int(np.argmax(scores))])
    beta, b = ridge_fit(X_train, y_train, best)
    return float(np.mean(np.sign(X_test @ beta + b) == y_test)), best


def ridge_pooling_experiment(poolings: dict, correlation: PositionCorrelation, mu_norm2s, *, dim: int,
                             delta: float, gamma: float, n_test: int, seeds=(0, 1, 2),
                             table: str = "class_centred", ridges=DEFAULT_RIDGES) -> list[dict]:
    """One row per (seed, ‖μ‖², pooling): accuracy, chosen penalty and the pooling's α/κ and ρ.

    ``poolings`` maps a name to weights of length T; N_train = d/γ, V = d/δ (``problem_sizes``).
    """
    if not poolings:
        raise ValueError("poolings is empty")
    weights = {name: validate_weights(w, correlation.length, name=name) for name, w in poolings.items()}
    weights = {name: w / np.linalg.norm(w) for name, w in weights.items()}
    snrs = {name: pooling_snr(w, correlation.matrix) for name, w in weights.items()}
    vocab, n_train = problem_sizes(dim, delta, gamma)
    rows = []
    for seed in seeds:
        for mu2 in mu_norm2s:
            # same noise table, direction, sequences and tokens for every ‖μ‖² and pooling of this seed
            rng = np.random.default_rng(seed)
            table_ = sample_table(dim, vocab, mu2, table=table, rng=rng)
            signs = correlation.sample_signs(n_train + n_test, rng)
            tokens = sample_tokens(table_, signs, rng)
            labels = correlation.labels(signs)
            for name, w in weights.items():
                pooled = pool_tokens(table_, tokens, w)
                accuracy, ridge = ridge_accuracy(pooled[:n_train], labels[:n_train], pooled[n_train:],
                                                 labels[n_train:], ridges, rng=seed)
                rows.append({
                    "pooling": name, "seed": seed, "mu_norm2": float(mu2), "alpha_over_kappa": snrs[name].ratio,
                    "rho": theory.snr(snrs[name].alpha, snrs[name].kappa,
                                      theory.effective_signal_norm2(mu2, dim / vocab, table)),
                    "accuracy": accuracy, "ridge": ridge, "dim": dim, "n_train": n_train, "n_test": n_test,
                    "vocab_size": vocab,
                })
    return rows


def summarise_accuracy(rows: list[dict]) -> list[dict]:
    """Mean accuracy and its standard error over seeds, per (pooling, ‖μ‖²)."""
    out = []
    keys = sorted({(row["mu_norm2"], row["pooling"]) for row in rows})
    for mu2, name in keys:
        group = [row for row in rows if row["mu_norm2"] == mu2 and row["pooling"] == name]
        acc = np.array([row["accuracy"] for row in group])
        out.append({
            "pooling": name, "mu_norm2": mu2, "rho": group[0]["rho"], "alpha_over_kappa": group[0]["alpha_over_kappa"],
            "seeds": len(group), "accuracy_mean": float(acc.mean()),
            "accuracy_sem": float(acc.std(ddof=1) / np.sqrt(len(acc))) if len(acc) > 1 else 0.0,
        })
    return out
