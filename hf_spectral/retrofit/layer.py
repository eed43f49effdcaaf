"""The layer the retrofit injects: a stock attention module that also carries an energy gate.

`add_energy_gates` gives each targeted attention module an ``energy_gate`` child (the same `EnergyGate` EGA-GPT
uses, ``ops/energy_gate.py``) and mixes `EnergyGatedAttentionMixin` into its class. The stock ``forward`` still
runs unchanged; around it the mixin

1. computes the gate's logit bias for the new keys from the attention input (the normalised hidden states);
2. without a KV cache, hands the bias to the attention call as a keyword argument; with one, hands the stock
   forward a `GatedKVCache` that writes the bias and gate state of the new keys into the cache's gated layer
   beside them (``ops/gate_cache.py``, as in EGA-GPT) and hands the attention call every cached key's bias;
3. routes the attention call through ``energy_gated_<backend>``, which runs the shared gated attention
   (``ops/gated_attention.py``) on the backend the model uses: eager adds the bias to the scores, flex_attention
   adds it in a ``score_mod``, SDPA takes it as the mask of a decoding step and from a folded query/key channel
   otherwise.

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
from transformers.utils import logging

from ..ops.energy_gate import padding_mask
from ..ops.gate_cache import EnergyGateCacheLayerMixin, can_hold_gate, gated_cache_layer, update_gated_cache
from ..ops.gated_attention import attention_with_key_bias, mask_with_key_bias
from ..ops.packing import PACKED_KWARGS, check_not_packed, packed_rows

logger = logging.get_logger(__name__)

GATED_PREFIX = "energy_gated_"
TOKEN_MASK_KEYWORD = "energy_gate_token_mask"  # the decoder's padding mask, on its way to the gated attention calls
DOCUMENTS_KEYWORD = "energy_gate_document_positions"  # packed rows: each token's index in its document, likewise
# The names stock attention forwards give their KV cache argument (newest first).
CACHE_ARGUMENTS = ("cache", "past_key_values", "layer_past", "past_key_value")


def _gated_attention_function(backend: str):
    def energy_gated_attention(
        module, query, key, value, attention_mask, scaling=None, dropout=0.0, energy_gate_bias=None,
        energy_gate_cache=None, **kwargs,
    ):
        if kwargs.get("s_aux") is not None:
            raise ValueError(
                f"energy gates do not support attention sinks (`s_aux`, {type(module).__name__}): a sink is a key no "
                "gate has an energy for"
            )
        if backend != "eager" and kwargs.pop("output_attentions", False):
            # As in the stock model (EGA-GPT instead runs such a call through eager): a model gated in some layers
            # only would otherwise return probabilities for those layers alone, a list not one entry per layer.
            logger.warning_once(
                f"`{backend}` attention does not return attention probabilities; load the model with "
                "`attn_implementation='eager'` for them"
            )
        if energy_gate_cache is not None:  # keys and values from the KV cache: the bias of every cached key
            energy_gate_bias = energy_gate_cache.key_bias
        family_eager = getattr(type(module), "family_eager_attention", None)
        if backend == "eager" and family_eager is not None and not getattr(module, "reorder_and_upcast_attn", False):
            # The family's own eager attention, the gate's log-bias added to its additive mask: whatever else it
            # does to the scores (soft-capping, its scaling, upcasting) stays as in the stock model.
            if energy_gate_bias is not None:
                attention_mask = mask_with_key_bias(module, attention_mask, query, key, energy_gate_bias)
            return family_eager(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        return attention_with_key_bias(
            module, backend, query, key, value, energy_gate_bias, attention_mask, scaling, dropout, **kwargs
        )

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
        if backend in ALL_MASK_ATTENTION_FUNCTIONS:  # padded batches keep their mask if a config carries this name
            AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[backend])
    return name


class AttentionConfigView:
    """A gated attention module's view of the model config: identical, except that the attention
    implementation resolves to the energy-gated wrapper of whatever the model currently uses."""

    # No __slots__: the view keeps an instance __dict__ of its own, which torch.compile's guards read (through the
    # __getattr__ below a slotted view answered with the config's __dict__, and torch 2.10's guard check failed on it)
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
    """Stands in for the KV cache during one gated attention call: ``update`` writes the new keys and values with
    the gate's bias and state into the cache's gated layer (``update_gated_cache``, as `EGAAttention` does in
    EGA-GPT) and keeps the bias of every cached key, which the attention call reads as ``key_bias``."""

    def __init__(self, cache, bias, state, features):
        self.cache, self.bias, self.state, self.features, self.key_bias = cache, bias, state, features, None

    def update(self, key, value, layer_idx, *args, **kwargs):
        key, value, self.key_bias = update_gated_cache(
            self.cache, layer_idx, key, value, self.bias, self.state, self.features, *args, **kwargs
        )
        return key, value

    def __getattr__(self, name):
        return getattr(self.cache, name)


class EnergyGatedAttentionMixin:
    """Mixed into a stock attention class (see the module docstring). Expects ``energy_gate`` and
    ``energy_gate_heads`` (indices of the gated key/value heads, ``None`` for all); its call gets the model-level 2D
    padding mask as the keyword ``energy_gate_token_mask``, which `TokenMaskHook` adds to the decoder's keyword
    arguments and the stock decoder layers pass down with theirs."""

    def __reduce_ex__(self, protocol):
        # The class is made at run time (`gated_attention_class`), so pickle cannot find it by name: a module is
        # pickled as "the gated form of its stock class", which any process rebuilds (`torch.save(model)`).
        return _new_gated_attention, (self.stock_class,), self.__dict__

    def forward(self, *args, **kwargs):
        stash = getattr(self, "energy_gate_stash", None) or {}
        # The decoder's padding mask and document positions, passed down by the decoder layers; layers that pass no
        # keyword arguments to their attention (Falcon, StableLM) leave them to what the decoder's hook last saw.
        token_mask = kwargs.pop(TOKEN_MASK_KEYWORD, stash.get(TOKEN_MASK_KEYWORD))
        document_positions = kwargs.pop(DOCUMENTS_KEYWORD, stash.get(DOCUMENTS_KEYWORD))
        cache_name = self.cache_argument
        for name in CACHE_ARGUMENTS:  # the cache under the name this family's attention takes
            if name != cache_name and name in kwargs:
                kwargs[cache_name] = kwargs.pop(name)
        if len(args) > 1:  # rare: bind to the stock signature to find the cache among positional arguments
            bound = self.stock_signature.bind(*args, **kwargs)
            extra = {}
            for name, parameter in self.stock_signature.parameters.items():
                if parameter.kind is inspect.Parameter.VAR_KEYWORD:
                    extra = bound.arguments.pop(name, {})
            args, kwargs = (), {**extra, **bound.arguments}
        hidden_states = args[0] if args else kwargs["hidden_states"]
        cache = kwargs.get(cache_name)
        identity = self._is_identity(cache)
        if identity and (cache is None or not can_hold_gate(cache, self.layer_idx)):
            return super().forward(*args, **kwargs)  # the stock attention, untouched: bit-exact
        past_state = past_features = None
        if cache is not None:  # each key's bias and gate state live beside it, in the cache's gated layer
            past_state, past_features, token_mask = gated_cache_layer(cache, self.layer_idx).gate_past(
                self.energy_gate.cached_positions, hidden_states.shape[1], token_mask
            )
        bias, _, state, features = self.energy_gate(
            hidden_states, token_mask, past_state, past_features, cache is not None, document_positions
        )
        if self.energy_gate_heads is not None:  # ungated heads get a zero bias, i.e. their stock attention
            keep = torch.zeros(bias.shape[1], device=bias.device, dtype=bias.dtype)
            keep[self.energy_gate_heads] = 1
            bias = bias * keep[:, None]
        if cache is None:
            kwargs["energy_gate_bias"] = bias
        else:
            kwargs[cache_name] = GatedKVCache(cache, bias, state, features)
            # An identity gate still fills the cache's gated layer (its bias is exactly 0), so that a later step
            # that runs the gate (compiled, or after α was trained) continues the cache; its attention stays stock.
            if not identity:
                kwargs["energy_gate_cache"] = kwargs[cache_name]
        return super().forward(*args, **kwargs)

    def _is_identity(self, cache) -> bool:
        """Whether this call's gate is the identity, so that the stock forward can run: every α is 0 (read on the
        host; not while compiling, where that would break the graph), no gradient is asked of the gate, and no key
        of this layer's cache holds a non-zero bias (keys written while α was not 0 keep their bias)."""
        if torch.compiler.is_compiling():
            return False
        alpha = self.energy_gate.alpha
        if torch.is_grad_enabled() and alpha.requires_grad:
            return False
        if bool(alpha.detach().any()):
            return False
        if cache is not None:
            layers = getattr(cache, "layers", None)
            if layers is None:
                return False
            layer = layers[self.layer_idx] if self.layer_idx < len(layers) else None
            if isinstance(layer, EnergyGateCacheLayerMixin) and layer.holds_acting_bias():
                return False
        return True


