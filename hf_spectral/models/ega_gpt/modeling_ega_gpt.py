"""EGA-GPT: a GPT (pre-LN, learned absolute positions, tied embeddings, GELU MLP) with energy-gated attention.

The gate is an additive per-key logit bias (``energy_gate.py``); each attention layer folds it into its queries
and keys and hands them to whichever kernel ``config._attn_implementation`` names (eager, sdpa, flex_attention),
so the fused causal kernels stay in use. The KV cache stores each key's bias, plus the per-key state later
steps need (raw energies for the running statistics, filter history), in the extra key/value channels: beam
search, cache cropping and left padding then need nothing special.

On CPU in float32 with the SDPA backend, the compiled kernels (``compiled_kernels.py``) take over where SDPA would
run unmasked: training passes attend through a C attention (forward and backward) that adds the bias to the scores
instead of paying for a folded channel; outside autograd, the causal gate of linear energies also runs in C on the
fused projection's output (the forward pass and prompt of unpadded sequences, every unpadded decoding step of
``generate()``, whose per-layer plans are kept through the generation), and decoding steps attend over the folded
cache in C. Everything else — padding, other backends, dtypes or devices, observed gates — runs the torch code,
which computes the same numbers.

The default KV cache (``generate()``'s, and a forward's with ``use_cache``) appends in place (``growing_cache.py``)
rather than concatenating; decoding steps inside ``generate()`` multiply by (in, out) copies of the projection
weights where the CPU BLAS runs that layout faster (``DecodingLinear``).
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
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

try:  # what output_gate_values=True switches on; private, hence the fallback (every hooked gate is then called)
    from transformers.utils.output_capturing import _active_collector as _active_output_collector
except ImportError:  # pragma: no cover - depends on the transformers version
    _active_output_collector = None

from .compiled_kernels import (
    CompiledCausalGate,
    causal_attention_with_key_bias,
    compiled_library,
    decoding_attention_with_key_bias,
)
from .configuration_ega_gpt import EGAConfig
from .energy_gate import (
    DerivedTensors,
    EnergyGate,
    LinearEnergy,
    MorletEnergy,
    cached_gate_state,
    cached_length,
    caching_derived_tensors,
    fold_bias_into_kv,
    fold_bias_into_qkv,
    folded_output_weight,
    folded_qkv_weights,
    keeping_derived_tensors,
    padding_mask,
    replace_folded_bias,
)
from .growing_cache import GrowingCache, GrowingLayer, append_in_place
from ...ops.pooling import SequencePooling
from ...ops.remote_code import save_model_code


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
    """Reference attention; with folded queries/keys its probabilities are the gated, renormalised ones."""
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value).transpose(1, 2).contiguous()
    return attn_output, attn_weights


class EGAMLP(nn.Module):
    def __init__(self, config: EGAConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.bias)
        self.act = ACT2FN[config.hidden_act]
        self.c_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.bias)
        self.dropout = nn.Dropout(config.resid_pdrop)

    def forward(self, hidden_states, decoding_weights: tuple | None = None):
        if decoding_weights is not None:  # a decoding step inside generate(): ``decoding_weights()``
            fc, proj = decoding_weights
            return self.dropout(proj(self.act(fc(hidden_states))))
        return self.dropout(self.c_proj(self.act(self.c_fc(hidden_states))))

    def decoding_weights(self) -> tuple | None:
        """The projections as ``DecodingLinear`` objects, or ``None`` where they must be called (adapters, hooks:
        ``plain_linear``)."""
        if not (plain_linear(self.c_fc) and plain_linear(self.c_proj)):
            return None
        return DecodingLinear(self.c_fc.weight, self.c_fc.bias), DecodingLinear(self.c_proj.weight,
                                                                                       self.c_proj.bias)


def plain_linear(module: nn.Module) -> bool:
    """Whether ``module`` is an ``nn.Linear`` that computes nothing beyond its weights (no adapter such as PEFT's
    LoRA, no quantisation, offloading or other hooks), so that its weights can be copied or folded."""
    return type(module) is nn.Linear and not (
        module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__
    )


class DecodingLinear:
    """A projection as decoding steps run it: with its (out, in) weight through ``F.linear`` for up to 8 rows, and
    beyond that with an (in, out) copy (GPT-2's Conv1D layout), which torch's CPU BLAS runs in 0.61-0.83x the time
    at 32 rows; at 1-8 rows neither layout wins consistently (``benchmarks/bench_decoding_parts.py``). The copy is
    made at the first call with more rows and lives as long as this object (one ``generate()`` call): at batch > 8
    a generation holds the weights of its projections twice."""

    __slots__ = ("weight", "bias", "_weight_in_out")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight, self.bias, self._weight_in_out = weight, bias, None  # weight: (out, in)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows <= 8:
            return nn.functional.linear(x, self.weight, self.bias)
        if self._weight_in_out is None:
            self._weight_in_out = self.weight.t().contiguous()
        flat = x.reshape(rows, x.shape[-1])
        out = flat @ self._weight_in_out if self.bias is None else torch.addmm(self.bias, flat, self._weight_in_out)
        return out.view(*x.shape[:-1], self.weight.shape[0])


class CompiledDecodingPlan(NamedTuple):
    """What an EGA layer's compiled decoding step keeps through a generation: the folded projections and the gate
    step bound to the gate's constants (``EGAAttention.build_decoding_plan``)."""

    qkv: DecodingLinear  # hidden -> folded q/k/v + energies
    folded_out: DecodingLinear  # folded heads -> hidden: for attention outputs with the folded channels
    out: DecodingLinear  # heads -> hidden: for attention outputs of head_dim channels
    head_width: int  # channels per cached head: head_dim + the folded channels
    gate: CompiledCausalGate


class BlockDecodingPlan(NamedTuple):
    """What a block keeps through a generation for its decoding steps: the attention's compiled plan and the MLP's
    projections, each ``None`` where it does not apply."""

    attention: CompiledDecodingPlan | None
    mlp: tuple | None


def _gate_observed(gate: EnergyGate) -> bool:
    """Whether something watches the gate module's calls, so that a decoding step must call it: hooks other than
    transformers' output-capturing hook, or that hook while it records gate values."""
    if gate._forward_pre_hooks:
        return True
    if not gate._forward_hooks:
        return False
    if any(getattr(hook, "__name__", None) != "output_capturing_hook" for hook in gate._forward_hooks.values()):
        return True
    collected = _active_output_collector.get() if _active_output_collector is not None else None
    return _active_output_collector is None or (collected is not None and "gate_values" in collected)


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
        self._derived_weights = DerivedTensors()
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

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        decoding_plan: CompiledDecodingPlan | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.energy_gate is not None:
            past_length = 0 if decoding_plan is None else self._compiled_step_past(decoding_plan, hidden_states, cache)
            if past_length:
                return self._compiled_decoding_step(
                    hidden_states, attention_mask, cache, decoding_plan, past_length, **kwargs
                )
            return self._gated_forward(hidden_states, attention_mask, token_mask, cache, **kwargs)
        query, key, value = self._project(hidden_states)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        attn_output, attn_weights = self._attend(query, key, value, attention_mask, **kwargs)
        return self.resid_dropout(self.c_proj(attn_output.reshape(*hidden_states.shape[:2], -1))), attn_weights

    def _project(self, hidden_states):
        shape = (*hidden_states.shape[:2], self.num_heads, self.head_dim)
        qkv = self.c_attn(hidden_states).split(self.config.hidden_size, dim=2)
        return tuple(t.view(shape).transpose(1, 2) for t in qkv)

    def _gated_forward(self, hidden_states, attention_mask, token_mask, cache, **kwargs):
        if token_mask is None and torch.is_grad_enabled():
            attn_output = self._compiled_training_forward(hidden_states, attention_mask, cache)
            if attn_output is not None:
                return attn_output, None
        batch, length, _ = hidden_states.shape
        head_dim, gate = self.head_dim, self.energy_gate
        width = max(1, gate.aux_width) if cache is not None else 1
        # Folding the weights costs a copy of them, which one decoding step cannot repay unless they are kept.
        fused = self._projections_fusable() and (length > 1 or keeping_derived_tensors())
        energy = None
        if fused:
            # One product projects q, k, v straight into the folded layout (fold_bias_into_qkv), plus the linear
            # energies: no copies to append channels, and a decoding step stays a few ops.
            qkv_weight, qkv_bias = self._folded_qkv_weights(width)
            projected = nn.functional.linear(hidden_states, qkv_weight, qkv_bias)
            qkv_columns = 3 * self.num_heads * (head_dim + width)
            # (narrow/select rather than indexing: a decoding step is short enough for Python's index parsing to show)
            qkv = projected.narrow(-1, 0, qkv_columns).view(batch, length, 3, self.num_heads, head_dim + width)
            if projected.shape[-1] > qkv_columns:
                energy = gate.energy.arrange(projected.narrow(-1, qkv_columns, projected.shape[-1] - qkv_columns))
                if torch.is_grad_enabled():  # qkv is written in place below; autograd must not see the energies move
                    energy = energy.clone()  # (in-place writes cost 3% less training time than concatenating)
        else:
            query, key, value = self._project(hidden_states)
        past_state = cached_gate_state(cache, self.layer_idx, head_dim)
        rebias_all_keys = False
        compiled_gate = None
        if fused and self._compiled_gate_applies(projected, energy, token_mask, past_state):
            compiled_gate = self._compiled_gate(width)
        if compiled_gate is not None:
            # The whole gate in one C call, which writes the bias (and the cache's state) into qkv itself; then, where
            # SDPA would run unmasked, the compiled attention adds the bias to the scores instead of reading the folded
            # channel. Without a cache to fill, the biases go to a small array of their own.
            attend_in_c = self._compiled_attention_applies(attention_mask)
            own_array = attend_in_c and cache is None
            key_bias = projected.new_empty(batch, length, self.num_heads) if own_array else qkv[:, :, 1, :, head_dim]
            compiled_gate.prefill(projected, key_bias if own_array else None)
            if attend_in_c:
                attn_output = causal_attention_with_key_bias(
                    qkv[..., :head_dim], key_bias.transpose(1, 2), self.scaling,
                    self.config.attn_pdrop if self.training else 0.0,
                )
                if attn_output is not None:
                    if cache is not None:
                        cache.update(*qkv.permute(2, 0, 3, 1, 4).unbind(0)[1:], self.layer_idx)
                    return self.resid_dropout(self.c_proj(attn_output.view(batch, length, -1))), None
            if own_array:  # the kernel is not available: the torch attention reads the folded channel
                qkv[:, :, 1, :, head_dim] = key_bias
            query, key, value = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        else:
            all_bias, _, state = gate(
                hidden_states, valid=token_mask, past_aux=past_state, return_aux=cache is not None, energy=energy
            )
            # With window statistics and a past, every cached key's bias changes with the window.
            rebias_all_keys = all_bias.shape[-1] != length
            if rebias_all_keys and type(cache.layers[self.layer_idx]) not in (DynamicLayer, GrowingLayer):
                raise ValueError(
                    "window statistics re-bias every cached key at each step and need a DynamicCache, not a "
                    f"{type(cache.layers[self.layer_idx]).__name__}"
                )
            bias = all_bias[..., -length:] if rebias_all_keys else all_bias
            if fused:
                qkv.select(2, 1).select(-1, head_dim).copy_(bias.transpose(1, 2))
                if state is not None:
                    qkv.select(2, 2).narrow(-1, head_dim, width).copy_(state.transpose(1, 2))
                query, key, value = qkv.permute(2, 0, 3, 1, 4).unbind(0)
                if length == 1:  # decoding: the cache concatenates contiguous keys/values faster (7% of a step at B=32)
                    key, value = key.contiguous(), value.contiguous()
            else:
                query, key, value = fold_bias_into_qkv(query, key, value, bias, self.scaling, state)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        if rebias_all_keys:
            key = replace_folded_bias(key, all_bias, head_dim)
        attn_output, attn_weights = self._attend(query, key, value, attention_mask, **kwargs)
        if fused and length > 1:  # (for one position, cutting the extra channels off is cheaper than reading them)
            out_weight = folded_output_weight(self.c_proj.weight, self.num_heads, width)
            attn_output = nn.functional.linear(attn_output.reshape(batch, length, -1), out_weight, self.c_proj.bias)
        else:
            attn_output = self.c_proj(attn_output[..., :head_dim].reshape(batch, length, -1))
        return self.resid_dropout(attn_output), attn_weights

    def _compiled_training_forward(self, hidden_states, attention_mask, cache) -> torch.Tensor | None:
        """The gated attention of a pass with autograd (training), without padding or a past, through the compiled
        attention and its backward (``causal_attention_with_key_bias``): q, k and v straight from the projection and
        the gate's bias added to the scores, rather than an extra folded channel that SDPA's forward and backward
        pay 10-20% for; a cache, if any, gets the folded keys and values. ``None`` where it does not apply (other
        backends, masks, a past, other dtypes or devices, autocast) or the kernel is not available; the caller then
        runs the torch code."""
        if not (
            self._compiled_attention_applies(attention_mask)
            and (cache is None or cache.get_seq_length(self.layer_idx) == 0)
            and hidden_states.dtype == torch.float32
            and hidden_states.device.type == "cpu"
            and self.c_attn.weight.dtype == torch.float32
            and not torch.is_autocast_enabled("cpu")
        ):
            return None
        batch, length, _ = hidden_states.shape
        gate, columns = self.energy_gate, 3 * self.config.hidden_size
        energy = None
        if self._projections_fusable() and isinstance(gate.energy, LinearEnergy):
            # q, k, v and the linear energies from one product
            energy_proj = gate.energy.proj
            weight = torch.cat([self.c_attn.weight, energy_proj.weight])
            bias = None
            if self.c_attn.bias is not None or energy_proj.bias is not None:
                bias = torch.cat([
                    self.c_attn.weight.new_zeros(columns) if self.c_attn.bias is None else self.c_attn.bias,
                    energy_proj.weight.new_zeros(energy_proj.out_features) if energy_proj.bias is None
                    else energy_proj.bias,
                ])
            projected = nn.functional.linear(hidden_states, weight, bias)
            energy = gate.energy.arrange(projected[..., columns:])
            qkv = projected[..., :columns]
        else:
            qkv = self.c_attn(hidden_states)
        key_bias, _, state = gate(hidden_states, return_aux=cache is not None, energy=energy)
        qkv = qkv.view(batch, length, 3, self.num_heads, self.head_dim)
        attn_output = causal_attention_with_key_bias(
            qkv, key_bias, self.scaling, self.config.attn_pdrop if self.training else 0.0
        )
        if attn_output is None:
            return None
        if cache is not None:
            _, key, value = qkv.permute(2, 0, 3, 1, 4).unbind(0)
            cache.update(*fold_bias_into_kv(key, value, key_bias, state), self.layer_idx)
        return self.resid_dropout(self.c_proj(attn_output.view(batch, length, -1)))

    def decoding_plan_sources(self) -> list[torch.Tensor | None]:
        """The parameters a ``CompiledDecodingPlan`` of this layer is derived from."""
        gate = self.energy_gate
        if gate is None:
            return []
        energy_proj = getattr(gate.energy, "proj", None)
        return [
            self.c_attn.weight, self.c_attn.bias, self.c_proj.weight, gate.tau, gate.alpha, gate.mix_logits,
            None if energy_proj is None else energy_proj.weight, None if energy_proj is None else energy_proj.bias,
        ]

    def _compiled_gate(self, width: int) -> CompiledCausalGate | None:
        """The compiled causal gate (``compiled_kernels``) for this layer's fused projection with ``width`` extra
        channels per head, or ``None`` where it does not apply: statistics other than causal, energies other than
        linear (the C code reads them from the fused projection), projections that must be called
        (``_projections_fusable``), weights not float32 on CPU, or no C compiler."""
        gate = self.energy_gate
        if not (
            gate.normalization == "causal"
            and isinstance(gate.energy, LinearEnergy)
            and self._projections_fusable()
            and self.c_attn.weight.dtype == torch.float32
            and self.c_attn.weight.device.type == "cpu"
        ):
            return None
        library = compiled_library()
        if library is None:
            return None
        return CompiledCausalGate(library, gate.constants(), self.num_heads, self.head_dim, width, gate.eps)

    def _compiled_gate_applies(self, projected, energy, token_mask, past_state) -> bool:
        """Whether a multi-position pass can run its gate in C: no autograd (the C code has no backward), the linear
        energies inside the fused float32 projection, no padding, nothing cached yet, nothing watching the gate."""
        return (
            energy is not None
            and not torch.is_grad_enabled()
            and token_mask is None
            and past_state is None
            and projected.dtype == torch.float32
            and projected.device.type == "cpu"
            and not _gate_observed(self.energy_gate)
        )

    def _compiled_attention_applies(self, attention_mask) -> bool:
        """Whether a pass may attend in C (the compiled kernels): where SDPA would run without a mask — the SDPA
        backend, no padding; causal over the new positions, or one position seeing every cached key — and so return
        no attention weights either. Passes over new positions also need an empty cache (the callers check)."""
        return self.config._attn_implementation == "sdpa" and attention_mask is None

    def build_decoding_plan(self) -> CompiledDecodingPlan | None:
        """What the compiled decoding step keeps through a generation, or ``None`` where it does not apply (no gate,
        or no compiled gate for it: ``_compiled_gate``)."""
        if self.energy_gate is None:
            return None
        width = self.energy_gate.aux_width
        compiled_gate = self._compiled_gate(width)
        if compiled_gate is None:
            return None
        qkv_weight, qkv_bias = self._folded_qkv_weights(width)
        return CompiledDecodingPlan(
            DecodingLinear(qkv_weight, qkv_bias),
            DecodingLinear(folded_output_weight(self.c_proj.weight, self.num_heads, width), self.c_proj.bias),
            DecodingLinear(self.c_proj.weight, self.c_proj.bias), self.head_dim + width, compiled_gate,
        )

    def _compiled_step_past(self, plan: CompiledDecodingPlan, hidden_states, cache) -> int:
        """The number of cached keys if this decoding step can take the compiled step, else 0. Checks what can change
        from step to step: nothing watches the gate module (``output_gate_values``, hooks), and the cache holds this
        layer's float32 values for every row with the plan's width (the C code reads them through raw pointers)."""
        if _gate_observed(self.energy_gate) or self.layer_idx >= len(cache.layers):
            return 0
        layer = cache.layers[self.layer_idx]
        past_length = cached_length(layer)
        values = layer.values
        applies = (
            past_length > 0
            and values.dtype == torch.float32
            and values.dim() == 4
            and values.shape[0] == hidden_states.shape[0]
            and values.shape[1] == self.num_heads
            and values.shape[2] >= past_length
            and values.shape[3] == plan.head_width
            and values.stride(3) == 1
            and values.device.type == "cpu"
        )
        return past_length if applies else 0

    def _compiled_decoding_step(self, hidden_states, attention_mask, cache, plan, past_length, **kwargs):
        """``_gated_forward`` for one new position without padding, the gate's arithmetic in one C call: the same
        q/k/v layout and cache contents, so that this and the torch code can take turns from step to step."""
        batch = hidden_states.shape[0]
        projected = plan.qkv(hidden_states)
        if projected.dtype != torch.float32:  # autocast: the C code reads and writes float32 only
            return self._gated_forward(hidden_states, attention_mask, None, cache, **kwargs)
        values = cache.layers[self.layer_idx].values
        query, key, value = plan.gate.step(projected, values, past_length - 1, past_length).unbind(0)
        key, value = cache.update(key, value, self.layer_idx)
        if self._compiled_attention_applies(attention_mask):
            attn_output = decoding_attention_with_key_bias(query, key, value, self.head_dim, self.scaling)
            if attn_output is not None:
                return self.resid_dropout(plan.out(attn_output.view(batch, 1, -1))), None
        attn_output, attn_weights = self._attend(query, key, value, attention_mask, **kwargs)
        attn_output = plan.folded_out(attn_output.reshape(batch, 1, -1))
        return self.resid_dropout(attn_output), attn_weights

    def _projections_fusable(self) -> bool:
        """Whether the projections are plain ``nn.Linear`` modules that compute nothing beyond their weights, so
        that their weights can be folded. Adapters (PEFT's LoRA), quantised layers, offloading or other hooks keep
        their own forward, and the layer then calls them and folds by concatenation."""
        modules = [self.c_attn, self.c_proj]
        if isinstance(self.energy_gate.energy, LinearEnergy):
            modules.append(self.energy_gate.energy.proj)
        return all(plain_linear(m) for m in modules)

    def _attend(self, query, key, value, attention_mask, **kwargs):
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        return attention_interface(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=self.config.attn_pdrop if self.training else 0.0,
            scaling=self.scaling,
            **kwargs,
        )

    def _folded_qkv_weights(self, width: int):
        """The q/k/v (+ linear energy) projection's weight and bias in the folded layout, kept between decoding
        steps inside ``caching_derived_tensors()`` (``DerivedTensors``)."""
        energy = self.energy_gate.energy
        energy_proj = energy.proj if isinstance(energy, LinearEnergy) else None
        energy_weight, energy_bias = (None, None) if energy_proj is None else (energy_proj.weight, energy_proj.bias)

        def build():
            return folded_qkv_weights(
                self.c_attn.weight, self.c_attn.bias, self.num_heads, self.head_dim, width, self.scaling,
                energy_weight, energy_bias,
            )

        return self._derived_weights.get(build, width, self.c_attn.weight, self.c_attn.bias, energy_weight, energy_bias)


class EGABlock(GradientCheckpointingLayer):
    def __init__(self, config: EGAConfig, layer_idx: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, bias=config.bias)
        self.attn = EGAAttention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, bias=config.bias)
        self.mlp = EGAMLP(config)

    def forward(self, hidden_states, attention_mask=None, token_mask=None, cache=None, decoding_plan=None, **kwargs):
        attn_output, _ = self.attn(
            self.ln_1(hidden_states), attention_mask=attention_mask, token_mask=token_mask, cache=cache,
            decoding_plan=None if decoding_plan is None else decoding_plan.attention, **kwargs,
        )
        hidden_states = hidden_states + attn_output
        return hidden_states + self.mlp(
            self.ln_2(hidden_states), decoding_weights=None if decoding_plan is None else decoding_plan.mlp
        )

    def build_decoding_plan(self) -> BlockDecodingPlan:
        return BlockDecodingPlan(self.attn.build_decoding_plan(), self.mlp.decoding_weights())

    def decoding_plan_sources(self) -> list[torch.Tensor | None]:
        """The parameters a ``BlockDecodingPlan`` is derived from."""
        mlp = self.mlp
        return [*self.attn.decoding_plan_sources(), mlp.c_fc.weight, mlp.c_fc.bias, mlp.c_proj.weight, mlp.c_proj.bias]


