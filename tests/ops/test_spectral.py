"""Properties of the spectral operations (hf_spectral/ops/spectral.py): DCT-II/III, spectral entropy, DCT mixing."""

import math

import pytest
import torch

from hf_spectral.ops import spectral as ops


def _scipy_fft():
    """scipy's DCT, the independent reference (scipy is an optional dependency)."""
    return pytest.importorskip("scipy.fft", reason="the reference DCT values come from scipy.fft")


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
    expected = torch.from_numpy(_scipy_fft().dct(x.numpy(), type=2, norm="ortho", axis=-1))
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_fft_dct_takes_16_bit_inputs(dtype):
    """torch's CPU FFT refuses bfloat16 and float16: the FFT form transforms them in float32 and returns their dtype,
    as the matrix form does."""
    x = _random(4, 64, seed=4, dtype=torch.float32).to(dtype)
    for transform in (ops.dct, ops.idct):
        out = transform(x, "fft")
        assert out.dtype == dtype
        # the exact float32 transform of the 16-bit values, rounded once to 16 bits
        torch.testing.assert_close(out, transform(x.float(), "matrix").to(dtype), atol=0, rtol=2 ** -7)
    mixed = ops.dct_mixing(x, torch.full((64,), 0.5, dtype=dtype), "fft")
    assert mixed.dtype == dtype
    torch.testing.assert_close(mixed.float(), 0.5 * x.float(), atol=0.02, rtol=0.02)


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
    X = torch.from_numpy(_scipy_fft().dct(x.numpy(), norm="ortho"))
    p = X**2 / (X**2).sum()
    expected = -(p * p.log()).sum() / math.log(64)
    assert ops.spectral_entropy(x).item() == pytest.approx(expected.item(), rel=1e-12)


def test_dc_power_scale_reproduces_the_authors_unnormalised_dct():
    # An unnormalised FFT-based DCT-II (scipy norm=None) gives X_0 twice the relative power of the orthonormal one.
    x = _random(10, 64, seed=6)
    unnormalised = torch.from_numpy(_scipy_fft().dct(x.numpy(), norm=None, axis=-1))
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
        _scipy_fft().idct(_scipy_fft().dct(x.numpy(), norm="ortho") * spectral_filter.numpy(), norm="ortho")
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


def test_entropy_under_autocast_keeps_float32_precision():
    # autocast would run the entropy's batched dot product in bfloat16 (max error ~5e-4 on LayerNorm-ed states)
    spectrum = ops.dct(torch.nn.functional.layer_norm(torch.randn(4, 64, 128), (128,)))
    reference = ops.spectral_entropy_from_spectrum(spectrum)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = ops.spectral_entropy_from_spectrum(spectrum)
    assert torch.equal(autocast, reference)  # the same float32 ops
