"""GPU benchmark: EGA-1 against GPT2LMHeadModel and CHIAR-Former against the same-size all-attention model, on one
CUDA device, in bfloat16, every ratio measured in the same run.

    python benchmarks/bench_gpu.py                       # CUDA, writes results/benchmarks/gpu.{md,json}
    python benchmarks/bench_gpu.py --budget_s 200        # fewer repeats where the time would run out
    python benchmarks/bench_gpu.py --device cpu --tiny   # tiny sizes, float32: exercises every code path on a CPU

What is measured (``benchmarks/gpu_check.sh`` runs it after the CUDA tests):

* EGA-1 (causal statistics in every layer), the same code without gates (BASE) and GPT2LMHeadModel of the same
  size (exact GELU, tied embeddings, no dropout), at 6 layers x 256 (vocabulary 65, the papers' character model)
  and 12 layers x 768 (vocabulary 50257, GPT-2 small), T = 1024: a training step (forward + backward + AdamW step,
  float32 weights under bfloat16 autocast, as `Trainer(bf16=True)` runs), the inference forward (bfloat16
  weights), cached greedy generation with the same cache class for both models (`cache_implementation="dynamic"`
  and `"static"`; the class each model actually used is recorded), tokens/s and peak GPU memory; under SDPA and,
  where a model accepts it, `flex_attention` (a model that refuses it is reported as "not supported", with the
  reason). A check that each model's forward runs with SDPA restricted to the fused kernels (flash /
  memory-efficient, no math fallback).
* CHIAR-Former (the authors' model: d = 256, 4 heads, layers DCT / routed / routed / attention, threshold routing
  calibrated per routed layer to the 75th entropy percentile, so that about 25% of the tokens take attention)
  against the same class with attention in every layer, at T = 2048 (batch 32) and 4096 (batch 16): forward and
  training step, with the speed-up the FLOP counter allows at the measured routing beside it.

Timing: each measurement runs its models in alternation (A B C, then C B A, ...) after two warm-up rounds; each
call is timed with CUDA events between `torch.cuda.synchronize()` calls (so a model's host-side launch time is
inside its own figure); ratios are medians of per-round time ratios, tokens/s come from median times. The number of
rounds is fitted to ``--budget_s``: every measurement gets a share of the time left, at least 3 rounds, and a
measurement whose share is gone before it starts is reported as skipped. Results are rewritten after every
measurement, so a run stopped early still leaves what it measured (marked partial).
"""

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from training.common.cli import non_negative_int, percentage, positive_int  # noqa: E402  (argparse types)

GPU_TARGET = {
    "measurement": "train", "size": "12x768", "backend": "sdpa", "model": "ega1", "target": 0.95,
    "text": "EGA-1 training >= 0.95x GPT-2 with SDPA at 12 x 768, T = 1024, bfloat16",
}
# The CPU targets of the same comparison, reported beside the GPU figures for reference (not GPU targets).
REFERENCE_TARGETS = {"train": 0.95, "forward": 0.95, "generate": 0.95, "chiar_forward": 1.3, "peak_memory": 1.10}


# ---------------------------------------------------------------------------------------------------------------
# Sizes
# ---------------------------------------------------------------------------------------------------------------


def ega_sizes(tiny: bool) -> list[dict]:
    if tiny:
        return [
            dict(label="2x64", layers=2, hidden=64, heads=4, vocab=65, length=32, train_batch=2, forward_batch=2),
            dict(label="2x96", layers=2, hidden=96, heads=4, vocab=97, length=32, train_batch=2, forward_batch=2),
        ]
    return [
        # The target size first: if the budget runs short it is the other size that loses rounds.
        dict(label="12x768", layers=12, hidden=768, heads=12, vocab=50257, length=1024, train_batch=8, forward_batch=8),
        dict(label="6x256", layers=6, hidden=256, heads=8, vocab=65, length=1024, train_batch=16, forward_batch=16),
    ]


def generation_settings(tiny: bool) -> list[dict]:
    if tiny:
        return [dict(batch=2, prompt=8, new_tokens=4)]
    return [dict(batch=1, prompt=128, new_tokens=64), dict(batch=32, prompt=128, new_tokens=64)]


def chiar_settings(tiny: bool, args) -> dict:
    if tiny:
        return dict(hidden=64, heads=4, vocab=65, lengths=[(64, 2), (128, 1)])
    # The authors' width (and that of the CPU benchmark), with batches that give the GPU 65k tokens per call.
    return dict(hidden=args.chiar_hidden, heads=args.chiar_heads, vocab=256, lengths=[(2048, 32), (4096, 16)])


# ---------------------------------------------------------------------------------------------------------------
# Timing and budget
# ---------------------------------------------------------------------------------------------------------------


class Budget:
    """Shares the time left among the measurements still to run, in proportion to their weights."""

    def __init__(self, seconds: float, weights: dict):
        self.deadline = time.perf_counter() + seconds
        self.pending = dict(weights)

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def allot(self, key: str) -> float:
        weight = self.pending.pop(key, 1.0)
        total = weight + sum(self.pending.values())
        return max(0.0, self.left()) * weight / total


