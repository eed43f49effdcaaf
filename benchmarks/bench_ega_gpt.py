"""EGA-1 (causal statistics, every layer gated) against a GPT of the same width and depth, like for like: the same
attention backend, the same cache class, the same run, measured as ratios.

    python benchmarks/bench_ega_gpt.py                     # full run, writes results/benchmarks/ega_gpt.{json,md}
    python benchmarks/bench_ega_gpt.py --quick             # a few minutes, writes ega_gpt_quick.{json,md}
    python benchmarks/bench_ega_gpt.py --backends sdpa --threads 1

Measured, per attention backend and thread count: training tokens/s (forward + backward + AdamW step) at T = 256
and T = 1024, inference forward tokens/s, cached generation tokens/s at batch 1 / 8 / 32 (greedy, a fixed number of
new tokens, both models given the same cache class), and the peak memory of a training step (peak RSS growth of a
fresh process).

Baselines. Under ``sdpa`` the baseline is ``GPT2LMHeadModel`` (exact GELU, tied embeddings). transformers' GPT-2 does
not support ``flex_attention``, so under ``flex_attention`` the baseline is EGA-GPT without gates
(``energy_gate_layers=[]``: the same GPT with transformers' flex attention and no gate); under ``sdpa`` that model is
measured too, to separate the gate's cost from our GPT's. flex_attention runs as transformers runs it: its kernel
compiled with ``torch.compile`` (on CPU too), the rest of the model eager. torch's flex_attention has no backward
pass on CPU, so training and its memory are measured under ``sdpa`` only.

With ``--compiled-generation``, generation is also measured the way transformers makes it fast: a ``StaticCache``
and each model's forward under ``torch.compile(fullgraph=True)`` (one graph per shape, no host read of the cache
length), the same for every model (``compiled-generate_*`` rows). ``--only`` restricts a run to some measurements.

Each ratio is printed beside its target (training, forward and generation ≥ 0.95×, memory ≤ 1.10×); a missed
target is reported with its shortfall and the reason found for it.
"""

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.timing import (  # noqa: E402
    flex_key_bias_kernels,
    folded_head_kernels,
    peak_rss_growth_mib,
    records_of_fresh_runs,
    speed_ratio,
    spread_over_runs,
    time_alternating,
)
from training.common.cli import positive_int  # noqa: E402  (the recipes' argument types)

# Layers × width (heads of 32 channels, GPT-2 small's 12 of 64); a character vocabulary, so that the layers, not the
# output projection, take the time. `--size` picks one; SIZE is the one this run measures.
SIZES = {
    "6x256": dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=8, vocab_size=65),
    "4x256": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, vocab_size=65),
    "12x768": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, vocab_size=65),
}
SIZE = dict(SIZES["6x256"])
SPEED_TARGET, MEMORY_TARGET = 0.95, 1.10
BACKENDS = ("sdpa", "flex_attention", "eager")  # what --backends may name

