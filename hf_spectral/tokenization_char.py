"""Character-level tokenizer: one id per character of a text file, as in the char-level benchmarks.

Self-contained (imports only ``transformers``) so that ``save_pretrained`` can copy it next to a
checkpoint and ``AutoTokenizer.from_pretrained(path, trust_remote_code=True)`` works without hf_spectral.
"""

import json
import os

from transformers import PreTrainedTokenizer

VOCAB_FILES_NAMES = {"vocab_file": "vocab.json"}
# The special tokens `CharTokenizer.from_text` adds by default (as the recipes' "<unk>", not a character of a text)
DEFAULT_EOS_TOKEN = "<eos>"
DEFAULT_PAD_TOKEN = "<pad>"


class CharTokenizer(PreTrainedTokenizer):
    """A character-level `PreTrainedTokenizer`.

    The vocabulary is the sorted set of characters of a corpus (``from_text`` / ``from_text_file``), so that
    TinyShakespeare's characters take the 65 ids 0-64 used in the papers. Special tokens are appended after the
    characters: ``from_text`` adds a padding token ``<pad>`` and an end-of-sequence token ``<eos>`` by default, in
    this order (``add_eos_and_pad=False`` leaves them out), so that batched generation, transformers' pipelines
    and lm-eval's scoring work; the constructor adds only the special tokens it is given. No token is inserted
    into encoded text: like GPT-2's tokenizer, ``tokenizer(text)`` gives the characters' ids only.

    Args:
        vocab_file (`str`): JSON file mapping each character to its id.
        unk_token (`str`, *optional*): Token for characters outside the vocabulary. Without it, such a
            character raises a `ValueError` instead of being silently replaced.
        pad_token, bos_token, eos_token (`str`, *optional*): Special tokens, added to the vocabulary if absent.
    """

    vocab_files_names = VOCAB_FILES_NAMES
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file, unk_token=None, pad_token=None, bos_token=None, eos_token=None, **kwargs):
        self.vocab = _read_vocabulary(vocab_file)
        # Special tokens new to the vocabulary take the next free ids: after the file's ids and after those of the
        # tokens added with `add_tokens` / `add_special_tokens` (a saved tokenizer gives them back in
        # `added_tokens_decoder`), which keep theirs.
        added = {int(index): str(token) for index, token in (kwargs.get("added_tokens_decoder") or {}).items()}
        next_id = max([*self.vocab.values(), *added]) + 1
        for token in (unk_token, pad_token, bos_token, eos_token):
            if token is not None and str(token) not in self.vocab and str(token) not in added.values():
                self.vocab[str(token)] = next_id
                next_id += 1
        self.ids_to_tokens = {index: token for token, index in self.vocab.items()}
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        super().__init__(
            unk_token=unk_token, pad_token=pad_token, bos_token=bos_token, eos_token=eos_token, **kwargs
        )

    @classmethod
    def from_text(cls, text: str, save_directory: str, add_eos_and_pad: bool = True, **kwargs) -> "CharTokenizer":
        """Build the vocabulary from the characters of ``text``; the vocab file is written to ``save_directory``.

        With ``add_eos_and_pad`` (the default), ``pad_token`` and ``eos_token`` default to ``DEFAULT_PAD_TOKEN`` and
        ``DEFAULT_EOS_TOKEN``, the ids after the characters (and after ``unk_token``, when given); passing either one
        (``None`` to leave that one out) overrides its default. ``add_eos_and_pad=False``: no special token but
        those passed, the vocabulary of the characters alone (as tokenizers built before these defaults).
        """
        if not text:
            raise ValueError("cannot build a character vocabulary from an empty text")
        if add_eos_and_pad:
            # Padding is its own token, not the end-of-sequence one as GPT-2 users often set it: a collator that
            # masks the labels of padding (DataCollatorForLanguageModeling masks every pad id) would otherwise
            # also mask every real end of sequence, and the model would never learn to stop. A character vocabulary
            # is built from scratch, so the extra id costs nothing to keep them apart.
            kwargs.setdefault("eos_token", DEFAULT_EOS_TOKEN)
            kwargs.setdefault("pad_token", DEFAULT_PAD_TOKEN)
        os.makedirs(save_directory, exist_ok=True)
        vocab_file = os.path.join(save_directory, VOCAB_FILES_NAMES["vocab_file"])
        with open(vocab_file, "w", encoding="utf-8") as handle:
            json.dump({char: index for index, char in enumerate(sorted(set(text)))}, handle, ensure_ascii=False)
        return cls(vocab_file, **kwargs)

    @classmethod
    def from_text_file(cls, path: str, save_directory: str, **kwargs) -> "CharTokenizer":
        """Build the vocabulary from the characters of the UTF-8 text file at ``path``."""
        if not os.path.isfile(path):
            raise FileNotFoundError(f"text file not found: {path}")
        with open(path, encoding="utf-8") as handle:
            return cls.from_text(handle.read(), save_directory, **kwargs)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def get_vocab(self) -> dict:
        # With the tokens added later (`add_tokens`): transformers sizes the tokenizer and numbers new tokens from it.
        return {**self.vocab, **self.added_tokens_encoder}

    def _tokenize(self, text, **kwargs):
        return list(text)

    def _convert_token_to_id(self, token):
        if token in self.vocab:
            return self.vocab[token]
        if self.unk_token is not None:  # an unk_token given after construction is an added token
            unk = str(self.unk_token)
            index = self.added_tokens_encoder.get(unk, self.vocab.get(unk))
            if index is None:
                raise ValueError(f"unk_token {unk!r} has no id: add it with add_special_tokens({{'unk_token': ...}})")
            return index
        raise ValueError(f"character {token!r} is not in the vocabulary and the tokenizer has no unk_token")

    def _convert_id_to_token(self, index):
        if index not in self.ids_to_tokens:
            raise ValueError(f"token id {index} is outside the vocabulary (size {len(self.vocab)})")
        return self.ids_to_tokens[index]

    def convert_tokens_to_string(self, tokens):
        return "".join(tokens)

    def save_vocabulary(self, save_directory, filename_prefix=None):
        if not os.path.isdir(save_directory):
            raise ValueError(f"save_directory must be an existing directory, got {save_directory}")
        name = (filename_prefix + "-" if filename_prefix else "") + VOCAB_FILES_NAMES["vocab_file"]
        vocab_file = os.path.join(save_directory, name)
        with open(vocab_file, "w", encoding="utf-8") as handle:
            json.dump(self.vocab, handle, ensure_ascii=False)
        return (vocab_file,)


def _read_vocabulary(vocab_file) -> dict:
    """The character -> id mapping of ``vocab_file``, refused with the file's name when missing or malformed."""
    if vocab_file is None or not os.path.isfile(vocab_file):  # (transformers would replace an OSError's message)
        raise ValueError(
            f"CharTokenizer needs its vocabulary file ({VOCAB_FILES_NAMES['vocab_file']}); not found: {vocab_file}"
        )
    try:
        with open(vocab_file, encoding="utf-8") as handle:
            vocab = json.load(handle)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{vocab_file} is not UTF-8 JSON: {error}") from error
    if not isinstance(vocab, dict) or not vocab:
        raise ValueError(f"{vocab_file} does not hold a non-empty JSON object mapping characters to ids")
    ids = list(vocab.values())
    if any(type(index) is not int or index < 0 for index in ids) or len(set(ids)) != len(ids):
        raise ValueError(f"{vocab_file}: the ids must be distinct non-negative integers")
    return vocab
