"""Energy-gate retrofit: add EGA gates (SPEC 1.1-1.2) to an existing checkpoint without changing its outputs.

    from transformers import AutoModelForCausalLM
    from hf_spectral.retrofit import EnergyGateConfig, add_energy_gates, mark_only_gates_trainable

    model = AutoModelForCausalLM.from_pretrained("path/or/hub-id")   # GPT-2, Llama, Mistral or Qwen2
    add_energy_gates(model, EnergyGateConfig())    # α = 0: logits are unchanged
    mark_only_gates_trainable(model)               # then train with Trainer / accelerate
    model.save_pretrained("gated")                 # config.json records the gates
    AutoModelForCausalLM.from_pretrained("gated")  # gates restored (with hf_spectral imported)

Gates next to LoRA adapters (PEFT): the gates train through ``modules_to_save`` and are stored in the adapter.

    from peft import LoraConfig, PeftModel, get_peft_model

    add_energy_gates(model, gate_config)
    peft_model = get_peft_model(model, LoraConfig(target_modules=["c_attn"], modules_to_save=["energy_gate"]))
    ...                                            # train
    peft_model.save_pretrained("adapter"); gate_config.save_pretrained("adapter")

    base = AutoModelForCausalLM.from_pretrained("path/or/hub-id")
    add_energy_gates(base, EnergyGateConfig.from_pretrained("adapter"))
    model = PeftModel.from_pretrained(base, "adapter")   # LoRA weights and trained gates restored

A gates-only file (a few kilobytes): ``save_energy_gates(model, "gates.safetensors")`` and
``load_energy_gates(model, "gates.safetensors")``, which refuses a file made for another model.
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
    supported_families,
)

__all__ = [
    "EnergyGateConfig",
    "add_energy_gates",
    "gated_attention_modules",
    "has_energy_gates",
    "load_energy_gates",
    "mark_only_gates_trainable",
    "register_energy_gated_models",
    "remove_energy_gates",
    "save_energy_gates",
    "supported_families",
]
