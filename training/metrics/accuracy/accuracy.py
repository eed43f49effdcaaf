"""Accuracy: the fraction of predictions equal to their references.

A local `evaluate` metric module, the counterpart of the Hub's ``accuracy`` (``evaluate.load("accuracy")`` needs the
network): ``evaluate.load("training/metrics/accuracy")``.
"""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = """
Accuracy = (number of predictions equal to their reference) / (number of predictions), optionally weighted per
example; with normalize=False, the (weighted) number of correct predictions.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list[int]`): predicted labels (class ids, or next-token ids).
    references (`list[int]`): true labels; -100 marks an example that is not scored (padding, as Trainer's labels).
    normalize (`bool`, defaults to True): the fraction correct; False: the number correct.
    sample_weight (`list[float]`, *optional*): a weight per example.
Returns:
    accuracy (float).
Examples:
    >>> metric = evaluate.load("training/metrics/accuracy")
    >>> metric.compute(predictions=[0, 1, 1, 2], references=[0, 1, 2, 2])["accuracy"]
    0.75
"""

IGNORED = -100


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references, normalize=True, sample_weight=None):
        predictions, references = np.asarray(predictions), np.asarray(references)
        weights = np.ones(len(references)) if sample_weight is None else np.asarray(sample_weight, dtype=np.float64)
        if weights.shape != references.shape:
            raise ValueError(f"sample_weight has {weights.size} values for {references.size} examples")
        scored = references != IGNORED
        if not scored.any():
            raise ValueError("no example to score (every reference is -100)")
        correct = float(((predictions == references) * weights)[scored].sum())
        return {"accuracy": correct / float(weights[scored].sum()) if normalize else correct}
