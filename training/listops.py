"""ListOps (Nangia & Bowman 2018; Long Range Arena): a bidirectional CHIAR-Former encoder against the same-size
all-attention encoder, accuracy overall and per nesting depth (SPEC 2.3).

    python -m training.listops --preset cpu                                   # generated, original settings
    python -m training.listops --train_file train_d20s.tsv --test_file test_d20s.tsv   # released files
    python -m training.listops --setting lra --context_length 2000 --preset authors    # LRA-style data
    hf-spectral train listops --help

Data: files in either released format (original: ``LABEL<TAB>EXPRESSION``; LRA: a ``Source<TAB>Target`` header,
then ``EXPRESSION<TAB>LABEL``), given per split with ``--train_file`` / ``--validation_file`` / ``--test_file``;
any split not given is generated (``training/listops_data.py``, ``--setting original`` or ``lra``, seeded by
``--data_seed``; generated files are written to ``<output_dir>/data/``). Every label read or generated is checked by
the independent evaluator first. Without ``--validation_file``, generated validation data is used.

Input: the expression's tokens without the ``(`` ``)`` bracketing (``--keep_brackets`` keeps them). Training
examples longer than ``--context_length`` tokens are left out; validation and test examples are truncated to it
and counted in the results (a truncated expression is not solvable).
"""

from __future__ import annotations

import os
import sys

from .common.chiar_experiment import ChiarTask, TaskData, run_recipe
from .common.presets import LMPreset, positive_int

PRESETS = {
    "authors": LMPreset(
        description="4 layers, d=256, 4 heads, 512 tokens, batch 32, lr 1e-4, 5000 steps",
        num_hidden_layers=4, num_attention_heads=4, hidden_size=256, context_length=512, batch_size=32,
        max_steps=5000, warmup_steps=500, learning_rate=1e-4, weight_decay=0.01, adam_beta2=0.999,
        lr_scheduler_type="linear", dropout=0.1, eval_steps=500, eval_batches=16, save_steps=1000, logging_steps=50,
        variants=("attention", "threshold", "hard", "3op"),
    ),
    "cpu": LMPreset(
        description="CPU scale: 4 layers, d=64, 4 heads, 64 tokens, batch 16, 80 steps, lr 3e-3",
        num_hidden_layers=4, num_attention_heads=4, hidden_size=64, context_length=64, batch_size=16,
        max_steps=80, warmup_steps=8, learning_rate=3e-3, weight_decay=0.01, dropout=0.0, eval_steps=20,
        eval_batches=2, save_steps=1000, logging_steps=10, variants=("attention", "threshold", "hard", "3op"),
    ),
    "smoke": LMPreset(
        description="smoke test: 3 layers, d=32, 2 heads, 64 tokens, batch 8, 6 steps",
        num_hidden_layers=3, num_attention_heads=2, hidden_size=32, context_length=64, batch_size=8, max_steps=6,
        warmup_steps=1, eval_steps=3, eval_batches=2, save_steps=3, logging_steps=2, variants=("attention", "threshold"),
    ),
}
GENERATED_SIZES = {"smoke": (400, 64, 128), "cpu": (10_000, 500, 1_000)}  # else the setting's own sizes


def add_arguments(parser):
    group = parser.add_argument_group("data")
    group.add_argument("--train_file", help="training examples (either released TSV format)")
    group.add_argument("--validation_file", help="validation examples")
    group.add_argument("--test_file", help="test examples")
    group.add_argument("--setting", choices=["original", "lra"], default="original",
                       help="generator settings for the splits not given as files (default: original)")
    group.add_argument("--generate_sizes", type=positive_int, nargs=3, metavar=("TRAIN", "VALIDATION", "TEST"),
                       help="generated examples per split (default: cpu 10000 500 1000; smoke 400 64 128; "
                            "else the setting's: original 90000 1000 10000, lra 96000 2000 2000)")
    group.add_argument("--data_seed", type=int, default=0, help="seed of the generator (default 0)")
    group.add_argument("--keep_brackets", action="store_true", help="keep the ( ) bracketing tokens in the input")


