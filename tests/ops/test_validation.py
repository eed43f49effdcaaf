"""`check_parameters_fit`: a model whose parameters cannot be allocated where it is built is refused before it
allocates anything, in the dtype and on the device it is built in; nothing is refused on the meta device, and under
accelerate's ``init_empty_weights`` (each parameter moves to the meta device as it is made) only the largest tensor
must fit. The model families' own tests check the message with an impossible config."""

import pytest
import torch
from accelerate import init_empty_weights
from transformers import AutoModelForCausalLM

from hf_spectral import EGAConfig, EGAForCausalLM
from hf_spectral.ops import validation
from hf_spectral.ops.validation import available_memory, parameter_blocks


def _config():
    return EGAConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                     max_position_embeddings=16)


def _elements(config) -> tuple[int, int]:
    """(all the elements `parameter_blocks` counts, those of its largest tensor)."""
    blocks = parameter_blocks(config, learned_positions=True)
    return sum(elements * count for _, elements, _, count in blocks), max(elements for _, elements, _, _ in blocks)


def test_the_parameters_are_counted_in_the_dtype_the_model_is_built_in(monkeypatch):
    total, _ = _elements(_config())
    monkeypatch.setattr(validation, "available_memory", lambda device: 3 * total)  # between bfloat16's and float32's
    with pytest.raises(ValueError, match=f"need at least .*\\({total * 4:,} bytes\\) of torch.float32 on cpu"):
        EGAForCausalLM(_config())
    model = AutoModelForCausalLM.from_config(_config(), dtype=torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16


def test_the_meta_device_is_never_checked(monkeypatch):
    monkeypatch.setattr(validation, "available_memory", lambda device: 0)
    with torch.device("meta"):
        model = EGAForCausalLM(EGAConfig(vocab_size=10**12))
    assert model.model.wte.weight.shape == (10**12, 256) and model.model.wte.weight.is_meta


def test_under_init_empty_weights_only_the_largest_tensor_must_fit(monkeypatch):
    total, largest = _elements(_config())
    monkeypatch.setattr(validation, "available_memory", lambda device: 4 * (total + largest) // 2)
    with pytest.raises(ValueError, match="the parameters of this model need"):
        EGAForCausalLM(_config())
    with init_empty_weights():
        assert EGAForCausalLM(_config()).lm_head.weight.is_meta
    monkeypatch.setattr(validation, "available_memory", lambda device: 4 * largest - 1)
    with init_empty_weights(), pytest.raises(ValueError, match="EGAConfig: its largest parameter tensor needs"):
        EGAForCausalLM(_config())


def test_the_memory_of_the_cpu_is_its_physical_memory():
    with open("/proc/meminfo") as meminfo:  # "MemTotal:  16318412 kB"
        total = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemTotal:"))
    assert available_memory(torch.device("cpu")) == total
