"""Train and evaluate EGA-GPT variants on one character-level corpus: what ``tinyshakespeare`` and ``ptb_char``
share. A recipe supplies its corpus, presets and paper numbers; this module does the rest.

One *run* is one (variant, normalisation, seed). Each run lives in ``<output_dir>/<run name>/``:
checkpoints while it trains, then the final model + tokenizer + ``README.md`` (model card), ``summary.json``
(every measured number), ``trainer_state.json`` (the log), ``gate_trajectory.jsonl`` and PNG figures.
A run whose ``summary.json`` exists is complete and is not trained again; a run with checkpoints resumes
from the newest complete one. The comparison of all runs goes to ``<output_dir>/results.{json,md}`` and
``validation_curves.png``.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
from dataclasses import dataclass

# Light imports only at module level: a recipe parses its options (and answers --help) before torch,
# transformers, datasets or accelerate are imported; the functions that need them import them.
from ..results import current_command, hardware_summary, mean_std, pm, write_results
from .data import LMData, fixed_subset
from .exit_codes import EXIT_INTERRUPTED
from .presets import (
    LMPreset,
    add_output_arguments,
    check_training_arguments,
    positive_int,
    recipe_prog,
    resolve_preset,
    world_size,
)

NORMALIZATIONS = ("causal", "window", "none")


# ------------------------------------------------------------------------------------------------------------
# Run specifications
# ------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunSpec:
    variant: str
    normalization: str
    seed: int

    @property
    def gated(self) -> bool:
        return self.variant != "BASE"

    @property
    def label(self) -> str:
        return self.variant if not self.gated else f"{self.variant} ({self.normalization})"

    @property
    def name(self) -> str:
        return (self.variant if not self.gated else f"{self.variant}-{self.normalization}") + f"-seed{self.seed}"


def parse_variant(text: str, default_normalization: str) -> tuple[str, str]:
    """``EGA-1`` → (EGA-1, default); ``EGA-1:window`` → (EGA-1, window); ``BASE`` has no normalisation."""
    from hf_spectral.models.ega_gpt.configuration_ega_gpt import VARIANTS

    variant, _, normalization = text.partition(":")
    if variant not in VARIANTS:
        raise argparse.ArgumentTypeError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    normalization = normalization or default_normalization
    if normalization not in NORMALIZATIONS:
        raise argparse.ArgumentTypeError(f"unknown normalisation {normalization!r} in {text!r}; choose from {NORMALIZATIONS}")
    return variant, ("none" if variant == "BASE" else normalization)


# ------------------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------------------


def add_data_arguments(parser, corpus):
    group = parser.add_argument_group("data")
    group.add_argument("--data_path", help=f"file or folder holding {', '.join(corpus.files.values())} "
                       f"(else ${corpus.env_var}, else $HF_SPECTRAL_DATA/{corpus.folder}/, else download)")
    group.add_argument("--dataset_name", help=f"read the text from this Hugging Face Hub dataset instead "
                       f"(e.g. {corpus.hub_dataset}); needs network access")
    group.add_argument("--dataset_config", help="configuration name of --dataset_name")
    group.add_argument("--text_column", default="text", help="text column of --dataset_name (default: text)")
    group.add_argument("--no_download", action="store_true", help="never download; fail if no local copy is found")


def add_training_arguments(parser, presets: dict, default_preset: str):
    group = parser.add_argument_group("preset and size (a preset's numbers are defaults; options override them)")
    group.add_argument("--preset", choices=sorted(presets), default=default_preset,
                       help="; ".join(f"{name}: {preset.description}" for name, preset in presets.items()))
    group.add_argument("--smoke", action="store_true", help="tiny model, a few steps, for tests (< 1 minute)")
    for name, kind, text in (
        ("num_hidden_layers", int, "transformer blocks"),
        ("num_attention_heads", int, "attention heads"),
        ("hidden_size", int, "model width C"),
        ("context_length", int, "tokens per training example (= max positions)"),
        ("dropout", float, "dropout on embeddings, residuals and attention"),
    ):
        group.add_argument(f"--{name}", type=kind, help=text)
    group = parser.add_argument_group("training")
    for name, kind, text in (
        ("max_steps", int, "optimizer steps"),
        ("batch_size", int, "global batch (split over processes under torchrun)"),
        ("learning_rate", float, "peak AdamW learning rate"),
        ("warmup_steps", int, "linear warm-up steps before the cosine decay"),
        ("weight_decay", float, "AdamW weight decay (matrices and embeddings only)"),
        ("eval_steps", int, "steps between validation-curve points"),
        ("eval_batches", int, "batches of the fixed validation subset per curve point"),
        ("final_eval_batches", int, "batches for the final losses (default: the whole validation split)"),
        ("leak_free_batches", int, "batches for the leak-free loss (default: the whole validation split)"),
        ("save_steps", int, "steps between checkpoints"),
        ("logging_steps", int, "steps between training-loss log lines"),
    ):
        group.add_argument(f"--{name}", type=kind, help=text)
    group.add_argument("--seeds", type=int, nargs="+", help="one run per seed (default: the preset's)")
    group.add_argument("--threads", type=positive_int, help="torch CPU threads per process (default: torch's choice)")
    group.add_argument("--attn_implementation", default="sdpa", choices=["sdpa", "eager", "flex_attention"])
    group.add_argument("--bf16", action="store_true", help="bfloat16 mixed precision (GPUs)")
    group.add_argument("--report_to", default="none", help="Trainer loggers, e.g. tensorboard, wandb (default: none)")
    add_output_arguments(parser)


def build_parser(recipe: str, description: str, corpus, presets: dict, default_preset: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=recipe_prog(recipe), description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--variants", nargs="+", metavar="VARIANT[:NORM]",
                        help="models to train: BASE, EGA-1, EGA-2, EGA-4, EGA-C, EGA-M-F, EGA-M, EGA-DB2, EGA-DB4, "
                             "optionally with a normalisation suffix, e.g. EGA-1:window (default: the preset's)")
    parser.add_argument("--normalization", default="causal", choices=NORMALIZATIONS,
                        help="energy normalisation of variants given without a suffix (default: causal)")
    add_data_arguments(parser, corpus)
    add_training_arguments(parser, presets, default_preset)
    return parser


def run_specs(args, preset: LMPreset, parser: argparse.ArgumentParser) -> list:
    texts = args.variants or list(preset.variants)
    try:
        parsed = [parse_variant(text, args.normalization) for text in texts]
    except argparse.ArgumentTypeError as error:
        parser.error(str(error))
    unique = list(dict.fromkeys(parsed))
    return [RunSpec(variant, normalization, seed) for variant, normalization in unique for seed in preset.seeds]


# ------------------------------------------------------------------------------------------------------------
# One run
# ------------------------------------------------------------------------------------------------------------


@dataclass
class Benchmark:
    """What a recipe tells the shared layer about its corpus and the paper."""

    recipe: str
    title: str  # e.g. "TinyShakespeare (char)"
    hub_dataset: str  # Hub id for model cards
    dataset_description: str
    paper: dict  # label -> the authors' validation loss (SPEC 1.4)
    paper_gap: dict  # label -> the authors' generalisation gap
    prompt: str = "\n"


def build_model(spec: RunSpec, preset: LMPreset, vocab_size: int, attn_implementation: str):
    from hf_spectral import EGAConfig, EGAForCausalLM

    extra = {} if not spec.gated else {"energy_normalization": spec.normalization}
    config = EGAConfig.from_variant(
        spec.variant,
        vocab_size=vocab_size,
        max_position_embeddings=preset.context_length,
        hidden_size=preset.hidden_size,
        num_hidden_layers=preset.num_hidden_layers,
        num_attention_heads=preset.num_attention_heads,
        embd_pdrop=preset.dropout,
        resid_pdrop=preset.dropout,
        attn_pdrop=preset.dropout,
        **extra,
    )
    model = EGAForCausalLM(config)
    model.set_attn_implementation(attn_implementation)
    return model


def batches_of(dataset, batch_size: int, limit: int | None):
    import torch

    count = len(dataset) if limit is None else min(len(dataset), limit * batch_size)
    for start in range(0, count, batch_size):
        yield torch.as_tensor(dataset[start : min(start + batch_size, count)]["input_ids"], dtype=torch.long)


def leak_free_evaluation(model, dataset, batch_size: int, limit: int | None, leak_free: bool = True) -> dict:
    """Ordinary loss and (``leak_free``) leak-free loss on the leak-free evaluation's validation blocks (the first
    ``limit`` batches; token-weighted means). Every model is scored on these blocks: a window model's leak-free loss
    compares with BASE's ordinary loss on the same blocks, not with its ``val_loss`` (another subset)."""
    import torch

    from hf_spectral.evaluation import causal_lm_losses

    totals, tokens = {"loss": 0.0, "leak_free_loss": 0.0} if leak_free else {"loss": 0.0}, 0
    was_training = model.training
    model.eval()
    for input_ids in batches_of(dataset, batch_size, limit):
        if leak_free:
            losses = causal_lm_losses(model, input_ids)
        else:
            with torch.no_grad():
                losses = {"loss": float(model(input_ids=input_ids, labels=input_ids, use_cache=False).loss)}
        count = input_ids.shape[0] * (input_ids.shape[1] - 1)
        for key in totals:
            totals[key] += losses[key] * count
        tokens += count
    model.train(was_training)
    return {key: value / tokens for key, value in totals.items()} | {"tokens": tokens}


