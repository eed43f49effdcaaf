"""Pooling of token states into one vector per sequence, for the sequence-classification heads.

Shared by every hf_spectral model (each model folder links this file, so remote code finds it next to the
modeling file). Position t below is the t-th *real* token of a sequence, so left and right padding pool alike.
"""

import torch
from torch import nn

POOLING_MODES = ("last", "mean", "learned", "rmt_optimal")


def token_positions(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) 0/1 mask -> index of each token among the real tokens of its row (0 at padding)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def pool_last(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """State of the right-most real token of each row (works with left and right padding)."""
    index = (torch.arange(mask.shape[1], device=mask.device) * mask.long()).argmax(-1)
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), index]


def pool_weighted(hidden: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ_t w_t h_t / Σ_t |w_t| over real tokens; ``weights`` is (B, T), already indexed by token position."""
    weights = weights * mask.to(weights.dtype)
    norm = weights.abs().sum(-1, keepdim=True).clamp(min=torch.finfo(weights.dtype).tiny)
    return torch.einsum("bt,btc->bc", (weights / norm).to(hidden.dtype), hidden)


class SequencePooling(nn.Module):
    """Pool (B, T, C) token states with a (B, T) padding mask into (B, C).

    Modes: ``last`` (last real token: the only one that has seen the whole sequence in a causal model),
    ``mean``, ``learned`` (softmax of a learned logit per position) and ``rmt_optimal`` (fixed weights w*,
    the top eigenvector of a position-correlation matrix R estimated from data, SPEC 3.2; set them with
    ``set_position_weights``, e.g. through ``hf_spectral.rmt.fit_rmt_pooling``).
    """

    def __init__(self, mode: str, max_positions: int):
        super().__init__()
        if mode not in POOLING_MODES:
            raise ValueError(f"unknown pooling {mode!r}; expected one of {POOLING_MODES}")
        self.mode, self.max_positions = mode, max_positions
        if mode == "learned":
            self.position_logits = nn.Parameter(torch.zeros(max_positions))
        elif mode == "rmt_optimal":
            # Uniform until fitted, i.e. mean pooling; saved with the model once fitted.
            self.register_buffer("position_weights", torch.ones(max_positions))

    def set_position_weights(self, weights: torch.Tensor) -> None:
        """Install fixed pooling weights (``rmt_optimal``); their sign is fixed so that they sum to > 0."""
        if self.mode != "rmt_optimal":
            raise ValueError(f"position weights are fixed only in 'rmt_optimal' pooling, not {self.mode!r}")
        weights = torch.as_tensor(weights, dtype=self.position_weights.dtype).flatten()
        if weights.numel() > self.max_positions or not torch.isfinite(weights).all():
            raise ValueError(f"expected at most {self.max_positions} finite weights, got {weights.numel()}")
        full = torch.zeros_like(self.position_weights)
        full[: weights.numel()] = weights if weights.sum() >= 0 else -weights
        self.position_weights.copy_(full)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if mask is None:
            mask = hidden.new_ones(hidden.shape[:2], dtype=torch.long)
        if self.mode == "last":
            return pool_last(hidden, mask)
        if self.mode == "mean":
            return pool_weighted(hidden, mask, mask.to(torch.float32))
        positions = token_positions(mask)
        if positions.max() >= self.max_positions:
            raise ValueError(f"sequence has more than {self.max_positions} tokens, the size of the pooling table")
        if self.mode == "learned":
            logits = self.position_logits[positions].masked_fill(mask == 0, float("-inf"))
            return pool_weighted(hidden, mask, torch.softmax(logits.float(), dim=-1))
        return pool_weighted(hidden, mask, self.position_weights[positions].float())
