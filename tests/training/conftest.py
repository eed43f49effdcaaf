"""Fixtures for the recipe tests: small synthetic corpora laid out like the real ones (no network, no shared data)."""

import os
import random
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARED_DATA = os.environ.get("HF_SPECTRAL_DATA", "/work/shared/data")
WORDS = ("the king my lord shall speak to thee and all that love him now hath come upon our gentle "
         "duke of york whose sword is true good night sweet prince what say you then").split()


def recipe_environment() -> dict:
    """Environment of a recipe run in a subprocess: the checkout importable, one thread, no Hub."""
    return {**os.environ, "PYTHONPATH": REPO_ROOT, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def torchrun_two_cpu_processes(module: str, *args: str) -> list[str]:
    """The command that runs ``python -m module args`` in two CPU processes under torchrun (``--standalone`` binds
    a free rendezvous port itself: picking one here first could race another run)."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return [torchrun, "--standalone", "--nproc_per_node", "2", "-m", module, *args]


def synthetic_text(characters: int, seed: int = 0) -> str:
    """Shakespeare-flavoured lines of random words: enough structure for a loss to fall in a few steps."""
    rng = random.Random(seed)
    lines, size = [], 0
    while size < characters:
        speaker = rng.choice(["KING", "DUKE", "ROMEO", "NURSE"])
        line = f"{speaker}:\n" + " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 12))).capitalize() + ".\n\n"
        lines.append(line)
        size += len(line)
    return "".join(lines)[:characters]


@pytest.fixture(scope="session")
def tiny_shakespeare(tmp_path_factory):
    """A 60,000-character stand-in for input.txt."""
    path = tmp_path_factory.mktemp("tinyshakespeare") / "input.txt"
    path.write_text(synthetic_text(60_000), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="session")
def tiny_ptb_words(tmp_path_factory):
    """A folder with PTB-style word files (train / valid / test), lower case, `<unk>` and `N`."""
    folder = tmp_path_factory.mktemp("ptb")
    rng = random.Random(1)
    vocabulary = [w for w in WORDS if w.isalpha()] + ["<unk>", "N"]
    for name, lines in (("ptb.train.txt", 900), ("ptb.valid.txt", 120), ("ptb.test.txt", 120)):
        text = "".join(" " + " ".join(rng.choice(vocabulary) for _ in range(rng.randint(4, 14))) + " \n"
                       for _ in range(lines))
        (folder / name).write_text(text, encoding="utf-8")
    return str(folder)


def shared_file(*parts):
    """A file of the project's shared data folder, or skip (CI machines may not have it)."""
    path = os.path.join(SHARED_DATA, *parts)
    if not os.path.isfile(path):
        pytest.skip(f"{path} not available")
    return path


@pytest.fixture(scope="session")
def tiny_wikitext(tmp_path_factory):
    """A folder with WikiText-like {train,valid,test}.txt: headings, paragraphs, <unk>, one paragraph per line."""
    folder = tmp_path_factory.mktemp("wikitext-2")
    rng = random.Random(2)
    for name, lines in (("train.txt", 400), ("valid.txt", 60), ("test.txt", 60)):
        text = []
        for index in range(lines):
            if index % 20 == 0:
                text.append(f" = {rng.choice(WORDS).capitalize()} {rng.choice(WORDS)} = \n \n")
            text.append(" " + " ".join(rng.choice(WORDS + ["<unk>", "@-@", ","]) for _ in range(rng.randint(8, 30)))
                        + " . \n")
        (folder / name).write_text("".join(text), encoding="utf-8")
    return str(folder)


@pytest.fixture(scope="session")
def tiny_imdb(tmp_path_factory):
    """A folder with IMDB-like train.jsonl.gz / test.jsonl.gz: reviews whose sentiment a word gives away."""
    import gzip
    import json

    folder = tmp_path_factory.mktemp("imdb")
    rng = random.Random(3)
    good, bad = ["great", "wonderful", "loved"], ["awful", "boring", "hated"]
    for split, count in (("train", 200), ("test", 90)):
        with gzip.open(folder / f"{split}.jsonl.gz", "wt", encoding="utf-8") as handle:
            for index in range(count):
                label = index % 2
                words = [rng.choice(WORDS) for _ in range(rng.randint(5, 40))] + [rng.choice(good if label else bad)]
                row = {"id": index, "label": label, "text": " ".join(words) + " <br /><br />"}
                handle.write(json.dumps(row) + "\n")
    return str(folder)
