"""The reproduction driver: which runs it plans, and the table it builds from finished runs."""

import json
import statistics
import sys

import pytest

from training import reproduce_ega
from training.common.jobs import run_logged


def test_the_plan_covers_three_seeds_of_the_main_models_and_one_of_every_other_variant(capsys):
    assert reproduce_ega.main(["--dry_run", "--output_dir", "/nonexistent"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 * (3 * 3 + 7)
    for benchmark in ("tinyshakespeare", "ptb_char"):
        for variant in ("BASE", "EGA-1:causal", "EGA-1:window"):
            assert sum(f"training.{benchmark} " in l and f"--variants {variant} " in l for l in lines) == 3
        for variant in ("EGA-2", "EGA-4", "EGA-C", "EGA-M-F", "EGA-M", "EGA-DB2", "EGA-DB4"):
            assert sum(f"training.{benchmark} " in l and f"--variants {variant}:causal " in l for l in lines) == 1
    # The headline comparison comes first, so that a stopped reproduction still has it.
    assert all("EGA-1" in l or "BASE" in l for l in lines[:18])


def _fake_summary(variant, normalization, seed, val, train, leak_free=None, tau=None, offset=0.0):
    """``offset``: the ordinary loss on the leak-free evaluation's blocks minus ``val`` (another subset)."""
    summary = {"variant": variant, "normalization": normalization, "seed": seed, "val_loss": val, "train_loss": train,
               "generalization_gap": val - train, "train_seconds": 60.0, "preset": {
                   "num_hidden_layers": 4, "num_attention_heads": 4, "hidden_size": 128, "context_length": 128,
                   "batch_size": 16, "max_steps": 800, "warmup_steps": 80, "learning_rate": 1e-3, "dropout": 0.1},
               "log_history": [{"step": 100, "eval_validation_curve_loss": val + 0.5}, {"step": 800, "loss": train}]}
    summary["val_loss_same_blocks"] = val + offset
    if leak_free is not None:
        summary["val_loss_leak_free"] = leak_free
    if tau is not None:
        summary["gates"] = {"tau_mean": tau}
    return summary


def test_aggregation_reports_means_paired_deltas_and_leak_free_comparison(tmp_path):
    out = tmp_path / "runs"
    args = ["--benchmarks", "tinyshakespeare", "--main_seeds", "0", "1", "--other_seeds", "0",
            "--output_dir", str(out), "--results_dir", str(tmp_path / "results")]
    base = {0: 1.50, 1: 1.54}
    for seed in (0, 1):
        # The leak-free blocks score 0.05 higher than the final evaluation's subset, for every model.
        runs = [_fake_summary("BASE", "none", seed, base[seed], base[seed] - 0.05, offset=0.05),
                _fake_summary("EGA-1", "causal", seed, base[seed] - 0.02, base[seed] - 0.06, tau=0.1 * seed, offset=0.05),
                _fake_summary("EGA-1", "window", seed, base[seed] - 0.10, base[seed] - 0.12,
                              leak_free=base[seed] + 0.30, tau=0.3, offset=0.05)]
        if seed == 0:
            runs += [_fake_summary(v, "causal", 0, 1.6, 1.5, tau=0.0)
                     for v in ("EGA-2", "EGA-4", "EGA-C", "EGA-M-F", "EGA-M", "EGA-DB2", "EGA-DB4")]
        for summary in runs:
            name = reproduce_ega.run_name(f"{summary['variant']}:{summary['normalization']}", seed)
            (out / "tinyshakespeare" / name).mkdir(parents=True)
            (out / "tinyshakespeare" / name / "summary.json").write_text(json.dumps(summary))
    assert reproduce_ega.main(args + ["--aggregate_only"]) == 0
    record = json.loads((tmp_path / "results" / "tinyshakespeare.json").read_text())
    rows = {row["model"]: row for row in record["rows"]}
    assert rows["BASE"]["val_loss_mean"] == pytest.approx(1.52)
    assert rows["BASE"]["val_loss_std"] == pytest.approx(statistics.stdev([1.50, 1.54]))
    assert rows["EGA-1 (causal)"]["delta_vs_base"] == pytest.approx(0.02)
    # The window model looks better by its leaky loss but is judged by its leak-free loss, against BASE's loss on
    # the same blocks (base + 0.05), not on the final evaluation's subset.
    assert rows["EGA-1 (window)"]["delta_vs_base"] == pytest.approx(-0.25)
    paired = record["paired_deltas"]
    assert paired["EGA-1 (window) ordinary loss vs BASE"]["mean"] == pytest.approx(0.10)
    assert paired["EGA-1 (window) leak-free loss vs BASE"]["mean"] == pytest.approx(-0.25)
    assert record["window_leak"]["window_ordinary_minus_leak_free"] == pytest.approx([-0.35, -0.35])
    assert rows["EGA-1 (causal)"]["tau_mean"] == pytest.approx(0.05)
    assert rows["EGA-1 (causal)"]["paper val"] == rows["EGA-1 (window)"]["paper val"] == "1.3712"
    assert (tmp_path / "results" / "tinyshakespeare.md").read_text().count("| EGA-") == 9
    assert (tmp_path / "results" / "tinyshakespeare_validation_curves_main.png").is_file()


def test_aggregation_refuses_to_write_results_while_runs_are_missing(tmp_path, capsys):
    code = reproduce_ega.main(["--benchmarks", "ptb_char", "--aggregate_only", "--output_dir", str(tmp_path / "runs"),
                               "--results_dir", str(tmp_path / "results")])
    assert code == 1
    assert "not complete" in capsys.readouterr().out
    assert not (tmp_path / "results").exists()


def test_a_recipe_process_imports_the_checkouts_recipes_from_any_working_directory(tmp_path, monkeypatch):
    """The reproduction scripts start `python -m training.<recipe>`: the child must find the checkout's package
    though it starts elsewhere than the checkout's root and the caller's path came from somewhere else (pytest)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    log = tmp_path / "logs" / "child.log"
    code, _ = run_logged([sys.executable, "-c", "import training.tinyshakespeare"], str(log), "import", "1")
    assert code == 0, log.read_text()


def test_smoke_runs_the_whole_pipeline_at_toy_size(tiny_shakespeare, tmp_path, capsys):
    """`--smoke`: BASE and EGA-1 (causal, window), seed 0, the smoke preset, one recipe process at a time; the
    table lands under the output folder, never in results/ega."""
    out = tmp_path / "runs"
    code = reproduce_ega.main(["--smoke", "--benchmarks", "tinyshakespeare", "--output_dir", str(out),
                               "--max_steps", "4", "--eval_steps", "2", "--save_steps", "4",
                               "--", "--data_path", tiny_shakespeare, "--no_plots"])
    assert code == 0, capsys.readouterr().out[-3000:]
    record = json.loads((out / "results" / "tinyshakespeare.json").read_text())
    assert [row["model"] for row in record["rows"]] == ["BASE", "EGA-1 (causal)", "EGA-1 (window)"]
    assert record["config"]["preset"] == "smoke" and record["seeds"] == [0]
    assert sorted(p.name for p in (out / "logs").iterdir()) == [
        "tinyshakespeare-BASE-seed0.log", "tinyshakespeare-EGA-1-causal-seed0.log", "tinyshakespeare-EGA-1-window-seed0.log"]
    # Rerun, the recipes reuse their complete runs; with other options they refuse them, and so does the
    # reproduction (it once skipped complete runs itself and reported the old runs under the new command)
    log = out / "logs" / "tinyshakespeare-BASE-seed0.log"
    assert reproduce_ega.main(["--smoke", "--benchmarks", "tinyshakespeare", "--output_dir", str(out),
                               "--max_steps", "4", "--eval_steps", "2", "--save_steps", "4",
                               "--", "--data_path", tiny_shakespeare, "--no_plots"]) == 0
    assert "complete already" in log.read_text()
    table = (out / "results" / "tinyshakespeare.json").read_text()
    assert reproduce_ega.main(["--smoke", "--benchmarks", "tinyshakespeare", "--output_dir", str(out),
                               "--max_steps", "5", "--eval_steps", "2", "--save_steps", "4",
                               "--", "--data_path", tiny_shakespeare, "--no_plots"]) == 1
    assert "holds a run made with other settings (max_steps: 4 there, 5 now)" in log.read_text()
    assert (out / "results" / "tinyshakespeare.json").read_text() == table, "the old runs' table is left as it was"


def test_smoke_refuses_another_preset():
    with pytest.raises(SystemExit):
        reproduce_ega.main(["--smoke", "--preset", "cpu", "--dry_run"])



@pytest.mark.parametrize("module, arguments", [
    ("reproduce_ega", ["--dry_run", "--threads", "0"]), ("reproduce_ega", ["--dry_run", "--jobs", "0"]),
    ("reproduce_chiar", ["--dry_run", "--threads", "-1"]), ("reproduce_chiar", ["--dry_run", "--jobs", "0"]),
])
def test_thread_and_job_counts_below_one_are_usage_errors(module, arguments, capsys):
    import importlib

    with pytest.raises(SystemExit) as exit_info:
        importlib.import_module(f"training.{module}").main(arguments)
    assert exit_info.value.code == 2
    assert f"argument {arguments[-2]}: must be a positive integer, got {arguments[-1]}" in capsys.readouterr().err
