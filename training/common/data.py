"""Corpora for the recipes: find the text, tokenize it, pack it into fixed-length training examples.

A corpus is looked up, in this order, at
  1. the path given on the command line (``--data_path``: a file, or a folder holding the corpus files),
  2. the corpus' own environment variable (e.g. ``TINYSHAKESPEARE_PATH``, a file or a folder),
  3. ``$HF_SPECTRAL_DATA/<folder>/`` (a folder laid out like the project's shared data folder),
  4. the recipe cache (``$HF_SPECTRAL_CACHE``, default ``~/.cache/hf_spectral/data``), where
  5. it is downloaded from its public source and checked against its published SHA-256,
or read from the Hugging Face Hub with ``--dataset_name`` (any dataset with a text column).

Text is loaded with ``datasets`` (one document per file), encoded as a whole, split contiguously where the
benchmark defines no validation split (first 90% train, last 10% validation, as nanoGPT and the EGA authors
do), and packed into blocks of ``block_size`` tokens that overlap by one token: block k holds tokens
[k(T−1), k(T−1)+T), so every token after the first is a prediction target exactly once.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field

import numpy as np

DATA_ROOT_ENV = "HF_SPECTRAL_DATA"
CACHE_ENV = "HF_SPECTRAL_CACHE"


class CorpusNotFoundError(FileNotFoundError):
    """No local copy of a corpus was found and it could not be downloaded."""


@dataclass(frozen=True)
class TextCorpus:
    """Where a benchmark's text lives.

    Attributes:
        name: short name used in run names and tables.
        folder: sub-folder of ``$HF_SPECTRAL_DATA`` (and of the download cache) holding the files.
        files: split name -> file name, e.g. ``{"train": "input.txt"}``.
        env_var: environment variable that may point at the file (single-file corpora) or the folder.
        urls: split -> public URL of the file, for downloading.
        sha256: file name -> published SHA-256, checked after every download.
        validation_fraction: fraction of the token stream held out (contiguously, at the end) as the
            validation split when ``files`` has no ``"validation"`` entry.
        derive: optional function (folder) -> None that writes missing files from others already present
            (PTB char from PTB word, with the published rule).
        hub_dataset: the Hugging Face Hub dataset holding the same text, for ``--dataset_name``.
    """

    name: str
    folder: str
    files: dict
    env_var: str
    urls: dict = field(default_factory=dict)
    sha256: dict = field(default_factory=dict)
    validation_fraction: float | None = None
    derive: object = None
    hub_dataset: str | None = None


def cache_root() -> str:
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "hf_spectral", "data")


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def download_file(url: str, destination: str, sha256: str | None = None, timeout: float = 60.0) -> str:
    """Download ``url`` to ``destination`` (via a temporary file, so a broken transfer leaves nothing behind)
    and check its SHA-256. Raises ``CorpusNotFoundError`` when the network is unreachable."""
    os.makedirs(os.path.dirname(os.path.abspath(destination)), exist_ok=True)
    # A fresh name opened exclusively rather than tempfile.mkstemp, whose 0600 would make the cached corpus private.
    tmp_path = f"{os.path.abspath(destination)}.{uuid.uuid4().hex}.part"
    try:
        with open(tmp_path, "xb") as out:
            try:
                with urllib.request.urlopen(url, timeout=timeout) as response:
                    shutil.copyfileobj(response, out)
            except (urllib.error.URLError, OSError) as error:
                raise CorpusNotFoundError(f"could not download {url}: {error}") from error
        if sha256 is not None:
            found = sha256_of(tmp_path)
            if found != sha256:
                raise ValueError(f"{url}: SHA-256 {found} does not match the published {sha256}; file discarded")
        os.replace(tmp_path, destination)
    finally:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
    return destination


def _files_in(folder: str, corpus: TextCorpus) -> dict | None:
    """The corpus files inside ``folder`` (deriving missing ones where the corpus knows how), or None."""
    if not os.path.isdir(folder):
        return None
    missing = [name for name in corpus.files.values() if not os.path.isfile(os.path.join(folder, name))]
    if missing and corpus.derive is not None and os.access(folder, os.W_OK):
        corpus.derive(folder)
        missing = [name for name in corpus.files.values() if not os.path.isfile(os.path.join(folder, name))]
    if missing:
        return None
    return {split: os.path.join(folder, name) for split, name in corpus.files.items()}


def _from_path(path: str, corpus: TextCorpus, origin: str) -> dict:
    if os.path.isfile(path):
        if len(corpus.files) != 1:
            raise ValueError(
                f"{origin} points at the file {path}, but {corpus.name} has several files "
                f"({', '.join(corpus.files.values())}): point it at the folder that holds them"
            )
        return {next(iter(corpus.files)): path}
    found = _files_in(path, corpus) or _files_in(os.path.join(path, corpus.folder), corpus)
    if found is None:
        raise CorpusNotFoundError(
            f"{origin} = {path}: expected {', '.join(corpus.files.values())} there (or in {path}/{corpus.folder}/)"
        )
    return found


def resolve_corpus_files(corpus: TextCorpus, data_path: str | None = None, download: bool = True) -> dict:
    """Local file of each split of ``corpus`` (see the module docstring for the search order)."""
    if data_path:
        return _from_path(data_path, corpus, "--data_path")
    if os.environ.get(corpus.env_var):
        return _from_path(os.environ[corpus.env_var], corpus, f"${corpus.env_var}")
    if os.environ.get(DATA_ROOT_ENV):
        found = _files_in(os.path.join(os.environ[DATA_ROOT_ENV], corpus.folder), corpus)
        if found:
            return found
    cached_folder = os.path.join(cache_root(), corpus.folder)
    found = _files_in(cached_folder, corpus)
    if found:
        return found
    if not download or not corpus.urls:
        raise CorpusNotFoundError(_not_found_message(corpus))
    try:
        for split, url in corpus.urls.items():
            name = os.path.basename(url) if split not in corpus.files else corpus.files[split]
            destination = os.path.join(cached_folder, name)
            if not os.path.isfile(destination):
                download_file(url, destination, corpus.sha256.get(name))
    except CorpusNotFoundError as error:
        raise CorpusNotFoundError(f"{error}\n{_not_found_message(corpus)}") from error
    found = _files_in(cached_folder, corpus)
    if found is None:
        raise CorpusNotFoundError(_not_found_message(corpus))
    return found


def _not_found_message(corpus: TextCorpus) -> str:
    return (
        f"{corpus.name}: no local copy found. Pass --data_path FILE_OR_FOLDER, set ${corpus.env_var}, or set "
        f"${DATA_ROOT_ENV} to a folder holding {corpus.folder}/{{{','.join(corpus.files.values())}}}"
        + (f"; downloading from {', '.join(corpus.urls.values())} needs network access" if corpus.urls else "")
    )


def load_corpus_texts(
    corpus: TextCorpus,
    data_path: str | None = None,
    dataset_name: str | None = None,
    dataset_config: str | None = None,
    text_column: str = "text",
    download: bool = True,
) -> dict:
    """The text of each split, as one string per split, read through ``datasets``.

    Local files are read with the ``text`` builder in document mode (each file is one example, byte-exact);
    a Hub dataset's splits are the concatenation of their ``text_column`` rows, one per line.
    """
    import datasets

    if dataset_name:
        loaded = datasets.load_dataset(dataset_name, dataset_config)
        if text_column not in loaded[next(iter(loaded))].column_names:
            raise ValueError(f"{dataset_name} has no column {text_column!r}; pass --text_column")
        texts = {}
        for split, rows in loaded.items():
            split = "validation" if split in ("valid", "val", "dev") else split
            texts[split] = "\n".join(rows[text_column]) if rows.num_rows > 1 else rows[0][text_column]
        return texts
    files = resolve_corpus_files(corpus, data_path, download=download)
    loaded = datasets.load_dataset(
        "text", data_files=files, sample_by="document", keep_linebreaks=True, keep_in_memory=True
    )
    texts = {split: loaded[split][0]["text"] if loaded[split].num_rows else "" for split in files}
    empty = [split for split, text in texts.items() if not text]
    if empty:
        raise ValueError(f"{corpus.name}: split(s) {empty} are empty ({[files[s] for s in empty]})")
    return texts


# ------------------------------------------------------------------------------------------------------------
# Tokenization
# ------------------------------------------------------------------------------------------------------------


def char_tokenizer(texts: dict, save_directory: str):
    """Character tokenizer whose vocabulary is every character of the corpus (all splits, as nanoGPT)."""
    from hf_spectral import CharTokenizer

    return CharTokenizer.from_text("".join(sorted(set("".join(texts.values())))), save_directory)


def word_tokenizer(train_text: str, save_directory: str, unk_token: str = "<unk>", eos_token: str = "<eos>",
                   min_frequency: int = 1):
    """Word-level ``PreTrainedTokenizerFast``: whitespace-split words of the training text, a line end as
    ``eos_token``, words outside the vocabulary as ``unk_token`` (the PTB / WikiText convention)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(unk_token=unk_token))
    backend.normalizer = normalizers.Replace("\n", f" {eos_token} ")
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    trainer = trainers.WordLevelTrainer(special_tokens=[unk_token, eos_token], min_frequency=min_frequency)
    backend.train_from_iterator(train_text.splitlines(keepends=True), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token=unk_token, eos_token=eos_token)
    os.makedirs(save_directory, exist_ok=True)
    tokenizer.save_pretrained(save_directory)
    return tokenizer