def gate_statistics(model, dataset, tokenizer, blocks: int = 16) -> dict:
    """Mean gate value per character over some validation blocks (mean over layers and heads): which
    characters the gates keep (high g) and which they suppress (low g)."""
    import torch

    from .plots import gate_values_per_token

    sums, counts = {}, {}
    for index in range(min(blocks, len(dataset))):
        ids = torch.as_tensor(dataset[index]["input_ids"], dtype=torch.long)
        gates = gate_values_per_token(model, ids)
        mean = torch.stack([values.mean(0) for values in gates.values()]).mean(0)
        for token, value in zip(ids.tolist(), mean.tolist()):
            sums[token] = sums.get(token, 0.0) + value
            counts[token] = counts.get(token, 0) + 1
    frequent = {token: sums[token] / counts[token] for token in sums if counts[token] >= 10}
    ranked = sorted(frequent.items(), key=lambda item: item[1])
    name = lambda token: tokenizer.convert_ids_to_tokens(token)  # noqa: E731
    return {
        "lowest_gate": [[name(t), round(v, 4)] for t, v in ranked[:8]],
        "highest_gate": [[name(t), round(v, 4)] for t, v in ranked[::-1][:8]],
    }


def tau_summary(model) -> dict | None:
    import torch

    from .callbacks import gate_parameters

    gates = gate_parameters(model)
    if not gates:
        return None
    per_layer = {str(layer): {"tau": tau.tolist(), "alpha": alpha.tolist()} for layer, (tau, alpha) in gates.items()}
    taus = torch.cat([tau.flatten() for tau, _ in gates.values()])
    alphas = torch.cat([alpha.flatten() for _, alpha in gates.values()])
    return {
        "tau_mean": float(taus.mean()), "tau_std": float(taus.std()) if taus.numel() > 1 else 0.0,
        "alpha_mean": float(alphas.mean()), "per_layer": per_layer,
    }


