"""CHIAR-Former on CUDA: the attention backends agree, cached generation equals the forward, and a routed layer's
forward never synchronises with the host. Skipped where torch sees no CUDA device."""

import pytest
import torch

from hf_spectral import ChiarConfig, ChiarForCausalLM

from .chiar_testing import build, random_ids, tiny_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available())")

ROUTED_3 = dict(routed_operators=["dct", "rbf", "attention"])


def _on_cuda(model, implementation=None):
    config = model.config.to_dict()
    if implementation is not None:
        config["attn_implementation"] = implementation
    twin = ChiarForCausalLM(ChiarConfig(**config)).eval()
    twin.load_state_dict(model.state_dict())
    return twin.cuda()


def _padded(ids, pads):
    mask = torch.ones_like(ids)
    for row, count in enumerate(pads):
        mask[row, :count] = 0
    return ids, mask


def test_backends_agree_on_cuda_and_with_the_cpu_model():
    ids = random_ids(3, 160, seed=1)
    ids, mask = _padded(ids, [0, 17, 5])
    cpu = build(ChiarForCausalLM, tiny_config(max_position_embeddings=256, attn_implementation="eager", **ROUTED_3),
                calibrate_on=ids)
    valid = mask.bool()
    with torch.no_grad():
        reference = cpu(ids, attention_mask=mask).logits
        for implementation in ("eager", "sdpa", "flex_attention"):
            model = _on_cuda(cpu, implementation)
            logits = model(ids.cuda(), attention_mask=mask.cuda()).logits.cpu()
            # TF32 may be on for CUDA matmuls: a looser tolerance than between CPU kernels.
            torch.testing.assert_close(logits[valid], reference[valid], atol=2e-3, rtol=2e-3, msg=implementation)


@pytest.mark.parametrize("implementation", ["sdpa", "flex_attention"])
def test_training_step_on_cuda_matches_eager_gradients(implementation):
    ids = random_ids(2, 200, seed=2).cuda()
    cpu = build(ChiarForCausalLM, tiny_config(max_position_embeddings=256, router_type="hard", **ROUTED_3))
    eager, other = _on_cuda(cpu, "eager"), _on_cuda(cpu, implementation)
    grads = []
    for model in (eager, other):
        model(ids, labels=ids).loss.backward()
        grads.append({name: p.grad for name, p in model.named_parameters() if p.grad is not None})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=2e-3, rtol=2e-3, msg=name)


@pytest.mark.parametrize("implementation", ["sdpa", "flex_attention"])
def test_cached_generation_equals_the_forward_on_cuda(implementation):
    ids = random_ids(2, 24, seed=3)
    ids, mask = _padded(ids, [0, 5])
    cpu = build(ChiarForCausalLM, tiny_config(**ROUTED_3), calibrate_on=ids)
    model = _on_cuda(cpu, implementation)
    ids, mask = ids.cuda(), mask.cuda()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
        full_mask = torch.cat([mask, torch.ones(2, 8, dtype=mask.dtype, device="cuda")], 1)
        reference = model(out.sequences, attention_mask=full_mask).logits[:, 23:-1]
    torch.testing.assert_close(torch.stack(out.logits, 1), reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("implementation", ["sdpa", "flex_attention"])
def test_routed_layer_forward_does_not_synchronise_with_the_host(implementation):
    """A routed CHIAR-Former (a quarter of the tokens to attention, padding, every routed operator) runs a whole
    forward with CUDA's sync debug mode set to raise on any synchronising call."""
    ids = random_ids(2, 256, seed=4)
    ids, mask = _padded(ids, [0, 31])
    cpu = build(ChiarForCausalLM, tiny_config(max_position_embeddings=256, **ROUTED_3), calibrate_on=ids,
                percentiles=(50.0, 75.0))
    model = _on_cuda(cpu, implementation)
    ids, mask = ids.cuda(), mask.cuda()
    with torch.no_grad():
        model(ids, attention_mask=mask, output_routing=True)  # warm-up: kernels compiled, caches filled
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = model(ids, attention_mask=mask, output_routing=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    fractions = torch.stack(out.routing_fractions).cpu()
    assert (fractions[:, 2] > 0.1).all()  # attention is routed some tokens in every routed layer
