"""Energy-gated attention (SPEC 1.1-1.3), implemented once and shared by EGA-GPT and the retrofit.

The gate of head h on key j is g_j = Σ_s softmax(m)_s σ(α_s (ẽ_j,s − τ_s)), with ẽ the normalised energy of the
key's input x_j at scale s. Gating then renormalising the attention probabilities,
Â_ij = A_ij g_j / Σ_k A_ik g_k, equals softmax_j(s_ij + log g_j): EGA is an additive, query-independent
per-key logit bias. We therefore never build a T×T gated matrix. ``fold_bias_into_qkv`` appends one channel
to queries and keys so that *any* attention kernel (eager, SDPA's fused causal kernel, flex) computes
q·k·scaling + bias, and the KV cache stores each key's bias with the key itself.

Dropout: the bias form gates and renormalises *before* attention dropout (dropout then acts on the gated
probabilities); the authors gate after dropout. The two agree exactly when attention dropout is 0.

Shapes: B batch, H gate heads, S energy scales, T positions, C hidden size, D head size.
"""

import math
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, StaticLayer

from .growing_cache import GrowingLayer

try:  # only the Daubechies energies need PyWavelets
    import pywt
except ImportError:  # pragma: no cover - exercised only where PyWavelets is missing
    pywt = None


# ----------------------------------------------------------------------------------------------------------------
# Pure tensor functions
# ----------------------------------------------------------------------------------------------------------------


def _float32(tensor: torch.Tensor) -> torch.Tensor:
    # The statistics run in float32 whatever the activation dtype; skip the no-op cast (decoding is op-bound).
    return tensor if tensor.dtype == torch.float32 else tensor.float()


