"""Figures of the reproduction: spectrum vs theory, overlap vs ρ, accuracy vs ρ.

Built on ``matplotlib.figure.Figure`` (no pyplot state, no backend choice), so they work headless; each function
returns the figure and saves it when ``path`` is given.
"""

from __future__ import annotations

import numpy as np

from ..dependencies import require

require("matplotlib", extra="rmt", feature="hf_spectral.rmt.plots")
from matplotlib.figure import Figure  # noqa: E402

from . import theory  # noqa: E402

__all__ = ["plot_spectrum", "plot_overlap_sweep", "plot_accuracy", "plot_pooling_weights"]

POOLING_COLORS = {"mean": "tab:gray", "causal": "tab:blue", "optimal": "tab:red"}


def _save(fig: Figure, path: str | None) -> Figure:
    if path:
        fig.savefig(path, dpi=130, bbox_inches="tight")
    return fig


def plot_spectrum(eigenvalues, delta: float, gamma: float, kappa: float = 1.0, rho: float | None = None,
                  bins: int = 80, title: str | None = None, path: str | None = None) -> Figure:
    """Histogram of the non-zero eigenvalues of S (as a density of all d eigenvalues) with the theoretical bulk
    density of κ(MP_δ ⊠ MP_γ); with ``rho``, the predicted outlier (or "no outlier") is marked."""
    values = np.asarray(eigenvalues, dtype=float)
    lower, upper = theory.bulk_edges(delta, gamma, kappa)
    nonzero = values[np.abs(values) > 1e-9 * np.abs(values).max()]
    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.add_subplot()
    # weights make the bars integrate to the non-zero fraction, like the theoretical continuous part
    bin_width = (nonzero.max() - nonzero.min()) / bins
    ax.hist(nonzero, bins=bins, weights=np.full(nonzero.size, 1.0 / (values.size * bin_width)), color="tab:blue",
            alpha=0.45, label=f"eigenvalues of S (d = {values.size})")
    grid = np.linspace(lower, upper, 800)
    ax.plot(grid, theory.bulk_density(grid, delta, gamma, kappa), color="black", lw=1.5,
            label=r"$\kappa\,(\mathrm{MP}_\delta \boxtimes \mathrm{MP}_\gamma)$ density")
    if rho is not None:
        if theory.has_sample_outlier(rho, delta, gamma):
            location = float(theory.sample_outlier(rho, delta, gamma, kappa))
            ax.axvline(location, color="tab:red", ls="--", label=f"predicted outlier {location:.3g}")
        else:
            ax.axvline(upper, color="tab:red", ls=":", label="no outlier predicted (bulk edge)")
        top = values.max()
        ax.plot([top], [0], marker="v", color="tab:red", ms=9, clip_on=False, label=f"measured top {top:.3g}")
    ax.set_xlabel(r"eigenvalue $\lambda$")
    ax.set_ylabel("density")
    ax.set_title(title or rf"$\delta$ = {delta:.3g}, $\gamma$ = {gamma:.3g}" + (rf", $\rho$ = {rho:.3g}" if rho else ""))
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_overlap_sweep(summary: list[dict], delta: float, gamma: float, title: str | None = None,
                       path: str | None = None) -> Figure:
    """Left: |ûᵀu|² vs ρ, theory curve (sample and population) and simulated means ± one standard deviation over
    seeds (``simulation.summarise_sweep`` rows); right: top eigenvalue / κ vs ρ with the bulk edge. Both
    thresholds are marked."""
    rhos = np.array([row["rho"] for row in summary])
    grid = np.linspace(0.0, max(rhos.max() * 1.05, theory.sample_threshold(delta, gamma) * 1.5), 600)
    population, sample = theory.population_threshold(delta), theory.sample_threshold(delta, gamma)
    fig = Figure(figsize=(11, 4.2))
    left, right = fig.subplots(1, 2)
    left.plot(grid, theory.sample_overlap(grid, delta, gamma), color="black", label=r"theory $|\hat u_S^\top u|^2$")
    left.plot(grid, theory.population_overlap(grid, delta), color="gray", ls="--", label="theory, population")
    left.errorbar(rhos, [row["overlap_mean"] for row in summary], yerr=[row["overlap_std"] for row in summary],
                  fmt="o", color="tab:red", ms=4, capsize=3, label=f"simulation (mean ± sd, {summary[0]['seeds']} seeds)")
    right.plot(grid[1:], theory.sample_outlier(grid[1:], delta, gamma), color="black", label=r"theory $\lambda_1/\kappa$")
    right.errorbar(rhos, [row["top_mean"] / _kappa(row) for row in summary],
                   yerr=[row["top_std"] / _kappa(row) for row in summary], fmt="o", color="tab:red", ms=4, capsize=3,
                   label="simulation")
    right.axhline(theory.bulk_edges(delta, gamma)[1], color="gray", ls=":", label="bulk edge")
    for ax in (left, right):
        ax.axvline(population, color="tab:green", ls="--", lw=1,
                   label=r"population threshold $\delta+\sqrt{\delta}$" + f" = {population:.3g}")
        ax.axvline(sample, color="tab:purple", ls="--", lw=1, label=f"sample threshold = {sample:.3g}")
        ax.set_xlabel(r"$\rho = \alpha\|\mu\|^2/\kappa$")
        ax.legend(fontsize=7)
    left.set_ylabel("overlap")
    right.set_ylabel(r"top eigenvalue / $\kappa$")
    fig.suptitle(title or rf"d = {summary[0]['dim']}, $\delta$ = {delta:.3g}, $\gamma$ = {gamma:.3g}")
    return _save(fig, path)


