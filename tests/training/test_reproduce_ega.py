"""The EGA reproduction (training/reproduce_ega.py): the runs it plans, its smoke run building both tables from the
files the run_clm runs wrote, and its errors."""

import json

import pytest

from training import reproduce_ega


def test_the_plan_covers_three_seeds_of_the_main_models_and_one_of_every_other_variant(tmp_path, capsys):
    assert reproduce_ega.main(["--dry_run", "--output_dir", str(tmp_path / "runs")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 * (3 * 3 + 7) and all(line.startswith("pending ") for line in lines)
    for benchmark in ("tinyshakespeare", "ptb_char"):
        for run in ("BASE", "EGA-1-causal", "EGA-1-window"):
            assert sum(f" {benchmark}-{run}-seed" in line for line in lines) == 3
        for variant in ("EGA-2", "EGA-4", "EGA-C", "EGA-M-F", "EGA-M", "EGA-DB2", "EGA-DB4"):
            assert sum(f" {benchmark}-{variant}-causal-seed0:" in line for line in lines) == 1
    # The headline comparison comes first, so that a stopped reproduction still has it; each a run of run_clm
    assert all("EGA-1" in line or "BASE" in line for line in lines[:18])
    last = tmp_path / "runs" / "ptb_char" / "EGA-1-window-seed2" / "args.json"
    assert lines[17].endswith(f"python -m training.run_clm {last}")
    assert not (tmp_path / "runs").exists()


def test_smoke_builds_both_tables_from_runs_made_in_their_own_processes(tiny_shakespeare, tiny_ptb_words, tmp_path,
                                                                        monkeypatch, capsys):
    """`--smoke --jobs 2`: BASE and EGA-1 (causal, window) on both corpora, each run a `python -m training.run_clm`
    process started from elsewhere than the checkout, logging to its own file; the tables under the output folder."""
    monkeypatch.setenv("TINYSHAKESPEARE_PATH", tiny_shakespeare)
    monkeypatch.setenv("PTB_PATH", tiny_ptb_words)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "runs"
    arguments = ["--smoke", "--jobs", "2", "--output_dir", str(out), "--data_dir", str(tmp_path / "data"),
                 "--max_steps", "4", "--eval_steps", "2", "--save_steps", "4"]
    assert reproduce_ega.main(arguments) == 0, capsys.readouterr()
    for benchmark in ("tinyshakespeare", "ptb_char"):
        record = json.loads((out / "results" / f"{benchmark}.json").read_text())
        assert [row["model"] for row in record["rows"]] == ["BASE", "EGA-1 (causal)", "EGA-1 (window)"]
        assert record["config"]["max_steps"] == 4 and record["seeds"] == [0]
        assert set(record["paired_deltas"]) == {"EGA-1 (causal) vs BASE", "EGA-1 (window) ordinary loss vs BASE",
                                                "EGA-1 (window) leak-free loss vs BASE"}
        assert len(record["window_leak"]["window_ordinary_minus_leak_free"]) == 1
        for name in ("validation_curves_main.png", "validation_curves_variants.png",
                     "EGA-1-causal_gate_heatmap.png", "EGA-1-window_gate_trajectories.png"):
            assert (out / "results" / f"{benchmark}_{name}").is_file(), name
        assert (out / "logs" / f"{benchmark}-EGA-1-window-seed0.log").is_file()
    table = (out / "results" / "tinyshakespeare.md").read_text()
    assert table.count("| EGA-1 (") == 2 and "## Provenance" in table
    # --aggregate_only writes the tables again from the finished runs; a run missing: none written
    assert reproduce_ega.main(arguments + ["--aggregate_only", "--results_dir", str(tmp_path / "again")]) == 0
    assert json.loads((tmp_path / "again" / "ptb_char.json").read_text())["rows"] == json.loads(
        (out / "results" / "ptb_char.json").read_text())["rows"]
    (out / "ptb_char" / "BASE-seed0" / "README.md").unlink()
    assert reproduce_ega.main(arguments + ["--aggregate_only", "--results_dir", str(tmp_path / "partial")]) == 1
    assert "ptb_char: 1 run(s) not complete (ptb_char-BASE-seed0)" in capsys.readouterr().out
    assert not (tmp_path / "partial" / "ptb_char.json").exists() and (tmp_path / "partial" / "tinyshakespeare.json"
                                                                      ).is_file()


def test_runs_of_a_table_of_record_join_a_new_table_without_being_trained(tiny_shakespeare, tmp_path, monkeypatch,
                                                                         capsys):
    """--add_to_results: the record's runs that --output_dir lacks are read from it, not trained; the table built
    from the record alone is the record's; a run complete here is read from its folder; a record made with other
    arguments is refused."""
    import shutil

    monkeypatch.setenv("TINYSHAKESPEARE_PATH", tiny_shakespeare)
    data = ["--data_dir", str(tmp_path / "data"), "--benchmarks", "tinyshakespeare", "--smoke", "--max_steps", "4",
            "--eval_steps", "2", "--save_steps", "4"]
    first = tmp_path / "first"
    assert reproduce_ega.main(data + ["--output_dir", str(first)]) == 0, capsys.readouterr()
    record_path = first / "results" / "tinyshakespeare.json"
    record = json.loads(record_path.read_text())
    capsys.readouterr()
    # Nothing here: every run is the record's, nothing trains, and the table is the record's
    elsewhere = tmp_path / "elsewhere"
    joined = data + ["--output_dir", str(elsewhere), "--add_to_results", str(record_path)]
    assert reproduce_ega.main(joined + ["--dry_run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"recorded tinyshakespeare-{run}-seed0: read from {record_path}"
                     for run in ("BASE", "EGA-1-causal", "EGA-1-window")]
    assert reproduce_ega.main(joined) == 0
    assert not (elsewhere / "tinyshakespeare").exists()  # nothing trained
    table = json.loads((elsewhere / "results" / "tinyshakespeare.json").read_text())
    assert table["rows"] == record["rows"] and table["paired_deltas"] == record["paired_deltas"]
    assert table["runs"] == record["runs"] and table["gate_by_character"] == record["gate_by_character"]
    assert table["recorded_runs"][0]["command"] == record["command"] and len(table["recorded_runs"][0]["runs"]) == 3
    assert "Read from an earlier table of record" in (elsewhere / "results" / "tinyshakespeare.md").read_text()
    # A run complete here is read from its folder (the others from the record): the same numbers
    shutil.copytree(first / "tinyshakespeare" / "EGA-1-causal-seed0", elsewhere / "tinyshakespeare" /
                    "EGA-1-causal-seed0")
    assert reproduce_ega.main(joined + ["--results_dir", str(tmp_path / "mixed")]) == 0
    mixed = json.loads((tmp_path / "mixed" / "tinyshakespeare.json").read_text())
    assert mixed["rows"] == record["rows"] and len(mixed["recorded_runs"][0]["runs"]) == 2
    # A table written from a record names the command that trained its runs, not the one that read them
    assert reproduce_ega.main(data + ["--output_dir", str(tmp_path / "third"), "--add_to_results", str(
        tmp_path / "mixed" / "tinyshakespeare.json"), "--results_dir", str(tmp_path / "third_results")]) == 0
    third = json.loads((tmp_path / "third_results" / "tinyshakespeare.json").read_text())
    assert [entry["command"] for entry in third["recorded_runs"]] == [record["command"], mixed["command"]]
    assert third["rows"] == record["rows"]
    # Other arguments than the record's: refused, naming the difference
    assert reproduce_ega.main(joined + ["--max_steps", "5", "--dry_run"]) == 2
    assert "holds runs made with other arguments (max_steps: 4 there, 5 here" in capsys.readouterr().err


@pytest.mark.parametrize("arguments, message", [
    (["--jobs", "0"], "argument --jobs: must be a positive integer, got 0"),
    (["--threads", "-1"], "argument --threads: must be a positive integer, got -1"),
    (["--benchmarks", "wikitext"], "argument --benchmarks: invalid choice: 'wikitext'"),
    (["--variants", "EGA-2"], "the reproduction's runs are set by --main_seeds and --other_seeds"),
    (["--add_to_results", "x.json"], "--add_to_results is the table of one corpus"),
    (["--add_to_results", "nowhere.json", "--benchmarks", "ptb_char"], "--add_to_results nowhere.json: not a table"),
])
def test_bad_arguments_end_with_a_one_line_error(arguments, message, tmp_path, capsys):
    assert reproduce_ega.main([*arguments, "--dry_run", "--output_dir", str(tmp_path / "runs")]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("python -m training.reproduce_ega: error: ")
    assert message in errors[0]
