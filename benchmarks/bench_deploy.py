"""Deployment paths against fp32 torch eager, in the same run: ONNX + onnxruntime, int8 dynamic quantization,
torchao int8 weight-only, bf16. What each changes in the logits and the loss, the size, and the speed.

    HF_SPECTRAL_DATA=/path/to/data python benchmarks/bench_deploy.py   # writes results/benchmarks/deploy.{json,md}
    python benchmarks/bench_deploy.py --data_path input.txt --quick    # tiny models, a few steps: a smoke check

Three small character-level models, each trained for a few hundred steps on TinyShakespeare's first 90% (at seed 0,
so that their predictions are peaked as a trained model's are, which is what quantization errors act on):

* EGA-GPT, variant EGA-1 (causal statistics);
* CHIAR-Former, the authors' layer layout (DCT / routed / routed / attention) with threshold routing between DCT
  mixing and attention, its thresholds calibrated after training to the 75th entropy percentile;
* GPT-2 with energy gates added (`add_energy_gates`, α = 2 at the start, so the gates act) and trained with them.

Each is scored on the same evaluation batch (consecutive blocks of the last 10%) by fp32 torch eager, then by each
path; a path that fails (export, runtime or quantization) is recorded with its error's first line and the others
go on. Per path: mean next-token loss and its difference from fp32 eager (nats per character), the largest
|logit difference|, the size of what is deployed (serialized weights or the .onnx file) and throughput relative to
fp32 eager (forward of the evaluation batch, timed in alternation: see benchmarks/timing.py).

The ONNX model is exported with `torch.onnx.export(..., dynamo=True)` from an example batch of another shape than
the evaluation batch, with batch and sequence length dynamic: the evaluation batch then runs through onnxruntime at
a shape the export never saw.
"""

import argparse
import copy
import io
import json
import os
import re
import shlex
import sys
import tempfile
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.timing import speed_ratio, time_alternating  # noqa: E402
from training.common.cli import positive_int  # noqa: E402  (the recipes' argument types)

