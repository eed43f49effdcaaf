"""The benchmarks' shared machinery (benchmarks/timing.py)."""

import textwrap

from benchmarks.timing import records_of_fresh_runs


def test_fresh_runs_measure_once_whatever_spelling_of_runs_they_were_given(tmp_path):
    # argparse accepts `--run 3` for `--runs 3`: a child handed it back would start runs of its own, forever.
    script = tmp_path / "bench.py"
    script.write_text(textwrap.dedent("""
        import argparse, json, os
        parser = argparse.ArgumentParser()
        parser.add_argument("--runs", type=int, default=1)
        parser.add_argument("--out")
        args = parser.parse_args()
        os.makedirs(args.out, exist_ok=True)
        json.dump({"runs": args.runs}, open(os.path.join(args.out, "r.json"), "w"))
    """))
    records = records_of_fresh_runs(str(script), ["--run", "3", "--out", "elsewhere"], 2, "--out")
    assert records == [{"runs": 1}, {"runs": 1}]
