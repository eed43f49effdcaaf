"""Leak-free evaluation of causal language models.

A model whose outputs at position i may depend on later tokens (EGA with ``window`` statistics, SPEC 1.2) gets a
validation loss from an ordinary forward pass that generation can never reach. ``leak_free_logits`` predicts each
position from its prefix only, exactly as cached generation does: tokens are fed one at a time (or in chunks for
models that are causal anyway), each step seeing the KV cache of the steps before. For a truly causal model
the result equals the ordinary forward pass (tested), so the two losses differ only by what leaked.
"""

import torch
import torch.nn.functional as F


@torch.no_grad()
def leak_free_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Logits (B, T, V) where position t is computed from tokens ≤ t only, one cached decoding step per token."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    cache, steps = None, []
    for t in range(input_ids.shape[1]):
        out = model(
            input_ids=input_ids[:, t : t + 1],
            attention_mask=attention_mask[:, : t + 1],
            cache=cache,
            use_cache=True,
        )
        cache = out.cache
        steps.append(out.logits[:, -1:].float())
    return torch.cat(steps, dim=1)


@torch.no_grad()
def causal_lm_losses(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> dict:
    """Mean next-token loss (nats) of an ordinary forward pass and of the leak-free decoding, on the same batch."""
    targets = input_ids[:, 1:]
    # A pair counts when both the context token and the target are tokens (left padding: not the first token
    # predicted from a pad position).
    weights = torch.ones_like(targets) if attention_mask is None else attention_mask[:, 1:] * attention_mask[:, :-1]
    weights = weights.float()
    if weights.sum() == 0:
        raise ValueError(
            f"no (token, next token) pair to score: input_ids of shape {tuple(input_ids.shape)}"
            + ("" if attention_mask is None else f" with {int(attention_mask.sum())} tokens under the attention_mask")
        )

    def loss(logits):
        nll = F.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), reduction="none")
        return float((nll * weights.flatten()).sum() / weights.sum())

    was_training = model.training
    model.eval()
    ordinary = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits.float()
    result = {"loss": loss(ordinary), "leak_free_loss": loss(leak_free_logits(model, input_ids, attention_mask))}
    model.train(was_training)
    return result
