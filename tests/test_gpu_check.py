"""The GPU check's machinery on a CPU: benchmarks/gpu_check.sh and benchmarks/bench_gpu.py.

The check runs once on a lent GPU, with no chance to fix it there, so every step it takes is run here: the script's
environment probe, its refusal without CUDA, the test discovery, the benchmark's every measurement (tiny sizes,
float32, ``--device cpu --tiny``), the report of a backend a model refuses, the results files with every section,
and the copy to ``$OUT``.
"""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "gpu_check.sh")


def run_script(tmp_path, *args, **env):
    # CUDA_VISIBLE_DEVICES="": the same on a machine with a GPU (the real check is not started from a test).
    environment = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": "", "GPU_CHECK_RESULTS": str(tmp_path / "results"),
                   "OUT": str(tmp_path / "out"), **env}
    return subprocess.run(["bash", SCRIPT, *args], cwd=tmp_path, env=environment, capture_output=True, text=True,
                          timeout=600)


def test_script_parses():
    subprocess.run(["bash", "-n", SCRIPT], check=True)


FAKE_CUDA_TESTS = {
    "test_cuda_fake.py": """
import pytest

def test_passes():
    pass

def test_fails():
    assert False, "planted failure"

@pytest.mark.skip(reason="needs CUDA")
def test_skipped():
    pass
""",
    "test_other.py": """
import pytest

@pytest.mark.{cuda_marker}
def test_marked_cuda():
    pass

def test_not_marked():
    raise AssertionError("a test without the cuda marker must not run")
""".format(cuda_marker="cuda"),  # formatted: this file itself must not look like one with marked CUDA tests
    "test_unrelated.py": "def test_never_collected():\n    raise AssertionError('not a CUDA test')\n",
}


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """The whole check in CPU mode, run from another folder (the script finds the repository itself), on planted CUDA
    tests (one fails), with a backend no model knows beside SDPA."""
    tmp_path = tmp_path_factory.mktemp("gpu_check")
    tests = tmp_path / "cuda_tests"
    tests.mkdir()
    for name, text in FAKE_CUDA_TESTS.items():
        (tests / name).write_text(text)
    result = run_script(tmp_path, "--", "--backends", "sdpa", "not_a_backend", GPU_CHECK_CPU="1",
                        GPU_CHECK_TESTS_DIR=str(tests))
    return tmp_path, result


def test_cpu_run_completes_and_copies_results(cpu_run):
    tmp_path, result = cpu_run
    # Exit 1: the benchmark completed, a (planted) CUDA test failed.
    assert result.returncode == 1, result.stdout[-4000:] + result.stderr[-4000:]
    assert "CUDA tests FAILED" in result.stdout
    assert "finished in" in result.stdout
    copied = sorted(os.listdir(tmp_path / "out"))
    assert copied == ["gpu_check.log", "gpu_tests.log", "gpu_tiny.json", "gpu_tiny.md"]
    for name in copied:
        with open(tmp_path / "results" / name, encoding="utf-8") as a, open(tmp_path / "out" / name, encoding="utf-8") as b:
            assert a.read() == b.read(), name


def test_cpu_run_reports_the_cuda_tests(cpu_run):
    tmp_path, _ = cpu_run
    with open(tmp_path / "results" / "gpu_tiny.json", encoding="utf-8") as handle:
        lines = json.load(handle)["tests"]
    text = "\n".join(lines)
    assert any(line.startswith("PASSED") and "test_cuda_fake.py::test_passes" in line for line in lines), text
    assert any(line.startswith("FAILED") and "test_cuda_fake.py::test_fails" in line for line in lines), text
    assert any(line.startswith("SKIPPED") and "needs CUDA" in line for line in lines), text
    assert any(line.startswith("PASSED") and "test_other.py::test_marked_cuda" in line for line in lines), text
    assert "test_not_marked" not in text and "test_never_collected" not in text
    assert any("CUDA tests FAILED" in line for line in lines), text


