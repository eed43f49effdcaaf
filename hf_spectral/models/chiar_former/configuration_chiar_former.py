"""CHIAR-Former configuration: a stack of layers whose token-mixing operator is DCT mixing, RBF kernel mixing,
attention, or a per-token choice among them made from the token's spectral entropy (SPEC 2)."""

from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig
from transformers.activations import ACT2FN
from transformers.utils import logging

from ...ops.pooling import POOLING_MODES
from ...ops.random_features import RBF_VARIANTS
from ...ops.routing import ROUTER_TYPES
from ...ops.spectral import DCT_IMPLEMENTATIONS
from ...ops.validation import (
    CheckedConfigMixin,
    check_bool,
    check_choice,
    check_non_negative,
    check_positive,
    check_positive_int,
    check_probability,
)

logger = logging.get_logger(__name__)  # also where `CheckedConfigMixin.from_dict` warns about loaded keys

OPERATORS = ("dct", "rbf", "attention")
LAYER_OPERATORS = OPERATORS + ("routed",)
ROUTED_EXECUTIONS = ("sparse", "dense")
LAYER_NORM_POSITIONS = ("post", "pre")
# Defaults of the fields that only some layouts read: a different value where nothing reads it is refused.
DEFAULT_ROUTED_OPERATORS = ["dct", "attention"]
DEFAULT_TAU_MID, DEFAULT_TAU_LO, DEFAULT_TAU_HI = 0.86, 0.855, 0.865

# What each layer keeps in a `DynamicCache(config=...)` (transformers' layer types): keys/values for attention,
# the RBF prefix sums as a recurrent state. A DCT layer keeps no state but still takes a linear-attention layer,
# not a `DummyLayer` ("moe"): transformers (5.25 on) reads a cache's length from its first layer, which a DummyLayer
# cannot answer, and counts a linear-attention layer's tokens (`count_new_tokens` in the modeling file).
_CACHE_LAYER_TYPES = {
    (True, True): "hybrid",
    (True, False): "full_attention",
    (False, True): "linear_attention",
    (False, False): "linear_attention",
}


