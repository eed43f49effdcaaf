"""The EGA reproduction at CPU scale: every variant on TinyShakespeare and PTB char, several seeds, one table per
corpus (results/ega/), each run a run of run_clm with the configuration training/configs/<corpus>_<preset>.json.

    HF_SPECTRAL_DATA=/path/to/data python -m training.reproduce_ega --jobs 2 --threads 1    # results/ega/
    python -m training.reproduce_ega --dry_run                   # every run's command, done / pending
    python -m training.reproduce_ega --aggregate_only            # the tables again, from the finished runs
    python -m training.reproduce_ega --smoke                     # the whole pipeline at toy size, in minutes
    python -m training.reproduce_ega --benchmarks ptb_char --add_to_results results/ega/ptb_char.json \
        --output_dir runs/ega_ptb_variants            # the variants trained, the record's main runs read from it
    python -m training.reproduce_ega --benchmarks tinyshakespeare --other_seeds --max_steps 2000 \\
        --warmup_steps 160 --output_dir runs/ega_long --results_dir results/ega_long      # results/ega_long/
    hf-spectral train reproduce_ega --help

Runs: BASE, EGA-1 (causal) and EGA-1 (window) with --main_seeds (default 0 1 2); EGA-2, EGA-4, EGA-C, EGA-M-F,
EGA-M, EGA-DB2 and EGA-DB4 (causal) with --other_seeds (default 0; --other_seeds alone: none), the main seeds first.
Each run is a folder of <output_dir>/<corpus>/; --jobs of them train at once, each logging to <output_dir>/logs/.
Finished runs are reused and interrupted ones resume from their last checkpoint, so the command can be rerun at any
time; a corpus's table is written once all its runs are complete. The corpora are found as the benchmarks find them
($TINYSHAKESPEARE_PATH, $PTB_PATH, $HF_SPECTRAL_DATA, the download cache or a download).

--add_to_results results/ega/<corpus>.json (with that corpus alone): the runs that table holds and --output_dir does
not are read from it instead of trained, and the new table holds both: e.g. the variants added to a main comparison
trained on another machine, whose run folders are not here (the record's arguments must be this command's).

--smoke: the smoke preset, seed 0, BASE and EGA-1 (causal and window), one run at a time in this process,
everything (tables included) under runs/ega_reproduction-smoke/, never in results/ega/.
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

from . import ptb_char, tinyshakespeare
from .common import ega
from .common.cli import UsageError, program_name, run_main
from .common.experiments import driver_parser, parse, train_and_report

BENCHMARKS = {"tinyshakespeare": tinyshakespeare, "ptb_char": ptb_char}
MAIN_VARIANTS = ("BASE", "EGA-1:causal", "EGA-1:window")
OTHER_VARIANTS = ("EGA-2", "EGA-4", "EGA-C", "EGA-M-F", "EGA-M", "EGA-DB2", "EGA-DB4")


def main(argv=None) -> int:
    prog = program_name("reproduce_ega")
    return run_main(lambda arguments: run(arguments, prog), argv, prog)


def run(argv, prog: str) -> int:
    parser = driver_parser(prog, __doc__)
    parser.add_argument("--benchmarks", nargs="+", choices=list(BENCHMARKS), default=list(BENCHMARKS))
    parser.add_argument("--main_seeds", type=int, nargs="+", help="seeds of BASE and EGA-1 (default 0 1 2; smoke 0)")
    parser.add_argument("--other_seeds", type=int, nargs="*",
                        help="seeds of the other variants (default 0; smoke and --other_seeds alone: none)")
    parser.add_argument("--results_dir", help="where the tables go (default results/ega; smoke: <output_dir>/results)")
    parser.add_argument("--aggregate_only", action="store_true", help="only write the tables from the finished runs")
    parser.add_argument("--add_to_results", metavar="JSON",
                        help="a table of record of one corpus (<corpus>.json as this command writes it): its runs "
                             "that are not complete in --output_dir are read from it, not trained, and the table "
                             "written holds them beside the runs trained here (new variants beside a main comparison "
                             "whose run folders are on another machine); it must come from the same arguments")
    ega.add_arguments(parser, ("cpu", "authors", "smoke"), "cpu")
    parser.set_defaults(jobs=None, threads=None)
    args, tokens = parse(parser, argv)
    if args.variants or args.seeds:
        raise UsageError("the reproduction's runs are set by --main_seeds and --other_seeds, not --variants / --seeds")
    if args.add_to_results and len(args.benchmarks) != 1:
        raise UsageError("--add_to_results is the table of one corpus: give that corpus alone with --benchmarks")
    smoke = args.smoke or args.preset == "smoke"
    preset = "smoke" if smoke else args.preset
    main_seeds = args.main_seeds or [0] if smoke else args.main_seeds or [0, 1, 2]
    other_seeds = ([] if smoke else [0]) if args.other_seeds is None else args.other_seeds
    args.jobs = args.jobs or (1 if smoke else 2)
    args.threads = args.threads or (None if smoke else 1)
    output_dir = args.output_dir or ("runs/ega_reproduction-smoke" if smoke else "runs/ega_reproduction")
    results_dir = args.results_dir or (os.path.join(output_dir, "results") if smoke else "results/ega")

    runs = {benchmark: {} for benchmark in args.benchmarks}  # (variant, statistics, seed) -> Run, per corpus
    order = []  # the main comparison first: a stopped reproduction has it complete
    for variants, seeds in ((MAIN_VARIANTS, main_seeds), (OTHER_VARIANTS, other_seeds)):
        for seed in seeds:
            for benchmark, module in BENCHMARKS.items():
                if benchmark in args.benchmarks:
                    made = ega.make_runs(benchmark, preset, [ega.parse_variant(text, "causal") for text in variants],
                                         [seed], os.path.join(output_dir, benchmark),
                                         module.data_files(args.data_dir), args, tokens)
                    for key, one in made.items():
                        one.name = f"{benchmark}-{one.name}"
                    runs[benchmark].update(made)
                    order += made.values()
    if args.add_to_results:  # the runs the record holds join the table instead of being trained
        (benchmark,) = args.benchmarks
        recorded = ega.recorded_runs(args.add_to_results, runs[benchmark])
        runs[benchmark].update(recorded)
        names = {one.name for one in recorded.values()}
        order = [one for one in order if one.name not in names]
        for one in recorded.values():
            print(f"recorded {one.name}: read from {args.add_to_results}")
    if not (args.dry_run or args.aggregate_only):
        for benchmark in args.benchmarks:
            files = BENCHMARKS[benchmark].data_files(args.data_dir)
            BENCHMARKS[benchmark].prepare_data(SimpleNamespace(data_path=None, no_download=False), files)
        if args.prepare_data:
            return 0

    def write_table(benchmark: str, made: dict) -> None:
        ega.write_report(benchmark, made, results_dir, benchmark,
                         f"EGA reproduction, {ega.TITLES[benchmark]}, {preset} preset")
        print(f"{benchmark}: {results_dir}/{benchmark}.{{json,md}}")

    return train_and_report(args, order, runs, output_dir, write_table)


if __name__ == "__main__":
    sys.exit(main())
