"""Corpus lookup, download, tokenization, splitting and packing of the recipe data layer."""

import hashlib
import io
import os
import urllib.error
from unittest import mock

import numpy as np
import pytest

from training.common import data as data_module
from training.common.data import (
    CorpusNotFoundError,
    TextCorpus,
    build_lm_data,
    char_tokenizer,
    contiguous_split,
    encode_text,
    load_corpus_texts,
    pack_blocks,
    resolve_corpus_files,
    word_tokenizer,
)
from training import ptb_char, tinyshakespeare

from .conftest import shared_file, synthetic_text


def test_packed_blocks_make_every_token_but_the_first_a_target_exactly_once():
    ids = np.arange(1000)
    blocks = pack_blocks(ids, 10)
    targets = blocks[:, 1:].reshape(-1)
    assert blocks.shape == (111, 10)
    np.testing.assert_array_equal(targets, ids[1 : 1 + targets.size])
    assert 1000 - 1 - targets.size < 9  # only a tail shorter than one block is dropped


def test_packing_rejects_text_shorter_than_one_block():
    with pytest.raises(ValueError, match="too few"):
        pack_blocks(np.arange(5), 10)


def test_contiguous_split_holds_out_the_last_ten_percent():
    train, validation = contiguous_split(np.arange(1000), 0.1)
    np.testing.assert_array_equal(train, np.arange(900))
    np.testing.assert_array_equal(validation, np.arange(900, 1000))
    with pytest.raises(ValueError):
        contiguous_split(np.arange(10), 1.5)


def test_tinyshakespeare_split_is_the_nanogpt_split_of_the_real_file(tmp_path):
    path = shared_file("tinyshakespeare", "input.txt")
    texts = load_corpus_texts(tinyshakespeare.CORPUS, data_path=path, download=False)
    text = open(path, encoding="utf-8").read()
    assert texts["train"] == text and len(text) == 1_115_394
    tokenizer = char_tokenizer(texts, str(tmp_path))
    data = build_lm_data(texts, tokenizer, 256, validation_fraction=0.1)
    assert len(tokenizer) == 65
    assert data.tokens == {"train": 1_003_854, "validation": 111_540}  # int(0.9 · n) characters for training
    first_validation_block = data.datasets["validation"][0]["input_ids"].tolist()
    assert tokenizer.decode(first_validation_block) == text[1_003_854 : 1_003_854 + 256]


def test_char_encoding_equals_the_tokenizer_call(tmp_path):
    text = synthetic_text(2000)
    tokenizer = char_tokenizer({"train": text}, str(tmp_path))
    assert encode_text(tokenizer, text).tolist() == tokenizer(text)["input_ids"]
    # a text that spells a token of several characters: tokenizer(text) keeps it whole, and so does encode_text
    tokenizer.add_special_tokens({"unk_token": "<unk>"})
    spelled = text[:50] + "<unk>" + text[50:100]
    assert encode_text(tokenizer, spelled).tolist() == tokenizer(spelled)["input_ids"]
    assert len(encode_text(tokenizer, spelled)) == 101


def test_word_tokenizer_maps_line_ends_to_eos_and_unknown_words_to_unk(tmp_path):
    tokenizer = word_tokenizer(" the cat sat \n the dog \n", str(tmp_path))
    ids = encode_text(tokenizer, " the bird sat \n")
    assert tokenizer.convert_ids_to_tokens(ids.tolist()) == ["the", "<unk>", "sat", "<eos>"]
    reloaded = type(tokenizer).from_pretrained(str(tmp_path))
    assert reloaded("the dog")["input_ids"] == tokenizer("the dog")["input_ids"]


def test_bits_per_char_accounting_counts_characters_per_token(tmp_path):
    text = " the cat sat \n the dog \n" * 50
    tokenizer = word_tokenizer(text, str(tmp_path))
    data = build_lm_data({"train": text, "validation": text}, tokenizer, 8)
    assert data.tokens["validation"] == 7 * 50  # the cat sat <eos> the dog <eos>
    assert data.chars_per_token("validation") == pytest.approx(len(text) / (7 * 50))


def test_a_held_out_split_counts_its_own_characters(tmp_path):
    text = "abcdefghij" * 100  # one character per token: each split has as many characters as tokens
    data = build_lm_data({"train": text}, char_tokenizer({"train": text}, str(tmp_path)), 8, validation_fraction=0.1)
    assert data.characters == {"train": 900, "validation": 100}
    assert data.chars_per_token("train") == data.chars_per_token("validation") == 1.0


# ------------------------------------------------------------------------------------------------------------
# Where the text comes from
# ------------------------------------------------------------------------------------------------------------


def _corpus(**changes):
    fields = dict(name="toy", folder="toy", files={"train": "input.txt"}, env_var="TOY_PATH",
                  urls={"train": "https://example.org/input.txt"}, validation_fraction=0.1)
    fields.update(changes)
    return TextCorpus(**fields)


@pytest.fixture
def clean_environment(monkeypatch, tmp_path):
    for name in ("TOY_PATH", "HF_SPECTRAL_DATA", "TINYSHAKESPEARE_PATH", "PTB_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_SPECTRAL_CACHE", str(tmp_path / "cache"))
    return tmp_path


def test_lookup_order_is_argument_then_variable_then_data_root(clean_environment, monkeypatch):
    root = clean_environment
    for folder in ("arg", "var", "root/toy"):
        (root / folder).mkdir(parents=True)
        (root / folder / "input.txt").write_text(folder)
    corpus = _corpus()
    monkeypatch.setenv("TOY_PATH", str(root / "var" / "input.txt"))
    monkeypatch.setenv("HF_SPECTRAL_DATA", str(root / "root"))
    assert resolve_corpus_files(corpus, str(root / "arg"))["train"] == str(root / "arg" / "input.txt")
    assert resolve_corpus_files(corpus)["train"] == str(root / "var" / "input.txt")
    monkeypatch.delenv("TOY_PATH")
    assert resolve_corpus_files(corpus)["train"] == str(root / "root" / "toy" / "input.txt")