def train_run(spec: RunSpec, data: LMData, preset: LMPreset, benchmark: Benchmark, args, output_dir: str, runs: int):
    """Train (or resume, or skip if complete) one run; return its summary, or None if it was interrupted."""
    from transformers import set_seed

    from .runs import (
        barrier,
        build_trainer,
        final_losses,
        default_card_repo_id,
        hub_repo_id,
        is_main_process,
        open_run_dir,
        data_fingerprint,
        run_settings,
        train_or_resume,
        write_json,
    )
    from .trainer import remove_checkpoints

    settings = run_settings(preset, args, data_fingerprint(data.tokenizer, data.datasets))
    run_dir, done = open_run_dir(output_dir, spec.name, args.restart, settings, getattr(args, "push_to_hub", False))
    hub_model_id = hub_repo_id(args, spec.name, runs)
    card_repo_id = default_card_repo_id(args, hub_model_id)
    if done is not None:
        if getattr(args, "eval_test", False) and "test" in data.datasets and "test_loss" not in done:
            done = add_test_loss(run_dir, done, spec, data, preset, benchmark, args, card_repo_id)
        return done

    set_seed(spec.seed)  # the seed fixes the initial weights, the data order and the dropout masks
    tokenizer = data.tokenizer
    model = build_model(spec, preset, len(tokenizer), args.attn_implementation)
    summary = {}
    trainer, interrupt = build_trainer(
        model, run_dir, preset, spec.seed, data.datasets["train"],
        fixed_subset(data.datasets["validation"], preset.eval_batches * preset.batch_size), tokenizer, args,
        chars_per_token=data.chars_per_token("validation"), run_name=f"{benchmark.recipe}/{spec.name}",
        hub_model_id=hub_model_id,
        model_card_fn=lambda directory, repo_id: write_card(directory, spec, preset, benchmark, summary, model,
                                                            repo_id=repo_id or card_repo_id),
    )
    timing = train_or_resume(trainer, interrupt, run_dir, preset.max_steps)
    if timing is None:
        return None

    extra_sets = {"test": data.datasets["test"]} if "test" in data.datasets and getattr(args, "eval_test", False) else None
    summary.update(
        run=spec.name, variant=spec.variant, normalization=spec.normalization, seed=spec.seed,
        sees_future=model.config.sees_future, steps=trainer.state.global_step,
        parameters=sum(p.numel() for p in model.parameters()),
        gate_parameters=sum(p.numel() for n, p in model.named_parameters() if "energy_gate" in n),
        **timing, **final_losses(trainer, data, preset, extra_sets),
    )
    # Under FSDP every process holds a shard, so every process must run these forwards; otherwise only the main one.
    if is_main_process() or trainer.is_fsdp_enabled:
        # Every model's ordinary loss on the leak-free blocks (`val_loss_same_blocks`), so that a window model's
        # leak-free loss has a BASE loss on the same blocks to be compared with. When those blocks and the final
        # evaluation's are both the whole split, a causal model's is `val_loss`: not computed a second time.
        validation = data.datasets["validation"]
        whole = preset.leak_free_batches is None or preset.leak_free_batches * preset.batch_size >= len(validation)
        if not model.config.sees_future and whole and summary["val_blocks"] == len(validation):
            summary.update(val_loss_same_blocks=summary["val_loss"],
                           leak_free_tokens=len(validation) * (len(validation[0]["input_ids"]) - 1))
        else:
            leak = leak_free_evaluation(model, validation, preset.batch_size, preset.leak_free_batches,
                                        leak_free=model.config.sees_future)
            summary.update(val_loss_same_blocks=leak["loss"], leak_free_tokens=leak["tokens"])
            if model.config.sees_future:
                summary["val_loss_leak_free"] = leak["leak_free_loss"]
        gates = tau_summary(model)
        if gates:
            summary["gates"] = gates
            summary["gate_by_character"] = gate_statistics(model, data.datasets["validation"], tokenizer)
    trainer.save_model()  # final model + tokenizer in the run folder, next to its card
    if is_main_process():
        summary.update(command=current_command(), preset=preset.to_dict(), hardware=hardware_summary(),
                       log_history=trainer.state.log_history)
        if getattr(trainer, "hub_model_id", None):  # the repository as the Hub resolved it, for later cards
            summary["hub_model_id"] = trainer.hub_model_id
        if not args.no_plots:
            write_run_plots(run_dir, spec, model, data, trainer.state.log_history, benchmark)
    if args.push_to_hub:
        trainer.push_to_hub(commit_message=f"{spec.name}: end of training")
    else:
        trainer.create_model_card()
    if is_main_process():
        if not args.keep_checkpoints:
            remove_checkpoints(run_dir)
        write_json(os.path.join(run_dir, "summary.json"), summary)  # last: its presence marks the run complete
    barrier()
    return summary


