"""Energy-gated model types: any decoder-only transformers model whose attention goes through transformers' attention
interface, with energy gates in its attention layers.

``add_energy_gates`` turns a stock model into the gated form of its class (``LlamaForCausalLM`` ->
``EnergyGatedLlamaForCausalLM``, its config ``LlamaConfig`` -> ``EnergyGatedLlamaConfig``, model type
``energy_gated_llama``). Each gated class is the stock class with `EnergyGatedModelMixin` in front, built on first use
(`gated_config_class`, `gated_model_class`) and reachable here by name (the module ``__getattr__``): its constructor
rebuilds the gates that ``config.energy_gates`` records, so ``from_pretrained`` finds a parameter for every saved gate
weight. The weights keep the stock names, plus ``...energy_gate.*`` under each gated attention module.

Nothing here names a family. The attention layers are the modules whose class hands its kernel to
``ALL_ATTENTION_FUNCTIONS`` (`calls_attention_interface`); each gets one gate head per key/value head, read from the
module (`key_value_heads`). What families differ in is met where it matters: in the gated attention call
(``layer.py``: the cache argument's name, the family's own eager attention, which keeps its soft-capping and scaling)
and in the KV cache (``ops/gate_cache.py``: sliding windows). `check_supported` refuses, naming why, what cannot take
gates.

This file is also the remote code of a retrofitted checkpoint: ``save_pretrained`` copies it with the files it
imports (flattened to sibling imports by `save_model_code`) next to the weights and names its classes in
``auto_map``, so that ``AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`` loads the gated model
where hf_spectral is not installed. It therefore imports only transformers, torch and files that can travel with it,
and of transformers' model families only the one it is asked for (by name, through ``transformers``' lazy module).
"""

import inspect
from contextlib import contextmanager

import torch
import transformers
from transformers import initialization as init

from ..ops.energy_gate import DaubechiesEnergy, EnergyGate, MorletEnergy, check_generation_mode
from ..ops.positions import keep_padding_mask_for_generate
from ..ops.remote_code import register_with_auto_class, save_pretrained_with_code
from .config import EnergyGateConfig
from .layer import AttentionConfigView, TokenMaskHook, gated_attention_class

GATED_PREFIX = "EnergyGated"
GATED_TYPE_PREFIX = "energy_gated_"
# The Auto classes a gated family is registered with, and the tables of transformers naming the stock classes.
AUTO_CLASSES = {
    "AutoModel": "MODEL_MAPPING_NAMES",
    "AutoModelForCausalLM": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "AutoModelForSequenceClassification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
}
# Values of `config.layer_types` that are attention; anything else (mamba, linear attention, ...) holds no keys to gate.
ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention", "attention"}
SUPPORTED = (
    "energy gates go into decoder-only (causal) transformers models whose attention layers call transformers' "
    "attention interface (GPT-2, Llama, Mistral, Qwen, Gemma, Phi, Falcon, ...: base model, causal LM or sequence "
    "classification head)"
)


class UnsupportedModelError(ValueError):
    """A model that cannot take energy gates; the message names why and what is supported."""


def _named(value) -> str:
    """A value in an error message: a function's or class's name, a string's or number's value, else its type."""
    shown = getattr(value, "__name__", value)
    if not isinstance(shown, (str, int, float)):
        return f"a {type(value).__name__} object"
    return f"{shown!r} ({type(value).__name__})"


def _refuse(what: str, why: str):
    raise UnsupportedModelError(f"energy gates cannot be added to {what}: {why}; {SUPPORTED}")


# ----------------------------------------------------------------------------------------------------------------
# Finding the attention layers
# ----------------------------------------------------------------------------------------------------------------

_CALLS_INTERFACE: dict[type, bool] = {}


def calls_attention_interface(attention_class: type) -> bool:
    """Whether ``attention_class``'s forward hands its kernel to ``ALL_ATTENTION_FUNCTIONS`` (read from its source,
    once per class): such a forward's attention call is what the gates wrap, whatever else it computes."""
    attention_class = getattr(attention_class, "stock_class", attention_class)
    if attention_class not in _CALLS_INTERFACE:
        forward = attention_class.__dict__.get("forward")
        try:
            source = inspect.getsource(forward) if forward is not None else ""
        except (OSError, TypeError):  # no source (a class built at run time)
            source = ""
        _CALLS_INTERFACE[attention_class] = "ALL_ATTENTION_FUNCTIONS" in source
    return _CALLS_INTERFACE[attention_class]


