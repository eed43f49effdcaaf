"""Model-facing tools: effective attention pooling weights, R̂ from data, fit_rmt_pooling (torch)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from hf_spectral import EGAConfig, EGAForSequenceClassification
from hf_spectral.ops.pooling import SequencePooling
from hf_spectral.rmt import (
    PrefixCorrelation,
    attention_pooling_report,
    attention_pooling_weights,
    estimate_position_correlation,
    fit_rmt_pooling,
    harmonic_causal_weights,
    sample_table,
    sample_tokens,
    validate_correlation_matrix,
)

T, L, VOCAB = 16, 3, 32


def early_signal_batches(n=384, batch_size=64, seed=0):
    """Label = the shared class of the first L tokens; the other tokens are independent of it (SPEC 3.2)."""
    rng = np.random.default_rng(seed)
    model = PrefixCorrelation(T, L)
    signs = model.sample_signs(n, rng)
    tokens = torch.tensor(sample_tokens(sample_table(2, VOCAB, 0.0, rng=rng), signs, rng))
    labels = torch.tensor((model.labels(signs) > 0).astype(np.int64))
    return [{"input_ids": tokens[i:i + batch_size], "attention_mask": torch.ones_like(tokens[i:i + batch_size]),
             "labels": labels[i:i + batch_size]} for i in range(0, n, batch_size)]


def tiny_classifier(pooling="rmt_optimal", **overrides):
    torch.manual_seed(0)
    config = EGAConfig(vocab_size=VOCAB, max_position_embeddings=T, hidden_size=32, num_hidden_layers=2,
                       num_attention_heads=2, num_labels=2, classifier_pooling=pooling, embd_pdrop=0.0,
                       resid_pdrop=0.0, attn_pdrop=0.0, **overrides)
    return EGAForSequenceClassification(config)


def early_mass(w):
    return np.abs(w[:L]).sum() / np.abs(w).sum()


def test_fit_rmt_pooling_concentrates_on_the_early_signal_and_survives_save_load(tmp_path):
    batches = early_signal_batches()
    model = tiny_classifier()
    fit = fit_rmt_pooling(model, batches)
    assert early_mass(fit.weights) > 0.6  # uniform weights would put L/T ≈ 0.19 there
    assert np.abs(fit.weights[:L]).min() > np.abs(fit.weights[L:]).max()
    assert fit.snr_optimal.ratio > 1.5 * fit.snr_mean.ratio
    installed = model.pooling.position_weights.numpy()
    np.testing.assert_allclose(installed[: fit.weights.size], fit.weights, rtol=1e-6)
    assert model.training  # the fit restores the training flag

    model.save_pretrained(tmp_path)
    reloaded = EGAForSequenceClassification.from_pretrained(tmp_path).eval()
    np.testing.assert_array_equal(reloaded.pooling.position_weights.numpy(), installed)
    inputs = {k: v for k, v in batches[0].items() if k != "labels"}
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**inputs).logits, model.eval()(**inputs).logits)


def test_fit_rejects_heads_that_are_not_rmt_optimal():
    with pytest.raises(ValueError, match="rmt_optimal"):
        fit_rmt_pooling(tiny_classifier("mean"), early_signal_batches(n=64))
    with pytest.raises(ValueError, match="SequencePooling"):
        fit_rmt_pooling(nn.Linear(2, 2), [])


class CausalMixer(nn.Module):
    """Not a transformers model: embeddings, a running mean over the prefix, and an rmt_optimal head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.embed = nn.Embedding(VOCAB, 24)
        self.pooling = SequencePooling("rmt_optimal", T)
        self.score = nn.Linear(24, 2)

    def forward(self, input_ids, attention_mask=None, output_hidden_states=False):
        h0 = self.embed(input_ids)
        h1 = h0 + 0.1 * h0.cumsum(1) / torch.arange(1, input_ids.shape[1] + 1)[None, :, None]
        return SimpleNamespace(logits=self.score(self.pooling(h1, attention_mask)), hidden_states=(h0, h1))


@pytest.mark.parametrize("states", ["embeddings", "pooled"])
def test_fit_works_for_any_model_with_the_shared_head(states):
    model = CausalMixer()
    fit = fit_rmt_pooling(model, early_signal_batches(), states=states)
    assert early_mass(fit.weights) > 0.5
    assert model.pooling.position_weights[:L].min() > model.pooling.position_weights[L:].abs().max()


