"""EGA-GPT on packed rows (several documents a row, as `DataCollatorWithFlattening` and TRL's padding-free batches
give them): every variant and statistic, on every backend, in training and evaluation mode, gives each document what
it gets alone, and a packed batch's loss and gradients are those of its documents."""

import pytest
import torch
from transformers import DataCollatorWithFlattening, DynamicCache

from hf_spectral import EGAConfig, EGAForCausalLM, EGAForSequenceClassification
from tests.helpers import INDUCTOR_ISA_FORCED, INDUCTOR_SKIP_REASON
from tests.packing import (
    assert_documents_as_alone,
    assert_documents_mixed,
    assert_packed_loss_and_gradients,
    documents,
    flattened,
    packed_inputs,
)

VOCAB = 41
VARIANTS = {  # every variant of the paper; the filters (EGA-C, Morlet, Daubechies) at scales that reach past a boundary
    "EGA-1": {},
    "EGA-2": {},
    "EGA-4": {},
    "EGA-C": {"energy_scales": [3, 15]},
    "EGA-M-F": {"energy_scales": [3, 31]},
    "EGA-M": {"energy_scales": [7, 31]},
    "EGA-DB2": {"energy_scales": [1, 8]},
    "EGA-DB4": {"energy_scales": [1, 4]},
}
CASES = [("BASE", "causal")] + [(v, n) for v in VARIANTS for n in ("causal", "window", "none")]
_MODELS = {}


def packed_model(variant: str, normalization: str) -> EGAForCausalLM:
    """One tiny model per variant and statistic, shared by the tests here; gates far from the identity (random α,
    τ), so that statistics mixed across a boundary would show."""
    if (variant, normalization) not in _MODELS:
        torch.manual_seed(0)
        config = EGAConfig.from_variant(
            variant, vocab_size=VOCAB, hidden_size=24, num_hidden_layers=2, num_attention_heads=3,
            max_position_embeddings=96, embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0,
            energy_normalization=normalization, **VARIANTS.get(variant, {}),
        )
        model = EGAForCausalLM(config)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith((".alpha", ".tau", ".mix_logits")):
                    parameter.normal_(0, 1.5)
                if name.endswith("ln_1.weight"):  # signal energies read the channel mean, 0 under a fresh LayerNorm
                    parameter.normal_(1.0, 0.5)
        _MODELS[variant, normalization] = model
    return _MODELS[variant, normalization]


@pytest.mark.filterwarnings("ignore:.*SEES FUTURE TOKENS")
@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("variant, normalization", CASES)
def test_each_packed_document_gets_what_it_gets_alone(variant, normalization, backend, mode):
    model = packed_model(variant, normalization)
    model.set_attn_implementation(backend)
    model.train(mode == "train")
    docs = documents(VOCAB)
    with torch.no_grad():
        packed = assert_documents_as_alone(model, docs, gate_values=variant != "BASE")
    assert packed.cache is None  # a packed row's keys would be read by a later step of every document


@pytest.mark.filterwarnings("ignore:.*SEES FUTURE TOKENS")
@pytest.mark.parametrize("variant, normalization", [("EGA-1", "causal"), ("EGA-C", "window"), ("EGA-M", "causal")])
def test_the_boundaries_come_from_cu_seq_lens_alone_too(variant, normalization):
    """``cu_seq_lens_q/k`` without position ids (flash-attention kwargs): the positions of each document are counted
    from them, and the documents kept apart as with restarting position ids."""
    model = packed_model(variant, normalization).eval()
    model.set_attn_implementation("sdpa")
    docs = documents(VOCAB)
    with torch.no_grad():
        assert_documents_as_alone(model, docs, flash_kwargs=True, positions=False, gate_values=True)
        assert_documents_as_alone(model, docs, flash_kwargs=True, positions=True, gate_values=True)


@pytest.mark.filterwarnings("ignore:.*SEES FUTURE TOKENS")
@pytest.mark.parametrize("variant, normalization", CASES)
def test_a_packed_batch_has_the_loss_and_gradients_of_its_documents(variant, normalization):
    model = packed_model(variant, normalization).train()
    model.set_attn_implementation("sdpa")
    assert_packed_loss_and_gradients(model, documents(VOCAB, seed=1))


@pytest.mark.filterwarnings("ignore:.*SEES FUTURE TOKENS")
@pytest.mark.parametrize("normalization", ["causal", "window"])
def test_concatenated_documents_would_mix(normalization):
    """The counter-check that makes the tests above able to fail: without the boundaries the gates' statistics (and
    attention) run across documents."""
    with torch.no_grad():
        assert_documents_mixed(packed_model("EGA-C", normalization).eval(), documents(VOCAB))


