"""The EGA-GPT benchmarks (training/tinyshakespeare.py, ptb_char.py over training/common/ega.py): one run_clm run per
variant and seed from a configuration, the comparison built from the files the runs wrote, reuse and resume of run
folders, one-line errors."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from huggingface_hub import ModelCard
from safetensors.torch import load_file

import hf_spectral
from training import ptb_char, tinyshakespeare

from .conftest import REPO_ROOT, recipe_environment


@pytest.fixture(scope="module")
def smoke_run(tiny_shakespeare, tmp_path_factory):
    """`--smoke` with BASE and EGA-1 (window statistics)."""
    out, data = tmp_path_factory.mktemp("tinyshakespeare_smoke"), tmp_path_factory.mktemp("data")
    previous_umask = os.umask(0o022)  # what the files' permissions are checked against
    try:
        code = tinyshakespeare.main(["--smoke", "--variants", "BASE", "EGA-1:window", "--data_path", tiny_shakespeare,
                                     "--output_dir", str(out), "--data_dir", str(data), "--threads", "2"])
    finally:
        os.umask(previous_umask)
    return {"out": out, "data": data, "code": code}


def test_every_variant_is_a_run_clm_run_and_the_table_is_built_from_their_files(smoke_run, capsys):
    out = smoke_run["out"]
    assert smoke_run["code"] == 0
    for run in ("BASE-seed0", "EGA-1-window-seed0"):
        for name in ("model.safetensors", "config.json", "vocab.json", "README.md", "args.json", "all_results.json",
                     "trainer_state.json"):
            assert (out / run / name).is_file(), f"{run}/{name} missing"
        assert not list((out / run).glob("checkpoint-*")), "checkpoints are removed once a run is complete"
        arguments = json.loads((out / run / "args.json").read_text())
        assert arguments["train_file"] == str(smoke_run["data"] / "tinyshakespeare" / "train.txt")
        assert arguments["max_steps"] == 12 and arguments["output_dir"] == str(out / run)  # the smoke configuration
    results = json.loads((out / "results.json").read_text())
    assert [row["model"] for row in results["rows"]] == ["BASE", "EGA-1 (window)"]
    base, window = (json.loads((out / run / "all_results.json").read_text()) for run in ("BASE-seed0",
                                                                                          "EGA-1-window-seed0"))
    assert results["rows"][0]["val_loss_mean"] == base["eval_loss"]
    assert results["rows"][0]["gap_mean"] == pytest.approx(base["eval_loss"] - base["eval_train_loss"])
    # The window model is judged by its leak-free loss, against BASE's loss on the same blocks
    assert results["rows"][1]["leak_free_mean"] == window["eval_leak_free_loss"] != window["eval_leaky_loss"]
    assert results["rows"][1]["delta_vs_base"] == pytest.approx(base["eval_leaky_loss"] - window["eval_leak_free_loss"])
    assert results["rows"][1]["tau_mean"] is not None and results["rows"][1]["gate params"] != "0"
    for name in ("results_validation_curves_main.png", "results_EGA-1-window_gate_heatmap.png",
                 "results_EGA-1-window_gate_trajectories.png"):
        assert (out / name).stat().st_size > 1000, name
    assert results["gate_by_character"]["EGA-1-window-seed0"]["highest_gate"]
    for path in out.rglob("*"):  # ordinary permissions under umask 022 (safetensors alone would write 0600)
        assert path.stat().st_mode & 0o777 == (0o755 if path.is_dir() else 0o644), path
    assert results["command"].startswith("python") and results["seeds"] == [0]


def test_the_window_model_card_says_it_sees_future_tokens(smoke_run):
    card = ModelCard.load(smoke_run["out"] / "EGA-1-window-seed0" / "README.md")
    assert "this model sees future tokens" in card.text
    names = {result.metric_name: result.metric_value for result in card.data.eval_results}
    metrics = json.loads((smoke_run["out"] / "EGA-1-window-seed0" / "all_results.json").read_text())
    assert names["eval_leak_free_perplexity"] == pytest.approx(math.exp(metrics["eval_leak_free_loss"]), rel=1e-3)


def test_a_saved_model_reloads_with_its_learned_gates(smoke_run):
    from transformers import AutoModelForCausalLM

    run_dir = smoke_run["out"] / "EGA-1-window-seed0"
    model = AutoModelForCausalLM.from_pretrained(run_dir)
    assert isinstance(model, hf_spectral.EGAForCausalLM) and model.config.energy_normalization == "window"
    history = json.loads((run_dir / "trainer_state.json").read_text())["log_history"]
    logged = [entry for entry in history if "gates/L1/H0/tau" in entry]
    assert [entry["step"] for entry in logged] == [1, 3, 6, 9, 12]  # every log line, and the end
    assert logged[-1]["gates/L1/H0/tau"] == pytest.approx(float(model.model.h[1].attn.energy_gate.tau[0].mean()),
                                                          abs=1e-5)


def test_a_rerun_reuses_complete_runs_and_refuses_them_under_other_arguments(smoke_run, tiny_shakespeare, tmp_path,
                                                                             capsys):
    out = shutil.copytree(smoke_run["out"], tmp_path / "copy")  # the rerun rewrites the table: not the shared one
    before = (out / "BASE-seed0" / "model.safetensors").stat().st_mtime
    arguments = ["--smoke", "--variants", "BASE", "--data_path", tiny_shakespeare, "--output_dir", str(out),
                 "--data_dir", str(smoke_run["data"])]
    assert tinyshakespeare.main(arguments) == 0
    output = capsys.readouterr().out
    assert "[BASE-seed0] complete already" in output and "validation loss  BASE" in output.splitlines()[-2]
    assert (out / "BASE-seed0" / "model.safetensors").stat().st_mtime == before
    assert tinyshakespeare.main(arguments + ["--max_steps", "13"]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "holds a run made with other arguments (max_steps: 12 there, 13 now)" in error[0]


def _command(tiny_shakespeare, output_dir, data_dir):
    return [sys.executable, "-m", "training.tinyshakespeare", "--smoke", "--variants", "EGA-1", "--max_steps", "40",
            "--save_steps", "10", "--eval_steps", "1000", "--data_path", tiny_shakespeare, "--output_dir",
            str(output_dir), "--data_dir", str(data_dir)]


def test_a_killed_run_resumes_from_its_last_checkpoint_with_nothing_lost(tiny_shakespeare, tmp_path):
    reference = subprocess.run(_command(tiny_shakespeare, tmp_path / "reference", tmp_path / "data"), cwd=REPO_ROOT,
                               env=recipe_environment(), capture_output=True, text=True, timeout=300)
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]
    run_dir = tmp_path / "interrupted" / "EGA-1-causal-seed0"
    process = subprocess.Popen(_command(tiny_shakespeare, tmp_path / "interrupted", tmp_path / "data"), cwd=REPO_ROOT,
                               env=recipe_environment(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline and process.poll() is None and not (run_dir / "checkpoint-20"
                                                                         / "trainer_state.json").is_file():
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    assert not (run_dir / "README.md").exists() and (run_dir / "checkpoint-20").is_dir()
    resumed = subprocess.run(_command(tiny_shakespeare, tmp_path / "interrupted", tmp_path / "data"), cwd=REPO_ROOT,
                             env=recipe_environment(), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"[EGA-1-causal-seed0] resuming from {run_dir / 'checkpoint-20'}" in resumed.stdout
    final = load_file(run_dir / "model.safetensors")
    expected = load_file(tmp_path / "reference" / "EGA-1-causal-seed0" / "model.safetensors")
    assert final.keys() == expected.keys() and all(torch.equal(final[name], expected[name]) for name in expected)


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--variants", "EGA-9"], "unknown variant 'EGA-9'"),
        (["--variants", "EGA-1:sideways"], "unknown energy statistics 'sideways'"),
        (["--seeds", "-1"], "--seeds must be integers in [0, 2**32 - 1], got -1"),
        (["--threads", "0"], "argument --threads: must be a positive integer, got 0"),
        (["--dropout", "1.5"], "--dropout must be in [0, 1), got 1.5"),
        (["--learnin_rate", "1"], "unrecognized arguments: --learnin_rate 1"),
        (["--report_to", "bogus"], "bogus"),
        (["--hidden_size", "30", "--num_attention_heads", "4"], "30"),
        (["--config_overrides", "n_layers=2"], "'n_layers' is not a field of EGAConfig"),
        (["--data_path", "/nonexistent/input.txt", "--no_download"], "--data_path /nonexistent/input.txt"),
    ],
)
def test_bad_arguments_end_with_a_one_line_error_before_anything_is_trained(arguments, message, tiny_shakespeare,
                                                                           tmp_path, capsys):
    data = [] if "--data_path" in arguments else ["--data_path", tiny_shakespeare]
    assert tinyshakespeare.main(["--smoke", *data, "--output_dir", str(tmp_path / "out"), "--data_dir",
                                 str(tmp_path / "data"), *arguments]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("python -m training.tinyshakespeare: error: "), errors
    assert message in errors[0]
    assert not (tmp_path / "out").exists()


def test_ptb_char_derives_its_character_files_and_reports_the_test_split(tiny_ptb_words, tmp_path):
    source = shutil.copytree(tiny_ptb_words, tmp_path / "ptb")
    out = tmp_path / "out"
    assert ptb_char.main(["--smoke", "--variants", "EGA-1", "--data_path", str(source), "--do_predict",
                          "--output_dir", str(out), "--data_dir", str(tmp_path / "data")]) == 0
    assert (source / "ptb.char.valid.txt").read_text() == ptb_char.word_to_char((source / "ptb.valid.txt").read_text())
    train = (tmp_path / "data" / "ptb_char" / "train.txt").read_text()
    assert train == ptb_char.join_characters(ptb_char.word_to_char((source / "ptb.train.txt").read_text()))
    results = json.loads((out / "results.json").read_text())
    metrics = json.loads((out / "EGA-1-causal-seed0" / "all_results.json").read_text())
    assert results["rows"][0]["test_loss_mean"] == metrics["test_loss"] > 0
    assert "| test loss |" in (out / "results.md").read_text()
    vocabulary = json.loads((out / "EGA-1-causal-seed0" / "vocab.json").read_text())
    assert " " not in vocabulary and "_" in vocabulary  # words joined by "_": no separator spaces