def stock_class_of(cls: type) -> type:
    """The transformers class ``cls`` is (a gated class: its stock class; a user's subclass: its nearest transformers
    ancestor), or ``None`` where it has none."""
    cls = getattr(cls, "stock_class", cls)
    for base in cls.__mro__:
        if base.__module__.startswith("transformers.models."):
            return base
    return None


def decoder_of(model):
    """The decoder stack of ``model``: its base model (``model.transformer``, ``model.model``, or itself)."""
    return model.base_model


def attention_layers(decoder) -> list:
    """The self-attention modules of ``decoder`` in layer order: the modules whose class calls the attention interface
    (not one inside another: a module that wraps an attention calls it through the inner one), except
    cross-attention and layers that reuse another layer's keys and values (``is_kv_shared_layer``: such a layer
    writes no keys of its own, so a gate there would have nothing to bias that the other layer's gate does not)."""
    found, inside = [], set()
    for module in decoder.modules():
        if id(module) in inside or not calls_attention_interface(type(module)):
            continue
        inside.update(id(inner) for inner in module.modules())
        if getattr(module, "is_cross_attention", False) or getattr(module, "is_kv_shared_layer", False):
            continue
        found.append(module)
    if all(isinstance(getattr(module, "layer_idx", None), int) for module in found):
        found.sort(key=lambda module: module.layer_idx)
    return found


