"""Registration of every hf_spectral model with the ``transformers`` Auto classes.

``register_auto_classes`` runs on ``import hf_spectral``, so that ``AutoConfig`` / ``AutoModel*`` /
``AutoTokenizer.from_pretrained`` find the hf_spectral classes wherever the plugin is imported.

The model and config classes are deliberately *not* given ``register_for_auto_class``: transformers'
``custom_object_save`` would then copy only the files a modeling file imports with single-dot imports and fail on
``from ...ops.x import``. Their ``save_pretrained`` writes the remote code itself
(`hf_spectral.ops.remote_code.save_model_code`): the flattened model files, the ops files they need and a complete
``auto_map``, so that a saved folder loads with ``trust_remote_code=True`` where hf_spectral is not installed. The
char tokenizer imports nothing relatively, so transformers' own mechanism saves its code.
"""

import transformers

from .ops.remote_code import register_with_auto_class


def _auto_table():
    # Imported here so that each model folder stays importable on its own (remote code).
    from .models import chiar_former, ega_gpt

    return [
        (
            ega_gpt.EGAConfig,
            {
                "AutoModel": ega_gpt.EGAModel,
                "AutoModelForCausalLM": ega_gpt.EGAForCausalLM,
                "AutoModelForSequenceClassification": ega_gpt.EGAForSequenceClassification,
            },
        ),
        (
            chiar_former.ChiarConfig,
            {
                "AutoModel": chiar_former.ChiarModel,
                "AutoModelForCausalLM": chiar_former.ChiarForCausalLM,
                "AutoModelForSequenceClassification": chiar_former.ChiarForSequenceClassification,
            },
        ),
    ]


def register_auto_classes() -> None:
    """Register configs, models and the char tokenizer with the Auto classes (idempotent)."""
    from .tokenization_char import CharTokenizer

    for config_class, models in _auto_table():
        transformers.AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        for auto_name, model_class in models.items():
            register_with_auto_class(config_class, auto_name, model_class)
        transformers.AutoTokenizer.register(config_class, slow_tokenizer_class=CharTokenizer, exist_ok=True)
    CharTokenizer.register_for_auto_class("AutoTokenizer")

    from .retrofit.model import register_energy_gated_models

    register_energy_gated_models()

    from .peft_integration import register_peft_integration

    # Default LoRA targets, adapters that keep their energy gates (HF_SPECTRAL_PEFT_INTEGRATION=0: targets only);
    # PEFT itself is not imported here
    register_peft_integration()
