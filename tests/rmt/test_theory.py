"""Closed forms of hf_spectral.rmt.theory against independent numerics (free-probability moments, the
Marchenko-Pastur law, Bai-Yao's map computed by quadrature) and against small seeded simulations."""

import math
import warnings

import numpy as np
import pytest
from scipy import integrate, optimize

from hf_spectral.rmt import (
    PrefixCorrelation,
    bulk_atom_at_zero,
    bulk_cdf,
    bulk_density,
    bulk_edges,
    harmonic_causal_weights,
    ks_distance,
    mean_pooling_weights,
    mu_norm2_for_rho,
    optimal_pooling_weights,
    pooling_snr,
    population_outlier,
    population_overlap,
    population_threshold,
    problem_sizes,
    sample_outlier,
    sample_overlap,
    sample_pooled,
    sample_table,
    sample_threshold,
    signal_overlap_factor,
    simulate_spectrum,
    stieltjes_transform,
)

RATIOS = [(0.5, 0.5), (0.25, 1.0), (1.0, 0.5), (2.0, 0.5), (0.5, 2.0), (0.3, 0.0), (0.0, 0.3)]


def _integrate_density(g, delta, gamma, kappa=1.0, points=20001):
    """∫ g(x) f(x) dx over the bulk, with x = lo + (hi − lo)(1 − cos θ)/2: the substitution absorbs the square-root
    edges (and the x^{-1/2} divergence of a hard edge at 0), so a plain trapezoid in θ converges fast."""
    lo, hi = bulk_edges(delta, gamma, kappa)
    theta = np.linspace(0.0, np.pi, points)[1:-1]
    x = lo + (hi - lo) * (1 - np.cos(theta)) / 2
    integrand = g(x) * bulk_density(x, delta, gamma, kappa) * (hi - lo) * np.sin(theta) / 2
    return np.sum(integrand) * (theta[1] - theta[0])


def _moments(delta, gamma, kappa=1.0):
    return [_integrate_density(lambda x, k=k: x**k, delta, gamma, kappa) for k in range(3)]


@pytest.mark.parametrize("delta, gamma", RATIOS)
def test_bulk_density_has_the_moments_of_the_free_product(delta, gamma):
    # MP laws of mean 1 and variance δ, γ: the free product has mean 1 and second moment 1 + δ + γ
    mass, first, second = _moments(delta, gamma)
    atom = bulk_atom_at_zero(delta, gamma)
    assert mass == pytest.approx(1 - atom, abs=2e-3)
    assert first == pytest.approx(1.0, abs=2e-3)
    assert second == pytest.approx(1 + delta + gamma, rel=2e-3)
    kappa_moments = _moments(delta, gamma, kappa=2.5)
    assert kappa_moments[1] == pytest.approx(2.5, abs=5e-3)


@pytest.mark.parametrize("c", [0.2, 0.7])
def test_one_ratio_zero_is_the_marchenko_pastur_law(c):
    x = np.linspace(0.05, 3.5, 200)
    a, b = (1 - np.sqrt(c)) ** 2, (1 + np.sqrt(c)) ** 2
    mp = np.where((x > a) & (x < b), np.sqrt(np.clip((b - x) * (x - a), 0, None)) / (2 * np.pi * c * x), 0.0)
    np.testing.assert_allclose(bulk_density(x, c, 0.0), mp, atol=1e-6)
    np.testing.assert_allclose(bulk_density(x, 0.0, c), mp, atol=1e-6)
    np.testing.assert_allclose(bulk_edges(c, 0.0), (a, b), rtol=1e-9)


def test_stieltjes_transform_is_the_right_branch():
    z = np.array([0.5 + 0.3j, 2.0 + 0.01j, 40.0 + 1.0j, -1.0 + 0.5j])
    m = stieltjes_transform(z, 0.5, 0.7)
    residual = m * (1 - 0.5 - 0.5 * z * m) * (1 - 0.7 - 0.7 * z * m) - z * m - 1
    assert np.abs(residual).max() < 1e-9
    assert np.all(m.imag > 0)
    assert abs(m[2] * z[2] + 1) < 0.1  # m(z) ≈ −1/z far away
    # a direct quadrature of ∫ f(t)/(t − z) dt agrees (points well off the axis)
    direct = [_integrate_density(lambda t, zz=zz: 1 / (t - zz), 0.5, 0.7) for zz in (z[0], z[2], z[3])]
    np.testing.assert_allclose(m[[0, 2, 3]], direct, rtol=1e-4)
    with pytest.raises(ValueError):
        stieltjes_transform(1.0, 0.5, 0.5)


