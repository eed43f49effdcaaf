"""Hub-ready model cards (``README.md`` next to a saved model) from the cards of the repository's ``model_cards/``.

Each file there is the card of one model family (``ega_gpt``, ``chiar_former``, ``energy_gated``): YAML front matter,
then what the family is, its intended use, how to load it, its limitations, how it was evaluated and its measured
results. The same file is the Jinja template of the card of every model of that family a recipe trains: rendered
without values it is the family's card; given a trained model's values (``model_name`` and the rest) it adds the
sections on that model, its own numbers beside the family's.
"""

from __future__ import annotations

import os

# model_cards/ sits beside the recipes' folder in both layouts: <checkout>/training/ and <checkout>/model_cards/ in a
# source checkout, hf_spectral/recipes/ and hf_spectral/model_cards/ once installed (setup.cfg's package_dir).
CARDS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "model_cards")
FAMILIES = ("ega_gpt", "chiar_former", "energy_gated")


def card_path(family: str) -> str:
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}: the model cards are {', '.join(FAMILIES)}")
    path = os.path.join(CARDS_DIR, f"{family}.md")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model card {path} not found (the model_cards/ folder is incomplete)")
    return path


def render_model_card(family: str, card_data=None, **values):
    """The ``huggingface_hub.ModelCard`` of ``family``, or, given ``values``, of one trained model of it.

    ``card_data`` (a ``ModelCardData``: the model's name, model index, datasets, its own tags) is merged into the
    family's front matter: its tags are added to the family's, its other fields replace the family's. A value the
    card uses but was not given raises ``jinja2.UndefinedError`` naming it.
    """
    import jinja2
    from huggingface_hub import ModelCard, ModelCardData

    card = ModelCard.load(card_path(family))
    metadata = card.data.to_dict()
    if card_data is not None:
        model = card_data.to_dict()
        family_tags = metadata.get("tags", [])
        metadata.update(model, tags=family_tags + [tag for tag in model.pop("tags", []) if tag not in family_tags])
    card.data = ModelCardData(**metadata)
    # A line holding only a {% tag %} leaves nothing behind
    environment = jinja2.Environment(undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
                                     keep_trailing_newline=True)
    card.text = environment.from_string(card.text).render(**values)
    return card


def eval_results(results: list[tuple], *, task_type: str, dataset_id: str, dataset_name: str,
                 task_name: str | None = None) -> list | None:
    """The model index of a card: one ``EvalResult`` per ``(metric name, split, metric type, value)`` whose value is
    known (None when there is none: the Hub rejects an empty model index)."""
    from huggingface_hub import EvalResult

    return [EvalResult(task_type=task_type, task_name=task_name, dataset_type=dataset_id, dataset_name=dataset_name,
                       dataset_split=split, metric_type=metric_type, metric_name=name,
                       metric_value=round(float(value), 4))
            for name, split, metric_type, value in results if value is not None] or None


def write_model_card(card, directory: str) -> str:
    path = os.path.join(directory, "README.md")
    card.save(path)
    return path
