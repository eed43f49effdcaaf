import pytest
import torch
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, pipeline

import hf_spectral
from hf_spectral import CharTokenizer, EGAConfig, EGAForCausalLM


def test_vocabulary_is_the_sorted_characters_of_the_text_then_pad_and_eos(tmp_path):
    text = "to be, or not to be\n"
    tokenizer = CharTokenizer.from_text(text, tmp_path)
    characters = len(set(text))
    assert tokenizer.vocab_size == len(tokenizer) == characters + 2
    assert tokenizer.convert_ids_to_tokens(list(range(characters))) == sorted(set(text))
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<pad>", characters)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<eos>", characters + 1)
    ids = tokenizer(text)["input_ids"]  # no token is inserted: the characters alone, as GPT-2's tokenizer
    assert len(ids) == len(text) and tokenizer.decode(ids) == text
    assert tokenizer.decode(ids + [tokenizer.eos_token_id], skip_special_tokens=True) == text


def test_tinyshakespeare_sized_vocabulary(tmp_path):
    text = "".join(chr(c) for c in range(32, 97)) * 3  # 65 distinct characters
    tokenizer = CharTokenizer.from_text(text, tmp_path)
    assert tokenizer.convert_tokens_to_ids(sorted(set(text))) == list(range(65)) and len(tokenizer) == 67
    assert CharTokenizer.from_text(text, tmp_path / "bare", add_eos_and_pad=False).vocab_size == 65


def test_eos_and_pad_can_be_left_out_or_renamed(tmp_path):
    bare = CharTokenizer.from_text("abc", tmp_path / "bare", add_eos_and_pad=False)
    assert bare.eos_token is None and bare.pad_token is None and len(bare) == 3
    no_pad = CharTokenizer.from_text("abc", tmp_path / "no_pad", pad_token=None)
    assert no_pad.pad_token is None and no_pad.eos_token_id == 3 and len(no_pad) == 4
    # the recipes' unknown token keeps the first id after the characters; a token of one's own replaces a default
    named = CharTokenizer.from_text("abc", tmp_path / "named", unk_token="<unk>", eos_token="</s>")
    assert [named.unk_token_id, named.pad_token_id, named.eos_token_id] == [3, 4, 5] and named.eos_token == "</s>"


def test_eos_and_pad_survive_saving_and_tokenizers_saved_without_them_still_load(tmp_path):
    tokenizer = CharTokenizer.from_text("hello world", tmp_path / "build")
    tokenizer.save_pretrained(tmp_path / "saved")
    EGAConfig(vocab_size=len(tokenizer)).save_pretrained(tmp_path / "saved")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "saved")
    assert (loaded.eos_token, loaded.pad_token) == ("<eos>", "<pad>")
    assert (loaded.eos_token_id, loaded.pad_token_id) == (tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert loaded.get_vocab() == tokenizer.get_vocab()

    # A folder saved before from_text added them (the characters only) loads as it was saved, ids unchanged
    CharTokenizer.from_text("hello world", tmp_path / "old", add_eos_and_pad=False).save_pretrained(tmp_path / "old")
    old = CharTokenizer.from_pretrained(tmp_path / "old")
    assert old.eos_token is None and old.pad_token is None and len(old) == len(set("hello world"))


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
    tokenizer = CharTokenizer.from_text("abc", tmp_path / "build", add_eos_and_pad=False, pad_token="<pad>")
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
    tokenizer = CharTokenizer.from_text("abc \n", tmp_path / "build", add_eos_and_pad=False)
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


PROMPTS = ["to be, or not", "to", "or not to be, that is", "be"]  # different lengths: batches pad them


def _tiny_model(name, vocab_size):
    torch.manual_seed(0)
    if name == "ega-gpt":
        config = EGAConfig.from_variant("EGA-1", vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2,
                                        num_attention_heads=2, max_position_embeddings=64)
        return EGAForCausalLM(config).eval()
    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab_size, n_embd=32, n_layer=2, n_head=2, n_positions=64)).eval()


