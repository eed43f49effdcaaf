"""CHIAR-Former under torch.compile: the forward traces into one graph (no graph break, no host read of routing
counts), and compiled forward passes and training steps match eager mode for every router, causal or not.

The router × causality matrix compiles with the ``aot_eager`` backend: Dynamo and AOTAutograd trace exactly the
graphs (forward and backward) that the default Inductor backend would receive, without generating and compiling C++
for each of them (minutes per graph on a small CPU). One test runs the default backend end to end.
"""

import pytest
import torch

from hf_spectral import ChiarForCausalLM, ChiarModel
from tests.helpers import CACHE_FREE_ON_OLD_DYNAMO, INDUCTOR_ISA_FORCED

from .chiar_testing import build, random_ids, tiny_config

# Compiled and eager runs differ by kernel fusion and summation order only.
FORWARD_TOLERANCE = dict(atol=2e-5, rtol=2e-5)
GRADIENT_TOLERANCE = dict(atol=5e-5, rtol=1e-4)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _routed_model(router_type: str, is_causal: bool, ids: torch.Tensor):
    config = tiny_config(router_type=router_type, is_causal=is_causal, routed_operators=["dct", "rbf", "attention"])
    # Thresholds calibrated on other tokens, and set between measured entropies: a token whose entropy lay on a
    # threshold would be routed by a last-bit difference between compiled and eager entropies.
    calibration = random_ids(4, ids.shape[1], seed=100)
    return build(ChiarForCausalLM if is_causal else ChiarModel, config, calibrate_on=calibration)


def _output(model, ids, is_causal):
    if is_causal:
        out = model(ids, labels=ids)
        return out.loss, out.logits
    hidden = model(ids).last_hidden_state
    return hidden.square().mean(), hidden


def _forward_and_gradients(model, ids, is_causal):
    model.zero_grad(set_to_none=True)
    loss, output = _output(model, ids, is_causal)
    loss.backward()
    parameters = getattr(model, "_orig_mod", model).named_parameters()  # a compiled model shares the eager one's
    return output.detach(), {name: p.grad.clone() for name, p in parameters if p.grad is not None}


def test_explain_finds_no_graph_break_in_a_routed_forward():
    """The authors' layout with a quarter of the tokens routed to attention in the routed layers."""
    ids = random_ids(2, 32, seed=1)
    model = build(ChiarForCausalLM, tiny_config(), calibrate_on=ids, percentiles=(75.0,))
    fractions = torch.stack(model(ids, output_routing=True).routing_fractions)[:, 1]
    assert ((fractions > 0.15) & (fractions < 0.35)).all()
    explanation = torch._dynamo.explain(model)(ids, **CACHE_FREE_ON_OLD_DYNAMO)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.parametrize("first_layer", ["attention", "dct"])
def test_a_static_cache_decoding_step_is_one_graph_and_matches_eager(first_layer):
    """A StaticCache keeps its length on the device: position ids, the new tokens' padding and the routed queries'
    slots are indexed with it, never read on the host; the compiled step (aot_eager, fullgraph) gives eager's logits.
    A DCT layer's cache layer (a linear-attention one, counting the tokens) compiles into the same graph."""
    from transformers import StaticCache

    ids = random_ids(2, 10, seed=34)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, :2] = 0
    model = build(ChiarForCausalLM, tiny_config(layer_operators=[first_layer, "routed"], num_hidden_layers=2),
                  calibrate_on=ids).eval()
    def prefilled():
        cache = StaticCache(config=model.config, max_cache_len=16)
        model(ids[:, :9], attention_mask=mask[:, :9], cache=cache, use_cache=True)
        return cache

    step = dict(input_ids=ids[:, 9:], attention_mask=mask, use_cache=True)
    with torch.no_grad():
        explanation = torch._dynamo.explain(model)(cache=prefilled(), **step)
        assert explanation.graph_break_count == 0, explanation.break_reasons
        compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
        logits = [compiled(cache=prefilled(), **step).logits, model(cache=prefilled(), **step).logits]
    torch.testing.assert_close(logits[1], logits[0], **FORWARD_TOLERANCE)


