"""Test helpers shared across the suite."""

import json
import os
import subprocess
import sys
import textwrap

import torch
from transformers.utils import is_torch_greater_or_equal

# Runs in a fresh interpreter where `import hf_spectral` fails, as on a machine without the plugin.
_REMOTE_LOAD_SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.modules["hf_spectral"] = None  # any import of the plugin now raises ImportError
    import torch, transformers
    path, auto_class, inputs_file, out_file = sys.argv[1:5]
    model = getattr(transformers, auto_class).from_pretrained(path, trust_remote_code=True).eval()
    inputs = {k: torch.tensor(v) for k, v in json.load(open(inputs_file)).items()}
    with torch.no_grad():
        logits = model(**inputs).logits
    assert not any(name == "hf_spectral" or name.startswith("hf_spectral.") for name in sys.modules
                   if sys.modules[name] is not None), "hf_spectral was imported"
    json.dump({"logits": logits.tolist(), "class": type(model).__module__ + "." + type(model).__name__},
              open(out_file, "w"))
    """
)


def load_without_plugin(path: str, auto_class: str, inputs: dict, tmp_path) -> tuple[torch.Tensor, str]:
    """Load ``path`` with ``transformers.<auto_class>.from_pretrained(..., trust_remote_code=True)`` in a
    subprocess that cannot import hf_spectral; return its logits on ``inputs`` and the loaded class name."""
    inputs_file, out_file = tmp_path / "inputs.json", tmp_path / "out.json"
    inputs_file.write_text(json.dumps({k: v.tolist() for k, v in inputs.items()}))
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    result = subprocess.run(
        [sys.executable, "-c", _REMOTE_LOAD_SCRIPT, str(path), auto_class, str(inputs_file), str(out_file)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    out = json.loads(out_file.read_text())
    return torch.tensor(out["logits"]), out["class"]


def perturb_after(input_ids: torch.Tensor, position: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """A copy of ``input_ids`` with every token after ``position`` replaced by a different random token."""
    generator = torch.Generator().manual_seed(seed)
    changed = input_ids.clone()
    tail = changed[:, position + 1 :]
    offset = torch.randint(1, vocab_size, tail.shape, generator=generator)
    changed[:, position + 1 :] = (tail + offset) % vocab_size
    return changed


def assert_causal(logits_of, input_ids: torch.Tensor, positions, vocab_size: int) -> None:
    """The causal perturbation test: for each position, changing every later token leaves the logits up to it exactly
    as they were, and moves some later ones (so that the test can fail). ``logits_of(ids)`` -> (B, T, V)."""
    reference = logits_of(input_ids)
    for position in positions:
        changed = logits_of(perturb_after(input_ids, position, vocab_size))
        assert torch.equal(changed[:, : position + 1], reference[:, : position + 1])
        assert not torch.allclose(changed[:, position + 1 :], reference[:, position + 1 :])


def gates_decoded_token_by_token(model, input_ids: torch.Tensor) -> tuple[torch.Tensor, object]:
    """Feed ``input_ids`` to ``model`` one token at a time through its cache (``cache=``, ``use_cache=True``,
    ``output_gate_values=True``): the first layer's gate values of every step, concatenated along the key axis in
    float32, and the final cache."""
    with torch.no_grad():
        cache, gates = None, []
        for t in range(input_ids.shape[1]):
            out = model(input_ids[:, t : t + 1], cache=cache, use_cache=True, output_gate_values=True)
            cache = out.cache
            gates.append(out.gate_values[0].float())
    return torch.cat(gates, -1), cache


def assert_cache_continues_across_an_autocast_boundary(model, input_ids, prefill_under_autocast: bool, split: int):
    """A KV cache filled by the first ``split`` tokens with bfloat16 autocast on (off), continued with it off (on),
    keeps the dtype it was filled in and gives the float32 forward's logits to bfloat16 tolerance."""
    with torch.no_grad():
        expected = model(input_ids).logits[:, split:]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=prefill_under_autocast):
            cache = model(input_ids[:, :split], use_cache=True).cache
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not prefill_under_autocast):
            continued = model(input_ids[:, split:], cache=cache, use_cache=True).logits
    assert cache.layers[0].values.dtype == (torch.bfloat16 if prefill_under_autocast else torch.float32)
    assert cache.get_seq_length() == input_ids.shape[1]
    torch.testing.assert_close(continued.float(), expected, atol=0.05, rtol=0.05)  # bfloat16 arithmetic


# torch 2.13's Inductor sizes its C++ vector loops for the CPU it runs on but builds them against ATen's vector types
# for the forced capability: with ATEN_CPU_CAPABILITY=avx2 on an AVX-512 machine its flex_attention kernel loops over
# 16 lanes of 8-lane vectors (index checks fail, values go wrong; the same BlockMask and inputs are fine at the native
# ISA), and with =default its flex template does not compile or the process aborts while building transformers' flex
# block mask. Tests that compile (flex_attention on CPU, torch.compile) therefore skip under a forced capability;
# every eager and SDPA test still runs there.
INDUCTOR_ISA_FORCED = os.environ.get("ATEN_CPU_CAPABILITY", "").lower() in ("default", "avx2")
INDUCTOR_SKIP_REASON = (
    "ATEN_CPU_CAPABILITY is forced below the CPU's ISA: torch 2.13's Inductor (flex_attention on CPU, torch.compile) "
    "fails to compile, aborts or computes wrong values there"
)


