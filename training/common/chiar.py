"""CHIAR-Former benchmarks: each arm (the all-attention baseline, CHIAR with a threshold / hard / soft router between
DCT mixing and attention, the 3-operator variant with RBF mixing, DCT mixing alone) against the others, one run of
run_clm (WikiText) or run_classification (IMDB, ListOps) per arm and seed from ``training/configs/<benchmark>_<preset>
.json``, and the comparison of the runs (SPEC 2.3). What the ``wikitext``, ``imdb`` and ``listops`` entry points and
``reproduce_chiar`` share.

The comparison reads what each run wrote: the task's numbers (perplexity per token and per word, accuracy, per
nesting depth), the routing fractions, FLOPs and training seconds logged while training (the last entry: on the
first training batches, in evaluation mode, at the end), the validation curve against steps and seconds, and, for
the figures, the saved model on validation data.
"""

from __future__ import annotations

import json
import math
import os
import statistics

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
    override_items,
    paired_delta,
    parse,
    pm,
    prepare_and_train,
    read_run,
    script_options,
    table_without_provenance,
)

ARMS = {
    "attention": "every layer full attention (the same-size baseline)",
    "threshold": "CHIAR DCT+Attn, threshold router (calibrated τ_mid)",
    "hard": "CHIAR DCT+Attn, hard router (Linear([x, H]), straight-through)",
    "soft": "CHIAR DCT+Attn, soft router (softmax blend, no compute saving)",
    "3op": "CHIAR DCT / RBF / Attn, threshold router (calibrated τ_lo / τ_hi)",
    "3op-hard": "CHIAR DCT / RBF / Attn, hard router",
    "dct": "every layer DCT mixing (mixes nothing across tokens: the control)",
}
TASKS = {  # title, script, the headline number, the paper's numbers (SPEC 2.3) and what they are
    "wikitext": ("WikiText-2", "run_clm", "test_perplexity_per_word",
                 {"attention": "75.19", "hard": "83.81 (DCT+Attn)"},
                 "WikiText-2 test perplexity per GPT-2 BPE token, 10 epochs"),
    "imdb": ("IMDB", "run_classification", "test_accuracy", {"attention": "84.96%", "hard": "83.72% (DCT+Attn)"},
             "IMDB test accuracy, GPT-2 BPE truncated to 256 tokens"),
    "listops": ("ListOps", "run_classification", "test_accuracy",
                {"attention": "98.85%", "hard": "63.35% (DCT+Attn; a flat one-operator toy, not this task)"},
                "the authors' 'ListOps' accuracy (a flat one-operator toy task, not ListOps)"),
}


def add_arguments(parser, default_arms: tuple) -> None:
    parser.add_argument("--preset", choices=("cpu", "authors", "smoke"), default="cpu",
                        help="the configuration training/configs/<benchmark>_<preset>.json (default: cpu)")
    parser.add_argument("--smoke", action="store_true", help="the smoke preset: a tiny model, a few steps")
    parser.add_argument("--arms", nargs="+", metavar="ARM[@all]", default=list(default_arms),
                        help="; ".join(f"{arm}: {text}" for arm, text in ARMS.items()) + ". ARM@all routes every "
                             f"layer instead of the authors' layout (DCT, routed ..., attention). Default: "
                             f"{' '.join(default_arms)}")
    add_size_arguments(parser)
    add_model_arguments(parser)


def add_model_arguments(parser) -> None:
    parser.add_argument("--layer_norm_position", choices=("post", "pre"),
                        help="post-LN (the configurations', as the authors) or pre-LN")


