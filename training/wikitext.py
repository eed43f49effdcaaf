"""WikiText-2 language modelling: CHIAR-Former arms against the same-size all-attention model (SPEC 2.3), one run of
run_clm per arm and seed with the configuration training/configs/wikitext2_<preset>.json, then their comparison.

    python -m training.wikitext --preset cpu                                  # the CPU scale (results/chiar/)
    python -m training.wikitext --arms attention threshold hard 3op threshold@all --seeds 0 1 2
    python -m training.wikitext --preset authors --bf16                      # the authors' small config (GPU)
    python -m training.wikitext --max_steps 400 --warmup_steps 40 --config_overrides layer_norm_position=pre
    hf-spectral train wikitext --help

Data: {train,valid,test}.txt (the pytorch/examples copies of WikiText-2 v1; the shared data folder's layout) at
--data_path, $WIKITEXT2_PATH or $HF_SPECTRAL_DATA/wikitext-2/, or downloaded; copied to <data_dir>/wikitext-2/ with a
byte-level BPE of --bpe_vocab_size ids trained on the training split (bpe-<size>/, as GPT-2's tokenizer but sized
to the model). The perplexity is reported per token (it depends on the tokenizer) and per word (exp(total NLL /
words), words: whitespace-separated tokens plus one end of line per line, the official WikiText count).
"""

import json
import os
import sys

from .common import chiar
from .common.cli import positive_int
from .common.data import TextCorpus, find_corpus, read_text, train_bpe_tokenizer, write_files

SPLITS = {"train": "train.txt", "validation": "valid.txt", "test": "test.txt"}
_EXAMPLES = "https://raw.githubusercontent.com/pytorch/examples/main/word_language_model/data/wikitext-2/"
CORPUS = TextCorpus(
    name="wikitext-2", folder="wikitext-2", files=SPLITS, env_var="WIKITEXT2_PATH",
    urls={split: _EXAMPLES + name for split, name in SPLITS.items()},
    sha256={"train.txt": "9e9fa1ad55b1c2c95b08e37dd8e653f638fac2c6de904b79e813611eefbc985f",
            "valid.txt": "f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8",
            "test.txt": "d790b833ef8cf03a90db7bf1271b7520b83c45ce07ba3c1a9699df81e239eca0"},
)
BPE_SIZES = {"smoke": 512, "cpu": 2048, "authors": 50257}  # the authors': GPT-2's


def add_data_arguments(parser) -> None:
    group = parser.add_argument_group("data")
    group.add_argument("--data_path", help="folder with {train,valid,test}.txt")
    group.add_argument("--no_download", action="store_true", help="fail instead of downloading WikiText-2")
    group.add_argument("--bpe_vocab_size", type=positive_int,
                       help="ids of the BPE (default: smoke 512, cpu 2048, authors 50257)")


def text_files(data_dir: str) -> dict:
    return {f"{split}_file": os.path.join(data_dir, "wikitext-2", f"{split}.txt") for split in SPLITS}


def data_files(args) -> dict:
    size = args.bpe_vocab_size or BPE_SIZES[args.preset]
    return {**text_files(args.data_dir), "tokenizer_name": os.path.join(args.data_dir, "wikitext-2", f"bpe-{size}")}


def write_text_files(args, files: dict) -> dict:
    """WikiText-2's splits copied to ``files``; returns their texts."""
    found = find_corpus(CORPUS, args.data_path, download=not args.no_download)
    texts = {split: read_text(path) for split, path in found.items()}
    write_files(os.path.dirname(files["train_file"]), {f"{split}.txt": text for split, text in texts.items()})
    return texts


def prepare_data(args, files: dict) -> None:
    """The splits, the BPE trained on the training split, and beside it ``words.json``: each split's tokens and
    words, for the perplexity per word."""
    texts = write_text_files(args, files)
    size = int(files["tokenizer_name"].rpartition("-")[2])
    tokenizer = train_bpe_tokenizer(texts["train"].splitlines(keepends=True), size, files["tokenizer_name"])
    counts = {split: {"tokens": sum(len(ids) for ids in tokenizer(text.splitlines(keepends=True))["input_ids"]),
                      "words": len(text.split()) + text.count("\n")} for split, text in texts.items()}
    write_files(files["tokenizer_name"], {"words.json": json.dumps(counts, indent=2)})


def main(argv=None) -> int:
    return chiar.main("wikitext", __doc__, argv, default_arms=("attention", "threshold", "hard", "3op"),
                      data_files=data_files, prepare_data=prepare_data, add_data_arguments=add_data_arguments)


if __name__ == "__main__":
    sys.exit(main())
