import pytest

from hf_spectral import EGAConfig, EGAForCausalLM
from hf_spectral.models.ega_gpt.configuration_ega_gpt import VARIANTS


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"hidden_size": 30, "num_attention_heads": 4}, "hidden_size"),
        ({"energy_kind": "fourier"}, "energy_kind"),
        ({"energy_kind": "conv", "energy_scales": [3, -7]}, "energy_scales"),
        ({"energy_kind": "morlet", "energy_scales": []}, "energy_scales"),
        ({"energy_scales": [3]}, "energy_scales"),  # scales make no sense for linear energies
        ({"energy_normalization": "global"}, "energy_normalization"),
        ({"energy_gate_layers": [0, 9]}, "energy_gate_layers"),
        ({"energy_projections": 0}, "energy_projections"),
        ({"num_hidden_layers": -1}, "num_hidden_layers"),
        ({"attn_pdrop": 1.5}, "attn_pdrop"),
        ({"energy_norm_eps": 0.0}, "energy_norm_eps"),
        ({"classifier_pooling": "max"}, "classifier_pooling"),
    ],
)
def test_bad_config_values_raise_value_error_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        EGAConfig(**overrides)


def test_every_paper_variant_builds():
    for name in VARIANTS:
        config = EGAConfig.from_variant(name, hidden_size=16, num_hidden_layers=2, num_attention_heads=2)
        model = EGAForCausalLM(config)
        gated = [layer.attn.energy_gate is not None for layer in model.model.h]
        assert gated == ([False, False] if name == "BASE" else [True, True])


def test_unknown_variant_lists_the_known_ones():
    with pytest.raises(ValueError, match="EGA-1"):
        EGAConfig.from_variant("EGA-7")


def test_authors_setup_has_12480_gate_parameters():
    """SPEC 1.1: 260 per head at C = 256, 12,480 for 6 layers x 8 heads, ~0.26% of the model."""
    model = EGAForCausalLM(EGAConfig())
    gate = sum(p.numel() for name, p in model.named_parameters() if ".energy_gate." in name)
    assert gate == 12_480
    per_head = sum(p.numel() for p in model.model.h[0].attn.energy_gate.parameters()) / 8
    assert per_head == 260
    total = sum(p.numel() for p in model.parameters())
    assert 0.0024 < gate / total < 0.0028


def test_window_normalisation_is_flagged_as_seeing_the_future():
    assert EGAConfig(energy_normalization="window").sees_future
    assert not EGAConfig(energy_normalization="causal").sees_future
    assert not EGAConfig(energy_normalization="window", energy_gate_layers=[]).sees_future


def test_config_round_trips_through_json(tmp_path):
    config = EGAConfig.from_variant("EGA-C", hidden_size=32, energy_scales=[3, 5])
    config.save_pretrained(tmp_path)
    loaded = EGAConfig.from_pretrained(tmp_path)
    assert loaded.to_dict() == config.to_dict()
    assert loaded.tie_word_embeddings is True