def add_test_loss(run_dir: str, summary: dict, spec: RunSpec, data: LMData, preset: LMPreset, benchmark, args,
                  repo_id: str) -> dict:
    """``--eval_test`` on a run completed without it: its saved model scores the test split as the final evaluation
    of a new run would (the same trainer set-up and metrics); its summary and model card record the result."""
    from transformers import AutoModelForCausalLM

    from .runs import build_trainer, is_main_process, write_json

    model = AutoModelForCausalLM.from_pretrained(run_dir, attn_implementation=args.attn_implementation)
    no_upload = argparse.Namespace(**{**vars(args), "push_to_hub": False, "stop_after_steps": None})
    trainer, _ = build_trainer(model, run_dir, preset, spec.seed, data.datasets["train"], data.datasets["validation"],
                               data.tokenizer, no_upload, chars_per_token=data.chars_per_token("validation"))
    metrics = trainer.evaluate(eval_dataset={"test": data.datasets["test"]})
    summary = {**summary, "test_loss": metrics["eval_test_loss"],
               "test_bits_per_char": metrics["eval_test_bits_per_char"]}
    print(f"[{spec.name}] --eval_test: test loss {summary['test_loss']:.4f} nats/char from the saved model", flush=True)
    if is_main_process():
        write_card(run_dir, spec, preset, benchmark, summary, model, repo_id=summary.get("hub_model_id") or repo_id)
        write_json(os.path.join(run_dir, "summary.json"), summary)
    return summary


