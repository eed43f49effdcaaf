"""Packed rows (hf_spectral/ops/packing.py): finding the documents as transformers finds them, the running sums that
restart at each, and every mechanism that reads across positions keeping them apart."""

import pytest
import torch

from hf_spectral.ops import packing
from hf_spectral.ops.energy_gate import EnergyGate, causal_filter, causal_zscore, window_zscore
from hf_spectral.ops.random_features import causal_kernel_attention

LENGTHS = (5, 1, 9, 17)  # a document of one token, documents across chunk boundaries of 8


def _position_ids(lengths, start=0):
    return torch.cat([torch.arange(n) + start for n in lengths])[None]


def _each_document(tensor, lengths, dim=-1):
    return tensor.split(list(lengths), dim=dim)


def test_documents_are_found_where_position_ids_restart_and_nowhere_else():
    positions = packing.document_positions_from_position_ids(_position_ids(LENGTHS))
    assert torch.equal(positions, _position_ids(LENGTHS))
    # transformers' rule: a document starts wherever the position does not step by one (any first position)
    shifted = packing.document_positions_from_position_ids(_position_ids(LENGTHS, start=2))
    assert torch.equal(shifted, _position_ids(LENGTHS))
    assert packing.document_positions_from_position_ids(torch.arange(12).expand(3, -1)) is None
    assert packing.document_positions_from_position_ids(torch.arange(4, 16)[None]) is None  # after a past


def test_cu_seq_lens_give_the_documents_of_every_row_and_refuse_impossible_ones():
    cu = torch.tensor([0, 3, 8, 10, 16], dtype=torch.int32)  # two rows of 8: (3, 5) and (2, 6)
    positions = packing.document_positions_from_cu_seq_lens(cu, batch=2, length=8)
    assert positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 0, 1, 2, 3, 4, 5]]
    with pytest.raises(ValueError, match="across the end of a row"):
        packing.document_positions_from_cu_seq_lens(torch.tensor([0, 3, 10, 16]), batch=2, length=8)
    for bad in ([0, 3, 3, 16], [1, 16], [0, 15], [0]):
        with pytest.raises(ValueError, match="rise strictly from 0"):
            packing.document_positions_from_cu_seq_lens(torch.tensor(bad), batch=2, length=8)


def test_packed_rows_are_recognised_only_without_a_mask_and_without_a_past():
    positions = _position_ids(LENGTHS)
    length = positions.shape[1]
    documents, _ = packing.packed_document_positions(positions, None, 0, 1, length, {})
    assert torch.equal(documents, positions)
    mask = torch.ones(1, length)
    assert packing.packed_document_positions(positions, mask, 0, 1, length, {})[0] is None  # a 2D mask: padding
    assert packing.packed_document_positions(positions, None, 4, 1, length, {})[0] is None  # a decoding call
    assert packing.packed_document_positions(positions, None, torch.tensor(0), 1, length, {})[0] is not None
    cu = {"cu_seq_lens_q": torch.tensor([0, 5, 6, 15, 32])}
    documents, counted = packing.packed_document_positions(None, None, 0, 1, length, cu)
    assert torch.equal(documents, positions) and torch.equal(counted, positions)
    with pytest.raises(ValueError, match="give one or the other"):
        packing.packed_document_positions(None, mask, 0, 1, length, cu)
    with pytest.raises(ValueError, match="cannot follow cached tokens"):
        packing.packed_document_positions(None, None, 3, 1, length, cu)
    with pytest.raises(ValueError, match="differ"):
        packing.packed_document_positions(None, None, 0, 1, length, {**cu, "cu_seq_lens_k": torch.tensor([0, 32])})
    with pytest.raises(ValueError, match="different places"):
        packing.packed_document_positions(torch.arange(length)[None], None, 0, 1, length, cu)


def test_document_cumsum_keeps_the_digits_of_a_document_late_in_a_long_row():
    """The row's running sums are float64: a document after 2^16 values of ~1 gets its sums to float32 rounding,
    where differences of float32 running sums would be off by ~1e-3."""
    generator = torch.Generator().manual_seed(0)
    lengths = (2**16, 3, 40)
    values = 1 + torch.rand(2, sum(lengths), generator=generator)
    positions = _position_ids(lengths).expand(2, -1)
    summed = packing.document_cumsum(values, positions)
    assert summed.dtype == torch.float32
    for piece, alone in zip(_each_document(summed, lengths), _each_document(values, lengths)):
        torch.testing.assert_close(piece, alone.double().cumsum(-1).float(), rtol=1e-6, atol=0)
    naive = values.cumsum(-1)
    late = naive[:, 2**16 : 2**16 + 3] - naive[:, 2**16 - 1 : 2**16]
    assert (late - values[:, 2**16 : 2**16 + 3].cumsum(-1)).abs().max() > 1e-4  # why float64


