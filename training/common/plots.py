"""The reproductions' figures (PNG), from what a run wrote: its ``log_history`` (validation curve, training loss, the
gates' τ and α, routing fractions and training seconds) and its saved model (gate values and routing per token)."""

from __future__ import annotations

import os

from hf_spectral.dependencies import require

matplotlib = require("matplotlib", extra="train", feature="the recipes' figures")
matplotlib.use("Agg")  # files only; never needs a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

OPERATOR_COLOURS = {"dct": "#4c72b0", "rbf": "#55a868", "attention": "#c44e52"}


def points(history: list, key: str) -> list:
    """(step, value) of every log entry that has ``key``."""
    return [(entry["step"], entry[key]) for entry in history if key in entry]


def seconds_at(history: list, step: float) -> float | None:
    """Training seconds at ``step``, interpolated between the entries that logged ``train_seconds``."""
    known = points(history, "train_seconds")
    if not known:
        return None
    return float(np.interp(step, [0] + [s for s, _ in known], [0.0] + [t for _, t in known]))


def plot_validation_curves(histories: dict, key: str, path: str, title: str, against_time: bool = False) -> str:
    """The validation curve ``key`` of each run (label -> log_history; labels "<arm> seed <k>" share a colour per arm)
    against the step, faint: the training loss; ``against_time``: a second panel against the training seconds."""
    fig, axes = plt.subplots(1, 2 if against_time else 1, figsize=(12 if against_time else 8, 4.8), squeeze=False)
    colours = {}
    for label, history in histories.items():
        colour = colours.setdefault(label.split(" seed")[0], f"C{len(colours) % 10}")
        curve = points(history, key)
        if curve:
            axes[0, 0].plot(*zip(*curve), color=colour, marker="o", markersize=3, label=label)
        if against_time and curve and points(history, "train_seconds"):
            axes[0, 1].plot([seconds_at(history, step) for step, _ in curve], [value for _, value in curve],
                            color=colour, marker="o", markersize=3)
        if key.endswith("loss") and points(history, "loss"):
            axes[0, 0].plot(*zip(*points(history, "loss")), color=colour, alpha=0.25, linewidth=1)
    axes[0, 0].set_xlabel("optimiser step")
    axes[0, 0].set_ylabel(key.replace("eval_", "validation "))
    if against_time:
        axes[0, 1].set_xlabel("training wall-clock (s)")
    for ax in axes[0]:
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=7, ncol=2 if len(histories) > 8 else 1)
    fig.suptitle(title, fontsize=10)
    return save(fig, path)


@torch.no_grad()
def gate_values_per_token(model, input_ids: torch.Tensor) -> dict:
    """{layer: (heads, T) gate values in (0, 1)} of one sequence, read from every ``EnergyGate`` by a forward hook
    (EGA-GPT and retrofitted models alike)."""
    import re

    from hf_spectral.ops.energy_gate import EnergyGate

    captured, handles = {}, []
    for name, module in model.named_modules():
        if isinstance(module, EnergyGate) and "original_module" not in name:
            layer = int(re.search(r"\.(?:h|layers|layer)\.(\d+)\.", name).group(1))
            handles.append(module.register_forward_hook(
                lambda mod, args, out, layer=layer: captured.__setitem__(layer, out[1][0].float().cpu())))
    model.eval()
    try:
        model(input_ids=input_ids[None])
    finally:
        for handle in handles:
            handle.remove()
    return dict(sorted(captured.items()))


def printable(token: str) -> str:
    return {"\n": "⏎", " ": "␣", "\t": "⇥"}.get(token, token)


def plot_gate_heatmap(gates: dict, tokens: list, path: str, title: str) -> str:
    """Gate values: one row per (layer, head), one column per token of a text sample."""
    rows = [(f"L{layer} H{head}", values[head].numpy()) for layer, values in gates.items()
            for head in range(values.shape[0])]
    fig, ax = plt.subplots(figsize=(max(8.0, 0.16 * len(tokens)), 1.2 + 0.28 * len(rows)))
    image = ax.imshow(np.stack([row for _, row in rows]), aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0,
                      interpolation="nearest")
    ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=7)
    ax.set_xticks(range(len(tokens)), [printable(token) for token in tokens], fontsize=7, family="monospace")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, fraction=0.02, pad=0.01, label="gate g")
    return save(fig, path)