def arm_overrides(arm: str, num_layers: int) -> dict:
    """The config fields that make ``arm`` (``ARM`` or ``ARM@all``) of a model with ``num_layers`` layers."""
    family, _, layout = arm.partition("@")
    if family not in ARMS or layout not in ("", "all") or (layout and family in ("attention", "dct")):
        raise UsageError(f"unknown arm {arm!r}: choose from {', '.join(ARMS)}, a routed one optionally with @all")
    if family in ("attention", "dct"):
        return {"layer_operators": [family] * num_layers}
    layers = (["routed"] * num_layers if layout or num_layers == 1
              else ["dct"] + ["routed"] * (num_layers - 2) + ["attention"])
    if "routed" not in layers:
        raise UsageError(f"{arm} needs a routed layer: the authors' layout of {num_layers} layers has none (DCT first, "
                         f"attention last); use 3 layers or more, or {family}@all")
    return {"layer_operators": layers, "router_type": "hard" if family.endswith("hard") else
            "soft" if family == "soft" else "threshold",
            "routed_operators": ["dct", "rbf", "attention"] if family.startswith("3op") else ["dct", "attention"]}


def run_name(arm: str, seed: int) -> str:
    family, _, layout = arm.partition("@")
    return family + (f"-{layout}-routed" if layout else "") + f"-seed{seed}"


def make_runs(benchmark: str, preset: str, arms: list, seeds: list, output_dir: str, files: dict, args,
              tokens: list) -> dict:
    """{(arm, seed): run}: the preset's configuration, the data ``files``, the size options of ``args`` and the
    script options among ``tokens``."""
    script = TASKS[benchmark][1]
    length = "block_size" if script == "run_clm" else "max_seq_length"
    base = apply_sizes({**config(f"{benchmark.replace('wikitext', 'wikitext2')}_{preset}"), **files}, args,
                       ("hidden_dropout",), length)
    options = script_options(script, tokens)
    if args.layer_norm_position:
        base["config_overrides"] = merge_overrides(base["config_overrides"],
                                                   {"layer_norm_position": args.layer_norm_position})
    layers = int(override_items(base["config_overrides"])["num_hidden_layers"])
    runs = {}
    for arm in dict.fromkeys(arms):
        overrides = merge_overrides(base["config_overrides"], arm_overrides(arm, layers))
        for seed in seeds:
            name = run_name(arm, seed)
            runs[arm, seed] = Run(name, script, {**base, "config_overrides": overrides, "seed": seed, **options,
                                                 "output_dir": os.path.join(output_dir, name)})
    return runs


# ----------------------------------------------------------------------------------------------------------------
# The comparison
# ----------------------------------------------------------------------------------------------------------------


def summary(benchmark: str, run: Run, arm: str, seed: int) -> dict:
    """What the table reports of one finished run, from the files it wrote (a language model's perplexity per word
    from the tokens and words of each split, ``words.json`` beside the tokenizer)."""
    result = read_run(run.folder)
    history = result["log_history"]
    logged = [entry for entry in history if "train_seconds" in entry]
    last = logged[-1] if logged else {}
    timed = [(entry["step"], entry["train_seconds"]) for entry in logged]
    # seconds per optimiser step between log entries, the first interval (start-up) left out
    rates = [(t1 - t0) / (s1 - s0) for (s0, t0), (s1, t1) in zip(timed[1:], timed[2:]) if s1 > s0]
    fractions = {key: value for key, value in last.items() if key.startswith("routing/")}
    attention = [value for key, value in fractions.items() if key.endswith("/attention")]
    found = {
        "run": run.name, "arm": arm, "family": arm.partition("@")[0], "layout": arm.partition("@")[2] or "authors",
        "seed": seed, "parameters": count_parameters(run.folder),
        "seconds_per_step": statistics.median(rates) if rates else None, "train_seconds": last.get("train_seconds"),
        "train_runtime": result.get("train_runtime"), "routing": {
            "fractions": fractions, "attention_fraction_routed_layers": statistics.fmean(attention) if attention
            else None, "attention_gflops_per_seq": last.get("attention_gflops_per_seq"),
            "total_gflops_per_seq": last.get("total_gflops_per_seq")},
        "log_history": history,
    }
    with open(os.path.join(run.folder, "config.json"), encoding="utf-8") as handle:
        model_config = json.load(handle)
    if model_config.get("router_type") == "threshold" and "routed" in model_config["layer_operators"]:
        found["thresholds"] = {key: model_config[key] for key in ("tau_mid", "tau_lo", "tau_hi", "layer_thresholds")}
    if TASKS[benchmark][1] == "run_clm":
        with open(os.path.join(run.arguments["tokenizer_name"], "words.json"), encoding="utf-8") as handle:
            words = json.load(handle)
        for split, prefix in (("validation", "eval_"), ("test", "test_")):
            loss = result.get(f"{prefix}loss")
            if loss is not None:
                tokens_per_word = (words[split]["tokens"] - 1) / words[split]["words"]
                found.update({f"{split}_loss": loss, f"{split}_perplexity": math.exp(loss),
                              f"{split}_perplexity_per_word": math.exp(loss * tokens_per_word)})
    else:
        for split, prefix in (("validation", "eval_"), ("test", "test_")):
            found[f"{split}_accuracy"] = result.get(f"{prefix}accuracy")
            depths = {key.rpartition("_")[2]: value for key, value in result.items()
                      if key.startswith(f"{prefix}accuracy_depth_")}
            if depths:
                found[f"{split}_accuracy_per_depth"] = dict(sorted(depths.items(), key=lambda item: int(item[0])))
    return found