def _first_attribute(objects, names):
    for source in objects:
        for name in names:
            value = getattr(source, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def key_value_heads(attention, config) -> int:
    """The key/value heads of ``attention``: its query heads over ``num_key_value_groups`` (grouped- and multi-query
    attention), else the counts of the module or the config. A gate acts on keys, so it has one head per key head."""
    heads = _first_attribute((attention, config), ("num_heads", "num_attention_heads", "n_head"))
    groups = _first_attribute((attention,), ("num_key_value_groups",))
    if heads is not None and groups is not None:
        return heads // groups
    if getattr(config, "multi_query", False) is True:
        return 1
    kv_heads = _first_attribute((attention, config), ("num_key_value_heads", "num_kv_heads"))
    return kv_heads or heads


def gate_heads(model) -> int:
    """The key/value heads of every attention layer of ``model`` (one number: a gate configuration has one)."""
    counts = {key_value_heads(attention, model.config) for attention in attention_layers(decoder_of(model))}
    if len(counts) != 1:
        _refuse(type(model).__name__, f"its attention layers have different numbers of key/value heads {sorted(counts)}")
    return counts.pop()


# ----------------------------------------------------------------------------------------------------------------
# What cannot take gates
# ----------------------------------------------------------------------------------------------------------------


def _text_config(config):
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def check_config_supported(config, name: str) -> None:
    """Refuse, naming why, a config of a model that cannot take gates (what the config alone tells)."""
    config = _text_config(config)
    if getattr(config, "is_encoder_decoder", False):
        _refuse(name, "it is an encoder-decoder model (its decoder attends to an encoder's keys, which no gate sees)")
    if getattr(config, "add_cross_attention", False):
        _refuse(name, "it has cross-attention (add_cross_attention=True)")
    if getattr(config, "alibi", False) is True:
        _refuse(name, "it uses ALiBi position biases (alibi=True), which its attention adds outside the interface")
    layer_types = getattr(config, "layer_types", None) or ()
    other = sorted({str(kind) for kind in layer_types if kind not in ATTENTION_LAYER_TYPES})
    if other:
        _refuse(name, f"it has layers of the types {other} (not attention: no keys for a gate to bias)")


def check_supported(model) -> None:
    """Refuse, with one message naming why and what is supported, a model that cannot take energy gates: not a
    transformers model, an encoder-decoder, cross-attention, ALiBi, non-attention layers (state-space, linear
    attention), attention that does not call transformers' attention interface, bidirectional attention, attention
    sinks."""
    check_is_model(model)
    name = type(model).__name__
    if not isinstance(model, transformers.PreTrainedModel) or stock_class_of(type(model)) is None:
        _refuse(name, "it is not a model class of transformers (nor a subclass of one)")
    check_config_supported(model.config, name)
    attentions = attention_layers(decoder_of(model))
    if not attentions:
        _refuse(name, "none of its attention layers calls transformers' attention interface (ALL_ATTENTION_FUNCTIONS)")
    if not all(getattr(attention, "is_causal", True) for attention in attentions):
        _refuse(name, "its attention is bidirectional (an encoder: is_causal=False)")
    if any(isinstance(getattr(attention, "sinks", None), torch.Tensor) for attention in attentions):
        # GPT-OSS: learned sink logits join every softmax (the attention call's `s_aux`), a key no gate has an
        # energy for, so the gated softmax would not be the gate's over the keys
        _refuse(name, "its attention has learned attention sinks (`sinks`, passed as `s_aux`)")
    gate_heads(model)


def check_is_model(model) -> None:
    """Refuse what is not a model at all (a class, a config, a function...), and a PEFT model, saying what to do."""
    if not isinstance(model, torch.nn.Module):
        what = f"the class {model.__name__} (build the model first)" if isinstance(model, type) else _named(model)
        raise TypeError(f"energy gates go into a model (a torch.nn.Module such as LlamaForCausalLM), not {what}")
    if hasattr(model, "get_base_model"):
        raise ValueError("add energy gates to the model before wrapping it with PEFT (get_peft_model)")


def check_class_supported(model_class) -> None:
    """`check_supported`'s first checks, for a class (the gated form of a class is made before any model exists)."""
    if not isinstance(model_class, type):
        raise TypeError(f"energy gates go into a model class (such as LlamaForCausalLM), not {_named(model_class)}")
    if not issubclass(model_class, transformers.PreTrainedModel) or stock_class_of(model_class) is None:
        _refuse(model_class.__name__, "it is not a model class of transformers (nor a subclass of one)")
    config_class = getattr(model_class, "config_class", None)
    model_type = getattr(config_class, "model_type", None)
    causal = _mapping("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES")
    if model_type not in causal:
        _refuse(model_class.__name__, f"its model type {model_type!r} has no causal LM in transformers (not decoder-only)")


def _mapping(table: str) -> dict:
    from transformers.models.auto import modeling_auto

    return getattr(modeling_auto, table)


# ----------------------------------------------------------------------------------------------------------------
# Injection
# ----------------------------------------------------------------------------------------------------------------


def inject_energy_gates(model, config: EnergyGateConfig) -> None:
    """Give the attention layers ``config`` selects an ``energy_gate`` and the gated attention class."""
    check_supported(model)
    decoder = decoder_of(model)
    attentions = attention_layers(decoder)
    layers = config.layers if config.layers is not None else list(range(len(attentions)))
    if max(layers) >= len(attentions):
        raise ValueError(f"`layers` {config.layers} out of range: the model has {len(attentions)} attention layers")
    num_heads = gate_heads(model)
    if config.heads is not None and max(config.heads) >= num_heads:
        raise ValueError(f"`heads` {config.heads} out of range: the model has {num_heads} key/value heads")
    hook = TokenMaskHook(decoder, masks_as_rows=_reads_masks_as_rows(decoder))
    gated = []
    for index in layers:
        attention = attentions[index]
        reference = next(attention.parameters())
        gate = EnergyGate(
            _text_config(model.config).hidden_size,
            num_heads,
            kind=config.energy_kind,
            projections=config.projections,
            scales=config.scales,
            normalization=config.normalization,
            eps=config.eps,
            tau_init=config.tau_init,
            alpha_init=config.alpha_init,
            morlet_learnable=config.morlet_learnable,
        ).to(device=reference.device, dtype=reference.dtype)
        attention.energy_gate = gate
        attention.energy_gate_heads = None if config.heads is None else list(config.heads)
        # Decoder layers that pass no keyword arguments on to their attention (Falcon, StableLM) leave the padding
        # mask and document positions to be read from what the hook last saw (see `TokenMaskHook.stash`).
        attention.energy_gate_stash = hook.stash
        if not isinstance(getattr(attention, "layer_idx", None), int):
            attention.layer_idx = index
        attention.__class__ = gated_attention_class(type(attention))
        attention.config = AttentionConfigView(attention.__dict__.get("config", model.config))
        gated.append(attention)
    decoder._energy_gated_attentions = gated
    decoder._energy_gate_hook = decoder.register_forward_pre_hook(hook, with_kwargs=True)
    mark_row_pooling(model)


def _reads_masks_as_rows(decoder) -> bool:
    # GPT-2's decoder reads a mask below 4D as rows of its sequences (`mask.view(sequences, -1)`, for its
    # (batch, choices, length) inputs): recognised by the code that does so, not by the family's name.
    try:
        source = inspect.getsource(type(decoder).forward)
    except (OSError, TypeError):
        return False
    return "attention_mask.view(batch_size, -1)" in source


def mark_row_pooling(model) -> None:
    """Tell the decoder's hook when ``model`` is a sequence classifier (one pooled vector a row, so packed rows are
    refused); a classifier whose decoder got its gates when it was built learns it here."""
    decoder = decoder_of(model)
    hook = decoder._forward_pre_hooks.get(decoder._energy_gate_hook.id)
    if isinstance(hook, TokenMaskHook):
        hook.pools_rows = type(model).__name__.endswith("ForSequenceClassification")


@torch.no_grad()
def init_energy_gates(model) -> None:
    """Initialise every gate of ``model`` from its config: τ, α as configured, mixing logits 0, energy
    projections N(0, initializer_range). Parameters already loaded from a checkpoint are left alone."""
    values = getattr(model.config, "energy_gates", None) or {}
    std = getattr(model.config, "initializer_range", 0.02)
    for gate in [module for module in model.modules() if isinstance(module, EnergyGate)]:
        init.constant_(gate.tau, values.get("tau_init", 0.0))
        init.constant_(gate.alpha, values.get("alpha_init", 0.0))
        init.zeros_(gate.mix_logits)
        for module in gate.energy.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Conv1d)):
                init.normal_(module.weight, mean=0.0, std=std)
                init.zeros_(module.bias)
            elif isinstance(module, MorletEnergy):
                omega, sigma = module.initial_omega_sigma()
                init.copy_(module.omega, omega)
                init.copy_(module.sigma, sigma)
            elif isinstance(module, DaubechiesEnergy):  # not saved: refilled after a build on the meta device
                init.copy_(module.taps, module.initial_taps())
            module._is_hf_initialized = True
        gate._is_hf_initialized = True