SEED = 0
MODELS = ("ega-gpt", "chiar-former", "retrofitted-gpt2")
PATHS = ("fp32-eager", "onnxruntime", "int8-dynamic", "torchao-int8-weight-only", "bf16")
# (hidden size, layers, heads, context, training steps, evaluation blocks): the full run's models are the size of
# the recipes' CPU configuration (training/configs/tinyshakespeare_cpu.json); --quick's only check the machinery.
SIZES = {"full": (128, 4, 4, 128, 300, 16), "quick": (32, 2, 2, 32, 3, 2)}
TRAIN_BATCH = 16


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny models, a few training steps (a smoke check)")
    parser.add_argument("--data_path", default=None,
                        help="TinyShakespeare's input.txt or a folder holding it (default: $TINYSHAKESPEARE_PATH, "
                        "$HF_SPECTRAL_DATA/tinyshakespeare/, the download cache, else it is downloaded)")
    parser.add_argument("--no_download", action="store_true", help="fail rather than download the text")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--train_steps", type=int, default=None,
                        help="training steps per model (default: 300, --quick 3; 0: random weights)")
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="torch and onnxruntime threads (default 1: ratios then hold on a shared machine)")
    parser.add_argument("--repeats", type=positive_int, default=None, help="timed rounds (default 5, --quick 1)")
    parser.add_argument("--out", default="results/benchmarks")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from training.common.data import find_corpus, read_text
    from training.results import write_results
    from training.tinyshakespeare import CORPUS

    hidden, layers, heads, context, steps, eval_blocks = SIZES["quick" if args.quick else "full"]
    steps = steps if args.train_steps is None else args.train_steps
    repeats = args.repeats or (1 if args.quick else 5)
    text = read_text(find_corpus(CORPUS, args.data_path, download=not args.no_download)["train"])
    split = int(0.9 * len(text))  # nanoGPT's split, as the recipes'
    train_text, eval_text = text[:split], text[split:]

    from hf_spectral import CharTokenizer

    with tempfile.TemporaryDirectory() as folder:
        tokenizer = CharTokenizer.from_text(train_text, folder, unk_token="<unk>")
    train_ids = torch.tensor(tokenizer(train_text)["input_ids"])
    # The evaluation characters seen in training (others are <unk>): consecutive blocks of the validation text
    eval_ids = torch.tensor(tokenizer(eval_text[: eval_blocks * context])["input_ids"])
    if len(eval_ids) < eval_blocks * context or len(train_ids) <= context + 1:
        raise SystemExit(f"the text is too short for {eval_blocks} evaluation blocks of {context} characters")
    eval_batch = eval_ids[: eval_blocks * context].view(eval_blocks, context)

    rows = []
    for name in args.models:
        model = build_model(name, len(tokenizer), hidden, layers, heads, context)
        train(model, train_ids, steps, context)
        if name == "chiar-former":
            calibrate(model, train_ids, context)
        model.eval()
        rows += measure_paths(name, model, eval_batch, args.threads, repeats)
        for row in rows[-len(PATHS):]:
            print({key: value for key, value in row.items() if value is not None}, flush=True)

    notes = describe(rows, hidden, layers, heads, context, steps, eval_batch.shape, len(tokenizer), args.threads)
    json_path, md_path = write_results(
        args.out, "deploy_quick" if args.quick else "deploy", rows,
        title="Deployment paths vs fp32 torch eager, same run",
        columns=["model", "path", "works", "loss", "delta_loss", "max_abs_delta_logit", "routes_changed",
                 "size_mib", "speed_vs_fp32_eager", "error"],
        config={"hidden_size": hidden, "layers": layers, "heads": heads, "context": context, "train_steps": steps,
                "train_batch": TRAIN_BATCH, "eval_batch": list(eval_batch.shape), "vocab_size": len(tokenizer),
                "threads": args.threads, "repeats": repeats, "models": args.models,
                "versions": library_versions()},
        seeds=[SEED], notes=notes,
        # called with arguments (a test): those, as the command that would give the same run
        command=None if argv is None else " ".join(["python", "benchmarks/bench_deploy.py", *map(shlex.quote, argv)]),
    )
    # The table as docs/deploy.md carries it (small differences in powers of ten, which the table above rounds)
    with open(json_path, encoding="utf-8") as handle:
        table = docs_table(json.load(handle))
    with open(md_path, "a", encoding="utf-8") as handle:
        handle.write(f"\n## The table in docs/deploy.md\n\n{table}\n")
    print(notes)


def build_model(name, vocab_size, hidden, layers, heads, context):
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_spectral import ChiarConfig, ChiarForCausalLM, EGAConfig, EGAForCausalLM
    from hf_spectral.retrofit import EnergyGateConfig, add_energy_gates

    torch.manual_seed(SEED)
    if name == "ega-gpt":
        return EGAForCausalLM(EGAConfig.from_variant(
            "EGA-1", vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
            max_position_embeddings=context))
    if name == "chiar-former":
        return ChiarForCausalLM(ChiarConfig(
            vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=max(layers, 4), num_attention_heads=heads,
            max_position_embeddings=context, routed_operators=["dct", "attention"], router_type="threshold"))
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=vocab_size, n_embd=hidden, n_layer=layers, n_head=heads,
                                      n_positions=context, bos_token_id=None, eos_token_id=None))
    return add_energy_gates(gpt2, EnergyGateConfig(alpha_init=2.0))  # α = 2 (the EGA paper's): the gates act