# What the measurements showed when a target was missed (the gate's work that the baseline does not do).
REASONS = {
    "train": "under SDPA the gate is one more channel per head (D + 1), which torch's CPU flash kernel runs markedly "
    "slower than D (the sdpa_kernel row: the kernel alone), plus the copies that fold it in (one per q, k, v) "
    "and the gate's own work (per-key energies, running moments, a log-sigmoid per head)",
    "forward": "the folded head (D + 1 channels, slower in torch's CPU flash kernel: the sdpa_kernel row), its "
    "copies (one per q, k, v), and the gate's energies and moments",
    "forward_flex_attention": "the gate's energies, running moments and log-sigmoid, and the key bias its score_mod "
    "reads inside torch's compiled CPU flex kernel (the flex_kernel row: the kernel alone, with and without it; "
    "under flex_attention there is no extra channel and no copy)",
    "generate": "a gated attention layer's decoding step dispatches {gated} torch ops against the ungated layer's "
    "{ungated} (counted in this run: the gate's energy projection, running-moment update and log-sigmoid, the "
    "writes of each key's bias and state into the cache beside it, the bias as SDPA's mask; several are views) on "
    "tensors of a few hundred values: bound by op dispatch, not arithmetic",
    "memory": "the folded channel stores q, k and v once more (D + 1 channels) for the backward pass",
    "compiled-generate": "compiled, the gate's per-step ops fuse into a few kernels; what stays is arithmetic "
    "the baseline does not do: the gate's energy projection, its cache writes (each key's bias and running "
    "moments), and SDPA with the bias as an additive mask",
    "generate_flex_attention": "the gate's per-step ops as under SDPA; besides, on CPU both models compile "
    "flex_attention for static shapes (with dynamic ones torch 2.13's CPU flex template cannot build kernels reading "
    "a captured tensor), so every new key length recompiles and, past dynamo's recompilation limit, runs "
    "uncompiled: short runs are dominated by compilation",
    "generate_flex_attention_static": "the gate's per-step ops, eager around the compiled flex kernel as under "
    "SDPA (a gated layer's decoding step dispatches {gated} torch ops against the ungated layer's {ungated}, counted "
    "under SDPA in this run); with a StaticCache the flex kernel compiles once per shape for both models",
}


