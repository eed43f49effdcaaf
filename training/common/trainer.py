"""The ``Trainer`` pieces every recipe shares: collator, metrics, checkpoints, the model card hook."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import uuid

import numpy as np
import torch
import torch.nn.functional as F
from transformers import Trainer

from hf_spectral.file_permissions import umask_permissions_for_what_is_written

METRICS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "metrics")
GATE_SCALAR_PARAMETERS = re.compile(r"energy_gate\..*(tau|alpha|mix_logits|omega|sigma)$")


def load_metric(name: str):
    """A local ``evaluate`` module from ``training/metrics/<name>/<name>.py`` (works offline)."""
    import evaluate

    path = os.path.join(METRICS_DIR, name)
    if not os.path.isfile(os.path.join(path, f"{name}.py")):
        raise FileNotFoundError(f"no metric module {name!r} under {METRICS_DIR}")
    # In memory and under a unique experiment id: concurrent runs must not share evaluate's cache files.
    return evaluate.load(path, keep_in_memory=True, experiment_id=uuid.uuid4().hex)


def collate_blocks(examples: list) -> dict:
    """Packed fixed-length blocks: the labels are the inputs (the model shifts them)."""
    input_ids = torch.stack([torch.as_tensor(example["input_ids"], dtype=torch.long) for example in examples])
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def token_nll(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token negative log-likelihood (B, T−1) of each next token: what the metrics need, instead of
    keeping (B, T, V) logits for a whole evaluation split in memory."""
    if isinstance(logits, tuple):
        logits = logits[0]
    shifted = labels[:, 1:]
    nll = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), shifted.flatten().clamp(min=0), reduction="none")
    return nll.view_as(shifted).masked_fill(shifted < 0, -1.0)


def lm_compute_metrics(chars_per_token: float = 1.0):
    """``compute_metrics`` for ``Trainer``: per-token NLL → loss, perplexity, bits per token / character."""
    metric = load_metric("language_model_loss")

    def compute(eval_prediction):
        nll = np.asarray(eval_prediction.predictions, dtype=np.float64).reshape(-1)
        result = metric.compute(predictions=nll[nll >= 0], chars_per_token=chars_per_token)
        result.pop("num_tokens")
        return result

    return compute


def checkpoint_is_complete(path: str) -> bool:
    """Trainer writes ``trainer_state.json`` last; a checkpoint cut short by a kill has none (or a broken one)."""
    state = os.path.join(path, "trainer_state.json")
    if not os.path.isfile(state) or os.path.isfile(os.path.join(path, "checkpoint-is-incomplete.txt")):
        return False
    try:
        with open(state, encoding="utf-8") as handle:
            json.load(handle)
    except (OSError, ValueError):
        return False
    return True


def last_complete_checkpoint(run_dir: str) -> str | None:
    """The newest complete ``checkpoint-<step>`` folder of a run, or None."""
    if not os.path.isdir(run_dir):
        return None
    steps = sorted(
        (int(match.group(1)), name)
        for name in os.listdir(run_dir)
        if (match := re.fullmatch(r"checkpoint-(\d+)", name)) and os.path.isdir(os.path.join(run_dir, name))
    )
    for _, name in reversed(steps):
        if checkpoint_is_complete(os.path.join(run_dir, name)):
            return os.path.join(run_dir, name)
    return None


def remove_checkpoints(run_dir: str):
    for name in os.listdir(run_dir):
        if re.fullmatch(r"checkpoint-\d+", name):
            shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)


class RecipeTrainer(Trainer):
    """``Trainer`` with two recipe conventions.

    * Gate scalars (τ, α, mixing logits, Morlet ω₀ / σ) get no weight decay, like every other non-matrix
      parameter in the authors' nanoGPT-style optimiser; decaying them would pull the gates towards 0.
    * ``create_model_card`` (called by ``push_to_hub`` too) writes the recipe's card, with the measured
      results, instead of Trainer's generic draft: ``model_card_fn(folder, repo_id)``, ``repo_id`` the Hub
      repository the trainer pushes to (its namespace resolved) or ``None``.
    * The pushes of checkpoints during training (``hub_strategy`` every_save / checkpoint) carry the model's code
      and gate configuration with the weights, so that the repository loads with ``trust_remote_code`` at every
      commit (Trainer copies only the config and weight files).
    """

    def __init__(self, *args, model_card_fn=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.model_card_fn = model_card_fn

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        # safetensors writes model files as 0600; a run's models are ordinary files (the folder's others keep theirs)
        folder = output_dir or self.args.output_dir
        saving = umask_permissions_for_what_is_written(folder) if self.args.should_save else contextlib.nullcontext()
        with saving:
            super().save_model(output_dir, _internal_call)

    def get_decay_parameter_names(self, model) -> list:
        return [name for name in super().get_decay_parameter_names(model) if not GATE_SCALAR_PARAMETERS.search(name)]

    def create_model_card(self, *args, **kwargs):
        if not self.is_world_process_zero():
            return
        if self.model_card_fn is None:
            return super().create_model_card(*args, **kwargs)
        self.model_card_fn(self.args.output_dir, getattr(self, "hub_model_id", None))  # set by init_hf_repo

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        if self.is_world_process_zero():
            for name in os.listdir(checkpoint_folder):
                if name.endswith(".py") or name == "energy_gate_config.json":
                    shutil.copy(os.path.join(checkpoint_folder, name), os.path.join(self.args.output_dir, name))
        super()._push_from_checkpoint(checkpoint_folder)
