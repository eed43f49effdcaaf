"""Hub-ready model cards (``README.md`` next to a saved model) from the templates in ``training/model_cards/``
(installed as ``hf_spectral/recipes/model_cards/``)."""

from __future__ import annotations

import os

# Next to the recipes, so the templates travel with them into the wheel (package data of hf_spectral.recipes).
TEMPLATE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "model_cards")


def template_path(name: str) -> str:
    path = os.path.join(TEMPLATE_DIR, name)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model card template {path} not found (the recipes' model_cards/ folder is incomplete)")
    return path


def build_model_card(
    template: str,
    *,
    model_name: str,
    results: list[dict],
    dataset_id: str,
    dataset_name: str,
    tags: list[str],
    base_model: str | None = None,
    **template_vars,
):
    """A ``huggingface_hub.ModelCard`` whose YAML metadata holds a model index with ``results``.

    Each result is ``{"split": ..., "metric_type": ..., "metric_name": ..., "value": ...}``; all are
    text-generation results on ``dataset_id`` (the Hub id of the dataset, e.g. ``karpathy/tiny_shakespeare``).
    """
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

    eval_results = [
        EvalResult(
            task_type="text-generation",
            task_name="Character-level language modelling",
            dataset_type=dataset_id,
            dataset_name=dataset_name,
            dataset_split=result["split"],
            metric_type=result["metric_type"],
            metric_name=result["metric_name"],
            metric_value=round(float(result["value"]), 4),
        )
        for result in results
        if result.get("value") is not None
    ]
    card_data = ModelCardData(
        model_name=model_name,
        library_name="transformers",
        pipeline_tag="text-generation",
        license="apache-2.0",
        tags=tags,
        datasets=[dataset_id],
        metrics=sorted({r["metric_type"] for r in results}),
        base_model=base_model,
        eval_results=eval_results or None,
    )
    return ModelCard.from_template(card_data, template_path=template_path(template), model_name=model_name, **template_vars)


def write_model_card(card, directory: str) -> str:
    path = os.path.join(directory, "README.md")
    card.save(path)
    return path
