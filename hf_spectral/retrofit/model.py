"""Model-level retrofit: find the attention layers of a supported model, inject energy gates, save and load them.

A retrofitted model is a model type of its own (``energy_gated_gpt2``, ``energy_gated_llama``, ...): the stock
config and model classes with the gate configuration on top (``modeling_energy_gated.py``), registered with the
Auto classes. Saved with ``save_pretrained`` it therefore loads back, gates included, through
``AutoModelForCausalLM.from_pretrained`` wherever hf_spectral is imported, and with ``trust_remote_code=True`` where
it is not (the folder carries the code); its weights keep the stock names, plus ``...attn.energy_gate.*``.
"""

import copy
import json
import os
import uuid

import transformers
from safetensors import safe_open
from safetensors.torch import save_file

from ..file_permissions import apply_umask
from .config import EnergyGateConfig, gate_structure
from .layer import EnergyGatedAttentionMixin
from .modeling_energy_gated import (  # noqa: F401  (check_supported, init_energy_gates: used by the CLI and tests)
    GATED_TYPE_PREFIX,
    EnergyGatedModelMixin,
    UnsupportedModelError,
    attention_layers,
    check_config_supported,
    check_is_model,
    check_supported,
    decoder_of,
    gate_heads,
    gated_config_class,
    gated_model_class,
    init_energy_gates,
    stock_class_of,
)
from .modeling_energy_gated import inject_energy_gates as _inject

GATES_FILE_METADATA_KEY = "hf_spectral_energy_gates"
GATES_FILE_FORMAT_VERSION = 1  # of the description in the metadata; a reader refuses versions it does not know


# ----------------------------------------------------------------------------------------------------------------
# Energy-gated model types (defined in modeling_energy_gated.py, the remote code of a retrofitted checkpoint)
# ----------------------------------------------------------------------------------------------------------------


class _LazyGatedConfig:
    """Stands in for ``EnergyGated<Config>`` of one causal-LM model type in ``AutoConfig``'s table until it is used:
    registering the real classes for every model type would import every family's modeling code on
    ``import hf_spectral``. Reading a config (``from_dict``, ``from_pretrained``) or building one builds the real
    class, which then takes this one's place in the table (`gated_config_class` registers it)."""

    model_type: str  # energy_gated_<stock type>
    stock_type: str

    @classmethod
    def real(cls) -> type:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        return gated_config_class(CONFIG_MAPPING[cls.stock_type])

    def __new__(cls, *args, **kwargs):
        return cls.real()(*args, **kwargs)

    @classmethod
    def from_dict(cls, *args, **kwargs):
        return cls.real().from_dict(*args, **kwargs)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        return cls.real().from_pretrained(*args, **kwargs)

    @classmethod
    def get_config_dict(cls, *args, **kwargs):
        return cls.real().get_config_dict(*args, **kwargs)


