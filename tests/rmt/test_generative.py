"""The sampler of SPEC 3.1: validation of R, exact second moments, table conventions, pooling."""

import numpy as np
import pytest

from hf_spectral.rmt import (
    AR1Correlation,
    MatrixCorrelation,
    PrefixCorrelation,
    pool_tokens,
    sample_pooled,
    sample_table,
    sample_tokens,
    validate_correlation_matrix,
)


@pytest.mark.parametrize(
    "matrix, message",
    [
        (np.array([[1.0, 0.5], [0.4, 1.0]]), "symmetric"),
        (np.array([[1.0, 0.2], [0.2, 0.9]]), "unit diagonal"),
        (np.array([[1.0, 0.9, -0.9], [0.9, 1.0, 0.0], [-0.9, 0.0, 1.0]]), "positive semi-definite"),
        (np.ones((2, 3)), "square"),
        (np.array([[1.0, np.nan], [np.nan, 1.0]]), "non-finite"),
        (np.ones(4), "square"),
    ],
)
def test_bad_correlation_matrices_raise_clear_errors(matrix, message):
    with pytest.raises(ValueError, match=message):
        validate_correlation_matrix(matrix)
    with pytest.raises(ValueError, match=message):
        MatrixCorrelation(matrix)


def test_matrix_not_reachable_by_signs_is_refused():
    # a valid correlation matrix (eigenvalues 0, 1.5, 1.5) that no Gaussian-sign vector realises
    R = np.full((3, 3), -0.5) + 1.5 * np.eye(3)
    validate_correlation_matrix(R)
    with pytest.raises(ValueError, match="not reachable"):
        MatrixCorrelation(R)


@pytest.mark.parametrize(
    "model",
    [PrefixCorrelation(12, 4), AR1Correlation(12, 0.7), AR1Correlation(6, -0.4),
     MatrixCorrelation(AR1Correlation(10, 0.5).matrix)],
    ids=repr,
)
def test_sign_samplers_have_second_moment_R_and_zero_mean(model):
    signs = model.sample_signs(60_000, np.random.default_rng(0))
    assert set(np.unique(signs)) <= {-1.0, 1.0}
    # standard error of a ±1 product mean is ≤ 1/√n ≈ 0.004
    assert np.abs(signs.T @ signs / len(signs) - model.matrix).max() < 0.02
    assert np.abs(signs.mean(axis=0)).max() < 0.02


def test_prefix_labels_are_the_shared_prefix_sign():
    model = PrefixCorrelation(10, 3)
    signs = model.sample_signs(200, 1)
    np.testing.assert_array_equal(model.labels(signs), signs[:, 0])
    assert np.all(signs[:, :3] == signs[:, :1])


def test_class_centred_table_has_zero_class_means_and_unit_noise():
    table = sample_table(400, 200, 2.0, rng=0)
    half = 100
    assert np.abs(table.noise[:, :half].mean(axis=1)).max() < 1e-12
    assert np.abs(table.noise[:, half:].mean(axis=1)).max() < 1e-12
    assert abs(np.linalg.norm(table.mu) ** 2 - 2.0) < 1e-12
    assert abs((table.noise**2).mean() - 1.0) < 0.02
    np.testing.assert_array_equal(table.signs, np.r_[np.ones(half), -np.ones(half)])
    raw = sample_table(400, 200, 2.0, table="raw", rng=0)
    # raw class means have squared norm ≈ d/(V/2) = 2δ
    assert abs(np.sum(raw.noise[:, :half].mean(axis=1) ** 2) - 4.0) < 1.0


@pytest.mark.parametrize("vocab", [7, 2, 0])
def test_table_needs_an_even_vocabulary(vocab):
    with pytest.raises(ValueError, match="even"):
        sample_table(10, vocab, 1.0)


def test_tokens_come_from_the_sign_class_and_pooling_is_the_weighted_sum():
    rng = np.random.default_rng(3)
    table = sample_table(20, 40, 1.0, rng=rng)
    model = AR1Correlation(7, 0.3)
    signs = model.sample_signs(50, rng)
    tokens = sample_tokens(table, signs, rng)
    np.testing.assert_array_equal(table.signs[tokens], signs)
    w = rng.standard_normal(7)
    w[2] = 0.0
    expected = np.einsum("t,ntd->nd", w, table.embeddings.T[tokens])
    np.testing.assert_allclose(pool_tokens(table, tokens, w), expected, atol=1e-12)
    with pytest.raises(ValueError, match="positions"):
        pool_tokens(table, tokens, w[:5])
    with pytest.raises(ValueError, match="all zeros"):
        sample_pooled(table, model, np.zeros(7), 5)


def test_a_prefix_of_one_labels_and_pools_by_the_first_position():
    from hf_spectral.rmt import PrefixCorrelation

    model = PrefixCorrelation(5, 1)  # R = I: every unit vector is a top eigenvector; the model means the first
    signs = model.sample_signs(200, np.random.default_rng(0))
    np.testing.assert_array_equal(model.labels(signs), signs[:, 0])
    np.testing.assert_array_equal(model.top_eigenvector(), [1.0, 0, 0, 0, 0])