@pytest.mark.parametrize("name", ["ega-gpt", "gpt2"])
def test_text_generation_pipeline_batches_prompts_as_it_runs_them_alone(tmp_path, name):
    """transformers' pipeline refuses to batch with a tokenizer without a pad token; with from_text's defaults each
    output of a left-padded batch is the output of its prompt alone."""
    tokenizer = CharTokenizer.from_text("".join(PROMPTS), tmp_path)
    generator = pipeline("text-generation", model=_tiny_model(name, len(tokenizer)), tokenizer=tokenizer)
    settings = dict(max_new_tokens=6, do_sample=False, return_full_text=False)
    alone = [generator(prompt, **settings)[0]["generated_text"] for prompt in PROMPTS]
    batched = [out[0]["generated_text"] for out in generator(PROMPTS, batch_size=3, **settings)]
    # (a random model may generate the end-of-sequence token, which ends that output early)
    assert batched == alone and sum(map(len, alone)) > 2 * len(PROMPTS)


def _loglikelihoods(model, tokenizer, requests):
    """lm-eval's loglikelihood of (context, continuation) pairs, as its HF model scores them: context and
    continuation encoded apart, an empty context replaced by the end-of-sequence token (lm-eval's prefix token
    when the tokenizer has no bos), the pairs left-padded into one batch, the continuation's log-probabilities
    summed."""
    prefix = [tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id]
    rows = [(tokenizer(context)["input_ids"] if context else prefix, tokenizer(continuation)["input_ids"])
            for context, continuation in requests]
    batch = tokenizer.pad({"input_ids": [context + continuation for context, continuation in rows]},
                          padding_side="left", return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits.log_softmax(-1)
    scores = []
    for row, (context, continuation) in enumerate(rows):
        targets = torch.tensor(continuation)
        predicted = logits[row, -len(continuation) - 1 : -1]  # the positions that predict the continuation
        scores.append(float(predicted.gather(-1, targets[:, None]).sum()))
    return scores


def test_lm_eval_style_scoring_batches_pairs_and_scores_an_empty_context(tmp_path):
    """Scoring needs a pad token to batch requests of different lengths and an eos (or bos) token to stand for an
    empty context: the batched scores are those of each request alone."""
    tokenizer = CharTokenizer.from_text("".join(PROMPTS), tmp_path)
    model = _tiny_model("ega-gpt", len(tokenizer))
    requests = [("to be, or", " not"), ("", "to be"), ("or not to be, that", " is")]
    alone = [_loglikelihoods(model, tokenizer, [request])[0] for request in requests]
    assert _loglikelihoods(model, tokenizer, requests) == pytest.approx(alone, abs=1e-4)
    assert all(score < 0 for score in alone)

    bare = CharTokenizer.from_text("".join(PROMPTS), tmp_path / "bare", add_eos_and_pad=False)
    with pytest.raises(ValueError, match="padding token"):
        bare.pad({"input_ids": [[1, 2], [3]]}, padding_side="left", return_tensors="pt")


def test_lm_eval_scores_with_the_tokenizer_when_installed(tmp_path):
    """lm-eval's own HF model (not a test dependency: skipped without it) batches and scores with from_text's
    tokenizer as the sketch above does; without eos and pad it fails on the empty context."""
    huggingface = pytest.importorskip("lm_eval.models.huggingface")
    from lm_eval.api.instance import Instance

    tokenizer = CharTokenizer.from_text("".join(PROMPTS), tmp_path)
    model = _tiny_model("ega-gpt", len(tokenizer))
    requests = [("to be, or", " not"), ("", "to be"), ("or not to be, that", " is")]
    instances = [Instance("loglikelihood", {}, request, index) for index, request in enumerate(requests)]
    scores = huggingface.HFLM(pretrained=model, tokenizer=tokenizer, batch_size=2, device="cpu").loglikelihood(instances)
    assert [score for score, _ in scores] == pytest.approx(_loglikelihoods(model, tokenizer, requests), abs=1e-4)

    bare = CharTokenizer.from_text("".join(PROMPTS), tmp_path / "bare", add_eos_and_pad=False)
    with pytest.raises(TypeError):
        huggingface.HFLM(pretrained=model, tokenizer=bare, batch_size=2, device="cpu").loglikelihood(instances)