def test_document_totals_sum_each_documents_values_at_every_one_of_its_positions():
    values = torch.arange(32.0)[None, None].expand(2, 3, -1)
    totals = packing.document_totals(values, _position_ids(LENGTHS).expand(2, -1))
    expected = torch.cat([piece.sum(-1, keepdim=True).expand_as(piece) for piece in _each_document(values, LENGTHS)], -1)
    assert torch.equal(totals, expected)


def test_the_statistics_and_filters_restart_at_every_document():
    generator = torch.Generator().manual_seed(1)
    energy = torch.randn(2, 3, 2, 32, generator=generator, dtype=torch.float64) * 3 + 7  # |mean| ≫ std
    positions = _position_ids(LENGTHS).expand(2, -1)
    z, count, mean, m2 = causal_zscore(energy, document_positions=positions)
    window = window_zscore(energy, document_positions=positions)
    pieces = zip(*(_each_document(t, LENGTHS) for t in (energy, z, count, mean, m2, window)))
    for alone, z_doc, count_doc, mean_doc, m2_doc, window_doc in pieces:
        for together, apart in zip((z_doc, count_doc, mean_doc, m2_doc), causal_zscore(alone)):
            torch.testing.assert_close(together, apart.expand_as(together), atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(window_doc, window_zscore(alone), atol=1e-10, rtol=1e-10)
    with pytest.raises(ValueError, match="no padding weights"):
        causal_zscore(energy, torch.ones(2, 1, 1, 32), document_positions=positions)
    signal = torch.randn(2, 32, generator=generator, dtype=torch.float64)
    kernels = torch.randn(3, 9, generator=generator, dtype=torch.float64)
    filtered = causal_filter(signal, kernels, positions[:1].expand(2, -1))
    for together, alone in zip(_each_document(filtered, LENGTHS), _each_document(signal, LENGTHS)):
        torch.testing.assert_close(together, causal_filter(alone, kernels), atol=1e-12, rtol=0)


@pytest.mark.parametrize("normalization", ["causal", "window", "none"])
@pytest.mark.parametrize("kind, options", [("linear", {"projections": 2}), ("conv", {"scales": [3, 15]}),
                                           ("morlet", {"scales": [3, 31]}), ("db4", {"scales": [1, 4]})])
def test_the_gate_of_each_packed_document_is_its_gate_alone(kind, options, normalization):
    torch.manual_seed(0)
    gate = EnergyGate(16, 2, kind=kind, normalization=normalization, **options).double()
    with torch.no_grad():
        for parameter in gate.parameters():
            parameter.normal_()
    x = torch.randn(2, 32, 16, dtype=torch.float64)
    positions = _position_ids(LENGTHS).expand(2, -1)
    bias, gate_values, state, _ = gate(x, return_state=True, document_positions=positions)
    for piece, alone in zip(zip(*(_each_document(t, LENGTHS) for t in (bias, gate_values))), _each_document(x, LENGTHS, 1)):
        expected = gate(alone)
        torch.testing.assert_close(piece[0], expected[0], atol=1e-9, rtol=0)
        torch.testing.assert_close(piece[1], expected[1], atol=1e-9, rtol=0)
    with pytest.raises(ValueError, match="without padding"):
        gate(x, torch.ones(2, 32, dtype=torch.bool), document_positions=positions)


@pytest.mark.parametrize("chunk_size", [4, 8, 64])
def test_kernel_attention_of_packed_rows_reads_only_each_documents_past(chunk_size):
    generator = torch.Generator().manual_seed(2)
    phi_q, phi_k = (torch.rand(2, 32, 6, generator=generator) for _ in range(2))
    values = torch.randn(2, 32, 5, generator=generator)
    positions = _position_ids(LENGTHS).expand(2, -1)
    out, state = causal_kernel_attention(phi_q, phi_k, values, chunk_size=chunk_size, document_positions=positions)
    pieces = [_each_document(t, LENGTHS, 1) for t in (phi_q, phi_k, values, out)]
    for q, k, v, together in zip(*pieces):
        alone, last_state = causal_kernel_attention(q, k, v, chunk_size=chunk_size)
        torch.testing.assert_close(together, alone, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(state, last_state, atol=1e-5, rtol=1e-5)  # the last document's sums
    with pytest.raises(ValueError, match="no cached past"):
        causal_kernel_attention(phi_q, phi_k, values, past_state=state, document_positions=positions)