def train(model, ids, steps, context):
    """``steps`` of AdamW on random blocks of ``ids`` (a fixed generator: the same blocks for every model)."""
    if steps <= 0:
        return
    generator = torch.Generator().manual_seed(SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)
    model.train()
    for step in range(steps):
        starts = torch.randint(0, len(ids) - context, (TRAIN_BATCH,), generator=generator)
        batch = torch.stack([ids[start : start + context] for start in starts.tolist()])
        for group in optimizer.param_groups:  # a short linear warm-up, then constant
            group["lr"] = 2e-3 * min(1.0, (step + 1) / max(1, steps // 10))
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()


def calibrate(model, ids, context):
    from hf_spectral.models.chiar_former import calibrate_thresholds

    blocks = ids[: 4 * 4 * context].view(4, 4, context)  # 4 batches of 4 training blocks
    calibrate_thresholds(model, list(blocks), percentiles=[75])  # ≈ 25% of the tokens to attention


def next_token_loss(logits, ids) -> float:
    return float(F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten()))


class LogitsOnly(torch.nn.Module):
    """The model as a function of the token ids alone, returning the logits: the graph ONNX gets (no cache)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


def measure_paths(name, model, batch, threads, repeats) -> list[dict]:
    """One row per path: what it changes against fp32 eager on ``batch``, its size, its speed."""
    with torch.inference_mode():
        reference = model(input_ids=batch, use_cache=False).logits.float()
    reference_loss = next_token_loss(reference, batch)
    routed = name == "chiar-former"
    forwards = {"fp32-eager": eager_forward(model, batch)}
    rows = {"fp32-eager": {"loss": reference_loss, "size_mib": state_dict_mib(model)}}
    with tempfile.TemporaryDirectory() as folder:
        for path in PATHS[1:]:
            try:
                forward, size, variant = PREPARE[path](model, batch, folder, threads)
                logits = torch.as_tensor(forward()).float()
                rows[path] = {"loss": next_token_loss(logits, batch), "size_mib": size,
                              "max_abs_delta_logit": float((logits - reference).abs().max())}
                if routed and variant is not None:
                    rows[path]["routes_changed"] = routes_changed(model, variant, batch)
                forwards[path] = forward
            except Exception as error:  # a failing path is a result: recorded, and the others go on
                rows[path] = {"error": error_summary(error)}
        times = time_alternating(forwards, repeats, warmup=1)["cpu"]
    table = []
    for path in PATHS:
        row = rows[path]
        works = "error" not in row
        table.append({
            "model": name, "path": path, "works": "yes" if works else "no",
            "loss": row.get("loss"),
            "delta_loss": row["loss"] - reference_loss if works else None,
            "max_abs_delta_logit": 0.0 if path == "fp32-eager" else row.get("max_abs_delta_logit"),
            "size_mib": row.get("size_mib"),
            "speed_vs_fp32_eager": speed_ratio(times, path, "fp32-eager") if works else None,
            "routes_changed": 0.0 if path == "fp32-eager" and routed else row.get("routes_changed"),
            "error": row.get("error"),
        })
    return table


def routes_changed(model, variant, batch) -> float:
    """The share of (token, routed layer) decisions of CHIAR-Former that ``variant`` takes otherwise than the fp32
    model. Routing thresholds a token's spectral entropy: rounding moves the tokens near a threshold to the other
    operator, whose output differs by far more than the rounding (the paths' largest logit differences)."""
    with torch.inference_mode():
        ours = model(input_ids=batch, use_cache=False, output_routing=True).routing_decisions
        theirs = variant(input_ids=batch, use_cache=False, output_routing=True).routing_decisions
    return float(torch.cat([(a != b).flatten() for a, b in zip(ours, theirs)]).float().mean())


def error_summary(error: BaseException) -> str:
    """The first line of the error and of its root cause (the exporter wraps what failed in a generic
    ConversionError), without the terminal colours the exporter adds."""
    def first_line(exception):
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(exception)).strip()
        return f"{type(exception).__name__}: {(text.splitlines() or [''])[0][:240]}"

    root = error
    while root.__cause__ is not None and root.__cause__ is not root:
        root = root.__cause__
    return first_line(error) + ("" if root is error else f" (cause: {first_line(root)})")


def eager_forward(model, batch):
    def forward():
        with torch.inference_mode():
            return model(input_ids=batch, use_cache=False).logits
    return forward


def state_dict_mib(model) -> float:
    """Serialized weights (torch.save of the state dict: tied weights once, quantized tensors as they are stored)."""
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return buffer.getbuffer().nbytes / 2**20


def require(module: str, extra: str):
    """``module`` imported, or an ImportError that names the extra which installs it."""
    try:
        return __import__(module)
    except ImportError as error:
        raise ImportError(f"needs {module}, which is not installed: pip install \"hf_spectral[{extra}]\"") from error


def prepare_onnx(model, batch, folder, threads):
    require("onnxscript", "export")  # torch.onnx.export(dynamo=True) translates the exported program with it
    onnxruntime = require("onnxruntime", "export")

    # An example of another shape than the evaluation batch: the run below checks the dynamic dimensions.
    example = batch[:2, : batch.shape[1] // 2].clone()
    dynamic = {"input_ids": {0: torch.export.Dim.DYNAMIC, 1: torch.export.Dim.DYNAMIC}}
    folder = tempfile.mkdtemp(dir=folder)  # this model's file and its external data alone
    path = os.path.join(folder, "model.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(LogitsOnly(model), (example,), dynamo=True, dynamic_shapes=dynamic,
                                    input_names=["input_ids"], output_names=["logits"], verbose=False)
    program.save(path)
    size = sum(os.path.getsize(os.path.join(folder, file)) for file in os.listdir(folder)) / 2**20
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = threads
    session = onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    feed = {"input_ids": batch.numpy()}
    return (lambda: session.run(["logits"], feed)[0]), size, None


def prepare_int8_dynamic(model, batch, folder, threads):
    # int8 weights and per-batch int8 activations for every nn.Linear (GPT-2's attention and MLP are Conv1D
    # modules, not nn.Linear: there only the gates' projections and the LM head are quantized)
    with warnings.catch_warnings():  # torch deprecates torch.ao.quantization for torchao; it still works in 2.13
        warnings.simplefilter("ignore", DeprecationWarning)
        quantized = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), {torch.nn.Linear},
                                                           dtype=torch.qint8)
    if not any(type(module).__module__.startswith("torch.ao.nn.quantized") for module in quantized.modules()):
        raise RuntimeError("quantize_dynamic replaced no nn.Linear")
    return eager_forward(quantized, batch), state_dict_mib(quantized), quantized