def listops_tokenizer(save_directory: str | None = None):
    """Word-level ``PreTrainedTokenizerFast`` over the 17 ListOps symbols, plus padding and unknown."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from .listops_data import VOCABULARY

    vocab = {"[PAD]": 0, "[UNK]": 1, **{token: index + 2 for index, token in enumerate(VOCABULARY)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]")
    if save_directory:
        tokenizer.save_pretrained(save_directory)
    return tokenizer


def load_examples(args, preset_name: str, output_dir: str) -> tuple[dict, dict]:
    """{split: [(label, expression)]} from the files given and the generator; every label checked."""
    from .listops_data import SETTINGS, SPLITS, check_labels, generate, read_tsv, write_tsv

    given = {"train": args.train_file, "validation": args.validation_file, "test": args.test_file}
    examples, sources = {}, {}
    for split, path in given.items():
        if path:
            examples[split] = read_tsv(path)
            sources[split] = os.path.abspath(path)
    missing = [split for split in SPLITS if split not in examples]
    if missing:
        setting = SETTINGS[args.setting]
        sizes = tuple(args.generate_sizes or GENERATED_SIZES.get(preset_name, setting.sizes))
        generated = generate(setting, sizes, seed=args.data_seed)
        folder = os.path.join(output_dir, "data")
        for split, name in zip(SPLITS, setting.files):
            if split in missing:
                examples[split] = generated[split]
                path = os.path.join(folder, name)
                write_tsv(path, generated[split], setting.header)
                sources[split] = f"generated ({args.setting} settings, seed {args.data_seed}): {path}"
    for split, rows in examples.items():
        mismatches = check_labels(rows)
        if mismatches:
            index, label, value = mismatches[0]
            raise ValueError(f"ListOps {split} ({sources[split]}): {len(mismatches)} of {len(rows)} labels disagree "
                             f"with the evaluator (first: example {index}, label {label}, evaluates to {value})")
    return examples, sources


def load_data(args, preset, tokenizer_dir):
    from .common.classification import PadCollator, accuracy_metrics, split_accuracy_evaluation, tokenized_dataset
    from .listops_data import BRACKETS, evaluate_expression

    output_dir = os.path.dirname(tokenizer_dir)
    preset_name = "smoke" if args.smoke else args.preset
    examples, sources = load_examples(args, preset_name, output_dir)
    tokenizer = listops_tokenizer(tokenizer_dir)

    def text_of(expression: str) -> str:
        return expression if args.keep_brackets else " ".join(t for t in expression.split() if t not in BRACKETS)

    def encode(texts):
        return tokenizer(texts, add_special_tokens=False)["input_ids"]

    sets, dropped = {}, 0
    for split, rows in examples.items():
        dataset = tokenized_dataset([text_of(e) for _, e in rows], [label for label, _ in rows], encode,
                                    preset.context_length, extra={"depth": [evaluate_expression(e)[1] for _, e in rows]})
        if split == "train":
            keep = [i for i, length in enumerate(dataset["length"]) if length <= preset.context_length]
            dropped = len(dataset) - len(keep)
            if not keep:
                raise ValueError(f"no training example fits --context_length {preset.context_length}")
            dataset = dataset.select(keep)
        sets[split] = dataset
    truncated = {split: int(sum(length > preset.context_length for length in sets[split]["length"]))
                 for split in ("validation", "test")}
    info = {"examples": {split: len(ds) for split, ds in sets.items()}, "sources": sources,
            "train_dropped_longer_than_max_length": dropped, "truncated_to_max_length": truncated,
            "max_length": preset.context_length, "brackets": bool(args.keep_brackets),
            "tokenizer": "the 17 ListOps symbols (word level)" + ("" if args.keep_brackets else ", brackets dropped")}

    return TaskData(datasets=sets, tokenizer=tokenizer, collator=PadCollator(tokenizer.pad_token_id), info=info,
                    num_labels=10, evaluate=split_accuracy_evaluation("depth"), compute_metrics=accuracy_metrics,
                    sample=max((sets["validation"][i]["input_ids"] for i in range(min(200, len(sets["validation"])))),
                               key=len)[:64])


TASK = ChiarTask(
    recipe="listops", title="ListOps", kind="classification", hub_dataset=None,
    dataset_description="ListOps expressions (10 classes), generated from the published generator rules or read "
                        "from the released TSV files",
    paper={"attention": "98.85%", "hard": "63.35% (DCT+Attn; a flat one-operator toy, not this task)"},
    paper_metric="the authors' 'ListOps' accuracy (a flat one-operator toy task, not ListOps)",
    primary="test_accuracy", higher_is_better=True, load_data=load_data, add_arguments=add_arguments,
    presets=PRESETS, default_preset="cpu",
)


def main(argv=None) -> int:
    return run_recipe(argv, TASK, __doc__)


if __name__ == "__main__":
    sys.exit(main())
