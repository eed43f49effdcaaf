"""training/run_clm.py: one causal LM trained or fine-tuned with Trainer, from a checkpoint folder or a model type, on
local text files; energy gates, LoRA, CHIAR-Former routing; a JSON file of arguments; resume; streaming; errors."""

import json
import math
import os

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

from hf_spectral import CharTokenizer
from hf_spectral.retrofit import has_energy_gates
from tests.training.conftest import REPO_ROOT, synthetic_text
from training.run_clm import main

BLOCK = 32
# Every run: a few CPU steps, batches of 4 blocks of 32 characters, no reporting integration
QUICK = ["--block_size", str(BLOCK), "--use_cpu", "--report_to", "none", "--per_device_train_batch_size", "4",
         "--per_device_eval_batch_size", "4", "--max_eval_samples", "8", "--seed", "0"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    (folder / "train.txt").write_text(synthetic_text(20_000, seed=0), encoding="utf-8")
    (folder / "valid.txt").write_text(synthetic_text(3_000, seed=1), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def tiny_gpt2(corpus, tmp_path_factory):
    """A GPT-2 of 2 layers saved to a folder with its own character tokenizer, standing in for a Hub checkpoint."""
    folder = tmp_path_factory.mktemp("gpt2")
    tokenizer = CharTokenizer.from_text((corpus / "train.txt").read_text(), str(folder), unk_token="<unk>")
    torch.manual_seed(0)
    config = GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=len(tokenizer), bos_token_id=None,
                        eos_token_id=None)
    GPT2LMHeadModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def files(corpus):
    return ["--train_file", str(corpus / "train.txt"), "--validation_file", str(corpus / "valid.txt")]


def results(folder, name="all_results.json"):
    return json.loads((folder / name).read_text())


def validation_loss(model, tokenizer, corpus, blocks: int = 8, path=None) -> float:
    """The mean next-token loss of the first ``blocks`` blocks of the validation text (or ``path``), cut as run_clm
    cuts it."""
    ids = tokenizer((path or corpus / "valid.txt").read_text())["input_ids"][: blocks * BLOCK]
    input_ids = torch.tensor(ids).view(blocks, BLOCK)
    model.eval()
    with torch.no_grad():
        return float(model(input_ids=input_ids, labels=input_ids).loss)


def test_gates_and_lora_fine_tune_a_checkpoint_and_the_adapter_reloads_with_its_gates(tiny_gpt2, corpus, tmp_path):
    """The adapter folder holds the LoRA weights and the trained gates; PeftModel.from_pretrained on a fresh stock
    GPT-2 adds the gates back, so the reloaded model scores the validation blocks exactly as the trained one did
    (its eval_loss). Without the gates the same LoRA weights score them differently: the gates were trained."""
    from peft import PeftModel

    output = tmp_path / "out"
    assert main(["--model_name_or_path", str(tiny_gpt2), *files(corpus), "--do_train", "--do_eval",
                 "--output_dir", str(output), "--max_steps", "3", "--learning_rate", "0.05", "--add_energy_gates",
                 "--gate_layers", "1", "--lora_r", "4", *QUICK]) == 0
    names = {path.name for path in output.iterdir()}
    assert {"adapter_model.safetensors", "energy_gate_config.json", "vocab.json", "README.md", "train_results.json",
            "eval_results.json", "all_results.json", "trainer_state.json"} <= names
    assert "model.safetensors" not in names  # an adapter, not a copy of the checkpoint
    metrics = results(output)
    assert metrics["perplexity"] == pytest.approx(math.exp(metrics["eval_loss"]))
    assert {"train_loss", "eval_accuracy", "train_samples", "eval_samples"} <= set(metrics)
    assert results(output, "eval_results.json")["perplexity"] == metrics["perplexity"]

    tokenizer = AutoTokenizer.from_pretrained(output)
    reloaded = PeftModel.from_pretrained(GPT2LMHeadModel.from_pretrained(tiny_gpt2), output)
    assert has_energy_gates(reloaded.get_base_model())
    alphas = [p for n, p in reloaded.named_parameters() if n.endswith("energy_gate.modules_to_save.default.alpha")]
    assert len(alphas) == 1 and alphas[0].abs().max() > 0  # layer 1 only; trained away from the identity (α = 0)
    assert validation_loss(reloaded, tokenizer, corpus) == pytest.approx(metrics["eval_loss"], abs=1e-5)
    for alpha in alphas:  # the gates back to the identity: the LoRA weights alone
        alpha.data.zero_()
    assert validation_loss(reloaded, tokenizer, corpus) != pytest.approx(metrics["eval_loss"], abs=1e-5)
    # The adapter folder itself evaluates as a model: its base with the trained gates and LoRA weights
    assert main(["--model_name_or_path", str(output), "--validation_file", str(corpus / "valid.txt"), "--do_eval",
                 "--output_dir", str(tmp_path / "evaluated"), *QUICK]) == 0
    assert results(tmp_path / "evaluated")["eval_loss"] == pytest.approx(metrics["eval_loss"], abs=1e-5)


@pytest.mark.parametrize(
    "model_options, expected",
    [
        (["--model_type", "ega_gpt", "--variant", "EGA-2", "--config_overrides",
          "num_hidden_layers=2,hidden_size=32,num_attention_heads=2,max_position_embeddings=32,resid_pdrop=0.0"],
         {"model_type": "ega_gpt", "energy_projections": 2, "num_hidden_layers": 2, "hidden_size": 32}),
        (["--model_type", "chiar_former", "--config_overrides",
          'num_hidden_layers=3,hidden_size=32, num_attention_heads=2,layer_operators=["dct","routed","attention"]'],
         {"model_type": "chiar_former", "layer_operators": ["dct", "routed", "attention"], "hidden_size": 32}),
    ],
)
def test_trains_ega_gpt_and_chiar_former_from_a_model_type_and_config_overrides(model_options, expected, corpus,
                                                                                 tmp_path):
    output = tmp_path / "out"
    assert main([*model_options, "--tokenizer_name", "char", *files(corpus), "--do_train", "--do_eval",
                 "--output_dir", str(output), "--max_steps", "2", "--logging_steps", "1", "--calibration_batches",
                 "2", *QUICK]) == 0
    config = AutoConfig.from_pretrained(output)
    assert {key: getattr(config, key) for key in expected} == expected
    tokenizer = AutoTokenizer.from_pretrained(output)
    assert isinstance(tokenizer, CharTokenizer) and config.vocab_size == len(tokenizer)  # sized to the characters
    model = AutoModelForCausalLM.from_pretrained(output)
    metrics = results(output)
    assert validation_loss(model, tokenizer, corpus) == pytest.approx(metrics["eval_loss"], abs=1e-5)
    card = (output / "README.md").read_text()
    assert ("An EGA-GPT trained from scratch" if config.model_type == "ega_gpt"
            else "A CHIAR-Former trained from scratch") in card
    if config.model_type == "chiar_former":
        # Thresholds calibrated before training (not the default τ_mid), routing and FLOPs logged at every step
        assert config.tau_mid != AutoConfig.for_model("chiar_former").tau_mid
        history = json.loads((output / "trainer_state.json").read_text())["log_history"]
        routing = [entry for entry in history if "routing/L1/attention" in entry]
        assert [entry["step"] for entry in routing] == [1, 2]
        assert all(entry["routing/L1/dct"] + entry["routing/L1/attention"] == pytest.approx(1, abs=1e-3)
                   and 0 < entry["attention_gflops_per_seq"] < entry["total_gflops_per_seq"] for entry in routing)
        assert "routing thresholds: {\"1\": [" in card


@pytest.mark.filterwarnings("ignore:.*SEES FUTURE TOKENS")
@pytest.mark.parametrize(
    "model_options",
    [
        ["--model_type", "ega_gpt", "--variant", "EGA-1", "--config_overrides",
         "num_hidden_layers=2,hidden_size=32,num_attention_heads=2,max_position_embeddings=32,resid_pdrop=0.0,"
         "embd_pdrop=0.0,attn_pdrop=0.0,energy_normalization=window"],
        ["--model_type", "chiar_former", "--config_overrides",
         'num_hidden_layers=3,hidden_size=32,num_attention_heads=2,layer_operators=["rbf","routed","attention"],'
         'routed_operators=["dct","rbf","attention"],rbf_chunk_size=8,hidden_dropout=0.0'],
    ],
    ids=["ega_gpt-window", "chiar_former-routed"],
)
def test_padding_free_training_keeps_each_document_apart(model_options, corpus, tmp_path):
    """--padding_free: every line of the text is a document of its own (pieces of at most --block_size tokens), and
    each batch is its documents flattened into one row. The final validation loss is the mean over batches of the
    token-weighted loss of each document scored alone: no document saw another."""
    output = tmp_path / "out"
    assert main([*model_options, "--tokenizer_name", "char", *files(corpus), "--do_train", "--do_eval",
                 "--output_dir", str(output), "--max_steps", "2", "--padding_free", "--calibration_batches", "1",
                 "--leak_free_eval_batches", "1", "--train_eval_samples", "4", *QUICK]) == 0
    metrics = results(output)
    tokenizer = AutoTokenizer.from_pretrained(output)
    model = AutoModelForCausalLM.from_pretrained(output).eval()
    lines = (corpus / "valid.txt").read_text().splitlines(keepends=True)
    pieces = [ids[i : i + BLOCK] for ids in tokenizer(lines)["input_ids"] for i in range(0, len(ids), BLOCK)]
    documents = [piece for piece in pieces if len(piece) > 1][:8]  # --max_eval_samples 8
    assert metrics["eval_samples"] == 8 and max(map(len, documents)) == BLOCK and min(map(len, documents)) < BLOCK
    batch_losses = []
    with torch.no_grad():
        for start in range(0, 8, 4):
            batch = documents[start : start + 4]
            losses = [float(model(torch.tensor([doc]), labels=torch.tensor([doc])).loss) for doc in batch]
            batch_losses.append(sum(loss * (len(doc) - 1) for loss, doc in zip(losses, batch))
                                / sum(len(doc) - 1 for doc in batch))
    assert metrics["eval_loss"] == pytest.approx(sum(batch_losses) / len(batch_losses), abs=1e-5)
    assert "eval_leak_free_loss" in metrics and "eval_train_loss" in metrics


def test_window_statistics_add_a_leak_free_evaluation_and_a_warning_to_the_card(corpus, tmp_path):
    # α = 8 (the paper's 2 ×4): an untrained model's gates are then strong enough for its leak to clear the test's
    # tolerance whatever its random initialisation (at α = 2 one initialisation leaked 5e-5 nats)
    output = tmp_path / "out"
    assert main(["--model_type", "ega_gpt", "--config_overrides", "num_hidden_layers=1,hidden_size=32,"
                 "num_attention_heads=2,max_position_embeddings=32,energy_normalization=window,gate_alpha_init=8",
                 "--tokenizer_name", "char", *files(corpus), "--do_eval", "--output_dir", str(output),
                 "--leak_free_eval_batches", "1", *QUICK]) == 0
    metrics = results(output, "eval_results.json")
    assert metrics["eval_leak_free_perplexity"] == pytest.approx(math.exp(metrics["eval_leak_free_loss"]))
    assert metrics["eval_leak_free_loss"] != pytest.approx(metrics["eval_leaky_loss"], abs=1e-4)  # the gates leak
    assert "this model sees future tokens" in (output / "README.md").read_text()


def test_a_json_file_of_arguments_with_options_after_it_overriding_it(tiny_gpt2, corpus, tmp_path):
    arguments = {"model_name_or_path": str(tiny_gpt2), "train_file": str(corpus / "train.txt"), "do_train": True,
                 "output_dir": str(tmp_path / "out"), "max_steps": 3, "learning_rate": 0.01, "block_size": BLOCK,
                 "use_cpu": True, "report_to": "none", "per_device_train_batch_size": 4}
    (tmp_path / "args.json").write_text(json.dumps(arguments))
    assert main([str(tmp_path / "args.json"), "--max_steps", "2"]) == 0
    state = json.loads((tmp_path / "out" / "trainer_state.json").read_text())
    assert state["global_step"] == state["max_steps"] == 2
    assert torch.load(tmp_path / "out" / "training_args.bin", weights_only=False).learning_rate == 0.01
    (tmp_path / "bad.json").write_text(json.dumps({**arguments, "learning_rat": 0.1}))
    assert main([str(tmp_path / "bad.json")]) == 2


def test_a_benchmark_configuration_runs_with_options_after_it_overriding_it(corpus, tmp_path):
    output = tmp_path / "out"
    config_file = os.path.join(REPO_ROOT, "training", "configs", "tinyshakespeare_smoke.json")
    assert main([config_file, "--variant", "EGA-1", *files(corpus),
                 "--output_dir", str(output), "--max_steps", "4", "--eval_steps", "2", "--save_steps", "4"]) == 0
    config = AutoConfig.from_pretrained(output)  # the configuration's model, the option's variant
    assert (config.model_type, config.hidden_size, config.num_hidden_layers, config.gated_layers) == (
        "ega_gpt", 32, 2, [0, 1])
    state = json.loads((output / "trainer_state.json").read_text())
    assert state["max_steps"] == 4 and [entry["step"] for entry in state["log_history"] if "eval_loss" in entry] == [
        2, 4]
    metrics = results(output)
    assert {"eval_train_loss", "eval_generalization_gap", "eval_leak_free_loss"} <= set(metrics)


def test_the_curve_reads_the_first_examples_the_end_scores_all_the_training_gap_and_the_test_split(
        tiny_gpt2, corpus, tmp_path):
    output = tmp_path / "out"
    assert main(["--model_name_or_path", str(tiny_gpt2), *files(corpus), "--test_file", str(corpus / "valid.txt"),
                 "--do_train", "--do_eval", "--do_predict", "--output_dir", str(output), "--max_steps", "2",
                 "--eval_strategy", "steps", "--eval_steps", "2", "--eval_samples_during_training", "4",
                 "--train_eval_samples", "8", "--leak_free_eval_batches", "1", *QUICK]) == 0
    metrics = results(output)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(output), AutoTokenizer.from_pretrained(output)
    curve = [entry["eval_loss"] for entry in json.loads((output / "trainer_state.json").read_text())["log_history"]
             if "eval_loss" in entry]
    assert curve == [pytest.approx(validation_loss(model, tokenizer, corpus, blocks=4), abs=1e-5)]
    assert metrics["eval_loss"] == pytest.approx(validation_loss(model, tokenizer, corpus, blocks=8), abs=1e-5)
    assert metrics["eval_samples"] == 8 and metrics["eval_loss"] != pytest.approx(curve[0], abs=1e-5)
    train = corpus / "train.txt"
    assert metrics["eval_train_loss"] == pytest.approx(validation_loss(model, tokenizer, corpus, 8, train), abs=1e-5)
    assert metrics["eval_generalization_gap"] == pytest.approx(metrics["eval_loss"] - metrics["eval_train_loss"])
    assert metrics["test_loss"] == pytest.approx(metrics["eval_loss"]) and metrics["test_samples"] == 8
    assert metrics["test_perplexity"] == pytest.approx(math.exp(metrics["test_loss"]))
    assert results(output, "test_results.json")["test_loss"] == metrics["test_loss"]
    # A model that sees no future token: its leak-free loss is its loss on the first batch
    assert metrics["eval_leak_free_loss"] == metrics["eval_leaky_loss"] == pytest.approx(
        validation_loss(model, tokenizer, corpus, blocks=4), abs=1e-5)


def test_gates_alone_train_and_are_logged_and_saved_alone(tiny_gpt2, corpus, tmp_path):
    from hf_spectral.retrofit import load_energy_gates

    output = tmp_path / "out"
    assert main(["--model_name_or_path", str(tiny_gpt2), *files(corpus), "--do_train", "--output_dir", str(output),
                 "--max_steps", "3", "--learning_rate", "0.05", "--add_energy_gates", "--train_only_gates",
                 "--logging_steps", "1", *QUICK]) == 0
    history = json.loads((output / "trainer_state.json").read_text())["log_history"]
    logged = [entry for entry in history if "gates/L1/H3/tau" in entry]
    assert [entry["step"] for entry in logged] == [1, 2, 3]
    assert 0 < logged[0]["train_seconds"] < logged[-1]["train_seconds"]
    assert logged[-1]["gates/L0/H0/alpha"] != 0  # the gates moved from the identity (α = 0)
    trained = AutoModelForCausalLM.from_pretrained(output)
    assert results(output)["trainable_parameters"] == sum(
        p.numel() for name, p in trained.named_parameters() if ".energy_gate." in name)
    rebuilt = GPT2LMHeadModel.from_pretrained(tiny_gpt2)
    load_energy_gates(rebuilt, str(output / "energy_gates.safetensors"))
    ids = torch.randint(0, rebuilt.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(rebuilt.eval()(ids).logits, trained.eval()(ids).logits, atol=1e-6)


def test_resuming_from_a_checkpoint_continues_the_run_that_was_never_interrupted(tiny_gpt2, corpus, tmp_path):
    common = ["--model_name_or_path", str(tiny_gpt2), *files(corpus), "--do_train", "--learning_rate", "0.01",
              "--lr_scheduler_type", "constant", "--save_steps", "2", *QUICK]
    assert main([*common, "--output_dir", str(tmp_path / "whole"), "--max_steps", "4"]) == 0
    assert main([*common, "--output_dir", str(tmp_path / "part"), "--max_steps", "2"]) == 0
    assert main([*common, "--output_dir", str(tmp_path / "part"), "--max_steps", "4",
                 "--resume_from_checkpoint", str(tmp_path / "part" / "checkpoint-2")]) == 0
    whole = AutoModelForCausalLM.from_pretrained(tmp_path / "whole").state_dict()
    resumed = AutoModelForCausalLM.from_pretrained(tmp_path / "part").state_dict()
    assert all(torch.allclose(whole[name], resumed[name], atol=1e-6) for name in whole)
    first = AutoModelForCausalLM.from_pretrained(tmp_path / "part" / "checkpoint-2").state_dict()
    assert not all(torch.allclose(first[name], resumed[name], atol=1e-6) for name in first)  # it did train on
    assert json.loads((tmp_path / "part" / "trainer_state.json").read_text())["global_step"] == 4


def test_streaming_a_text_file(tiny_gpt2, corpus, tmp_path):
    output = tmp_path / "out"
    assert main(["--model_name_or_path", str(tiny_gpt2), *files(corpus), "--streaming", "--do_train", "--do_eval",
                 "--output_dir", str(output), "--max_steps", "2", *QUICK]) == 0
    metrics = results(output)
    assert metrics["perplexity"] == pytest.approx(math.exp(metrics["eval_loss"]))
    model = AutoModelForCausalLM.from_pretrained(output)
    assert validation_loss(model, AutoTokenizer.from_pretrained(output), corpus) == pytest.approx(
        metrics["eval_loss"], abs=1e-5)  # the same first 8 blocks as a run that does not stream
    assert main(["--model_name_or_path", str(tiny_gpt2), "--train_file", str(corpus / "train.txt"), "--streaming",
                 "--do_train", "--output_dir", str(tmp_path / "epochs"), *QUICK]) == 2  # no --max_steps


def test_position_buckets_split_the_predictions_of_a_block_as_evenly_as_they_can():
    from training.run_clm import position_buckets

    assert position_buckets(128, 8) == [(1, 15)] + [(16 * k, 16 * k + 15) for k in range(1, 7)] + [(112, 127)]
    assert position_buckets(64, 4) == position_buckets(128, 8)[:3] + [(48, 63)]  # the same positions at any context
    buckets = position_buckets(10, 6)  # 9 predictions in 6 buckets: none empty, none overlapping, all covered
    assert [last - first + 1 for first, last in buckets] == [1, 2, 1, 2, 1, 2]
    assert [p for first, last in buckets for p in range(first, last + 1)] == list(range(1, 10))
    assert position_buckets(32, 31) == [(t, t) for t in range(1, 32)]


def test_the_loss_per_position_in_the_block_is_scored_in_the_evaluation_loop(corpus, tmp_path):
    """--position_loss_buckets 4 at block 32: the mean loss of the predictions of positions 1-7, 8-15, 16-23, 24-31
    of the validation blocks, as the saved model gives them token by token; their mean weighted by the predictions
    is the evaluation loss. The evaluations during training report them too."""
    output = tmp_path / "out"
    assert main(["--model_type", "ega_gpt", "--variant", "EGA-1", "--config_overrides",
                 "num_hidden_layers=2,hidden_size=32,num_attention_heads=2,max_position_embeddings=32",
                 "--tokenizer_name", "char", *files(corpus), "--do_train", "--do_eval", "--max_steps", "4",
                 "--learning_rate", "0.01", "--eval_strategy", "steps", "--eval_steps", "2", "--position_loss_buckets",
                 "4", "--output_dir", str(output), *QUICK]) == 0
    metrics = results(output)
    keys = sorted(key for key in metrics if key.startswith("eval_position_loss_"))
    assert keys == [f"eval_position_loss_{span}" for span in ("01-07", "08-15", "16-23", "24-31")]
    model, tokenizer = AutoModelForCausalLM.from_pretrained(output).eval(), AutoTokenizer.from_pretrained(output)
    ids = torch.tensor(tokenizer((corpus / "valid.txt").read_text())["input_ids"][: 8 * BLOCK]).view(8, BLOCK)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    losses = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
    for key, (first, last) in zip(keys, [(1, 7), (8, 15), (16, 23), (24, 31)]):
        assert metrics[key] == pytest.approx(float(losses[:, first - 1:last].mean()), abs=1e-5), key
    assert len({round(metrics[key], 4) for key in keys}) == 4  # trained: the positions differ
    weighted = sum(metrics[key] * count for key, count in zip(keys, (7, 8, 8, 8))) / 31
    assert weighted == pytest.approx(metrics["eval_loss"], abs=1e-5)
    history = json.loads((output / "trainer_state.json").read_text())["log_history"]
    assert [entry["step"] for entry in history if "eval_position_loss_24-31" in entry] == [2, 4]


@pytest.mark.parametrize(
    "options, message",
    [
        (["--model_type", "transformer_xxl", "--tokenizer_name", "char"], "unknown --model_type 'transformer_xxl'"),
        (["--model_type", "gpt2", "--tokenizer_name", "char", "--position_loss_buckets", "32"],
         "--position_loss_buckets 32: a block of 32 tokens has 31 predictions; give at most that many buckets"),
        (["--model_type", "gpt2", "--tokenizer_name", "char", "--position_loss_buckets", "0"],
         "--position_loss_buckets must be positive, got 0"),
        (["--model_type", "gpt2", "--tokenizer_name", "char", "--position_loss_buckets", "4", "--padding_free"],
         "--position_loss_buckets with --padding_free: a flattened batch is one row of several documents"),
        (["--model_type", "ega_gpt", "--tokenizer_name", "char", "--add_energy_gates", "--config_overrides",
          "num_hidden_layers=1,hidden_size=16,num_attention_heads=2"],
         "--add_energy_gates: energy gates cannot be added to EGAForCausalLM"),
        (["--model_type", "gpt2", "--tokenizer_name", "char", "--config_overrides", "n_layers=2"],
         "'n_layers' is not a field of GPT2Config"),
        (["--model_name_or_path", "GPT2", "--train_file", "/nonexistent/train.txt"],
         "--train_file /nonexistent/train.txt: no such file"),
        (["--model_type", "gpt2", "--tokenizer_name", "char", "--text_column_name", "body"],
         "--text_column_name 'body' is not a column of the data; its columns are text"),
        (["--model_type", "gpt2", "--tokenizer_name", "char", "--gate_layers", "0"],
         "--gate_layers configures added gates: use it with --add_energy_gates"),
        (["--model_type", "gpt2", "--tokenizer_name", "char", "--lora_r", "4"], "--lora_r adapts a pretrained"),
        (["--model_type", "gpt2", "--tokenizer_name", "char", "--learnin_rate", "1"],
         "unrecognized arguments: --learnin_rate 1"),
        (["--model_name_or_path", "GPT2", "--add_energy_gates", "--gate_normalization", "sideways"],
         "argument --gate_normalization/--gate-normalization: invalid choice: 'sideways'"),
        (["--model_type", "gpt2", "--tokenizer_name", "char", "--train_eval_samples", "4"],
         "--train_eval_samples is reported with the evaluation: add --do_eval"),
        (["--model_type", "gpt2", "--tokenizer_name", "char", "--do_predict"],
         "--do_predict needs a test split (--test_file, or a dataset that has one)"),
        (["--model_type", "gpt2", "--tokenizer_name", "char", "--eval_samples_during_training", "0"],
         "--eval_samples_during_training must be at least 1, got 0"),
    ],
)
def test_bad_arguments_end_with_a_one_line_error(options, message, corpus, tmp_path, capsys):
    output = tmp_path / "out"
    train = [] if "--train_file" in options else ["--train_file", str(corpus / "train.txt")]
    assert main([*options, *train, "--do_train", "--output_dir", str(output), *QUICK]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("python -m training.run_clm: error: "), errors
    assert message in errors[0]
    assert not output.exists()
