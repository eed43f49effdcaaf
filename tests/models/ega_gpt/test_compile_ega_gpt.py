"""EGA-GPT under torch.compile: no graph break in a forward, and compiled forward passes and training steps equal
eager ones for every variant. Compilation is slow on CPU, so the models are tiny and the variants share one
compilation (a container whose forward runs them all)."""

import pytest
import torch
from torch import nn
from transformers import StaticCache

from hf_spectral import EGAForCausalLM
from tests.helpers import (
    CACHE_FREE_ON_OLD_DYNAMO,
    INDUCTOR_ISA_FORCED,
    INDUCTOR_SKIP_REASON,
    assert_fullgraph_static_generation_matches_eager,
)
from tests.models.ega_gpt.test_modeling_ega_gpt import VOCAB, padded_batch, tiny_config

VARIANTS = [
    ("BASE", {}),
    ("EGA-1", {}),
    ("EGA-1", {"energy_normalization": "window"}),
    ("EGA-2", {}),
    ("EGA-4", {}),
    ("EGA-C", {"energy_scales": [3, 5]}),
    ("EGA-M-F", {"energy_scales": [3, 7]}),
    ("EGA-M", {"energy_scales": [3, 7]}),
    ("EGA-DB2", {"energy_scales": [1, 2]}),
    ("EGA-DB4", {"energy_scales": [1, 2]}),
]


def _model(variant, seed=0, **overrides):
    torch.manual_seed(seed)
    model = EGAForCausalLM(tiny_config(variant, num_hidden_layers=1, **overrides))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith((".alpha", ".tau", ".mix_logits")):
                parameter.normal_(0, 1.5)
    return model


class _EveryVariant(nn.Module):
    def __init__(self, models):
        super().__init__()
        self.models = nn.ModuleList(models)

    def forward(self, input_ids, attention_mask, labels):
        outputs = [model(input_ids, attention_mask=attention_mask, labels=labels) for model in self.models]
        return [out.loss for out in outputs], [out.logits for out in outputs]


def test_an_ega1_forward_has_no_graph_break():
    model = _model("EGA-1").eval()
    ids, mask = padded_batch()
    for kwargs in ({}, {"attention_mask": mask}, {"use_cache": False}):
        explanation = torch._dynamo.explain(model)(ids, **{**kwargs, **CACHE_FREE_ON_OLD_DYNAMO})
        assert explanation.graph_break_count == 0, explanation.break_reasons
        assert explanation.graph_count == 1


@pytest.mark.parametrize("variant", ["EGA-1", "EGA-C"])
def test_a_static_cache_decoding_step_has_no_graph_break(variant):
    """A StaticCache keeps its length on the device: the gates gather their cached state at tensor positions, so a
    decoding step, padded or not, is one graph (and on a GPU never waits for the device)."""
    model = _model(variant, **({"energy_scales": [3, 5]} if variant == "EGA-C" else {})).eval()
    ids, mask = padded_batch()
    step_mask = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], 1)
    cases = ((ids[:, 5:], {}, {}), (ids, {"attention_mask": mask}, {"attention_mask": step_mask}))
    for prompt, kwargs, step_kwargs in cases:
        cache = StaticCache(config=model.config, max_cache_len=20)
        with torch.no_grad():
            model(prompt, cache=cache, use_cache=True, **kwargs)
            explanation = torch._dynamo.explain(model)(prompt[:, -1:], cache=cache, use_cache=True, **step_kwargs)
        assert explanation.graph_break_count == 0, explanation.break_reasons
        assert explanation.graph_count == 1


@pytest.mark.skipif(INDUCTOR_ISA_FORCED, reason=INDUCTOR_SKIP_REASON)
def test_a_fullgraph_compiled_model_generates_with_a_static_cache_what_the_eager_one_generates():
    ids, mask = padded_batch()
    assert_fullgraph_static_generation_matches_eager(_model("EGA-1").eval(), ids, mask, new_tokens=4)