def prepare_torchao(model, batch, folder, threads):
    require("torchao", "quantization")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    quantized = copy.deepcopy(model)
    quantize_(quantized, Int8WeightOnlyConfig())  # every nn.Linear's weight int8, per output channel
    return eager_forward(quantized, batch), state_dict_mib(quantized), quantized


def prepare_bf16(model, batch, folder, threads):
    halved = copy.deepcopy(model).to(torch.bfloat16)
    return eager_forward(halved, batch), state_dict_mib(halved), halved


PREPARE = {"onnxruntime": prepare_onnx, "int8-dynamic": prepare_int8_dynamic,
           "torchao-int8-weight-only": prepare_torchao, "bf16": prepare_bf16}


def docs_table(record: dict) -> str:
    """The table of docs/deploy.md from a results record (the test checks the page against the committed record):
    one row per model and path, then the failing paths' errors and the command, date and CPU of the run."""
    def number(value, form):
        return "—" if value is None else format(value, form)

    lines = ["| model | path | works | Δloss (nats/char) | max \\|Δlogit\\| | routes changed | size (MiB) | "
             "speed vs fp32 eager |", "|---|---|---|---|---|---|---|---|"]
    for row in record["rows"]:
        lines.append(f"| {row['model']} | {row['path']} | {row['works']} | {number(row['delta_loss'], '+.1e')} | "
                     f"{number(row['max_abs_delta_logit'], '.1e')} | {number(row.get('routes_changed'), '.1%')} | "
                     f"{number(row['size_mib'], '.2f')} | "
                     f"{number(row['speed_vs_fp32_eager'], '.2f')}{'' if row['speed_vs_fp32_eager'] is None else '×'} |")
    failing = [f"- {row['model']} / {row['path']}: `{row['error']}`" for row in record["rows"] if row["works"] == "no"]
    hardware = record["hardware"]
    config = record["config"]
    return "\n".join([
        *lines, "",
        *(["Failing paths:", "", *failing, ""] if failing else []),
        f"Run: `{record['command']}`, {record['date']}; {hardware.get('cpu_model', hardware['processor'])} "
        f"({hardware['cpu_count']} cores, {config['threads']} thread(s)), torch {hardware['torch']}, transformers "
        f"{hardware['transformers']}, " + ", ".join(f"{name} {version}" for name, version in config["versions"].items())
        + f"; seed {record['seeds'][0]}, {config['train_steps']} training steps, evaluation batch "
        f"{config['eval_batch'][0]} × {config['eval_batch'][1]} characters; fp32 eager loss "
        + ", ".join(f"{row['model']} {row['loss']:.3f}" for row in record["rows"] if row["path"] == "fp32-eager")
        + ".",
    ])


