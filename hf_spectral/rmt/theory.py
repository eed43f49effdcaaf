"""Closed forms for the spectrum of the pooled sample covariance S (SPEC 3.1-3.2).

Conventions used by every function here:

* ``delta = d / V`` (dimension over vocabulary size), ``gamma = d / N`` (dimension over number of sequences).
* ``kappa = ‖w‖²`` (noise scale of the pooling weights) and ``rho = α ‖μ‖² / κ`` with ``α = wᵀRw``; eigenvalues
  scale with κ, every other quantity is scale-free.
* **Class-centred table.** The formulas are exact (in the limit) for a table whose noise vectors have zero mean
  within each sign class. With a raw Gaussian table the class means of the noise add ≈ δ to the signal, so pass
  ``rho`` computed from ``‖μ‖² + δ`` instead (``effective_signal_norm2``); the outlier eigenvector then aligns
  with μ + (z̄₊ − z̄₋)/2, so its overlap with μ/‖μ‖ is ``sample_overlap`` × ``signal_overlap_factor``; and the raw
  table's common mean adds an unrelated rank-one term to the uncentred S (see ``hf_spectral.rmt.generative``).
* ``s = rho − delta`` is the shifted SNR that every outlier formula is written in.

Bulk: κ · (MP_δ ⊠ MP_γ). Its Stieltjes transform m(x) = ∫ dμ(t) / (t − x) at x = λ/κ solves the cubic
m (1 − δ − δxm)(1 − γ − γxm) − xm − 1 = 0 (MP_δ as population spectrum fed through the Marchenko-Pastur
equation with ratio γ), and the density is Im m(λ/κ + i0) / (πκ). Outliers come from Bai-Yao's ψ map applied
to the population spike of MP_δ + ρ uuᵀ; see ``sample_outlier``.
"""

from __future__ import annotations

import numpy as np
from numpy.polynomial import Polynomial

__all__ = [
    "stieltjes_transform",
    "bulk_density",
    "bulk_support",
    "bulk_edges",
    "bulk_atom_at_zero",
    "bulk_cdf",
    "population_threshold",
    "sample_threshold",
    "population_outlier",
    "population_overlap",
    "sample_outlier",
    "sample_overlap",
    "has_population_outlier",
    "has_sample_outlier",
    "effective_signal_norm2",
    "signal_overlap_factor",
    "snr",
]


