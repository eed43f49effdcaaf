"""Sequence classification for the CHIAR recipes (IMDB, ListOps): tokenized datasets, a padding collator,
accuracy during training, and the final accuracy of whole splits (optionally per group, e.g. nesting depth)."""

from __future__ import annotations

import numpy as np


class PadCollator:
    """Pads a batch to its longest example (rounded up to a multiple of 8) with ``pad_id``; builds the attention
    mask and the labels. Extra columns (e.g. ``depth``) are left out: the model does not take them."""

    def __init__(self, pad_id: int, multiple: int = 8):
        self.pad_id, self.multiple = pad_id, multiple

    def __call__(self, examples: list) -> dict:
        import torch

        longest = max(len(e["input_ids"]) for e in examples)
        longest = -(-longest // self.multiple) * self.multiple
        input_ids = torch.full((len(examples), longest), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(examples), longest), dtype=torch.long)
        for row, example in enumerate(examples):
            ids = torch.as_tensor(example["input_ids"], dtype=torch.long)
            input_ids[row, : len(ids)] = ids
            attention_mask[row, : len(ids)] = 1
        batch = {"input_ids": input_ids, "attention_mask": attention_mask}
        if "labels" in examples[0]:
            batch["labels"] = torch.as_tensor([int(e["labels"]) for e in examples], dtype=torch.long)
        return batch


def accuracy_metrics(eval_prediction) -> dict:
    logits = eval_prediction.predictions
    logits = logits[0] if isinstance(logits, tuple) else logits
    predictions = np.asarray(logits).argmax(-1)
    return {"accuracy": float((predictions == np.asarray(eval_prediction.label_ids)).mean())}


def by_length(dataset):
    """The dataset sorted by length (evaluation pads each batch to its longest example: far less padding)."""
    lengths = np.array([len(ids) for ids in dataset["input_ids"]])
    return dataset.select(np.argsort(lengths, kind="stable").tolist())


def split_accuracy(trainer, dataset, group_column: str | None = None) -> dict:
    """Accuracy of the whole ``dataset`` and, with ``group_column``, per value of that column."""
    dataset = by_length(dataset)
    output = trainer.predict(dataset, metric_key_prefix="final")
    logits = output.predictions[0] if isinstance(output.predictions, tuple) else output.predictions
    correct = np.asarray(logits).argmax(-1) == np.asarray(output.label_ids)
    result = {"accuracy": float(correct.mean()), "examples": int(len(correct)), "loss": output.metrics.get("final_loss")}
    if group_column:
        groups = np.asarray(dataset[group_column])
        result["per_" + group_column] = {
            str(value): {"accuracy": float(correct[groups == value].mean()), "examples": int((groups == value).sum())}
            for value in sorted(set(groups.tolist()))}
    return result


def split_accuracy_evaluation(group_column: str | None = None):
    """The ``evaluate`` of a classification recipe's ``TaskData``: ``<split>_accuracy``, ``<split>_loss`` and
    ``<split>_examples`` of the whole validation and test splits (`split_accuracy`), and with ``group_column``
    ``<split>_accuracy_per_<group_column>``."""

    def evaluate(trainer, model, data, preset, args):
        result = {}
        for split in ("validation", "test"):
            found = split_accuracy(trainer, data.datasets[split], group_column=group_column)
            result[f"{split}_accuracy"] = found["accuracy"]
            result[f"{split}_loss"] = found["loss"]
            result[f"{split}_examples"] = found["examples"]
            if group_column:
                result[f"{split}_accuracy_per_{group_column}"] = found[f"per_{group_column}"]
        return result

    return evaluate


def tokenized_dataset(texts: list, labels: list, encode, max_length: int, extra: dict | None = None):
    """A ``datasets.Dataset`` with input_ids (truncated to ``max_length``), labels, the untruncated length and any
    ``extra`` columns."""
    import datasets

    ids = encode(texts)
    columns = {"input_ids": [row[:max_length] for row in ids], "labels": [int(label) for label in labels],
               "length": [len(row) for row in ids], **(extra or {})}
    return datasets.Dataset.from_dict(columns)
