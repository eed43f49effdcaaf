"""What ``training/run_clm.py`` and ``training/run_classification.py`` share, in the order the scripts use it.

* `ModelArguments` (a checkpoint, or a model type with config overrides; the tokenizer) and `SpectralArguments` (the
  project's additions: energy gates, LoRA, CHIAR-Former routing), parsed with ``TrainingArguments`` by
  `parse_arguments`: a JSON file of arguments first, command-line options after it overriding it;
* `load_raw_datasets`: a Hub dataset or local files, with a validation split;
* `build_config`, `build_tokenizer` (``char``: a character tokenizer of the training text), `build_model`;
* `add_gates_and_lora`; `calibrate_routing` for CHIAR-Former;
* `SpectralTrainer` (the gates' weight decay and learning rate) and `TrainingLogCallback` (gates, routing, time);
* `write_model_card`: the family card of ``model_cards/`` for EGA-GPT and CHIAR-Former, Trainer's card otherwise.

Bad input raises `UsageError`, which the scripts print as one line (``<program>: error: ...``) with exit status 2.
The scripts stand on ``HfArgumentParser``, ``TrainingArguments`` and ``Trainer`` alone; the benchmark drivers run
them with a configuration of ``training/configs/``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import logging
import math
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field

import datasets
import torch
import transformers
from transformers import (
    CONFIG_MAPPING,
    AutoConfig,
    AutoTokenizer,
    HfArgumentParser,
    Trainer,
    TrainerCallback,
)

import hf_spectral  # noqa: F401  (registers EGA-GPT, CHIAR-Former and the energy-gated models with the Auto classes)
from hf_spectral.file_permissions import umask_permissions_for_what_is_written
from hf_spectral.retrofit import EnergyGateConfig, add_energy_gates, has_energy_gates, mark_only_gates_trainable
from hf_spectral.retrofit.cli import TOKENIZER_FILES

from .cli import UsageError, one_line, program_name, run_main  # noqa: F401  (the scripts' entry points use them)

logger = logging.getLogger(__name__)

METRICS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "metrics")
# The data files each builder of `datasets` reads, by extension.
BUILDERS = {"txt": "text", "json": "json", "jsonl": "json", "csv": "csv"}


@contextlib.contextmanager
def said_as_usage_error(what: str):
    """Inside the block, the errors bad input makes a library raise (no such file or Hub id, a value it refuses)
    become a `UsageError` naming ``what`` was being done."""
    try:
        yield
    except (ValueError, TypeError, KeyError, OSError) as error:
        raise UsageError(f"{what}: {one_line(error)}") from error


# ----------------------------------------------------------------------------------------------------------------
# Arguments
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class ModelArguments:
    """Which model to train: a checkpoint to fine-tune, or a model type (or config) to train from scratch."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Checkpoint to fine-tune: a folder or a Hub id (any model of the task's Auto class, e.g. "
                  "EGA-GPT, CHIAR-Former, GPT-2, Llama, a retrofitted checkpoint). Unset: train from scratch."},
    )
    model_type: str | None = field(
        default=None,
        metadata={"help": "Train a new model of this type from scratch: ega_gpt, chiar_former, or any model type of "
                  "transformers (gpt2, llama, ...)."},
    )
    variant: str | None = field(
        default=None,
        metadata={"help": "With --model_type ega_gpt: the EGA paper's variant (BASE, EGA-1, EGA-2, EGA-4, EGA-C, "
                  "EGA-M-F, EGA-M, EGA-DB2, EGA-DB4), the base that --config_overrides changes."},
    )
    config_overrides: str | None = field(
        default=None,
        metadata={"help": "With --model_type: config fields as key=value,key=value, e.g. n_embd=64,n_layer=2 (numbers, "
                  "true / false and strings as is; lists and null as JSON: layer_operators=[\"dct\",\"routed\"])."},
    )
    config_name: str | None = field(
        default=None, metadata={"help": "Train from scratch with this config (a folder or Hub id)."}
    )
    tokenizer_name: str | None = field(
        default=None,
        metadata={"help": "Tokenizer folder or Hub id (default: the checkpoint's), or `char`: a character tokenizer "
                  "(hf_spectral.CharTokenizer) of the characters of the training split, with <unk> for others, then "
                  "<pad> and <eos> (never in the data: for batched generation and evaluation harnesses)."},
    )
    char_eos_and_pad: bool = field(
        default=True,
        metadata={"help": "With --tokenizer_name char: add <pad> and <eos> (false: the characters and <unk> only, "
                  "the vocabulary of runs made before these tokens were added, e.g. to continue a sweep alike)."},
    )
    cache_dir: str | None = field(default=None, metadata={"help": "Where Hub downloads are stored."})
    model_revision: str = field(default="main", metadata={"help": "Branch, tag or commit of a Hub checkpoint."})
    token: str | None = field(default=None, metadata={"help": "Hub token (default: the one `hf auth login` saved)."})
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Run the code a Hub checkpoint or dataset ships (read it first)."}
    )
    attn_implementation: str | None = field(
        default=None,
        metadata={"help": "Attention backend (sdpa, eager, flex_attention, ...; default: transformers' choice)."},
    )
    dtype: str = field(
        default="auto",
        metadata={"help": "Data type of the checkpoint's weights: auto (the type they were saved in), or float32 "
                  "(full-precision weights; --bf16 then trains in mixed precision), bfloat16, float16.",
                  "choices": ["auto", "bfloat16", "float16", "float32"]},
    )

    def __post_init__(self):
        if self.model_name_or_path and (self.model_type or self.config_name):
            raise ValueError("give either --model_name_or_path (fine-tune a checkpoint) or --model_type / "
                             "--config_name (train from scratch), not both")
        if self.model_type and self.config_name:
            raise ValueError("give either --model_type or --config_name (a new model's config), not both")
        if not (self.model_name_or_path or self.model_type or self.config_name):
            raise ValueError("no model: give --model_name_or_path, --model_type or --config_name")
        if self.model_type and self.model_type not in CONFIG_MAPPING:
            raise ValueError(f"unknown --model_type {self.model_type!r}: hf_spectral's are ega_gpt and chiar_former, "
                             "transformers' are the keys of CONFIG_MAPPING (gpt2, llama, mistral, qwen2, ...)")
        if self.config_overrides and not self.model_type:
            raise ValueError("--config_overrides changes the config of a new model: use it with --model_type")
        if self.config_overrides and self.config_name:
            raise ValueError("--config_overrides cannot be combined with --config_name")
        if self.variant and self.model_type != "ega_gpt":
            raise ValueError("--variant is a variant of EGA-GPT: use it with --model_type ega_gpt")

    @property
    def from_scratch(self) -> bool:
        return not self.model_name_or_path

    @property
    def sets_vocab_size(self) -> bool:
        return bool(re.search(r"(^|,)\s*vocab_size\s*=", self.config_overrides or ""))

    def hub_kwargs(self) -> dict:
        return {"cache_dir": self.cache_dir, "revision": self.model_revision, "token": self.token,
                "trust_remote_code": self.trust_remote_code}


