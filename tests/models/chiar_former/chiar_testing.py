"""Shared builders for the CHIAR-Former tests."""

import torch

from hf_spectral import ChiarConfig
from hf_spectral.models.chiar_former import calibrate_thresholds

VOCAB = 37
PAD, BOS = 0, 1


def tiny_config(**overrides) -> ChiarConfig:
    """A CHIAR-Former small enough for fast CPU tests; dropout off so that outputs are deterministic."""
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout=0.0,
        rbf_num_features=16,
        rbf_chunk_size=8,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=None,
    )
    fields.update(overrides)
    return ChiarConfig(**fields)


def random_ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    """Token ids avoiding the pad and bos ids."""
    return torch.randint(2, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def build(model_class, config, seed: int = 0, calibrate_on: torch.Tensor | None = None, percentiles=None):
    """A model in eval mode with seeded weights; threshold routers are calibrated per layer on ``calibrate_on`` so
    that every routed operator gets tokens (the authors' default thresholds route nothing at d = 32)."""
    torch.manual_seed(seed)
    model = model_class(config).eval()
    if calibrate_on is not None and config.router_type == "threshold" and config.routed_layers:
        if percentiles is None:
            percentiles = (50.0,) if len(config.routed_operators) == 2 else (33.0, 67.0)
        calibrate_thresholds(model, [calibrate_on], percentiles=percentiles, per_layer=True)
    return model


# Every causal operator and router: single-operator layouts, each router with 2 and 3 operators, pre-LN.
CAUSAL_VARIANTS = {
    "dct-only": dict(layer_operators=["dct", "dct"], num_hidden_layers=2),
    "rbf-only": dict(layer_operators=["rbf", "rbf"], num_hidden_layers=2),
    "attention-only": dict(layer_operators=["attention", "attention"], num_hidden_layers=2),
    "threshold-2": dict(),
    "threshold-3": dict(routed_operators=["dct", "rbf", "attention"]),
    "hard-2": dict(router_type="hard"),
    "hard-3": dict(router_type="hard", routed_operators=["dct", "rbf", "attention"]),
    "soft-3": dict(router_type="soft", routed_operators=["dct", "rbf", "attention"]),
    "dense-threshold-3": dict(routed_operators=["dct", "rbf", "attention"], routed_execution="dense"),
    "pre-ln-threshold-3": dict(routed_operators=["dct", "rbf", "attention"], layer_norm_position="pre"),
    "fft-dct": dict(routed_operators=["dct", "rbf", "attention"], dct_implementation="fft"),
}

