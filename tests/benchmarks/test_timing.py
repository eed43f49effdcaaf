"""The benchmarks' shared machinery (benchmarks/timing.py)."""

import textwrap

import torch

from benchmarks.timing import flex_key_bias_kernels, records_of_fresh_runs


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


def test_the_flex_kernel_pair_times_the_plain_call_and_the_one_adding_the_key_bias():
    # The benchmark's reason for a flex_attention shortfall rests on this pair: it must be the same causal call,
    # once with the gate's bias added to the scores and once without.
    steps = flex_key_bias_kernels(batch=1, heads=2, length=128, head_dim=16)
    plain, biased = steps["flex_plain"](), steps["flex_key_bias"]()  # (B, T, H, D)
    generator = torch.Generator().manual_seed(0)  # the helper's inputs, drawn again in its order
    q, k, v = (torch.randn(1, 2, 128, 16, generator=generator) for _ in range(3))
    bias = torch.nn.functional.logsigmoid(torch.randn(1, 2, 128, generator=generator))
    causal = torch.ones(128, 128, dtype=torch.bool).tril()
    scores = (q @ k.transpose(-1, -2)) / 4 + bias[:, :, None, :]
    expected = (scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v).transpose(1, 2)
    torch.testing.assert_close(biased, expected, atol=1e-5, rtol=1e-4)
    unbiased = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    torch.testing.assert_close(plain, unbiased, atol=1e-5, rtol=1e-4)