def plot_gate_trajectories(history: list, path: str, title: str) -> str | None:
    """τ and α of every head against the step (``gates/L<layer>/H<head>/...`` log entries), one column per layer."""
    keys = sorted({key for entry in history for key in entry if key.startswith("gates/")})
    layers = sorted({int(key.split("/")[1][1:]) for key in keys})
    if not layers:
        return None
    fig, axes = plt.subplots(2, len(layers), figsize=(3.2 * len(layers), 5.5), squeeze=False, sharex=True)
    for column, layer in enumerate(layers):
        for row, name in enumerate(("tau", "alpha")):
            ax = axes[row, column]
            for key in (key for key in keys if key.startswith(f"gates/L{layer}/") and key.endswith(f"/{name}")):
                ax.plot(*zip(*points(history, key)), linewidth=1, label=key.split("/")[2].replace("H", "head "))
            ax.set_title(f"layer {layer}: {'τ' if name == 'tau' else 'α'}", fontsize=9)
            ax.grid(alpha=0.3)
        axes[1, column].set_xlabel("step")
    axes[0, 0].legend(fontsize=6)
    fig.suptitle(title)
    return save(fig, path)


@torch.no_grad()
def plot_entropy_histograms(model, batches: list, path: str, title: str) -> str | None:
    """One histogram per routed layer of the tokens' spectral entropy, with the layer's thresholds."""
    from hf_spectral.models.chiar_former import measure_entropies

    config = model.config
    if not config.routed_layers:
        return None
    entropies = measure_entropies(model.eval(), batches, across_processes=False)
    fig, axes = plt.subplots(1, len(entropies), figsize=(max(7.0, 4.2 * len(entropies)), 3.4), squeeze=False)
    for ax, layer, values in zip(axes[0], config.routed_layers, entropies):
        ax.hist(values.numpy(), bins=60, color="#777777", alpha=0.85)
        if config.router_type == "threshold":
            for tau in config.thresholds_for(layer):
                ax.axvline(tau, color="black", linestyle="--", linewidth=1)
                ax.text(tau, ax.get_ylim()[1] * 0.95, f" τ={tau:.4f}", fontsize=7, va="top")
        ax.set_title(f"layer {layer}", fontsize=9)
        ax.set_xlabel("spectral entropy H")
    axes[0, 0].set_ylabel("tokens")
    fig.suptitle(title, fontsize=10)
    return save(fig, path)