# ----------------------------------------------------------------------------------------------------------------
# The model types
# ----------------------------------------------------------------------------------------------------------------


class EnergyGatedModelMixin:
    """Mixed into a stock model class: rebuilds the gates recorded in ``config.energy_gates`` at construction, so
    ``from_pretrained`` finds a parameter for every saved gate weight; saves its code with the weights."""

    def __reduce_ex__(self, protocol):
        # The gated form of a subclass (a user's model class) is made at run time (`gated_model_class`), so pickle
        # cannot find it by name: such a model is pickled as "the gated form of its stock class" (`torch.save`).
        # A class defined by name (here, or a user's subclass of a gated class) pickles as usual.
        if type(self) is not gated_model_class(self.stock_class):
            return super().__reduce_ex__(protocol)
        return _new_gated_model, (self.stock_class,), self.__getstate__()

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        if not isinstance(getattr(config, "energy_gates", None), dict):
            if not str(getattr(config, "model_type", "")).startswith(GATED_TYPE_PREFIX):
                raise ValueError(
                    f"{type(self).__name__} was given a stock {config.model_type} config, without energy gates: load "
                    "a stock checkpoint with its stock class (or an Auto class) and add gates with add_energy_gates"
                )
            raise ValueError(
                f"{type(self).__name__} needs `energy_gates` in its config (the gate configuration add_energy_gates "
                "records); this config has none"
            )
        # Heads that build their decoder with `AutoModel.from_config` get the gated decoder (registered below): its
        # gates are already in place.
        if getattr(decoder_of(self), "_energy_gated_attentions", None) is None:
            inject_energy_gates(self, EnergyGateConfig.from_dict(config.energy_gates))
        else:
            mark_row_pooling(self)

    # generate() with a StaticCache: the gates read their padding from the 2D mask (a flex BlockMask has none), and
    # each layer is allocated at its first write (its keys and values are folded, wider than the head size).
    create_masks_for_generate = staticmethod(keep_padding_mask_for_generate)

    def _validate_generation_mode(self, generation_mode, generation_config, *args, **kwargs):
        normalization = self.config.energy_gates.get("normalization")
        check_generation_mode(normalization, generation_mode, generation_config, type(self).__name__)
        return super()._validate_generation_mode(generation_mode, generation_config, *args, **kwargs)

    def initialize_weights(self):
        # The stock `_init_weights` (run per sub-model) does not know the gate parameters: initialise them first
        # and mark them done. Parameters loaded from a checkpoint are skipped by the `init` functions.
        init_energy_gates(self)
        super().initialize_weights()

    def save_pretrained(self, save_directory, *args, **kwargs):
        # The folder carries this file and what it imports, so it loads with trust_remote_code without hf_spectral.
        with saved_as_family_config(self.config):
            return save_pretrained_with_code(super().save_pretrained, self, save_directory, *args, **kwargs)


