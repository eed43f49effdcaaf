"""The layer the retrofit injects: a stock attention module that also carries an energy gate.

`add_energy_gates` gives each targeted attention module an ``energy_gate`` child (the same `EnergyGate` EGA-GPT
uses) and mixes `EnergyGatedAttentionMixin` into its class. The stock ``forward`` still runs unchanged; around
it the mixin

1. computes the gate's logit bias for the new keys from the attention input (the normalised hidden states);
2. hands the stock forward a `GatedKVCache` that folds bias and gate state into the new keys/values before they
   reach the real KV cache (so the cache keeps every key's bias, as in EGA-GPT);
3. routes the attention call through ``energy_gated_<backend>``, which pads the queries to match and drops the
   extra output channels, then calls the backend the model uses (eager, sdpa, flex_attention, ...).

Step 3 needs the module to see a different attention-implementation name from the model: the module's ``config``
becomes an `AttentionConfigView`. The model's own config, and with it mask creation, stays untouched, so a
later ``model.set_attn_implementation(...)`` keeps working.
"""

import copy
import inspect
import sys

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..models.ega_gpt.energy_gate import (
    cached_gate_state,
    fold_bias_into_kv,
    pad_query_for_bias,
    padding_mask,
    replace_folded_bias,
)

GATED_PREFIX = "energy_gated_"


def _gated_attention_function(backend: str):
    def energy_gated_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        width = key.shape[-1] - query.shape[-1]  # channels `GatedKVCache` appended to the keys
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        if width > 0:
            query = pad_query_for_bias(query, width, scaling)
        attention = module.stock_eager_attention if backend == "eager" else ALL_ATTENTION_FUNCTIONS[backend]
        output, weights = attention(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        return (output[..., : output.shape[-1] - width] if width > 0 else output), weights

    energy_gated_attention.__name__ = f"energy_gated_{backend.replace('|', '_')}_attention"
    return energy_gated_attention


def gated_attention_name(backend: str | None) -> str:
    """The registered name of the energy-gated wrapper around ``backend`` (registered on first use)."""
    backend = backend or "eager"
    name = GATED_PREFIX + backend
    if name not in AttentionInterface._global_mapping:
        if backend != "eager" and backend not in ALL_ATTENTION_FUNCTIONS:
            raise ValueError(f"energy gates cannot wrap the attention implementation {backend!r}")
        AttentionInterface.register(name, _gated_attention_function(backend))
        if backend in ALL_MASK_ATTENTION_FUNCTIONS:  # in case a model config ever carries the wrapped name
            AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[backend])
    return name


class AttentionConfigView:
    """A gated attention module's view of the model config: identical, except that the attention
    implementation resolves to the energy-gated wrapper of whatever the model currently uses."""

    __slots__ = ("config",)

    def __init__(self, config):
        object.__setattr__(self, "config", config)

    @property
    def _attn_implementation(self) -> str:
        return gated_attention_name(self.config._attn_implementation)

    def __getattr__(self, name):
        return getattr(self.config, name)

    def __setattr__(self, name, value):
        setattr(self.config, name, value)

    def __deepcopy__(self, memo):
        return AttentionConfigView(copy.deepcopy(self.config, memo))

    def __reduce__(self):
        return AttentionConfigView, (self.config,)


class GatedKVCache:
    """Stands in for the KV cache during one gated attention call.

    ``update`` folds the gate's bias and per-key state into the new keys/values, stores them in the real cache
    (if any) and returns the full keys/values, exactly as `EGAAttention` does in EGA-GPT.
    """

    def __init__(self, cache, bias, state, head_dim, rebias_all_keys):
        self.cache, self.bias, self.state = cache, bias, state
        self.head_dim, self.rebias_all_keys = head_dim, rebias_all_keys

    def update(self, key, value, layer_idx, *args, **kwargs):
        key, value = fold_bias_into_kv(key, value, self.bias[..., -key.shape[2] :], self.state)
        if self.cache is not None:
            key, value = self.cache.update(key, value, layer_idx, *args, **kwargs)
        if self.rebias_all_keys:
            key = replace_folded_bias(key, self.bias, self.head_dim)
        return key, value

    def __getattr__(self, name):
        return getattr(self.cache, name)


