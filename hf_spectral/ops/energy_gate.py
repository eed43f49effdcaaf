"""Energy gate (SPEC 1.1-1.3): per-key energies, their normalisation, and the gate as a log-logit bias.

The gate of head h on key j is g_j = Σ_s softmax(m)_s σ(α_s (ẽ_j,s − τ_s)), with ẽ the normalised energy of the
key's input x_j at scale s. Gating then renormalising the attention probabilities,
Â_ij = A_ij g_j / Σ_k A_ik g_k, equals softmax_j(s_ij + log g_j): the gate is an additive, query-independent
per-key logit bias, and no T×T gated matrix is ever built (``gated_attention.py`` adds the bias inside the
attention backends).

This file holds the pure tensor functions and the ``EnergyGate`` module that owns the gate's parameters:

* energies: linear (EGA-1/2/4), causal convolution (EGA-C), one-sided Morlet filters (EGA-M, EGA-M-F),
  Daubechies high-pass filters (EGA-DB2/DB4; PyWavelets, imported only when those are built);
* statistics: ``causal`` (running moments over the valid prefix: one function, ``causal_zscore``, serves the full
  pass and every cached step), ``window`` (over the whole sequence: sees the future) and ``none``;
* the log-gate bias, exactly 0 when α = 0, so that a fresh gate is an exact identity;
* what a KV cache must keep per key so that a later step continues exactly where the full pass would be: the
  running count, mean and M2 (``causal``) or the raw energies (``window``), float32 whatever the activation dtype,
  and the filter history of the convolutional energies (the cache layers that hold them: ``gate_cache.py``).

Dropout: the bias form gates and renormalises *before* attention dropout (dropout then acts on the gated
probabilities); the authors gate after dropout. The two agree exactly when attention dropout is 0.

Shapes: B batch, H gate heads, S energy scales, T positions, C hidden size.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from .packing import document_cumsum, document_starts, document_totals
from .positions import host_reads_are_free, padding_of_causal_mask
from .precision import as_dtype, at_least_float32

NORMALIZATIONS = ("causal", "window", "none")
ENERGY_KINDS = ("linear", "conv", "morlet", "db2", "db4")
DEFAULT_ENERGY_NORM_EPS = 1e-5
DEFAULT_KERNEL_SIZES = (3, 7, 15, 31)  # EGA-C and EGA-M scales (SPEC 1.3)
DEFAULT_DILATIONS = (1, 2, 4, 8)  # EGA-DB2 / EGA-DB4 dyadic dilations (SPEC 1.3)


def default_scales(kind: str) -> list[int] | None:
    """The scales an energy kind uses unless configured: kernel lengths (conv, Morlet), dilations (Daubechies);
    ``None`` for kinds without scales (linear) and unknown kinds (which the configs reject)."""
    if kind in ("conv", "morlet"):
        return list(DEFAULT_KERNEL_SIZES)
    if kind in ("db2", "db4"):
        return list(DEFAULT_DILATIONS)
    return None


# ----------------------------------------------------------------------------------------------------------------
# Statistics
# ----------------------------------------------------------------------------------------------------------------


def causal_zscore(
    energy: torch.Tensor,
    weight: torch.Tensor | None = None,
    past: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    eps: float = 1e-5,
    document_positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal z-scores from running moments: position j uses the mean and unbiased std of the valid energies at
    positions ≤ j (z = 0 while fewer than two were seen, and at padding).

    The same arithmetic serves a whole sequence and one cached decoding step. Values are shifted by a reference
    before the running sums — the first valid energy of the chunk while no token was seen, the running mean after —
    which keeps Σx² − (Σx)²/n clear of cancellation when |mean| ≫ std; for one new position after a past it is
    exactly Welford's update.

    Args:
        energy: (B, H, S, T) float32 energies of the new positions.
        weight: (B, 1, 1, T) float 1 at tokens, 0 at padding; ``None`` when every position is a token.
        past: ``(count (B, H, 1, 1), mean (B, H, S, 1), m2 (B, H, S, 1))`` after all earlier positions (what
            this function returned at the last of them), or ``None`` at the start of a sequence.
        eps: lower bound on the standard deviation.
        document_positions: (B, T) index of each position in its own document of a packed row
            (``packing.py``): the moments restart at every document. Packed rows have no padding and no past.

    Returns:
        z (B, H, S, T), and the running count (B, H, 1, T), mean and M2 (B, H, S, T) at each position — the state
        a later step continues from. All float32.
    """
    if document_positions is not None:
        if weight is not None or past is not None:
            raise ValueError("the statistics of packed documents take no padding weights and no cached past")
        return _document_causal_zscore(energy, document_positions, eps)
    length = energy.shape[-1]
    past_count, past_mean, past_m2 = past if past is not None else (None, None, None)
    if past is not None and length == 1 and weight is None:  # a decoding step after tokens: Welford's update
        count = past_count + 1
        delta = energy - past_mean
        mean = torch.addcdiv(past_mean, delta, count)
        centred = energy - mean
        m2 = torch.addcmul(past_m2, delta, centred)  # ≥ 0 up to rounding, which the eps floor below covers
        std = (m2 / (count - 1).clamp(min=1)).clamp(min=eps * eps).sqrt()
        return centred / std, count, mean, m2
    if weight is None:  # every position is a token: no masking, counts are 1, 2, … (what weights of 1 would give)
        count = torch.arange(1, length + 1, device=energy.device, dtype=energy.dtype) if length > 1 or past is None else 1
        # After a past of tokens its mean is the reference (a past of padding only would have the defined mean 0).
        shift = energy[..., :1] if past is None else past_mean
    else:
        count = weight.cumsum(-1)
        shift = energy.gather(-1, weight.argmax(-1, keepdim=True).expand(*energy.shape[:-1], 1))  # first token
        if past is not None:  # the past's mean once it holds a token
            shift = torch.where(past_count > 0, past_mean, shift)
    if past is not None:  # shifted by the past's mean, the past adds only its count and M2 (Chan's merge)
        count = past_count + count
    x = energy - shift if weight is None else (energy - shift) * weight
    s1, s2 = (x, x.square()) if length == 1 else (x.cumsum(-1), x.square().cumsum(-1))  # one step: no cumsum to run
    running_mean = s1 / (count if weight is None else count.clamp(min=1))  # of the shifted values; count ≥ 1 unpadded
    m2 = torch.addcmul(s2 if past is None else past_m2 + s2, s1, running_mean, value=-1).clamp(min=0)
    std = (m2 / (count - 1).clamp(min=1)).clamp(min=eps * eps).sqrt()
    # At a first token x equals its running mean exactly (x / 1), so z = 0 there without a test; padding is masked.
    z = (x - running_mean) / std if weight is None else (x - running_mean) / std * (weight > 0)
    mean = shift + running_mean
    if weight is not None:  # no token yet: a defined state, whatever the chunking
        mean = torch.where(count > 0, mean, 0.0)
    return z, count.expand(*energy.shape[:2], 1, length), mean, m2


