"""Pure tensor operations of CHIAR-Former (SPEC 2.1): DCT, spectral entropy, DCT mixing, random-feature kernel
mixing, rotary positions, routing and the index bookkeeping of sparse (gathered-query) attention.

Every function works on the last axis as the hidden axis and on any leading shape unless its docstring gives
shapes. Nothing here holds parameters; the modules of ``modeling_chiar_former.py`` own them.
"""

import functools
import math

import torch
from torch.nn import functional as F

DCT_IMPLEMENTATIONS = ("matrix", "fft")


def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    """Half-precision inputs are promoted for the exponentials, logs and sums; float64 stays float64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


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
def cached_dct_matrix(size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """:func:`dct_matrix`, built once per (size, dtype, device): layers call it on every forward pass."""
    return dct_matrix(size, dtype, device)


def _dct_twiddle(size: int, dtype: torch.dtype, device) -> torch.Tensor:
    k = torch.arange(size, dtype=torch.float64, device=device)
    scale = torch.full((size,), math.sqrt(2.0 / size), dtype=torch.float64, device=device)
    scale[0] = math.sqrt(1.0 / size)
    return (torch.polar(torch.ones_like(k), -math.pi * k / (2 * size)) * scale).to(
        torch.complex128 if dtype == torch.float64 else torch.complex64
    )


def dct_fft(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal DCT-II through one length-N complex FFT (Makhoul 1980): reorder x as [x₀, x₂, …, x₃, x₁],
    FFT, rotate by e^{−iπk/2N} and scale. Same result as ``x @ dct_matrix(N).T`` up to rounding."""
    size = x.shape[-1]
    if x.numel() == 0:  # MKL's FFT rejects empty batches (e.g. no token routed to DCT mixing)
        return x.clone()
    reordered = torch.cat([x[..., ::2], x[..., 1::2].flip(-1)], dim=-1)
    spectrum = torch.fft.fft(reordered, dim=-1)
    return (spectrum * _dct_twiddle(size, x.dtype, x.device)).real.to(x.dtype)


