"""SequencePooling (hf_spectral/ops/pooling.py): the pooling modes of the classification heads."""

import contextlib

import pytest
import torch

from transformers.testing_utils import CaptureLogger

from hf_spectral.ops import pooling
from hf_spectral.ops.pooling import (
    IN_GRAPH_ASSERTIONS_FIRE,
    POOLING_MODES,
    SequencePooling,
    classifier_attention_mask,
    pool_last,
    pool_weighted,
)
from tests.helpers import INDUCTOR_ISA_FORCED, INDUCTOR_SKIP_REASON


def padded(batch=3, length=7, width=5, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, length, width, generator=generator)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[0, :2] = 0  # left padding
    mask[1, -3:] = 0  # right padding
    return hidden, mask


def test_the_configs_use_the_one_list_of_pooling_modes():
    from hf_spectral.models.chiar_former import configuration_chiar_former
    from hf_spectral.models.ega_gpt import configuration_ega_gpt

    assert POOLING_MODES == ("last", "mean", "learned", "rmt_optimal")
    for module in (configuration_ega_gpt, configuration_chiar_former):
        assert not hasattr(module, "CLASSIFIER_POOLINGS")
        assert module.POOLING_MODES is POOLING_MODES


def test_last_and_mean_pool_the_real_tokens():
    hidden, mask = padded()
    torch.testing.assert_close(pool_last(hidden, mask), torch.stack([hidden[0, -1], hidden[1, 3], hidden[2, -1]]))
    mean = pool_weighted(hidden, mask, mask.float())
    torch.testing.assert_close(mean[0], hidden[0, 2:].mean(0))
    torch.testing.assert_close(mean[1], hidden[1, :4].mean(0))


@pytest.mark.parametrize("mode", ["last", "mean", "learned"])
def test_a_causal_4d_mask_pools_as_its_padding_and_other_shapes_are_refused(mode):
    hidden, mask = padded()
    head = SequencePooling(mode, max_positions=8)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()[None, None] & mask.bool()[:, None, None, :]
    torch.testing.assert_close(head(hidden, causal), head(hidden, mask), atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"must be \(batch, length\) = \(3, 7\).*got shape \(3, 6\)"):
        head(hidden, mask[:, :6])


def test_the_classifier_mask_comes_from_the_pad_token_or_a_warning():
    ids = torch.tensor([[5, 6, 0], [7, 0, 0]])
    given = torch.ones(2, 3, dtype=torch.long)
    assert classifier_attention_mask("M", ids, None, given, 0) is given
    assert classifier_attention_mask("M", ids, None, None, 0).tolist() == [[1, 1, 0], [1, 0, 0]]
    pooling.logger.warning_once.cache_clear()
    with CaptureLogger(pooling.logger) as captured:
        assert classifier_attention_mask("M", ids, None, None, None) is None
        assert classifier_attention_mask("M", ids[:1], None, None, None) is None  # one row: no padding to tell
    assert captured.out.count("cannot tell padding from tokens") == 1
    with CaptureLogger(pooling.logger) as captured:
        classifier_attention_mask("M", None, torch.zeros(2, 3, 4), None, 0)
    assert "`inputs_embeds` and no `attention_mask`" in captured.out
    assert classifier_attention_mask("M", None, None, None, 0) is None  # the model names the missing input


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="'max'.*rmt_optimal"):
        SequencePooling("max", 8)


def test_unfitted_rmt_optimal_refuses_to_run():
    pooling = SequencePooling("rmt_optimal", 8)
    hidden, mask = padded()
    assert not pooling.is_fitted
    with pytest.raises(ValueError, match="no fitted weights.*fit_rmt_pooling.*set_position_weights"):
        pooling(hidden, mask)
    with pooling.unfitted_allowed():  # explicit opt-in: acts as mean pooling
        torch.testing.assert_close(pooling(hidden, mask), SequencePooling("mean", 8)(hidden, mask))
    with pytest.raises(ValueError, match="no fitted weights"):
        pooling(hidden, mask)


def test_fitted_rmt_optimal_pools_with_its_weights_by_real_token_position():
    pooling = SequencePooling("rmt_optimal", 8)
    weights = torch.tensor([3.0, 2.0, 1.0, 0.5, 0.0, 0.0, 0.0])
    pooling.set_position_weights(-weights)  # the sign is fixed so that the weights sum to > 0
    assert pooling.is_fitted
    torch.testing.assert_close(pooling.position_weights[:7], weights)
    hidden, mask = padded()
    pooled = pooling(hidden, mask)
    expected_row0 = (weights[:5, None] * hidden[0, 2:]).sum(0) / weights[:5].sum()
    torch.testing.assert_close(pooled[0], expected_row0)


def test_weights_of_both_signs_are_normalised_by_their_absolute_sum():
    pooling = SequencePooling("rmt_optimal", 7)
    weights = torch.tensor([2.0, -1.0, 1.0, 0.5, 0.0, 0.0, 0.0])
    pooling.set_position_weights(weights)
    hidden, mask = padded()
    expected_row0 = (weights[:5, None] * hidden[0, 2:]).sum(0) / weights[:5].abs().sum()
    torch.testing.assert_close(pooling(hidden, mask)[0], expected_row0)