def encode_text(tokenizer, text: str) -> np.ndarray:
    """Token ids of a whole document (int32). Character tokenizers take the direct vocabulary lookup: the
    same ids as ``tokenizer(text)``, without the special-token trie walk over millions of characters, unless the text
    spells a token of several characters (a special or added token), which ``tokenizer(text)`` keeps whole."""
    from hf_spectral import CharTokenizer

    vocab = tokenizer.get_vocab() if isinstance(tokenizer, CharTokenizer) else {}
    if vocab and not any(len(token) > 1 and token in text for token in vocab):
        unknown = set(text) - set(vocab)
        if unknown and tokenizer.unk_token is None:
            raise ValueError(f"characters {sorted(unknown)[:10]} are not in the vocabulary")
        unk = vocab.get(str(tokenizer.unk_token)) if unknown else None
        return np.fromiter((vocab.get(char, unk) for char in text), dtype=np.int32, count=len(text))
    ids = tokenizer(text.splitlines(keepends=True), add_special_tokens=False)["input_ids"]
    return np.fromiter((i for line in ids for i in line), dtype=np.int32)


def contiguous_split(ids: np.ndarray, validation_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """First ``1 − validation_fraction`` of the stream for training, the rest for validation."""
    if not 0.0 < validation_fraction < 1.0:
        raise ValueError(f"validation_fraction must be in (0, 1), got {validation_fraction}")
    cut = int(len(ids) * (1.0 - validation_fraction))
    return ids[:cut], ids[cut:]


def pack_blocks(ids: np.ndarray, block_size: int) -> np.ndarray:
    """(N, block_size) blocks overlapping by one token, so that every token but the first is a target once.

    The tail that does not fill a whole block is dropped (fewer than ``block_size`` tokens).
    """
    if block_size < 2:
        raise ValueError(f"block_size must be at least 2, got {block_size}")
    stride = block_size - 1
    if len(ids) < block_size:
        raise ValueError(f"{len(ids)} tokens are too few for one block of {block_size}")
    count = (len(ids) - block_size) // stride + 1
    index = np.arange(count)[:, None] * stride + np.arange(block_size)[None, :]
    return np.ascontiguousarray(ids[index])


@dataclass
class LMData:
    """Packed splits of one corpus, with what is needed to report them."""

    datasets: object  # datasets.DatasetDict: "train", "validation" (and "test" when the benchmark has one)
    tokenizer: object
    tokens: dict  # split -> number of tokens before packing
    characters: dict  # split -> number of characters (bits per character = nats · tokens / chars / ln 2)

    def chars_per_token(self, split: str) -> float:
        return self.characters[split] / self.tokens[split]


def build_lm_data(
    texts: dict,
    tokenizer,
    block_size: int,
    validation_fraction: float | None = None,
) -> LMData:
    """Encode each split, split contiguously if there is no validation text, pack, wrap in a ``DatasetDict``."""
    import datasets

    encoded = {split: encode_text(tokenizer, text) for split, text in texts.items()}
    characters = {split: len(text) for split, text in texts.items()}
    if "validation" not in encoded:
        if validation_fraction is None:
            raise ValueError("the corpus has no validation split and no validation_fraction was given")
        train_ids = encoded.pop("train")
        encoded["train"], encoded["validation"] = contiguous_split(train_ids, validation_fraction)
        ratio = characters.pop("train") / max(len(train_ids), 1)
        characters["train"] = round(len(encoded["train"]) * ratio)
        characters["validation"] = round(len(encoded["validation"]) * ratio)
    packed = datasets.DatasetDict(
        {
            split: datasets.Dataset.from_dict({"input_ids": pack_blocks(ids, block_size).tolist()})
            for split, ids in encoded.items()
        }
    ).with_format("torch")
    return LMData(packed, tokenizer, {split: len(ids) for split, ids in encoded.items()}, characters)


def fixed_subset(dataset, count: int | None, seed: int = 0):
    """A fixed random subset of ``count`` rows (the same for every variant and seed, so curves compare)."""
    if count is None or count >= len(dataset):
        return dataset
    rng = np.random.default_rng(seed)
    return dataset.select(sorted(rng.choice(len(dataset), size=count, replace=False).tolist()))