class Clock:
    """Times single calls: CUDA events between synchronisations on CUDA, ``perf_counter`` elsewhere."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def time_call(self, fn) -> float:
        if not self.cuda:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3


def time_alternating(clock: Clock, fns: dict, seconds: float, min_repeats: int = 3, max_repeats: int = 30,
                     warmup: int = 2) -> tuple[dict, int]:
    """Time ``fns`` in alternating rounds (order reversed every other round) after ``warmup`` rounds; the number of
    rounds fills ``seconds`` (measured from the last warm-up round), between ``min_repeats`` and ``max_repeats``.

    Returns ({name: [seconds per round]}, rounds)."""
    names = list(fns)
    round_seconds = 0.0
    for _ in range(warmup):
        round_seconds = sum(clock.time_call(fns[name]) for name in names)
    repeats = int(min(max_repeats, max(min_repeats, seconds // max(round_seconds, 1e-6))))
    times = {name: [] for name in names}
    for index in range(repeats):
        for name in names if index % 2 == 0 else reversed(names):
            times[name].append(clock.time_call(fns[name]))
    return times, repeats


def speed_ratio(times: dict, name: str, baseline: str) -> float:
    """Median over rounds of time(baseline) / time(name): > 1 means ``name`` is faster."""
    return statistics.median(b / a for a, b in zip(times[name], times[baseline]))


# ---------------------------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------------------------


def set_backend(model, backend: str) -> str:
    """Switch ``model`` to attention backend ``backend``; returns how ("set_attn_implementation", or "forced" when the
    model does not declare the backend but routes attention through transformers' `ALL_ATTENTION_FUNCTIONS`).
    Raises when the model cannot use the backend at all."""
    try:
        model.set_attn_implementation(backend)
        return "set_attn_implementation"
    except Exception as error:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        declared = getattr(model, "_supports_attention_backend", False)
        if not declared or backend not in ALL_ATTENTION_FUNCTIONS:
            raise
        # GPT2LMHeadModel reads `config._attn_implementation` at every call and dispatches through
        # ALL_ATTENTION_FUNCTIONS, so a backend it does not declare can still be measured like for like.
        for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
            config._attn_implementation = backend
        print(f"  note: {type(model).__name__} refused {backend} ({first_line(error)}); forced through the config")
        return "forced"


def build_gpt2(size: dict):
    from transformers import GPT2Config, GPT2LMHeadModel

    # Exact GELU as in EGA-GPT (GPT-2's default tanh approximation is a different activation), no dropout.
    config = GPT2Config(
        n_embd=size["hidden"], n_layer=size["layers"], n_head=size["heads"], vocab_size=size["vocab"],
        n_positions=size["length"], activation_function="gelu", tie_word_embeddings=True,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    return GPT2LMHeadModel(config)


def build_ega(size: dict, variant: str):
    import hf_spectral

    config = hf_spectral.EGAConfig.from_variant(
        variant, hidden_size=size["hidden"], num_hidden_layers=size["layers"], num_attention_heads=size["heads"],
        vocab_size=size["vocab"], max_position_embeddings=size["length"], embd_pdrop=0.0, resid_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    return hf_spectral.EGAForCausalLM(config)


EGA_BUILDERS = {
    "gpt2": build_gpt2,
    "ega_base": lambda size: build_ega(size, "BASE"),
    "ega1": lambda size: build_ega(size, "EGA-1"),
}


def random_ids(batch: int, length: int, vocab: int, device, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=generator).to(device)


def training_step(model, ids, amp_dtype, device, fused_adamw: bool):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, **({"fused": True} if fused_adamw else {}))
    model.train()

    def step():
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, optimizer


def forward_call(model, ids):
    model.eval()

    def call():
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)

    return call


def generate_call(model, ids, new_tokens: int, cache_implementation: str):
    model.eval()
    mask = torch.ones_like(ids)

    def call(return_output: bool = False):
        with torch.no_grad():
            output = model.generate(
                ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                pad_token_id=0, cache_implementation=cache_implementation, disable_compile=True,
                return_dict_in_generate=return_output,
            )
        return output

    return call


def cache_class_used(call) -> str:
    output = call(return_output=True)
    cache = getattr(output, "cache", None) or getattr(output, "past_key_values", None)
    return type(cache).__name__ if cache is not None else "none returned"


def state_mib(model, optimizer=None) -> float:
    """Parameters and optimizer state held by ``model`` (MiB)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if optimizer is not None:
        for state in optimizer.state.values():
            total += sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t))
    return total / 2**20


