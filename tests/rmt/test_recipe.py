"""The reproduction recipe runs end to end at smoke sizes and writes its tables, figures and summary."""

import json
import os
import subprocess
import sys

import pytest

from training.rmt_signal_recovery import main

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_recipe_help():
    result = subprocess.run([sys.executable, "-m", "training.rmt_signal_recovery", "--help"], capture_output=True,
                            text=True, timeout=120, cwd=REPO_ROOT)
    assert result.returncode == 0 and "--smoke" in result.stdout


def test_smoke_run_writes_every_result(tmp_path):
    stale = tmp_path / "model_heads_old.json"  # left in the folder by an earlier command
    stale.write_text("{}")
    os.utime(stale, (stale.stat().st_atime - 86400, stale.stat().st_mtime - 86400))
    results = main(["--smoke", "--out", str(tmp_path)])
    names = {path.name for path in tmp_path.iterdir()}
    for table in ("pooling_snr", "bulk_ks", "outliers", "below_threshold", "raw_table", "harmonic_attention", "ridge",
                  "model_heads", "model_attention"):
        assert {f"{table}.json", f"{table}.md"} <= names
        record = json.loads((tmp_path / f"{table}.json").read_text())
        assert record["rows"] and record["command"] and "hardware" in record
    for figure in ("accuracy_vs_rho.png", "model_pooling_weights.png", "spectrum_delta0.5_gamma0.5.png",
                   "overlap_vs_rho_delta0.5_gamma0.5.png"):
        assert (tmp_path / figure).stat().st_size > 10_000
    readme = (tmp_path / "README.md").read_text()
    assert "| claim | criterion | measured | verdict |" in readme and "Smoke sizes" in readme
    assert "- `pooling_snr.json`" in readme and "model_heads_old" not in readme  # this run's files only
    assert set(results) >= {"snr", "bulk", "outliers", "below", "raw", "harmonic", "ridge", "model"}


def test_a_seed_count_below_one_and_a_file_as_output_folder_are_usage_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--smoke", "--seeds", "0"])
    assert exit_info.value.code == 2
    assert "argument --seeds: must be a positive integer, got 0" in capsys.readouterr().err
    (tmp_path / "afile").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        main(["--smoke", "--out", str(tmp_path / "afile")])
    assert exit_info.value.code == 2 and "exists and is not a folder" in capsys.readouterr().err
