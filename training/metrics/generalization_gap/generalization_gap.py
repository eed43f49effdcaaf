"""Generalisation gap = validation loss − training loss, per run and across runs (seeds).

A local `evaluate` metric module: ``evaluate.load("training/metrics/generalization_gap")``. The training loss
must be measured like the validation loss (evaluation mode, no dropout, same estimator), not taken from the
running training loss, which is inflated by dropout.
"""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = """
The generalisation gap of a language model: how much higher its loss is on held-out text than on the text it
was trained on (SPEC 1.4 quotes val − train = 0.331 for the baseline and 0.289 for EGA-1 on TinyShakespeare).
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list[float]`): validation losses, one per run.
    references (`list[float]`): training losses of the same runs, measured in evaluation mode.
Returns:
    gap (mean of val − train), gap_std (sample standard deviation over runs, 0 for one run), gaps (per run).
Examples:
    >>> metric = evaluate.load("training/metrics/generalization_gap")
    >>> metric.compute(predictions=[1.5], references=[1.2])["gap"]
    0.3
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class GeneralizationGap(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("float64"), "references": datasets.Value("float64")}
            ),
        )

    def _compute(self, predictions, references):
        validation, training = np.asarray(predictions, dtype=np.float64), np.asarray(references, dtype=np.float64)
        if validation.size == 0:
            raise ValueError("no losses given")
        gaps = validation - training
        return {
            "gap": float(gaps.mean()),
            "gap_std": float(gaps.std(ddof=1)) if gaps.size > 1 else 0.0,
            "gaps": [float(g) for g in gaps],
        }