def idct_fft(X: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`dct_fft` (orthonormal DCT-III) through one length-N complex inverse FFT."""
    size = X.shape[-1]
    if X.numel() == 0:
        return X.clone()
    twiddle = _dct_twiddle(size, X.dtype, X.device)
    # Rebuild the Hermitian-symmetric spectrum V_k = (X_k − i X_{N−k}) / twiddle_k with X_N = 0.
    mirrored = torch.cat([torch.zeros_like(X[..., :1]), X[..., 1:].flip(-1)], dim=-1)
    spectrum = torch.complex(X, -mirrored) / twiddle
    reordered = torch.fft.ifft(spectrum, dim=-1).real.to(X.dtype)
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
    (..., N) -> (...). H ∈ [0, 1]: 0 when one coefficient holds all the power, 1 for a flat power spectrum;
    a zero vector gets H = 0.

    ``dc_power_scale`` multiplies the k = 0 power before normalising. The authors compute the DCT with an
    unnormalised FFT construction that gives the k = 0 coefficient twice the power of the orthonormal DCT
    (their X_0 misses the 1/√2 factor); ``dc_power_scale=2`` reproduces their entropies, the default 1 is the
    orthonormal definition of SPEC 2.1.
    """
    power = _at_least_float32(spectrum).square()
    if dc_power_scale != 1.0:
        power = torch.cat([power[..., :1] * dc_power_scale, power[..., 1:]], dim=-1)
    total = power.sum(-1)
    # Σ p log p = Σ P log P / S − log S with P = X², S = Σ P, the sum as one batched dot product: a few passes
    # over the spectrum instead of seven. log(max(P, tiny)) keeps P log P = 0 and its gradient finite at P = 0.
    log_power = torch.log(power.clamp_min(torch.finfo(power.dtype).tiny))
    p_log_p = torch.einsum("...k,...k->...", power, log_power)
    nonzero = total > 0
    safe_total = torch.where(nonzero, total, torch.ones_like(total))
    entropy = (torch.log(safe_total) - p_log_p / safe_total) / math.log(spectrum.shape[-1])
    return torch.where(nonzero, entropy.clamp(0.0, 1.0), torch.zeros_like(entropy)).to(spectrum.dtype)


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


@functools.lru_cache(maxsize=32)
def butterfly_dct_halves(size: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The (N/2 × N/2) blocks C_e = D[0::2, :N/2] and C_o = D[1::2, :N/2] of the DCT matrix (N even)."""
    matrix, half = dct_matrix(size, torch.float64, device), size // 2
    return matrix[0::2, :half].to(dtype).contiguous(), matrix[1::2, :half].to(dtype).contiguous()


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


# ---------------------------------------------------------------------------------------------------------------
# RBF kernel mixing: random features of the Gaussian kernel exp(−γ ‖x − y‖²)
# ---------------------------------------------------------------------------------------------------------------


def positive_random_features(x: torch.Tensor, omega: torch.Tensor, gamma: float) -> torch.Tensor:
    """Positive random features of the Gaussian kernel (FAVOR+, Choromanski et al. 2021), x (..., d), ω (d, R)
    with columns ~ N(0, 2γ I) -> φ(x) (..., R), φ(x) = exp(ωᵀx − 2γ‖x‖²) / √R, so that
    E[φ(x)·φ(y)] = exp(−γ ‖x − y‖²). Positive features keep the kernel-attention normaliser Σ φ(q)·φ(k) > 0.
    Computed in float32 (the exponent is not scale-free)."""
    x = _at_least_float32(x)
    exponent = x @ omega.to(x.dtype) - 2.0 * gamma * x.square().sum(-1, keepdim=True)
    return torch.exp(exponent) / math.sqrt(omega.shape[-1])


def trigonometric_random_features(x: torch.Tensor, omega: torch.Tensor) -> torch.Tensor:
    """The authors' random Fourier features φ(x) = [cos(xω), sin(xω)] / √R, x (..., d), ω (d, R) -> (..., 2R),
    with E[φ(x)·φ(y)] = exp(−γ ‖x − y‖²) for ω ~ N(0, 2γ I). Not positive: usable only inside a softmax."""
    x = _at_least_float32(x)
    projected = x @ omega.to(x.dtype)
    return torch.cat([projected.cos(), projected.sin()], dim=-1) / math.sqrt(omega.shape[-1])


def kernel_attention_state(phi_k: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Sum over positions of φ(k_j) [v_j, 1]ᵀ: phi_k (B, T, R), values (B, T, d) -> state (B, R, d + 1).
    The last column is the normaliser Σ φ(k_j). Zero rows of phi_k (padding) contribute nothing."""
    augmented = _at_least_float32(values)
    augmented = torch.cat([augmented, augmented.new_ones(augmented.shape[:-1] + (1,))], -1)
    return phi_k.to(augmented.dtype).transpose(1, 2) @ augmented


def _read_out(numerator_and_normaliser: torch.Tensor, eps: float) -> torch.Tensor:
    return numerator_and_normaliser[..., :-1] / (numerator_and_normaliser[..., -1:] + eps)


def causal_kernel_attention(
    phi_q: torch.Tensor,
    phi_k: torch.Tensor,
    values: torch.Tensor,
    past_state: torch.Tensor | None = None,
    chunk_size: int = 64,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal linear (kernel) attention with prefix sums (Katharopoulos et al. 2020):

        out_i = Σ_{j ≤ i} (φ(q_i)·φ(k_j)) v_j / Σ_{j ≤ i} φ(q_i)·φ(k_j),

    phi_q, phi_k (B, T, R), values (B, T, d) -> (out (B, T, d), state (B, R, d + 1)). ``past_state`` is the
    :func:`kernel_attention_state` of every earlier token (generation), the returned state includes the new ones.
    Computed chunk by chunk: the prefix sums are carried between chunks of ``chunk_size`` positions and each chunk
    adds its own masked C × C block, O(T·R·d + T·C·(R + d)) time and O(T/C · R · d) memory instead of a
    (T, R, d) tensor of running sums. Padding keys must have φ(k) = 0.
    """
    batch, length, features = phi_k.shape
    width = values.shape[-1] + 1
    dtype = torch.promote_types(_at_least_float32(values).dtype, phi_k.dtype)
    state = phi_k.new_zeros(batch, features, width, dtype=dtype) if past_state is None else past_state.to(dtype)
    chunks = -(-length // chunk_size)
    padded = chunks * chunk_size - length
    phi_q, phi_k = phi_q.to(dtype), phi_k.to(dtype)
    augmented = torch.cat([values.to(dtype), phi_k.new_ones(batch, length, 1)], dim=-1)
    if padded:
        phi_q, phi_k, augmented = (F.pad(t, (0, 0, 0, padded)) for t in (phi_q, phi_k, augmented))
    phi_q = phi_q.view(batch, chunks, chunk_size, features)
    phi_k = phi_k.view(batch, chunks, chunk_size, features)
    augmented = augmented.view(batch, chunks, chunk_size, width)

    chunk_states = phi_k.transpose(-1, -2) @ augmented  # (B, n, R, d + 1)
    running = torch.cumsum(chunk_states, dim=1)
    before_chunk = torch.cat([torch.zeros_like(running[:, :1]), running[:, :-1]], dim=1) + state[:, None]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=phi_q.device).tril()
    scores = (phi_q @ phi_k.transpose(-1, -2)).masked_fill(~causal, 0.0)
    summed = phi_q @ before_chunk + scores @ augmented
    out = _read_out(summed.view(batch, chunks * chunk_size, width)[:, :length], eps)
    return out.to(values.dtype), state + running[:, -1]


def bidirectional_kernel_attention(
    phi_q: torch.Tensor, phi_k: torch.Tensor, values: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """Unmasked linear kernel attention out_i = Σ_j (φ(q_i)·φ(k_j)) v_j / Σ_j φ(q_i)·φ(k_j) over all positions
    (encoders), O(T·R·d). Shapes as in :func:`causal_kernel_attention`; padding keys must have φ(k) = 0."""
    state = kernel_attention_state(phi_k, values)
    return _read_out(phi_q.to(state.dtype) @ state, eps).to(values.dtype)


def authors_rbf_mixing(phi: torch.Tensor, values: torch.Tensor, key_valid: torch.Tensor | None = None) -> torch.Tensor:
    """The authors' RBF mixing softmax(φ φᵀ) v over all tokens, phi (B, T, 2R), values (B, T, d) -> (B, T, d).

    Every token reads every other token, including later ones: **not causal**, for bidirectional encoders only.
    ``key_valid`` (B, T) excludes padding keys.
    """
    scores = phi @ phi.transpose(1, 2)
    if key_valid is not None:
        allowed = key_valid[:, None, :] | torch.eye(phi.shape[1], dtype=torch.bool, device=phi.device)  # no empty row
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    return (torch.softmax(scores, dim=-1) @ values.to(phi.dtype)).to(values.dtype)


# ---------------------------------------------------------------------------------------------------------------
# Rotary position embedding
# ---------------------------------------------------------------------------------------------------------------


def rotary_phases(position_ids: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    """RoPE phases e^{i p θ_j}, θ_j = theta^(−2j / head_dim), for integer positions (B, T) -> complex (B, T, head_dim/2)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim))
    angles = position_ids[..., None].float() * inv_freq
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary(x: torch.Tensor, phases: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """Rotate each channel pair (x_{2j}, x_{2j+1}) of x (B, T, heads, head_dim) by the phases (B, T, head_dim/2)
    (RoFormer, Su et al. 2021, in its complex form): q·k then depends on positions only through their difference.
    One complex multiply instead of the rotate-half formulation's four elementwise passes.

    ``in_place``: rotate x's own memory and return x, where x is float32 with adjacent channel pairs (else a new
    tensor as without it). For a projection's fresh output, which nothing else reads, this saves allocating and
    writing a second tensor of its size."""
    if in_place and x.dtype == torch.float32 and x.stride(-1) == 1 and x.storage_offset() % 2 == 0 and all(
        stride % 2 == 0 for stride in x.stride()[:-1]
    ):
        torch.view_as_complex(x.unflatten(-1, (-1, 2))).mul_(phases[:, :, None])
        return x
    pairs = torch.view_as_complex(x.float().contiguous().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * phases[:, :, None]).flatten(-2).to(x.dtype)


# ---------------------------------------------------------------------------------------------------------------
# Routing
# ---------------------------------------------------------------------------------------------------------------


def threshold_routes(entropy: torch.Tensor, thresholds: list[float]) -> torch.Tensor:
    """Operator index per token from its spectral entropy (SPEC 2.1), operators ordered from low to high entropy.

    One threshold τ_mid: 1 (e.g. attention) if H > τ_mid, else 0 (DCT). Two thresholds τ_lo ≤ τ_hi:
    0 if H < τ_lo, 1 if τ_lo ≤ H ≤ τ_hi, 2 if H > τ_hi. (...) -> (...) long.
    """
    if len(thresholds) == 1:
        return (entropy > thresholds[0]).long()
    if len(thresholds) == 2:
        return (entropy >= thresholds[0]).long() + (entropy > thresholds[1]).long()
    raise ValueError(f"threshold routing takes 1 or 2 thresholds, got {len(thresholds)}")


def straight_through_gate(probabilities: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
    """Straight-through gate of the chosen operator, g = 1 + p_r − sg(p_r): exactly 1 in the forward pass,
    ∂g/∂p_r = 1 backwards. probabilities (..., K), routes (...) -> (...).

    Multiplying only the chosen operator's output by g is what lets a hard-routed layer skip the other
    operators; it equals the dense one-hot formulation Σ_k onehot_k (1 + p_k − sg(p_k)) op_k, in value and in
    gradient, since the one-hot factor zeroes every other term. (The Gumbel-style estimator onehot − sg(p) + p
    would need every operator's output for every token, i.e. no compute saving in training.)
    """
    chosen = probabilities.gather(-1, routes[..., None])[..., 0]
    return 1.0 + chosen - chosen.detach()


def one_hot_gates(probabilities: torch.Tensor | None, routes: torch.Tensor, num_operators: int) -> torch.Tensor:
    """Dense gates (..., K) of the one-hot-select formulation: onehot(route), times the straight-through factor
    1 + p − sg(p) when router probabilities exist (hard routing)."""
    gates = F.one_hot(routes, num_operators).float()
    if probabilities is not None:
        gates = gates * (1.0 + probabilities - probabilities.detach())
    return gates


def usage_entropy_penalty(probabilities: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """log K − H(ū), ū = mean router probabilities over the (valid) tokens of the batch, probabilities (B, T, K).

    Zero when the operators are used equally, log K when one takes everything; adding λ times it to the loss
    counters routing collapse. A training loss only: the route of a token never depends on this batch average.
    """
    if valid is None:
        usage = probabilities.reshape(-1, probabilities.shape[-1]).mean(0)
    else:
        weights = valid.to(probabilities.dtype)[..., None]
        usage = (probabilities * weights).sum((0, 1)) / weights.sum().clamp_min(1.0)
    entropy = -(usage * torch.log(usage.clamp_min(torch.finfo(usage.dtype).tiny))).sum()
    return math.log(probabilities.shape[-1]) - entropy


# ---------------------------------------------------------------------------------------------------------------
# Sparse execution: gathering the tokens routed to one operator
# ---------------------------------------------------------------------------------------------------------------


def gathered_query_mask(
    query_slots: torch.Tensor,
    key_valid: torch.Tensor | None,
    is_causal: bool,
    dtype: torch.dtype,
    key_length: int | None = None,
) -> torch.Tensor | None:
    """Additive attention mask (B, 1, M, S) for gathered queries at key slots ``query_slots`` (B, M) against the
    first S keys (S = ``key_length`` or all of ``key_valid`` (B, ≥ S)): a query sees the valid keys at slots ≤ its
    own (all valid keys when not causal). With padding, a query also sees its own slot, so that padding queries never
    get an empty row. None when nothing is masked (bidirectional, no padding)."""
    if key_length is None:
        key_length = key_valid.shape[1]
    key_slots = torch.arange(key_length, device=query_slots.device)
    if key_valid is None:
        if not is_causal:
            return None
        # Keys before the earliest query are visible to every query: only the staircase after it needs a comparison.
        first = int(query_slots.min())
        mask = torch.zeros(query_slots.shape[0], 1, query_slots.shape[1], key_length, dtype=dtype, device=query_slots.device)
        blocked = key_slots[first:] > query_slots[..., None]
        mask[:, 0, :, first:].masked_fill_(blocked, torch.finfo(dtype).min)
        return mask
    else:
        blocked = ~key_valid[:, None, :key_length]
        if is_causal:
            blocked = blocked | (key_slots > query_slots[..., None])
        blocked = blocked & (key_slots != query_slots[..., None])
    minimum = torch.tensor(torch.finfo(dtype).min, dtype=dtype, device=blocked.device)
    return torch.where(blocked, minimum, torch.zeros((), dtype=dtype, device=blocked.device))[:, None]


def query_chunks(query_slots: torch.Tensor, min_chunk: int = 64, max_chunks: int = 8) -> list[tuple[int, int, int]]:
    """Split gathered, position-ordered causal queries (B, M) into chunks that each need only a prefix of the keys:
    [(start, end, number of keys)], the key prefix reaching the chunk's last query slot. Attending chunk by chunk
    skips most of the future keys a single masked call would compute, ≈ (1 + 1/n) / 2 of the work with n chunks."""
    width = query_slots.shape[1]
    count = max(1, min(max_chunks, width // min_chunk))
    bounds = [round(i * width / count) for i in range(count + 1)]
    # Rows end with padding queries at a low slot, so take the largest slot of the whole chunk, not its last one.
    chunk_max = torch.stack([query_slots[:, start:end].amax() for start, end in zip(bounds[:-1], bounds[1:])])
    return [(start, end, last + 1) for start, end, last in zip(bounds[:-1], bounds[1:], chunk_max.tolist())]
