"""Packed rows: several documents in one row of a batch, as padding-free training batches them.

transformers' ``DataCollatorWithFlattening`` (and TRL's ``padding_free`` / ``packing``) put several documents in a
row with no padding and no ``attention_mask``; ``position_ids`` restart at 0 where a document starts, and
``cu_seq_lens_q`` / ``cu_seq_lens_k`` (``return_flash_attn_kwargs=True``) may give the boundaries too. transformers'
mask creation then keeps the documents apart in attention (``masking_utils.find_packed_sequence_indices``). Every
mechanism here that reads across positions must keep them apart as well: the gates' running statistics and their
convolutional filters, CHIAR-Former's RBF prefix sums and the masks of its routed queries. They take the
**document positions**: (B, T) long, the index of each token in its own document (0 at a document's first token),
or ``None`` for rows of one sequence each (then nothing changes).

Boundaries are found as transformers finds them: a document starts where the position id does not step by one from
the previous token's; ``cu_seq_lens_*`` where given (checked against the position ids). Only a call with nothing
cached and no ``attention_mask`` can hold packed rows (a 2D mask means padding, as for transformers).

The running sums of a document are differences of running sums over the row, taken in float64 so that a document
late in a long row gets the digits it gets alone (float32 would lose about log10(T) of them to the cancellation).
"""

import torch
from transformers.masking_utils import find_packed_sequence_indices

from .positions import host_length, host_reads_are_free

PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k")


def document_positions_from_indices(documents: torch.Tensor) -> torch.Tensor:
    """(B, T) non-decreasing document index of each token -> (B, T) long index of each token in its document."""
    index = torch.arange(documents.shape[-1], device=documents.device)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    first = torch.where(starts, index, 0).cummax(-1).values
    return index - first


def document_positions_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor | None:
    """(B, T) position ids -> document positions, or ``None`` where every row is one document (the check reads the
    tensor on the host outside compiled graphs, as transformers' own detection does; a compiled graph always gets the
    tensor, which then says one document per row)."""
    documents = find_packed_sequence_indices(position_ids)
    return None if documents is None else document_positions_from_indices(documents)


