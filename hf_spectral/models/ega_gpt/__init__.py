from .configuration_ega_gpt import VARIANTS, EGAConfig
from .modeling_ega_gpt import EGAForCausalLM, EGAForSequenceClassification, EGAModel, EGAPreTrainedModel

__all__ = ["VARIANTS", "EGAConfig", "EGAForCausalLM", "EGAForSequenceClassification", "EGAModel", "EGAPreTrainedModel"]
