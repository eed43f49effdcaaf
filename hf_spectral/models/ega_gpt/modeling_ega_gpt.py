"""EGA-GPT: a GPT (pre-LN, learned absolute positions, tied embeddings, GELU MLP) with energy-gated attention.

Each gated attention layer computes its energy gate (``ops/energy_gate.py``) from the layer's input and adds the
log-gate to the attention logits of every key (``ops/gated_attention.py``): as a score bias under ``eager``, as a
``score_mod`` under ``flex_attention``, as one folded query/key channel under ``sdpa`` (which keeps SDPA's fused
causal kernel). The attention backend is ``config._attn_implementation``, as in transformers' own models.

Generation uses transformers' caches (``DynamicCache``, ``StaticCache``): a gated layer stores its keys and values
folded, each key with its bias and the per-key gate state the next step continues from (the running moments of the
causal statistics as float32 bits, raw energies for window statistics, filter history for the convolutional
energies). Beam search, cropping and left padding therefore need nothing special.
"""

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
from transformers.utils import can_return_tuple, logging
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from ...ops.energy_gate import DaubechiesEnergy, EnergyGate, MorletEnergy, check_generation_mode, padding_mask
from ...ops.gate_cache import gated_cache_layer, update_gated_cache
from ...ops.gated_attention import (
    attention_with_key_bias,
    eager_attention_with_key_bias,
    flex_attention_forward,
    implementation_for_call,
)
from ...ops.packing import packed_rows
from ...ops.pooling import SequencePooling, classifier_attention_mask, refuse_packed_rows
from ...ops.positions import (
    host_length,
    host_reads_are_free,
    keep_padding_mask_for_generate,
    mask_width_is_valid,
    new_positions,
    token_positions,
)
from ...ops.remote_code import save_pretrained_with_code
from ...ops.validation import check_parameters_fit
from .configuration_ega_gpt import EGAConfig

logger = logging.get_logger(__name__)


@dataclass
class EGAModelOutputWithPast(BaseModelOutputWithPast):
    r"""
    gate_values (`tuple[torch.FloatTensor]`, *optional*, returned with `output_gate_values=True`):
        One (batch, heads, new positions) tensor of gate values g ∈ (0, 1) per gated layer.
    """

    gate_values: tuple[torch.FloatTensor, ...] | None = None


@dataclass
class EGACausalLMOutputWithPast(CausalLMOutputWithPast):
    r"""
    gate_values (`tuple[torch.FloatTensor]`, *optional*, returned with `output_gate_values=True`):
        One (batch, heads, new positions) tensor of gate values g ∈ (0, 1) per gated layer.
    """

    gate_values: tuple[torch.FloatTensor, ...] | None = None


@dataclass
class EGASequenceClassifierOutputWithPast(SequenceClassifierOutputWithPast):
    r"""
    gate_values (`tuple[torch.FloatTensor]`, *optional*, returned with `output_gate_values=True`):
        One (batch, heads, positions) tensor of gate values per gated layer.
    """

    gate_values: tuple[torch.FloatTensor, ...] | None = None


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Plain attention for the ungated layers; it reads the mask any backend's mask interface built, so that it can
    stand in for SDPA or flex_attention when a call asks for attention probabilities."""
    return eager_attention_with_key_bias(module, query, key, value, None, attention_mask, scaling, dropout)


class EGAMLP(nn.Module):
    def __init__(self, config: EGAConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.bias)
        self.act = ACT2FN[config.hidden_act]
        self.c_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.bias)
        self.dropout = nn.Dropout(config.resid_pdrop)

    def forward(self, hidden_states):
        return self.dropout(self.c_proj(self.act(self.c_fc(hidden_states))))


class EGAAttention(nn.Module):
    """Causal multi-head self-attention with an optional energy gate on the keys."""

    def __init__(self, config: EGAConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        self.c_attn = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=config.bias)
        self.c_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.resid_pdrop)
        self.energy_gate = None
        if layer_idx in config.gated_layers:
            self.energy_gate = EnergyGate(
                config.hidden_size,
                config.num_attention_heads,
                kind=config.energy_kind,
                projections=config.energy_projections,
                scales=config.energy_scales,
                normalization=config.energy_normalization,
                eps=config.energy_norm_eps,
                tau_init=config.gate_tau_init,
                alpha_init=config.gate_alpha_init,
                morlet_learnable=config.morlet_learnable,
            )

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        document_positions: torch.Tensor | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``attention_mask``: what the mask interface built for the backend; ``token_mask``: (batch, cached + new)
        bool, False at padding (the gate's statistics skip padding), or ``None`` without padding;
        ``document_positions``: (batch, new) index of each token in its document of a packed row, or ``None``."""
        batch, length, _ = hidden_states.shape
        qkv = self.c_attn(hidden_states).view(batch, length, 3, self.num_heads, self.head_dim)
        query, key, value = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (batch, heads, length, head_dim)
        implementation = self.config._attn_implementation
        dropout = self.config.attn_pdrop if self.training else 0.0

        if self.energy_gate is None:
            if cache is not None:
                key, value = cache.update(key, value, self.layer_idx)
            # output_attentions: only eager computes the probabilities; it stands in for the other backends.
            # flex_attention: the gated layers' call (no bias here), which also builds padded batches on CPU.
            implementation = implementation_for_call(implementation, kwargs)
            attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
            if implementation == "flex_attention":
                attention_interface = flex_attention_forward
            attn_output, attn_weights = attention_interface(
                self, query, key, value, attention_mask, dropout=dropout, scaling=self.scaling, **kwargs
            )
        else:
            past_state = past_features = None
            if cache is not None:  # each key's bias and gate state live beside it, in the cache's gated layer
                layer = gated_cache_layer(cache, self.layer_idx)
                past_state, past_features, token_mask = layer.gate_past(
                    self.energy_gate.cached_positions, length, token_mask
                )
            bias, _, state, features = self.energy_gate(
                hidden_states, token_mask, past_state, past_features, cache is not None, document_positions
            )
            if cache is not None:
                key, value, bias = update_gated_cache(cache, self.layer_idx, key, value, bias, state, features)
            attn_output, attn_weights = attention_with_key_bias(
                self, implementation, query, key, value, bias, attention_mask, self.scaling, dropout, **kwargs
            )
        attn_output = attn_output.reshape(batch, length, -1)
        return self.resid_dropout(self.c_proj(attn_output)), attn_weights