@pytest.mark.skipif(INDUCTOR_ISA_FORCED, reason=INDUCTOR_SKIP_REASON)
def test_compiled_forward_and_training_step_equal_eager_for_every_variant():
    """Forward logits within atol 1e-5 / rtol 1e-5 and every gradient within atol 1e-5 / rtol 1e-4 (inductor
    fuses and reorders float32 sums)."""
    eager = _EveryVariant([_model(variant, seed=i, **overrides) for i, (variant, overrides) in enumerate(VARIANTS)])
    compiled_models = _EveryVariant([_model(variant, seed=i, **overrides) for i, (variant, overrides) in enumerate(VARIANTS)])
    compiled_models.load_state_dict(eager.state_dict())
    eager.train(), compiled_models.train()  # dropout is 0 in the tiny configs: train() changes no number
    compiled = torch.compile(compiled_models)
    ids, mask = padded_batch()
    labels = ids.masked_fill(mask == 0, -100)

    eager_losses, eager_logits = eager(ids, mask, labels)
    sum(eager_losses).backward()
    compiled_losses, compiled_logits = compiled(ids, mask, labels)
    sum(compiled_losses).backward()

    for (variant, overrides), a, b in zip(VARIANTS, compiled_logits, eager_logits):
        torch.testing.assert_close(a * mask[..., None], b * mask[..., None], atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"{variant} {overrides}: {m}")
    torch.testing.assert_close(torch.stack(compiled_losses), torch.stack(eager_losses), atol=1e-5, rtol=1e-5)
    gated = 0
    for (name, a), (_, b) in zip(compiled_models.named_parameters(), eager.named_parameters()):
        if b.grad is None:
            assert a.grad is None, name
            continue
        gated += ".energy_gate." in name
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    assert gated >= 9 * 3  # τ, α and the mixing logits of every gated variant received gradients


@pytest.mark.skipif(INDUCTOR_ISA_FORCED, reason=INDUCTOR_SKIP_REASON)
def test_a_compiled_model_generates_what_the_eager_one_generates():
    model = _model("EGA-C", energy_scales=[3, 5]).eval()
    ids = padded_batch()[0][:, 5:]
    expected = model.generate(ids, max_new_tokens=3, do_sample=False)
    model.forward = torch.compile(model.forward)
    assert torch.equal(model.generate(ids, max_new_tokens=3, do_sample=False), expected)
    assert expected.shape[1] == ids.shape[1] + 3 and int(expected.max()) < VOCAB


@pytest.mark.skipif(INDUCTOR_ISA_FORCED, reason=INDUCTOR_SKIP_REASON)
def test_a_compiled_flex_attention_forward_equals_eager():
    """Under flex_attention the kernel's score_mod reads the gate's bias (uncached) or the bias the cache keeps
    beside its keys; on CPU torch.compile(model) had failed to build that kernel (a tensor computed in its graph)."""
    model = _model("EGA-1").eval()
    model.set_attn_implementation("flex_attention")
    compiled = torch.compile(model)
    ids, mask = padded_batch()
    with torch.no_grad():
        for use_cache in (False, True):
            expected = model(ids, attention_mask=mask, use_cache=use_cache).logits * mask[..., None]
            got = compiled(ids, attention_mask=mask, use_cache=use_cache).logits * mask[..., None]
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_torch_export_with_a_dynamic_length_equals_eager():
    """torch.export of a padded EGA-1 forward (no cache) with the sequence length dynamic: the exported program
    runs other lengths and padding and gives the eager logits (atol 1e-5, rtol 1e-5)."""
    from torch.export import Dim, export

    model = _model("EGA-1", use_cache=False).eval()
    ids, mask = padded_batch()
    length = Dim("length", min=2, max=model.config.max_position_embeddings)
    program = export(model, (), {"input_ids": ids, "attention_mask": mask},
                     dynamic_shapes={"input_ids": {1: length}, "attention_mask": {1: length}}).module()
    for width in (ids.shape[1], 5):
        other_ids, other_mask = ids[:, -width:], mask[:, -width:]
        with torch.no_grad():
            expected = model(other_ids, attention_mask=other_mask).logits * other_mask[..., None]
            got = program(input_ids=other_ids, attention_mask=other_mask).logits * other_mask[..., None]
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
