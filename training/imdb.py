"""IMDB sentiment (Maas et al. 2011, 25k / 25k labelled reviews): a bidirectional CHIAR-Former encoder's arms against
the same-size all-attention encoder (SPEC 2.3), one run of run_classification per arm and seed with the configuration
training/configs/imdb_<preset>.json, then their comparison.

    python -m training.imdb --preset cpu                                   # the first 128 BPE tokens, CPU scale
    python -m training.imdb --preset authors --bf16                        # 256 BPE tokens, as the authors
    hf-spectral train imdb --help

Data: train.jsonl.gz / test.jsonl.gz ({"text", "label"} per line; the shared data folder's layout) at --data_path,
$IMDB_PATH or $HF_SPECTRAL_DATA/imdb/. --validation_examples reviews are held out of the training split (a fixed
random choice) for the validation curve; the accuracy is measured on the whole test split (--max_test_examples: a
fixed random subset). <br /> tags become spaces. Written to <data_dir>/imdb/ as JSON lines, with a byte-level BPE
trained on the training reviews (bpe-<size>/). Reviews longer than the context keep their first tokens.
"""

import gzip
import json
import os
import random
import sys

from .common import chiar
from .common.cli import UsageError, positive_int
from .common.data import TextCorpus, find_corpus, train_bpe_tokenizer, write_jsonl

CORPUS = TextCorpus(name="imdb", folder="imdb", files={"train": "train.jsonl.gz", "test": "test.jsonl.gz"},
                    env_var="IMDB_PATH")
BPE_SIZES = {"smoke": 512, "cpu": 4096, "authors": 8192}


def add_data_arguments(parser) -> None:
    group = parser.add_argument_group("data")
    group.add_argument("--data_path", help="folder with train.jsonl.gz and test.jsonl.gz")
    group.add_argument("--bpe_vocab_size", type=positive_int, help="ids of the BPE (default: smoke 512, cpu 4096, "
                       "authors 8192)")
    group.add_argument("--validation_examples", type=positive_int, default=1000,
                       help="training reviews held out for the validation curve (default 1000; smoke at most 64)")
    group.add_argument("--max_train_examples", type=positive_int, help="a fixed random subset of the training reviews "
                       "(smoke: 512)")
    group.add_argument("--max_test_examples", type=positive_int, help="a fixed random subset of the test reviews "
                       "(default: all; smoke: 64)")


def data_files(args) -> dict:
    folder = os.path.join(args.data_dir, "imdb")
    size = args.bpe_vocab_size or BPE_SIZES[args.preset]
    return {**{f"{split}_file": os.path.join(folder, f"{split}.jsonl") for split in ("train", "validation", "test")},
            "tokenizer_name": os.path.join(folder, f"bpe-{size}")}


def read_reviews(path: str) -> list:
    rows = []
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                row = json.loads(line)
                if not isinstance(row.get("text"), str) or row.get("label") not in (0, 1):
                    raise UsageError(f"{path}:{number}: expected {{'text': str, 'label': 0 or 1}}")
                rows.append({"text": row["text"].replace("<br />", " "), "label": row["label"]})
    return rows


def subset(rows: list, count: int | None, seed: int) -> list:
    return rows if count is None or count >= len(rows) else random.Random(seed).sample(rows, count)


def prepare_data(args, files: dict) -> None:
    found = find_corpus(CORPUS, args.data_path, download=False)
    train, test = read_reviews(found["train"]), read_reviews(found["test"])
    smoke = args.preset == "smoke"  # a check of the pipeline, not a measurement: small subsets unless given
    held_out = min(args.validation_examples, 64) if smoke else args.validation_examples
    if not 0 < held_out < len(train):
        raise UsageError(f"--validation_examples must be in (0, {len(train)}), got {held_out}")
    order = list(range(len(train)))
    random.Random(0).shuffle(order)  # the files are sorted by label: hold out a random, fixed choice
    validation = [train[index] for index in order[:held_out]]
    train = subset([train[index] for index in order[held_out:]], args.max_train_examples or (512 if smoke else None), 2)
    test = subset(test, args.max_test_examples or (64 if smoke else None), 1)
    folder = os.path.dirname(files["train_file"])
    write_jsonl(folder, {"train.jsonl": train, "validation.jsonl": validation, "test.jsonl": test})
    size = int(files["tokenizer_name"].rpartition("-")[2])
    train_bpe_tokenizer([row["text"] for row in train], size, files["tokenizer_name"])


def main(argv=None) -> int:
    return chiar.main("imdb", __doc__, argv, default_arms=("attention", "threshold", "hard", "3op"),
                      data_files=data_files, prepare_data=prepare_data, add_data_arguments=add_data_arguments)


if __name__ == "__main__":
    sys.exit(main())
