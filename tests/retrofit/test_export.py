"""A retrofitted checkpoint exported for serving: torch.export with a dynamic batch and length, and ONNX
(torch.onnx.export's dynamo exporter) run by onnxruntime, give eager's logits for GPT-2 and Llama (grouped key
heads) with acting gates (non-zero α), padded batches included; the two share one export."""

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from hf_spectral.retrofit import EnergyGateConfig, add_energy_gates
from tests.helpers import EveryModel, assert_exports_with_dynamic_batch_and_length, padded_inputs

VOCAB = 50


def gated(model):
    model = add_energy_gates(model.eval(), EnergyGateConfig())
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith((".alpha", ".tau")):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 2)
    return model.eval()


def test_retrofitted_gpt2_and_llama_export_to_onnx_with_a_dynamic_batch_and_length(tmp_path):
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64))
    llama = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                         max_position_embeddings=64))
    models = [gated(gpt2), gated(llama)]
    cases = [padded_inputs(batch, length, VOCAB, seed=length) for batch, length in ((3, 5), (1, 1), (4, 29))]
    assert_exports_with_dynamic_batch_and_length(EveryModel(models), padded_inputs(2, 12, VOCAB, seed=0), cases,
                                                 tmp_path / "retrofit.onnx")