_GATE_HELP = {f.name: f.metadata["help"] for f in dataclasses.fields(EnergyGateConfig)}


@dataclass
class SpectralArguments:
    """The project's additions: energy gates on a checkpoint, LoRA adapters, CHIAR-Former routing, and evaluation."""

    add_energy_gates: bool = field(
        default=False,
        metadata={"help": "Add energy gates (hf_spectral.retrofit) to a GPT-2, Llama, Mistral or Qwen2 model. With "
                  "--gate_alpha_init 0 (default) its outputs are unchanged until training moves the gates."},
    )
    gate_normalization: str = field(
        default="causal", metadata={"help": _GATE_HELP["normalization"], "choices": ["causal", "window", "none"]}
    )
    gate_energy_kind: str = field(
        default="linear",
        metadata={"help": _GATE_HELP["energy_kind"], "choices": ["linear", "conv", "morlet", "db2", "db4"]},
    )
    gate_projections: int = field(default=1, metadata={"help": _GATE_HELP["projections"]})
    gate_scales: list[int] | None = field(default=None, metadata={"help": _GATE_HELP["scales"]})
    gate_layers: list[int] | None = field(default=None, metadata={"help": _GATE_HELP["layers"]})
    gate_heads: list[int] | None = field(default=None, metadata={"help": _GATE_HELP["heads"]})
    gate_tau_init: float = field(default=0.0, metadata={"help": _GATE_HELP["tau_init"]})
    gate_alpha_init: float = field(default=0.0, metadata={"help": _GATE_HELP["alpha_init"]})
    train_only_gates: bool = field(
        default=False, metadata={"help": "Freeze every weight but the energy gates (added, or of the checkpoint)."}
    )
    lora_r: int = field(default=0, metadata={"help": "Rank of LoRA adapters (PEFT); 0: no LoRA."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA scaling α (the update is scaled by α / r)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA branch."})
    lora_target_modules: list[str] | None = field(
        default=None,
        metadata={"help": "Module names LoRA adapts (default: PEFT's for the model type; hf_spectral registers "
                  "EGA-GPT's, CHIAR-Former's and the energy-gated models'). Added gates always train beside LoRA "
                  "and are saved in the adapter."},
    )
    calibrate_thresholds: bool = field(
        default=True,
        metadata={"help": "CHIAR-Former with threshold routing: set the entropy thresholds to percentiles of the "
                  "entropies measured on the first --calibration_batches training batches before training."},
    )
    calibration_batches: int = field(
        default=8,
        metadata={"help": "CHIAR-Former: training batches the thresholds are calibrated on; the routing fractions "
                  "and FLOPs logged during training are measured on them too."},
    )
    calibration_percentiles: list[float] | None = field(
        default=None,
        metadata={"help": "Entropy percentiles of the thresholds: one (2 routed operators; default 75, about 25%% of "
                  "the tokens to attention) or two (3 operators; default the authors' 33 67)."},
    )
    per_layer_thresholds: bool = field(
        default=False, metadata={"help": "Calibrate one threshold set per routed layer (default: one shared set)."}
    )
    leak_free_eval_batches: int | None = field(
        default=None,
        metadata={"help": "Causal LMs: the first N evaluation batches are also scored leak-free, each token predicted "
                  "from its prefix (eval_leak_free_loss, by cached decoding for a model whose gates use window "
                  "statistics and see future tokens), beside the ordinary loss on the same batches (eval_leaky_loss)."
                  " Default: 4 for a model that sees future tokens, none for others (whose two losses are equal)."},
    )
    gate_learning_rate: float | None = field(
        default=None,
        metadata={"help": "Learning rate of the energy gates (added or the model's own; default: --learning_rate): "
                  "gates that start as the identity beside pretrained weights train faster with a higher one."},
    )
    gate_scalar_weight_decay: bool = field(
        default=False,
        metadata={"help": "Apply --weight_decay to the gates' scalars (τ, α, mixing logits, Morlet ω₀ / σ) too. By "
                  "default they are not decayed, as in the EGA authors' optimiser: decay pulls the gates towards 0."},
    )
    eval_samples_during_training: int | None = field(
        default=None,
        metadata={"help": "Evaluations during training (--eval_strategy) score only the first N evaluation examples: "
                  "a cheap validation curve. The final evaluation scores all of them (or --max_eval_samples)."},
    )
    train_eval_samples: int = field(
        default=0,
        metadata={"help": "With --do_eval: also score the first N training examples in evaluation mode (no dropout) "
                  "after training: eval_train_loss, and the generalisation gap eval_generalization_gap = eval_loss "
                  "- eval_train_loss."},
    )

    def __post_init__(self):
        changed = [item.name for item in dataclasses.fields(self) if getattr(self, item.name) != item.default]
        gate_options = [name for name in changed if name.removeprefix("gate_") in _GATE_HELP]  # EnergyGateConfig's
        if gate_options and not self.add_energy_gates:
            raise ValueError(f"--{gate_options[0]} configures added gates: use it with --add_energy_gates")
        lora_options = [name for name in changed if name.startswith("lora_") and name != "lora_r"]
        if lora_options and self.lora_r == 0:
            raise ValueError(f"--{lora_options[0]} configures LoRA: use it with --lora_r (a rank > 0)")
        if self.lora_r < 0:
            raise ValueError(f"--lora_r must be 0 (no LoRA) or a positive rank, got {self.lora_r}")
        if self.train_only_gates and self.lora_r:
            raise ValueError("--train_only_gates trains the gates alone; with --lora_r added gates already train "
                             "beside the adapters")
        for name in ("calibration_batches", "eval_samples_during_training"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name} must be at least 1, got {getattr(self, name)}")
        for name in ("leak_free_eval_batches", "train_eval_samples"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"--{name} must be 0 or more, got {getattr(self, name)}")
        if self.gate_learning_rate is not None and not self.gate_learning_rate > 0:
            raise ValueError(f"--gate_learning_rate must be positive, got {self.gate_learning_rate}")
        if self.add_energy_gates:
            self.gate_config()  # its own checks (a ValueError naming the setting)

    def gate_config(self) -> EnergyGateConfig:
        return EnergyGateConfig(
            normalization=self.gate_normalization, energy_kind=self.gate_energy_kind,
            projections=self.gate_projections, scales=self.gate_scales, layers=self.gate_layers,
            heads=self.gate_heads, tau_init=self.gate_tau_init, alpha_init=self.gate_alpha_init,
        )


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each option's default in its help; the description (the script's docstring, with examples) as written."""


class ArgumentParser(HfArgumentParser):
    """``HfArgumentParser`` whose errors (an invalid choice, a value of the wrong type) are a one-line `UsageError`
    instead of argparse's usage text and exit."""

    def error(self, message):
        raise UsageError(message)


def parse_arguments(dataclass_types: tuple, argv: list | None, prog: str, description: str) -> tuple:
    """The dataclasses of ``argv``: options as on any command line or, first, a ``.json`` file of them (the keys
    are the options' names), which the options after it override."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = ArgumentParser(dataclass_types, prog=prog, description=description, formatter_class=HelpFormatter)
    if argv and argv[0].endswith(".json"):
        path, argv = argv[0], argv[1:]
        try:
            with open(path, encoding="utf-8") as handle:
                values = json.load(handle)
        except (OSError, ValueError) as error:
            raise UsageError(f"cannot read the arguments file {path}: {one_line(error)}") from error
        if not isinstance(values, dict):
            raise UsageError(f"{path} must hold a JSON object of arguments, not a {type(values).__name__}")
        known = {item.name for kind in dataclass_types for item in dataclasses.fields(kind)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise UsageError(f"{path}: unknown arguments {', '.join(unknown)}")
        parser.set_defaults(**values)
    try:
        *parsed, unknown = parser.parse_args_into_dataclasses(args=argv, look_for_args_file=False,
                                                              return_remaining_strings=True)
    except ValueError as error:  # a value a __post_init__ refuses
        raise UsageError(one_line(error)) from error
    if unknown:
        raise UsageError(f"unrecognized arguments: {' '.join(unknown)}")
    return tuple(parsed)


def check_arguments(model_args, spectral_args, training_args) -> None:
    """What no single dataclass can check."""
    if spectral_args.lora_r and model_args.from_scratch:
        raise UsageError("--lora_r adapts a pretrained --model_name_or_path: a new model's random weights would be "
                         "the adapter's base, and they are not saved")
    if not (training_args.do_train or training_args.do_eval or training_args.do_predict):
        raise UsageError("nothing to do: pass --do_train, --do_eval and / or --do_predict")
    if spectral_args.train_eval_samples and not training_args.do_eval:
        raise UsageError("--train_eval_samples is reported with the evaluation: add --do_eval")
    from transformers.integrations import get_reporting_integration_callbacks

    with said_as_usage_error("--report_to"):  # else refused by Trainer, once the data are prepared
        get_reporting_integration_callbacks(training_args.report_to)
    checkpoint = training_args.resume_from_checkpoint
    if checkpoint is not None and not os.path.isdir(checkpoint):
        raise UsageError(f"--resume_from_checkpoint {checkpoint}: no such checkpoint folder")


def setup_logging(training_args) -> None:
    """Log lines as run_clm's: INFO on the main process, warnings on the others."""
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", datefmt="%m/%d/%Y %H:%M:%S",
                        handlers=[logging.StreamHandler(sys.stdout)])
    level = training_args.get_process_log_level()
    logging.getLogger(__package__.rpartition(".")[0]).setLevel(level)  # the scripts' and this module's loggers
    datasets.utils.logging.set_verbosity(level)
    transformers.utils.logging.set_verbosity(level)