class EGAPreTrainedModel(PreTrainedModel):
    config_class = EGAConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["EGABlock"]
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_record_outputs = {
        "hidden_states": EGABlock,
        "attentions": OutputRecorder(EGAAttention, index=1),
        "gate_values": OutputRecorder(EnergyGate, index=1),
    }

    def save_pretrained(self, save_directory, *args, is_main_process: bool = True, **kwargs):
        # transformers' `register_for_auto_class` copies only single-dot imports: write the remote code ourselves
        # (flattened model files, the ops they need, a complete auto_map) so the folder loads without hf_spectral.
        super().save_pretrained(save_directory, *args, is_main_process=is_main_process, **kwargs)
        if is_main_process:
            save_model_code(self, save_directory)

    def _init_weights(self, module):
        super()._init_weights(module)  # Linear / Conv1d / Embedding: N(0, initializer_range); LayerNorm: 1, 0
        if isinstance(module, EnergyGate):
            init.constant_(module.tau, self.config.gate_tau_init)
            init.constant_(module.alpha, self.config.gate_alpha_init)
            init.zeros_(module.mix_logits)
        elif isinstance(module, MorletEnergy):
            omega = torch.tensor([torch.pi / length for length in module.lengths]).repeat(module.num_heads, 1)
            init.copy_(module.omega, omega)
            init.copy_(module.sigma, 5.0 / omega)
        elif isinstance(module, SequencePooling):
            if module.mode == "learned":
                init.zeros_(module.position_logits)
            elif module.mode == "rmt_optimal":
                init.ones_(module.position_weights)


