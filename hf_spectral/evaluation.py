"""Leak-free evaluation of causal language models.

A model whose outputs at position i may depend on later tokens (EGA with ``window`` statistics, SPEC 1.2) gets a
validation loss from an ordinary forward pass that generation can never reach. ``leak_free_logits`` predicts each
position from its prefix only, exactly as cached generation does: tokens are fed one at a time, each step seeing
the KV cache of the steps before (one forward pass per position, whatever the model). For a truly causal model the
result equals the ordinary forward pass (tested), so the two losses differ only by what leaked.
"""

from contextlib import contextmanager

import torch
import torch.nn.functional as F

from .ops.positions import token_positions


def _checked_batch(input_ids: torch.Tensor, attention_mask: torch.Tensor | None):
    """The mask (ones where none is given) and the positions generate() gives each token: real tokens counted, so
    that left padding does not shift them (GPT-2 and models like it number positions from 0 otherwise)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or input_ids.shape[1] == 0:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a (batch, length ≥ 1) tensor, got {shape}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    elif attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, got "
            f"{tuple(attention_mask.shape)}"
        )
    return attention_mask, token_positions(attention_mask)


@contextmanager
def evaluation_mode(model):
    """The model in evaluation mode (no dropout) and without gradients for the block; afterwards, also on an error,
    every submodule is back in its own mode (a model training with some blocks frozen in eval mode stays so)."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for module, training in modes:
            module.training = training


@torch.no_grad()
def leak_free_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Logits (B, T, V) where position t is computed from tokens ≤ t only, one cached decoding step per token, in
    evaluation mode, with the positions generate() gives (real tokens counted)."""
    attention_mask, positions = _checked_batch(input_ids, attention_mask)
    cache, steps = None, []
    with evaluation_mode(model):
        for t in range(input_ids.shape[1]):
            out = model(
                input_ids=input_ids[:, t : t + 1],
                attention_mask=attention_mask[:, : t + 1],
                position_ids=positions[:, t : t + 1],
                cache=cache,
                use_cache=True,
            )
            cache = out.cache
            steps.append(out.logits[:, -1:].float())
    return torch.cat(steps, dim=1)


@torch.no_grad()
def causal_lm_losses(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> dict:
    """Mean next-token loss (nats) of an ordinary forward pass and of the leak-free decoding, on the same batch."""
    mask, positions = _checked_batch(input_ids, attention_mask)
    targets = input_ids[:, 1:]
    # A pair counts when both the context token and the target are tokens (left padding: not the first token
    # predicted from a pad position).
    weights = (mask[:, 1:] * mask[:, :-1]).float()
    if weights.sum() == 0:
        raise ValueError(
            f"no (token, next token) pair to score: input_ids of shape {tuple(input_ids.shape)}"
            + ("" if attention_mask is None else f" with {int(attention_mask.sum())} tokens under the attention_mask")
        )

    def loss(logits):
        nll = F.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), reduction="none")
        return float((nll * weights.flatten()).sum() / weights.sum())

    with evaluation_mode(model):
        ordinary = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                         use_cache=False).logits.float()
        leak_free = leak_free_logits(model, input_ids, attention_mask)
    return {"loss": loss(ordinary), "leak_free_loss": loss(leak_free)}