class EnergyGatedConfigMixin:
    """Mixed into a stock config class: a config saved alone also carries the code (and a complete ``auto_map``),
    so that ``AutoModelForCausalLM.from_config(config, trust_remote_code=True)`` works without hf_spectral."""

    def __reduce_ex__(self, protocol):
        # As for the models: the gated form of a config subclass is made at run time (`gated_config_class`).
        if type(self) is not gated_config_class(self.stock_config_class):
            return super().__reduce_ex__(protocol)
        return _new_gated_config, (self.stock_config_class,), self.__dict__

    def save_pretrained(self, save_directory, *args, **kwargs):
        with saved_as_family_config(self):
            return save_pretrained_with_code(super().save_pretrained, self, save_directory, *args, **kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs):
        # A retrofitted model's `name_or_path` is the stock checkpoint it came from, whose config others read through
        # the model's config class (PEFT's adapter save reads the base vocabulary size so): a stock config is read by
        # the stock class, as what it is, a config without gates, instead of a gated one holding no `energy_gates`.
        config_dict, _ = cls.get_config_dict(pretrained_model_name_or_path, **dict(kwargs))
        if config_dict.get("model_type") == cls.stock_config_class.model_type:
            return cls.stock_config_class.from_pretrained(pretrained_model_name_or_path, **kwargs)
        return super().from_pretrained(pretrained_model_name_or_path, **kwargs)


@contextmanager
def saved_as_family_config(config):
    """While saving, a gated config of a user's config subclass is its family's gated config: the class this file
    defines by name, which ``auto_map`` names and the checkpoint loads back as (as transformers loads a stock
    subclass's checkpoint as the stock class; what the subclass stores in the config is saved all the same)."""
    own = type(config)
    if isinstance(config, EnergyGatedConfigMixin):  # (any other config is refused by the code saving, by name)
        config.__class__ = gated_config_class(stock_class_of(config.stock_config_class))
    try:
        yield
    finally:
        config.__class__ = own


# Gated classes, built on first use: the stock class -> its gated form. A family's own classes (not a user's
# subclasses) are also set as globals of this module, by name, where ``auto_map`` and pickle find them.
_GATED_CONFIGS: dict[type, type] = {}
_GATED_MODELS: dict[type, type] = {}


