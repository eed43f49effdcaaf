"""Retrofit energy gates into a pretrained GPT-2, against plain fine-tuning at the same budget.

    python -m training.retrofit_gpt2 --preset cpu                  # the committed comparison (results/retrofit/)
    python -m training.retrofit_gpt2 --smoke                       # seconds, for tests
    python -m training.retrofit_gpt2 --arms full gates --finetune_steps 1000
    hf-spectral train retrofit_gpt2 --help

No pretrained GPT-2 can be downloaded here, so the recipe makes one:
  1. pretrain a small ``GPT2LMHeadModel`` from scratch on ``--pretrain_corpus`` (default WikiText-2, read as
     characters), once; it is saved in ``<output_dir>/pretrained-seed<seed>/`` and reused by later invocations;
  2. fine-tune copies of it on ``--finetune_corpus`` (default TinyShakespeare: a shift of domain and style),
     every arm for the same number of steps on the same batches:
       full        continued plain fine-tuning of every weight (the reference),
       gates       energy gates added (``hf_spectral.retrofit``, EGA-1, causal, α = 0) and only they train,
       lora        LoRA adapters only (PEFT), the control for "a few trainable parameters",
       gates+lora  gates and LoRA adapters together (gates through PEFT ``modules_to_save``),
       gates+full  gates added, then every weight trains.
Each arm reports the validation loss on the fine-tuning corpus, the generalisation gap, and the loss on the
pretraining corpus afterwards (how much of it was forgotten).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import sys
from dataclasses import dataclass

# Light imports only at module level: options are parsed (and --help answered) before torch, transformers,
# datasets or accelerate are imported; the functions that train import what they need.
from . import ptb_char, tinyshakespeare
from .common.data import TextCorpus, build_lm_data, encode_text, fixed_subset, load_corpus_texts, word_tokenizer
from .common.exit_codes import EXIT_INTERRUPTED
from .common.lm_experiment import tau_summary
from .common.presets import LMPreset, check_training_arguments, positive_int, recipe_prog, world_size
from .results import current_command, hardware_summary, write_results

WIKITEXT2 = TextCorpus(
    name="wikitext2",
    folder="wikitext-2",
    files={"train": "train.txt", "validation": "valid.txt", "test": "test.txt"},
    env_var="WIKITEXT2_PATH",
    urls={split: f"https://raw.githubusercontent.com/pytorch/examples/main/word_language_model/data/wikitext-2/{name}"
          for split, name in (("train", "train.txt"), ("validation", "valid.txt"), ("test", "test.txt"))},
    sha256={
        "train.txt": "9e9fa1ad55b1c2c95b08e37dd8e653f638fac2c6de904b79e813611eefbc985f",
        "valid.txt": "f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8",
        "test.txt": "d790b833ef8cf03a90db7bf1271b7520b83c45ce07ba3c1a9699df81e239eca0",
    },
    hub_dataset="wikitext",
)
CORPORA = {"wikitext2": WIKITEXT2, "tinyshakespeare": tinyshakespeare.CORPUS, "ptb_char": ptb_char.CORPUS}
HUB_DATASETS = {"wikitext2": "wikitext", "tinyshakespeare": "karpathy/tiny_shakespeare", "ptb_char": "ptb_text_only"}
ARMS = ("full", "gates", "lora", "gates+lora", "gates+full")
ARM_DESCRIPTIONS = {
    "full": "continued plain fine-tuning of every weight, no gates (the reference)",
    "gates": "energy gates added with α = 0 (the identity), then only the gates train",
    "lora": "LoRA adapters on every linear layer (c_attn, c_proj, c_fc), nothing else trains (control)",
    "gates+lora": "energy gates and LoRA adapters train together (gates through PEFT modules_to_save)",
    "gates+full": "energy gates added, then every weight trains",
}


@dataclass(frozen=True)
class RetrofitPreset:
    description: str
    num_hidden_layers: int
    num_attention_heads: int
    hidden_size: int
    context_length: int
    batch_size: int
    pretrain_steps: int
    pretrain_warmup_steps: int
    pretrain_learning_rate: float
    finetune_steps: int
    finetune_warmup_steps: int
    lr_full: float  # arms that train every weight
    lr_lora: float  # LoRA adapters
    lr_gates: float  # the gates (a few thousand parameters starting from the identity)
    lora_r: int = 8
    lora_alpha: int = 16
    dropout: float = 0.1
    eval_steps: int = 100
    eval_batches: int = 10
    final_eval_batches: int | None = None
    save_steps: int = 200
    logging_steps: int = 25
    arms: tuple = ARMS
    seeds: tuple = (0,)

    def replace(self, **changes) -> "RetrofitPreset":
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def phase(self, steps: int, warmup: int, learning_rate: float) -> LMPreset:
        """The ``LMPreset`` one training phase runs with (for ``training_arguments``)."""
        return LMPreset(
            description=self.description, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads, hidden_size=self.hidden_size,
            context_length=self.context_length, batch_size=self.batch_size, max_steps=steps, warmup_steps=warmup,
            learning_rate=learning_rate, dropout=self.dropout, eval_steps=self.eval_steps,
            eval_batches=self.eval_batches, final_eval_batches=self.final_eval_batches, save_steps=self.save_steps,
            logging_steps=self.logging_steps,
        )


PRESETS = {
    "cpu": RetrofitPreset(
        description=("GPT-2 4 layers, 4 heads, C=128, context 128, batch 16; pretrain 1500 steps (lr 1e-3), "
                     "fine-tune 400 steps per arm"),
        num_hidden_layers=4, num_attention_heads=4, hidden_size=128, context_length=128, batch_size=16,
        pretrain_steps=1500, pretrain_warmup_steps=100, pretrain_learning_rate=1e-3,
        finetune_steps=400, finetune_warmup_steps=40, lr_full=3e-4, lr_lora=1e-3, lr_gates=1e-2,
        final_eval_batches=60,
    ),
    "gpu": RetrofitPreset(
        description=("GPT-2 6 layers, 8 heads, C=256, context 256, batch 64; pretrain 5000 steps (lr 6e-4), "
                     "fine-tune 1000 steps per arm"),
        num_hidden_layers=6, num_attention_heads=8, hidden_size=256, context_length=256, batch_size=64,
        pretrain_steps=5000, pretrain_warmup_steps=300, pretrain_learning_rate=6e-4,
        finetune_steps=1000, finetune_warmup_steps=100, lr_full=1e-4, lr_lora=1e-3, lr_gates=1e-2,
        eval_steps=250, eval_batches=50, save_steps=500, logging_steps=50, seeds=(0, 1, 2),
    ),
    "smoke": RetrofitPreset(
        description="smoke test: GPT-2 2 layers, 2 heads, C=32, context 32, batch 8; 10 + 6 steps",
        num_hidden_layers=2, num_attention_heads=2, hidden_size=32, context_length=32, batch_size=8,
        pretrain_steps=10, pretrain_warmup_steps=2, pretrain_learning_rate=1e-3,
        finetune_steps=6, finetune_warmup_steps=1, lr_full=3e-4, lr_lora=1e-3, lr_gates=1e-2,
        eval_steps=3, eval_batches=2, final_eval_batches=3, save_steps=3, logging_steps=2,
    ),
}


# ------------------------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------------------------


def retrofit_tokenizer(level: str, pretrain_texts: dict, finetune_texts: dict, save_directory: str,
                       min_count: int):
    """One vocabulary for both corpora. Characters (default): every character seen at least ``min_count``
    times in the two training texts, the rest as ``<unk>``. Words: whitespace words likewise."""
    from hf_spectral import CharTokenizer

    if level == "word":
        return word_tokenizer(pretrain_texts["train"] + "\n" + finetune_texts["train"], save_directory,
                              min_frequency=min_count)
    counts = collections.Counter(pretrain_texts["train"]) + collections.Counter(finetune_texts["train"])
    kept = "".join(sorted(char for char, count in counts.items() if count >= min_count))
    return CharTokenizer.from_text(kept, save_directory, unk_token="<unk>")


def load_corpora(args, preset, tokenizer_dir):
    texts = {}
    for role in ("pretrain", "finetune"):
        name = getattr(args, f"{role}_corpus")
        data_path = getattr(args, f"{role}_data_path")
        corpus_texts = load_corpus_texts(CORPORA[name], data_path, download=not args.no_download)
        if name == "ptb_char":
            corpus_texts = {split: ptb_char.join_characters(text) for split, text in corpus_texts.items()}
        texts[role] = corpus_texts
    tokenizer = retrofit_tokenizer(args.level, texts["pretrain"], texts["finetune"], tokenizer_dir, args.min_count)
    data = {}
    for role, name in (("pretrain", args.pretrain_corpus), ("finetune", args.finetune_corpus)):
        data[role] = build_lm_data(texts[role], tokenizer, preset.context_length,
                                   validation_fraction=CORPORA[name].validation_fraction)
    unknown = {role: float((encode_text(tokenizer, texts[role]["train"][:200_000]) == tokenizer.unk_token_id).mean())
               for role in texts} if tokenizer.unk_token_id is not None else {}
    return data, tokenizer, unknown


# ------------------------------------------------------------------------------------------------------------
# Models and optimisers
# ------------------------------------------------------------------------------------------------------------


def new_gpt2(preset: RetrofitPreset, vocab_size: int, attn_implementation: str):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab_size, n_positions=preset.context_length, n_embd=preset.hidden_size,
        n_layer=preset.num_hidden_layers, n_head=preset.num_attention_heads, resid_pdrop=preset.dropout,
        embd_pdrop=preset.dropout, attn_pdrop=preset.dropout, bos_token_id=None, eos_token_id=None,
        tie_word_embeddings=True,
    )
    model = GPT2LMHeadModel(config)
    model.set_attn_implementation(attn_implementation)
    return model


def gate_config_from(args):
    from hf_spectral.retrofit import EnergyGateConfig

    return EnergyGateConfig(normalization=args.gate_normalization, energy_kind="linear", projections=1,
                            alpha_init=0.0, tau_init=0.0)


def prepare_arm(arm: str, pretrained_dir: str, preset: RetrofitPreset, args):
    """The model an arm fine-tunes, its trainable parameters set, and the gate config (or None)."""
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(pretrained_dir)
    model.set_attn_implementation(args.attn_implementation)
    gate_config = None
    if "gates" in arm:
        from hf_spectral.retrofit import add_energy_gates, mark_only_gates_trainable

        gate_config = gate_config_from(args)
        add_energy_gates(model, gate_config)
        if arm == "gates":
            mark_only_gates_trainable(model)
    if "lora" in arm:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            task_type="CAUSAL_LM", r=preset.lora_r, lora_alpha=preset.lora_alpha, lora_dropout=0.0,
            target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True,  # GPT-2 uses Conv1D layers
            modules_to_save=["energy_gate"] if gate_config else None,
        )
        model = get_peft_model(model, lora)
    return model, gate_config


def is_gate_parameter(name: str) -> bool:
    return ".energy_gate." in f".{name}"


def make_optimizer(model, preset: RetrofitPreset, arm: str):
    """AdamW with one learning rate per kind of parameter: the gates (``lr_gates``), LoRA adapters (``lr_lora``)
    and pretrained weights (``lr_full``). Weight decay only on matrices and embeddings, never on gate scalars
    (τ, α, mixing logits), as in the EGA-GPT recipes."""
    import torch

    from .common.trainer import GATE_SCALAR_PARAMETERS

    groups = {}
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        if is_gate_parameter(name):
            kind = "gates"
        elif "lora_" in name:
            kind = "lora"
        else:
            kind = "full"
        decay = parameter.ndim >= 2 and not GATE_SCALAR_PARAMETERS.search(name)
        groups.setdefault((kind, decay), []).append(parameter)
    learning_rates = {"gates": preset.lr_gates, "lora": preset.lr_lora, "full": preset.lr_full}
    return torch.optim.AdamW(
        [{"params": params, "lr": learning_rates[kind], "weight_decay": 0.1 if decay else 0.0}
         for (kind, decay), params in sorted(groups.items())],
        betas=(0.9, 0.95),
    )


def arm_learning_rate(arm: str, preset: RetrofitPreset) -> float:
    """The peak learning rate shown in logs (the largest of the arm's groups)."""
    rates = {"full": [preset.lr_full], "gates": [preset.lr_gates], "lora": [preset.lr_lora],
             "gates+lora": [preset.lr_gates, preset.lr_lora], "gates+full": [preset.lr_gates, preset.lr_full]}
    return max(rates[arm])


# ------------------------------------------------------------------------------------------------------------
# Training a phase
# ------------------------------------------------------------------------------------------------------------


def pretrain(args, preset, data, tokenizer):
    """Phase 1 (once per pretraining seed): a GPT-2 trained from scratch on the pretraining corpus."""
    from transformers import set_seed

    from .common.runs import barrier, build_trainer, data_fingerprint, final_losses, is_main_process, open_run_dir
    from .common.runs import run_settings, train_or_resume, write_json
    from .common.trainer import remove_checkpoints

    phase = preset.phase(preset.pretrain_steps, preset.pretrain_warmup_steps, preset.pretrain_learning_rate)
    # Reused by every fine-tuning arm, so only if made as this command would make it: the pretraining data and the
    # vocabulary (built from both corpora), and the options that act on pretraining.
    settings = run_settings(phase, data=data_fingerprint(tokenizer, data["pretrain"].datasets),
                            corpus=args.pretrain_corpus, level=args.level, min_count=args.min_count,
                            attn_implementation=args.attn_implementation, bf16=args.bf16)
    run_dir, done = open_run_dir(args.output_dir, f"pretrained-seed{args.pretrain_seed}", args.restart, settings)
    if done is not None:
        return run_dir, done
    set_seed(args.pretrain_seed)
    model = new_gpt2(preset, len(tokenizer), args.attn_implementation)
    curve_set = fixed_subset(data["pretrain"].datasets["validation"], preset.eval_batches * preset.batch_size)
    args_without_hub = argparse.Namespace(**{**vars(args), "push_to_hub": False})  # only fine-tuned arms are pushed
    trainer, interrupt = build_trainer(model, run_dir, phase, args.pretrain_seed, data["pretrain"].datasets["train"],
                                       curve_set, tokenizer, args_without_hub, run_name="retrofit_gpt2/pretrained")
    timing = train_or_resume(trainer, interrupt, run_dir, phase.max_steps)
    if timing is None:
        return None, None
    own = final_losses(trainer, data["pretrain"], phase)
    zero_shot = final_losses(trainer, data["finetune"], phase)
    summary = {"arm": "pretrained (no fine-tuning)", "seed": args.pretrain_seed, "steps": trainer.state.global_step,
               "parameters": sum(p.numel() for p in model.parameters()),
               "pretrain_val_loss": own["val_loss"], "pretrain_train_loss": own["train_loss"],
               "val_loss": zero_shot["val_loss"], "train_loss": zero_shot["train_loss"],
               "generalization_gap": zero_shot["generalization_gap"], **timing,
               "log_history": trainer.state.log_history, "command": current_command(), "preset": preset.to_dict()}
    trainer.save_model()
    if is_main_process():
        remove_checkpoints(run_dir)
        write_json(os.path.join(run_dir, "summary.json"), summary)
    barrier()
    return run_dir, summary


def finetune_arm(arm, seed, pretrained_dir, args, preset, data, tokenizer, runs):
    from transformers import set_seed

    from .common.runs import barrier, build_trainer, data_fingerprint, final_losses, hub_repo_id, is_main_process
    from .common.runs import open_run_dir, run_settings, train_or_resume, write_json
    from .common.trainer import remove_checkpoints

    run_name = f"{arm.replace('+', '_')}-seed{seed}"
    # The whole preset (the pretraining's numbers too: the arm starts from that model), every option with an effect
    # (the pretraining seed among them) and both corpora.
    splits = {f"{role}/{name}": split for role in ("pretrain", "finetune")
              for name, split in data[role].datasets.items()}
    settings = run_settings(preset, args, data_fingerprint(tokenizer, splits))
    run_dir, done = open_run_dir(args.output_dir, run_name, args.restart, settings, args.push_to_hub)
    if done is not None:
        return done
    set_seed(seed)
    model, gate_config = prepare_arm(arm, pretrained_dir, preset, args)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for n, p in model.named_parameters() if "original_module" not in n)
    phase = preset.phase(preset.finetune_steps, preset.finetune_warmup_steps, arm_learning_rate(arm, preset))
    curve_set = fixed_subset(data["finetune"].datasets["validation"], preset.eval_batches * preset.batch_size)
    summary = {}
    hub_model_id = hub_repo_id(args, run_name, runs)
    trainer, interrupt = build_trainer(
        model, run_dir, phase, seed, data["finetune"].datasets["train"], curve_set, tokenizer, args,
        optimizer=make_optimizer(model, preset, arm), hub_model_id=hub_model_id, run_name=f"retrofit_gpt2/{run_name}",
        model_card_fn=lambda directory, repo_id: write_arm_card(
            directory, arm, seed, preset, args, summary, gate_config, repo_id or hub_model_id or "<user>/<repo>"),
    )
    timing = train_or_resume(trainer, interrupt, run_dir, phase.max_steps)
    if timing is None:
        return None
    losses = final_losses(trainer, data["finetune"], phase,
                          {"pretrain_validation": fixed_subset(data["pretrain"].datasets["validation"],
                                                               phase.final_eval_batches and phase.final_eval_batches * phase.batch_size)})
    summary.update(arm=arm, seed=seed, steps=trainer.state.global_step, trainable_parameters=trainable,
                   total_parameters=total, **timing, **losses, pretrain_val_loss=losses["pretrain_validation_loss"])
    gates = tau_summary(model)
    if gates:
        summary["gates"] = gates
    trainer.save_model()
    if is_main_process():
        if gate_config is not None:
            gate_config.save_pretrained(run_dir)  # PEFT adapters need it to rebuild the gates before loading
            if not hasattr(model, "get_base_model"):
                from hf_spectral.retrofit import save_energy_gates

                save_energy_gates(model, os.path.join(run_dir, "energy_gates.safetensors"))
        summary.update(command=current_command(), hardware=hardware_summary(), preset=preset.to_dict(),
                       log_history=trainer.state.log_history)
        if not args.no_plots and gates:
            from .common.plots import write_gate_figures

            write_gate_figures(run_dir, model, data["finetune"].datasets["validation"], tokenizer,
                               f"retrofit arm {arm}: gate values on fine-tuning validation text (rows: layer, head)",
                               f"retrofit arm {arm}: τ and α during fine-tuning")
    if args.push_to_hub:
        trainer.push_to_hub(commit_message=f"{run_name}: end of training")
    else:
        trainer.create_model_card()
    if is_main_process():
        remove_checkpoints(run_dir)
        write_json(os.path.join(run_dir, "summary.json"), summary)
    barrier()
    return summary


