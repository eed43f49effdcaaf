"""docs/deploy.md works as written: its Python blocks run (one after the other, in one interpreter, as the page
says), and its measured table is the one benchmarks/bench_deploy.py wrote into results/benchmarks/deploy.json."""

import json
import os
import pathlib
import re
import subprocess
import sys

from benchmarks import bench_deploy
from tests.test_readme import python_blocks

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "deploy.md"


def test_the_deploy_pages_python_blocks_run_in_order(tmp_path):
    blocks = python_blocks(PAGE.read_text())
    assert len(blocks) >= 3 and not [block for block in blocks if block["not_run"]]
    script = tmp_path / "deploy.py"
    script.write_text("\n".join(block["code"] for block in blocks))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home"),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, f"--- stdout ---\n{result.stdout[-3000:]}\n--- stderr ---\n{result.stderr[-6000:]}"
    # The first number printed (the exporter prints its progress too) is the ONNX block's largest logit difference
    # from torch's: float32 rounding, not an approximation. The last three are the Δloss of int8 and bf16.
    numbers = [float(line) for line in result.stdout.split() if re.fullmatch(r"-?[0-9.]+(e[-+][0-9]+)?", line)]
    assert len(numbers) == 4 and numbers[0] < 1e-4 and all(abs(delta) < 0.05 for delta in numbers[1:]), result.stdout
    assert (tmp_path / "ega.onnx").is_file()


def test_the_measured_table_is_the_committed_benchmark_record():
    record = json.loads((ROOT / "results" / "benchmarks" / "deploy.json").read_text())
    assert bench_deploy.docs_table(record) in PAGE.read_text(), "regenerate the table: bench_deploy.docs_table"
    assert "--quick" not in record["command"] and {row["model"] for row in record["rows"]} == set(bench_deploy.MODELS)