def _document_causal_zscore(energy: torch.Tensor, document_positions: torch.Tensor, eps: float):
    """`causal_zscore` of packed rows, the moments restarting at every document: each document shifted by its own
    first energy, its running sums taken from the row's (``packing.document_cumsum``)."""
    length = energy.shape[-1]
    starts = document_starts(document_positions)[:, None, None, :]
    shift = energy.gather(-1, starts.expand(energy.shape))  # the first energy of each position's document
    x = energy - shift
    count = (document_positions + 1)[:, None, None, :].to(energy.dtype)
    s1, s2 = document_cumsum(x, document_positions), document_cumsum(x.square(), document_positions)
    running_mean = s1 / count
    m2 = torch.addcmul(s2, s1, running_mean, value=-1).clamp(min=0)
    std = (m2 / (count - 1).clamp(min=1)).clamp(min=eps * eps).sqrt()
    return (x - running_mean) / std, count.expand(*energy.shape[:2], 1, length), shift + running_mean, m2


def window_zscore(
    energy: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-5,
    document_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """The authors' statistics: every position uses the mean and unbiased std of all valid positions of its row
    (which sees the future). energy (B, H, S, T) float32, weight (B, 1, 1, T) or ``None``; returns z, 0 at padding.
    ``document_positions`` (B, T) (packed rows, no padding): the window of a position is its own document."""
    if document_positions is not None:
        if weight is not None:
            raise ValueError("the statistics of packed documents take no padding weights")
        count = document_totals(torch.ones_like(energy[:, :1, :1]), document_positions)
        mean = document_totals(energy, document_positions) / count
        variance = document_totals((energy - mean).square(), document_positions) / (count - 1).clamp(min=1)
        return (energy - mean) / variance.clamp(min=eps * eps).sqrt() * (count >= 2)
    if weight is None:
        weight = energy.new_ones(1, 1, 1, energy.shape[-1])
    count = weight.sum(-1, keepdim=True)
    mean = (energy * weight).sum(-1, keepdim=True) / count.clamp(min=1)
    variance = ((energy - mean).square() * weight).sum(-1, keepdim=True) / (count - 1).clamp(min=1)
    return (energy - mean) / variance.clamp(min=eps * eps).sqrt() * ((count >= 2) & (weight > 0))


def token_weight(valid: torch.Tensor | None) -> torch.Tensor | None:
    """(B, T) bool padding mask -> (B, 1, 1, T) float32 weights broadcasting against (B, H, S, T)."""
    return None if valid is None else valid[:, None, None, :].float()


def normalize_energy(
    energy: torch.Tensor,
    valid: torch.Tensor | None = None,
    mode: str = "causal",
    eps: float = 1e-5,
    document_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """z-normalise energies (B, H, S, T) along time, ignoring padding (``valid`` (B, T) bool, False at padding).

    ``mode``: ``"causal"`` (``causal_zscore``: no later token can change a position), ``"window"``
    (``window_zscore``: sees the future) or ``"none"`` (energies unchanged). Returns float32, 0 at padding.
    ``document_positions`` (B, T): packed rows, each document normalised on its own.
    """
    energy, weight = at_least_float32(energy), token_weight(valid)
    if mode == "causal":
        return causal_zscore(energy, weight, eps=eps, document_positions=document_positions)[0]
    if mode == "window":
        return window_zscore(energy, weight, eps, document_positions)
    if mode == "none":
        return energy if weight is None else energy * weight
    raise ValueError(f"unknown energy normalisation {mode!r}; expected one of {NORMALIZATIONS}")


# ----------------------------------------------------------------------------------------------------------------
# The gate
# ----------------------------------------------------------------------------------------------------------------


def log_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """log σ(x) as −softplus(−x): in torch within one float32 rounding of F.logsigmoid (relative 2e-7), and it
    exports to ONNX's Softplus, which onnxruntime computes stably, where the export of F.logsigmoid loses digits far
    from 0 (2e-5 in the logits of a window-statistics gate). Exactly 0 − 0 at α = 0, as before: a fresh gate stays
    the identity."""
    return -F.softplus(-x)


def log_gate_bias(
    z: torch.Tensor, tau: torch.Tensor, alpha: torch.Tensor, mix_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate values and their log as an attention-logit bias.

    Args:
        z: (B, H, S, T) normalised energies.
        tau, alpha, mix_logits: (H, S) thresholds, slopes and scale-mixing logits.

    Returns:
        bias: (B, H, T) float32, log g_j − log g(ẽ = 0). The subtracted per-head constant does not change the
            softmax; it makes the bias 0 when α = 0, and for a head whose α are all exactly 0 the bias is exactly 0
            (one scale: both terms are logsigmoid(±0); several: the mixture's rounding residue is subtracted as a
            constant, so gradients still reach α): a fresh gate is an exact identity on any CPU.
        gate: (B, H, T) the gate values g_j ∈ (0, 1).
    """
    if z.shape[-2] == 1:  # one scale: the mixture is the gate itself, and α = 0 gives logsigmoid(±0) twice: bias 0
        alpha, tau = as_dtype(alpha, z.dtype), as_dtype(tau, z.dtype)  # (H, 1), broadcasting against (B, H, T)
        log_gate = log_sigmoid(alpha * (z[:, :, 0] - tau))
        bias = log_gate - log_sigmoid(alpha * -tau)
        if torch.is_grad_enabled() and mix_logits.requires_grad:
            # log_softmax of one logit is exactly 0 (x − x): the bias keeps its bits, and the mixing logit stays in
            # the graph with its zero gradient, which DistributedDataParallel (find_unused_parameters=False) needs.
            bias = bias + torch.log_softmax(as_dtype(mix_logits, z.dtype), dim=-1)
        return bias, log_gate.exp()
    alpha, tau = as_dtype(alpha, z.dtype)[..., None], as_dtype(tau, z.dtype)[..., None]  # (H, S, 1)
    log_mix = torch.log_softmax(as_dtype(mix_logits, z.dtype), dim=-1)[..., None]
    log_gate = torch.logsumexp(log_mix + log_sigmoid(alpha * (z - tau)), dim=-2)  # (B, H, T)
    log_gate_at_mean = torch.logsumexp(log_mix + log_sigmoid(alpha * -tau), dim=-2)  # (H, 1)
    bias = log_gate - log_gate_at_mean
    identity = (alpha == 0).all(dim=-2)  # (H, 1): every scale of the head has α = 0
    return bias - bias.detach() * identity, log_gate.exp()


# ----------------------------------------------------------------------------------------------------------------
# Generation
# ----------------------------------------------------------------------------------------------------------------


def check_generation_mode(normalization: str, generation_mode: str, generation_config, model_name: str) -> None:
    """Refuse the decodings that would feed a model whose gates use ``window`` statistics other tokens per call
    than plain decoding does. Assisted and prompt-lookup decoding (``generation_mode`` "assisted_generation") score
    several draft tokens in one cached call and take each draft position's logits for those plain decoding would
    give there; a chunked prefill (``generation_config.prefill_chunk_size``) runs the prompt in several calls.
    Window statistics normalise every key over all positions of a call, so a draft position's gate would see the
    drafts after it, and a chunk's gates would not see the later chunks: the tokens would differ from plain
    decoding's without any sign."""
    if normalization != "window":
        return
    if generation_mode == "assisted_generation":
        raise ValueError(
            f"{model_name} gates its keys with window statistics, which normalise over every token of a call: "
            "assisted or prompt-lookup decoding would verify its drafts against gates that see the later drafts "
            "and give other tokens than plain decoding. Generate without assistant_model / "
            "prompt_lookup_num_tokens, or use a model with causal statistics"
        )
    if getattr(generation_config, "prefill_chunk_size", None) is not None:
        raise ValueError(
            f"{model_name} gates its keys with window statistics, which normalise over every token of a call: a "
            "chunked prefill (prefill_chunk_size) would gate each chunk's keys without the later chunks and give "
            "other logits than one prefill. Generate without prefill_chunk_size, or use a model with causal "
            "statistics"
        )


def padding_mask(mask, length: int | torch.Tensor | None = None) -> torch.Tensor | None:
    """The (batch, past + new) bool padding mask (True at tokens) behind an ``attention_mask``: a 2D mask as given;
    a causal 4D mask (batch, 1, queries, keys), bool or additive, through `padding_of_causal_mask` (its last row's
    first ``length`` columns; a mask that is not causal plus padding is refused); a dict of masks (one per layer
    type) through its first entry; ``None`` for no mask or one that is not a tensor (a flex ``BlockMask``), and for
    a CPU mask without padding. A tensor of other dimensions is refused: read as no padding, it would let the gates
    count padding as tokens.

    Without padding the gates skip their masking (about ten element-wise ops per layer, which bound a decoding step
    on CPU). Like transformers' own SDPA mask, the check runs only outside compiled graphs, and only on CPU, where
    reading the mask costs no device synchronisation."""
    if isinstance(mask, dict):
        mask = next((m for m in mask.values() if m is not None), None)
    if not isinstance(mask, torch.Tensor):
        return None
    if mask.ndim not in (2, 4):
        raise ValueError(
            f"the energy gates read padding from a 2D (batch, cached + new) or 4D (batch, 1, new, cached + new) "
            f"attention mask; got one of shape {tuple(mask.shape)}"
        )
    tokens = mask.bool() if mask.ndim == 2 else padding_of_causal_mask(mask, length)
    if host_reads_are_free(tokens) and bool(tokens.all()):
        return None
    return tokens


# ----------------------------------------------------------------------------------------------------------------
# Filters
# ----------------------------------------------------------------------------------------------------------------


def causal_filter(
    signal: torch.Tensor, kernels: torch.Tensor, document_positions: torch.Tensor | None = None
) -> torch.Tensor:
    """One-sided causal filtering: out[..., c, t] = Σ_u kernels[c, u] · signal[..., t − u] (zero before t = 0).

    Args:
        signal: (B, T) one scalar per position.
        kernels: (K, L) filter taps, tap u applied at lag u.
        document_positions: (B, T) index of each position in its document of a packed row, or ``None``: the
            filters then read no lag u > document_positions[t] (zero before each document, as before t = 0).

    Returns:
        (B, K, T).
    """
    length = kernels.shape[-1]
    if document_positions is not None:
        windows = F.pad(signal, (length - 1, 0)).unfold(-1, length, 1)  # (B, T, L): column j is lag L − 1 − j
        lags = torch.arange(length - 1, -1, -1, device=signal.device)
        windows = windows * (lags <= document_positions[..., None]).to(signal.dtype)
        return torch.einsum("btl,kl->bkt", windows, kernels.flip(-1).to(signal.dtype))
    padded = F.pad(signal[:, None, :], (length - 1, 0))
    return F.conv1d(padded, kernels.flip(-1)[:, None, :].to(signal.dtype))


def morlet_kernels(omega: torch.Tensor, sigma: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Real and imaginary one-sided Morlet taps, t = 0..L−1: cos/sin(ω₀ t)·exp(−t²/2σ²), zero for t ≥ L.

    Args:
        omega, sigma: (H, S) centre frequencies and envelope widths.
        lengths: the S kernel lengths L_s.

    Returns:
        (H, S, 2, max L) taps.
    """
    t = torch.arange(max(lengths), dtype=omega.dtype, device=omega.device)
    inside = (t[None, :] < torch.tensor(lengths, device=omega.device)[:, None]).to(omega.dtype)  # (S, L)
    envelope = torch.exp(-t.square() / (2 * sigma[..., None].square())) * inside
    phase = omega[..., None] * t
    return torch.stack([torch.cos(phase) * envelope, torch.sin(phase) * envelope], dim=-2)


def daubechies_kernels(wavelet: str, dilations: list[int]) -> torch.Tensor:
    """Decomposition high-pass taps of ``wavelet`` (PyWavelets) dilated by each factor: (S, max length), float64."""
    try:
        import pywt
    except ImportError as error:
        raise ImportError(
            f"the {wavelet} energies (EGA-DB2 / EGA-DB4) need PyWavelets: pip install \"hf_spectral[wavelets]\" "
            "(or pip install PyWavelets for a model loaded with trust_remote_code)"
        ) from error
    taps = torch.tensor(pywt.Wavelet(wavelet).dec_hi, dtype=torch.float64)
    length = (len(taps) - 1) * max(dilations) + 1
    kernels = torch.zeros(len(dilations), length, dtype=torch.float64)
    for row, dilation in enumerate(dilations):
        kernels[row, : (len(taps) - 1) * dilation + 1 : dilation] = taps
    return kernels


# ----------------------------------------------------------------------------------------------------------------
# Energy functions: x (B, T, C) -> raw energies (B, H, S, T)
#
# Each one also says what a KV cache must remember per position to compute the energies of later positions
# (``feature_width`` values per head, written by ``features``) and how far back it looks (``history``).
# ----------------------------------------------------------------------------------------------------------------


class LinearEnergy(nn.Module):
    """EGA-1/2/4: e_j = w·x_j + b, one Linear(C→1) per head and projection."""

    feature_width = 0
    history = 0

    def __init__(self, hidden_size: int, num_heads: int, projections: int = 1):
        super().__init__()
        self.num_heads, self.num_scales = num_heads, projections
        self.proj = nn.Linear(hidden_size, num_heads * projections)

    def forward(self, x, past_features=None, document_positions=None):
        return self.arrange(self.proj(x))

    def arrange(self, projected):
        """(B, T, H·S) outputs of ``proj`` -> (B, H, S, T)."""
        batch, length, _ = projected.shape
        return projected.view(batch, length, self.num_heads, self.num_scales).permute(0, 2, 3, 1)

    def features(self, x):
        return None


class _WindowedEnergy(nn.Module):
    """Energies computed from a window of past inputs; the cache keeps the last ``history`` inputs."""

    def _with_history(self, new, past_features):
        """Prepend the cached history (B, H, T_past, F) to ``new`` (B, T, ·), as ``self.features`` wrote it."""
        if past_features is None:
            return new, 0
        past = self._unpack(past_features[:, :, -self.history :, :])
        return torch.cat([past.to(new.dtype), new], dim=1), past.shape[1]


class ConvEnergy(_WindowedEnergy):
    """EGA-C: per head a causal Conv1d(C → 2, kernel k) per scale k; energy = out₀² + out₁²."""

    def __init__(self, hidden_size: int, num_heads: int, kernel_sizes: list[int]):
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size {hidden_size} must be divisible by the number of gate heads {num_heads}")
        self.num_heads, self.num_scales = num_heads, len(kernel_sizes)
        self.kernel_sizes = list(kernel_sizes)
        self.history = max(kernel_sizes) - 1
        self.feature_width = hidden_size // num_heads  # each head stores its slice of x
        self.convs = nn.ModuleList(nn.Conv1d(hidden_size, 2 * num_heads, k) for k in kernel_sizes)

    def forward(self, x, past_features=None, document_positions=None):
        if document_positions is not None:
            return self._documents_forward(x, document_positions)
        full, offset = self._with_history(x, past_features)
        batch = x.shape[0]
        energies = []
        for kernel, conv in zip(self.kernel_sizes, self.convs):
            out = conv(F.pad(full.transpose(1, 2), (kernel - 1, 0)))[..., offset:]
            energies.append(out.view(batch, self.num_heads, 2, -1).square().sum(2))
        return torch.stack(energies, dim=2)

    def _documents_forward(self, x, document_positions):
        """The convolutions of packed rows: a position reads no lag past its document's start. One product per tap
        (the convolution's own arithmetic, lag by lag), each masked where it would read the previous document."""
        batch, length, _ = x.shape
        energies = []
        for kernel, conv in zip(self.kernel_sizes, self.convs):
            out = 0.0 if conv.bias is None else conv.bias
            for lag in range(kernel):
                earlier = F.pad(x, (0, 0, lag, 0))[:, :length]  # x[t − lag], zero before the row
                term = F.linear(earlier, conv.weight[:, :, kernel - 1 - lag])
                out = out + term * (lag <= document_positions)[..., None].to(term.dtype)
            out = out.transpose(1, 2).reshape(batch, self.num_heads, 2, length)
            energies.append(out.square().sum(2))
        return torch.stack(energies, dim=2)

    def features(self, x):
        return x.view(*x.shape[:2], self.num_heads, self.feature_width).transpose(1, 2)

    def _unpack(self, features):
        return features.transpose(1, 2).reshape(features.shape[0], features.shape[2], -1)


class _SignalEnergy(_WindowedEnergy):
    """Energies of the channel-mean signal s_t = mean_c x_t,c under a bank of one-sided causal filters."""

    feature_width = 1

    def forward(self, x, past_features=None, document_positions=None):
        signal, offset = self._with_history(x.mean(-1), past_features)
        kernels = self.kernels()
        responses = causal_filter(signal, kernels.flatten(0, -2), document_positions)[..., offset:]
        return self.energy_from(responses.view(x.shape[0], *kernels.shape[:-1], -1))

    def features(self, x):
        return x.mean(-1)[:, None, :, None].expand(-1, self.num_heads, -1, -1)

    def _unpack(self, features):
        return features[:, 0, :, 0]


class MorletEnergy(_SignalEnergy):
    """EGA-M / EGA-M-F: |Morlet response|² of the channel-mean signal, one scale per kernel length L.

    ω₀ is initialised to π/L and σ to 5/ω₀; ω₀ is capped at 0.95π and σ kept ≥ 5/ω₀ (admissibility ω₀σ ≥ 5).
    """

    def __init__(self, num_heads: int, lengths: list[int], learnable: bool = True):
        super().__init__()
        self.num_heads, self.num_scales, self.lengths = num_heads, len(lengths), list(lengths)
        self.history = max(lengths) - 1
        omega, sigma = self.initial_omega_sigma()
        if learnable:
            self.omega, self.sigma = nn.Parameter(omega), nn.Parameter(sigma)
        else:
            self.register_buffer("omega", omega)
            self.register_buffer("sigma", sigma)

    def initial_omega_sigma(self) -> tuple[torch.Tensor, torch.Tensor]:
        omega = torch.tensor([math.pi / length for length in self.lengths]).repeat(self.num_heads, 1)
        return omega, 5.0 / omega

    def kernels(self):
        omega = self.omega.clamp(max=0.95 * math.pi)
        sigma = torch.maximum(self.sigma, 5.0 / omega)
        return morlet_kernels(omega, sigma, self.lengths)  # (H, S, 2, L)

    def energy_from(self, responses):  # (B, H, S, 2, T)
        return responses.square().sum(3)


class DaubechiesEnergy(_SignalEnergy):
    """EGA-DB2 / EGA-DB4 (our definition, SPEC 1.3): squared high-pass coefficients of the channel-mean signal
    at dyadic dilations, one scale per dilation; taps from PyWavelets."""

    def __init__(self, num_heads: int, wavelet: str, dilations: list[int]):
        super().__init__()
        self.num_heads, self.num_scales = num_heads, len(dilations)
        self.wavelet, self.dilations = wavelet, list(dilations)
        # Not saved (fixed by the config): a model built on the meta device refills it in `_init_weights`.
        self.register_buffer("taps", self.initial_taps().to(torch.get_default_dtype()), persistent=False)
        self.history = self.taps.shape[-1] - 1

    def initial_taps(self) -> torch.Tensor:
        """The taps in float64, as PyWavelets gives them (cast once to the buffer's dtype)."""
        return daubechies_kernels(self.wavelet, self.dilations)

    def _apply(self, fn, recurse=True):
        # A cast (``.double()``, ``.to(dtype)``) derives the taps again from PyWavelets' float64 values, so that a
        # float32 model turned float64 does not keep float32-rounded filters. A call that changed nothing keeps them.
        before = self.taps
        super()._apply(fn, recurse)
        if self.taps is not before:
            self.taps = self.initial_taps().to(device=self.taps.device, dtype=self.taps.dtype)
        return self

    def kernels(self):
        return self.taps[None, :, None, :]  # (1, S, 1, L): the same filters for every head

    def energy_from(self, responses):  # (B, 1, S, 1, T)
        return responses[:, :, :, 0].square().expand(-1, self.num_heads, -1, -1)


def build_energy(kind, hidden_size, num_heads, projections=1, scales=None, morlet_learnable=True) -> nn.Module:
    if kind == "linear":
        return LinearEnergy(hidden_size, num_heads, projections)
    if kind == "conv":
        return ConvEnergy(hidden_size, num_heads, scales)
    if kind == "morlet":
        return MorletEnergy(num_heads, scales, learnable=morlet_learnable)
    if kind in ("db2", "db4"):
        return DaubechiesEnergy(num_heads, kind, scales)
    raise ValueError(f"unknown energy kind {kind!r}; expected one of {ENERGY_KINDS}")


# ----------------------------------------------------------------------------------------------------------------
# The gate module
# ----------------------------------------------------------------------------------------------------------------


class EnergyGate(nn.Module):
    """Per-head energy gate of one attention layer: energies → normalisation → log-gate bias.

    Parameters per head and scale: the energy function's, plus τ, α and one mixing logit (for EGA-1 at
    C = 256: w (256) + b + τ + α + m = 260, SPEC 1.1).

    ``forward`` returns ``(bias, gate, state, features)``: the logit bias for the attention, the gate values
    (recorded by ``output_gate_values=True``) and the per-key state and features for the KV cache (``None`` unless
    asked).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        kind: str = "linear",
        projections: int = 1,
        scales: list[int] | None = None,
        normalization: str = "causal",
        eps: float = 1e-5,
        tau_init: float = 0.0,
        alpha_init: float = 2.0,
        morlet_learnable: bool = True,
    ):
        super().__init__()
        if normalization not in NORMALIZATIONS:
            raise ValueError(f"unknown energy normalisation {normalization!r}; expected one of {NORMALIZATIONS}")
        self.normalization, self.eps = normalization, eps
        self.energy = build_energy(kind, hidden_size, num_heads, projections, scales, morlet_learnable)
        shape = (num_heads, self.energy.num_scales)
        self.tau = nn.Parameter(torch.full(shape, float(tau_init)))
        self.alpha = nn.Parameter(torch.full(shape, float(alpha_init)))
        self.mix_logits = nn.Parameter(torch.zeros(shape))

    @property
    def num_scales(self) -> int:
        return self.energy.num_scales

    @property
    def state_floats(self) -> int:
        """float32 values of normalisation state per key: running count, mean and M2 (causal), the raw energies
        the window is recomputed from (window), nothing (none)."""
        return {"causal": 1 + 2 * self.num_scales, "window": self.num_scales, "none": 0}[self.normalization]

    @property
    def cached_positions(self) -> int | None:
        """How many of the latest cached keys' state and features a call needs: the last one's running moments and
        the filter history (causal, none), or every key (``None``: window statistics normalise the whole past
        again)."""
        return None if self.normalization == "window" else max(1, self.energy.history)

    def forward(
        self,
        x: torch.Tensor,
        valid: torch.Tensor | None = None,
        past_state: torch.Tensor | None = None,
        past_features: torch.Tensor | None = None,
        return_state: bool = False,
        document_positions: torch.Tensor | None = None,
    ):
        """Gate the keys of ``x``.

        Args:
            x: (B, T, C) the attention layer's (normalised) input for the new positions.
            valid: (B, T_past + T) bool, False at padding, or ``None``: the cached keys of ``past_state`` /
                ``past_features``, then the new positions.
            past_state, past_features: what earlier calls returned as ``state`` and ``features`` for the latest
                cached keys (from the KV cache): at least the last ``cached_positions`` of them, or all; ``None``
                before the first key. Positions before the first key may be read as zeros (a ``StaticCache``, whose
                length stays on the device): a count of 0, silence for the filters, False in ``valid``.
            return_state: also return the per-key state and features of the new positions, for the cache.
            document_positions: (B, T) index of each position in its own document of a packed row
                (``packing.py``), or ``None``: statistics and filters then restart at every document. Packed rows
                have no padding and no past.

        Returns:
            bias: (B, H, T) float32; with ``window`` normalisation and a past, (B, H, T_past + T), because
                every key's statistics change when the window grows.
            gate: (B, H, T) gate values of the new positions.
            state: (B, H, T, state_floats) float32 (at least), or ``None`` (not asked, or no statistics).
            features: (B, H, T, F') of ``x``'s dtype, what the filter energies read back, or ``None``.
        """
        length = x.shape[1]
        past = past_state if past_state is not None else past_features
        past_length = 0 if past is None else past.shape[2]
        if valid is not None and valid.shape[-1] != past_length + length:
            raise ValueError(
                f"the padding mask covers {valid.shape[-1]} positions but the gate sees {past_length + length} "
                f"({past_length} cached + {length} new)"
            )
        if document_positions is not None and (valid is not None or past is not None):
            raise ValueError("packed documents come without padding and without a cached past")
        new_valid = None if valid is None else valid[:, past_length:]
        if self.energy.history and new_valid is not None:  # padding reads as silence: left padding changes nothing
            x = x * new_valid[:, :, None].to(x.dtype)
        features = past_features if self.energy.feature_width else None
        energy = at_least_float32(self.energy(x, features, document_positions))
        weight = token_weight(new_valid)

        state = None
        if self.normalization == "causal":
            moments = None
            if past_state is not None:  # (count, mean, M2) at the last cached key, each (B, H, ·, 1)
                last = past_state[:, :, -1:, :].transpose(2, 3)
                moments = last.split([1, self.num_scales, self.num_scales], dim=2)
            z, count, mean, m2 = causal_zscore(energy, weight, moments, self.eps, document_positions)
            state = torch.cat([count, mean, m2], dim=2) if return_state else None
        elif self.normalization == "window":
            state = energy
            if past_state is not None:  # every key is normalised again over the grown window
                energy = torch.cat([past_state.transpose(2, 3).to(energy.dtype), energy], -1)
                weight = token_weight(valid)
            z = window_zscore(energy, weight, self.eps, document_positions)
        else:
            z = energy if weight is None else energy * weight
        bias, gate = log_gate_bias(z, self.tau, self.alpha, self.mix_logits)
        if gate.shape[-1] != length:
            gate = gate[..., -length:]
        if not return_state:
            return bias, gate, None, None
        return bias, gate, None if state is None else state.transpose(2, 3), self.energy.features(x)


__all__ = [
    "DEFAULT_DILATIONS",
    "DEFAULT_ENERGY_NORM_EPS",
    "DEFAULT_KERNEL_SIZES",
    "ENERGY_KINDS",
    "NORMALIZATIONS",
    "ConvEnergy",
    "DaubechiesEnergy",
    "EnergyGate",
    "LinearEnergy",
    "MorletEnergy",
    "build_energy",
    "causal_filter",
    "causal_zscore",
    "daubechies_kernels",
    "default_scales",
    "log_gate_bias",
    "morlet_kernels",
    "normalize_energy",
    "padding_mask",
    "token_weight",
    "window_zscore",
]
