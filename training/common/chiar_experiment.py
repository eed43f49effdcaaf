"""CHIAR-Former experiments: what the ``wikitext``, ``imdb`` and ``listops`` recipes share.

One *arm* is one model family (the all-attention baseline, CHIAR with threshold / hard / soft routing between DCT
mixing and attention, the 3-operator variant with RBF kernel mixing), in the authors' layer layout (DCT / routed
... / attention) or with every layer routed (``ARM@all``). One *run* is one (arm, seed); it lives in
``<output_dir>/<run name>/``: checkpoints while it trains, then the final model, tokenizer, ``README.md`` (model
card), ``summary.json`` (every measured number), ``calibration.json`` (routing thresholds), ``routing_log.jsonl``
and the figures. A run with a ``summary.json`` is complete and skipped; one with checkpoints resumes from the
newest complete one (weights, optimiser, scheduler, RNG, data position, calibrated thresholds). The comparison
goes to ``<output_dir>/results.{json,md}``.

Measured per run: the task's quality numbers, routing fractions per routed layer and operator (logged during
training from the training batches themselves, and at the end on validation data), attention / total FLOPs per
sequence from the routing actually taken (``count_flops``), and the wall-clock time of every optimiser step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from dataclasses import dataclass, field

from ..results import mean_std, pm
from .exit_codes import EXIT_INTERRUPTED
from .presets import (
    LMPreset,
    add_output_arguments,
    check_training_arguments,
    non_negative_int,
    percentage,
    positive_int,
    recipe_prog,
    resolve_preset,
)

# ------------------------------------------------------------------------------------------------------------
# Arms
# ------------------------------------------------------------------------------------------------------------

ARMS = {
    "attention": "every layer full attention (the same-size baseline)",
    "threshold": "CHIAR DCT+Attn, threshold router (calibrated τ_mid)",
    "hard": "CHIAR DCT+Attn, hard router (Linear([x, H]), straight-through)",
    "soft": "CHIAR DCT+Attn, soft router (softmax blend, no compute saving)",
    "3op": "CHIAR DCT / RBF / Attn, threshold router (calibrated τ_lo / τ_hi)",
    "3op-hard": "CHIAR DCT / RBF / Attn, hard router",
    "dct": "every layer DCT mixing (mixes nothing across tokens: the control)",
}
LAYOUTS = {"": "authors' layout (DCT, routed ..., attention)", "all": "every layer routed"}
EXIT_INTERRUPTED_CODE = EXIT_INTERRUPTED  # a run stopped with a checkpoint (signal or --stop_after_steps)
ROUTING_OUTPUT_KEYS = ["cache", "routing_decisions", "routing_entropies", "routing_fractions",
                       "router_probabilities", "aux_loss", "hidden_states", "attentions"]


@dataclass(frozen=True)
class Arm:
    family: str
    layout: str = ""  # "" (authors') or "all" (every layer routed)
    seed: int = 0

    @property
    def routed(self) -> bool:
        return self.family not in ("attention", "dct")

    @property
    def label(self) -> str:
        return self.family + (f"@{self.layout}" if self.layout else "")

    @property
    def name(self) -> str:
        return self.family + (f"-{self.layout}-routed" if self.layout else "") + f"-seed{self.seed}"

    @property
    def needs_calibration(self) -> bool:
        return self.family in ("threshold", "3op")

    def config_overrides(self, num_layers: int) -> dict:
        if self.family == "attention":
            return {"layer_operators": ["attention"] * num_layers}
        if self.family == "dct":
            return {"layer_operators": ["dct"] * num_layers}
        from hf_spectral.models.chiar_former import default_layer_operators

        three = self.family.startswith("3op")
        router = "hard" if self.family.endswith("hard") else ("soft" if self.family == "soft" else "threshold")
        layout = ["routed"] * num_layers if self.layout == "all" else default_layer_operators(num_layers)
        return {"layer_operators": layout, "router_type": router,
                "routed_operators": ["dct", "rbf", "attention"] if three else ["dct", "attention"]}


def parse_arm(text: str, seed: int = 0) -> Arm:
    family, _, layout = text.partition("@")
    if family not in ARMS:
        raise argparse.ArgumentTypeError(f"unknown arm {family!r}; choose from {', '.join(ARMS)}")
    if layout not in LAYOUTS:
        raise argparse.ArgumentTypeError(f"unknown layout {layout!r} in {text!r}; use ARM or ARM@all")
    if layout and family in ("attention", "dct"):
        raise argparse.ArgumentTypeError(f"{family!r} has no routed layers, so no layout suffix")
    return Arm(family, layout, seed)


# ------------------------------------------------------------------------------------------------------------
# The task a recipe describes
# ------------------------------------------------------------------------------------------------------------


@dataclass
class ChiarTask:
    """What a recipe tells the shared layer: its data, its metrics and the paper's numbers."""

    recipe: str
    title: str
    kind: str  # "lm" (causal language model) or "classification" (bidirectional encoder)
    hub_dataset: str | None  # the data's Hub id; None for generated data (ListOps)
    dataset_description: str
    paper: dict  # the authors' number per arm family (SPEC 2.3)
    paper_metric: str  # what the paper's number is, e.g. "WikiText-2 test perplexity (GPT-2 BPE)"
    primary: str  # summary key of the headline number
    higher_is_better: bool
    load_data: object  # (args, preset, tokenizer_dir) -> TaskData
    add_arguments: object = None  # (parser) -> None
    presets: dict = field(default_factory=dict)
    default_preset: str = "cpu"


@dataclass
class TaskData:
    datasets: dict  # "train", "validation" and optionally "test": datasets.Dataset
    tokenizer: object
    collator: object
    info: dict  # sizes, words per split, ... (written to the results)
    num_labels: int | None = None
    evaluate: object = None  # (trainer, model, data, preset, args) -> dict of final numbers
    compute_metrics: object = None
    preprocess_logits: object = None
    sample: object = None  # one example (input ids) for the routing map


# ------------------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------------------


def _looks_like_a_path(name: str) -> bool:
    """Whether ``name`` can only be a local path (a Hub repository id is ``name`` or ``owner/name``)."""
    return (os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1
            or (os.sep != "/" and os.sep in name))