def register_energy_gated_models() -> None:
    """Register an ``energy_gated_<type>`` config with ``AutoConfig`` for every causal-LM model type of transformers
    (run on ``import hf_spectral``; cheap: a stand-in each, no family's code imported). The gated model classes are
    registered with ``AutoModel*`` when a family's gated config is first built."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    for stock_type in list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        if stock_type.startswith(GATED_TYPE_PREFIX) or stock_type not in CONFIG_MAPPING:
            continue
        gated_type = GATED_TYPE_PREFIX + stock_type
        if gated_type in CONFIG_MAPPING._extra_content:  # the real class (or a stand-in) is there already
            continue
        stand_in = type(f"LazyEnergyGatedConfig_{stock_type}", (_LazyGatedConfig,),
                        {"model_type": gated_type, "stock_type": stock_type, "__module__": __name__})
        transformers.AutoConfig.register(gated_type, stand_in, exist_ok=True)


def _is_gated_attention(module) -> bool:
    # Also by name: a checkpoint loaded with trust_remote_code before `import hf_spectral` runs its folder's copy of
    # modeling_energy_gated.py, whose mixin is another class object with the same code.
    return any(cls.__name__ == EnergyGatedAttentionMixin.__name__ for cls in type(module).__mro__)


def gated_attention_modules(model) -> list:
    return [module for module in model.modules() if _is_gated_attention(module)]


def has_energy_gates(model) -> bool:
    return bool(gated_attention_modules(model))


def add_energy_gates(model, config: EnergyGateConfig | None = None):
    """Add energy gates to ``model`` in place and return it.

    With the default ``alpha_init=0`` every gate starts as the identity, so the logits do not change (exactly;
    tested for padded batches and cached generation). The model becomes an ``energy_gated_<family>`` model:
    ``save_pretrained`` records the gate configuration in ``config.json`` and the gates load back with
    ``AutoModelForCausalLM.from_pretrained``. The model gets a copy of its config to record the gates in, so other
    models built from the same config object stay as they are. If adding fails (e.g. PyWavelets missing for db2/db4
    energies), the model is left as it was.
    """
    config = config or EnergyGateConfig()
    if not isinstance(config, EnergyGateConfig):
        raise TypeError(f"config must be an EnergyGateConfig, got {type(config).__name__}")
    check_is_model(model)
    if has_energy_gates(model):
        raise ValueError("this model already has energy gates; call remove_energy_gates(model) first")
    check_supported(model)
    decoder = decoder_of(model)
    attentions = attention_layers(decoder)
    before = {
        "attentions": [(attention, type(attention), attention.__dict__.get("config")) for attention in attentions],
        "config": model.config,
        "model_class": type(model),
    }
    try:
        before["repointed"] = _give_own_config(model)
        _inject(model, config)
        model.config.energy_gates = config.to_dict()
        model.config.__class__ = gated_config_class(type(model.config))
        init_energy_gates(model)
        model.__class__ = gated_model_class(type(model))
    except BaseException:
        _restore(model, decoder, before)
        raise
    return model


def _give_own_config(model) -> list:
    """Point ``model`` and every module of it that shares its config at a copy, and return those modules. The
    retrofit changes the config it gates or ungates; another model built from the same object
    (``GPT2LMHeadModel(config)`` twice, ``AutoModelForCausalLM.from_config(model.config)``) must not change with it."""
    shared = model.config
    own = copy.deepcopy(shared)
    repointed = [module for module in model.modules() if module.__dict__.get("config") is shared]
    for module in repointed:
        module.config = own
    return repointed


def _restore(model, decoder, before: dict) -> None:
    """Undo a partly done `add_energy_gates`: every attention, the decoder, the config and the model as they were."""
    for module in before.get("repointed", ()):
        module.config = before["config"]
    for attention, attention_class, attention_config in before["attentions"]:
        for name in ("energy_gate", "energy_gate_heads", "energy_gate_stash"):
            if hasattr(attention, name):
                delattr(attention, name)
        attention.__class__ = attention_class
        if attention_config is not None:
            attention.config = attention_config
    hook = decoder.__dict__.pop("_energy_gate_hook", None)
    if hook is not None:
        hook.remove()
    decoder.__dict__.pop("_energy_gated_attentions", None)
    model.__class__ = before["model_class"]


def remove_energy_gates(model):
    """Remove every energy gate: ``model`` becomes the stock model again (with whatever its other weights learned)."""
    gated = gated_attention_modules(model)
    if not gated:
        raise ValueError("this model has no energy gates")
    _give_own_config(model)  # a model made with `from_config(gated.config)` shares the gated model's
    for attention in gated:
        del attention.energy_gate
        del attention.energy_gate_heads
        attention.__dict__.pop("energy_gate_stash", None)
        attention.config = model.config  # (its view showed the shared config)
        attention.__class__ = type(attention).stock_class
    decoder = decoder_of(model)
    decoder._energy_gate_hook.remove()
    del decoder._energy_gated_attentions, decoder._energy_gate_hook
    del model.config.energy_gates
    model.config.__class__ = type(model.config).stock_config_class  # the stock class, or the user's subclass
    model.config.__dict__.pop("model_type", None)  # a gated checkpoint's config.json set the gated type here
    _forget_gated_remote_code(model.config)
    # The model's own class, and a decoder that a classification head built through AutoModel (its gated form
    # where the config was gated: Llama's, Mistral's and Qwen2's heads) become stock classes again.
    for module in model.modules():
        if any(cls.__name__ == EnergyGatedModelMixin.__name__ for cls in type(module).__mro__):
            module.__class__ = type(module).stock_class
    return model


def _forget_gated_remote_code(config) -> None:
    # A config loaded from a retrofitted checkpoint names the gated classes in `auto_map`; the stock model's folder
    # carries no such code, so those entries would send `trust_remote_code=True` after a missing file.
    auto_map = getattr(config, "auto_map", None)
    if isinstance(auto_map, dict):
        kept = {name: ref for name, ref in auto_map.items() if not str(ref).startswith("modeling_energy_gated.")}
        if kept:
            config.auto_map = kept
        else:
            del config.auto_map


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


def _architecture(model) -> str:
    return type(model).stock_class.__name__ if hasattr(type(model), "stock_class") else type(model).__name__


def _gates_description(model) -> dict:
    return {
        "format_version": GATES_FILE_FORMAT_VERSION,
        **_gates_shape(model),
        "architecture": _architecture(model),
        "config": dict(model.config.energy_gates),
    }


def _gates_shape(model) -> dict:
    """What a gates file must match in a model: its family, width, key/value heads and attention layers."""
    stock = stock_class_of(type(model.config))
    return {
        "model_type": stock.model_type if stock is not None else model.config.model_type,
        "hidden_size": model.config.get_text_config().hidden_size,
        "gate_heads": gate_heads(model),
        "num_attention_layers": len(attention_layers(decoder_of(model))),
    }


_PEFT_GATE_COPIES = ".modules_to_save."  # PEFT's name for the trained copies of a module in ``modules_to_save``


def _gate_tensors(model) -> dict:
    """The gate tensors of ``model`` under the names a model without PEFT gives them. Gates that PEFT trains through
    ``modules_to_save`` are held twice (``original_module`` and one copy per adapter): the copy of the active adapter
    is the model's gate."""
    tensors = {}
    for name, tensor in model.state_dict().items():
        if not _is_gate_parameter(name) or ".energy_gate.original_module." in f".{name}":
            continue
        if _PEFT_GATE_COPIES in name:
            wrapper, _, rest = name.partition(_PEFT_GATE_COPIES)
            adapter, _, field = rest.partition(".")
            active = model.get_submodule(wrapper).active_adapter
            active = [active] if isinstance(active, str) else list(active)
            if len(active) != 1:
                raise ValueError(f"{wrapper} has {len(active)} active adapters; activate the one whose gates to save")
            if adapter != active[0]:
                continue
            name = f"{wrapper}.{field}"
        tensors[name] = tensor.detach().cpu().contiguous()
    return tensors


