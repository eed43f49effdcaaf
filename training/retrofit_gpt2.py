"""Energy gates retrofitted into a pretrained GPT-2, against plain fine-tuning at the same budget (results/retrofit/):
every step a run of run_clm, with the configurations training/configs/retrofit_{pretrain,finetune}_<preset>.json.

    python -m training.retrofit_gpt2 --preset cpu --seeds 0 1 --threads 1    # the committed comparison
    python -m training.retrofit_gpt2 --smoke                                  # seconds, for tests
    python -m training.retrofit_gpt2 --arms full gates --max_steps 1000      # options of run_clm: every arm
    hf-spectral train retrofit_gpt2 --help

No pretrained GPT-2 can be downloaded here, so the comparison makes one:
  1. pretrain a small GPT2LMHeadModel from scratch on WikiText-2 read as characters (<output_dir>/pretrained-seed0/,
     reused by later invocations), one vocabulary for both corpora: the characters seen at least 20 times in their
     training texts, the others <unk>;
  2. fine-tune it on TinyShakespeare (a shift of domain and style), every arm for the same steps on the same batches:
       full        continued plain fine-tuning of every weight (the reference),
       gates       energy gates added (EGA-1, causal, α = 0: the identity) and only they train,
       lora        LoRA adapters on every linear layer (r = 8), the control for "a few trainable parameters",
       gates+lora  gates and LoRA adapters together (gates through PEFT modules_to_save),
       gates+full  gates added, then every weight trains;
  3. score each arm on the pretraining corpus afterwards (how much of it was forgotten), and the pretrained model on
     the fine-tuning corpus (where every arm started). Each is an evaluation-only run of run_clm.
Learning rates (the configurations' are the full arm's): pretrained weights 3e-4 (gpu preset: 1e-4), LoRA 1e-3,
gates 1e-2 (--gate_learning_rate beside the others).
"""

from __future__ import annotations

import collections
import os
import sys
from types import SimpleNamespace

from . import tinyshakespeare, wikitext
from .common.cli import program_name, run_main
from .common.data import read_text
from .common.experiments import (Run, config, driver_parser, execute, mean_std, parse, pm, read_run, script_options,
                                 table_without_provenance)

ARMS = ("full", "gates", "lora", "gates+lora", "gates+full")
LEARNING_RATES = {"lora": 1e-3, "gates": 1e-2}
MIN_COUNT = 20  # characters seen fewer times in the two training texts are <unk>


def data_files(data_dir: str) -> dict:
    return {"pretrain": wikitext.text_files(data_dir), "finetune": tinyshakespeare.data_files(data_dir),
            "tokenizer": os.path.join(data_dir, "retrofit", "tokenizer")}


def prepare_data(args, files: dict) -> None:
    """WikiText-2 and TinyShakespeare's files, and the characters tokenizer of both."""
    from hf_spectral import CharTokenizer

    pretrain = wikitext.write_text_files(SimpleNamespace(data_path=args.pretrain_data_path,
                                                         no_download=args.no_download), files["pretrain"])
    tinyshakespeare.prepare_data(SimpleNamespace(data_path=args.finetune_data_path, no_download=args.no_download),
                                 files["finetune"])
    counts = collections.Counter(pretrain["train"]) + collections.Counter(read_text(files["finetune"]["train_file"]))
    kept = "".join(sorted(char for char, count in counts.items() if count >= MIN_COUNT))
    CharTokenizer.from_text(kept, files["tokenizer"], unk_token="<unk>").save_pretrained(files["tokenizer"])