@strict
class ChiarConfig(CheckedConfigMixin, PreTrainedConfig):
    r"""
    Configuration of a CHIAR-Former. Defaults are the authors' small model (SPEC 2.3): 4 layers DCT / routed /
    routed / attention, d = 256, 4 heads, context 256, GPT-2 BPE vocabulary, post-LN, threshold routing between
    DCT mixing and attention.

    Every value is checked when the config is built: a wrong type raises huggingface_hub's
    `StrictDataclassFieldValidationError` (as for every transformers config); a NaN, an infinite or out-of-range
    value, and a routing setting the layout would ignore (thresholds on non-routed layers or with a learned
    router, `tau_lo`/`tau_hi` with 2 routed operators, router settings without routed layers) raise a `ValueError`
    naming the field and the value. Loading a config.json that lacks one of these fields or has keys that are no
    field logs a warning naming them.

    Args:
        vocab_size (`int`): Number of token ids (GPT-2 BPE: 50257).
        max_position_embeddings (`int`): Context length. Positions use RoPE, so this only sizes the learned /
            `rmt_optimal` pooling tables of the classification head.
        hidden_size (`int`): Width d of the residual stream; the DCT and the spectral entropy act on these d channels.
        num_hidden_layers (`int`): Number of layers; must equal `len(layer_operators)` when that is given.
        num_attention_heads (`int`): Heads of the attention operator; must divide `hidden_size`.
        intermediate_size (`int`, *optional*): FFN width, 4 × `hidden_size` when unset.
        hidden_act (`str`): FFN activation (GELU).
        hidden_dropout (`float`): Dropout on the embeddings and on every residual branch.
        attention_dropout (`float`): Dropout on attention probabilities.
        layer_norm_eps (`float`): LayerNorm epsilon.
        initializer_range (`float`): Standard deviation of the N(0, σ) weight init.
        attention_bias (`bool`): Biases on the query/key/value projections (the authors use them).
        rope_theta (`float`): RoPE base.
        layer_norm_position (`str`): `"post"` (authors: x ← LN(x + op(x)), then x ← LN(x + FFN(x))) or `"pre"`
            (x ← x + op(LN(x)), x ← x + FFN(LN(x)), final LayerNorm).
        is_causal (`bool`): Causal language model (default) or bidirectional encoder. Causal models only accept
            causal operators (see `rbf_variant`).
        layer_operators (`list[str]`, *optional*): Operator of each layer: `"dct"`, `"rbf"`, `"attention"` or
            `"routed"` (a per-token choice among `routed_operators`). Default: `"dct"`, then `"routed"` layers, then
            `"attention"` — for 4 layers the authors' DCT / routed / routed / attention.
        routed_operators (`list[str]`): Operators a routed layer chooses from, ordered from low to high spectral
            entropy: 2 (`["dct", "attention"]`, the authors' final "DCT+Attn" model) or 3
            (`["dct", "rbf", "attention"]`).
        router_type (`str`): `"threshold"` (no parameters: fixed entropy thresholds), `"hard"` (Linear([x, H]) →
            one operator per token, straight-through gradient) or `"soft"` (softmax blend of every operator's output;
            no compute saving).
        routed_execution (`str`): `"sparse"` (default: in threshold and hard routing each operator runs only on its
            tokens; attention gathers its routed tokens as queries against the keys and values of all tokens) or
            `"dense"` (every operator on every token, selected by one-hot gates, as the authors' code; same outputs).
        tau_mid (`float`): Threshold of 2-operator threshold routing: attention when H > τ_mid.
        tau_lo, tau_hi (`float`): Thresholds of 3-operator threshold routing: H < τ_lo → first operator,
            τ_lo ≤ H ≤ τ_hi → second, H > τ_hi → third. The defaults are the authors' calibrated 0.855 / 0.865
            at d = 256 (τ_mid between them); they depend on d and on the data, so calibrate them
            (`calibrate_thresholds`).
        layer_thresholds (`list`, *optional*): Per-layer thresholds overriding the τ fields: one entry per layer,
            `None` for non-routed layers, a list of 1 (τ_mid) or 2 (τ_lo, τ_hi) values for routed layers.
        router_usage_entropy_weight (`float`): λ of the usage-entropy regulariser λ (log K − H(ū)) added to the loss
            (authors: 0.01 when used; 0 = off). Needs router probabilities: hard or soft routing.
        dct_implementation (`str`): `"matrix"` (default: DCT matrices, split by one butterfly stage; 2.3-4× faster
            DCT mixing on CPU at d = 256 than `"fft"`, see `benchmarks/bench_chiar_former.py`) or `"fft"`.
        rbf_variant (`str`): `"positive"` (default): linear kernel attention with positive random features of the
            Gaussian kernel, causal through prefix sums in causal models, O(T·R·d). `"authors"`: softmax(φφᵀ) with
            trigonometric features over all tokens, unmasked — it reads future tokens, so only `is_causal=False`
            accepts it.
        rbf_num_features (`int`): Number R of random features (authors: 64).
        rbf_gamma (`float`, *optional*): Kernel width γ of exp(−γ‖x − y‖²); 1 / (4 `hidden_size`) when unset. The
            positive-feature estimate has relative variance (exp(2γ‖x + y‖²) − 1) / R; with LayerNorm-ed states
            (‖x‖² ≈ d) this default keeps it below ≈ 6 / R while independent states still get kernel e^{−1/2}.
        rbf_chunk_size (`int`): Chunk length of the causal prefix-sum computation.
        classifier_pooling (`str`): Pooling of `ChiarForSequenceClassification`: `"last"`, `"mean"`, `"learned"` or
            `"rmt_optimal"` (see `SequencePooling`).
        classifier_dropout (`float`): Dropout before the classification head.
        use_cache (`bool`): Return a cache from forward passes (generation).
    """

    model_type = "chiar_former"
    # Trainer's evaluation gathers only the logits (and the loss): the routing outputs stay out of `predictions`.
    keys_to_ignore_at_inference = [
        "cache", "routing_decisions", "routing_entropies", "routing_fractions", "router_probabilities", "aux_loss"
    ]

    vocab_size: int = 50257
    max_position_embeddings: int = 256
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    intermediate_size: int | None = None
    hidden_act: str = "gelu"
    hidden_dropout: int | float = 0.1
    attention_dropout: int | float = 0.0
    layer_norm_eps: int | float = 1e-5
    initializer_range: int | float = 0.02
    attention_bias: bool = True
    rope_theta: int | float = 10000.0
    layer_norm_position: str = "post"
    is_causal: bool = True
    layer_operators: list[str] | None = None
    routed_operators: list[str] | None = None
    router_type: str = "threshold"
    routed_execution: str = "sparse"
    tau_mid: int | float = DEFAULT_TAU_MID
    tau_lo: int | float = DEFAULT_TAU_LO
    tau_hi: int | float = DEFAULT_TAU_HI
    layer_thresholds: list[list[int | float] | None] | None = None
    router_usage_entropy_weight: int | float = 0.0
    dct_implementation: str = "matrix"
    rbf_variant: str = "positive"
    rbf_num_features: int = 64
    rbf_gamma: int | float | None = None
    rbf_chunk_size: int = 64
    classifier_pooling: str = "last"
    classifier_dropout: int | float = 0.0
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    tie_word_embeddings: bool = True

    def __post_init__(self, **kwargs):
        if self.intermediate_size is None:
            self.intermediate_size = 4 * self.hidden_size
        if self.layer_operators is None and isinstance(self.num_hidden_layers, int) and self.num_hidden_layers > 0:
            self.layer_operators = default_layer_operators(self.num_hidden_layers)
        if self.routed_operators is None:
            self.routed_operators = list(DEFAULT_ROUTED_OPERATORS)
        if self.rbf_gamma is None and isinstance(self.hidden_size, int) and self.hidden_size > 0:
            self.rbf_gamma = 1.0 / (4 * self.hidden_size)
        self._validate()
        super().__post_init__(**kwargs)

    def _validate(self):
        # Every value is checked where it enters (types are checked by `@strict` on assignment): a NaN, an infinite
        # base or a setting that the chosen layout would ignore is refused with its name and value.
        for name in ("vocab_size", "max_position_embeddings", "hidden_size", "num_hidden_layers",
                     "num_attention_heads", "intermediate_size", "rbf_num_features", "rbf_chunk_size"):
            check_positive_int(name, getattr(self, name))
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"`hidden_size` ({self.hidden_size}) must be divisible by `num_attention_heads` "
                f"({self.num_attention_heads})"
            )
        if (self.hidden_size // self.num_attention_heads) % 2:
            raise ValueError("`hidden_size` / `num_attention_heads` must be even (RoPE rotates channel pairs)")
        check_choice("hidden_act", self.hidden_act, sorted(ACT2FN))
        for name in ("hidden_dropout", "attention_dropout", "classifier_dropout"):
            check_probability(name, getattr(self, name))
        for name, allowed in (
            ("layer_norm_position", LAYER_NORM_POSITIONS),
            ("router_type", ROUTER_TYPES),
            ("routed_execution", ROUTED_EXECUTIONS),
            ("rbf_variant", RBF_VARIANTS),
            ("dct_implementation", DCT_IMPLEMENTATIONS),
            ("classifier_pooling", POOLING_MODES),
        ):
            check_choice(name, getattr(self, name), allowed)
        for name in ("layer_norm_eps", "rope_theta", "rbf_gamma"):
            check_positive(name, getattr(self, name))
        check_non_negative("initializer_range", self.initializer_range)
        check_non_negative("router_usage_entropy_weight", self.router_usage_entropy_weight)
        for name in ("attention_bias", "is_causal", "use_cache", "tie_word_embeddings"):
            check_bool(name, getattr(self, name))

        if not isinstance(self.layer_operators, list):
            raise ValueError(f"`layer_operators` must be a list of operator names, got {self.layer_operators!r}")
        unknown = [op for op in self.layer_operators if op not in LAYER_OPERATORS]
        if unknown:
            raise ValueError(f"`layer_operators` has unknown operators {unknown}; expected names in {LAYER_OPERATORS}")
        if len(self.layer_operators) != self.num_hidden_layers:
            raise ValueError(
                f"`layer_operators` has {len(self.layer_operators)} entries but `num_hidden_layers` is "
                f"{self.num_hidden_layers}; give one operator per layer"
            )
        unknown = [op for op in self.routed_operators if op not in OPERATORS]
        if unknown:
            raise ValueError(f"`routed_operators` has unknown operators {unknown}; expected names in {OPERATORS}")
        if len(self.routed_operators) not in (2, 3) or len(set(self.routed_operators)) != len(self.routed_operators):
            raise ValueError(
                f"`routed_operators` must list 2 or 3 distinct operators, low to high entropy, got {self.routed_operators!r}"
            )

        if self.is_causal and self.rbf_variant == "authors" and "rbf" in self.operators_in_use:
            raise ValueError(
                "`rbf_variant='authors'` (softmax(φφᵀ) over all tokens, no mask) reads future tokens and cannot be used "
                "in a causal model (`is_causal=True`); use `rbf_variant='positive'` (causal prefix sums) or build a "
                "bidirectional encoder with `is_causal=False`"
            )

        for name in ("tau_mid", "tau_lo", "tau_hi"):
            self._check_thresholds(name, [getattr(self, name)])
        if self.tau_lo > self.tau_hi:
            raise ValueError(f"`tau_lo` ({self.tau_lo}) must not exceed `tau_hi` ({self.tau_hi})")
        if self.layer_thresholds is not None:
            if len(self.layer_thresholds) != self.num_hidden_layers:
                raise ValueError(
                    f"`layer_thresholds` has {len(self.layer_thresholds)} entries but `num_hidden_layers` is "
                    f"{self.num_hidden_layers}"
                )
            for index, thresholds in enumerate(self.layer_thresholds):
                if thresholds is None:
                    continue
                if self.layer_operators[index] != "routed":
                    raise ValueError(
                        f"`layer_thresholds[{index}]={thresholds!r}` would be ignored: layer {index} runs "
                        f"{self.layer_operators[index]!r}, not 'routed'; give None for non-routed layers"
                    )
                if len(thresholds) != len(self.routed_operators) - 1:
                    raise ValueError(
                        f"`layer_thresholds[{index}]` must hold {len(self.routed_operators) - 1} value(s) for "
                        f"{len(self.routed_operators)} routed operators, got {thresholds!r}"
                    )
                self._check_thresholds(f"layer_thresholds[{index}]", thresholds)
        self._refuse_ignored_routing_settings()

    def _refuse_ignored_routing_settings(self):
        """Routing settings that this layout would not read: refused rather than silently ignored."""
        if not self.routed_layers:
            changed = [
                f"{name}={value!r}"
                for name, value, default in (
                    ("routed_operators", self.routed_operators, DEFAULT_ROUTED_OPERATORS),
                    ("router_type", self.router_type, "threshold"),
                    ("router_usage_entropy_weight", self.router_usage_entropy_weight, 0.0),
                    ("layer_thresholds", self.layer_thresholds, None),
                    ("tau_mid", self.tau_mid, DEFAULT_TAU_MID),
                    ("tau_lo", self.tau_lo, DEFAULT_TAU_LO),
                    ("tau_hi", self.tau_hi, DEFAULT_TAU_HI),
                )
                if value != default and not (name == "layer_thresholds" and value is not None and not any(
                    t is not None for t in value))
            ]
            if changed:
                raise ValueError(
                    f"{', '.join(changed)} would be ignored: no layer is 'routed' (`layer_operators`="
                    f"{self.layer_operators!r})"
                )
            return
        if self.router_usage_entropy_weight > 0 and self.router_type == "threshold":
            raise ValueError(
                f"`router_usage_entropy_weight={self.router_usage_entropy_weight!r}` regularises router probabilities, "
                "which `router_type='threshold'` does not have; use `router_type='hard'` or `'soft'`, or set the "
                "weight to 0"
            )
        if self.router_type != "threshold":
            if self.layer_thresholds is not None and any(t is not None for t in self.layer_thresholds):
                raise ValueError(
                    f"`layer_thresholds` would be ignored: `router_type={self.router_type!r}` learns its routing; "
                    "thresholds apply to `router_type='threshold'`"
                )
            changed = [f"{name}={getattr(self, name)!r}" for name, default in
                       (("tau_mid", DEFAULT_TAU_MID), ("tau_lo", DEFAULT_TAU_LO), ("tau_hi", DEFAULT_TAU_HI))
                       if getattr(self, name) != default]
            if changed:
                raise ValueError(
                    f"{', '.join(changed)} would be ignored: `router_type={self.router_type!r}` learns its routing; "
                    "thresholds apply to `router_type='threshold'`"
                )
            return
        unused = (("tau_lo", DEFAULT_TAU_LO), ("tau_hi", DEFAULT_TAU_HI)) if len(self.routed_operators) == 2 else (
            ("tau_mid", DEFAULT_TAU_MID),)
        changed = [f"{name}={getattr(self, name)!r}" for name, default in unused if getattr(self, name) != default]
        if changed:
            used = "`tau_mid`" if len(self.routed_operators) == 2 else "`tau_lo` / `tau_hi`"
            raise ValueError(
                f"{', '.join(changed)} would be ignored: {len(self.routed_operators)} routed operators "
                f"({self.routed_operators}) are split by {used}"
            )

    @staticmethod
    def _check_thresholds(name: str, values) -> None:
        if not isinstance(values, (list, tuple)) or any(not 0.0 <= value <= 1.0 for value in values):
            raise ValueError(f"`{name}` must lie in [0, 1] (entropies are normalised), got {list(values)!r}")
        if list(values) != sorted(values):
            raise ValueError(f"`{name}`: τ_lo must not exceed τ_hi, got {list(values)!r}")

    @property
    def routed_layers(self) -> list[int]:
        """Indices of the layers that route each token to one of `routed_operators`."""
        return [i for i, op in enumerate(self.layer_operators) if op == "routed"]

    @property
    def operators_in_use(self) -> set[str]:
        """Every operator some layer can run."""
        ops = {op for op in self.layer_operators if op != "routed"}
        return ops | (set(self.routed_operators) if self.routed_layers else set())

    def layer_operator_set(self, layer_idx: int) -> list[str]:
        """Operators layer `layer_idx` may run (one, or the routed operators)."""
        op = self.layer_operators[layer_idx]
        return list(self.routed_operators) if op == "routed" else [op]

    def thresholds_for(self, layer_idx: int) -> list[float]:
        """Entropy thresholds of routed layer `layer_idx`: its `layer_thresholds` entry, else τ_mid or τ_lo / τ_hi."""
        if self.layer_thresholds is not None and self.layer_thresholds[layer_idx] is not None:
            return [float(t) for t in self.layer_thresholds[layer_idx]]
        return [float(self.tau_mid)] if len(self.routed_operators) == 2 else [float(self.tau_lo), float(self.tau_hi)]

    @property
    def layer_types(self) -> list[str]:
        """Cache layer type of each layer for `DynamicCache(config=...)` (derived from `layer_operators`)."""
        types = []
        for index in range(self.num_hidden_layers):
            ops = self.layer_operator_set(index)
            types.append(_CACHE_LAYER_TYPES[("attention" in ops, "rbf" in ops)])
        return types


def default_layer_operators(num_layers: int) -> list[str]:
    """The authors' layout generalised to any depth: DCT first, attention last, routed layers in between."""
    if num_layers == 1:
        return ["routed"]
    return ["dct"] + ["routed"] * (num_layers - 2) + ["attention"]


__all__ = ["ChiarConfig", "default_layer_operators"]