class RecipeArgumentParser(argparse.ArgumentParser):
    """The recipes' parser: after parsing, values that no single option's ``type`` can judge are checked, and a bad
    one is a usage error (status 2) naming the option."""

    def parse_known_args(self, args=None, namespace=None):
        parsed, rest = super().parse_known_args(args, namespace)
        percentiles = parsed.calibration_percentiles
        if percentiles is not None and (len(percentiles) > 2 or list(percentiles) != sorted(percentiles)):
            self.error(f"argument --calibration_percentiles: one value (2 operators) or two non-decreasing ones "
                       f"(3 operators), got {' '.join(f'{p:g}' for p in percentiles)}")
        model = getattr(parsed, "evaluate_model", None)
        # Without --tokenizer_name_or_path the tokenizer is read from the model's folder: it must be local then.
        if (model and not os.path.isdir(model)
                and (_looks_like_a_path(model) or not getattr(parsed, "tokenizer_name_or_path", None))):
            self.error(f"argument --evaluate_model: no such folder: {model}")
        return parsed, rest


def build_parser(task: ChiarTask, description: str) -> argparse.ArgumentParser:
    parser = RecipeArgumentParser(
        prog=recipe_prog(task.recipe), description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Any other `TrainingArguments` field can be given as --<field> <value> (e.g. --gradient_accumulation_steps "
               "2, --torch_compile true, --optim adamw_torch_fused); it is passed to the Trainer unchanged.",
    )
    parser.add_argument("--arms", nargs="+", metavar="ARM[@all]",
                        help="models to train: " + "; ".join(f"{k}: {v}" for k, v in ARMS.items())
                        + ". Suffix @all routes every layer instead of the authors' layout (default: the preset's)")
    group = parser.add_argument_group("preset and size (a preset's numbers are defaults; options override them)")
    group.add_argument("--preset", choices=sorted(task.presets), default=task.default_preset,
                       help="; ".join(f"{name}: {preset.description}" for name, preset in task.presets.items()))
    group.add_argument("--smoke", action="store_true", help="tiny model, a few steps, for tests (< 1 minute)")
    length_help = ("tokens per training block (= context)" if task.kind == "lm"
                   else "maximum tokens per example (longer ones are truncated; see the recipe)")
    for name, kind, text in (
        ("num_hidden_layers", int, "layers"),
        ("num_attention_heads", int, "attention heads"),
        ("hidden_size", int, "model width d"),
        ("context_length", int, length_help),
        ("dropout", float, "dropout on embeddings and residual branches"),
    ):
        group.add_argument(f"--{name}", type=kind, help=text)
    group = parser.add_argument_group("CHIAR model and routing")
    group.add_argument("--intermediate_size", type=int, help="FFN width (default 4 d)")
    group.add_argument("--layer_norm_position", choices=["post", "pre"], default="post",
                       help="post-LN as the authors (default) or pre-LN")
    group.add_argument("--routed_execution", choices=["sparse", "dense"], default="sparse",
                       help="sparse: each operator runs only on its tokens (default); dense: every operator on every "
                            "token, selected by one-hot gates (the authors' code)")
    group.add_argument("--dct_implementation", choices=["matrix", "fft"], default="matrix")
    group.add_argument("--rbf_num_features", type=int, default=64, help="random features R of RBF mixing")
    group.add_argument("--router_usage_entropy_weight", type=float, default=0.0,
                       help="λ of the usage-entropy regulariser (hard / soft routers; authors 0.01; default off)")
    group.add_argument("--calibration_percentiles", type=percentage, nargs="+",
                       help="entropy percentiles for the thresholds: one (2 operators; default 75, ≈ 25%% of tokens "
                            "to attention) or two (3 operators; default the authors' 33 67)")
    group.add_argument("--calibration_batches", type=positive_int, default=8,
                       help="training batches measured by calibration")
    group.add_argument("--per_layer_thresholds", action="store_true",
                       help="calibrate one threshold set per routed layer (default: one shared set, as the authors)")
    group.add_argument("--recalibrate_steps", type=non_negative_int, default=0,
                       help="recalibrate the thresholds every N steps during training (default 0: once, before)")
    group.add_argument("--config_overrides", nargs="+", metavar="KEY=VALUE", default=[],
                       help="any other ChiarConfig field (not one an arm or an option sets), VALUE as JSON (e.g. "
                            "rope_theta=500000 rbf_gamma=0.001)")
    if task.kind == "classification":
        group.add_argument("--classifier_pooling", choices=["mean", "last", "learned", "rmt_optimal"], default="mean")
    group = parser.add_argument_group("training")
    for name, kind, text in (
        ("max_steps", int, "optimizer steps"),
        ("batch_size", int, "global batch (split over processes under torchrun)"),
        ("learning_rate", float, "peak AdamW learning rate"),
        ("warmup_steps", int, "linear warm-up steps before the decay"),
        ("weight_decay", float, "AdamW weight decay"),
        ("adam_beta2", float, "AdamW β2"),
        ("lr_scheduler_type", str, "learning-rate schedule (cosine, linear, constant, ...)"),
        ("eval_steps", int, "steps between validation-curve points"),
        ("eval_batches", int, "batches of the fixed validation subset per curve point"),
        ("final_eval_batches", int, "batches for the final numbers of each split (default: whole splits)"),
        ("save_steps", int, "steps between checkpoints"),
        ("logging_steps", int, "steps between training log lines (routing fractions, FLOPs, loss)"),
    ):
        group.add_argument(f"--{name}", type=kind, help=text)
    group.add_argument("--routing_batches", type=positive_int, default=4,
                       help="validation batches for the final routing fractions and FLOPs (default 4)")
    group.add_argument("--seeds", type=int, nargs="+", help="one run per seed and arm (default: the preset's)")
    group.add_argument("--threads", type=positive_int,
                       help="torch CPU threads per process (default: torch's choice)")
    group.add_argument("--attn_implementation", default="sdpa", choices=["sdpa", "eager"])
    group.add_argument("--bf16", action="store_true", help="bfloat16 mixed precision (GPUs)")
    group.add_argument("--report_to", default="none", help="Trainer loggers, e.g. tensorboard, wandb (default: none)")
    add_output_arguments(parser, task.recipe)
    if task.add_arguments:
        task.add_arguments(parser)
    return parser


# TrainingArguments fields a recipe sets itself: its run folders, per-run seeds, the global batch split over the
# processes, and the step-wise evaluation and checkpoints its validation curves, tables and resumption read.
RECIPE_TRAINING_FIELDS = {
    "output_dir": "--output_dir", "seed": "--seeds", "data_seed": "--seeds", "per_device_train_batch_size":
    "--batch_size", "per_device_eval_batch_size": "--batch_size", "eval_strategy": "--eval_steps",
    "save_strategy": "--save_steps",
}
# Fields a recipe cannot honour: resuming needs complete checkpoints (optimiser, scheduler and random states).
REFUSED_TRAINING_FIELDS = {"save_only_model": "a resumed run needs its optimiser, scheduler and random states"}


def parse_training_overrides(rest: list) -> dict:
    """``--<field> <value>`` pairs naming ``TrainingArguments`` fields, typed by ``HfArgumentParser``; ValueError
    for anything else, and for the fields the recipe sets itself (``RECIPE_TRAINING_FIELDS``)."""
    if not rest:
        return {}
    from transformers import HfArgumentParser, TrainingArguments

    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    names = [token[2:].split("=", 1)[0] for token in rest if token.startswith("--")]
    unknown = [name for name in names if name not in fields]
    if unknown or not names or not rest[0].startswith("--"):
        raise ValueError(f"unrecognized arguments: {' '.join(rest)} (neither a recipe option nor a "
                         f"TrainingArguments field{': ' + ', '.join(unknown) if unknown else ''})")
    taken = [name for name in names if name in RECIPE_TRAINING_FIELDS]
    if taken:
        raise ValueError(f"--{taken[0]} is set by the recipe; use {RECIPE_TRAINING_FIELDS[taken[0]]}")
    refused = [name for name in names if name in REFUSED_TRAINING_FIELDS]
    if refused:
        raise ValueError(f"--{refused[0]} is not supported: {REFUSED_TRAINING_FIELDS[refused[0]]}")
    parsed, extra = HfArgumentParser(TrainingArguments).parse_known_args(rest)
    if extra:
        raise ValueError(f"could not parse the TrainingArguments options {' '.join(extra)}")
    return {name: getattr(parsed, name) for name in names}


def parse_config_overrides(items: list) -> dict:
    """``--config_overrides KEY=VALUE`` items -> {KEY: VALUE read as JSON, else as a string}; ValueError without
    ``=``."""
    overrides = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--config_overrides takes KEY=VALUE, got {item!r}")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    return overrides


# ------------------------------------------------------------------------------------------------------------
# Trainer with routing and timing
# ------------------------------------------------------------------------------------------------------------


def _trainer_classes():
    """Built on first use, so that ``--help`` never imports torch or transformers."""
    import torch
    from transformers import TrainerCallback

    from .trainer import RecipeTrainer

    class StepTimer(TrainerCallback):
        """Wall-clock seconds of every optimiser step (forward, backward, optimiser; no evaluation, logging or
        checkpointing), and their running total for the curves against time."""

        def __init__(self):
            self.durations, self.total, self._start = [], 0.0, None

        def on_train_begin(self, args, state, control, **kwargs):
            # A resumed run continues the clock of the run it resumes.
            previous = [entry["train_seconds"] for entry in state.log_history if "train_seconds" in entry]
            self.total = previous[-1] if previous else 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if self._start is None:
                return
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            duration = time.perf_counter() - self._start
            self.durations.append(duration)
            self.total += duration
            self._start = None

    class RecalibrationCallback(TrainerCallback):
        """Recalibrates the thresholds every ``every`` steps on the calibration batches (``--recalibrate_steps``)."""

        def __init__(self, every: int, calibrate):
            self.every, self.calibrate = every, calibrate

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if self.every and state.global_step % self.every == 0 and state.global_step < state.max_steps:
                self.calibrate(state.global_step)

    class ChiarTrainer(RecipeTrainer):
        """``RecipeTrainer`` that logs, at every training log line, the routing fractions of the training batches
        since the previous line (per routed layer and operator), the attention / total FLOPs per sequence of the
        last training batch (from the routing it took), and the training clock."""

        def __init__(self, *args, timer=None, routing_log=None, **kwargs):
            super().__init__(*args, **kwargs)
            self.timer, self.routing_log = timer, routing_log
            self._fraction_sums, self._batches, self._last = None, 0, None

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            inputs = {**inputs, "output_routing": True}  # the routing fractions and decisions logged below
            loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
            if model.training and getattr(outputs, "routing_fractions", None):
                fractions = [f.detach() for f in outputs.routing_fractions]
                # Summed on the device: no host synchronisation until a log line asks for them.
                self._fraction_sums = fractions if self._fraction_sums is None else [
                    a + b for a, b in zip(self._fraction_sums, fractions)]
                self._batches += 1
                self._last = ([d.detach() for d in outputs.routing_decisions], inputs.get("attention_mask"),
                              inputs["input_ids"].shape)
            elif model.training and self._last is None:
                self._last = ((), inputs.get("attention_mask"), inputs["input_ids"].shape)
            return (loss, outputs) if return_outputs else loss

        def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ROUTING_OUTPUT_KEYS)

        def log(self, logs, start_time=None):
            if self.timer is not None:
                logs["train_seconds"] = round(self.timer.total, 3)
            if "loss" in logs and self._last is not None:
                unwrapped = self.accelerator.unwrap_model(self.model)
                config = unwrapped.config
                record = {"step": self.state.global_step}
                if self._fraction_sums is not None:
                    for layer, sums in zip(config.routed_layers, self._fraction_sums):
                        for operator, value in zip(config.routed_operators, (sums / self._batches).tolist()):
                            logs[f"routing/L{layer}/{operator}"] = round(value, 4)
                decisions, mask, shape = self._last
                flops = count_sequence_flops(config, shape, decisions, mask, lm=hasattr(unwrapped, "lm_head"))
                logs["attention_gflops_per_seq"] = round(flops["attention"], 5)
                logs["total_gflops_per_seq"] = round(flops["total"], 5)
                record.update({k: v for k, v in logs.items() if k.startswith("routing/") or "gflops" in k})
                if self.routing_log and self.is_world_process_zero():
                    with open(self.routing_log, "a", encoding="utf-8") as handle:
                        handle.write(json.dumps(record) + "\n")
                self._fraction_sums, self._batches = None, 0
            super().log(logs, start_time)

    return StepTimer, RecalibrationCallback, ChiarTrainer


