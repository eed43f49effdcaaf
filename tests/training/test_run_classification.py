"""training/run_classification.py: one sequence classifier trained with Trainer on a CSV file, from a model type or a
checkpoint folder, with accuracy (and accuracy per ListOps nesting depth), gates + LoRA, and one-line errors."""

import csv
import json
import random

import pytest
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, GPT2Config, GPT2LMHeadModel

from hf_spectral import CharTokenizer
from hf_spectral.retrofit import has_energy_gates
from tests.training.conftest import WORDS
from training.run_classification import main

QUICK = ["--use_cpu", "--report_to", "none", "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "8",
         "--seed", "0", "--max_seq_length", "48"]
CHIAR = ["--model_type", "chiar_former", "--tokenizer_name", "char", "--config_overrides",
         'num_hidden_layers=3,hidden_size=32,num_attention_heads=2,is_causal=false,layer_operators=["dct","routed",'
         '"attention"]']


def write_csv(path, rows: int, seed: int):
    """Sentences labelled by the king (`royal`), the duke (`noble`) or neither (`common`), with a depth column."""
    rng = random.Random(seed)
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["sentence", "label", "depth"])
        for index in range(rows):
            sentence = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 9)))
            label = "royal" if "king" in sentence else "noble" if "duke" in sentence else "common"
            writer.writerow([sentence, label, index % 3])
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    return write_csv(folder / "train.csv", 160, seed=0), write_csv(folder / "dev.csv", 40, seed=1)


def files(data):
    return ["--train_file", str(data[0]), "--validation_file", str(data[1])]


def results(folder, name="all_results.json"):
    return json.loads((folder / name).read_text())


def test_trains_chiar_former_on_a_csv_file_with_accuracy_per_depth(data, tmp_path):
    output = tmp_path / "out"
    assert main([*CHIAR, *files(data), "--test_file", str(data[1]), "--do_train", "--do_eval", "--do_predict",
                 "--output_dir", str(output), "--max_steps", "3", "--logging_steps", "1", "--calibration_batches", "2",
                 *QUICK]) == 0
    metrics = results(output)
    # Accuracy overall is the example-weighted mean of the accuracies per depth (each depth holds ~1/3 of dev.csv)
    depths = [int(row["depth"]) for row in csv.DictReader(open(data[1], encoding="utf-8"))]
    for split in ("eval", "test"):  # the test split is dev.csv again: the same numbers
        per_depth = sum(metrics[f"{split}_accuracy_depth_{d}"] * depths.count(d) for d in set(depths)) / len(depths)
        assert metrics[f"{split}_accuracy"] == pytest.approx(per_depth) == pytest.approx(metrics["eval_accuracy"])
    assert metrics["test_samples"] == 40 and results(output, "test_results.json")["test_loss"] == pytest.approx(
        metrics["eval_loss"])
    assert metrics["eval_samples"] == 40 and metrics["train_samples"] == 160
    config = AutoConfig.from_pretrained(output)
    assert config.id2label == {0: "common", 1: "noble", 2: "royal"} and not config.is_causal
    model = AutoModelForSequenceClassification.from_pretrained(output)
    tokenizer = AutoTokenizer.from_pretrained(output)
    assert isinstance(tokenizer, CharTokenizer) and config.pad_token_id == tokenizer.pad_token_id is not None
    # The saved classifier scores dev.csv as the trained one did
    rows = list(csv.DictReader(open(data[1], encoding="utf-8")))
    batch = tokenizer([row["sentence"] for row in rows], truncation=True, max_length=48, padding=True,
                      return_tensors="pt")
    model.eval()
    with torch.no_grad():
        predictions = model(**batch).logits.argmax(-1)
    labels = torch.tensor([config.label2id[row["label"]] for row in rows])
    assert float((predictions == labels).float().mean()) == pytest.approx(metrics["eval_accuracy"])
    history = json.loads((output / "trainer_state.json").read_text())["log_history"]
    assert [entry["step"] for entry in history if "routing/L1/attention" in entry] == [1, 2, 3]
    assert "AutoModelForSequenceClassification" in (output / "README.md").read_text()