def document_positions_from_cu_seq_lens(cu_seq_lens: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """Cumulative document lengths over the flattened batch, (documents + 1,) starting at 0 and ending at
    batch × length (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``) -> (B, T) document positions.
    A document may not run from one row into the next; checked where reading the tensor is free."""
    cu_seq_lens = cu_seq_lens.to(torch.long).flatten()
    if host_reads_are_free(cu_seq_lens):
        bounds = cu_seq_lens.tolist()
        if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != batch * length or any(
            later <= earlier for earlier, later in zip(bounds, bounds[1:])
        ):
            raise ValueError(
                f"cu_seq_lens must rise strictly from 0 to batch × length = {batch * length} (the cumulative lengths "
                f"of the packed documents), got {bounds[:8]}{' ...' if len(bounds) > 8 else ''}"
            )
        crossing = sorted(set(range(0, batch * length, length)) - set(bounds))
        if crossing:
            raise ValueError(
                f"cu_seq_lens puts a document across the end of a row (row {crossing[0] // length} starts inside one): "
                "each packed document must lie within one row"
            )
    flat = torch.arange(batch * length, device=cu_seq_lens.device)
    documents = torch.searchsorted(cu_seq_lens[1:-1].contiguous(), flat, right=True)
    return document_positions_from_indices(documents.view(batch, length))


def packed_document_positions(
    position_ids: torch.Tensor | None,
    attention_mask,
    past_length,
    batch: int,
    length: int,
    kwargs: dict,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The document positions of a call (``None``: one sequence per row) and the position ids it should use.

    Packed rows are recognised only where transformers recognises them: no ``attention_mask`` and nothing cached.
    ``cu_seq_lens_q`` / ``cu_seq_lens_k`` in ``kwargs`` give the boundaries; without ``position_ids`` they also give
    the positions (each document counted from 0), with them the two must agree. Otherwise ``position_ids`` that
    restart inside a row mark the boundaries. Contradictory inputs are refused, naming them. ``past_length``: an int,
    or a cache's length as a tensor (read where that is free; elsewhere taken for a past)."""
    cu_seq_lens = [kwargs.get(name) for name in PACKED_KWARGS if kwargs.get(name) is not None]
    if not cu_seq_lens and (position_ids is None or attention_mask is not None):
        return None, position_ids  # the usual call (and every decoding step): nothing to read
    nothing_cached = host_length(past_length) == 0
    if cu_seq_lens:
        if attention_mask is not None:
            raise ValueError(
                "cu_seq_lens_q / cu_seq_lens_k mark packed documents, an attention_mask marks padding: give one or the "
                "other (packed rows have no padding)"
            )
        if not nothing_cached:
            raise ValueError("cu_seq_lens_q / cu_seq_lens_k mark packed documents, which cannot follow cached tokens")
        if len(cu_seq_lens) == 2 and (
            cu_seq_lens[0].shape != cu_seq_lens[1].shape
            or (host_reads_are_free(cu_seq_lens[0]) and not torch.equal(cu_seq_lens[0].cpu(), cu_seq_lens[1].cpu()))
        ):
            raise ValueError("cu_seq_lens_q and cu_seq_lens_k differ: self-attention over packed documents needs one set")
        documents = document_positions_from_cu_seq_lens(cu_seq_lens[0], batch, length)
        if position_ids is None:
            return documents, documents
        from_positions = document_positions_from_position_ids(position_ids.expand(batch, -1))
        if host_reads_are_free(documents) and not torch.equal(
            documents, torch.zeros_like(documents) if from_positions is None else from_positions
        ):
            raise ValueError(
                "position_ids and cu_seq_lens_q / cu_seq_lens_k put the packed documents' boundaries at different "
                "places: give position_ids that restart where each document starts, or leave them out"
            )
        return documents, position_ids
    if not nothing_cached:
        return None, position_ids
    return document_positions_from_position_ids(position_ids.expand(batch, -1)), position_ids


def packed_rows(position_ids, attention_mask, cache, use_cache: bool | None, batch: int, length: int, kwargs: dict,
                model_name: str) -> tuple[torch.Tensor | None, torch.Tensor | None, bool | None]:
    """The document positions of a model call, the position ids it should use and whether it keeps a KV cache: a
    model's whole policy for packed rows (`packed_document_positions`).

    Packed rows keep no cache: a cache the model would create by default (``use_cache``) is left out, one passed in
    is refused (its keys would hold several documents, and a later step would read all of them). A compiled graph
    cannot tell packed rows from position ids that only count without reading them on the host: there, as in
    transformers' own mask creation, a call with a cache is one sequence a row, and one without takes the document
    positions (which then say one document a row where that is what the row holds)."""
    past_length = 0 if cache is None else cache.get_seq_length()
    documents, position_ids = packed_document_positions(position_ids, attention_mask, past_length, batch, length, kwargs)
    if documents is None:
        return None, position_ids, use_cache
    explicit = any(kwargs.get(name) is not None for name in PACKED_KWARGS)
    if torch.compiler.is_compiling() and not explicit:
        return (None if cache is not None or use_cache else documents), position_ids, use_cache
    check_packed_cache(documents, cache, model_name)
    return documents, position_ids, False


def check_packed_cache(document_positions: torch.Tensor | None, cache, model_name: str) -> None:
    """Refuse a KV cache given with packed rows: its keys would hold several documents, and a later step would
    attend to all of them. (A cache the model would only create by default is left out instead.)"""
    if document_positions is not None and cache is not None:
        raise ValueError(
            f"{model_name} got packed rows (position_ids restarting inside a row, or cu_seq_lens) together with a KV "
            "cache: a cache keeps one sequence per row. Run packed rows without a cache (use_cache=False) and "
            "generate from one sequence per row"
        )


def check_not_packed(document_positions: torch.Tensor | None, model_name: str, why: str) -> None:
    """Refuse packed rows where a model cannot keep their documents apart (``why`` says what it would mix). Outside
    compiled graphs: inside one, document positions come whether or not a row holds several documents."""
    if document_positions is not None and not torch.compiler.is_compiling():
        raise ValueError(
            f"{model_name} cannot take packed rows (position_ids restarting inside a row, or cu_seq_lens): {why}. "
            "Give one sequence per row, padded, with an attention_mask"
        )


def wide_dtype(device: torch.device) -> torch.dtype:
    """The dtype of a row's running sums that a document's sums are taken from: float64, except on Apple's MPS,
    which has none (float32 there, to float32 rounding of the row's sums)."""
    return torch.float32 if torch.device(device).type == "mps" else torch.float64


def document_cumsum(values: torch.Tensor, document_positions: torch.Tensor) -> torch.Tensor:
    """Running sums along the last axis that restart at each document: values (..., T) broadcasting against the
    (B, T) document positions, reshaped as (B, 1, ..., 1, T) -> (..., T) in ``values``' dtype. Differences of
    float64 running sums over the row (see the module docstring)."""
    length = values.shape[-1]
    starts = torch.arange(length, device=values.device) - document_positions  # first position of each document
    running = values.to(wide_dtype(values.device)).cumsum(-1)
    shape = (starts.shape[0],) + (1,) * (values.ndim - 2) + (length,)
    before = (starts - 1).clamp(min=0).view(shape).expand(*running.shape[:-1], length)
    earlier = torch.where(starts.view(shape) > 0, running.gather(-1, before), 0.0)
    return (running - earlier).to(values.dtype)


def document_totals(values: torch.Tensor, document_positions: torch.Tensor) -> torch.Tensor:
    """The sum over each token's whole document, at every token: values (..., T) broadcasting against the (B, T)
    document positions as in `document_cumsum` -> (..., T)."""
    length = values.shape[-1]
    documents = (document_positions == 0).long().cumsum(-1) - 1  # (B, T) index of each token's document
    shape = (documents.shape[0],) + (1,) * (values.ndim - 2) + (length,)
    documents = documents.view(shape).expand(values.shape)
    totals = torch.zeros_like(values).scatter_add(-1, documents, values)
    return totals.gather(-1, documents)


def document_starts(document_positions: torch.Tensor) -> torch.Tensor:
    """(B, T) document positions -> (B, T) position in the row where each token's document starts."""
    return torch.arange(document_positions.shape[-1], device=document_positions.device) - document_positions


__all__ = [
    "PACKED_KWARGS",
    "check_not_packed",
    "check_packed_cache",
    "document_cumsum",
    "document_positions_from_cu_seq_lens",
    "document_positions_from_indices",
    "document_positions_from_position_ids",
    "document_starts",
    "document_totals",
    "packed_document_positions",
    "packed_rows",
    "wide_dtype",
]