def make_runs(args, preset: str, files: dict, tokens: list) -> tuple:
    """The pretraining run, the fine-tuning runs {(arm, seed): run}, and the evaluation-only runs: the pretrained
    model on the fine-tuning corpus, each arm on the pretraining corpus."""
    output_dir = args.output_dir
    pretrained = Run("pretrained-seed0", "run_clm", {
        **config(f"retrofit_pretrain_{preset}"), "train_file": files["pretrain"]["train_file"],
        "validation_file": files["pretrain"]["validation_file"], "tokenizer_name": files["tokenizer"],
        "output_dir": os.path.join(output_dir, "pretrained-seed0")})
    finetune = {**config(f"retrofit_finetune_{preset}"), **files["finetune"],
                "model_name_or_path": os.path.abspath(pretrained.folder)}
    evaluation = {"do_train": False, "eval_samples_during_training": None}
    zero_shot = Run("pretrained-seed0-finetune_eval", "run_clm", {
        **finetune, **evaluation, "output_dir": os.path.join(output_dir, "pretrained-seed0-finetune_eval")})
    options = script_options("run_clm", tokens)
    arms, forgetting = {}, {}
    for arm in dict.fromkeys(args.arms):
        overrides = {}
        if "gates" in arm:
            overrides.update(add_energy_gates=True, gate_normalization=args.gate_normalization)
        if "lora" in arm:
            overrides.update(lora_r=8, lora_alpha=16, lora_target_modules=["c_attn", "c_proj", "c_fc"],
                             learning_rate=LEARNING_RATES["lora"])
        if arm == "gates":
            overrides.update(train_only_gates=True, learning_rate=LEARNING_RATES["gates"])
        elif "gates" in arm:
            overrides["gate_learning_rate"] = LEARNING_RATES["gates"]
        for seed in args.seeds or [0]:
            name = f"{arm.replace('+', '_')}-seed{seed}"
            arms[arm, seed] = Run(name, "run_clm", {**finetune, **overrides, "seed": seed, **options,
                                                    "output_dir": os.path.join(output_dir, name)})
            forgetting[arm, seed] = Run(f"{name}-pretrain_eval", "run_clm", {
                **finetune, **evaluation, "model_name_or_path": os.path.abspath(arms[arm, seed].folder),
                "train_file": None, "train_eval_samples": 0,
                "validation_file": files["pretrain"]["validation_file"],
                "output_dir": os.path.join(output_dir, f"{name}-pretrain_eval")})
    return pretrained, zero_shot, arms, forgetting


def write_report(pretrained: Run, zero_shot: Run, arms: dict, forgetting: dict, results_dir: str) -> None:
    from .results import write_results
    from .common.ega import gate_figures_and_characters
    from .common.plots import plot_validation_curves

    summaries = []
    for (arm, seed), run in arms.items():
        result = read_run(run.folder)
        last = ([entry for entry in result["log_history"] if "train_seconds" in entry] or [{}])[-1]
        taus = [value for key, value in last.items() if key.startswith("gates/") and key.endswith("/tau")]
        summaries.append({
            "arm": arm, "seed": seed, "val_loss": result["eval_loss"], "train_loss": result["eval_train_loss"],
            "generalization_gap": result["eval_generalization_gap"],
            "pretrain_val_loss": read_run(forgetting[arm, seed].folder)["eval_loss"],
            "trainable_parameters": result["trainable_parameters"], "train_seconds": result["train_runtime"],
            "tau_mean": sum(taus) / len(taus) if taus else None, "log_history": result["log_history"]})
    start, own = read_run(zero_shot.folder), read_run(pretrained.folder)
    rows = [{"arm": "pretrained (no fine-tuning)", "seeds": 1, "trainable params": "0",
             "val loss": f"{start['eval_loss']:.4f}", "pretrain-corpus loss": f"{own['eval_loss']:.4f}",
             "gap (val − train)": f"{start['eval_generalization_gap']:.4f}", "val_loss_mean": start["eval_loss"]}]
    full = mean_std([found["val_loss"] for found in summaries if found["arm"] == "full"])[0]
    for arm in dict.fromkeys(found["arm"] for found in summaries):
        runs = [found for found in summaries if found["arm"] == arm]
        val, val_std = mean_std([found["val_loss"] for found in runs])
        rows.append({
            "arm": arm, "seeds": len(runs), "trainable params": f"{runs[0]['trainable_parameters']:,}",
            "val loss": pm(val, val_std), "Δ vs full": "" if full is None or arm == "full" else f"{full - val:+.4f}",
            "pretrain-corpus loss": pm(*mean_std([found["pretrain_val_loss"] for found in runs])),
            "gap (val − train)": pm(*mean_std([found["generalization_gap"] for found in runs])),
            "τ (mean)": pm(*mean_std([found["tau_mean"] for found in runs]), 3),
            "train min / run": f"{sum(found['train_seconds'] for found in runs) / len(runs) / 60:.1f}",
            "val_loss_mean": val, "val_loss_std": val_std,
            "delta_vs_full": None if full is None or arm == "full" else full - val})
    if full is not None:
        rows[0]["Δ vs full"] = f"{full - start['eval_loss']:+.4f}"
    first = next(iter(arms.values())).arguments
    notes = (f"GPT-2 ({pretrained.arguments['config_overrides']}) pretrained for {pretrained.arguments['max_steps']} "
             f"steps on WikiText-2 characters, then each arm fine-tuned for {first['max_steps']} steps (batch "
             f"{first['per_device_train_batch_size']}, the same data order per seed) on TinyShakespeare. val loss: "
             "TinyShakespeare validation, nats per character, evaluation mode, mean ± std over seeds; Δ vs full = full "
             "− arm (positive: better than continued plain fine-tuning); pretrain-corpus loss: WikiText-2 validation "
             f"after fine-tuning (forgetting). Learning rates: {zero_shot.arguments['learning_rate']} for pretrained "
             f"weights, "
             f"{LEARNING_RATES['lora']} for LoRA, {LEARNING_RATES['gates']} for gates. Gates: EGA-1, "
             f"{first.get('gate_normalization', 'causal')} statistics, α = 0 at the start.")
    write_results(results_dir, "retrofit_gpt2", rows, title="GPT-2 retrofit: energy gates vs plain fine-tuning "
                  "(WikiText-2 → TinyShakespeare)", config={"pretrain": pretrained.arguments, "finetune": first},
                  seeds=sorted({found["seed"] for found in summaries}), notes=notes,
                  columns=["arm", "seeds", "trainable params", "val loss", "Δ vs full", "pretrain-corpus loss",
                           "gap (val − train)", "τ (mean)", "train min / run"],
                  extra={"runs": [{k: v for k, v in found.items() if k != "log_history"} for found in summaries]})
    plot_validation_curves({f"{found['arm']} seed {found['seed']}": found["log_history"] for found in summaries},
                           "eval_loss", os.path.join(results_dir, "retrofit_gpt2_curves.png"),
                           "Fine-tuning on TinyShakespeare: validation loss per arm")
    gated = sorted(key for key in arms if key[0] == "gates")
    if gated:
        gate_figures_and_characters(arms[gated[0]], f"retrofit arm gates, seed {gated[0][1]}", results_dir,
                                    f"gates_seed{gated[0][1]}_")


