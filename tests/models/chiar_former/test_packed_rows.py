"""CHIAR-Former on packed rows (several documents a row, as `DataCollatorWithFlattening` and TRL's padding-free batches
give them): every router and operator set, sparse and dense execution, on every backend, in training and evaluation
mode, gives each document the logits and routing decisions it gets alone (RBF prefix sums, routed attention's masks,
calibration), and a packed batch's loss and gradients are those of its documents."""

import pytest
import torch
from transformers import DynamicCache

from hf_spectral import ChiarForCausalLM, ChiarForSequenceClassification, ChiarModel
from hf_spectral.models.chiar_former import calibrate_thresholds
from hf_spectral.models.chiar_former.calibration import measure_entropies
from tests.helpers import INDUCTOR_ISA_FORCED, INDUCTOR_SKIP_REASON
from tests.models.chiar_former.chiar_testing import VOCAB, tiny_config
from tests.packing import (
    assert_documents_as_alone,
    assert_documents_mixed,
    assert_packed_loss_and_gradients,
    documents,
    flattened,
    packed_inputs,
)

# (operators, router, execution): every router on both operator sets, sparse and dense (soft routing blends every
# operator: it has one execution)
CONFIGS = [
    (operators, router, execution)
    for operators in (("dct", "attention"), ("dct", "rbf", "attention"))
    for router in ("threshold", "hard", "soft")
    for execution in (("sparse",) if router == "soft" else ("sparse", "dense"))
]
_MODELS = {}


def packed_model(operators, router, execution, lengths=None) -> ChiarForCausalLM:
    """One model per configuration, shared: an RBF layer (prefix sums), two routed layers and an attention layer.
    Thresholds are calibrated on the test documents packed (each placed in a gap between measured entropies, far
    from every token's), learned routers' logits scaled up, so that rounding cannot move a token across."""
    key = (operators, router, execution, lengths)
    if key not in _MODELS:
        config = tiny_config(
            layer_operators=["rbf", "routed", "routed", "attention"], num_hidden_layers=4,
            routed_operators=list(operators), router_type=router, routed_execution=execution,
            max_position_embeddings=256,
        )
        torch.manual_seed(0)
        model = ChiarForCausalLM(config).eval()
        if router == "threshold":
            calibrate_thresholds(model, [flattened(documents(VOCAB, **_lengths(lengths)))], per_layer=True,
                                 percentiles=[30, 70] if len(operators) == 3 else [50])
        else:
            with torch.no_grad():
                for layer in model.model.layers:
                    if layer.router is not None:
                        layer.router.proj.weight.mul_(10.0)
        _MODELS[key] = model
    return _MODELS[key]


def _lengths(lengths):
    return {} if lengths is None else {"lengths": lengths}


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("operators, router, execution", CONFIGS)
def test_each_packed_document_gets_what_it_gets_alone(operators, router, execution, backend, mode):
    model = packed_model(operators, router, execution)
    model.set_attn_implementation(backend)
    model.train(mode == "train")
    with torch.no_grad():
        packed = assert_documents_as_alone(model, documents(VOCAB), routing=True)
    assert packed.cache is None
    model.eval()


@pytest.mark.parametrize("operators, router, execution", [(("dct", "rbf", "attention"), "threshold", "sparse"),
                                                          (("dct", "attention"), "hard", "dense")])
def test_the_boundaries_come_from_cu_seq_lens_alone_too(operators, router, execution):
    model = packed_model(operators, router, execution).eval()
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        assert_documents_as_alone(model, documents(VOCAB), flash_kwargs=True, positions=False, routing=True)


@pytest.mark.parametrize("operators, router, execution", CONFIGS)
def test_a_packed_batch_has_the_loss_and_gradients_of_its_documents(operators, router, execution):
    model = packed_model(operators, router, execution).train()
    model.set_attn_implementation("sdpa")
    try:
        assert_packed_loss_and_gradients(model, documents(VOCAB))
    finally:
        model.eval()


def test_concatenated_documents_would_mix():
    with torch.no_grad():
        assert_documents_mixed(packed_model(("dct", "rbf", "attention"), "threshold", "sparse"), documents(VOCAB))


def test_calibration_measures_packed_documents_as_it_measures_them_alone():
    model = packed_model(("dct", "rbf", "attention"), "threshold", "sparse")
    docs = documents(VOCAB)
    packed = measure_entropies(model, [flattened(docs)])
    alone = measure_entropies(model, [torch.tensor([doc]) for doc in docs])
    for together, apart in zip(packed, alone):
        torch.testing.assert_close(together, apart, atol=1e-6, rtol=0)


@pytest.mark.skipif(INDUCTOR_ISA_FORCED, reason=INDUCTOR_SKIP_REASON)
@pytest.mark.parametrize("operators, router, execution", [(("dct", "rbf", "attention"), "threshold", "sparse"),
                                                          (("dct", "attention"), "soft", "sparse")])
def test_flex_attention_keeps_packed_documents_apart(operators, router, execution):
    """flex_attention's BlockMask of gathered queries, in evaluation (no flex backward on CPU): a row of 300 tokens
    (three blocks of 128), so that blocks skip the key blocks before their documents."""
    lengths = (150, 40, 110)
    model = packed_model(operators, router, execution, lengths)
    model.set_attn_implementation("flex_attention")
    try:
        with torch.no_grad():
            assert_documents_as_alone(model, documents(VOCAB, lengths=lengths), routing=True)
    finally:
        model.set_attn_implementation("sdpa")


def test_packed_rows_refuse_a_cache_a_classifier_and_a_bidirectional_encoder():
    model = packed_model(("dct", "rbf", "attention"), "threshold", "sparse")
    batch = packed_inputs(flattened(documents(VOCAB)))
    with pytest.raises(ValueError, match="packed rows .* together with a KV cache"):
        model(**batch, cache=DynamicCache(config=model.config))
    with torch.no_grad():
        assert model(**batch, use_cache=True).cache is None
    config = tiny_config(layer_operators=["rbf", "attention"], num_hidden_layers=2, is_causal=False)
    with pytest.raises(ValueError, match="pools one vector per row"):
        ChiarForSequenceClassification(config).eval()(**batch)
    with pytest.raises(ValueError, match="bidirectional encoder"):
        ChiarModel(config).eval()(**batch)


@pytest.mark.skipif(INDUCTOR_ISA_FORCED, reason=INDUCTOR_SKIP_REASON)
def test_a_compiled_forward_keeps_packed_documents_apart():
    """torch.compile (one graph): the gathered layout takes its static width, the document positions their tensors."""
    model = packed_model(("dct", "rbf", "attention"), "threshold", "sparse").eval()
    model.set_attn_implementation("sdpa")
    batch = packed_inputs(flattened(documents(VOCAB)))
    with torch.no_grad():
        expected = model(**batch).logits
        torch._dynamo.reset()
        packed = torch.compile(model, fullgraph=True)(**batch, use_cache=False).logits
    torch.testing.assert_close(packed, expected, atol=1e-5, rtol=0)
