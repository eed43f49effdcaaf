"""What the benchmark entry points and the reproductions share: a benchmark's configuration (``training/configs/``)
with each run's overrides, one run of ``run_clm`` or ``run_classification`` per arm and seed, and the files those
write read back for the tables.

A run folder holds ``args.json``, the configuration with the run's overrides (``python -m training.run_clm
<folder>/args.json`` trains that run again), and what the script writes: the model, ``all_results.json``,
``trainer_state.json`` and the model card ``README.md``, written last. A run with its card is complete and reused; one
with a checkpoint resumes from the newest complete one; either only under the arguments it was made with (other
arguments are refused, naming the differences).

Nothing heavy is imported at module level: the entry points answer ``--help`` before torch loads.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .cli import ArgumentParser, UsageError, positive_int

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
PACKAGE = __package__.rpartition(".")[0]  # `training` in a checkout, `hf_spectral.recipes` installed


def config(name: str) -> dict:
    """The arguments of ``training/configs/<name>.json``."""
    with open(os.path.join(CONFIGS, f"{name}.json"), encoding="utf-8") as handle:
        return json.load(handle)


def override_items(text: str | None) -> dict:
    """``key=value,key=value`` (run_clm's --config_overrides; a comma inside a JSON list stays in its value) as a
    dict of the values' texts."""
    items = {}
    for item in re.split(r",(?=\s*\w+\s*=)", text or ""):
        if item.strip():
            key, sep, value = item.partition("=")
            if not sep:
                raise UsageError(f"--config_overrides takes KEY=VALUE,KEY=VALUE; got {item.strip()!r}")
            items[key.strip()] = value.strip()
    return items


def merge_overrides(text: str | None, values: dict) -> str:
    """``config_overrides`` text with ``values`` set in it (values that are no strings written as JSON)."""
    items = override_items(text)
    items.update({key: value if isinstance(value, str) else json.dumps(value) for key, value in values.items()})
    return ",".join(f"{key}={value}" for key, value in items.items())


def driver_parser(prog: str, description: str) -> ArgumentParser:
    """A driver's parser with the options every driver has; its other options are the script's, for every run."""
    import argparse

    # (no abbreviations: a script's option such as --seed would be taken for the driver's --seeds)
    parser = ArgumentParser(prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                            allow_abbrev=False,
                            epilog="Any other option is the training script's (run_clm / run_classification, e.g. "
                                   "--max_steps, --learning_rate, --bf16, --report_to) and applies to every run.")
    parser.add_argument("--seeds", type=int, nargs="+", help="one run per seed (default: the benchmark's)")
    parser.add_argument("--output_dir", help="where the runs and the table are written")
    parser.add_argument("--data_dir", default="data", type=os.path.abspath,
                        help="where the data files and tokenizers the runs read are written (default: data/, the "
                             "folder the configurations name)")
    parser.add_argument("--prepare_data", action="store_true", help="write the data files, then stop")
    parser.add_argument("--jobs", type=positive_int, default=1,
                        help="runs at once: 1 trains them one after the other in this process; more start that many "
                             "processes at a time, each logging to <output_dir>/logs/")
    parser.add_argument("--threads", type=positive_int, help="torch threads per run (default: torch's choice)")
    parser.add_argument("--dry_run", action="store_true", help="print each run's command and state, then stop")
    return parser


def add_size_arguments(parser) -> None:
    """Options for the model's size and the batch, each changing the configuration where it says so."""
    group = parser.add_argument_group("size (changes the configuration)")
    for name, kind, text in (
        ("num_hidden_layers", positive_int, "layers"), ("num_attention_heads", positive_int, "attention heads"),
        ("hidden_size", positive_int, "model width"),
        ("context_length", positive_int, "tokens per example: the model's positions and the data's blocks"),
        ("dropout", float, "dropout of the model"), ("batch_size", positive_int, "examples per device and step"),
        ("eval_batches", positive_int, "batches of the validation curve (--eval_samples_during_training)"),
    ):
        group.add_argument(f"--{name}", type=kind, help=text)
    group.add_argument("--config_overrides", help="KEY=VALUE,KEY=VALUE set in the configuration's config_overrides")


def apply_sizes(arguments: dict, args, dropout_fields: tuple, length_argument: str) -> dict:
    """``arguments`` with the size options of `add_size_arguments` given in ``args``: the model's fields in
    config_overrides (``dropout_fields``: the config's dropout fields), the length in ``length_argument`` too."""
    fields = {name: getattr(args, name) for name in ("num_hidden_layers", "num_attention_heads", "hidden_size")
              if getattr(args, name) is not None}
    if args.context_length is not None:
        fields["max_position_embeddings"] = arguments[length_argument] = args.context_length
    if args.dropout is not None:
        if not 0 <= args.dropout < 1:
            raise UsageError(f"--dropout must be in [0, 1), got {args.dropout}")
        fields.update(dict.fromkeys(dropout_fields, args.dropout))
    if args.batch_size is not None:
        arguments["per_device_train_batch_size"] = arguments["per_device_eval_batch_size"] = args.batch_size
    if args.eval_batches is not None:
        arguments["eval_samples_during_training"] = args.eval_batches * arguments["per_device_eval_batch_size"]
    fields.update(override_items(args.config_overrides))
    return {**arguments, "config_overrides": merge_overrides(arguments.get("config_overrides"), fields)}


def parse(parser, argv) -> tuple:
    """The driver's options, and the other tokens of the command line: the training script's options for every run
    (`script_options` reads them)."""
    argv = [token for token in (sys.argv[1:] if argv is None else argv) if token != "--"]  # (an older separator)
    args, rest = parser.parse_known_args(argv)
    if any(seed < 0 or seed >= 2**32 for seed in args.seeds or ()):
        raise UsageError(f"--seeds must be integers in [0, 2**32 - 1], got {' '.join(map(str, args.seeds))}")
    return args, rest


def script_options(script: str, tokens: list) -> dict:
    """The options among ``tokens`` (``--max_steps 100 --bf16``), typed by ``script``'s own parser, as JSON values:
    what a driver's command line passes on to every run. An option the script does not have is a `UsageError`."""
    import argparse

    if not tokens:
        return {}
    module = importlib.import_module(f"{PACKAGE}.{script}")
    from .run_scripts import ArgumentParser as ScriptParser

    parser = ScriptParser(module.ARGUMENTS)
    for action in parser._actions:  # only the options given, not every default
        action.default = argparse.SUPPRESS
    return {key: getattr(value, "value", value) for key, value in vars(parser.parse_args(tokens)).items()}


@dataclass
class Run:
    """One training run: the script's name and its arguments (``output_dir``: the run folder)."""

    name: str
    script: str
    arguments: dict

    @property
    def folder(self) -> str:
        return self.arguments["output_dir"]

    @property
    def complete(self) -> bool:
        return os.path.isfile(os.path.join(self.folder, "README.md"))

    def command(self) -> str:
        return f"python -m {PACKAGE}.{self.script} {os.path.join(self.folder, 'args.json')}"


def check(runs: list) -> None:
    """Every run's arguments as its script will read them, before any run starts (a bad option of the last run would
    otherwise stop a reproduction after hours)."""
    from transformers import HfArgumentParser

    from .run_scripts import build_config, check_arguments, one_line

    for run in runs:
        module = importlib.import_module(f"{PACKAGE}.{run.script}")
        try:
            model_args, _, spectral_args, training_args = HfArgumentParser(module.ARGUMENTS).parse_dict(run.arguments)
        except (ValueError, TypeError) as error:
            raise UsageError(f"{run.name}: {one_line(error)}") from None
        check_arguments(model_args, spectral_args, training_args)
        if model_args.from_scratch:
            build_config(model_args)  # its overrides checked (a checkpoint's may not exist yet)


def last_checkpoint(folder: str) -> str | None:
    """The newest checkpoint of ``folder`` that Trainer finished writing (its trainer_state.json is written last)."""
    if not os.path.isdir(folder):
        return None
    steps = sorted((int(match.group(1)), name) for name in os.listdir(folder)
                   if (match := re.fullmatch(r"checkpoint-(\d+)", name)))
    complete = [name for _, name in steps if os.path.isfile(os.path.join(folder, name, "trainer_state.json"))]
    return os.path.join(folder, complete[-1]) if complete else None


def recorded_arguments(run: Run) -> dict | None:
    path = os.path.join(run.folder, "args.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def start(run: Run) -> list | None:
    """The script's argv that trains ``run`` (its args.json, and the checkpoint to resume from), or None when it is
    complete. A folder holding a run made with other arguments is refused."""
    recorded = recorded_arguments(run) or {}
    checkpoint = last_checkpoint(run.folder)
    differences = [f"{key}: {recorded.get(key)!r} there, {run.arguments.get(key)!r} now"
                   for key in sorted(set(recorded) | set(run.arguments))
                   if key != "output_dir" and recorded.get(key) != run.arguments.get(key)]  # (a moved folder is kept)
    if recorded and (run.complete or checkpoint) and differences:
        raise UsageError(f"{run.folder} holds a run made with other arguments ({'; '.join(differences)}): rerun with "
                         "the options that made it, use another --output_dir, or delete the folder")
    if run.complete:
        return None
    os.makedirs(run.folder, exist_ok=True)
    path = os.path.join(run.folder, "args.json")
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(run.arguments, handle, indent=2)
    return [path] + (["--resume_from_checkpoint", checkpoint] if checkpoint else [])


def train(runs: list, jobs: int = 1, threads: int | None = None, log_dir: str | None = None) -> list:
    """Trains the runs that are not complete: with ``jobs`` 1 one after the other in this process, else that many
    processes at a time, each logging to ``log_dir``. A complete run's checkpoints are removed. Returns the runs
    that failed (a process's exit status; in this process an error stops the driver)."""
    todo = []
    for run in runs:
        argv = start(run)
        if argv is None:
            print(f"[{run.name}] complete already ({run.folder})", flush=True)
        else:
            if len(argv) > 1:
                print(f"[{run.name}] resuming from {argv[-1]}", flush=True)
            todo.append((run, argv))

    def finished(run: Run, code: int) -> Run | None:
        if code == 0:
            for name in os.listdir(run.folder):
                if re.fullmatch(r"checkpoint-\d+", name):
                    shutil.rmtree(os.path.join(run.folder, name), ignore_errors=True)
        print(f"[{time.strftime('%H:%M:%S')}] {run.name}: {'done' if code == 0 else f'failed (exit {code})'}",
              flush=True)
        return None if code == 0 else run

    if jobs == 1:
        if threads:
            import torch

            torch.set_num_threads(threads)
        return [run for run, argv in todo
                if finished(run, importlib.import_module(f"{PACKAGE}.{run.script}").main(argv)) is not None]

    env = {**os.environ, "OMP_NUM_THREADS": str(threads or 1)}
    if PACKAGE == "training":  # a checkout's package: importable by the children wherever they start
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    os.makedirs(log_dir, exist_ok=True)

    def run_process(item):
        run, argv = item
        log = os.path.join(log_dir, f"{run.name}.log")
        print(f"[{time.strftime('%H:%M:%S')}] {run.name}: started (log: {log})", flush=True)
        with open(log, "a", encoding="utf-8") as handle:
            code = subprocess.call([sys.executable, "-m", f"{PACKAGE}.{run.script}", *argv], stdout=handle,
                                   stderr=subprocess.STDOUT, env=env)
        return finished(run, code)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return [run for run in pool.map(run_process, todo) if run is not None]


def execute(args, runs: list, log_dir: str) -> bool:
    """--dry_run (print each run's state and command), or check and train every run; True when all are complete."""
    if args.dry_run:
        for run in runs:
            print(f"{'done   ' if run.complete else 'pending'} {run.name}: {run.command()}")
        return False
    for run in runs if len(runs) > 1 else ():  # one Hub repository per run
        if run.arguments.get("hub_model_id"):
            run.arguments["hub_model_id"] += f"-{os.path.basename(run.folder)}"
    check(runs)
    failed = train(runs, args.jobs, args.threads, log_dir)
    if failed:
        print(f"failed: {', '.join(run.name for run in failed)}; their logs: {log_dir}", file=sys.stderr)
    return not failed


def prepare_and_train(args, runs: list, output_dir: str, files: dict, prepare_data) -> int | None:
    """A benchmark's command: write the data files its runs read (``prepare_data(args, files)``; --prepare_data: only
    that, listing them), then --dry_run or train every run. The exit code when the command ends here (data prepared,
    dry run, a run failed), None when every run is complete and the table can be written."""
    if not args.dry_run:
        prepare_data(args, files)
        if args.prepare_data:
            print("\n".join(f"{key}: {path}" for key, path in files.items()))
            return 0
    if not execute(args, runs, os.path.join(output_dir, "logs")):
        return 0 if args.dry_run else 1
    return None


def train_and_report(args, order: list, runs: dict, output_dir: str, write_table) -> int:
    """A reproduction's command after its data are prepared: --dry_run, or train ``order`` (unless --aggregate_only),
    then ``write_table(benchmark, made)`` for every benchmark of ``runs`` (benchmark -> its runs) whose runs are all
    complete. Exit code 1 when a run failed or a table is missing."""
    if args.dry_run or not args.aggregate_only:
        complete = execute(args, order, os.path.join(output_dir, "logs"))
        if args.dry_run:
            return 0
        if not complete:
            return 1
    written = True
    for benchmark, made in runs.items():
        missing = [one.name for one in made.values() if not one.complete]
        if missing:
            print(f"{benchmark}: {len(missing)} run(s) not complete ({', '.join(missing)}); no table written")
            written = False
            continue
        write_table(benchmark, made)
    return 0 if written else 1


def table_without_provenance(path: str) -> str:
    """A results Markdown file up to its provenance block: what a command prints when it is done."""
    with open(path, encoding="utf-8") as handle:
        return handle.read().split("## Provenance")[0]


# ----------------------------------------------------------------------------------------------------------------
# Reading finished runs
# ----------------------------------------------------------------------------------------------------------------


def read_run(folder: str) -> dict:
    """A finished run's numbers: ``all_results.json``, with ``log_history`` (``trainer_state.json``: training losses,
    the validation curve, what the additions logged) and ``arguments`` (``args.json``)."""
    with open(os.path.join(folder, "all_results.json"), encoding="utf-8") as handle:
        result = json.load(handle)
    state = os.path.join(folder, "trainer_state.json")
    result["log_history"] = []
    if os.path.isfile(state):
        with open(state, encoding="utf-8") as handle:
            result["log_history"] = json.load(handle)["log_history"]
    with open(os.path.join(folder, "args.json"), encoding="utf-8") as handle:
        result["arguments"] = json.load(handle)
    return result


def count_parameters(folder: str, keep=lambda name: True) -> int:
    """Parameters of the model a run saved, those whose names ``keep`` accepts, a tied weight once. Counted on the
    model its configuration builds (on the meta device, nothing allocated), not in its weights file, which also holds
    the buffers: an RBF operator's random features, a fixed wavelet's filter."""
    import torch
    import transformers

    import hf_spectral

    config = transformers.AutoConfig.from_pretrained(folder)
    architecture = (config.architectures or [""])[0]
    model_class = getattr(hf_spectral, architecture, None) or getattr(transformers, architecture, None)
    if model_class is None:
        raise ValueError(f"{folder}: config.json names no model class hf_spectral or transformers has "
                         f"(architectures: {config.architectures})")
    with torch.device("meta"):
        model = model_class(config)
    return sum(parameter.numel() for name, parameter in model.named_parameters() if keep(name))


def mean_std(values: list) -> tuple:
    """Mean and sample standard deviation of the values that are not None: (None, None) without any, std None with
    one value."""
    values = [value for value in values if value is not None]
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def pm(mean, std, digits: int = 4) -> str:
    """``mean ± std`` (the mean alone without a std; "" without a mean)."""
    if mean is None:
        return ""
    return f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if std is not None else "")


def paired_delta(baseline: dict, model: dict) -> dict | None:
    """baseline − model over the seeds both have (``{seed: value}``): mean, sample std and each seed's difference.
    Pairing by seed removes the part of the seed noise the two runs share (initialisation seed, data order)."""
    seeds = sorted(seed for seed in set(baseline) & set(model)
                   if baseline[seed] is not None and model[seed] is not None)
    if not seeds:
        return None
    deltas = [baseline[seed] - model[seed] for seed in seeds]
    mean, std = mean_std(deltas)
    return {"mean": mean, "std": std, "per_seed": deltas, "seeds": seeds}