@pytest.mark.parametrize("is_causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("router_type", ["threshold", "hard", "soft"])
def test_compiled_forward_and_training_step_match_eager(router_type, is_causal):
    ids = random_ids(2, 16, seed=2)
    model = _routed_model(router_type, is_causal, ids)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(_output(compiled, ids, is_causal)[1], _output(model, ids, is_causal)[1],
                                   **FORWARD_TOLERANCE)
    model.train()  # dropout is off in the tiny config: train mode changes nothing but the flag
    output, grads = _forward_and_gradients(compiled, ids, is_causal)
    expected_output, expected_grads = _forward_and_gradients(model, ids, is_causal)
    torch.testing.assert_close(output, expected_output, **FORWARD_TOLERANCE)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], **GRADIENT_TOLERANCE, msg=name)


@pytest.mark.skipif(
    INDUCTOR_ISA_FORCED,
    reason="with ATEN_CPU_CAPABILITY forced below the CPU's own ISA, Inductor's C++ kernels for this model fail to "
    "compile (default: at::vec used in scalar code) or give NaN entropies (avx2 on an AVX-512 CPU) in torch 2.13; "
    "the aot_eager tests above cover the traced graphs",
)
def test_default_backend_compiles_a_routed_model_and_matches_eager():
    """torch.compile(model) with Inductor: forward and a training step (optimizer included) of a threshold-routed
    causal model; the sparse layout is the static one (T rows) under compilation, eager mode gathers fewer rows."""
    ids = random_ids(2, 16, seed=3)
    model = _routed_model("threshold", True, ids)
    reference = build(ChiarForCausalLM, model.config)
    reference.load_state_dict(model.state_dict())
    compiled = torch.compile(model)
    with torch.no_grad():
        out, expected = compiled(ids, output_routing=True), reference(ids, output_routing=True)
    for routes, expected_routes in zip(out.routing_decisions, expected.routing_decisions):
        assert torch.equal(routes, expected_routes)
    assert all(len(torch.unique(routes)) == 3 for routes in out.routing_decisions)  # every operator ran
    torch.testing.assert_close(out.logits, expected.logits, **FORWARD_TOLERANCE)
    for trained in (compiled, reference):
        trained.train()
        optimizer = torch.optim.SGD(trained.parameters(), lr=0.1)
        trained(ids, labels=ids).loss.backward()
        optimizer.step()
        trained.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, **GRADIENT_TOLERANCE)


@pytest.mark.skipif(INDUCTOR_ISA_FORCED, reason="Inductor's C++ kernels under a forced ATEN_CPU_CAPABILITY (above)")
def test_a_compiled_flex_attention_forward_of_a_routed_model_equals_eager():
    """flex_attention's block mask skips the unrouted queries, reading the routing computed in the same forward; on
    CPU torch.compile(model) had failed to build that kernel."""
    ids = random_ids(2, 16, seed=3)
    model = _routed_model("threshold", True, ids)
    model.set_attn_implementation("flex_attention")
    with torch.no_grad():
        expected = model(ids, output_routing=True)
        out = torch.compile(model)(ids, output_routing=True)
    for routes, expected_routes in zip(out.routing_decisions, expected.routing_decisions):
        assert torch.equal(routes, expected_routes)
    torch.testing.assert_close(out.logits, expected.logits, **FORWARD_TOLERANCE)


def test_torch_export_of_a_routed_model_with_a_dynamic_length_equals_eager():
    """torch.export of a padded, threshold-routed forward (DCT / attention; no cache) with the sequence length
    dynamic: the exported program (static-width layout) gives the eager logits at other lengths (every configuration,
    RBF included, and ONNX: test_export_chiar_former.py)."""
    from torch.export import Dim, export

    calibration = random_ids(4, 16, seed=100)
    config = tiny_config(routed_operators=["dct", "attention"], use_cache=False)
    model = build(ChiarForCausalLM, config, calibrate_on=calibration)
    ids = random_ids(2, 16, seed=3)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    length = Dim("length", min=2, max=config.max_position_embeddings)
    program = export(model, (), {"input_ids": ids, "attention_mask": mask},
                     dynamic_shapes={"input_ids": {1: length}, "attention_mask": {1: length}}).module()
    for width in (16, 9):
        other_ids, other_mask = ids[:, -width:], mask[:, -width:]
        with torch.no_grad():
            expected = model(other_ids, attention_mask=other_mask).logits * other_mask[..., None]
            got = program(input_ids=other_ids, attention_mask=other_mask).logits * other_mask[..., None]
        torch.testing.assert_close(got, expected, **FORWARD_TOLERANCE)