def library_versions() -> dict:
    versions = {}
    for module in ("onnx", "onnxscript", "onnxruntime", "torchao"):
        try:
            versions[module] = __import__(module).__version__
        except Exception as error:  # not installed: the path's rows say what failed
            versions[module] = f"unavailable ({type(error).__name__})"
    return versions


def describe(rows, hidden, layers, heads, context, steps, eval_shape, vocab_size, threads) -> str:
    failing = [f"{row['model']} {row['path']}: {row['error']}" for row in rows if row["works"] == "no"]
    losses = {row["model"]: row["loss"] for row in rows if row["path"] == "fp32-eager"}
    return (
        f"Character-level models (C = {hidden}, {layers} layers (CHIAR-Former: {max(layers, 4)}), {heads} heads, "
        f"context {context}, {vocab_size} ids) trained {steps} steps (batch {TRAIN_BATCH}, AdamW, seed {SEED}) on "
        f"TinyShakespeare's first 90%; evaluated on {eval_shape[0]} consecutive blocks of {eval_shape[1]} characters "
        "of the last 10%. fp32 eager loss: "
        + ", ".join(f"{model} {loss:.4f}" for model, loss in losses.items())
        + " nats per character.\n\n"
        "`delta_loss`: loss of the path − fp32 eager loss (nats per character); `max_abs_delta_logit`: the largest "
        "|logit difference| over the batch; `routes_changed` (CHIAR-Former, torch paths): the share of its "
        "(token, routed layer) decisions taken otherwise than in fp32 (a token near a threshold changes operator, "
        "hence the large logit differences where the loss barely moves); `size_mib`: torch.save of the state dict, or the .onnx file; "
        f"`speed_vs_fp32_eager`: throughput ratio from CPU time ({threads} thread(s)), "
        "> 1 is faster; these move by several points between runs and CPUs, the deltas by their last digits.\n\n"
        "Paths: ONNX via `torch.onnx.export(..., dynamo=True)` with dynamic batch and sequence length, run by "
        "onnxruntime's CPU provider at a shape the export did not see; `torch.ao.quantization.quantize_dynamic` "
        "on nn.Linear (qint8); torchao `quantize_(model, Int8WeightOnlyConfig())`; `model.to(torch.bfloat16)`.\n\n"
        + ("Failing paths:\n" + "\n".join(f"- {line}" for line in failing) if failing else "Every path works.")
        + "\n"
    )


if __name__ == "__main__":
    main()
