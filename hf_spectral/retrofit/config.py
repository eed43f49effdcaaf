"""Configuration of an energy-gate retrofit (which layers and heads get a gate, and what kind)."""

import json
import os
from dataclasses import asdict, dataclass, field, fields

from ..models.ega_gpt.configuration_ega_gpt import DEFAULT_DILATIONS, DEFAULT_KERNEL_SIZES, ENERGY_KINDS

CONFIG_NAME = "energy_gate_config.json"


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
        if self.normalization not in ("causal", "window", "none"):
            raise ValueError(f"`normalization` must be 'causal', 'window' or 'none', got {self.normalization!r}")
        if self.energy_kind not in ENERGY_KINDS:
            raise ValueError(f"`energy_kind` must be one of {ENERGY_KINDS}, got {self.energy_kind!r}")
        if not isinstance(self.projections, int) or self.projections <= 0:
            raise ValueError(f"`projections` must be a positive integer, got {self.projections!r}")
        if self.scales is None and self.energy_kind != "linear":
            self.scales = list(DEFAULT_KERNEL_SIZES if self.energy_kind in ("conv", "morlet") else DEFAULT_DILATIONS)
        if self.scales is not None:
            if self.energy_kind == "linear":
                raise ValueError("`scales` applies to conv/morlet/db energies; use `projections` for linear")
            self.scales = list(self.scales)
            if not self.scales or any(not isinstance(s, int) or s <= 0 for s in self.scales):
                raise ValueError(f"`scales` must be a non-empty list of positive integers, got {self.scales!r}")
        for name in ("layers", "heads"):
            value = getattr(self, name)
            if value is not None:
                value = sorted(set(value))
                if not value or any(not isinstance(i, int) or i < 0 for i in value):
                    raise ValueError(f"`{name}` must be a non-empty list of non-negative indices, got {getattr(self, name)!r}")
                setattr(self, name, value)
        if self.eps <= 0:
            raise ValueError(f"`eps` must be positive, got {self.eps!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "EnergyGateConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"unknown energy-gate config keys {sorted(unknown)}; expected a subset of {sorted(known)}")
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
        with open(path, encoding="utf-8") as handle:
            return cls.from_dict(json.load(handle))
