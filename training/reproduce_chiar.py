"""The CHIAR-Former reproduction at CPU scale: every arm on WikiText-2, ListOps and IMDB, several seeds, one table
per benchmark beside the paper's numbers (SPEC 2.3).

    python -m training.reproduce_chiar --dry_run                          # list the recipe commands
    HF_SPECTRAL_DATA=/path/to/data nohup python -m training.reproduce_chiar --jobs 2 --threads 1 \\
        > /tmp/chiar_repro.log 2>&1 &
    python -m training.reproduce_chiar --aggregate_only                   # rebuild results/chiar/ from finished runs

Arms: WikiText-2 (``--wikitext_arms``): the all-attention baseline, CHIAR DCT+Attn with the threshold and the hard
router and the 3-operator variant, each in the authors' layout (DCT / routed / routed / attention) and with every
layer routed (``@all``), and the control with DCT mixing in every layer (``dct``: no token mixing at all, a
learned bigram model); ListOps and IMDB (``--listops_arms``, ``--imdb_arms``): the authors' layout only. Every
arm with ``--seeds`` (default 0 1 2), at each recipe's ``cpu`` preset. One recipe process per (benchmark, seed)
trains that seed's arms, logging to ``<output_dir>/logs/``; ``--jobs`` processes run at once. Finished runs are
skipped, so the command can be rerun at any time; the tables are written from whatever runs are complete (missing
ones are listed in them).
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
from .common.presets import non_negative_int, positive_int, recipe_prog

BENCHMARKS = ("wikitext", "listops", "imdb")
WIKITEXT_ARMS = ("attention", "threshold", "hard", "3op", "threshold@all", "hard@all", "3op@all", "dct")
CLASSIFICATION_ARMS = ("attention", "threshold", "hard", "3op")


def arms_of(args, benchmark: str) -> list:
    return list(getattr(args, f"{benchmark}_arms"))


def run_dir_name(arm: str, seed: int) -> str:
    family, _, layout = arm.partition("@")
    return family + (f"-{layout}-routed" if layout else "") + f"-seed{seed}"


def planned(args) -> list:
    """(benchmark, seed) recipe invocations, seed by seed, WikiText-2 (the headline) first in each. With --jobs 2
    the first two at once are different benchmarks, so no two processes prepare the same data at the same time."""
    return [(benchmark, seed) for seed in args.seeds for benchmark in args.benchmarks]


def recipe_command(args, benchmark: str, seed: int) -> list:
    command = [sys.executable, "-m", f"{__package__}.{benchmark}", "--preset", args.preset, "--arms", *arms_of(args, benchmark),
               "--seeds", str(seed), "--output_dir", os.path.join(args.output_dir, benchmark)]
    if args.threads:
        command += ["--threads", str(args.threads)]
    if seed != min(args.seeds):
        command.append("--no_plots")  # figures of the first seed only
    if benchmark == "imdb" and args.imdb_test_examples:
        command += ["--max_test_examples", str(args.imdb_test_examples)]
    return command + list(args.recipe_args)


def check_plan(args, parser: argparse.ArgumentParser) -> None:
    """A preset or an arm that a recipe would refuse is a usage error here, before any recipe process starts."""
    import importlib

    from .common.chiar_experiment import parse_arm

    for benchmark in args.benchmarks:
        presets = importlib.import_module(f"{__package__}.{benchmark}").PRESETS
        if args.preset not in presets:
            parser.error(f"--preset {args.preset}: {benchmark} has the presets {', '.join(sorted(presets))}")
        for arm in arms_of(args, benchmark):
            try:
                parse_arm(arm)
            except argparse.ArgumentTypeError as error:
                parser.error(f"--{benchmark}_arms: {error}")


def complete(args, benchmark: str, seed: int) -> bool:
    return all(os.path.isfile(os.path.join(args.output_dir, benchmark, run_dir_name(arm, seed), "summary.json"))
               for arm in arms_of(args, benchmark))


def execute(args, benchmark: str, seed: int) -> tuple:
    # Started even when its runs look complete: the recipe reuses a complete run only if it was made with this
    # command's settings, and refuses it otherwise (a skip here would report old runs under new options).
    log_path = os.path.join(args.output_dir, "logs", f"{benchmark}-seed{seed}.log")
    code, elapsed = run_logged(
        recipe_command(args, benchmark, seed), log_path, f"{benchmark} seed {seed}", str(args.threads or 1)
    )
    return benchmark, seed, code, elapsed


# ------------------------------------------------------------------------------------------------------------
# Aggregation
# ------------------------------------------------------------------------------------------------------------


def task_of(benchmark: str):
    if benchmark == "wikitext":
        from .wikitext import task_for

        return task_for("wikitext-2")
    if benchmark == "imdb":
        from .imdb import TASK

        return TASK
    from .listops import TASK

    return TASK


def load_summaries(args, benchmark: str) -> tuple[list, list]:
    found, missing = [], []
    for seed in args.seeds:
        for arm in arms_of(args, benchmark):
            path = os.path.join(args.output_dir, benchmark, run_dir_name(arm, seed), "summary.json")
            if os.path.isfile(path):
                with open(path, encoding="utf-8") as handle:
                    found.append(json.load(handle))
            else:
                missing.append(run_dir_name(arm, seed))
    return found, missing


def paired_deltas(summaries: list, key: str, baseline: str = "attention") -> dict:
    """Per arm: mean ± std over seeds of (arm − baseline) of ``key``, paired by seed."""
    by_arm: dict = {}
    for s in summaries:
        by_arm.setdefault(s["arm"], {})[s["seed"]] = s
    base = by_arm.get(baseline, {})
    result = {}
    for arm, runs in by_arm.items():
        seeds = sorted(set(runs) & set(base))
        if arm == baseline or not seeds:
            continue
        deltas = [runs[seed][key] - base[seed][key] for seed in seeds if runs[seed].get(key) is not None]
        if deltas:
            result[arm] = {"mean": statistics.fmean(deltas), "std": statistics.stdev(deltas) if len(deltas) > 1 else None,
                           "per_seed": deltas, "seeds": seeds}
    return result


def aggregate(args, benchmark: str) -> bool:
    from .common.chiar_experiment import comparison_rows
    from .common.chiar_plots import plot_curves_against_time
    from .results import write_results

    summaries, missing = load_summaries(args, benchmark)
    if not summaries:
        print(f"{benchmark}: no complete run; nothing written")
        return False
    task = task_of(benchmark)
    curve_key = "eval_validation_curve_loss" if task.kind == "lm" else "eval_validation_curve_accuracy"
    rows = comparison_rows(summaries, task, curve_key)
    deltas = paired_deltas(summaries, task.primary)
    for row in rows:
        delta = deltas.get(row["arm"])
        row[f"Δ {task.primary} vs attention (paired)"] = "" if delta is None else (
            f"{delta['mean']:+.4f}" + (f" ± {delta['std']:.4f}" if delta["std"] is not None else ""))
        runs = [s for s in summaries if s["arm"] == row["arm"]]
        row["train s / run"] = f"{statistics.fmean(s['train_seconds'] for s in runs):.0f}"
        row["params"] = f"{runs[0]['parameters']:,}"
    first = summaries[0]
    preset = first["preset"]
    columns = [c for c in rows[0] if not c.endswith(("_mean", "_std", "_seconds", "_share")) and c not in (
        "attention_gflops_per_seq", "total_gflops_per_seq", "per_seed")]
    scale = (f"{preset['num_hidden_layers']} layers, d = {preset['hidden_size']}, {preset['num_attention_heads']} "
             f"heads, length {preset['context_length']}, batch {preset['batch_size']}, {preset['max_steps']} steps "
             f"({preset['warmup_steps']} warm-up, {preset['lr_scheduler_type']}), AdamW lr {preset['learning_rate']}, "
             f"weight decay {preset['weight_decay']}, dropout {preset['dropout']}; data: {json.dumps(first['data'].get('examples') or first['data'].get('tokens'))}")
    notes = (f"Scale: {scale}. {task.primary}: mean ± sample std over seeds; Δ paired by seed (same seed = same data "
             "order). s/step: median wall-clock seconds per optimiser step, measured in the run (shared 2-core CPU: "
             "noisy). attn share: tokens routed to attention in the routed layers (validation data). GFLOPs per "
             "sequence from the routing taken. 'val curve @ N s': validation curve at the training time of the run "
             "whose curve ends first (equal wall-clock); '@ last step': equal steps. Paper (SPEC 2.3): "
             f"{task.paper_metric}, at the authors' scale (not comparable in absolute terms)."
             + (f"\n\nMissing runs (not complete when this table was written): {', '.join(missing)}." if missing else ""))
    extra = {"run_hardware": first.get("hardware"), "paired_deltas": deltas, "missing_runs": missing,
             "run_commands": sorted({s.get("command", "") for s in summaries}),
             "runs": [{k: v for k, v in s.items() if k not in ("log_history", "hardware", "preset")} for s in summaries]}
    os.makedirs(args.results_dir, exist_ok=True)
    write_results(args.results_dir, benchmark, rows, title=f"CHIAR-Former reproduction, {task.title}, CPU scale",
                  config={"preset": args.preset, **preset, "runs": len(summaries), "arms": arms_of(args, benchmark)},
                  seeds=sorted({s["seed"] for s in summaries}), notes=notes, columns=columns, command=args.command,
                  extra=extra)
    plot_curves_against_time(summaries, curve_key, os.path.join(args.results_dir, f"{benchmark}_validation_curves.png"),
                             f"{task.title}: validation curve per arm against steps and training time (all seeds)")
    seed = min(s["seed"] for s in summaries)
    for arm in ("threshold", "hard", "3op"):
        for name in ("entropy_histograms.png", "routing_fractions.png", "routing_map.png"):
            source = os.path.join(args.output_dir, benchmark, run_dir_name(arm, seed), name)
            if os.path.isfile(source):
                shutil.copyfile(source, os.path.join(args.results_dir, f"{benchmark}_{arm}_{name}"))
    print(f"{benchmark}: results written to {args.results_dir}/{benchmark}.{{json,md}}"
          + (f" ({len(missing)} run(s) missing)" if missing else ""))
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog=recipe_prog("reproduce_chiar"), description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--benchmarks", nargs="+", choices=BENCHMARKS, default=list(BENCHMARKS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--wikitext_arms", nargs="+", default=list(WIKITEXT_ARMS))
    parser.add_argument("--listops_arms", nargs="+", default=list(CLASSIFICATION_ARMS))
    parser.add_argument("--imdb_arms", nargs="+", default=list(CLASSIFICATION_ARMS))
    parser.add_argument("--imdb_test_examples", type=non_negative_int, default=1000,
                        help="fixed random subset of the IMDB test split (default 1000; 0 = all 25,000)")
    parser.add_argument("--preset", default="cpu", help="recipe preset of every run (default: cpu)")
    parser.add_argument("--jobs", type=positive_int, default=1, help="recipe processes at once (default 1)")
    parser.add_argument("--threads", type=positive_int, default=2, help="torch threads per process (default 2)")
    parser.add_argument("--output_dir", default="runs/chiar_reproduction")
    parser.add_argument("--results_dir", default="results/chiar")
    parser.add_argument("--dry_run", action="store_true",
                        help="print the commands and exit; [finished]: every run folder holds a summary (the recipe "
                             "still reuses a run only if made with the command's settings)")
    parser.add_argument("--aggregate_only", action="store_true", help="only rebuild the tables from finished runs")
    parser.add_argument("recipe_args", nargs=argparse.REMAINDER,
                        help="after `--`: further options for every recipe run")
    args = parser.parse_args(argv)
    if args.recipe_args and args.recipe_args[0] == "--":
        args.recipe_args = args.recipe_args[1:]
    check_plan(args, parser)
    args.command = " ".join(["python -m training.reproduce_chiar"] + list(argv if argv is not None else sys.argv[1:]))
    plan = planned(args)
    if args.dry_run:
        for benchmark, seed in plan:
            state = "finished" if complete(args, benchmark, seed) else "pending"
            print(f"[{state}] {' '.join(recipe_command(args, benchmark, seed))}")
        return 0
    failed = []
    if not args.aggregate_only:
        signal.signal(signal.SIGTERM, stop_running)
        signal.signal(signal.SIGINT, stop_running)
        started = time.time()
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            outcomes = list(pool.map(lambda item: execute(args, *item), plan))
        failed = [(b, s, c) for b, s, c, _ in outcomes if c not in (0, None)]
        print(f"reproduction: {len(plan)} recipe runs in {(time.time() - started) / 60:.1f} min; "
              f"{len(failed)} failed {failed or ''}", flush=True)
    # A benchmark with a failed recipe run keeps its old table: its folder may still hold runs of other settings
    # (which the recipe refused to reuse), which the table would report under this command.
    written = [aggregate(args, benchmark) for benchmark in args.benchmarks
               if not any(failure[0] == benchmark for failure in failed)]
    return 0 if all(written) and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
