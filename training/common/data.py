"""The benchmarks' data: where a corpus is found, and the plain files (and tokenizers) the drivers write for run_clm
and run_classification to read.

A corpus is looked up, in this order, at
  1. the path given on the command line (``--data_path``: a file, or a folder holding the corpus files),
  2. the corpus' own environment variable (e.g. ``TINYSHAKESPEARE_PATH``, a file or a folder),
  3. ``$HF_SPECTRAL_DATA/<folder>/`` (a folder laid out like the project's shared data folder),
  4. the download cache (``$HF_SPECTRAL_CACHE``, default ``~/.cache/hf_spectral/data``), where
  5. it is downloaded from its public source and checked against its published SHA-256.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field

from .cli import UsageError

DATA_ROOT_ENV = "HF_SPECTRAL_DATA"
CACHE_ENV = "HF_SPECTRAL_CACHE"


@dataclass(frozen=True)
class TextCorpus:
    """Where a benchmark's text lives: ``files`` (split -> file name) in ``folder`` of ``$HF_SPECTRAL_DATA`` or the
    cache, or at ``$env_var``; ``urls`` and ``sha256`` to download it; ``derive(folder)`` writes missing files from
    others (PTB's character files from its word files)."""

    name: str
    folder: str
    files: dict
    env_var: str
    urls: dict = field(default_factory=dict)
    sha256: dict = field(default_factory=dict)
    derive: object = None


def cache_root() -> str:
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "hf_spectral", "data")


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def download_file(url: str, destination: str, sha256: str | None = None, timeout: float = 60.0) -> str:
    """``url`` to ``destination`` through a temporary file (a broken transfer leaves nothing), its SHA-256 checked;
    a `UsageError` when the network is out of reach."""
    os.makedirs(os.path.dirname(os.path.abspath(destination)), exist_ok=True)
    # A fresh name opened exclusively rather than tempfile.mkstemp, whose 0600 would make the cached corpus private.
    partial = f"{os.path.abspath(destination)}.{uuid.uuid4().hex}.part"
    try:
        with open(partial, "xb") as out:
            try:
                with urllib.request.urlopen(url, timeout=timeout) as response:
                    shutil.copyfileobj(response, out)
            except (urllib.error.URLError, OSError) as error:
                raise UsageError(f"could not download {url}: {error}") from error
        if sha256 is not None and sha256_of(partial) != sha256:
            raise UsageError(f"{url}: SHA-256 {sha256_of(partial)} does not match the published {sha256}; discarded")
        os.replace(partial, destination)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return destination


def _files_in(folder: str, corpus: TextCorpus) -> dict | None:
    """The corpus files inside ``folder`` (deriving missing ones where the corpus knows how), or None."""
    if not os.path.isdir(folder):
        return None
    missing = [name for name in corpus.files.values() if not os.path.isfile(os.path.join(folder, name))]
    if missing and corpus.derive is not None and os.access(folder, os.W_OK):
        corpus.derive(folder)
        missing = [name for name in corpus.files.values() if not os.path.isfile(os.path.join(folder, name))]
    return None if missing else {split: os.path.join(folder, name) for split, name in corpus.files.items()}


def _from_path(path: str, corpus: TextCorpus, origin: str) -> dict:
    if os.path.isfile(path):
        if len(corpus.files) != 1:
            raise UsageError(f"{origin} points at the file {path}, but {corpus.name} has several files "
                             f"({', '.join(corpus.files.values())}): point it at the folder that holds them")
        return {next(iter(corpus.files)): path}
    found = _files_in(path, corpus) or _files_in(os.path.join(path, corpus.folder), corpus)
    if found is None:
        raise UsageError(f"{origin} {path}: expected {', '.join(corpus.files.values())} there (or in "
                         f"{path}/{corpus.folder}/)")
    return found


def find_corpus(corpus: TextCorpus, data_path: str | None = None, download: bool = True) -> dict:
    """The local file of each split of ``corpus`` (see the module docstring for the search order)."""
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
    where = (f"{corpus.name}: no local copy found. Pass --data_path FILE_OR_FOLDER, set ${corpus.env_var}, or set "
             f"${DATA_ROOT_ENV} to a folder holding {corpus.folder}/{{{','.join(corpus.files.values())}}}")
    if not download or not corpus.urls:
        raise UsageError(where)
    try:
        for split, url in corpus.urls.items():
            name = corpus.files.get(split, os.path.basename(url))
            if not os.path.isfile(os.path.join(cached_folder, name)):
                download_file(url, os.path.join(cached_folder, name), corpus.sha256.get(name))
    except UsageError as error:
        raise UsageError(f"{error}; {where}") from error
    found = _files_in(cached_folder, corpus)
    if found is None:
        raise UsageError(where)
    return found


def read_text(path: str) -> str:
    with open(path, encoding="utf-8", newline="") as handle:  # byte-exact: "\r" stays "\r"
        text = handle.read()
    if not text.strip():
        raise UsageError(f"{path} is empty")
    return text


def write_files(folder: str, contents: dict) -> dict:
    """``{name: text}`` written into ``folder``, each file only when its content changed (so that the caches of
    ``datasets``, keyed on the files' times, stay valid); returns ``{name: path}``."""
    os.makedirs(folder, exist_ok=True)
    paths = {}
    for name, text in contents.items():
        path = paths[name] = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path, encoding="utf-8", newline="") as handle:
                if handle.read() == text:
                    continue
        with open(path + ".tmp", "w", encoding="utf-8", newline="") as handle:
            handle.write(text)
        os.replace(path + ".tmp", path)
    return paths


def write_jsonl(folder: str, rows_per_file: dict) -> dict:
    """``{name: [row dict, ...]}`` as JSON-lines files in ``folder`` (`write_files`)."""
    return write_files(folder, {name: "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
                                for name, rows in rows_per_file.items()})


END_OF_TEXT = "<|endoftext|>"


def train_bpe_tokenizer(texts, vocab_size: int, save_directory: str):
    """A byte-level BPE ``PreTrainedTokenizerFast`` (GPT-2's pre-tokenizer and byte alphabet, so no unknown token)
    of ``vocab_size`` ids trained on ``texts``, one of them ``<|endoftext|>`` (also padding, beginning and end),
    saved in ``save_directory``: GPT-2's own tokenizer, sized to the model, where it cannot be downloaded."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 257:
        raise UsageError(f"a byte-level BPE needs at least 257 ids (256 bytes and {END_OF_TEXT}), got {vocab_size}")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[END_OF_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=END_OF_TEXT, eos_token=END_OF_TEXT,
                                        unk_token=END_OF_TEXT, pad_token=END_OF_TEXT)
    tokenizer.save_pretrained(save_directory)
    return tokenizer