def curve_at(history: list, key: str, seconds: float):
    """The validation curve ``key`` at ``seconds`` of training (linear between its points), None past its end."""
    import numpy as np

    from .plots import points, seconds_at

    curve = [(seconds_at(history, step), value) for step, value in points(history, key)]
    if not curve or curve[0][0] is None or seconds > curve[-1][0]:
        return None
    return float(np.interp(seconds, *zip(*curve)))


def comparison_rows(benchmark: str, summaries: list, curve_key: str) -> list:
    """One row per arm: the headline number (mean ± std over seeds), seconds per step, routing, FLOPs against the
    all-attention arm, the validation curve at equal training time (when the run whose curve ends first ended) and at
    the last step, the paper's number, and the other numbers of the task."""
    _, script, primary, paper, _ = TASKS[benchmark]
    groups = {}
    for found in summaries:
        groups.setdefault(found["arm"], []).append(found)
    budget = min(found["train_seconds"] or 0.0 for found in summaries)
    base = {key: mean_std([found["routing"][key] for found in groups.get("attention", [])])[0]
            for key in ("attention_gflops_per_seq", "total_gflops_per_seq")}
    digits = 2 if script == "run_clm" else 4
    rows = []
    for arm, runs in groups.items():
        flops = {key: mean_std([found["routing"][key] for found in runs])[0] for key in base}
        share = mean_std([found["routing"]["attention_fraction_routed_layers"] for found in runs])[0]
        headline = mean_std([found.get(primary) for found in runs])
        step = mean_std([found["seconds_per_step"] for found in runs])
        at_time = mean_std([curve_at(found["log_history"], curve_key, budget) for found in runs])
        last = mean_std([([value for entry in found["log_history"] for key, value in entry.items() if key == curve_key]
                          or [None])[-1] for found in runs])

        def change(key):
            if not base[key] or flops[key] is None or arm == "attention":
                return ""
            return f"{flops[key] / base[key] - 1:+.1%}"

        row = {"arm": arm, "seeds": len(runs), primary: pm(*headline, digits), "s/step": pm(*step, 3),
               "attn share (routed layers)": "" if share is None else f"{share:.1%}",
               "attn GFLOPs/seq": "" if flops["attention_gflops_per_seq"] is None
               else f"{flops['attention_gflops_per_seq']:.4f}",
               "Δ attn FLOPs": change("attention_gflops_per_seq"), "Δ total FLOPs": change("total_gflops_per_seq"),
               f"val curve @ {budget:.0f} s": pm(*at_time), "val curve @ last step": pm(*last),
               "paper": paper.get(arm, "")}
        for other in ("validation_perplexity", "test_perplexity", "validation_perplexity_per_word",
                      "validation_accuracy", "test_accuracy"):
            if other != primary and any(found.get(other) is not None for found in runs):
                row[other] = pm(*mean_std([found.get(other) for found in runs]), digits)
        row.update({"primary_mean": headline[0], "primary_std": headline[1], "seconds_per_step_mean": step[0],
                    "attention_gflops_per_seq": flops["attention_gflops_per_seq"],
                    "total_gflops_per_seq": flops["total_gflops_per_seq"], "curve_at_equal_time_mean": at_time[0],
                    "curve_at_equal_time_std": at_time[1], "curve_final_mean": last[0],
                    "equal_time_budget_seconds": budget, "attention_share": share,
                    "per_seed": {str(found["seed"]): found.get(primary) for found in runs}})
        rows.append(row)
    return rows