def write_run_plots(run_dir, spec, model, data, log_history, benchmark):
    from .plots import plot_learning_curves, write_gate_figures

    plot_learning_curves({spec.label: log_history}, os.path.join(run_dir, "learning_curve.png"),
                         f"{benchmark.title}: {spec.label}, seed {spec.seed}")
    if spec.gated:
        write_gate_figures(run_dir, model, data.datasets["validation"], data.tokenizer,
                           f"{benchmark.title}: gate values of {spec.label} on validation text (rows: layer, head)",
                           f"{benchmark.title}: τ and α of {spec.label} during training")


# ------------------------------------------------------------------------------------------------------------
# Model card
# ------------------------------------------------------------------------------------------------------------


def write_card(directory: str, spec: RunSpec, preset: LMPreset, benchmark: Benchmark, summary: dict, model,
               repo_id: str | None = None) -> str:
    from hf_spectral.models.ega_gpt.configuration_ega_gpt import VARIANTS

    from huggingface_hub import ModelCardData

    from .model_card import eval_results, render_model_card, write_model_card

    # (name, metric type, split, value); the gap is no evaluation of a split: in the table, not the model index
    rows = [("validation loss (nats/char)", "loss", "validation", summary.get("val_loss")),
            ("validation perplexity", "perplexity", "validation", summary.get("val_perplexity")),
            ("validation bits per character", "bits_per_char", "validation", summary.get("val_bits_per_char")),
            ("training loss, eval mode (nats/char)", "loss", "train", summary.get("train_loss")),
            ("generalisation gap (val − train)", "generalization_gap", None, summary.get("generalization_gap"))]
    if "val_loss_leak_free" in summary:
        # The leak-free loss is measured on its own blocks (`leak_free_batches`): beside it, the ordinary loss on the
        # same blocks, the pair that measures the leak (the validation loss above may cover other blocks).
        blocks = f"{summary.get('leak_free_tokens', 0):,} predicted tokens of the validation split"
        rows[:0] = [(f"LEAK-FREE validation loss (nats/char), {blocks}", "loss", "validation",
                     summary["val_loss_leak_free"]),
                    ("ordinary validation loss on the same tokens (sees future tokens)", "loss", "validation",
                     summary.get("val_loss_same_blocks"))]
    if "test_loss" in summary:
        rows.append(("test loss (nats/char)", "loss", "test", summary["test_loss"]))
    if summary.get("sees_future"):
        # Window statistics: every ordinary number above saw future tokens, the model index included; the leak-free
        # loss is the honest one, given as perplexity and bits per character too.
        rows = [(name if "LEAK-FREE" in name or "sees future" in name else f"{name} (sees future tokens)", kind,
                 split, value) for name, kind, split, value in rows]
        # the ordinary figures' conversion (1 / ln 2 per character, scaled by the characters per token)
        bits_per_char_per_nat = summary.get("val_bits_per_char", math.nan) / summary.get("val_loss", math.nan)
        if "val_loss_leak_free" in summary and math.isfinite(bits_per_char_per_nat):
            rows[1:1] = [("LEAK-FREE validation perplexity", "perplexity", "validation",
                          math.exp(summary["val_loss_leak_free"])),
                         ("LEAK-FREE validation bits per character", "bits_per_char", "validation",
                          summary["val_loss_leak_free"] * bits_per_char_per_nat)]
    table = "| metric | value |\n|---|---|\n" + "".join(
        f"| {name} | {value:.4f} |\n" for name, _, _, value in rows if value is not None)
    notes = []
    if summary.get("gates"):
        notes.append(f"Learned gate threshold τ: mean {summary['gates']['tau_mean']:.3f} "
                     f"(± {summary['gates']['tau_std']:.3f} over heads and layers); slope α: mean "
                     f"{summary['gates']['alpha_mean']:.3f}.")
    if benchmark.paper.get(spec.label) or benchmark.paper.get(spec.variant):
        notes.append(f"The EGA authors report {benchmark.paper.get(spec.variant):.4f} for {spec.variant} at their "
                     f"full scale (6 layers, C = 256, 5000 steps, single seed, window statistics); this model's "
                     f"size and schedule are given above.")
    variant_descriptions = {
        "BASE": "no energy gates (baseline)", "EGA-1": "one linear energy projection per head",
        "EGA-2": "two linear energy projections per head", "EGA-4": "four linear energy projections per head",
        "EGA-C": "causal Conv1d energies, kernels 3/7/15/31", "EGA-M-F": "fixed causal Morlet energies",
        "EGA-M": "learned causal Morlet energies", "EGA-DB2": "Daubechies db2 high-pass energies",
        "EGA-DB4": "Daubechies db4 high-pass energies",
    }
    model_name = f"ega-gpt-{benchmark.recipe}-{spec.name}".lower()
    indexed = [(name, split, kind, value) for name, kind, split, value in rows if split and value is not None]
    card_data = ModelCardData(
        model_name=model_name, datasets=[benchmark.hub_dataset], metrics=sorted({kind for _, _, kind, _ in indexed}),
        tags=["character-level", spec.variant.lower()],
        eval_results=eval_results(indexed,
                                  task_type="text-generation", task_name="Character-level language modelling",
                                  dataset_id=benchmark.hub_dataset, dataset_name=benchmark.title),
    )
    card = render_model_card(
        "ega_gpt", card_data,
        model_name=model_name,
        summary=(f"A character-level EGA-GPT language model ({spec.label}) trained on {benchmark.title} with the "
                 f"hf_spectral `{benchmark.recipe}` recipe."),
        sees_future=bool(summary.get("sees_future")),
        variant=spec.variant,
        variant_description=variant_descriptions.get(spec.variant, VARIANTS.get(spec.variant)),
        normalization=spec.normalization if spec.gated else "n/a (no gates)",
        size=(f"{preset.num_hidden_layers} layers, {preset.num_attention_heads} heads, C = {preset.hidden_size}, "
              f"context {preset.context_length}, dropout {preset.dropout}"),
        num_parameters=f"{summary.get('parameters', sum(p.numel() for p in model.parameters())):,}",
        gate_parameters=f"{summary.get('gate_parameters', 0):,}",
        tokenizer_description=f"characters ({model.config.vocab_size} ids), `hf_spectral.CharTokenizer`",
        dataset_description=benchmark.dataset_description,
        schedule=(f"{preset.max_steps} steps, batch {preset.batch_size}, AdamW lr {preset.learning_rate} "
                  f"betas ({preset.adam_beta1}, {preset.adam_beta2}) weight decay {preset.weight_decay}, "
                  f"clip {preset.max_grad_norm}, {preset.warmup_steps} warm-up steps, {preset.lr_scheduler_type} decay"),
        seed=spec.seed,
        hardware=_hardware_line(summary.get("hardware") or hardware_summary()),
        wall_time=f"{summary['train_seconds'] / 60:.1f} min of training" if "train_seconds" in summary else "n/a",
        command=summary.get("command") or current_command(),
        results_table=table,
        results_notes="\n\n".join(notes),
        repo_id=repo_id or directory,
        prompt=benchmark.prompt.replace("\n", "\\n"),
        recipe=benchmark.recipe,
    )
    return write_model_card(card, directory)


