"""Model-level retrofit: find the attention layers of a supported model, inject energy gates, save and load them.

A retrofitted model is a model type of its own (``energy_gated_gpt2``, ``energy_gated_llama``, ...): the stock
config and model classes with the gate configuration on top, registered with the Auto classes. Saved with
``save_pretrained`` it therefore loads back, gates included, through ``AutoModelForCausalLM.from_pretrained``
wherever hf_spectral is imported; its weights keep the stock names, plus ``...attn.energy_gate.*``.
"""

import json
import os
import tempfile
from dataclasses import dataclass

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import initialization as init

from ..models.ega_gpt.energy_gate import EnergyGate, MorletEnergy
from .config import EnergyGateConfig
from .layer import AttentionConfigView, EnergyGatedAttentionMixin, gated_attention_class, set_token_mask_hook

GATES_FILE_METADATA_KEY = "hf_spectral_energy_gates"


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


def _families() -> list[Family]:
    from transformers.models.gpt2 import modeling_gpt2 as gpt2
    from transformers.models.llama import modeling_llama as llama
    from transformers.models.mistral import modeling_mistral as mistral
    from transformers.models.qwen2 import modeling_qwen2 as qwen2

    families = [
        Family("gpt2", transformers.GPT2Config, gpt2.GPT2Attention, gpt2.GPT2Model, {
            "AutoModel": gpt2.GPT2Model,
            "AutoModelForCausalLM": gpt2.GPT2LMHeadModel,
            "AutoModelForSequenceClassification": gpt2.GPT2ForSequenceClassification,
        }),
    ]
    for name, module, prefix in (("llama", llama, "Llama"), ("mistral", mistral, "Mistral"), ("qwen2", qwen2, "Qwen2")):
        families.append(Family(name, getattr(transformers, f"{prefix}Config"), getattr(module, f"{prefix}Attention"),
                               getattr(module, f"{prefix}Model"), {
            "AutoModel": getattr(module, f"{prefix}Model"),
            "AutoModelForCausalLM": getattr(module, f"{prefix}ForCausalLM"),
            "AutoModelForSequenceClassification": getattr(module, f"{prefix}ForSequenceClassification"),
        }))
    return families


_FAMILIES: list[Family] | None = None


def supported_families() -> list[Family]:
    global _FAMILIES
    if _FAMILIES is None:
        _FAMILIES = _families()
    return _FAMILIES


def _supported_names() -> str:
    return ", ".join(cls.__name__ for family in supported_families() for cls in family.model_classes.values())


def family_of(model) -> Family:
    for family in supported_families():
        if isinstance(model, tuple(family.model_classes.values())):
            return family
    if hasattr(model, "get_base_model"):
        raise ValueError("add energy gates to the model before wrapping it with PEFT (get_peft_model)")
    raise ValueError(
        f"energy gates cannot be added to {type(model).__name__}; supported: {_supported_names()} "
        "(and models sharing the Llama attention: grouped-query attention is supported)"
    )


# ----------------------------------------------------------------------------------------------------------------
# Energy-gated model types
# ----------------------------------------------------------------------------------------------------------------