def _mp_cauchy(delta, z):
    """G(z) = ∫ dMP_δ(t)/(z − t) by quadrature, for real z above the support (δ ≤ 1)."""
    a, b = (1 - np.sqrt(delta)) ** 2, (1 + np.sqrt(delta)) ** 2
    f = lambda t: np.sqrt((b - t) * (t - a)) / (2 * np.pi * delta * t) / (z - t)  # noqa: E731
    return integrate.quad(f, a, b, limit=200)[0]


@pytest.mark.parametrize("delta, gamma", [(0.5, 0.5), (0.25, 1.0), (0.8, 0.3)])
def test_outlier_closed_forms_match_bai_yao_by_quadrature(delta, gamma):
    edge = (1 + np.sqrt(delta)) ** 2
    assert population_threshold(delta) == pytest.approx(1 / _mp_cauchy(delta, edge + 1e-10), rel=1e-3)
    for rho in (1.3 * sample_threshold(delta, gamma), 3 * sample_threshold(delta, gamma)):
        # population spike ℓ of MP_δ + ρuuᵀ solves G(ℓ) = 1/ρ; overlap −1/(ρ² G'(ℓ))
        ell = optimize.brentq(lambda x: _mp_cauchy(delta, x) - 1 / rho, edge + 1e-9, 1e4)
        assert population_outlier(rho, delta) == pytest.approx(ell, rel=1e-6)
        h = 1e-4 * ell
        dG = (_mp_cauchy(delta, ell + h) - _mp_cauchy(delta, ell - h)) / (2 * h)
        assert population_overlap(rho, delta) == pytest.approx(-1 / (rho**2 * dG), rel=1e-4)
        # sample: ψ(ℓ) = ℓ(1 − γ + γℓG(ℓ)), overlap = population overlap · ℓψ'(ℓ)/ψ(ℓ)
        psi = lambda x: x * (1 - gamma + gamma * x * _mp_cauchy(delta, x))  # noqa: E731
        dpsi = (psi(ell + h) - psi(ell - h)) / (2 * h)
        assert sample_outlier(rho, delta, gamma, kappa=1.7) == pytest.approx(1.7 * psi(ell), rel=1e-6)
        expected_overlap = -1 / (rho**2 * dG) * ell * dpsi / psi(ell)
        assert sample_overlap(rho, delta, gamma) == pytest.approx(expected_overlap, rel=1e-3)
    # the sample threshold is where ψ'(ℓ(ρ)) changes sign
    def dpsi_at(rho):
        ell = optimize.brentq(lambda x: _mp_cauchy(delta, x) - 1 / rho, edge + 1e-9, 1e4)
        h = 1e-5 * ell
        return (ell + h) * (1 - gamma + gamma * (ell + h) * _mp_cauchy(delta, ell + h)) - (ell - h) * (
            1 - gamma + gamma * (ell - h) * _mp_cauchy(delta, ell - h))
    threshold = sample_threshold(delta, gamma)
    assert dpsi_at(threshold * 0.97) < 0 < dpsi_at(threshold * 1.03)


def test_zero_delta_gives_classical_bbp():
    gamma = 0.4
    rho = np.array([0.3, 1.0, 2.5])
    assert sample_threshold(0.0, gamma) == pytest.approx(np.sqrt(gamma))
    above = rho > np.sqrt(gamma)
    np.testing.assert_allclose(sample_outlier(rho, 0.0, gamma)[above], ((1 + rho) * (1 + gamma / rho))[above])
    np.testing.assert_allclose(sample_overlap(rho, 0.0, gamma),
                               np.where(above, (1 - gamma / rho**2) / (1 + gamma / rho), 0.0))


