"""Properties of CHIAR-Former's pure tensor operations (hf_spectral/models/chiar_former/spectral_ops.py)."""

import math

import numpy as np
import pytest
import scipy.fft
import torch

from hf_spectral.models.chiar_former import spectral_ops as ops


def _random(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# --- DCT --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [8, 31, 64])
def test_dct_matrix_is_orthogonal(size):
    matrix = ops.dct_matrix(size, torch.float64)
    torch.testing.assert_close(matrix @ matrix.T, torch.eye(size, dtype=torch.float64))


@pytest.mark.parametrize("implementation", ops.DCT_IMPLEMENTATIONS)
@pytest.mark.parametrize("size", [16, 33, 256])
def test_dct_matches_scipy_orthonormal_dct(implementation, size):
    x = _random(5, size)
    expected = torch.from_numpy(scipy.fft.dct(x.numpy(), type=2, norm="ortho", axis=-1))
    torch.testing.assert_close(ops.dct(x, implementation), expected)


@pytest.mark.parametrize("implementation", ops.DCT_IMPLEMENTATIONS)
@pytest.mark.parametrize("size", [16, 33, 256])
def test_dct_round_trip(implementation, size):
    x = _random(3, 7, size, seed=1)
    torch.testing.assert_close(ops.idct(ops.dct(x, implementation), implementation), x)
    X = _random(3, size, seed=2)
    torch.testing.assert_close(ops.dct(ops.idct(X, implementation), implementation), X)


def test_dct_implementations_agree_in_float32():
    x = _random(4, 256, seed=3, dtype=torch.float32)
    torch.testing.assert_close(ops.dct(x, "fft"), ops.dct(x, "matrix"), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ops.idct(x, "fft"), ops.idct(x, "matrix"), atol=1e-4, rtol=1e-4)


def test_unknown_dct_implementation_is_rejected():
    with pytest.raises(ValueError, match="unknown DCT implementation"):
        ops.dct(torch.zeros(2, 4), "wavelet")


# --- spectral entropy -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [16, 256])
def test_entropy_of_one_hot_spectrum_is_zero(size):
    for k in (0, 1, size // 2, size - 1):
        spectrum = torch.zeros(size, dtype=torch.float64)
        spectrum[k] = -3.0
        assert ops.spectral_entropy_from_spectrum(spectrum).item() == pytest.approx(0.0, abs=1e-12)
        # A hidden state equal to one DCT basis vector has that one-hot spectrum.
        basis_vector = ops.dct_matrix(size, torch.float64)[k]
        assert ops.spectral_entropy(basis_vector).item() == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("size", [16, 256])
def test_entropy_of_flat_spectrum_is_one(size):
    spectrum = torch.full((size,), 0.7, dtype=torch.float64) * torch.tensor([1.0, -1.0]).repeat(size // 2)
    assert ops.spectral_entropy_from_spectrum(spectrum).item() == pytest.approx(1.0, abs=1e-12)
    flat_state = ops.idct(torch.ones(size, dtype=torch.float64))
    assert ops.spectral_entropy(flat_state).item() == pytest.approx(1.0, abs=1e-9)


def test_entropy_is_bounded_scale_invariant_and_zero_for_zero_vector():
    x = _random(100, 64, seed=4)
    entropy = ops.spectral_entropy(x)
    assert entropy.min() > 0 and entropy.max() < 1
    torch.testing.assert_close(ops.spectral_entropy(17.0 * x), entropy)
    assert ops.spectral_entropy(torch.zeros(64, dtype=torch.float64)).item() == 0.0


def test_entropy_matches_direct_formula():
    x = _random(64, seed=5)
    X = torch.from_numpy(scipy.fft.dct(x.numpy(), norm="ortho"))
    p = X**2 / (X**2).sum()
    expected = -(p * p.log()).sum() / math.log(64)
    assert ops.spectral_entropy(x).item() == pytest.approx(expected.item(), rel=1e-12)


def test_dc_power_scale_reproduces_the_authors_unnormalised_dct():
    # An unnormalised FFT-based DCT-II (scipy norm=None) gives X_0 twice the relative power of the orthonormal one.
    x = _random(10, 64, seed=6)
    unnormalised = torch.from_numpy(scipy.fft.dct(x.numpy(), norm=None, axis=-1))
    authors = ops.spectral_entropy_from_spectrum(unnormalised)
    torch.testing.assert_close(ops.spectral_entropy(x, dc_power_scale=2.0), authors)
    assert not torch.allclose(ops.spectral_entropy(x), authors)


def test_entropy_gradient_is_finite_with_zero_coefficients():
    spectrum = torch.tensor([0.0, 1.0, 2.0, 0.0], requires_grad=True)
    ops.spectral_entropy_from_spectrum(spectrum).backward()
    assert torch.isfinite(spectrum.grad).all()


# --- DCT mixing -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", ops.DCT_IMPLEMENTATIONS)
@pytest.mark.parametrize("size", [32, 33])
def test_dct_mixing_with_unit_filter_is_identity(implementation, size):
    x = _random(2, 5, size, seed=7)
    torch.testing.assert_close(ops.dct_mixing(x, torch.ones(size, dtype=torch.float64), implementation), x)


@pytest.mark.parametrize("implementation", ops.DCT_IMPLEMENTATIONS)
@pytest.mark.parametrize("size", [32, 33])
def test_dct_mixing_filters_the_spectrum(implementation, size):
    x = _random(2, 5, size, seed=8)
    spectral_filter = _random(size, seed=9)
    expected = torch.from_numpy(
        scipy.fft.idct(scipy.fft.dct(x.numpy(), norm="ortho") * spectral_filter.numpy(), norm="ortho")
    )
    torch.testing.assert_close(ops.dct_mixing(x, spectral_filter, implementation), expected)


@pytest.mark.parametrize("size", [32, 33])
def test_even_odd_dct_gives_the_coefficients_and_the_mixing(size):
    x, spectral_filter = _random(3, 4, size, seed=33), _random(size, seed=34)
    spectrum, mixed = ops.dct_even_odd(x, spectral_filter)
    reference = ops.dct(x)
    order = torch.cat([torch.arange(0, size, 2), torch.arange(1, size, 2)]) if size % 2 == 0 else torch.arange(size)
    torch.testing.assert_close(spectrum, reference[..., order])
    torch.testing.assert_close(mixed, ops.idct(reference * spectral_filter))
    torch.testing.assert_close(ops.dct_even_odd(x)[0], spectrum)
    assert ops.dct_even_odd(x)[1] is None
    torch.testing.assert_close(ops.spectral_entropy_from_spectrum(spectrum), ops.spectral_entropy(x))


def test_dct_mixing_is_per_token():
    x = _random(1, 6, 16, seed=10)
    changed = x.clone()
    changed[:, 3:] = _random(1, 3, 16, seed=11)
    f = _random(16, seed=12)
    torch.testing.assert_close(ops.dct_mixing(changed, f)[:, :3], ops.dct_mixing(x, f)[:, :3])


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


# --- rotary positions -------------------------------------------------------------------------------------------


def test_rotary_scores_depend_only_on_relative_position():
    q, k = _random(1, 1, 1, 8, seed=30).float(), _random(1, 1, 1, 8, seed=31).float()

    def score(query_position, key_position):
        q_phase = ops.rotary_phases(torch.tensor([[query_position]]), 8, 10000.0)
        k_phase = ops.rotary_phases(torch.tensor([[key_position]]), 8, 10000.0)
        return (ops.apply_rotary(q, q_phase) * ops.apply_rotary(k, k_phase)).sum()

    torch.testing.assert_close(score(7, 3), score(104, 100), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(score(7, 3), score(7, 5))
    # Position 0 is the identity and every rotation keeps the norm.
    torch.testing.assert_close(ops.apply_rotary(q, ops.rotary_phases(torch.tensor([[0]]), 8, 10000.0)), q)
    rotated = ops.apply_rotary(q, ops.rotary_phases(torch.tensor([[37]]), 8, 10000.0))
    torch.testing.assert_close(rotated.norm(), q.norm())


def test_rotary_in_place_rotates_the_tensor_itself_and_keeps_its_gradients():
    """``in_place`` on a projection's output (the key half of a fused key/value product, a strided slice) gives the
    out-of-place result in the same memory, and gradients through it equal the out-of-place ones; tensors it cannot
    rotate in place (not float32, odd offsets) get a new tensor and stay unchanged."""
    generator = torch.Generator().manual_seed(32)
    states = torch.randn(2, 5, 12, generator=generator)
    weight = torch.randn(24, 12, generator=generator, requires_grad=True)
    phases = ops.rotary_phases(torch.arange(5).expand(2, 5), 4, 10000.0)

    def keys(in_place):
        key_value = states @ weight.t()
        key = key_value[..., :12].reshape(2, 5, 3, 4)
        rotated = ops.apply_rotary(key, phases, in_place=in_place)
        return key_value, key, rotated

    key_value, key, rotated = keys(in_place=True)
    assert rotated is key and rotated.data_ptr() == key_value.data_ptr()
    _, _, expected = keys(in_place=False)
    torch.testing.assert_close(rotated, expected)
    upstream = torch.randn(2, 5, 3, 4, generator=generator)
    (grad,) = torch.autograd.grad((rotated * upstream).sum() + key_value[..., 12:].sum(), weight)
    (expected_grad,) = torch.autograd.grad((expected * upstream).sum() + keys(False)[0][..., 12:].sum(), weight)
    torch.testing.assert_close(grad, expected_grad)

    for unrotatable in (key.detach().double(), key.detach().flatten(-2)[..., 1:9].reshape(2, 5, 2, 4)):
        before = unrotatable.clone()
        out = ops.apply_rotary(unrotatable, phases, in_place=True)
        assert out.data_ptr() != unrotatable.data_ptr()
        torch.testing.assert_close(unrotatable, before)
        torch.testing.assert_close(out, ops.apply_rotary(before, phases).to(out.dtype))


# --- routing ----------------------------------------------------------------------------------------------------


def test_threshold_routes_follow_the_spec_boundaries():
    entropy = torch.tensor([0.1, 0.5, 0.50001, 0.7, 0.9, 0.9001])
    assert ops.threshold_routes(entropy, [0.5]).tolist() == [0, 0, 1, 1, 1, 1]
    assert ops.threshold_routes(entropy, [0.5, 0.9]).tolist() == [0, 1, 1, 1, 1, 2]
    with pytest.raises(ValueError):
        ops.threshold_routes(entropy, [0.1, 0.2, 0.3])


def test_straight_through_gate_is_one_forward_and_passes_the_gradient():
    logits = torch.tensor([[0.3, -0.2, 1.0]], requires_grad=True)
    probabilities = torch.softmax(logits, -1)
    routes = probabilities.argmax(-1)
    gate = ops.straight_through_gate(probabilities, routes)
    assert gate.item() == 1.0
    gate.sum().backward()
    expected = torch.autograd.grad(torch.softmax(logits, -1)[0, 2], logits)[0]
    torch.testing.assert_close(logits.grad, expected)


def test_one_hot_gates_equal_the_straight_through_gate_on_the_chosen_operator():
    probabilities = torch.softmax(_random(4, 3, seed=32).float(), -1)
    routes = torch.tensor([0, 2, 1, 2])
    gates = ops.one_hot_gates(probabilities, routes, 3)
    torch.testing.assert_close(gates.sum(-1), torch.ones(4))
    torch.testing.assert_close(gates.gather(-1, routes[:, None])[:, 0], ops.straight_through_gate(probabilities, routes))


def test_usage_entropy_penalty_is_zero_for_balanced_and_log_k_for_collapsed_usage():
    balanced = torch.eye(3)[torch.tensor([0, 1, 2, 0, 1, 2])][None]
    assert ops.usage_entropy_penalty(balanced).item() == pytest.approx(0.0, abs=1e-6)
    collapsed = torch.eye(3)[torch.zeros(6, dtype=torch.long)][None]
    assert ops.usage_entropy_penalty(collapsed).item() == pytest.approx(math.log(3), abs=1e-6)
    valid = torch.tensor([[True, True, True, False, False, False]])  # padding excluded from the usage
    assert ops.usage_entropy_penalty(balanced, valid).item() == pytest.approx(0.0, abs=1e-6)


# --- sparse execution bookkeeping -------------------------------------------------------------------------------


def test_query_chunks_cover_the_queries_and_reach_each_chunks_last_slot():
    slots = torch.tensor([[3, 9, 20, 41, 42, 60, 61, 90], [5, 6, 7, 70, 80, 0, 0, 0]])  # row 2: 3 padding queries
    chunks = ops.query_chunks(slots, min_chunk=2, max_chunks=3)
    assert [start for start, _, _ in chunks] == [0, 3, 5] and chunks[-1][1] == 8
    for start, end, key_length in chunks:
        assert key_length == int(slots[:, start:end].max()) + 1
    assert ops.query_chunks(slots, min_chunk=64) == [(0, 8, 91)]


def test_gathered_query_mask_is_causal_skips_padding_and_never_empty():
    key_valid = torch.tensor([[False, True, True, True, True]])
    mask = ops.gathered_query_mask(torch.tensor([[0, 2, 4]]), key_valid, True, torch.float32)[0, 0]
    allowed = (mask == 0).numpy()
    np.testing.assert_array_equal(
        allowed,
        [[True, False, False, False, False],  # a padding query sees only itself
         [False, True, True, False, False],
         [False, True, True, True, True]],
    )
    bidirectional = ops.gathered_query_mask(torch.tensor([[2]]), key_valid, False, torch.float32)[0, 0]
    np.testing.assert_array_equal((bidirectional == 0).numpy(), [[False, True, True, True, True]])
    # No padding: the causal mask alone (on a key prefix), or no mask at all for a bidirectional layer.
    prefix = ops.gathered_query_mask(torch.tensor([[1, 3]]), None, True, torch.float32, key_length=4)[0, 0]
    np.testing.assert_array_equal((prefix == 0).numpy(), [[True, True, False, False], [True, True, True, True]])
    assert ops.gathered_query_mask(torch.tensor([[1]]), None, False, torch.float32, key_length=4) is None
