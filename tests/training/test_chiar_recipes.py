"""The CHIAR-Former recipes end to end at smoke size (WikiText, IMDB, ListOps), resume, the BPE tokenizer and the
command line (TrainingArguments pass-through)."""

import gzip
import json
import os
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file

import hf_spectral  # noqa: F401  (registers CHIAR-Former with the Auto classes)
from training import imdb, listops, wikitext
from training.common.bpe import train_bpe_tokenizer
from training.common.chiar_experiment import EXIT_INTERRUPTED_CODE, parse_training_overrides

from .conftest import REPO_ROOT, WORDS, recipe_environment, torchrun_two_cpu_processes

THREADS = ["--threads", "2"]


def _wikitext_folder(folder, seed=0):
    """WikiText-like splits in the official layout: headings, paragraphs, <unk>, one paragraph per line."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for name, lines in (("wiki.train.tokens", 400), ("wiki.valid.tokens", 60), ("wiki.test.tokens", 60)):
        text = []
        for index in range(lines):
            if index % 20 == 0:
                text.append(f" = {rng.choice(WORDS).capitalize()} {rng.choice(WORDS)} = \n \n")
            text.append(" " + " ".join(rng.choice(WORDS + ["<unk>", "@-@", ","]) for _ in range(rng.randint(8, 30)))
                        + " . \n")
        (folder / name).write_text("".join(text), encoding="utf-8")
    return folder


def _summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def wikitext_run(tmp_path_factory):
    data = _wikitext_folder(tmp_path_factory.mktemp("wikitext"))
    out = tmp_path_factory.mktemp("wikitext_out")
    code = wikitext.main(["--smoke", "--data_path", str(data), "--output_dir", str(out), "--arms", "attention",
                          "threshold", *THREADS, "--dataloader_num_workers", "0"])  # (a TrainingArguments field)
    return {"code": code, "out": out, "data": data}


def test_wikitext_smoke_writes_models_tokenizer_card_results_and_figures(wikitext_run):
    out = wikitext_run["out"]
    assert wikitext_run["code"] == 0
    for run in ("attention-seed0", "threshold-seed0"):
        for name in ("model.safetensors", "config.json", "tokenizer.json", "README.md", "summary.json",
                     "learning_curve.png", "routing_log.jsonl"):
            assert (out / run / name).is_file(), f"{run}/{name} missing"
        assert not list((out / run).glob("checkpoint-*"))
    for name in ("entropy_histograms.png", "routing_fractions.png", "routing_map.png"):
        assert (out / "threshold-seed0" / name).stat().st_size > 5000
    assert json.loads((out / "threshold-seed0" / "calibration.json").read_text())["history"][0]["step"] == 0
    results = json.loads((out / "results.json").read_text())
    assert [row["arm"] for row in results["rows"]] == ["attention", "threshold"]
    assert results["hardware"]["cpu_count"] and results["seeds"] == [0] and results["command"].startswith("python")
    assert results["config"]["training_overrides"] == {"dataloader_num_workers": "0"}
    card = (out / "threshold-seed0" / "README.md").read_text()
    assert "chiar-former" in card and "per word" in card.replace("_", " ")
    from huggingface_hub import ModelCard

    summary = _summary(out / "threshold-seed0")
    indexed = {r.metric_name: r for r in ModelCard.load(out / "threshold-seed0" / "README.md").data.eval_results}
    assert indexed["test perplexity per word"].metric_type == "perplexity"
    assert indexed["test perplexity per word"].dataset_split == "test"
    bits_per_char = round(summary["validation_bits_per_char"], 4)
    assert indexed["validation bits per char"].metric_value == pytest.approx(bits_per_char)
    assert {r.metric_type for r in indexed.values()} <= {"loss", "perplexity", "bits_per_char", "accuracy"}
    assert "validation blocks" not in indexed and "validation blocks" in card  # a count: in the table only


def test_wikitext_summary_reports_perplexities_routing_flops_and_step_times(wikitext_run):
    base, routed = (_summary(wikitext_run["out"] / run) for run in ("attention-seed0", "threshold-seed0"))
    # the smoke preset scores at most final_eval_batches of each split, and the results say so
    notes = (wikitext_run["out"] / "results.md").read_text()
    assert "at most 3 batches (12 blocks), not necessarily the whole split" in notes
    for summary in (base, routed):
        for split in ("validation", "test"):
            loss = summary[f"{split}_loss"]
            assert summary[f"{split}_perplexity"] == pytest.approx(torch.tensor(loss).exp().item(), rel=1e-6)
            # per word = exp(total NLL / words): words are fewer than BPE tokens here, so it is larger.
            tokens, words = summary["data"]["tokens"][split], summary["data"]["words"][split]
            assert summary[f"{split}_perplexity_per_word"] == pytest.approx(
                torch.tensor(loss * (tokens - 1) / words).exp().item(), rel=1e-6)
        assert summary["seconds_per_step"] > 0 and summary["train_seconds"] > 0
    assert base["routing"]["fractions"] == {} and routed["routing"]["attention_gflops_per_seq"] < \
        base["routing"]["attention_gflops_per_seq"]
    fractions = routed["routing"]["fractions"]["1"]
    assert set(fractions) == {"dct", "attention"} and sum(fractions.values()) == pytest.approx(1.0)
    # The calibrated threshold is what the saved model routes with.
    config = json.loads((wikitext_run["out"] / "threshold-seed0" / "config.json").read_text())
    saved = config["layer_thresholds"][1] if config["layer_thresholds"] else [config["tau_mid"]]
    assert saved == routed["thresholds"]["1"] == routed["calibration"][0]["thresholds"]["1"]
    logged = [json.loads(line) for line in (wikitext_run["out"] / "threshold-seed0" / "routing_log.jsonl").open()]
    assert logged and all(abs(r["routing/L1/dct"] + r["routing/L1/attention"] - 1) < 1e-3 for r in logged)
    assert all(r["attention_gflops_per_seq"] > 0 for r in logged)
    history = [e for e in routed["log_history"] if "eval_validation_curve_loss" in e]
    assert history and all("train_seconds" in e for e in history)


def test_saved_wikitext_model_and_tokenizer_load_with_auto_classes(wikitext_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir = wikitext_run["out"] / "threshold-seed0"
    model = AutoModelForCausalLM.from_pretrained(run_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(run_dir)
    ids = tokenizer(" = The king = \n the duke of york", return_tensors="pt")["input_ids"]
    assert tokenizer.decode(ids[0]) == " = The king = \n the duke of york"
    weights = load_file(str(run_dir / "model.safetensors"))
    assert torch.equal(model.model.embed_tokens.weight, weights["model.embed_tokens.weight"])
    assert model(input_ids=ids).logits.shape == (1, ids.shape[1], len(tokenizer))


def test_a_finished_run_is_reused_under_options_without_effect(wikitext_run, capsys, tmp_path):
    """The preset's BPE size given explicitly, a TrainingArguments field that only changes the display, the data
    loader's workers: the same runs (they had been refused as made with other settings)."""
    out = shutil.copytree(wikitext_run["out"], tmp_path / "copy")  # the rerun rewrites its records: not the shared ones
    assert wikitext.main(["--smoke", "--data_path", str(wikitext_run["data"]), "--output_dir", str(out),
                          "--arms", "attention", "threshold", *THREADS, "--bpe_vocab_size", "512",
                          "--disable_tqdm", "true", "--dataloader_num_workers", "1", "--no_plots"]) == 0
    assert capsys.readouterr().out.count("complete already") == 2


