"""The parts of a decoding step that EGA-GPT's generation does differently from GPT-2's, each against the way it
replaces, in the same run, at the shapes of the EGA benchmark's model (hidden 256, 8 heads of 32, MLP 1024):

* the KV cache append: ``DynamicLayer`` (transformers' default: concatenation, which copies the whole cache) against
  ``GrowingLayer`` (EGA-GPT's default: written into spare room), at batch 32 from 64 to 128 cached positions;
* the projections of one block at a step's few rows, the weights evicted from the CPU caches before each call: ``F.linear`` with an (out, in) weight, as ``nn.Linear`` holds it, against
  the product with an (in, out) copy (GPT-2's Conv1D layout): where the second wins, ``DecodingLinear`` takes it;
* the attention over the folded cache (32 + 2 channels per head): SDPA over the folded channels, the compiled
  decoding attention, and, for scale, SDPA over an unfolded 32-channel cache (what GPT-2 reads), with the caches
  evicted from the CPU caches before each call (a step's other layers do that in a model).

    python benchmarks/bench_decoding_parts.py      # writes results/benchmarks/decoding_parts.{json,md}
"""

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.timing import time_alternating  # noqa: E402
from hf_spectral.models.ega_gpt.compiled_kernels import decoding_attention_with_key_bias  # noqa: E402
from hf_spectral.models.ega_gpt.growing_cache import GrowingLayer  # noqa: E402
from transformers.cache_utils import DynamicLayer  # noqa: E402

HIDDEN, HEADS, HEAD_DIM, FOLDED, MLP = 256, 8, 32, 34, 1024


def alternating_medians(fns: dict, repeats: int, before_each=None) -> dict:
    """Median wall-clock seconds per call of each function, called in turn (``timing.time_alternating``)."""
    times = time_alternating(fns, repeats, warmup=1, before_each=before_each)["wall"]
    return {name: statistics.median(values) for name, values in times.items()}


def cache_append(batch: int, repeats: int) -> list[dict]:
    """64 decoding steps' appends to one layer after a 64-position prompt."""
    generator = torch.Generator().manual_seed(0)
    prompt = [torch.randn(batch, HEADS, 64, FOLDED, generator=generator) for _ in range(2)]
    steps = [torch.randn(batch, HEADS, 1, FOLDED, generator=generator) for _ in range(2)]

    def appends(layer_class):
        def run():
            layer = layer_class(128) if layer_class is GrowingLayer else layer_class()
            layer.update(*prompt)
            for _ in range(64):
                layer.update(*steps)
        return run

    with torch.inference_mode():
        medians = alternating_medians({"DynamicLayer": appends(DynamicLayer), "GrowingLayer": appends(GrowingLayer)},
                                      repeats)
    return [{"part": f"cache append, batch {batch}, 64 steps from 64 positions", "variant": name,
             "ms": 1e3 * seconds, "ratio": seconds / medians["DynamicLayer"]} for name, seconds in medians.items()]