_GATED_ATTENTION_CLASSES: dict[type, type] = {}


def _new_gated_attention(stock_class: type):
    """An empty instance of the gated form of ``stock_class``, for unpickling (its state is set next)."""
    gated = gated_attention_class(stock_class)
    return gated.__new__(gated)


def _signature_without_self(function) -> inspect.Signature:
    signature = inspect.signature(function)
    return signature.replace(parameters=list(signature.parameters.values())[1:])


def gated_attention_class(stock_class: type) -> type:
    """``EnergyGated<StockAttention>``: the stock class with `EnergyGatedAttentionMixin` in front (cached); a gated
    class is returned as it is."""
    if issubclass(stock_class, EnergyGatedAttentionMixin):
        return stock_class
    if stock_class not in _GATED_ATTENTION_CLASSES:
        signature = _signature_without_self(stock_class.forward)
        eager = getattr(sys.modules.get(stock_class.__module__), "eager_attention_forward", None)
        gated = type(
            f"EnergyGated{stock_class.__name__}",
            (EnergyGatedAttentionMixin, stock_class),
            {
                "stock_class": stock_class,
                "stock_signature": signature,
                "cache_argument": next((name for name in CACHE_ARGUMENTS if name in signature.parameters), "cache"),
                # the eager attention beside the stock class (None: the shared one in ops/gated_attention.py)
                "family_eager_attention": staticmethod(eager) if callable(eager) else None,
                "__module__": __name__,
            },
        )
        _GATED_ATTENTION_CLASSES[stock_class] = gated
    return _GATED_ATTENTION_CLASSES[stock_class]