def write_arm_card(directory, arm, seed, preset, args, summary, gate_config, repo_id):
    from huggingface_hub import ModelCardData

    from .common.model_card import eval_results, render_model_card, write_model_card

    rows = [("fine-tuning validation loss (nats/token)", "loss", "validation", summary.get("val_loss")),
            ("fine-tuning training loss, eval mode", "loss", "train", summary.get("train_loss")),
            ("generalisation gap (val − train)", "generalization_gap", "validation", summary.get("generalization_gap")),
            ("pretraining-corpus validation loss after fine-tuning", "loss", "validation",
             summary.get("pretrain_val_loss"))]
    sees_future = gate_config is not None and gate_config.normalization == "window"
    if sees_future:  # window statistics: every loss of the gated model saw future tokens, the model index included
        rows = [(f"{name} (sees future tokens)", kind, split, value) for name, kind, split, value in rows]
    table = "| metric | value |\n|---|---|\n" + "".join(f"| {n} | {v:.4f} |\n" for n, _, _, v in rows if v is not None)
    adapter = "lora" in arm  # saved as a PEFT adapter on the pretrained GPT-2, not as a whole model
    notes = ""
    if summary.get("gates"):
        notes = f"Learned gate threshold τ: mean {summary['gates']['tau_mean']:.3f}; slope α: mean {summary['gates']['alpha_mean']:.3f}."
    if sees_future:
        notes += (" The gates use window statistics (`--gate_normalization window`, the EGA authors'): each position's "
                  "gate is normalised over the whole sequence, future tokens included, so these losses are not those "
                  "of a causal language model.")
    model_name = f"gpt2-retrofit-{arm.replace('+', '-')}-seed{seed}"
    indexed = [(name, split, kind, value) for name, kind, split, value in rows[:3] if value is not None]
    card_data = ModelCardData(
        model_name=model_name, datasets=[HUB_DATASETS[args.finetune_corpus]],
        metrics=sorted({kind for _, _, kind, _ in indexed}),
        # PEFT's loader reads the adapter's card metadata: an adapter's library is peft
        library_name="peft" if adapter else None,
        tags=["gpt2"] + (["peft", "lora"] if adapter else []),
        eval_results=eval_results(indexed, task_type="text-generation", task_name="Character-level language modelling",
                                  dataset_id=HUB_DATASETS[args.finetune_corpus], dataset_name=args.finetune_corpus),
    )
    card = render_model_card(
        "energy_gated", card_data,
        model_name=model_name,
        summary=f"A small GPT-2, pretrained here on {args.pretrain_corpus} and fine-tuned on {args.finetune_corpus} "
                f"with the `{arm}` arm of the hf_spectral retrofit comparison.",
        size=(f"{preset.num_hidden_layers} layers, {preset.num_attention_heads} heads, C = {preset.hidden_size}, "
              f"context {preset.context_length}, {args.level}-level tokens"),
        pretrain_description=args.pretrain_corpus, pretrain_steps=preset.pretrain_steps,
        finetune_description=args.finetune_corpus, finetune_steps=preset.finetune_steps, arm=arm,
        arm_description=ARM_DESCRIPTIONS[arm],
        trainable_parameters=f"{summary.get('trainable_parameters', 0):,}",
        total_parameters=f"{summary.get('total_parameters', 0):,}",
        gate_config=json.dumps(gate_config.to_dict()) if gate_config else "",
        schedule=(f"batch {preset.batch_size}, AdamW betas (0.9, 0.95), lr {preset.lr_full} (pretrained weights) / "
                  f"{preset.lr_lora} (LoRA) / {preset.lr_gates} (gates), {preset.finetune_warmup_steps} warm-up "
                  f"steps, cosine decay, clip 1.0"),
        seed=seed, hardware=str((summary.get("hardware") or hardware_summary()).get("cpu_model")),
        wall_time=f"{summary.get('train_seconds', 0) / 60:.1f} min of fine-tuning",
        command=summary.get("command") or current_command(), results_table=table, results_notes=notes,
        repo_id=repo_id, adapter=adapter,
    )
    return write_model_card(card, directory)


