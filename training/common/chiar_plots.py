"""Figures of the CHIAR-Former recipes: spectral-entropy histograms with the thresholds, routing fractions over
training, a routing map over a sample text, and validation curves against steps and training time (PNG)."""

from __future__ import annotations

import json
import os

import matplotlib

matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from .plots import _printable, _save  # noqa: E402

OPERATOR_COLOURS = {"dct": "#4c72b0", "rbf": "#55a868", "attention": "#c44e52"}


@torch.no_grad()
def _entropies(model, batches: list) -> list:
    from hf_spectral.models.chiar_former import measure_entropies

    was_training = model.training
    model.eval()
    try:
        return measure_entropies(model, batches, across_processes=False)  # drawn by the main process alone
    finally:
        model.train(was_training)


def plot_entropy_histograms(model, batches: list, path: str, title: str) -> str | None:
    """One histogram per routed layer of the tokens' normalised spectral entropy, with the layer's thresholds."""
    config = model.config
    if not config.routed_layers:
        return None
    entropies = _entropies(model, batches)
    fig, axes = plt.subplots(1, len(entropies), figsize=(max(7.0, 4.2 * len(entropies)), 3.4), squeeze=False)
    for ax, layer, values in zip(axes[0], config.routed_layers, entropies):
        values = values.numpy()
        ax.hist(values, bins=60, color="#777777", alpha=0.85)
        if config.router_type == "threshold":
            for tau in config.thresholds_for(layer):
                ax.axvline(tau, color="black", linestyle="--", linewidth=1)
                ax.text(tau, ax.get_ylim()[1] * 0.95, f" τ={tau:.4f}", fontsize=7, va="top")
        ax.set_title(f"layer {layer}", fontsize=9)
        ax.set_xlabel("spectral entropy H")
    axes[0, 0].set_ylabel("tokens")
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def plot_routing_over_training(routing_log: str, path: str, title: str, operators: list) -> str | None:
    """Fraction of the training tokens per operator (one panel per routed layer) against the step."""
    if not os.path.isfile(routing_log):
        return None
    with open(routing_log, encoding="utf-8") as handle:
        records = [json.loads(line) for line in handle if line.strip()]
    layers = sorted({key.split("/")[1] for r in records for key in r if key.startswith("routing/")})
    if not layers:
        return None
    fig, axes = plt.subplots(1, len(layers), figsize=(max(7.0, 4.2 * len(layers)), 3.2), squeeze=False, sharey=True)
    for ax, layer in zip(axes[0], layers):
        for operator in operators:
            key = f"routing/{layer}/{operator}"
            points = [(r["step"], r[key]) for r in records if key in r]
            if points:
                ax.plot(*zip(*points), label=operator, color=OPERATOR_COLOURS.get(operator), marker=".")
        ax.set_title(f"layer {layer[1:]}", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel("fraction of training tokens")
    axes[0, 0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


@torch.no_grad()
def plot_routing_map(model, input_ids: torch.Tensor, tokenizer, path: str, title: str) -> str | None:
    """Which operator each token of one sample took in each routed layer (rows: layers, columns: tokens)."""
    config = model.config
    if not config.routed_layers:
        return None
    was_training = model.training
    model.eval()
    try:
        kwargs = {"use_cache": False} if hasattr(model, "lm_head") else {}
        outputs = model(input_ids=input_ids[None], output_routing=True, **kwargs)
    finally:
        model.train(was_training)
    routes = torch.stack([d[0] for d in outputs.routing_decisions]).cpu().numpy()
    tokens = [_printable(tokenizer.convert_tokens_to_string([t]) or t)
              for t in tokenizer.convert_ids_to_tokens(input_ids.tolist())]
    colours = [OPERATOR_COLOURS.get(op, "#999999") for op in config.routed_operators]
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    fig, ax = plt.subplots(figsize=(max(8.0, 0.2 * len(tokens)), 1.4 + 0.45 * len(routes)))
    ax.imshow(routes, aspect="auto", cmap=ListedColormap(colours), vmin=0, vmax=len(colours) - 1,
              interpolation="nearest")
    ax.set_yticks(range(len(routes)), [f"layer {layer}" for layer in config.routed_layers], fontsize=8)
    ax.set_xticks(range(len(tokens)), tokens, fontsize=6, rotation=90, family="monospace")
    ax.legend(handles=[Patch(color=c, label=op) for op, c in zip(config.routed_operators, colours)],
              fontsize=7, loc="upper right", bbox_to_anchor=(1.0, 1.35), ncol=len(colours))
    ax.set_title(title, fontsize=10, loc="left")
    return _save(fig, path)


def plot_curves_against_time(summaries: list, key: str, path: str, title: str) -> str:
    """Validation curve per run against the optimiser step (left) and the training wall-clock (right)."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    colours = {}
    for summary in summaries:
        colour = colours.setdefault(summary["arm"], f"C{len(colours) % 10}")
        points = [(e["step"], e.get("train_seconds"), e[key]) for e in summary["log_history"] if key in e]
        if not points:
            continue
        steps, seconds, values = zip(*points)
        label = f"{summary['arm']} seed {summary['seed']}"
        left.plot(steps, values, color=colour, marker="o", markersize=3, label=label, alpha=0.8)
        if all(s is not None for s in seconds):
            right.plot(seconds, values, color=colour, marker="o", markersize=3, alpha=0.8)
    left.set_xlabel("optimiser step")
    right.set_xlabel("training wall-clock (s)")
    left.set_ylabel(key.replace("eval_validation_curve_", "validation "))
    for ax in (left, right):
        ax.grid(alpha=0.3)
    left.legend(fontsize=6, ncol=2)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def write_run_figures(run_dir: str, model, data, batches: list, log_history: list, task, arm):
    """The run's figures: learning curve; for routed models the entropy histograms, the routing fractions over
    training and the routing map of ``data.sample``."""
    from .plots import plot_learning_curves

    plot_learning_curves({arm.label: log_history}, os.path.join(run_dir, "learning_curve.png"),
                         f"{task.title}: {arm.label}, seed {arm.seed}")
    if not model.config.routed_layers:
        return
    plot_entropy_histograms(model, batches, os.path.join(run_dir, "entropy_histograms.png"),
                            f"{task.title}, {arm.label}: spectral entropy per routed layer (validation tokens)")
    plot_routing_over_training(os.path.join(run_dir, "routing_log.jsonl"), os.path.join(run_dir, "routing_fractions.png"),
                               f"{task.title}, {arm.label}: tokens per operator during training",
                               list(model.config.routed_operators))
    if data.sample is not None:
        plot_routing_map(model, torch.as_tensor(data.sample, dtype=torch.long), data.tokenizer,
                         os.path.join(run_dir, "routing_map.png"),
                         f"{task.title}, {arm.label}: operator per token (sample)")