def count_sequence_flops(config, shape, decisions, attention_mask, lm: bool) -> dict:
    """Attention and total GFLOPs per sequence of one batch, from the routing it took."""
    from hf_spectral.models.chiar_former import count_flops

    batch, length = shape
    flops = count_flops(config, batch, length, [d.cpu() for d in decisions],
                        attention_mask=None if attention_mask is None else attention_mask.cpu(),
                        lm_head_positions=length if lm else None)
    return {"attention": flops["attention"] / batch / 1e9, "attention_core": flops["attention_core"] / batch / 1e9,
            "total": flops["total"] / batch / 1e9}


# ------------------------------------------------------------------------------------------------------------
# Model, calibration, routing profile
# ------------------------------------------------------------------------------------------------------------


# Thresholds that calibration writes: given in --config_overrides for a calibrated arm, they would be replaced.
CALIBRATED_FIELDS = ("tau_mid", "tau_lo", "tau_hi", "layer_thresholds")
# ChiarConfig fields the recipe sets itself, and from what: --config_overrides would otherwise change what an arm
# is (an "attention" baseline made routed) or a size while the run is reported under the arm's name and options.
RECIPE_CONFIG_FIELDS = {
    **dict.fromkeys(("layer_operators", "router_type", "routed_operators"), "--arms"),
    **dict.fromkeys(("vocab_size", "pad_token_id", "eos_token_id", "bos_token_id"), "the tokenizer"),
    "is_causal": "the task", "num_labels": "the data", "max_position_embeddings": "--context_length",
    "hidden_dropout": "--dropout",
    **{name: f"--{name}" for name in (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "layer_norm_position",
        "routed_execution", "dct_implementation", "rbf_num_features", "router_usage_entropy_weight",
        "classifier_pooling")},
}


