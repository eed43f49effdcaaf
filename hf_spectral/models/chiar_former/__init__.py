from .calibration import calibrate_thresholds, measure_entropies
from .configuration_chiar_former import ChiarConfig, default_layer_operators
from .flop_counter import count_flops
from .modeling_chiar_former import (
    ChiarForCausalLM,
    ChiarForSequenceClassification,
    ChiarModel,
    ChiarPreTrainedModel,
    routing_fractions,
)

__all__ = [
    "ChiarConfig",
    "ChiarForCausalLM",
    "ChiarForSequenceClassification",
    "ChiarModel",
    "ChiarPreTrainedModel",
    "calibrate_thresholds",
    "count_flops",
    "default_layer_operators",
    "measure_entropies",
    "routing_fractions",
]
