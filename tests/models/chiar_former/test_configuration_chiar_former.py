"""ChiarConfig: defaults, derived layouts and clear errors for bad values."""

import json
import logging

import pytest
from huggingface_hub.errors import StrictDataclassClassValidationError, StrictDataclassFieldValidationError
from transformers import AutoConfig

from hf_spectral import ChiarConfig

from .chiar_testing import tiny_config


def test_defaults_are_the_authors_small_model():
    config = ChiarConfig()
    assert config.model_type == "chiar_former"
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (256, 4, 4)
    assert config.layer_operators == ["dct", "routed", "routed", "attention"]
    assert config.routed_operators == ["dct", "attention"]
    assert config.router_type == "threshold" and config.layer_norm_position == "post"
    assert config.intermediate_size == 1024 and config.tie_word_embeddings
    assert config.routed_layers == [1, 2]
    assert config.thresholds_for(1) == [0.86]
    assert config.router_usage_entropy_weight == 0.0  # regulariser off by default


def test_default_layout_follows_the_depth():
    assert tiny_config(num_hidden_layers=6).layer_operators == ["dct"] + ["routed"] * 4 + ["attention"]
    assert tiny_config(num_hidden_layers=1).layer_operators == ["routed"]


def test_cache_layer_types_follow_the_operators():
    config = tiny_config(routed_operators=["dct", "rbf", "attention"])
    assert config.layer_types == ["linear_attention", "hybrid", "hybrid", "full_attention"]
    assert tiny_config(layer_operators=["dct", "rbf", "attention", "routed"]).layer_types == [
        "linear_attention", "linear_attention", "full_attention", "full_attention"
    ]
    # A DCT layer keeps no state, but not a DummyLayer ("moe"): transformers reads the cache's length from layer 0.
    # Without any attention the cache is purely recurrent (generation then runs the linear-cache path).
    assert tiny_config(layer_operators=["dct", "rbf"], num_hidden_layers=2).layer_types == ["linear_attention"] * 2


def test_thresholds_per_layer_override_the_shared_ones():
    config = tiny_config(routed_operators=["dct", "rbf", "attention"], layer_thresholds=[None, [0.2, 0.4], None, None])
    assert config.thresholds_for(1) == [0.2, 0.4]
    assert config.thresholds_for(2) == [config.tau_lo, config.tau_hi]


def test_config_round_trips_through_json(tmp_path):
    config = tiny_config(routed_operators=["dct", "rbf", "attention"], router_type="hard", layer_norm_position="pre")
    config.save_pretrained(tmp_path)
    loaded = ChiarConfig.from_pretrained(tmp_path)
    for name in ("layer_operators", "routed_operators", "router_type", "layer_norm_position", "rbf_gamma", "tau_lo"):
        assert getattr(loaded, name) == getattr(config, name)


NAN, INF = float("nan"), float("inf")
THREE = ["dct", "rbf", "attention"]

