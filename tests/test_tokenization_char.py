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


def test_added_tokens_get_their_own_ids_and_survive_saving(tmp_path):
    """transformers numbers added tokens and sizes the tokenizer from get_vocab: added tokens must be in it."""
    tokenizer = CharTokenizer.from_text("abc", tmp_path / "build", pad_token="<pad>")
    assert tokenizer.add_tokens(["xyz", "Q"]) == 2 and len(tokenizer) == 6
    tokenizer.add_special_tokens({"additional_special_tokens": ["<mask>"]})
    ids = tokenizer("xyz<mask>")["input_ids"]
    assert ids == [4, 6] and tokenizer.decode(ids) == "xyz<mask>"
    tokenizer.save_pretrained(tmp_path / "saved")
    loaded = CharTokenizer.from_pretrained(tmp_path / "saved")
    assert len(loaded) == 7 and loaded("Qxyz<mask>")["input_ids"] == [5, 4, 6]


def test_special_tokens_take_the_next_free_id_of_any_vocabulary(tmp_path):
    (tmp_path / "vocab.json").write_text('{"a": 1, "b": 2}')
    tokenizer = CharTokenizer(str(tmp_path / "vocab.json"), pad_token="<pad>")
    assert tokenizer.pad_token_id == 3 and tokenizer.decode([2]) == "b"


def test_special_tokens_given_after_tokens_were_added_take_ids_no_token_has(tmp_path):
    """A special token given at load time goes after the added tokens (it had taken the first added token's id,
    dropping that token), and an unk_token added later maps unknown characters to itself (it had raised KeyError,
    and after saving mapped them to another token's id)."""
    tokenizer = CharTokenizer.from_text("abc \n", tmp_path / "build")
    tokenizer.add_tokens(["<x>"])  # id 5
    tokenizer.save_pretrained(tmp_path / "added")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "added", pad_token="<pad>")
    assert loaded.convert_tokens_to_ids("<x>") == 5 and loaded.pad_token_id == 6
    assert loaded("a<x>b")["input_ids"] == [2, 5, 3] and len(loaded) == 7

    tokenizer.add_special_tokens({"unk_token": "<unk>"})  # id 6
    assert tokenizer("az")["input_ids"] == [2, 6]
    tokenizer.save_pretrained(tmp_path / "unk")
    reloaded = AutoTokenizer.from_pretrained(tmp_path / "unk")
    assert reloaded.unk_token_id == 6 and reloaded("az<x>")["input_ids"] == [2, 6, 5]
    assert reloaded.get_vocab() == tokenizer.get_vocab() and len(reloaded) == len(tokenizer) == 7


@pytest.mark.parametrize("content, error, message", [
    (None, ValueError, r"needs its vocabulary file \(vocab.json\); not found"),
    (b"{not json", ValueError, "vocab.json is not UTF-8 JSON"),
    (b'{"a": "0"}', ValueError, "distinct non-negative integers"),
    (b'{"a": 0, "b": 0}', ValueError, "distinct non-negative integers"),
    (b"[]", ValueError, "non-empty JSON object"),
], ids=["missing", "not json", "string id", "duplicate ids", "not an object"])
def test_a_missing_or_malformed_vocabulary_file_is_refused_by_name(tmp_path, content, error, message):
    CharTokenizer.from_text("ab", tmp_path).save_pretrained(tmp_path)
    vocab = tmp_path / "vocab.json"
    if content is None:
        vocab.unlink()
    else:
        vocab.write_bytes(content)
    with pytest.raises(error, match=message):
        AutoTokenizer.from_pretrained(tmp_path)
