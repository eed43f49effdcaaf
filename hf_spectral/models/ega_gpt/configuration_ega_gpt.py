"""EGA-GPT configuration: a GPT (pre-LN, learned absolute positions, tied embeddings) whose attention
layers carry an energy gate (SPEC 1.1-1.4)."""

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig
from transformers.activations import ACT2FN
from transformers.utils import logging

from ...ops.energy_gate import DEFAULT_ENERGY_NORM_EPS, ENERGY_KINDS, default_scales
from ...ops.energy_gate import NORMALIZATIONS as ENERGY_NORMALIZATIONS
from ...ops.pooling import POOLING_MODES
from ...ops.validation import (
    CheckedConfigMixin,
    check_bool,
    check_choice,
    check_energy_settings,
    check_finite,
    check_index_list,
    check_known_keys,
    check_non_negative,
    check_positive,
    check_positive_int,
    check_probability,
)

logger = logging.get_logger(__name__)


# The papers' ablations as config overrides (SPEC 1.3-1.4). "BASE" is the same class without gates.
VARIANTS = {
    "BASE": {"energy_gate_layers": []},
    "EGA-1": {"energy_kind": "linear", "energy_projections": 1},
    "EGA-2": {"energy_kind": "linear", "energy_projections": 2},
    "EGA-4": {"energy_kind": "linear", "energy_projections": 4},
    "EGA-C": {"energy_kind": "conv"},
    "EGA-M-F": {"energy_kind": "morlet", "morlet_learnable": False},
    "EGA-M": {"energy_kind": "morlet", "morlet_learnable": True},
    "EGA-DB2": {"energy_kind": "db2"},
    "EGA-DB4": {"energy_kind": "db4"},
}