def save_energy_gates(model, path: str) -> str:
    """Write only the gate parameters (a few kilobytes) to the safetensors file ``path``; return ``path``. For a PEFT
    model (or the model inside one) whose gates train through ``modules_to_save``, the active adapter's gates."""
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    if not has_energy_gates(model):
        raise ValueError("this model has no energy gates to save")
    tensors = _gate_tensors(model)
    metadata = {"format": "pt", GATES_FILE_METADATA_KEY: json.dumps(_gates_description(model))}
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    # Write next to the target, then rename: an interrupted save never leaves a truncated file behind.
    temporary = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
    try:
        save_file(tensors, temporary, metadata=metadata)
        apply_umask(temporary)  # safetensors writes 0600; a gates file is as readable as any other file
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)
    return path


def _read_gates_file(path: str) -> tuple[dict, dict]:
    """(tensors, description) of a file written by `save_energy_gates`; ValueError for anything else."""
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
    try:
        saved = json.loads(metadata[GATES_FILE_METADATA_KEY])
        if not isinstance(saved, dict) or not isinstance(saved.get("config"), dict):
            raise ValueError("no gate configuration")
    except ValueError as error:
        raise ValueError(f"{path} has a corrupt '{GATES_FILE_METADATA_KEY}' description: {error}") from error
    if saved.get("format_version") != GATES_FILE_FORMAT_VERSION:
        raise ValueError(
            f"{path} is an energy-gate file of format version {saved.get('format_version')!r}; this version of "
            f"hf_spectral reads version {GATES_FILE_FORMAT_VERSION}"
        )
    for name, tensor in tensors.items():
        if not _is_gate_parameter(name):
            raise ValueError(f"{path} holds {name}, which is not an energy-gate parameter")
        if tensor.is_floating_point() and not bool(tensor.isfinite().all()):
            raise ValueError(f"{path}: {name} holds non-finite values")
    return tensors, saved


def _check_gate_tensors(model, tensors: dict, path: str, architecture: str | None) -> None:
    state = model.state_dict()
    expected_keys = {name for name in state if _is_gate_parameter(name)}
    if set(tensors) != expected_keys:
        other = f" (it was saved from a {architecture}, this model is a {_architecture(model)})"
        raise ValueError(
            f"{path} does not match this model's gates{other if architecture != _architecture(model) else ''}: "
            f"missing {sorted(expected_keys - set(tensors))[:5]}, unexpected {sorted(set(tensors) - expected_keys)[:5]}"
        )
    for name, tensor in tensors.items():
        if tensor.shape != state[name].shape:
            raise ValueError(f"{path}: {name} has shape {tuple(tensor.shape)}, the model expects {tuple(state[name].shape)}")


def load_energy_gates(model, path: str):
    """Load a file written by `save_energy_gates` into ``model`` (adding the gates first if it has none).

    Refuses, with a message naming the mismatch, a file made for another model family, width, head count or
    number of layers, with gates configured differently from the ones ``model`` already has, or with tensors of
    other names, shapes or non-finite values. When it refuses, ``model`` is exactly as it was: same class, same
    modules, same parameters (gates added for the check are removed again).
    """
    tensors, saved = _read_gates_file(path)
    check_is_model(model)
    if not has_energy_gates(model):
        check_supported(model)
    expected = _gates_shape(model)
    for key, value in expected.items():
        if saved.get(key) != value:
            raise ValueError(f"{path} was made for a model with {key}={saved.get(key)!r}, this model has {value!r}")
    gate_config = EnergyGateConfig.from_dict(saved["config"])
    added = not has_energy_gates(model)
    if not added and gate_structure(model.config.energy_gates) != gate_structure(gate_config.to_dict()):
        raise ValueError(f"{path} holds gates configured as {gate_config.to_dict()}, the model's are {model.config.energy_gates}")
    if added:
        add_energy_gates(model, gate_config)
    previous = {name: tensor.detach().clone() for name, tensor in model.state_dict().items() if _is_gate_parameter(name)}
    try:
        _check_gate_tensors(model, tensors, path, saved.get("architecture"))
        model.load_state_dict(tensors, strict=False)
    except BaseException:
        if added:
            remove_energy_gates(model)
        else:
            model.load_state_dict(previous, strict=False)
        raise
    return model
