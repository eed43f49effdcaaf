"""EnergyGateConfig: every bad value and every setting the chosen energy would ignore is refused by name."""

import json
import logging

import pytest

from hf_spectral.retrofit import EnergyGateConfig
from hf_spectral.retrofit.config import CONFIG_NAME

NAN, INF = float("nan"), float("inf")

BAD_CONFIGS = [
    (dict(normalization="global"), r"`normalization` must be one of \('causal', 'window', 'none'\), got 'global'"),
    (dict(energy_kind="fourier"), r"`energy_kind` must be one of \('linear', .*\), got 'fourier'"),
    (dict(projections=0), r"`projections` must be a positive integer, got 0"),
    (dict(projections=True), r"`projections` must be a positive integer, got True"),
    (dict(projections=2.0), r"`projections` must be a positive integer, got 2.0"),
    (dict(tau_init=NAN), r"`tau_init` must be a finite number, got nan"),
    (dict(alpha_init=INF), r"`alpha_init` must be a finite number, got inf"),
    (dict(alpha_init="0"), r"`alpha_init` must be a finite number, got '0'"),
    (dict(eps=NAN), r"`eps` must be a finite number, got nan"),
    (dict(eps=0), r"`eps` must be positive, got 0"),
    (dict(morlet_learnable="no"), r"`morlet_learnable` must be True or False, got 'no'"),
    (dict(energy_kind="morlet", morlet_learnable=1), r"`morlet_learnable` must be True or False, got 1"),
    (dict(energy_kind="conv", scales=[0]), r"`scales` must be a non-empty list of positive integers, got \[0\]"),
    (dict(energy_kind="conv", scales=[]), r"`scales` must be a non-empty list of positive integers, got \[\]"),
    (dict(layers=[]), r"`layers` must not be empty"),
    (dict(layers=[-1]), r"`layers` must hold integer indices >= 0, got -1"),
    (dict(layers=[1, 1]), r"`layers` lists an index twice: \[1, 1\]"),
    (dict(heads=[True]), r"`heads` must hold integer indices >= 0, got True"),
    (dict(heads="0"), r"`heads` must be a list of indices, got '0'"),
    # combinations that would be silently ignored
    (dict(scales=[3]), r"`scales=\[3\]` applies to conv/morlet/db energies .* ignored with `energy_kind='linear'`"),
    (dict(energy_kind="conv", projections=3),
     r"`projections=3` applies to linear energies .* ignored with `energy_kind='conv'`"),
    (dict(morlet_learnable=False), r"`morlet_learnable=False` applies to Morlet energies .* `energy_kind='linear'`"),
    (dict(normalization="none", eps=1e-3), r"`eps=0.001` .* ignored with `normalization='none'`"),
]


@pytest.mark.parametrize("overrides, message", BAD_CONFIGS, ids=[str(row[0]) for row in BAD_CONFIGS])
def test_bad_values_and_ignored_combinations_are_refused_with_field_and_value(overrides, message):
    with pytest.raises(ValueError, match=message):
        EnergyGateConfig(**overrides)


def test_good_configs_are_normalised():
    config = EnergyGateConfig(layers=[3, 1], heads=(2, 0), energy_kind="db4")
    assert config.layers == [1, 3] and config.heads == [0, 2] and config.scales == [1, 2, 4, 8]
    assert EnergyGateConfig(energy_kind="morlet", morlet_learnable=False, scales=(3, 7)).scales == [3, 7]
    assert EnergyGateConfig(normalization="none").eps == 1e-5


def test_round_trip_and_loading_checks(tmp_path, caplog):
    config = EnergyGateConfig(energy_kind="conv", scales=[3, 5], layers=[0], alpha_init=0.5)
    config.save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING):
        assert EnergyGateConfig.from_pretrained(tmp_path) == config
    assert caplog.records == []
    values = json.loads((tmp_path / CONFIG_NAME).read_text())
    del values["normalization"]
    (tmp_path / CONFIG_NAME).write_text(json.dumps(values))
    with caplog.at_level(logging.WARNING):
        assert EnergyGateConfig.from_pretrained(tmp_path).normalization == "causal"
    assert "no value for ['normalization']" in caplog.text
    values["normalisation"] = "window"
    (tmp_path / CONFIG_NAME).write_text(json.dumps(values))
    with pytest.raises(ValueError, match=r"unknown energy-gate config keys \['normalisation'\]"):
        EnergyGateConfig.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match=CONFIG_NAME):
        EnergyGateConfig.from_pretrained(tmp_path / "missing")
    for corrupt, why in (('{"normalization": "cau', "Unterminated string"), ("[1, 2]", "holds a list, not an object")):
        (tmp_path / CONFIG_NAME).write_text(corrupt)  # a truncated or foreign file: named, not a bare JSON error
        with pytest.raises(ValueError, match=f"{tmp_path / CONFIG_NAME} is not a valid {CONFIG_NAME}: .*{why}"):
            EnergyGateConfig.from_pretrained(tmp_path)


def test_window_statistics_are_said_to_see_future_tokens(caplog):
    with caplog.at_level(logging.WARNING):
        EnergyGateConfig()
    assert "FUTURE" not in caplog.text
    with caplog.at_level(logging.WARNING):
        EnergyGateConfig(normalization="window")
    assert "SEES FUTURE TOKENS" in caplog.text