def peak_mib(clock: Clock, fn) -> float | None:
    """Peak GPU memory (MiB) allocated during ``fn()`` above what was allocated before it (activations, gradients,
    temporaries); None off CUDA."""
    if not clock.cuda:
        fn()
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def fused_sdpa_check(model, ids) -> str:
    """Whether the forward runs with SDPA limited to the fused kernels (flash, memory-efficient): "ok" or the error."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model.eval()
    try:
        with torch.no_grad(), sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            model(input_ids=ids, use_cache=False)
        return "ok"
    except Exception as error:
        return "failed: " + first_line(error)


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300] if text else ''}"


# ---------------------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------------------


class Run:
    """Holds the rows measured so far and rewrites the result files after each measurement."""

    def __init__(self, args, device):
        self.args = args
        self.device = device
        self.clock = Clock(device)
        self.rows = []
        self.sections = {}
        self.compiled_graphs = {}
        self.started = time.perf_counter()
        self.complete = False
        self.backends = {}

    def add(self, **row):
        self.rows.append(row)

    def section(self, name: str, started: float, graphs_before: int):
        elapsed = time.perf_counter() - started
        self.sections[name] = round(elapsed, 1)
        self.compiled_graphs[name] = compiled_graphs() - graphs_before
        print(f"[{name}] {elapsed:.1f} s, {self.compiled_graphs[name]} graph(s) compiled (total "
              f"{time.perf_counter() - self.started:.1f} s)", flush=True)
        write_results(self)


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far (flex_attention compiles; recompiles show here)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def measure(run: Run, budget: Budget, key: str, fns: dict, baseline: str, common: dict, tokens: int,
            peaks: dict | None = None, extra: dict | None = None):
    """Times ``fns`` under ``key``'s share of the budget and adds one row per model (ratios against ``baseline``)."""
    seconds = budget.allot(key)
    if seconds < run.args.min_slot_s:
        for name in fns:
            run.add(**common, model=name, status=f"skipped: budget spent ({seconds:.1f} s left for it)")
        return
    try:
        times, repeats = time_alternating(run.clock, fns, seconds, min_repeats=3, max_repeats=run.args.max_repeats,
                                          warmup=run.args.warmup)
    except Exception as error:  # one failing measurement must not stop the others
        traceback.print_exc()
        if run.clock.cuda:
            torch.cuda.empty_cache()
        for name in fns:
            run.add(**common, model=name, status="error: " + first_line(error))
        return
    for name in fns:
        median_s = statistics.median(times[name])
        run.add(
            **common, model=name, status="ok", repeats=repeats, median_ms=median_s * 1e3,
            tokens_per_s=tokens / median_s, ratio_vs_baseline=speed_ratio(times, name, baseline),
            baseline=baseline, peak_mib=(peaks or {}).get(name), **((extra or {}).get(name, {})),
        )
    line = ", ".join(f"{r['model']} {r['tokens_per_s']:.0f} tok/s ({r['ratio_vs_baseline']:.3f}x)"
                     for r in run.rows[-len(fns):])
    print(f"  {common['measurement']} {common.get('size', '')} {common.get('backend', '')}: {line}", flush=True)


def forward_calls(run: Run, models: dict, ids) -> tuple[dict, dict]:
    """After the training measurements: every model's gradients dropped and its weights cast to the run's dtype
    (inference runs in bfloat16), then one forward call per model and its peak memory."""
    for model in models.values():
        model.zero_grad(set_to_none=True)
        model.to(run.dtype)
    if run.clock.cuda:
        torch.cuda.empty_cache()
    calls = {name: forward_call(model, ids) for name, model in models.items()}
    return calls, {name: peak_mib(run.clock, call) for name, call in calls.items()}


def skip_spent(run: Run, budget: Budget, prefix: str, base: dict) -> bool:
    """True (and the task's measurements reported as skipped) when too little budget is left to start the task: a
    compiled backend (anything but SDPA and eager) needs ``--min_compile_s`` for its compiles, which no budget trims."""
    needed = run.args.min_slot_s if base["backend"] in ("sdpa", "eager") else max(run.args.min_slot_s,
                                                                                 run.args.min_compile_s)
    if budget.left() >= needed:
        return False
    for key in [k for k in budget.pending if k.startswith(prefix)]:
        budget.pending.pop(key)
        run.add(**base, measurement=key[len(prefix):], model="",
                status=f"skipped: {max(budget.left(), 0):.0f} s of the budget left, {needed:.0f} s needed to start")
    return True


def build_models(run: Run, names, builder, common: dict, backend: str) -> dict:
    """Builds each model on the device with ``backend``; a model that cannot is reported and left out."""
    models = {}
    for name in names:
        try:
            torch.manual_seed(0)
            model = builder(name).to(run.device)
            how = set_backend(model, backend)
            run.backends[f"{common['section']}/{name}/{backend}"] = how
            models[name] = model
        except Exception as error:
            reason = ("not supported: " if backend != "sdpa" else "error: ") + first_line(error)
            print(f"  {name} with {backend}: {reason}", flush=True)
            run.add(**common, model=name, status=reason)
    return models


def probe_backend(run: Run, models: dict, ids, common: dict) -> dict:
    """One forward per model: a backend that builds but fails at the first call is reported as not supported. It runs
    on the measured batch, so that a compiled backend (flex_attention) compiles its forward for that shape once."""
    usable = {}
    for name, model in models.items():
        try:
            # Under the training's autocast: the same bfloat16 attention inputs as the later bfloat16 forward.
            with torch.autocast(run.device.type, dtype=run.amp_dtype, enabled=run.amp_dtype is not None):
                forward_call(model, ids)()
            usable[name] = model
        except Exception as error:
            print(f"  {name} with {common['backend']}: first forward failed: {first_line(error)}", flush=True)
            run.add(**common, model=name, status="not supported: " + first_line(error))
    return usable


