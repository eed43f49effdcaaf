"""Random-feature kernel mixing of CHIAR-Former (SPEC 2.1) as pure tensor functions: random features of the Gaussian
kernel exp(−γ ‖x − y‖²) and the linear (kernel) attention built on them.

* :func:`positive_random_features` (FAVOR+) keep every kernel estimate positive, so the normaliser of kernel
  attention stays positive: :func:`causal_kernel_attention` (prefix sums, causal, O(T·R·d), its running sums are the
  generation cache) and :func:`bidirectional_kernel_attention` (encoders).
* :func:`trigonometric_random_features` and :func:`authors_rbf_mixing` reproduce the authors' unmasked
  softmax(φ φᵀ) v, which reads future tokens: encoders only.

Shapes: B batch, T positions, d value width, R random features (ω is (d_in, R)).
"""

import math

import torch
from torch.nn import functional as F

from .packing import document_starts, wide_dtype
from .precision import at_least_float32, full_precision

RBF_VARIANTS = ("positive", "authors")


def positive_random_features(x: torch.Tensor, omega: torch.Tensor, gamma: float) -> torch.Tensor:
    """Positive random features of the Gaussian kernel (FAVOR+, Choromanski et al. 2021), x (..., d), ω (d, R)
    with columns ~ N(0, 2γ I) -> φ(x) (..., R), φ(x) = exp(ωᵀx − 2γ‖x‖²) / √R, so that
    E[φ(x)·φ(y)] = exp(−γ ‖x − y‖²). Positive features keep the kernel-attention normaliser Σ φ(q)·φ(k) > 0.
    Computed in float32 (the exponent is not scale-free)."""
    x = at_least_float32(x)
    with full_precision(x):
        exponent = x @ omega.to(x.dtype) - 2.0 * gamma * x.square().sum(-1, keepdim=True)
    return torch.exp(exponent) / math.sqrt(omega.shape[-1])


def trigonometric_random_features(x: torch.Tensor, omega: torch.Tensor) -> torch.Tensor:
    """The authors' random Fourier features φ(x) = [cos(xω), sin(xω)] / √R, x (..., d), ω (d, R) -> (..., 2R),
    with E[φ(x)·φ(y)] = exp(−γ ‖x − y‖²) for ω ~ N(0, 2γ I). Not positive: usable only inside a softmax."""
    x = at_least_float32(x)
    with full_precision(x):
        projected = x @ omega.to(x.dtype)
    return torch.cat([projected.cos(), projected.sin()], dim=-1) / math.sqrt(omega.shape[-1])


