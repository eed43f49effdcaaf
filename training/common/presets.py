"""Presets: model size plus the training schedule, and the ``TrainingArguments`` they stand for.

Every number of a preset can be overridden on the command line; the preset only supplies defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LMPreset:
    """One model size and training schedule for a character-level language-model benchmark.

    ``batch_size`` is the global batch (per optimizer step, over all processes): under ``torchrun`` each of
    the N processes gets ``batch_size / N`` examples, so the optimisation is the same on 1 or N processes.
    """

    description: str
    num_hidden_layers: int
    num_attention_heads: int
    hidden_size: int
    context_length: int
    batch_size: int
    max_steps: int
    warmup_steps: int
    learning_rate: float = 3e-4
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0
    lr_scheduler_type: str = "cosine"
    dropout: float = 0.1
    eval_steps: int = 250  # validation-curve points
    eval_batches: int = 50  # curve points average this many batches of a fixed validation subset (authors: 50)
    final_eval_batches: int | None = None  # final losses: None = the whole validation split
    leak_free_batches: int | None = None  # leak-free loss of `window` models: None = the whole validation split
    save_steps: int = 500
    logging_steps: int = 50
    variants: tuple = ("BASE", "EGA-1")
    seeds: tuple = (0,)

    def replace(self, **changes) -> "LMPreset":
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# The authors' setup (SPEC 1.4), shared by every character-level benchmark.
AUTHORS = LMPreset(
    description="EGA authors' setup (SPEC 1.4): 6 layers, 8 heads, C=256, context 256, batch 64, 5000 steps",
    num_hidden_layers=6, num_attention_heads=8, hidden_size=256, context_length=256,
    batch_size=64, max_steps=5000, warmup_steps=300, eval_steps=250, eval_batches=50, save_steps=500,
    variants=("BASE", "EGA-1", "EGA-2", "EGA-4", "EGA-C", "EGA-M-F", "EGA-M", "EGA-DB2", "EGA-DB4"),
)

# The scale of this project's CPU reproduction (results/ega/): 4 layers, 4 heads, C=128, context 128 (the
# authors' "smaller early setup", SPEC 1.4). Steps and batch are sized so that the 32 runs of the reproduction
# fit in about 2.5 hours on a shared 2-core machine; with so few steps the learning rate is nanoGPT's 1e-3 for
# models of this size instead of the authors' 3e-4 for 5000 steps.
CPU = LMPreset(
    description="CPU reproduction scale: 4 layers, 4 heads, C=128, context 128, batch 16, 800 steps, lr 1e-3",
    num_hidden_layers=4, num_attention_heads=4, hidden_size=128, context_length=128,
    batch_size=16, max_steps=800, warmup_steps=80, learning_rate=1e-3, eval_steps=100, eval_batches=10,
    leak_free_batches=20, save_steps=200, logging_steps=25, variants=("BASE", "EGA-1", "EGA-1:window"),
)

# For tests: seconds, not minutes. Numbers mean nothing.
SMOKE = LMPreset(
    description="smoke test: 2 layers, 2 heads, C=32, context 32, batch 8, 12 steps",
    num_hidden_layers=2, num_attention_heads=2, hidden_size=32, context_length=32,
    batch_size=8, max_steps=12, warmup_steps=2, eval_steps=6, eval_batches=2, final_eval_batches=4,
    leak_free_batches=1, save_steps=6, logging_steps=3, variants=("BASE", "EGA-1"),
)


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def has_accelerator() -> bool:
    """Whether torch sees an accelerator (CUDA, XPU, MPS, ...) that accelerate would train on: one present at run
    time. (A CUDA build of torch names CUDA as its accelerator on a machine without a GPU too.)"""
    import torch

    return torch.accelerator.is_available()


def training_arguments(preset: LMPreset, output_dir: str, seed: int, **overrides):
    """``TrainingArguments`` for one run of ``preset``: AdamW, warm-up + cosine, clipping, step-based
    evaluation / checkpointing, progress bars, no external loggers (``report_to`` can turn them on)."""
    import torch
    from transformers import TrainingArguments

    processes = world_size()
    if preset.batch_size % processes:
        raise ValueError(f"batch_size {preset.batch_size} is not divisible by the {processes} processes")
    per_device = preset.batch_size // processes
    arguments = dict(
        output_dir=output_dir,
        max_steps=preset.max_steps,
        per_device_train_batch_size=per_device,
        per_device_eval_batch_size=per_device,
        learning_rate=preset.learning_rate,
        adam_beta1=preset.adam_beta1,
        adam_beta2=preset.adam_beta2,
        weight_decay=preset.weight_decay,
        max_grad_norm=preset.max_grad_norm,
        lr_scheduler_type=preset.lr_scheduler_type,
        warmup_steps=preset.warmup_steps,
        eval_strategy="steps",
        eval_steps=preset.eval_steps,
        save_strategy="steps",
        save_steps=preset.save_steps,
        save_total_limit=2,
        logging_strategy="steps",
        logging_steps=preset.logging_steps,
        logging_first_step=True,
        report_to="none",
        seed=seed,
        data_seed=seed,
        dataloader_drop_last=True,
        remove_unused_columns=False,
        prediction_loss_only=False,
        disable_tqdm=False,
        dataloader_pin_memory=torch.cuda.is_available(),
        # Without an accelerator, accelerate (>= 1.13) makes a torchrun process group data-parallel only when told
        # to use the CPU; otherwise every process would train its own copy of the model on its share of the data.
        use_cpu=processes > 1 and not has_accelerator(),
        # CPU processes talk through gloo; NCCL is used when every process has a GPU.
        ddp_backend=None if torch.cuda.is_available() else ("gloo" if processes > 1 else None),
        ddp_find_unused_parameters=False,
    )
    arguments.update({k: v for k, v in overrides.items() if v is not None})
    return TrainingArguments(**arguments)


def check_training_arguments(parser: argparse.ArgumentParser, preset: LMPreset, args, **overrides) -> None:
    """Build the runs' ``TrainingArguments`` once before any data or folder is touched: a setting transformers
    refuses (``--bf16`` without hardware support, an unknown ``--report_to``, a bad ``TrainingArguments`` field) is
    a usage error (status 2) instead of a traceback after the data are prepared and the first run folder made."""
    from transformers.integrations.integration_utils import get_reporting_integration_callbacks

    try:  # (TrainingArguments creates no folder)
        arguments = training_arguments(preset, os.path.join("runs", "unused"), 0, bf16=args.bf16 or None,
                                       report_to=args.report_to, **overrides)
        get_reporting_integration_callbacks(arguments.report_to)
    except (ValueError, TypeError, ImportError) as error:
        parser.error(f"transformers' TrainingArguments refuse these options: {error}")


@dataclass
class HubOptions:
    """``--push_to_hub`` and friends, passed to ``TrainingArguments`` unchanged."""

    push_to_hub: bool = False
    hub_model_id: str | None = None
    hub_token: str | None = None
    hub_private_repo: bool | None = None
    hub_strategy: str = "every_save"
    extra: dict = field(default_factory=dict)


def resolve_preset(args, presets: dict, parser: argparse.ArgumentParser, *,
                   heads_divide_width: bool = False) -> tuple[str, LMPreset]:
    """The preset ``--preset`` names (``smoke`` with ``--smoke``) with the numbers given on the command line in place
    of its own. A size or count that is not positive, a learning rate that is not a positive number, a negative
    warm-up or weight decay, a dropout outside [0, 1), a seed outside [0, 2³²) and, with ``heads_divide_width``, a
    width that the number of heads does not divide are usage errors (``parser.error``: status 2)."""
    name = "smoke" if args.smoke else args.preset
    preset = presets[name].replace(
        **{key: getattr(args, key, None) for key in LMPreset.__dataclass_fields__
           if key not in ("description", "variants", "seeds")})
    if args.seeds:
        preset = preset.replace(seeds=tuple(args.seeds))
    for key in ("num_hidden_layers", "num_attention_heads", "hidden_size", "context_length", "batch_size",
                "max_steps", "eval_steps", "eval_batches", "save_steps", "logging_steps", "final_eval_batches",
                "leak_free_batches"):
        if getattr(preset, key) is not None and getattr(preset, key) <= 0:
            parser.error(f"--{key} must be positive, got {getattr(preset, key)}")
    if not (math.isfinite(preset.learning_rate) and preset.learning_rate > 0):
        parser.error(f"--learning_rate must be a positive number, got {preset.learning_rate}")
    for key in ("warmup_steps", "weight_decay"):
        value = getattr(preset, key)
        if not (math.isfinite(value) and value >= 0):
            parser.error(f"--{key} must be a number of at least 0, got {value}")
    if heads_divide_width and preset.hidden_size % preset.num_attention_heads:
        parser.error(f"--hidden_size {preset.hidden_size} is not divisible by --num_attention_heads "
                     f"{preset.num_attention_heads}")
    if not 0 <= preset.dropout < 1:
        parser.error(f"--dropout must be in [0, 1), got {preset.dropout}")
    if any(not 0 <= seed < 2**32 for seed in preset.seeds):  # what torch, numpy and random accept
        parser.error(f"--seeds must be integers in [0, 2**32 - 1], got {' '.join(map(str, preset.seeds))}")
    return name, preset


def recipe_prog(recipe: str) -> str:
    """The program name in a recipe's usage and error lines, as the user ran it: ``hf-spectral train RECIPE`` from
    the command-line tool, else ``python -m <package>.RECIPE`` (``training`` in a checkout, ``hf_spectral.recipes``
    installed)."""
    if os.path.basename(sys.argv[0]) == "hf-spectral":
        return f"hf-spectral train {recipe}"
    return f"python -m {__package__.rpartition('.')[0]}.{recipe}"


def positive_int(text: str) -> int:
    """An argparse ``type`` for counts that must be at least 1 (``--threads``, ``--stop_after_steps``): 0 or less is
    a usage error (status 2) naming the option, not a value silently ignored or a traceback later."""
    return _int_at_least(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    """An argparse ``type`` for counts that may be 0 (warm-up rounds)."""
    return _int_at_least(text, 0, "an integer >= 0")


def _int_at_least(text: str, lowest: int, kind: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < lowest:
        raise argparse.ArgumentTypeError(f"must be {kind}, got {value}")
    return value


def percentage(text: str) -> float:
    """An argparse ``type`` for a percentage or percentile in [0, 100] (NaN refused), as a usage error naming the
    option."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not 0 <= value <= 100:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a number in [0, 100], got {text}")
    return value


def add_output_arguments(parser, recipe: str = "<recipe>") -> None:
    """The "output, checkpoints, Hub" options of the training recipes; ``recipe`` names the default folder."""
    group = parser.add_argument_group("output, checkpoints, Hub")
    group.add_argument("--output_dir", help=f"where runs are written (default: runs/{recipe}-<preset>)")
    group.add_argument("--restart", action="store_true", help="discard existing checkpoints and results of the runs")
    group.add_argument("--stop_after_steps", type=positive_int,
                       help="stop with a checkpoint at this global step (resume by rerunning without it)")
    group.add_argument("--keep_checkpoints", action="store_true", help="keep checkpoints after a run completes")
    group.add_argument("--no_plots", action="store_true", help="skip the PNG figures")
    group.add_argument("--push_to_hub", action="store_true", help="push each trained model (and checkpoints) to the Hub")
    group.add_argument("--hub_model_id", help="repository name; with several runs the run name is appended")
    group.add_argument("--hub_token", help="token with write access (default: the cached login)")
    group.add_argument("--hub_private_repo", action="store_true", default=None, help="create private repositories")
    group.add_argument("--hub_strategy", default="every_save", choices=["end", "every_save", "checkpoint", "all_checkpoints"])
