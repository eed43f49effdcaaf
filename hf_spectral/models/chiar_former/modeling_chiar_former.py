"""CHIAR-Former: each layer mixes tokens with DCT mixing, RBF kernel mixing or attention, or lets every token pick
one of them from its spectral entropy (SPEC 2).

A layer is an operator sub-layer and a GELU FFN, each with a residual connection (post-LN by default, as the
authors). The mechanisms are the pure tensor functions of ``hf_spectral/ops`` (``spectral``: DCT, spectral entropy,
DCT mixing; ``routing``: routers, straight-through gate, gathered layouts and their attention masks;
``random_features``: kernel attention); this file holds their parameters and wires them into a transformers model.

Routed layers compute the DCT of every token once: it gives the spectral entropy the router reads and the DCT mixing
output (one pair of matrix products). With threshold or hard routing the other operators then run only on their own
tokens (SPEC 2.2): attention projects keys and values for every token (a routed query sees exactly the keys a dense
layer shows it) but queries and outputs only for its routed tokens. Each row's routed tokens are gathered into a
(B, Q) layout (stable order: routed tokens first, in position order), attended through transformers' attention
backends (``eager``, ``sdpa``, ``flex_attention``) with the mask of their slots, and scattered back. Nothing in a
forward pass reads a tensor on the host where that costs a synchronisation:

* the layout width Q is the sequence length under ``torch.compile`` and on accelerators (static shapes, no host
  read); then ``flex_attention``'s block mask skips every block of unrouted queries and the future of each routed
  block, while the query / output projections and SDPA still process Q = T rows;
* in eager mode on CPU, where reading the routed count costs nothing, Q is the largest routed count of the batch
  (SDPA and eager attention; ``flex_attention`` keeps Q = T so that its compiled kernel sees one shape): projections
  and attention then process ≈ the routed fraction of the queries, and the causal queries are attended in up to four
  groups, each against the key prefix its latest query reads (about 5/8 of the (query, key) pairs of one call).

Soft routing, and ``routed_execution="dense"`` (the authors' one-hot select), run every operator on every token.
Routing is per token and reads only the token's own state, so a causal model stays causal and generation with the
cache takes the routes of the forward pass.

Cache (``DynamicCache(config=...)``, layer types from ``config.layer_types``): attention keeps the keys/values of
every token (a later token routed to attention reads them all), the RBF operator keeps its prefix sums
Σ φ(k)[v, 1]ᵀ as a recurrent state, DCT mixing keeps nothing but the token count of its linear-attention cache layer
(``count_new_tokens``). transformers' hybrid cache layers then handle beam search reordering; left padding is
handled by excluding padding keys from the masks and the prefix sums.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, LinearAttentionCacheLayerMixin
from transformers.generation import GenerationMode
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutputWithPast,
    CausalLMOutputWithPast,
    SequenceClassifierOutputWithPast,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb, rotate_half
from transformers.utils import can_return_tuple, logging
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .configuration_chiar_former import ChiarConfig
from ...ops.gated_attention import flex_attention_forward
from ...ops.packing import check_not_packed, document_starts, packed_rows
from ...ops.pooling import SequencePooling, classifier_attention_mask, refuse_packed_rows
from ...ops.positions import (
    host_length,
    host_reads_are_free,
    keep_padding_mask_for_generate,
    mask_width_is_valid,
    new_positions,
    padding_of_causal_mask,
    token_positions,
)
from ...ops.remote_code import save_pretrained_with_code
from ...ops.random_features import (
    authors_rbf_mixing,
    bidirectional_kernel_attention,
    causal_kernel_attention,
    positive_random_features,
    trigonometric_random_features,
)
from ...ops.routing import (
    gather_routed,
    gathered_query_block_mask,
    gathered_query_mask,
    hard_routes,
    one_hot_gates,
    routed_layout,
    router_probabilities,
    routing_fractions,
    scatter_routed,
    soft_routes,
    straight_through_gate,
    threshold_routes,
    usage_entropy_penalty,
)
from ...ops.spectral import dct, dct_even_odd, dct_mixing, idct, spectral_entropy_from_spectrum
from ...ops.validation import check_parameters_fit

logger = logging.get_logger(__name__)

# Block size of CHIAR's flex_attention block masks (flex_attention's default).
FLEX_BLOCK_SIZE = 128
# Gathered causal queries attended in up to this many groups, each against its own key prefix (eager mode on CPU),
# when each group holds at least KEY_PREFIX_MIN_QUERIES queries (fewer make the kernel calls inefficient).
KEY_PREFIX_CHUNKS = 4
KEY_PREFIX_MIN_QUERIES = 64

_ROUTING_DOC = r"""
    The routing outputs below are returned with `output_routing=True` (otherwise None), as transformers' models
    return attentions or router logits only when asked: their per-layer tuples cannot be split by batch row the way
    a pipeline splits a batch's outputs.

    routing_decisions (`tuple[torch.LongTensor]`):
        One (batch, new positions) tensor per routed layer: index into `config.routed_operators` of the operator each
        token took (soft routing: the operator with the largest weight). Padding tokens take operator 0.
    routing_entropies (`tuple[torch.FloatTensor]`):
        One (batch, new positions) tensor per routed layer: normalised spectral entropy H ∈ [0, 1] of each token's
        operator input, at least float32 (what the router compares with its thresholds).
    routing_fractions (`tuple[torch.FloatTensor]`):
        One (num routed operators,) tensor per routed layer: fraction of the non-padding tokens routed to each operator.
    router_probabilities (`tuple[torch.FloatTensor]`, *optional*):
        Hard and soft routing: one (batch, new positions, num routed operators) tensor of router probabilities per
        routed layer.
    aux_loss (`torch.FloatTensor`, *optional*):
        The usage-entropy regulariser λ Σ_layers (log K − H(ū)) when `router_usage_entropy_weight` > 0; the heads add it
        to their loss.

    With `output_attentions=True`, `attentions` holds one tensor per layer whose attention takes every token as a
    query, in layer order: the `attention` layers, and the routed layers that run every operator on every token
    (`routed_execution="dense"`, soft routing). Mixing layers, and routed layers that attend with their routed queries
    only, record none.