# transformers 5.25 builds the DynamicCache of a forward called with use_cache=True through code that torch's Dynamo
# traces without a graph break only from torch 2.9 on (on torch 2.8 a stock GPT-2's forward breaks twice there). On
# an older torch the tests that count graph breaks count them in the model's own code: in forwards without a cache.
DYNAMO_TRACES_CACHE_CREATION = is_torch_greater_or_equal("2.9", accept_dev=True)
CACHE_FREE_ON_OLD_DYNAMO = {} if DYNAMO_TRACES_CACHE_CREATION else {"use_cache": False}


def assert_fullgraph_static_generation_matches_eager(model, input_ids, attention_mask, new_tokens: int) -> None:
    """transformers' fast generation, both ways, with a StaticCache and the model compiled as one graph
    (``fullgraph=True``: any graph break fails), generates the eager tokens, logits within atol 1e-5 / rtol 1e-5:
    the compilation ``generate()`` applies by itself on a GPU (its ``CompileConfig``, forced here on the CPU),
    then the documented recipe, ``model.forward`` under ``torch.compile``."""
    from transformers import CompileConfig

    settings = dict(attention_mask=attention_mask, max_new_tokens=new_tokens, do_sample=False,
                    cache_implementation="static", output_logits=True, return_dict_in_generate=True)
    expected = model.generate(input_ids, **settings)
    # Compiled code is cached per code object, and transformers' forward decorators share theirs across models:
    # earlier tests' entries would count against dynamo's recompilation limit.
    torch._dynamo.reset()
    compile_config = CompileConfig(fullgraph=True)
    compile_config._compile_all_devices = True  # generate() compiles by itself only on accelerators
    auto_compiled = model.generate(input_ids, compile_config=compile_config, **settings)
    assert "_compiled_call" in vars(model), "generate() did not compile the model"
    del model._compiled_call
    model.forward = torch.compile(model.forward, fullgraph=True)
    compiled = model.generate(input_ids, **settings)
    for outputs in (auto_compiled, compiled):
        assert torch.equal(outputs.sequences, expected.sequences)
        for a, b in zip(outputs.logits, expected.logits):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


class EveryModel(torch.nn.Module):
    """Several models behind one forward, so that one export covers them all (exporting is seconds per program on a
    small CPU): each model's logits, a language model's on the real tokens only (padding positions zeroed, where eager
    and an exported program may differ without meaning)."""

    def __init__(self, models):
        super().__init__()
        self.models = torch.nn.ModuleList(models)

    def forward(self, input_ids, attention_mask):
        outputs = [model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
                   for model in self.models]
        keep = attention_mask[..., None].to(torch.float32)
        return tuple(logits * keep if logits.dim() == 3 else logits for logits in outputs)


def padded_inputs(batch: int, length: int, vocab_size: int, seed: int, low: int = 1) -> dict:
    """Token ids in [low, vocab_size) with every other row left-padded (its first third masked)."""
    ids = torch.randint(low, vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[::2, : length // 3] = 0
    return {"input_ids": ids, "attention_mask": mask}


EXPORT_TOLERANCE = dict(atol=1e-5, rtol=0)  # the bar for onnxruntime against eager; measured ≤ 1e-6


def assert_exports_with_dynamic_batch_and_length(module, example: dict, cases: list, onnx_path) -> None:
    """``module`` (input_ids, attention_mask) -> tuple of tensors exported once with torch.export, the batch and the
    length dynamic, then to ONNX from that program (torch.onnx.export, dynamo exporter) and run by onnxruntime:
    both give eager's outputs on every input of ``cases`` (other batches and lengths than the example's)."""
    import onnxruntime
    from torch.export import Dim, export

    module.eval()
    batch, length = Dim("batch", min=1, max=16), Dim("length", min=1, max=48)
    shapes = {name: {0: batch, 1: length} for name in example}
    program = export(module, (), example, dynamic_shapes=shapes)
    torch.onnx.export(program, (), str(onnx_path), kwargs=example, dynamo=True, verbose=False)
    session = onnxruntime.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    for inputs in cases:
        with torch.no_grad():
            expected = module(**inputs)
            exported = program.module()(**inputs)
        ran = session.run(None, {name: value.numpy() for name, value in inputs.items()})
        assert len(exported) == len(ran) == len(expected)
        for index, (want, got, onnx_out) in enumerate(zip(expected, exported, ran)):
            shape = tuple(inputs["input_ids"].shape)
            torch.testing.assert_close(got, want, **EXPORT_TOLERANCE, msg=lambda m: f"torch.export {index} {shape}: {m}")
            torch.testing.assert_close(torch.from_numpy(onnx_out), want, **EXPORT_TOLERANCE,
                                       msg=lambda m: f"onnxruntime {index} {shape}: {m}")
