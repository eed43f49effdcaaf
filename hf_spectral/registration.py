"""Registration of every hf_spectral model with the ``transformers`` Auto classes.

``register_auto_classes`` runs on ``import hf_spectral``. It also calls ``register_for_auto_class`` so
that ``save_pretrained`` writes an ``auto_map`` and copies the model folder's code next to the weights:
the checkpoint then loads with ``trust_remote_code=True`` where hf_spectral is not installed.
"""

import transformers


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
        config_class.register_for_auto_class()
        for auto_name, model_class in models.items():
            getattr(transformers, auto_name).register(config_class, model_class, exist_ok=True)
            model_class.register_for_auto_class(auto_name)
        transformers.AutoTokenizer.register(config_class, slow_tokenizer_class=CharTokenizer, exist_ok=True)
    CharTokenizer.register_for_auto_class("AutoTokenizer")

    from .retrofit import register_energy_gated_models

    register_energy_gated_models()
