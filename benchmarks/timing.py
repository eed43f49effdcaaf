"""Timing shared by the benchmark scripts: models measured in alternation, compared as ratios of medians.

Alternating step by step (A, B, C, A, B, C, ...) means that load from other processes, thermal state and
allocator warm-up hit every model alike. Each call is timed twice: wall-clock, and the CPU time of this process
(``time.process_time``). Run single-threaded (``torch.set_num_threads(1)``), CPU time counts only this
process's own work, so its ratios hold on a machine shared with other jobs, where wall-clock ratios drift.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def time_alternating(fns: dict, repeats: int, warmup: int = 2, before_each=None) -> dict:
    """Call each function in turn ``repeats`` times (after ``warmup`` rounds); ``before_each``, if given, runs
    untimed before every timed call (e.g. to evict the CPU caches).

    Returns ``{"wall": {name: [seconds, ...]}, "cpu": {name: [seconds, ...]}}``.
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {"wall": {name: [] for name in fns}, "cpu": {name: [] for name in fns}}
    for _ in range(repeats):
        for name, fn in fns.items():
            if before_each is not None:
                before_each()
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            times["cpu"][name].append(time.process_time() - cpu)
            times["wall"][name].append(time.perf_counter() - wall)
    return times


def speed_ratio(times: dict, name: str, baseline: str) -> float:
    """Throughput of ``name`` relative to ``baseline`` (> 1: faster), from the medians of ``times[name]``."""
    return statistics.median(times[baseline]) / statistics.median(times[name])


def folded_head_kernels(batch: int, heads: int, length: int, head_dim: int, backward: bool, seed: int = 0) -> dict:
    """torch's causal SDPA kernel alone at a model's head size D and at the folded D + 1 (the energy gate's channel
    under SDPA): ``{"head_D": step, "head_D+1": step}``, each a forward, or a forward and backward, on random inputs."""
    import torch

    generator = torch.Generator().manual_seed(seed)

    def kernel(width):
        shape = (batch, heads, length, width)
        q, k, v = (torch.randn(shape, generator=generator, requires_grad=backward) for _ in range(3))
        if not backward:
            return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        grad = torch.randn(shape, generator=generator)

        def step():
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)
            q.grad = k.grad = v.grad = None

        return step

    return {f"head_{head_dim}": kernel(head_dim), f"head_{head_dim + 1}": kernel(head_dim + 1)}


def flex_key_bias_kernels(batch: int, heads: int, length: int, head_dim: int, seed: int = 0) -> dict:
    """The causal flex_attention call EGA-GPT makes under ``attn_implementation="flex_attention"`` (on CPU: the
    kernel compiled for static shapes), alone, forward only, plain and with the gate's ``score_mod`` adding a key
    bias: ``{"flex_plain": step, "flex_key_bias": step}``, on random inputs."""
    import torch

    from hf_spectral.ops.gated_attention import flex_attention_with_key_bias

    generator = torch.Generator().manual_seed(seed)
    module = torch.nn.Module().eval()  # the call reads the module's `is_causal` (default) and grouping only
    q, k, v = (torch.randn(batch, heads, length, head_dim, generator=generator) for _ in range(3))
    bias = torch.nn.functional.logsigmoid(torch.randn(batch, heads, length, generator=generator))

    def kernel(key_bias):
        @torch.no_grad()
        def step():
            return flex_attention_with_key_bias(module, q, k, v, key_bias, None, head_dim**-0.5)[0]

        return step

    return {"flex_plain": kernel(None), "flex_key_bias": kernel(bias)}


def peak_rss_growth_mib(step) -> float:
    """Peak resident-memory growth (MiB) of running ``step()`` twice; call in a fresh process for a clean figure."""
    import os
    import resource

    with open("/proc/self/statm") as handle:
        before = int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    step()
    step()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before


def records_of_fresh_runs(script: str, argv: list[str], runs: int, out_option: str) -> list[dict]:
    """Run the benchmark ``script`` ``runs`` times, each in a fresh process, with the options ``argv`` (less its
    ``--runs`` and ``out_option``) and its results written into a temporary folder through ``out_option``; return
    each run's JSON record. Ratios taken in one process on a shared machine move by several points in the next."""
    options, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--runs", out_option):
            skip = True
        elif not arg.startswith(("--runs=", out_option + "=")):
            options.append(arg)
    records = []
    with tempfile.TemporaryDirectory() as folder:
        for run in range(runs):
            out = os.path.join(folder, str(run))
            # `--runs 1` last: it wins over any spelling of --runs left in the options (argparse takes `--run 3`
            # too), so that a child never starts runs of its own.
            subprocess.run([sys.executable, os.path.abspath(script), *options, out_option, out, "--runs", "1"],
                           check=True)
            (name,) = [f for f in os.listdir(out) if f.endswith(".json")]
            with open(os.path.join(out, name)) as file:
                records.append(json.load(file))
    return records


def spread_over_runs(ratios: list[float]) -> dict:
    """A ratio measured once per run: its median, range and each run's value (``per_run``, 3 decimals)."""
    return {"median_ratio": statistics.median(ratios), "min_ratio": min(ratios), "max_ratio": max(ratios),
            "per_run": " / ".join(f"{ratio:.3f}" for ratio in ratios)}
