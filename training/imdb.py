"""IMDB sentiment (Maas et al. 2011, 25k / 25k labelled reviews): a bidirectional CHIAR-Former encoder against the
same-size all-attention encoder (SPEC 2.3).

    python -m training.imdb --preset cpu                                   # short reviews, CPU scale
    python -m training.imdb --preset authors --bf16                        # 256 BPE tokens, as the authors
    python -m training.imdb --tokenizer bytes --context_length 4000        # Long Range Arena's text task
    hf-spectral train imdb --help

Data: ``train.jsonl.gz`` / ``test.jsonl.gz`` (``{"text", "label"}`` per line; the project's shared data layout) in
``--data_path``, ``$IMDB_PATH`` or ``$HF_SPECTRAL_DATA/imdb/``; or the Hub dataset ``stanfordnlp/imdb``
(``--dataset_name``). ``--validation_examples`` reviews are held out of the training split (a fixed random
choice) for the validation curve; the accuracy is measured on the whole test split (``--max_test_examples`` takes a
fixed random subset instead, stated in the results). Reviews longer than ``--context_length`` tokens keep their
first tokens (the authors: 256 GPT-2 BPE tokens; LRA: 4,000 bytes). ``<br />`` tags become spaces.

Tokenizer (``--tokenizer``): ``bpe`` (default: a byte-level BPE of ``--bpe_vocab_size`` ids trained on the training
reviews), ``bytes`` (one id per UTF-8 byte, LRA), or any local folder via ``--tokenizer_name_or_path``.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import sys

from .common.chiar_experiment import ChiarTask, TaskData, run_recipe
from .common.presets import LMPreset, positive_int

PRESETS = {
    "authors": LMPreset(
        description="authors' IMDB setup (SPEC 2.3): 4 layers, d=256, 4 heads, 256 BPE tokens, batch 32, lr 1e-4",
        num_hidden_layers=4, num_attention_heads=4, hidden_size=256, context_length=256, batch_size=32,
        max_steps=7000, warmup_steps=500, learning_rate=1e-4, weight_decay=0.01, adam_beta2=0.999,
        lr_scheduler_type="linear", dropout=0.1, eval_steps=500, eval_batches=16, save_steps=1000, logging_steps=50,
        variants=("attention", "threshold", "hard", "3op"),
    ),
    "cpu": LMPreset(
        description="CPU scale: 4 layers, d=64, 4 heads, first 128 BPE tokens (4096 ids), batch 16, 60 steps, lr 3e-3",
        num_hidden_layers=4, num_attention_heads=4, hidden_size=64, context_length=128, batch_size=16,
        max_steps=60, warmup_steps=6, learning_rate=3e-3, weight_decay=0.01, dropout=0.0, eval_steps=15,
        eval_batches=2, save_steps=1000, logging_steps=10, variants=("attention", "threshold", "hard", "3op"),
    ),
    "smoke": LMPreset(
        description="smoke test: 3 layers, d=32, 2 heads, 32 tokens, batch 4, 6 steps",
        num_hidden_layers=3, num_attention_heads=2, hidden_size=32, context_length=32, batch_size=4, max_steps=6,
        warmup_steps=1, eval_steps=3, eval_batches=2, save_steps=3, logging_steps=2, variants=("attention", "threshold"),
    ),
}


def add_arguments(parser):
    group = parser.add_argument_group("data and tokenizer")
    group.add_argument("--data_path", help="folder with train.jsonl.gz and test.jsonl.gz")
    group.add_argument("--dataset_name", help="read from this Hub dataset instead (e.g. stanfordnlp/imdb)")
    group.add_argument("--dataset_config", help="its configuration")
    group.add_argument("--tokenizer", choices=["bpe", "bytes"], default="bpe")
    group.add_argument("--tokenizer_name_or_path", help="a local tokenizer folder instead")
    group.add_argument("--bpe_vocab_size", type=positive_int,
                       help="ids of the trained BPE (default 8192; cpu 4096; smoke 512)")
    group.add_argument("--validation_examples", type=positive_int, default=1000,
                       help="training reviews held out for the validation curve (default 1000)")
    group.add_argument("--max_train_examples", type=positive_int, help="a fixed random subset of the training reviews")
    group.add_argument("--max_test_examples", type=positive_int, help="a fixed random subset of the test reviews "
                       "(default: the whole test split; 64 with --smoke, which also takes 512 training and at most 64 "
                       "validation reviews unless given)")
    group.add_argument("--keep_html", action="store_true", help="keep the <br /> tags")


def read_jsonl_gz(path: str) -> list:
    rows = []
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "text" not in row or row.get("label") not in (0, 1):
                raise ValueError(f"{path}:{number}: expected {{'text': str, 'label': 0 or 1}}")
            rows.append((row["text"], int(row["label"])))
    return rows


def load_reviews(args) -> dict:
    """{"train": [(text, label)], "test": [...]} from the Hub or a local folder."""
    if args.dataset_name:
        import datasets

        loaded = datasets.load_dataset(args.dataset_name, args.dataset_config)
        return {split: list(zip(loaded[split]["text"], loaded[split]["label"])) for split in ("train", "test")}
    candidates = [args.data_path] if args.data_path else [
        p for p in (os.environ.get("IMDB_PATH"),
                    os.environ.get("HF_SPECTRAL_DATA") and os.path.join(os.environ["HF_SPECTRAL_DATA"], "imdb")) if p]
    for folder in candidates:
        paths = {split: os.path.join(folder, f"{split}.jsonl.gz") for split in ("train", "test")}
        if all(os.path.isfile(p) for p in paths.values()):
            return {split: read_jsonl_gz(path) for split, path in paths.items()}
    raise FileNotFoundError(f"IMDB: no train.jsonl.gz and test.jsonl.gz in {candidates or 'any folder'}; pass "
                            "--data_path, set $IMDB_PATH or $HF_SPECTRAL_DATA, or use --dataset_name stanfordnlp/imdb")


def subset(rows: list, count: int | None, seed: int) -> list:
    if count is None or count >= len(rows):
        return rows
    return random.Random(seed).sample(rows, count)


def load_data(args, preset, tokenizer_dir):
    from .common.bpe import byte_tokenizer, load_tokenizer, train_bpe_tokenizer
    from .common.classification import PadCollator, accuracy_metrics, split_accuracy_evaluation, tokenized_dataset

    reviews = load_reviews(args)
    if getattr(args, "smoke", False):  # a check of the pipeline, not a measurement: small subsets unless given
        args.max_train_examples = 512 if args.max_train_examples is None else args.max_train_examples
        args.max_test_examples = 64 if args.max_test_examples is None else args.max_test_examples
        args.validation_examples = min(args.validation_examples, 64)
    clean = (lambda text: text) if args.keep_html else (lambda text: text.replace("<br />", " "))
    train = [(clean(t), y) for t, y in reviews["train"]]
    test = [(clean(t), y) for t, y in subset(reviews["test"], args.max_test_examples, seed=1)]
    order = list(range(len(train)))
    random.Random(0).shuffle(order)  # the files are sorted by label: hold out a random, fixed choice
    if not 0 < args.validation_examples < len(train):
        raise ValueError(f"--validation_examples must be in (0, {len(train)}), got {args.validation_examples}")
    validation = [train[i] for i in order[: args.validation_examples]]
    train = subset([train[i] for i in order[args.validation_examples:]], args.max_train_examples, seed=2)

    if args.tokenizer_name_or_path:
        tokenizer, description = load_tokenizer(args.tokenizer_name_or_path), f"local {args.tokenizer_name_or_path}"
    elif args.tokenizer == "bytes":
        tokenizer, description = byte_tokenizer(tokenizer_dir), "UTF-8 bytes (Long Range Arena text task)"
    else:
        vocab = args.bpe_vocab_size or (512 if args.smoke else 4096 if args.preset == "cpu" else 8192)
        tokenizer = train_bpe_tokenizer([t for t, _ in train], vocab, tokenizer_dir)
        description = f"byte-level BPE, {len(tokenizer)} ids, trained on the training reviews"

    def encode(texts):
        return tokenizer(texts, add_special_tokens=False)["input_ids"]

    sets = {name: tokenized_dataset([t for t, _ in rows], [y for _, y in rows], encode, preset.context_length)
            for name, rows in (("train", train), ("validation", validation), ("test", test))}
    truncated = {name: int(sum(length > preset.context_length for length in ds["length"])) for name, ds in sets.items()}
    info = {"examples": {name: len(ds) for name, ds in sets.items()}, "truncated_to_max_length": truncated,
            "max_length": preset.context_length, "tokenizer": description,
            "test_subset": args.max_test_examples is not None and args.max_test_examples < len(reviews["test"])}

    return TaskData(datasets=sets, tokenizer=tokenizer, collator=PadCollator(tokenizer.pad_token_id), info=info,
                    num_labels=2, evaluate=split_accuracy_evaluation(), compute_metrics=accuracy_metrics,
                    sample=sets["validation"][0]["input_ids"][:64])


TASK = ChiarTask(
    recipe="imdb", title="IMDB", kind="classification", hub_dataset="stanfordnlp/imdb",
    dataset_description=("IMDB Large Movie Review Dataset v1.0: 25,000 training reviews (minus the held-out "
                         "validation reviews) and the 25,000 test reviews, first tokens of each review"),
    paper={"attention": "84.96%", "hard": "83.72% (DCT+Attn)"},
    paper_metric="IMDB test accuracy, GPT-2 BPE truncated to 256 tokens",
    primary="test_accuracy", higher_is_better=True, load_data=load_data, add_arguments=add_arguments,
    presets=PRESETS, default_preset="cpu",
)


def main(argv=None) -> int:
    return run_recipe(argv, TASK, __doc__)


if __name__ == "__main__":
    sys.exit(main())