def test_the_wikitext_task_follows_the_parsed_corpus_option(monkeypatch):
    """Not the strings in argv: --corpus=wikitext-103 is WikiText-103, an --output_dir named wikitext-103 is not."""
    monkeypatch.setattr(wikitext, "run_recipe", lambda argv, task, description: task.title)
    assert wikitext.main(["--smoke", "--corpus=wikitext-103"]) == "WikiText-103"
    assert wikitext.main(["--smoke", "--corp", "wikitext-103"]) == "WikiText-103"
    assert wikitext.main(["--smoke", "--output_dir", "wikitext-103"]) == "WikiText-2"


def test_wikitext_evaluates_a_saved_model_on_a_folder_with_only_the_test_split(wikitext_run, tmp_path, capsys):
    only_test = tmp_path / "only_test"
    only_test.mkdir()
    (only_test / "wiki.test.tokens").write_text((wikitext_run["data"] / "wiki.test.tokens").read_text())
    run_dir = wikitext_run["out"] / "threshold-seed0"
    assert wikitext.main([f"--evaluate_model={run_dir}", "--data_path", str(only_test),  # (the = form too)
                          "--output_dir", str(tmp_path / "eval"), "--final_eval_batches", "3", "--batch_size", "4",
                          *THREADS]) == 0
    found = json.loads((tmp_path / "eval" / "evaluation.json").read_text())
    assert "validation_loss" not in found
    # The same model on the same split gives the training run's own test perplexity.
    assert found["test_perplexity_per_word"] == pytest.approx(_summary(run_dir)["test_perplexity_per_word"], rel=1e-4)
    # Training from such a folder is refused with a message naming what is missing.
    assert wikitext.main(["--smoke", "--data_path", str(only_test), "--output_dir", str(tmp_path / "x"), *THREADS]) == 2
    assert "training needs the train and validation split(s)" in capsys.readouterr().err