# ------------------------------------------------------------------------------------------------------------
# Table
# ------------------------------------------------------------------------------------------------------------

COLUMNS = ["arm", "seeds", "trainable params", "val loss", "Δ vs full", "pretrain-corpus loss", "gap (val − train)",
           "τ (mean)", "train min / run"]


def comparison_rows(pretrained: dict, summaries: list) -> list:
    import statistics

    def pm(values, digits=4):
        values = [v for v in values if v is not None]
        if not values:
            return "", None, None
        mean = statistics.fmean(values)
        std = statistics.stdev(values) if len(values) > 1 else None
        return f"{mean:.{digits}f}" + (f" ± {std:.{digits}f}" if std is not None else ""), mean, std

    by_arm = {}
    for summary in summaries:
        by_arm.setdefault(summary["arm"], []).append(summary)
    full_mean = pm([s["val_loss"] for s in by_arm.get("full", [])])[1]
    rows = [{"arm": "pretrained (no fine-tuning)", "seeds": 1, "trainable params": "0",
             "val loss": f"{pretrained['val_loss']:.4f}", "Δ vs full": "" if full_mean is None else
             f"{full_mean - pretrained['val_loss']:+.4f}", "pretrain-corpus loss": f"{pretrained['pretrain_val_loss']:.4f}",
             "gap (val − train)": f"{pretrained['generalization_gap']:.4f}", "τ (mean)": "", "train min / run": "",
             "val_loss_mean": pretrained["val_loss"]}]
    for arm, runs in by_arm.items():
        val_text, val_mean, val_std = pm([s["val_loss"] for s in runs])
        rows.append({
            "arm": arm, "seeds": len(runs), "trainable params": f"{runs[0]['trainable_parameters']:,}",
            "val loss": val_text,
            "Δ vs full": "" if full_mean is None or arm == "full" else f"{full_mean - val_mean:+.4f}",
            "pretrain-corpus loss": pm([s.get("pretrain_val_loss") for s in runs])[0],
            "gap (val − train)": pm([s["generalization_gap"] for s in runs])[0],
            "τ (mean)": pm([s["gates"]["tau_mean"] for s in runs if s.get("gates")], 3)[0],
            "train min / run": f"{statistics.fmean(s['train_seconds'] for s in runs) / 60:.1f}",
            "val_loss_mean": val_mean, "val_loss_std": val_std,
            "delta_vs_full": None if full_mean is None or arm == "full" else full_mean - val_mean,
        })
    return rows


