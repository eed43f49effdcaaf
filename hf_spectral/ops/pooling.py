"""Pooling of token states into one vector per sequence, for the sequence-classification heads.

Shared by every hf_spectral model (a saved checkpoint carries a copy next to its modeling file, so remote code
finds it). Position t below is the t-th *real* token of a sequence, so left and right padding pool alike.
"""

import weakref
from contextlib import contextmanager

import torch
from torch import nn

from transformers.utils import is_torch_greater_or_equal, logging

from .packing import check_not_packed, packed_document_positions
from .positions import padding_of_causal_mask, token_positions

logger = logging.get_logger(__name__)

# Whether a compiled graph keeps torch._assert_async: torch 2.6 to 2.8 compiled the unfitted rmt_optimal check away
# (measured), so there a compiled head reads its weights on the host (a graph break) rather than run unchecked.
IN_GRAPH_ASSERTIONS_FIRE = is_torch_greater_or_equal("2.9", accept_dev=True)

# The one list of pooling modes: the models' configs check `classifier_pooling` against it.
POOLING_MODES = ("last", "mean", "learned", "rmt_optimal")


def pool_last(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """State of the right-most real token of each row (works with left and right padding)."""
    index = (torch.arange(mask.shape[1], device=mask.device) * mask.long()).argmax(-1)
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), index]


