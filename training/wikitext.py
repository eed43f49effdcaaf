"""WikiText-2 / WikiText-103 language modelling: CHIAR-Former arms against the same-size all-attention model
(SPEC 2.3).

    python -m training.wikitext --preset cpu                                  # WikiText-2, CPU scale
    python -m training.wikitext --arms attention threshold hard 3op threshold@all --seeds 0 1 2
    python -m training.wikitext --preset authors --bf16                      # the authors' small config (GPU)
    python -m training.wikitext --corpus wikitext-103 --dataset_name Salesforce/wikitext \\
        --dataset_config wikitext-103-v1 --preset authors --max_steps 36000
    python -m training.wikitext --evaluate_model runs/wikitext-cpu/threshold-seed0 --data_path only_test_folder/
    hf-spectral train wikitext --help

Data: a folder in the official layout (``wiki.{train,valid,test}.tokens``) or the pytorch/examples names
(``{train,valid,test}.txt``), given by ``--data_path``, ``$WIKITEXT2_PATH`` / ``$WIKITEXT103_PATH`` or
``$HF_SPECTRAL_DATA/wikitext-2/`` (``wikitext-103/``); or the Hub dataset ``Salesforce/wikitext`` with
``--dataset_name``. For evaluation a folder may hold only some of the splits.

Tokenizer: a byte-level BPE (``--bpe_vocab_size`` ids, GPT-2's pre-tokenizer) trained with ``tokenizers`` on the
training split and saved with every model as a ``PreTrainedTokenizerFast``; or any local tokenizer folder
(``--tokenizer_name_or_path``). Perplexity is reported per token (depends on the tokenizer) and per word
(exp(total NLL / words), words = whitespace-separated tokens plus one end of line per line, the official
WikiText token count), so that numbers compare across tokenizers.
"""

from __future__ import annotations

import math
import os
import sys

from .common.chiar_experiment import ChiarTask, TaskData, run_recipe
from .common.presets import LMPreset, positive_int

CORPORA = {
    "wikitext-2": {"folder": "wikitext-2", "env": "WIKITEXT2_PATH", "hub": ("Salesforce/wikitext", "wikitext-2-v1")},
    "wikitext-103": {"folder": "wikitext-103", "env": "WIKITEXT103_PATH",
                     "hub": ("Salesforce/wikitext", "wikitext-103-v1")},
}
SPLIT_FILES = {"train": ("wiki.train.tokens", "train.txt"), "validation": ("wiki.valid.tokens", "valid.txt"),
               "test": ("wiki.test.tokens", "test.txt")}

PRESETS = {
    # SPEC 2.3: the CHIAR authors' small config (d 256, 4 heads, context 256, batch 128, lr 1e-4, wd 0.01,
    # warm-up 500, 10 epochs: ≈ 800 steps on WikiText-2 with a GPT-2-sized BPE; set --max_steps for WikiText-103).
    "authors": LMPreset(
        description="CHIAR authors' config (SPEC 2.3): 4 layers, d=256, 4 heads, context 256, batch 128, lr 1e-4, "
                    "wd 0.01, 500 warm-up, 800 steps (≈ 10 epochs of WikiText-2)",
        num_hidden_layers=4, num_attention_heads=4, hidden_size=256, context_length=256, batch_size=128,
        max_steps=800, warmup_steps=500, learning_rate=1e-4, weight_decay=0.01, adam_beta2=0.999,
        lr_scheduler_type="linear", dropout=0.1, eval_steps=100, eval_batches=8, save_steps=200, logging_steps=20,
        variants=("attention", "threshold", "hard", "3op"),
    ),
    # The CPU reproduction (results/chiar/): the authors' width and depth, shorter context and far fewer steps.
    "cpu": LMPreset(
        description="CPU scale: 4 layers, d=64, 4 heads, context 128, batch 8, 60 steps, lr 3e-3, BPE 2048",
        num_hidden_layers=4, num_attention_heads=4, hidden_size=64, context_length=128, batch_size=8,
        max_steps=60, warmup_steps=6, learning_rate=3e-3, weight_decay=0.01, dropout=0.0, eval_steps=15,
        eval_batches=2, final_eval_batches=10, save_steps=1000, logging_steps=10,
        variants=("attention", "threshold", "hard", "3op"),
    ),
    "smoke": LMPreset(
        description="smoke test: 3 layers (DCT / routed / attention), d=32, 2 heads, context 32, batch 4, 6 steps",
        num_hidden_layers=3, num_attention_heads=2, hidden_size=32, context_length=32, batch_size=4, max_steps=6,
        warmup_steps=1, eval_steps=3, eval_batches=2, final_eval_batches=3, save_steps=3, logging_steps=2,
        variants=("attention", "threshold"),
    ),
}

PAPER = {"attention": "75.19", "hard": "83.81 (DCT+Attn)"}
PAPER_103 = {"attention": "66.62 (val)", "hard": "36.54 (val)", "threshold": "40.55 (val)"}