def bench_ega(run: Run, budget: Budget, size: dict, backend: str):
    args, device = run.args, run.device
    names = ["gpt2", "ega_base", "ega1"]
    base = dict(section="ega", size=size["label"], backend=backend, length=size["length"])
    if skip_spent(run, budget, f"ega/{size['label']}/{backend}/", base):
        return
    train_ids = random_ids(size["train_batch"], size["length"], size["vocab"], device)
    forward_ids = random_ids(size["forward_batch"], size["length"], size["vocab"], device, seed=1)

    models = build_models(run, names, lambda name: EGA_BUILDERS[name](size), {**base, "measurement": "build"},
                          backend)
    models = probe_backend(run, models, forward_ids, {**base, "measurement": "first forward"})
    if "gpt2" not in models:
        for key in [k for k in budget.pending if k.startswith(f"ega/{size['label']}/{backend}/")]:
            budget.pending.pop(key)
        return

    # Training: float32 weights, bfloat16 autocast (on CUDA), AdamW.
    steps, peaks, extra = {}, {}, {}
    for name, model in models.items():
        step, optimizer = training_step(model, train_ids, run.amp_dtype, device, fused_adamw=run.clock.cuda)
        try:
            step()  # the optimizer state exists from here on, as in any later step
            peaks[name] = peak_mib(run.clock, step)
        except Exception as error:
            traceback.print_exc()
            run.add(**base, measurement="train", batch=size["train_batch"], model=name,
                    status="error: " + first_line(error))
            continue
        steps[name] = step
        extra[name] = {"state_mib": state_mib(model, optimizer),
                       "parameters": sum(p.numel() for p in model.parameters())}
    if "gpt2" in steps:
        measure(run, budget, f"ega/{size['label']}/{backend}/train", steps, "gpt2",
                {**base, "measurement": "train", "batch": size["train_batch"]},
                size["train_batch"] * size["length"], peaks, extra)
    else:  # its share of the time goes to the measurements still to run
        budget.pending.pop(f"ega/{size['label']}/{backend}/train", None)
    del steps, step, optimizer  # the optimizer states go with the closures
    calls, peaks = forward_calls(run, models, forward_ids)
    measure(run, budget, f"ega/{size['label']}/{backend}/forward", calls, "gpt2",
            {**base, "measurement": "forward", "batch": size["forward_batch"]},
            size["forward_batch"] * size["length"], peaks)

    if backend == "sdpa":  # on a CPU: its flash kernel (the code path; the GPU run is the check)
        for name, model in models.items():
            run.add(**base, measurement="fused SDPA only (flash / memory-efficient)", model=name,
                    status=fused_sdpa_check(model, forward_ids[:2]))

    if backend == "sdpa":  # generation's many small steps: the decoding comparison is made on SDPA
        for setting in generation_settings(args.tiny):
            for cache in ("dynamic", "static"):
                key = f"ega/{size['label']}/{backend}/generate/{setting['batch']}/{cache}"
                ids = random_ids(setting["batch"], setting["prompt"], size["vocab"], device, seed=2)
                calls, extra = {}, {}
                for name in ("gpt2", "ega1"):
                    if name not in models:
                        continue
                    call = generate_call(models[name], ids, setting["new_tokens"], cache)
                    try:
                        extra[name] = {"cache_class": cache_class_used(call)}
                    except Exception as error:
                        traceback.print_exc()
                        run.add(**base, measurement=f"generate ({cache} cache)", batch=setting["batch"], model=name,
                                status="error: " + first_line(error))
                        continue
                    calls[name] = call
                if "gpt2" not in calls:
                    budget.pending.pop(key, None)
                    continue
                measure(run, budget, key, calls, "gpt2",
                        {**base, "measurement": f"generate ({cache} cache)", "batch": setting["batch"],
                         "length": f"{setting['prompt']}+{setting['new_tokens']}"},
                        setting["batch"] * setting["new_tokens"], extra=extra)
    del models
    if run.clock.cuda:
        torch.cuda.empty_cache()


def chiar_config(settings: dict, length: int, backend: str, **overrides):
    from hf_spectral import ChiarConfig

    fields = dict(
        vocab_size=settings["vocab"], hidden_size=settings["hidden"], num_attention_heads=settings["heads"],
        num_hidden_layers=4, max_position_embeddings=length, hidden_dropout=0.0, attention_dropout=0.0,
        attn_implementation=backend,
    )
    fields.update(overrides)
    return ChiarConfig(**fields)


def routing_summary(model, baseline, ids) -> dict:
    """What CHIAR's routing does on ``ids``: the fraction of the tokens each routed layer sends to attention, and the
    forward speed-up over ``baseline`` that the package's FLOP counter allows (total FLOPs, LM head included)."""
    from hf_spectral.models.chiar_former import count_flops

    with torch.no_grad():
        output = model(input_ids=ids, use_cache=False, output_routing=True)
    attention_index = list(model.config.routed_operators).index("attention")
    decisions = [d.cpu() for d in getattr(output, "routing_decisions", None) or ()]
    summary = {"attention_fraction": [round(float((d == attention_index).float().mean()), 4) for d in decisions]}
    batch, length = ids.shape
    try:
        flops = count_flops(model.config, batch, length, decisions, lm_head_positions=length)["total"]
        baseline_flops = count_flops(baseline.config, batch, length, (), lm_head_positions=length)["total"]
        summary["flop_speedup_bound"] = round(baseline_flops / flops, 3)
    except Exception as error:  # the counter is a cross-check; its failure does not stop the measurement
        print(f"  FLOP counter failed: {first_line(error)}", flush=True)
    return summary