def _hardware_line(hardware: dict) -> str:
    device = hardware.get("cuda") or hardware.get("cpu_model") or hardware.get("processor")
    return f"{device}, {hardware.get('torch_threads')} torch threads, torch {hardware.get('torch')}"


# ------------------------------------------------------------------------------------------------------------
# Tables
# ------------------------------------------------------------------------------------------------------------


def comparable_base(base_runs: list, leak_free: bool) -> float | None:
    """BASE's mean loss to compare a model with: its ``val_loss`` for an ordinary loss; for a leak-free loss, its
    ordinary loss on the leak-free evaluation's blocks (``val_loss_same_blocks``; None when a run lacks it)."""
    key = "val_loss_same_blocks" if leak_free else "val_loss"
    values = [s.get(key) for s in base_runs]
    return statistics.fmean(values) if values and None not in values else None


def comparison_rows(summaries: list, paper: dict, paper_gap: dict | None = None) -> list:
    """One row per (variant, normalisation): mean ± std over seeds, Δ vs BASE (positive = better than BASE,
    as in SPEC 1.4), gap, learned τ, and the paper's numbers beside them."""
    groups = {}
    for summary in summaries:
        spec = RunSpec(summary["variant"], summary["normalization"], summary["seed"])
        groups.setdefault(spec.label, []).append(summary)
    base = comparable_base(groups.get("BASE", []), leak_free=False)
    base_same_blocks = comparable_base(groups.get("BASE", []), leak_free=True)
    paper_base = paper.get("BASE")
    rows = []
    for label, runs in groups.items():
        variant = runs[0]["variant"]
        val, val_std = mean_std([s["val_loss"] for s in runs])
        leak, leak_std = mean_std([s.get("val_loss_leak_free") for s in runs])
        test, test_std = mean_std([s.get("test_loss") for s in runs])
        # A window model's leak-free loss is the one that compares with BASE, on the blocks it was measured on.
        comparable, reference = (leak, base_same_blocks) if leak is not None else (val, base)
        gap, gap_std = mean_std([s["generalization_gap"] for s in runs])
        tau, tau_std = mean_std([s["gates"]["tau_mean"] for s in runs if s.get("gates")])
        rows.append({
            "model": label,
            "seeds": len(runs),
            "val loss": pm(val, val_std),
            "leak-free val loss": pm(leak, leak_std),
            "test loss": pm(test, test_std),
            "Δ vs BASE": "" if reference is None or label == "BASE" else f"{reference - comparable:+.4f}",
            "gap (val − train)": pm(gap, gap_std),
            "τ (mean)": pm(tau, tau_std, 3),
            "paper val": "" if paper.get(variant) is None else f"{paper[variant]:.4f}",
            "paper Δ": "" if paper.get(variant) is None or paper_base is None or variant == "BASE"
            else f"{paper_base - paper[variant]:+.4f}",
            "paper gap": "" if not paper_gap or paper_gap.get(variant) is None else f"{paper_gap[variant]:.3f}",
            "val_loss_mean": val, "val_loss_std": val_std, "leak_free_mean": leak, "leak_free_std": leak_std,
            "test_loss_mean": test, "test_loss_std": test_std,
            "gap_mean": gap, "gap_std": gap_std, "tau_mean": tau, "tau_std": tau_std,
            "delta_vs_base": None if reference is None or label == "BASE" else reference - comparable,
        })
    return rows