class EGABlock(GradientCheckpointingLayer):
    def __init__(self, config: EGAConfig, layer_idx: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, bias=config.bias)
        self.attn = EGAAttention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, bias=config.bias)
        self.mlp = EGAMLP(config)

    def forward(self, hidden_states, attention_mask=None, token_mask=None, cache=None, document_positions=None, **kwargs):
        attn_output, _ = self.attn(
            self.ln_1(hidden_states),
            attention_mask=attention_mask,
            token_mask=token_mask,
            cache=cache,
            document_positions=document_positions,
            **kwargs,
        )
        hidden_states = hidden_states + attn_output
        return hidden_states + self.mlp(self.ln_2(hidden_states))


class EGAPreTrainedModel(PreTrainedModel):
    """Weight initialisation, attention backends (eager, SDPA, flex_attention) and loading shared by the EGA-GPT
    models (`EGAConfig`)."""

    config_class = EGAConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["EGABlock"]
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = True
    _can_record_outputs = {
        "hidden_states": EGABlock,
        "attentions": OutputRecorder(EGAAttention, index=1),
        "gate_values": OutputRecorder(EnergyGate, index=1),
    }

    def __init__(self, config, *args, **kwargs):
        # Values assigned after the config was built are checked here, and the sizes against the memory of the
        # device the parameters go to, before any layer is built.
        config._validate()
        check_parameters_fit(config, learned_positions=True)
        super().__init__(config, *args, **kwargs)

    def _init_weights(self, module):
        super()._init_weights(module)  # Linear / Conv1d / Embedding: N(0, initializer_range); LayerNorm: 1, 0
        if isinstance(module, EnergyGate):
            init.constant_(module.tau, self.config.gate_tau_init)
            init.constant_(module.alpha, self.config.gate_alpha_init)
            init.zeros_(module.mix_logits)
        elif isinstance(module, MorletEnergy):
            omega, sigma = module.initial_omega_sigma()
            init.copy_(module.omega, omega)
            init.copy_(module.sigma, sigma)
        elif isinstance(module, DaubechiesEnergy):
            init.copy_(module.taps, module.initial_taps())
        elif isinstance(module, SequencePooling):
            if module.mode == "learned":
                init.zeros_(module.position_logits)
            elif module.mode == "rmt_optimal":
                init.ones_(module.position_weights)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """``PreTrainedModel.save_pretrained``, then the code that loads the folder with ``trust_remote_code=True``
        where hf_spectral is not installed (``ops/remote_code.py``)."""
        return save_pretrained_with_code(super().save_pretrained, self, save_directory, *args, **kwargs)