# ----------------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------------


def check_data_arguments(data_args, extensions: tuple, positive: tuple) -> None:
    """The data options of a script: its data (``check_data_files``), a held-out percentage in 1..99, and the
    options named in ``positive`` positive where given."""
    check_data_files(data_args, extensions)
    if not 0 < data_args.validation_split_percentage < 100:
        raise ValueError(f"--validation_split_percentage must be in 1..99, got {data_args.validation_split_percentage}")
    for name in positive:
        if getattr(data_args, name) is not None and getattr(data_args, name) < 1:
            raise ValueError(f"--{name} must be positive, got {getattr(data_args, name)}")


def check_data_files(data_args, extensions: tuple) -> None:
    """A dataset name or data files, existing, of a known extension, the same for every split."""
    files = {"train": data_args.train_file, "validation": data_args.validation_file, "test": data_args.test_file}
    given = {split: path for split, path in files.items() if path}
    if data_args.dataset_name and given:
        raise ValueError("give either --dataset_name or data files (--train_file, --validation_file, --test_file), "
                         "not both")
    if not data_args.dataset_name and not given:
        raise ValueError("no data: give --dataset_name or --train_file (and optionally --validation_file)")
    for split, path in given.items():
        extension = path.rpartition(".")[2]
        if extension not in extensions:
            raise ValueError(f"--{split}_file {path}: the extension must be one of {', '.join(extensions)}")
        if not os.path.isfile(path):
            raise ValueError(f"--{split}_file {path}: no such file")
    if len({BUILDERS[path.rpartition('.')[2]] for path in given.values()}) > 1:
        raise ValueError("--train_file, --validation_file and --test_file must have the same format")


