"""The benchmarks' data: corpus lookup and download, the files the drivers write for the training scripts, PTB's
character rule, the BPE tokenizer."""

import hashlib
import io
import os
import random
import urllib.error
from types import SimpleNamespace
from unittest import mock

import pytest

from training import ptb_char, tinyshakespeare
from training.common import data as data_module
from training.common.cli import UsageError
from training.common.data import TextCorpus, find_corpus, train_bpe_tokenizer, write_files

from .conftest import WORDS, shared_file


def test_tinyshakespeare_split_is_the_nanogpt_split_of_the_real_file(tmp_path):
    path = shared_file("tinyshakespeare", "input.txt")
    files = tinyshakespeare.data_files(str(tmp_path))
    tinyshakespeare.prepare_data(SimpleNamespace(data_path=path, no_download=True), files)
    text = open(path, encoding="utf-8").read()
    train = open(files["train_file"], encoding="utf-8").read()
    validation = open(files["validation_file"], encoding="utf-8").read()
    assert len(text) == 1_115_394 and (len(train), len(validation)) == (1_003_854, 111_540)  # int(0.9 · n) to train
    assert train + validation == text


def test_data_files_are_written_only_when_their_content_changes(tmp_path):
    paths = write_files(str(tmp_path), {"a.txt": "one\r\ntwo"})
    before = os.stat(paths["a.txt"]).st_mtime_ns
    os.utime(paths["a.txt"], ns=(before - 10**9, before - 10**9))  # as if written a second ago
    write_files(str(tmp_path), {"a.txt": "one\r\ntwo"})
    assert os.stat(paths["a.txt"]).st_mtime_ns == before - 10**9  # the caches of `datasets` keyed on it stay valid
    write_files(str(tmp_path), {"a.txt": "three"})
    assert open(paths["a.txt"], encoding="utf-8").read() == "three" and os.listdir(tmp_path) == ["a.txt"]
    assert open(write_files(str(tmp_path), {"b.txt": "x\r\n"})["b.txt"], "rb").read() == b"x\r\n"  # byte-exact


def _corpus(**changes):
    fields = dict(name="toy", folder="toy", files={"train": "input.txt"}, env_var="TOY_PATH",
                  urls={"train": "https://example.org/input.txt"})
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
    assert find_corpus(corpus, str(root / "arg"))["train"] == str(root / "arg" / "input.txt")
    assert find_corpus(corpus)["train"] == str(root / "var" / "input.txt")
    monkeypatch.delenv("TOY_PATH")
    assert find_corpus(corpus)["train"] == str(root / "root" / "toy" / "input.txt")


def test_a_wrong_data_path_is_a_clear_error(clean_environment):
    with pytest.raises(UsageError, match="expected input.txt"):
        find_corpus(_corpus(), str(clean_environment / "nowhere"))
    with pytest.raises(UsageError, match="point it at the folder"):
        two_files = _corpus(files={"train": "a.txt", "validation": "b.txt"})
        (clean_environment / "a.txt").write_text("x")
        find_corpus(two_files, str(clean_environment / "a.txt"))


def _serve(content: bytes):
    return mock.patch.object(data_module.urllib.request, "urlopen", return_value=io.BytesIO(content))


def test_download_fetches_the_public_file_and_checks_its_sha256(clean_environment):
    content = b"To be, or not to be\n" * 100
    corpus = _corpus(sha256={"input.txt": hashlib.sha256(content).hexdigest()})
    with _serve(content) as urlopen:
        path = find_corpus(corpus)["train"]
    assert urlopen.call_args[0][0] == "https://example.org/input.txt"
    assert open(path, "rb").read() == content
    assert path.startswith(str(clean_environment / "cache"))
    with _serve(b"never read") as urlopen:  # now cached: no second download
        assert find_corpus(corpus)["train"] == path
    urlopen.assert_not_called()


def test_a_corrupted_download_is_discarded(clean_environment):
    corpus = _corpus(sha256={"input.txt": "0" * 64})
    with _serve(b"tampered"), pytest.raises(UsageError, match="SHA-256"):
        find_corpus(corpus)
    assert not os.listdir(clean_environment / "cache" / "toy")


def test_offline_without_a_local_copy_says_what_to_pass(clean_environment):
    with mock.patch.object(data_module.urllib.request, "urlopen", side_effect=urllib.error.URLError("offline")):
        with pytest.raises(UsageError, match="--data_path") as error:
            find_corpus(tinyshakespeare.CORPUS)
    assert "TINYSHAKESPEARE_PATH" in str(error.value) and "HF_SPECTRAL_DATA" in str(error.value)
    with pytest.raises(UsageError, match="no local copy found"):
        find_corpus(tinyshakespeare.CORPUS, download=False)


def test_tinyshakespeare_downloads_from_char_rnn_up_to_the_network_call(clean_environment):
    path = shared_file("tinyshakespeare", "input.txt")
    with _serve(open(path, "rb").read()) as urlopen:
        files = find_corpus(tinyshakespeare.CORPUS)
    assert "karpathy/char-rnn" in urlopen.call_args[0][0]
    assert data_module.sha256_of(files["train"]) == tinyshakespeare.CORPUS.sha256["input.txt"]


def test_ptb_char_files_are_derived_from_the_downloaded_word_files(clean_environment):
    served = {name: open(shared_file("ptb", name), "rb").read() for name in ptb_char.WORD_FILES.values()}

    def urlopen(url, timeout=None):
        return io.BytesIO(served[os.path.basename(url)])

    with mock.patch.object(data_module.urllib.request, "urlopen", side_effect=urlopen):
        files = find_corpus(ptb_char.CORPUS)
    for split in ("validation", "test"):
        derived = open(files[split], "rb").read()
        assert derived == open(shared_file("ptb", ptb_char.CHAR_FILES[split]), "rb").read()


def test_ptb_word_to_char_rule_reproduces_the_published_file():
    words = open(shared_file("ptb", "ptb.valid.txt"), encoding="utf-8").read()
    assert ptb_char.word_to_char(words) == open(shared_file("ptb", "ptb.char.valid.txt"), encoding="utf-8").read()


def test_joined_ptb_format_drops_only_the_separator_spaces():
    assert ptb_char.join_characters("a b _ c d \n e _ f \n ") == "ab_cd\ne_f\n"


def test_bpe_tokenizer_is_saved_and_reloaded_with_no_unknown_byte(tmp_path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    lines = [" ".join(random.Random(i).choice(WORDS) for _ in range(12)) + " \n" for i in range(300)]
    tokenizer = train_bpe_tokenizer(lines, 320, str(tmp_path / "tok"))
    assert isinstance(tokenizer, PreTrainedTokenizerFast) and len(tokenizer) <= 320
    reloaded = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    text = "the king of ünïcode 123\n"
    assert reloaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert reloaded.decode(reloaded(text)["input_ids"]) == text  # byte-level: every character comes back
    assert reloaded.pad_token == reloaded.eos_token == "<|endoftext|>"
    with pytest.raises(UsageError, match="at least 257 ids"):
        train_bpe_tokenizer(lines, 100, str(tmp_path / "small"))
