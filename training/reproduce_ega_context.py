"""Does EGA's gain grow with the context? BASE against EGA-1 (causal statistics) at several context lengths with the
same model, the same tokens per optimiser step and the same steps, on TinyShakespeare and PTB char, several seeds;
the validation loss per position in the window; and EGA-1 from several initial thresholds τ (results/ega_context/).
Each run is a run of run_clm with the configuration training/configs/<corpus>_cpu.json, its context changed.

    HF_SPECTRAL_DATA=/path/to/data python -m training.reproduce_ega_context --jobs 1 --threads 1   # results/ega_context/
    python -m training.reproduce_ega_context --dry_run            # every run's command, done / pending
    python -m training.reproduce_ega_context --aggregate_only     # the tables again, from the runs finished so far
    python -m training.reproduce_ega_context --smoke              # the whole pipeline at toy size, in a minute
    hf-spectral train reproduce_ega_context --help

Runs: for every context of --contexts (default 64 128 256 512) and corpus, BASE and EGA-1 (causal) with --seeds
(default 0 1 2): max_position_embeddings and the blocks are the context, the batch is --tokens_per_step (2048) divided
by it (32 x 64 = 16 x 128 = 8 x 256 = 4 x 512: context 128 is the cpu configuration, results/ega/), the counts of
blocks the configuration evaluates (the validation curve, the training blocks of the generalisation gap) scale the
same way, so that every context reads the same tokens; the whole validation split is scored at the end, with the loss
per bucket of --bucket_width (16) window positions (run_clm's --position_loss_buckets). Then EGA-1 from each τ of
--tau_inits (default -0.5 0 1) on --tau_corpus at --tau_context, --tau_steps long (--tau_warmup_steps warm-up).
The queue: seed 0 of every context and corpus, then the next seed, ..., then the τ runs, so that a stopped sweep has
the most informative runs. Each run is a folder of <output_dir>/<corpus>/context<T>/ (τ runs: <output_dir>/tau/);
finished runs are reused and interrupted ones resume, so the command can be rerun at any time. The tables are written
from the runs complete so far, labelled partial until all are. --add_to_results results/ega_context/context_sweep.json
goes on from the table of record on another machine: the runs it holds are read from it, not trained again.

Any other option is run_clm's and applies to every run (e.g. --max_steps: to the sweep; the τ runs keep --tau_steps
and --tau_warmup_steps).

--smoke: the smoke configuration, contexts 16 and 32, seed 0, two τ runs, one run at a time in this process, everything
(tables included) under runs/ega_context-smoke/, never in results/ega_context/.
"""

from __future__ import annotations

import copy
import os
import sys
from types import SimpleNamespace

from . import ptb_char, tinyshakespeare
from .common import ega
from .common.cli import UsageError, positive_int, program_name, run_main
from .common.experiments import add_size_arguments, config, driver_parser, execute, merge_overrides, parse

BENCHMARKS = {"tinyshakespeare": tinyshakespeare, "ptb_char": ptb_char}
ARMS = (("BASE", "none"), ("EGA-1", "causal"))
# The configuration's counts of blocks, scaled by (its block size / the context): the same tokens at every context
BLOCK_COUNTS = ("eval_samples_during_training", "train_eval_samples", "max_eval_samples", "max_train_samples")
DEFAULTS = {
    "cpu": {"contexts": [64, 128, 256, 512], "seeds": [0, 1, 2], "tokens_per_step": 2048, "bucket_width": 16,
            "tau_inits": [-0.5, 0.0, 1.0], "tau_context": 128, "tau_steps": 2000, "tau_warmup_steps": 160},
    "smoke": {"contexts": [16, 32], "seeds": [0], "tokens_per_step": 128, "bucket_width": 8,
              "tau_inits": [-0.5, 1.0], "tau_context": 16, "tau_steps": 8, "tau_warmup_steps": 2},
}


def main(argv=None) -> int:
    prog = program_name("reproduce_ega_context")
    return run_main(lambda arguments: run(arguments, prog), argv, prog)


def finite_float(text: str) -> float:
    import argparse
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be finite, got {text}")
    return value


