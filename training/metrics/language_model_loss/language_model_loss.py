"""Language-model loss, perplexity, bits per token and bits per character from per-token log-likelihoods.

A local `evaluate` metric module: ``evaluate.load("training/metrics/language_model_loss")``.
"""

import math

import datasets
import evaluate
import numpy as np

_DESCRIPTION = """
Aggregates the negative log-likelihood (in nats) of every predicted token of an evaluation set:
loss = mean NLL per token, perplexity = exp(loss), bits_per_token = loss / ln 2 and
bits_per_char = total NLL / (number of characters covered) / ln 2, where the number of characters is
num_tokens × chars_per_token (1 for character-level models).
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list[float]`): negative log-likelihood, in nats, of each predicted token (padding excluded).
    chars_per_token (`float`, defaults to 1.0): characters of text per token of the evaluated split.
Returns:
    loss, perplexity, bits_per_token, bits_per_char (floats) and num_tokens (int).
Examples:
    >>> metric = evaluate.load("training/metrics/language_model_loss")
    >>> metric.compute(predictions=[math.log(2), math.log(2)])["bits_per_char"]
    1.0
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class LanguageModelLoss(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("float64")}),
        )

    def _compute(self, predictions, chars_per_token=1.0):
        nll = np.asarray(predictions, dtype=np.float64)
        if nll.size == 0:
            raise ValueError("no token log-likelihoods to aggregate")
        if not np.all(np.isfinite(nll)) or np.any(nll < 0):
            raise ValueError("negative log-likelihoods must be finite and non-negative")
        if chars_per_token <= 0:
            raise ValueError(f"chars_per_token must be positive, got {chars_per_token}")
        loss = float(nll.mean())
        return {
            "loss": loss,
            "perplexity": math.exp(loss),
            "bits_per_token": loss / math.log(2),
            "bits_per_char": loss / chars_per_token / math.log(2),
            "num_tokens": int(nll.size),
        }
