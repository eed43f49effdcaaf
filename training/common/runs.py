"""One training run with ``Trainer``, as every recipe does it: build the trainer, train or resume, score the result.

A run lives in its own folder: checkpoints while it trains (resumed from the newest complete one), then the final
model next to its ``summary.json``, whose presence marks the run complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time

import torch

from hf_spectral.file_permissions import make_folders
from hf_spectral.ops.remote_code import write_text_atomically  # noqa: F401  (also the recipes' writer)

from .callbacks import GateTrajectoryCallback, GracefulInterruptCallback, StopAfterStepsCallback
from .data import fixed_subset
from .exit_codes import EXIT_INTERRUPTED  # noqa: F401  (the recipes' status after a checkpointed stop)
from .presets import LMPreset, training_arguments
from .trainer import RecipeTrainer, collate_blocks, last_complete_checkpoint, lm_compute_metrics, load_metric, token_nll

TRAIN_EVAL_BLOCKS = 1000  # training blocks scored in evaluation mode for the generalisation gap (at most)


def is_main_process() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def barrier():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def write_json(path: str, payload: dict):
    write_text_atomically(path, json.dumps(payload, indent=2, default=str))


def read_summary(run_dir: str) -> dict | None:
    path = os.path.join(run_dir, "summary.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


RUN_SETTINGS_FILE = "run_settings.json"
# 2: every option with an effect and the data's fingerprint (for retrofit_gpt2's pretrained model and arms too: its
# earlier files lack keys, so they are refused, naming them). Files without a version (1) hold the preset's numbers
# and a few options; a run folder written then is checked against what its file holds.
RUN_SETTINGS_VERSION = 2
# Preset fields that do not change what a run computes: reusing its folder with other values is fine.
PRESET_FIELDS_WITHOUT_EFFECT = ("description", "variants", "arms", "seeds", "save_steps", "logging_steps")


# Options that shape the data or the tokenizer: their effect is recorded through the data's fingerprint (resolved,
# where an option may be left to the preset's defaults), and an earlier settings file that holds them is not compared
# on them.
DATA_SHAPING_OPTIONS = frozenset({
    "corpus", "tokenizer", "bpe_vocab_size", "validation_examples", "max_train_examples", "max_test_examples",
    "keep_html", "setting", "generate_sizes", "data_seed", "keep_brackets",
})


# Command-line options that do not change what a run computes: where its data are read from (the data are recorded
# by their fingerprint instead) and its results written, how fast it runs, what is reported or uploaded, which runs
# an invocation makes (the run's name holds its variant or arm and seed), and the preset's own numbers (recorded as
# resolved). Every other option of a recipe belongs to its runs' settings, so that a new option cannot be missed.
OPTIONS_WITHOUT_EFFECT = frozenset({
    "output_dir", "results_dir", "restart", "stop_after_steps", "keep_checkpoints", "no_plots", "push_to_hub",
    "hub_model_id", "hub_token", "hub_private_repo", "hub_strategy", "report_to", "threads", "no_download",
    "data_path", "dataset_name", "dataset_config", "text_column", "train_file", "validation_file", "test_file",
    "pretrain_data_path", "finetune_data_path", *DATA_SHAPING_OPTIONS,
    "tokenizer_name_or_path", "preset", "smoke", "seeds", "variants", "normalization", "arms", "evaluate_model",
    "eval_test",  # scores the test split once training is done
    *LMPreset.__dataclass_fields__,
})


# TrainingArguments fields (given through a recipe's pass-through options) that change how a run is shown, logged,
# stored or fed, not what it computes.
TRAINING_ARGUMENTS_WITHOUT_EFFECT = frozenset({
    "disable_tqdm", "logging_strategy", "logging_first_step", "logging_nan_inf_filter", "log_level",
    "log_level_replica", "log_on_each_node", "report_to", "run_name", "project", "trackio_space_id",
    "save_total_limit", "save_on_each_node", "dataloader_num_workers", "dataloader_pin_memory",
    "dataloader_persistent_workers", "dataloader_prefetch_factor", "skip_memory_metrics",
    "include_num_input_tokens_seen", "ddp_timeout",
    "push_to_hub", "hub_model_id", "hub_strategy", "hub_token", "hub_private_repo", "hub_always_push",
    "hub_revision",
})


def run_settings(preset, args=None, data: dict | None = None, **extra) -> dict:
    """What decides a run's result, as JSON values: the preset's fields (those with an effect), the command's other
    options (all but ``OPTIONS_WITHOUT_EFFECT`` and the preset's fields, which the options only override: recorded
    as resolved), the data's fingerprint (``data_fingerprint``) and ``extra``."""
    fields = preset.to_dict()
    values = {k: v for k, v in fields.items() if k not in PRESET_FIELDS_WITHOUT_EFFECT}
    options = {} if args is None else {k: v for k, v in sorted(vars(args).items())
                                       if k not in OPTIONS_WITHOUT_EFFECT and k not in fields}
    fingerprint = {} if data is None else {"data": data}
    settings = {**values, **options, **fingerprint, **extra, "settings_version": RUN_SETTINGS_VERSION}
    return json.loads(json.dumps(settings, default=str))