def load_raw_datasets(data_args, model_args, need_validation: bool, streaming: bool = False):
    """``{"train", "validation", "test"}`` splits, those there are (streamed with ``streaming``). Without a validation
    split, the first ``validation_split_percentage`` percent of the training split are held out (not possible for a
    stream)."""
    if data_args.dataset_name:
        with said_as_usage_error(f"cannot load the dataset {data_args.dataset_name}"):
            # (datasets 4 runs no dataset scripts and has no trust_remote_code option)
            code = {"trust_remote_code": True} if model_args.trust_remote_code else {}
            raw = datasets.load_dataset(data_args.dataset_name, data_args.dataset_config_name,
                                        cache_dir=model_args.cache_dir, token=model_args.token, streaming=streaming,
                                        **code)
    else:
        files = {split: path for split, path in (("train", data_args.train_file), ("test", data_args.test_file),
                                                 ("validation", data_args.validation_file)) if path}
        builder = BUILDERS[next(iter(files.values())).rpartition(".")[2]]
        options = {"keep_linebreaks": data_args.keep_linebreaks} if builder == "text" else {}
        with said_as_usage_error(f"cannot read {', '.join(files.values())}"):
            raw = datasets.load_dataset(builder, data_files=files, cache_dir=model_args.cache_dir,
                                        streaming=streaming, **options)
    if not {"train", "validation", "test"} & set(raw):
        raise UsageError(f"the dataset has no train, validation or test split (it has {', '.join(raw)})")
    if need_validation and "validation" not in raw:
        if streaming:
            raise UsageError("--streaming with --do_eval needs a validation split (--validation_file, or a dataset "
                             "that has one): a percentage of a stream cannot be held out")
        if "train" not in raw:
            raise UsageError("--do_eval needs a validation split or a training split to hold one out of")
        train = raw["train"]
        held_out = max(1, len(train) * data_args.validation_split_percentage // 100)
        if held_out >= len(train):
            raise UsageError(f"the training split ({len(train)} examples) is too small to hold out a validation split")
        raw["validation"] = train.select(range(held_out))
        raw["train"] = train.select(range(held_out, len(train)))
    return raw


def requested_splits(raw_datasets, training_args, spectral_args) -> list:
    """The splits a run reads: train (--do_train, or the training-loss evaluation of --train_eval_samples),
    validation (--do_eval) and test (--do_predict); a train or test split that is asked for and missing is a usage
    error (a missing validation split was held out of the training split already)."""
    wanted = {"train": training_args.do_train or spectral_args.train_eval_samples > 0,
              "validation": training_args.do_eval, "test": training_args.do_predict}
    splits = [split for split, needed in wanted.items() if needed]
    for split, option in (("train", "--do_train or --train_eval_samples"), ("test", "--do_predict")):
        if split in splits and split not in raw_datasets:
            raise UsageError(f"{option} needs a {split} split (--{split}_file, or a dataset that has one)")
    return splits


def column_names(dataset) -> list:
    """The columns of a dataset, also of a stream whose features are unknown until read (its first example's)."""
    if dataset.column_names is not None:
        return list(dataset.column_names)
    return list(next(iter(dataset)).keys())


def check_column(dataset, name: str, option: str) -> None:
    names = column_names(dataset)
    if name not in names:
        raise UsageError(f"{option} {name!r} is not a column of the data; its columns are {', '.join(names)}")


def first_examples(dataset, count: int | None):
    """The first ``count`` examples (all with None), of a dataset or a stream (or None)."""
    if count is None or dataset is None:
        return dataset
    if isinstance(dataset, datasets.IterableDataset):
        return dataset.take(count)
    return dataset.select(range(min(count, len(dataset))))


# ----------------------------------------------------------------------------------------------------------------
# Config, tokenizer, model
# ----------------------------------------------------------------------------------------------------------------


def parse_config_overrides(text: str, defaults) -> dict:
    """``key=value,key=value`` -> {key: value}, each value read as the type of the field's default in ``defaults``
    (as ``PreTrainedConfig.update_from_string``: numbers, true / false, strings), or as JSON where the default is
    None, a list or a dict; ``null`` is None. A comma starts a new item only before ``key=``, so JSON lists keep
    theirs."""
    overrides = {}
    if not text.strip():
        return overrides
    for item in re.split(r",(?=\s*\w+\s*=)", text.strip()):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not key:
            raise ValueError(f"--config_overrides takes key=value,key=value; got {item!r}")
        if not hasattr(defaults, key):
            raise ValueError(f"--config_overrides: {key!r} is not a field of {type(defaults).__name__}")
        default = getattr(defaults, key)
        try:
            if value == "null":
                overrides[key] = None
            elif isinstance(default, bool):
                if value.lower() not in ("true", "false"):
                    raise ValueError(f"expected true or false, got {value!r}")
                overrides[key] = value.lower() == "true"
            elif isinstance(default, int):
                overrides[key] = int(value)
            elif isinstance(default, float):
                overrides[key] = float(value)
            elif isinstance(default, str):
                overrides[key] = value
            else:
                overrides[key] = json.loads(value)
        except ValueError as error:
            raise ValueError(f"--config_overrides {key}={value}: {one_line(error)}") from error
    return overrides


def build_config(model_args, **task_fields):
    """The model's config: the checkpoint's (or --config_name's), or a new one of --model_type (EGA-GPT: of
    --variant) with --config_overrides. ``task_fields`` (e.g. num_labels) go to every config."""
    if model_args.model_name_or_path or model_args.config_name:
        source = model_args.config_name or model_args.model_name_or_path
        adapter = os.path.join(source, "adapter_config.json")
        if os.path.isfile(adapter) and not os.path.isfile(os.path.join(source, "config.json")):
            with open(adapter, encoding="utf-8") as handle:  # a PEFT adapter folder: the config of its base model
                source = json.load(handle)["base_model_name_or_path"]
        with said_as_usage_error(f"cannot read the config of {source}"):
            return AutoConfig.from_pretrained(source, **model_args.hub_kwargs(), **task_fields)
    with said_as_usage_error(f"cannot build the config of a new {model_args.model_type} model"):
        if model_args.variant:
            from hf_spectral import EGAConfig

            defaults = EGAConfig.from_variant(model_args.variant)
        else:
            defaults = CONFIG_MAPPING[model_args.model_type]()
        overrides = parse_config_overrides(model_args.config_overrides or "", defaults)
        if model_args.variant:
            return EGAConfig.from_variant(model_args.variant, **task_fields, **overrides)
        return AutoConfig.for_model(model_args.model_type, **task_fields, **overrides)


def build_tokenizer(model_args, train_texts=None, pad_token: str | None = None):
    """The tokenizer of --tokenizer_name or of the checkpoint; ``char``: a `CharTokenizer` of the characters of
    ``train_texts`` (an iterable of strings), with ``<unk>`` for the others, then `CharTokenizer.from_text`'s
    ``<pad>`` (or ``pad_token`` when given) and ``<eos>``: ids the data never holds (no token is added to the text),
    so that the trained model generates in batches, through pipelines and under lm-eval."""
    name = model_args.tokenizer_name or model_args.model_name_or_path
    if name == "char":
        from hf_spectral import CharTokenizer

        if train_texts is None:
            raise UsageError("--tokenizer_name char builds its vocabulary from the whole training split: it needs "
                             "one, not streamed (else save a CharTokenizer.from_text_file(...) and give its folder)")
        characters = set()
        for text in train_texts:
            characters.update(text)
        if not characters:
            raise UsageError("--tokenizer_name char: the training split holds no text")
        folder = tempfile.mkdtemp(prefix="char-tokenizer-")  # read at once; the tokenizer is saved with the model
        try:
            # split_special_tokens: a literal "<unk>" in the text (Penn Treebank has thousands) is five characters,
            # not the tokenizer's unknown-token id
            special_tokens = {"unk_token": "<unk>"} | ({"pad_token": pad_token} if pad_token else {})
            return CharTokenizer.from_text("".join(sorted(characters)), folder, split_special_tokens=True,
                                           add_eos_and_pad=model_args.char_eos_and_pad, **special_tokens)
        finally:
            shutil.rmtree(folder)
    if name is None:
        raise UsageError("a new model needs --tokenizer_name: a tokenizer folder or Hub id, or char")
    # AutoTokenizer would build an empty tokenizer from the config of a folder without one
    if os.path.isdir(name) and not any(os.path.isfile(os.path.join(name, file)) for file in TOKENIZER_FILES):
        raise UsageError(f"{name} holds no tokenizer: give --tokenizer_name")
    with said_as_usage_error(f"cannot load the tokenizer {name}"):
        return AutoTokenizer.from_pretrained(name, **model_args.hub_kwargs())


def build_model(auto_class, model_args, config, tokenizer):
    """The checkpoint's weights, or a new model of ``config`` sized to the tokenizer (unless --config_overrides
    set vocab_size); a tokenizer larger than the embeddings grows them (run_clm's rule)."""
    if model_args.from_scratch:
        if not model_args.sets_vocab_size:
            config.vocab_size = len(tokenizer)
        with said_as_usage_error(f"cannot build a {config.model_type} model for {auto_class.__name__}"):
            model = auto_class.from_config(config, trust_remote_code=model_args.trust_remote_code,
                                           attn_implementation=model_args.attn_implementation)
    else:
        dtype = "auto" if model_args.dtype == "auto" else getattr(torch, model_args.dtype)
        with said_as_usage_error(f"cannot load {model_args.model_name_or_path} as {auto_class.__name__}"):
            model = auto_class.from_pretrained(model_args.model_name_or_path, config=config, dtype=dtype,
                                               attn_implementation=model_args.attn_implementation,
                                               **model_args.hub_kwargs())
    embedding_size = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > embedding_size:
        model.resize_token_embeddings(len(tokenizer))
    return model


def prepare_for_training(model, training_args) -> None:
    """TrainingArguments the model needs: a routed CHIAR-Former's operator that no token of a process's batch chose
    gets no gradient there, which DistributedDataParallel refuses unless told to look for unused parameters."""
    if is_chiar(model) and base_model(model).config.routed_layers and training_args.ddp_find_unused_parameters is None:
        training_args.ddp_find_unused_parameters = True


def save_gates_alone(trainer) -> None:
    """``energy_gates.safetensors`` beside a model whose gates alone trained: a few kilobytes that rebuild it from the
    model the gates were added to (`hf_spectral.retrofit.load_energy_gates`)."""
    from hf_spectral.retrofit import save_energy_gates

    if trainer.is_world_process_zero():
        save_energy_gates(trainer.model, os.path.join(trainer.args.output_dir, "energy_gates.safetensors"))


def load_metric(name: str):
    """A local ``evaluate`` module of ``training/metrics/<name>/`` (works offline), in memory and under an experiment
    id of its own: runs at the same time must not share evaluate's cache files."""
    import evaluate

    path = os.path.join(METRICS_DIR, name)
    if not os.path.isfile(os.path.join(path, f"{name}.py")):
        raise FileNotFoundError(f"no metric module {name!r} under {METRICS_DIR}")
    return evaluate.load(path, keep_in_memory=True, experiment_id=uuid.uuid4().hex)


def base_model(model):
    """The transformers model inside a PEFT model (the model itself otherwise)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def add_gates_and_lora(model, spectral_args, task_type: str):
    """The project's additions to ``model``: energy gates (identity at α = 0), only the gates trainable, or LoRA
    adapters with the added gates training beside them and saved in the adapter (PEFT ``modules_to_save``)."""
    if spectral_args.add_energy_gates:
        with said_as_usage_error("--add_energy_gates"):
            add_energy_gates(model, spectral_args.gate_config())
    if spectral_args.train_only_gates:
        if not has_energy_gates(model):
            raise UsageError("--train_only_gates: the model has no retrofitted energy gates; add them with "
                             "--add_energy_gates")
        mark_only_gates_trainable(model)
    if spectral_args.lora_r:
        from peft import LoraConfig, get_peft_model

        lora_config = LoraConfig(
            task_type=task_type, r=spectral_args.lora_r, lora_alpha=spectral_args.lora_alpha,
            lora_dropout=spectral_args.lora_dropout, target_modules=spectral_args.lora_target_modules,
            modules_to_save=["energy_gate"] if spectral_args.add_energy_gates else None,
        )
        with said_as_usage_error("--lora_r"):
            model = get_peft_model(model, lora_config)
    trainable, total = trainable_parameters(model), sum(p.numel() for p in model.parameters())
    logger.info(f"trainable parameters: {trainable:,} of {total:,} ({100 * trainable / total:.3f}%)")
    return model


def trainable_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def sees_future_tokens(config) -> bool:
    """Whether a causal LM of ``config`` lets later tokens move its gates (window statistics)."""
    if config.model_type == "ega_gpt":
        return config.sees_future
    return (getattr(config, "energy_gates", None) or {}).get("normalization") == "window"


def leak_free_metrics(model, batches: list) -> dict:
    """Next-token loss of ``batches`` with each token predicted from its prefix alone and its perplexity, beside
    ``leaky_loss``: the ordinary forward pass's loss on the same batches. For a model whose gates see future tokens
    the leak-free loss comes from cached decoding, one step per token (`hf_spectral.evaluation.causal_lm_losses`);
    for any other the two are the same forward pass."""
    from hf_spectral.evaluation import causal_lm_losses, evaluation_mode

    device = next(model.parameters()).device
    future = sees_future_tokens(base_model(model).config)
    losses = []
    for batch in batches:
        input_ids = batch["input_ids"].to(device)
        mask = None if batch.get("attention_mask") is None else batch["attention_mask"].to(device)
        if future:
            losses.append(causal_lm_losses(model, input_ids, mask))
        else:
            with evaluation_mode(model), torch.no_grad():
                loss = float(model(input_ids=input_ids, attention_mask=mask, labels=input_ids, use_cache=False).loss)
            losses.append({"loss": loss, "leak_free_loss": loss})
    leak_free = statistics.fmean(loss["leak_free_loss"] for loss in losses)
    return {"leak_free_loss": leak_free, "leak_free_perplexity": math.exp(leak_free),
            "leaky_loss": statistics.fmean(loss["loss"] for loss in losses)}


# ----------------------------------------------------------------------------------------------------------------
# Training: the optimiser of the additions, what is logged while training
# ----------------------------------------------------------------------------------------------------------------

# The energy gates' scalars: threshold τ, slope α, the mixing logits of several scales, Morlet ω₀ and σ
GATE_SCALARS = re.compile(r"\.energy_gate\..*(tau|alpha|mix_logits|omega|sigma)$")


class SpectralTrainer(Trainer):
    """``Trainer`` with the additions' optimiser settings: the gates' scalars get no weight decay (unless
    --gate_scalar_weight_decay) and the gates their own learning rate (--gate_learning_rate). Its saves give the files
    they write the umask's modes (safetensors writes 0600), and the pushes of checkpoints carry the model's code, so
    that a Hub repository loads with ``trust_remote_code`` at every commit (Trainer copies the weights and config
    only)."""

    def __init__(self, *args, spectral_args, **kwargs):
        super().__init__(*args, **kwargs)
        self.spectral_args = spectral_args

    def get_decay_parameter_names(self, model) -> list:
        names = super().get_decay_parameter_names(model)
        if self.spectral_args.gate_scalar_weight_decay:
            return names
        return [name for name in names if not GATE_SCALARS.search(name)]

    def create_optimizer(self, model=None):
        creating = self.optimizer is None
        optimizer = super().create_optimizer(model)
        rate = self.spectral_args.gate_learning_rate
        if creating and rate is not None:  # the gates of each parameter group move to a group of their own
            gates = {id(p) for name, p in (model or self.model).named_parameters() if ".energy_gate." in name}
            for group in list(optimizer.param_groups):
                moved = [p for p in group["params"] if id(p) in gates]
                if moved:
                    group["params"] = [p for p in group["params"] if id(p) not in gates]
                    optimizer.add_param_group({**group, "params": moved, "lr": rate})
        return optimizer

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        folder = output_dir or self.args.output_dir
        saving = umask_permissions_for_what_is_written(folder) if self.args.should_save else contextlib.nullcontext()
        with saving:
            super().save_model(output_dir, _internal_call)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        if self.is_world_process_zero():
            for name in os.listdir(checkpoint_folder):
                if name.endswith(".py") or name == "energy_gate_config.json":
                    shutil.copy(os.path.join(checkpoint_folder, name), os.path.join(self.args.output_dir, name))
        super()._push_from_checkpoint(checkpoint_folder)


def gate_values(model) -> dict:
    """τ and α of every energy gate (EGA-GPT's or added; of PEFT's trained copy, not its frozen original), per layer
    and head, averaged over scales: ``gates/L<layer>/H<head>/tau`` and ``.../alpha``."""
    parameters = dict(model.named_parameters())
    values = {}
    for name, tau in parameters.items():
        if ".energy_gate." in name and name.endswith(".tau") and "original_module" not in name:
            layer = re.search(r"\.(?:h|layers|layer)\.(\d+)\.", name).group(1)
            alpha = parameters[name.removesuffix("tau") + "alpha"]
            for kind, values_per_head in (("tau", tau), ("alpha", alpha)):
                for head, value in enumerate(values_per_head.detach().float().mean(-1).tolist()):
                    values[f"gates/L{layer}/H{head}/{kind}"] = round(value, 5)
    return values


# ----------------------------------------------------------------------------------------------------------------
# CHIAR-Former: calibration, routing fractions and FLOPs
# ----------------------------------------------------------------------------------------------------------------


def is_chiar(model) -> bool:
    return base_model(model).config.model_type == "chiar_former"


def fixed_batches(dataset, collator, count: int, batch_size: int) -> list:
    """The first ``count`` batches of ``dataset`` (a dataset or a stream), in order, collated."""
    rows = list(itertools.islice(iter(dataset), count * batch_size))
    return [collator(rows[start:start + batch_size]) for start in range(0, len(rows), batch_size)]


def calibrate_routing(model, batches: list, spectral_args) -> dict | None:
    """CHIAR-Former with threshold routing: thresholds at percentiles of the entropies measured on ``batches``
    (None for other models). Every process of a data-parallel run measures the same batches with the same weights,
    so each sets the thresholds one process would."""
    from hf_spectral.models.chiar_former import calibrate_thresholds

    chiar = base_model(model)
    config = chiar.config
    if not (spectral_args.calibrate_thresholds and config.routed_layers and config.router_type == "threshold"):
        return None
    with said_as_usage_error("cannot calibrate the routing thresholds"):
        result = calibrate_thresholds(chiar, batches, percentiles=spectral_args.calibration_percentiles,
                                      per_layer=spectral_args.per_layer_thresholds, across_processes=False)
    logger.info(f"routing thresholds calibrated on {len(batches)} training batches: {result['thresholds']}")
    return result


@torch.no_grad()
def routing_profile(model, batches: list) -> dict:
    """On ``batches``, in evaluation mode: the fraction of the (non-padding) tokens each routed layer sends to each
    operator (``routing/L<layer>/<operator>``) and the GFLOPs per sequence of the routing taken (`count_flops`)."""
    from hf_spectral.evaluation import evaluation_mode
    from hf_spectral.models.chiar_former import count_flops

    chiar = base_model(model)
    config = chiar.config
    device = next(chiar.parameters()).device
    counts = torch.zeros(len(config.routed_layers), len(config.routed_operators or ()))
    flops = {"attention": 0.0, "total": 0.0}
    sequences = 0
    with evaluation_mode(chiar):
        for batch in batches:
            input_ids = batch["input_ids"].to(device)
            mask = batch.get("attention_mask")
            mask = None if mask is None else mask.to(device)
            packed = {"position_ids": batch["position_ids"].to(device)} if "position_ids" in batch else {}
            outputs = chiar(input_ids=input_ids, attention_mask=mask, output_routing=True, **packed,
                            **({"use_cache": False} if config.is_causal else {}))
            valid = torch.ones_like(input_ids, dtype=torch.bool) if mask is None else mask.bool()
            for layer, routes in enumerate(outputs.routing_decisions):
                counts[layer] += torch.bincount(routes[valid].cpu(), minlength=counts.shape[1]).float()
            found = count_flops(config, *input_ids.shape, [d.cpu() for d in outputs.routing_decisions],
                                attention_mask=None if mask is None else mask.cpu(),
                                lm_head_positions=input_ids.shape[1] if hasattr(chiar, "lm_head") else None)
            for key in flops:
                flops[key] += found[key]
            sequences += input_ids.shape[0]
    fractions = counts / counts.sum(-1, keepdim=True).clamp_min(1)
    profile = {f"routing/L{layer}/{operator}": round(float(share), 4)
               for layer, row in zip(config.routed_layers, fractions)
               for operator, share in zip(config.routed_operators, row)}
    profile.update({f"{key}_gflops_per_seq": round(value / max(sequences, 1) / 1e9, 6) for key, value in flops.items()})
    return profile


class TrainingLogCallback(TrainerCallback):
    """After every training log line and at the end of training, logs what the model's additions do, as a log entry
    of its own (to every ``report_to`` integration and ``trainer_state.json``): ``train_seconds``, the wall-clock
    seconds of the optimiser steps so far (forward, backward, update; no evaluation or saving); the gates' τ and α
    (`gate_values`); for a CHIAR-Former its routing fractions and FLOPs on fixed training batches
    (`routing_profile` of ``routing_batches``). Each step's seconds are kept for the model card.

    It logs through the trainer, which `set_trainer` gives it once the trainer exists."""

    def __init__(self, routing_batches: list | None = None):
        self.routing_batches, self.trainer = routing_batches, None
        self.step_seconds, self._start, self._logged_step, self._seconds_before = [], None, None, 0.0

    def set_trainer(self, trainer) -> None:
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        # A resumed run's clock goes on from the time its checkpoint had logged
        logged = [entry["train_seconds"] for entry in state.log_history if "train_seconds" in entry]
        self._seconds_before = logged[-1] if logged else 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self._start is not None:
            self.step_seconds.append(time.perf_counter() - self._start)
            self._start = None

    def on_log(self, args, state, control, logs=None, model=None, **kwargs):
        if "loss" in (logs or {}):  # a training log line (not this callback's own entry, nor evaluation's)
            self._log(state, model)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if self._logged_step != state.global_step:
            self._log(state, model)

    def _log(self, state, model):
        self._logged_step = state.global_step
        entry = {"train_seconds": round(self._seconds_before + sum(self.step_seconds), 3), **gate_values(model)}
        if self.routing_batches is not None:
            entry.update(routing_profile(model, self.routing_batches))
        self.trainer.log(entry)


# ----------------------------------------------------------------------------------------------------------------
# Model card
# ----------------------------------------------------------------------------------------------------------------

EGA_VARIANT_DESCRIPTIONS = {
    "BASE": "no energy gates (baseline)", "EGA-1": "one linear energy projection per head",
    "EGA-2": "two linear energy projections per head", "EGA-4": "four linear energy projections per head",
    "EGA-C": "causal Conv1d energies", "EGA-M-F": "fixed causal Morlet energies",
    "EGA-M": "learned causal Morlet energies", "EGA-DB2": "Daubechies db2 high-pass energies",
    "EGA-DB4": "Daubechies db4 high-pass energies",
}


# Metrics a card's results table and model index show (``eval_<name>`` and ``test_<name>``; run_clm's validation
# perplexity is ``perplexity``)
CARD_METRICS = ("loss", "perplexity", "accuracy", "leak_free_loss", "leak_free_perplexity")


def ega_variant(config) -> str:
    """The EGA paper's variant ``config`` is (BASE when it has no gates), or "custom"."""
    from hf_spectral.models.ega_gpt.configuration_ega_gpt import VARIANTS

    if not config.gated_layers:
        return "BASE"
    for name, values in VARIANTS.items():
        if name != "BASE" and all(getattr(config, key) == value for key, value in values.items()):
            return name
    return "custom"


def card_family(model) -> str | None:
    """The model card of ``model_cards/`` a trained ``model`` gets: ``ega_gpt`` or ``chiar_former`` for a whole model
    of those families, ``energy_gated`` for a model with added energy gates (whole or as a PEFT adapter), else None
    (Trainer's card)."""
    inner = base_model(model)
    if inner.config.model_type in ("ega_gpt", "chiar_former"):
        return inner.config.model_type if model is inner else None
    return "energy_gated" if has_energy_gates(inner) else None


def write_model_card(trainer, model_args, data_args, metrics: dict, *, script: str, task: str,
                     tokenizer, log_callback=None) -> None:
    """README.md of ``output_dir`` (and of the Hub repository with --push_to_hub): the family card of
    ``model_cards/`` (`card_family`) with this model's section; Trainer's card for other models."""
    training_args = trainer.args
    dataset = data_args.dataset_name or os.path.basename(data_args.train_file or data_args.validation_file
                                                         or data_args.test_file)
    kwargs = {"finetuned_from": model_args.model_name_or_path, "tasks": task, "dataset": dataset}
    if data_args.dataset_config_name:
        kwargs["dataset_args"] = data_args.dataset_config_name
    family = card_family(trainer.model)
    if family is None:
        if training_args.push_to_hub:
            trainer.push_to_hub(**kwargs)
        else:
            trainer.create_model_card(**kwargs)
        return
    if training_args.push_to_hub:
        trainer.push_to_hub(**kwargs)  # uploads the folder; its card is replaced below
    if not trainer.is_world_process_zero():
        return
    card = family_card(family, trainer, model_args, data_args, dataset, metrics, script, task, tokenizer,
                       log_callback.step_seconds if log_callback else [])
    card.save(os.path.join(training_args.output_dir, "README.md"))
    if training_args.push_to_hub:
        card.push_to_hub(trainer.hub_model_id, token=training_args.hub_token)


def family_card(family: str, trainer, model_args, data_args, dataset: str, metrics: dict, script: str, task: str,
                tokenizer, step_seconds: list):
    from huggingface_hub import ModelCardData

    from ..results import current_command, hardware_summary
    from .model_card import eval_results, render_model_card

    args, model = trainer.args, trainer.model
    config = base_model(model).config
    model_name = (args.hub_model_id or os.path.basename(os.path.abspath(args.output_dir))).split("/")[-1]
    rows = []  # (metric name, split, metric type, value)
    for key, value in metrics.items():
        for prefix, split in (("eval_", "validation"), ("test_", "test"), ("", "validation")):
            if key.startswith(prefix) and key.removeprefix(prefix) in CARD_METRICS:
                rows.append((key, split, key.removeprefix(prefix), value))
                break
    table = "| metric | value |\n|---|---|\n" + "".join(f"| {name} | {value:.4f} |\n" for name, _, _, value in rows)
    card_data = ModelCardData(
        model_name=model_name, pipeline_tag=task, datasets=[data_args.dataset_name] if data_args.dataset_name else None,
        library_name="peft" if model is not base_model(model) else None,  # PEFT's loader reads an adapter's card
        eval_results=eval_results(rows, task_type=task, dataset_id=dataset, dataset_name=dataset),
    )
    hardware = hardware_summary()
    origin = (f"fine-tuned from `{model_args.model_name_or_path}`" if model_args.model_name_or_path
              else "trained from scratch")
    kind = {"chiar_former": "A CHIAR-Former", "ega_gpt": "An EGA-GPT"}.get(family,
                                                                      f"A `{type(base_model(model)).__name__}`")
    common = {
        "model_name": model_name, "recipe": script, "command": current_command(), "seed": args.seed,
        "summary": f"{kind} {origin} on {dataset} with the hf_spectral script `{script}` (transformers' `Trainer`).",
        "num_parameters": f"{sum(p.numel() for p in model.parameters()):,}",
        "tokenizer_description": f"`{type(tokenizer).__name__}`, {len(tokenizer)} ids",
        "dataset_description": dataset,
        "schedule": (f"{trainer.state.global_step} steps, batch {args.per_device_train_batch_size} per device × "
                     f"{args.world_size} × {args.gradient_accumulation_steps} accumulation, "
                     f"{getattr(args.optim, 'value', args.optim)} lr {args.learning_rate}, weight decay "
                     f"{args.weight_decay}, {getattr(args.lr_scheduler_type, 'value', args.lr_scheduler_type)} "
                     "schedule"),
        "hardware": f"{hardware.get('cuda') or hardware.get('cpu_model') or hardware.get('processor')}",
        "wall_time": f"{metrics['train_runtime']:.1f} s of training" if "train_runtime" in metrics else "n/a",
        "results_table": table, "results_notes": "", "repo_id": args.hub_model_id or args.output_dir,
    }
    if family == "energy_gated":
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        gates = sum(p.numel() for name, p in model.named_parameters() if p.requires_grad and ".energy_gate." in name)
        adapter = model is not base_model(model)
        return render_model_card(
            "energy_gated", card_data, **common, adapter=adapter,
            size=f"{config.num_hidden_layers} layers, {config.num_attention_heads} heads, width {config.hidden_size}",
            trained_description=("LoRA adapters and the energy gates" if adapter else "only the energy gates"
                                 if trainable == gates else "every weight and the energy gates"),
            trainable_parameters=f"{trainable:,}",
            total_parameters=f"{sum(p.numel() for n, p in model.named_parameters() if 'original_module' not in n):,}",
            gate_config=json.dumps(config.energy_gates),
        )
    if family == "ega_gpt":
        variant = ega_variant(config)
        return render_model_card(
            "ega_gpt", card_data, **common, variant=variant,
            variant_description=EGA_VARIANT_DESCRIPTIONS.get(variant, "a configuration of its own"),
            normalization=config.energy_normalization if config.gated_layers else "n/a (no gates)",
            sees_future=sees_future_tokens(config),
            size=(f"{config.num_hidden_layers} layers, {config.num_attention_heads} heads, C = {config.hidden_size}, "
                  f"context {config.max_position_embeddings}"),
            gate_parameters=f"{sum(p.numel() for n, p in model.named_parameters() if '.energy_gate.' in n):,}",
        )
    routed = bool(config.routed_layers)
    return render_model_card(
        "chiar_former", card_data, **common,
        arm=f"{config.router_type}-routed" if routed else "not routed",
        arm_description=(f"routed layers choose among {', '.join(config.routed_operators)} per token"
                         if routed else "every layer runs one operator"),
        layers=" / ".join(config.layer_operators),
        size=(f"{config.num_hidden_layers} layers, d = {config.hidden_size}, {config.num_attention_heads} heads, "
              f"{config.layer_norm_position}-LN"),
        thresholds=json.dumps({str(layer): config.thresholds_for(layer) for layer in config.routed_layers})
        if routed and config.router_type == "threshold" else "n/a",
        seconds_per_step=f"{statistics.median(step_seconds):.3f} s" if step_seconds else "n/a",
        auto_class="ForCausalLM" if task == "text-generation" else "ForSequenceClassification",
    )