def write_comparison(args, preset, pretrained, summaries, unknown_rate):
    from .common.plots import plot_learning_curves

    rows = comparison_rows(pretrained, summaries)
    notes = (
        f"GPT-2 ({preset.num_hidden_layers} layers, {preset.num_attention_heads} heads, C = {preset.hidden_size}, "
        f"context {preset.context_length}, {args.level}-level) pretrained for {preset.pretrain_steps} steps on "
        f"{args.pretrain_corpus}, then each arm fine-tuned for {preset.finetune_steps} steps (batch "
        f"{preset.batch_size}, same data order per seed) on {args.finetune_corpus}. val loss: {args.finetune_corpus} "
        f"validation, nats per token, evaluation mode, mean ± std over seeds; Δ vs full = full − arm (positive: "
        f"better than continued plain fine-tuning); pretrain-corpus loss: {args.pretrain_corpus} validation after "
        f"fine-tuning (forgetting). Learning rates: {preset.lr_full} for pretrained weights, {preset.lr_lora} for "
        f"LoRA, {preset.lr_gates} for gates. Gates: EGA-1, {args.gate_normalization} statistics, α = 0 at the start."
    )
    config = {**preset.to_dict(), "pretrain_corpus": args.pretrain_corpus, "finetune_corpus": args.finetune_corpus,
              "level": args.level, "gate_normalization": args.gate_normalization, "unknown_token_rate": unknown_rate,
              "world_size": world_size()}
    paths = write_results(args.results_dir or args.output_dir, "retrofit_gpt2", rows,
                          title=f"GPT-2 retrofit: energy gates vs plain fine-tuning ({args.pretrain_corpus} → "
                                f"{args.finetune_corpus})",
                          config=config, seeds=sorted({s["seed"] for s in summaries}), notes=notes, columns=COLUMNS,
                          extra={"pretrained": {k: v for k, v in pretrained.items() if k != "log_history"},
                                 "runs": [{k: v for k, v in s.items() if k != "log_history"} for s in summaries]})
    histories = {f"{s['arm']} seed {s['seed']}": s["log_history"] for s in summaries if s.get("log_history")}
    if histories and not args.no_plots:
        plot_learning_curves(histories, os.path.join(args.results_dir or args.output_dir, "retrofit_gpt2_curves.png"),
                             f"Fine-tuning on {args.finetune_corpus}: validation loss per arm")
    return rows, paths


