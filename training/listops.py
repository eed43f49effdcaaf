"""ListOps (Nangia & Bowman 2018; Long Range Arena): a bidirectional CHIAR-Former encoder's arms against the same-size
all-attention encoder (SPEC 2.3), one run of run_classification per arm and seed with the configuration
training/configs/listops_<preset>.json, then their comparison, with the accuracy per nesting depth.

    python -m training.listops --preset cpu                                   # generated, original settings
    python -m training.listops --train_file train_d20s.tsv --test_file test_d20s.tsv   # released files
    python -m training.listops --setting lra --context_length 2000 --preset authors    # LRA-style data
    hf-spectral train listops --help

Data: files in either released format (original: LABEL<TAB>EXPRESSION; LRA: a Source<TAB>Target header, then
EXPRESSION<TAB>LABEL) given per split with --train_file / --validation_file / --test_file; a split not given is
generated (training/listops_data.py, --setting original or lra, seeded by --data_seed; sizes: smoke 400 / 64 / 128,
cpu 10,000 / 500 / 1,000, authors the setting's). Every label is checked by the independent evaluator first. Written
to <data_dir>/listops/ as JSON lines (text, label, depth) with the word-level tokenizer of the 17 symbols.

Input: the expression's tokens without the ( ) bracketing (--keep_brackets keeps them). Training examples longer
than the context are left out; validation and test examples are truncated to it (a truncated expression is not
solvable; the counts are in <data_dir>/listops/statistics.json).
"""

import json
import os
import sys

from .common import chiar
from .common.cli import UsageError, positive_int
from .common.experiments import config
from .common.data import write_files, write_jsonl
from .listops_data import BRACKETS, SETTINGS, SPLITS, VOCABULARY, check_labels, evaluate_expression, generate, read_tsv

GENERATED_SIZES = {"smoke": (400, 64, 128), "cpu": (10_000, 500, 1_000)}  # else the setting's own sizes


def add_data_arguments(parser) -> None:
    group = parser.add_argument_group("data")
    for split in SPLITS:
        group.add_argument(f"--{split}_file", help=f"{split} examples, a TSV file in either released format")
    group.add_argument("--setting", choices=sorted(SETTINGS), default="original",
                       help="generator settings of the splits not given as files (default: original)")
    group.add_argument("--generate_sizes", type=positive_int, nargs=3, metavar=("TRAIN", "VALIDATION", "TEST"),
                       help="generated examples per split (default: see above)")
    group.add_argument("--data_seed", type=int, default=0, help="seed of the generator (default 0)")
    group.add_argument("--keep_brackets", action="store_true", help="keep the ( ) bracketing tokens in the input")


def data_files(args) -> dict:
    folder = os.path.join(args.data_dir, "listops")
    return {**{f"{split}_file": os.path.join(folder, f"{split}.jsonl") for split in SPLITS},
            "tokenizer_name": os.path.join(folder, "tokenizer")}


def tokenizer_of_symbols():
    """Word-level ``PreTrainedTokenizerFast`` over the 17 ListOps symbols, with padding and unknown."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, **{token: index + 2 for index, token in enumerate(VOCABULARY)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]")


def prepare_data(args, files: dict) -> None:
    """Each split read or generated, its labels checked, written as JSON lines; the tokenizer beside them."""
    given = {split: getattr(args, f"{split}_file") for split in SPLITS}
    examples = {split: read_tsv(path) for split, path in given.items() if path}
    missing = [split for split in SPLITS if split not in examples]
    if missing:
        sizes = tuple(args.generate_sizes or GENERATED_SIZES.get(args.preset, SETTINGS[args.setting].sizes))
        generated = generate(args.setting, sizes, seed=args.data_seed)
        examples.update({split: generated[split] for split in missing})
    for split, rows in examples.items():
        mismatches = check_labels(rows)
        if mismatches:
            index, label, value = mismatches[0]
            raise UsageError(f"ListOps {split} ({given[split] or 'generated'}): {len(mismatches)} of {len(rows)} "
                             f"labels disagree with the evaluator (first: example {index}, label {label}, evaluates "
                             f"to {value})")
    length = args.context_length or config(f"listops_{args.preset}")["max_seq_length"]
    statistics, rows_per_file = {}, {}
    for split, rows in examples.items():
        texts = [expression if args.keep_brackets else " ".join(token for token in expression.split()
                                                                  if token not in BRACKETS) for _, expression in rows]
        rows = [{"text": text, "label": label, "depth": evaluate_expression(expression)[1]}
                for text, (label, expression) in zip(texts, rows)]
        longer = sum(len(row["text"].split()) > length for row in rows)
        if split == "train":
            rows = [row for row in rows if len(row["text"].split()) <= length]
            if not rows:
                raise UsageError(f"no training example fits the context of {length} tokens")
        statistics[split] = {"examples": len(rows), ("dropped" if split == "train" else "truncated"): longer,
                             "source": given[split] or f"generated ({args.setting}, seed {args.data_seed})"}
        rows_per_file[f"{split}.jsonl"] = rows
    folder = os.path.dirname(files["train_file"])
    write_jsonl(folder, rows_per_file)
    write_files(folder, {"statistics.json": json.dumps(statistics, indent=2)})
    tokenizer_of_symbols().save_pretrained(files["tokenizer_name"])


def main(argv=None) -> int:
    return chiar.main("listops", __doc__, argv, default_arms=("attention", "threshold", "hard", "3op"),
                      data_files=data_files, prepare_data=prepare_data, add_data_arguments=add_data_arguments)


if __name__ == "__main__":
    sys.exit(main())
