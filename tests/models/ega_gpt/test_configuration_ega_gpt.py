import json
import logging

import pytest
from huggingface_hub.errors import StrictDataclassClassValidationError, StrictDataclassFieldValidationError
from transformers import AutoConfig

from hf_spectral import EGAConfig, EGAForCausalLM
from hf_spectral.models.ega_gpt.configuration_ega_gpt import VARIANTS


NAN, INF = float("nan"), float("inf")

# Every bad value or ignored combination, with the message it must raise. Wrong types are refused by `@strict`
# (huggingface_hub's StrictDataclassFieldValidationError, as for every transformers config); the rest by ValueError.
BAD_CONFIGS = [
    ({"vocab_size": 0}, ValueError, r"`vocab_size` must be a positive integer, got 0"),
    ({"max_position_embeddings": -4}, ValueError, r"`max_position_embeddings` must be a positive integer, got -4"),
    ({"num_hidden_layers": -1}, ValueError, r"`num_hidden_layers` must be a positive integer, got -1"),
    ({"hidden_size": 30, "num_attention_heads": 4}, ValueError, r"`hidden_size` \(30\) must be divisible"),
    ({"intermediate_size": 0}, ValueError, r"`intermediate_size` must be a positive integer, got 0"),
    ({"energy_projections": 0}, ValueError, r"`energy_projections` must be a positive integer, got 0"),
    ({"vocab_size": True}, StrictDataclassFieldValidationError, r"vocab_size.*expected int, got bool"),
    ({"hidden_act": "gelux"}, ValueError, r"`hidden_act` must be one of \(.*'gelu'.*\), got 'gelux'"),
    ({"attn_pdrop": 1.5}, ValueError, r"`attn_pdrop` must be in \[0, 1\), got 1.5"),
    ({"resid_pdrop": NAN}, ValueError, r"`resid_pdrop` must be a finite number, got nan"),
    ({"embd_pdrop": -0.1}, ValueError, r"`embd_pdrop` must be in \[0, 1\), got -0.1"),
    ({"classifier_dropout": 1}, ValueError, r"`classifier_dropout` must be in \[0, 1\), got 1"),
    ({"layer_norm_eps": -1}, ValueError, r"`layer_norm_eps` must be positive, got -1"),
    ({"layer_norm_eps": NAN}, ValueError, r"`layer_norm_eps` must be a finite number, got nan"),
    ({"initializer_range": INF}, ValueError, r"`initializer_range` must be a finite number, got inf"),
    ({"initializer_range": -0.02}, ValueError, r"`initializer_range` must be >= 0, got -0.02"),
    ({"energy_norm_eps": NAN}, ValueError, r"`energy_norm_eps` must be a finite number, got nan"),
    ({"energy_norm_eps": 0.0}, ValueError, r"`energy_norm_eps` must be positive, got 0.0"),
    ({"gate_alpha_init": NAN}, ValueError, r"`gate_alpha_init` must be a finite number, got nan"),
    ({"gate_alpha_init": -INF}, ValueError, r"`gate_alpha_init` must be a finite number, got -inf"),
    ({"gate_tau_init": INF}, ValueError, r"`gate_tau_init` must be a finite number, got inf"),
    ({"bias": "yes"}, StrictDataclassFieldValidationError, r"bias.*expected bool.*'yes'"),
    ({"use_cache": 1}, StrictDataclassFieldValidationError, r"use_cache.*expected bool.*1"),
    ({"morlet_learnable": "no"}, StrictDataclassFieldValidationError, r"morlet_learnable.*expected bool.*'no'"),
    ({"energy_kind": "fourier"}, ValueError, r"`energy_kind` must be one of \('linear', .*\), got 'fourier'"),
    ({"energy_normalization": "global"}, ValueError, r"`energy_normalization` must be one of .*, got 'global'"),
    ({"classifier_pooling": "max"}, ValueError, r"`classifier_pooling` must be one of .*'rmt_optimal'\), got 'max'"),
    ({"energy_gate_layers": [0, 9]}, ValueError, r"`energy_gate_layers` must hold integer indices >= 0, < 6, got 9"),
    ({"energy_gate_layers": [1, 1]}, ValueError, r"`energy_gate_layers` lists an index twice: \[1, 1\]"),
    ({"energy_kind": "conv", "energy_scales": [3, -7]}, ValueError,
     r"`energy_scales` must be a non-empty list of positive integers, got \[3, -7\]"),
    ({"energy_kind": "morlet", "energy_scales": []}, ValueError, r"`energy_scales` must be a non-empty list"),
    # combinations that would be silently ignored
    ({"energy_scales": [3]}, ValueError, r"`energy_scales=\[3\]` applies to conv/morlet/db energies"),
    ({"energy_kind": "conv", "energy_projections": 3}, ValueError,
     r"`energy_projections=3` applies to linear energies .* ignored with `energy_kind='conv'`"),
    ({"energy_kind": "db2", "morlet_learnable": False}, ValueError,
     r"`morlet_learnable=False` applies to Morlet energies .* ignored with `energy_kind='db2'`"),
    ({"energy_normalization": "none", "energy_norm_eps": 1e-3}, ValueError,
     r"`energy_norm_eps=0.001` .* ignored with `energy_normalization='none'`"),
]