def test_fine_tunes_a_language_model_checkpoint_as_a_classifier_with_gates_and_lora(data, tmp_path):
    """A GPT-2 language model gets a new classification head; its gates and LoRA weights train, and the adapter
    (gates and head included) reloads through PeftModel on a fresh stock GPT2ForSequenceClassification."""
    from peft import PeftModel
    from transformers import GPT2ForSequenceClassification

    checkpoint = tmp_path / "gpt2"
    text = " ".join(WORDS)
    # As GPT-2's tokenizer: an end-of-text token and no padding token (the recipe pads with the end-of-text one)
    tokenizer = CharTokenizer.from_text(text, str(checkpoint), unk_token="<unk>", eos_token="<eos>", pad_token=None)
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=len(tokenizer),
                               bos_token_id=None, eos_token_id=None)).save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    output = tmp_path / "out"
    assert main(["--model_name_or_path", str(checkpoint), *files(data), "--text_column_name", "sentence",
                 "--do_train", "--do_eval", "--output_dir", str(output), "--max_steps", "3", "--learning_rate", "0.05",
                 "--add_energy_gates", "--lora_r", "4", *QUICK]) == 0
    metrics = results(output)
    config = AutoConfig.from_pretrained(checkpoint, num_labels=3, pad_token_id=tokenizer.eos_token_id)
    base = GPT2ForSequenceClassification.from_pretrained(checkpoint, config=config)
    model = PeftModel.from_pretrained(base, output)
    assert has_energy_gates(model.get_base_model())
    rows = list(csv.DictReader(open(data[1], encoding="utf-8")))
    tokenizer = AutoTokenizer.from_pretrained(output)
    batch = tokenizer([row["sentence"] for row in rows], truncation=True, max_length=48, padding=True,
                      return_tensors="pt")
    labels = torch.tensor([["common", "noble", "royal"].index(row["label"]) for row in rows])
    model.eval()
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(model(**batch).logits, labels)
    assert float(loss) == pytest.approx(metrics["eval_loss"], abs=1e-5)


@pytest.mark.parametrize(
    "options, message",
    [
        (["--label_column_name", "class"], "--label_column_name 'class' is not a column of the data"),
        (["--text_column_name", "body"], "--text_column_name 'body' is not a column of the data"),
        (["--label_column_name", "depth", "--train_file", "{real}"], "holds real numbers"),
        (["--train_file", "/nonexistent/train.csv"], "--train_file /nonexistent/train.csv: no such file"),
        (["--train_file", "{txt}"], "the extension must be one of csv, json, jsonl"),
    ],
)
def test_bad_arguments_end_with_a_one_line_error(options, message, data, tmp_path, capsys):
    real = tmp_path / "real.csv"
    real.write_text("sentence,label,depth\nthe king,royal,0.5\nthe duke,noble,1.5\n")
    (tmp_path / "train.txt").write_text("the king\n")
    options = [option.format(real=real, txt=tmp_path / "train.txt") for option in options]
    train = [] if "--train_file" in options else ["--train_file", str(data[0])]
    output = tmp_path / "out"
    assert main([*CHIAR, *train, *options, "--do_train", "--output_dir", str(output), *QUICK]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("python -m training.run_classification: error: "), errors
    assert message in errors[0]
    assert not output.exists()


def test_an_rmt_optimal_pooling_head_is_fitted_on_the_first_training_batches(data, tmp_path):
    output = tmp_path / "out"
    pooling = CHIAR[:5] + [CHIAR[5] + ",classifier_pooling=rmt_optimal"]
    assert main([*pooling, *files(data), "--do_train", "--do_eval", "--output_dir", str(output), "--max_steps", "2",
                 "--calibration_batches", "2", *QUICK]) == 0
    model = AutoModelForSequenceClassification.from_pretrained(output)
    assert model.config.classifier_pooling == "rmt_optimal" and model.pooling.is_fitted
