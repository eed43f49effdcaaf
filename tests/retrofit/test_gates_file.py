"""`add_energy_gates` and `load_energy_gates` leave the model exactly as it was when they fail."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel

import hf_spectral  # noqa: F401
from hf_spectral.retrofit import EnergyGateConfig, add_energy_gates, load_energy_gates, save_energy_gates
from hf_spectral.retrofit import modeling_energy_gated

VOCAB = 50


def gpt2(path=None):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64))
    if path is not None:
        model.save_pretrained(path)
    return model


def snapshot(model):
    """Everything a failed call must not change: classes, module tree, parameters and buffers, config."""
    return {
        "class": type(model),
        "config_class": type(model.config),
        "config": model.config.to_dict(),
        "modules": [(name, type(module)) for name, module in model.named_modules()],
        "state": {name: tensor.clone() for name, tensor in model.state_dict().items()},
        "hooks": [len(module._forward_pre_hooks) for module in model.modules()],
        "attributes": [sorted(vars(module)) for module in model.modules()],
    }


def assert_unchanged(model, before):
    after = snapshot(model)
    for key in ("class", "config_class", "config", "modules", "hooks", "attributes"):
        assert after[key] == before[key], key
    assert after["state"].keys() == before["state"].keys()
    for name, tensor in before["state"].items():
        assert torch.equal(after["state"][name], tensor), name


def gates_file(tmp_path, gate_config=None):
    model = add_energy_gates(gpt2(), gate_config or EnergyGateConfig(alpha_init=0.5))
    path = save_energy_gates(model, tmp_path / "gates.safetensors")
    with safe_open(path, framework="pt") as handle:
        return path, {key: handle.get_tensor(key) for key in handle.keys()}, handle.metadata()


def rewrite(path, tensors, metadata):
    save_file(tensors, path, metadata=metadata)
    return path


def broken_files(tmp_path):
    path, tensors, metadata = gates_file(tmp_path)
    name = next(iter(tensors))
    yield "not a readable safetensors file", rewrite_bytes(tmp_path / "corrupt.safetensors", path.read_bytes()[:-40])
    wrong_shape = {**tensors, name: torch.zeros(tensors[name].numel() + 1)}
    yield f"{name} has shape", rewrite(tmp_path / "shape.safetensors", wrong_shape, metadata)
    missing = dict(list(tensors.items())[1:])
    yield "does not match this model's gates: missing", rewrite(tmp_path / "missing.safetensors", missing, metadata)
    nan = {**tensors, name: torch.full_like(tensors[name], float("nan"))}
    yield "non-finite values", rewrite(tmp_path / "nan.safetensors", nan, metadata)
    stray = {**tensors, "transformer.wte.weight": torch.zeros(VOCAB, 32)}
    yield "not an energy-gate parameter", rewrite(tmp_path / "stray.safetensors", stray, metadata)
    yield "corrupt", rewrite(tmp_path / "badjson.safetensors", tensors, {**metadata, "hf_spectral_energy_gates": "{"})
    other = {**metadata, "hf_spectral_energy_gates": metadata["hf_spectral_energy_gates"].replace('"hidden_size": 32',
                                                                                                  '"hidden_size": 48')}
    yield "hidden_size=48", rewrite(tmp_path / "width.safetensors", tensors, other)


def rewrite_bytes(path, data):
    path.write_bytes(data)
    return path


def test_a_failed_load_leaves_a_model_without_gates_unchanged(tmp_path):
    model = gpt2()
    before = snapshot(model)
    for message, path in broken_files(tmp_path):
        with pytest.raises(ValueError, match=message):
            load_energy_gates(model, path)
        assert_unchanged(model, before)
    assert type(model) is GPT2LMHeadModel


def test_a_failed_load_leaves_a_gated_model_unchanged(tmp_path):
    model = add_energy_gates(gpt2(), EnergyGateConfig(alpha_init=0.5))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith((".alpha", ".tau")):
                parameter.add_(0.25)
    before = snapshot(model)
    for message, path in broken_files(tmp_path):
        with pytest.raises(ValueError, match=message):
            load_energy_gates(model, path)
        assert_unchanged(model, before)


def test_a_good_file_still_loads_after_failures(tmp_path):
    path, tensors, _ = gates_file(tmp_path)
    model = gpt2()
    (tmp_path / "broken").mkdir()
    for _, broken in broken_files(tmp_path / "broken"):
        with pytest.raises(ValueError):
            load_energy_gates(model, broken)
    load_energy_gates(model, path)
    state = model.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in tensors.items())


def test_a_failed_add_leaves_the_model_unchanged(tmp_path, monkeypatch):
    model = gpt2()
    before = snapshot(model)
    built = []
    real_gate = modeling_energy_gated.EnergyGate

    def failing_gate(*args, **kwargs):  # fails on the second layer, after the first one was gated
        built.append(1)
        if len(built) == 2:
            raise ImportError("energy kind needs PyWavelets: pip install \"hf_spectral[wavelets]\"")
        return real_gate(*args, **kwargs)

    monkeypatch.setattr(modeling_energy_gated, "EnergyGate", failing_gate)
    with pytest.raises(ImportError, match="PyWavelets"):
        add_energy_gates(model, EnergyGateConfig())
    assert len(built) == 2
    assert_unchanged(model, before)
    monkeypatch.undo()
    add_energy_gates(model, EnergyGateConfig())  # and it can still be gated afterwards


def test_gates_that_differ_only_in_their_starting_values_take_the_file(tmp_path):
    """tau_init and alpha_init only start τ and α, which the file holds: a model whose gates started elsewhere has
    the same gates (as after loading a gated adapter, whose gates are added as the identity)."""
    path, tensors, _ = gates_file(tmp_path)  # alpha_init=0.5
    model = add_energy_gates(gpt2(), EnergyGateConfig(alpha_init=0.0, tau_init=2.0))
    load_energy_gates(model, path)
    state = model.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in tensors.items())