# Every bad value or ignored combination, with the message it must raise. Wrong types are refused by `@strict`
# (huggingface_hub's StrictDataclassFieldValidationError, as for every transformers config); the rest by ValueError.
BAD_CONFIGS = [
    (dict(vocab_size=0), ValueError, r"`vocab_size` must be a positive integer, got 0"),
    (dict(rbf_num_features=0), ValueError, r"`rbf_num_features` must be a positive integer, got 0"),
    (dict(rbf_chunk_size=-8), ValueError, r"`rbf_chunk_size` must be a positive integer, got -8"),
    (dict(intermediate_size=0), ValueError, r"`intermediate_size` must be a positive integer, got 0"),
    (dict(hidden_size=30), ValueError, r"`hidden_size` \(30\) must be divisible"),
    (dict(hidden_size=12, num_attention_heads=4), ValueError, r"`hidden_size` / `num_attention_heads` must be even"),
    (dict(num_attention_heads=True), StrictDataclassFieldValidationError, r"num_attention_heads.*expected int"),
    (dict(hidden_act="swishy"), ValueError, r"`hidden_act` must be one of .*, got 'swishy'"),
    (dict(hidden_dropout=1.0), ValueError, r"`hidden_dropout` must be in \[0, 1\), got 1.0"),
    (dict(attention_dropout=NAN), ValueError, r"`attention_dropout` must be a finite number, got nan"),
    (dict(classifier_dropout=-0.5), ValueError, r"`classifier_dropout` must be in \[0, 1\), got -0.5"),
    (dict(layer_norm_eps=-1), ValueError, r"`layer_norm_eps` must be positive, got -1"),
    (dict(layer_norm_eps=INF), ValueError, r"`layer_norm_eps` must be a finite number, got inf"),
    (dict(initializer_range=NAN), ValueError, r"`initializer_range` must be a finite number, got nan"),
    (dict(rope_theta=INF), ValueError, r"`rope_theta` must be a finite number, got inf"),
    (dict(rope_theta=0), ValueError, r"`rope_theta` must be positive, got 0"),
    (dict(rbf_gamma=INF), ValueError, r"`rbf_gamma` must be a finite number, got inf"),
    (dict(rbf_gamma=-1.0), ValueError, r"`rbf_gamma` must be positive, got -1.0"),
    (dict(router_type="hard", router_usage_entropy_weight=INF), ValueError,
     r"`router_usage_entropy_weight` must be a finite number, got inf"),
    (dict(router_usage_entropy_weight=-0.01), ValueError, r"`router_usage_entropy_weight` must be >= 0, got -0.01"),
    (dict(attention_bias="yes"), StrictDataclassFieldValidationError, r"attention_bias.*expected bool.*'yes'"),
    (dict(is_causal=0), StrictDataclassFieldValidationError, r"is_causal.*expected bool"),
    (dict(layer_operators=["dct", "fourier", "routed", "attention"]), ValueError,
     r"`layer_operators` has unknown operators \['fourier'\]"),
    (dict(layer_operators=["dct", "routed", "attention"]), ValueError,
     r"`layer_operators` has 3 entries but `num_hidden_layers` is 4"),
    (dict(routed_operators=["dct", "convolution"]), ValueError, r"`routed_operators` has unknown operators"),
    (dict(routed_operators=["attention"]), ValueError, r"`routed_operators` must list 2 or 3 distinct operators"),
    (dict(routed_operators=["dct", "dct"]), ValueError, r"`routed_operators` must list 2 or 3 distinct operators"),
    (dict(router_type="learned"), ValueError, r"`router_type` must be one of \('threshold', 'hard', 'soft'\)"),
    (dict(routed_execution="lazy"), ValueError, r"`routed_execution` must be one of .*, got 'lazy'"),
    (dict(rbf_variant="cosine"), ValueError, r"`rbf_variant` must be one of .*, got 'cosine'"),
    (dict(layer_norm_position="sandwich"), ValueError, r"`layer_norm_position` must be one of .*, got 'sandwich'"),
    (dict(dct_implementation="wavelet"), ValueError, r"`dct_implementation` must be one of .*, got 'wavelet'"),
    (dict(classifier_pooling="max"), ValueError, r"`classifier_pooling` must be one of .*, got 'max'"),
    (dict(tau_mid=1.2), ValueError, r"`tau_mid` must lie in \[0, 1\].*\[1.2\]"),
    (dict(tau_mid=NAN), ValueError, r"`tau_mid` must lie in \[0, 1\].*nan"),
    (dict(tau_lo=-0.1), ValueError, r"`tau_lo` must lie in \[0, 1\]"),
    (dict(tau_hi=1.5), ValueError, r"`tau_hi` must lie in \[0, 1\]"),
    (dict(tau_lo=0.9, tau_hi=0.8), ValueError, r"`tau_lo` \(0.9\) must not exceed `tau_hi` \(0.8\)"),
    (dict(layer_thresholds=[None, [1.3], None, None]), ValueError, r"`layer_thresholds\[1\]` must lie in \[0, 1\]"),
    (dict(routed_operators=THREE, layer_thresholds=[None, [0.7, 0.6], None, None]), ValueError,
     r"`layer_thresholds\[1\]`: τ_lo must not exceed τ_hi"),
    (dict(layer_thresholds=[None, [0.5, 0.6], None, None]), ValueError,
     r"`layer_thresholds\[1\]` must hold 1 value\(s\) for 2 routed operators"),
    (dict(layer_thresholds=[None, [0.5]]), ValueError, r"`layer_thresholds` has 2 entries but `num_hidden_layers` is 4"),
    (dict(layer_operators=["rbf", "attention"], num_hidden_layers=2, rbf_variant="authors"), ValueError,
     r"`rbf_variant='authors'` .* cannot be used in a causal model"),
    # combinations that would be silently ignored
    (dict(router_usage_entropy_weight=0.01), ValueError,
     r"`router_usage_entropy_weight=0.01` regularises router probabilities, which `router_type='threshold'`"),
    (dict(layer_thresholds=[[0.5], None, None, None]), ValueError,
     r"`layer_thresholds\[0\]=\[0.5\]` would be ignored: layer 0 runs 'dct', not 'routed'"),
    (dict(layer_operators=["dct", "attention"], num_hidden_layers=2, router_type="soft"), ValueError,
     r"router_type='soft' would be ignored: no layer is 'routed'"),
    (dict(layer_operators=["dct", "attention"], num_hidden_layers=2, routed_operators=THREE), ValueError,
     r"routed_operators=\['dct', 'rbf', 'attention'\] would be ignored: no layer is 'routed'"),
    (dict(layer_operators=["dct", "attention"], num_hidden_layers=2, tau_mid=0.5), ValueError,
     r"tau_mid=0.5 would be ignored: no layer is 'routed'"),
    (dict(layer_operators=["dct", "attention"], num_hidden_layers=2, tau_lo=0.1, tau_hi=0.2), ValueError,
     r"tau_lo=0.1, tau_hi=0.2 would be ignored: no layer is 'routed'"),
    (dict(router_type="hard", tau_mid=0.5), ValueError,
     r"tau_mid=0.5 would be ignored: `router_type='hard'` learns its routing"),
    (dict(router_type="soft", routed_operators=THREE, layer_thresholds=[None, [0.2, 0.4], None, None]), ValueError,
     r"`layer_thresholds` would be ignored: `router_type='soft'` learns its routing"),
    (dict(tau_lo=0.1), ValueError, r"tau_lo=0.1 would be ignored: 2 routed operators .* split by `tau_mid`"),
    (dict(routed_operators=THREE, tau_mid=0.5), ValueError,
     r"tau_mid=0.5 would be ignored: 3 routed operators .* split by `tau_lo` / `tau_hi`"),
]


