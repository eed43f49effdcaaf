"""TinyShakespeare, characters: EGA-GPT variants against the baseline (SPEC 1.4), one run of run_clm per variant and
seed with the configuration training/configs/tinyshakespeare_<preset>.json, then their comparison.

    python -m training.tinyshakespeare --preset demo                 # BASE vs EGA-1 (causal), a few minutes on a CPU
    python -m training.tinyshakespeare --preset cpu --seeds 0 1 2    # the CPU reproduction scale (results/ega/)
    python -m training.tinyshakespeare --variants BASE EGA-1 EGA-1:window EGA-C --max_steps 2000 --bf16
    python -m training.run_clm training/configs/tinyshakespeare_cpu.json --variant EGA-1   # one run by hand
    hf-spectral train tinyshakespeare --help

The text (1,115,394 characters, 65 distinct) has no official split: the first 90% of the characters train, the last
10% validate, as in nanoGPT and the EGA authors' code; they are written to <data_dir>/tinyshakespeare/.
"""

import os
import sys

from .common import ega
from .common.data import TextCorpus, find_corpus, read_text, write_files

CORPUS = TextCorpus(
    name="tinyshakespeare", folder="tinyshakespeare", files={"train": "input.txt"}, env_var="TINYSHAKESPEARE_PATH",
    urls={"train": "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"},
    sha256={"input.txt": "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"},
)


def data_files(data_dir: str) -> dict:
    folder = os.path.join(data_dir, "tinyshakespeare")
    return {"train_file": os.path.join(folder, "train.txt"), "validation_file": os.path.join(folder, "validation.txt")}


def prepare_data(args, files: dict) -> None:
    """The first 90% of the characters of input.txt to ``train_file``, the rest to ``validation_file``."""
    text = read_text(find_corpus(CORPUS, args.data_path, download=not args.no_download)["train"])
    cut = int(len(text) * 0.9)
    write_files(os.path.dirname(files["train_file"]), {"train.txt": text[:cut], "validation.txt": text[cut:]})


def main(argv=None) -> int:
    return ega.main("tinyshakespeare", __doc__, argv, presets=("demo", "cpu", "authors", "smoke"), default="cpu",
                    data_files=data_files, prepare_data=prepare_data)


if __name__ == "__main__":
    sys.exit(main())