@pytest.mark.skipif(INDUCTOR_ISA_FORCED, reason=INDUCTOR_SKIP_REASON)
@pytest.mark.filterwarnings("ignore:.*SEES FUTURE TOKENS")
@pytest.mark.parametrize("variant, normalization", [("EGA-1", "causal"), ("EGA-C", "window")])
def test_flex_attention_keeps_packed_documents_apart(variant, normalization):
    """flex_attention (evaluation: torch 2.13 has no flex backward on CPU), a BlockMask of transformers' own."""
    model = packed_model(variant, normalization).eval()
    model.set_attn_implementation("flex_attention")
    try:
        with torch.no_grad():
            assert_documents_as_alone(model, documents(VOCAB), gate_values=True)
    finally:
        model.set_attn_implementation("sdpa")


def test_packed_rows_refuse_a_cache_and_a_classifier_refuses_them():
    model = packed_model("EGA-1", "causal").eval()
    batch = packed_inputs(flattened(documents(VOCAB)))
    with pytest.raises(ValueError, match="packed rows .* together with a KV cache"):
        model(**batch, cache=DynamicCache(config=model.config))
    with torch.no_grad():  # use_cache=True asks for one: a packed row gets none
        assert model(**batch, use_cache=True).cache is None
    classifier = EGAForSequenceClassification(model.config).eval()
    with pytest.raises(ValueError, match="pools one vector per row"):
        classifier(**batch)
    with pytest.raises(ValueError, match="pools one vector per row"):
        classifier(input_ids=batch["input_ids"], cu_seq_lens_q=torch.tensor([0, 23, 40, 71]))


def test_packed_rows_with_padding_or_contradicting_boundaries_are_refused():
    model = packed_model("EGA-1", "causal").eval()
    batch = flattened(documents(VOCAB), flash_kwargs=True)
    with pytest.raises(ValueError, match="give one or the other"):
        model(input_ids=batch["input_ids"], attention_mask=torch.ones_like(batch["input_ids"]),
              cu_seq_lens_q=batch["cu_seq_lens_q"])
    with pytest.raises(ValueError, match="different places"):
        model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
              cu_seq_lens_q=torch.tensor([0, 20, 40, 71]))
    with pytest.raises(ValueError, match="across the end of a row"):
        two_rows = batch["input_ids"][:, :70].reshape(2, 35)
        model(input_ids=two_rows, cu_seq_lens_q=torch.tensor([0, 23, 40, 70]))
    block_diagonal = torch.zeros(1, 1, 71, 71, dtype=torch.bool)
    for start, end in ((0, 23), (23, 40), (40, 71)):
        block_diagonal[..., start:end, start:end] = torch.ones(end - start, end - start, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match="causal plus padding"):
        model(input_ids=batch["input_ids"], attention_mask=block_diagonal)


def test_rows_of_one_document_each_take_the_unpacked_path():
    """Position ids that only count (one document a row) change nothing: the same logits as without them, and the
    cache as usual."""
    model = packed_model("EGA-1", "causal").eval()
    ids = torch.tensor(documents(VOCAB, lengths=(12, 12)))
    with torch.no_grad():
        plain = model(ids, use_cache=True)
        counted = model(ids, position_ids=torch.arange(12).expand(2, -1), use_cache=True)
    assert torch.equal(plain.logits, counted.logits)
    assert counted.cache is not None and counted.cache.get_seq_length() == 12


def test_a_packed_row_may_be_longer_than_the_learned_positions():
    """Positions count within each document: a row longer than max_position_embeddings is fine when each document
    fits, and a document that does not is refused (from cu_seq_lens, whose positions the model counts)."""
    model = packed_model("EGA-1", "causal").eval()
    docs = documents(VOCAB, lengths=(60, 60))  # 120 tokens, 96 learned positions
    with torch.no_grad():
        assert_documents_as_alone(model, docs)
    collated = DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": d} for d in documents(
        VOCAB, lengths=(100, 20))])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(input_ids=collated["input_ids"], cu_seq_lens_q=collated["cu_seq_lens_q"])


@pytest.mark.skipif(INDUCTOR_ISA_FORCED, reason=INDUCTOR_SKIP_REASON)
def test_a_compiled_forward_keeps_packed_documents_apart():
    """Under torch.compile (one graph, no host read) a packed row without a cache (use_cache=False, or a loss) gives
    the eager model's per-document logits; a compiled graph cannot tell packed rows from counted positions, so, as in
    transformers, a call that keeps a cache is read as one sequence a row."""
    model = packed_model("EGA-C", "causal").eval()
    model.set_attn_implementation("sdpa")
    batch = flattened(documents(VOCAB))
    with torch.no_grad():
        expected = model(**packed_inputs(batch)).logits
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True)
        packed = compiled(**packed_inputs(batch), use_cache=False)
        loss = compiled(**packed_inputs(batch), labels=batch["labels"]).loss
    torch.testing.assert_close(packed.logits, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(loss, model(**packed_inputs(batch), labels=batch["labels"]).loss, atol=1e-5, rtol=0)