@strict
class EGAConfig(CheckedConfigMixin, PreTrainedConfig):
    r"""
    Configuration of an EGA-GPT model. Defaults are the authors' setup (SPEC 1.4): 6 layers, 8 heads,
    C = 256, context 256, 65 characters, dropout 0.1, init N(0, 0.02), EGA-1 gates in every layer.

    Every value is checked when the config is built: a wrong type raises huggingface_hub's
    `StrictDataclassFieldValidationError` (as for every transformers config); a NaN, an infinite or out-of-range
    value, and a setting the chosen energy would ignore (e.g. `energy_projections=3` with `energy_kind="conv"`)
    raise a `ValueError` naming the field and the value. Loading a config.json that lacks one of these fields (its
    default then decides the computation) or has keys that are no field (e.g. a misspelt `energy_normalisation`)
    logs a warning naming them; so does such a keyword given to the constructor (transformers keeps it as an
    attribute), while `from_variant` refuses it.

    Args:
        vocab_size (`int`): Number of token ids.
        max_position_embeddings (`int`): Length of the learned absolute position table (the context).
        hidden_size (`int`): Width C of the residual stream; the energy projections read all C channels.
        num_hidden_layers (`int`): Number of transformer blocks.
        num_attention_heads (`int`): Heads per attention layer; must divide `hidden_size`.
        intermediate_size (`int`, *optional*): MLP width, 4 × `hidden_size` when unset.
        hidden_act (`str`): MLP activation (GELU in the papers).
        embd_pdrop, resid_pdrop, attn_pdrop (`float`): Dropout on embeddings, residual branches and
            attention probabilities.
        layer_norm_eps (`float`): LayerNorm epsilon.
        initializer_range (`float`): Standard deviation of the N(0, σ) weight init.
        bias (`bool`): Biases in the linear layers and LayerNorms, as in GPT-2.
        use_cache (`bool`): Return a KV cache from forward passes (generation).
        energy_gate_layers (`list[int]`, *optional*): Which layers carry an energy gate. `None` (default) gates
            every layer; `[]` gives the ungated baseline with the same code path and parameter names.
        energy_kind (`str`): How the per-key energy is computed: `"linear"` (EGA-1/2/4: one Linear(C→1) per
            head and projection), `"conv"` (EGA-C: causal Conv1d(C→2) per head and kernel size, energy
            = out₀² + out₁²), `"morlet"` (EGA-M / EGA-M-F: one-sided causal Morlet filters of the channel-mean
            signal), `"db2"` / `"db4"` (Daubechies high-pass filters at dyadic dilations).
        energy_projections (`int`): Number k of linear projections per head (EGA-k), each with its own gate.
            Linear energies only (must stay 1 for the others).
        energy_scales (`list[int]`, *optional*): Kernel lengths for `conv` / `morlet` (default 3, 7, 15, 31),
            dilations for `db2` / `db4` (default 1, 2, 4, 8). Each scale has its own gate.
        morlet_learnable (`bool`): Learn ω₀ and σ of the Morlet filters (EGA-M) or keep them fixed (EGA-M-F).
            Morlet energies only (must stay True for the others).
        energy_normalization (`str`): Statistics used to z-normalise the energies: `"causal"` (default; key j
            uses the non-padding positions ≤ j, so no future token can move a gate), `"window"` (the authors'
            statistics over the whole sequence: **sees future tokens** in a causal LM) or `"none"`.
        energy_norm_eps (`float`): Lower bound on the standard deviation used for normalisation (> 0; not
            settable with `energy_normalization="none"`, which has no statistics).
        gate_tau_init (`float`): Initial gate threshold τ (authors: 0).
        gate_alpha_init (`float`): Initial gate slope α (authors: 2). With α = 0 a gate is the identity. Finite.
        classifier_pooling (`str`): Pooling of `EGAForSequenceClassification`: `"last"` (last non-padding
            token), `"mean"`, `"learned"` (softmax of learned per-position weights) or `"rmt_optimal"` (top
            eigenvector of an estimated position-correlation matrix, see `hf_spectral.rmt`).
        classifier_dropout (`float`): Dropout before the classification head.
    """

    model_type = "ega_gpt"
    keys_to_ignore_at_inference = ["cache"]

    vocab_size: int = 65
    max_position_embeddings: int = 256
    hidden_size: int = 256
    num_hidden_layers: int = 6
    num_attention_heads: int = 8
    intermediate_size: int | None = None
    hidden_act: str = "gelu"
    embd_pdrop: int | float = 0.1
    resid_pdrop: int | float = 0.1
    attn_pdrop: int | float = 0.1
    layer_norm_eps: int | float = 1e-5
    initializer_range: int | float = 0.02
    bias: bool = True
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    tie_word_embeddings: bool = True
    energy_gate_layers: list[int] | None = None
    energy_kind: str = "linear"
    energy_projections: int = 1
    energy_scales: list[int] | None = None
    morlet_learnable: bool = True
    energy_normalization: str = "causal"
    energy_norm_eps: int | float = DEFAULT_ENERGY_NORM_EPS
    gate_tau_init: int | float = 0.0
    gate_alpha_init: int | float = 2.0
    classifier_pooling: str = "last"
    classifier_dropout: int | float = 0.0

    def __post_init__(self, **kwargs):
        if self.intermediate_size is None:
            self.intermediate_size = 4 * self.hidden_size
        if self.energy_scales is None:
            self.energy_scales = default_scales(self.energy_kind)
        self._validate()
        super().__post_init__(**kwargs)
        if self.energy_normalization == "window" and self.gated_layers:
            logger.warning(
                "EGAConfig(energy_normalization='window'): the gate statistics are taken over the whole sequence, "
                "so every position SEES FUTURE TOKENS. Use it to reproduce the authors' numbers or for encoders; "
                "compare causal LMs only through the leak-free evaluation."
            )

    def _validate(self):
        # Every value is checked where it enters (types are checked by `@strict` on assignment): a NaN epsilon or a
        # setting that the chosen mechanism would ignore is refused with its name and value.
        for name in ("vocab_size", "max_position_embeddings", "hidden_size", "num_hidden_layers",
                     "num_attention_heads", "intermediate_size", "energy_projections"):
            check_positive_int(name, getattr(self, name))
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"`hidden_size` ({self.hidden_size}) must be divisible by `num_attention_heads` "
                f"({self.num_attention_heads})"
            )
        check_choice("hidden_act", self.hidden_act, sorted(ACT2FN))
        for name in ("embd_pdrop", "resid_pdrop", "attn_pdrop", "classifier_dropout"):
            check_probability(name, getattr(self, name))
        check_positive("layer_norm_eps", self.layer_norm_eps)
        check_non_negative("initializer_range", self.initializer_range)
        for name in ("bias", "use_cache", "tie_word_embeddings", "morlet_learnable"):
            check_bool(name, getattr(self, name))
        check_choice("energy_kind", self.energy_kind, ENERGY_KINDS)
        check_choice("energy_normalization", self.energy_normalization, ENERGY_NORMALIZATIONS)
        check_choice("classifier_pooling", self.classifier_pooling, POOLING_MODES)
        check_positive("energy_norm_eps", self.energy_norm_eps)
        check_finite("gate_tau_init", self.gate_tau_init)
        check_finite("gate_alpha_init", self.gate_alpha_init)
        if self.energy_gate_layers is not None:
            check_index_list("energy_gate_layers", self.energy_gate_layers, self.num_hidden_layers)

        # Settings the chosen energy would ignore.
        check_energy_settings(
            self.energy_kind,
            projections=("energy_projections", self.energy_projections),
            scales=("energy_scales", self.energy_scales),
            morlet_learnable=self.morlet_learnable,
            normalization=("energy_normalization", self.energy_normalization),
            eps=("energy_norm_eps", self.energy_norm_eps),
            default_eps=DEFAULT_ENERGY_NORM_EPS,
        )

    @property
    def gated_layers(self) -> list[int]:
        """Indices of the layers that carry an energy gate."""
        if self.energy_gate_layers is None:
            return list(range(self.num_hidden_layers))
        return sorted(set(self.energy_gate_layers))

    @property
    def sees_future(self) -> bool:
        """True when a causal LM built from this config lets future tokens move a gate (window statistics)."""
        return self.energy_normalization == "window" and bool(self.gated_layers)

    @classmethod
    def from_variant(cls, variant: str, **kwargs) -> "EGAConfig":
        """Config of one of the papers' models: BASE, EGA-1, EGA-2, EGA-4, EGA-C, EGA-M-F, EGA-M, EGA-DB2, EGA-DB4.

        ``kwargs`` override the size or any other field, e.g. ``from_variant("EGA-1", energy_normalization="window")``;
        a keyword that is no field (a misspelt ``energy_normalisation``) raises a ``ValueError`` naming it.
        """
        if variant not in VARIANTS:
            raise ValueError(f"unknown EGA variant {variant!r}; choose one of {list(VARIANTS)}")
        # Unlike the constructor (which transformers lets keep extra attributes), this call takes field values only.
        check_known_keys(cls, kwargs, f"EGAConfig.from_variant({variant!r})")
        return cls(**{**VARIANTS[variant], **kwargs})


__all__ = ["EGAConfig"]
