"""The CHIAR-Former reproduction at CPU scale: every arm on WikiText-2, ListOps and IMDB, several seeds, one table per
benchmark beside the paper's numbers (SPEC 2.3; results/chiar/), each run a run of run_clm or run_classification with
the configuration training/configs/<benchmark>_<preset>.json.

    HF_SPECTRAL_DATA=/path/to/data python -m training.reproduce_chiar --jobs 2 --threads 1   # results/chiar/
    python -m training.reproduce_chiar --dry_run                      # every run's command, done / pending
    python -m training.reproduce_chiar --aggregate_only               # the tables again, from the finished runs
    python -m training.reproduce_chiar --smoke                        # the whole pipeline at toy size
    python -m training.reproduce_chiar --benchmarks wikitext --wikitext_arms attention threshold hard dct \\
        --max_steps 400 --warmup_steps 40 --eval_steps 50 --eval_batches 4 --output_dir runs/chiar_long \\
        --results_dir results/chiar/long_400_steps                    # results/chiar/long_400_steps/
        # (and --layer_norm_position pre: long_400_steps_preln/, --learning_rate 1e-3: long_400_steps_lr1e-3/)

Arms: WikiText-2 (--wikitext_arms): the all-attention baseline, CHIAR DCT+Attn with the threshold and the hard router
and the 3-operator variant, each in the authors' layout (DCT / routed / routed / attention) and with every layer routed
(@all), and the control with DCT mixing in every layer (dct: no token mixing at all); ListOps and IMDB (--listops_arms,
--imdb_arms): the authors' layout only. Every arm with --seeds (default 0 1 2). Each run is a folder of
<output_dir>/<benchmark>/; --jobs of them train at once, each logging to <output_dir>/logs/. Finished runs are reused
and interrupted ones resume, so the command can be rerun at any time; a benchmark's table is written once all its
runs are complete. Data: as each benchmark finds it ($HF_SPECTRAL_DATA, ...); ListOps is generated.

--smoke: the smoke preset, seed 0, two arms per benchmark, one run at a time in this process, everything (tables
included) under runs/chiar_reproduction-smoke/.
"""

from __future__ import annotations

import os
import sys

from . import imdb, listops, wikitext
from .common import chiar
from .common.cli import ArgumentParser, non_negative_int, program_name, run_main
from .common.experiments import add_size_arguments, driver_parser, parse, train_and_report

BENCHMARKS = {"wikitext": wikitext, "listops": listops, "imdb": imdb}
WIKITEXT_ARMS = ("attention", "threshold", "hard", "3op", "threshold@all", "hard@all", "3op@all", "dct")
CLASSIFICATION_ARMS = ("attention", "threshold", "hard", "3op")


def main(argv=None) -> int:
    prog = program_name("reproduce_chiar")
    return run_main(lambda arguments: run(arguments, prog), argv, prog)


def run(argv, prog: str) -> int:
    parser = driver_parser(prog, __doc__)
    parser.add_argument("--benchmarks", nargs="+", choices=list(BENCHMARKS), default=list(BENCHMARKS))
    parser.add_argument("--preset", choices=("cpu", "authors", "smoke"), default="cpu")
    parser.add_argument("--smoke", action="store_true", help="the smoke preset, seed 0, two arms per benchmark")
    for benchmark, arms in (("wikitext", WIKITEXT_ARMS), ("listops", CLASSIFICATION_ARMS),
                            ("imdb", CLASSIFICATION_ARMS)):
        parser.add_argument(f"--{benchmark}_arms", nargs="+", help=f"default: {' '.join(arms)} (smoke: the first two)")
    parser.add_argument("--imdb_test_examples", type=non_negative_int, default=1000,
                        help="fixed random subset of the IMDB test split (default 1000; 0: all 25,000)")
    parser.add_argument("--results_dir",
                        help="where the tables go (default results/chiar; smoke: <output_dir>/results)")
    parser.add_argument("--aggregate_only", action="store_true", help="only write the tables from the finished runs")
    add_size_arguments(parser)
    chiar.add_model_arguments(parser)
    parser.set_defaults(threads=None)
    args, tokens = parse(parser, argv)
    smoke = args.smoke or args.preset == "smoke"
    args.preset = "smoke" if smoke else args.preset
    seeds = args.seeds or ([0] if smoke else [0, 1, 2])
    args.threads = args.threads or (None if smoke else 2)
    output_dir = args.output_dir or ("runs/chiar_reproduction-smoke" if smoke else "runs/chiar_reproduction")
    results_dir = args.results_dir or (os.path.join(output_dir, "results") if smoke else "results/chiar")

    runs, order, data = {}, [], {}
    for benchmark in args.benchmarks:
        module = BENCHMARKS[benchmark]
        # The benchmark's own data options, at their defaults
        data_parser = ArgumentParser()
        module.add_data_arguments(data_parser)
        data[benchmark] = data_parser.parse_args([])
        data[benchmark].__dict__.update(preset=args.preset, data_dir=args.data_dir, context_length=args.context_length,
                                        max_test_examples=args.imdb_test_examples or None)
        default = WIKITEXT_ARMS if benchmark == "wikitext" else CLASSIFICATION_ARMS
        arms = getattr(args, f"{benchmark}_arms") or (default[:2] if smoke else default)
        runs[benchmark] = chiar.make_runs(benchmark, args.preset, arms, seeds, os.path.join(output_dir, benchmark),
                                          module.data_files(data[benchmark]), args, tokens)
        for one in runs[benchmark].values():
            one.name = f"{benchmark}-{one.name}"
    for seed in seeds:  # seed by seed: a stopped reproduction has whole seeds
        order += [one for made in runs.values() for (_, run_seed), one in made.items() if run_seed == seed]
    if not (args.dry_run or args.aggregate_only):
        for benchmark in args.benchmarks:
            BENCHMARKS[benchmark].prepare_data(data[benchmark], BENCHMARKS[benchmark].data_files(data[benchmark]))
        if args.prepare_data:
            return 0

    def write_table(benchmark: str, made: dict) -> None:
        chiar.write_report(benchmark, made, results_dir, benchmark,
                           f"CHIAR-Former reproduction, {chiar.TASKS[benchmark][0]}, {args.preset} preset")
        print(f"{benchmark}: {results_dir}/{benchmark}.{{json,md}}")

    return train_and_report(args, order, runs, output_dir, write_table)


if __name__ == "__main__":
    sys.exit(main())