"""


@dataclass
class ChiarModelOutputWithPast(BaseModelOutputWithPast):
    __doc__ = BaseModelOutputWithPast.__doc__ + _ROUTING_DOC

    routing_decisions: tuple[torch.LongTensor, ...] | None = None
    routing_entropies: tuple[torch.FloatTensor, ...] | None = None
    routing_fractions: tuple[torch.FloatTensor, ...] | None = None
    router_probabilities: tuple[torch.FloatTensor, ...] | None = None
    aux_loss: torch.FloatTensor | None = None


@dataclass
class ChiarCausalLMOutputWithPast(CausalLMOutputWithPast):
    __doc__ = CausalLMOutputWithPast.__doc__ + _ROUTING_DOC

    routing_decisions: tuple[torch.LongTensor, ...] | None = None
    routing_entropies: tuple[torch.FloatTensor, ...] | None = None
    routing_fractions: tuple[torch.FloatTensor, ...] | None = None
    router_probabilities: tuple[torch.FloatTensor, ...] | None = None
    aux_loss: torch.FloatTensor | None = None


@dataclass
class ChiarSequenceClassifierOutputWithPast(SequenceClassifierOutputWithPast):
    __doc__ = SequenceClassifierOutputWithPast.__doc__ + _ROUTING_DOC

    routing_decisions: tuple[torch.LongTensor, ...] | None = None
    routing_entropies: tuple[torch.FloatTensor, ...] | None = None
    routing_fractions: tuple[torch.FloatTensor, ...] | None = None
    router_probabilities: tuple[torch.FloatTensor, ...] | None = None
    aux_loss: torch.FloatTensor | None = None


class ChiarRotaryEmbedding(LlamaRotaryEmbedding):
    """RoPE cos / sin for integer positions: transformers' Llama rotary embedding (default rope type), with the
    frequencies θ_j = rope_theta^(−2j / head_dim) taken from CHIAR's `rope_theta` (the config has no
    `rope_parameters`). The rotation is transformers' rotate-half form (`apply_rotary_pos_emb`)."""

    def __init__(self, config: ChiarConfig):
        nn.Module.__init__(self)
        self.config = config
        self.rope_type = "default"
        self.max_seq_len_cached = self.original_max_seq_len = config.max_position_embeddings
        inv_freq, self.attention_scaling = self.compute_default_rope_parameters(config)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        self.original_inv_freq = nn.Buffer(inv_freq.clone(), persistent=False)

    @staticmethod
    def compute_default_rope_parameters(config: ChiarConfig, device=None, **kwargs) -> tuple[torch.Tensor, float]:
        head_dim = config.hidden_size // config.num_attention_heads
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / head_dim
        return 1.0 / (float(config.rope_theta) ** exponents), 1.0


def rotate(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of one tensor (batch, heads, positions, head_dim) with cos / sin (batch, positions, head_dim): the
    single-tensor form of transformers' `apply_rotary_pos_emb`, for routed queries, which sit at other positions than
    the keys."""
    cos, sin = cos[:, None], sin[:, None]
    return states * cos + rotate_half(states) * sin


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Softmax attention in plain torch; ``attention_mask`` is boolean (True = may attend), as CHIAR builds it."""
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights.masked_fill(~attention_mask, torch.finfo(attn_weights.dtype).min)
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value).transpose(1, 2).contiguous()
    return attn_output, attn_weights


class ChiarMLP(nn.Module):
    def __init__(self, config: ChiarConfig):
        super().__init__()
        self.fc_in = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = ACT2FN[config.hidden_act]
        self.fc_out = nn.Linear(config.intermediate_size, config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, hidden_states):
        return self.dropout(self.fc_out(self.act(self.fc_in(hidden_states))))


class ChiarDCTMixing(nn.Module):
    """DCT mixing branch iDCT(DCT(x) ⊙ f) with a learned spectral filter f (init 1); per token, so causal."""

    def __init__(self, config: ChiarConfig):
        super().__init__()
        self.implementation = config.dct_implementation
        self.spectral_filter = nn.Parameter(torch.ones(config.hidden_size))
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, hidden_states: torch.Tensor, return_spectrum: bool = False):
        """The branch; with ``return_spectrum``, ``(branch, DCT coefficients of the input)``: routed layers need
        both for the entropy. In matrix form both come from the same butterfly products (coefficients then in
        even-then-odd order). (One entry point: accelerate's offloading moves the filter in through ``forward``.)"""
        if not return_spectrum:
            return self.dropout(dct_mixing(hidden_states, self.spectral_filter, self.implementation))
        if self.implementation == "matrix":
            spectrum, mixed = dct_even_odd(hidden_states, self.spectral_filter)
        else:
            spectrum = dct(hidden_states, self.implementation)
            mixed = idct(spectrum * self.spectral_filter.to(spectrum.dtype), self.implementation)
        return self.dropout(mixed), spectrum


def cached_recurrent_state(cache: Cache | None, layer_idx: int) -> torch.Tensor | None:
    """The RBF prefix sums stored for a layer, or None before the first forward pass."""
    if cache is None:
        return None
    layer = cache.layers[layer_idx]
    if not layer.is_recurrent_states_initialized[0]:
        return None
    return layer.recurrent_states[0]