def test_cpu_run_measures_every_section(cpu_run):
    tmp_path, _ = cpu_run
    with open(tmp_path / "results" / "gpu_tiny.json", encoding="utf-8") as handle:
        record = json.load(handle)
    assert record["complete"] is True
    assert record["environment"]["torch"] and record["environment"]["transformers"]
    assert "--backends sdpa not_a_backend" in record["command"]
    rows = record["rows"]

    def ok(section, measurement, size=None, length=None):
        found = [r for r in rows if r["section"] == section and r["measurement"] == measurement
                 and r["backend"] == "sdpa" and (size is None or r["size"] == size)
                 and (length is None or r["length"] == length) and r["status"] == "ok"]
        return {r["model"]: r for r in found}

    for size in ("2x64", "2x96"):
        for measurement in ("train", "forward"):
            models = ok("ega", measurement, size=size)
            assert set(models) == {"gpt2", "ega_base", "ega1"}, (size, measurement, rows)
            assert models["gpt2"]["ratio_vs_baseline"] == 1.0
            assert all(r["tokens_per_s"] > 0 and r["repeats"] >= 3 for r in models.values())
        for cache, cache_class in (("dynamic", "DynamicCache"), ("static", "StaticCache")):
            models = ok("ega", f"generate ({cache} cache)", size=size)
            assert set(models) == {"gpt2", "ega1"}, (size, cache, rows)
            assert {r["cache_class"] for r in models.values()} == {cache_class}
    for length in (64, 128):
        for measurement in ("train", "forward"):
            models = ok("chiar", measurement, length=length)
            assert set(models) == {"all_attention", "chiar"}, (length, measurement, rows)
            fractions = models["chiar"]["attention_fraction"]
            assert len(fractions) == 2 and all(0.05 <= f <= 0.5 for f in fractions), fractions

    refused = [r for r in rows if r["backend"] == "not_a_backend"]
    assert {(r["section"], r["model"]) for r in refused} >= {
        ("ega", "gpt2"), ("ega", "ega_base"), ("ega", "ega1"), ("chiar", "all_attention"), ("chiar", "chiar")
    }
    assert all(r["status"].startswith("not supported: ") for r in refused)
    assert set(record["elapsed_s"]) >= {"ega 2x64 sdpa", "ega 2x96 sdpa", "chiar T=64 B=2 sdpa",
                                        "chiar T=128 B=1 sdpa", "total"}
    assert any(line.startswith("- **GPU target**") for line in record["targets"])


def test_cpu_run_markdown_has_every_section(cpu_run):
    tmp_path, _ = cpu_run
    with open(tmp_path / "results" / "gpu_tiny.md", encoding="utf-8") as handle:
        text = handle.read()
    for heading in ("## Targets", "## CUDA tests", "## EGA-1 vs GPT2LMHeadModel", "## CHIAR-Former vs all-attention",
                    "## Elapsed time per section", "## How to read this", "## Provenance"):
        assert heading in text, heading
    assert "Partial results" not in text
    assert "run by `GPU_CHECK_CPU=1 bash benchmarks/gpu_check.sh -- --backends sdpa not_a_backend`" in text
    assert "not supported: " in text
    # The CUDA tests' outcome lines from the script's pytest log are in the results.
    assert "GPU check" in text.split("## CUDA tests", 1)[1].split("##", 1)[0]


def test_script_stops_without_cuda(tmp_path):
    result = run_script(tmp_path)
    assert result.returncode == 2, result.stdout[-4000:] + result.stderr[-4000:]
    assert "torch.cuda.is_available() is False" in result.stdout
    # Nothing measured, nothing written but the log, which still reaches $OUT.
    assert os.listdir(tmp_path / "out") == ["gpu_check.log"]
    assert not os.path.exists(tmp_path / "results" / "gpu.md")


def test_script_stops_when_torch_is_missing(tmp_path):
    result = run_script(tmp_path, PYTHON="/bin/false")
    assert result.returncode == 3
    assert "cannot import torch" in result.stdout


def test_tests_summary_of_a_run_stopped_at_its_limit(tmp_path):
    """A pytest run killed by the time limit prints no summary: its per-test lines (-v) are kept instead."""
    from benchmarks.bench_gpu import read_tests_summary

    log = tmp_path / "gpu_tests.log"
    log.write_text("collected 2 items\n\ntests/a.py::test_x PASSED [ 50%]\ntests/a.py::test_y FAILED [100%]\n"
                   "GPU check [160 s]: CUDA tests STOPPED at their 150 s limit\n")
    assert read_tests_summary(str(log)) == [
        "tests/a.py::test_x PASSED [ 50%]", "tests/a.py::test_y FAILED [100%]",
        "GPU check [160 s]: CUDA tests STOPPED at their 150 s limit",
    ]
    assert read_tests_summary(str(tmp_path / "missing.log")) == [f"(no test log at {tmp_path / 'missing.log'})"]


def test_a_benchmark_that_measured_nothing_fails(tmp_path, capsys):
    """A check whose every row failed or was refused must not pass as green."""
    from benchmarks.bench_gpu import main

    with pytest.raises(SystemExit, match="measured nothing"):
        main(["--device", "cpu", "--tiny", "--sections", "chiar", "--backends", "not_a_backend",
              "--out", str(tmp_path)])