def test_interrupted_routed_run_resumes_with_its_thresholds_and_ends_with_the_same_weights(wikitext_run, tmp_path):
    args = ["--smoke", "--data_path", str(wikitext_run["data"]), "--output_dir", str(tmp_path), "--arms",
            "threshold", *THREADS]
    shutil.copytree(wikitext_run["out"] / "tokenizer", tmp_path / "tokenizer")  # the same BPE, not retrained
    assert wikitext.main(args + ["--stop_after_steps", "3"]) == EXIT_INTERRUPTED_CODE
    run_dir = tmp_path / "threshold-seed0"
    assert list(run_dir.glob("checkpoint-3")) and not (run_dir / "summary.json").exists()
    assert wikitext.main(args) == 0
    resumed, uninterrupted = _summary(run_dir), _summary(wikitext_run["out"] / "threshold-seed0")
    assert resumed["resumed_from"] == "checkpoint-3"
    assert resumed["thresholds"] == uninterrupted["thresholds"]
    # the saved configs agree too: one shared threshold in tau_mid, as calibration left it (not per layer)
    saved = [json.loads((folder / "config.json").read_text())
             for folder in (run_dir, wikitext_run["out"] / "threshold-seed0")]
    assert [(c["tau_mid"], c["layer_thresholds"]) for c in saved] == [(saved[1]["tau_mid"], None)] * 2
    a = load_file(str(run_dir / "model.safetensors"))
    b = load_file(str(wikitext_run["out"] / "threshold-seed0" / "model.safetensors"))
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-5)


def test_imdb_smoke_trains_a_bidirectional_hard_routed_encoder(tmp_path):
    rng = random.Random(0)
    data = tmp_path / "imdb"
    data.mkdir()
    good, bad = ["great", "wonderful", "loved"], ["awful", "boring", "hated"]
    for split, count in (("train", 200), ("test", 90)):
        with gzip.open(data / f"{split}.jsonl.gz", "wt", encoding="utf-8") as handle:
            for index in range(count):
                label = index % 2
                words = [rng.choice(WORDS) for _ in range(rng.randint(5, 40))] + [rng.choice(good if label else bad)]
                handle.write(json.dumps({"id": index, "rating": 8 if label else 2, "label": label,
                                         "text": " ".join(words) + " <br /><br />"}) + "\n")
    out = tmp_path / "out"
    assert imdb.main(["--smoke", "--data_path", str(data), "--validation_examples", "30", "--arms", "hard",
                      "--output_dir", str(out), *THREADS]) == 0
    summary = _summary(out / "hard-seed0")
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(out / "hard-seed0")
    assert config.is_causal is False and config.router_type == "hard" and config.num_labels == 2
    # --smoke scores a fixed subset of 64 test reviews unless told otherwise (the whole IMDB test split took minutes)
    assert summary["test_examples"] == 64 and 0 <= summary["test_accuracy"] <= 1
    assert summary["data"]["examples"] == {"train": 170, "validation": 30, "test": 64}
    assert "calibration" not in summary, "the hard router has no thresholds to calibrate"
    notes = (out / "results.md").read_text()  # every example of a split is scored; the test split is a subset
    assert "not necessarily the whole split" not in notes and "fixed random subset of the benchmark's test" in notes
    assert (out / "hard-seed0" / "routing_map.png").is_file()


