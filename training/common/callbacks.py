"""Trainer callbacks shared by the recipes: gate trajectories and graceful interruption."""

from __future__ import annotations

import json
import os
import signal

import torch
from transformers import TrainerCallback


def gate_parameters(model) -> dict:
    """{layer index: (τ, α)} of every energy gate in ``model`` (EGA-GPT or a retrofitted model), each (heads, scales).

    Gates are found by name (``...h.<i>.attn.energy_gate[...].tau``), so PEFT or DDP wrappers do not matter.
    """
    parameters = dict(model.named_parameters())
    found = {}
    for name, tau in parameters.items():
        # PEFT keeps a frozen `original_module` copy beside the trained one of a module it saves.
        if ".energy_gate." in name and name.endswith(".tau") and "original_module" not in name:
            alpha = parameters[name[: -len("tau")] + "alpha"]
            found[_layer_index(name)] = (tau.detach().float().cpu(), alpha.detach().float().cpu())
    return dict(sorted(found.items()))


def _layer_index(name: str) -> int:
    parts = name.split(".")
    for previous, part in zip(parts, parts[1:]):
        if previous in ("h", "layers", "layer") and part.isdigit():
            return int(part)
    raise ValueError(f"cannot find the layer index in parameter name {name!r}")


class GateTrajectoryCallback(TrainerCallback):
    """Records τ and α of every gate (per layer, head and scale) every ``every`` steps to a JSON-lines file.

    On resume, records from steps after the checkpoint are dropped first, so an interrupted run's file is
    exactly what an uninterrupted run would have written.
    """

    def __init__(self, path: str, every: int):
        self.path = path
        self.every = max(1, every)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if not state.is_world_process_zero or not gate_parameters(model):
            return
        kept = [record for record in read_gate_trajectory(self.path) if record["step"] <= state.global_step]
        with open(self.path, "w", encoding="utf-8") as handle:
            handle.writelines(json.dumps(record) + "\n" for record in kept)
        if state.global_step == 0:
            self._record(0, model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.is_world_process_zero and (state.global_step % self.every == 0 or state.global_step == state.max_steps):
            self._record(state.global_step, model)

    def _record(self, step, model):
        gates = gate_parameters(model)
        if not gates:
            return
        record = {
            "step": step,
            "layers": {str(layer): {"tau": tau.tolist(), "alpha": alpha.tolist()} for layer, (tau, alpha) in gates.items()},
        }
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")


def read_gate_trajectory(path: str) -> list:
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


class GracefulInterruptCallback(TrainerCallback):
    """First SIGTERM or SIGINT (Ctrl-C): finish the current step, write a checkpoint, stop.

    The checkpoint is a normal Trainer checkpoint (weights, optimizer, scheduler, RNG states, data position),
    so rerunning the same command resumes from it with nothing lost: the resumed run is step for step the
    run that was never interrupted. A second SIGINT stops at once (KeyboardInterrupt).
    """

    def __init__(self):
        self.interrupted_by = None
        self._previous = {}

    def on_train_begin(self, args, state, control, **kwargs):
        for signum in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[signum] = signal.signal(signum, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass

    def _handle(self, signum, frame):
        if self.interrupted_by is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.interrupted_by = signal.Signals(signum).name
        print(f"\n{self.interrupted_by} received: saving a checkpoint after this step, then stopping", flush=True)

    def on_step_end(self, args, state, control, **kwargs):
        stop = torch.tensor(float(self.interrupted_by is not None))
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # torchrun forwards the signal to every process, but not necessarily during the same step.
            torch.distributed.all_reduce(stop, op=torch.distributed.ReduceOp.MAX)
        if stop.item() > 0:
            if self.interrupted_by is None:
                self.interrupted_by = "SIGTERM (another process)"
            control.should_save = True
            control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()


class StopAfterStepsCallback(TrainerCallback):
    """Stops training (with a checkpoint) after ``step`` optimizer steps: an interruption on demand, for tests
    and for splitting a long run into sessions (``--stop_after_steps``)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step and state.global_step < state.max_steps:
            control.should_save = True
            control.should_training_stop = True
