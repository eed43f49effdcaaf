"""PEFT integration: default LoRA targets for the hf_spectral models, and adapters that keep their energy gates.

``import hf_spectral`` imports neither PEFT nor accelerate for it (transformers itself imports accelerate where it is
installed): when PEFT is already imported, ``register_peft_integration`` registers at once; otherwise a one-shot
import hook for the module ``peft`` (`PeftImportHook`) registers right after a later ``import peft`` has run.

**Default target modules.** PEFT finds the modules a ``LoraConfig`` without ``target_modules`` adapts in tables
keyed by ``config.model_type`` (``peft.utils.constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`` and its
copies for the other methods; each tuner class holds one as ``target_module_mapping``). hf_spectral adds:

* ``ega_gpt``: GPT-2's entries, since EGA-GPT names its modules as GPT-2 does (``attn.c_attn`` = the fused
  query/key/value projection, ``attn.c_proj``, ``mlp.c_fc``, ``mlp.c_proj``, ``ln_1``, ``ln_2``, ``ln_f``), so that
  ``get_peft_model(EGAForCausalLM(config), LoraConfig(task_type="CAUSAL_LM"))`` adapts ``c_attn`` as for GPT-2;
* ``chiar_former`` (LoRA and the methods that share its table): ``q_proj`` and ``kv_proj`` of the attention operator
  and the value projection ``v_proj`` of the RBF operator (DCT mixing has no weights);
* ``energy_gated_<type>`` (any retrofitted model): the entries of its stock model type, for every type PEFT has.

**Adapters of gated models.** An adapter trained on a model with energy gates (``add_energy_gates``; the gates train
next to LoRA through ``modules_to_save=["energy_gate"]`` and are stored in the adapter) needs gates in the model it
is loaded into: where the model has none, PEFT drops the trained gate weights without a word. hf_spectral wraps four
methods for this:

* ``PeftModel.save_pretrained``: when the base model has energy gates, it also writes their configuration,
  ``energy_gate_config.json``, into each adapter folder it writes;
* ``PeftModel.from_pretrained`` (and through it ``AutoPeftModelFor*.from_pretrained``), ``PeftModel.load_adapter``
  (a further adapter: the gates go into the PEFT model's base model) and transformers' ``model.load_adapter``
  (``PeftAdapterMixin.load_adapter``): when the adapter folder holds ``energy_gate_config.json`` and the model has
  no gates, they add gates of that configuration, as the identity (α = 0, whatever α the adapter's gates started
  from), and log a WARNING naming the adapter and the configuration. The adapter's trained gates are PEFT's copies
  of the model's gates (``modules_to_save``) and get its weights; other adapters and ``disable_adapter()`` see the
  identity gates, that is the model unchanged. A load that fails removes the gates it added.

They raise a ``ValueError`` saying what to run when the gates cannot be restored: the model has gates configured
differently (``tau_init`` and ``alpha_init``, starting values only, are not compared), or the adapter records gates
but holds no trained weights for them (they live in the gated base checkpoint it was trained on).

For an adapter folder without ``energy_gate_config.json`` each wrapper calls PEFT's or transformers' method
straight through after that one existence check (``save_pretrained``: when the base model has no gates). The wrappers
are functions of this module (their ``__module__``, ``__qualname__`` and ``__doc__`` say so; ``__wrapped__`` is the
original method). Switch them off with ``HF_SPECTRAL_PEFT_INTEGRATION=0`` in the environment of ``import
hf_spectral``, or with ``unregister_peft_integration()``, which puts PEFT's and transformers' own methods back;
``load_gated_adapter(model, adapter)`` and ``write_gate_config(peft_model, folder)`` do the same explicitly. The
default target modules concern hf_spectral's model types alone and stay registered.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import inspect
import os
import sys

from transformers.utils import logging

logger = logging.get_logger(__name__)

GATE_CONFIG_NAME = "energy_gate_config.json"  # as hf_spectral.retrofit.config.CONFIG_NAME
ADAPTER_WEIGHTS_NAMES = ("adapter_model.safetensors", "adapter_model.bin")
SWITCH_VARIABLE = "HF_SPECTRAL_PEFT_INTEGRATION"
SWITCH_VALUES = {"1": True, "true": True, "on": True, "yes": True,
                 "0": False, "false": False, "off": False, "no": False}

# Default LoRA targets (LoRA's table and the tables PEFT copies from it).
CHIAR_LORA_TARGET_MODULES = ["q_proj", "kv_proj", "v_proj"]
RETROFIT_PREFIX = "energy_gated_"  # as hf_spectral.retrofit's model types: energy_gated_<stock model type>


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
        # A retrofitted model keeps its stock module names: every family PEFT has defaults for keeps them.
        for model_type, targets in list(table.items()):
            if not model_type.startswith(RETROFIT_PREFIX) and isinstance(targets, list):
                table.setdefault(RETROFIT_PREFIX + model_type, list(targets))
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


def _gates_with_weights(model_id, hub_kwargs: dict) -> set[str]:
    """Names (as the adapter's weights spell them) of the gates whose own parameters the adapter holds: gates saved
    whole through ``modules_to_save``, told by the threshold τ every gate has. A LoRA delta on a gate's projection
    (``...energy_gate.energy.proj.lora_A``) is no such gate: the gate it adapts is part of the base checkpoint."""
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
        return {key.removesuffix(".tau") for key in keys if f".{key}".endswith(".energy_gate.tau")}
    return set()


def prepare_model_for_adapter(model, model_id, **kwargs) -> bool:
    """Give ``model`` (a ``PeftModel``: its base model) the energy gates that the adapter ``model_id`` records in its
    ``energy_gate_config.json``, as the identity, before the adapter is loaded; see the module docstring. Does
    nothing for an adapter without that file. Returns whether it added gates."""
    hub_kwargs = _hub_kwargs(kwargs)
    config_path = _adapter_file(model_id, GATE_CONFIG_NAME, hub_kwargs)
    if config_path is None:
        return False
    from .retrofit import EnergyGateConfig, add_energy_gates, has_energy_gates, remove_energy_gates
    from .retrofit.config import gate_structure, read_gate_config_file

    # The model's own gates are the identity, whatever the adapter's gates started from: its trained gates are
    # PEFT's copies of them and get its weights, while other adapters and disable_adapter() see the model unchanged.
    gate_config = EnergyGateConfig.from_dict({**read_gate_config_file(config_path), "tau_init": 0.0, "alpha_init": 0.0})
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if has_energy_gates(base):
        if gate_structure(base.config.energy_gates) != gate_structure(gate_config.to_dict()):
            raise ValueError(
                f"the adapter {model_id} was trained with energy gates configured as "
                f"{gate_structure(gate_config.to_dict())}, the model's gates are configured as "
                f"{gate_structure(base.config.energy_gates)}; load it into a model with its gates: "
                f"remove_energy_gates(model), then load the adapter again"
            )
        return False
    add_energy_gates(base, gate_config)
    try:
        trained = _gates_with_weights(model_id, hub_kwargs)
        gates = [name for name, module in base.named_modules() if name.endswith(".energy_gate")]
        missing = [gate for gate in gates if not any(f".{owner}".endswith(f".{gate}") for owner in trained)]
        if missing:
            raise ValueError(
                f"the adapter {model_id} was trained on a model with energy gates ({GATE_CONFIG_NAME}) but "
                f"holds no trained weights for {missing}: they are part of the base checkpoint it was trained on. "
                "Load that gated checkpoint as the model (AutoModelForCausalLM.from_pretrained(<gated checkpoint>), "
                "saved with save_pretrained after add_energy_gates), or add the gates and their weights first: "
                f"add_energy_gates(model, EnergyGateConfig.from_pretrained({str(model_id)!r})); "
                "load_energy_gates(model, <file written by save_energy_gates>)"
            )
    except BaseException:
        remove_energy_gates(base)
        raise
    logger.warning(
        f"the adapter {model_id} was trained with energy gates: added them to the model as the identity "
        f"({gate_config.to_dict()}); the adapter's trained gates are loaded into PEFT's copies of them "
        f"(modules_to_save). Switch this off with {SWITCH_VARIABLE}=0."
    )
    return True


def _load_with_gates(model, model_id, load, **kwargs):
    """``load()`` after ``prepare_model_for_adapter``; gates it added are removed again if ``load`` fails, so that a
    failed load leaves ``model`` as it was."""
    if not prepare_model_for_adapter(model, model_id, **kwargs):
        return load()
    try:
        return load()
    except BaseException:
        from .retrofit import remove_energy_gates

        remove_energy_gates(model.get_base_model() if hasattr(model, "get_base_model") else model)
        raise


def load_gated_adapter(model, model_id, **kwargs):
    """``PeftModel.from_pretrained(model, model_id, **kwargs)`` after adding to ``model`` the energy gates the adapter
    was trained with (see the module docstring), whether or not the wrappers are on; returns the ``PeftModel``."""
    from peft import PeftModel

    return _load_with_gates(model, model_id, lambda: PeftModel.from_pretrained(model, model_id, **kwargs), **kwargs)


def _adapter_depends_on_gates(gated_attentions: list, adapter_name: str) -> bool:
    """Whether an adapter's outputs depend on the model's energy gates: it trains copies of them
    (``modules_to_save``), or the model's own gates are not the identity (α ≠ 0: the gates of a gated checkpoint).
    An adapter trained while the model's gates were the identity (added for another adapter) loads without them."""
    for attention in gated_attentions:
        gate = attention.energy_gate
        if adapter_name in getattr(gate, "modules_to_save", {}):
            return True
        if getattr(gate, "original_module", gate).alpha.count_nonzero():
            return True
    return False


def write_gate_config(peft_model, save_directory, selected_adapters=None) -> list[str]:
    """Write ``energy_gate_config.json`` next to each adapter that ``peft_model.save_pretrained`` wrote and whose
    outputs depend on the energy gates of its base model; returns the paths written."""
    from .retrofit import EnergyGateConfig, gated_attention_modules

    base = peft_model.get_base_model()
    gated_attentions = gated_attention_modules(base)
    if not gated_attentions:
        return []
    gate_config = EnergyGateConfig.from_dict(dict(base.config.energy_gates))
    adapters = selected_adapters if selected_adapters is not None else list(peft_model.peft_config)
    paths = []
    for adapter_name in adapters:
        # PEFT's layout: the default adapter at the top, the others in a folder named after them.
        directory = save_directory if adapter_name == "default" else os.path.join(save_directory, adapter_name)
        if os.path.isdir(directory) and _adapter_depends_on_gates(gated_attentions, adapter_name):
            paths.append(gate_config.save_pretrained(directory))
    return paths


# ----------------------------------------------------------------------------------------------------------------
# The wrappers, and switching them on and off
# ----------------------------------------------------------------------------------------------------------------

ADDS_GATES = f"the energy gates an adapter records ({GATE_CONFIG_NAME}) are added to a model without gates"
NO_GATE_CONFIG = f"an adapter folder without {GATE_CONFIG_NAME}"
_originals: dict[tuple[type, str], object] = {}  # (class, method name) -> the attribute it had before wrapping
_wrap_peft_model_on_import = False  # whether the import hook wraps PeftModel's methods besides the target modules


def _install(owner: type, name: str, make_wrapper, adds: str, unless: str) -> None:
    """Replace ``owner.<name>`` by ``make_wrapper(original function)``: a function of this module that says what it
    adds, how to switch it off, and keeps the original as ``__wrapped__`` (``inspect.signature`` follows it)."""
    if (owner, name) in _originals:
        return
    attribute = owner.__dict__[name]
    is_classmethod = isinstance(attribute, classmethod)
    original = attribute.__func__ if is_classmethod else attribute
    wrapper = make_wrapper(original)
    wrapper.__qualname__ = f"{owner.__name__}.{wrapper.__name__}"
    wrapper.__wrapped__ = original
    wrapper.__doc__ = (
        f"{owner.__module__}.{owner.__name__}.{name}, wrapped by hf_spectral: {adds}. For {unless} it calls "
        f"{name} straight through. Switch it off with {SWITCH_VARIABLE}=0 (before "
        "import hf_spectral) or hf_spectral.peft_integration.unregister_peft_integration().\n\n"
        f"{inspect.getdoc(original) or ''}"
    )
    _originals[(owner, name)] = attribute
    setattr(owner, name, classmethod(wrapper) if is_classmethod else wrapper)


def _wrap_peft_model() -> None:
    from peft import PeftModel

    def wrap_from_pretrained(original):
        def from_pretrained_adding_energy_gates(cls, model, model_id, *args, **kwargs):
            return _load_with_gates(model, model_id, lambda: original(cls, model, model_id, *args, **kwargs), **kwargs)

        return from_pretrained_adding_energy_gates

    def wrap_load_adapter(original):
        def load_adapter_adding_energy_gates(self, model_id, *args, **kwargs):
            return _load_with_gates(self, model_id, lambda: original(self, model_id, *args, **kwargs), **kwargs)

        return load_adapter_adding_energy_gates

    def wrap_save_pretrained(original):
        signature = inspect.signature(original)

        def save_pretrained_writing_gate_config(self, save_directory, *args, **kwargs):
            result = original(self, save_directory, *args, **kwargs)
            arguments = signature.bind(self, save_directory, *args, **kwargs).arguments
            if arguments.get("is_main_process", True):
                write_gate_config(self, save_directory, arguments.get("selected_adapters"))
            return result

        return save_pretrained_writing_gate_config

    _install(PeftModel, "from_pretrained", wrap_from_pretrained, ADDS_GATES, NO_GATE_CONFIG)
    _install(PeftModel, "load_adapter", wrap_load_adapter, ADDS_GATES + " (to its base model)", NO_GATE_CONFIG)
    _install(PeftModel, "save_pretrained", wrap_save_pretrained,
             f"a model with energy gates also writes their configuration into each adapter folder ({GATE_CONFIG_NAME})",
             "a model without energy gates")


def _wrap_transformers_load_adapter() -> None:
    from transformers.integrations.peft import PeftAdapterMixin

    def wrap_load_adapter(original):
        signature = inspect.signature(original)

        def load_adapter_adding_energy_gates(self, *args, **kwargs):
            arguments = signature.bind(self, *args, **kwargs).arguments
            load_config = arguments.get("load_config")
            model_id = arguments.get("peft_model_id") or getattr(load_config, "pretrained_model_name_or_path", None)
            if model_id is None:  # an adapter given as peft_config + adapter_state_dict: no folder to look in
                return original(self, *args, **kwargs)
            hub_kwargs = {**(getattr(load_config, "download_kwargs", None) or {}), **arguments.get("kwargs", {}),
                          **(arguments.get("adapter_kwargs") or {})}
            if arguments.get("local_files_only"):
                hub_kwargs["local_files_only"] = True
            return _load_with_gates(self, model_id, lambda: original(self, *args, **kwargs), **hub_kwargs)

        return load_adapter_adding_energy_gates

    _install(PeftAdapterMixin, "load_adapter", wrap_load_adapter, ADDS_GATES, NO_GATE_CONFIG)


def _register_with_peft() -> None:
    register_peft_target_modules()
    if _wrap_peft_model_on_import:
        _wrap_peft_model()


class _RegisteringLoader:
    """Stands in for peft's loader while its module executes, then registers (and gives the module its loader
    back)."""

    def __init__(self, loader, hook):
        self.loader, self.hook = loader, hook

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        module.__loader__ = module.__spec__.loader = self.loader
        self.hook.remove()
        _register_with_peft()

    def __getattr__(self, name):  # anything else a loader offers (resources, source) is the real loader's
        return getattr(self.loader, name)


class PeftImportHook(importlib.abc.MetaPathFinder):
    """A finder for the module ``peft`` alone, first in ``sys.meta_path``: it finds peft's spec through the other
    finders and has the registration run right after peft's ``__init__`` has executed, then leaves
    ``sys.meta_path``. So ``import hf_spectral`` need not import PEFT."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "peft":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _RegisteringLoader(spec.loader, self)
        return spec

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


def _switch_from_environment() -> bool:
    value = os.environ.get(SWITCH_VARIABLE, "1").strip().lower()
    if value not in SWITCH_VALUES:
        raise ValueError(f"{SWITCH_VARIABLE}={os.environ[SWITCH_VARIABLE]!r}: expected 1 (wrappers on) or 0 (off)")
    return SWITCH_VALUES[value]


def register_peft_integration(wrap_loaders: bool | None = None) -> None:
    """Register the default target modules with PEFT and, with ``wrap_loaders`` (default: unless
    ``HF_SPECTRAL_PEFT_INTEGRATION=0``), wrap the adapter loaders and ``PeftModel.save_pretrained`` (see the module
    docstring). Runs on ``import hf_spectral``; idempotent. Imports no PEFT: when it is not imported yet, the
    registration runs right after ``import peft``."""
    global _wrap_peft_model_on_import
    wrap_loaders = _switch_from_environment() if wrap_loaders is None else wrap_loaders
    _wrap_peft_model_on_import = _wrap_peft_model_on_import or wrap_loaders
    if wrap_loaders:
        _wrap_transformers_load_adapter()  # transformers' module is imported with PreTrainedModel: no PEFT needed
    if "peft" in sys.modules:
        _register_with_peft()
    elif not any(isinstance(finder, PeftImportHook) for finder in sys.meta_path) and importlib.util.find_spec("peft"):
        sys.meta_path.insert(0, PeftImportHook())


def unregister_peft_integration() -> None:
    """Put PEFT's and transformers' own methods back (the very attributes the classes had), and wrap nothing when
    PEFT is imported later. The default target modules stay registered."""
    global _wrap_peft_model_on_import
    _wrap_peft_model_on_import = False
    for (owner, name), attribute in _originals.items():
        setattr(owner, name, attribute)
    _originals.clear()


__all__ = [
    "CHIAR_LORA_TARGET_MODULES",
    "PeftImportHook",
    "load_gated_adapter",
    "prepare_model_for_adapter",
    "register_peft_integration",
    "register_peft_target_modules",
    "unregister_peft_integration",
    "write_gate_config",
]