_PACKING_ARGUMENTS = ("input_ids", "inputs_embeds", "position_ids", *CACHE_ARGUMENTS)


class TokenMaskHook:
    """A forward pre-hook for a decoder stack: adds its 2D padding mask (True at tokens, ``None`` without padding)
    to the decoder's keyword arguments as ``energy_gate_token_mask``; the stock decoder passes its extra keyword
    arguments to every layer and each layer to its attention, where the gated ones take it. As an argument of each
    layer's call, the mask is what gradient checkpointing's recomputation sees too, even after the model ran on
    another batch before the backward (a reference or KL forward); a mask kept on the modules would be that batch's.

    Packed rows (several documents a row: ``position_ids`` restarting, or ``cu_seq_lens_*``, with no attention mask
    and nothing cached; ``ops/packing.py``) go the same way as ``energy_gate_document_positions``, so that the gates'
    statistics restart at every document. The stock decoder keeps the documents apart in attention only when it
    builds its mask without a KV cache, so the hook turns off the cache it would create for such a call
    (``use_cache=False``), refuses one passed in, and gives ``cu_seq_lens`` without ``position_ids`` the positions of
    each document. A sequence classifier's decoder (``pools_rows``) refuses packed rows: the head pools one vector a
    row.

    Where ``attention_mask`` (and the inputs) sit among the decoder's arguments is read from its signature here,
    once: the hook itself binds no signature, which a compiled graph (``torch.compile(fullgraph=True)``) could not
    trace after generate()'s keyword arguments. (A class, not a closure, so that a gated model pickles.)

    ``masks_as_rows``: the decoder reads a mask below 4D as rows of its sequences, ``mask.view(sequences, -1)``
    (GPT-2: a flat mask, (batch, choices, length) inputs); the gates then read it the same way.
    """

    def __init__(self, decoder, masks_as_rows: bool = False):
        names = list(inspect.signature(decoder.forward).parameters)
        self.position = names.index("attention_mask") if "attention_mask" in names else None
        inputs = ("input_ids", "inputs_embeds") if masks_as_rows else ()
        self.input_positions = {name: names.index(name) for name in inputs if name in names}
        self.argument_positions = {name: names.index(name) for name in _PACKING_ARGUMENTS if name in names}
        self.pools_rows = False
        # The mask and document positions of the latest call, for attention modules whose decoder layer does not
        # pass keyword arguments on (Falcon, StableLM). Only there does a recomputation under gradient checkpointing
        # after a forward on another batch read that batch's: such layers give no other way in.
        self.stash = {}

    def __call__(self, module, args, kwargs):
        if not hasattr(self, "input_positions"):  # a hook pickled before it counted sequences: GPT-2's count them
            self.__init__(module, masks_as_rows=str(getattr(module.config, "model_type", "")).endswith("gpt2"))
        mask = kwargs.get("attention_mask")
        if mask is None and self.position is not None and self.position < len(args):
            mask = args[self.position]
        if self.input_positions and isinstance(mask, torch.Tensor) and mask.ndim < 4:
            sequences = self._sequences(args, kwargs)
            if sequences is not None and mask.numel() % sequences == 0:
                mask = mask.reshape(sequences, -1)
        kwargs = {**kwargs, TOKEN_MASK_KEYWORD: padding_mask(mask)}
        if not hasattr(self, "argument_positions"):  # a hook pickled before packed rows were read
            self.argument_positions, self.pools_rows = {}, False
        kwargs = self._with_documents(module, args, kwargs, mask)
        stash = self.__dict__.setdefault("stash", {})
        stash[TOKEN_MASK_KEYWORD], stash[DOCUMENTS_KEYWORD] = kwargs[TOKEN_MASK_KEYWORD], kwargs.get(DOCUMENTS_KEYWORD)
        return args, kwargs

    def _argument(self, name, args, kwargs):
        value = kwargs.get(name)
        position = self.argument_positions.get(name)
        if value is None and position is not None and position < len(args):
            value = args[position]
        return value

    def _with_documents(self, module, args, kwargs, mask) -> dict:
        """``kwargs`` with the document positions of packed rows (and what the stock decoder needs to keep their
        documents apart), or as they are."""
        position_ids = self._argument("position_ids", args, kwargs)
        if not any(kwargs.get(name) is not None for name in PACKED_KWARGS) and (position_ids is None or mask is not None):
            return kwargs  # the usual call, and every decoding step: one sequence a row
        input_ids, inputs_embeds = self._argument("input_ids", args, kwargs), self._argument("inputs_embeds", args, kwargs)
        if input_ids is not None:  # (batch, length), or GPT-2's (batch, choices, length): rows of sequences
            length = input_ids.shape[-1]
            batch = input_ids.numel() // max(1, length)
        elif inputs_embeds is not None:
            length = inputs_embeds.shape[-2]
            batch = inputs_embeds.numel() // max(1, length * inputs_embeds.shape[-1])
        else:
            return kwargs
        cache = self._argument("cache", args, kwargs)
        cache = cache if cache is not None else self._argument("past_key_values", args, kwargs)
        use_cache = kwargs.get("use_cache")
        use_cache = getattr(module.config, "use_cache", False) if use_cache is None else use_cache
        if position_ids is not None and position_ids.shape[-1] == length:
            position_ids = position_ids.reshape(-1, length)
        name = type(module).__name__
        documents, positions, use_cache = packed_rows(position_ids, mask, cache, use_cache, batch, length, kwargs, name)
        if documents is None:
            return kwargs
        if self.pools_rows:
            check_not_packed(documents, name, "a sequence classifier pools one vector per row, not one per document")
        kwargs = {**kwargs, DOCUMENTS_KEYWORD: documents, "use_cache": use_cache}
        if positions is not position_ids:  # counted from cu_seq_lens: the stock mask and positions need them too
            kwargs["position_ids"] = positions
        return kwargs

    def _sequences(self, args, kwargs) -> int | None:
        """How many sequences the decoder's input holds (as GPT-2 counts them), or None where it has none."""
        for name, position in self.input_positions.items():
            value = kwargs.get(name)
            if value is None and position < len(args):
                value = args[position]
            if isinstance(value, torch.Tensor):
                return value.numel() // value.shape[-1] if name == "input_ids" else value.shape[0]
        return None