def kernel_attention_state(phi_k: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Sum over positions of φ(k_j) [v_j, 1]ᵀ: phi_k (B, T, R), values (B, T, d) -> state (B, R, d + 1).
    The last column is the normaliser Σ φ(k_j). Zero rows of phi_k (padding) contribute nothing."""
    augmented = at_least_float32(values)
    augmented = torch.cat([augmented, augmented.new_ones(augmented.shape[:-1] + (1,))], -1)
    with full_precision(augmented):
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
    document_positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal linear (kernel) attention with prefix sums (Katharopoulos et al. 2020):

        out_i = Σ_{j ≤ i} (φ(q_i)·φ(k_j)) v_j / Σ_{j ≤ i} φ(q_i)·φ(k_j),

    phi_q, phi_k (B, T, R), values (B, T, d) -> (out (B, T, d), state (B, R, d + 1)). ``past_state`` is the
    :func:`kernel_attention_state` of every earlier token (generation), the returned state includes the new ones.
    Computed chunk by chunk: the prefix sums are carried between chunks of ``chunk_size`` positions and each chunk
    adds its own masked C × C block, O(T·R·d + T·C·(R + d)) time and O(T/C · R · d) memory instead of a
    (T, R, d) tensor of running sums. Padding keys must have φ(k) = 0.

    ``document_positions`` (B, T), the index of each token in its document of a packed row (``packing.py``; no
    past): each token then reads only the earlier tokens of its own document, and the returned state is that of each
    row's last document. A chunk's tokens of the document that began before it read that document's sums since its
    start: the row's sums before the chunk minus those before the document's first token, in float64.
    """
    if document_positions is not None and past_state is not None:
        raise ValueError("packed documents have no cached past")
    batch, length, features = phi_k.shape
    width = values.shape[-1] + 1
    dtype = torch.promote_types(at_least_float32(values).dtype, phi_k.dtype)
    state = phi_k.new_zeros(batch, features, width, dtype=dtype) if past_state is None else past_state.to(dtype)
    phi_q, phi_k = phi_q.to(dtype), phi_k.to(dtype)
    augmented = torch.cat([values.to(dtype), phi_k.new_ones(batch, length, 1)], dim=-1)
    if document_positions is None and not isinstance(length, int) and torch.compiler.is_exporting():
        return _running_sums_kernel_attention(phi_q, phi_k, augmented, state, eps, values.dtype)
    chunks = -(-length // chunk_size)
    padded = chunks * chunk_size - length
    if padded:
        phi_q, phi_k, augmented = (F.pad(t, (0, 0, 0, padded)) for t in (phi_q, phi_k, augmented))
    phi_q = phi_q.view(batch, chunks, chunk_size, features)
    phi_k = phi_k.view(batch, chunks, chunk_size, features)
    augmented = augmented.view(batch, chunks, chunk_size, width)

    with full_precision(augmented):  # the prefix sums a cache carries over every later step stay float32
        chunk_states = phi_k.transpose(-1, -2) @ augmented  # (B, n, R, d + 1)
        causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=phi_q.device).tril()
        scores = phi_q @ phi_k.transpose(-1, -2)
        if document_positions is not None:
            return _documents_kernel_attention(
                phi_q, phi_k, augmented, chunk_states, scores, causal, document_positions, length, eps, values.dtype
            )
        running = torch.cumsum(chunk_states, dim=1)
        before_chunk = torch.cat([torch.zeros_like(running[:, :1]), running[:, :-1]], dim=1) + state[:, None]
        summed = phi_q @ before_chunk + scores.masked_fill(~causal, 0.0) @ augmented
    out = _read_out(summed.view(batch, chunks * chunk_size, width)[:, :length], eps)
    return out.to(values.dtype), state + running[:, -1]


def _running_sums_kernel_attention(phi_q, phi_k, augmented, state, eps, dtype):
    """`causal_kernel_attention` with a running sum per token, (B, T, R, d + 1) memory, for torch.export with a
    dynamic length: a count of chunks is a floor division of the length, which export's shape checks cannot keep
    symbolic (they specialise the program to one count of chunks), and the same sums computed in another order agree
    with the chunked ones to rounding."""
    with full_precision(augmented):
        running = torch.cumsum(phi_k[..., :, None] * augmented[..., None, :], dim=1) + state[:, None]  # (B, T, R, W)
        summed = (phi_q[..., None, :] @ running).squeeze(-2)
    return _read_out(summed, eps).to(dtype), running[:, -1]


def _documents_kernel_attention(
    phi_q, phi_k, augmented, chunk_states, scores, causal, document_positions, length, eps, dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """`causal_kernel_attention` of packed rows, from its chunked tensors ((B, n, C, ·), chunk states (B, n, R, W),
    within-chunk scores (B, n, C, C)); see its docstring."""
    batch, chunks, chunk_size, _ = phi_q.shape
    starts = document_starts(document_positions)  # (B, T): where each token's document begins
    # Positions past the row end (chunk padding) are documents of their own, which no token reads.
    starts = F.pad(starts, (0, chunks * chunk_size - length), value=length).view(batch, chunks, chunk_size)
    same_document = starts[..., :, None] == starts[..., None, :]
    running = torch.cumsum(chunk_states.to(wide_dtype(chunk_states.device)), dim=1)
    before_chunk = torch.cat([torch.zeros_like(running[:, :1]), running[:, :-1]], dim=1)

    def sums_before(positions: torch.Tensor) -> torch.Tensor:
        """Σ_{j < p} φ(k_j) [v_j, 1]ᵀ over the row for positions p (B, m) < T -> (B, m, R, W), float64."""
        chunk = positions.div(chunk_size, rounding_mode="floor")
        gathered = [t.gather(1, chunk[:, :, None, None].expand(-1, -1, *t.shape[2:])) for t in (phi_k, augmented)]
        inside = torch.arange(chunk_size, device=positions.device) < (positions - chunk * chunk_size)[..., None]
        partial = (gathered[0] * inside[..., None]).transpose(-1, -2) @ gathered[1]
        return before_chunk.gather(1, chunk[:, :, None, None].expand(-1, -1, *running.shape[2:])) + partial

    first = starts[..., 0]  # the document each chunk begins in
    carried = (before_chunk - sums_before(first)).to(phi_q.dtype)  # its sums from its start to the chunk's
    reads_carried = (starts == first[..., None])[..., None]
    summed = (phi_q @ carried) * reads_carried + scores.masked_fill(~(causal & same_document), 0.0) @ augmented
    out = _read_out(summed.view(batch, chunks * chunk_size, -1)[:, :length], eps)
    last_document = (running[:, -1:] - sums_before(starts.view(batch, -1)[:, length - 1 : length]))[:, 0]
    return out.to(dtype), last_document.to(phi_q.dtype)


def bidirectional_kernel_attention(
    phi_q: torch.Tensor, phi_k: torch.Tensor, values: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """Unmasked linear kernel attention out_i = Σ_j (φ(q_i)·φ(k_j)) v_j / Σ_j φ(q_i)·φ(k_j) over all positions
    (encoders), O(T·R·d). Shapes as in :func:`causal_kernel_attention`; padding keys must have φ(k) = 0."""
    state = kernel_attention_state(phi_k, values)
    with full_precision(state):
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
