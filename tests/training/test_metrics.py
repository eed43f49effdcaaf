"""The local evaluate module of training/metrics/ (works offline)."""

import pytest

from training.common.run_scripts import load_metric


def test_accuracy_scores_every_reference_but_the_ignored_ones():
    metric = load_metric("accuracy")
    assert metric.compute(predictions=[0, 5, 1, 2], references=[0, -100, 2, 2])["accuracy"] == pytest.approx(2 / 3)
    assert metric.compute(predictions=[0, 1], references=[0, 2], sample_weight=[3, 1])["accuracy"] == 0.75
    assert metric.compute(predictions=[0, 1], references=[0, 2], normalize=False)["accuracy"] == 1
    with pytest.raises(ValueError, match="no example to score"):
        metric.compute(predictions=[1], references=[-100])


def test_unknown_metric_module_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="no metric module"):
        load_metric("bleu")
