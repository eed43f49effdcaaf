"""Retrofitted models on packed rows (several documents a row, as `DataCollatorWithFlattening` and TRL's padding-free
batches give them): every family, energy kind and statistic, on every backend, in training and evaluation mode,
gives each document what it gets alone, as the stock models do (the controls), and a packed batch's loss and
gradients are those of its documents."""

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import (
    DynamicCache,
    GPT2Config,
    GPT2ForSequenceClassification,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from hf_spectral.retrofit import EnergyGateConfig, add_energy_gates
from tests.helpers import INDUCTOR_ISA_FORCED, INDUCTOR_SKIP_REASON
from tests.packing import (
    assert_documents_as_alone,
    assert_documents_mixed,
    assert_packed_loss_and_gradients,
    documents,
    flattened,
    packed_inputs,
)

VOCAB = 50
LLAMA_SIZE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128)
STOCK = {
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=128,
                                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**LLAMA_SIZE)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**LLAMA_SIZE)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**LLAMA_SIZE)),
}
GATES = {"linear": {}, "conv": {"scales": [3, 15]}, "morlet": {"scales": [7, 31]}}
_MODELS = {}


def stock_model(family: str):
    if ("stock", family) not in _MODELS:
        torch.manual_seed(0)
        _MODELS["stock", family] = STOCK[family]()
    return _MODELS["stock", family]


def gated_model(family: str, kind: str, normalization: str, **gate_options):
    """A retrofitted copy of the family's stock model, shared; gates far from the identity."""
    key = (family, kind, normalization, repr(sorted(gate_options.items())))
    if key not in _MODELS:
        model = copy.deepcopy(stock_model(family))
        add_energy_gates(model, EnergyGateConfig(energy_kind=kind, normalization=normalization, alpha_init=1.5,
                                                 **GATES[kind], **gate_options))
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith(".tau"):
                    parameter.copy_(torch.randn(parameter.shape, generator=generator))
                if kind == "morlet" and name.endswith(("ln_1.weight", "input_layernorm.weight")):
                    parameter.copy_(1 + torch.randn(parameter.shape, generator=generator) / 2)  # a channel mean ≠ 0
        _MODELS[key] = model
    return _MODELS[key]


@pytest.mark.filterwarnings("ignore:.*SEES FUTURE TOKENS")
@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("normalization", ["causal", "window", "none"])
@pytest.mark.parametrize("kind", list(GATES))
@pytest.mark.parametrize("family", list(STOCK))
def test_each_packed_document_gets_what_it_gets_alone(family, kind, normalization, backend, mode):
    model = gated_model(family, kind, normalization)
    model.set_attn_implementation(backend)
    model.train(mode == "train")
    try:
        with torch.no_grad():
            packed = assert_documents_as_alone(model, documents(VOCAB))
        assert packed.cache is None  # turned off: transformers keeps packed documents apart only without a cache
    finally:
        model.eval()


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_stock_models_keep_packed_documents_apart_without_a_cache(family, backend, mode):
    """The controls: stock GPT-2 and Llama through the same test. They keep the documents apart only when they build
    no KV cache (transformers detects packed rows for its mask only then), so they run with use_cache=False."""
    model = stock_model(family)
    model.set_attn_implementation(backend)
    model.train(mode == "train")
    try:
        with torch.no_grad():
            assert_documents_as_alone(model, documents(VOCAB), use_cache=False)
    finally:
        model.eval()


@pytest.mark.parametrize("family", list(STOCK))
def test_a_packed_batch_has_the_loss_and_gradients_of_its_documents(family):
    model = gated_model(family, "conv", "causal").train()
    model.set_attn_implementation("sdpa")
    try:
        assert_packed_loss_and_gradients(model, documents(VOCAB))
        assert_packed_loss_and_gradients(stock_model(family).train(), documents(VOCAB), use_cache=False)  # control
    finally:
        model.eval()
        stock_model(family).eval()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_the_boundaries_come_from_cu_seq_lens_alone_too(family):
    """Without position ids, the documents' positions are counted from cu_seq_lens (the stock mask and RoPE / learned
    positions read them too)."""
    model = gated_model(family, "conv", "window").eval()
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        assert_documents_as_alone(model, documents(VOCAB), flash_kwargs=True, positions=False)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_only_some_layers_and_heads_gated(family):
    model = gated_model(family, "linear", "causal", layers=[1], heads=[1]).eval()
    with torch.no_grad():
        assert_documents_as_alone(model, documents(VOCAB))


def test_concatenated_documents_would_mix():
    with torch.no_grad():
        assert_documents_mixed(gated_model("llama", "conv", "causal").eval(), documents(VOCAB))


def test_lora_with_trained_gates_keeps_packed_documents_apart():
    model = copy.deepcopy(gated_model("llama", "linear", "causal"))
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                  modules_to_save=["energy_gate"]))
    with torch.no_grad():
        assert_documents_as_alone(peft_model.eval(), documents(VOCAB))


@pytest.mark.skipif(INDUCTOR_ISA_FORCED, reason=INDUCTOR_SKIP_REASON)
def test_flex_attention_keeps_packed_documents_apart():
    model = gated_model("llama", "conv", "causal").eval()
    model.set_attn_implementation("flex_attention")
    try:
        with torch.no_grad():
            assert_documents_as_alone(model, documents(VOCAB))
    finally:
        model.set_attn_implementation("sdpa")


def test_packed_rows_refuse_a_cache_and_a_classifier_refuses_them():
    model = gated_model("llama", "linear", "causal").eval()
    batch = packed_inputs(flattened(documents(VOCAB)))
    with pytest.raises(ValueError, match="packed rows .* together with a KV cache"):
        model(**batch, past_key_values=DynamicCache(config=model.config))
    torch.manual_seed(0)
    classifiers = [GPT2ForSequenceClassification(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB,
                                                            pad_token_id=0)),
                   LlamaForSequenceClassification(LlamaConfig(**LLAMA_SIZE, pad_token_id=0))]
    for classifier in classifiers:
        add_energy_gates(classifier.eval())
        with pytest.raises(ValueError, match="pools one vector per row"):
            classifier(**batch)
    reloaded = type(classifiers[1])(copy.deepcopy(classifiers[1].config)).eval()  # gates built with its decoder
    with pytest.raises(ValueError, match="pools one vector per row"):
        reloaded(**batch)