def options(argv, prog: str) -> tuple:
    """The command line: (args with every default of the preset filled in, the run_clm options for every run, the
    preset, the output folder, the results folder)."""
    parser = driver_parser(prog, __doc__)
    parser.add_argument("--benchmarks", nargs="+", choices=list(BENCHMARKS), default=list(BENCHMARKS))
    parser.add_argument("--preset", choices=list(DEFAULTS), default="cpu",
                        help="the configurations training/configs/<corpus>_<preset>.json (default: %(default)s)")
    parser.add_argument("--smoke", action="store_true", help="the smoke preset: a tiny model, a few steps")
    parser.add_argument("--contexts", type=positive_int, nargs="+", help="context lengths (default 64 128 256 512)")
    parser.add_argument("--tokens_per_step", type=positive_int,
                        help="tokens per optimiser step at every context: the batch is this / the context (default "
                             "2048; every context must divide it)")
    parser.add_argument("--bucket_width", type=positive_int,
                        help="window positions per bucket of the per-position loss (default 16; every context must "
                             "be a multiple of it)")
    parser.add_argument("--tau_inits", type=finite_float, nargs="*",
                        help="initial τ of the EGA-1 runs of the τ study (default -0.5 0 1; none: no τ runs)")
    parser.add_argument("--tau_corpus", choices=list(BENCHMARKS), default="tinyshakespeare",
                        help="corpus of the τ runs (default: %(default)s)")
    parser.add_argument("--tau_context", type=positive_int, help="context of the τ runs (default 128)")
    parser.add_argument("--tau_steps", type=positive_int, help="steps of the τ runs (default 2000)")
    parser.add_argument("--tau_warmup_steps", type=int, help="warm-up steps of the τ runs (default 160)")
    parser.add_argument("--tau_seed", type=int, default=0, help="seed of the τ runs (default: %(default)s)")
    parser.add_argument("--results_dir",
                        help="where the tables go (default results/ega_context; smoke: <output_dir>/results)")
    parser.add_argument("--add_to_results", metavar="JSON",
                        help="a context_sweep.json this driver wrote (results/ega_context/context_sweep.json): the "
                             "sweep's runs it holds and --output_dir does not are read from it, not trained (they "
                             "must have been made with the arguments planned here)")
    parser.add_argument("--aggregate_only", action="store_true",
                        help="only write the tables, from the runs complete so far")
    add_size_arguments(parser)
    parser.set_defaults(jobs=None, threads=None)
    args, tokens = parse(parser, argv)
    if args.context_length is not None or args.batch_size is not None:
        raise UsageError("the contexts and batches are set by --contexts and --tokens_per_step, not --context_length "
                         "/ --batch_size")
    preset = "smoke" if args.smoke else args.preset
    defaults = DEFAULTS[preset]
    for name in ("contexts", "seeds", "tokens_per_step", "bucket_width", "tau_inits", "tau_context", "tau_steps",
                 "tau_warmup_steps"):
        if getattr(args, name) is None:
            setattr(args, name, defaults[name])
    if args.tau_warmup_steps < 0:
        raise UsageError(f"--tau_warmup_steps must be 0 or more, got {args.tau_warmup_steps}")
    args.jobs = args.jobs or 1
    args.threads = args.threads or (None if preset == "smoke" else 1)
    output_dir = args.output_dir or ("runs/ega_context-smoke" if preset == "smoke" else "runs/ega_context")
    results_dir = args.results_dir or (os.path.join(output_dir, "results") if preset == "smoke"
                                       else "results/ega_context")
    return args, tokens, preset, output_dir, results_dir


def run(argv, prog: str) -> int:
    args, tokens, preset, output_dir, results_dir = options(argv, prog)
    sweep, taus, order = plan(args, tokens, preset, output_dir)
    if args.add_to_results:  # the runs of a sweep spread over several sittings: those its record holds are not rerun
        from .common import ega_context

        recorded = ega_context.recorded_sweep_runs(args.add_to_results, sweep)
        sweep.update(recorded)
        names = {one.name for one in recorded.values()}
        order = [one for one in order if one.name not in names]
        for name in sorted(names):
            print(f"recorded {name}: read from {args.add_to_results}")
    if not (args.dry_run or args.aggregate_only):
        for benchmark in dict.fromkeys(args.benchmarks + ([args.tau_corpus] if taus else [])):
            files = BENCHMARKS[benchmark].data_files(args.data_dir)
            BENCHMARKS[benchmark].prepare_data(SimpleNamespace(data_path=None, no_download=False), files)
        if args.prepare_data:
            return 0
    if args.dry_run:
        execute(args, order, os.path.join(output_dir, "logs"))
        return 0
    trained = True
    if not args.aggregate_only:
        trained = execute(args, order, os.path.join(output_dir, "logs"))
    from .common import ega_context

    written = ega_context.write_report(sweep, taus, results_dir, preset, args.tau_corpus)
    return 0 if trained and written else 1