@pytest.mark.parametrize("delta, gamma", RATIOS[:5])
def test_thresholds_are_ordered_and_outliers_leave_the_bulk(delta, gamma):
    pop, smp = population_threshold(delta), sample_threshold(delta, gamma)
    assert pop <= smp
    rho = np.linspace(smp * 1.001, 5 * smp, 50)
    assert np.all(sample_outlier(rho, delta, gamma) > bulk_edges(delta, gamma)[1])
    assert np.all(np.diff(sample_overlap(rho, delta, gamma)) > 0)
    assert sample_overlap(smp * 0.999, delta, gamma) == 0.0
    assert sample_outlier(smp * 0.999, delta, gamma) == pytest.approx(bulk_edges(delta, gamma)[1])


def test_bad_ratios_raise():
    for call in (lambda: bulk_density(1.0, -0.1, 0.5), lambda: bulk_edges(0.5, 0.5, kappa=0.0),
                 lambda: sample_threshold(np.nan, 0.5), lambda: population_outlier(2.0, 0.5, kappa=-1)):
        with pytest.raises(ValueError):
            call()
    # A NaN or negative ρ would fail every threshold test and read as the bulk edge / overlap 0: refused
    for call in (sample_outlier, sample_overlap):
        for rho in (np.nan, -3.0, np.array([1.0, np.nan])):
            with pytest.raises(ValueError, match="rho must be finite"):
                call(rho, 0.5, 0.5)
    with pytest.raises(ValueError, match="rho must be finite"):
        population_overlap(-1.0, 0.5)


# ----------------------------------------------------------------------------------------------------------------
# Small simulations (seeded): these fail if the theory or the sampler is wrong
# ----------------------------------------------------------------------------------------------------------------

T, L = 32, 4
PREFIX = PrefixCorrelation(T, L)
WEIGHTS = {"mean": mean_pooling_weights(T), "causal": harmonic_causal_weights(T),
           "optimal": optimal_pooling_weights(PREFIX.matrix)}


@pytest.mark.parametrize("delta, gamma", [(0.5, 0.5), (2.0, 0.5), (0.5, 2.0)])
def test_simulated_bulk_matches_the_density(delta, gamma):
    result = simulate_spectrum(WEIGHTS["causal"], PREFIX, dim=300, delta=delta, gamma=gamma, mu_norm2=0.0, seed=0)
    assert ks_distance(result.eigenvalues, result.delta, result.gamma, result.kappa) < 0.025
    # plain Marchenko-Pastur with ratio δ + γ (what one gets by forgetting the finite vocabulary) is far off
    wrong = ks_distance(result.eigenvalues / result.kappa, 0.0, result.delta + result.gamma)
    assert wrong > 0.05


@pytest.mark.parametrize("tiny", [1e-8, 1e-10, 1e-12, 1e-14])
def test_a_vanishing_ratio_gives_the_marchenko_pastur_limit(tiny):
    # the cubic's third root grows like 1/(δγx): it must neither hide the density nor swamp the other two roots
    x = np.linspace(0.1, 2.9, 15)
    for delta, gamma in ((tiny, 0.5), (0.5, tiny)):
        np.testing.assert_allclose(bulk_density(x, delta, gamma), bulk_density(x, 0.0, 0.5), atol=1e-6)
        assert bulk_cdf(delta, gamma).continuous_mass == pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize("delta, gamma", [(2.0, 2.0), (1.5, 1.5)])
def test_next_to_an_atom_at_zero_the_transform_is_the_atoms(delta, gamma):
    # with an atom at 0 every root grows like 1/x as x → 0: the cubic must stay a cubic there
    atom = bulk_atom_at_zero(delta, gamma)
    z = np.array([1e-7 + 1e-8j, 1e-6 + 1e-9j])
    np.testing.assert_allclose(stieltjes_transform(z, delta, gamma), -atom / z, rtol=0.02)
    assert bulk_cdf(delta, gamma, points=40001).continuous_mass == pytest.approx(1 - atom, abs=1e-4)
    assert (bulk_density(np.array([1e-9, 1e-7]), delta, gamma) > 100).all()  # the hard edge's x^(-1/2)


