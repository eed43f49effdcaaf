"""Spectral operations of CHIAR-Former (SPEC 2.1) as pure tensor functions: the orthonormal DCT-II / DCT-III over
the hidden axis (matrix and FFT forms), the normalised spectral entropy the router reads, and DCT mixing
iDCT(DCT(x) ⊙ f).

Every function acts on the last axis (the hidden axis, size N) and accepts any leading shape. Nothing here holds
parameters: the spectral filter f belongs to the model's DCT-mixing module.
"""

import functools
import math

import torch

from .precision import at_least_float32, full_precision

DCT_IMPLEMENTATIONS = ("matrix", "fft")


# ---------------------------------------------------------------------------------------------------------------
# Orthonormal DCT-II / DCT-III over the hidden axis
# ---------------------------------------------------------------------------------------------------------------


def dct_matrix(size: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """Orthonormal DCT-II matrix D (size × size): ``D[k, n] = s_k cos(π (n + ½) k / N)``, s_0 = √(1/N),
    s_k = √(2/N). ``X = x @ D.T`` is the DCT-II of x, ``x = X @ D`` its inverse (DCT-III); D is orthogonal."""
    n = torch.arange(size, dtype=torch.float64, device=device)
    matrix = torch.cos(math.pi * (n[None, :] + 0.5) * n[:, None] / size) * math.sqrt(2.0 / size)
    matrix[0] /= math.sqrt(2.0)
    return matrix.to(dtype)


@functools.lru_cache(maxsize=32)
def _cached_dct_matrix(size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    with torch.inference_mode(False):  # a normal tensor even when first built under inference mode
        return dct_matrix(size, dtype, device)


def cached_dct_matrix(size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """:func:`dct_matrix`, built once per (size, dtype, device) in eager mode (layers call it on every forward pass);
    under ``torch.compile`` built in the graph, where the compiler folds it (no cache for the tracer to distrust)."""
    if torch.compiler.is_compiling():
        return dct_matrix(size, dtype, device)
    return _cached_dct_matrix(size, dtype, device)


def _dct_twiddle(size: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotation e^{−iπk/2N} times the orthonormal scale, as its real and imaginary parts (N,) each. Real tensors
    only, outside the FFT itself: ONNX has no complex tensors, and its exporter carries an FFT's output as
    (real, imaginary) pairs (torch.view_as_real), which is how these functions read it."""
    k = torch.arange(size, dtype=torch.float64, device=device)
    scale = torch.full((size,), math.sqrt(2.0 / size), dtype=torch.float64, device=device)
    scale[0] = math.sqrt(1.0 / size)
    angle = -math.pi * k / (2 * size)
    return (torch.cos(angle) * scale).to(dtype), (torch.sin(angle) * scale).to(dtype)


def dct_fft(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal DCT-II through one length-N complex FFT (Makhoul 1980): reorder x as [x₀, x₂, …, x₃, x₁],
    FFT, rotate by e^{−iπk/2N} and scale (the real part). Same result as ``x @ dct_matrix(N).T`` up to rounding.
    16-bit inputs are transformed in float32 (torch's FFT takes no bfloat16, and float16 only for powers of two on
    CUDA)."""
    size = x.shape[-1]
    if x.numel() == 0:  # MKL's FFT rejects empty batches (e.g. no token routed to DCT mixing)
        return x.clone()
    work = at_least_float32(x)
    reordered = torch.cat([work[..., ::2], work[..., 1::2].flip(-1)], dim=-1)
    spectrum = torch.view_as_real(torch.fft.fft(reordered, dim=-1))  # (..., N, 2)
    cos, sin = _dct_twiddle(size, work.dtype, x.device)
    return (spectrum[..., 0] * cos - spectrum[..., 1] * sin).to(x.dtype)


def idct_fft(X: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`dct_fft` (orthonormal DCT-III) through one length-N complex inverse FFT (in float32 for
    16-bit inputs)."""
    size = X.shape[-1]
    if X.numel() == 0:
        return X.clone()
    work = at_least_float32(X)
    cos, sin = _dct_twiddle(size, work.dtype, X.device)
    # Rebuild the Hermitian-symmetric spectrum V_k = (X_k − i X_{N−k}) / twiddle_k with X_N = 0; 1 / twiddle_k is
    # conj(twiddle_k) / |twiddle_k|², |twiddle_k| being the scale.
    mirrored = torch.cat([torch.zeros_like(work[..., :1]), work[..., 1:].flip(-1)], dim=-1)
    magnitude = cos * cos + sin * sin
    real = (work * cos - mirrored * sin) / magnitude
    imaginary = -(work * sin + mirrored * cos) / magnitude
    spectrum = torch.view_as_complex(torch.stack([real, imaginary], dim=-1))
    reordered = torch.view_as_real(torch.fft.ifft(spectrum, dim=-1))[..., 0].to(X.dtype)
    x = torch.empty_like(X)
    half = (size + 1) // 2
    x[..., ::2] = reordered[..., :half]
    x[..., 1::2] = reordered[..., half:].flip(-1)
    return x


def dct(x: torch.Tensor, implementation: str = "matrix", matrix: torch.Tensor | None = None) -> torch.Tensor:
    """Orthonormal DCT-II of x over its last axis.

    ``implementation="matrix"`` multiplies by the N×N DCT matrix (O(N²) per vector, but one BLAS call);
    ``"fft"`` uses :func:`dct_fft` (O(N log N)). Measured on a 2-core CPU at N = 256
    (``benchmarks/bench_chiar_former.py``, results/benchmarks/chiar_former.md): a plain DCT costs about the same
    either way (0.8-1.2×), and the DCT mixing the model runs (:func:`dct_mixing`, :func:`dct_even_odd`: folded
    filter, one butterfly stage) is 2.3-4× faster in matrix form than through two FFTs. Matrix is the default
    (`ChiarConfig.dct_implementation`). ``matrix`` may be passed in to avoid rebuilding it.
    """
    if implementation == "fft":
        return dct_fft(x)
    if implementation != "matrix":
        raise ValueError(f"unknown DCT implementation {implementation!r}; expected one of {DCT_IMPLEMENTATIONS}")
    if matrix is None:
        matrix = dct_matrix(x.shape[-1], x.dtype, x.device)
    return x @ matrix.T


def idct(X: torch.Tensor, implementation: str = "matrix", matrix: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of :func:`dct` (orthonormal DCT-III) over the last axis."""
    if implementation == "fft":
        return idct_fft(X)
    if implementation != "matrix":
        raise ValueError(f"unknown DCT implementation {implementation!r}; expected one of {DCT_IMPLEMENTATIONS}")
    if matrix is None:
        matrix = dct_matrix(X.shape[-1], X.dtype, X.device)
    return X @ matrix


# ---------------------------------------------------------------------------------------------------------------
# Spectral entropy and DCT mixing
# ---------------------------------------------------------------------------------------------------------------


def spectral_entropy_from_spectrum(spectrum: torch.Tensor, dc_power_scale: float = 1.0) -> torch.Tensor:
    """Normalised spectral entropy H = −Σ_k p_k log p_k / log N, p_k = X_k² / Σ_j X_j², of DCT coefficients X
    (..., N) -> (...), at least float32 (a 16-bit H would move the routing: bfloat16 values near the authors'
    thresholds, 0.855 / 0.865, lie 0.004 apart). H ∈ [0, 1]: 0 when one coefficient holds all the power, 1 for a
    flat power spectrum; a zero vector gets H = 0.

    ``dc_power_scale`` multiplies the k = 0 power before normalising. The authors compute the DCT with an
    unnormalised FFT construction that gives the k = 0 coefficient twice the power of the orthonormal DCT
    (their X_0 misses the 1/√2 factor); ``dc_power_scale=2`` reproduces their entropies, the default 1 is the
    orthonormal definition of SPEC 2.1.
    """
    power = at_least_float32(spectrum).square()
    if dc_power_scale != 1.0:
        power = torch.cat([power[..., :1] * dc_power_scale, power[..., 1:]], dim=-1)
    total = power.sum(-1)
    # Σ p log p = Σ P log P / S − log S with P = X², S = Σ P, the sum as one batched dot product: a few passes
    # over the spectrum instead of seven. log(max(P, tiny)) keeps P log P = 0 and its gradient finite at P = 0.
    log_power = torch.log(power.clamp_min(torch.finfo(power.dtype).tiny))
    with full_precision(power):
        p_log_p = torch.einsum("...k,...k->...", power, log_power)
    nonzero = total > 0
    safe_total = torch.where(nonzero, total, torch.ones_like(total))
    entropy = (torch.log(safe_total) - p_log_p / safe_total) / math.log(spectrum.shape[-1])
    return torch.where(nonzero, entropy.clamp(0.0, 1.0), torch.zeros_like(entropy))


def spectral_entropy(
    x: torch.Tensor, implementation: str = "matrix", dc_power_scale: float = 1.0
) -> torch.Tensor:
    """Normalised spectral entropy of each vector x (..., N) -> (...): :func:`spectral_entropy_from_spectrum`
    of its orthonormal DCT-II."""
    return spectral_entropy_from_spectrum(dct(x, implementation), dc_power_scale)


def dct_filter_matrix(spectral_filter: torch.Tensor, matrix: torch.Tensor | None = None) -> torch.Tensor:
    """The N×N matrix W = Dᵀ diag(f) D with ``x @ W == idct(dct(x) * f)``: DCT mixing folded into one matmul."""
    if matrix is None:
        matrix = dct_matrix(spectral_filter.shape[-1], spectral_filter.dtype, spectral_filter.device)
    return matrix.T @ (spectral_filter[:, None] * matrix)


def _dct_halves(size: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    matrix, half = dct_matrix(size, torch.float64, device), size // 2
    return matrix[0::2, :half].to(dtype).contiguous(), matrix[1::2, :half].to(dtype).contiguous()


@functools.lru_cache(maxsize=32)
def _cached_dct_halves(size: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.inference_mode(False):
        return _dct_halves(size, dtype, device)


def butterfly_dct_halves(size: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The (N/2 × N/2) blocks C_e = D[0::2, :N/2] and C_o = D[1::2, :N/2] of the DCT matrix (N even), cached in eager
    mode as :func:`cached_dct_matrix`."""
    if torch.compiler.is_compiling():
        return _dct_halves(size, dtype, device)
    return _cached_dct_halves(size, dtype, device)


def dct_even_odd(
    x: torch.Tensor, spectral_filter: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """DCT-II coefficients of x (..., N) in even-then-odd order [X_0, X_2, …, X_1, X_3, …] and, given a filter f,
    the DCT mixing iDCT(DCT(x) ⊙ f), through one butterfly stage of the fast DCT.

    Since D[k, N−1−n] = (−1)^k D[k, n], with a = x[:N/2] and b = x[N/2:] reversed, X_{2j} = (a + b)·C_e[j] and
    X_{2j+1} = (a − b)·C_o[j]; the inverse folds the same way. Two (N/2)-wide products replace one N-wide one:
    half the multiply-adds of ``x @ D.T``. The order of the coefficients does not matter to the spectral entropy;
    with a filter both outputs come from the same two products, [X_even | P] = (a + b) [C_eᵀ | C_eᵀ diag(f_e) C_e]
    and likewise for the odd half. Odd N falls back to the full matrix (coefficients then in natural order).
    """
    size = x.shape[-1]
    if size % 2:
        matrix = cached_dct_matrix(size, x.dtype, x.device)
        spectrum = x @ matrix.T
        return spectrum, None if spectral_filter is None else x @ dct_filter_matrix(spectral_filter, matrix).to(x.dtype)
    even, odd = butterfly_dct_halves(size, x.dtype, x.device)
    half = size // 2
    front, back = x[..., :half], x[..., half:].flip(-1)
    sums, differences = front + back, front - back
    if spectral_filter is None:
        return torch.cat([sums @ even.T, differences @ odd.T], dim=-1), None
    spectral_filter = spectral_filter.to(x.dtype)
    even_weights = torch.cat([even.T, even.T @ (spectral_filter[0::2, None] * even)], dim=1)
    odd_weights = torch.cat([odd.T, odd.T @ (spectral_filter[1::2, None] * odd)], dim=1)
    even_spectrum, even_mixed = (sums @ even_weights).chunk(2, dim=-1)
    odd_spectrum, odd_mixed = (differences @ odd_weights).chunk(2, dim=-1)
    mixed = torch.cat([even_mixed + odd_mixed, (even_mixed - odd_mixed).flip(-1)], dim=-1)
    return torch.cat([even_spectrum, odd_spectrum], dim=-1), mixed


def dct_mixing(x: torch.Tensor, spectral_filter: torch.Tensor, implementation: str = "matrix") -> torch.Tensor:
    """The DCT mixing branch iDCT(DCT(x) ⊙ f) over the hidden axis, x (..., N), f (N,) -> (..., N).

    The CHIAR operator is LN(x + iDCT(DCT(x) ⊙ f)) (SPEC 2.1); the residual and the LayerNorm belong to the layer
    (post-LN by default), so this returns the branch only. It acts on each token alone: causal by construction.
    The matrix form applies the folded filter Dᵀ diag(f) D, split by one butterfly stage into two (N/2)-wide
    products (N even): [P + Q, reverse(P − Q)] with P = (a + b) C_eᵀ diag(f_e) C_e, Q = (a − b) C_oᵀ diag(f_o) C_o.
    """
    if implementation != "matrix":
        return idct(dct(x, implementation) * spectral_filter, implementation)
    size = x.shape[-1]
    if size % 2:
        return x @ dct_filter_matrix(spectral_filter, cached_dct_matrix(size, x.dtype, x.device)).to(x.dtype)
    even, odd = butterfly_dct_halves(size, x.dtype, x.device)
    half = size // 2
    front, back = x[..., :half], x[..., half:].flip(-1)
    spectral_filter = spectral_filter.to(x.dtype)
    even_mixed = (front + back) @ (even.T @ (spectral_filter[0::2, None] * even))
    odd_mixed = (front - back) @ (odd.T @ (spectral_filter[1::2, None] * odd))
    return torch.cat([even_mixed + odd_mixed, (even_mixed - odd_mixed).flip(-1)], dim=-1)
