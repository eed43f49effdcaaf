"""Byte-level BPE tokenizers trained with ``tokenizers`` on a training split, saved as ``PreTrainedTokenizerFast``.

GPT-2's own tokenizer files cannot be downloaded on every machine; a byte-level BPE trained on the benchmark's
training split is the same kind of tokenizer (GPT-2's pre-tokenizer and byte alphabet, no unknown tokens), with
a vocabulary sized to the model. Any local tokenizer folder can be used instead (``load_tokenizer``).
"""

from __future__ import annotations

import hashlib
import json
import os

END_OF_TEXT = "<|endoftext|>"
META_FILE = "bpe_training.json"  # how a saved BPE tokenizer was trained: reused only when this matches


def _fingerprint(texts) -> str:
    digest = hashlib.sha256()
    for text in texts:
        digest.update(text.encode("utf-8", "surrogatepass"))
        digest.update(b"\x00")
    return digest.hexdigest()


def train_bpe_tokenizer(texts, vocab_size: int, save_directory: str | None = None, min_frequency: int = 2):
    """A byte-level BPE ``PreTrainedTokenizerFast`` with ``vocab_size`` ids (one of them ``<|endoftext|>``, which
    is also the padding, beginning and end token) trained on ``texts`` (a list of strings: lines or documents).

    With ``save_directory``, the tokenizer is saved there; a tokenizer already saved there from the same texts
    and vocabulary size is loaded instead of trained again.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if vocab_size < 257:
        raise ValueError(f"a byte-level BPE needs at least 257 ids (256 bytes and {END_OF_TEXT}), got {vocab_size}")
    texts = list(texts)
    meta = {"vocab_size": vocab_size, "min_frequency": min_frequency, "texts_sha256": _fingerprint(texts),
            "texts": len(texts)}
    if save_directory and os.path.isfile(os.path.join(save_directory, META_FILE)):
        with open(os.path.join(save_directory, META_FILE), encoding="utf-8") as handle:
            if json.load(handle) == meta:
                return AutoTokenizer.from_pretrained(save_directory)
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[END_OF_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=END_OF_TEXT, eos_token=END_OF_TEXT,
                                        unk_token=END_OF_TEXT, pad_token=END_OF_TEXT)
    if save_directory:
        os.makedirs(save_directory, exist_ok=True)
        tokenizer.save_pretrained(save_directory)
        from .runs import write_text_atomically

        # Every process of a data-parallel run trains and saves the same tokenizer.
        write_text_atomically(os.path.join(save_directory, META_FILE), json.dumps(meta))
    return tokenizer


def load_tokenizer(path: str):
    """Any local tokenizer folder (``AutoTokenizer``); a padding token is added from eos / unk when missing."""
    from transformers import AutoTokenizer

    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer folder {path} not found")
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    return tokenizer


def byte_tokenizer(save_directory: str | None = None):
    """One id per UTF-8 byte (the Long Range Arena text task's input), plus padding: a ``PreTrainedTokenizerFast``
    whose byte-level pre-tokenizer maps every byte to one symbol and whose vocabulary is exactly those 256."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<pad>": 0, **{symbol: index + 1 for index, symbol in enumerate(alphabet)}}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<pad>")
    if save_directory:
        tokenizer.save_pretrained(save_directory)
    return tokenizer
