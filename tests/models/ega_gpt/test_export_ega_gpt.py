"""EGA-GPT exported for serving: torch.export with a dynamic batch and length, and ONNX (torch.onnx.export's dynamo
exporter) run by onnxruntime, give eager's logits for every variant, padded batches included. The variants share
one export (one program running them all)."""

from hf_spectral import EGAForCausalLM
from tests.helpers import EveryModel, assert_exports_with_dynamic_batch_and_length, padded_inputs
from tests.models.ega_gpt.test_compile_ega_gpt import VARIANTS
from tests.models.ega_gpt.test_modeling_ega_gpt import VOCAB, tiny_model


def test_every_variant_exports_to_onnx_with_a_dynamic_batch_and_length(tmp_path):
    models = [tiny_model(variant, seed=index, num_hidden_layers=1, **overrides)
              for index, (variant, overrides) in enumerate(VARIANTS)]
    assert all(model.config.use_cache for model in models)
    cases = [padded_inputs(batch, length, VOCAB, seed=length) for batch, length in ((3, 5), (1, 1), (2, 17), (4, 40))]
    assert_exports_with_dynamic_batch_and_length(EveryModel(models), padded_inputs(2, 12, VOCAB, seed=0), cases,
                                                 tmp_path / "ega.onnx")