TABLE_COLUMNS = ["model", "seeds", "val loss", "leak-free val loss", "test loss", "Δ vs BASE", "gap (val − train)",
                 "τ (mean)", "paper val", "paper Δ", "paper gap"]


def table_columns(rows: list) -> list:
    """TABLE_COLUMNS, without the test loss when no run has one (it is measured with --eval_test)."""
    return [column for column in TABLE_COLUMNS if column != "test loss" or any(row["test loss"] for row in rows)]


def write_experiment_results(out, summaries, preset_name, preset, benchmark, data, args):
    from .plots import plot_learning_curves

    rows = comparison_rows(summaries, benchmark.paper, benchmark.paper_gap)
    notes = (
        f"Validation loss in nats per character, final step, {'the whole validation split' if preset.final_eval_batches is None else f'{preset.final_eval_batches} batches'} "
        f"in evaluation mode; mean ± sample std over seeds. Δ vs BASE = BASE − model (positive: better than BASE), "
        "computed from the leak-free loss where there is one. `window` models see future tokens: their ordinary "
        "loss is not comparable. Paper numbers: SPEC 1.4 (authors' README, 6 layers, C = 256, 5000 steps, one seed, "
        "window statistics)."
    )
    config = {"preset": preset_name, **preset.to_dict(), "corpus_tokens": data.tokens, "vocab_size": len(data.tokenizer),
              "world_size": world_size(), "attn_implementation": args.attn_implementation,
              # the options only some recipes have (PTB's text format and test-split evaluation)
              **{name: getattr(args, name) for name in ("char_format", "eval_test") if hasattr(args, name)}}
    seeds = sorted({s["seed"] for s in summaries})
    paths = write_results(out, "results", rows, title=f"{benchmark.title}: EGA-GPT variants ({preset_name} preset)",
                          config=config, seeds=seeds, notes=notes, columns=table_columns(rows))
    histories = {f"{RunSpec(s['variant'], s['normalization'], s['seed']).label} seed {s['seed']}": s["log_history"]
                 for s in summaries if s.get("log_history")}
    if histories:
        plot_learning_curves(histories, os.path.join(out, "validation_curves.png"),
                             f"{benchmark.title}: validation loss per variant ({preset_name} preset)")
    return rows, paths


