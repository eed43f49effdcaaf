"""The EGA-GPT benchmark compares like with like (benchmarks/bench_ega_gpt.py)."""

import pytest

from benchmarks import bench_ega_gpt


@pytest.mark.parametrize("name", ["gpt2", "ega"])
def test_a_training_step_builds_no_cache_for_either_model(name):
    """GPT-2's config asks for a cache (use_cache=True) and EGA-GPT builds none in training: a GPT-2 baseline left
    to build one paid for copies of every layer's keys and values that EGA-GPT did not, in time and memory."""
    model = bench_ega_gpt.build(name, 16, "sdpa")
    caches = []
    model.register_forward_hook(lambda module, args, output: caches.append(output.past_key_values))
    bench_ega_gpt.training_step_fn(model, 1, 16)()
    assert caches == [None]
