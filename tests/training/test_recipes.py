"""End-to-end smoke runs of the character-level recipes: outputs, model cards, Hub push, resume, torchrun."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from unittest import mock

import pytest
import torch
import transformers
from huggingface_hub import HfApi, ModelCard
from huggingface_hub.hf_api import RepoUrl
from safetensors.torch import load_file

import hf_spectral
from training import ptb_char, tinyshakespeare
from training.common.lm_experiment import EXIT_INTERRUPTED
from training.common.presets import LMPreset

from .conftest import REPO_ROOT, recipe_environment, synthetic_text, torchrun_two_cpu_processes



@pytest.fixture(scope="module")
def pushed_smoke_run(tiny_shakespeare, tmp_path_factory):
    """One `--smoke --push_to_hub` run of BASE and EGA-1 (window), with the Hub replaced at the network call."""
    output_dir = tmp_path_factory.mktemp("tinyshakespeare_smoke")
    uploads, created = [], []

    def create_repo(self, repo_id, **kwargs):  # the Hub puts a repository without a namespace in the user's
        created.append((repo_id, kwargs.get("private")))
        return RepoUrl(f"https://huggingface.co/{repo_id if '/' in repo_id else 'someone/' + repo_id}")

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        files = sorted(os.listdir(folder_path))
        readme = open(os.path.join(folder_path, "README.md"), encoding="utf-8").read() if "README.md" in files else None
        uploads.append({"repo_id": repo_id, "files": files, "readme": readme, "ignore": kwargs.get("ignore_patterns"),
                        "message": kwargs.get("commit_message", "")})
        return mock.MagicMock()

    previous_umask = os.umask(0o022)  # what the files' permissions are checked against
    def whoami(self, *args, **kwargs):
        return {"name": "someone"}

    with mock.patch.object(HfApi, "create_repo", create_repo), mock.patch.object(HfApi, "whoami", whoami), \
            mock.patch.object(HfApi, "upload_folder", upload_folder):
        code = tinyshakespeare.main([
            "--smoke", "--variants", "BASE", "EGA-1:window", "--data_path", tiny_shakespeare,
            "--output_dir", str(output_dir), "--push_to_hub", "--hub_model_id", "ega-smoke",
            "--hub_strategy", "every_save", "--threads", "2",
        ])
    os.umask(previous_umask)
    return {"dir": output_dir, "code": code, "uploads": uploads, "created": created}


def _summary(run_dir):
    with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as handle:
        return json.load(handle)


def test_smoke_run_writes_models_summaries_table_and_figures(pushed_smoke_run):
    out = pushed_smoke_run["dir"]
    assert pushed_smoke_run["code"] == 0
    for run in ("BASE-seed0", "EGA-1-window-seed0"):
        for name in ("model.safetensors", "config.json", "vocab.json", "README.md", "summary.json", "learning_curve.png"):
            assert (out / run / name).is_file(), f"{run}/{name} missing"
        assert not list((out / run).glob("checkpoint-*")), "checkpoints are removed once a run is complete"
    for name in ("gate_heatmap.png", "gate_trajectories.png"):
        assert (out / "EGA-1-window-seed0" / name).stat().st_size > 1000
    assert (out / "validation_curves.png").is_file()
    results = json.loads((out / "results.json").read_text())
    assert [row["model"] for row in results["rows"]] == ["BASE", "EGA-1 (window)"]
    # Ordinary permissions under umask 022 (safetensors alone would write the model as 0600)
    for path in out.rglob("*"):  # (the folder itself is pytest's, 0700)
        assert path.stat().st_mode & 0o777 == (0o755 if path.is_dir() else 0o644), path
    assert results["command"].startswith("python") and results["hardware"]["cpu_count"] and results["seeds"] == [0]


def test_window_model_is_reported_with_its_leak_free_loss(pushed_smoke_run):
    summary = _summary(pushed_smoke_run["dir"] / "EGA-1-window-seed0")
    assert summary["sees_future"] is True
    assert summary["val_loss_leak_free"] > 0 and summary["val_loss_same_blocks"] > 0
    row = json.loads((pushed_smoke_run["dir"] / "results.json").read_text())["rows"][1]
    assert row["leak_free_mean"] == pytest.approx(summary["val_loss_leak_free"])
    base = _summary(pushed_smoke_run["dir"] / "BASE-seed0")
    # Δ vs BASE of a window model is computed from its leak-free loss, never from the leaky one, and against BASE's
    # loss on the same blocks.
    assert row["delta_vs_base"] == pytest.approx(base["val_loss_same_blocks"] - summary["val_loss_leak_free"])
    card = (pushed_smoke_run["dir"] / "EGA-1-window-seed0" / "README.md").read_text()
    assert "sees future tokens" in card and "LEAK-FREE" in card
    # beside it, the ordinary loss on the same tokens: the pair that measures the leak
    same_tokens = summary["val_loss_same_blocks"]
    assert f"| ordinary validation loss on the same tokens (sees future tokens) | {same_tokens:.4f} |" in card
    # In the model index (the Hub's evaluation widget) every ordinary number says it saw the future; the leak-free
    # loss comes as perplexity and bits per character too
    metadata = ModelCard.load(pushed_smoke_run["dir"] / "EGA-1-window-seed0" / "README.md").data
    names = {result.metric_name: result.metric_value for result in metadata.eval_results}
    assert all("LEAK-FREE" in name or "sees future tokens" in name for name in names), sorted(names)
    assert "validation perplexity (sees future tokens)" in names
    assert names["LEAK-FREE validation perplexity"] == pytest.approx(math.exp(summary["val_loss_leak_free"]), rel=1e-3)


def test_model_card_metadata_holds_the_measured_results(pushed_smoke_run):
    run_dir = pushed_smoke_run["dir"] / "BASE-seed0"
    summary = _summary(run_dir)
    card = ModelCard.load(run_dir / "README.md")
    results = {result.metric_name: (result.dataset_split, result.metric_value) for result in card.data.eval_results}
    assert results["validation loss (nats/char)"] == ("validation", pytest.approx(round(summary["val_loss"], 4)))
    assert results["training loss, eval mode (nats/char)"] == ("train", pytest.approx(round(summary["train_loss"], 4)))
    # The gap is no evaluation of one split: in the card's table, not in its model index
    assert "generalisation gap (val − train)" not in results and "generalisation gap (val − train)" in card.text
    assert card.data.pipeline_tag == "text-generation" and "karpathy/tiny_shakespeare" in card.data.datasets
    assert summary["command"] in card.text


def test_push_to_hub_uploads_each_model_with_its_card(pushed_smoke_run):
    repos = {upload["repo_id"]: upload for upload in pushed_smoke_run["uploads"]}  # the last push of each
    assert set(repos) == {"someone/ega-smoke-BASE-seed0", "someone/ega-smoke-EGA-1-window-seed0"}
    for repo_id, upload in repos.items():
        assert {"README.md", "model.safetensors", "config.json", "vocab.json"} <= set(upload["files"])
        assert "model-index" in upload["readme"]
        assert any(pattern.startswith("checkpoint") for pattern in upload["ignore"])
        # the card names the repository as the Hub resolved it (it had named the local folder or the bare name)
        assert f'from_pretrained("{repo_id}", trust_remote_code=True)' in upload["readme"]
    assert "ega-smoke-BASE-seed0" in [repo for repo, _ in pushed_smoke_run["created"]]
    # Pushes of checkpoints during training carry the model's code: the repository loads with trust_remote_code at
    # every commit (Trainer copies only the config and weight files)
    in_progress = [upload for upload in pushed_smoke_run["uploads"] if "Training in progress" in upload["message"]]
    assert len(in_progress) >= 2
    assert all({"modeling_ega_gpt.py", "configuration_ega_gpt.py", "energy_gate.py"} <= set(upload["files"])
               for upload in in_progress)


def test_saved_model_reloads_with_its_learned_gates(pushed_smoke_run):
    from transformers import AutoModelForCausalLM

    run_dir = pushed_smoke_run["dir"] / "EGA-1-window-seed0"
    model = AutoModelForCausalLM.from_pretrained(run_dir)
    assert isinstance(model, hf_spectral.EGAForCausalLM) and model.config.energy_normalization == "window"
    tau = _summary(run_dir)["gates"]["per_layer"]["1"]["tau"]
    assert torch.allclose(model.model.h[1].attn.energy_gate.tau, torch.tensor(tau))


def test_gate_trajectory_is_recorded_every_logging_step(pushed_smoke_run):
    lines = (pushed_smoke_run["dir"] / "EGA-1-window-seed0" / "gate_trajectory.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [0, 3, 6, 9, 12]
    assert set(records[-1]["layers"]) == {"0", "1"}
    assert records[0]["layers"]["0"]["alpha"] == [[2.0], [2.0]] != records[-1]["layers"]["0"]["alpha"]


def test_a_completed_run_is_not_trained_again(pushed_smoke_run, tiny_shakespeare, capsys, tmp_path):
    out = shutil.copytree(pushed_smoke_run["dir"], tmp_path / "copy")  # the rerun rewrites the table: not the shared
    before = (out / "BASE-seed0" / "model.safetensors").stat().st_mtime
    assert tinyshakespeare.main(["--smoke", "--variants", "BASE", "--data_path", tiny_shakespeare,
                                 "--output_dir", str(out)]) == 0
    assert "complete already" in capsys.readouterr().out
    assert (out / "BASE-seed0" / "model.safetensors").stat().st_mtime == before


# ------------------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------------------


def test_help_is_reachable_through_the_hf_spectral_command(capsys, monkeypatch):
    from hf_spectral.cli import main as cli

    monkeypatch.setattr(sys, "argv", ["/venv/bin/hf-spectral", "train", "tinyshakespeare", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        cli()
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "--preset" in text and "demo" in text and "--push_to_hub" in text
    assert text.startswith("usage: hf-spectral train tinyshakespeare "), "the usage line names the command run"
    monkeypatch.setattr(sys, "argv", ["/venv/bin/hf-spectral", "train", "tinyshakespeare", "--max_steps", "0"])
    with pytest.raises(SystemExit) as exit_info:
        cli()
    assert exit_info.value.code == 2
    assert "hf-spectral train tinyshakespeare: error: --max_steps must be positive, got 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--variants", "EGA-9"], "unknown variant 'EGA-9'"),
        (["--variants", "EGA-1:sideways"], "unknown normalisation 'sideways'"),
        (["--hidden_size", "30", "--num_attention_heads", "4"], "not divisible"),
        (["--max_steps", "0"], "--max_steps must be positive"),
        (["--final_eval_batches", "0"], "--final_eval_batches must be positive, got 0"),
        (["--leak_free_batches", "-1"], "--leak_free_batches must be positive, got -1"),
        (["--learning_rate", "-1"], "--learning_rate must be a positive number, got -1.0"),
        (["--learning_rate", "0"], "--learning_rate must be a positive number, got 0.0"),
        (["--learning_rate", "nan"], "--learning_rate must be a positive number, got nan"),
        (["--warmup_steps", "-1"], "--warmup_steps must be a number of at least 0, got -1"),
        (["--weight_decay", "-0.1"], "--weight_decay must be a number of at least 0, got -0.1"),
        (["--report_to", "bogus"], "TrainingArguments refuse these options: bogus is not supported"),
    ],
)
def test_bad_options_are_usage_errors(arguments, message, tiny_shakespeare, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        tinyshakespeare.main(["--smoke", "--data_path", tiny_shakespeare, "--output_dir", str(tmp_path)] + arguments)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "python -m training.tinyshakespeare: error: " in error and message in error
    assert not any(tmp_path.iterdir()), "refused before anything is written"


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--stop_after_steps", "0"], "argument --stop_after_steps: must be a positive integer, got 0"),
        (["--stop_after_steps", "x"], "argument --stop_after_steps: invalid int value: 'x'"),
    ],
)
def test_bad_counts_are_usage_errors(arguments, message, tiny_shakespeare, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        tinyshakespeare.main(["--smoke", "--data_path", tiny_shakespeare, "--output_dir", str(tmp_path)] + arguments)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir()), "refused before anything is written"


@pytest.mark.parametrize("threads", ["0", "-1"])
def test_threads_below_one_are_refused_before_the_data_is_read(threads, tiny_shakespeare, tmp_path, capsys):
    output_dir = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        tinyshakespeare.main(["--smoke", "--data_path", tiny_shakespeare, "--output_dir", str(output_dir),
                              "--threads", threads])
    assert exit_info.value.code == 2
    assert f"argument --threads: must be a positive integer, got {threads}" in capsys.readouterr().err
    assert not output_dir.exists()


def test_a_run_that_failed_before_its_first_checkpoint_does_not_block_the_corrected_command(tmp_path):
    from training.common.runs import RUN_SETTINGS_FILE, open_run_dir

    run_dir = tmp_path / "BASE-seed0"
    run_dir.mkdir()
    (run_dir / RUN_SETTINGS_FILE).write_text(json.dumps({"max_steps": 8, "settings_version": 2}))
    assert open_run_dir(str(tmp_path), "BASE-seed0", False, {"max_steps": 9, "settings_version": 2}) == (
        str(run_dir), None)
    assert json.loads((run_dir / RUN_SETTINGS_FILE).read_text())["max_steps"] == 9  # the new command's settings
    (run_dir / "checkpoint-4").mkdir()  # something to resume: now held to its settings
    with pytest.raises(SystemExit, match="\\(max_steps: 9 there, 10 now\\)"):
        open_run_dir(str(tmp_path), "BASE-seed0", False, {"max_steps": 10, "settings_version": 2})


def test_missing_data_and_a_file_as_output_folder_are_clear_errors(tmp_path, capsys):
    output_dir = tmp_path / "runs" / "missing-data"
    code = tinyshakespeare.main(["--smoke", "--data_path", str(tmp_path / "missing"), "--output_dir", str(output_dir)])
    assert code == 2
    assert "--data_path" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()  # the folders this run created are gone: nothing half-written stays
    (tmp_path / "afile").write_text("")
    assert tinyshakespeare.main(["--smoke", "--output_dir", str(tmp_path / "afile")]) == 2
    assert "exists and is not a folder" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------------
# PTB
# ------------------------------------------------------------------------------------------------------------


def test_ptb_char_recipe_derives_char_files_and_reports_the_test_split(tiny_ptb_words, tmp_path, capsys):
    data_dir = tmp_path / "ptb"
    shutil.copytree(tiny_ptb_words, data_dir)
    arguments = ["--smoke", "--variants", "EGA-1", "--data_path", str(data_dir), "--eval_test",
                 "--output_dir", str(tmp_path / "out"), "--no_plots"]
    code = ptb_char.main(arguments)
    assert code == 0
    assert (data_dir / "ptb.char.valid.txt").read_text() == ptb_char.word_to_char((data_dir / "ptb.valid.txt").read_text())
    summary = _summary(tmp_path / "out" / "EGA-1-causal-seed0")
    assert summary["test_loss"] > 0 and summary["val_loss"] > 0
    assert "| test loss |" in (tmp_path / "out" / "results.md").read_text()
    # A run completed without a test loss gets one from its saved model: the number its final evaluation gave
    summary_file = tmp_path / "out" / "EGA-1-causal-seed0" / "summary.json"
    summary_file.write_text(json.dumps({k: v for k, v in summary.items() if not k.startswith("test_")}))
    (summary_file.parent / "README.md").unlink()  # its card is written again, with the test loss
    assert ptb_char.main(arguments) == 0
    assert "--eval_test: test loss" in capsys.readouterr().out
    assert _summary(tmp_path / "out" / "EGA-1-causal-seed0")["test_loss"] == pytest.approx(summary["test_loss"],
                                                                                         rel=1e-6)
    assert "| test loss (nats/char) |" in (tmp_path / "out" / "EGA-1-causal-seed0" / "README.md").read_text()
    vocabulary = json.loads((tmp_path / "out" / "tokenizer" / "vocab.json").read_text())
    assert " " not in vocabulary and "_" in vocabulary  # joined format: no separator spaces
    config = json.loads((tmp_path / "out" / "results.json").read_text())["config"]
    assert (config["char_format"], config["eval_test"], config["attn_implementation"]) == ("joined", True, "sdpa")


# ------------------------------------------------------------------------------------------------------------
# Interruption and resume, torchrun
# ------------------------------------------------------------------------------------------------------------


def _recipe_command(tiny_shakespeare, output_dir, *extra):
    return [sys.executable, "-m", "training.tinyshakespeare", "--smoke", "--variants", "EGA-1", "--max_steps", "60",
            "--eval_steps", "1000", "--save_steps", "1000", "--threads", "1", "--no_plots",
            "--data_path", tiny_shakespeare, "--output_dir", str(output_dir), *extra]


def test_a_killed_run_resumes_from_its_checkpoint_with_nothing_lost(tiny_shakespeare, tmp_path):
    """SIGTERM mid-training → checkpoint at the end of that step, exit; rerun → resumes and ends with exactly the
    weights of a run that was never interrupted."""
    reference = subprocess.run(_recipe_command(tiny_shakespeare, tmp_path / "reference"), cwd=REPO_ROOT,
                               env=recipe_environment(), capture_output=True, text=True, timeout=300)
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]

    interrupted_dir = tmp_path / "interrupted"
    trajectory = interrupted_dir / "EGA-1-causal-seed0" / "gate_trajectory.jsonl"
    process = subprocess.Popen(_recipe_command(tiny_shakespeare, interrupted_dir), cwd=REPO_ROOT,
                               env=recipe_environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and process.poll() is None:
        if trajectory.is_file() and any(json.loads(l)["step"] >= 6 for l in trajectory.read_text().splitlines() if l):
            break
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    output = process.communicate(timeout=120)[0]
    assert process.returncode == EXIT_INTERRUPTED, output[-3000:]
    checkpoints = list((interrupted_dir / "EGA-1-causal-seed0").glob("checkpoint-*"))
    assert len(checkpoints) == 1 and 6 <= int(checkpoints[0].name.split("-")[1]) < 60, output[-2000:]

    resumed = subprocess.run(_recipe_command(tiny_shakespeare, interrupted_dir), cwd=REPO_ROOT,
                             env=recipe_environment(), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
    final = load_file(interrupted_dir / "EGA-1-causal-seed0" / "model.safetensors")
    expected = load_file(tmp_path / "reference" / "EGA-1-causal-seed0" / "model.safetensors")
    assert final.keys() == expected.keys()
    for name in expected:
        assert torch.equal(final[name], expected[name]), name
    summaries = [_summary(d / "EGA-1-causal-seed0") for d in (tmp_path / "reference", interrupted_dir)]
    assert summaries[1]["resumed_from"] == checkpoints[0].name
    assert summaries[0]["val_loss"] == summaries[1]["val_loss"]
    trajectories = [(d / "EGA-1-causal-seed0" / "gate_trajectory.jsonl").read_text()
                    for d in (tmp_path / "reference", interrupted_dir)]
    assert trajectories[0] == trajectories[1]


def test_stop_after_steps_leaves_a_checkpoint_to_resume(tiny_shakespeare, tmp_path, capsys):
    arguments = ["--smoke", "--variants", "BASE", "--data_path", tiny_shakespeare, "--output_dir", str(tmp_path),
                 "--no_plots", "--max_steps", "8", "--eval_steps", "100"]
    assert tinyshakespeare.main(arguments + ["--stop_after_steps", "4"]) == EXIT_INTERRUPTED
    # the same command would stop again at once: the message says how to resume
    assert ("stopped at step 4/8 (--stop_after_steps)" in (out := capsys.readouterr().out)
            and "Rerun without --stop_after_steps (or with a later step) to resume." in out)
    assert [p.name for p in (tmp_path / "BASE-seed0").glob("checkpoint-*")] == ["checkpoint-4"]
    assert not (tmp_path / "BASE-seed0" / "summary.json").exists()
    # Resuming with other settings would keep the checkpoint's schedule while recording the new ones: refused
    with pytest.raises(SystemExit, match="holds a run made with other settings \\(learning_rate: .* there, 0.01 now"):
        tinyshakespeare.main(arguments + ["--learning_rate", "1e-2"])
    (tmp_path / "BASE-seed0" / "run_settings.json").unlink()  # a folder from before settings were recorded
    with pytest.raises(SystemExit, match="cannot resume from .*checkpoint-4: its model has other sizes.*--restart"):
        tinyshakespeare.main(arguments + ["--hidden_size", "48"])
    assert not (tmp_path / "BASE-seed0" / "run_settings.json").exists()
    assert tinyshakespeare.main(arguments) == 0
    assert _summary(tmp_path / "BASE-seed0")["resumed_from"] == "checkpoint-4"
    # A complete run (trained again with its settings recorded) is not reported as one made with other settings
    assert tinyshakespeare.main(arguments + ["--restart"]) == 0
    with pytest.raises(SystemExit, match="holds a run made with other settings \\(max_steps: 8 there, 9 now\\)"):
        tinyshakespeare.main(arguments[:-4] + ["--max_steps", "9", "--eval_steps", "100"])
    # Other data of the same size, or another attention backend, is another run; a copy of the same data read from
    # elsewhere with another thread count is the same run
    other, copy = tmp_path / "other.txt", tmp_path / "copy.txt"
    other.write_text(synthetic_text(60_000, seed=1), encoding="utf-8")
    shutil.copyfile(tiny_shakespeare, copy)
    with pytest.raises(SystemExit, match="holds a run made with other settings \\(data: "):
        tinyshakespeare.main([*arguments[:4], str(other), *arguments[5:]])
    with pytest.raises(SystemExit, match="\\(attn_implementation: 'sdpa' there, 'eager' now\\)"):
        tinyshakespeare.main(arguments + ["--attn_implementation", "eager"])
    assert tinyshakespeare.main([*arguments[:4], str(copy), *arguments[5:], "--threads", "1"]) == 0
    assert "complete already" in capsys.readouterr().out
    # A folder from before every option and the data were recorded (no settings_version) is checked on what its
    # file holds: still reused with the same numbers, still refused with others
    settings_file = tmp_path / "BASE-seed0" / "run_settings.json"
    recorded = json.loads(settings_file.read_text())
    settings_file.write_text(json.dumps({k: v for k, v in recorded.items() if k in LMPreset.__dataclass_fields__}))
    assert tinyshakespeare.main(arguments + ["--attn_implementation", "eager"]) == 0
    assert "complete already" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="\\(learning_rate: .* there, 0.01 now\\)"):
        tinyshakespeare.main(arguments + ["--learning_rate", "1e-2"])


def test_torchrun_processes_train_on_the_cpu_when_torch_is_a_cuda_build_without_a_gpu(monkeypatch, tmp_path):
    # PyPI's torch is a CUDA build: on a machine without a GPU it still names CUDA as its accelerator. The processes
    # of a torchrun must then be told to use the CPU, or accelerate leaves each of them training alone.
    from training.common import presets

    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *args, **kwargs: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    monkeypatch.setattr(presets, "world_size", lambda: 2)
    # The arguments as given: TrainingArguments' __post_init__ would start the process group of a real run
    monkeypatch.setattr(transformers.TrainingArguments, "__post_init__", lambda self: None)
    assert not presets.has_accelerator()
    preset = LMPreset("test", num_hidden_layers=1, num_attention_heads=1, hidden_size=8, context_length=8,
                      batch_size=4, max_steps=1, warmup_steps=0)
    arguments = presets.training_arguments(preset, str(tmp_path), seed=0)
    assert arguments.use_cpu is True and arguments.ddp_backend == "gloo"
    assert arguments.per_device_train_batch_size == 2


def test_the_recipe_runs_under_torchrun_with_two_cpu_processes(tiny_shakespeare, tmp_path):
    command = torchrun_two_cpu_processes(
        "training.tinyshakespeare", "--smoke", "--variants", "EGA-1", "--threads", "1", "--no_plots",
        "--data_path", tiny_shakespeare, "--output_dir", str(tmp_path))
    result = subprocess.run(command, cwd=REPO_ROOT, env=recipe_environment(), capture_output=True, text=True,
                            timeout=300)
    # The recipe fails unless both processes end with the same weights (runs.check_replicas_agree): processes that
    # accelerate never joined would each train their own model.
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["config"]["world_size"] == 2
    summary = _summary(tmp_path / "EGA-1-causal-seed0")
    assert summary["steps"] == 12 and summary["val_loss"] > 0
    assert "validation loss  EGA-1 (causal)" in result.stdout


def test_processes_writing_one_json_file_at_once_never_fail(tmp_path):
    """Every process of a data-parallel run may write the same record (a CHIAR run's calibration, a tokenizer's
    metadata): each writes through its own temporary file (a shared one was renamed away under the other)."""
    path = tmp_path / "record.json"
    writer = ("import sys; from training.common.runs import write_json\n"
              "for i in range(300): write_json(sys.argv[1], {'writer': sys.argv[2], 'i': i, 'pad': 'x' * 4096})")
    processes = [subprocess.Popen([sys.executable, "-c", writer, str(path), str(n)], cwd=REPO_ROOT,
                                  env=recipe_environment(), stderr=subprocess.PIPE, text=True) for n in range(2)]
    errors = [process.communicate(timeout=120)[1] for process in processes]
    assert [process.returncode for process in processes] == [0, 0], errors
    assert json.loads(path.read_text())["i"] == 299
    assert [p.name for p in tmp_path.iterdir()] == ["record.json"]  # no temporary file left


def test_an_interrupted_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    from training.common import runs

    path = tmp_path / "summary.json"
    runs.write_json(str(path), {"old": True})

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runs.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        runs.write_json(str(path), {"old": False})
    assert json.loads(path.read_text()) == {"old": True} and [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_push_to_hub_without_hub_access_is_refused_before_the_data_is_read(tiny_shakespeare, tmp_path, capsys):
    def no_network(self, *args, **kwargs):
        raise OSError("[Errno -2] Name or service not known")

    with mock.patch.object(HfApi, "whoami", no_network):
        code = tinyshakespeare.main(["--smoke", "--data_path", tiny_shakespeare, "--output_dir", str(tmp_path / "out"),
                                     "--push_to_hub"])
    assert code == 2 and not (tmp_path / "out").exists()
    assert "error: --push_to_hub: cannot use the Hugging Face Hub (OSError: [Errno -2]" in capsys.readouterr().err


def test_a_complete_run_says_it_is_not_pushed_again(tmp_path, capsys):
    """--push_to_hub pushes at the end of training; a run complete already is not trained, so it is not pushed: said
    so, with the way to upload it, instead of a silent success."""
    from training.common.runs import open_run_dir

    (tmp_path / "BASE-seed0").mkdir()
    (tmp_path / "BASE-seed0" / "summary.json").write_text(json.dumps({"val_loss": 1.0}))
    _, done = open_run_dir(str(tmp_path), "BASE-seed0", restart=False, push_to_hub=True)
    assert done == {"val_loss": 1.0}
    assert "--push_to_hub: not pushed, the run was complete already" in capsys.readouterr().out