def data_fingerprint(tokenizer, splits) -> dict:
    """What identifies a run's data without their path: every split's size and content (the fingerprint ``datasets``
    derives from a dataset's content and the transforms that made it, as for its own caching) and the tokenizer's
    vocabulary (its size and a hash of its entries)."""
    vocabulary = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False).encode()
    return {"splits": {name: [len(split), split._fingerprint] for name, split in splits.items()},
            "vocabulary": len(tokenizer), "vocabulary_sha256": hashlib.sha256(vocabulary).hexdigest()}


def open_run_dir(output_dir: str, name: str, restart: bool, settings: dict | None = None,
                 push_to_hub: bool = False) -> tuple[str, dict | None]:
    """The folder of run ``name`` in ``output_dir`` (emptied first by the main process with ``restart``), and the
    summary of the run when it is complete already (it is not trained again); else the folder is created, and None.

    ``settings`` (`run_settings`) are recorded in the folder when the run starts. A folder whose run (complete, or
    checkpointed to be resumed) was made with other settings is refused, naming the differences: it would otherwise
    be reported, or resumed with its old schedule, as if this command had made it."""
    run_dir = os.path.join(output_dir, name)
    if restart and is_main_process() and os.path.isdir(run_dir):
        shutil.rmtree(run_dir)
    barrier()
    settings_path = os.path.join(run_dir, RUN_SETTINGS_FILE)
    # Only a run with something to reuse (a summary, a checkpoint) is held to its settings: a start that failed before
    # its first checkpoint (a bad option, unreachable data) must not block the corrected command.
    entries = os.listdir(run_dir) if os.path.isdir(run_dir) else []
    checkpointed = any(entry.startswith("checkpoint-") for entry in entries)
    if settings is not None and (checkpointed or "summary.json" in entries) and os.path.isfile(settings_path):
        with open(settings_path, encoding="utf-8") as handle:
            recorded = json.load(handle)
        compared = set(recorded) | set(settings) if "settings_version" in recorded else set(recorded)
        if "data" in recorded:  # the data's fingerprint holds what these options did
            compared -= DATA_SHAPING_OPTIONS
        differences = [f"{key}: {recorded.get(key)!r} there, {settings.get(key)!r} now"
                       for key in sorted(compared) if recorded.get(key) != settings.get(key)]
        if differences:
            raise SystemExit(
                f"error: {run_dir} holds a run made with other settings ({'; '.join(differences)}): rerun with the "
                "options that made it, or add --restart to train it again"
            )
    done = read_summary(run_dir)
    if done is not None:
        print(f"[{name}] complete already ({run_dir}/summary.json); --restart trains it again", flush=True)
        if push_to_hub:  # the push happens at the end of training, which does not run again
            print(f"[{name}] --push_to_hub: not pushed, the run was complete already; upload {run_dir} with "
                  f"`huggingface-cli upload <repo> {run_dir}`, or add --restart", flush=True)
        return run_dir, done
    os.makedirs(run_dir, exist_ok=True)
    # (a checkpoint from before settings were recorded: nothing to compare with, none written for it)
    if settings is not None and not checkpointed and is_main_process():
        write_json(settings_path, settings)
    return run_dir, None


def default_card_repo_id(args, hub_model_id: str | None) -> str:
    """The repository a model card names when the trainer has resolved none: ``hub_model_id`` for a run that pushes,
    else a placeholder."""
    return (hub_model_id if getattr(args, "push_to_hub", False) else None) or "<user>/<repo>"