def gated_config_class(config_class: type) -> type:
    """``EnergyGated<StockConfig>``: the gated form of a transformers config class, or of a user's subclass of one,
    so that the model keeps what the subclass adds (built and cached; a gated class is returned as it is). The gated
    form of a family's own config registers the family's gated models with the Auto classes."""
    if issubclass(config_class, EnergyGatedConfigMixin):
        return config_class
    if config_class not in _GATED_CONFIGS:
        stock = stock_class_of(config_class)
        if stock is None or not issubclass(config_class, transformers.PreTrainedConfig):
            raise TypeError(f"{config_class.__name__} is not a config class of transformers (nor a subclass of one)")
        gated = _GATED_CONFIGS[config_class] = type(
            f"{GATED_PREFIX}{config_class.__name__}",
            (EnergyGatedConfigMixin, config_class),
            {"model_type": GATED_TYPE_PREFIX + stock.model_type, "stock_config_class": config_class,
             "__module__": __name__},
        )
        if config_class is stock:
            globals()[gated.__name__] = gated
            _register_gated_family(gated)
    return _GATED_CONFIGS[config_class]


def _register_gated_family(gated_config: type) -> None:
    # Where this file is remote code, nothing else registers these: `AutoModel.from_config` inside a stock head
    # would otherwise ask for `trust_remote_code`, and pipelines would not take the causal LM.
    from transformers.models.auto import modeling_auto

    transformers.AutoConfig.register(gated_config.model_type, gated_config, exist_ok=True)
    stock_type = gated_config.stock_config_class.model_type
    _share_weight_conversions(stock_type, gated_config.model_type)
    for auto_name, table in AUTO_CLASSES.items():
        stock_name = getattr(modeling_auto, table).get(stock_type)
        stock_model = getattr(transformers, stock_name, None) if isinstance(stock_name, str) else None
        if isinstance(stock_model, type) and stock_model.config_class is gated_config.stock_config_class:
            gated_model = gated_model_class(stock_model)
            register_with_auto_class(gated_config, auto_name, gated_model)
            _share_weight_conversions(stock_model.__name__, gated_model.__name__)


def _share_weight_conversions(stock_name: str, gated_name: str) -> None:
    # transformers saves some families in their older checkpoint layout (Mixtral's experts one by one, GPT-NeoX's
    # `embed_out`) and converts on loading, by model type or class name: the gated type and classes convert alike.
    from transformers import conversion_mapping

    conversions = conversion_mapping.get_checkpoint_conversion_mapping(stock_name)
    if conversions is not None:
        conversion_mapping.register_checkpoint_conversion_mapping(gated_name, conversions, overwrite=True)


def gated_model_class(model_class: type) -> type:
    """``EnergyGated<StockModel>``: the gated form of a transformers model class, or of a user's subclass of one
    (built and cached; a gated class is returned as it is)."""
    if issubclass(model_class, EnergyGatedModelMixin):
        return model_class
    if model_class not in _GATED_MODELS:
        check_class_supported(model_class)
        stock = stock_class_of(model_class)
        config_class = gated_config_class(stock_class_of(stock.config_class))
        if model_class not in _GATED_MODELS:  # (registering the family may have built it)
            gated = _GATED_MODELS[model_class] = type(
                f"{GATED_PREFIX}{model_class.__name__}",
                (EnergyGatedModelMixin, model_class),
                {"config_class": config_class, "stock_class": model_class, "__module__": __name__},
            )
            if model_class is stock:
                globals()[gated.__name__] = gated
    return _GATED_MODELS[model_class]


def _new_gated_config(config_class: type):
    """An empty instance of the gated form of ``config_class``, for unpickling (its state is set next)."""
    gated = gated_config_class(config_class)
    return gated.__new__(gated)


def _new_gated_model(stock_class: type):
    """An empty instance of the gated form of ``stock_class``, for unpickling (its state is set next)."""
    gated = gated_model_class(stock_class)
    return gated.__new__(gated)


def __getattr__(name: str):
    # ``EnergyGated<transformers class>``, built on first access: what a saved folder's ``auto_map`` and pickle
    # name. Only that family's module of transformers is imported.
    if name.startswith(GATED_PREFIX) and not name.startswith("EnergyGatedConfig") and name != "EnergyGatedModelMixin":
        stock = getattr(transformers, name[len(GATED_PREFIX):], None)
        if isinstance(stock, type) and issubclass(stock, transformers.PreTrainedConfig):
            return gated_config_class(stock)
        if isinstance(stock, type) and issubclass(stock, transformers.PreTrainedModel):
            return gated_model_class(stock)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