def add_arguments(parser):
    group = parser.add_argument_group("data and tokenizer")
    group.add_argument("--corpus", choices=sorted(CORPORA), default="wikitext-2")
    group.add_argument("--data_path", help="folder with wiki.{train,valid,test}.tokens or {train,valid,test}.txt")
    group.add_argument("--dataset_name", help="read from this Hub dataset instead (e.g. Salesforce/wikitext)")
    group.add_argument("--dataset_config", help="its configuration (e.g. wikitext-103-v1, wikitext-2-raw-v1)")
    group.add_argument("--text_column", default="text")
    group.add_argument("--tokenizer_name_or_path", help="a local tokenizer folder instead of training a BPE")
    group.add_argument("--bpe_vocab_size", type=positive_int,
                       help="ids of the trained BPE (default: authors preset 50257 as GPT-2, cpu 2048, smoke 512)")
    group.add_argument("--evaluate_model", metavar="MODEL_DIR",
                       help="no training: evaluate this saved model (with its tokenizer) on the splits found")


def find_split_files(folder: str) -> dict:
    found = {}
    for split, names in SPLIT_FILES.items():
        for name in names:
            if os.path.isfile(os.path.join(folder, name)):
                found[split] = os.path.join(folder, name)
                break
    return found


def load_texts(args, need_train: bool = True) -> dict:
    """{split: text} from the Hub or a local folder (see the module docstring)."""
    corpus = CORPORA[args.corpus]
    if args.dataset_name:
        import datasets

        loaded = datasets.load_dataset(args.dataset_name, args.dataset_config)
        texts = {}
        for split, rows in loaded.items():
            lines = rows[args.text_column]
            joined = "".join(lines) if lines and all(line.endswith("\n") or not line for line in lines[:100]) else "\n".join(lines)
            texts["validation" if split in ("valid", "val", "dev") else split] = joined
        return texts
    candidates = [args.data_path] if args.data_path else []
    if not args.data_path:
        if os.environ.get(corpus["env"]):
            candidates.append(os.environ[corpus["env"]])
        if os.environ.get("HF_SPECTRAL_DATA"):
            candidates.append(os.path.join(os.environ["HF_SPECTRAL_DATA"], corpus["folder"]))
    for folder in candidates:
        files = find_split_files(folder) or find_split_files(os.path.join(folder, corpus["folder"]))
        if files:
            break
    else:
        raise FileNotFoundError(
            f"{args.corpus}: no wiki.{{train,valid,test}}.tokens or {{train,valid,test}}.txt found in "
            f"{candidates or 'any folder'}; pass --data_path, set ${corpus['env']} or $HF_SPECTRAL_DATA, or use "
            f"--dataset_name {corpus['hub'][0]} --dataset_config {corpus['hub'][1]}")
    required = ("train", "validation") if need_train else ()
    missing = [split for split in required if split not in files]
    if missing:
        raise FileNotFoundError(f"{folder}: training needs the {' and '.join(missing)} split(s) "
                                f"({', '.join(SPLIT_FILES[s][0] for s in missing)}); found {sorted(files)}")
    texts = {}
    for split, path in files.items():
        with open(path, encoding="utf-8") as handle:
            texts[split] = handle.read()
        if not texts[split].strip():
            raise ValueError(f"{path} is empty")
    return texts


def count_words(text: str) -> int:
    """Whitespace-separated tokens plus one end of line per line: the official WikiText token count."""
    return len(text.split()) + text.count("\n")


def build_tokenizer(args, texts: dict, tokenizer_dir: str, smoke: bool):
    from .common.bpe import load_tokenizer, train_bpe_tokenizer

    if args.tokenizer_name_or_path:
        return load_tokenizer(args.tokenizer_name_or_path), f"local tokenizer {args.tokenizer_name_or_path}"
    vocab = args.bpe_vocab_size or {"smoke": 512, "authors": 50257}.get("smoke" if smoke else args.preset, 2048 if args.preset == "cpu" else 8192)
    tokenizer = train_bpe_tokenizer(texts["train"].splitlines(keepends=True), vocab, tokenizer_dir)
    return tokenizer, f"byte-level BPE, {len(tokenizer)} ids, trained on the {args.corpus} training split"


def lm_task_data(texts: dict, tokenizer, tokenizer_description: str, block_size: int) -> TaskData:
    import datasets

    from .common.data import encode_text, pack_blocks
    from .common.trainer import collate_blocks, lm_compute_metrics, token_nll

    encoded = {split: encode_text(tokenizer, text) for split, text in texts.items()}
    packed = {split: datasets.Dataset.from_dict({"input_ids": pack_blocks(ids, block_size).tolist()}).with_format("torch")
              for split, ids in encoded.items()}
    tokens = {split: len(ids) for split, ids in encoded.items()}
    characters = {split: len(text) for split, text in texts.items()}
    words = {split: count_words(text) for split, text in texts.items()}
    info = {"tokens": tokens, "words": words, "characters": characters, "tokenizer": tokenizer_description,
            "blocks": {split: len(ds) for split, ds in packed.items()}}
    first = packed.get("validation", next(iter(packed.values())))
    sample = first[0]["input_ids"][:64].tolist()

    def evaluate(trainer, model, task_data, preset, args):
        return evaluate_splits(trainer, task_data, preset.final_eval_batches and preset.final_eval_batches * preset.batch_size)

    chars_per_token = characters["validation"] / tokens["validation"] if "validation" in tokens else 1.0
    return TaskData(datasets=packed, tokenizer=tokenizer, collator=collate_blocks, info=info, evaluate=evaluate,
                    compute_metrics=lm_compute_metrics(chars_per_token), preprocess_logits=token_nll, sample=sample)