@functools.cache
def decode_step_op_counts() -> dict:
    """The torch ops one attention layer dispatches for a cached decoding step (batch 1, 64 cached keys, SDPA),
    gated (EGA-1) and ungated: the gate's per-step work, counted rather than timed."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import DynamicCache

    import hf_spectral
    from hf_spectral.models.ega_gpt.modeling_ega_gpt import EGAAttention

    class CountOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    counts = {}
    for name, variant in (("gated", "EGA-1"), ("ungated", "BASE")):
        config = hf_spectral.EGAConfig.from_variant(variant, **SIZE)
        config._attn_implementation = "sdpa"
        attention = EGAAttention(config, layer_idx=0).eval()
        cache = DynamicCache(config=config)
        with torch.inference_mode():
            attention(torch.randn(1, 64, SIZE["hidden_size"]), cache=cache)
            with CountOps() as counter:
                attention(torch.randn(1, 1, SIZE["hidden_size"]), cache=cache)
        counts[name] = counter.ops
    return counts


def compile_for_generation(model):
    """transformers' recipe for fast generation, applied alike to every model: the forward compiled as one graph,
    used with a StaticCache (shapes stay fixed from step to step)."""
    model.forward = torch.compile(model.forward, fullgraph=True)
    return model


def build(name: str, context: int, backend: str):
    from transformers import GPT2Config, GPT2LMHeadModel

    import hf_spectral

    if name == "gpt2":
        # Exact GELU as in EGA-GPT (GPT-2's default tanh approximation costs several extra element-wise ops).
        config = GPT2Config(
            n_embd=SIZE["hidden_size"], n_layer=SIZE["num_hidden_layers"], n_head=SIZE["num_attention_heads"],
            vocab_size=SIZE["vocab_size"], n_positions=context, tie_word_embeddings=True, activation_function="gelu",
            bos_token_id=0, eos_token_id=0, attn_pdrop=0.0,
        )
        model = GPT2LMHeadModel(config)
    else:
        variant = {"ega": "EGA-1", "ega_base": "BASE", "ega_compiled_gate": "EGA-1"}[name]
        config = hf_spectral.EGAConfig.from_variant(variant, max_position_embeddings=context, attn_pdrop=0.0, **SIZE)
        model = hf_spectral.EGAForCausalLM(config)
        if name == "ega_compiled_gate":  # torch's route for the gate's small ops: one compiled graph per gate call
            for block in model.model.h:
                block.attn.energy_gate.forward = torch.compile(block.attn.energy_gate.forward, dynamic=True)
    model.set_attn_implementation(backend)
    return model


def training_step_fn(model, batch, length, seed=0):
    data = torch.randint(0, SIZE["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    model.train()

    def step():
        # No cache: GPT-2 (use_cache=True in its config) would otherwise build one in training, and EGA-GPT does not.
        model(input_ids=data, labels=data, use_cache=False).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def forward_fn(model, batch, length, seed=0):
    data = torch.randint(0, SIZE["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))
    model.eval()

    def step():
        with torch.inference_mode():
            model(input_ids=data, use_cache=False)

    return step


def generate_fn(model, batch, prompt, new_tokens, cache_implementation, seed=0):
    """Greedy generate() of exactly ``new_tokens`` tokens with the named transformers cache (the same for both
    models)."""
    data = torch.randint(0, SIZE["vocab_size"], (batch, prompt), generator=torch.Generator().manual_seed(seed))
    model.eval()

    def step():
        with torch.inference_mode():
            model.generate(
                data, attention_mask=torch.ones_like(data), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                do_sample=False, pad_token_id=0, cache_implementation=cache_implementation,
            )

    return step


def peak_memory_child(name, batch, length, backend):
    """Peak RSS growth (MiB) of two training steps (the optimizer state exists from the second), in this process."""
    torch.manual_seed(0)
    print(json.dumps({"peak_mib": peak_rss_growth_mib(training_step_fn(build(name, length, backend), batch, length))}))


def peak_memory(name, batch, length, backend, threads):
    out = subprocess.run(
        [sys.executable, __file__, "--memory-child", name, str(batch), str(length), backend, "--threads", str(threads),
         "--size", next(size for size, values in SIZES.items() if values == SIZE)],
        capture_output=True, text=True, check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_mib"]


def verdict_line(label: str, ratio: float, baseline: str, backend: str = "sdpa", cache: str = "dynamic") -> str:
    kind = "memory" if label.startswith("peak") else label.split("_")[0]
    for specific in (f"{kind}_{backend}_{cache}", f"{kind}_{backend}"):
        if specific in REASONS:
            kind = specific
            break
    if kind.startswith("memory"):
        met = ratio <= MEMORY_TARGET
        line = f"{label}: {ratio:.3f}× {baseline} (target ≤ {MEMORY_TARGET})"
        miss = f"over by {100 * (ratio - MEMORY_TARGET):.2f} points"
    else:
        met = ratio >= SPEED_TARGET
        line = f"{label}: {ratio:.3f}× {baseline} (target ≥ {SPEED_TARGET})"
        miss = f"short by {100 * (SPEED_TARGET - ratio):.2f} points"
    reason = REASONS[kind]
    if "{gated}" in reason:
        reason = reason.format(**decode_step_op_counts())
    return f"{line} met" if met else f"{line} MISSED, {miss}: {reason}"


def compiled_gate_line(label: str, ratio: float, baseline: str) -> str:
    return (f"{label}: with the gate under torch.compile (`ega_compiled_gate`, not the default path) "
            f"{ratio:.3f}× {baseline}")


def folded_kernel_line(label: str, folded: str, ratio: float, plain: str) -> str:
    return (f"{label} (no target): torch's SDPA kernel alone, forward + backward, runs the folded {folded} at "
            f"{ratio:.3f}× the speed of {plain}, the model's head size")


def flex_kernel_line(label: str, ratio: float) -> str:
    return (f"{label} (no target): the compiled flex_attention call alone, causal, forward, runs with the gate's "
            f"key-bias score_mod at {ratio:.3f}× the speed of the plain call")


def results_name(args) -> str:
    """ega_gpt, ega_gpt_<size other than 6x256>, then _<first --only prefix>, each with _quick for --quick."""
    size = f"_{args.size}" if args.size != "6x256" else ""
    only = f"_{args.only.split(',')[0].replace('-', '_')}" if args.only else ""
    return f"ega_gpt{size}{only}{'_quick' if args.quick else ''}"


def aggregate_runs(args):
    """Run this benchmark ``args.runs`` times, each in a fresh process, and write one table of the judged ratio of
    every (threads, backend, measurement, model): its median over the runs, its range and each run's value."""
    from training.results import write_results

    runs = records_of_fresh_runs(__file__, sys.argv[1:], args.runs, "--out")
    judged = {}  # (threads, backend, measurement, model) -> ratio per run; 1 thread: CPU time, otherwise wall
    for record in runs:
        for row in record["rows"]:
            key = (row["threads"], row["backend"], row["measurement"], row["model"])
            cpu = row["threads"] == 1 or row["measurement"].startswith("peak")
            judged.setdefault(key, []).append(row["ratio_vs_baseline" if cpu else "wall_ratio_vs_baseline"])
    rows, verdicts = [], []
    plain_head = f"head_{SIZE['hidden_size'] // SIZE['num_attention_heads']}"
    for (threads, backend, measurement, model), ratios in judged.items():
        rows.append({"threads": threads, "backend": backend, "measurement": measurement, "model": model,
                     **spread_over_runs(ratios)})
        median = rows[-1]["median_ratio"]
        spread = f"median of {len(ratios)} runs, range {min(ratios):.3f}-{max(ratios):.3f}"
        baseline = "gpt2" if backend == "sdpa" else "ega_base"
        if model == "ega":
            line = verdict_line(measurement, median, baseline, backend, args.cache)
            verdicts.append(f"[{backend}, threads {threads}] {line} ({spread})")
        elif model == "ega_compiled_gate":
            verdicts.append(f"[{backend}, threads {threads}] {compiled_gate_line(measurement, median, baseline)} "
                            f"({spread})")
        elif measurement.startswith("sdpa_kernel") and model != plain_head:
            verdicts.append(f"[{backend}, threads {threads}] "
                            f"{folded_kernel_line(measurement, model, median, plain_head)} ({spread})")
        elif measurement.startswith("flex_kernel") and model != "flex_plain":
            verdicts.append(f"[{backend}, threads {threads}] {flex_kernel_line(measurement, median)} ({spread})")
    if "flex_attention" in args.backends:
        verdicts.append("[flex_attention] training and its memory: not measured: torch's flex_attention has no "
                        "backward pass on CPU")
    notes = (
        f"Each ratio is the median over {args.runs} runs of the benchmark, each in a fresh process (range and every "
        "run's value beside it): the ratio judged in each run, from CPU time at 1 thread and from wall-clock time "
        "with several threads, throughput(model) / throughput(baseline) (> 1 faster; memory: peak(model) / "
        "peak(baseline), < 1 smaller). Baseline: GPT2LMHeadModel under sdpa; EGA-GPT without gates (`ega_base`) "
        f"under flex_attention; generation cache: `{args.cache}` for every model. Size: {json.dumps(SIZE)}; `ega` = "
        "EGA-1, causal statistics, every layer gated; `ega_compiled_gate` = the same with each gate's forward under "
        "torch.compile (not the default path); `compiled-generate_*`: generation with a StaticCache and every "
        "model's forward under torch.compile(fullgraph=True); `head_32` / `head_33`: torch's SDPA kernel alone at "
        "the model's head size and at the folded one; `flex_plain` / `flex_key_bias`: the compiled flex_attention call "
        "alone, without and with the gate's score_mod.\n\n"
        "Targets for `ega`:\n" + "\n".join(f"- {v}" for v in verdicts)
    )
    first = runs[0]
    write_results(
        args.out, results_name(args), rows,
        title=f"EGA-GPT vs a GPT of the same size, same backend and cache: {args.runs} runs",
        config={**first["config"], "runs": args.runs}, seeds=[0], notes=notes,
        columns=["threads", "backend", "measurement", "model", "median_ratio", "min_ratio", "max_ratio", "per_run"],
        extra={"hardware": first["hardware"]},  # the measuring processes' (their thread count), not this one's
    )
    print(notes)