def print_final_losses(summaries: list):
    """The numbers a user waits for, on their own lines at the end of the output."""
    print("\n" + "=" * 78)
    base_runs = [s for s in summaries if s["variant"] == "BASE"]
    for summary in summaries:
        spec = RunSpec(summary["variant"], summary["normalization"], summary["seed"])
        line = f"validation loss  {spec.label:<22} seed {spec.seed}: {summary['val_loss']:.4f} nats/char"
        leak_free = "val_loss_leak_free" in summary
        if leak_free:  # the leak is the difference on the same tokens (the leak-free evaluation's own blocks)
            line += (f"  (leak-free: {summary['val_loss_leak_free']:.4f}, ordinary on the same tokens: "
                     f"{summary['val_loss_same_blocks']:.4f}; the ordinary loss sees future tokens)")
        comparable = summary["val_loss_leak_free"] if leak_free else summary["val_loss"]
        base_mean = comparable_base(base_runs, leak_free)
        if base_mean is not None and summary["variant"] != "BASE":
            line += f"  Δ vs BASE {base_mean - comparable:+.4f}"
        print(line)
    print("=" * 78, flush=True)


# ------------------------------------------------------------------------------------------------------------
# Entry point shared by the recipes
# ------------------------------------------------------------------------------------------------------------


def run_recipe(argv, *, benchmark: Benchmark, corpus, presets: dict, default_preset: str, description: str,
               load_data, extra_arguments=None) -> int:
    """Parse ``argv``, prepare the corpus, train every requested run, write the comparison. Returns the exit code."""
    parser = build_parser(benchmark.recipe, description, corpus, presets, default_preset)
    if extra_arguments:
        extra_arguments(parser)
    args = parser.parse_args(argv)
    preset_name, preset = resolve_preset(args, presets, parser, heads_divide_width=True)
    specs = run_specs(args, preset, parser)
    check_training_arguments(parser, preset, args)

    from .runs import is_main_process, prepare_recipe

    output_dir, data = prepare_recipe(args, benchmark.recipe, preset_name, preset, load_data)
    if data is None:
        return 2
    print(f"{benchmark.title}: {', '.join(f'{k} {v:,} tokens' for k, v in data.tokens.items())}; vocabulary "
          f"{len(data.tokenizer)}; preset {preset_name}; runs: {', '.join(s.name for s in specs)}", flush=True)

    summaries = []
    for spec in specs:
        summary = train_run(spec, data, preset, benchmark, args, output_dir, len(specs))
        if summary is None:
            return EXIT_INTERRUPTED
        summaries.append(summary)
    if is_main_process():
        rows, paths = write_experiment_results(output_dir, summaries, preset_name, preset, benchmark, data, args)
        print(open(paths[1], encoding="utf-8").read().split("## Provenance")[0])
        print_final_losses(summaries)
    return 0

