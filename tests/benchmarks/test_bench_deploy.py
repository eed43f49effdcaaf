"""The deployment benchmark (benchmarks/bench_deploy.py) runs every path on every model, records the paths that
fail instead of stopping, and finds the exported EGA-GPT and retrofitted GPT-2 equal to torch."""

import json

import pytest

from benchmarks import bench_deploy

# ONNX runs the same fp32 arithmetic in another order: logits agree to float32 rounding (≈ 2e-7 measured on a
# Xeon); the bound leaves room for other CPUs' kernels. Quantized and bf16 paths change the loss by ~1e-3 at most
# on these tiny models; 0.05 nats would be a broken path, not rounding.
ONNX_LOGIT_TOLERANCE = 1e-4
LOSSY_LOSS_TOLERANCE = 0.05


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deploy")
    corpus = folder / "input.txt"  # a small stand-in for TinyShakespeare: the test needs no data set
    corpus.write_text("".join(f"{i}: To be, or not to be, that is the question;\n" for i in range(300)))
    bench_deploy.main(["--quick", "--data_path", str(corpus), "--out", str(folder / "out")])
    assert (folder / "out" / "deploy_quick.md").read_text().startswith("# Deployment paths")
    return json.loads((folder / "out" / "deploy_quick.json").read_text())


def rows_of(record, model):
    return {row["path"]: row for row in record["rows"] if row["model"] == model}


def test_every_model_gets_a_row_per_path_with_the_command_and_hardware(record):
    assert [(row["model"], row["path"]) for row in record["rows"]] == [
        (model, path) for model in bench_deploy.MODELS for path in bench_deploy.PATHS]
    assert "--quick" in record["command"] and record["hardware"]["torch"] and record["seeds"] == [0]
    for row in record["rows"]:
        if row["works"] == "yes":
            assert row["loss"] > 0 and row["max_abs_delta_logit"] is not None and row["error"] is None
        else:  # a failing path says why, and has no numbers
            assert row["error"] and row["loss"] is None and row["delta_loss"] is None


@pytest.mark.parametrize("model", ["ega-gpt", "retrofitted-gpt2"])
def test_onnx_export_runs_in_onnxruntime_with_torchs_logits(record, model):
    onnx = rows_of(record, model)["onnxruntime"]
    assert onnx["works"] == "yes", onnx["error"]
    assert onnx["max_abs_delta_logit"] <= ONNX_LOGIT_TOLERANCE and abs(onnx["delta_loss"]) <= 1e-5


@pytest.mark.parametrize("model", bench_deploy.MODELS)
def test_quantized_and_bf16_paths_work_and_change_the_loss_a_little(record, model):
    rows = rows_of(record, model)
    for path in ("int8-dynamic", "torchao-int8-weight-only", "bf16"):
        assert rows[path]["works"] == "yes", rows[path]["error"]
        assert 0 < rows[path]["max_abs_delta_logit"] and abs(rows[path]["delta_loss"]) <= LOSSY_LOSS_TOLERANCE
    assert rows["bf16"]["size_mib"] < 0.6 * rows["fp32-eager"]["size_mib"]
    # CHIAR-Former's torch paths also say how many routing decisions rounding changed; the others have no routing
    routed = [rows[path]["routes_changed"] for path in ("fp32-eager", "int8-dynamic", "torchao-int8-weight-only", "bf16")]
    if model == "chiar-former":
        assert routed[0] == 0.0 and all(0.0 <= share <= 1.0 for share in routed)
    else:
        assert routed == [None] * 4