def check_inputs(config, input_ids, inputs_embeds, attention_mask, position_ids, past_length, cache=None) -> None:
    """Refuse inputs the model would otherwise mishandle silently, with the argument and the shapes."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    if input_ids is not None and input_ids.ndim != 2:
        raise ValueError(f"input_ids must be (batch, length), got shape {tuple(input_ids.shape)}")
    if inputs_embeds is not None and (inputs_embeds.ndim != 3 or inputs_embeds.shape[-1] != config.hidden_size):
        raise ValueError(
            f"inputs_embeds must be (batch, length, hidden_size = {config.hidden_size}), got shape "
            f"{tuple(inputs_embeds.shape)}"
        )
    name, shape = ("input_ids", input_ids.shape) if input_ids is not None else ("inputs_embeds", inputs_embeds.shape)
    batch, length = shape[0], shape[1]
    if batch == 0 or length == 0:
        raise ValueError(f"{name} is empty (shape {tuple(shape)}): give at least one sequence of at least one token")
    past_length = host_length(past_length)  # a StaticCache's tensor: read only where that costs nothing
    if attention_mask is not None:
        if attention_mask.ndim == 2:
            width = f"cached + {length}" if past_length is None else past_length + length
            if attention_mask.shape[0] != batch or attention_mask.shape[1] < length or (
                past_length is not None and not mask_width_is_valid(attention_mask.shape[1], past_length, length, cache)
            ):
                raise ValueError(
                    f"attention_mask has shape {tuple(attention_mask.shape)}, expected (batch, cached + new) = "
                    f"({batch}, {width}) for {name} of shape {tuple(shape)} after "
                    f"{'the' if past_length is None else past_length} cached positions"
                )
        elif attention_mask.ndim == 4:
            if attention_mask.shape[0] != batch or attention_mask.shape[1] != 1 or attention_mask.shape[2] != length:
                raise ValueError(
                    f"a 4D attention_mask must be (batch, 1, new, cached + new) = ({batch}, 1, {length}, ...), got "
                    f"shape {tuple(attention_mask.shape)}"
                )
        else:
            raise ValueError(
                f"attention_mask must be 2D (batch, cached + new) or 4D (batch, 1, new, cached + new), got shape "
                f"{tuple(attention_mask.shape)} for {name} of shape {tuple(shape)}"
            )
    if position_ids is not None:
        if position_ids.ndim != 2 or position_ids.shape[1] != length or position_ids.shape[0] not in (1, batch):
            raise ValueError(
                f"position_ids must be (batch, length) or (1, length) = ({batch}, {length}), got shape "
                f"{tuple(position_ids.shape)}"
            )
        if host_reads_are_free(position_ids):  # values: not on a device (a wait) nor in a compiled graph (no raise)
            low, high = position_ids.aminmax()
            if low < 0 or high >= config.max_position_embeddings:
                past_context = high >= config.max_position_embeddings
                raise ValueError(
                    f"position_ids must lie in [0, max_position_embeddings = {config.max_position_embeddings}), got "
                    f"values from {int(low)} to {int(high)}"
                    + (" (if from generate(): the prompt's tokens plus max_new_tokens run past the learned positions)"
                       if past_context else "")
                )


def check_context_length(config, position_ids, past_length, length) -> None:
    """Refuse a sequence longer than the learned position embeddings, naming its length (instead of an IndexError
    in the embedding). Positions count tokens, so only a sequence whose cached + new width exceeds the context can
    be too long, and only then are the positions read (on the host where that is free)."""
    past_length = host_length(past_length)
    if past_length is None or past_length + length <= config.max_position_embeddings:
        return
    if not host_reads_are_free(position_ids):
        return
    last = int(position_ids.max())
    if last >= config.max_position_embeddings:
        raise ValueError(
            f"the sequence reaches position {last} ({past_length} cached + {length} new positions), but EGA-GPT has "
            f"learned position embeddings for max_position_embeddings = {config.max_position_embeddings} only: "
            "shorten the input (or max_new_tokens)"
        )


class EGAModel(EGAPreTrainedModel):
    """The EGA-GPT decoder without a head: a GPT-2-style stack whose attention layers (`config.gated_layers`) gate
    every key by its energy (SPEC 1). ``forward`` takes ``output_gate_values=True`` to return the gate values of the
    new positions, one (batch, heads, positions) tensor per gated layer (``gate_values``)."""

    def __init__(self, config: EGAConfig):
        super().__init__(config)
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.drop = nn.Dropout(config.embd_pdrop)
        self.h = nn.ModuleList(EGABlock(config, i) for i in range(config.num_hidden_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, bias=config.bias)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.wte

    def set_input_embeddings(self, value):
        self.wte = value

    @merge_with_config_defaults
    @capture_outputs
    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> EGAModelOutputWithPast:
        past_length = cache.get_seq_length() if cache is not None else 0
        check_inputs(self.config, input_ids, inputs_embeds, attention_mask, position_ids, past_length, cache)
        if inputs_embeds is None:
            inputs_embeds = self.wte(input_ids)
        batch, length = inputs_embeds.shape[:2]
        # Packed rows (several documents a row): the gates' statistics and filters restart at each document, as
        # transformers' mask keeps the documents apart in attention; their keys cannot be cached for a later step.
        given_positions = position_ids
        document_positions, position_ids, use_cache = packed_rows(
            position_ids, attention_mask, cache, use_cache, batch, length, kwargs, type(self).__name__
        )
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)

        # The gates need the padding of every position they normalise over: (batch, ≥ cached + new), True at tokens.
        token_mask = padding_mask(attention_mask, past_length + length)
        if position_ids is None:
            if token_mask is not None:  # count real tokens, so that left padding does not shift positions
                position_ids = new_positions(token_positions(token_mask), past_length, length)
            else:
                position_ids = (torch.arange(length, device=inputs_embeds.device) + past_length)[None]
        if position_ids is not given_positions:  # counted here (a packed row's from its cu_seq_lens): within the table?
            check_context_length(self.config, position_ids, past_length, length)

        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=position_ids,
        )
        hidden_states = self.drop(inputs_embeds + self.wpe(position_ids))
        # Early-exit drafting (`assistant_early_exit`) lowers num_hidden_layers: run that many blocks.
        for block in self.h[: self.config.num_hidden_layers]:
            hidden_states = block(
                hidden_states,
                attention_mask=causal_mask,
                token_mask=token_mask,
                cache=cache,
                document_positions=document_positions,
                **kwargs,
            )
        return EGAModelOutputWithPast(last_hidden_state=self.ln_f(hidden_states), cache=cache)


class EGAForCausalLM(EGAPreTrainedModel, GenerationMixin):
    """EGA-GPT with a language-model head (tied to the input embeddings unless `config.tie_word_embeddings` is
    False); generates with transformers' caches. ``forward(..., output_gate_values=True)`` also returns the gate
    values (``gate_values``, as `EGAModel`)."""

    _tied_weights_keys = {"lm_head.weight": "model.wte.weight"}
    # generate() with a StaticCache: the gates read their padding from the 2D mask (a flex BlockMask has none).
    create_masks_for_generate = staticmethod(keep_padding_mask_for_generate)

    def __init__(self, config: EGAConfig):
        super().__init__(config)
        self.model = EGAModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.wte

    def set_input_embeddings(self, value):
        self.model.wte = value

    def _validate_generated_length(self, generation_config, input_ids_length, has_default_max_length):
        super()._validate_generated_length(generation_config, input_ids_length, has_default_max_length)
        # Positions are learned up to max_position_embeddings: a generation that would pass them stops with an error
        # at that step. Said up front (a warning: positions count tokens, so left padding may leave room).
        if generation_config.max_length > self.config.max_position_embeddings:
            logger.warning_once(
                f"generate() may run to {generation_config.max_length} positions ({input_ids_length} in the input, "
                f"then new tokens), but EGA-GPT's learned positions end at max_position_embeddings = "
                f"{self.config.max_position_embeddings}: a row that reaches them stops the generation with an error. "
                f"Ask for at most {max(0, self.config.max_position_embeddings - input_ids_length)} new tokens."
            )

    def _validate_generation_mode(self, generation_mode, generation_config, *args, **kwargs):
        normalization = self.config.energy_normalization if self.config.gated_layers else "none"
        check_generation_mode(normalization, generation_mode, generation_config, type(self).__name__)
        return super()._validate_generation_mode(generation_mode, generation_config, *args, **kwargs)

    @can_return_tuple
    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
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
    ) -> EGACausalLMOutputWithPast:
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
        return EGACausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            gate_values=outputs.gate_values,
        )


class EGAForSequenceClassification(EGAPreTrainedModel):
    """EGA-GPT with a pooled classification head (pooling: ``config.classifier_pooling``)."""

    def __init__(self, config: EGAConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = EGAModel(config)
        self.pooling = SequencePooling(config.classifier_pooling, config.max_position_embeddings)
        self.dropout = nn.Dropout(config.classifier_dropout)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.wte

    def set_input_embeddings(self, value):
        self.model.wte = value

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        **kwargs,
    ) -> EGASequenceClassifierOutputWithPast:
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
            **kwargs,
        )
        pooled = self.pooling(outputs.last_hidden_state, attention_mask)
        logits = self.score(self.dropout(pooled))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, pooled_logits=logits, config=self.config)
        return EGASequenceClassifierOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            gate_values=outputs.gate_values,
        )


__all__ = ["EGAForCausalLM", "EGAForSequenceClassification", "EGAModel", "EGAPreTrainedModel"]