@pytest.mark.parametrize("overrides, error, message", BAD_CONFIGS, ids=[str(row[0]) for row in BAD_CONFIGS])
def test_bad_values_and_ignored_combinations_are_refused_with_field_and_value(overrides, error, message):
    with pytest.raises(error, match=message):
        tiny_config(**overrides)


def saved_config(tmp_path, **overrides) -> dict:
    tiny_config(**overrides).save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


def test_loading_our_own_saved_config_is_silent(tmp_path, caplog):
    saved_config(tmp_path, routed_operators=THREE, router_type="hard")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        ChiarConfig.from_pretrained(tmp_path)
        AutoConfig.from_pretrained(tmp_path)
    assert [r for r in caplog.records if "loaded config" in r.getMessage()] == []


def test_a_loaded_config_without_a_computation_field_or_with_an_unknown_key_warns_naming_them(tmp_path, caplog):
    values = saved_config(tmp_path)
    del values["rope_theta"]
    values["router"] = values.pop("router_type")
    (tmp_path / "config.json").write_text(json.dumps(values))
    with caplog.at_level(logging.WARNING):
        config = AutoConfig.from_pretrained(tmp_path)
    assert config.rope_theta == 10000.0
    warning = " ".join(r.getMessage() for r in caplog.records)
    assert "no value for ['rope_theta', 'router_type']" in warning
    assert "not ChiarConfig fields and are ignored: ['router']" in warning


def test_authors_rbf_is_accepted_in_an_encoder():
    config = tiny_config(layer_operators=["rbf", "attention"], num_hidden_layers=2, rbf_variant="authors", is_causal=False)
    assert config.rbf_variant == "authors"


def test_regulariser_is_accepted_with_router_probabilities():
    assert tiny_config(router_type="hard", router_usage_entropy_weight=0.01).router_usage_entropy_weight == 0.01


def test_a_bad_value_assigned_after_construction_is_refused_at_save(tmp_path):
    config = tiny_config()
    config.layer_thresholds = [[0.5], None, None, None]  # layer 0 is DCT: the threshold would be ignored
    with pytest.raises(StrictDataclassClassValidationError, match=r"`layer_thresholds\[0\]=\[0.5\]` would be ignored"):
        config.save_pretrained(tmp_path)
    assert not (tmp_path / "config.json").exists()


def test_the_constructor_warns_about_an_unknown_keyword_but_not_about_transformers_keys(tmp_path, caplog):
    def constructor_warnings():
        return [r.getMessage() for r in caplog.records if "kept as plain attributes" in r.getMessage()]

    with caplog.at_level(logging.WARNING):
        config = tiny_config(router="hard", attn_implementation="eager")
    assert config.router == "hard" and config.router_type == "threshold"  # kept, but no field: hence the warning
    assert constructor_warnings() == [
        "ChiarConfig: keyword(s) that are no ChiarConfig field, kept as plain attributes the models do not read: "
        "`router` (did you mean `router_type`?)"
    ]
    config = tiny_config(attn_implementation="eager", num_labels=4)
    config.architectures = ["ChiarForCausalLM"]
    config.save_pretrained(tmp_path)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        ChiarConfig(**{**config.to_dict(), "routed_execution": "dense"})
        ChiarConfig.from_pretrained(tmp_path)
        AutoConfig.from_pretrained(tmp_path)
    assert constructor_warnings() == []


def test_a_value_assigned_after_construction_is_checked_when_a_model_is_built():
    from hf_spectral import ChiarForCausalLM

    config = tiny_config()
    config.num_hidden_layers = 3
    with pytest.raises(ValueError, match=r"`layer_operators` has 4 entries but `num_hidden_layers` is 3"):
        ChiarForCausalLM(config)
