"""Energy-gated model types: a stock transformers model (GPT-2, Llama, Mistral, Qwen2) with energy gates in its
attention layers.

``add_energy_gates`` turns a stock model into one of the classes below (``GPT2LMHeadModel`` ->
``EnergyGatedGPT2LMHeadModel``, its config ``GPT2Config`` -> ``EnergyGatedGPT2Config``, model type
``energy_gated_gpt2``). Each class is the stock class with `EnergyGatedModelMixin` in front: its constructor rebuilds
the gates that ``config.energy_gates`` records, so ``from_pretrained`` finds a parameter for every saved gate weight.
The weights keep the stock names, plus ``...attn.energy_gate.*``.

This file is also the remote code of a retrofitted checkpoint: ``save_pretrained`` copies it with the files it
imports (flattened to sibling imports by `save_model_code`) next to the weights and names its classes in
``auto_map``, so that ``AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`` loads the gated model
where hf_spectral is not installed. It therefore imports only transformers, torch and files that can travel with it.
"""

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import transformers
from transformers import initialization as init
from transformers.models.gpt2 import modeling_gpt2 as gpt2
from transformers.models.llama import modeling_llama as llama
from transformers.models.mistral import modeling_mistral as mistral
from transformers.models.qwen2 import modeling_qwen2 as qwen2

from ..ops.energy_gate import DaubechiesEnergy, EnergyGate, MorletEnergy, check_generation_mode
from ..ops.positions import keep_padding_mask_for_generate
from ..ops.remote_code import save_pretrained_with_code
from .config import EnergyGateConfig
from .layer import AttentionConfigView, TokenMaskHook, gated_attention_class


@dataclass(frozen=True)
class Family:
    """A model family the retrofit knows: where its attention layers are and how many key/value heads they have."""

    model_type: str
    config_class: type
    attention_class: type
    decoder_class: type  # owns the layers and receives the 2D attention mask
    model_classes: dict  # Auto class name -> stock model class

    def gate_heads(self, config) -> int:
        # A gate acts on keys, so grouped-query models get one gate per key/value head.
        return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def _family(model_type: str, config_class: type, module, prefix: str, causal_lm: str) -> Family:
    return Family(
        model_type,
        config_class,
        getattr(module, f"{prefix}Attention"),
        getattr(module, f"{prefix}Model"),
        {
            "AutoModel": getattr(module, f"{prefix}Model"),
            "AutoModelForCausalLM": getattr(module, causal_lm),
            "AutoModelForSequenceClassification": getattr(module, f"{prefix}ForSequenceClassification"),
        },
    )


FAMILIES = (
    _family("gpt2", transformers.GPT2Config, gpt2, "GPT2", "GPT2LMHeadModel"),
    _family("llama", transformers.LlamaConfig, llama, "Llama", "LlamaForCausalLM"),
    _family("mistral", transformers.MistralConfig, mistral, "Mistral", "MistralForCausalLM"),
    _family("qwen2", transformers.Qwen2Config, qwen2, "Qwen2", "Qwen2ForCausalLM"),
)


def supported_families() -> tuple[Family, ...]:
    return FAMILIES


def _supported_names() -> str:
    return ", ".join(cls.__name__ for family in FAMILIES for cls in family.model_classes.values())


def _named(value) -> str:
    """A value in an error message: a function's or class's name, a string's or number's value, else its type."""
    shown = getattr(value, "__name__", value)
    if not isinstance(shown, (str, int, float)):
        return f"a {type(value).__name__} object"
    return f"{shown!r} ({type(value).__name__})"


def family_of_class(model_class: type) -> Family:
    if not isinstance(model_class, type):
        raise TypeError(f"energy gates go into a model class (such as GPT2LMHeadModel), not {_named(model_class)}")
    for family in FAMILIES:
        if issubclass(model_class, tuple(family.model_classes.values())):
            return family
    raise ValueError(
        f"energy gates cannot be added to {model_class.__name__}; supported: {_supported_names()} and their subclasses"
    )


