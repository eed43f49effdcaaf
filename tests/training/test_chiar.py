"""The CHIAR-Former benchmarks (training/wikitext.py, imdb.py, listops.py over training/common/chiar.py) and their
reproduction (training/reproduce_chiar.py): one run of run_clm or run_classification per arm and seed, the tables
built from the files the runs wrote, one-line errors."""

import json
import math

import pytest

from training import imdb, listops, reproduce_chiar, wikitext


@pytest.fixture(scope="module")
def wikitext_run(tiny_wikitext, tmp_path_factory):
    out, data = tmp_path_factory.mktemp("wikitext_out"), tmp_path_factory.mktemp("data")
    code = wikitext.main(["--smoke", "--data_path", tiny_wikitext, "--output_dir", str(out), "--data_dir", str(data),
                          "--arms", "attention", "threshold", "--dataloader_num_workers", "0"])  # a script option
    return {"code": code, "out": out, "data": data}


def test_wikitext_arms_are_run_clm_runs_and_the_table_reads_their_perplexities_routing_and_flops(wikitext_run):
    out, data = wikitext_run["out"], wikitext_run["data"] / "wikitext-2"
    assert wikitext_run["code"] == 0
    assert json.loads((out / "threshold-seed0" / "args.json").read_text())["tokenizer_name"] == str(data / "bpe-512")
    record = json.loads((out / "results.json").read_text())
    runs = {run["arm"]: run for run in record["runs"]}
    metrics = json.loads((out / "threshold-seed0" / "all_results.json").read_text())
    words = json.loads((data / "bpe-512" / "words.json").read_text())
    threshold = runs["threshold"]
    assert threshold["test_perplexity_per_word"] == pytest.approx(
        math.exp(metrics["test_loss"] * (words["test"]["tokens"] - 1) / words["test"]["words"]))
    assert threshold["test_perplexity"] == pytest.approx(metrics["test_perplexity"])
    assert 0 < threshold["routing"]["attention_fraction_routed_layers"] < 1
    assert set(threshold["routing"]["fractions"]) == {"routing/L1/dct", "routing/L1/attention"}
    assert threshold["thresholds"]["tau_mid"] != json.loads((out / "attention-seed0" / "config.json").read_text())[
        "tau_mid"]  # calibrated on training batches before training
    assert runs["attention"]["routing"]["attention_fraction_routed_layers"] is None
    rows = {row["arm"]: row for row in record["rows"]}
    assert rows["threshold"]["Δ attn FLOPs"].startswith("-") and rows["attention"]["paper"] == "75.19"
    assert rows["threshold"]["seconds_per_step_mean"] > 0 and rows["threshold"]["curve_final_mean"] > 0
    for name in ("results_validation_curves.png", "wikitext_threshold_entropy_histograms.png",
                 "wikitext_threshold_routing_fractions.png", "wikitext_threshold_routing_map.png"):
        assert (out / name).stat().st_size > 1000, name
    history = json.loads((out / "threshold-seed0" / "trainer_state.json").read_text())["log_history"]
    assert [entry["step"] for entry in history if "routing/L1/attention" in entry] == [1, 2, 4, 6]