def arm_config(arm: Arm, preset: LMPreset, args, task: ChiarTask, data: TaskData):
    """The ChiarConfig of ``arm``; a ValueError naming the arm for settings it cannot take."""
    from hf_spectral.models.chiar_former import ChiarConfig
    from hf_spectral.ops.validation import check_known_keys

    tokenizer = data.tokenizer
    settings = dict(
        vocab_size=len(tokenizer), max_position_embeddings=preset.context_length, hidden_size=preset.hidden_size,
        num_hidden_layers=preset.num_hidden_layers, num_attention_heads=preset.num_attention_heads,
        hidden_dropout=preset.dropout, layer_norm_position=args.layer_norm_position,
        routed_execution=args.routed_execution, dct_implementation=args.dct_implementation,
        rbf_num_features=args.rbf_num_features, is_causal=task.kind == "lm", pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
    )
    if args.intermediate_size:
        settings["intermediate_size"] = args.intermediate_size
    settings.update(arm.config_overrides(preset.num_hidden_layers))
    if arm.routed and args.router_usage_entropy_weight and not arm.needs_calibration:
        settings["router_usage_entropy_weight"] = args.router_usage_entropy_weight
    if task.kind == "classification":
        settings.update(num_labels=data.num_labels, classifier_pooling=args.classifier_pooling)
    overrides = parse_config_overrides(args.config_overrides)
    check_known_keys(ChiarConfig, overrides, "--config_overrides")  # a misspelt key would only be warned about
    taken = [key for key in overrides if key in RECIPE_CONFIG_FIELDS]
    if taken:
        raise ValueError(f"--config_overrides {taken[0]}: the recipe sets it from {RECIPE_CONFIG_FIELDS[taken[0]]}")
    calibrated = [key for key in CALIBRATED_FIELDS if key in overrides]
    if arm.needs_calibration and calibrated:
        raise ValueError(f"--config_overrides {', '.join(calibrated)}: {arm.label} calibrates its thresholds on "
                         "training batches, which would replace them; choose the share of tokens with "
                         "--calibration_percentiles instead")
    settings.update(overrides)
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # a huggingface_hub without strict dataclasses: configurations raise ValueError / TypeError
        StrictDataclassError = ValueError
    try:
        config = ChiarConfig(**settings)
    except (ValueError, TypeError, StrictDataclassError) as error:  # the Hub's field checks (e.g. rope_theta="x")
        raise ValueError(f"invalid CHIAR configuration for {arm.label}: {error}") from None
    percentiles = args.calibration_percentiles
    if arm.needs_calibration and percentiles and len(percentiles) != len(config.routed_operators) - 1:
        raise ValueError(f"--calibration_percentiles {' '.join(f'{p:g}' for p in percentiles)}: {arm.label} "
                         f"routes between {len(config.routed_operators)} operators, so it takes "
                         f"{len(config.routed_operators) - 1} percentile(s)")
    if arm.routed and not config.routed_layers:
        raise ValueError(f"{arm.label} needs a routed layer, but the authors' layout with {config.num_hidden_layers} "
                         f"layers has none (DCT first, attention last): use at least 3 layers or {arm.family}@all")
    return config


def check_arm_configs(arms, preset: LMPreset, args, task: ChiarTask) -> None:
    """Every arm's configuration checked before any data is prepared or any arm trains (a later arm's bad setting
    would otherwise stop a run after hours): with a stand-in vocabulary, the real one being unknown yet."""
    from types import SimpleNamespace

    stand_in = SimpleNamespace(tokenizer=_StandInTokenizer(), num_labels=2)
    for arm in arms:
        arm_config(arm, preset, args, task, stand_in)


class _StandInTokenizer:
    pad_token_id = eos_token_id = bos_token_id = 0

    def __len__(self):
        return 256


def build_model(arm: Arm, preset: LMPreset, args, task: ChiarTask, data: TaskData):
    from hf_spectral.models.chiar_former import ChiarForCausalLM, ChiarForSequenceClassification

    try:
        config = arm_config(arm, preset, args, task, data)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    model = (ChiarForCausalLM if task.kind == "lm" else ChiarForSequenceClassification)(config)
    model.set_attn_implementation(args.attn_implementation)
    return model


def calibration_batches(data: TaskData, preset: LMPreset, count: int, seed: int = 0) -> list:
    """A fixed list of collated training batches (the same for every arm and seed)."""
    from .data import fixed_subset

    subset = fixed_subset(data.datasets["train"], count * preset.batch_size, seed=seed)
    rows = [subset[i] for i in range(len(subset))]
    return [data.collator(rows[i:i + preset.batch_size]) for i in range(0, len(rows), preset.batch_size)]


def apply_thresholds(config, thresholds: dict, per_layer: bool):
    """Set the thresholds ``{layer: [τ...]}`` that ``calibrate_thresholds`` returned on ``config`` as it leaves them:
    one set per routed layer in ``layer_thresholds``, or one shared set in ``tau_mid`` / ``tau_lo``, ``tau_hi`` (so
    that a resumed run saves the config an uninterrupted one saves)."""
    if per_layer:
        values = [None] * config.num_hidden_layers
        for layer, taus in thresholds.items():
            values[int(layer)] = [float(t) for t in taus]
        config.layer_thresholds = values
        return
    from hf_spectral.models.chiar_former.calibration import set_shared_thresholds

    set_shared_thresholds(config, next(iter(thresholds.values())))


