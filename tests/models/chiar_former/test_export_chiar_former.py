"""CHIAR-Former exported for serving: torch.export with a dynamic batch and length, and ONNX (torch.onnx.export's
dynamo exporter) run by onnxruntime, give eager's logits for every router (threshold, hard, soft), both operator
sets (DCT / attention and DCT / RBF / attention), sparse and dense execution, the single-operator layouts and the
bidirectional classifier, padded batches included. The configurations share one export (one program running them
all): routing, the gathered layout of routed tokens and the RBF prefix sums are traced with the length symbolic.
Each model has one layer of the kind it tests (a routed layer, or one of each single operator): exporting costs
seconds per layer on a small CPU, and the layers of a stack are exported alike."""

from hf_spectral import ChiarForCausalLM, ChiarForSequenceClassification
from tests.helpers import EveryModel, assert_exports_with_dynamic_batch_and_length, padded_inputs
from tests.models.chiar_former.chiar_testing import CAUSAL_VARIANTS, VOCAB, build, random_ids, tiny_config


def one_layer(overrides):
    """The configuration cut to the first of its layers (a routed one unless it names others)."""
    return dict(overrides, layer_operators=overrides.get("layer_operators", ["routed"])[:1], num_hidden_layers=1)


ROUTED = {
    f"{router}-{'/'.join(operators)}-{execution}": one_layer(dict(router_type=router, routed_operators=list(operators),
                                                                  routed_execution=execution))
    for router in ("threshold", "hard", "soft")
    for operators in (("dct", "attention"), ("dct", "rbf", "attention"))
    for execution in ("sparse", "dense")
}
OTHERS = {name: one_layer(CAUSAL_VARIANTS[name])
          for name in ("dct-only", "rbf-only", "attention-only", "pre-ln-threshold-3", "fft-dct")}


def test_every_configuration_exports_to_onnx_with_a_dynamic_batch_and_length(tmp_path):
    calibration = random_ids(4, 16, seed=100)
    models = [build(ChiarForCausalLM, tiny_config(**overrides), seed=index, calibrate_on=calibration)
              for index, overrides in enumerate([*ROUTED.values(), *OTHERS.values()])]
    models.append(build(ChiarForSequenceClassification,
                        tiny_config(is_causal=False, num_labels=3, routed_operators=["dct", "rbf", "attention"],
                                    layer_operators=["dct", "routed", "attention"], num_hidden_layers=3),
                        calibrate_on=calibration))
    # lengths below, at and past a chunk of the RBF prefix sums (8 here), a routed layout of one token included
    cases = [padded_inputs(batch, length, VOCAB, seed=length, low=2)
             for batch, length in ((3, 5), (1, 1), (2, 8), (4, 17), (2, 40))]
    assert_exports_with_dynamic_batch_and_length(EveryModel(models), padded_inputs(2, 12, VOCAB, seed=0, low=2),
                                                 cases, tmp_path / "chiar.onnx")
