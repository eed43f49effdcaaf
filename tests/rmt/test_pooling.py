"""Pooling weights and α/κ (SPEC 3.2), including parameter-free causal attention at large d."""

import numpy as np
import pytest

from hf_spectral.rmt import (
    AR1Correlation,
    PrefixCorrelation,
    causal_attention_limit_weights,
    harmonic_causal_weights,
    mean_pooling_weights,
    optimal_pooling_weights,
    parameter_free_causal_attention,
    pooling_snr,
    sample_table,
    sample_tokens,
)


def test_spec_prefix_example_mean_harmonic_optimal():
    R = PrefixCorrelation(64, 8).matrix
    assert pooling_snr(mean_pooling_weights(64), R).ratio == pytest.approx(1.875)
    assert pooling_snr(harmonic_causal_weights(64), R).ratio == pytest.approx(5.14, abs=0.005)
    assert pooling_snr(optimal_pooling_weights(R), R).ratio == pytest.approx(8.0)


@pytest.mark.parametrize("T, L", [(10, 1), (20, 5), (33, 32)])
def test_prefix_closed_forms(T, L):
    R = PrefixCorrelation(T, L).matrix
    assert pooling_snr(mean_pooling_weights(T), R).ratio == pytest.approx((L**2 + T - L) / T)
    assert pooling_snr(optimal_pooling_weights(R), R).ratio == pytest.approx(max(L, 1))


def test_harmonic_weights_by_hand():
    # strictly earlier keys, T = 3: query 2 -> key 1; query 3 -> keys 1, 2 (1/2 each); mean over 2 queries
    np.testing.assert_allclose(harmonic_causal_weights(3), [0.75, 0.25, 0.0])
    # with the self key, T = 2: query 1 -> key 1; query 2 -> keys 1, 2
    np.testing.assert_allclose(harmonic_causal_weights(2, include_self=True), [0.75, 0.25])
    H = np.cumsum(1 / np.arange(1, 11))
    w = harmonic_causal_weights(10)
    np.testing.assert_allclose(w / w[0], (H[8] - np.r_[0, H[:9]]) / H[8])
    np.testing.assert_allclose(causal_attention_limit_weights(10, 0.0), harmonic_causal_weights(10, True))
    with pytest.raises(ValueError):
        harmonic_causal_weights(1)


def test_optimal_weights_maximise_the_rayleigh_quotient():
    R = AR1Correlation(16, 0.8).matrix
    best = pooling_snr(optimal_pooling_weights(R), R).ratio
    assert best == pytest.approx(np.linalg.eigvalsh(R)[-1])
    rng = np.random.default_rng(0)
    assert all(pooling_snr(rng.standard_normal(16), R).ratio <= best + 1e-12 for _ in range(200))
    assert optimal_pooling_weights(R).sum() > 0


def test_snr_rejects_mismatched_or_bad_weights():
    R = PrefixCorrelation(8, 2).matrix
    with pytest.raises(ValueError, match="positions"):
        pooling_snr(np.ones(7), R)
    with pytest.raises(ValueError, match="all zeros"):
        pooling_snr(np.zeros(8), R)
    with pytest.raises(ValueError, match="symmetric"):
        pooling_snr(np.ones(2), np.array([[1.0, 0.3], [0.0, 1.0]]))


@pytest.mark.parametrize("tau", [1.0, 3.0])
def test_parameter_free_causal_attention_tends_to_harmonic_weights(tau):
    T = 24
    model = PrefixCorrelation(T, 4)

    def measured(dim, include_self):
        rng = np.random.default_rng(1)
        table = sample_table(dim, 2 * dim, 1.0, rng=rng)
        X = table.embeddings.T[sample_tokens(table, model.sample_signs(48, rng), rng)]
        return parameter_free_causal_attention(X, tau, include_self)

    strict, limit = harmonic_causal_weights(T), causal_attention_limit_weights(T, tau, include_self=True)
    err_small = np.abs(measured(40, False) - strict).max()
    err_large = np.abs(measured(3000, False) - strict).max()
    assert err_large < 0.03 * strict.max()
    assert err_large < err_small / 3  # the deviation shrinks with d
    assert np.abs(measured(3000, True) - limit).max() < 0.03 * limit.max()
    # the conventions differ: the self-key measurement is far from the strictly causal limit
    assert np.abs(measured(3000, True) - strict).max() > 0.1 * strict.max()


def test_causal_attention_limit_weights_stay_finite_for_any_tau():
    from hf_spectral.rmt import causal_attention_limit_weights

    np.testing.assert_allclose(causal_attention_limit_weights(4, 710.0), np.full(4, 0.25))  # each query: itself
    # τ → −∞: query 1 keeps its only key, query i > 1 spreads 1/(i − 1) over its earlier keys
    expected = np.array([1 + 1 + 1 / 2 + 1 / 3, 1 / 2 + 1 / 3, 1 / 3, 0.0]) / 4
    np.testing.assert_allclose(causal_attention_limit_weights(4, -800.0), expected, atol=1e-12)
    np.testing.assert_allclose(causal_attention_limit_weights(4, -30.0), expected, atol=1e-12)