class EnergyGatedModelMixin:
    """Mixed into a stock model class: rebuilds the gates recorded in ``config.energy_gates`` at construction, so
    ``from_pretrained`` finds a parameter for every saved gate weight."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        _inject(self, family_of(self), EnergyGateConfig.from_dict(config.energy_gates))

    def initialize_weights(self):
        # The stock `_init_weights` (run per sub-model) does not know the gate parameters: initialise them first
        # and mark them done. Parameters loaded from a checkpoint are skipped by the `init` functions.
        init_energy_gates(self)
        super().initialize_weights()


_GATED_CONFIGS: dict[type, type] = {}
_GATED_MODELS: dict[type, type] = {}


def gated_config_class(family: Family) -> type:
    if family.config_class not in _GATED_CONFIGS:
        _GATED_CONFIGS[family.config_class] = type(
            f"EnergyGated{family.config_class.__name__}",
            (family.config_class,),
            {"model_type": f"energy_gated_{family.model_type}", "__module__": __name__},
        )
    return _GATED_CONFIGS[family.config_class]


def gated_model_class(stock_class: type) -> type:
    if stock_class not in _GATED_MODELS:
        family = family_of_class(stock_class)
        _GATED_MODELS[stock_class] = type(
            f"EnergyGated{stock_class.__name__}",
            (EnergyGatedModelMixin, stock_class),
            {"config_class": gated_config_class(family), "stock_class": stock_class, "__module__": __name__},
        )
    return _GATED_MODELS[stock_class]


def family_of_class(model_class: type) -> Family:
    for family in supported_families():
        if issubclass(model_class, tuple(family.model_classes.values())):
            return family
    raise ValueError(f"energy gates cannot be added to {model_class.__name__}; supported: {_supported_names()}")


def register_energy_gated_models() -> None:
    """Register ``energy_gated_<family>`` configs and models with the Auto classes (run on ``import hf_spectral``)."""
    for family in supported_families():
        config_class = gated_config_class(family)
        transformers.AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        for auto_name, stock_class in family.model_classes.items():
            getattr(transformers, auto_name).register(config_class, gated_model_class(stock_class), exist_ok=True)


# ----------------------------------------------------------------------------------------------------------------
# Injection
# ----------------------------------------------------------------------------------------------------------------


def _decoder_of(model, family: Family):
    return next(module for module in model.modules() if isinstance(module, family.decoder_class))


def _attention_layers(decoder, family: Family) -> list:
    layers = [
        module
        for module in decoder.modules()
        if isinstance(module, family.attention_class) and not getattr(module, "is_cross_attention", False)
    ]
    return sorted(layers, key=lambda module: module.layer_idx)


def gated_attention_modules(model) -> list:
    return [module for module in model.modules() if isinstance(module, EnergyGatedAttentionMixin)]


def has_energy_gates(model) -> bool:
    return bool(gated_attention_modules(model))


def _inject(model, family: Family, config: EnergyGateConfig) -> None:
    if getattr(model.config, "add_cross_attention", False):
        raise ValueError("energy gates are not supported on models with cross-attention (add_cross_attention=True)")
    decoder = _decoder_of(model, family)
    attentions = _attention_layers(decoder, family)
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
        attention.energy_gate_token_mask = None
        attention.__class__ = gated_attention_class(type(attention))
        attention.config = AttentionConfigView(model.config)
        gated.append(attention)
    decoder._energy_gated_attentions = gated
    decoder._energy_gate_hook = decoder.register_forward_pre_hook(set_token_mask_hook(), with_kwargs=True)


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
            elif isinstance(module, MorletEnergy) and isinstance(module.omega, torch.nn.Parameter):
                omega = torch.tensor([torch.pi / length for length in module.lengths]).repeat(module.num_heads, 1)
                init.copy_(module.omega, omega)
                init.copy_(module.sigma, 5.0 / omega)
            module._is_hf_initialized = True
        gate._is_hf_initialized = True


def add_energy_gates(model, config: EnergyGateConfig | None = None):
    """Add energy gates to ``model`` in place and return it.

    With the default ``alpha_init=0`` every gate starts as the identity, so the logits do not change (exactly;
    tested for padded batches and cached generation). The model becomes an ``energy_gated_<family>`` model:
    ``save_pretrained`` records the gate configuration in ``config.json`` and the gates load back with
    ``AutoModelForCausalLM.from_pretrained``.
    """
    config = config or EnergyGateConfig()
    if not isinstance(config, EnergyGateConfig):
        raise TypeError(f"config must be an EnergyGateConfig, got {type(config).__name__}")
    family = family_of(model)
    if has_energy_gates(model):
        raise ValueError("this model already has energy gates; call remove_energy_gates(model) first")
    _inject(model, family, config)
    model.config.energy_gates = config.to_dict()
    model.config.__class__ = gated_config_class(family)
    init_energy_gates(model)
    model.__class__ = gated_model_class(type(model))
    return model


def remove_energy_gates(model):
    """Remove every energy gate: ``model`` becomes the stock model again (with whatever its other weights learned)."""
    gated = gated_attention_modules(model)
    if not gated:
        raise ValueError("this model has no energy gates")
    family = family_of(model)
    for attention in gated:
        del attention.energy_gate
        del attention.energy_gate_heads, attention.energy_gate_token_mask
        attention.config = attention.config.config
        attention.__class__ = type(attention).stock_class
    decoder = _decoder_of(model, family)
    decoder._energy_gate_hook.remove()
    del decoder._energy_gated_attentions, decoder._energy_gate_hook
    del model.config.energy_gates
    model.config.__class__ = family.config_class
    if hasattr(type(model), "stock_class"):
        model.__class__ = type(model).stock_class
    return model


# ----------------------------------------------------------------------------------------------------------------
# Training and persistence
# ----------------------------------------------------------------------------------------------------------------


def _is_gate_parameter(name: str) -> bool:
    return ".energy_gate." in f".{name}"


def mark_only_gates_trainable(model) -> int:
    """Freeze everything except the energy gates; return the number of trainable parameters."""
    if not has_energy_gates(model):
        raise ValueError("this model has no energy gates; call add_energy_gates first")
    trainable = 0
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(_is_gate_parameter(name))
        trainable += parameter.numel() if parameter.requires_grad else 0
    return trainable


def _gates_description(model) -> dict:
    family = family_of(model)
    return {
        "format_version": 1,
        "model_type": family.model_type,
        "architecture": type(model).stock_class.__name__ if hasattr(type(model), "stock_class") else type(model).__name__,
        "hidden_size": model.config.hidden_size,
        "gate_heads": family.gate_heads(model.config),
        "num_attention_layers": len(_attention_layers(_decoder_of(model, family), family)),
        "config": dict(model.config.energy_gates),
    }


def save_energy_gates(model, path: str) -> str:
    """Write only the gate parameters (a few kilobytes) to the safetensors file ``path``; return ``path``."""
    if hasattr(model, "get_base_model"):
        raise ValueError("for a PEFT model, save the adapter (gates are saved in it through modules_to_save)")
    if not has_energy_gates(model):
        raise ValueError("this model has no energy gates to save")
    tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in model.state_dict().items()
               if _is_gate_parameter(name)}
    metadata = {"format": "pt", GATES_FILE_METADATA_KEY: json.dumps(_gates_description(model))}
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    # Write next to the target, then rename: an interrupted save never leaves a truncated file behind.
    handle, temporary = tempfile.mkstemp(dir=directory, suffix=".tmp")
    os.close(handle)
    try:
        save_file(tensors, temporary, metadata=metadata)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
    return path


def load_energy_gates(model, path: str):
    """Load a file written by `save_energy_gates` into ``model`` (adding the gates first if it has none).

    Refuses, with a message naming the mismatch, a file made for another model family, width, head count or
    number of layers, or with gates configured differently from the ones ``model`` already has.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"energy-gate file not found: {path}")
    try:
        with safe_open(path, framework="pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    except Exception as error:  # safetensors raises its own error types for corrupt files
        raise ValueError(f"{path} is not a readable safetensors file: {error}") from error
    if GATES_FILE_METADATA_KEY not in metadata:
        raise ValueError(f"{path} is not an energy-gate file (no '{GATES_FILE_METADATA_KEY}' metadata)")
    saved = json.loads(metadata[GATES_FILE_METADATA_KEY])
    family = family_of(model)
    expected = {
        "model_type": family.model_type,
        "hidden_size": model.config.hidden_size,
        "gate_heads": family.gate_heads(model.config),
        "num_attention_layers": len(_attention_layers(_decoder_of(model, family), family)),
    }
    for key, value in expected.items():
        if saved.get(key) != value:
            raise ValueError(f"{path} was made for a model with {key}={saved.get(key)!r}, this model has {value!r}")
    gate_config = EnergyGateConfig.from_dict(saved["config"])
    if not has_energy_gates(model):
        add_energy_gates(model, gate_config)
    elif dict(model.config.energy_gates) != gate_config.to_dict():
        raise ValueError(f"{path} holds gates configured as {gate_config.to_dict()}, the model's are {model.config.energy_gates}")
    state = model.state_dict()
    expected_keys = {name for name in state if _is_gate_parameter(name)}
    if set(tensors) != expected_keys:
        raise ValueError(
            f"{path} does not match this model's gates: missing {sorted(expected_keys - set(tensors))[:5]}, "
            f"unexpected {sorted(set(tensors) - expected_keys)[:5]}"
        )
    for name, tensor in tensors.items():
        if tensor.shape != state[name].shape:
            raise ValueError(f"{path}: {name} has shape {tuple(tensor.shape)}, the model expects {tuple(state[name].shape)}")
    model.load_state_dict(tensors, strict=False)
    return model