def evaluate_splits(trainer, task_data: TaskData, limit: int | None) -> dict:
    """Loss, perplexity per token and per word, bits per character of the validation and test splits."""
    from .common.data import fixed_subset

    info = task_data.info
    sets = {split: fixed_subset(task_data.datasets[split], limit) for split in ("validation", "test")
            if split in task_data.datasets}
    metrics = trainer.evaluate(eval_dataset=sets)
    result = {}
    for split, dataset in sets.items():
        loss = metrics[f"eval_{split}_loss"]
        tokens_per_word = (info["tokens"][split] - 1) / info["words"][split]
        result.update({
            f"{split}_loss": loss, f"{split}_perplexity": math.exp(loss),
            f"{split}_perplexity_per_word": math.exp(loss * tokens_per_word),
            f"{split}_bits_per_char": loss * (info["tokens"][split] - 1) / info["characters"][split] / math.log(2),
            f"{split}_blocks": len(dataset),
        })
    return result


def load_data(args, preset, tokenizer_dir):
    texts = load_texts(args)
    tokenizer, description = build_tokenizer(args, texts, tokenizer_dir, smoke=args.smoke)
    return lm_task_data(texts, tokenizer, description, preset.context_length)


def evaluate_saved_model(args) -> int:
    """``--evaluate_model``: perplexities of a saved model on whichever splits the data holds."""
    import json

    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    import hf_spectral  # noqa: F401  (registers the architecture)

    from .common.bpe import load_tokenizer
    from .common.trainer import collate_blocks, lm_compute_metrics, token_nll

    if args.threads:
        torch.set_num_threads(args.threads)
    texts = load_texts(args, need_train=False)
    texts = {split: text for split, text in texts.items() if split != "train"}
    if not texts:
        raise SystemExit("error: no validation or test split found to evaluate")
    model = AutoModelForCausalLM.from_pretrained(args.evaluate_model)
    tokenizer = load_tokenizer(args.tokenizer_name_or_path or args.evaluate_model)
    length = args.context_length or model.config.max_position_embeddings
    data = lm_task_data(texts, tokenizer, "saved with the model", length)
    output_dir = args.output_dir or os.path.join(args.evaluate_model, "evaluation")
    trainer = Trainer(model=model, args=TrainingArguments(output_dir=output_dir, per_device_eval_batch_size=args.batch_size or 8,
                                                          report_to="none"),
                      data_collator=collate_blocks, compute_metrics=lm_compute_metrics(), preprocess_logits_for_metrics=token_nll)
    result = evaluate_splits(trainer, data, args.final_eval_batches and args.final_eval_batches * (args.batch_size or 8))
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, "evaluation.json"), "w", encoding="utf-8") as handle:
        json.dump({"model": args.evaluate_model, "data": data.info, **result}, handle, indent=2)
    for key, value in result.items():
        print(f"{key:<32} {value:.4f}" if isinstance(value, float) else f"{key:<32} {value}")
    return 0


def task_for(corpus: str) -> ChiarTask:
    wt2 = corpus == "wikitext-2"
    return ChiarTask(
        recipe="wikitext", title="WikiText-2" if wt2 else "WikiText-103", kind="lm",
        hub_dataset="Salesforce/wikitext",
        dataset_description=(f"{'WikiText-2' if wt2 else 'WikiText-103'} (v1, tokenized), the benchmark's train / valid "
                             "/ test splits, packed into blocks of the context length overlapping by one token"),
        paper=PAPER if wt2 else PAPER_103,
        paper_metric=("WikiText-2 test perplexity per GPT-2 BPE token, 10 epochs" if wt2
                      else "WikiText-103 validation perplexity per GPT-2 BPE token"),
        primary="test_perplexity_per_word", higher_is_better=False, load_data=load_data,
        add_arguments=add_arguments, presets=PRESETS, default_preset="cpu",
    )


def main(argv=None) -> int:
    from .common.chiar_experiment import build_parser

    argv = list(sys.argv[1:] if argv is None else argv)
    # The corpus names the task (title, paper numbers) and --evaluate_model the mode: read as the recipe's own parser
    # reads them (--corpus=..., abbreviations), not by looking for the strings (an --output_dir may be "wikitext-103").
    args, _ = build_parser(task_for("wikitext-2"), __doc__).parse_known_args(argv)
    task = task_for(args.corpus)
    if args.evaluate_model:
        args, _ = build_parser(task, __doc__).parse_known_args(argv)
        return evaluate_saved_model(args)
    return run_recipe(argv, task, __doc__)


if __name__ == "__main__":
    sys.exit(main())
