"""Figures the recipes write: validation curves, per-token gate heat maps, τ/α trajectories (PNG)."""

from __future__ import annotations

import os

from hf_spectral.dependencies import require

matplotlib = require("matplotlib", extra="train", feature="the recipes' figures")
matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

VALIDATION_CURVE_KEY = "eval_validation_curve_loss"


def curve(log_history: list, key: str) -> tuple[list, list]:
    points = [(entry["step"], entry[key]) for entry in log_history if key in entry]
    return [p[0] for p in points], [p[1] for p in points]


def plot_learning_curves(histories: dict, path: str, title: str) -> str:
    """Validation loss (fixed subset, evaluation mode) per run; thin lines: running training loss.

    ``histories``: label -> Trainer ``log_history``. Several runs with the same label prefix (seeds) get one
    colour.
    """
    fig, ax = plt.subplots(figsize=(8, 5))
    colours = {}
    for label, history in histories.items():
        group = label.split(" seed")[0]
        colour = colours.setdefault(group, f"C{len(colours) % 10}")
        steps, values = curve(history, VALIDATION_CURVE_KEY)
        ax.plot(steps, values, color=colour, marker="o", markersize=3, label=label)
        steps, values = curve(history, "loss")
        ax.plot(steps, values, color=colour, alpha=0.25, linewidth=1)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.text(0.99, 0.99, "markers: validation (eval mode); faint: training (running, with dropout)",
            transform=ax.transAxes, ha="right", va="top", fontsize=7, alpha=0.7)
    return _save(fig, path)


@torch.no_grad()
def gate_values_per_token(model, input_ids: torch.Tensor) -> dict:
    """{layer: (heads, T) gate values g ∈ (0, 1)} for one sequence, read from every ``EnergyGate`` module by a
    forward hook, so it works for EGA-GPT and for retrofitted models alike."""
    from hf_spectral.ops.energy_gate import EnergyGate

    from .callbacks import _layer_index

    captured, handles = {}, []
    for name, module in model.named_modules():
        if isinstance(module, EnergyGate) and "original_module" not in name:
            layer = _layer_index(name)
            handles.append(module.register_forward_hook(
                lambda mod, args, out, layer=layer: captured.__setitem__(layer, out[1][0].float().cpu())))
    was_training = model.training
    model.eval()
    try:
        model(input_ids=input_ids[None] if input_ids.ndim == 1 else input_ids[:1])
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
    return dict(sorted(captured.items()))


def _printable(char: str) -> str:
    return {"\n": "⏎", " ": "␣", "\t": "⇥"}.get(char, char)


def plot_gate_heatmap(gates: dict, tokens: list, path: str, title: str) -> str:
    """Heat map of gate values: one row per (layer, head), one column per token of a text sample."""
    rows, labels = [], []
    for layer, values in gates.items():
        for head in range(values.shape[0]):
            rows.append(values[head].numpy())
            labels.append(f"L{layer} H{head}")
    matrix = np.stack(rows)
    width = max(8.0, 0.16 * len(tokens))
    fig, ax = plt.subplots(figsize=(width, 1.2 + 0.28 * len(rows)))
    image = ax.imshow(matrix, aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest")
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.set_xticks(range(len(tokens)), [_printable(t) for t in tokens], fontsize=7, family="monospace")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, fraction=0.02, pad=0.01, label="gate g")
    return _save(fig, path)


def plot_gate_trajectories(records: list, path: str, title: str) -> str:
    """τ and α of every head (mean over scales) against the training step, one column per layer."""
    layers = sorted({int(layer) for record in records for layer in record["layers"]})
    fig, axes = plt.subplots(2, len(layers), figsize=(3.2 * len(layers), 5.5), squeeze=False, sharex=True)
    steps = [record["step"] for record in records]
    for column, layer in enumerate(layers):
        for row, name in enumerate(("tau", "alpha")):
            values = np.array([np.asarray(record["layers"][str(layer)][name]).mean(-1) for record in records])
            ax = axes[row, column]
            for head in range(values.shape[1]):
                ax.plot(steps, values[:, head], linewidth=1, label=f"head {head}")
            ax.set_title(f"layer {layer}: {'τ' if name == 'tau' else 'α'}", fontsize=9)
            ax.grid(alpha=0.3)
            if row == 1:
                ax.set_xlabel("step")
    axes[0, 0].legend(fontsize=6)
    fig.suptitle(title)
    return _save(fig, path)


def write_gate_figures(run_dir: str, model, dataset, tokenizer, heatmap_title: str, trajectory_title: str):
    """``gate_heatmap.png`` (gate values on the first 96 tokens of ``dataset``) and, when the run recorded them,
    ``gate_trajectories.png`` (from ``gate_trajectory.jsonl``) in ``run_dir``."""
    from .callbacks import read_gate_trajectory

    sample = torch.as_tensor(dataset[0]["input_ids"][:96], dtype=torch.long)
    tokens = tokenizer.convert_ids_to_tokens(sample.tolist())
    plot_gate_heatmap(gate_values_per_token(model, sample), tokens, os.path.join(run_dir, "gate_heatmap.png"),
                      heatmap_title)
    records = read_gate_trajectory(os.path.join(run_dir, "gate_trajectory.jsonl"))
    if records:
        plot_gate_trajectories(records, os.path.join(run_dir, "gate_trajectories.png"), trajectory_title)


def _save(fig, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