# ------------------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------------------


def build_parser():
    parser = argparse.ArgumentParser(prog=recipe_prog("retrofit_gpt2"), description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu",
                        help="; ".join(f"{name}: {p.description}" for name, p in PRESETS.items()))
    parser.add_argument("--smoke", action="store_true", help="tiny model, a few steps (< 1 minute)")
    parser.add_argument("--arms", nargs="+", choices=ARMS, help="fine-tuning arms (default: all)")
    parser.add_argument("--seeds", type=int, nargs="+", help="fine-tuning seeds (default: the preset's)")
    parser.add_argument("--pretrain_seed", type=int, default=0)
    group = parser.add_argument_group("data")
    group.add_argument("--pretrain_corpus", choices=sorted(CORPORA), default="wikitext2")
    group.add_argument("--finetune_corpus", choices=sorted(CORPORA), default="tinyshakespeare")
    group.add_argument("--pretrain_data_path", help="file or folder of the pretraining corpus (else its environment "
                       "variable, $HF_SPECTRAL_DATA, or a download)")
    group.add_argument("--finetune_data_path", help="file or folder of the fine-tuning corpus")
    group.add_argument("--level", choices=["char", "word"], default="char", help="tokens: characters or words")
    group.add_argument("--min_count", type=int, default=20,
                       help="characters / words seen fewer times in the two training texts become <unk> (default 20)")
    group.add_argument("--no_download", action="store_true")
    group = parser.add_argument_group("model and schedule (override the preset)")
    for name, kind in (("num_hidden_layers", int), ("num_attention_heads", int), ("hidden_size", int),
                       ("context_length", int), ("batch_size", int), ("pretrain_steps", int),
                       ("pretrain_learning_rate", float), ("finetune_steps", int), ("lr_full", float),
                       ("lr_lora", float), ("lr_gates", float), ("lora_r", int), ("eval_steps", int),
                       ("final_eval_batches", int), ("save_steps", int), ("dropout", float)):
        group.add_argument(f"--{name}", type=kind)
    group.add_argument("--gate_normalization", choices=["causal", "window", "none"], default="causal",
                       help="energy statistics of the retrofitted gates (default causal; window sees the future)")
    group.add_argument("--attn_implementation", default="sdpa", choices=["sdpa", "eager"])
    group.add_argument("--threads", type=positive_int)
    group.add_argument("--bf16", action="store_true")
    group.add_argument("--report_to", default="none")
    group = parser.add_argument_group("output, checkpoints, Hub")
    group.add_argument("--output_dir", help="default: runs/retrofit_gpt2-<preset>")
    group.add_argument("--results_dir", help="where the comparison table goes (default: --output_dir)")
    group.add_argument("--restart", action="store_true",
                       help="discard existing checkpoints and results of the runs (the pretraining's too)")
    group.add_argument("--stop_after_steps", type=positive_int,
                       help="stop each phase with a checkpoint after this many steps")
    group.add_argument("--no_plots", action="store_true")
    group.add_argument("--push_to_hub", action="store_true", help="push each fine-tuned arm to the Hub")
    group.add_argument("--hub_model_id")
    group.add_argument("--hub_token")
    group.add_argument("--hub_private_repo", action="store_true", default=None)
    group.add_argument("--hub_strategy", default="every_save", choices=["end", "every_save", "checkpoint", "all_checkpoints"])
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    preset_name = "smoke" if args.smoke else args.preset
    overrides = {f: getattr(args, f) for f in RetrofitPreset.__dataclass_fields__ if hasattr(args, f) and f != "seeds"}
    preset = PRESETS[preset_name].replace(**overrides)
    if args.seeds:
        preset = preset.replace(seeds=tuple(args.seeds))
    if args.arms:
        preset = preset.replace(arms=tuple(dict.fromkeys(args.arms)))
    if preset.hidden_size % preset.num_attention_heads:
        parser.error(f"--hidden_size {preset.hidden_size} is not divisible by --num_attention_heads {preset.num_attention_heads}")
    for name in ("pretrain_steps", "finetune_steps", "batch_size", "context_length"):
        if getattr(preset, name) <= 0:
            parser.error(f"--{name} must be positive")
    if args.pretrain_corpus == args.finetune_corpus:
        print(f"note: pretraining and fine-tuning on the same corpus ({args.pretrain_corpus})", flush=True)

    from .common.runs import is_main_process, prepare_recipe

    check_training_arguments(parser, preset.phase(preset.pretrain_steps, preset.pretrain_warmup_steps,
                                                  preset.pretrain_learning_rate), args)
    args.output_dir, corpora = prepare_recipe(args, "retrofit_gpt2", preset_name, preset, load_corpora)
    if corpora is None:
        return 2
    data, tokenizer, unknown = corpora
    print(f"vocabulary {len(tokenizer)} ({args.level}); unknown-token rate {unknown}; pretrain "
          f"{data['pretrain'].tokens}, fine-tune {data['finetune'].tokens} tokens", flush=True)

    pretrained_dir, pretrained = pretrain(args, preset, data, tokenizer)
    if pretrained is None:
        return EXIT_INTERRUPTED
    runs = len(preset.arms) * len(preset.seeds)
    summaries = []
    for seed in preset.seeds:
        for arm in preset.arms:
            summary = finetune_arm(arm, seed, pretrained_dir, args, preset, data, tokenizer, runs)
            if summary is None:
                return EXIT_INTERRUPTED
            summaries.append(summary)
    if is_main_process():
        rows, paths = write_comparison(args, preset, pretrained, summaries, unknown)
        print(open(paths[1], encoding="utf-8").read().split("## Provenance")[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
