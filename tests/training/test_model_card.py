"""The model cards of model_cards/: each family's card is a complete Hub card, and the card every recipe writes next
to a trained model is that family card with the model's own sections added."""

import re
from pathlib import Path

import jinja2
import pytest
from huggingface_hub import ModelCard

from training.common import model_card
from training.common.model_card import FAMILIES, render_model_card

from .conftest import REPO_ROOT

CARDS = Path(REPO_ROOT) / "model_cards"
SECTIONS = ["Intended use", "How to use", "Limitations", "How it was evaluated", "Measured results"]
# The sections a trained model's card takes unchanged from its family's card (Limitations gains a line on the model)
FAMILY_SECTIONS = ["Intended use", "How it was evaluated", "Measured results"]


def sections(text: str) -> dict:
    """``## heading`` -> the text below it, up to the next such heading (### subsections stay inside)."""
    parts = re.split(r"^## (.+)\n", text, flags=re.M)
    return {heading: body.strip() for heading, body in zip(parts[1::2], parts[2::2])}


def test_the_renderer_reads_the_cards_at_the_top_of_the_repository():
    assert Path(model_card.CARDS_DIR) == CARDS
    assert sorted(path.stem for path in CARDS.glob("*.md") if path.name != "README.md") == sorted(FAMILIES)
    assert not (Path(REPO_ROOT) / "training" / "model_cards").exists()  # one source of truth


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_card_is_a_hub_card_with_every_section(family):
    front_matter = ModelCard((CARDS / f"{family}.md").read_text(encoding="utf-8")).data  # the file as written
    assert front_matter.library_name == "transformers" and front_matter.license == "apache-2.0"
    assert front_matter.pipeline_tag == "text-generation" and "hf_spectral" in front_matter.tags

    card = render_model_card(family)
    assert card.data.to_dict() == front_matter.to_dict()
    assert "{{" not in card.text and "{%" not in card.text and "{#" not in card.text
    title, intro = re.match(r"\s*# ([^\n]+)\n(.*?)\n## ", card.text, flags=re.S).groups()
    assert title and len(intro.split()) > 50, "what the family is, below the title"
    body = sections(card.text)
    assert list(body) == SECTIONS and all(body.values())
    usage = body["How to use"]
    assert "### Without hf_spectral" in usage and "trust_remote_code=True" in usage and "import hf_spectral" in usage
    assert re.search(r"^\|.+\|$", body["Measured results"], flags=re.M), "the measured results, as a table"
    # Every result and protocol the card cites is in the repository
    cited = set(re.findall(r"`((?:results|docs|tests)/[^`]*)`", card.text))
    assert any(path.startswith("results/") for path in cited)
    for path in cited:
        assert (Path(REPO_ROOT) / path).exists(), path


def test_a_value_the_model_card_needs_but_was_not_given_is_named():
    with pytest.raises(jinja2.UndefinedError, match="summary"):
        render_model_card("ega_gpt", model_name="ega-gpt-tinyshakespeare-ega-1-causal-seed0")


def test_an_unknown_family_is_refused_naming_the_cards():
    with pytest.raises(ValueError, match=r"unknown model family 'gpt2'.*ega_gpt, chiar_former, energy_gated"):
        render_model_card("gpt2")


# ----------------------------------------------------------------------------------------------------------------
# The card each recipe writes for a trained model
# ----------------------------------------------------------------------------------------------------------------

HARDWARE = {"cpu_model": "a test CPU", "torch_threads": 1, "torch": "2"}


def ega_card(directory):
    from hf_spectral import EGAConfig, EGAForCausalLM
    from training import tinyshakespeare
    from training.common.lm_experiment import RunSpec, write_card

    model = EGAForCausalLM(EGAConfig.from_variant("EGA-1", energy_normalization="window", vocab_size=40,
                                                  hidden_size=32, num_hidden_layers=1, num_attention_heads=2))
    summary = {"val_loss": 2.25, "val_perplexity": 9.49, "val_bits_per_char": 3.246, "train_loss": 2.2,
               "generalization_gap": 0.05, "sees_future": True, "val_loss_leak_free": 2.31,
               "val_loss_same_blocks": 2.24, "leak_free_tokens": 4096, "hardware": HARDWARE,
               "command": "python -m training.tinyshakespeare --smoke"}
    write_card(str(directory), RunSpec("EGA-1", "window", 0), tinyshakespeare.PRESETS["smoke"],
               tinyshakespeare.BENCHMARK, summary, model, repo_id="someone/ega")
    return summary


def chiar_card(directory):
    from hf_spectral.models.chiar_former import ChiarConfig, ChiarForSequenceClassification
    from training import imdb
    from training.common.chiar_experiment import TaskData, parse_arm, write_card

    model = ChiarForSequenceClassification(ChiarConfig(
        vocab_size=40, hidden_size=32, num_attention_heads=2, num_hidden_layers=3, num_labels=2,
        routed_operators=["dct", "attention"], router_type="threshold"))
    data = TaskData(datasets={}, tokenizer=None, collator=None, info={"tokenizer": "BPE, 512 ids"})
    summary = {"validation_accuracy": 0.61, "test_accuracy": 0.6, "test_examples": 1000, "seconds_per_step": 0.2,
               "hardware": HARDWARE, "command": "python -m training.imdb --smoke"}
    write_card(str(directory), parse_arm("threshold"), imdb.PRESETS["smoke"], imdb.TASK, summary, model, data,
               repo_id="someone/chiar")
    return summary


def retrofit_card(directory):
    from training import retrofit_gpt2

    args = retrofit_gpt2.build_parser().parse_args(["--smoke"])
    summary = {"val_loss": 2.5, "train_loss": 2.4, "generalization_gap": 0.1, "pretrain_val_loss": 3.0,
               "trainable_parameters": 2112, "total_parameters": 828992, "hardware": HARDWARE,
               "command": "python -m training.retrofit_gpt2 --smoke"}
    retrofit_gpt2.write_arm_card(str(directory), "gates", 0, retrofit_gpt2.PRESETS["smoke"], args, summary,
                                 retrofit_gpt2.gate_config_from(args), "someone/retrofit")
    return summary


RECIPE_CARDS = {"ega_gpt": (ega_card, "someone/ega"), "chiar_former": (chiar_card, "someone/chiar"),
                "energy_gated": (retrofit_card, "someone/retrofit")}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_card_a_recipe_writes_is_its_family_card_with_the_model_added(family, tmp_path):
    write, repo_id = RECIPE_CARDS[family]
    summary = write(tmp_path)
    card = ModelCard.load(tmp_path / "README.md")
    family_card = render_model_card(family)

    # Front matter: the family's, with the model's name, model index and tags added
    assert set(family_card.data.tags) <= set(card.data.tags) and card.data.license == "apache-2.0"
    assert card.data.eval_results and card.data.model_name in card.text.splitlines()[1]
    # Body: the family's sections as they are, the model's own sections before them
    body, family_body = sections(card.text), sections(family_card.text)
    assert list(body) == ["This model"] + SECTIONS
    for heading in FAMILY_SECTIONS:
        assert body[heading] == family_body[heading], heading
    assert body["Limitations"].startswith(family_body["Limitations"]) and "**This model**" in body["Limitations"]
    assert family_card.text.split("\n## ")[0].split("\n", 2)[2].strip() in card.text  # what the family is
    assert summary["command"] in body["This model"] and "{{" not in card.text
    assert f'"{repo_id}"' in body["How to use"]
