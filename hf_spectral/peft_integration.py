"""PEFT integration: default LoRA targets for the hf_spectral models, and adapters that cannot lose energy gates.

Both run on ``import hf_spectral`` (``register_peft_integration``) when PEFT is installed.

**Default target modules.** PEFT finds the modules a ``LoraConfig`` without ``target_modules`` adapts in tables
keyed by ``config.model_type`` (``peft.utils.constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`` and its
copies for the other methods; each tuner class holds one as ``target_module_mapping``). hf_spectral adds:

* ``ega_gpt``: GPT-2's entries, since EGA-GPT names its modules as GPT-2 does (``attn.c_attn`` = the fused
  query/key/value projection, ``attn.c_proj``, ``mlp.c_fc``, ``mlp.c_proj``, ``ln_1``, ``ln_2``, ``ln_f``), so that
  ``get_peft_model(EGAForCausalLM(config), LoraConfig(task_type="CAUSAL_LM"))`` adapts ``c_attn`` as for GPT-2;
* ``chiar_former`` (LoRA and the methods that share its table): ``q_proj`` and ``kv_proj`` of the attention operator
  and the value projection ``v_proj`` of the RBF operator (DCT mixing has no weights);
* ``energy_gated_<family>`` (retrofitted GPT-2 / Llama / Mistral / Qwen2): the stock family's entries.

**Adapters of gated models.** An adapter trained on a model with energy gates (``add_energy_gates``; the gates train
next to LoRA through ``modules_to_save=["energy_gate"]`` and are stored in the adapter) needs those gates in the model
it is loaded into: PEFT itself would drop the trained gate weights without a word when they are missing. So:

* ``PeftModel.save_pretrained`` of a gated model also writes the gate configuration, ``energy_gate_config.json``,
  into each adapter folder it writes;
* ``PeftModel.from_pretrained(model, adapter)`` (and ``AutoPeftModelFor*.from_pretrained``) adds those gates to a
  ``model`` that has none before loading, so the trained gate weights land in them; it raises a ``ValueError`` when
  the gates cannot be restored (the adapter holds gate weights but no gate configuration, the gates live in a gated
  base checkpoint the adapter does not contain, or ``model`` has gates configured differently);
* ``PeftModel.load_adapter`` (a further adapter on a PEFT model) and transformers' ``model.load_adapter`` raise the
  same ``ValueError`` instead of loading gate weights into a model without gates.

``load_gated_adapter(model, adapter)`` does the same explicitly (it returns the ``PeftModel``).
"""

from __future__ import annotations

import functools
import os

from transformers.utils import logging

logger = logging.get_logger(__name__)

GATE_CONFIG_NAME = "energy_gate_config.json"  # as hf_spectral.retrofit.config.CONFIG_NAME
ADAPTER_WEIGHTS_NAMES = ("adapter_model.safetensors", "adapter_model.bin")

# Default LoRA targets (LoRA's table and the tables PEFT copies from it).
CHIAR_LORA_TARGET_MODULES = ["q_proj", "kv_proj", "v_proj"]
RETROFIT_FAMILIES = ("gpt2", "llama", "mistral", "qwen2")

_WRAPPED_MARK = "__hf_spectral_wrapped__"


# ----------------------------------------------------------------------------------------------------------------
# Default target modules
# ----------------------------------------------------------------------------------------------------------------


def _target_module_tables() -> list[dict]:
    """Every model-type -> module-names table of PEFT (the constants and the tuner classes' own references)."""
    from peft.tuners.tuners_utils import BaseTuner
    from peft.utils import constants

    tables, seen = [], set()

    def add(table):
        if isinstance(table, dict) and id(table) not in seen and isinstance(table.get("gpt2"), list):
            seen.add(id(table))
            tables.append(table)

    for name in dir(constants):
        if name.startswith("TRANSFORMERS_MODELS_TO_") and name.endswith("_MAPPING"):
            add(getattr(constants, name))
    pending = list(BaseTuner.__subclasses__())
    while pending:
        tuner = pending.pop()
        pending.extend(tuner.__subclasses__())
        add(getattr(tuner, "target_module_mapping", None))
    return tables