class EGAModel(EGAPreTrainedModel):
    def __init__(self, config: EGAConfig):
        super().__init__(config)
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.drop = nn.Dropout(config.embd_pdrop)
        self.h = nn.ModuleList(EGABlock(config, i) for i in range(config.num_hidden_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, bias=config.bias)
        self.gradient_checkpointing = False
        self._decoding_plans = DerivedTensors()
        self.post_init()

    def get_input_embeddings(self):
        return self.wte

    def set_input_embeddings(self, value):
        self.wte = value

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
    ) -> EGAModelOutputWithPast:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.wte(input_ids)
        if use_cache and cache is None:
            cache = GrowingCache(config=self.config)
        length = inputs_embeds.shape[1]
        past_length = int(cache.get_seq_length()) if cache is not None else 0

        token_mask = None
        if attention_mask is not None and attention_mask.ndim == 2:
            if attention_mask.shape[1] != past_length + length:
                raise ValueError(
                    f"attention_mask has {attention_mask.shape[1]} positions, expected {past_length + length} "
                    f"({past_length} cached + {length} new)"
                )
            # An all-ones mask means "no padding": dropping it lets the gates take their cheaper unpadded paths.
            token_mask = None if bool(attention_mask.all()) else attention_mask.bool()
        elif attention_mask is not None:  # a causal 4D mask (generate() builds one for a StaticCache)
            seen = padding_mask(attention_mask, past_length + length)
            token_mask = None if seen is None or bool(seen.all()) else seen
        if position_ids is None:
            if token_mask is not None:  # count real tokens, so that left padding does not shift positions
                position_ids = (token_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -length:]
            else:
                position_ids = torch.arange(past_length, past_length + length, device=inputs_embeds.device)[None]
        if position_ids.max() >= self.config.max_position_embeddings:
            raise ValueError(
                f"position {int(position_ids.max())} is beyond max_position_embeddings "
                f"({self.config.max_position_embeddings})"
            )

        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            cache=cache,
            position_ids=position_ids,
        )
        hidden_states = self.drop(inputs_embeds + self.wpe(position_ids))
        plans = None
        if length == 1 and past_length and token_mask is None and keeping_derived_tensors():
            plans = self._compiled_decoding_plans()
        for index, block in enumerate(self.h):
            hidden_states = block(
                hidden_states, attention_mask=causal_mask, token_mask=token_mask, cache=cache,
                decoding_plan=None if plans is None else plans[index], **kwargs,
            )
        return EGAModelOutputWithPast(last_hidden_state=self.ln_f(hidden_states), cache=cache)

    def _compiled_decoding_plans(self) -> list:
        """Per block, its decoding step's plan (``BlockDecodingPlan``), kept through a generation and checked against
        every layer's parameters once per step rather than once per layer (``DerivedTensors.kept``)."""
        plans = self._decoding_plans.kept(None)
        if plans is DerivedTensors.MISSING:
            sources = [t for block in self.h for t in block.decoding_plan_sources()]
            plans = self._decoding_plans.get(lambda: [block.build_decoding_plan() for block in self.h], None, *sources)
        return plans


class EGAForCausalLM(EGAPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.wte.weight"}

    def __init__(self, config: EGAConfig):
        super().__init__(config)
        self.model = EGAModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.wte

    def set_input_embeddings(self, value):
        self.model.wte = value

    def generate(self, *args, **kwargs):
        # The weights stay fixed through one generation: keep the folded weights and gate constants between steps.
        with caching_derived_tensors():
            return super().generate(*args, **kwargs)

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size,
                                      max_cache_length):
        """generate()'s default cache (the ``DynamicCache`` made when the caller passes none) appends in place into
        buffers of the generation's maximum length (``GrowingLayer``): the same contents, without copying the whole
        cache at every step. Other caches (static, offloaded, quantised, the caller's) stay as they are."""
        super()._prepare_cache_for_generation(
            generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
        )
        cache = model_kwargs.get("cache")
        if type(cache) is DynamicCache and not cache.offloading and not getattr(cache, "_is_user_defined", False):
            append_in_place(cache, reserve=max(int(max_cache_length), 0))

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
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=False,
            **kwargs,
        )
        if attention_mask is None and input_ids is not None and self.config.pad_token_id is not None:
            attention_mask = (input_ids != self.config.pad_token_id).long()
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
