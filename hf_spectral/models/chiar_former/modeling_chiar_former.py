"""CHIAR-Former: each layer mixes tokens with DCT mixing, RBF kernel mixing or attention, or lets every token pick
one of them from its spectral entropy (SPEC 2).

A layer is an operator sub-layer and a GELU FFN, each with a residual connection (post-LN by default, as the
authors). Routed layers compute the DCT of every token once: it gives the spectral entropy the router reads and the
DCT mixing output (one matrix product). With threshold or hard routing the routed layer then runs sparsely:
attention projects keys and values for every token but queries only for its routed tokens, which are gathered,
attended against all keys in blocks that each compute only the keys their last query sees (the plugin's compiled
kernel; masked SDPA calls on key-prefix chunks where it does not apply) and scattered back; a token routed to DCT
mixing is never a query.
Soft routing, and `routed_execution="dense"` (the authors' one-hot select), run every operator on every token.
Routing is per token and reads only the token's own state, so a causal model stays causal and generation with the
cache takes the routes of the forward pass.

Cache (``DynamicCache(config=...)``, layer types from ``config.layer_types``): attention keeps the keys/values of
every token (a later token routed to attention reads them all), the RBF operator keeps its prefix sums
Σ φ(k)[v, 1]ᵀ as a recurrent state, DCT mixing keeps nothing. transformers' hybrid cache layers then handle beam
search reordering; left padding is handled by excluding padding keys from the masks and the prefix sums.
"""

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutputWithPast,
    CausalLMOutputWithPast,
    SequenceClassifierOutputWithPast,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import can_return_tuple
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .configuration_chiar_former import ChiarConfig
from ...ops.pooling import SequencePooling
from ...ops.remote_code import save_model_code
from .spectral_ops import (
    apply_rotary,
    authors_rbf_mixing,
    bidirectional_kernel_attention,
    causal_kernel_attention,
    dct,
    dct_even_odd,
    dct_mixing,
    gathered_query_mask,
    idct,
    one_hot_gates,
    positive_random_features,
    query_chunks,
    rotary_phases,
    spectral_entropy_from_spectrum,
    straight_through_gate,
    threshold_routes,
    trigonometric_random_features,
    usage_entropy_penalty,
)

