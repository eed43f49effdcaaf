"""Configuration of an energy-gate retrofit (which layers and heads get a gate, and what kind)."""

import json
import os
from dataclasses import asdict, dataclass, field, fields

from transformers.utils import logging

from ..ops.energy_gate import DEFAULT_ENERGY_NORM_EPS, ENERGY_KINDS, default_scales
from ..ops.energy_gate import NORMALIZATIONS as ENERGY_NORMALIZATIONS
from ..ops.validation import (
    check_bool,
    check_choice,
    check_energy_settings,
    check_finite,
    check_index_list,
    check_positive,
    check_positive_int,
)

logger = logging.get_logger(__name__)

CONFIG_NAME = "energy_gate_config.json"
# Starting values of gate parameters: gates configured alike but for these compute the same once their weights are
# loaded (α = 0 makes a gate the identity whatever τ is).
INIT_ONLY_FIELDS = ("tau_init", "alpha_init")


@dataclass
class EnergyGateConfig:
    """What `add_energy_gates` injects. Defaults give EGA-1 gates with causal statistics that start as the identity."""

    normalization: str = field(
        default="causal",
        metadata={"help": "Energy statistics: 'causal' (prefix, no future leak), 'window' (authors', sees the future) or 'none'."},
    )
    energy_kind: str = field(
        default="linear", metadata={"help": "Energy function: linear, conv, morlet, db2 or db4 (SPEC 1.3)."}
    )
    projections: int = field(default=1, metadata={"help": "Linear projections per head (EGA-k), each with its own gate."})
    scales: list[int] | None = field(
        default=None,
        metadata={"help": "Kernel lengths (conv, morlet; default 3,7,15,31) or dilations (db2, db4; default 1,2,4,8)."},
    )
    layers: list[int] | None = field(default=None, metadata={"help": "Layer indices to gate; None gates every layer."})
    heads: list[int] | None = field(
        default=None,
        metadata={"help": "Key/value head indices to gate (others keep their attention); None gates every head."},
    )
    tau_init: float = field(default=0.0, metadata={"help": "Initial gate threshold τ."})
    alpha_init: float = field(
        default=0.0,
        metadata={"help": "Initial gate slope α. 0 makes every gate the identity, so the model's outputs are unchanged."},
    )
    eps: float = field(default=1e-5, metadata={"help": "Lower bound on the std used to normalise energies."})
    morlet_learnable: bool = field(default=True, metadata={"help": "Learn ω₀ and σ of Morlet energies (EGA-M)."})

    def __post_init__(self):
        # Every value is checked here (a plain dataclass: types too), with the field's name and value in the
        # message; settings that the chosen energy would ignore are refused.
        check_choice("normalization", self.normalization, ENERGY_NORMALIZATIONS)
        check_choice("energy_kind", self.energy_kind, ENERGY_KINDS)
        check_positive_int("projections", self.projections)
        check_finite("tau_init", self.tau_init)
        check_finite("alpha_init", self.alpha_init)  # a NaN/inf slope breaks the identity at α = 0
        check_positive("eps", self.eps)
        check_bool("morlet_learnable", self.morlet_learnable)
        if self.scales is None:
            self.scales = default_scales(self.energy_kind)
        check_energy_settings(
            self.energy_kind,
            projections=("projections", self.projections),
            scales=("scales", self.scales),
            morlet_learnable=self.morlet_learnable,
            normalization=("normalization", self.normalization),
            eps=("eps", self.eps),
            default_eps=DEFAULT_ENERGY_NORM_EPS,
        )
        if self.scales is not None:
            self.scales = list(self.scales)
        for name in ("layers", "heads"):
            value = getattr(self, name)
            if value is not None:
                check_index_list(name, value, allow_empty=False)
                setattr(self, name, sorted(value))
        if self.normalization == "window":  # every model the retrofit takes is a causal decoder
            logger.warning(
                "EnergyGateConfig(normalization='window'): the gate statistics are taken over the whole sequence, so "
                "every position of the causal model SEES FUTURE TOKENS. Use it to reproduce the authors' numbers; "
                "compare causal LMs only through the leak-free evaluation."
            )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "EnergyGateConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"unknown energy-gate config keys {sorted(unknown)}; expected a subset of {sorted(known)}")
        missing = sorted(known - set(values))
        if missing:
            logger.warning(
                f"EnergyGateConfig: the loaded gate config has no value for {missing}; using the defaults. If the "
                "gates were made with other values, the model's outputs will differ."
            )
        return cls(**values)

    def save_pretrained(self, save_directory: str) -> str:
        """Write ``energy_gate_config.json`` into ``save_directory`` (e.g. next to a PEFT adapter)."""
        os.makedirs(save_directory, exist_ok=True)
        path = os.path.join(save_directory, CONFIG_NAME)
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(self.to_dict(), handle, indent=2)
        return path

    @classmethod
    def from_pretrained(cls, directory: str) -> "EnergyGateConfig":
        path = os.path.join(directory, CONFIG_NAME)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no {CONFIG_NAME} in {directory}")
        return cls.from_dict(read_gate_config_file(path))


def read_gate_config_file(path: str) -> dict:
    """The values an ``energy_gate_config.json`` holds; a file that is no JSON object is refused with its path."""
    try:
        with open(path, encoding="utf-8") as handle:
            values = json.load(handle)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not a valid {CONFIG_NAME}: {error}") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path} is not a valid {CONFIG_NAME}: it holds a {type(values).__name__}, not an object")
    return values


def gate_structure(values: dict) -> dict:
    """The entries of a gate configuration that decide the gates' parameters and what they compute: all but the
    starting values (``INIT_ONLY_FIELDS``). Two gate configurations are the same gates when these are equal."""
    return {key: value for key, value in values.items() if key not in INIT_ONLY_FIELDS}
