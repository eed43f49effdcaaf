"""Properties of random-feature kernel mixing (hf_spectral/ops/random_features.py)."""

import math

import pytest
import torch

from hf_spectral.ops import random_features as ops


def _random(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# --- random-feature kernel mixing -------------------------------------------------------------------------------


def _gaussian_kernel(x, y, gamma):
    return torch.exp(-gamma * (x[:, None] - y[None]).square().sum(-1))


@pytest.mark.parametrize("features", ["positive", "trigonometric"])
def test_random_features_estimate_the_gaussian_kernel(features):
    d, gamma, count = 8, 1.0 / 8, 40000
    # The positive estimator's relative variance per feature is exp(2γ‖x + y‖²) − 1: keep it moderate.
    x, y = _random(6, d, seed=13) * 0.5, _random(6, d, seed=14) * 0.5
    omega = _random(d, count, seed=15) * math.sqrt(2 * gamma)
    if features == "positive":
        phi_x, phi_y = ops.positive_random_features(x, omega, gamma), ops.positive_random_features(y, omega, gamma)
        assert (phi_x > 0).all()
    else:
        phi_x, phi_y = ops.trigonometric_random_features(x, omega), ops.trigonometric_random_features(y, omega)
    estimate = phi_x.double() @ phi_y.double().T
    torch.testing.assert_close(estimate, _gaussian_kernel(x, y, gamma), atol=0.03, rtol=0.05)


def _reference_kernel_attention(phi_q, phi_k, values, causal):
    scores = phi_q.double() @ phi_k.double().transpose(1, 2)
    if causal:
        scores = scores * torch.ones(scores.shape[-2:], dtype=torch.float64).tril()
    return (scores @ values.double()) / (scores.sum(-1, keepdim=True) + 1e-6)


@pytest.mark.parametrize("length,chunk", [(1, 4), (13, 4), (16, 16), (40, 64)])
def test_causal_kernel_attention_matches_quadratic_reference(length, chunk):
    phi_q, phi_k = _random(2, length, 5, seed=16).exp(), _random(2, length, 5, seed=17).exp()
    values = _random(2, length, 3, seed=18)
    out, state = ops.causal_kernel_attention(phi_q, phi_k, values, chunk_size=chunk)
    torch.testing.assert_close(out.double(), _reference_kernel_attention(phi_q, phi_k, values, True), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.double(), ops.kernel_attention_state(phi_k, values).double(), atol=1e-4, rtol=1e-5)


def test_causal_kernel_attention_continues_from_its_state():
    phi_q, phi_k = _random(2, 21, 5, seed=19).exp(), _random(2, 21, 5, seed=20).exp()
    values = _random(2, 21, 3, seed=21)
    whole, whole_state = ops.causal_kernel_attention(phi_q, phi_k, values, chunk_size=4)
    first, state = ops.causal_kernel_attention(phi_q[:, :9], phi_k[:, :9], values[:, :9], chunk_size=4)
    pieces = [first]
    for t in range(9, 21):  # token by token, as in generation
        out, state = ops.causal_kernel_attention(phi_q[:, t : t + 1], phi_k[:, t : t + 1], values[:, t : t + 1], state, 4)
        pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces, 1), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, whole_state, atol=1e-4, rtol=1e-5)


def test_causal_kernel_attention_ignores_future_tokens():
    phi_q, phi_k = _random(1, 12, 4, seed=22).exp(), _random(1, 12, 4, seed=23).exp()
    values = _random(1, 12, 3, seed=24)
    out, _ = ops.causal_kernel_attention(phi_q, phi_k, values, chunk_size=5)
    phi_k2, values2 = phi_k.clone(), values.clone()
    phi_k2[:, 7:] *= 5.0
    values2[:, 7:] = -values2[:, 7:]
    out2, _ = ops.causal_kernel_attention(phi_q, phi_k2, values2, chunk_size=5)
    torch.testing.assert_close(out2[:, :7], out[:, :7])
    assert not torch.allclose(out2[:, 7:], out[:, 7:])


def test_bidirectional_kernel_attention_matches_reference():
    phi_q, phi_k = _random(2, 9, 5, seed=25).exp(), _random(2, 9, 5, seed=26).exp()
    values = _random(2, 9, 3, seed=27)
    out = ops.bidirectional_kernel_attention(phi_q, phi_k, values)
    torch.testing.assert_close(out.double(), _reference_kernel_attention(phi_q, phi_k, values, False), atol=1e-5, rtol=1e-5)


def test_authors_rbf_mixing_is_softmax_of_feature_products_and_reads_the_future():
    phi, values = _random(2, 7, 6, seed=28).float(), _random(2, 7, 4, seed=29).float()
    expected = torch.softmax(phi @ phi.transpose(1, 2), -1) @ values
    out = ops.authors_rbf_mixing(phi, values)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    changed = values.clone()
    changed[:, -1] += 1.0
    assert not torch.allclose(ops.authors_rbf_mixing(phi, changed)[:, 0], out[:, 0])
    key_valid = torch.ones(2, 7, dtype=torch.bool)
    key_valid[:, -1] = False  # a padding key is not read
    torch.testing.assert_close(
        ops.authors_rbf_mixing(phi, changed, key_valid)[:, :-1], ops.authors_rbf_mixing(phi, values, key_valid)[:, :-1]
    )


def test_kernel_mixing_under_autocast_keeps_float32_precision():
    # autocast would run the features' exponent and the prefix sums' products in bfloat16 (~1% feature error)
    generator = torch.Generator().manual_seed(0)
    x = torch.nn.functional.layer_norm(torch.randn(2, 40, 64, generator=generator), (64,))
    gamma = 1 / (4 * 64)
    omega = torch.randn(64, 32, generator=generator) * math.sqrt(2 * gamma)
    values = torch.randn(2, 40, 16, generator=generator)

    def mix():
        phi = ops.positive_random_features(x, omega, gamma)
        trig = ops.trigonometric_random_features(x, omega)
        return (phi, trig, *ops.causal_kernel_attention(phi, phi, values, chunk_size=16),
                ops.bidirectional_kernel_attention(phi, phi, values))

    reference = mix()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = mix()
    for a, b in zip(autocast, reference):
        assert a.dtype == torch.float32 and torch.equal(a, b)  # the same float32 ops