_ROUTING_DOC = r"""
    routing_decisions (`tuple[torch.LongTensor]`):
        One (batch, new positions) tensor per routed layer: index into `config.routed_operators` of the operator each
        token took (soft routing: the operator with the largest weight). Padding tokens take operator 0.
    routing_entropies (`tuple[torch.FloatTensor]`):
        One (batch, new positions) tensor per routed layer: normalised spectral entropy H ∈ [0, 1] of each token's
        operator input.
    routing_fractions (`tuple[torch.FloatTensor]`):
        One (num routed operators,) tensor per routed layer: fraction of the non-padding tokens routed to each operator.
    router_probabilities (`tuple[torch.FloatTensor]`, *optional*):
        Hard and soft routing: one (batch, new positions, num routed operators) tensor of router probabilities per
        routed layer.
    aux_loss (`torch.FloatTensor`, *optional*):
        The usage-entropy regulariser λ Σ_layers (log K − H(ū)) when `router_usage_entropy_weight` > 0; the heads add it
        to their loss.
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


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
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

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.dropout(dct_mixing(hidden_states, self.spectral_filter, self.implementation))

    def with_spectrum(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The branch and the DCT coefficients of the input (routed layers need them for the entropy). In matrix
        form both come from the same butterfly products (coefficients then in even-then-odd order)."""
        if self.implementation == "matrix":
            spectrum, mixed = dct_even_odd(hidden_states, self.spectral_filter)
        else:
            spectrum = dct(hidden_states, self.implementation)
            mixed = idct(spectrum * self.spectral_filter.to(spectrum.dtype), self.implementation)
        return self.dropout(mixed), spectrum


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
        selected: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(B, T, d) -> (B, T, d), or only the rows of the ``selected`` (B, T) tokens, flattened (N, d).

        Every token contributes its key and value to the prefix sums whether or not it is selected."""
        values = self.v_proj(hidden_states)
        if self.variant == "authors":
            phi = trigonometric_random_features(hidden_states, self.omega)
            mixed = authors_rbf_mixing(phi, values, token_valid)
        else:
            phi = positive_random_features(hidden_states, self.omega, self.gamma)
            phi_keys = phi if token_valid is None else phi * token_valid[..., None]
            if self.is_causal:
                past_state = cached_recurrent_state(cache, self.layer_idx)
                mixed, state = causal_kernel_attention(phi, phi_keys, values, past_state, self.chunk_size)
                if cache is not None:
                    cache.update_recurrent_state(state, self.layer_idx)
            else:
                mixed = bidirectional_kernel_attention(phi, phi_keys, values)
        if selected is not None:
            mixed = mixed[selected]
        return self.dropout(self.o_proj(mixed))


def cached_recurrent_state(cache: Cache | None, layer_idx: int) -> torch.Tensor | None:
    """The RBF prefix sums stored for a layer, or None before the first forward pass."""
    if cache is None:
        return None
    layer = cache.layers[layer_idx]
    if not layer.is_recurrent_states_initialized[0]:
        return None
    return layer.recurrent_states[0]


def _compiled_routed_attention() -> Callable | None:
    """The compiled attention for gathered queries (``causal_attention_at_row_positions``, shared with EGA-GPT), or
    ``None`` where this folder runs outside the hf_spectral package (loaded with ``trust_remote_code``): the torch
    code then computes the same result. Imported by name so that this folder stays self-contained for the Hub."""
    try:
        module = importlib.import_module("..ega_gpt.compiled_kernels", __package__)
    except (ImportError, TypeError, ValueError):
        return None
    return module.causal_attention_at_row_positions


class ChiarAttention(nn.Module):
    """Multi-head self-attention with RoPE and qkv biases.

    Given ``queries`` (a (B, T) mask), only those tokens are queries (sparse routing); keys and values always come
    from every token, cached ones included, so that a routed query sees exactly the keys a dense layer shows it.
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
        return states.reshape(*states.shape[:-1], self.num_heads, self.head_dim)

    def forward(
        self,
        hidden_states: torch.Tensor,
        rotary: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        key_valid: torch.Tensor | None = None,
        past_length: int = 0,
        cache: Cache | None = None,
        queries: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Dense: (B, T, d) -> (B, T, d) with the model's ``attention_mask``. Sparse: -> (N, d), the outputs of the
        N tokens selected by ``queries`` in ``queries.nonzero()`` order; masks are built here from ``key_valid``
        (B, past + T) and the query slots."""
        # RoPE rotates the projections' fresh outputs in place (apply_rotary's in_place), so no second tensor of their
        # size is written; keys and values are slices, not chunk()s, because autograd forbids in-place writes to views
        # from a function returning several. (batch, heads, positions, head_dim) is then made contiguous for SDPA,
        # whose CPU kernels run ≈ 10% faster on it; the compiled kernel for routed queries reads any strides.
        key_value = self.kv_proj(hidden_states)
        key, value = key_value[..., : self.config.hidden_size], key_value[..., self.config.hidden_size :]
        key = apply_rotary(self._heads(key), rotary, in_place=True).transpose(1, 2)
        value = self._heads(value).transpose(1, 2)
        compiled = None if queries is None else self._compiled_sparse_attention(key, key_valid)
        if compiled is None:
            key, value = key.contiguous(), value.contiguous()
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        if queries is None:
            query = apply_rotary(self._heads(self.q_proj(hidden_states)), rotary, in_place=True)
            query = query.transpose(1, 2).contiguous()
            attn_output, attn_weights = self._attend(query, key, value, attention_mask, **kwargs)
            attn_output = attn_output.reshape(*attn_output.shape[:2], -1)
            return self.dropout(self.o_proj(attn_output)), attn_weights
        # Token b * T + t of the flattened batch: one index_select gathers the routed rows (cheaper than indexing by
        # (row, column) pairs), in row order, as the attention takes them.
        selected = queries.reshape(-1).nonzero().squeeze(1)
        if selected.numel() == 0:  # no token routed here: only the cache grew
            return hidden_states.new_zeros(0, hidden_states.shape[-1]), None
        query = self.q_proj(hidden_states.reshape(-1, hidden_states.shape[-1]).index_select(0, selected))
        query_phases = rotary.reshape(-1, rotary.shape[-1]).index_select(0, selected)
        query = apply_rotary(self._heads(query)[None], query_phases[None], in_place=True)[0]
        attn_output = self._attend_sparse(
            query, key, value, queries, selected, past_length, key_valid, compiled, **kwargs
        )
        return self.dropout(self.o_proj(attn_output.reshape(attn_output.shape[0], -1))), None

    def _attend(self, query, key, value, attention_mask, **kwargs):
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        dropout = self.config.attention_dropout if self.training else 0.0
        return attention_interface(self, query, key, value, attention_mask, dropout=dropout, scaling=self.scaling, **kwargs)

    def _attend_sparse(self, query, key, value, queries, selected, past_length, key_valid, compiled, **kwargs):
        """Routed queries (N, heads, head_dim), the tokens ``selected`` (N,) of the flattened (B, T) ``queries`` mask,
        ordered by row, then position, at key slots past_length + t -> (N, heads, head_dim). Each row attends on its
        own, so no row pads its queries to another's count. Causal queries skip most future keys as a dense causal
        kernel skips them: through ``compiled`` where it applies (``_compiled_sparse_attention``'s answer for these
        keys; every row in one call), else in masked chunks, each against the key prefix its last query can see."""
        length = queries.shape[1]
        slots = selected % length + past_length
        dropout = self.config.attention_dropout if self.training else 0.0
        if compiled is not None:
            row_starts = selected.new_zeros(key.shape[0] + 1)
            torch.cumsum(queries.sum(1), 0, out=row_starts[1:])
            out = compiled(query, key, value, slots, row_starts, self.scaling, dropout)
            if out is not None:
                return out
        counts = queries.sum(1).tolist()
        outputs = []
        for row, row_query, row_slots in zip(range(key.shape[0]), query.split(counts), slots.split(counts)):
            if row_query.shape[0] == 0:
                continue
            row_query, row_slots = row_query.transpose(0, 1)[None].contiguous(), row_slots[None]
            row_valid = None if key_valid is None else key_valid[row : row + 1]
            chunks = query_chunks(row_slots) if self.is_causal else [(0, row_slots.shape[1], key.shape[2])]
            for start, end, key_length in chunks:
                mask = gathered_query_mask(row_slots[:, start:end], row_valid, self.is_causal, query.dtype, key_length)
                out, _ = self._attend(
                    row_query[:, :, start:end],
                    key[row : row + 1, :, :key_length],
                    value[row : row + 1, :, :key_length],
                    mask,
                    is_causal=False,
                    **kwargs,
                )
                outputs.append(out[0])
        return torch.cat(outputs, 0)

    def _compiled_sparse_attention(self, key, key_valid) -> Callable | None:
        """The compiled attention routed queries go through (``causal_attention_at_row_positions``: for each block of 64
        queries only the keys its last query sees, no mask tensor), or ``None`` where it does not apply: causal
        layers without padding on the SDPA backend, in float32 on CPU, with the plugin installed."""
        if (
            self.is_causal
            and key_valid is None
            and self.config._attn_implementation == "sdpa"
            and key.dtype == torch.float32
            and key.device.type == "cpu"
            and not torch.is_autocast_enabled("cpu")
        ):
            return _compiled_routed_attention()
        return None


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
            probabilities = torch.softmax(self.proj(features).float(), dim=-1)
            routes = probabilities.argmax(-1)
        if token_valid is not None:  # padding takes the first (lowest-entropy) operator: its output is never read
            routes = routes.masked_fill(~token_valid, 0)
        return routes, probabilities


class ChiarLayer(GradientCheckpointingLayer):
    """Operator sub-layer (one operator, or a routed choice) and FFN, each residual; post-LN or pre-LN."""

    def __init__(self, config: ChiarConfig, layer_idx: int):
        super().__init__()
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
        rotary: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        key_valid: torch.Tensor | None = None,
        token_valid: torch.Tensor | None = None,
        past_length: int = 0,
        cache: Cache | None = None,
        **kwargs,
    ):
        """-> (hidden states, routes, entropies, router probabilities); the last three are None unless routed."""
        operator_input = self.operator_norm(hidden_states) if self.pre_norm else hidden_states
        context = dict(
            rotary=rotary,
            attention_mask=attention_mask,
            key_valid=key_valid,
            token_valid=token_valid,
            past_length=past_length,
            cache=cache,
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

    @staticmethod
    def _attention_context(context: dict) -> dict:
        return {name: value for name, value in context.items() if name != "token_valid"}

    def _run(self, operator: str, states: torch.Tensor, context: dict, dct_output: torch.Tensor | None = None):
        """One operator on every token."""
        if operator == "dct":
            return self.dct(states) if dct_output is None else dct_output
        if operator == "rbf":
            return self.rbf(states, context["token_valid"], context["cache"])
        return self.attention(states, **self._attention_context(context))[0]

    def _routed(self, states: torch.Tensor, context: dict):
        dct_output = None
        if self.dct is not None:
            dct_output, spectrum = self.dct.with_spectrum(states)
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

        # DCT mixing runs on every token: it comes out of the product that gives the spectrum for the entropy, which
        # costs less on CPU than gathering and scattering the DCT-routed rows. The other operators then overwrite
        # the rows of their own tokens.
        mixed = dct_output if dct_output is not None else torch.zeros_like(states)
        for k, operator in enumerate(self.operators):
            selected = routes == k
            if operator == "dct":
                continue
            if operator == "rbf":
                # Called even with nothing selected: every token's key and value enter the prefix sums.
                rows, cols = selected.nonzero(as_tuple=True)
                out = self.rbf(states, context["token_valid"], context["cache"], selected=selected)
                mixed = mixed.index_put((rows, cols), out)
            else:
                # Called even with no query: every token's key and value go to the cache.
                out, _ = self.attention(states, queries=selected, **self._attention_context(context))
                mixed = mixed.index_put(selected.nonzero(as_tuple=True), out)
        if probabilities is not None:
            mixed = mixed * straight_through_gate(probabilities, routes)[..., None].to(mixed.dtype)
        return mixed, routes, entropy, probabilities


class ChiarPreTrainedModel(PreTrainedModel):
    config_class = ChiarConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["ChiarLayer"]
    _supports_sdpa = True
    # Attention probabilities (eager attention only) are recorded for layers that attend densely; a sparse routed
    # layer attends in per-row chunks and records none.
    _can_record_outputs = {
        "hidden_states": ChiarLayer,
        "attentions": OutputRecorder(ChiarAttention, index=1),
    }

    def save_pretrained(self, save_directory, *args, is_main_process: bool = True, **kwargs):
        # transformers' `register_for_auto_class` copies only single-dot imports: write the remote code ourselves
        # (flattened model files, the ops they need, a complete auto_map) so the folder loads without hf_spectral.
        super().save_pretrained(save_directory, *args, is_main_process=is_main_process, **kwargs)
        if is_main_process:
            save_model_code(self, save_directory)

    def _init_weights(self, module):
        super()._init_weights(module)  # Linear / Embedding: N(0, initializer_range), biases 0; LayerNorm: 1, 0
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
        self.built_causal = config.is_causal
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def _past_length(self, cache: Cache | None, attention_mask: torch.Tensor | None, length: int) -> int:
        if cache is None:
            return 0
        if len(cache.layers) != self.config.num_hidden_layers:
            raise ValueError(
                f"the cache has {len(cache.layers)} layers, the model {self.config.num_hidden_layers}: create it with "
                "`DynamicCache(config=model.config)` so that each layer gets the state its operator needs"
            )
        if any(t in ("full_attention", "hybrid") for t in self.config.layer_types):
            return int(cache.get_seq_length())
        # Only recurrent state: nothing depends on the past length except the mask's shape.
        return attention_mask.shape[1] - length if attention_mask is not None and attention_mask.ndim == 2 else 0

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
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if not self.built_causal:
            if cache is not None:
                raise ValueError("a bidirectional CHIAR encoder (is_causal=False) has no cache")
            use_cache = False
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        batch, length = inputs_embeds.shape[:2]
        if isinstance(attention_mask, dict):  # generate() with a StaticCache: one causal mask per layer type
            attention_mask = next((m for m in attention_mask.values() if m is not None), None)
        past_length = self._past_length(cache, attention_mask, length)
        if attention_mask is not None and attention_mask.ndim == 4:
            # A causal 4D mask (generate() builds one for a StaticCache): the last query sees every earlier token, so
            # its row is the padding mask (bool: True = seen; float: 0 = seen).
            seen = attention_mask[:, 0, -1, : past_length + length]
            attention_mask = seen if seen.dtype == torch.bool else seen == 0

        key_valid = token_valid = None
        if attention_mask is not None:
            if attention_mask.ndim != 2:
                raise ValueError("CHIAR-Former takes a 2D (batch, past + new positions) padding mask")
            if attention_mask.shape[1] != past_length + length:
                raise ValueError(
                    f"attention_mask has {attention_mask.shape[1]} positions, expected {past_length + length} "
                    f"({past_length} cached + {length} new)"
                )
            if not bool(attention_mask.all()):  # without padding, skip every padding mask and fix-up
                key_valid = attention_mask.bool()
                token_valid = key_valid[:, -length:]
        if position_ids is None:
            if key_valid is not None:  # count real tokens, so that left padding does not shift positions
                position_ids = (key_valid.long().cumsum(-1) - 1).clamp(min=0)[:, -length:]
            else:
                position_ids = torch.arange(past_length, past_length + length, device=inputs_embeds.device)[None]
        position_ids = position_ids.expand(batch, -1)
        head_dim = self.config.hidden_size // self.config.num_attention_heads
        rotary = rotary_phases(position_ids, head_dim, self.config.rope_theta)

        causal_mask = None
        if "attention" in self.config.operators_in_use:
            causal_mask = create_causal_mask(
                config=self.config,
                inputs_embeds=inputs_embeds,
                attention_mask=attention_mask,
                cache=cache,
                position_ids=position_ids,
            )

        hidden_states = self.dropout(inputs_embeds)
        decisions, entropies, fractions, probabilities = [], [], [], []
        for layer in self.layers:
            hidden_states, routes, entropy, probs = layer(
                hidden_states,
                rotary=rotary,
                attention_mask=causal_mask,
                key_valid=key_valid,
                token_valid=token_valid,
                past_length=past_length,
                cache=cache,
                **kwargs,
            )
            if routes is not None:
                decisions.append(routes)
                entropies.append(entropy)
                fractions.append(routing_fractions(routes, token_valid, len(self.config.routed_operators)))
                if probs is not None:
                    probabilities.append(probs)

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


def routing_fractions(routes: torch.Tensor, token_valid: torch.Tensor | None, num_operators: int) -> torch.Tensor:
    """Fraction of the non-padding tokens routed to each operator, (B, T) -> (K,)."""
    counts = torch.nn.functional.one_hot(routes, num_operators).float()
    if token_valid is not None:
        counts = counts * token_valid[..., None]
        return counts.sum((0, 1)) / token_valid.sum().clamp_min(1)
    return counts.mean((0, 1))


def _routing_fields(outputs) -> dict:
    return {
        "routing_decisions": outputs.routing_decisions,
        "routing_entropies": outputs.routing_entropies,
        "routing_fractions": outputs.routing_fractions,
        "router_probabilities": outputs.router_probabilities,
        "aux_loss": outputs.aux_loss,
    }


class ChiarForCausalLM(ChiarPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

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
                loss = loss + outputs.aux_loss
        return ChiarCausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            **_routing_fields(outputs),
        )


class ChiarForSequenceClassification(ChiarPreTrainedModel):
    """CHIAR-Former with a pooled classification head (pooling: ``config.classifier_pooling``)."""

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
        **kwargs,
    ) -> ChiarSequenceClassifierOutputWithPast:
        kwargs.pop("use_cache", None)
        if attention_mask is None and input_ids is not None and self.config.pad_token_id is not None:
            attention_mask = (input_ids != self.config.pad_token_id).long()
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=False,
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
            **_routing_fields(outputs),
        )


__all__ = [
    "ChiarForCausalLM",
    "ChiarForSequenceClassification",
    "ChiarModel",
    "ChiarPreTrainedModel",
    "routing_fractions",
]