def test_a_wrong_data_path_is_a_clear_error(clean_environment):
    with pytest.raises(CorpusNotFoundError, match="expected input.txt"):
        resolve_corpus_files(_corpus(), str(clean_environment / "nowhere"))
    with pytest.raises(ValueError, match="point it at the folder"):
        two_files = _corpus(files={"train": "a.txt", "validation": "b.txt"})
        (clean_environment / "a.txt").write_text("x")
        resolve_corpus_files(two_files, str(clean_environment / "a.txt"))


def _serve(content: bytes):
    return mock.patch.object(data_module.urllib.request, "urlopen", return_value=io.BytesIO(content))


def test_download_fetches_the_public_file_and_checks_its_sha256(clean_environment):
    content = b"To be, or not to be\n" * 100
    corpus = _corpus(sha256={"input.txt": hashlib.sha256(content).hexdigest()})
    with _serve(content) as urlopen:
        path = resolve_corpus_files(corpus)["train"]
    assert urlopen.call_args[0][0] == "https://example.org/input.txt"
    assert open(path, "rb").read() == content
    assert path.startswith(str(clean_environment / "cache"))
    with _serve(b"never read") as urlopen:  # now cached: no second download
        assert resolve_corpus_files(corpus)["train"] == path
    urlopen.assert_not_called()


def test_a_corrupted_download_is_discarded(clean_environment):
    corpus = _corpus(sha256={"input.txt": "0" * 64})
    with _serve(b"tampered"), pytest.raises(ValueError, match="SHA-256"):
        resolve_corpus_files(corpus)
    assert not os.listdir(clean_environment / "cache" / "toy")


def test_offline_without_a_local_copy_says_what_to_pass(clean_environment):
    with mock.patch.object(data_module.urllib.request, "urlopen", side_effect=urllib.error.URLError("offline")):
        with pytest.raises(CorpusNotFoundError, match="--data_path") as error:
            resolve_corpus_files(tinyshakespeare.CORPUS)
    assert "TINYSHAKESPEARE_PATH" in str(error.value) and "HF_SPECTRAL_DATA" in str(error.value)


def test_tinyshakespeare_downloads_from_char_rnn_up_to_the_network_call(clean_environment):
    path = shared_file("tinyshakespeare", "input.txt")
    with _serve(open(path, "rb").read()) as urlopen:
        files = resolve_corpus_files(tinyshakespeare.CORPUS)
    assert "karpathy/char-rnn" in urlopen.call_args[0][0]
    assert data_module.sha256_of(files["train"]) == tinyshakespeare.CORPUS.sha256["input.txt"]


def test_ptb_char_files_are_derived_from_the_downloaded_word_files(clean_environment):
    served = {name: open(shared_file("ptb", name), "rb").read() for name in ptb_char.WORD_FILES.values()}

    def urlopen(url, timeout=None):
        return io.BytesIO(served[os.path.basename(url)])

    with mock.patch.object(data_module.urllib.request, "urlopen", side_effect=urlopen):
        files = resolve_corpus_files(ptb_char.CORPUS)
    for split in ("validation", "test"):
        derived = open(files[split], "rb").read()
        assert derived == open(shared_file("ptb", ptb_char.CHAR_FILES[split]), "rb").read()


def test_ptb_word_to_char_rule_reproduces_the_published_file():
    words = open(shared_file("ptb", "ptb.valid.txt"), encoding="utf-8").read()
    assert ptb_char.word_to_char(words) == open(shared_file("ptb", "ptb.char.valid.txt"), encoding="utf-8").read()


def test_ptb_from_the_hub_gets_the_character_rule_before_the_tokenizer(monkeypatch, tmp_path):
    import argparse

    words = {"train": "the company said\n", "validation": "it said\n", "test": "no\n"}
    monkeypatch.setattr(ptb_char, "load_corpus_texts", lambda *args, **kwargs: dict(words))
    seen = {}
    monkeypatch.setattr(ptb_char, "build_lm_data", lambda texts, tokenizer, block: seen.update(texts))
    args = argparse.Namespace(data_path=None, dataset_name="ptb_text_only", dataset_config=None, text_column="sentence",
                              no_download=True, char_format="file")
    ptb_char.load_data(args, argparse.Namespace(context_length=8), str(tmp_path))
    assert seen == {split: ptb_char.word_to_char(text) for split, text in words.items()}
    assert seen["train"] != words["train"]


def test_joined_ptb_format_drops_only_the_separator_spaces():
    assert ptb_char.join_characters("a b _ c d \n e _ f \n ") == "ab_cd\ne_f\n"


def test_hub_dataset_names_are_read_through_datasets(monkeypatch):
    import datasets

    hub = datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"text": ["First Citizen:", "Before we proceed"]}),
        "validation": datasets.Dataset.from_dict({"text": ["All:"]}),
    })
    with mock.patch.object(datasets, "load_dataset", return_value=hub) as load:
        texts = load_corpus_texts(tinyshakespeare.CORPUS, dataset_name="karpathy/tiny_shakespeare")
    load.assert_called_once_with("karpathy/tiny_shakespeare", None)
    assert texts == {"train": "First Citizen:\nBefore we proceed", "validation": "All:"}
    with mock.patch.object(datasets, "load_dataset", return_value=hub):
        with pytest.raises(ValueError, match="no column 'content'"):
            load_corpus_texts(tinyshakespeare.CORPUS, dataset_name="x", text_column="content")