def test_the_saved_wikitext_model_and_tokenizer_load_with_the_auto_classes(wikitext_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_spectral  # noqa: F401  (registers CHIAR-Former)

    model = AutoModelForCausalLM.from_pretrained(wikitext_run["out"] / "threshold-seed0")
    tokenizer = AutoTokenizer.from_pretrained(wikitext_run["out"] / "threshold-seed0")
    ids = tokenizer("the king of york", return_tensors="pt")["input_ids"]
    assert model(input_ids=ids).logits.shape == (1, ids.shape[1], len(tokenizer))
    assert model.config.is_causal and model.config.layer_operators == ["dct", "routed", "attention"]


def test_imdb_trains_a_bidirectional_hard_routed_encoder_on_held_out_and_subset_splits(tiny_imdb, tmp_path):
    from transformers import AutoConfig

    out, data = tmp_path / "out", tmp_path / "data"
    assert imdb.main(["--smoke", "--data_path", tiny_imdb, "--validation_examples", "30", "--arms", "hard",
                      "--output_dir", str(out), "--data_dir", str(data)]) == 0
    config = AutoConfig.from_pretrained(out / "hard-seed0")
    assert config.is_causal is False and config.router_type == "hard" and config.num_labels == 2
    assert config.classifier_pooling == "mean"
    # --smoke scores a fixed subset of 64 test reviews (the whole IMDB test split takes minutes)
    sizes = {split: len((data / "imdb" / f"{split}.jsonl").read_text().splitlines())
             for split in ("train", "validation", "test")}
    assert sizes == {"train": 170, "validation": 30, "test": 64}
    assert "<br />" not in (data / "imdb" / "train.jsonl").read_text()
    metrics = json.loads((out / "hard-seed0" / "all_results.json").read_text())
    assert metrics["test_samples"] == 64 and 0 <= metrics["test_accuracy"] <= 1
    assert json.loads((out / "results.json").read_text())["runs"][0]["test_accuracy"] == metrics["test_accuracy"]
    assert "thresholds" not in json.loads((out / "results.json").read_text())["runs"][0]  # a hard router has none


def test_listops_reads_released_files_and_reports_the_accuracy_per_depth(tmp_path):
    from training.listops_data import generate, write_tsv

    splits = generate("original", (300, 40, 60), seed=5)
    write_tsv(str(tmp_path / "train.tsv"), splits["train"], header=True)  # LRA format
    write_tsv(str(tmp_path / "test_d20s.tsv"), splits["test"], header=False)  # original format
    out, data = tmp_path / "out", tmp_path / "data"
    assert listops.main(["--smoke", "--train_file", str(tmp_path / "train.tsv"), "--test_file",
                         str(tmp_path / "test_d20s.tsv"), "--arms", "3op", "--output_dir", str(out), "--data_dir",
                         str(data)]) == 0
    run = json.loads((out / "results.json").read_text())["runs"][0]
    rows = [json.loads(line) for line in (data / "listops" / "test.jsonl").read_text().splitlines()]
    depths = [row["depth"] for row in rows]
    assert len(rows) == 60 and all("(" not in row["text"] for row in rows)  # brackets dropped
    assert run["test_accuracy"] == pytest.approx(
        sum(accuracy * depths.count(int(depth)) for depth, accuracy in run["test_accuracy_per_depth"].items()) / 60)
    assert run["thresholds"]["tau_lo"] < run["thresholds"]["tau_hi"]  # three operators: τ_lo and τ_hi calibrated
    statistics = json.loads((data / "listops" / "statistics.json").read_text())
    assert statistics["test"]["source"].endswith("test_d20s.tsv") and "generated" in statistics["validation"]["source"]
    # A file whose labels the evaluator does not reproduce is refused
    wrong = tmp_path / "wrong.tsv"
    wrong.write_text("1\t( ( ( [MAX 2 ) 9 ) ] )\n", encoding="utf-8")
    assert listops.main(["--smoke", "--test_file", str(wrong), "--output_dir", str(tmp_path / "o2"), "--data_dir",
                         str(data)]) == 2


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--arms", "sideways"], "unknown arm 'sideways'"),
        (["--arms", "attention@all"], "unknown arm 'attention@all'"),
        (["--arms", "threshold", "--num_hidden_layers", "2"], "threshold needs a routed layer"),
        (["--config_overrides", "tau_mdi=0.5"], "'tau_mdi' is not a field of ChiarConfig"),
        (["--calibration_batches", "0"], "--calibration_batches must be at least 1, got 0"),
        (["--bpe_vocab_size", "0"], "argument --bpe_vocab_size: must be a positive integer, got 0"),
    ],
)
def test_bad_arguments_end_with_a_one_line_error(arguments, message, tiny_wikitext, tmp_path, capsys):
    assert wikitext.main(["--smoke", "--data_path", tiny_wikitext, "--output_dir", str(tmp_path / "out"),
                          "--data_dir", str(tmp_path / "data"), *arguments]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("python -m training.wikitext: error: ") and message in errors[0]
    assert not (tmp_path / "out").exists()


def test_the_reproduction_smoke_builds_a_table_per_benchmark(tiny_wikitext, tiny_imdb, tmp_path, monkeypatch,
                                                             capsys):
    monkeypatch.setenv("WIKITEXT2_PATH", tiny_wikitext)
    monkeypatch.setenv("IMDB_PATH", tiny_imdb)
    out = tmp_path / "runs"
    assert reproduce_chiar.main(["--smoke", "--output_dir", str(out), "--data_dir", str(tmp_path / "data")]) == 0
    for benchmark, primary in (("wikitext", "test_perplexity_per_word"), ("listops", "test_accuracy"),
                               ("imdb", "test_accuracy")):
        record = json.loads((out / "results" / f"{benchmark}.json").read_text())
        assert [row["arm"] for row in record["rows"]] == ["attention", "threshold"]
        assert record["rows"][1][f"Δ {primary} vs attention (paired)"] != "" and record["seeds"] == [0]
        assert (out / "results" / f"{benchmark}_threshold_routing_map.png").is_file()
    assert reproduce_chiar.main(["--smoke", "--output_dir", str(out), "--dry_run"]) == 0
    lines = capsys.readouterr().out.splitlines()[-6:]
    assert all(line.startswith("done    ") for line in lines) and "run_classification" in lines[-1]