def projections(rows: int, repeats: int) -> list[dict]:
    """One decoding step's four projections (q/k/v, attention output, MLP in and out) for ``rows`` sequences."""
    generator = torch.Generator().manual_seed(0)
    shapes = [(HIDDEN, 3 * HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, MLP), (MLP, HIDDEN)]
    weights = [torch.randn(out, inp, generator=generator) * 0.05 for inp, out in shapes]
    biases = [torch.randn(w.shape[0], generator=generator) for w in weights]
    copies = [w.t().contiguous() for w in weights]  # as DecodingLinear copies them
    inputs = [torch.randn(rows, 1, w.shape[1], generator=generator) for w in weights]

    def linear():
        for x, w, b in zip(inputs, weights, biases):
            F.linear(x, w, b)

    def in_out():
        for x, w, b in zip(inputs, copies, biases):
            torch.addmm(b, x.view(rows, -1), w)

    evict = torch.zeros(64 * 2**20 // 4)  # a step's other layers evict these weights from the CPU caches
    with torch.inference_mode():
        medians = alternating_medians({"F.linear (out, in)": linear, "addmm (in, out)": in_out}, repeats,
                                      before_each=lambda: evict.add_(1.0))
    return [{"part": f"projections of one block, {rows} rows, caches evicted", "variant": name, "ms": 1e3 * seconds,
             "ratio": seconds / medians["F.linear (out, in)"]} for name, seconds in medians.items()]


def decoding_attention(batch: int, length: int, repeats: int) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    # caches at the front of buffers of 128 positions, as generate() fills them
    key, value = (torch.randn(batch, HEADS, 128, FOLDED, generator=generator)[:, :, :length] for _ in range(2))
    key[..., HEAD_DIM] = -torch.rand(batch, HEADS, length, generator=generator)  # the keys' log-gate bias
    query = torch.randn(batch, HEADS, 1, FOLDED, generator=generator)
    query[..., HEAD_DIM] = HEAD_DIM**0.5  # the folded query's bias channel: SDPA then adds the key's bias
    query[..., HEAD_DIM + 1 :] = 0
    plain_key, plain_value = (torch.randn(batch, HEADS, 128, HEAD_DIM, generator=generator)[:, :, :length]
                              for _ in range(2))
    evict = torch.zeros(64 * 2**20 // 4)  # 64 MiB: more than this CPU's L2, written before each call

    fns = {
        "SDPA, folded cache": lambda: F.scaled_dot_product_attention(query, key, value, scale=HEAD_DIM**-0.5),
        "compiled, folded cache": lambda: decoding_attention_with_key_bias(query, key, value, HEAD_DIM,
                                                                           HEAD_DIM**-0.5),
        "SDPA, unfolded cache (GPT-2)": lambda: F.scaled_dot_product_attention(query[..., :HEAD_DIM], plain_key,
                                                                               plain_value),
    }
    with torch.inference_mode():
        expected = fns["SDPA, folded cache"]()[..., :HEAD_DIM].transpose(1, 2)
        torch.testing.assert_close(fns["compiled, folded cache"](), expected, atol=1e-5, rtol=0)
        medians = alternating_medians(fns, repeats, before_each=lambda: evict.add_(1.0))
    return [{"part": f"attention of one step, batch {batch}, {length} cached, caches evicted", "variant": name,
             "ms": 1e3 * seconds, "ratio": seconds / medians["SDPA, folded cache"]} for name, seconds in medians.items()]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=41)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="results/benchmarks")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from training.results import write_results

    rows = [*cache_append(32, max(5, args.repeats // 4)), *cache_append(8, max(5, args.repeats // 4))]
    for batch in (1, 4, 8, 16, 32):
        rows += projections(batch, args.repeats * 10)
    for batch in (8, 32):
        rows += decoding_attention(batch, 96, args.repeats * 5)
    for row in rows:
        print(f"{row['part']:<62} {row['variant']:<30} {row['ms']:8.3f} ms  x{row['ratio']:.3f}")
    write_results(
        args.out, "decoding_parts", rows, title="Parts of a decoding step: EGA-GPT's way against the one it replaces",
        config={"hidden": HIDDEN, "heads": HEADS, "head_dim": HEAD_DIM, "folded_channels": FOLDED, "mlp": MLP,
                "repeats": args.repeats, "threads": args.threads},
        seeds=[0],
        notes=("Median milliseconds per call over alternating rounds; `ratio` is the time against the first variant "
               "of the same part (< 1: faster). These parts explain the generation rows of `ega_gpt.md`: GPT-2's "
               "default cache concatenates (first part), its Conv1D projections already hold (in, out) weights "
               "(second part), and EGA-GPT's cache keeps 2 extra channels per head (third part)."),
        columns=["part", "variant", "ms", "ratio"],
    )


if __name__ == "__main__":
    main()