def family_of_config_class(config_class: type) -> Family:
    return next(family for family in FAMILIES if issubclass(config_class, family.config_class))


def family_of(model) -> Family:
    if not isinstance(model, torch.nn.Module):
        what = f"the class {model.__name__} (build the model first)" if isinstance(model, type) else _named(model)
        raise TypeError(f"energy gates go into a model (a torch.nn.Module such as GPT2LMHeadModel), not {what}")
    for family in FAMILIES:
        if isinstance(model, tuple(family.model_classes.values())):
            return family
    if hasattr(model, "get_base_model"):
        raise ValueError("add energy gates to the model before wrapping it with PEFT (get_peft_model)")
    raise ValueError(
        f"energy gates cannot be added to {type(model).__name__}; supported: {_supported_names()} and their subclasses"
    )


# ----------------------------------------------------------------------------------------------------------------
# Injection
# ----------------------------------------------------------------------------------------------------------------


def decoder_of(model, family: Family):
    return next(module for module in model.modules() if isinstance(module, family.decoder_class))


def attention_layers(decoder, family: Family) -> list:
    layers = [
        module
        for module in decoder.modules()
        if isinstance(module, family.attention_class) and not getattr(module, "is_cross_attention", False)
    ]
    return sorted(layers, key=lambda module: module.layer_idx)