def test_bulk_cdf_reports_its_mass():
    assert bulk_cdf(0.5, 0.5).continuous_mass == pytest.approx(1.0, abs=1e-3)
    assert bulk_cdf(2.0, 0.5)(0.0) == pytest.approx(0.5)


@pytest.mark.parametrize("pooling", ["mean", "optimal"])
def test_simulated_outlier_and_overlap_match_past_the_threshold(pooling):
    delta, gamma = 0.5, 0.5
    rho = 2.5 * sample_threshold(delta, gamma)
    w = WEIGHTS[pooling]
    mu2 = mu_norm2_for_rho(rho, w, PREFIX, delta)
    runs = [simulate_spectrum(w, PREFIX, dim=400, delta=delta, gamma=gamma, mu_norm2=mu2, seed=s) for s in range(4)]
    top = np.mean([r.top_eigenvalue / r.kappa for r in runs])
    overlap = np.mean([r.overlap for r in runs])
    assert top == pytest.approx(float(sample_outlier(rho, delta, gamma)), rel=0.03)
    assert overlap == pytest.approx(float(sample_overlap(rho, delta, gamma)), rel=0.04)
    # forgetting the vocabulary (δ = 0, classical BBP) predicts an overlap this test would reject
    assert abs(float(sample_overlap(rho, 0.0, gamma)) - overlap) > 0.04 * overlap


def test_no_outlier_between_the_two_thresholds():
    # population outlier exists, sample outlier does not: S shows no spike and û carries no signal
    delta, gamma = 0.5, 1.0
    pop, smp = population_threshold(delta), sample_threshold(delta, gamma)
    rho = (pop + smp) / 2
    w = WEIGHTS["causal"]
    mu2 = mu_norm2_for_rho(rho, w, PREFIX, delta)
    for seed in range(3):
        r = simulate_spectrum(w, PREFIX, dim=400, delta=delta, gamma=gamma, mu_norm2=mu2, seed=seed)
        assert r.top_eigenvalue / r.kappa < bulk_edges(delta, gamma)[1]
        assert r.overlap < 0.15
    assert population_overlap(rho, delta) > 0.3


def test_raw_table_needs_the_delta_correction():
    delta, gamma = 0.5, 0.5
    w = WEIGHTS["optimal"]
    mu2 = 1.0
    runs = [simulate_spectrum(w, PREFIX, dim=400, delta=delta, gamma=gamma, mu_norm2=mu2, table="raw", center=True,
                              seed=s) for s in range(6)]
    top = np.mean([r.top_eigenvalue / r.kappa for r in runs])
    rho_corrected, rho_naive = L * (mu2 + runs[0].delta), L * mu2
    assert runs[0].rho == pytest.approx(rho_corrected)
    assert top == pytest.approx(float(sample_outlier(rho_corrected, delta, gamma)), rel=0.03)
    assert abs(top - float(sample_outlier(rho_naive, delta, gamma))) > 0.1 * top
    # the outlier aligns with μ + (z̄₊ − z̄₋)/2: its overlap with μ/‖μ‖ loses the factor ‖μ‖²/(‖μ‖² + δ)
    overlap = np.mean([r.overlap for r in runs])
    factor = signal_overlap_factor(mu2, runs[0].delta, "raw")
    assert overlap == pytest.approx(float(sample_overlap(rho_corrected, delta, gamma)) * factor, rel=0.06)
    # ... and the draw's own theory() says so (it had left the factor out: a 10-20% "disagreement")
    predicted = runs[0].theory()["overlap"]
    assert predicted == pytest.approx(float(sample_overlap(rho_corrected, runs[0].delta, runs[0].gamma)) * factor)
    assert overlap == pytest.approx(predicted, rel=0.06)