def test_estimate_handles_padding_and_needs_labels():
    batches = early_signal_batches(n=256)
    for batch in batches:  # right padding: random lengths in [L + 2, T]
        lengths = torch.randint(L + 2, T + 1, (batch["input_ids"].shape[0],), generator=torch.Generator().manual_seed(0))
        batch["attention_mask"] = (torch.arange(T)[None] < lengths[:, None]).long()
    estimate = estimate_position_correlation(CausalMixer(), batches)
    validate_correlation_matrix(estimate.matrix)
    assert estimate.matrix.shape[0] == T and estimate.counts[-1] < estimate.counts[0]
    R = estimate.matrix
    prefix_pairs = R[:L, :L][~np.eye(L, dtype=bool)]
    later_pairs = R[L:10, L:10][~np.eye(10 - L, dtype=bool)]  # positions held by ≥ 148 of 256 sequences
    assert prefix_pairs.min() > 0.2 and np.abs(later_pairs).mean() < 0.1
    with pytest.raises(ValueError, match="labelled"):
        estimate_position_correlation(CausalMixer(), [{k: v for k, v in batches[0].items() if k != "labels"}])
    # The estimate reads the data twice: a one-pass iterator would leave the second pass empty (R̂ = I, and a fit
    # would put all its weight on the last position), so it is refused.
    with pytest.raises(ValueError, match="re-iterable"):
        estimate_position_correlation(CausalMixer(), iter(batches))


def test_a_label_sorted_dataset_gives_the_estimate_of_the_known_number_of_classes():
    """The first batches may hold only class 0 (IMDB's train split is sorted by label): the classes found later
    join the one-hot label matrix, as if `num_classes` had been given."""
    batches = early_signal_batches(n=256, batch_size=64)
    ids, labels = (torch.cat([b[k] for b in batches]) for k in ("input_ids", "labels"))
    order = torch.argsort(labels, stable=True)
    ids, labels = ids[order], labels[order]
    ordered = [{"input_ids": ids[i : i + 64], "labels": labels[i : i + 64]} for i in range(0, 256, 64)]
    assert ordered[0]["labels"].max() == 0
    inferred = estimate_position_correlation(CausalMixer(), ordered)
    given = estimate_position_correlation(CausalMixer(), ordered, num_classes=2)
    np.testing.assert_allclose(inferred.matrix, given.matrix, rtol=1e-12, atol=1e-12)


def uniform_attention_classifier():
    """No gates, zero query/key projections: every query attends uniformly to its keys j ≤ i."""
    model = tiny_classifier("mean", energy_gate_layers=[], attn_implementation="sdpa")
    with torch.no_grad():
        for block in model.model.h:
            C = block.attn.c_attn.in_features
            block.attn.c_attn.weight[: 2 * C] = 0
            block.attn.c_attn.bias[: 2 * C] = 0
    return model


def test_uniform_causal_attention_measures_the_harmonic_weights_with_self_key():
    model = uniform_attention_classifier()
    measured = attention_pooling_weights(model, early_signal_batches(n=64))
    assert model.config._attn_implementation == "sdpa"  # switched to eager for the measurement only
    expected = harmonic_causal_weights(T, include_self=True)
    assert measured.layer_weights.shape == (2, T) and measured.head_weights.shape == (2, 2, T)
    np.testing.assert_allclose(measured.layer_weights, np.tile(expected, (2, 1)), atol=1e-6)
    # a left-padded sequence of 10 tokens is measured on its own 10 positions
    ids = torch.randint(0, VOCAB, (1, T))
    mask = (torch.arange(T) >= T - 10).long()[None]
    padded = attention_pooling_weights(model, [{"input_ids": ids, "attention_mask": mask}])
    np.testing.assert_allclose(padded.layer_weights[0, :10], harmonic_causal_weights(10, include_self=True), atol=1e-6)
    np.testing.assert_allclose(padded.layer_weights[0, 10:], 0.0, atol=1e-7)


def test_attention_report_on_a_gated_model_against_the_known_R():
    model = tiny_classifier("last", attn_implementation="eager")
    rows = attention_pooling_report(model, early_signal_batches(n=128), PrefixCorrelation(T, L).matrix)
    by_name = {row["pooling"]: row for row in rows}
    assert {"attention layer 0", "attention layer 1", "mean", "optimal"} <= set(by_name)
    assert by_name["optimal"]["alpha_over_kappa"] == pytest.approx(L)
    assert by_name["mean"]["alpha_over_kappa"] == pytest.approx((L**2 + T - L) / T)
    for layer in ("attention layer 0", "attention layer 1"):
        assert 1.0 <= by_name[layer]["alpha_over_kappa"] <= L


def test_fit_works_on_chiar_former_classifier():
    from hf_spectral import ChiarConfig, ChiarForSequenceClassification

    torch.manual_seed(0)
    config = ChiarConfig(vocab_size=VOCAB, max_position_embeddings=T, hidden_size=32, num_attention_heads=2,
                         num_labels=2, classifier_pooling="rmt_optimal")
    model = ChiarForSequenceClassification(config)
    fit = fit_rmt_pooling(model, early_signal_batches())
    assert np.abs(fit.weights[:L]).min() > np.abs(fit.weights[L:]).max()
    np.testing.assert_allclose(model.pooling.position_weights[:T].numpy(), fit.weights, rtol=1e-6)