def validation_batches(run: Run, count: int) -> list:
    """The first ``count`` validation batches of a run, as its script cuts them, tokenized with its tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(run.folder)
    arguments, size = run.arguments, run.arguments["per_device_eval_batch_size"]
    if run.script == "run_clm":
        import torch

        with open(arguments["validation_file"], encoding="utf-8") as handle:
            ids = tokenizer(handle.read())["input_ids"]
        block = arguments["block_size"]
        blocks = torch.tensor(ids[:min(len(ids) // block, count * size) * block]).view(-1, block)
        return [{"input_ids": blocks[start:start + size]} for start in range(0, len(blocks), size)]
    with open(arguments["validation_file"], encoding="utf-8") as handle:
        texts = [json.loads(line)["text"] for _, line in zip(range(count * size), handle)]
    return [dict(tokenizer(texts[start:start + size], truncation=True, max_length=arguments["max_seq_length"],
                           padding=True, return_tensors="pt")) for start in range(0, len(texts), size)]


def write_figures(benchmark: str, run: Run, arm: str, directory: str) -> None:
    """Entropy histograms, routing fractions over training and the routing map of a sample, of one routed run."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from .plots import plot_entropy_histograms, plot_routing_map, plot_routing_over_training

    title = f"{TASKS[benchmark][0]}, {arm}"
    auto = AutoModelForCausalLM if run.script == "run_clm" else AutoModelForSequenceClassification
    model = auto.from_pretrained(run.folder)
    batches = validation_batches(run, 4)
    prefix = os.path.join(directory, f"{benchmark}_{arm}_")
    plot_entropy_histograms(model, batches, prefix + "entropy_histograms.png",
                            f"{title}: spectral entropy per routed layer (validation tokens)")
    plot_routing_over_training(read_run(run.folder)["log_history"], model.config.routed_operators,
                               prefix + "routing_fractions.png", f"{title}: tokens per operator during training")
    sample = batches[0]["input_ids"][0]
    if "attention_mask" in batches[0]:
        sample = sample[batches[0]["attention_mask"][0].bool()]
    plot_routing_map(model, sample[:64], AutoTokenizer.from_pretrained(run.folder), prefix + "routing_map.png",
                     f"{title}: operator per token (a validation sample)")


