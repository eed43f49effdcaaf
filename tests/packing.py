"""Packed rows in tests: batches built by transformers' `DataCollatorWithFlattening` (several documents in one row,
position ids restarting at each, no attention mask), and the checks that each document of a packed row gets what it
gets alone, and that a packed batch's loss and gradients are those of its documents run one by one."""

import torch
from transformers import DataCollatorWithFlattening

# Three documents of different lengths: long enough for the gates' statistics and the conv / Morlet / Daubechies
# filters (up to 31 taps here) to run across a boundary, and for RBF chunks of 8 to straddle one.
DOCUMENT_LENGTHS = (23, 17, 31)
# Float32 arithmetic in other kernels and another order of summation (a document's running sums are differences of
# the row's, the packed mask is a block-diagonal one instead of SDPA's causal flag): agreement to a few float32 ulps
# of the logits' size (|logits| ≤ ~5 here). Measured: ≤ 2e-7 on every model.
ATOL = 2e-5


def documents(vocab_size: int, lengths=DOCUMENT_LENGTHS, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab_size, (length,), generator=generator).tolist() for length in lengths]


def flattened(docs: list[list[int]], flash_kwargs: bool = False) -> dict:
    """The batch `DataCollatorWithFlattening` builds: one row, ``labels`` with -100 at each document's first token,
    ``position_ids`` restarting at 0, and with ``flash_kwargs`` ``cu_seq_lens_q/k`` and ``max_length_q/k`` too."""
    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
    return collator([{"input_ids": doc, "labels": doc} for doc in docs])


def packed_inputs(batch: dict, positions: bool = True) -> dict:
    """What a model gets from a flattened batch (without labels); ``positions=False``: the boundaries only from
    ``cu_seq_lens_*``."""
    names = ["input_ids", "cu_seq_lens_q", "cu_seq_lens_k"] + (["position_ids"] if positions else [])
    return {name: batch[name] for name in names if name in batch}


def _spans(docs):
    """(document, its first position in the packed row) for each document."""
    start = 0
    for doc in docs:
        yield doc, start
        start += len(doc)


def assert_documents_as_alone(model, docs, *, flash_kwargs=False, positions=True, atol=ATOL, routing=False,
                              gate_values=False, **forward_kwargs):
    """Run the documents packed into one row, then each alone: the packed row's logits (and, asked for, gate values
    and routing decisions) at each document's positions equal those of the document alone. Returns the packed output.

    Routing decisions are compared exactly: the tests place the routers' thresholds (and scale their logits) far from
    every token's value, so that float32 rounding cannot move a token across."""
    batch = flattened(docs, flash_kwargs)
    extra = {"output_gate_values": True} if gate_values else {}
    extra.update({"output_routing": True} if routing else {})
    packed = model(**packed_inputs(batch, positions), **extra, **forward_kwargs)
    for doc, start in _spans(docs):
        length = len(doc)
        alone = model(torch.tensor([doc]), **extra, **forward_kwargs)
        torch.testing.assert_close(packed.logits[0, start : start + length], alone.logits[0], atol=atol, rtol=0)
        if gate_values:
            assert len(packed.gate_values) == len(alone.gate_values) > 0
            for together, apart in zip(packed.gate_values, alone.gate_values):
                torch.testing.assert_close(together[0, :, start : start + length], apart[0], atol=1e-5, rtol=0)
        if routing:
            assert len(packed.routing_decisions) == len(alone.routing_decisions) > 0
            for together, apart in zip(packed.routing_decisions, alone.routing_decisions):
                assert torch.equal(together[0, start : start + length], apart[0])
    return packed


def assert_documents_mixed(model, docs, **forward_kwargs) -> float:
    """The counter-check: the same documents concatenated as one sequence (what packing without boundaries gives)
    differ from the documents alone somewhere after the first document, so that the tests above can fail."""
    row = torch.tensor([sum(docs, [])])
    together = model(row, **forward_kwargs).logits
    worst = 0.0
    for doc, start in list(_spans(docs))[1:]:
        alone = model(torch.tensor([doc]), **forward_kwargs).logits
        worst = max(worst, float((together[0, start : start + len(doc)] - alone[0]).abs().max()))
    assert worst > 1e-3, "concatenated documents give what they give alone: the packing tests could not fail"
    return worst


def assert_packed_loss_and_gradients(model, docs, *, rtol=1e-4, atol=1e-6, **forward_kwargs):
    """The loss of a packed batch (mean over the predicted tokens of every document) and its gradients equal those
    of the documents run one by one, each weighted by its number of predicted tokens."""
    batch = flattened(docs)
    parameters = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    packed = model(**packed_inputs(batch), labels=batch["labels"], **forward_kwargs).loss
    packed.backward()
    packed_grads = {name: p.grad.clone() for name, p in parameters if p.grad is not None}
    model.zero_grad(set_to_none=True)
    predicted = sum(len(doc) - 1 for doc in docs)
    one_by_one = sum(
        model(torch.tensor([doc]), labels=torch.tensor([doc]), **forward_kwargs).loss * (len(doc) - 1) / predicted
        for doc in docs
    )
    one_by_one.backward()
    torch.testing.assert_close(packed, one_by_one, rtol=rtol, atol=atol)
    assert packed_grads, "no parameter got a gradient"
    for name, p in parameters:
        if p.grad is None:
            assert name not in packed_grads, name
            continue
        torch.testing.assert_close(packed_grads[name], p.grad, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
    model.zero_grad(set_to_none=True)