@dataclass
class Calibrator:
    """Threshold calibration of one run, recorded in ``calibration.json`` so that a resumed run routes with the
    thresholds the interrupted one had at its checkpoint."""

    model: object
    batches: list
    path: str
    percentiles: list | None
    per_layer: bool

    def history(self) -> list:
        if not os.path.isfile(self.path):
            return []
        with open(self.path, encoding="utf-8") as handle:
            return json.load(handle)["history"]

    def __call__(self, step: int) -> dict:
        from hf_spectral.models.chiar_former import calibrate_thresholds, measure_entropies

        from .runs import barrier, is_main_process, write_json

        # Every process of a data-parallel run holds the same weights and reads the same batches, so each sets the
        # thresholds a single process would: nothing to pool across processes.
        result = calibrate_thresholds(self.model, self.batches, percentiles=self.percentiles, per_layer=self.per_layer,
                                      across_processes=False)
        entropies = measure_entropies(self.model.eval(), self.batches, across_processes=False)
        self.model.train()
        entry = {"step": step, "thresholds": {str(k): v for k, v in result["thresholds"].items()},
                 "percentiles": result["percentiles"],
                 "entropy_quantiles": [[float(q) for q in _quantiles(e)] for e in entropies]}
        if is_main_process():  # one writer: processes replacing the same file at once lose each other's rename
            history = [h for h in self.history() if h["step"] < step] + [entry]
            write_json(self.path, {"history": history})
        barrier()  # the others read the file (a resumed run's restore) only once it is written
        return entry

    def restore(self, step: int) -> dict | None:
        entries = [h for h in self.history() if h["step"] <= step]
        if not entries:
            return None
        apply_thresholds(self.model.config, entries[-1]["thresholds"], self.per_layer)
        return entries[-1]


def _quantiles(values):
    import torch

    return torch.quantile(values.double()[:100_000], torch.tensor([0.01, 0.25, 0.5, 0.75, 0.99], dtype=torch.float64))


def routing_profile(model, batches: list) -> dict:
    """Routing fractions per routed layer and operator (token-weighted) and GFLOPs per sequence, in evaluation mode,
    over ``batches`` (collated validation batches)."""
    import torch

    config = model.config
    counts = [torch.zeros(len(config.routed_operators)) for _ in config.routed_layers]
    flops = {"attention": 0.0, "attention_core": 0.0, "total": 0.0}
    sequences = 0
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            for batch in batches:
                inputs = {k: v.to(device) for k, v in batch.items() if k in ("input_ids", "attention_mask")}
                outputs = model(**inputs, output_routing=True, **({"use_cache": False} if config.is_causal else {}))
                mask = inputs.get("attention_mask")
                for store, routes in zip(counts, outputs.routing_decisions):
                    valid = mask.bool() if mask is not None else torch.ones_like(routes, dtype=torch.bool)
                    store += torch.bincount(routes[valid].cpu(), minlength=len(config.routed_operators)).float()
                found = count_sequence_flops(config, inputs["input_ids"].shape, outputs.routing_decisions, mask,
                                             lm=hasattr(model, "lm_head"))
                rows = inputs["input_ids"].shape[0]
                for key in flops:
                    flops[key] += found[key] * rows
                sequences += rows
    finally:
        model.train(was_training)
    fractions = {str(layer): dict(zip(config.routed_operators, (c / c.sum().clamp_min(1)).tolist()))
                 for layer, c in zip(config.routed_layers, counts)}
    attention_share = None
    if config.routed_layers:
        index = config.routed_operators.index("attention") if "attention" in config.routed_operators else None
        if index is not None:
            attention_share = float(sum(c[index] for c in counts) / sum(c.sum() for c in counts).clamp_min(1))
    return {"fractions": fractions, "attention_fraction_routed_layers": attention_share,
            **{f"{key}_gflops_per_seq": value / max(sequences, 1) for key, value in flops.items()}}


# ------------------------------------------------------------------------------------------------------------
# One run
# ------------------------------------------------------------------------------------------------------------