def test_listops_smoke_reads_released_files_and_reports_accuracy_per_depth(tmp_path):
    from training.listops_data import generate, write_tsv

    splits = generate("original", (300, 40, 60), seed=5)
    write_tsv(str(tmp_path / "train.tsv"), splits["train"], header=True)  # LRA format
    write_tsv(str(tmp_path / "test_d20s.tsv"), splits["test"], header=False)  # original format
    out = tmp_path / "out"
    assert listops.main(["--smoke", "--train_file", str(tmp_path / "train.tsv"), "--test_file",
                         str(tmp_path / "test_d20s.tsv"), "--arms", "3op", "--output_dir", str(out), *THREADS]) == 0
    summary = _summary(out / "3op-seed0")
    per_depth = summary["test_accuracy_per_depth"]
    assert sum(group["examples"] for group in per_depth.values()) == summary["test_examples"] == 60
    assert summary["test_accuracy"] == pytest.approx(
        sum(g["accuracy"] * g["examples"] for g in per_depth.values()) / 60)
    assert len(summary["thresholds"]["1"]) == 2, "three operators: τ_lo and τ_hi"
    card = (out / "3op-seed0" / "README.md").read_text()
    assert "model-index" in card and "datasets:" not in card.split("---")[1]  # generated data: no Hub dataset id
    assert summary["data"]["sources"]["test"].endswith("test_d20s.tsv")
    assert "generated" in summary["data"]["sources"]["validation"]
    # A file whose labels the evaluator does not reproduce is refused.
    wrong = tmp_path / "wrong.tsv"
    wrong.write_text("1\t( ( ( [MAX 2 ) 9 ) ] )\n", encoding="utf-8")
    assert listops.main(["--smoke", "--test_file", str(wrong), "--output_dir", str(tmp_path / "o2"), *THREADS]) == 2