def context_settings(benchmark: str, preset: str, context: int, tokens_per_step: int, bucket_width: int,
                     args) -> dict:
    """The run_clm options of one context that the size options do not set: the configuration's counts of blocks
    scaled to the same tokens, the per-position loss buckets."""
    base = config(f"{benchmark}_{preset}")
    if tokens_per_step % context:
        raise UsageError(f"--tokens_per_step {tokens_per_step} is not a multiple of the context {context}")
    if context % bucket_width:
        raise UsageError(f"the context {context} is not a multiple of --bucket_width {bucket_width}")
    # char_eos_and_pad off: the sweep's first runs were made before run_clm's char tokenizer had eos and pad tokens,
    # and every run of one table has the same vocabulary (the two ids would change each model's initialisation)
    settings = {"position_loss_buckets": context // bucket_width, "char_eos_and_pad": False}
    for key in BLOCK_COUNTS:
        if base.get(key) and not (key == "eval_samples_during_training" and args.eval_batches is not None):
            settings[key] = max(1, base[key] * base["block_size"] // context)
    if settings["position_loss_buckets"] > context - 1:  # width 1: one bucket more than the predictions
        raise UsageError(f"--bucket_width {bucket_width} leaves an empty bucket at context {context}")
    return settings


def sized(args, context: int, tokens_per_step: int):
    """``args`` with the context and the batch of one context, for `ega.make_runs`."""
    one = copy.copy(args)
    one.context_length, one.batch_size = context, tokens_per_step // context
    return one


def plan(args, tokens: list, preset: str, output_dir: str) -> tuple:
    """The runs: {(corpus, context, variant, statistics, seed): Run} of the sweep, {τ init: Run} of the τ study, and
    the order they train in (seed by seed, then the τ runs)."""
    sweep, taus, order = {}, {}, []
    for seed in args.seeds:
        for benchmark in args.benchmarks:
            files = BENCHMARKS[benchmark].data_files(args.data_dir)
            for context in args.contexts:
                settings = context_settings(benchmark, preset, context, args.tokens_per_step, args.bucket_width, args)
                made = ega.make_runs(benchmark, preset, list(ARMS), [seed],
                                     os.path.join(output_dir, benchmark, f"context{context}"), files,
                                     sized(args, context, args.tokens_per_step), tokens, settings)
                for (variant, normalization, _), one in made.items():
                    one.name = f"{benchmark}-context{context}-{one.name}"
                    sweep[benchmark, context, variant, normalization, seed] = one
                    order.append(one)
    files = BENCHMARKS[args.tau_corpus].data_files(args.data_dir)
    for init in args.tau_inits:
        settings = context_settings(args.tau_corpus, preset, args.tau_context, args.tokens_per_step,
                                    args.bucket_width, args)
        made = ega.make_runs(args.tau_corpus, preset, [("EGA-1", "causal")], [args.tau_seed],
                             os.path.join(output_dir, "tau", f"tau{init:+g}"), files,
                             sized(args, args.tau_context, args.tokens_per_step), tokens, settings)
        (one,) = made.values()
        one.name = f"tau{init:+g}-{args.tau_corpus}-context{args.tau_context}-{one.name}"
        one.arguments.update(max_steps=args.tau_steps, warmup_steps=args.tau_warmup_steps)
        one.arguments["config_overrides"] = merge_overrides(one.arguments["config_overrides"], {"gate_tau_init": init})
        taus[init] = one
        order.append(one)
    return sweep, taus, order


if __name__ == "__main__":
    sys.exit(main())