def _kappa(row):
    return row.get("kappa", 1.0)


def plot_accuracy(summary: list[dict], title: str | None = None, path: str | None = None) -> Figure:
    """Ridge test accuracy (mean ± s.e.m. over seeds, ``downstream.summarise_accuracy`` rows) for each pooling,
    against ‖μ‖² (left: same data, same signal) and against the pooling's own ρ = α‖μ‖²/κ (right)."""
    fig = Figure(figsize=(11, 4.2))
    left, right = fig.subplots(1, 2)
    for name in dict.fromkeys(row["pooling"] for row in summary):
        rows = sorted((row for row in summary if row["pooling"] == name), key=lambda row: row["mu_norm2"])
        label = f"{name} (α/κ = {rows[0]['alpha_over_kappa']:.3g})"
        for ax, key in ((left, "mu_norm2"), (right, "rho")):
            ax.errorbar([row[key] for row in rows], [row["accuracy_mean"] for row in rows],
                        yerr=[row["accuracy_sem"] for row in rows], fmt="o-", ms=4, capsize=3,
                        color=POOLING_COLORS.get(name), label=label)
    left.set_xlabel(r"$\|\mu\|^2$")
    right.set_xlabel(r"$\rho = \alpha\|\mu\|^2/\kappa$ of each pooling")
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_ylabel("ridge test accuracy")
        ax.legend(fontsize=8)
    fig.suptitle(title or "ridge classification of pooled sequences")
    return _save(fig, path)


def plot_pooling_weights(weights: dict, title: str | None = None, path: str | None = None) -> Figure:
    """Pooling weight profiles (name -> weights over positions), each rescaled so that its absolute values sum to 1
    (weights of both signs, such as an eigenvector's, may sum to 0), on one axis; e.g. the effective weights of a
    model's attention layers next to the harmonic and the fitted RMT-optimal weights."""
    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.add_subplot()
    for name, w in weights.items():
        w = np.asarray(w, dtype=float)
        scale = np.abs(w).sum()
        ax.plot(np.arange(1, w.size + 1), w / scale if scale > 0 else w, marker=".", label=name,
                color=POOLING_COLORS.get(name))
    ax.set_xlabel("position t")
    ax.set_ylabel(r"weight $w_t$ (|w| sums to 1)")
    ax.set_title(title or "pooling weights")
    ax.legend(fontsize=8)
    return _save(fig, path)