def pool_weighted(hidden: torch.Tensor, mask: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ_t w_t h_t / Σ_t |w_t| over real tokens; ``weights`` is (B, T), already indexed by token position."""
    weights = weights * mask.to(weights.dtype)
    norm = weights.abs().sum(-1, keepdim=True).clamp(min=torch.finfo(weights.dtype).tiny)
    return torch.einsum("bt,btc->bc", (weights / norm).to(hidden.dtype), hidden)


def refuse_packed_rows(model_name: str, input_ids, inputs_embeds, attention_mask, position_ids, kwargs: dict) -> None:
    """A classification head pools one vector per row: refuse packed rows (several documents a row, ``packing.py``),
    whose documents it would pool together."""
    tokens = input_ids if input_ids is not None else inputs_embeds
    if tokens is None or tokens.ndim < 2:
        return  # the model itself names what is wrong
    documents, _ = packed_document_positions(position_ids, attention_mask, 0, tokens.shape[0], tokens.shape[1], kwargs)
    check_not_packed(documents, model_name, "a sequence classifier pools one vector per row, not one per document")


def classifier_attention_mask(model_name: str, input_ids, inputs_embeds, attention_mask, pad_token_id):
    """The attention mask a classification head runs its model with and pools over: the one given, else the
    non-padding tokens of ``input_ids`` (``pad_token_id``), else ``None``, with a warning where a batch of several rows
    may hold padding that nothing marks (transformers' own heads refuse such a batch or warn)."""
    if attention_mask is not None:
        return attention_mask
    if input_ids is not None and pad_token_id is not None:
        return (input_ids != pad_token_id).long()  # attention and gates skip padding too
    if input_ids is None and inputs_embeds is None:
        return None  # the model itself names what is missing
    rows = (input_ids if input_ids is not None else inputs_embeds).shape[0]
    if rows > 1:
        source = "`inputs_embeds`" if input_ids is None else "`input_ids` with no `pad_token_id` in the config"
        logger.warning_once(
            f"{model_name} got {source} and no `attention_mask`: it cannot tell padding from tokens, so every "
            "position of a row is pooled as a token. Pass the attention_mask for padded batches."
        )
    return None


UNFITTED_MESSAGE = (
    "this 'rmt_optimal' pooling head has no fitted weights; fit them with "
    "hf_spectral.rmt.fit_rmt_pooling(model, train_dataloader) or install them with "
    "model.pooling.set_position_weights(weights) before running the model"
)


class SequencePooling(nn.Module):
    """Pool (B, T, C) token states with a (B, T) padding mask into (B, C).

    Modes: ``last`` (last real token: the only one that has seen the whole sequence in a causal model),
    ``mean``, ``learned`` (softmax of a learned logit per position) and ``rmt_optimal`` (fixed weights w*,
    the top eigenvector of a position-correlation matrix R estimated from data, SPEC 3.2; set them with
    ``set_position_weights``, e.g. through ``hf_spectral.rmt.fit_rmt_pooling``).

    An ``rmt_optimal`` head starts *unfitted* (its weight table is all ones) and refuses to run until weights are
    installed: acting as mean pooling without a word would hide a forgotten fitting step. Only the scale-free
    direction of the weights matters (the pooled vector is Σ w_t h_t / Σ |w_t|), so installed weights that happen
    to be all ones over the whole table are stored rescaled, never mistaken for the unfitted state.
    """

    def __init__(self, mode: str, max_positions: int):
        super().__init__()
        if mode not in POOLING_MODES:
            raise ValueError(f"unknown pooling {mode!r}; expected one of {POOLING_MODES}")
        self.mode, self.max_positions = mode, max_positions
        if mode == "learned":
            self.position_logits = nn.Parameter(torch.zeros(max_positions))
        elif mode == "rmt_optimal":
            # All ones marks the unfitted head (see the class docstring); saved with the model once fitted.
            self.register_buffer("position_weights", torch.ones(max_positions))
        self._allow_unfitted = False
        # (a weak reference to the weight tensor, its version) last found fitted: read once, not per call
        self._checked_weights = None

    @property
    def is_fitted(self) -> bool:
        """False for an ``rmt_optimal`` head whose weights were never installed (always True in other modes)."""
        return self.mode != "rmt_optimal" or bool(self._fitted())

    def _fitted(self) -> torch.Tensor:
        """Whether the ``rmt_optimal`` weights were installed, as a 0-dim bool tensor on their device."""
        if self.max_positions == 1:  # one position: any weight pools it alike, so the table counts as fitted
            return torch.ones((), dtype=torch.bool, device=self.position_weights.device)
        return (self.position_weights != 1).any()

    def _check_fitted(self) -> None:
        """Refuse an unfitted ``rmt_optimal`` head. The weights are read on the host when they are new or changed
        since the last check (installed, loaded, moved), not at every call: on a device each read would wait for
        it. A compiled graph cannot read them: it asserts on the device instead (a RuntimeError on CPU, a
        device-side assertion on a GPU) where torch keeps the assertion (``IN_GRAPH_ASSERTIONS_FIRE``)."""
        if torch.compiler.is_compiling() and IN_GRAPH_ASSERTIONS_FIRE:
            torch._assert_async(self._fitted(), UNFITTED_MESSAGE)
            return
        weights = self.position_weights
        try:
            version = weights._version
        except RuntimeError:  # a tensor made under inference_mode keeps no version counter: check at every call
            version = None
        checked = self._checked_weights
        if version is not None and checked is not None and checked[0]() is weights and checked[1] == version:
            return
        if not self.is_fitted:
            raise ValueError(UNFITTED_MESSAGE)
        self._checked_weights = (weakref.ref(weights), version)

    def __getstate__(self):
        # pickling (torch.save(model)) carries no record of the check: a loaded head checks its weights again
        return {**super().__getstate__(), "_checked_weights": None}

    @contextmanager
    def unfitted_allowed(self):
        """Let an unfitted ``rmt_optimal`` head run (as mean pooling) inside the block: for tools that need the
        model's other outputs before the head is fitted, e.g. ``hf_spectral.rmt.attention_pooling_weights``."""
        previous, self._allow_unfitted = self._allow_unfitted, True
        try:
            yield self
        finally:
            self._allow_unfitted = previous

    def set_position_weights(self, weights: torch.Tensor) -> None:
        """Install fixed pooling weights (``rmt_optimal``); their sign is fixed so that they sum to > 0."""
        if self.mode != "rmt_optimal":
            raise ValueError(f"position weights are fixed only in 'rmt_optimal' pooling, not {self.mode!r}")
        weights = torch.as_tensor(weights, dtype=self.position_weights.dtype).flatten()
        if weights.numel() > self.max_positions or not torch.isfinite(weights).all():
            raise ValueError(f"expected at most {self.max_positions} finite weights, got {weights.numel()}")
        if not weights.abs().sum() > 0:
            raise ValueError("position weights must not all be zero")
        full = torch.zeros_like(self.position_weights)
        full[: weights.numel()] = weights if weights.sum() >= 0 else -weights
        if self.max_positions > 1 and bool((full == 1).all()):
            full = full / self.max_positions**0.5  # same pooling; all ones is reserved for "unfitted"
        with torch.no_grad():
            self.position_weights.copy_(full)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``mask``: (B, T) padding (1 / True at tokens), or the model's causal 4D attention mask (B, 1, T, T)."""
        if mask is None:
            mask = hidden.new_ones(hidden.shape[:2], dtype=torch.long)
        elif mask.ndim == 4:
            mask = padding_of_causal_mask(mask, hidden.shape[1])
        if mask.shape != hidden.shape[:2]:
            raise ValueError(
                f"the pooling mask must be (batch, length) = {tuple(hidden.shape[:2])} (or a 4D attention mask), got "
                f"shape {tuple(mask.shape)}"
            )
        if self.mode == "last":
            return pool_last(hidden, mask)
        if self.mode == "mean":
            return pool_weighted(hidden, mask, mask.to(torch.float32))
        if self.mode == "rmt_optimal" and not self._allow_unfitted:
            self._check_fitted()
        positions = token_positions(mask)
        # A row's positions count its tokens, so only a sequence longer than the table can overflow it: the values
        # are read (a host synchronisation on a device) only then.
        if hidden.shape[1] > self.max_positions and positions.max() >= self.max_positions:
            raise ValueError(f"sequence has more than {self.max_positions} tokens, the size of the pooling table")
        if self.mode == "learned":
            # The lowest float, not -inf: a row of padding only gets finite weights (zeroed by the mask), not NaN.
            logits = self.position_logits[positions].float().masked_fill(mask == 0, torch.finfo(torch.float32).min)
            return pool_weighted(hidden, mask, torch.softmax(logits, dim=-1))
        return pool_weighted(hidden, mask, self.position_weights[positions].float())