def inject_energy_gates(model, family: Family, config: EnergyGateConfig) -> None:
    """Give the attention layers ``config`` selects an ``energy_gate`` and the gated attention class."""
    if getattr(model.config, "add_cross_attention", False):
        raise ValueError("energy gates are not supported on models with cross-attention (add_cross_attention=True)")
    decoder = decoder_of(model, family)
    attentions = attention_layers(decoder, family)
    layers = config.layers if config.layers is not None else list(range(len(attentions)))
    if max(layers) >= len(attentions):
        raise ValueError(f"`layers` {config.layers} out of range: the model has {len(attentions)} attention layers")
    num_heads = family.gate_heads(model.config)
    if config.heads is not None and max(config.heads) >= num_heads:
        raise ValueError(f"`heads` {config.heads} out of range: the model has {num_heads} key/value heads")

    gated = []
    for index in layers:
        attention = attentions[index]
        reference = next(attention.parameters())
        gate = EnergyGate(
            model.config.hidden_size,
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
        attention.__class__ = gated_attention_class(type(attention))
        attention.config = AttentionConfigView(model.config)
        gated.append(attention)
    decoder._energy_gated_attentions = gated
    decoder._energy_gate_hook = decoder.register_forward_pre_hook(
        TokenMaskHook(decoder, masks_as_rows=family.model_type == "gpt2"), with_kwargs=True
    )
    mark_row_pooling(model, family)


def mark_row_pooling(model, family: Family) -> None:
    """Tell the decoder's hook when ``model`` is a sequence classifier (one pooled vector a row, so packed rows are
    refused); a classifier whose decoder got its gates when it was built learns it here."""
    decoder = decoder_of(model, family)
    hook = decoder._forward_pre_hooks.get(decoder._energy_gate_hook.id)
    if isinstance(hook, TokenMaskHook):
        hook.pools_rows = isinstance(model, family.model_classes["AutoModelForSequenceClassification"])


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
            if getattr(config, "model_type", None) == family_of_class(type(self)).model_type:
                raise ValueError(
                    f"{type(self).__name__} was given a stock {config.model_type} config, without energy gates: load "
                    "a stock checkpoint with its stock class (or an Auto class) and add gates with add_energy_gates"
                )
            raise ValueError(
                f"{type(self).__name__} needs `energy_gates` in its config (the gate configuration add_energy_gates "
                "records); this config has none"
            )
        family = family_of(self)
        # Llama's, Mistral's and Qwen2's classification heads build their decoder with `AutoModel.from_config`,
        # which gives the gated decoder (registered below): its gates are already in place.
        if getattr(decoder_of(self, family), "_energy_gated_attentions", None) is None:
            inject_energy_gates(self, family, EnergyGateConfig.from_dict(config.energy_gates))
        else:
            mark_row_pooling(self, family)

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
        if type(self) is not gated_form_of_config_class(self.stock_config_class):
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
        config.__class__ = gated_config_class(family_of_config_class(config.stock_config_class))
    try:
        yield
    finally:
        config.__class__ = own


def _gated_config(family: Family, config_class: type) -> type:
    return type(
        f"EnergyGated{config_class.__name__}",
        (EnergyGatedConfigMixin, config_class),
        {"model_type": f"energy_gated_{family.model_type}", "stock_config_class": config_class,
         "__module__": __name__},
    )


def _gated_model(stock_class: type, config_class: type) -> type:
    return type(
        f"EnergyGated{stock_class.__name__}",
        (EnergyGatedModelMixin, stock_class),
        {"config_class": config_class, "stock_class": stock_class, "__module__": __name__},
    )


# One config class and three model classes per family, defined here by name ("EnergyGated" + the stock name), so
# that ``auto_map`` entries such as "modeling_energy_gated.EnergyGatedGPT2LMHeadModel" find them: EnergyGatedGPT2Config,
# EnergyGatedGPT2Model, EnergyGatedGPT2LMHeadModel, EnergyGatedGPT2ForSequenceClassification, and likewise
# EnergyGatedLlamaConfig, EnergyGatedLlamaModel, EnergyGatedLlamaForCausalLM, ... for Llama, Mistral and Qwen2.
_GATED_CONFIGS: dict[type, type] = {}
_GATED_MODELS: dict[type, type] = {}
for _family_entry in FAMILIES:
    _stock_config = _family_entry.config_class
    _config_class = _GATED_CONFIGS[_stock_config] = _gated_config(_family_entry, _stock_config)
    globals()[_config_class.__name__] = _config_class
    for _stock_class in _family_entry.model_classes.values():
        _model_class = _GATED_MODELS[_stock_class] = _gated_model(_stock_class, _config_class)
        globals()[_model_class.__name__] = _model_class
    # What `AutoModel.from_config` inside a stock head builds for a gated config, also where this file is remote
    # code and nothing else registered it (it would otherwise ask for `trust_remote_code`).
    transformers.AutoModel.register(
        _config_class, _GATED_MODELS[_family_entry.model_classes["AutoModel"]], exist_ok=True
    )
del _family_entry, _stock_config, _config_class, _stock_class, _model_class


def gated_config_class(family: Family, config_class: type | None = None) -> type:
    """``EnergyGated<StockConfig>`` of ``family``; with ``config_class``, a subclass of the stock config (a user's
    config class), its gated form, built (and cached) so that the model keeps what its subclass adds. A gated
    config class is returned as it is."""
    config_class = config_class or family.config_class
    if issubclass(config_class, EnergyGatedConfigMixin):
        return config_class
    if config_class not in _GATED_CONFIGS:
        _GATED_CONFIGS[config_class] = _gated_config(family, config_class)
    return _GATED_CONFIGS[config_class]


def gated_form_of_config_class(config_class: type) -> type:
    """`gated_config_class` of ``config_class`` (a stock config class or a subclass of one), its family found."""
    return gated_config_class(family_of_config_class(config_class), config_class)


def _new_gated_config(config_class: type):
    """An empty instance of the gated form of ``config_class``, for unpickling (its state is set next)."""
    gated = gated_form_of_config_class(config_class)
    return gated.__new__(gated)


def _new_gated_model(stock_class: type):
    """An empty instance of the gated form of ``stock_class``, for unpickling (its state is set next)."""
    gated = gated_model_class(stock_class)
    return gated.__new__(gated)


def gated_model_class(stock_class: type) -> type:
    """``EnergyGated<StockModel>``: the class defined above for a stock class, built (and cached) for a subclass."""
    if stock_class not in _GATED_MODELS:
        family = family_of_class(stock_class)
        _GATED_MODELS[stock_class] = _gated_model(stock_class, gated_config_class(family))
    return _GATED_MODELS[stock_class]