def bench_chiar(run: Run, budget: Budget, length: int, batch: int, backend: str):
    from hf_spectral import ChiarForCausalLM
    from hf_spectral.models.chiar_former import calibrate_thresholds

    device, settings = run.device, chiar_settings(run.args.tiny, run.args)
    base = dict(section="chiar", size=f"4x{settings['hidden']}", backend=backend, length=length, batch=batch)
    if skip_spent(run, budget, f"chiar/{length}/{backend}/", base):
        return
    ids = random_ids(batch, length, settings["vocab"], device, seed=length)
    models, extra = {}, {}
    for name, overrides in (("all_attention", {"layer_operators": ["attention"] * 4}), ("chiar", {})):
        try:
            torch.manual_seed(0)
            models[name] = ChiarForCausalLM(chiar_config(settings, length, backend, **overrides)).to(device)
            set_backend(models[name], backend)
        except Exception as error:
            reason = ("not supported: " if backend != "sdpa" else "error: ") + first_line(error)
            print(f"  CHIAR {name} with {backend}: {reason}", flush=True)
            run.add(**base, measurement="build", model=name, status=reason)
    models = probe_backend(run, models, ids, {**base, "measurement": "first forward"})
    if "all_attention" not in models or "chiar" not in models:
        for key in [k for k in budget.pending if k.startswith(f"chiar/{length}/{backend}/")]:
            budget.pending.pop(key)
        return
    chiar = models["chiar"]
    try:
        calibration = [random_ids(batch, length, settings["vocab"], device, seed=length + 1 + i) for i in range(2)]
        thresholds = calibrate_thresholds(chiar, calibration, percentiles=(100.0 - run.args.attention_percent,),
                                          per_layer=True)["thresholds"]
        extra["chiar"] = {"thresholds": {str(k): [round(t, 5) for t in v] for k, v in thresholds.items()},
                          **routing_summary(chiar, models["all_attention"], ids)}
    except Exception as error:
        traceback.print_exc()
        run.add(**base, measurement="calibration", model="chiar", status="error: " + first_line(error))
        for key in [k for k in budget.pending if k.startswith(f"chiar/{length}/{backend}/")]:
            budget.pending.pop(key)
        return
    print(f"  CHIAR T={length}: attention fraction per routed layer {extra['chiar']['attention_fraction']}",
          flush=True)

    # Training first (float32 weights, bfloat16 autocast), then the bfloat16 forward, as for EGA.
    steps, peaks = {}, {}
    for name, model in models.items():
        step, _ = training_step(model, ids, run.amp_dtype, device, fused_adamw=run.clock.cuda)
        try:
            step()
            peaks[name] = peak_mib(run.clock, step)
        except Exception as error:
            traceback.print_exc()
            run.add(**base, measurement="train", model=name, status="error: " + first_line(error))
            continue
        steps[name] = step
    if len(steps) == 2:
        measure(run, budget, f"chiar/{length}/{backend}/train", steps, "all_attention",
                {**base, "measurement": "train"}, batch * length, peaks, extra)
    else:
        budget.pending.pop(f"chiar/{length}/{backend}/train", None)
    del steps, step
    calls, peaks = forward_calls(run, models, ids)
    try:  # the routing the timed forward takes: the training steps above moved it from the calibrated one
        extra["chiar"] = {**extra["chiar"], **routing_summary(chiar, models["all_attention"], ids)}
    except Exception as error:
        traceback.print_exc()
        run.add(**base, measurement="routing after training", model="chiar", status="error: " + first_line(error))
    measure(run, budget, f"chiar/{length}/{backend}/forward", calls, "all_attention",
            {**base, "measurement": "forward"}, batch * length, peaks, extra)

    if backend == "sdpa":  # on a CPU: its flash kernel (the code path; the GPU run is the check)
        for name, model in models.items():
            run.add(**base, measurement="fused SDPA only (flash / memory-efficient)", model=name,
                    status=fused_sdpa_check(model, ids))

    del models, chiar
    if run.clock.cuda:
        torch.cuda.empty_cache()


def plan(args) -> list[tuple]:
    """The measurements in the order they run, with their budget weights (share of the time). SDPA (the GPU target's
    backend) comes first; then the other backends, interleaving EGA and CHIAR so that a budget spent on compiling
    still leaves one size of each measured."""
    tasks = []
    for backend in args.backends:
        ega = []
        for size in ega_sizes(args.tiny):
            weights = {f"ega/{size['label']}/{backend}/train": 3.0, f"ega/{size['label']}/{backend}/forward": 1.0}
            if backend == "sdpa":
                for setting in generation_settings(args.tiny):
                    for cache in ("dynamic", "static"):
                        weights[f"ega/{size['label']}/{backend}/generate/{setting['batch']}/{cache}"] = 1.0
            ega.append((("ega", size, backend), weights))
        chiar = []
        for length, batch in chiar_settings(args.tiny, args)["lengths"]:
            weights = {f"chiar/{length}/{backend}/forward": 1.5, f"chiar/{length}/{backend}/train": 1.5}
            chiar.append((("chiar", (length, batch), backend), weights))
        if backend == "sdpa":
            tasks += ega + chiar
        else:
            tasks += [task for pair in zip(ega, chiar) for task in pair] + ega[len(chiar):] + chiar[len(ega):]
    return tasks


# ---------------------------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------------------------