def main(argv=None) -> int:
    prog = program_name("retrofit_gpt2")
    return run_main(lambda arguments: run(arguments, prog), argv, prog)


def run(argv, prog: str) -> int:
    parser = driver_parser(prog, __doc__)
    parser.add_argument("--preset", choices=("cpu", "gpu", "smoke"), default="cpu",
                        help="the configurations training/configs/retrofit_{pretrain,finetune}_<preset>.json")
    parser.add_argument("--smoke", action="store_true", help="the smoke preset: a tiny GPT-2, a few steps")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS), help="fine-tuning arms (default: all)")
    parser.add_argument("--gate_normalization", choices=("causal", "window", "none"), default="causal",
                        help="energy statistics of the gates (default causal; window sees future tokens)")
    parser.add_argument("--results_dir", help="where the table goes (default: --output_dir)")
    group = parser.add_argument_group("data")
    group.add_argument("--pretrain_data_path", help="WikiText-2: a folder with {train,valid,test}.txt")
    group.add_argument("--finetune_data_path", help="TinyShakespeare: input.txt or its folder")
    group.add_argument("--no_download", action="store_true", help="fail instead of downloading a corpus")
    args, tokens = parse(parser, argv)
    preset = "smoke" if args.smoke else args.preset
    args.output_dir = args.output_dir or os.path.join("runs", f"retrofit_gpt2-{preset}")
    files = data_files(args.data_dir)
    pretrained, zero_shot, arms, forgetting = make_runs(args, preset, files, tokens)
    if not args.dry_run:
        prepare_data(args, files)
        if args.prepare_data:
            return 0
    log_dir = os.path.join(args.output_dir, "logs")
    for phase in ([pretrained], [zero_shot, *arms.values()], list(forgetting.values())):
        if not execute(args, phase, log_dir) and not args.dry_run:
            return 1
    if args.dry_run:
        return 0
    results_dir = args.results_dir or args.output_dir
    write_report(pretrained, zero_shot, arms, forgetting, results_dir)
    print(table_without_provenance(os.path.join(results_dir, "retrofit_gpt2.md")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