class EnergyGatedAttentionMixin:
    """Mixed into a stock attention class (see the module docstring). Expects ``energy_gate``,
    ``energy_gate_heads`` (indices of the gated key/value heads, ``None`` for all) and ``energy_gate_token_mask``
    (the model-level 2D padding mask, set by a hook on the decoder before each forward)."""

    def forward(self, *args, **kwargs):
        if "past_key_values" in kwargs:  # the name transformers deprecates in favour of `cache`
            kwargs["cache"] = kwargs.pop("past_key_values")
        if len(args) > 1:  # rare: bind to the stock signature to find `cache` among positional arguments
            bound = self.stock_signature.bind(*args, **kwargs)
            extra = {}
            for name, parameter in self.stock_signature.parameters.items():
                if parameter.kind is inspect.Parameter.VAR_KEYWORD:
                    extra = bound.arguments.pop(name, {})
            args, kwargs = (), {**extra, **bound.arguments}
        hidden_states = args[0] if args else kwargs["hidden_states"]
        cache = kwargs.get("cache")
        past_state = cached_gate_state(cache, self.layer_idx, self.head_dim)
        bias, _, state = self.energy_gate(
            hidden_states, valid=self.energy_gate_token_mask, past_aux=past_state, return_aux=cache is not None
        )
        if self.energy_gate_heads is not None:  # ungated heads get a zero bias, i.e. their stock attention
            keep = torch.zeros(bias.shape[1], device=bias.device, dtype=bias.dtype)
            keep[self.energy_gate_heads] = 1
            bias = bias * keep[:, None]
        rebias = bias.shape[-1] != hidden_states.shape[1]
        kwargs["cache"] = GatedKVCache(cache, bias, state, self.head_dim, rebias)
        return super().forward(*args, **kwargs)


_GATED_ATTENTION_CLASSES: dict[type, type] = {}


def _signature_without_self(function) -> inspect.Signature:
    signature = inspect.signature(function)
    return signature.replace(parameters=list(signature.parameters.values())[1:])


def gated_attention_class(stock_class: type) -> type:
    """``EnergyGated<StockAttention>``: the stock class with `EnergyGatedAttentionMixin` in front (cached)."""
    if stock_class not in _GATED_ATTENTION_CLASSES:
        stock_module = sys.modules[stock_class.__module__]
        gated = type(
            f"EnergyGated{stock_class.__name__}",
            (EnergyGatedAttentionMixin, stock_class),
            {
                "stock_class": stock_class,
                "stock_signature": _signature_without_self(stock_class.forward),
                # The model family's own eager function (GQA handling differs between families).
                "stock_eager_attention": staticmethod(stock_module.eager_attention_forward),
                "__module__": __name__,
            },
        )
        _GATED_ATTENTION_CLASSES[stock_class] = gated
    return _GATED_ATTENTION_CLASSES[stock_class]


def set_token_mask_hook():
    """A forward pre-hook for the decoder stack: hands its 2D padding mask to the gated attention modules listed
    in ``decoder._energy_gated_attentions`` (a plain attribute, so that deep copies hook their own modules).

    The mask stays set after the call, so that gradient checkpointing's recomputation sees the same one.
    """

    signatures = {}

    def hook(module, args, kwargs):
        signature = signatures.setdefault(type(module), inspect.signature(module.forward))
        bound = signature.bind_partial(*args, **kwargs)
        token_mask = padding_mask(bound.arguments.get("attention_mask"))
        for attention in module._energy_gated_attentions:
            attention.energy_gate_token_mask = token_mask

    return hook