@pytest.mark.parametrize("overrides, error, message", BAD_CONFIGS, ids=[str(row[0]) for row in BAD_CONFIGS])
def test_bad_values_and_ignored_combinations_are_refused_with_field_and_value(overrides, error, message):
    with pytest.raises(error, match=message):
        EGAConfig(**overrides)


def test_every_good_combination_of_the_refused_fields_still_builds():
    EGAConfig(energy_kind="morlet", morlet_learnable=False, energy_scales=[3, 7])
    EGAConfig(energy_kind="linear", energy_projections=4)
    EGAConfig(energy_normalization="none")
    EGAConfig(gate_alpha_init=0, gate_tau_init=-1.5, initializer_range=0, energy_gate_layers=[])


def saved_config(tmp_path, **overrides) -> dict:
    EGAConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, **overrides).save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


def write_config(tmp_path, values: dict) -> None:
    (tmp_path / "config.json").write_text(json.dumps(values))


def test_loading_our_own_saved_config_is_silent(tmp_path, caplog):
    saved_config(tmp_path, energy_kind="conv", energy_normalization="window")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        EGAConfig.from_pretrained(tmp_path)
        AutoConfig.from_pretrained(tmp_path)
    assert [r for r in caplog.records if "loaded config" in r.getMessage()] == []


def test_a_loaded_config_without_a_computation_field_warns_naming_it(tmp_path, caplog):
    values = saved_config(tmp_path)
    del values["energy_normalization"]
    write_config(tmp_path, values)
    with caplog.at_level(logging.WARNING):
        config = AutoConfig.from_pretrained(tmp_path)
    assert config.energy_normalization == "causal"
    warning = " ".join(r.getMessage() for r in caplog.records)
    assert "no value for ['energy_normalization']" in warning and "energy_normalization='causal'" in warning


def test_a_misspelt_or_unknown_key_warns_naming_it(tmp_path, caplog):
    values = saved_config(tmp_path)
    values["energy_normalisation"] = values.pop("energy_normalization")
    values["gate_temperature"] = 3.0
    write_config(tmp_path, values)
    with caplog.at_level(logging.WARNING):
        EGAConfig.from_pretrained(tmp_path)
    warning = " ".join(r.getMessage() for r in caplog.records)
    assert "no value for ['energy_normalization']" in warning
    assert "not EGAConfig fields and are ignored: ['energy_normalisation', 'gate_temperature']" in warning


def test_overrides_at_load_time_are_checked_with_the_file(tmp_path, caplog):
    saved_config(tmp_path)
    loaded = EGAConfig.from_pretrained(tmp_path, energy_kind="conv")
    assert loaded.energy_kind == "conv" and loaded.energy_scales == [3, 7, 15, 31]  # derived like a fresh config
    with pytest.raises(ValueError, match="energy_norm_eps"):
        EGAConfig.from_pretrained(tmp_path, energy_norm_eps=float("nan"))


