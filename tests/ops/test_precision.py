"""The working precision of the mechanisms (hf_spectral/ops/precision.py)."""

import torch

from hf_spectral.ops.precision import full_precision


def test_full_precision_turns_autocast_off_and_is_empty_on_a_device_without_autocast():
    x = torch.ones(2, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert (x @ x).dtype == torch.bfloat16
        with full_precision(x):
            assert (x @ x).dtype == torch.float32
    on_meta = torch.ones(2, 2, device="meta")
    with full_precision(on_meta):
        assert (on_meta @ on_meta).dtype == torch.float32


def test_a_compiled_graph_does_not_ask_whether_the_device_has_autocast(monkeypatch):
    """torch 2.10's Dynamo cannot trace torch.amp.is_autocast_available: asked inside a graph, it broke every
    forward that keeps its statistics in full precision (a failure under fullgraph=True). Stand-in: the same answer,
    with a graph break when a graph asks."""
    answer = torch.amp.is_autocast_available

    def breaks_a_graph(device_type):
        if torch.compiler.is_compiling():
            torch._dynamo.graph_break()
        return answer(device_type)

    monkeypatch.setattr(torch.amp, "is_autocast_available", breaks_a_graph)

    def square(x):
        with full_precision(x):
            return x @ x

    torch._dynamo.reset()
    x = torch.randn(3, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        compiled = torch.compile(square, fullgraph=True, backend="eager")(x)
    assert compiled.dtype == torch.float32
    torch.testing.assert_close(compiled, x @ x, atol=1e-6, rtol=1e-6)
