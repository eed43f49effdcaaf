import pytest
from transformers import AutoTokenizer

import hf_spectral
from hf_spectral import CharTokenizer, EGAConfig


def test_vocabulary_is_the_sorted_characters_of_the_text(tmp_path):
    text = "to be, or not to be\n"
    tokenizer = CharTokenizer.from_text(text, tmp_path)
    assert tokenizer.vocab_size == len(set(text))
    assert tokenizer.convert_ids_to_tokens(list(range(tokenizer.vocab_size))) == sorted(set(text))
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text) and tokenizer.decode(ids) == text


def test_tinyshakespeare_sized_vocabulary(tmp_path):
    text = "".join(chr(c) for c in range(32, 97)) * 3  # 65 distinct characters
    assert CharTokenizer.from_text(text, tmp_path).vocab_size == 65


def test_save_and_reload_with_auto_tokenizer(tmp_path):
    tokenizer = CharTokenizer.from_text("hello world", tmp_path / "build", pad_token="<pad>")
    tokenizer.save_pretrained(tmp_path / "saved")
    EGAConfig(vocab_size=len(tokenizer)).save_pretrained(tmp_path / "saved")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "saved")
    assert type(loaded) is CharTokenizer
    assert loaded.get_vocab() == tokenizer.get_vocab() and loaded.pad_token == "<pad>"
    batch = loaded(["hello", "wo"], padding=True, padding_side="left")
    assert batch["attention_mask"][1] == [0, 0, 0, 1, 1]
    assert loaded.decode(batch["input_ids"][1], skip_special_tokens=True) == "wo"


def test_unknown_characters_raise_without_unk_token(tmp_path):
    tokenizer = CharTokenizer.from_text("abc", tmp_path)
    with pytest.raises(ValueError, match="'z'"):
        tokenizer("abz")
    with_unk = CharTokenizer.from_text("abc", tmp_path / "unk", unk_token="?")
    assert with_unk("abz")["input_ids"][-1] == with_unk.convert_tokens_to_ids("?")


def test_missing_text_file_is_reported(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing.txt"):
        CharTokenizer.from_text_file(tmp_path / "nothing.txt", tmp_path)