def test_every_paper_variant_builds():
    for name in VARIANTS:
        config = EGAConfig.from_variant(name, hidden_size=16, num_hidden_layers=2, num_attention_heads=2)
        model = EGAForCausalLM(config)
        gated = [layer.attn.energy_gate is not None for layer in model.model.h]
        assert gated == ([False, False] if name == "BASE" else [True, True])


def test_unknown_variant_lists_the_known_ones():
    with pytest.raises(ValueError, match="EGA-1"):
        EGAConfig.from_variant("EGA-7")



def test_from_variant_refuses_an_unknown_keyword_naming_the_closest_field():
    # A misspelt field once became a stray attribute while the field kept its default (`energy_normalization` stayed
    # 'causal' with `energy_normalisation="window"`).
    with pytest.raises(ValueError, match=r"from_variant\('EGA-1'\): unknown keyword\(s\) `energy_normalisation` "
                                         r"\(did you mean `energy_normalization`\?\), `zzz`;"):
        EGAConfig.from_variant("EGA-1", energy_normalisation="window", zzz=1, hidden_size=32, num_attention_heads=4)
    # Keys transformers' base config takes are no typo.
    config = EGAConfig.from_variant("EGA-2", hidden_size=32, num_attention_heads=4, attn_implementation="eager",
                                    dtype="float32", num_labels=3, pad_token_id=0, tie_word_embeddings=False)
    assert config._attn_implementation == "eager" and config.num_labels == 3 and config.energy_projections == 2


def _constructor_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "kept as plain attributes" in r.getMessage()]


def test_the_constructor_keeps_an_unknown_keyword_but_warns_naming_it(caplog):
    with caplog.at_level(logging.WARNING):
        config = EGAConfig(energy_normalisation="window", hidden_size=32, num_attention_heads=4)
    assert config.energy_normalisation == "window"  # transformers keeps extra attributes by design
    assert _constructor_warnings(caplog) == [
        "EGAConfig: keyword(s) that are no EGAConfig field, kept as plain attributes the models do not read: "
        "`energy_normalisation` (did you mean `energy_normalization`?)"
    ]


def test_transformers_own_keywords_do_not_warn(tmp_path, caplog):
    config = EGAConfig(hidden_size=32, num_attention_heads=4, attn_implementation="eager", num_labels=3)
    config.architectures = ["EGAForCausalLM"]
    config.save_pretrained(tmp_path)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        EGAConfig(**config.to_dict())
        EGAConfig.from_dict(config.to_dict(), attn_implementation="sdpa")
        EGAConfig.from_pretrained(tmp_path)  # `auto_map`, `transformers_version`, `dtype`...
        AutoConfig.from_pretrained(tmp_path)
    assert _constructor_warnings(caplog) == []


def test_a_loaded_unknown_key_warns_once(tmp_path, caplog):
    values = saved_config(tmp_path)
    values["gate_temperature"] = 3.0
    write_config(tmp_path, values)
    with caplog.at_level(logging.WARNING):
        EGAConfig.from_pretrained(tmp_path)
    assert [r for r in caplog.records if "gate_temperature" in r.getMessage()] != []
    assert _constructor_warnings(caplog) == []  # only the loaded config's warning

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
    assert loaded.to_dict() == config.to_dict()  # the `auto_map` the save wrote included
    assert loaded.tie_word_embeddings is True


def test_a_bad_value_assigned_after_construction_is_refused_at_save(tmp_path):
    config = EGAConfig()
    config.gate_alpha_init = float("nan")
    with pytest.raises(StrictDataclassClassValidationError, match="`gate_alpha_init` must be a finite number"):
        config.save_pretrained(tmp_path)
    assert not (tmp_path / "config.json").exists()


@pytest.mark.parametrize("field, value, message", [
    ("num_attention_heads", 5, r"`hidden_size` \(24\) must be divisible by `num_attention_heads` \(5\)"),
    ("energy_kind", "conv", r"`energy_kind='conv'` needs `energy_scales`"),
])
def test_a_value_assigned_after_construction_is_checked_when_a_model_is_built(field, value, message):
    config = EGAConfig.from_variant("EGA-1", vocab_size=40, hidden_size=24, num_hidden_layers=2, num_attention_heads=3)
    setattr(config, field, value)
    with pytest.raises(ValueError, match=message):
        EGAForCausalLM(config)