def test_weights_of_all_ones_are_mean_pooling_and_not_the_unfitted_state():
    pooling = SequencePooling("rmt_optimal", 7)
    pooling.set_position_weights(torch.ones(7))
    assert pooling.is_fitted
    hidden, mask = padded()
    torch.testing.assert_close(pooling(hidden, mask), SequencePooling("mean", 7)(hidden, mask))


@pytest.mark.parametrize("bad, message", [
    (torch.ones(9), "at most 8"),
    (torch.tensor([1.0, float("nan")]), "finite"),
    (torch.zeros(3), "not all be zero"),
])
def test_bad_position_weights_are_refused(bad, message):
    pooling = SequencePooling("rmt_optimal", 8)
    with pytest.raises(ValueError, match=message):
        pooling.set_position_weights(bad)
    assert not pooling.is_fitted
    with pytest.raises(ValueError, match="only in 'rmt_optimal'"):
        SequencePooling("mean", 8).set_position_weights(torch.ones(3))


@pytest.mark.parametrize("mode", ["last", "mean", "learned"])
def test_a_row_of_padding_only_pools_to_finite_values_and_gradients(mode):
    pooling = SequencePooling(mode, max_positions=6)
    hidden = torch.randn(2, 5, 4, requires_grad=True)
    mask = torch.tensor([[0, 0, 0, 0, 0], [0, 1, 1, 1, 1]])
    pooled = pooling(hidden, mask)
    pooled.sum().backward()
    assert torch.isfinite(pooled).all() and torch.isfinite(hidden.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in pooling.parameters() if p.grad is not None)


@pytest.mark.parametrize("mode", ["last", "mean", "learned", "rmt_optimal"])
def test_pooling_reads_no_values_from_a_device(mode):
    """A meta tensor has no values (a read raises): pooling sequences that fit the table reads none, as it must not
    on a GPU (each read would wait for the device)."""
    pooling = SequencePooling(mode, max_positions=8).to("meta")
    hidden, mask = (tensor.to("meta") for tensor in padded())
    with pooling.unfitted_allowed() if mode == "rmt_optimal" else contextlib.nullcontext():
        assert pooling(hidden, mask).shape == (3, 5)


def test_rmt_optimal_reads_whether_it_is_fitted_once_per_set_of_weights(monkeypatch):
    reads = []
    monkeypatch.setattr(SequencePooling, "is_fitted", property(lambda self: reads.append(1) or True))
    pooling = SequencePooling("rmt_optimal", 7)
    pooling.set_position_weights(torch.arange(7.0))
    hidden, mask = padded()
    for _ in range(3):
        pooling(hidden, mask)
    assert len(reads) == 1
    pooling.to(torch.float64)  # new weight tensors: read again, once
    pooling(hidden.double(), mask)
    pooling(hidden.double(), mask)
    assert len(reads) == 2


def test_rmt_optimal_weights_changed_in_place_are_checked_again():
    pooling = SequencePooling("rmt_optimal", 7)
    pooling.set_position_weights(torch.arange(7.0))
    hidden, mask = padded()
    pooling(hidden, mask)
    with torch.no_grad():
        pooling.position_weights.fill_(1.0)  # the unfitted marker, written in place
    with pytest.raises(ValueError, match="no fitted weights"):
        pooling(hidden, mask)


def test_a_sequence_longer_than_the_pooling_table_is_refused():
    hidden, mask = padded(length=7)
    with pytest.raises(ValueError, match="more than 6 tokens"):
        SequencePooling("learned", 6)(hidden, mask)
    mask[:, :1] = 0  # 6 tokens in every row: a padded row may be longer than the table
    assert SequencePooling("learned", 6)(hidden, mask).shape == (3, 5)


@pytest.mark.skipif(INDUCTOR_ISA_FORCED, reason=INDUCTOR_SKIP_REASON)
def test_a_compiled_rmt_optimal_head_still_refuses_to_run_unfitted():
    hidden, mask = padded()
    pooling = SequencePooling("rmt_optimal", 8)
    if IN_GRAPH_ASSERTIONS_FIRE:  # one graph: the check cannot read the weights and asserts on the device
        compiled, error = torch.compile(pooling, fullgraph=True, dynamic=False), RuntimeError
    else:  # a torch that compiles the assertion away: the check reads the weights on the host, a graph break
        compiled, error = torch.compile(pooling, dynamic=False), ValueError
    with pytest.raises(error, match="no fitted weights"):
        compiled(hidden, mask)
    pooling.set_position_weights(torch.arange(7.0))
    torch.testing.assert_close(compiled(hidden, mask), pooling(hidden, mask))


def test_a_pickled_or_copied_head_keeps_no_record_of_the_check_and_checks_again(tmp_path):
    import copy
    import pickle

    pooling = SequencePooling("rmt_optimal", 7)
    pooling.set_position_weights(torch.arange(7.0))
    hidden, mask = padded()
    expected = pooling(hidden, mask)
    assert pooling._checked_weights is not None
    for other in (pickle.loads(pickle.dumps(pooling)), copy.deepcopy(pooling)):
        assert other._checked_weights is None
        torch.testing.assert_close(other(hidden, mask), expected)
        with torch.no_grad():
            other.position_weights.fill_(1.0)
        with pytest.raises(ValueError, match="no fitted weights"):
            other(hidden, mask)