def _as_weight(valid: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """(B, T) bool padding mask -> (B, 1, 1, T) float weights (1 for every position when ``valid`` is None)."""
    if valid is None:
        return like.new_ones(like.shape[-1])
    return valid.view(valid.shape[0], 1, 1, valid.shape[1]).to(like.dtype)


def causal_zscore(
    energy: torch.Tensor,
    valid: torch.Tensor | None = None,
    past: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    eps: float = 1e-5,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal z-scores from running moments: position j uses the mean and unbiased std of the valid energies
    at positions ≤ j (0 while fewer than two were seen, and at padding).

    Args:
        energy: (B, H, S, T) raw energies of new positions.
        valid: (B, T) bool, False at padding, or ``None``.
        past: ``(count, mean (B, H, S, 1), m2 (B, H, S, 1))`` of all earlier positions (a decoding step), count
            a (B,) tensor or, without padding, an int; ``None`` at the start of a sequence.
        eps: lower bound on the standard deviation.

    Returns:
        z (B, H, S, T) and the running mean and M2 (sum of squared deviations) at each position, all float32:
        the state a later step continues from.
    """
    e = _float32(energy)
    if past is not None and e.shape[-1] == 1 and valid is None and isinstance(past[0], int):
        return causal_zscore_step(e, past[0], past[1], past[2], eps)
    weight = _as_weight(valid, e)
    if past is not None and e.shape[-1] == 1:  # one decoding step: Welford's update, no running sums
        count = past[0].view(-1, 1, 1, 1) + weight
        delta = (e - past[1]) * weight
        mean = past[1] + delta / count.clamp(min=1)
        m2 = past[2] + delta * (e - mean)
        std = (m2 / (count - 1).clamp(min=1)).clamp(min=eps * eps).sqrt()
        return (e - mean) / std * ((count >= 2) & (weight > 0)), mean, m2
    if past is None:
        # Shift by the first token's energy (known to every later position, so still causal) before the
        # running sums: keeps Σx² − (Σx)²/n away from catastrophic cancellation when |mean| ≫ std.
        shift = e.gather(-1, weight.expand_as(e).argmax(-1, keepdim=True))
        count, m2 = weight.cumsum(-1), 0.0
    else:  # shifting by the running mean, the past adds only its count and M2 (Chan et al.'s merge)
        past_count = past[0] if isinstance(past[0], int) else past[0].view(-1, 1, 1, 1)
        shift, m2 = _float32(past[1]), _float32(past[2])
        count = past_count + weight.cumsum(-1)
    x = (e - shift) * weight
    s1 = x.cumsum(-1)
    safe_count = count.clamp(min=1)
    m2 = (m2 + x.square().cumsum(-1) - s1.square() / safe_count).clamp(min=0)
    std = (m2 / (count - 1).clamp(min=1)).clamp(min=eps * eps).sqrt()
    z = (x - s1 / safe_count) / std * ((count >= 2) & (weight > 0))
    return z, shift + s1 / safe_count, m2


def causal_zscore_step(
    energy: torch.Tensor, past_count: int, mean: torch.Tensor, m2: torch.Tensor, eps: float = 1e-5
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``causal_zscore`` for one new position after ``past_count`` ≥ 1 tokens and no padding: Welford's update in
    seven element-wise ops, because a decoding step is bound by the number of ops, not by their size.

    Args:
        energy: (B, H, S, 1) float32; mean, m2: (B, H, S, 1) the running moments after the past tokens.

    Returns:
        z, mean, m2 of the new position, each (B, H, S, 1).
    """
    count = past_count + 1
    delta = energy - mean
    mean = torch.add(mean, delta, alpha=1.0 / count)
    deviation = energy - mean
    m2 = torch.addcmul(m2, delta, deviation)
    # z = deviation / sqrt(max(m2 / (count - 1), eps²)), with the division moved out of the tensor ops
    z = deviation * m2.clamp(min=eps * eps * (count - 1)).rsqrt_().mul_(math.sqrt(count - 1))
    return z, mean, m2


def normalize_energy(
    energy: torch.Tensor,
    valid: torch.Tensor | None = None,
    mode: str = "causal",
    eps: float = 1e-5,
) -> torch.Tensor:
    """z-normalise energies along time, ignoring padding.

    Args:
        energy: (B, H, S, T) raw energies.
        valid: (B, T) bool, False at padding; ``None`` means every position is a token.
        mode: ``"causal"``: position j uses the mean / unbiased std of the valid positions ≤ j (ẽ = 0 while
            the prefix holds fewer than two tokens), so no later token can change it; ``"window"``: the
            authors' statistics over every valid position of the sequence (sees the future); ``"none"``:
            energies pass through unchanged.
        eps: lower bound on the standard deviation.

    Returns:
        (B, H, S, T) float32 normalised energies, 0 at padding.
    """
    if mode == "causal":
        return causal_zscore(energy, valid, eps=eps)[0]
    e = _float32(energy)
    weight = _as_weight(valid, e)
    if mode == "none":
        return e * weight
    if mode == "window":
        count = weight.sum(-1, keepdim=True)
        mean = (e * weight).sum(-1, keepdim=True) / count.clamp(min=1)
        std = (((e - mean).square() * weight).sum(-1, keepdim=True) / (count - 1).clamp(min=1)).clamp(min=eps * eps).sqrt()
        return (e - mean) / std * ((count >= 2) & (weight > 0))
    raise ValueError(f"unknown energy normalisation {mode!r}; expected 'causal', 'window' or 'none'")


def gate_constants(
    tau: torch.Tensor, alpha: torch.Tensor, mix_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The per-head terms of the gate formula that do not depend on the energies, shaped to broadcast against
    z (B, H, S, T) — or (B, H, T) with one scale: α, −ατ, log softmax(m) (``None`` with one scale) and the log
    gate at the mean energy, log g(ẽ = 0), (H, 1)."""
    alpha, tau = _float32(alpha), _float32(tau)
    neg_alpha_tau = (alpha * tau).neg_()
    if alpha.shape[-1] == 1:  # one scale: the mixture is the gate itself
        return alpha, neg_alpha_tau, None, F.logsigmoid(neg_alpha_tau)
    log_mix = torch.log_softmax(_float32(mix_logits), dim=-1)
    log_gate_at_mean = torch.logsumexp(log_mix + F.logsigmoid(neg_alpha_tau), dim=-1, keepdim=True)
    return alpha[..., None], neg_alpha_tau[..., None], log_mix[..., None], log_gate_at_mean


def log_gate_bias(
    z: torch.Tensor,
    tau: torch.Tensor,
    alpha: torch.Tensor,
    mix_logits: torch.Tensor,
    constants: tuple[torch.Tensor, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gate values and their log as an attention-logit bias.

    Args:
        z: (B, H, S, T) normalised energies.
        tau, alpha, mix_logits: (H, S) thresholds, slopes and scale-mixing logits.
        constants: ``gate_constants(tau, alpha, mix_logits)`` when the caller keeps them; computed when ``None``.

    Returns:
        bias: (B, H, T) float32, log g_j − log g(ẽ = 0). The subtracted per-head constant does not change the
            softmax, and makes the bias exactly 0 when α = 0, so that a fresh gate is an exact identity.
        gate: (B, H, T) the gate values g_j ∈ (0, 1).
    """
    alpha, neg_alpha_tau, log_mix, log_gate_at_mean = constants or gate_constants(tau, alpha, mix_logits)
    if log_mix is None:  # one scale; (H, 1) constants broadcast over (B, H, T)
        log_gate = F.logsigmoid(torch.addcmul(neg_alpha_tau, alpha, z.squeeze(2)))  # α (z − τ)
    else:
        log_gate = torch.logsumexp(log_mix + F.logsigmoid(torch.addcmul(neg_alpha_tau, alpha, z)), dim=-2)
    return log_gate - log_gate_at_mean, log_gate.exp()


def pad_query_for_bias(query: torch.Tensor, width: int, scaling: float) -> torch.Tensor:
    """q' = [q, 1/scaling, 0, …] with ``width`` extra channels: the partner of ``fold_bias_into_kv``."""
    parts = [query, query.new_full((*query.shape[:-1], 1), 1.0 / scaling)]
    if width > 1:
        parts.append(query.new_zeros(width - 1).expand(*query.shape[:-1], width - 1))
    return torch.cat(parts, dim=-1)


def fold_bias_into_kv(
    key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor, aux: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """k' = [k, bias, 0, …], v' = [v, aux]: the key/value half of ``fold_bias_into_qkv``.

    The KV cache stores k' and v', so each key keeps its bias and the gate state later steps need.
    """
    width = 1 if aux is None else max(1, aux.shape[-1])
    key_parts = [key, bias.to(key.dtype).unsqueeze(-1)]
    if width > 1:
        key_parts.append(key.new_zeros(width - 1).expand(*key.shape[:-1], width - 1))
    value_pad = value.new_zeros(width).expand(*value.shape[:-1], width) if aux is None else aux.to(value.dtype)
    return torch.cat(key_parts, dim=-1), torch.cat([value, value_pad], dim=-1)


def fold_bias_into_qkv(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: torch.Tensor,
    scaling: float,
    aux: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Append channels so that q'·k'·scaling = q·k·scaling + bias for any attention kernel.

    q' = [q, 1/scaling, 0, …], k' = [k, bias, 0, …], v' = [v, aux]. All three get the same P ≥ 1 extra
    channels (fused kernels need equal head sizes); the extra value channels carry ``aux`` — per-key state
    the KV cache must remember for later steps (raw energies, filter history) — and their outputs are
    discarded: the caller keeps ``out[..., :D]``.

    Args:
        query: (B, Hq, Tq, D); key, value: (B, Hk, Tk, D) with Hq a multiple of Hk (grouped-query attention).
        bias: (B, Hk, Tk) per-key logit bias.
        scaling: the attention's score scaling (1/√D for standard attention).
        aux: optional (B, Hk, Tk, P) per-key state to carry in the value channels.
    """
    key, value = fold_bias_into_kv(key, value, bias, aux)
    return pad_query_for_bias(query, key.shape[-1] - query.shape[-1], scaling), key, value


def folded_qkv_weights(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    num_heads: int,
    head_dim: int,
    width: int,
    scaling: float,
    extra_weight: torch.Tensor | None = None,
    extra_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight and bias of a fused q/k/v projection that emits ``fold_bias_into_qkv``'s layout directly, so that
    q, k and v are not copied once more to append channels: zero weight rows add ``width`` channels per head, the
    first of q's being the constant 1/scaling through the bias. The caller writes the key bias and the value state
    into their channels in place. ``extra_weight`` rows (E, C) (the linear energies) are appended after q/k/v, so
    that the same product computes them.

    Args:
        weight: (3·H·D, C) and bias: (3·H·D,) or ``None``, rows ordered (q/k/v, head, channel).

    Returns:
        weight (3·H·(D + width) + E, C) and bias: ``x @ weight.T + bias`` viewed as (…, 3, H, D + width) after
        its first 3·H·(D + width) columns, the extra key and value channels zero.
    """
    rows = weight.view(3, num_heads, head_dim, -1)
    padded_weight = F.pad(rows, (0, 0, 0, width)).view(-1, rows.shape[-1])
    extra = rows.new_zeros(3, num_heads, width)
    extra[0, :, 0] = 1.0 / scaling
    stock_bias = rows.new_zeros(3, num_heads, head_dim) if bias is None else bias.view(3, num_heads, head_dim)
    padded_bias = torch.cat([stock_bias, extra], dim=-1).view(-1)
    if extra_weight is not None:
        padded_weight = torch.cat([padded_weight, extra_weight])
        padded_bias = torch.cat([padded_bias, extra_weight.new_zeros(len(extra_weight)) if extra_bias is None else extra_bias])
    return padded_weight, padded_bias


def folded_output_weight(weight: torch.Tensor, num_heads: int, width: int) -> torch.Tensor:
    """The output projection's weight (C_out, H·D) with ``width`` zero columns after each head, so that it reads
    folded attention outputs (…, H, D + width) without first cutting off the extra channels (a copy)."""
    columns = weight.view(weight.shape[0], num_heads, -1)
    return F.pad(columns, (0, width)).view(weight.shape[0], -1)


_filled_caches: ContextVar[list | None] = ContextVar("hf_spectral_filled_caches", default=None)


@contextmanager
def caching_derived_tensors():
    """Let every ``DerivedTensors`` keep what it derives for the duration of the block (``generate()`` runs in one),
    then drop it all on exit.

    The weights cannot change unseen within one generation; between calls they may, by any route — including
    in-place updates through ``.data`` (PEFT's merge, old init code), which no version counter records — so nothing
    derived outlives the block.
    """
    filled = []
    token = _filled_caches.set(filled)
    try:
        yield
    finally:
        _filled_caches.reset(token)
        for cache in filled:
            cache.clear()


def keeping_derived_tensors() -> bool:
    """Whether ``DerivedTensors`` keep what they derive right now (inside ``caching_derived_tensors()``, no autograd)."""
    return _filled_caches.get() is not None and not torch.is_grad_enabled()


class DerivedTensors:
    """Tensors derived from parameters (folded projection weights, gate constants): derived again on every call,
    except inside ``caching_derived_tensors()`` without autograd, where they are kept between calls — a decoding step
    cannot afford to copy the weights. Inside the block a kept value is still rebuilt when a source's storage,
    version counter (bumped by in-place updates), dtype or device changes; holding the sources' storage keeps it
    alive, so that a new tensor cannot reuse a stale address.
    """

    MISSING = object()

    def __init__(self):
        self.clear()

    def clear(self):
        self.sources, self.source_versions, self.storages, self.versions, self.derived = [], [], (), (), None

    def get(self, build, key, *sources: torch.Tensor | None):
        if not keeping_derived_tensors() or any(t is not None and t.is_inference() for t in sources):
            return build()  # outside a generation, differentiable, or no version counter to check
        versions = (key,) + tuple(None if t is None else (t.data_ptr(), t._version, t.dtype, t.device) for t in sources)
        if versions != self.versions:
            self.derived = build()
            self.versions, self.storages = versions, tuple(None if t is None else t.detach() for t in sources)
            self.sources = [t for t in sources if t is not None]
            self.source_versions = [t._version for t in self.sources]
            _filled_caches.get().append(self)
        return self.derived

    def kept(self, key):
        """The value kept for ``key`` while no tensor it was derived from (those ``get`` was given) has been updated in
        place since, else ``MISSING``: for a decoding step, which cannot afford ``get``'s full test of every source
        per layer. Replacing a source's storage (``.data = …``) or rebinding a module attribute inside the block goes
        unseen here; ``get`` sees both.
        """
        if self.versions and self.versions[0] == key and keeping_derived_tensors():
            if [t._version for t in self.sources] == self.source_versions:
                return self.derived
        return self.MISSING


def cached_length(layer) -> int:
    """The number of keys a KV cache layer holds. Energy-gated layers keep per-key gate state in the cache, so the
    layer must keep every key as written, at its position: a ``DynamicLayer``, ``GrowingLayer`` or ``StaticLayer``
    (``DynamicCache``, ``GrowingCache``, ``StaticCache``, their offloaded forms), or a sliding-window layer until its
    window starts dropping keys (the statistics count every earlier token). Quantised layers alter the keys and
    raise, as does a full window."""
    if type(layer) in (DynamicLayer, GrowingLayer, StaticLayer):
        return int(layer.get_seq_length())
    if type(layer) is DynamicSlidingWindowLayer:
        held = layer.values.shape[-2] if layer.is_initialized else 0
        if int(layer.get_seq_length()) == held:
            return held
        raise ValueError(
            f"the KV cache's sliding window has dropped {int(layer.get_seq_length()) - held} keys; energy-gated "
            "attention keeps its per-key gate state (statistics over every earlier token) in the cache and cannot "
            "continue past the window: use a DynamicCache without a sliding window"
        )
    raise ValueError(
        f"energy-gated attention keeps per-key gate state in its KV cache and needs every key kept as written; "
        f"a {type(layer).__name__} does not: use a DynamicCache or a StaticCache"
    )


def padding_mask(mask, length: int | None = None) -> torch.Tensor | None:
    """The (batch, past + new) bool padding mask (True at tokens) behind an ``attention_mask``: a 2D mask as given;
    a causal 4D mask — generate() builds one for a StaticCache, or a dict of them, one per layer type — read from its
    last query row, which sees every earlier token: its first ``length`` columns, or up to the last column that query
    sees (its own position); ``None`` for anything else."""
    if isinstance(mask, dict):
        mask = next((m for m in mask.values() if m is not None), None)
    if not isinstance(mask, torch.Tensor) or mask.ndim not in (2, 4):
        return None
    if mask.ndim == 2:
        return mask.bool()
    seen = mask[:, 0, -1]
    seen = seen if seen.dtype == torch.bool else seen == 0
    return seen[:, : int(seen.any(0).nonzero().max()) + 1 if length is None else length]


def cached_gate_state(cache, layer_idx: int, head_dim: int) -> torch.Tensor | None:
    """The per-key gate state a layer's KV cache holds after the first ``head_dim`` value channels, for the keys
    cached so far (a ``StaticCache`` holds more positions than it has filled), or ``None`` before the first."""
    if cache is None or layer_idx >= len(cache.layers):
        return None
    layer = cache.layers[layer_idx]
    past_length = cached_length(layer)
    if past_length == 0:
        return None
    return layer.values[:, :, :past_length, head_dim:]


def replace_folded_bias(key: torch.Tensor, bias: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Overwrite the bias channel of folded keys (B, H, T, D + P) with ``bias`` (B, H, T); out of place."""
    return torch.cat([key[..., :head_dim], bias.to(key.dtype)[..., None], key[..., head_dim + 1 :]], dim=-1)


def causal_filter(signal: torch.Tensor, kernels: torch.Tensor) -> torch.Tensor:
    """One-sided causal filtering: out[..., c, t] = Σ_u kernels[c, u] · signal[..., t − u] (zero before t = 0).

    Args:
        signal: (B, T) one scalar per position.
        kernels: (K, L) filter taps, tap u applied at lag u.

    Returns:
        (B, K, T).
    """
    length = kernels.shape[-1]
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
    max_len = max(lengths)
    t = torch.arange(max_len, dtype=omega.dtype, device=omega.device)
    inside = (t[None, :] < torch.tensor(lengths, device=omega.device)[:, None]).to(omega.dtype)  # (S, L)
    envelope = torch.exp(-t.square() / (2 * sigma[..., None].square())) * inside
    phase = omega[..., None] * t
    return torch.stack([torch.cos(phase) * envelope, torch.sin(phase) * envelope], dim=-2)


def daubechies_kernels(wavelet: str, dilations: list[int]) -> torch.Tensor:
    """Decomposition high-pass taps of ``wavelet`` (PyWavelets) dilated by each factor: (S, max length)."""
    if pywt is None:
        raise ImportError("the db2/db4 energies need PyWavelets: pip install PyWavelets")
    taps = torch.tensor(pywt.Wavelet(wavelet).dec_hi, dtype=torch.float64)
    length = (len(taps) - 1) * max(dilations) + 1
    kernels = torch.zeros(len(dilations), length, dtype=torch.float64)
    for row, dilation in enumerate(dilations):
        kernels[row, : (len(taps) - 1) * dilation + 1 : dilation] = taps
    return kernels.float()


# ----------------------------------------------------------------------------------------------------------------
# Energy functions: x (B, T, C) -> raw energies (B, H, S, T)
#
# Each one also says what the KV cache must remember per position to compute the energies of later positions
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

    def forward(self, x, past_features=None):
        return self.arrange(self.proj(x))

    def arrange(self, projected):
        """(B, T, H·S) outputs of ``proj`` (also when a caller fused ``proj`` into its own product) -> (B, H, S, T)."""
        batch, length, _ = projected.shape
        return projected.view(batch, length, self.num_heads, self.num_scales).permute(0, 2, 3, 1)

    def features(self, x):
        return None


class _WindowedEnergy(nn.Module):
    """Energies computed from a window of past inputs; the cache keeps the last ``history`` inputs."""

    def _with_history(self, new, past_features):
        """Prepend the cached history (B, H, T_past, F) to ``new`` (B, T, ·), as ``self.features`` wrote it."""
        if past_features is None or self.history == 0:
            return new, 0
        past = self._unpack(past_features[:, :, -self.history :, :])
        return torch.cat([past, new], dim=1), past.shape[1]


class ConvEnergy(_WindowedEnergy):
    """EGA-C: per head a causal Conv1d(C → 2, kernel k) per scale k; energy = out₀² + out₁²."""

    def __init__(self, hidden_size: int, num_heads: int, kernel_sizes: list[int]):
        super().__init__()
        self.num_heads, self.num_scales = num_heads, len(kernel_sizes)
        self.kernel_sizes = list(kernel_sizes)
        self.history = max(kernel_sizes) - 1
        self.feature_width = hidden_size // num_heads  # each head stores its slice of x
        if self.feature_width * num_heads != hidden_size:
            raise ValueError(f"hidden_size {hidden_size} must be divisible by the number of gate heads {num_heads}")
        self.convs = nn.ModuleList(nn.Conv1d(hidden_size, 2 * num_heads, k) for k in kernel_sizes)

    def forward(self, x, past_features=None):
        full, offset = self._with_history(x, past_features)
        batch = x.shape[0]
        energies = []
        for kernel, conv in zip(self.kernel_sizes, self.convs):
            out = conv(F.pad(full.transpose(1, 2), (kernel - 1, 0)))[..., offset:]
            energies.append(out.view(batch, self.num_heads, 2, -1).square().sum(2))
        return torch.stack(energies, dim=2)

    def features(self, x):
        return x.view(*x.shape[:2], self.num_heads, self.feature_width).transpose(1, 2)

    def _unpack(self, features):
        return features.transpose(1, 2).reshape(features.shape[0], features.shape[2], -1)


class _SignalEnergy(_WindowedEnergy):
    """Energies of the channel-mean signal s_t = mean_c x_t,c under a bank of one-sided causal filters."""

    feature_width = 1

    def forward(self, x, past_features=None):
        signal, offset = self._with_history(x.mean(-1), past_features)
        kernels = self.kernels()
        responses = causal_filter(signal, kernels.flatten(0, -2))[..., offset:]
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
        omega = torch.tensor([math.pi / length for length in lengths]).repeat(num_heads, 1)
        sigma = 5.0 / omega
        if learnable:
            self.omega, self.sigma = nn.Parameter(omega), nn.Parameter(sigma)
        else:
            self.register_buffer("omega", omega)
            self.register_buffer("sigma", sigma)

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
        self.register_buffer("taps", daubechies_kernels(wavelet, dilations), persistent=False)
        self.history = self.taps.shape[-1] - 1

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
    raise ValueError(f"unknown energy kind {kind!r}; expected linear, conv, morlet, db2 or db4")


# ----------------------------------------------------------------------------------------------------------------
# The gate module
# ----------------------------------------------------------------------------------------------------------------


class EnergyGate(nn.Module):
    """Per-head energy gate of one attention layer: energies → normalisation → log-gate bias.

    Parameters per head and scale: the energy function's, plus τ, α and one mixing logit (for EGA-1 at
    C = 256: w (256) + b + τ + α + m = 260, SPEC 1.1).

    ``forward`` returns ``(bias, gate, aux)``: the logit bias to fold into the attention, the gate values
    (recorded by ``output_gate_values=True``) and the per-key state for the KV cache (``None`` unless asked).
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
        if normalization not in ("causal", "window", "none"):
            raise ValueError(f"unknown energy normalisation {normalization!r}; expected causal, window or none")
        self.normalization, self.eps = normalization, eps
        self.energy = build_energy(kind, hidden_size, num_heads, projections, scales, morlet_learnable)
        shape = (num_heads, self.energy.num_scales)
        self.tau = nn.Parameter(torch.full(shape, float(tau_init)))
        self.alpha = nn.Parameter(torch.full(shape, float(alpha_init)))
        self.mix_logits = nn.Parameter(torch.zeros(shape))
        self._constants = DerivedTensors()  # gate_constants, kept between calls while no gradient is recorded

    @property
    def num_scales(self) -> int:
        return self.energy.num_scales

    @property
    def state_width(self) -> int:
        """Per-key normalisation state the KV cache carries: running mean and M2 (causal), the raw energy the
        whole window is recomputed from (window), nothing (none)."""
        return {"causal": 2, "window": 1, "none": 0}[self.normalization] * self.energy.num_scales

    @property
    def aux_width(self) -> int:
        """Per-key values the KV cache carries for this gate: normalisation state, then the energy's features."""
        return self.state_width + self.energy.feature_width

    def constants(self) -> tuple:
        """``gate_constants`` of this gate's parameters (kept between decoding steps, see ``DerivedTensors``)."""
        return self._constants.get(
            lambda: gate_constants(self.tau, self.alpha, self.mix_logits), None, self.tau, self.alpha, self.mix_logits
        )

    def forward(
        self,
        x: torch.Tensor,
        valid: torch.Tensor | None = None,
        past_aux: torch.Tensor | None = None,
        return_aux: bool = False,
        energy: torch.Tensor | None = None,
    ):
        """Gate the keys of ``x``.

        Args:
            x: (B, T, C) the attention layer's (normalised) input for the new positions.
            valid: (B, T_past + T) bool, False at padding, or ``None``.
            past_aux: (B, H, T_past, aux_width) what earlier calls returned as ``aux`` (from the KV cache).
            return_aux: also return the per-key state of the new positions for the cache.
            energy: (B, H, S, T) raw energies of ``x`` when the caller computed them (a linear energy fused into
                the attention's own projection); computed here when ``None``.

        Returns:
            bias: (B, H, T) float32; with ``window`` normalisation and a past, (B, H, T_past + T), because
                every key's statistics change when the window grows.
            gate: (B, H, T) gate values of the new positions.
            aux: (B, H, T, aux_width) or ``None``.
        """
        num_scales, width = self.energy.num_scales, self.state_width
        length = x.shape[1]
        past_length = 0 if past_aux is None else past_aux.shape[2]
        if valid is not None:
            if valid.shape[-1] != past_length + length:
                raise ValueError(
                    f"attention_mask covers {valid.shape[-1]} positions but the layer sees {past_length + length} "
                    "(cached + new)"
                )
            if self.energy.history:  # padded inputs read as silence: left padding then changes nothing
                x = x * valid[:, -length:, None].to(x.dtype)
        past_state = past_features = None
        if past_length:
            past_state = past_aux[..., :width]
            if self.energy.feature_width:
                past_features = past_aux[..., width:]
        # Round to the activation dtype, as the cached copy will be, so cached and uncached paths agree.
        if energy is None:
            energy = self.energy(x, past_features)
        if energy.dtype != x.dtype:
            energy = energy.to(x.dtype)
        new_valid = valid if valid is None or valid.shape[-1] == length else valid[:, -length:]

        state = None
        if self.normalization == "causal":
            past = None
            if past_length:
                past_count = past_length if valid is None else valid[:, :past_length].sum(-1, dtype=torch.float32)
                last = past_state[:, :, -1:, :].transpose(2, 3)  # (B, H, 2S, 1): mean and M2 at the last key
                past = (past_count, last[:, :, :num_scales], last[:, :, num_scales:])
            z, mean, m2 = causal_zscore(energy, new_valid, past, self.eps)
            state = torch.cat([mean, m2], dim=2).transpose(2, 3)
        elif self.normalization == "window":
            energies = energy if past_state is None else torch.cat([past_state.transpose(2, 3).to(energy.dtype), energy], -1)
            z = normalize_energy(energies, valid, "window", self.eps)
            state = energy.transpose(2, 3)
        else:
            z = normalize_energy(energy, new_valid, "none", self.eps)
        bias, gate = log_gate_bias(z, self.tau, self.alpha, self.mix_logits, self.constants())
        if gate.shape[-1] != length:
            gate = gate[..., -length:]
        aux = None
        if return_aux:
            parts = [] if state is None else [state]
            features = self.energy.features(x)
            if features is not None:
                parts.append(features)
            aux = None if not parts else parts[0] if len(parts) == 1 else torch.cat([p.to(x.dtype) for p in parts], -1)
        return bias, gate, aux
