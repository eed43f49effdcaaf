"""Energy-gate retrofit: add EGA gates (SPEC 1.1-1.2) to an existing checkpoint without changing its outputs.

    from transformers import AutoModelForCausalLM
    from hf_spectral.retrofit import EnergyGateConfig, add_energy_gates, mark_only_gates_trainable

    model = AutoModelForCausalLM.from_pretrained("path/or/hub-id")   # any decoder-only family of transformers
    add_energy_gates(model, EnergyGateConfig())    # α = 0: logits are unchanged
    mark_only_gates_trainable(model)               # then train with Trainer / accelerate
    model.save_pretrained("gated")                 # config.json records the gates
    AutoModelForCausalLM.from_pretrained("gated")  # gates restored (with hf_spectral imported)
    AutoModelForCausalLM.from_pretrained("gated", trust_remote_code=True)  # the same, where it is not installed

Gates next to LoRA adapters (PEFT): the gates train through ``modules_to_save`` and are stored in the adapter;
``save_pretrained`` also writes the gate configuration (``energy_gate_config.json``) into the adapter folder.

    from peft import LoraConfig, PeftModel, get_peft_model

    add_energy_gates(model, gate_config)
    peft_model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", modules_to_save=["energy_gate"]))
    ...                                            # train
    peft_model.save_pretrained("adapter")          # LoRA weights, trained gates, gate configuration

    base = AutoModelForCausalLM.from_pretrained("path/or/hub-id")      # no gates
    model = PeftModel.from_pretrained(base, "adapter")   # gates added (a warning), LoRA weights and trained gates

The gates go into ``base`` as the identity and the trained ones into PEFT's copies, so ``disable_adapter()`` and
other adapters see ``base`` unchanged; the same holds for ``AutoPeftModelFor*``, ``PeftModel.load_adapter`` and
transformers' ``model.load_adapter``. When the gates cannot be restored (gates configured differently, gates that
live in a gated base checkpoint) loading raises a ``ValueError`` saying what to do. ``hf_spectral.peft_integration``
tells how (it wraps those loaders and ``PeftModel.save_pretrained``) and how to switch it off;
``hf_spectral.peft_integration.load_gated_adapter(base, "adapter")`` does the same explicitly.

A gates-only file (a few kilobytes): ``save_energy_gates(model, "gates.safetensors")`` and
``load_energy_gates(model, "gates.safetensors")``, which refuses a file made for another model and leaves the model
unchanged when it refuses.
"""

from .config import EnergyGateConfig
from .model import (
    add_energy_gates,
    gated_attention_modules,
    has_energy_gates,
    load_energy_gates,
    mark_only_gates_trainable,
    register_energy_gated_models,
    remove_energy_gates,
    save_energy_gates,
    check_supported,
)

__all__ = [
    "EnergyGateConfig",
    "add_energy_gates",
    "check_supported",
    "gated_attention_modules",
    "has_energy_gates",
    "load_energy_gates",
    "mark_only_gates_trainable",
    "register_energy_gated_models",
    "remove_energy_gates",
    "save_energy_gates",
]