def test_bpe_tokenizer_is_saved_reloaded_and_reused(tmp_path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    lines = [" ".join(random.Random(i).choice(WORDS) for _ in range(12)) + " \n" for i in range(300)]
    tokenizer = train_bpe_tokenizer(lines, 320, str(tmp_path / "tok"))
    assert isinstance(tokenizer, PreTrainedTokenizerFast) and len(tokenizer) <= 320
    reloaded = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    text = "the king of ünïcode 123\n"
    assert reloaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert reloaded.decode(reloaded(text)["input_ids"]) == text  # byte level: nothing is unknown
    assert reloaded.pad_token == reloaded.eos_token == "<|endoftext|>"
    stamp = os.path.getmtime(tmp_path / "tok" / "tokenizer.json")
    train_bpe_tokenizer(lines, 320, str(tmp_path / "tok"))
    assert os.path.getmtime(tmp_path / "tok" / "tokenizer.json") == stamp, "same texts and size: reused"
    assert len(train_bpe_tokenizer(lines, 280, str(tmp_path / "tok"))) <= 280


def test_training_arguments_fields_pass_through_the_command_line():
    found = parse_training_overrides(["--gradient_accumulation_steps", "2", "--optim", "adamw_torch",
                                      "--dataloader_num_workers=1"])
    assert found == {"gradient_accumulation_steps": 2, "optim": "adamw_torch", "dataloader_num_workers": 1}
    with pytest.raises(ValueError, match="not_a_field"):
        parse_training_overrides(["--not_a_field", "3"])
    assert parse_training_overrides([]) == {}


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--calibration_percentiles", "150"], "argument --calibration_percentiles: must be a number in [0, 100]"),
        (["--calibration_percentiles", "nan"], "argument --calibration_percentiles: must be a number in [0, 100]"),
        (["--calibration_percentiles", "70", "30"], "two non-decreasing ones (3 operators), got 70 30"),
        (["--calibration_percentiles", "10", "20", "30"], "two non-decreasing ones (3 operators), got 10 20 30"),
        (["--threads", "0"], "argument --threads: must be a positive integer, got 0"),
        (["--threads", "-1"], "argument --threads: must be a positive integer, got -1"),
        (["--stop_after_steps", "0"], "argument --stop_after_steps: must be a positive integer, got 0"),
        (["--max_steps", "0"], "--max_steps must be positive, got 0"),
        (["--arms", "sideways"], "unknown arm 'sideways'"),
        (["--config_overrides", "rope_theta"], "--config_overrides takes KEY=VALUE, got 'rope_theta'"),
        (["--not_a_field", "3"], "neither a recipe option nor a TrainingArguments field: not_a_field"),
        (["--eval_strategy", "no"], "--eval_strategy is set by the recipe; use --eval_steps"),
        (["--save_only_model", "true"], "--save_only_model is not supported: a resumed run needs its optimiser"),
        (["--seeds", "-1"], "--seeds must be integers in [0, 2**32 - 1], got -1"),
        # Every arm's configuration is checked before the first arm trains, not when its turn comes.
        (["--arms", "attention", "threshold", "--num_hidden_layers", "2"],
         "threshold needs a routed layer, but the authors' layout with 2 layers has none"),
        (["--config_overrides", "tau_mid=0.5"], "--config_overrides tau_mid: threshold calibrates its thresholds"),
        (["--config_overrides", "tau_mdi=0.5"], "unknown keyword(s) `tau_mdi` (did you mean `tau_mid`?)"),
        (["--arms", "attention", "--config_overrides", 'layer_operators=["dct", "routed", "attention"]'],
         "--config_overrides layer_operators: the recipe sets it from --arms"),
        (["--config_overrides", "hidden_size=48"],
         "--config_overrides hidden_size: the recipe sets it from --hidden_size"),
        (["--recalibrate_steps", "-1"], "argument --recalibrate_steps: must be an integer >= 0, got -1"),
        (["--routing_batches", "0"], "argument --routing_batches: must be a positive integer, got 0"),
        (["--calibration_batches", "0"], "argument --calibration_batches: must be a positive integer, got 0"),
        (["--bpe_vocab_size", "0"], "argument --bpe_vocab_size: must be a positive integer, got 0"),
    ],
)
def test_bad_chiar_options_are_usage_errors(arguments, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        wikitext.main(["--smoke", "--arms", "threshold", "--output_dir", str(tmp_path / "out"), *arguments])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "recipe, arguments, message",
    [
        (imdb, ["--max_test_examples", "0"], "argument --max_test_examples: must be a positive integer, got 0"),
        (imdb, ["--validation_examples", "-1"], "argument --validation_examples: must be a positive integer"),
        (listops, ["--generate_sizes", "10", "0", "10"], "argument --generate_sizes: must be a positive integer"),
    ],
)
def test_bad_data_sizes_are_usage_errors(recipe, arguments, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        recipe.main(["--smoke", "--output_dir", str(tmp_path / "out"), *arguments])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "arguments, message",
    [(["--preset", "foo"], "--preset foo: wikitext has the presets"),
     (["--listops_arms", "sideways"], "--listops_arms: unknown arm 'sideways'")],
)
def test_a_reproduction_with_a_preset_or_arm_no_recipe_takes_is_a_usage_error(arguments, message, tmp_path, capsys):
    from training import reproduce_chiar

    with pytest.raises(SystemExit) as exit_info:
        reproduce_chiar.main([*arguments, "--output_dir", str(tmp_path / "runs"), "--dry_run"])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_an_output_folder_that_cannot_be_made_is_a_clear_error(capsys):
    # /proc takes no new folder, whoever runs the test
    assert wikitext.main(["--smoke", "--arms", "threshold", "--output_dir", "/proc/no/such"]) == 2
    assert "error: cannot create --output_dir /proc/no/such: " in capsys.readouterr().err


