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

def write_card(directory, model, model_args, task="text-generation", data_class=None):
    """The card run_clm (run_classification) writes for ``model`` trained in ``directory``, with a few results."""
    from transformers import TrainingArguments

    from hf_spectral import CharTokenizer
    from training.common.run_scripts import SpectralArguments, SpectralTrainer, write_model_card
    from training.run_clm import DataTrainingArguments

    (directory / "train.txt").write_text("to be or not to be\n")
    data_args = (data_class or DataTrainingArguments)(train_file=str(directory / "train.txt"))
    repo_id = f"someone/{model.config.model_type}"
    trainer = SpectralTrainer(model=model, args=TrainingArguments(output_dir=str(directory), hub_model_id=repo_id,
                                                                  report_to=[]), spectral_args=SpectralArguments())
    tokenizer = CharTokenizer.from_text("abcdefgh ", str(directory / "tokenizer"))
    metrics = {"eval_loss": 2.25, "perplexity": 9.49, "test_loss": 2.3, "train_runtime": 60.0}
    write_model_card(trainer, model_args, data_args, metrics, script="run_clm", task=task, tokenizer=tokenizer)
    return repo_id


def ega_card(directory):
    from hf_spectral import EGAConfig, EGAForCausalLM
    from training.common.run_scripts import ModelArguments

    model = EGAForCausalLM(EGAConfig.from_variant("EGA-1", energy_normalization="window", vocab_size=40,
                                                  hidden_size=32, num_hidden_layers=1, num_attention_heads=2))
    return write_card(directory, model, ModelArguments(model_type="ega_gpt", variant="EGA-1"))


def chiar_card(directory):
    from hf_spectral.models.chiar_former import ChiarConfig, ChiarForSequenceClassification
    from training.common.run_scripts import ModelArguments
    from training.run_classification import DataTrainingArguments

    model = ChiarForSequenceClassification(ChiarConfig(
        vocab_size=40, hidden_size=32, num_attention_heads=2, num_hidden_layers=3, num_labels=2,
        routed_operators=["dct", "attention"], router_type="threshold"))
    (directory / "train.csv").write_text("text,label\na,0\n")
    return write_card(directory, model, ModelArguments(model_type="chiar_former"), task="text-classification",
                      data_class=lambda train_file: DataTrainingArguments(train_file=str(directory / "train.csv")))


def retrofit_card(directory):
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_spectral.retrofit import EnergyGateConfig, add_energy_gates, mark_only_gates_trainable
    from training.common.run_scripts import ModelArguments

    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=40, n_positions=32,
                                       bos_token_id=None, eos_token_id=None))
    add_energy_gates(model, EnergyGateConfig())
    mark_only_gates_trainable(model)
    return write_card(directory, model, ModelArguments(model_name_or_path="path/to/gpt2"))


RECIPE_CARDS = {"ega_gpt": ega_card, "chiar_former": chiar_card, "energy_gated": retrofit_card}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_card_a_recipe_writes_is_its_family_card_with_the_model_added(family, tmp_path):
    from training.results import current_command

    repo_id = RECIPE_CARDS[family](tmp_path)
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
    assert current_command() in body["This model"] and "{{" not in card.text
    assert f'"{repo_id}"' in body["How to use"]
