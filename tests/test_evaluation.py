"""hf_spectral.evaluation: leak-free logits and losses of any causal LM."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from hf_spectral.evaluation import causal_lm_losses, leak_free_logits
from hf_spectral.retrofit import add_energy_gates


def _gpt2(gated):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=30, n_embd=32, n_layer=2, n_head=2, n_positions=32, pad_token_id=0))
    return add_energy_gates(model) if gated else model


@pytest.mark.parametrize("gated", [False, True], ids=["gpt2", "retrofitted gpt2"])
def test_left_padding_changes_nothing_for_models_that_number_positions_from_zero(gated):
    # GPT-2 numbers positions from 0 including pads unless given position_ids, as generate() gives them.
    model = _gpt2(gated)
    ids = torch.randint(1, 30, (1, 9), generator=torch.Generator().manual_seed(1))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(ids)], dim=1)
    alone, left = causal_lm_losses(model, ids), causal_lm_losses(model, padded, mask)
    assert left["loss"] == pytest.approx(alone["loss"], abs=1e-5)
    assert left["leak_free_loss"] == pytest.approx(alone["leak_free_loss"], abs=1e-5)
    torch.testing.assert_close(leak_free_logits(model, padded, mask)[:, 3:], leak_free_logits(model, ids),
                               atol=1e-5, rtol=1e-5)


def test_evaluation_runs_without_dropout_and_restores_the_mode_also_on_error():
    model = _gpt2(False)
    model.config.attn_pdrop = model.config.resid_pdrop = 0.5
    model = GPT2LMHeadModel(model.config).train()
    ids = torch.randint(1, 30, (2, 6), generator=torch.Generator().manual_seed(2))
    assert torch.equal(leak_free_logits(model, ids), leak_free_logits(model, ids)) and model.training
    with pytest.raises(ValueError, match="attention_mask must have the shape of input_ids"):
        causal_lm_losses(model, ids, torch.ones(2, 5, dtype=torch.long))
    assert model.training
    # Mixed modes come back as they were: a block frozen in eval mode inside a training model stays in eval mode.
    model.transformer.h[0].eval()
    modes = {name: module.training for name, module in model.named_modules()}
    causal_lm_losses(model, ids)
    assert {name: module.training for name, module in model.named_modules()} == modes
    assert not model.transformer.h[0].attn.attn_dropout.training and model.transformer.h[1].training


@pytest.mark.parametrize("ids, message", [
    (torch.ones(6, dtype=torch.long), r"input_ids must be a \(batch, length ≥ 1\) tensor, got \(6,\)"),
    (torch.ones(2, 0, dtype=torch.long), r"got \(2, 0\)"),
])
def test_bad_input_ids_are_refused_with_their_shape(ids, message):
    with pytest.raises(ValueError, match=message):
        leak_free_logits(_gpt2(False), ids)