def environment(device: torch.device) -> dict:
    import transformers

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda_runtime": torch.version.cuda,
        "device": str(device),
        "platform": platform.platform(),
    }
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        info.update(gpu=properties.name, gpu_memory_gib=round(properties.total_memory / 2**30, 1),
                    compute_capability=f"{properties.major}.{properties.minor}",
                    multiprocessors=properties.multi_processor_count, cudnn=torch.backends.cudnn.version(),
                    matmul_allow_tf32=torch.backends.cuda.matmul.allow_tf32,
                    sdpa_enabled={"flash": torch.backends.cuda.flash_sdp_enabled(),
                                  "memory_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
                                  "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
                                  "math": torch.backends.cuda.math_sdp_enabled()})
        try:
            info["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            info["driver"] = "unknown (nvidia-smi not available)"
    else:
        info["cpu_threads"] = torch.get_num_threads()
    try:
        info["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                            timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        info["git_commit"] = os.environ.get("HF_SPECTRAL_COMMIT", "unknown (no git checkout)")
    return info


def target_lines(rows: list[dict]) -> list[str]:
    """The GPU target, then the CPU targets of the same comparisons for reference, each with how far off it is."""

    def verdict(value, target, higher_is_better=True):
        met = value >= target if higher_is_better else value <= target
        if met:
            return "met"
        off = (target - value) / target if higher_is_better else (value - target) / target
        return f"MISSED by {off:.1%}"

    def sibling(row, model):
        return next((r for r in rows if r["model"] == model and r.get("status") == "ok"
                     and all(r.get(k) == row.get(k) for k in ("section", "measurement", "size", "backend", "batch",
                                                              "length"))), None)

    def where_the_time_goes(row):
        """EGA-1 against BASE (the same code without gates) separates the gates' cost from the rest of the code's."""
        base = sibling(row, "ega_base")
        if row["section"] == "chiar" and row.get("attention_fraction") is not None:
            bound = row.get("flop_speedup_bound")
            return (f" [why: the routed layers send {', '.join(f'{f:.0%}' for f in row['attention_fraction'])} of the "
                    f"tokens to attention" + (f"; the FLOP counter allows {bound:.2f}x" if bound else "") + "]")
        if row["section"] != "ega" or base is None:
            return ""
        return (f" [why: BASE, the same code without gates, runs at {base['ratio_vs_baseline']:.3f}x GPT-2; EGA-1 at "
                f"{row['ratio_vs_baseline'] / base['ratio_vs_baseline']:.3f}x BASE, the gates' own cost]")

    lines = []
    found = [r for r in rows if r["section"] == "ega" and r["measurement"] == GPU_TARGET["measurement"]
             and r["backend"] == GPU_TARGET["backend"] and r["model"] == GPU_TARGET["model"]]
    target_row = next((r for r in found if r["size"] == GPU_TARGET["size"]), None)
    if target_row is None and found:  # the tiny CPU run has other sizes: judge its first, in the target's place
        target_row = found[0]
    if target_row is None or target_row.get("status") != "ok":
        status = target_row["status"] if target_row else "not measured"
        lines.append(f"- **GPU target** {GPU_TARGET['text']}: NOT MEASURED ({status})")
    else:
        value = target_row["ratio_vs_baseline"]
        lines.append(f"- **GPU target** {GPU_TARGET['text']}: {value:.3f}x at {target_row['size']} — "
                     f"{verdict(value, GPU_TARGET['target'])}{where_the_time_goes(target_row)}")
    lines.append("")
    lines.append("For reference, the CPU targets of the same comparisons (not GPU targets):")
    lines.append("")
    for row in rows:
        if row.get("status") != "ok" or row["model"] not in ("ega1", "chiar"):
            continue
        kind = row["measurement"].split(" ")[0]
        target = REFERENCE_TARGETS["chiar_forward"] if row["section"] == "chiar" and kind == "forward" else (
            REFERENCE_TARGETS.get(kind) if row["section"] == "ega" else None)
        where = f"{row['section']} {row['size']} {row['backend']} {row['measurement']} B={row.get('batch')} " \
                f"T={row['length']}"
        if target is not None:
            lines.append(f"- {where}: {row['ratio_vs_baseline']:.3f}x (≥ {target}) — "
                         f"{verdict(row['ratio_vs_baseline'], target)}{where_the_time_goes(row)}")
        if row["section"] == "ega" and kind == "train":
            baseline = sibling(row, "gpt2")
            if baseline and baseline.get("peak_mib") and row.get("peak_mib"):
                ratio = (row["peak_mib"] + row["state_mib"]) / (baseline["peak_mib"] + baseline["state_mib"])
                lines.append(f"- {where}: peak training memory {ratio:.3f}x GPT-2 (≤ "
                             f"{REFERENCE_TARGETS['peak_memory']}) — "
                             f"{verdict(ratio, REFERENCE_TARGETS['peak_memory'], higher_is_better=False)}")
    return lines


def markdown(run: Run, record: dict) -> str:
    def fmt(value, digits=3):
        if value is None:
            return ""
        if isinstance(value, float):
            return f"{value:.{digits}f}" if abs(value) < 1e5 else f"{value:.0f}"
        return str(value)

    env = record["environment"]
    where = env.get("gpu", env["device"])
    out = [f"# {record['title']}", ""]
    if not run.complete:
        out += ["**Partial results: the run stopped before every measurement was made.**", ""]
    out += [f"{where}; torch {env['torch']} (CUDA {env['cuda_runtime']}), transformers {env['transformers']}; "
            f"{record['settings']['dtype']}.", ""]
    out += ["## Targets", "", *record["targets"], ""]
    if record.get("tests"):
        out += ["## CUDA tests", "", "```", *record["tests"], "```", ""]
    columns = ["measurement", "size", "backend", "batch", "length", "model", "status", "repeats", "median_ms",
               "tokens_per_s", "ratio_vs_baseline", "peak_mib", "state_mib", "cache_class", "attention_fraction",
               "flop_speedup_bound"]
    titles = {"ega": "EGA-1 vs GPT2LMHeadModel (ratios against `gpt2`; > 1 is faster)",
              "chiar": "CHIAR-Former vs all-attention (ratios against `all_attention`; > 1 is faster)"}
    for section, title in titles.items():
        rows = [r for r in run.rows if r["section"] == section]
        out += [f"## {title}", ""]
        if not rows:
            out += ["_not measured_", ""]
            continue
        used = [c for c in columns if any(r.get(c) not in (None, "") for r in rows)]
        out += ["| " + " | ".join(used) + " |", "|" + "---|" * len(used)]
        out += ["| " + " | ".join(fmt(r.get(c)) for c in used) + " |" for r in rows]
        out.append("")
    graphs = record["compiled_graphs"]
    out += ["## Elapsed time per section (s)", "",
            *[f"- {name}: {seconds}" + (f" ({graphs[name]} graphs compiled by torch.compile)" if graphs.get(name) else "")
              for name, seconds in record["elapsed_s"].items()], ""]
    out += ["## How to read this", "", *[f"- {note}" for note in record["notes"]], ""]
    out += ["## Provenance", "", f"- command: `{record['command']}`"
            + (f", run by `{record['invoked_by']}`" if record["invoked_by"] else ""), f"- date: {record['date']}",
            f"- environment: `{json.dumps(env)}`", f"- settings: `{json.dumps(record['settings'])}`", ""]
    return "\n".join(out)


NOTES = [
    "`ratio_vs_baseline`: median over alternating rounds of time(baseline) / time(model); > 1 is faster than the "
    "baseline (`gpt2` for EGA, `all_attention` for CHIAR). `tokens_per_s`: tokens of the call / median time.",
    "Training: forward + backward + AdamW step; on CUDA fused AdamW, float32 weights under bfloat16 autocast; "
    "forward and generation on CUDA: bfloat16 weights, `torch.no_grad` (`--tiny`: float32 throughout). No dropout.",
    "`peak_mib` (CUDA only): peak GPU memory allocated during one call above what was allocated before it "
    "(activations, gradients, temporaries); `state_mib`: parameters plus AdamW state. Peak training memory ratios "
    "use their sum.",
    "Generation: greedy, a fixed number of new tokens, `cache_implementation` as named for both models "
    "(`disable_compile=True`: the static cache runs eagerly, without generate's automatic `torch.compile`, whose "
    "compile time does not fit the budget); `cache_class` is the cache class each model actually returned; "
    "`tokens_per_s` counts the new tokens, the prompt's prefill is inside the time.",
    "`ega_base`: EGA-GPT's code without gates (`energy_gate_layers=[]`): `ega1` against it is the gate's own cost.",
    "A backend a model refuses is reported as `not supported` with its reason; `forced` in the backends record "
    "means the model does not declare the backend but dispatches through `ALL_ATTENTION_FUNCTIONS`, and was set "
    "through its config. `fused SDPA only`: one forward under `sdpa_kernel([FLASH_ATTENTION, "
    "EFFICIENT_ATTENTION])`, i.e. without the math fallback.",
    "CHIAR: thresholds calibrated per routed layer (`calibrate_thresholds(per_layer=True)`) on two other random "
    "batches at the entropy percentile that sends `attention_percent` of the tokens to attention; "
    "`attention_fraction` is what each routed layer sent on the measured batch (the train row: with the calibrated "
    "weights; the forward row: with the weights it is timed with, after the training steps); `flop_speedup_bound` is "
    "the forward speed-up over the all-attention model that `count_flops` allows at that routing (LM head included).",
]


def write_results(run: Run):
    args = run.args
    record = {
        "title": "GPU benchmark: EGA-1 vs GPT-2 and CHIAR-Former vs all-attention" if not args.tiny
        else "GPU benchmark code paths on a CPU (tiny sizes, float32; not a measurement of the models)",
        "complete": run.complete,
        "command": " ".join(shlex.quote(a) for a in ["python", *sys.argv]),
        "invoked_by": args.invoked_by,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "environment": run.environment,
        "settings": {
            "dtype": "bfloat16" if run.dtype == torch.bfloat16 else str(run.dtype).replace("torch.", ""),
            "training": "float32 weights, bfloat16 autocast" if run.amp_dtype else "float32",
            "budget_s": args.budget_s, "backends": args.backends, "ega_sizes": ega_sizes(args.tiny),
            "generation": generation_settings(args.tiny), "chiar": chiar_settings(args.tiny, args),
            "attention_percent": args.attention_percent, "max_repeats": args.max_repeats,
            "backend_switches": run.backends,
        },
        "targets": target_lines(run.rows),
        "tests": read_tests_summary(args.tests_log),
        "elapsed_s": dict(run.sections),
        "compiled_graphs": dict(run.compiled_graphs),
        "notes": NOTES,
        "rows": run.rows,
    }
    os.makedirs(args.out, exist_ok=True)
    for suffix, text in ((".json", json.dumps(record, indent=2, default=str) + "\n"), (".md", markdown(run, record))):
        path = os.path.join(args.out, args.name + suffix)
        with open(path + ".tmp", "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(path + ".tmp", path)


def read_tests_summary(path: str | None) -> list[str]:
    """The outcome lines of a pytest log: its short summary (``-rA``) and final count where pytest got that far, else
    the per-test lines of ``-v`` (a run stopped at its time limit), and the check script's own lines."""
    if not path:
        return []
    if not os.path.exists(path):
        return [f"(no test log at {path})"]
    with open(path, encoding="utf-8", errors="replace") as handle:
        lines = [line.rstrip() for line in handle]
    outcomes = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")
    keep, in_summary = [], False  # (line, is a per-test -v line of the pytest run being read)
    for line in lines:
        if "short test summary info" in line:
            in_summary = True
            keep = [entry for entry in keep if not entry[1]]  # the summary replaces that run's -v lines
        elif line.startswith("GPU check") or (line.startswith("=") and (" in " in line or "no tests ran" in line)):
            keep = [(text, False) for text, _ in keep]
            keep.append((line, False))
            in_summary = False
        elif in_summary and line.startswith(outcomes):
            keep.append((line, False))
        elif not in_summary and "::" in line and any(f" {word}" in line for word in outcomes):
            keep.append((line, True))
    return [text for text, _ in keep][-300:] or lines[-40:]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cuda (default) or cpu")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes in float32: tests the code paths, not speed")
    parser.add_argument("--budget_s", type=float, default=None,
                        help="seconds for all measurements (default 240 on CUDA, 10 with --tiny); rounds are "
                        "trimmed to fit, at least 3 per measurement")
    parser.add_argument("--backends", nargs="+", default=None,
                        help="attention backends (default: sdpa flex_attention; sdpa with --tiny)")
    parser.add_argument("--sections", nargs="+", default=["ega", "chiar"], choices=["ega", "chiar"])
    parser.add_argument("--chiar_hidden", type=positive_int, default=256,
                        help="CHIAR width (default 256, the authors')")
    parser.add_argument("--chiar_heads", type=positive_int, default=4)
    parser.add_argument("--attention_percent", type=percentage, default=25.0,
                        help="percent of the tokens CHIAR's routed layers send to attention")
    parser.add_argument("--max_repeats", type=positive_int, default=None,
                        help="rounds at most (default 20; 3 with --tiny)")
    parser.add_argument("--warmup", type=non_negative_int, default=None,
                        help="warm-up rounds (default 2; 1 with --tiny)")
    parser.add_argument("--min_slot_s", type=float, default=None,
                        help="a measurement whose share of the budget is below this is skipped (default 2 s on "
                        "CUDA; never with --tiny, whose run must cover every code path)")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads on a CPU (default 1)")
    parser.add_argument("--min_compile_s", type=float, default=None,
                        help="budget needed to start a task on a compiled backend (flex_attention): default 60 s on "
                        "CUDA, never skipped with --tiny")
    parser.add_argument("--tests_log", default=None, help="pytest log whose outcome lines go into the results")
    parser.add_argument("--invoked_by", default=None, help="the command that ran this one (for the provenance)")
    parser.add_argument("--out", default=os.path.join(ROOT, "results", "benchmarks"))
    parser.add_argument("--name", default=None, help="file name without suffix (default gpu, gpu_tiny with --tiny)")
    args = parser.parse_args(argv)
    if args.chiar_hidden % args.chiar_heads:
        parser.error(f"--chiar_hidden {args.chiar_hidden} must be divisible by --chiar_heads {args.chiar_heads}")
    if args.device == "cpu" and not args.tiny:
        parser.error("--device cpu runs the GPU sizes for hours: add --tiny (the CPU run checks the code paths)")
    args.budget_s = args.budget_s if args.budget_s is not None else (10.0 if args.tiny else 240.0)
    args.backends = args.backends or (["sdpa"] if args.tiny else ["sdpa", "flex_attention"])
    args.min_slot_s = args.min_slot_s if args.min_slot_s is not None else (float("-inf") if args.tiny else 2.0)
    args.min_compile_s = args.min_compile_s if args.min_compile_s is not None else (
        float("-inf") if args.tiny else 60.0)
    args.max_repeats = args.max_repeats if args.max_repeats is not None else (3 if args.tiny else 20)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 2)
    args.name = args.name or ("gpu_tiny" if args.tiny else "gpu")

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("CUDA is not available to this torch (" + torch.__version__ + "); use --device cpu --tiny "
                         "to exercise the code paths on a CPU")
    if device.type == "cpu":
        # Tiny CPU runs check code paths; one thread avoids OpenMP's spin-waits on a machine shared with other jobs.
        torch.set_num_threads(args.threads)
    import hf_spectral  # noqa: F401  (registers the models)

    run = Run(args, device)
    run.dtype = torch.bfloat16 if device.type == "cuda" and not args.tiny else torch.float32
    run.amp_dtype = torch.bfloat16 if run.dtype == torch.bfloat16 else None
    run.environment = environment(device)
    print(json.dumps(run.environment), flush=True)
    tasks = [task for task in plan(args) if task[0][0] in args.sections]
    budget = Budget(args.budget_s, {key: w for _, weights in tasks for key, w in weights.items()})
    write_results(run)
    for (kind, what, backend), _ in tasks:
        started, graphs_before = time.perf_counter(), compiled_graphs()
        label = f"{kind} {what['label'] if kind == 'ega' else 'T=%d B=%d' % what} {backend}"
        print(f"[{label}] budget left {budget.left():.0f} s", flush=True)
        if backend not in ("sdpa", "eager"):
            # Each task compiles its own graphs (flex_attention's kernel per model, shape, dtype and grad mode): a
            # fresh recompilation budget, so that no task's rows run uncompiled past the limit the ones before used.
            torch._dynamo.reset()
        try:
            if kind == "ega":
                bench_ega(run, budget, what, backend)
            else:
                bench_chiar(run, budget, what[0], what[1], backend)
        except Exception as error:  # keep what was measured; say what broke
            traceback.print_exc()
            run.add(section=kind, size=what["label"] if kind == "ega" else "", backend=backend,
                    length=what["length"] if kind == "ega" else what[0], measurement="section", model="",
                    status="error: " + first_line(error))
        run.section(label, started, graphs_before)
    run.complete = True
    run.sections["total"] = round(time.perf_counter() - run.started, 1)
    write_results(run)
    print("\n".join(target_lines(run.rows)))
    print(f"wrote {os.path.join(args.out, args.name)}.md and .json in {run.sections['total']} s", flush=True)
    # Nothing timed (the fused-SDPA checks' "ok" rows time nothing): the check must not look green.
    if not any(row.get("status") == "ok" and row.get("ratio_vs_baseline") is not None for row in run.rows):
        raise SystemExit("bench_gpu.py measured nothing: every row failed or was skipped (see the rows' status)")


if __name__ == "__main__":
    main()
