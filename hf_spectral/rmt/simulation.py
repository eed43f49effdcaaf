"""Monte-Carlo checks of the theory: draw S, return its spectrum, top eigenvalue and overlap; sweep ρ.

S = (1/N) Σ_n c_n c_nᵀ, uncentred as in SPEC 3.1 (``center=True`` subtracts the sample mean first, which removes
the raw table's common-mean term; for the class-centred table it changes nothing in the limit). Sizes are given as
d with the ratios δ = d/V and γ = d/N; V is rounded to an even integer and N to an integer, and the ratios actually
used are reported.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import warnings

import numpy as np

from . import theory
from .generative import PositionCorrelation, sample_pooled, sample_table, validate_weights
from .pooling import pooling_snr

__all__ = ["SpectrumResult", "problem_sizes", "simulate_spectrum", "ks_distance", "rho_sweep", "summarise_sweep",
           "mu_norm2_for_rho"]


@dataclass
class SpectrumResult:
    """One draw of S.

    Attributes:
        eigenvalues: all d eigenvalues of S, ascending.
        top_eigenvalue: λ₁(S).
        overlap: |û₁ᵀu|², û₁ the top eigenvector of S and u = μ/‖μ‖.
        max_overlap: the largest |ûᵢᵀu|² over the top ``track`` eigenvectors and its index ``max_overlap_rank``
            (0 = top); differs from ``overlap`` when another spike (raw table, uncentred S) sits above the signal.
        rho: ρ = α‖μ‖²_eff/κ with ‖μ‖²_eff = ‖μ‖² (class-centred) or ‖μ‖² + δ (raw table).
        dim, vocab_size, n_samples, delta, gamma, alpha, kappa, mu_norm2, table, center: the draw's settings.
    """

    eigenvalues: np.ndarray = field(repr=False)
    top_eigenvalue: float
    overlap: float
    max_overlap: float
    max_overlap_rank: int
    rho: float
    dim: int
    vocab_size: int
    n_samples: int
    delta: float
    gamma: float
    alpha: float
    kappa: float
    mu_norm2: float
    table: str
    center: bool

    def theory(self) -> dict:
        """The theory's predictions for this draw's δ, γ, κ and ρ (``hf_spectral.rmt.theory``)."""
        return {
            "population_threshold": theory.population_threshold(self.delta),
            "sample_threshold": theory.sample_threshold(self.delta, self.gamma),
            "bulk_edge": theory.bulk_edges(self.delta, self.gamma, self.kappa)[1],
            "top_eigenvalue": float(theory.sample_outlier(self.rho, self.delta, self.gamma, self.kappa)),
            # measured against μ/‖μ‖: a raw table's outlier eigenvector aligns with the effective signal instead
            "overlap": float(theory.sample_overlap(self.rho, self.delta, self.gamma)
                             * theory.signal_overlap_factor(self.mu_norm2, self.delta, self.table)),
            "has_outlier": bool(theory.has_sample_outlier(self.rho, self.delta, self.gamma)),
        }

    def summary(self) -> dict:
        """Scalars only (no eigenvalue array), for result tables."""
        row = {k: v for k, v in asdict(self).items() if k != "eigenvalues"}
        row["second_eigenvalue"] = float(self.eigenvalues[-2]) if self.eigenvalues.size > 1 else float("nan")
        return row


def problem_sizes(dim: int, delta: float, gamma: float) -> tuple[int, int]:
    """(V, N) for d and the ratios: V = d/δ rounded to an even integer ≥ 4, N = d/γ rounded (≥ 1)."""
    if not (isinstance(dim, (int, np.integer)) and dim >= 1):
        raise ValueError(f"dim must be a positive integer, got {dim!r}")
    if not (np.isfinite(delta) and delta > 0 and np.isfinite(gamma) and gamma > 0):
        raise ValueError(f"delta and gamma must be positive and finite for a simulation, got {delta!r}, {gamma!r}")
    vocab = max(4, 2 * int(round(dim / delta / 2)))
    n = max(1, int(round(dim / gamma)))
    if abs(dim / vocab - delta) > 0.05 * delta or abs(dim / n - gamma) > 0.05 * gamma:
        warnings.warn(
            f"at d = {dim} the simulation runs δ = d/V = {dim / vocab:.4g}, γ = d/N = {dim / n:.4g}, not the "
            f"δ = {delta:g}, γ = {gamma:g} asked for (V is rounded to an even integer ≥ 4, N to an integer ≥ 1): "
            "raise dim for ratios this far from 1", stacklevel=2,
        )
    return vocab, n


def mu_norm2_for_rho(rho: float, weights, correlation: PositionCorrelation, delta: float,
                     table: str = "class_centred") -> float:
    """‖μ‖² that gives ρ with these weights: ρκ/α, minus δ for a raw table (ValueError if that is negative)."""
    rho = float(theory._check_rho(rho))
    snr = pooling_snr(weights, correlation.matrix)
    mu2 = rho / snr.ratio - (delta if table == "raw" else 0.0)
    if table not in ("class_centred", "raw"):
        raise ValueError(f"table must be 'class_centred' or 'raw', got {table!r}")
    if mu2 < 0:  # only a raw table's (ρ ≥ 0 is checked above)
        raise ValueError(f"rho = {rho} is below the raw table's floor α/κ·δ = {snr.ratio * delta:.4g}")
    return float(mu2)


def simulate_spectrum(weights, correlation: PositionCorrelation, *, dim: int, delta: float, gamma: float,
                      mu_norm2: float, table: str = "class_centred", center: bool = False, seed=0,
                      track: int = 5) -> SpectrumResult:
    """Draw a table and N = d/γ sequences, pool them with ``weights`` and return the spectrum of S.

    The bulk law and the thresholds depend on the weights only through κ and ρ when the pooled noise mixes several
    positions: with T fixed, weights concentrated on about one position (effective count κ²/Σ w_t⁴ below 2, e.g. a
    one-hot w) pool a single token per sequence, the sequences share those tokens sparsely, and the spectrum departs
    from MP_δ ⊠ MP_γ at any d (a top eigenvalue past the edge without signal). A warning says so."""
    if isinstance(track, bool) or not isinstance(track, (int, np.integer)) or track < 1:
        raise ValueError(f"track must be an integer >= 1 (the top eigenvectors to measure), got {track!r}")
    w = validate_weights(weights, correlation.length)
    effective_positions = float(np.sum(w**2) ** 2 / np.sum(w**4))
    if effective_positions < 2:
        warnings.warn(
            f"the pooling weights are concentrated on {effective_positions:.2f} effective positions (κ²/Σ w⁴ < 2): "
            "the bulk law MP_δ ⊠ MP_γ and its edge do not describe this spectrum; spread the weights over several "
            "positions for the theory's regime", stacklevel=2,
        )
    vocab, n = problem_sizes(dim, delta, gamma)
    rng = np.random.default_rng(seed)
    table_ = sample_table(dim, vocab, mu_norm2, table=table, rng=rng)
    pooled = sample_pooled(table_, correlation, w, n, rng).vectors
    if center:
        pooled = pooled - pooled.mean(axis=0)
    S = pooled.T @ pooled / n
    values, vectors = np.linalg.eigh(S)
    u = table_.signal_direction
    top = vectors[:, ::-1][:, :track].T @ u
    overlaps = top**2
    snr = pooling_snr(w, correlation.matrix)
    delta_used, gamma_used = dim / vocab, dim / n
    rho = theory.snr(snr.alpha, snr.kappa, theory.effective_signal_norm2(mu_norm2, delta_used, table))
    return SpectrumResult(
        eigenvalues=values, top_eigenvalue=float(values[-1]), overlap=float(overlaps[0]),
        max_overlap=float(overlaps.max()), max_overlap_rank=int(overlaps.argmax()), rho=rho, dim=dim,
        vocab_size=vocab, n_samples=n, delta=delta_used, gamma=gamma_used, alpha=snr.alpha, kappa=snr.kappa,
        mu_norm2=float(mu_norm2), table=table, center=center,
    )


def ks_distance(eigenvalues, delta: float, gamma: float, kappa: float = 1.0, exclude_top: int = 0) -> float:
    """Kolmogorov-Smirnov distance sup_λ |F_emp(λ) − F(λ)| between the eigenvalues (minus the ``exclude_top``
    largest, e.g. a predicted outlier) and the bulk law κ(MP_δ ⊠ MP_γ), atom at 0 included. Eigenvalues within
    max(1e-9, 100 ε)·λ_max of 0 count as 0, ε the precision of the eigenvalues' own float type: a float32
    eigensolver leaves the null space at ~1e-7·λ_max, a float64 one at ~1e-15·λ_max."""
    if isinstance(exclude_top, bool) or not isinstance(exclude_top, (int, np.integer)) or exclude_top < 0:
        raise ValueError(f"exclude_top must be an integer >= 0, got {exclude_top!r}")
    given = np.asarray(eigenvalues)
    precision = np.finfo(given.dtype).eps if np.issubdtype(given.dtype, np.floating) else np.finfo(float).eps
    values = np.sort(given.astype(float).ravel())
    if values.size == 0:
        raise ValueError("no eigenvalues given for the KS distance")
    if not np.isfinite(values).all():
        raise ValueError(f"the eigenvalues must be finite; got {int((~np.isfinite(values)).sum())} NaN or infinite")
    # the atom at 0 shows up as round-off of either sign; count those eigenvalues as exactly 0
    zero_tolerance = max(1e-9, 100 * float(precision)) * max(np.abs(values).max(), 1e-300)
    values = np.where(np.abs(values) <= zero_tolerance, 0.0, values)
    if exclude_top:
        values = values[:-exclude_top]
    if values.size == 0:
        raise ValueError(f"no eigenvalues left for the KS distance after excluding the top {exclude_top}")
    # compare the two step/continuous functions at every distinct value x and just below it: F is continuous
    # except for its atom at 0, where F(0⁻) = 0
    points, counts = np.unique(values, return_counts=True)
    F = theory.bulk_cdf(delta, gamma, kappa)(points)
    F_below = np.where(points == 0, 0.0, F)
    emp = np.cumsum(counts) / values.size
    emp_below = emp - counts / values.size
    return float(max(np.abs(emp - F).max(), np.abs(emp_below - F_below).max()))


def rho_sweep(weights, correlation: PositionCorrelation, rhos, *, dim: int, delta: float, gamma: float,
              seeds=(0, 1, 2), table: str = "class_centred", center: bool = False) -> list[dict]:
    """One row per (ρ, seed): measured top eigenvalue / overlap next to the theory's. ‖μ‖² is set per ρ through
    ``mu_norm2_for_rho`` (so ρ is exact for the table convention), eigenvalues in units of the actual κ."""
    w = validate_weights(weights, correlation.length)
    vocab, n = problem_sizes(dim, delta, gamma)
    delta_used = dim / vocab
    rows = []
    for rho in rhos:
        mu2 = mu_norm2_for_rho(rho, w, correlation, delta_used, table)
        for seed in seeds:
            result = simulate_spectrum(w, correlation, dim=dim, delta=delta, gamma=gamma, mu_norm2=mu2, table=table,
                                       center=center, seed=seed)
            predicted = result.theory()
            rows.append({
                "rho": result.rho, "seed": seed, "dim": dim, "delta": result.delta, "gamma": result.gamma,
                "kappa": result.kappa,
                "top_eigenvalue": result.top_eigenvalue, "second_eigenvalue": float(result.eigenvalues[-2]),
                "overlap": result.overlap,
                "theory_top_eigenvalue": predicted["top_eigenvalue"], "theory_overlap": predicted["overlap"],
                "theory_has_outlier": predicted["has_outlier"], "bulk_edge": predicted["bulk_edge"],
            })
    return rows


def summarise_sweep(rows: list[dict]) -> list[dict]:
    """Group ``rho_sweep`` rows by ρ: mean and standard deviation over seeds and relative errors vs theory."""
    out = []
    for rho in sorted({row["rho"] for row in rows}):
        group = [row for row in rows if row["rho"] == rho]
        top = np.array([row["top_eigenvalue"] for row in group])
        ov = np.array([row["overlap"] for row in group])
        first = group[0]
        th_top, th_ov = first["theory_top_eigenvalue"], first["theory_overlap"]
        out.append({
            "rho": rho, "seeds": len(group), "dim": first["dim"], "delta": first["delta"], "gamma": first["gamma"],
            "kappa": first["kappa"],
            "top_mean": float(top.mean()), "top_std": float(top.std(ddof=1)) if len(group) > 1 else 0.0,
            "theory_top": th_top, "top_rel_error": float(abs(top.mean() - th_top) / th_top),
            "overlap_mean": float(ov.mean()), "overlap_std": float(ov.std(ddof=1)) if len(group) > 1 else 0.0,
            "theory_overlap": th_ov,
            "overlap_rel_error": float(abs(ov.mean() - th_ov) / th_ov) if th_ov > 0 else float("nan"),
            "theory_has_outlier": first["theory_has_outlier"], "bulk_edge": first["bulk_edge"],
        })
    return out
