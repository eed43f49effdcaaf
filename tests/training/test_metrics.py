"""The local `evaluate` metric modules and the per-token NLL the Trainer hands them."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from training.common.classification import split_accuracy
from training.common.trainer import lm_compute_metrics, load_metric, token_nll


def test_language_model_loss_gives_perplexity_and_bits():
    metric = load_metric("language_model_loss")
    result = metric.compute(predictions=[math.log(4)] * 3 + [math.log(4)], chars_per_token=2.0)
    assert result["loss"] == pytest.approx(math.log(4))
    assert result["perplexity"] == pytest.approx(4.0)
    assert result["bits_per_token"] == pytest.approx(2.0)
    assert result["bits_per_char"] == pytest.approx(1.0)  # two characters per token
    assert result["num_tokens"] == 4


def test_language_model_loss_rejects_impossible_likelihoods():
    with pytest.raises(ValueError, match="non-negative"):
        load_metric("language_model_loss").compute(predictions=[0.5, -0.1])


def test_generalization_gap_is_validation_minus_training_over_runs():
    result = load_metric("generalization_gap").compute(predictions=[1.5, 1.7], references=[1.2, 1.2])
    assert result["gaps"] == pytest.approx([0.3, 0.5])
    assert result["gap"] == pytest.approx(0.4)
    assert result["gap_std"] == pytest.approx(np.std([0.3, 0.5], ddof=1))


def test_accuracy_scores_every_reference_but_the_ignored_ones():
    metric = load_metric("accuracy")
    assert metric.compute(predictions=[0, 1, 1, 2], references=[0, 1, 2, 2])["accuracy"] == 0.75
    # -100 marks what Trainer's labels do not score (padding); weights count examples unequally
    assert metric.compute(predictions=[0, 5, 1, 2], references=[0, -100, 2, 2])["accuracy"] == pytest.approx(2 / 3)
    assert metric.compute(predictions=[0, 1], references=[0, 2], sample_weight=[3, 1])["accuracy"] == 0.75
    assert metric.compute(predictions=[0, 1], references=[0, 2], normalize=False)["accuracy"] == 1
    with pytest.raises(ValueError, match="no example to score"):
        metric.compute(predictions=[1], references=[-100])


def test_token_nll_matches_the_model_loss():
    torch.manual_seed(0)
    logits, labels = torch.randn(3, 7, 11), torch.randint(0, 11, (3, 7))
    nll = token_nll(logits, labels)
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1))
    assert nll.shape == (3, 6)
    assert nll.mean().item() == pytest.approx(expected.item(), rel=1e-6)


def test_token_nll_marks_ignored_labels_and_averages_the_others_as_the_model_loss():
    torch.manual_seed(0)
    logits, labels = torch.randn(3, 7, 11), torch.randint(0, 11, (3, 7))
    labels[0, :4] = -100  # e.g. a left-padded row
    labels[2, 5] = -100
    nll = token_nll(logits, labels)
    ignored = labels[:, 1:] == -100  # token_nll scores the next token: position t of nll is labels[:, t + 1]
    assert ignored.any() and (~ignored).any()
    assert torch.equal(nll[ignored], torch.full((int(ignored.sum()),), -1.0))
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1), ignore_index=-100)
    assert nll[~ignored].mean().item() == pytest.approx(expected.item(), rel=1e-6)


def test_compute_metrics_ignores_padded_positions():
    class Prediction:
        predictions = np.array([[math.log(2), -1.0], [math.log(2), math.log(2)]])

    assert lm_compute_metrics()(Prediction())["bits_per_char"] == pytest.approx(1.0)


def test_unknown_metric_module_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="no metric module"):
        load_metric("bleu")


def test_split_accuracy_per_group_reads_the_groups_of_the_predicted_rows():
    """split_accuracy predicts on the dataset sorted by length: the groups must be read in that order too."""
    import datasets
    from transformers.trainer_utils import PredictionOutput

    class RightOnlyAtDepthOne:
        def predict(self, dataset, metric_key_prefix="test"):
            labels = np.asarray(dataset["labels"])
            chosen = np.where(np.asarray(dataset["depth"]) == 1, labels, (labels + 1) % 10)
            return PredictionOutput(predictions=np.eye(10)[chosen], label_ids=labels, metrics={})

    depth = [1, 2, 1, 3, 2, 1]
    lengths = [5, 1, 4, 2, 3, 6]  # not in order: sorting by length moves the depth-1 rows to the end
    dataset = datasets.Dataset.from_dict({"input_ids": [[7] * n for n in lengths], "labels": [3, 1, 4, 1, 5, 9],
                                          "depth": depth})
    result = split_accuracy(RightOnlyAtDepthOne(), dataset, group_column="depth")
    assert result["accuracy"] == pytest.approx(depth.count(1) / len(depth))
    assert result["per_depth"] == {"1": {"accuracy": 1.0, "examples": 3}, "2": {"accuracy": 0.0, "examples": 2},
                                   "3": {"accuracy": 0.0, "examples": 1}}