def train_run(arm: Arm, data: TaskData, preset: LMPreset, task: ChiarTask, args, training_overrides: dict,
              output_dir: str, runs: int):
    """Train (or resume, or skip when complete) one run; return its summary, or None if it was interrupted."""
    from transformers import set_seed

    from ..results import current_command, hardware_summary
    from .callbacks import GracefulInterruptCallback, StopAfterStepsCallback
    from .data import fixed_subset
    from .presets import training_arguments
    from .runs import (
        TRAINING_ARGUMENTS_WITHOUT_EFFECT, barrier, check_replicas_agree, data_fingerprint, default_card_repo_id,
        hub_repo_id, is_main_process, open_run_dir, print_stopped, run_settings, train_from, write_json,
    )
    from .trainer import last_complete_checkpoint, remove_checkpoints

    effective = {k: v for k, v in training_overrides.items() if k not in TRAINING_ARGUMENTS_WITHOUT_EFFECT}
    settings = run_settings(preset, args, data_fingerprint(data.tokenizer, data.datasets),
                            training_overrides=effective)
    run_dir, done = open_run_dir(output_dir, arm.name, args.restart, settings, getattr(args, "push_to_hub", False))
    if done is not None:
        return done

    set_seed(arm.seed)  # initial weights, data order, dropout masks
    model = build_model(arm, preset, args, task, data)
    summary: dict = {}
    hub_model_id = hub_repo_id(args, arm.name, runs)
    StepTimer, RecalibrationCallback, ChiarTrainer = _trainer_classes()
    timer = StepTimer()
    training_args = training_arguments(
        preset, run_dir, arm.seed,
        bf16=args.bf16 or None, report_to=args.report_to, run_name=f"{task.recipe}/{arm.name}",
        push_to_hub=args.push_to_hub or None, hub_model_id=hub_model_id, hub_token=args.hub_token,
        hub_private_repo=args.hub_private_repo, hub_strategy=args.hub_strategy,
        dataloader_drop_last=task.kind == "lm",
        # A routed layer's operator that no token of a process's batch chose gets no gradient there, which
        # DistributedDataParallel refuses unless told to look for unused parameters.
        **{"ddp_find_unused_parameters": bool(model.config.routed_layers), **training_overrides},
    )
    callbacks = [GracefulInterruptCallback(), timer]
    interrupt = callbacks[0]
    if args.stop_after_steps:
        callbacks.append(StopAfterStepsCallback(args.stop_after_steps))

    calibrator = None
    checkpoint = last_complete_checkpoint(run_dir)
    resumed_step = int(checkpoint.rsplit("-", 1)[1]) if checkpoint else 0
    if arm.needs_calibration:
        batches = calibration_batches(data, preset, args.calibration_batches)
        calibrator = Calibrator(model, batches, os.path.join(run_dir, "calibration.json"),
                                args.calibration_percentiles, args.per_layer_thresholds)
        restored = calibrator.restore(resumed_step) if checkpoint else None
        if restored is None:
            entry = calibrator(0)
            if is_main_process():
                print(f"[{arm.name}] thresholds calibrated on {len(batches)} training batches: {entry['thresholds']} "
                      f"(percentiles {entry['percentiles']})", flush=True)
        if args.recalibrate_steps:
            callbacks.append(RecalibrationCallback(args.recalibrate_steps, calibrator))
    elif args.calibration_percentiles and is_main_process():
        print(f"[{arm.name}] --calibration_percentiles ignored: {arm.family} has no thresholds", flush=True)
    if getattr(model.config, "classifier_pooling", None) == "rmt_optimal" and not checkpoint:
        # an unfitted rmt_optimal head refuses to run: fit it at initialisation (a resumed run restores its weights)
        from hf_spectral.rmt import fit_rmt_pooling

        fit = fit_rmt_pooling(model, calibration_batches(data, preset, args.calibration_batches))
        print(f"[{arm.name}] rmt_optimal head fitted on {fit.estimate.n_sequences} training sequences", flush=True)

    validation = data.datasets["validation"]
    curve_set = fixed_subset(validation, preset.eval_batches * preset.batch_size)
    train_set = data.datasets["train"]
    routing_log = os.path.join(run_dir, "routing_log.jsonl")
    if is_main_process() and os.path.isfile(routing_log):  # drop records after the checkpoint being resumed
        with open(routing_log, encoding="utf-8") as handle:
            kept = [line for line in handle if line.strip() and json.loads(line)["step"] <= resumed_step]
        with open(routing_log, "w", encoding="utf-8") as handle:
            handle.writelines(kept)
    trainer = ChiarTrainer(
        model=model, args=training_args,
        train_dataset=train_set.select(range(len(train_set) // preset.batch_size * preset.batch_size))
        if task.kind == "lm" else train_set,
        eval_dataset={"validation_curve": curve_set}, data_collator=data.collator, processing_class=data.tokenizer,
        compute_metrics=data.compute_metrics, preprocess_logits_for_metrics=data.preprocess_logits,
        callbacks=callbacks, timer=timer, routing_log=routing_log,
        model_card_fn=lambda directory, repo_id: write_card(
            directory, arm, preset, task, summary, model, data,
            repo_id=repo_id or default_card_repo_id(args, hub_model_id)),
    )
    if checkpoint:
        print(f"[{arm.name}] resuming from {checkpoint}", flush=True)
    started = time.time()
    train_from(trainer, checkpoint)
    check_replicas_agree(trainer)
    if trainer.state.global_step < preset.max_steps:
        print_stopped(arm.name, trainer.state.global_step, preset.max_steps, interrupt.interrupted_by, run_dir)
        return None

    steady = timer.durations[3:] or timer.durations
    summary.update(
        run=arm.name, arm=arm.label, family=arm.family, layout=arm.layout or "authors", seed=arm.seed,
        steps=trainer.state.global_step, parameters=sum(p.numel() for p in model.parameters()),
        layer_operators=list(model.config.layer_operators), routed_operators=list(model.config.routed_operators),
        router_type=model.config.router_type,
        seconds_per_step=statistics.median(steady) if steady else None,
        seconds_per_step_mean=statistics.fmean(steady) if steady else None,
        train_seconds=round(timer.total, 2), wall_seconds_this_session=round(time.time() - started, 1),
        resumed_from=checkpoint and os.path.basename(checkpoint),
    )
    if calibrator is not None:
        summary["thresholds"] = {str(k): model.config.thresholds_for(k) for k in model.config.routed_layers}
        summary["calibration"] = calibrator.history()
    summary.update(data.evaluate(trainer, model, data, preset, args))
    routing_sets = [data.collator([validation[i] for i in range(start, min(start + preset.batch_size, len(validation)))])
                    for start in range(0, min(len(validation), args.routing_batches * preset.batch_size), preset.batch_size)]
    summary["routing"] = routing_profile(model, routing_sets)
    trainer.save_model()
    if is_main_process():
        summary.update(command=current_command(), preset=preset.to_dict(), hardware=hardware_summary(),
                       training_overrides={k: str(v) for k, v in training_overrides.items()},
                       log_history=trainer.state.log_history, data=data.info)
        if not args.no_plots:
            from .chiar_plots import write_run_figures

            write_run_figures(run_dir, model, data, routing_sets, trainer.state.log_history, task, arm)
    if args.push_to_hub:
        trainer.push_to_hub(commit_message=f"{arm.name}: end of training")
    else:
        trainer.create_model_card()
    if is_main_process():
        if not args.keep_checkpoints:
            remove_checkpoints(run_dir)
        write_json(os.path.join(run_dir, "summary.json"), summary)  # last: marks the run complete
    barrier()
    return summary


# ------------------------------------------------------------------------------------------------------------
# Model card
# ------------------------------------------------------------------------------------------------------------

# Metric type (the Hub's metric id) of each evaluation summary key after its split prefix; keys not listed are
# counts (blocks, examples) or structured values and stay out of the model index.
CARD_METRIC_TYPES = {"loss": "loss", "perplexity": "perplexity", "perplexity_per_word": "perplexity",
                     "bits_per_char": "bits_per_char", "accuracy": "accuracy"}


def write_card(directory: str, arm: Arm, preset: LMPreset, task: ChiarTask, summary: dict, model, data: TaskData,
               repo_id: str | None = None) -> str:
    from huggingface_hub import ModelCardData

    from ..results import hardware_summary
    from .model_card import eval_results, render_model_card, write_model_card

    results, counts = [], []  # (name, split, metric type, value): metrics go into the model index, counts do not
    for key, value in summary.items():
        split, _, metric = key.partition("_")
        if split not in ("validation", "test", "val") or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        row = (key.replace("_", " "), "validation" if split == "val" else split, CARD_METRIC_TYPES.get(metric), value)
        (results if row[2] else counts).append(row)
    table = "| metric | value |\n|---|---|\n" + "".join(f"| {name} | {value:.4f} |\n" for name, _, _, value in results)
    table += "".join(f"| {name} | {value:g} |\n" for name, _, _, value in counts)
    routing = summary.get("routing") or {}
    notes = []
    if routing.get("fractions"):
        notes.append("Routing fractions on validation data (per routed layer): " + "; ".join(
            f"layer {layer}: " + ", ".join(f"{op} {share:.1%}" for op, share in ops.items())
            for layer, ops in routing["fractions"].items()) + ".")
    if routing.get("attention_gflops_per_seq") is not None:
        notes.append(f"Attention {routing['attention_gflops_per_seq']:.4f} GFLOPs and total "
                     f"{routing['total_gflops_per_seq']:.4f} GFLOPs per sequence (counted from the routing taken).")
    if task.paper.get(arm.family) is not None:
        notes.append(f"The CHIAR-Former paper reports {task.paper[arm.family]} ({task.paper_metric}) at its own scale.")
    task_type = "text-generation" if task.kind == "lm" else "text-classification"
    card_data = ModelCardData(
        model_name=f"chiar-former-{task.recipe}-{arm.name}".lower(), pipeline_tag=task_type,
        datasets=[task.hub_dataset] if task.hub_dataset else None, tags=[arm.family],
        eval_results=eval_results(results, task_type=task_type, dataset_id=task.hub_dataset or task.recipe,
                                  dataset_name=task.title),
    )
    hardware = summary.get("hardware") or hardware_summary()
    config = model.config
    card = render_model_card(
        "chiar_former", card_data,
        model_name=card_data.model_name,
        summary=f"A CHIAR-Former ({arm.label}) trained on {task.title} with the hf_spectral `{task.recipe}` recipe.",
        arm=arm.label, arm_description=ARMS[arm.family] + ("; every layer routed" if arm.layout == "all" else ""),
        layers=" / ".join(config.layer_operators) + (f" (routed among {', '.join(config.routed_operators)}, "
                                                      f"{config.router_type} router)" if config.routed_layers else ""),
        size=(f"{config.num_hidden_layers} layers, d = {config.hidden_size}, {config.num_attention_heads} heads, "
              f"context {preset.context_length}, {config.layer_norm_position}-LN, dropout {preset.dropout}"),
        num_parameters=f"{sum(p.numel() for p in model.parameters()):,}",
        thresholds=json.dumps({str(k): config.thresholds_for(k) for k in config.routed_layers})
        if config.routed_layers and config.router_type == "threshold" else "n/a",
        tokenizer_description=data.info.get("tokenizer", type(data.tokenizer).__name__),
        dataset_description=task.dataset_description,
        schedule=(f"{preset.max_steps} steps, batch {preset.batch_size}, AdamW lr {preset.learning_rate} betas "
                  f"({preset.adam_beta1}, {preset.adam_beta2}), weight decay {preset.weight_decay}, "
                  f"{preset.warmup_steps} warm-up steps, {preset.lr_scheduler_type} decay"),
        seed=arm.seed,
        hardware=f"{hardware.get('cuda') or hardware.get('cpu_model') or hardware.get('processor')}, "
                 f"{hardware.get('torch_threads')} torch threads",
        seconds_per_step=(f"{summary['seconds_per_step']:.3f} s" if summary.get("seconds_per_step") else "n/a"),
        command=summary.get("command", ""), results_table=table, results_notes="\n\n".join(notes),
        auto_class="ForCausalLM" if task.kind == "lm" else "ForSequenceClassification",
        repo_id=repo_id or directory, recipe=task.recipe,
    )
    return write_model_card(card, directory)


# ------------------------------------------------------------------------------------------------------------
# Comparison table
# ------------------------------------------------------------------------------------------------------------


def curve_at_time(history: list, key: str, seconds: float):
    """The validation-curve value ``key`` at ``seconds`` of training, linearly interpolated between the curve points
    (training seconds recorded with each point); None beyond the run's last point."""
    points = [(e["train_seconds"], e[key]) for e in history if key in e and "train_seconds" in e]
    if not points:
        return None
    points.sort()
    if seconds <= points[0][0]:
        return points[0][1]
    for (t0, v0), (t1, v1) in zip(points, points[1:]):
        if t0 <= seconds <= t1:
            return v0 + (v1 - v0) * (seconds - t0) / max(t1 - t0, 1e-9)
    return None


def comparison_rows(summaries: list, task: ChiarTask, curve_key: str) -> list:
    """One row per arm: the task's numbers (mean ± std over seeds), time per step, routing, FLOPs, the validation
    curve at equal wall-clock (the fastest arm's training time) and at equal steps, and the paper's number."""
    groups: dict = {}
    for summary in summaries:
        groups.setdefault(summary["arm"], []).append(summary)
    # Equal wall-clock: the training time of the run whose curve ends first, so that every run has a value there.
    budget = min(max([e["train_seconds"] for e in s["log_history"] if curve_key in e and "train_seconds" in e]
                     or [s["train_seconds"]]) for s in summaries)
    base_runs = groups.get("attention", [])
    base_attention = mean_std([s["routing"]["attention_gflops_per_seq"] for s in base_runs])[0]
    base_total = mean_std([s["routing"]["total_gflops_per_seq"] for s in base_runs])[0]
    digits = 2 if task.kind == "lm" else 4
    rows = []
    for label, runs in groups.items():
        primary = mean_std([s.get(task.primary) for s in runs])
        attention_flops = mean_std([s["routing"]["attention_gflops_per_seq"] for s in runs])[0]
        total_flops = mean_std([s["routing"]["total_gflops_per_seq"] for s in runs])[0]
        step = mean_std([s["seconds_per_step"] for s in runs])
        at_time = mean_std([curve_at_time(s["log_history"], curve_key, budget) for s in runs])
        final_curve = mean_std([curve_at_time(s["log_history"], curve_key, float("inf")) or
                                [e[curve_key] for e in s["log_history"] if curve_key in e][-1] for s in runs])
        share = mean_std([s["routing"].get("attention_fraction_routed_layers") for s in runs])[0]
        row = {
            "arm": label, "seeds": len(runs),
            task.primary: pm(*primary, digits),
            "s/step": pm(*step, 3),
            "attn share (routed layers)": "" if share is None else f"{share:.1%}",
            "attn GFLOPs/seq": f"{attention_flops:.4f}",
            "Δ attn FLOPs": "" if not base_attention or label == "attention" else f"{attention_flops / base_attention - 1:+.1%}",
            "Δ total FLOPs": "" if not base_total or label == "attention" else f"{total_flops / base_total - 1:+.1%}",
            f"val curve @ {budget:.0f} s": pm(*at_time, 4),
            "val curve @ last step": pm(*final_curve, 4),
            "paper": "" if task.paper.get(runs[0]["family"]) is None or runs[0]["layout"] != "authors"
            else str(task.paper[runs[0]["family"]]),
            "primary_mean": primary[0], "primary_std": primary[1], "seconds_per_step_mean": step[0],
            "attention_gflops_per_seq": attention_flops, "total_gflops_per_seq": total_flops,
            "curve_at_equal_time_mean": at_time[0], "curve_at_equal_time_std": at_time[1],
            "curve_final_mean": final_curve[0], "equal_time_budget_seconds": budget, "attention_share": share,
            "per_seed": {str(s["seed"]): s.get(task.primary) for s in runs},
        }
        for extra in ("validation_perplexity", "test_perplexity", "validation_perplexity_per_word",
                      "validation_accuracy", "test_accuracy"):
            values = [s.get(extra) for s in runs]
            if any(v is not None for v in values) and extra != task.primary:
                row[extra] = pm(*mean_std(values), digits)
        rows.append(row)
    return rows


def write_experiment_results(output_dir: str, summaries: list, task: ChiarTask, preset_name: str, preset,
                             data: TaskData, args, curve_key: str, training_overrides: dict):
    from ..results import write_results

    rows = comparison_rows(summaries, task, curve_key)
    columns = [c for c in rows[0] if not c.endswith(("_mean", "_std", "_seconds", "_share")) and c not in (
        "attention_gflops_per_seq", "total_gflops_per_seq", "per_seed")]
    notes = (f"{task.primary}: mean ± sample std over seeds. s/step: median wall-clock seconds per optimiser step "
             "(forward, backward, optimiser). attn share: fraction of tokens routed to attention in the routed layers "
             "(validation data, evaluation mode). GFLOPs per sequence counted from the routing taken "
             "(`count_flops`). 'val curve @ N s': the validation-curve "
             f"{curve_key.replace('eval_validation_curve_', '')} at the training time of the run whose curve ends first (equal "
             f"wall-clock); '@ last step': at equal steps. Paper (SPEC 2.3, the authors' scale): {task.paper_metric}.")
    if preset.final_eval_batches and task.kind == "lm":  # (classification scores every example of its splits)
        notes += (f" Final numbers of each split on a fixed subset of at most {preset.final_eval_batches} batches "
                  f"({preset.final_eval_batches * preset.batch_size} blocks), not necessarily the whole split.")
    if data.info.get("test_subset"):
        notes += " The test split is a fixed random subset of the benchmark's test examples (see `data`)."
    config = {"preset": preset_name, **preset.to_dict(), "data": data.info,
              **{k: getattr(args, k) for k in ("layer_norm_position", "routed_execution", "calibration_percentiles",
                                               "calibration_batches", "per_layer_thresholds", "recalibrate_steps",
                                               "router_usage_entropy_weight", "config_overrides")},
              "training_overrides": {k: str(v) for k, v in training_overrides.items()}}
    seeds = sorted({s["seed"] for s in summaries})
    paths = write_results(output_dir, "results", rows, title=f"{task.title}: CHIAR-Former arms ({preset_name} preset)",
                          config=config, seeds=seeds, notes=notes, columns=columns)
    if not args.no_plots:
        from .chiar_plots import plot_curves_against_time

        plot_curves_against_time(summaries, curve_key, os.path.join(output_dir, "validation_curves.png"),
                                 f"{task.title}: validation curve against steps and training time")
    return rows, paths


# ------------------------------------------------------------------------------------------------------------
# Entry point shared by the recipes
# ------------------------------------------------------------------------------------------------------------


def run_recipe(argv, task: ChiarTask, description: str) -> int:
    """Parse ``argv`` (before importing torch, so that ``--help`` is fast), prepare the data, train every
    requested (arm, seed), write the comparison. Returns the exit code."""
    parser = build_parser(task, description)
    args, rest = parser.parse_known_args(argv)
    preset_name, preset = resolve_preset(args, task.presets, parser)
    try:
        arm_labels = [parse_arm(text) for text in (args.arms or list(preset.variants))]
        parse_config_overrides(args.config_overrides)
        training_overrides = parse_training_overrides(rest)
    except (argparse.ArgumentTypeError, ValueError) as error:
        parser.error(str(error))
    arm_labels = list(dict.fromkeys(arm_labels))
    try:
        check_arm_configs(arm_labels, preset, args, task)
    except ValueError as error:
        parser.error(str(error))
    check_training_arguments(parser, preset, args, **training_overrides)
    arms = [Arm(a.family, a.layout, seed) for seed in preset.seeds for a in arm_labels]

    from .runs import is_main_process, prepare_recipe

    output_dir, data = prepare_recipe(args, task.recipe, preset_name, preset, task.load_data)
    if data is None:
        return 2
    sizes = ", ".join(f"{split} {len(ds):,}" for split, ds in data.datasets.items())
    print(f"{task.title}: {sizes} examples; vocabulary {len(data.tokenizer)}; preset {preset_name}; runs: "
          f"{', '.join(a.name for a in arms)}", flush=True)
    summaries = []
    for arm in arms:
        summary = train_run(arm, data, preset, task, args, training_overrides, output_dir, len(arms))
        if summary is None:
            return EXIT_INTERRUPTED_CODE
        summaries.append(summary)
    if is_main_process():
        curve_key = "eval_validation_curve_loss" if task.kind == "lm" else "eval_validation_curve_accuracy"
        _, paths = write_experiment_results(output_dir, summaries, task, preset_name, preset, data, args, curve_key,
                                            training_overrides)
        print(open(paths[1], encoding="utf-8").read().split("## Provenance")[0])
        print("=" * 78)
        for summary in summaries:
            value = summary.get(task.primary)
            print(f"{task.primary:<28} {summary['arm']:<18} seed {summary['seed']}: "
                  f"{'n/a' if value is None else f'{value:.4f}'}  ({summary['seconds_per_step']:.3f} s/step)")
        print("=" * 78, flush=True)
    return 0


__all__ = ["ARMS", "Arm", "ChiarTask", "TaskData", "parse_arm", "run_recipe"]