def thread_counts(text: str) -> str:
    """An argparse ``type`` for ``--threads``: comma-separated counts, each 0 (torch's default) or more; the text is
    kept as given (it is recorded in the results and passed on to the memory subprocesses)."""
    try:
        counts = [int(count) for count in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma-separated thread counts expected, got {text!r}") from None
    if any(count < 0 for count in counts):
        raise argparse.ArgumentTypeError(f"thread counts must be 0 (torch's default) or more, got {text!r}")
    return text


def backend_names(text: str) -> str:
    """An argparse ``type`` for ``--backends``: comma-separated attention backends, kept as the text given."""
    unknown = [name for name in text.split(",") if name not in BACKENDS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown backend(s) {', '.join(map(repr, unknown))} in {text!r} "
                                         f"(choose from {', '.join(BACKENDS)})")
    return text


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller batches, fewer tokens and repeats")
    parser.add_argument("--size", default="6x256", choices=list(SIZES),
                        help="layers x width of both models (default 6x256; 12x768 is GPT-2 small's)")
    parser.add_argument("--repeats", type=positive_int, default=None)
    parser.add_argument("--backends", type=backend_names, default="sdpa,flex_attention",
                        help=f"comma-separated attention backends ({', '.join(BACKENDS)})")
    parser.add_argument("--threads", type=thread_counts, default="1,0",
                        help="comma-separated torch thread counts; 0 = torch's default (1: CPU-time ratios then hold "
                        "on a machine shared with other jobs)")
    parser.add_argument("--cache", default="dynamic", choices=["dynamic", "static"],
                        help="cache_implementation for generation")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument("--compiled-gate", action="store_true",
                        help="under sdpa, also measure EGA-1 with each gate's forward under torch.compile "
                        "(`ega_compiled_gate`; the rest of the model eager)")
    parser.add_argument("--compiled-generation", action="store_true",
                        help="under sdpa, also measure generation with a StaticCache and every model's forward under "
                        "torch.compile(fullgraph=True) (`compiled-generate_*` rows)")
    parser.add_argument("--only", default=None,
                        help="comma-separated names or prefixes of the timed measurements to run (e.g. "
                        "compiled-generate; the kernel and peak-memory rows are left out); the results then go to "
                        "ega_gpt_<first prefix>")
    parser.add_argument("--out", default="results/benchmarks")
    parser.add_argument("--runs", type=positive_int, default=1,
                        help="repeat the whole benchmark in this many fresh processes and report the median ratio "
                        "and its range (ratios from one process can move by several points between processes)")
    parser.add_argument("--memory-child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    SIZE.update(SIZES[args.size])
    if args.runs > 1:
        return aggregate_runs(args)
    default_threads = torch.get_num_threads()
    if args.memory_child:
        torch.set_num_threads(int(args.threads) or default_threads)
        name, batch, length, backend = args.memory_child
        peak_memory_child(name, int(batch), int(length), backend)
        return

    from training.results import write_results

    quick = args.quick
    repeats = args.repeats or (3 if quick else 9)
    settings = {
        "train_T256": dict(kind="train", batch=2 if quick else 16, length=256),
        "train_T1024": dict(kind="train", batch=1 if quick else 4, length=1024),
        "forward_T256": dict(kind="forward", batch=4 if quick else 16, length=256),
        "generate_batch1": dict(kind="generate", batch=1, prompt=64, new_tokens=16 if quick else 128),
        "generate_batch8": dict(kind="generate", batch=8, prompt=64, new_tokens=16 if quick else 128),
        "generate_batch32": dict(kind="generate", batch=32, prompt=64, new_tokens=8 if quick else 64),
    }
    if args.compiled_generation:
        for batch in (1, 8, 32):
            settings[f"compiled-generate_batch{batch}"] = dict(settings[f"generate_batch{batch}"],
                                                               kind="compiled-generate")
    if args.only:
        prefixes = tuple(args.only.split(","))
        unmatched = [prefix for prefix in prefixes if not any(label.startswith(prefix) for label in settings)]
        if unmatched:
            parser.error(f"--only {','.join(unmatched)} matches no measurement of this run; the measurements: "
                         f"{', '.join(settings)} (compiled-generate_* with --compiled-generation)")
        settings = {label: setting for label, setting in settings.items() if label.startswith(prefixes)}
    mem_setting = dict(batch=2 if quick else 8, length=1024)
    rows, verdicts = [], []
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads or default_threads)
        thread_label = threads or f"default ({default_threads})"
        for backend in args.backends.split(","):
            baseline = "gpt2" if backend == "sdpa" else "ega_base"
            names = ["gpt2", "ega_base", "ega"] if backend == "sdpa" else ["ega_base", "ega"]
            if args.compiled_gate and backend == "sdpa":
                names.insert(-1, "ega_compiled_gate")  # `ega` stays last: the verdicts read the last row
            torch.manual_seed(0)
            for label, setting in settings.items():
                if setting["kind"] == "compiled-generate" and backend != "sdpa":
                    continue
                if backend == "flex_attention" and setting["kind"] == "train":
                    verdicts.append(f"[{backend}, threads {thread_label}] {label}: not measured: torch's "
                                    "flex_attention has no backward pass on CPU")
                    print(verdicts[-1], flush=True)
                    continue
                context = max(setting.get("length", 256), 256)
                if setting["kind"] == "compiled-generate" or backend == "flex_attention":
                    # Each setting compiles its own graphs (flex_attention's kernel, compiled forwards): a fresh
                    # recompilation budget, so that no setting runs uncompiled for the settings measured before it.
                    torch._dynamo.reset()
                if setting["kind"] == "compiled-generate":
                    names_here = [n for n in names if n != "ega_compiled_gate"]
                    models = {name: compile_for_generation(build(name, context, backend)) for name in names_here}
                else:
                    models = {name: build(name, context, backend) for name in names}
                if setting["kind"] == "train":
                    fns = {n: training_step_fn(m, setting["batch"], setting["length"]) for n, m in models.items()}
                    tokens = setting["batch"] * setting["length"]
                elif setting["kind"] == "forward":
                    fns = {n: forward_fn(m, setting["batch"], setting["length"]) for n, m in models.items()}
                    tokens = setting["batch"] * setting["length"]
                else:
                    cache = "static" if setting["kind"] == "compiled-generate" else args.cache
                    shape = (setting["batch"], setting["prompt"], setting["new_tokens"], cache)
                    fns = {n: generate_fn(m, *shape) for n, m in models.items()}
                    tokens = setting["batch"] * setting["new_tokens"]
                times = time_alternating(fns, repeats)
                for name in fns:
                    rows.append({
                        "threads": thread_label, "backend": backend, "measurement": label, "model": name,
                        "tokens_per_cpu_s": tokens / statistics.median(times["cpu"][name]),
                        "ratio_vs_baseline": speed_ratio(times["cpu"], name, baseline),
                        "wall_ratio_vs_baseline": speed_ratio(times["wall"], name, baseline),
                    })
                ega = rows[-1]
                # Several threads: process CPU time counts busy-waiting threads; wall-clock is the measure there.
                ratio = ega["ratio_vs_baseline"] if threads == 1 else ega["wall_ratio_vs_baseline"]
                line = verdict_line(label, ratio, baseline, backend, args.cache)
                verdicts.append(f"[{backend}, threads {thread_label}] {line}")
                print(verdicts[-1], flush=True)
                if "ega_compiled_gate" in fns:
                    compiled = rows[-2]["ratio_vs_baseline" if threads == 1 else "wall_ratio_vs_baseline"]
                    verdicts.append(f"[{backend}, threads {thread_label}] "
                                    + compiled_gate_line(label, compiled, baseline))
                    print(verdicts[-1], flush=True)
            if backend == "sdpa" and not args.only:  # the folded head's cost in the kernel alone, at training
                setting = settings["train_T256"]
                heads = SIZE["num_attention_heads"]
                fns = folded_head_kernels(setting["batch"], heads, setting["length"], SIZE["hidden_size"] // heads,
                                          backward=True)
                times = time_alternating(fns, repeats)
                plain, folded = fns
                for name in fns:
                    rows.append({
                        "threads": thread_label, "backend": backend, "measurement": "sdpa_kernel_train_T256",
                        "model": name, "ratio_vs_baseline": speed_ratio(times["cpu"], name, plain),
                        "wall_ratio_vs_baseline": speed_ratio(times["wall"], name, plain),
                    })
                ratio = rows[-1]["ratio_vs_baseline" if threads == 1 else "wall_ratio_vs_baseline"]
                verdicts.append(f"[{backend}, threads {thread_label}] "
                                + folded_kernel_line("sdpa_kernel_train_T256", folded, ratio, plain))
                print(verdicts[-1], flush=True)
            if backend == "flex_attention" and not args.only:  # the score_mod's cost in the kernel alone
                setting = settings["forward_T256"]
                heads = SIZE["num_attention_heads"]
                torch._dynamo.reset()
                fns = flex_key_bias_kernels(setting["batch"], heads, setting["length"], SIZE["hidden_size"] // heads)
                times = time_alternating(fns, repeats)
                for name in fns:
                    rows.append({
                        "threads": thread_label, "backend": backend, "measurement": "flex_kernel_forward_T256",
                        "model": name, "ratio_vs_baseline": speed_ratio(times["cpu"], name, "flex_plain"),
                        "wall_ratio_vs_baseline": speed_ratio(times["wall"], name, "flex_plain"),
                    })
                ratio = rows[-1]["ratio_vs_baseline" if threads == 1 else "wall_ratio_vs_baseline"]
                verdicts.append(f"[{backend}, threads {thread_label}] "
                                + flex_kernel_line("flex_kernel_forward_T256", ratio))
                print(verdicts[-1], flush=True)
            if not args.no_memory and not args.only and backend != "flex_attention":  # no flex backward on CPU
                names = [n for n in names if n != "ega_compiled_gate"]
                mem = {n: peak_memory(n, mem_setting["batch"], mem_setting["length"], backend, threads) for n in names}
                for name in names:
                    rows.append({"threads": thread_label, "backend": backend, "measurement": "peak_train_memory_T1024",
                                 "model": name, "peak_mib": mem[name], "ratio_vs_baseline": mem[name] / mem[baseline]})
                verdicts.append(f"[{backend}, threads {thread_label}] " + verdict_line(
                    "peak_train_memory_T1024", mem["ega"] / mem[baseline], baseline))
                print(verdicts[-1], flush=True)
    notes = (
        "Speed ratios are throughput(model) / throughput(baseline), > 1 faster: from this process's CPU time at 1 "
        "thread (`ratio_vs_baseline`), from wall-clock time otherwise (`wall_ratio_vs_baseline`, the one judged with "
        "several threads). Memory ratios are peak(model) / peak(baseline), < 1 smaller. Baseline: GPT2LMHeadModel "
        "under sdpa; EGA-GPT without gates (`ega_base`) under flex_attention, which transformers' GPT-2 does not "
        f"support. Size: {json.dumps(SIZE)}; `ega` = EGA-1, causal statistics, every layer gated; generation cache: "
        f"`{args.cache}` for every model (`compiled-generate_*`: a StaticCache and every model's forward under "
        "torch.compile(fullgraph=True)).\n\nTargets for `ega`:\n" + "\n".join(f"- {v}" for v in verdicts)
    )
    write_results(
        args.out,
        results_name(args),
        rows,
        title="EGA-GPT vs a GPT of the same size, same backend and cache, same run",
        config={"size": SIZE, "settings": settings, "repeats": repeats, "memory": mem_setting,
                "threads": args.threads, "backends": args.backends, "cache": args.cache},
        seeds=[0],
        notes=notes,
        columns=["threads", "backend", "measurement", "model", "tokens_per_cpu_s", "ratio_vs_baseline",
                 "wall_ratio_vs_baseline", "peak_mib"],
    )
    print(notes)


if __name__ == "__main__":
    main()