def test_scalar_arguments_and_bad_values_are_handled_by_name():
    from hf_spectral.rmt import has_population_outlier, has_sample_outlier, snr, stieltjes_transform

    scalar = stieltjes_transform(2 + 0.5j, 0.5, 0.5)
    assert np.shape(scalar) == () and scalar == stieltjes_transform([2 + 0.5j], 0.5, 0.5)[0]
    for call in (lambda: has_sample_outlier(float("nan"), 0.5, 0.5), lambda: has_population_outlier(-5, 0.5)):
        with pytest.raises(ValueError, match="rho must be finite and >= 0"):
            call()
    with pytest.raises(ValueError, match="alpha must be finite and >= 0"):
        snr(-1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="mu_norm2 must be finite and >= 0"):
        snr(1.0, 1.0, float("nan"))


@pytest.mark.parametrize("delta", [0.25, 0.5, 2.0])
def test_below_the_population_threshold_the_top_eigenvalue_is_the_bulk_edge(delta):
    edge, threshold = (1 + math.sqrt(delta)) ** 2, population_threshold(delta)
    assert population_outlier(0.9 * threshold, delta, kappa=2.0) == pytest.approx(2.0 * edge, rel=1e-12)
    assert population_overlap(0.9 * threshold, delta) == 0.0
    # continuous at the threshold: the outlier leaves the edge there
    assert population_outlier(threshold * (1 + 1e-9), delta) == pytest.approx(edge, rel=1e-6)


def test_simulation_sizes_say_when_the_ratios_asked_for_cannot_be_met():
    with pytest.warns(UserWarning, match=r"at d = 10 the simulation runs δ = d/V = 2\.5, γ = d/N = 10, not the "
                                         r"δ = 100, γ = 10000"):
        assert problem_sizes(10, 100.0, 1e4) == (4, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert problem_sizes(300, 2.0, 0.5) == (150, 600)
    with pytest.raises(ValueError, match="track must be an integer >= 1"):
        simulate_spectrum(WEIGHTS["causal"], PREFIX, dim=40, delta=0.5, gamma=0.5, mu_norm2=1.0, track=0)
    with pytest.raises(ValueError, match="rho must be finite and >= 0"):
        mu_norm2_for_rho(float("nan"), WEIGHTS["causal"], PREFIX, 0.5)


def test_ks_distance_refuses_a_negative_count_to_exclude():
    with pytest.raises(ValueError, match="exclude_top must be an integer >= 0, got -1"):
        ks_distance(np.linspace(0.1, 2.0, 50), 0.5, 0.5, exclude_top=-1)
    with pytest.raises(ValueError, match="no eigenvalues given"):
        ks_distance([], 0.5, 0.5)
    with pytest.raises(ValueError, match="must be finite; got 1 NaN"):
        ks_distance([0.5, float("nan"), 1.0], 0.5, 0.5)


def test_ks_distance_counts_the_null_space_of_a_float32_eigensolver_as_the_atom():
    # δ = 2: half the spectrum is the atom at 0, which float32 round-off leaves at ~1e-7·λ_max, not ~1e-15
    dim, delta, gamma = 300, 2.0, 0.5
    vocab, n = problem_sizes(dim, delta, gamma)
    rng = np.random.default_rng(0)
    table = sample_table(dim, vocab, 0.0, rng=rng)
    pooled = sample_pooled(table, PREFIX, WEIGHTS["causal"], n, rng).vectors
    S = pooled.T @ pooled / n
    kappa = pooling_snr(WEIGHTS["causal"], PREFIX.matrix).kappa
    exact = ks_distance(np.linalg.eigvalsh(S), dim / vocab, dim / n, kappa)
    single = ks_distance(np.linalg.eigvalsh(S.astype(np.float32)), dim / vocab, dim / n, kappa)
    assert exact < 0.025
    assert single == pytest.approx(exact, abs=0.005)


def test_weights_on_about_one_position_warn_that_the_bulk_law_does_not_hold():
    from hf_spectral.rmt import PrefixCorrelation, simulate_spectrum

    with pytest.warns(UserWarning, match="effective positions"):
        simulate_spectrum(np.eye(8)[0], PrefixCorrelation(8, 1), dim=60, delta=0.5, gamma=0.5, mu_norm2=0.0)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        simulate_spectrum(np.ones(8), PrefixCorrelation(8, 2), dim=60, delta=0.5, gamma=0.5, mu_norm2=0.0)