def plot_routing_over_training(history: list, operators: list, path: str, title: str) -> str | None:
    """Share of the tokens of the fixed training batches per operator (``routing/L<layer>/<operator>`` log entries)
    against the step, one panel per routed layer."""
    layers = sorted({key.split("/")[1] for entry in history for key in entry if key.startswith("routing/")},
                    key=lambda layer: int(layer[1:]))
    if not layers:
        return None
    fig, axes = plt.subplots(1, len(layers), figsize=(max(7.0, 4.2 * len(layers)), 3.2), squeeze=False, sharey=True)
    for ax, layer in zip(axes[0], layers):
        for operator in operators:
            curve = points(history, f"routing/{layer}/{operator}")
            if curve:
                ax.plot(*zip(*curve), label=operator, color=OPERATOR_COLOURS.get(operator), marker=".")
        ax.set_title(f"layer {layer[1:]}", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0, 0].set_ylabel("fraction of tokens")
    axes[0, 0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    return save(fig, path)


@torch.no_grad()
def plot_routing_map(model, input_ids: torch.Tensor, tokenizer, path: str, title: str) -> str | None:
    """The operator each token of one sample took in each routed layer (rows: layers, columns: tokens)."""
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    config = model.config
    if not config.routed_layers:
        return None
    outputs = model.eval()(input_ids=input_ids[None], output_routing=True,
                           **({"use_cache": False} if config.is_causal else {}))
    routes = torch.stack([decisions[0] for decisions in outputs.routing_decisions]).cpu().numpy()
    tokens = [printable(tokenizer.convert_tokens_to_string([token]) or token)
              for token in tokenizer.convert_ids_to_tokens(input_ids.tolist())]
    colours = [OPERATOR_COLOURS.get(operator, "#999999") for operator in config.routed_operators]
    fig, ax = plt.subplots(figsize=(max(8.0, 0.2 * len(tokens)), 1.4 + 0.45 * len(routes)))
    ax.imshow(routes, aspect="auto", cmap=ListedColormap(colours), vmin=0, vmax=len(colours) - 1,
              interpolation="nearest")
    ax.set_yticks(range(len(routes)), [f"layer {layer}" for layer in config.routed_layers], fontsize=8)
    ax.set_xticks(range(len(tokens)), tokens, fontsize=6, rotation=90, family="monospace")
    ax.legend(handles=[Patch(color=c, label=op) for op, c in zip(config.routed_operators, colours)],
              fontsize=7, loc="upper right", bbox_to_anchor=(1.0, 1.35), ncol=len(colours))
    ax.set_title(title, fontsize=10, loc="left")
    return save(fig, path)


def save(fig, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_delta_vs_context(deltas: dict, path: str, title: str) -> str:
    """Δ against the context (log scale): per corpus (label -> [(context, paired delta)], a delta as
    `experiments.paired_delta` gives it) the mean with the seeds' sample std as error bars, each seed faint."""
    fig, ax = plt.subplots(figsize=(7, 4.4))
    ax.axhline(0.0, color="black", linewidth=0.8)
    for index, (label, cells) in enumerate(deltas.items()):
        cells = sorted(cells, key=lambda cell: cell[0])
        offset = 1 + 0.04 * (index - (len(deltas) - 1) / 2)  # the corpora side by side at each context
        contexts = [context * offset for context, _ in cells]
        ax.errorbar(contexts, [delta["mean"] for _, delta in cells],
                    yerr=[delta["std"] or 0.0 for _, delta in cells], color=f"C{index}", marker="o", capsize=4,
                    label=f"{label} (mean ± std over seeds)")
        for context, (_, delta) in zip(contexts, cells):
            ax.scatter([context] * len(delta["per_seed"]), delta["per_seed"], color=f"C{index}", alpha=0.35, s=12)
    ax.set_xscale("log", base=2)
    every = sorted({context for cells in deltas.values() for context, _ in cells})
    ax.set_xticks(every, [str(context) for context in every])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("Δ = BASE − EGA-1 validation loss (nats/char)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    return save(fig, path)


def plot_position_deltas(positions: dict, path: str, title: str, titles: dict | None = None) -> str:
    """Per corpus, Δ by group of window positions, one line per context (``positions``: the cells of
    `ega_context.comparison`, each {benchmark, context, groups: {"first-last": {"delta": ...}}}; ``titles``: a
    panel title per corpus)."""
    titles = titles or {}
    benchmarks = list(dict.fromkeys(cell["benchmark"] for cell in positions.values()))
    fig, axes = plt.subplots(1, len(benchmarks), figsize=(6.2 * len(benchmarks), 4.2), squeeze=False, sharey=True)
    for ax, benchmark in zip(axes[0], benchmarks):
        cells = sorted((cell for cell in positions.values() if cell["benchmark"] == benchmark),
                       key=lambda cell: cell["context"])
        for index, cell in enumerate(cells):
            groups = sorted(((int(label.split("-")[0]), int(label.split("-")[1]), group["delta"])
                             for label, group in cell["groups"].items() if group["delta"]))
            if groups:
                middle = [(first + last) / 2 for first, last, _ in groups]
                ax.errorbar(middle, [delta["mean"] for *_, delta in groups],
                            yerr=[delta["std"] or 0.0 for *_, delta in groups], marker="o", capsize=3,
                            color=f"C{index}", label=f"context {cell['context']}")
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("position of the predicted token in the window (group middle)")
        ax.set_title(titles.get(benchmark, benchmark), fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0, 0].set_ylabel("Δ = BASE − EGA-1 (nats/char)")
    fig.suptitle(title, fontsize=10)
    return save(fig, path)


def plot_tau_trajectories(trajectories: dict, reference: float | None, path: str, title: str) -> str:
    """The mean τ over heads against the step (label -> [(step, mean, min, max)]), the heads' range as a band, and
    a reference value (the paper's claim) dashed."""
    fig, ax = plt.subplots(figsize=(7, 4.4))
    for index, (label, rows) in enumerate(trajectories.items()):
        if not rows:
            continue
        steps, means, lows, highs = zip(*rows)
        ax.plot(steps, means, color=f"C{index}", label=label)
        ax.fill_between(steps, lows, highs, color=f"C{index}", alpha=0.15)
    if reference is not None:
        ax.axhline(reference, color="black", linestyle="--", linewidth=1, label=f"paper: τ → {reference}")
    ax.set_xlabel("optimiser step")
    ax.set_ylabel("τ (mean over layers and heads)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    return save(fig, path)
