"""The EGA reproduction at CPU scale: every variant on TinyShakespeare and PTB char, several seeds, one table.

    python -m training.reproduce_ega --dry_run                   # list the runs and their commands
    nohup python -m training.reproduce_ega --jobs 2 --threads 1 > /tmp/ega_repro.log 2>&1 &
    python -m training.reproduce_ega --aggregate_only            # rebuild results/ega/ from finished runs
    python -m training.reproduce_ega --smoke --benchmarks tinyshakespeare   # a tiny end-to-end check
    hf-spectral train reproduce_ega --help                       # the same, from an installed package

Runs: BASE, EGA-1 (causal) and EGA-1 (window) with ``--main_seeds`` (default 0 1 2); EGA-2, EGA-4, EGA-C,
EGA-M-F, EGA-M, EGA-DB2 and EGA-DB4 (causal) with ``--other_seeds`` (default 0; ``--other_seeds`` alone
skips them). Each run is one recipe
process (``python -m training.<benchmark> --variants V --seeds S ...``; ``hf_spectral.recipes.<benchmark>`` when
installed) logging to ``<output_dir>/logs/``;
``--jobs`` of them run at once. Finished runs (``summary.json``) are skipped and interrupted ones resume from
their checkpoints, so the command can be rerun at any time. The tables, figures and conclusions data are
written to ``--results_dir`` only once every run of a benchmark is complete.

``--smoke`` checks the whole pipeline in minutes: the recipes' smoke preset, seed 0, BASE and EGA-1 (causal and
window) only, one process at a time, everything (tables included) under ``runs/ega_reproduction-smoke/``, never
in ``results/ega/``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from .common.jobs import run_logged, stop_running
from .common.presets import positive_int, recipe_prog

BENCHMARKS = ("tinyshakespeare", "ptb_char")
MAIN_VARIANTS = ("BASE", "EGA-1:causal", "EGA-1:window")
OTHER_VARIANTS = ("EGA-2", "EGA-4", "EGA-C", "EGA-M-F", "EGA-M", "EGA-DB2", "EGA-DB4")


def run_name(variant: str, seed: int) -> str:
    name, _, normalization = variant.partition(":")
    if name == "BASE":
        return f"BASE-seed{seed}"
    return f"{name}-{normalization or 'causal'}-seed{seed}"


def planned_runs(args) -> list:
    """(benchmark, variant, seed) in the order they are run: the main comparison's seeds first, so that an
    early stop still leaves the headline numbers complete."""
    runs = []
    for seed in args.main_seeds:
        for benchmark in args.benchmarks:
            runs += [(benchmark, variant, seed) for variant in MAIN_VARIANTS]
    for seed in args.other_seeds:
        for benchmark in args.benchmarks:
            runs += [(benchmark, variant if ":" in variant else f"{variant}:causal", seed) for variant in OTHER_VARIANTS]
    return runs


def recipe_command(args, benchmark: str, variant: str, seed: int) -> list:
    # The recipes are this module's siblings: training.<benchmark> in a checkout, hf_spectral.recipes.<benchmark>
    # when installed.
    command = [sys.executable, "-m", f"{__package__}.{benchmark}", "--preset", args.preset, "--variants", variant,
               "--seeds", str(seed), "--output_dir", os.path.join(args.output_dir, benchmark)]
    if args.threads:
        command += ["--threads", str(args.threads)]
    for option in ("max_steps", "batch_size", "context_length", "eval_steps", "eval_batches", "leak_free_batches",
                   "final_eval_batches", "num_hidden_layers", "num_attention_heads", "hidden_size", "warmup_steps",
                   "learning_rate", "save_steps"):
        value = getattr(args, option)
        if value is not None:
            command += [f"--{option}", str(value)]
    return command + list(args.recipe_args)


def summary_path(args, benchmark: str, variant: str, seed: int) -> str:
    return os.path.join(args.output_dir, benchmark, run_name(variant, seed), "summary.json")


def execute(args, benchmark, variant, seed) -> tuple:
    # Started even when the run looks complete: the recipe reuses a complete run only if it was made with this
    # command's settings, and refuses it otherwise (a skip here would report an old run under new options).
    log_path = os.path.join(args.output_dir, "logs", f"{benchmark}-{run_name(variant, seed)}.log")
    threads = str(args.threads or os.environ.get("OMP_NUM_THREADS", "")) or "1"
    code, elapsed = run_logged(
        recipe_command(args, benchmark, variant, seed), log_path, f"{benchmark} {run_name(variant, seed)}", threads
    )
    return benchmark, variant, seed, code, elapsed


# ------------------------------------------------------------------------------------------------------------
# Aggregation
# ------------------------------------------------------------------------------------------------------------


def load_summaries(args, benchmark: str) -> tuple[list, list]:
    found, missing = [], []
    for bench, variant, seed in planned_runs(args):
        if bench != benchmark:
            continue
        path = summary_path(args, bench, variant, seed)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as handle:
                found.append(json.load(handle))
        else:
            missing.append(run_name(variant, seed))
    return found, missing


def paired_delta(summaries: list, label_a: str, label_b: str, key_b: str = "val_loss",
                 key_a: str = "val_loss") -> dict | None:
    """Mean and sample std over seeds of loss(a) − loss(b) for runs with the same seed (a = BASE: positive
    means b is better). Pairing by seed removes the part of the seed noise the two runs share (data order)."""
    from .common.lm_experiment import RunSpec

    by_label = {}
    for s in summaries:
        by_label.setdefault(RunSpec(s["variant"], s["normalization"], s["seed"]).label, {})[s["seed"]] = s
    a, b = by_label.get(label_a, {}), by_label.get(label_b, {})
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return None
    seeds = [seed for seed in seeds if a[seed].get(key_a) is not None and b[seed].get(key_b) is not None]
    if not seeds:
        return None
    deltas = [a[seed][key_a] - b[seed][key_b] for seed in seeds]
    return {"mean": statistics.fmean(deltas), "std": statistics.stdev(deltas) if len(deltas) > 1 else None,
            "per_seed": deltas, "seeds": seeds}


def aggregate(args, benchmark: str) -> bool:
    """Write ``<results_dir>/<benchmark>.{json,md}`` and figures; False if runs are missing."""
    import importlib

    from .common.lm_experiment import RunSpec, comparison_rows, table_columns
    from .common.plots import plot_learning_curves
    from .results import write_results

    summaries, missing = load_summaries(args, benchmark)
    if missing:
        print(f"{benchmark}: {len(missing)} run(s) not complete ({', '.join(missing)}); no results written")
        return False
    recipe = importlib.import_module(f".{benchmark}", __package__)
    bench = recipe.BENCHMARK
    rows = comparison_rows(summaries, bench.paper, bench.paper_gap)
    for row in rows:  # wall time per run, for sizing future runs
        runs = [s for s in summaries if RunSpec(s["variant"], s["normalization"], s["seed"]).label == row["model"]]
        row["train min / run"] = f"{statistics.fmean(s['train_seconds'] for s in runs) / 60:.1f}"
        # Energy functions differ a lot in size (EGA-C's convolutions add more than a quarter to the model).
        row["gate params"] = f"{runs[0].get('gate_parameters', 0):,}"
        row["params"] = f"{runs[0].get('parameters', 0):,}"
    paired = {
        "EGA-1 (causal) vs BASE": paired_delta(summaries, "BASE", "EGA-1 (causal)"),
        "EGA-1 (window) ordinary loss vs BASE": paired_delta(summaries, "BASE", "EGA-1 (window)"),
        # On the leak-free evaluation's blocks, both models (BASE's val_loss is another subset).
        "EGA-1 (window) leak-free loss vs BASE": paired_delta(summaries, "BASE", "EGA-1 (window)", "val_loss_leak_free",
                                                              key_a="val_loss_same_blocks"),
    }
    windows = [s for s in summaries if s["normalization"] == "window"]
    leak = {
        "window_ordinary_minus_leak_free": [s["val_loss_same_blocks"] - s["val_loss_leak_free"] for s in windows],
        "window_same_blocks_ordinary": [s["val_loss_same_blocks"] for s in windows],
        "window_leak_free": [s["val_loss_leak_free"] for s in windows],
    }
    gate_chars = {RunSpec(s["variant"], s["normalization"], s["seed"]).name: s.get("gate_by_character")
                  for s in summaries if s.get("gate_by_character") and s["seed"] == min(args.main_seeds)}
    first = summaries[0]
    preset = first["preset"]
    scale = (f"{preset['num_hidden_layers']} layers, {preset['num_attention_heads']} heads, C = {preset['hidden_size']}, "
             f"context {preset['context_length']}, batch {preset['batch_size']}, {preset['max_steps']} steps "
             f"({preset['warmup_steps']} warm-up, cosine), AdamW lr {preset['learning_rate']}, dropout {preset['dropout']}")
    paired_lines = "\n".join(
        f"- {name}: {d['mean']:+.4f}" + (f" ± {d['std']:.4f}" if d["std"] is not None else "")
        + f" (seeds {d['seeds']}; positive = better than BASE)" for name, d in paired.items() if d)
    val_blocks = sorted({s.get("val_blocks") for s in summaries})
    notes = (f"Scale: {scale}. Validation loss in nats per character at the final step, on {val_blocks} blocks of "
             f"{preset['context_length']} characters (the whole validation split unless the preset caps it), "
             f"evaluation mode; mean ± sample std over seeds. Δ vs BASE = mean BASE − mean model (positive: "
             f"better), from the leak-free loss for `window` models, whose ordinary loss sees future tokens. "
             f"Paper: SPEC 1.4 (6 layers, C = 256, 5000 steps, one seed, window statistics).\n\n"
             f"Paired by seed (model and BASE share the seed):\n{paired_lines}\n")
    columns = table_columns(rows) + ["gate params", "params", "train min / run"]
    # Each run records the machine it ran on; the table process itself is not what was measured.
    extra = {"run_hardware": first.get("hardware"), "paired_deltas": paired, "window_leak": leak, "gate_by_character": gate_chars, "runs": [
        {k: v for k, v in s.items() if k not in ("log_history", "hardware", "preset")} for s in summaries]}
    os.makedirs(args.results_dir, exist_ok=True)
    write_results(args.results_dir, benchmark, rows, title=f"EGA reproduction, {bench.title}, CPU scale",
                  config={"preset": args.preset, **preset, "runs": len(summaries)},
                  seeds=sorted({s["seed"] for s in summaries}), notes=notes, columns=columns,
                  command=args.command, extra=extra)
    histories = {f"{RunSpec(s['variant'], s['normalization'], s['seed']).label} seed {s['seed']}": s["log_history"]
                 for s in summaries}
    main = {k: v for k, v in histories.items() if k.split(" seed")[0] in ("BASE", "EGA-1 (causal)", "EGA-1 (window)")}
    plot_learning_curves(main, os.path.join(args.results_dir, f"{benchmark}_validation_curves_main.png"),
                         f"{bench.title}: BASE vs EGA-1, all seeds")
    seed0 = {k: v for k, v in histories.items() if k.endswith(f"seed {min(args.main_seeds)}")}
    plot_learning_curves(seed0, os.path.join(args.results_dir, f"{benchmark}_validation_curves_variants.png"),
                         f"{bench.title}: every variant, seed {min(args.main_seeds)}")
    for name in ("gate_heatmap.png", "gate_trajectories.png"):
        for label in ("EGA-1-causal", "EGA-1-window"):
            source = os.path.join(args.output_dir, benchmark, f"{label}-seed{min(args.main_seeds)}", name)
            if os.path.isfile(source):
                shutil.copyfile(source, os.path.join(args.results_dir, f"{benchmark}_{label}_{name}"))
    print(f"{benchmark}: results written to {args.results_dir}/{benchmark}.{{json,md}}")
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog=recipe_prog("reproduce_ega"), description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--benchmarks", nargs="+", choices=BENCHMARKS, default=list(BENCHMARKS))
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny end-to-end run: smoke preset, seed 0, BASE and EGA-1 only, one job, written under "
                             "runs/ega_reproduction-smoke/ (tables in its results/ folder)")
    parser.add_argument("--preset", help="recipe preset for every run (default: cpu; smoke with --smoke)")
    parser.add_argument("--main_seeds", type=int, nargs="+", help="seeds of BASE and EGA-1 (default: 0 1 2; 0 with --smoke)")
    parser.add_argument("--other_seeds", type=int, nargs="*",
                        help="seeds of the other variants (default: 0; none with --smoke; none: only BASE and EGA-1, "
                             "e.g. for a longer schedule)")
    parser.add_argument("--jobs", type=positive_int, help="recipe processes at once (default: 2; 1 with --smoke)")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads per process (default 1)")
    parser.add_argument("--output_dir", help="default: runs/ega_reproduction (runs/ega_reproduction-smoke with --smoke)")
    parser.add_argument("--results_dir", help="default: results/ega (<output_dir>/results with --smoke)")
    parser.add_argument("--dry_run", action="store_true", help="print the commands and exit")
    parser.add_argument("--aggregate_only", action="store_true", help="only rebuild the tables from finished runs")
    for option, kind in (("max_steps", int), ("batch_size", int), ("context_length", int), ("eval_steps", int),
                         ("eval_batches", int), ("leak_free_batches", int), ("final_eval_batches", int),
                         ("num_hidden_layers", int), ("num_attention_heads", int), ("hidden_size", int),
                         ("warmup_steps", int), ("learning_rate", float), ("save_steps", int)):
        parser.add_argument(f"--{option}", type=kind, help="passed to every recipe run")
    parser.add_argument("recipe_args", nargs=argparse.REMAINDER,
                        help="after `--`: further options for every recipe run (e.g. -- --data_path ...)")
    args = parser.parse_args(argv)
    if args.recipe_args and args.recipe_args[0] == "--":
        args.recipe_args = args.recipe_args[1:]
    if args.smoke and args.preset not in (None, "smoke"):
        parser.error(f"--smoke runs the smoke preset; drop --preset {args.preset} or --smoke")
    defaults = ({"preset": "smoke", "main_seeds": [0], "other_seeds": [], "jobs": 1,
                 "output_dir": "runs/ega_reproduction-smoke"} if args.smoke else
                {"preset": "cpu", "main_seeds": [0, 1, 2], "other_seeds": [0], "jobs": 2,
                 "output_dir": "runs/ega_reproduction"})
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.results_dir is None:
        args.results_dir = os.path.join(args.output_dir, "results") if args.smoke else "results/ega"
    from .results import current_command

    args.command = current_command()
    runs = planned_runs(args)
    if args.dry_run:
        for benchmark, variant, seed in runs:
            done = "done   " if os.path.isfile(summary_path(args, benchmark, variant, seed)) else "pending"
            print(done, " ".join(recipe_command(args, benchmark, variant, seed)))
        return 0
    failed = []
    if not args.aggregate_only:
        signal.signal(signal.SIGTERM, stop_running)
        signal.signal(signal.SIGINT, stop_running)
        started = time.time()
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            outcomes = list(pool.map(lambda run: execute(args, *run), runs))
        failed = [(b, run_name(v, s), code) for b, v, s, code, _ in outcomes if code != 0]
        print(f"all runs finished in {(time.time() - started) / 60:.1f} min; failed: {failed or 'none'}", flush=True)
    # A benchmark with a failed run keeps its old table: its folder may still hold a summary of that run from other
    # settings (the recipe refused to reuse it), which the table would report under this command.
    complete = [aggregate(args, benchmark) for benchmark in args.benchmarks
                if not any(failure[0] == benchmark for failure in failed)]
    return 0 if all(complete) and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
