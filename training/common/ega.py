"""EGA-GPT on a character corpus: the paper's variants against the baseline (SPEC 1.4), one run_clm run per variant
and seed from ``training/configs/<benchmark>_<preset>.json``, and the comparison of the runs. What the
``tinyshakespeare`` and ``ptb_char`` entry points and ``reproduce_ega`` share.

The comparison (`write_report`) reads what each run wrote: the validation loss on the whole validation split, the
training loss in evaluation mode and the generalisation gap, the leak-free loss of a model whose gates use window
statistics (it sees future tokens) beside every model's ordinary loss on the same blocks (Δ vs BASE compares these),
τ and α as logged while training, and, from the saved model, the gates' values over validation text.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass, field

from .cli import UsageError, program_name, run_main
from .experiments import (
    Run,
    add_size_arguments,
    apply_sizes,
    config,
    count_parameters,
    driver_parser,
    mean_std,
    merge_overrides,
    paired_delta,
    parse,
    pm,
    prepare_and_train,
    read_run,
    script_options,
    table_without_provenance,
)

VARIANTS = ("BASE", "EGA-1", "EGA-2", "EGA-4", "EGA-C", "EGA-M-F", "EGA-M", "EGA-DB2", "EGA-DB4")
NORMALIZATIONS = ("causal", "window", "none")
TITLES = {"tinyshakespeare": "TinyShakespeare (char)", "ptb_char": "PTB (char)"}
# SPEC 1.4: the authors' README, one seed, final-step validation loss (nats/char), and the generalisation gap
PAPER = {"tinyshakespeare": {"BASE": 1.4742, "EGA-1": 1.3712, "EGA-2": 1.3950, "EGA-4": 1.4088, "EGA-C": 1.3745,
                             "EGA-M-F": 1.4733, "EGA-DB2": 1.4692, "EGA-DB4": 1.4748},
         "ptb_char": {"BASE": 1.0897, "EGA-1": 0.9889}}
PAPER_GAP = {"tinyshakespeare": {"BASE": 0.331, "EGA-1": 0.289}, "ptb_char": {}}
DROPOUT_FIELDS = ("embd_pdrop", "resid_pdrop", "attn_pdrop")


def add_arguments(parser, presets: tuple, default: str) -> None:
    parser.add_argument("--preset", choices=presets, default=default,
                        help="the configuration training/configs/<benchmark>_<preset>.json (default: %(default)s)")
    parser.add_argument("--smoke", action="store_true", help="the smoke preset: a tiny model, a few steps")
    parser.add_argument("--variants", nargs="+", metavar="VARIANT[:NORM]",
                        help=f"models to train: {', '.join(VARIANTS)}, optionally with the energy statistics, e.g. "
                             "EGA-1:window (default: BASE and EGA-1)")
    parser.add_argument("--normalization", choices=NORMALIZATIONS, default="causal",
                        help="energy statistics of the variants given without one (default: causal)")
    add_size_arguments(parser)


def parse_variant(text: str, default_normalization: str) -> tuple:
    """``EGA-1`` -> (EGA-1, default); ``EGA-1:window`` -> (EGA-1, window); BASE has no gates, so no statistics."""
    variant, _, normalization = text.partition(":")
    if variant not in VARIANTS:
        raise UsageError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    normalization = normalization or default_normalization
    if normalization not in NORMALIZATIONS:
        raise UsageError(f"unknown energy statistics {normalization!r} in {text!r}; choose from "
                         f"{', '.join(NORMALIZATIONS)}")
    return variant, "none" if variant == "BASE" else normalization


def label(variant: str, normalization: str) -> str:
    return variant if variant == "BASE" else f"{variant} ({normalization})"


def run_name(variant: str, normalization: str, seed: int) -> str:
    return (variant if variant == "BASE" else f"{variant}-{normalization}") + f"-seed{seed}"


def make_runs(benchmark: str, preset: str, variants: list, seeds: list, output_dir: str, files: dict, args,
              tokens: list, settings: dict | None = None) -> dict:
    """{(variant, statistics, seed): run_clm run}: the preset's configuration, the data ``files``, the size options
    of ``args``, ``settings`` (run_clm options a driver sets) and the script options among ``tokens``."""
    base = {**apply_sizes({**config(f"{benchmark}_{preset}"), **files}, args, DROPOUT_FIELDS, "block_size"),
            **(settings or {})}
    options = script_options("run_clm", tokens)
    runs = {}
    for variant, normalization in dict.fromkeys(variants):
        for seed in seeds:
            name = run_name(variant, normalization, seed)
            arguments = {**base, "variant": variant, "seed": seed, **options,
                         "output_dir": os.path.join(output_dir, name)}
            if variant != "BASE":
                arguments["config_overrides"] = merge_overrides(arguments["config_overrides"],
                                                                {"energy_normalization": normalization})
            runs[variant, normalization, seed] = Run(name, "run_clm", arguments)
    return runs


@dataclass
class RecordedRun(Run):
    """A run whose folder is not on this machine, read from a table of record (a ``<corpus>.json`` that
    `write_report` wrote): ``recorded`` is its entry of the record's ``runs``, ``source`` the record itself. It counts
    as complete and is never trained; `write_report` takes its numbers from the record."""

    recorded: dict = field(default_factory=dict)
    source: dict = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return True


# Arguments that say where a run's files are, not how it ran: compared by their last two parts (data_dir may differ)
LOCATION_ARGUMENTS = ("output_dir", "train_file", "validation_file", "test_file")


def argument_differences(recorded: dict, planned: dict, ignore: tuple = ()) -> list:
    """"<key>: <recorded> there, <planned> here" for every argument in which a recorded run differs from one planned
    here; the paths of `LOCATION_ARGUMENTS` compared by their last two parts (the data folder may differ)."""

    def compared(key: str, value):
        return os.path.join(*str(value).split(os.sep)[-2:]) if key in LOCATION_ARGUMENTS and value else value

    return [f"{key}: {recorded.get(key)!r} there, {planned.get(key)!r} here"
            for key in sorted(set(recorded) | set(planned))
            if key not in ignore and compared(key, recorded.get(key)) != compared(key, planned.get(key))]


def read_record(path: str) -> tuple:
    """(the table of record at ``path``, its runs by name, its configuration); a `UsageError` if it is not one."""
    try:
        with open(path, encoding="utf-8") as handle:
            record = json.load(handle)
        held = {found["run"]: found for found in record["runs"]}
        recorded_config = dict(record["config"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UsageError(f"--add_to_results {path}: not a table of record ({' '.join(str(error).split())})") from None
    return record, held, recorded_config


def recorded_runs(path: str, runs: dict) -> dict:
    """{key: `RecordedRun`} for the runs of ``runs`` ({(variant, statistics, seed): Run}) that are not complete here
    and that the table of record at ``path`` holds (by name). The record must come from the arguments these runs
    have: its ``config`` (the arguments of one of its runs) must equal that run's here, the data files by name, and
    each run it gives must have the same steps; otherwise a `UsageError` names the difference."""
    record, held, recorded_config = read_record(path)
    wanted = {key: run for key, run in runs.items() if not run.complete and run.name in held}
    if not wanted:
        return {}
    by_folder = {os.path.basename(run.folder): run for run in runs.values()}
    same = by_folder.get(os.path.basename(str(recorded_config.get("output_dir", ""))))
    if same is None:
        raise UsageError(f"--add_to_results {path}: its configuration is of no run planned here "
                         f"({recorded_config.get('output_dir')})")

    differences = argument_differences(recorded_config, same.arguments, ignore=("output_dir",))
    for key, run in wanted.items():
        if held[run.name].get("steps") != run.arguments.get("max_steps"):
            differences.append(f"{run.name}: {held[run.name].get('steps')} steps there, "
                               f"{run.arguments.get('max_steps')} here")
    if differences:
        raise UsageError(f"--add_to_results {path} holds runs made with other arguments ({'; '.join(differences)})")
    return {key: RecordedRun(run.name, run.script, run.arguments, recorded=held[run.name], source=record)
            for key, run in wanted.items()}


# ----------------------------------------------------------------------------------------------------------------
# The comparison
# ----------------------------------------------------------------------------------------------------------------


def summary(run: Run, variant: str, normalization: str, seed: int) -> dict:
    """What the table reports of one finished run, from the files it wrote."""
    result = read_run(run.folder)
    history = result["log_history"]
    gates = {key: value for key, value in ([entry for entry in history if "train_seconds" in entry] or [{}])[-1].items()
             if key.startswith("gates/")}
    taus = [value for key, value in gates.items() if key.endswith("/tau")]
    found = {
        "run": run.name, "variant": variant, "normalization": normalization, "seed": seed,
        "sees_future": normalization == "window", "steps": result["arguments"]["max_steps"],
        "val_loss": result["eval_loss"], "val_perplexity": result["perplexity"],
        "train_loss": result.get("eval_train_loss"),
        "generalization_gap": result.get("eval_generalization_gap"), "test_loss": result.get("test_loss"),
        "val_loss_same_blocks": result.get("eval_leaky_loss"), "train_seconds": result.get("train_runtime"),
        "parameters": count_parameters(run.folder),
        "gate_parameters": count_parameters(run.folder, lambda name: ".energy_gate." in name),
        "log_history": history,
    }
    if normalization == "window":
        found["val_loss_leak_free"] = result.get("eval_leak_free_loss")
    positions = {key.removeprefix("eval_position_loss_"): value for key, value in result.items()
                 if key.startswith("eval_position_loss_")}
    if positions:  # run_clm's --position_loss_buckets: {"<first>-<last>": loss}
        found["position_loss"] = positions
    if taus:
        alphas = [value for key, value in gates.items() if key.endswith("/alpha")]
        found["gates"] = {"tau_mean": statistics.fmean(taus), "tau_std": statistics.pstdev(taus),
                          "alpha_mean": statistics.fmean(alphas), "per_head": gates}
    return found


def comparison_rows(summaries: list, paper: dict, paper_gap: dict) -> list:
    """One row per (variant, statistics): mean ± std over seeds, Δ vs BASE (positive: better than BASE; from the
    leak-free loss of a window model, against BASE's loss on the same blocks), gap, learned τ, the paper's numbers."""
    groups = {}
    for found in summaries:
        groups.setdefault(label(found["variant"], found["normalization"]), []).append(found)
    base = groups.get("BASE", [])
    base_val = mean_std([found["val_loss"] for found in base])[0]
    base_same_blocks = mean_std([found.get("val_loss_same_blocks") for found in base])[0]
    rows = []
    for name, runs in groups.items():
        variant = runs[0]["variant"]
        val, val_std = mean_std([found["val_loss"] for found in runs])
        leak, leak_std = mean_std([found.get("val_loss_leak_free") for found in runs])
        test, test_std = mean_std([found.get("test_loss") for found in runs])
        gap, gap_std = mean_std([found.get("generalization_gap") for found in runs])
        tau, tau_std = mean_std([found["gates"]["tau_mean"] for found in runs if found.get("gates")])
        comparable, reference = (leak, base_same_blocks) if leak is not None else (val, base_val)
        delta = None if reference is None or comparable is None or name == "BASE" else reference - comparable
        paper_val, paper_base = paper.get(variant), paper.get("BASE")
        rows.append({
            "model": name, "seeds": len(runs), "val loss": pm(val, val_std), "leak-free val loss": pm(leak, leak_std),
            "test loss": pm(test, test_std), "Δ vs BASE": "" if delta is None else f"{delta:+.4f}",
            "gap (val − train)": pm(gap, gap_std), "τ (mean)": pm(tau, tau_std, 3),
            "paper val": "" if paper_val is None else f"{paper_val:.4f}",
            "paper Δ": "" if None in (paper_val, paper_base) or variant == "BASE" else f"{paper_base - paper_val:+.4f}",
            "paper gap": "" if paper_gap.get(variant) is None else f"{paper_gap[variant]:.3f}",
            "gate params": f"{runs[0]['gate_parameters']:,}", "params": f"{runs[0]['parameters']:,}",
            "train min / run": f"{statistics.fmean(found['train_seconds'] or 0 for found in runs) / 60:.1f}",
            "val_loss_mean": val, "val_loss_std": val_std, "leak_free_mean": leak, "leak_free_std": leak_std,
            "test_loss_mean": test, "test_loss_std": test_std, "gap_mean": gap, "gap_std": gap_std,
            "tau_mean": tau, "tau_std": tau_std, "delta_vs_base": delta,
        })
    return rows


COLUMNS = ["model", "seeds", "val loss", "leak-free val loss", "test loss", "Δ vs BASE", "gap (val − train)",
           "τ (mean)", "paper val", "paper Δ", "paper gap", "gate params", "params", "train min / run"]


def gate_figures_and_characters(run: Run, title: str, figures: str, prefix: str) -> dict:
    """From the saved model and the validation text: the gate heat map over the first 96 characters, the τ / α
    trajectories (from the log), and the mean gate value per character over 16 validation blocks (the characters the
    gates keep and those they suppress)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .plots import gate_values_per_token, plot_gate_heatmap, plot_gate_trajectories

    model = AutoModelForCausalLM.from_pretrained(run.folder)
    tokenizer = AutoTokenizer.from_pretrained(run.folder)
    with open(run.arguments["validation_file"], encoding="utf-8") as handle:
        ids = tokenizer(handle.read())["input_ids"]
    block = run.arguments["block_size"]
    blocks = [torch.tensor(ids[start:start + block]) for start in range(0, min(len(ids), 16 * block), block)]
    plot_gate_heatmap(gate_values_per_token(model, blocks[0][:96]), tokenizer.convert_ids_to_tokens(blocks[0][:96]),
                      os.path.join(figures, f"{prefix}gate_heatmap.png"), f"{title}: gate values on validation text "
                      "(rows: layer, head)")
    plot_gate_trajectories(read_run(run.folder)["log_history"], os.path.join(figures, f"{prefix}gate_trajectories.png"),
                           f"{title}: τ and α during training")
    sums, counts = {}, {}
    for block_ids in blocks:
        gates = gate_values_per_token(model, block_ids)
        mean = torch.stack([values.mean(0) for values in gates.values()]).mean(0)
        for token, value in zip(block_ids.tolist(), mean.tolist()):
            sums[token], counts[token] = sums.get(token, 0.0) + value, counts.get(token, 0) + 1
    ranked = sorted((sums[token] / counts[token], token) for token in sums if counts[token] >= 10)
    name = tokenizer.convert_ids_to_tokens
    return {"lowest_gate": [[name(token), round(value, 4)] for value, token in ranked[:8]],
            "highest_gate": [[name(token), round(value, 4)] for value, token in ranked[::-1][:8]]}


def recorded_provenance(recorded: list) -> tuple:
    """({"recorded_runs": [{runs, command, date, hardware}]}, the notes' lines saying so) for the `RecordedRun`s of a
    table: the command that trained each, the record's or the one its own record names; ({}, "") when none."""
    if not recorded:
        return {}, ""
    sources = {}
    for run in recorded:
        origin = next((entry for entry in run.source.get("recorded_runs", []) if run.name in entry["runs"]),
                      run.source)
        # by the record itself: two records can share their command and their date to the second
        sources.setdefault(id(origin), (origin, []))[1].append(run.name)
    extra = {"recorded_runs": [{"runs": names, "command": source.get("command"), "date": source.get("date"),
                                "hardware": source.get("hardware")} for source, names in sources.values()]}
    notes = "".join(
        f"\nRead from an earlier table of record, not trained by this command ({len(names)} runs: "
        f"{', '.join(names)}): `{source.get('command')}`, {source.get('date')}, "
        f"{(source.get('hardware') or {}).get('cpu_model', 'CPU not recorded')}; their figures are that "
        "command's, and their minutes per run were measured on its machine.\n" for source, names in sources.values())
    return extra, notes


def write_report(benchmark: str, runs: dict, results_dir: str, name: str, title: str) -> list:
    """``<results_dir>/<name>.{json,md}``: the comparison of the finished ``runs`` ({(variant, statistics, seed):
    Run}), with the paired deltas, the leak of window statistics and the gates' characters; validation curves, and
    gate figures of the first seed's EGA-1 runs. Returns the summaries."""
    from ..results import write_results
    from .plots import plot_validation_curves

    summaries = [dict(run.recorded) if isinstance(run, RecordedRun) else summary(run, *key)
                 for key, run in runs.items()]
    recorded = [run for run in runs.values() if isinstance(run, RecordedRun)]
    rows = comparison_rows(summaries, PAPER[benchmark], PAPER_GAP[benchmark])
    by_label = {}
    for found in summaries:
        by_label.setdefault(label(found["variant"], found["normalization"]), {})[found["seed"]] = found
    base = by_label.get("BASE", {})

    def values(runs_of: dict, key: str) -> dict:
        return {seed: found.get(key) for seed, found in runs_of.items()}

    paired = {
        "EGA-1 (causal) vs BASE": paired_delta(values(base, "val_loss"), values(by_label.get("EGA-1 (causal)", {}),
                                                                              "val_loss")),
        "EGA-1 (window) ordinary loss vs BASE": paired_delta(values(base, "val_loss"),
                                                             values(by_label.get("EGA-1 (window)", {}), "val_loss")),
        # both on the leak-free evaluation's blocks
        "EGA-1 (window) leak-free loss vs BASE": paired_delta(
            values(base, "val_loss_same_blocks"), values(by_label.get("EGA-1 (window)", {}), "val_loss_leak_free")),
    }
    windows = [found for found in summaries if found["normalization"] == "window"]
    leak = {"window_ordinary_minus_leak_free": [found["val_loss_same_blocks"] - found["val_loss_leak_free"]
                                                for found in windows if found.get("val_loss_leak_free") is not None]}
    first_seed = min(found["seed"] for found in summaries)
    characters = {}
    for (variant, normalization, seed), run in runs.items():
        if variant == "EGA-1" and seed == first_seed:
            if isinstance(run, RecordedRun):  # its figures stay those the record was made with
                if run.name in run.source.get("gate_by_character", {}):
                    characters[run.name] = run.source["gate_by_character"][run.name]
                continue
            characters[run.name] = gate_figures_and_characters(
                run, f"{TITLES[benchmark]}, {label(variant, normalization)}", results_dir,
                f"{name}_EGA-1-{normalization}_")
    arguments = next(iter(runs.values())).arguments
    scale = (f"{arguments['config_overrides']}; block {arguments['block_size']}, batch "
             f"{arguments['per_device_train_batch_size']}, {arguments['max_steps']} steps ({arguments['warmup_steps']} "
             f"warm-up, {arguments['lr_scheduler_type']}), AdamW lr {arguments['learning_rate']}, betas "
             f"({arguments['adam_beta1']}, {arguments['adam_beta2']}), weight decay {arguments['weight_decay']} "
             "(not on the gate scalars)")
    paired_lines = "\n".join(f"- {key}: {pm(delta['mean'], delta['std'])} (seeds {delta['seeds']}; positive = better "
                             "than BASE)" for key, delta in paired.items() if delta)
    notes = (f"Scale: {scale}. Validation loss in nats per character at the final step on the whole validation split "
             "(evaluation mode); mean ± sample std over seeds. Δ vs BASE = mean BASE − mean model (positive: better); "
             f"for `window` models from the leak-free loss (first {arguments.get('leak_free_eval_batches')} "
             "validation batches, each token from its prefix) against BASE's ordinary loss on the same batches: their "
             "ordinary loss sees future tokens. Paper: SPEC 1.4 (6 layers, C = 256, 5000 steps, one seed, window "
             f"statistics).\n\nPaired by seed (model and BASE share the seed):\n{paired_lines}\n")
    extra, provenance = recorded_provenance(recorded)
    notes += provenance
    columns = [column for column in COLUMNS if column != "test loss" or any(row["test loss"] for row in rows)]
    write_results(results_dir, name, rows, title=title, config=arguments, seeds=sorted({f["seed"] for f in summaries}),
                  notes=notes, columns=columns,
                  extra={**extra, "paired_deltas": paired, "window_leak": leak, "gate_by_character": characters,
                         "runs": [{k: v for k, v in found.items() if k != "log_history"} for found in summaries]})
    # The figures, of the runs whose log is here (a record keeps no log): a figure that would lack some is not drawn
    # unless it is the variants' one, drawn without them
    histories = {f"{label(found['variant'], found['normalization'])} seed {found['seed']}": found.get("log_history")
                 for found in summaries}
    main = {key: history for key, history in histories.items()
            if key.split(" seed")[0] in ("BASE", "EGA-1 (causal)", "EGA-1 (window)")}
    if all(history is not None for history in main.values()):
        plot_validation_curves(main, "eval_loss", os.path.join(results_dir, f"{name}_validation_curves_main.png"),
                               f"{TITLES[benchmark]}: BASE vs EGA-1, every seed")
    first = {key: history for key, history in histories.items() if key.endswith(f"seed {first_seed}")}
    missing = [key for key, history in first.items() if history is None]
    if len(missing) < len(first):
        plot_validation_curves({key: history for key, history in first.items() if history is not None}, "eval_loss",
                               os.path.join(results_dir, f"{name}_validation_curves_variants.png"),
                               f"{TITLES[benchmark]}: every variant, seed {first_seed}"
                               + (f" (not drawn, read from a record: {', '.join(missing)})" if missing else ""))
    return summaries


def print_losses(summaries: list) -> None:
    """The numbers a user waits for, one line per run, at the end of the output."""
    print("=" * 78)
    base = [found for found in summaries if found["variant"] == "BASE"]
    for found in summaries:
        line = (f"validation loss  {label(found['variant'], found['normalization']):<22} seed {found['seed']}: "
                f"{found['val_loss']:.4f} nats/char")
        leak_free = found.get("val_loss_leak_free")
        if leak_free is not None:
            line += (f"  (leak-free: {leak_free:.4f}, ordinary on the same tokens: {found['val_loss_same_blocks']:.4f};"
                     " the ordinary loss sees future tokens)")
        key = "val_loss_same_blocks" if leak_free is not None else "val_loss"
        reference = mean_std([other.get(key) for other in base])[0]
        if reference is not None and found["variant"] != "BASE":
            line += f"  Δ vs BASE {reference - (leak_free if leak_free is not None else found['val_loss']):+.4f}"
        print(line)
    print("=" * 78, flush=True)


# Variants a preset trains by default
DEFAULT_VARIANTS = {"demo": ("BASE", "EGA-1"), "smoke": ("BASE", "EGA-1"), "cpu": ("BASE", "EGA-1", "EGA-1:window"),
                    "cpu_padding_free": ("BASE", "EGA-1"),
                    "authors": VARIANTS}


def main(benchmark: str, description: str, argv, *, presets: tuple, default: str, data_files, prepare_data) -> int:
    """The entry point of a benchmark: ``data_files(data_dir)`` names the files its runs read and
    ``prepare_data(args, files)`` writes them (``args``: the command line's, with ``data_path``, ``no_download``)."""
    prog = program_name(benchmark)

    def run(argv) -> int:
        parser = driver_parser(prog, description)
        add_arguments(parser, presets, default)
        group = parser.add_argument_group("data")
        group.add_argument("--data_path", help="the corpus: a file or a folder (default: $HF_SPECTRAL_DATA, the "
                           "download cache, else a download from its public source)")
        group.add_argument("--no_download", action="store_true", help="fail instead of downloading the corpus")
        args, tokens = parse(parser, argv)
        preset = "smoke" if args.smoke else args.preset
        variants = [parse_variant(text, args.normalization) for text in args.variants or DEFAULT_VARIANTS[preset]]
        output_dir = args.output_dir or os.path.join("runs", f"{benchmark}-{preset}")
        files = data_files(args.data_dir)
        runs = make_runs(benchmark, preset, variants, args.seeds or [0], output_dir, files, args, tokens)
        code = prepare_and_train(args, list(runs.values()), output_dir, files, prepare_data)
        if code is not None:
            return code
        summaries = write_report(benchmark, runs, output_dir, "results",
                                 f"{TITLES[benchmark]}: EGA-GPT variants ({preset} preset)")
        print(table_without_provenance(os.path.join(output_dir, "results.md")))
        print_losses(summaries)
        return 0

    return run_main(run, argv, prog)