def _check_ratios(delta, gamma=None):
    for name, value in (("delta", delta), ("gamma", gamma)):
        if value is not None and not (np.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite ratio >= 0, got {value!r}")


def _check_rho(rho) -> np.ndarray:
    """ρ as a float array; NaN or a negative ρ would otherwise fall through the threshold tests to the bulk."""
    rho = np.asarray(rho, dtype=float)
    if not np.all(np.isfinite(rho) & (rho >= 0)):
        raise ValueError(f"rho must be finite and >= 0, got {rho!r}")
    return rho


def _check_kappa(kappa):
    if not (np.isfinite(kappa) and kappa > 0):
        raise ValueError(f"kappa = ‖w‖² must be positive and finite, got {kappa!r}")


def _cubic_coefficients(x, delta, gamma):
    """Coefficients (highest first) in m of m(1 − δ − δxm)(1 − γ − γxm) − xm − 1, for each x (complex ok)."""
    x = np.asarray(x)
    a3 = delta * gamma * x**2
    a2 = -x * (gamma + delta - 2 * gamma * delta)
    a1 = (1 - delta) * (1 - gamma) - x
    a0 = -np.ones_like(x)
    return np.stack(np.broadcast_arrays(a3, a2, a1, a0), axis=-1)


def _roots(coefficients):
    """Roots of each row's cubic (highest degree first), NaN-padded where the leading coefficients vanish.

    Rows with a cubic coefficient go through one batched companion-matrix eigenvalue call, quadratics (δγ = 0: the
    Marchenko-Pastur equation) through the quadratic formula, the rest (x = 0) through ``np.roots``. A cubic
    coefficient with |a₃| < 1e-10 a₂² counts as 0 (δγ → 0; the ratio δγ/(γ + δ − 2γδ)² does not depend on x): its
    third root, of size ~1/(δγx), carries no mass, and in the companion matrix it would swamp the other two with its
    round-off. (A test relative to all the coefficients would also drop the cubic near x = 0, where an atom at 0
    makes every root grow like 1/x.)
    """
    coefficients = np.asarray(coefficients, dtype=complex)
    flat = coefficients.reshape(-1, 4)
    out = np.full((flat.shape[0], 3), np.nan + 0j)
    cubic = np.abs(flat[:, 0]) > np.maximum(1e-10 * np.abs(flat[:, 1]) ** 2, 1e-300)
    if cubic.any():
        monic = flat[cubic, 1:] / flat[cubic, :1]
        companion = np.zeros((monic.shape[0], 3, 3), dtype=complex)
        companion[:, 0, :] = -monic
        companion[:, 1, 0] = companion[:, 2, 1] = 1.0
        out[cubic] = np.linalg.eigvals(companion)
    quadratic = ~cubic & (np.abs(flat[:, 1]) > 1e-300)
    if quadratic.any():
        a, b, c = flat[quadratic, 1], flat[quadratic, 2], flat[quadratic, 3]
        root = np.sqrt(b * b - 4 * a * c)
        out[quadratic, 0], out[quadratic, 1] = (-b + root) / (2 * a), (-b - root) / (2 * a)
    for index in np.flatnonzero(~cubic & ~quadratic):
        r = np.roots(flat[index])
        out[index, : r.size] = r
    return out.reshape(coefficients.shape[:-1] + (3,))


def _pick_stieltjes_branch(z, roots):
    """The root that is a Stieltjes transform of a measure on [0, ∞): Im m > 0 and Im(z m) ≥ 0 for Im z > 0
    (Krein-Nudelman); where several roots pass, the one reached by continuation from far up the imaginary axis
    (where m ≈ −1/z) along z + i·y, y decreasing geometrically."""
    valid = (roots.imag > 0) & ((z[..., None] * roots).imag > -1e-12 * np.abs(z[..., None] * roots))
    count = valid.sum(-1)
    pick = np.argmax(valid, axis=-1)
    out = np.take_along_axis(roots, pick[..., None], axis=-1)[..., 0]
    return out, count != 1


def stieltjes_transform(z, delta: float, gamma: float) -> np.ndarray:
    """Stieltjes transform m(z) = ∫ dμ(t)/(t − z) of MP_δ ⊠ MP_γ (unit scale, κ = 1) at complex z, Im z > 0.

    m is the root of the cubic that maps the upper half plane into itself with Im(z m) ≥ 0 (the conditions for a
    measure on [0, ∞)); ambiguous points are resolved by continuation from z + 10³ i, where m ≈ −1/z.
    """
    _check_ratios(delta, gamma)
    shape = np.shape(z)  # a scalar z gives a 0-d array back
    z = np.atleast_1d(np.asarray(z, dtype=complex))
    if np.any(z.imag <= 0):
        raise ValueError("stieltjes_transform needs Im z > 0; use bulk_density for the real axis")
    m, ambiguous = _pick_stieltjes_branch(z, _roots(_cubic_coefficients(z, delta, gamma)))
    for index in zip(*np.nonzero(ambiguous)):
        point = z[index]
        previous = -1.0 / (point + 1e3j)
        for lift in np.geomspace(1e3, 1e-12, 120):
            candidates = _roots(_cubic_coefficients(np.array([point + 1j * lift]), delta, gamma))[0]
            candidates = candidates[~np.isnan(candidates)]
            previous = candidates[np.argmin(np.abs(candidates - previous))]
        m[index] = previous
    return m.reshape(shape)


def bulk_atom_at_zero(delta: float, gamma: float) -> float:
    """Mass of MP_δ ⊠ MP_γ at 0: S = Z A Zᵀ has rank ≤ min(d, V, N), so max(0, 1 − 1/δ, 1 − 1/γ)."""
    _check_ratios(delta, gamma)
    return max(0.0, 1 - 1 / delta if delta > 0 else 0.0, 1 - 1 / gamma if gamma > 0 else 0.0)


def _discriminant_polynomial(delta, gamma):
    """Discriminant (in m) of the cubic, as a polynomial in x: its sign changes at the bulk edges."""
    x = Polynomial([0, 1])
    a = delta * gamma * x**2
    b = -(gamma + delta - 2 * gamma * delta) * x
    c = (1 - delta) * (1 - gamma) - x
    d = Polynomial([-1])
    if delta * gamma == 0:  # the cubic degenerates to the Marchenko-Pastur quadratic b m² + c m + d
        return c * c - 4 * b * d
    return 18 * a * b * c * d - 4 * b**3 * d + b**2 * c**2 - 4 * a * c**3 - 27 * a**2 * d**2


def bulk_support(delta: float, gamma: float, kappa: float = 1.0) -> list[tuple[float, float]]:
    """Intervals [λ₋, λ₊] (in λ, i.e. scaled by κ) where the continuous part of κ(MP_δ ⊠ MP_γ) has density.

    Edges are the positive real zeros of the cubic's discriminant; an interval belongs to the support where the
    cubic has a complex root pair (discriminant < 0). The atom at 0 (``bulk_atom_at_zero``) is not included.
    """
    _check_ratios(delta, gamma)
    _check_kappa(kappa)
    if delta == 0 and gamma == 0:
        return [(kappa, kappa)]  # both laws are δ₁: S = κ I
    disc = _discriminant_polynomial(delta, gamma)
    zeros = disc.roots()
    real = np.sort(zeros[(np.abs(zeros.imag) < 1e-9 * (1 + np.abs(zeros.real))) & (zeros.real > 1e-12)].real)
    candidates = np.concatenate([[0.0], real])
    intervals = []
    for lo, hi in zip(candidates[:-1], candidates[1:]):
        if hi - lo > 1e-12 and disc((lo + hi) / 2) < 0:
            if intervals and abs(intervals[-1][1] - lo) < 1e-12:
                intervals[-1] = (intervals[-1][0], hi)
            else:
                intervals.append((lo, hi))
    if not intervals:
        raise RuntimeError(f"no bulk support found for delta={delta}, gamma={gamma}")  # pragma: no cover
    return [(kappa * lo, kappa * hi) for lo, hi in intervals]


def bulk_edges(delta: float, gamma: float, kappa: float = 1.0) -> tuple[float, float]:
    """(lower, upper) edge of the bulk κ(MP_δ ⊠ MP_γ), ignoring the atom at 0. The lower edge is 0 (a hard
    edge where the density diverges) when the smallest of d, V, N is tied: δ = 1 with γ ≤ 1, γ = 1 with δ ≤ 1,
    or δ = γ ≥ 1."""
    support = bulk_support(delta, gamma, kappa)
    return support[0][0], support[-1][1]


def bulk_density(lam, delta: float, gamma: float, kappa: float = 1.0) -> np.ndarray:
    """Density f(λ) = Im m(λ/κ + i0) / (πκ) of the continuous part of κ(MP_δ ⊠ MP_γ) at real λ (any shape).

    Integrates to 1 − ``bulk_atom_at_zero(delta, gamma)``; zero outside ``bulk_support``.
    """
    _check_ratios(delta, gamma)
    _check_kappa(kappa)
    lam = np.asarray(lam, dtype=float)
    x = lam / kappa
    if delta == 0 and gamma == 0:
        raise ValueError("delta = gamma = 0: the bulk is a point mass at κ, it has no density")
    roots = _roots(_cubic_coefficients(x.astype(complex), delta, gamma))
    # on the real axis inside the support the cubic has exactly one complex-conjugate pair: Im m(x + i0) > 0
    imag = np.nanmax(np.where(np.isnan(roots), 0.0, roots.imag), axis=-1)
    # outside the support all three roots are real up to round-off, relative to the pair's size (the median: as
    # δγ → 0 the third root grows like 1/(δγx) and would hide a real density)
    imag = np.where(imag > 1e-9 * (1 + np.median(np.abs(np.nan_to_num(roots)), axis=-1)), imag, 0.0)
    inside = np.zeros_like(x, dtype=bool)
    for lo, hi in bulk_support(delta, gamma):
        inside |= (x >= lo) & (x <= hi)
    return np.where(inside & (x > 0), imag, 0.0) / (np.pi * kappa)


def bulk_cdf(delta: float, gamma: float, kappa: float = 1.0, points: int = 4001):
    """Distribution function F(λ) of κ(MP_δ ⊠ MP_γ), atom at 0 included, as a callable.

    The density is integrated on a grid clustered at each support edge (x = a + (b − a)(1 − cos θ)/2), where it
    vanishes like a square root or diverges at a hard edge; the continuous part is rescaled to its exact mass
    1 − atom so that quadrature error does not shift the KS distance.
    """
    atom = bulk_atom_at_zero(delta, gamma)
    grids, masses = [], []
    for lo, hi in bulk_support(delta, gamma, kappa):
        theta = np.linspace(0.0, np.pi, points)
        grid = lo + (hi - lo) * (1 - np.cos(theta)) / 2
        dens = bulk_density(grid, delta, gamma, kappa)
        # a divergent hard edge at 0: use the neighbouring value there (integrable singularity)
        dens[~np.isfinite(dens)] = 0.0
        cumulative = np.concatenate([[0.0], np.cumsum(np.diff(grid) * (dens[1:] + dens[:-1]) / 2)])
        grids.append(grid)
        masses.append(cumulative)
    total = sum(m[-1] for m in masses)
    offsets = np.cumsum([0.0] + [m[-1] for m in masses])
    grid = np.concatenate(grids)
    values = np.concatenate([atom + (1 - atom) * (off + m) / total for off, m in zip(offsets, masses)])

    def cdf(lam):
        lam = np.asarray(lam, dtype=float)
        out = np.interp(lam, grid, values, left=atom, right=1.0)
        return np.where(lam < 0, 0.0, out)

    cdf.continuous_mass = total  # the quadrature's own mass, a check on the density (should be 1 − atom)
    return cdf


# ----------------------------------------------------------------------------------------------------------------
# Outliers
# ----------------------------------------------------------------------------------------------------------------


def population_threshold(delta: float) -> float:
    """ρ above which the population covariance κ(C + ρ uuᵀ), C ~ MP_δ, has an outlier: δ + √δ."""
    _check_ratios(delta)
    return delta + np.sqrt(delta)


def _sample_cubic(s, delta, gamma):
    return s**3 - (gamma + delta + gamma * delta) * s - 2 * gamma * delta


def sample_threshold(delta: float, gamma: float) -> float:
    """ρ above which the sample covariance S has an outlier: δ + s*, s* the largest root of
    s³ − (γ + δ + γδ)s − 2γδ (always ≥ the population threshold; δ = 0 gives BBP's √γ)."""
    _check_ratios(delta, gamma)
    roots = np.roots([1.0, 0.0, -(gamma + delta + gamma * delta), -2 * gamma * delta])
    real = roots[np.abs(roots.imag) < 1e-9].real
    return float(delta + max(real.max(), np.sqrt(delta)))


def has_population_outlier(rho, delta: float):
    """ρ > δ + √δ."""
    return _check_rho(rho) > population_threshold(delta)


def has_sample_outlier(rho, delta: float, gamma: float):
    """ρ above ``sample_threshold``."""
    return _check_rho(rho) > sample_threshold(delta, gamma)


def population_outlier(rho, delta: float, kappa: float = 1.0):
    """Top eigenvalue of the population covariance κ(C + ρ uuᵀ): κρ(s + 1)/s past the threshold, else the
    bulk edge κ(1 + √δ)²; s = ρ − δ."""
    _check_ratios(delta)
    _check_kappa(kappa)
    rho = _check_rho(rho)
    s = rho - delta
    with np.errstate(divide="ignore", invalid="ignore"):
        value = kappa * rho * (s + 1) / s
    return np.where(has_population_outlier(rho, delta), value, kappa * (1 + np.sqrt(delta)) ** 2)


def population_overlap(rho, delta: float):
    """|v_popᵀ u|² for the population top eigenvector: 1 − δ/s² past the threshold, 0 below; s = ρ − δ."""
    _check_ratios(delta)
    rho = _check_rho(rho)
    s = rho - delta
    with np.errstate(divide="ignore", invalid="ignore"):
        value = 1 - delta / s**2
    return np.where(has_population_outlier(rho, delta), value, 0.0)


def sample_outlier(rho, delta: float, gamma: float, kappa: float = 1.0):
    """Top eigenvalue of S: κρ(s + 1)(s + γ)/s² past ``sample_threshold``, else the upper bulk edge.

    Derivation: the population spike ℓ = ρ(s + 1)/s satisfies G(ℓ) = 1/ρ for the MP_δ Cauchy transform G;
    Bai-Yao's map ψ(ℓ) = ℓ(1 − γ + γℓG(ℓ)) then gives the sample location, and ψ'(ℓ) > 0 the threshold.
    """
    _check_ratios(delta, gamma)
    _check_kappa(kappa)
    rho = _check_rho(rho)
    s = rho - delta
    with np.errstate(divide="ignore", invalid="ignore"):
        value = kappa * rho * (s + 1) * (s + gamma) / s**2
    return np.where(has_sample_outlier(rho, delta, gamma), value, bulk_edges(delta, gamma, kappa)[1])


def sample_overlap(rho, delta: float, gamma: float):
    """|ûᵀu|² for the top eigenvector û of S: [s³ − (γ + δ + γδ)s − 2γδ] / [s²(s + γ)] past the sample
    threshold, 0 below. It is the population overlap 1 − δ/s² times Bai-Yao's ℓψ'(ℓ)/ψ(ℓ); δ = 0 gives the
    classical BBP overlap (1 − γ/ρ²)/(1 + γ/ρ)."""
    _check_ratios(delta, gamma)
    rho = _check_rho(rho)
    s = rho - delta
    with np.errstate(divide="ignore", invalid="ignore"):
        value = _sample_cubic(s, delta, gamma) / (s**2 * (s + gamma))
    return np.where(has_sample_outlier(rho, delta, gamma), value, 0.0)


def effective_signal_norm2(mu_norm2: float, delta: float, table: str = "class_centred") -> float:
    """‖μ‖² to use in ρ: unchanged for a class-centred table, ‖μ‖² + δ for a raw Gaussian table (the class means
    z̄± of the noise have squared norm ≈ 2δ each; (z̄₊ − z̄₋)/2, of squared norm ≈ δ, adds to ±μ)."""
    if not (np.isfinite(mu_norm2) and mu_norm2 >= 0):
        raise ValueError(f"mu_norm2 = ‖μ‖² must be finite and >= 0, got {mu_norm2!r}")
    if table == "class_centred":
        return float(mu_norm2)
    if table == "raw":
        _check_ratios(delta)
        return float(mu_norm2) + float(delta)
    raise ValueError(f"table must be 'class_centred' or 'raw', got {table!r}")


def signal_overlap_factor(mu_norm2: float, delta: float, table: str = "class_centred") -> float:
    """Factor turning the overlap with the effective signal direction into the overlap with μ/‖μ‖: 1 for a
    class-centred table, ‖μ‖²/(‖μ‖² + δ) for a raw one (the effective signal μ + (z̄₊ − z̄₋)/2 is nearly
    orthogonal to its noise part, of squared norm ≈ δ)."""
    effective = effective_signal_norm2(mu_norm2, delta, table)
    return 1.0 if effective == 0 else float(mu_norm2) / effective


def snr(alpha: float, kappa: float, mu_norm2: float) -> float:
    """ρ = α ‖μ‖² / κ (pass ``effective_signal_norm2`` for a raw table)."""
    _check_kappa(kappa)
    for name, value in (("alpha", alpha), ("mu_norm2", mu_norm2)):
        if not (np.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
    return float(alpha) * float(mu_norm2) / float(kappa)