@pytest.mark.parametrize("model", ["{tmp}/missing", "./no/such/model", "not-a-local-folder"])
def test_evaluating_a_missing_model_folder_is_a_usage_error(model, tmp_path, capsys):
    model = model.format(tmp=tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        wikitext.main(["--evaluate_model", model])
    assert exit_info.value.code == 2
    assert f"argument --evaluate_model: no such folder: {model}" in capsys.readouterr().err


class _Tokenizer:
    pad_token_id = eos_token_id = bos_token_id = 0

    def __len__(self):
        return 64


@pytest.mark.parametrize(
    "arm, arguments, message",
    [
        # huggingface_hub's strict-dataclass check (not a ValueError) refuses the field's type.
        ("threshold", ["--config_overrides", "rope_theta=oops"],
         "(?s)invalid CHIAR configuration for threshold: .*rope_theta.*oops"),
        ("threshold", ["--calibration_percentiles", "30", "60"],
         "--calibration_percentiles 30 60: .* routes between 2 operators, so it takes 1 percentile"),
        ("3op", ["--calibration_percentiles", "50"],
         "--calibration_percentiles 50: .* routes between 3 operators, so it takes 2 percentile"),
    ],
)
def test_bad_chiar_configurations_are_clear_errors(arm, arguments, message):
    from types import SimpleNamespace

    from training.common.chiar_experiment import build_model, build_parser, parse_arm

    task = wikitext.task_for("wikitext-2")
    args, _ = build_parser(task, "").parse_known_args(["--smoke", *arguments])
    with pytest.raises(SystemExit, match=message):
        build_model(parse_arm(arm), wikitext.PRESETS["smoke"], args, task, SimpleNamespace(tokenizer=_Tokenizer()))


def test_a_reproduction_whose_runs_fail_exits_with_an_error(tmp_path, monkeypatch, capsys):
    from training import reproduce_chiar

    started = []
    monkeypatch.setattr(reproduce_chiar, "run_logged", lambda command, *rest: started.append(command) or (2, 0.0))
    assert reproduce_chiar.main(["--benchmarks", "listops", "--seeds", "0", "--listops_arms", "attention",
                                 "--output_dir", str(tmp_path / "runs"), "--results_dir", str(tmp_path / "res")]) == 1
    assert len(started) == 1 and "1 failed" in capsys.readouterr().out
    assert not (tmp_path / "res").exists()


def test_reproduction_plan_and_tables_from_finished_runs(tmp_path, capsys):
    from training import reproduce_chiar

    assert reproduce_chiar.main(["--dry_run", "--output_dir", str(tmp_path / "runs")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 9 and all(line.startswith("[pending]") for line in lines)
    assert "training.wikitext" in lines[0] and "threshold@all hard@all 3op@all" in lines[0]
    assert "training.listops" in lines[1] and "--no_plots" not in lines[1] and "--no_plots" in lines[3]
    assert "training.imdb" in lines[-1] and "--max_test_examples 1000" in lines[-1]

    # Tables from fake finished runs: paired deltas, FLOP changes, equal wall-clock column, missing runs listed.
    def fake(arm, seed, perplexity, seconds, attention):
        family, _, layout = arm.partition("@")
        history = [{"step": 10, "train_seconds": seconds / 2, "eval_validation_curve_loss": 7.0},
                   {"step": 20, "train_seconds": seconds, "eval_validation_curve_loss": 6.0}]
        return {"arm": arm, "family": family, "layout": layout or "authors", "seed": seed, "train_seconds": seconds,
                "seconds_per_step": seconds / 20, "parameters": 1000, "test_perplexity_per_word": perplexity,
                "routing": {"attention_gflops_per_seq": attention, "total_gflops_per_seq": 1.0 + attention,
                            "attention_fraction_routed_layers": None if arm == "attention" else 0.25},
                "log_history": history, "data": {"tokens": {"train": 1}}, "hardware": {},
                "preset": {"num_hidden_layers": 4, "hidden_size": 128, "num_attention_heads": 4, "context_length": 128,
                           "batch_size": 8, "max_steps": 20, "warmup_steps": 2, "lr_scheduler_type": "cosine",
                           "learning_rate": 2e-3, "weight_decay": 0.01, "dropout": 0.0}}

    runs = tmp_path / "runs" / "wikitext"
    for arm, seed, ppl, seconds, attention in (("attention", 0, 100.0, 16.0, 0.4), ("attention", 1, 110.0, 22.0, 0.4),
                                               ("threshold", 0, 120.0, 10.0, 0.1), ("threshold", 1, 125.0, 12.0, 0.1)):
        folder = runs / reproduce_chiar.run_dir_name(arm, seed)
        folder.mkdir(parents=True)
        (folder / "summary.json").write_text(json.dumps(fake(arm, seed, ppl, seconds, attention)))
    assert reproduce_chiar.main(["--aggregate_only", "--benchmarks", "wikitext", "--seeds", "0", "1",
                                 "--wikitext_arms", "attention", "threshold", "hard", "--output_dir",
                                 str(tmp_path / "runs"), "--results_dir", str(tmp_path / "results")]) == 0
    table = json.loads((tmp_path / "results" / "wikitext.json").read_text())
    rows = {row["arm"]: row for row in table["rows"]}
    assert rows["threshold"]["Δ test_perplexity_per_word vs attention (paired)"] == "+17.5000 ± 3.5355"
    assert rows["threshold"]["Δ attn FLOPs"] == "-75.0%" and rows["attention"]["test_perplexity_per_word"] == "105.00 ± 7.07"
    # Equal wall-clock: the curve of threshold seed 0 ends first (10 s); every run is read there.
    assert rows["attention"]["equal_time_budget_seconds"] == pytest.approx(10.0)
    # attention seed 0: 7.0 at 8 s, 6.0 at 16 s -> 6.75 at 10 s; seed 1: its first point is at 11 s -> 7.0.
    assert rows["attention"]["curve_at_equal_time_mean"] == pytest.approx(6.875)
    # threshold seed 0: 6.0 at its last point (10 s); seed 1: 7.0 at 6 s, 6.0 at 12 s -> 6.333 at 10 s.
    assert rows["threshold"]["curve_at_equal_time_mean"] == pytest.approx((6.0 + 7.0 - 4.0 / 6.0) / 2)
    assert table["missing_runs"] == ["hard-seed0", "hard-seed1"]


def test_a_routed_run_trains_data_parallel_under_torchrun(wikitext_run, tmp_path):
    """Two CPU processes, threshold routing: the recipe fails unless both end with the same weights
    (runs.check_replicas_agree). Calibrated on one batch and again at every step, so that the two processes reach
    each calibration together: both once wrote calibration.json, and one of them then lost its rename."""
    import subprocess

    shutil.copytree(wikitext_run["out"] / "tokenizer", tmp_path / "tokenizer")
    command = torchrun_two_cpu_processes(
        "training.wikitext", "--smoke", "--data_path", str(wikitext_run["data"]), "--output_dir", str(tmp_path),
        "--arms", "threshold", "--threads", "1", "--no_plots", "--calibration_batches", "1", "--recalibrate_steps", "1")
    result = subprocess.run(command, cwd=REPO_ROOT, env=recipe_environment(), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = _summary(tmp_path / "threshold-seed0")
    assert summary["thresholds"] and len(summary["calibration"]) == summary["steps"]  # at 0 and every step but the last
    assert result.stdout.count("thresholds calibrated on 1 training batches") == 1  # said once, by the main process


def test_words_are_counted_as_wikitext_counts_them():
    assert wikitext.count_words("a b\nc\n") == 5  # three words and two end-of-line tokens
    from .conftest import shared_file

    test_split = open(shared_file("wikitext-2", "test.txt"), encoding="utf-8").read()
    assert wikitext.count_words(test_split) == 245_569  # the published size of WikiText-2's test set
