"""hf_spectral: a Hugging Face Transformers plugin for spectral attention research.

* EGA-GPT (energy-gated attention) and the energy-gate retrofit for existing checkpoints;
* CHIAR-Former (spectral-entropy routing between DCT mixing, RBF kernel mixing and attention);
* ``hf_spectral.rmt``: random-matrix theory of attention pooling.

Importing the package registers every model with the ``transformers`` Auto classes.
"""

from .models.chiar_former import (
    ChiarConfig,
    ChiarForCausalLM,
    ChiarForSequenceClassification,
    ChiarModel,
    ChiarPreTrainedModel,
)
from .models.ega_gpt import (
    EGAConfig,
    EGAForCausalLM,
    EGAForSequenceClassification,
    EGAModel,
    EGAPreTrainedModel,
)
from .registration import register_auto_classes
from .tokenization_char import CharTokenizer

register_auto_classes()

__version__ = "0.1.0"

__all__ = [
    "CharTokenizer",
    "ChiarConfig",
    "ChiarForCausalLM",
    "ChiarForSequenceClassification",
    "ChiarModel",
    "ChiarPreTrainedModel",
    "EGAConfig",
    "EGAForCausalLM",
    "EGAForSequenceClassification",
    "EGAModel",
    "EGAPreTrainedModel",
    "register_auto_classes",
]