def hub_access_problem(token: str | None) -> str | None:
    """Why the Hub cannot take pushes from here (no network, no token, a token it refuses), or None."""
    from huggingface_hub import HfApi

    try:
        HfApi(token=token).whoami()
    except Exception as error:  # a connection error (httpx), a missing token (OSError), an HTTP error: all mean no
        first_line = (str(error).strip().splitlines() or [""])[0]
        unknown = type(error).__name__ == "LocalTokenNotFoundError" or "401" in first_line
        return (f"cannot use the Hugging Face Hub ({type(error).__name__}: {first_line})"
                + ("; log in with `hf auth login` or pass --hub_token" if unknown else ""))
    return None


def prepare_recipe(args, recipe: str, preset_name: str, preset, load_data) -> tuple[str, object]:
    """What a recipe does before its runs: torch's thread count (``--threads``), the output folder (``--output_dir``,
    else ``runs/<recipe>-<preset>``) and ``load_data(args, preset, tokenizer_dir)``, run by the main process first
    (it writes the tokenizer files; the others then read the same vocabulary). Returns the folder and the data; the
    data is None when they cannot be read (the error is printed: the recipe exits with status 2)."""
    output_dir = args.output_dir or os.path.join("runs", f"{recipe}-{preset_name}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if getattr(args, "push_to_hub", False):
        problem = hub_access_problem(getattr(args, "hub_token", None))
        if problem is not None:  # said before any data is prepared or trained, not at the first push
            print(f"error: --push_to_hub: {problem}", file=sys.stderr)
            return output_dir, None
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        print(f"error: --output_dir {output_dir} exists and is not a folder", file=sys.stderr)
        return output_dir, None
    try:
        created = make_folders(output_dir)
    except OSError as error:
        print(f"error: cannot create --output_dir {output_dir}: {error}", file=sys.stderr)
        return output_dir, None

    from accelerate import PartialState

    from .data import CorpusNotFoundError

    state = PartialState()
    try:
        with state.main_process_first():
            data = load_data(args, preset, os.path.join(output_dir, "tokenizer"))
    except (CorpusNotFoundError, OSError, ValueError) as error:  # OSError: also a Hub dataset out of reach
        print(f"error: {error}", file=sys.stderr)
        if created and state.is_main_process:  # no empty (or half-written) output folder stays behind
            shutil.rmtree(created, ignore_errors=True)
        return output_dir, None
    return output_dir, data


def hub_repo_id(args, run_name: str, runs: int) -> str | None:
    """``--hub_model_id``, with the run name appended when one invocation trains several runs."""
    if not args.hub_model_id:
        return None
    return f"{args.hub_model_id}-{run_name}" if runs > 1 else args.hub_model_id


def build_trainer(model, run_dir: str, preset: LMPreset, seed: int, train_set, curve_set, tokenizer, args, *,
                  optimizer=None, model_card_fn=None, hub_model_id=None, chars_per_token: float = 1.0,
                  run_name: str | None = None):
    """A ``RecipeTrainer`` for one run, with the recipes' callbacks; returns it and its interrupt callback."""
    training_args = training_arguments(
        preset, run_dir, seed,
        dataloader_drop_last=False,
        bf16=args.bf16 or None,
        report_to=args.report_to,
        run_name=run_name,
        push_to_hub=args.push_to_hub or None,
        hub_model_id=hub_model_id,
        hub_token=args.hub_token,
        hub_private_repo=args.hub_private_repo,
        hub_strategy=args.hub_strategy,
    )
    interrupt = GracefulInterruptCallback()
    callbacks = [interrupt, GateTrajectoryCallback(os.path.join(run_dir, "gate_trajectory.jsonl"), preset.logging_steps)]
    if args.stop_after_steps:
        callbacks.append(StopAfterStepsCallback(args.stop_after_steps))
    batch = preset.batch_size
    trainer = RecipeTrainer(
        model=model,
        args=training_args,
        # Full training batches at every epoch boundary, so that evaluation can keep every block (no drop_last).
        train_dataset=train_set.select(range(len(train_set) // batch * batch)),
        eval_dataset={"validation_curve": curve_set},
        data_collator=collate_blocks,
        processing_class=tokenizer,
        compute_metrics=lm_compute_metrics(chars_per_token),
        preprocess_logits_for_metrics=token_nll,
        callbacks=callbacks,
        optimizers=(optimizer, None),
        model_card_fn=model_card_fn,
    )
    return trainer, interrupt


def check_replicas_agree(trainer) -> None:
    """In a data-parallel run of several processes, raise unless every process holds the same weights: replicas
    apply the same averaged gradients to the same weights, while processes that were never joined (a launcher or
    accelerate setting gone wrong) would each have trained their own model, and only the first one's would be
    saved. Sharded runs (FSDP, DeepSpeed) hold different shards by design and are not checked."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    if trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled:
        return
    with torch.no_grad():  # on the parameters' device: NCCL gathers CUDA tensors only
        local = torch.stack([p.detach().double().sum() for p in trainer.model.parameters()])
    replicas = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(replicas, local)
    differing = [rank for rank, weights in enumerate(replicas) if not torch.equal(weights, replicas[0])]
    if differing:
        raise RuntimeError(
            f"the {dist.get_world_size()} processes ended training with different weights (processes {differing} "
            "differ from process 0): the run was not data-parallel. On a machine without an accelerator, "
            "accelerate needs `use_cpu=True` to join torchrun's processes."
        )


def train_from(trainer, checkpoint: str | None):
    """``trainer.train(resume_from_checkpoint=checkpoint)``; a checkpoint whose model has other sizes than this
    command's (changed options) is a one-line error naming the way out, not a traceback."""
    try:
        return trainer.train(resume_from_checkpoint=checkpoint)
    except RuntimeError as error:
        if checkpoint and "size mismatch" in str(error):
            raise SystemExit(
                f"error: cannot resume from {checkpoint}: its model has other sizes than this command's "
                f"({str(error).splitlines()[-1].strip()}). Rerun with the options that wrote it, or add --restart to "
                "discard it and train again."
            ) from None
        raise


def print_stopped(name: str, step: int, max_steps: int, interrupted_by: str | None, run_dir: str) -> None:
    """Say where a run stopped early and how to resume it: a signal's run resumes with the same command; a run stopped
    by ``--stop_after_steps`` (the global step to stop at) would stop again at once, one step further."""
    how = ("Rerun the same command to resume" if interrupted_by else
           "Rerun without --stop_after_steps (or with a later step) to resume")
    print(f"[{name}] stopped at step {step}/{max_steps} ({interrupted_by or '--stop_after_steps'}); checkpoint in "
          f"{run_dir}. {how}.", flush=True)


def train_or_resume(trainer, interrupt, run_dir: str, max_steps: int) -> dict | None:
    """Train, resuming from the newest complete checkpoint of ``run_dir``. Returns timing facts, or None when the
    run stopped early (signal, ``--stop_after_steps``) with a checkpoint to resume from."""
    name = os.path.basename(os.path.normpath(run_dir))
    checkpoint = last_complete_checkpoint(run_dir)
    if checkpoint:
        print(f"[{name}] resuming from {checkpoint}", flush=True)
    started = time.time()
    output = train_from(trainer, checkpoint)
    check_replicas_agree(trainer)
    if trainer.state.global_step < max_steps:
        print_stopped(name, trainer.state.global_step, max_steps, interrupt.interrupted_by, run_dir)
        return None
    return {"train_seconds": round(time.time() - started, 1),
            "resumed_from": checkpoint and os.path.basename(checkpoint),
            "train_runtime_last_session": output.metrics.get("train_runtime")}


def final_losses(trainer, data, preset: LMPreset, extra_sets: dict | None = None) -> dict:
    """Final losses in evaluation mode: the validation split (whole, or ``final_eval_batches`` of it) and as many
    training blocks (at most ``TRAIN_EVAL_BLOCKS``), so that val − train is the generalisation gap and not a
    dropout artefact; plus ``extra_sets`` (name → dataset, e.g. a test split)."""
    limit = preset.final_eval_batches and preset.final_eval_batches * preset.batch_size
    validation = fixed_subset(data.datasets["validation"], limit)
    train_blocks = min(len(validation), TRAIN_EVAL_BLOCKS)
    sets = {"validation": validation, "train": fixed_subset(data.datasets["train"], train_blocks, seed=1),
            **(extra_sets or {})}
    metrics = trainer.evaluate(eval_dataset=sets)
    result = {
        "val_loss": metrics["eval_validation_loss"], "train_loss": metrics["eval_train_loss"],
        "val_perplexity": metrics["eval_validation_perplexity"],
        "val_bits_per_char": metrics["eval_validation_bits_per_char"],
        "val_blocks": len(validation), "train_eval_blocks": train_blocks,
    }
    for name in extra_sets or {}:
        result[f"{name}_loss"] = metrics[f"eval_{name}_loss"]
        result[f"{name}_bits_per_char"] = metrics[f"eval_{name}_bits_per_char"]
    result["generalization_gap"] = load_metric("generalization_gap").compute(
        predictions=[result["val_loss"]], references=[result["train_loss"]])["gap"]
    return result