def count_new_tokens(cache: Cache, layer_idx: int, hidden_states: torch.Tensor) -> None:
    """Record the new positions in a linear-attention cache layer without keys and values (RBF prefix sums, or
    nothing: DCT mixing). transformers counts such a layer's tokens (its length, which generation reads from the
    first layer) through its convolution state, so the layer keeps one of zero channels: it costs nothing, and
    cropping and beam reordering handle it like any other."""
    batch, length = hidden_states.shape[:2]
    cache.update_conv_state(hidden_states.new_empty(batch, 0, length), layer_idx, conv_kernel_size=1)


class ChiarRBFMixing(nn.Module):
    """RBF kernel mixing: token states attend to each other through random features of the Gaussian kernel
    exp(−γ‖x_i − x_j‖²) with fixed ω (saved with the weights), values and output projected.

    ``positive`` variant: linear kernel attention with positive random features, causal through prefix sums in a
    causal model (the sums are the cache state), over all tokens in an encoder. ``authors`` variant (encoders only):
    softmax(φφᵀ) v with trigonometric features.
    """

    def __init__(self, config: ChiarConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.variant = config.rbf_variant
        self.is_causal = config.is_causal
        self.gamma = float(config.rbf_gamma)
        self.chunk_size = config.rbf_chunk_size
        self.omega = nn.Buffer(torch.empty(config.hidden_size, config.rbf_num_features))
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=config.attention_bias)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(
        self,
        hidden_states: torch.Tensor,
        token_valid: torch.Tensor | None = None,
        cache: Cache | None = None,
        layout: tuple[torch.Tensor, torch.Tensor] | None = None,
        document_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(B, T, d) -> (B, T, d), or, given a gathered ``layout`` (index (B, Q), valid (B, Q)), the outputs of those
        tokens only (B, Q, d). Every token contributes its key and value to the sums whether or not it is gathered;
        in packed rows (``document_positions`` (B, T)) only to those of its own document."""
        values = self.v_proj(hidden_states)
        if self.variant == "authors":
            phi = trigonometric_random_features(hidden_states, self.omega)
            mixed = authors_rbf_mixing(phi, values, token_valid)
        else:
            phi = positive_random_features(hidden_states, self.omega, self.gamma)
            phi_keys = phi if token_valid is None else phi * token_valid[..., None]
            if self.is_causal:
                past_state = cached_recurrent_state(cache, self.layer_idx)
                mixed, state = causal_kernel_attention(
                    phi, phi_keys, values, past_state, self.chunk_size, document_positions=document_positions
                )
                if cache is not None:
                    cache.update_recurrent_state(state, self.layer_idx)
            else:
                mixed = bidirectional_kernel_attention(phi, phi_keys, values)
        if layout is not None:
            mixed = gather_routed(mixed, layout[0])
        return self.dropout(self.o_proj(mixed))


class ChiarAttention(nn.Module):
    """Multi-head self-attention with RoPE and qkv biases, through transformers' attention backends.

    Given a gathered ``layout`` (the routed tokens of each row, :func:`routed_layout`), only those tokens are
    queries; keys and values always come from every token, cached ones included, so that a routed query sees exactly
    the keys a dense layer shows it.
    """

    def __init__(self, config: ChiarConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = config.is_causal
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=config.attention_bias)
        # Keys and values in one product: a routed layer computes them for every token, queries only for some.
        self.kv_proj = nn.Linear(config.hidden_size, 2 * config.hidden_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=config.attention_bias)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def _heads(self, states: torch.Tensor) -> torch.Tensor:
        """(B, N, d) -> (B, heads, N, head_dim)."""
        return states.view(*states.shape[:2], self.num_heads, self.head_dim).transpose(1, 2)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        key_valid: torch.Tensor | None = None,
        past_length: int = 0,
        cache: Cache | None = None,
        layout: tuple[torch.Tensor, torch.Tensor] | None = None,
        document_positions: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Dense: (B, T, d) -> ((B, T, d), attention probabilities under eager attention). Routed (``layout`` given):
        -> ((B, Q, d) outputs of the gathered tokens, None). ``key_valid`` (B, past + T) marks real tokens (None:
        no padding); ``document_positions`` (B, T): packed rows, whose queries read their own document's keys only;
        the masks are built here, once the cache has given the keys."""
        batch, length, _ = hidden_states.shape
        cos, sin = position_embeddings
        key_value = self.kv_proj(hidden_states)
        key = self._heads(key_value[..., : self.config.hidden_size])
        value = self._heads(key_value[..., self.config.hidden_size :])

        if layout is None:
            query = self._heads(self.q_proj(hidden_states))
            query, key = apply_rotary_pos_emb(query, key, cos, sin)
        else:
            index, query_valid = layout
            key = rotate(key, cos, sin)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        key_length = key.shape[2]

        implementation = self._implementation(kwargs)
        # The first key each query may read: its document's first token in a packed row (no past there), else 0.
        query_starts = None if document_positions is None else document_starts(document_positions)
        if layout is None:
            query_slots = (torch.arange(length, device=key.device) + past_length).expand(batch, -1)
            query_valid = None
        else:
            if index.shape[1] == 0:  # no token routed here (eager mode on CPU): only the cache grew
                return hidden_states.new_zeros(batch, 0, hidden_states.shape[-1]), None
            query = self._heads(self.q_proj(gather_routed(hidden_states, index)))
            query = rotate(query, gather_routed(cos, index), gather_routed(sin, index))
            query_slots = index + past_length
            if query_starts is not None:
                query_starts = gather_routed(query_starts, index)
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
        if implementation == "eager":  # CHIAR's own, which reads its boolean masks
            attention_interface = eager_attention_forward
        elif implementation == "flex_attention":  # on CPU compiled for static shapes: input shapes may change
            attention_interface = flex_attention_forward
        dropout = self.config.attention_dropout if self.training else 0.0
        chunks = self._key_prefix_chunks(implementation, query_slots) if layout is not None else 1
        if chunks > 1:
            attn_output = self._attend_in_key_prefixes(
                attention_interface, chunks, query, key, value, query_slots, query_valid, key_valid, query_starts,
                dropout, **kwargs,
            )
            return self.dropout(self.o_proj(attn_output.reshape(batch, query.shape[2], -1))), None

        mask, is_causal = self._mask(
            implementation, query_slots, query_valid, key_valid, key_length, past_length, query_starts,
            dense=layout is None,
        )
        attn_output, attn_weights = attention_interface(
            self, query, key, value, mask, dropout=dropout, scaling=self.scaling, is_causal=is_causal, **kwargs
        )
        attn_output = self.dropout(self.o_proj(attn_output.reshape(batch, query.shape[2], -1)))
        return attn_output, attn_weights if layout is None else None

    def _key_prefix_chunks(self, implementation: str, query_slots: torch.Tensor) -> int:
        """How many groups of gathered causal queries to attend separately, each against only the key prefix its
        latest query reads. Only where the prefix lengths can be read for free (eager mode on CPU) and for the
        backends that compute every (query, key) pair they are given (SDPA with a mask, eager): ≈ (1 + 1/n) / 2 of
        the pairs with n groups. flex_attention's block mask already skips each block's future."""
        if not self.is_causal or implementation not in ("sdpa", "eager") or not host_reads_are_free(query_slots):
            return 1
        return max(1, min(KEY_PREFIX_CHUNKS, query_slots.shape[1] // KEY_PREFIX_MIN_QUERIES))

    def _attend_in_key_prefixes(
        self, attention_interface, chunks, query, key, value, query_slots, query_valid, key_valid, query_starts,
        dropout, **kwargs,
    ):
        """Gathered causal queries (B, heads, Q, head_dim) in ``chunks`` consecutive groups, each against the keys up
        to the latest slot a valid query of the group has (one host read for all groups) -> (B, Q, heads, head_dim)."""
        width = query.shape[2]
        bounds = [round(i * width / chunks) for i in range(chunks + 1)]
        latest = torch.where(query_valid, query_slots, 0)
        ends = torch.stack([latest[:, start:end].amax() for start, end in zip(bounds[:-1], bounds[1:])]) + 1
        outputs = []
        for start, end, key_length in zip(bounds[:-1], bounds[1:], ends.tolist()):
            starts = None if query_starts is None else query_starts[:, start:end]
            mask = gathered_query_mask(
                query_slots[:, start:end], query_valid[:, start:end], key_valid, key_length, True, starts
            )
            out, _ = attention_interface(
                self,
                query[:, :, start:end],
                key[:, :, :key_length],
                value[:, :, :key_length],
                mask,
                dropout=dropout,
                scaling=self.scaling,
                is_causal=False,
                **kwargs,
            )
            outputs.append(out)
        return torch.cat(outputs, dim=1)

    def _implementation(self, kwargs: dict) -> str:
        """The attention backend of this call: the config's, or eager when attention probabilities are asked for,
        which the fused backends do not return (transformers' models fall back the same way)."""
        implementation = self.config._attn_implementation or "eager"
        if implementation != "eager" and kwargs.get("output_attentions", getattr(self.config, "output_attentions", False)):
            logger.warning_once(
                f"CHIAR-Former: the `{implementation}` attention backend does not return attention probabilities; "
                "`output_attentions=True` computes them with the eager implementation instead (slower). Load the model "
                "with `attn_implementation='eager'` to silence this warning."
            )
            return "eager"
        return implementation

    def _mask(self, implementation, query_slots, query_valid, key_valid, key_length, past_length, query_starts, dense):
        """The attention mask of queries at ``query_slots`` (B, Q) and the ``is_causal`` flag for the backend.

        flex_attention: a BlockMask (blocks of unrouted queries and each block's future skipped). SDPA over every
        query without padding nor packed documents, when the keys are exactly the cached and new tokens (not a static
        cache's longer buffer): no mask, the kernel's own causal flag (its fastest path). Otherwise a boolean
        (B, 1, Q, S) mask. ``query_starts`` (B, Q): the first key slot each query reads (packed rows), or None."""
        if implementation == "flex_attention":
            mask = gathered_query_block_mask(
                query_slots, query_valid, key_valid, key_length, self.is_causal, FLEX_BLOCK_SIZE, query_starts
            )
            return mask, False
        if (
            dense
            and key_valid is None
            and query_starts is None
            and implementation == "sdpa"
            and isinstance(past_length, int)  # not a StaticCache: its buffer is longer than what it holds
            and key_length == past_length + query_slots.shape[1]
        ):
            if past_length == 0:  # every key is a new token: the kernel's causal flag is the mask
                return None, self.is_causal
            if query_slots.shape[1] == 1:  # one new token after the cache: it reads every key
                return None, False
        return gathered_query_mask(query_slots, query_valid, key_valid, key_length, self.is_causal, query_starts), False


class ChiarRouter(nn.Module):
    """Chooses an operator per token from its own state: entropy thresholds, or Linear([x, H]) for hard / soft."""

    def __init__(self, config: ChiarConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.router_type = config.router_type
        self.num_operators = len(config.routed_operators)
        self.proj = None
        if self.router_type != "threshold":
            self.proj = nn.Linear(config.hidden_size + 1, self.num_operators)

    def forward(
        self, hidden_states: torch.Tensor, entropy: torch.Tensor, token_valid: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> routes (B, T) long, probabilities (B, T, K) or None (threshold routing)."""
        probabilities = None
        if self.proj is None:
            routes = threshold_routes(entropy, self.config.thresholds_for(self.layer_idx))
        else:
            features = torch.cat([hidden_states, entropy[..., None].to(hidden_states.dtype)], dim=-1)
            probabilities = router_probabilities(self.proj(features))
            routes = hard_routes(probabilities) if self.router_type == "hard" else soft_routes(probabilities)
        if token_valid is not None:  # padding takes the first (lowest-entropy) operator: its output is never read
            routes = routes.masked_fill(~token_valid, 0)
        return routes, probabilities


def routed_capacity(selected: torch.Tensor) -> int:
    """Width Q of the gathered layout of the ``selected`` (B, T) tokens.

    Where reading the count costs nothing (CPU, eager mode): the largest count of the batch, so that projections and
    attention process only the routed rows. Elsewhere (accelerators, ``torch.compile``): T, a static shape that
    needs no host read."""
    if not host_reads_are_free(selected):
        return selected.shape[1]
    return int(selected.sum(1).max())


class ChiarLayer(GradientCheckpointingLayer):
    """Operator sub-layer (one operator, or a routed choice) and FFN, each residual; post-LN or pre-LN."""

    def __init__(self, config: ChiarConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.operators = config.layer_operator_set(layer_idx)
        self.is_routed = config.layer_operators[layer_idx] == "routed"
        self.pre_norm = config.layer_norm_position == "pre"
        self.dense_routing = config.router_type == "soft" or config.routed_execution == "dense"
        self.dct_implementation = config.dct_implementation
        self.dct = ChiarDCTMixing(config) if "dct" in self.operators else None
        self.rbf = ChiarRBFMixing(config, layer_idx) if "rbf" in self.operators else None
        self.attention = ChiarAttention(config, layer_idx) if "attention" in self.operators else None
        self.router = ChiarRouter(config, layer_idx) if self.is_routed else None
        self.operator_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = ChiarMLP(config)
        self.mlp_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        key_valid: torch.Tensor | None = None,
        token_valid: torch.Tensor | None = None,
        past_length: int = 0,
        cache: Cache | None = None,
        document_positions: torch.Tensor | None = None,
        **kwargs,
    ):
        """-> (hidden states, routes, entropies, router probabilities); the last three are None unless routed.
        ``document_positions`` (B, T): packed rows, each document mixed and attended on its own."""
        operator_input = self.operator_norm(hidden_states) if self.pre_norm else hidden_states
        context = dict(
            position_embeddings=position_embeddings,
            key_valid=key_valid,
            token_valid=token_valid,
            past_length=past_length,
            cache=cache,
            document_positions=document_positions,
            **kwargs,
        )
        routes = entropy = probabilities = None
        if self.is_routed:
            mixed, routes, entropy, probabilities = self._routed(operator_input, context)
        else:
            mixed = self._run(self.operators[0], operator_input, context)

        if self.pre_norm:
            hidden_states = hidden_states + mixed
            hidden_states = hidden_states + self.mlp(self.mlp_norm(hidden_states))
        else:
            hidden_states = self.operator_norm(hidden_states + mixed)
            hidden_states = self.mlp_norm(hidden_states + self.mlp(hidden_states))
        return hidden_states, routes, entropy, probabilities

    def _run(self, operator, states, context, dct_output=None, layout=None):
        """One operator on every token, or on the tokens of a gathered ``layout`` only (then (B, Q, d))."""
        if operator == "dct":
            return self.dct(states) if dct_output is None else dct_output
        if operator == "rbf":
            return self.rbf(states, context["token_valid"], context["cache"], layout, context["document_positions"])
        attention_context = {name: value for name, value in context.items() if name != "token_valid"}
        return self.attention(states, layout=layout, **attention_context)[0]

    def _routed(self, states: torch.Tensor, context: dict):
        dct_output = None
        if self.dct is not None:
            dct_output, spectrum = self.dct(states, return_spectrum=True)
        elif self.dct_implementation == "matrix":
            spectrum, _ = dct_even_odd(states)
        else:
            spectrum = dct(states, self.dct_implementation)
        # Threshold routes are piecewise constant in the entropy: no gradient to carry.
        with torch.set_grad_enabled(torch.is_grad_enabled() and self.router.proj is not None):
            entropy = spectral_entropy_from_spectrum(spectrum)
        routes, probabilities = self.router(states, entropy, context["token_valid"])

        if self.dense_routing:
            # Soft routing blends every operator; dense execution is the authors' one-hot-select formulation.
            weights = probabilities if self.router.router_type == "soft" else None
            if weights is None:
                weights = one_hot_gates(probabilities, routes, len(self.operators))
            mixed = sum(
                weights[..., k : k + 1].to(states.dtype) * self._run(op, states, context, dct_output)
                for k, op in enumerate(self.operators)
            )
            return mixed, routes, entropy, probabilities

        # DCT mixing runs on every token: it comes out of the products that give the spectrum for the entropy, which
        # costs less than gathering and scattering the DCT-routed rows. The other operators then replace the rows of
        # their own tokens; each is called even when no token took it (keys, values and prefix sums of every token
        # go to the cache).
        mixed = dct_output if dct_output is not None else torch.zeros_like(states)
        # flex_attention keeps the static width T: its compiled kernel would otherwise see a new query length at every
        # batch (recompilations, and dynamic shapes its CPU template does not compile in torch 2.13); its block mask
        # skips the blocks of unrouted queries instead.
        flex = self.config._attn_implementation == "flex_attention"
        for k, operator in enumerate(self.operators):
            if operator == "dct":
                continue
            selected = routes == k
            capacity = selected.shape[1] if flex and operator == "attention" else routed_capacity(selected)
            layout = routed_layout(selected, capacity)
            out = self._run(operator, states, context, layout=layout)
            mixed = scatter_routed(mixed, selected, layout[0], out)
        if probabilities is not None:
            mixed = mixed * straight_through_gate(probabilities, routes)[..., None].to(mixed.dtype)
        return mixed, routes, entropy, probabilities


class ChiarPreTrainedModel(PreTrainedModel):
    """Weight initialisation, attention backends (eager, SDPA, flex_attention) and loading shared by the
    CHIAR-Former models (`ChiarConfig`)."""

    config_class = ChiarConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["ChiarLayer"]
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = True
    # Attention probabilities (eager attention, or the eager fallback of output_attentions=True) are recorded for layers
    # that attend with every token as a query; a routed layer's gathered queries record none.
    _can_record_outputs = {
        "hidden_states": ChiarLayer,
        "attentions": OutputRecorder(ChiarAttention, index=1),
    }

    def __init__(self, config, *args, **kwargs):
        # Values assigned after the config was built are checked here, and the sizes against the memory of the
        # device the parameters go to, before any layer is built.
        config._validate()
        check_parameters_fit(config, learned_positions=False)
        super().__init__(config, *args, **kwargs)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' ``save_pretrained``, then the code that loads the folder without the plugin
        (``trust_remote_code=True``): the configuration and modeling files, the ops files they import, the ``auto_map``."""
        return save_pretrained_with_code(super().save_pretrained, self, save_directory, *args, **kwargs)

    def _init_weights(self, module):
        # Linear / Embedding: N(0, initializer_range), biases 0; LayerNorm: 1, 0; the rotary embedding's frequencies.
        super()._init_weights(module)
        if isinstance(module, ChiarDCTMixing):
            init.ones_(module.spectral_filter)
        elif isinstance(module, ChiarRBFMixing):
            init.normal_(module.omega, mean=0.0, std=(2.0 * module.gamma) ** 0.5)
        elif isinstance(module, SequencePooling):
            if module.mode == "learned":
                init.zeros_(module.position_logits)
            elif module.mode == "rmt_optimal":
                init.ones_(module.position_weights)


class ChiarModel(ChiarPreTrainedModel):
    """The CHIAR-Former stack without a head: DCT mixing, RBF kernel attention, full attention or routed layers
    (`config.layer_operators`), a routed layer choosing an operator per token from the spectral entropy of its state
    (SPEC 2). With ``output_routing=True`` its output also holds, per routed layer, ``routing_decisions``,
    ``routing_entropies``, ``routing_fractions`` and (learned routers) ``router_probabilities``, and ``aux_loss``
    with a usage regulariser."""

    def __init__(self, config: ChiarConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout)
        self.layers = nn.ModuleList(ChiarLayer(config, i) for i in range(config.num_hidden_layers))
        # Post-LN layers already end in a LayerNorm.
        self.norm = (
            nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
            if config.layer_norm_position == "pre"
            else nn.Identity()
        )
        self.rotary_emb = ChiarRotaryEmbedding(config)
        self.built_causal = config.is_causal
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def _past_length(
        self, cache: Cache | None, attention_mask: torch.Tensor | None, length: int
    ) -> int | torch.Tensor:
        """The number of cached positions: an int, or a ``StaticCache``'s on-device tensor (never read on the host
        there, so that a decoding step does not wait for the device and compiles as one graph)."""
        if cache is None:
            return 0
        if len(cache.layers) != self.config.num_hidden_layers:
            raise ValueError(
                f"the cache has {len(cache.layers)} layers, the model {self.config.num_hidden_layers}: create it with "
                "`DynamicCache(config=model.config)` so that each layer gets the state its operator needs"
            )
        for index in range(self.config.num_hidden_layers):
            if "rbf" in self.config.layer_operator_set(index) and not isinstance(
                cache.layers[index], LinearAttentionCacheLayerMixin
            ):
                raise ValueError(
                    f"layer {index} keeps RBF prefix sums in the cache, but the cache's layer {index} is a "
                    f"{type(cache.layers[index]).__name__} that cannot hold them (a cache built without the model's "
                    "config, e.g. by PEFT prefix tuning): create it with `DynamicCache(config=model.config)`"
                )
        # (a list, not next() over a generator: torch 2.8's Dynamo breaks the graph on that)
        key_layers = [i for i, t in enumerate(self.config.layer_types) if t in ("full_attention", "hybrid")]
        if key_layers:
            # A StaticCache's length is a tensor its layers' updates advance in place: keep this call's value.
            past_length = cache.get_seq_length(key_layers[0])
            return past_length.clone() if isinstance(past_length, torch.Tensor) else past_length
        # Only recurrent state: nothing depends on the past length except the mask's shape.
        return attention_mask.shape[1] - length if attention_mask is not None and attention_mask.ndim == 2 else 0

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_routing: bool = False,
        **kwargs,
    ) -> ChiarModelOutputWithPast:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        # transformers lets an `is_causal` kwarg turn decoders bidirectional per call; CHIAR builds its operators
        # (RBF prefix sums, routed-query masks) causal or not from the config, so only the config may decide.
        if kwargs.pop("is_causal", self.built_causal) != self.built_causal:
            raise ValueError(
                f"this CHIAR model was built with is_causal={self.built_causal}; set `is_causal` in the config instead "
                "of passing it to forward"
            )
        if input_ids is not None:
            _check_tokens("input_ids", input_ids, 2)
            inputs_embeds = self.embed_tokens(input_ids)
        else:
            _check_tokens("inputs_embeds", inputs_embeds, 3, self.config.hidden_size)
        if not self.built_causal:
            if cache is not None:
                raise ValueError("a bidirectional CHIAR encoder (is_causal=False) has no cache")
            use_cache = False
        batch, length = inputs_embeds.shape[:2]
        # Packed rows (several documents a row, no attention_mask, nothing cached): every operator keeps the
        # documents apart; their keys and prefix sums cannot be cached for a later step.
        document_positions, position_ids, use_cache = packed_rows(
            position_ids, attention_mask, cache, use_cache, batch, length, kwargs, type(self).__name__
        )
        if not self.built_causal:
            check_not_packed(
                document_positions, type(self).__name__, "a bidirectional encoder's RBF sums and attention run over the "
                "whole row"
            )
            document_positions = None  # (in a compiled graph: counted positions, one sequence a row)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if isinstance(attention_mask, dict):  # transformers' masks per layer type (`create_masks_for_generate`)
            attention_mask = next((m for m in attention_mask.values() if m is not None), None)
        past_length = self._past_length(cache, attention_mask, length)
        # A StaticCache's length is read on the host only where that is free: for the checks and the slicing below.
        known_length = host_length(past_length)
        if attention_mask is not None and attention_mask.ndim == 4:
            # A causal 4D mask (generate() builds one for a StaticCache): its last row is the padding. Without a
            # host-side length the whole row: the slots after the new positions read as padding, which the attention
            # masks skip anyway.
            width = None if known_length is None else known_length + length
            attention_mask = padding_of_causal_mask(attention_mask, width)

        key_valid = token_valid = None
        if attention_mask is not None:
            width = f"cached + {length}" if known_length is None else known_length + length
            if attention_mask.ndim != 2 or attention_mask.shape[0] != batch or attention_mask.shape[1] < length or (
                known_length is not None
                and not mask_width_is_valid(attention_mask.shape[1], known_length, length, cache)
            ):
                cached = "?" if known_length is None else known_length
                raise ValueError(
                    f"attention_mask must have shape (batch, cached + new positions) = ({batch}, {width}) ({cached} "
                    f"cached, {length} new), got {tuple(attention_mask.shape)}"
                )
            key_valid = attention_mask.bool()
            # Without padding every padding mask and fix-up is skipped; read where that costs no synchronisation.
            if host_reads_are_free(key_valid) and bool(key_valid.all()):
                key_valid = None
            else:
                token_valid = new_positions(key_valid, past_length, length)
        position_ids = self._position_ids(position_ids, key_valid, batch, length, past_length, inputs_embeds.device)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)

        hidden_states = self.dropout(inputs_embeds)
        decisions, entropies, fractions, probabilities = [], [], [], []
        # Early-exit drafting (`assistant_early_exit`) lowers num_hidden_layers: run that many layers.
        for layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states, routes, entropy, probs = layer(
                hidden_states,
                position_embeddings=position_embeddings,
                key_valid=key_valid,
                token_valid=token_valid,
                past_length=past_length,
                cache=cache,
                document_positions=document_positions,
                **kwargs,
            )
            if routes is not None and output_routing:
                decisions.append(routes)
                entropies.append(entropy)
                fractions.append(routing_fractions(routes, token_valid, len(self.config.routed_operators)))
                if probs is not None:
                    probabilities.append(probs)

        if cache is not None:  # the linear-attention layers without keys (PEFT prefix tuning's cache has none)
            for index, layer in enumerate(cache.layers[: self.config.num_hidden_layers]):
                if isinstance(layer, LinearAttentionCacheLayerMixin) and not isinstance(layer, CacheLayerMixin):
                    count_new_tokens(cache, index, hidden_states)

        if not output_routing:
            return ChiarModelOutputWithPast(last_hidden_state=self.norm(hidden_states), cache=cache)
        aux_loss = None
        if self.config.router_usage_entropy_weight > 0 and probabilities:
            penalty = sum(usage_entropy_penalty(probs, token_valid) for probs in probabilities)
            aux_loss = self.config.router_usage_entropy_weight * penalty
        return ChiarModelOutputWithPast(
            last_hidden_state=self.norm(hidden_states),
            cache=cache,
            routing_decisions=tuple(decisions),
            routing_entropies=tuple(entropies),
            routing_fractions=tuple(fractions),
            router_probabilities=tuple(probabilities) if probabilities else None,
            aux_loss=aux_loss,
        )

    @staticmethod
    def _position_ids(position_ids, key_valid, batch, length, past_length, device) -> torch.Tensor:
        """(B, T) positions: given ones checked, else counted over real tokens (left padding does not shift them)."""
        if position_ids is None:
            if key_valid is not None:
                return new_positions(token_positions(key_valid), past_length, length)
            return (torch.arange(length, device=device) + past_length)[None].expand(batch, -1)
        if position_ids.ndim == 1:
            position_ids = position_ids[None]
        if position_ids.ndim != 2 or position_ids.shape[0] not in (1, batch) or position_ids.shape[1] != length:
            raise ValueError(
                f"position_ids must have shape (batch, new positions) = ({batch}, {length}) or (1, {length}), got "
                f"{tuple(position_ids.shape)}"
            )
        # A value check reads the tensor: done where that costs no synchronisation (CPU, eager mode).
        if host_reads_are_free(position_ids) and bool((position_ids < 0).any()):
            raise ValueError(
                f"position_ids must be >= 0, got a minimum of {int(position_ids.min())} in position_ids of shape "
                f"{tuple(position_ids.shape)}"
            )
        return position_ids.expand(batch, -1)


def _check_tokens(name: str, tokens: torch.Tensor, ndim: int, hidden_size: int | None = None) -> None:
    """Refuse inputs of the wrong rank, width or with no token, naming the argument and its shape (shapes are static:
    no synchronisation, no graph break)."""
    layout = "(batch, positions)" if ndim == 2 else f"(batch, positions, hidden_size = {hidden_size})"
    if tokens.ndim != ndim or (hidden_size is not None and tokens.shape[-1] != hidden_size):
        raise ValueError(f"{name} must have shape {layout}, got a {tokens.ndim}-D tensor of shape {tuple(tokens.shape)}")
    if tokens.shape[0] == 0 or tokens.shape[1] == 0:
        raise ValueError(f"{name} is empty (shape {tuple(tokens.shape)}): CHIAR-Former needs at least one token per row")


def _routing_fields(outputs, output_routing: bool) -> dict:
    if not output_routing:
        return {}
    return {
        "routing_decisions": outputs.routing_decisions,
        "routing_entropies": outputs.routing_entropies,
        "routing_fractions": outputs.routing_fractions,
        "router_probabilities": outputs.router_probabilities,
        "aux_loss": outputs.aux_loss,
    }


class ChiarForCausalLM(ChiarPreTrainedModel, GenerationMixin):
    """A causal CHIAR-Former (`config.is_causal`) with a language-model head (tied to the input embeddings unless
    `config.tie_word_embeddings` is False); generates with transformers' caches (RBF layers keep a recurrent
    state). With ``output_routing=True`` returns the routing outputs of `ChiarModel` beside the logits; with labels
    it adds ``aux_loss`` (the usage regulariser) to the loss whether or not they are returned."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    # generate() hands the forward the 2D padding mask for every cache (the routing and the RBF sums read it).
    create_masks_for_generate = staticmethod(keep_padding_mask_for_generate)

    def __init__(self, config: ChiarConfig):
        if not config.is_causal:
            raise ValueError("ChiarForCausalLM needs `is_causal=True`; a bidirectional encoder cannot be a language model")
        super().__init__(config)
        self.model = ChiarModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def _validate_generation_mode(self, generation_mode, generation_config, *args, **kwargs):
        # Assisted decoding (a draft model, or prompt lookup) crops the caches back to the accepted tokens. RBF
        # mixing's prefix sums cannot be rolled back: transformers 5.24 refuses such a main model itself, 5.25 would
        # crop them wrongly; neither refuses such a draft. Nor can transformers 5.24 read the length of a draft's cache
        # without attention layers.
        prefix_sums = any("rbf" in self.config.layer_operator_set(i) for i in range(self.config.num_hidden_layers))
        is_draft = getattr(generation_config, "is_assistant", False)
        if prefix_sums and generation_mode == GenerationMode.ASSISTED_GENERATION:
            raise ValueError(
                f"this {type(self).__name__} cannot generate with an assistant_model, early exit or prompt lookup: its "
                "cache holds RBF mixing's prefix sums, which cannot be cropped back after the drafts are verified"
            )
        if is_draft and (prefix_sums or set(self.config.layer_types) == {"linear_attention"}):
            raise ValueError(
                f"this {type(self).__name__} cannot be an assistant_model: its cache holds RBF mixing's prefix sums "
                "(or it has no attention layer), which cannot be cropped back after the drafts are verified. Use a "
                "draft model whose layers are DCT mixing and attention"
            )
        return super()._validate_generation_mode(generation_mode, generation_config, *args, **kwargs)

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        output_routing: bool = False,
        **kwargs,
    ) -> ChiarCausalLMOutputWithPast:
        if labels is not None and use_cache is None:
            use_cache = False  # a loss (training, evaluation) has no use for a KV cache, which would copy every key
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_routing=output_routing or labels is not None,  # a loss adds the usage regulariser
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            hidden_states = hidden_states[:, -logits_to_keep:]
        elif isinstance(logits_to_keep, torch.Tensor):
            hidden_states = hidden_states[:, logits_to_keep]
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
            if outputs.aux_loss is not None:
                aux_loss = outputs.aux_loss
                num_items_in_batch = kwargs.get("num_items_in_batch")
                if num_items_in_batch is not None:
                    # The token loss is a sum over this micro-batch divided by the tokens of all micro-batches (and
                    # processes) of an optimiser step, which Trainer then adds up: the regulariser takes this
                    # micro-batch's share of those tokens, so that it counts once per step, not once per micro-batch.
                    aux_loss = aux_loss * (labels[..., 1:] != -100).sum() / num_items_in_batch
                loss = loss + aux_loss
        return ChiarCausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            **_routing_fields(outputs, output_routing),
        )


class ChiarForSequenceClassification(ChiarPreTrainedModel):
    """CHIAR-Former with a pooled classification head (pooling: ``config.classifier_pooling``). Routing outputs and
    the usage regulariser as `ChiarForCausalLM`."""

    def __init__(self, config: ChiarConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = ChiarModel(config)
        self.pooling = SequencePooling(config.classifier_pooling, config.max_position_embeddings)
        self.dropout = nn.Dropout(config.classifier_dropout)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        output_routing: bool = False,
        **kwargs,
    ) -> ChiarSequenceClassifierOutputWithPast:
        kwargs.pop("use_cache", None)
        refuse_packed_rows(type(self).__name__, input_ids, inputs_embeds, attention_mask, position_ids, kwargs)
        attention_mask = classifier_attention_mask(
            type(self).__name__, input_ids, inputs_embeds, attention_mask, self.config.pad_token_id
        )
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=False,
            output_routing=output_routing or labels is not None,
            **kwargs,
        )
        pooled = self.pooling(outputs.last_hidden_state, attention_mask)
        logits = self.score(self.dropout(pooled))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, pooled_logits=logits, config=self.config)
            if outputs.aux_loss is not None:
                loss = loss + outputs.aux_loss
        return ChiarSequenceClassifierOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            **_routing_fields(outputs, output_routing),
        )


__all__ = [
    "ChiarForCausalLM",
    "ChiarForSequenceClassification",
    "ChiarModel",
    "ChiarPreTrainedModel",
    "routing_fractions",
]