def register_peft_target_modules() -> None:
    """Add the hf_spectral model types to PEFT's default target-module tables (idempotent; existing entries kept)."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as LORA

    lora_gpt2 = list(LORA["gpt2"])
    for table in _target_module_tables():
        table.setdefault("ega_gpt", list(table["gpt2"]))
        for family in RETROFIT_FAMILIES:
            if family in table:
                table.setdefault(f"energy_gated_{family}", list(table[family]))
        # CHIAR-Former's names follow Llama's, not GPT-2's: only LoRA-like tables (GPT-2 -> the fused qkv projection)
        if table["gpt2"] == lora_gpt2:
            table.setdefault("chiar_former", list(CHIAR_LORA_TARGET_MODULES))


# ----------------------------------------------------------------------------------------------------------------
# Adapters of gated models
# ----------------------------------------------------------------------------------------------------------------


def _hub_kwargs(kwargs: dict) -> dict:
    return {key: kwargs[key] for key in ("subfolder", "revision", "cache_dir", "token", "local_files_only")
            if kwargs.get(key) is not None}


def _adapter_file(model_id, filename: str, hub_kwargs: dict) -> str | None:
    """Path of ``filename`` in the adapter ``model_id`` (a folder or a Hub repository), None when it has none."""
    subfolder = hub_kwargs.get("subfolder") or ""
    if os.path.isdir(os.path.join(str(model_id), subfolder)):
        path = os.path.join(str(model_id), subfolder, filename)
        return path if os.path.isfile(path) else None
    from transformers.utils import cached_file

    try:
        return cached_file(str(model_id), filename, _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False, **hub_kwargs)
    except (OSError, ValueError):  # no such repository or an invalid id: PEFT reports it when it loads the adapter
        return None


def _is_gate_parameter_key(key: str) -> bool:
    """Whether an adapter weight is a gate's own parameter (the gate saved whole: ``modules_to_save``), told by its
    threshold τ, which every gate has. A LoRA delta on a gate's projection (``...energy_gate.energy.proj.lora_A``)
    is not: the gate it adapts is part of the base checkpoint."""
    return f".{key}".endswith(".energy_gate.tau")


def adapter_gate_info(model_id, **kwargs) -> tuple[dict | None, bool]:
    """(gate configuration recorded in the adapter or None, whether the adapter's weights hold the gates' own
    parameters)."""
    hub_kwargs = _hub_kwargs(kwargs)
    if _adapter_file(model_id, "adapter_config.json", hub_kwargs) is None:
        return None, False  # not an adapter we can reach: PEFT reports that itself (one failed lookup, not three)
    keys = None
    for name in ADAPTER_WEIGHTS_NAMES:  # the file PEFT loads next (a Hub download is cached for it)
        path = _adapter_file(model_id, name, hub_kwargs)
        if path is None:
            continue
        if name.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(path, framework="pt") as handle:
                keys = list(handle.keys())
        else:
            import torch

            keys = list(torch.load(path, map_location="cpu", weights_only=True))
        break
    if keys is None:
        return None, False  # no adapter weights to be found: PEFT reports that itself
    config_path = _adapter_file(model_id, GATE_CONFIG_NAME, hub_kwargs)
    gate_config = None
    if config_path is not None:
        from .retrofit.config import read_gate_config_file

        gate_config = read_gate_config_file(config_path)
    return gate_config, any(_is_gate_parameter_key(key) for key in keys)


def prepare_model_for_adapter(model, model_id, *, add_missing_gates: bool = True, **kwargs) -> bool:
    """Make sure ``model`` has the energy gates the adapter ``model_id`` was trained with, before it is loaded.

    Adds them (``add_missing_gates``) when ``model`` has none and the adapter records their configuration and holds
    their trained weights; raises a ``ValueError`` saying what to do when that is not possible. Does nothing for an
    adapter of a model without gates. Returns whether it added gates."""
    from .retrofit import EnergyGateConfig, add_energy_gates, has_energy_gates

    gate_values, has_gate_weights = adapter_gate_info(model_id, **kwargs)
    if gate_values is None and not has_gate_weights:
        return False
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    recorded = EnergyGateConfig.from_dict(gate_values) if gate_values is not None else None
    if has_energy_gates(base):
        current = dict(base.config.energy_gates)
        if recorded is not None and current != recorded.to_dict():
            raise ValueError(
                f"the adapter {model_id} was trained with energy gates configured as {recorded.to_dict()}, the model's "
                f"gates are configured as {current}"
            )
        return False
    if recorded is None and any(name.endswith("energy_gate") for name, _ in base.named_modules()):
        return False  # gates of the architecture itself (EGA-GPT): PEFT loads their weights like any other module's
    if not has_gate_weights:
        raise ValueError(
            f"the adapter {model_id} was trained on a model with energy gates ({GATE_CONFIG_NAME}), but it does not "
            "contain them: they are part of the base checkpoint it was trained on. Load that gated checkpoint (saved "
            "with save_pretrained after add_energy_gates) as the base model, or add the gates and their weights "
            "first (add_energy_gates + load_energy_gates)."
        )
    if recorded is None:
        raise ValueError(
            f"the adapter {model_id} holds trained energy-gate weights, but the model has no energy gates and the "
            f"adapter does not record their configuration ({GATE_CONFIG_NAME}); they would be dropped. Add the gates "
            "they were trained with first: hf_spectral.retrofit.add_energy_gates(model, EnergyGateConfig(...)), or "
            f"write the configuration into the adapter folder with gate_config.save_pretrained(<adapter folder>)."
        )
    if not add_missing_gates or hasattr(model, "get_base_model"):
        raise ValueError(
            f"the adapter {model_id} holds trained energy-gate weights, but the model has no energy gates; add them "
            f"before wrapping the model with PEFT: add_energy_gates(model, EnergyGateConfig.from_dict({gate_values})), "
            "or load the adapter with PeftModel.from_pretrained / hf_spectral.peft_integration.load_gated_adapter"
        )
    logger.info(f"adding the energy gates recorded in {model_id} ({recorded.to_dict()}) before loading the adapter")
    add_energy_gates(base, recorded)
    return True


def _load_with_gates(model, model_id, load, **kwargs):
    """``load()`` after ``prepare_model_for_adapter``; gates it added are removed again if ``load`` fails, so that a
    failed load leaves ``model`` as it was."""
    added = prepare_model_for_adapter(model, model_id, **kwargs)
    try:
        return load()
    except BaseException:
        if added:
            from .retrofit import remove_energy_gates

            remove_energy_gates(model)
        raise


def load_gated_adapter(model, model_id, **kwargs):
    """``PeftModel.from_pretrained(model, model_id, **kwargs)`` after adding to ``model`` the energy gates the adapter
    was trained with (see the module docstring); returns the ``PeftModel``."""
    from peft import PeftModel

    return _load_with_gates(model, model_id, lambda: PeftModel.from_pretrained(model, model_id, **kwargs), **kwargs)


def write_gate_config(peft_model, save_directory, selected_adapters=None) -> list[str]:
    """Write ``energy_gate_config.json`` next to each adapter that ``peft_model.save_pretrained`` wrote, when its base
    model has energy gates; returns the paths written."""
    from .retrofit import EnergyGateConfig, has_energy_gates

    base = peft_model.get_base_model()
    if not has_energy_gates(base):
        return []
    gate_config = EnergyGateConfig.from_dict(dict(base.config.energy_gates))
    adapters = selected_adapters if selected_adapters is not None else list(peft_model.peft_config)
    paths = []
    for adapter_name in adapters:
        # PEFT's layout: the default adapter at the top, the others in a folder named after them.
        directory = save_directory if adapter_name == "default" else os.path.join(save_directory, adapter_name)
        if os.path.isdir(directory):
            paths.append(gate_config.save_pretrained(directory))
    return paths


def _wrap_peft_model() -> None:
    from peft import PeftModel

    if getattr(PeftModel.from_pretrained, _WRAPPED_MARK, False):
        return

    from_pretrained = PeftModel.__dict__["from_pretrained"].__func__
    save_pretrained = PeftModel.save_pretrained
    load_adapter = PeftModel.load_adapter

    @functools.wraps(from_pretrained)
    def from_pretrained_with_gates(cls, model, model_id, *args, **kwargs):
        return _load_with_gates(model, model_id, lambda: from_pretrained(cls, model, model_id, *args, **kwargs),
                                **kwargs)

    @functools.wraps(save_pretrained)
    def save_pretrained_with_gates(self, save_directory, *args, **kwargs):
        result = save_pretrained(self, save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            write_gate_config(self, save_directory, kwargs.get("selected_adapters"))
        return result

    @functools.wraps(load_adapter)
    def load_adapter_with_gates(self, model_id, *args, **kwargs):
        prepare_model_for_adapter(self, model_id, add_missing_gates=False, **kwargs)
        return load_adapter(self, model_id, *args, **kwargs)

    for function in (from_pretrained_with_gates, save_pretrained_with_gates, load_adapter_with_gates):
        setattr(function, _WRAPPED_MARK, True)
    PeftModel.from_pretrained = classmethod(from_pretrained_with_gates)
    PeftModel.save_pretrained = save_pretrained_with_gates
    PeftModel.load_adapter = load_adapter_with_gates


def _wrap_transformers_load_adapter() -> None:
    from transformers.integrations.peft import PeftAdapterMixin

    load_adapter = PeftAdapterMixin.load_adapter
    if getattr(load_adapter, _WRAPPED_MARK, False):
        return

    @functools.wraps(load_adapter)
    def load_adapter_with_gates(self, peft_model_id=None, *args, **kwargs):
        if peft_model_id is None:
            return load_adapter(self, peft_model_id, *args, **kwargs)
        hub_kwargs = {**(kwargs.get("adapter_kwargs") or {}), **kwargs}
        return _load_with_gates(self, peft_model_id, lambda: load_adapter(self, peft_model_id, *args, **kwargs),
                                **hub_kwargs)

    setattr(load_adapter_with_gates, _WRAPPED_MARK, True)
    PeftAdapterMixin.load_adapter = load_adapter_with_gates


def register_peft_integration() -> bool:
    """Register the default target modules and the gate-aware adapter loading with PEFT (run on ``import
    hf_spectral``; idempotent). Returns False when PEFT is not installed."""
    try:
        import peft  # noqa: F401
    except ImportError:
        return False
    register_peft_target_modules()
    _wrap_peft_model()
    _wrap_transformers_load_adapter()
    return True


__all__ = [
    "CHIAR_LORA_TARGET_MODULES",
    "adapter_gate_info",
    "load_gated_adapter",
    "prepare_model_for_adapter",
    "register_peft_integration",
    "register_peft_target_modules",
    "write_gate_config",
]
