"""ChiarConfig: defaults, derived layouts and clear errors for bad values."""

import pytest

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
    assert config.layer_types == ["moe", "hybrid", "hybrid", "full_attention"]
    assert tiny_config(layer_operators=["dct", "rbf", "attention", "routed"]).layer_types == [
        "moe", "linear_attention", "full_attention", "full_attention"
    ]
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


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(layer_operators=["dct", "fourier", "routed", "attention"]), "layer_operators"),
        (dict(routed_operators=["dct", "convolution"]), "routed_operators"),
        (dict(routed_operators=["attention"]), "routed_operators"),
        (dict(routed_operators=["dct", "dct"]), "routed_operators"),
        (dict(layer_operators=["dct", "routed", "attention"]), "layer_operators"),
        (dict(num_hidden_layers=3, layer_operators=["dct", "routed", "routed", "attention"]), "layer_operators"),
        (dict(tau_mid=1.2), "tau_mid"),
        (dict(tau_lo=-0.1), "tau_lo"),
        (dict(tau_hi=1.5), "tau_hi"),
        (dict(tau_lo=0.9, tau_hi=0.8), "tau_lo"),
        (dict(layer_thresholds=[None, [1.3], None, None]), "layer_thresholds[1]"),
        (dict(routed_operators=["dct", "rbf", "attention"], layer_thresholds=[None, [0.7, 0.6], None, None]),
         "layer_thresholds[1]"),
        (dict(layer_thresholds=[None, [0.5, 0.6], None, None]), "layer_thresholds[1]"),
        (dict(layer_thresholds=[None, [0.5]]), "layer_thresholds"),
        (dict(router_type="learned"), "router_type"),
        (dict(routed_execution="lazy"), "routed_execution"),
        (dict(rbf_variant="cosine"), "rbf_variant"),
        (dict(layer_norm_position="sandwich"), "layer_norm_position"),
        (dict(dct_implementation="wavelet"), "dct_implementation"),
        (dict(classifier_pooling="max"), "classifier_pooling"),
        (dict(hidden_size=30), "hidden_size"),
        (dict(hidden_size=12, num_attention_heads=4), "hidden_size"),  # odd head dim: RoPE needs pairs
        (dict(hidden_dropout=1.0), "hidden_dropout"),
        (dict(rbf_num_features=0), "rbf_num_features"),
        (dict(rbf_gamma=-1.0), "rbf_gamma"),
        (dict(router_usage_entropy_weight=-0.01), "router_usage_entropy_weight"),
        (dict(router_usage_entropy_weight=0.01), "router_usage_entropy_weight"),  # threshold routing has no probs
        (dict(layer_operators=["rbf", "attention"], num_hidden_layers=2, rbf_variant="authors"), "rbf_variant"),
    ],
)
def test_bad_values_raise_a_value_error_naming_the_field(overrides, field):
    with pytest.raises(ValueError) as error:
        tiny_config(**overrides)
    assert f"`{field}" in str(error.value)


def test_authors_rbf_is_accepted_in_an_encoder():
    config = tiny_config(layer_operators=["rbf", "attention"], num_hidden_layers=2, rbf_variant="authors", is_causal=False)
    assert config.rbf_variant == "authors"


def test_regulariser_is_accepted_with_router_probabilities():
    assert tiny_config(router_type="hard", router_usage_entropy_weight=0.01).router_usage_entropy_weight == 0.01
