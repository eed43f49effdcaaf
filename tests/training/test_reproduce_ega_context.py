"""The context sweep (training/reproduce_ega_context.py): the runs it plans (same tokens per step at every context,
the queue seed by seed, the τ runs last), its smoke run building the tables from the files the run_clm runs wrote,
partial tables, and its errors."""

import json
import statistics

import pytest

from training import reproduce_ega_context
from training.common import ega_context


def planned(argv):
    args, tokens, preset, output_dir, _ = reproduce_ega_context.options(argv, "prog")
    return reproduce_ega_context.plan(args, tokens, preset, output_dir)


def test_every_context_reads_the_same_tokens_with_the_same_model_and_steps(tmp_path, capsys):
    sweep, taus, order = planned(["--output_dir", str(tmp_path / "runs")])
    assert len(sweep) == 2 * 4 * 2 * 3 and sorted(taus) == [-0.5, 0.0, 1.0] and len(order) == len(sweep) + 3
    for (benchmark, context, variant, normalization, seed), run in sweep.items():
        arguments = run.arguments
        assert arguments["block_size"] == context and arguments["per_device_train_batch_size"] * context == 2048
        assert f"max_position_embeddings={context}," in arguments["config_overrides"]
        assert "num_hidden_layers=4,num_attention_heads=4,hidden_size=128" in arguments["config_overrides"]
        assert arguments["max_steps"] == 800 and arguments["warmup_steps"] == 80 and arguments["seed"] == seed
        assert arguments["position_loss_buckets"] == context // 16 and arguments["char_eos_and_pad"] is False
        # the blocks evaluated scale with the context: the same tokens (the cpu configuration: 160 and 1000 at 128)
        assert arguments["eval_samples_during_training"] * context == 160 * 128
        assert arguments["train_eval_samples"] * context == 1000 * 128
        assert ("energy_normalization=causal" in arguments["config_overrides"]) == (variant == "EGA-1")
    # context 128 is the cpu configuration of results/ega, run for run
    from training.common.experiments import config

    same = sweep["tinyshakespeare", 128, "EGA-1", "causal", 1].arguments
    reference = config("tinyshakespeare_cpu")
    assert {key: same[key] for key in reference if key not in ("output_dir", "train_file", "validation_file",
                                                               "config_overrides", "variant", "seed")} == {
        key: value for key, value in reference.items() if key not in ("output_dir", "train_file", "validation_file",
                                                                      "config_overrides", "variant", "seed")}
    # the queue: every context and corpus of seed 0, then seed 1, then seed 2, then the τ runs
    assert [run.arguments["seed"] for run in order[:48]] == [0] * 16 + [1] * 16 + [2] * 16
    for init, run in taus.items():
        assert run is order[48 + sorted(taus).index(init)] and run.arguments["max_steps"] == 2000
        assert run.arguments["warmup_steps"] == 160 and run.arguments["block_size"] == 128
        assert f"gate_tau_init={json.dumps(init)}" in run.arguments["config_overrides"]
    assert reproduce_ega_context.main(["--dry_run", "--output_dir", str(tmp_path / "runs")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 51 and all(line.startswith("pending ") for line in lines)
    assert lines[-1].startswith("pending tau+1-tinyshakespeare-context128-EGA-1-causal-seed0: python -m "
                                "training.run_clm ")
    assert not (tmp_path / "runs").exists()


def test_position_groups_are_the_same_positions_at_every_context():
    buckets = {"01-15": 1.0, "16-31": 2.0, "32-47": 3.0, "48-63": 5.0}
    assert ega_context.position_groups(buckets) == [(1, 15, 1.0), (16, 31, 2.0), (32, 63, 4.0)]
    wide = {f"{16 * k:03d}-{16 * k + 15:03d}": float(k) for k in range(1, 8)} | {"001-015": 0.0}
    groups = ega_context.position_groups(wide)
    assert [(first, last) for first, last, _ in groups] == [(1, 15), (16, 31), (32, 63), (64, 127)]
    assert groups[3][2] == pytest.approx(statistics.fmean([4.0, 5.0, 6.0, 7.0]))
    # the first group has one prediction fewer than the others: means weight each bucket by its predictions
    assert ega_context.position_groups({"1-3": 0.0, "4-7": 1.0, "8-15": 2.0})[0] == (1, 3, 0.0)
    assert ega_context.position_groups({"1-3": 0.0, "4-7": 1.0, "8-15": 2.0})[2] == (8, 15, 2.0)
    assert ega_context.position_groups({"1-3": 0.0, "4-5": 1.0, "6-7": 3.0})[1] == (4, 7, 2.0)


def test_smoke_builds_the_tables_from_the_runs_and_says_when_they_are_partial(tiny_shakespeare, tmp_path,
                                                                             monkeypatch, capsys):
    monkeypatch.setenv("TINYSHAKESPEARE_PATH", tiny_shakespeare)
    out = tmp_path / "runs"
    arguments = ["--smoke", "--benchmarks", "tinyshakespeare", "--seeds", "0", "1", "--contexts", "16", "32",
                 "--tau_inits", "1", "--max_steps", "4", "--eval_steps", "2", "--save_steps", "4",
                 "--output_dir", str(out), "--data_dir", str(tmp_path / "data")]
    assert reproduce_ega_context.main(arguments) == 0, capsys.readouterr()
    results = out / "results"
    record = json.loads((results / "context_sweep.json").read_text())
    assert record["complete_runs"] == record["planned_runs"] == 8 and "partial" not in record["title"]
    assert [(row["context"], row["batch"]) for row in record["rows"]] == [(16, 8), (32, 4)]
    runs = {(found["context"], found["variant"], found["seed"]): found for found in record["runs"]}
    for context in (16, 32):
        folder = out / "tinyshakespeare" / f"context{context}"
        written = {(variant, seed): json.loads((folder / f"{name}-seed{seed}" / "all_results.json").read_text())
                   for variant, name in (("BASE", "BASE"), ("EGA-1", "EGA-1-causal")) for seed in (0, 1)}
        deltas = [written["BASE", seed]["eval_loss"] - written["EGA-1", seed]["eval_loss"] for seed in (0, 1)]
        delta = record["paired_deltas"][f"tinyshakespeare context {context}"]
        assert delta["per_seed"] == pytest.approx(deltas) and delta["mean"] == pytest.approx(sum(deltas) / 2)
        # the loss per position: the buckets of 8 positions the runs wrote, merged into 1-7, 8-15, 16-31
        assert set(runs[context, "BASE", 0]["position_loss"]) == ({"01-07", "08-15"} if context == 16 else
                                                                 {"01-07", "08-15", "16-23", "24-31"})
        groups = record["position_deltas"][f"tinyshakespeare context {context}"]["groups"]
        assert list(groups) == (["1-7", "8-15"] if context == 16 else ["1-7", "8-15", "16-31"])
        last = ["08-15"] if context == 16 else ["16-23", "24-31"]  # the last group: buckets of 8 predictions each

        def late(result):
            return statistics.fmean(result[f"eval_position_loss_{span}"] for span in last)

        expected = [late(written["BASE", seed]) - late(written["EGA-1", seed]) for seed in (0, 1)]
        assert groups[list(groups)[-1]]["delta"]["per_seed"] == pytest.approx(expected)
    # the trend: with two contexts one doubling apart, the slope is the difference of the mean deltas
    (trend,) = record["trend"]
    means = [record["paired_deltas"][f"tinyshakespeare context {context}"]["mean"] for context in (16, 32)]
    assert trend["points"] == 4 and trend["slope"] == pytest.approx(means[1] - means[0])
    assert trend["last_minus_first"] == pytest.approx(means[1] - means[0])
    table = (results / "context_sweep.md").read_text()
    assert "Δ by position of the predicted token" in table and "## Provenance" in table
    tau = json.loads((results / "tau_init.json").read_text())
    assert [row["τ init"] for row in tau["rows"]] == ["+1"]
    (found,) = tau["runs"]
    assert found["steps"] == 8 and found["tau_trajectory"][0][0] == 1  # logged from the first step
    assert found["tau_trajectory"][0][1] == pytest.approx(1.0, abs=0.05) and len(found["tau_at"]) == 4
    for name in ("delta_vs_context.png", "position_delta.png", "tau_trajectories.png"):
        assert (results / name).stat().st_size > 0, name
    # a run missing: the tables are written from the others, and say so
    (out / "tinyshakespeare" / "context32" / "BASE-seed1" / "README.md").unlink()
    again = tmp_path / "again"
    assert reproduce_ega_context.main(arguments + ["--aggregate_only", "--results_dir", str(again)]) == 0
    partial = json.loads((again / "context_sweep.json").read_text())
    assert partial["complete_runs"] == 7 and partial["title"].endswith("(partial: 7 of 8 runs complete)")
    assert partial["paired_deltas"]["tinyshakespeare context 32"]["seeds"] == [0]
    assert partial["rows"][0] == record["rows"][0]  # context 16: all its runs are there
    assert "**Partial**: 7 of 8" in (again / "context_sweep.md").read_text()
    # --add_to_results: a sweep going on elsewhere from the table of record trains only what the record lacks
    elsewhere = [argument if argument != str(out) else str(tmp_path / "elsewhere") for argument in arguments]
    joined = elsewhere + ["--add_to_results", str(again / "context_sweep.json")]
    assert reproduce_ega_context.main(joined + ["--dry_run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len([line for line in lines if line.startswith("recorded ")]) == 7
    assert [line.split(":")[0] for line in lines if line.startswith("pending ")] == [
        "pending tinyshakespeare-context32-BASE-seed1", "pending tau+1-tinyshakespeare-context16-EGA-1-causal-seed0"]
    third = tmp_path / "third"
    assert reproduce_ega_context.main(joined + ["--aggregate_only", "--results_dir", str(third)]) == 0
    read = json.loads((third / "context_sweep.json").read_text())
    assert read["rows"] == partial["rows"] and read["paired_deltas"] == partial["paired_deltas"]
    assert read["recorded_runs"][0]["command"] == partial["command"] and len(read["recorded_runs"][0]["runs"]) == 7
    assert all(found["arguments"]["max_steps"] == 4 for found in read["runs"])  # kept for the next record
    # a record made with other arguments is refused, naming the difference
    assert reproduce_ega_context.main(joined + ["--dry_run", "--learning_rate", "0.5"]) == 2
    assert "other arguments (tinyshakespeare-context16-BASE-seed0: learning_rate: 0.0003 there, 0.5 here" in (
        capsys.readouterr().err)
    # a record of the first sweep (no arguments per run) is checked by its configuration and each run's settings
    for found in partial["runs"]:
        found.pop("arguments")
    (third / "older.json").write_text(json.dumps(partial))
    older = elsewhere + ["--add_to_results", str(third / "older.json"), "--dry_run"]
    assert reproduce_ega_context.main(older) == 0
    assert len([line for line in capsys.readouterr().out.splitlines() if line.startswith("recorded ")]) == 7
    assert reproduce_ega_context.main(older + ["--max_steps", "5"]) == 2
    assert "max_steps: 4 there, 5 here" in capsys.readouterr().err


@pytest.mark.parametrize("arguments, message", [
    (["--contexts", "64", "96"], "--tokens_per_step 2048 is not a multiple of the context 96"),
    (["--contexts", "24", "--tokens_per_step", "48"], "the context 24 is not a multiple of --bucket_width 16"),
    (["--context_length", "256"], "the contexts and batches are set by --contexts and --tokens_per_step"),
    (["--tau_inits", "nan"], "argument --tau_inits: must be finite, got nan"),
    (["--benchmarks", "wikitext"], "argument --benchmarks: invalid choice: 'wikitext'"),
])
def test_bad_arguments_end_with_a_one_line_error(arguments, message, tmp_path, capsys):
    assert reproduce_ega_context.main([*arguments, "--dry_run", "--output_dir", str(tmp_path / "runs")]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("python -m training.reproduce_ega_context: error: ")
    assert message in errors[0]