def collated_batches(n=128, batch_size=32):
    """The same data as `early_signal_batches`, through transformers' `DataCollatorWithPadding` (BatchEncoding)."""
    from transformers import DataCollatorWithPadding, PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t1")),
                                        pad_token="t0")
    collator = DataCollatorWithPadding(tokenizer)
    features = [{"input_ids": ids.tolist(), "labels": int(label)}
                for batch in early_signal_batches(n=n, batch_size=batch_size)
                for ids, label in zip(batch["input_ids"], batch["labels"])]
    return [collator(features[i:i + batch_size]) for i in range(0, n, batch_size)]


def test_rmt_tools_accept_batch_encodings_tuples_and_tensors():
    from transformers import BatchEncoding

    collated = collated_batches()
    assert all(isinstance(batch, BatchEncoding) for batch in collated)
    as_dicts = early_signal_batches(n=128, batch_size=32)
    model = tiny_classifier("last", attn_implementation="eager")
    reference = attention_pooling_weights(model, as_dicts)
    for batches in (collated,
                    [batch["input_ids"] for batch in as_dicts],
                    [(b["input_ids"], b["labels"]) for b in as_dicts],
                    [[b["input_ids"], b["attention_mask"], b["labels"]] for b in as_dicts]):
        np.testing.assert_allclose(attention_pooling_weights(model, batches).layer_weights,
                                   reference.layer_weights, atol=1e-6)
    report = attention_pooling_report(model, collated)
    assert {row["pooling"] for row in report} >= {"attention layer 0", "mean", "optimal"}
    fit_from_encodings = fit_rmt_pooling(tiny_classifier(), collated)
    fit_from_tuples = fit_rmt_pooling(tiny_classifier(), [(b["input_ids"], b["attention_mask"], b["labels"])
                                                          for b in as_dicts])
    np.testing.assert_allclose(fit_from_encodings.weights, fit_from_tuples.weights, atol=1e-8)
    assert fit_from_encodings.snr_previous is None  # the head was unfitted
    with pytest.raises(ValueError, match="mappings.*got str"):
        attention_pooling_weights(model, ["not a batch"])
    with pytest.raises(ValueError, match="length 4"):
        attention_pooling_weights(model, [tuple(as_dicts[0]["input_ids"] for _ in range(4))])


def test_batches_without_a_mask_skip_the_padding_the_model_skips():
    """Without an attention_mask the model finds its padding through `pad_token_id`; the tools index the same real
    tokens (they had counted the padding as tokens: another R̂, other attention weights, a fit over padding)."""
    torch.manual_seed(0)
    model = EGAForSequenceClassification(EGAConfig(
        vocab_size=VOCAB + 1, pad_token_id=VOCAB, max_position_embeddings=T, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_labels=2, classifier_pooling="last", embd_pdrop=0.0, resid_pdrop=0.0,
        attn_pdrop=0.0, attn_implementation="eager"))
    masked = early_signal_batches(n=128, batch_size=32)
    generator = torch.Generator().manual_seed(0)
    for batch in masked:  # right padding: random lengths in [L + 2, T]
        lengths = torch.randint(L + 2, T + 1, (batch["input_ids"].shape[0],), generator=generator)
        batch["attention_mask"] = (torch.arange(T)[None] < lengths[:, None]).long()
        batch["input_ids"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, VOCAB)
    unmasked = [(batch["input_ids"], batch["labels"]) for batch in masked]
    np.testing.assert_array_equal(attention_pooling_weights(model, unmasked).layer_weights,
                                  attention_pooling_weights(model, masked).layer_weights)
    estimate = estimate_position_correlation(model, unmasked, states=1)
    np.testing.assert_array_equal(estimate.matrix, estimate_position_correlation(model, masked, states=1).matrix)
    assert estimate.counts[-1] < estimate.counts[0]
    with pytest.raises(ValueError, match=r"states=5 is no hidden_states index: .* returns 3"):
        estimate_position_correlation(model, masked, states=5)


def test_an_unfitted_rmt_optimal_head_refuses_to_run_but_can_be_measured_and_fitted():
    model = tiny_classifier()
    batch = {k: v for k, v in early_signal_batches(n=8, batch_size=8)[0].items() if k != "labels"}
    with pytest.raises(ValueError, match="no fitted weights.*fit_rmt_pooling"):
        model(**batch)
    attention_pooling_weights(model, [batch])  # reads attentions only: allowed before fitting
    with pytest.raises(ValueError, match="no fitted weights"):
        model(**batch)  # ... and the refusal is back afterwards
    fit_rmt_pooling(model, early_signal_batches(n=128), states="pooled")
    assert model.pooling.is_fitted
    assert model(**batch).logits.shape == (8, 2)