def write_report(benchmark: str, runs: dict, results_dir: str, name: str, title: str) -> list:
    """``<results_dir>/<name>.{json,md}``: the comparison of the finished ``runs`` ({(arm, seed): Run}), paired
    deltas against the all-attention arm, the validation curves against steps and seconds, and the figures of the
    first seed's threshold, hard and 3op runs. Returns the summaries."""
    from ..results import write_results
    from .plots import plot_validation_curves

    _, script, primary, _, paper_metric = TASKS[benchmark]
    summaries = [summary(benchmark, run, arm, seed) for (arm, seed), run in runs.items()]
    curve_key = "eval_loss" if script == "run_clm" else "eval_accuracy"
    rows = comparison_rows(benchmark, summaries, curve_key)
    by_arm = {}
    for found in summaries:
        by_arm.setdefault(found["arm"], {})[found["seed"]] = found.get(primary)
    deltas = {arm: paired_delta(values, by_arm.get("attention", {})) for arm, values in by_arm.items()
              if arm != "attention"}  # arm − attention
    for row in rows:
        delta = deltas.get(row["arm"])
        row[f"Δ {primary} vs attention (paired)"] = "" if delta is None else pm(delta["mean"], delta["std"])
        runs_of = [found for found in summaries if found["arm"] == row["arm"]]
        row["train s / run"] = f"{statistics.fmean(found['train_runtime'] or 0 for found in runs_of):.0f}"
        row["params"] = f"{runs_of[0]['parameters']:,}"
    arguments = next(iter(runs.values())).arguments
    scale = (f"{arguments['config_overrides']}; batch {arguments['per_device_train_batch_size']}, "
             f"{arguments['max_steps']} steps ({arguments['warmup_steps']} warm-up, {arguments['lr_scheduler_type']}), "
             f"AdamW lr {arguments['learning_rate']}, betas ({arguments['adam_beta1']}, {arguments['adam_beta2']}), "
             f"weight decay {arguments['weight_decay']}")
    notes = (f"Scale: {scale}. {primary}: mean ± sample std over seeds; Δ = arm − attention, paired by seed (same "
             "seed = same data order). s/step: median wall-clock seconds per optimiser step between log lines (a "
             "shared CPU is noisy). attn share: tokens routed to attention in the routed layers; GFLOPs per sequence "
             "from the routing taken (`count_flops`); both on the first training batches, in evaluation mode, at the "
             "end of training. 'val curve @ N s': the validation curve at the training time of the run that ended "
             f"first (equal wall-clock); '@ last step': equal steps. Paper (SPEC 2.3): {paper_metric}, at the "
             "authors' scale (not comparable in absolute terms).")
    columns = [column for column in rows[0] if not column.endswith(("_mean", "_std", "_seconds", "_share"))
               and column not in ("attention_gflops_per_seq", "total_gflops_per_seq", "per_seed")]
    write_results(results_dir, name, rows, title=title, config=arguments, seeds=sorted({f["seed"] for f in summaries}),
                  notes=notes, columns=columns, extra={"paired_deltas": deltas, "runs": [
                      {key: value for key, value in found.items() if key != "log_history"} for found in summaries]})
    histories = {f"{found['arm']} seed {found['seed']}": found["log_history"] for found in summaries}
    plot_validation_curves(histories, curve_key, os.path.join(results_dir, f"{name}_validation_curves.png"),
                           f"{TASKS[benchmark][0]}: validation curve per arm against steps and training time",
                           against_time=True)
    first_seed = min(found["seed"] for found in summaries)
    for (arm, seed), run in runs.items():
        if seed == first_seed and arm in ("threshold", "hard", "3op"):
            write_figures(benchmark, run, arm, results_dir)
    return summaries


def main(benchmark: str, description: str, argv, *, default_arms: tuple, data_files, prepare_data,
         add_data_arguments) -> int:
    """The entry point of a benchmark: ``data_files(args)`` names the files its runs read (the tokenizer's folder
    too), ``prepare_data(args, files)`` writes them, ``add_data_arguments(parser)`` adds its data options."""
    prog = program_name(benchmark)

    def run(argv) -> int:
        parser = driver_parser(prog, description)
        add_arguments(parser, default_arms)
        add_data_arguments(parser)
        args, tokens = parse(parser, argv)
        args.preset = "smoke" if args.smoke else args.preset
        output_dir = args.output_dir or os.path.join("runs", f"{benchmark}-{args.preset}")
        files = data_files(args)
        runs = make_runs(benchmark, args.preset, args.arms, args.seeds or [0], output_dir, files, args, tokens)
        code = prepare_and_train(args, list(runs.values()), output_dir, files, prepare_data)
        if code is not None:
            return code
        summaries = write_report(benchmark, runs, output_dir, "results",
                                 f"{TASKS[benchmark][0]}: CHIAR-Former arms ({args.preset} preset)")
        print(table_without_provenance(os.path.join(output_dir, "results.md")))
        primary = TASKS[benchmark][2]
        for found in summaries:
            value = found.get(primary)
            print(f"{primary:<28} {found['arm']:<18} seed {found['seed']}: "
                  f"{'n/a' if value is None else f'{value:.4f}'}")
        return 0

    return run_main(run, argv, prog)
