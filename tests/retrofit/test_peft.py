"""PEFT: default LoRA targets for the hf_spectral models, and adapters of gated models that keep their gates through
every loader (PeftModel.from_pretrained / load_adapter, AutoPeftModel, transformers' load_adapter)."""

import warnings

import pytest
import torch
from peft import AutoPeftModelForCausalLM, LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging as transformers_logging

import hf_spectral  # noqa: F401  (registers the PEFT integration)
from hf_spectral import ChiarConfig, ChiarForCausalLM, EGAConfig, EGAForCausalLM
from hf_spectral.peft_integration import GATE_CONFIG_NAME, load_gated_adapter
from hf_spectral.retrofit import EnergyGateConfig, add_energy_gates, gated_attention_modules, has_energy_gates

INTEGRATION_LOGGER = transformers_logging.get_logger("hf_spectral.peft_integration")

VOCAB = 50


def batch(length=10, seed=1):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (3, length), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    return ids.masked_fill(mask == 0, 0), mask


def logits(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits * mask[..., None]


def train_steps(model, steps=3):
    ids, mask = batch()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval()


def ega_model():
    torch.manual_seed(0)
    return EGAForCausalLM(EGAConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                    max_position_embeddings=32, embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0))


def chiar_model():
    torch.manual_seed(0)
    return ChiarForCausalLM(ChiarConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                        max_position_embeddings=32, hidden_dropout=0.0,
                                        layer_operators=["routed", "attention"], routed_operators=["dct", "rbf", "attention"]))


def tiny_gpt2():
    return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64))


def gpt2_checkpoint(path):
    torch.manual_seed(0)
    tiny_gpt2().save_pretrained(path)
    return path


# ----------------------------------------------------------------------------------------------------------------
# Default target modules
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("build, expected", [
    (ega_model, {"attn.c_attn"}),
    (chiar_model, {"attention.q_proj", "attention.kv_proj", "rbf.v_proj"}),
], ids=["ega_gpt", "chiar_former"])
def test_lora_without_target_modules_adapts_the_attention_projections(build, expected):
    model = build().eval()
    ids, mask = batch()
    before = logits(model, ids, mask)
    peft_model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=4))
    adapted = {name.split("model.", 2)[-1] for name, module in peft_model.named_modules() if hasattr(module, "lora_A")}
    suffixes = {".".join(name.split(".")[-2:]) for name in adapted}
    assert suffixes == expected
    # every attention layer is adapted, nothing else
    attention_layers = {name for name, _ in model.named_modules() if name.endswith((".attn", ".attention"))}
    assert all(any(name.startswith(layer + ".") for name in adapted) for layer in attention_layers)
    peft_model.eval()
    torch.testing.assert_close(logits(peft_model, ids, mask), before, atol=1e-6, rtol=0)  # LoRA starts at zero
    trainable = {name for name, p in peft_model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)


def test_a_retrofitted_model_gets_the_stock_family_targets(tmp_path):
    model = add_energy_gates(AutoModelForCausalLM.from_pretrained(gpt2_checkpoint(tmp_path / "g")))
    peft_model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=4))
    assert {name.rsplit(".", 1)[-1] for name, m in peft_model.named_modules() if hasattr(m, "lora_A")} == {"c_attn"}


# ----------------------------------------------------------------------------------------------------------------
# Adapters of gated models
# ----------------------------------------------------------------------------------------------------------------


def trained_gated_adapter(tmp_path, gate_config=None, modules_to_save=("energy_gate",), target_modules=None):
    """A GPT-2 checkpoint, gates added, LoRA + gates trained and saved as an adapter; returns (base, adapter, logits)."""
    base_path = gpt2_checkpoint(tmp_path / "base")
    gate_config = gate_config or EnergyGateConfig(alpha_init=0.5, layers=[1])
    model = add_energy_gates(AutoModelForCausalLM.from_pretrained(base_path), gate_config)
    lora = LoraConfig(task_type="CAUSAL_LM", r=4, modules_to_save=list(modules_to_save), target_modules=target_modules)
    peft_model = get_peft_model(model, lora)
    train_steps(peft_model)
    ids, mask = batch()
    expected = logits(peft_model, ids, mask)
    peft_model.save_pretrained(tmp_path / "adapter")
    return base_path, tmp_path / "adapter", expected


@pytest.mark.parametrize("inner", [False, True])
def test_the_gates_of_a_peft_model_save_to_a_gates_file(tmp_path, inner):
    # PEFT holds a modules_to_save gate twice (original_module, modules_to_save.default): the file once held both
    # under names no model has, and loading it failed.
    from hf_spectral.retrofit import load_energy_gates, save_energy_gates

    model = add_energy_gates(tiny_gpt2(), EnergyGateConfig(alpha_init=0.5, layers=[1]))
    lora = LoraConfig(task_type="CAUSAL_LM", r=4, modules_to_save=["energy_gate"])
    peft_model = train_steps(get_peft_model(model, lora))
    wrapper = peft_model.base_model.model.transformer.h[1].attn.energy_gate
    trained = wrapper.modules_to_save["default"]
    assert not torch.equal(trained.alpha, wrapper.original_module.alpha), "the trained copy is another gate"
    path = save_energy_gates(peft_model.get_base_model() if inner else peft_model, tmp_path / "gates.safetensors")
    fresh = load_energy_gates(tiny_gpt2(), path)
    loaded = fresh.transformer.h[1].attn.energy_gate
    for name, parameter in trained.named_parameters():
        assert torch.equal(loaded.get_parameter(name), parameter), name


def test_saving_a_gated_adapter_records_the_gate_config(tmp_path):
    # PEFT's save reads the base checkpoint's config (the stock GPT-2 the gates were added to) through the gated
    # model's config class: it once warned "a model of type gpt2 to instantiate a model of type energy_gated_gpt2".
    config_logger = transformers_logging.get_logger("transformers.configuration_utils")
    with CaptureLogger(config_logger) as captured:
        _, adapter, _ = trained_gated_adapter(tmp_path)
    assert "to instantiate a model of type" not in captured.out
    assert EnergyGateConfig.from_pretrained(adapter) == EnergyGateConfig(alpha_init=0.5, layers=[1])


def identity_gates(model) -> bool:
    """Whether every gate of the model itself (not PEFT's trained copies) has α = 0, the identity."""
    gates = [attention.energy_gate for attention in gated_attention_modules(model)]
    return bool(gates) and all(not getattr(gate, "original_module", gate).alpha.any() for gate in gates)


def test_plain_peft_loading_onto_a_model_without_gates_restores_them(tmp_path):
    base_path, adapter, expected = trained_gated_adapter(tmp_path)
    ids, mask = batch()
    fresh = AutoModelForCausalLM.from_pretrained(base_path)
    stock = logits(fresh.eval(), ids, mask)
    assert not has_energy_gates(fresh)
    with warnings.catch_warnings(), CaptureLogger(INTEGRATION_LOGGER) as captured:
        warnings.simplefilter("error", UserWarning)  # no "missing adapter keys"
        restored = PeftModel.from_pretrained(fresh, adapter).eval()
    assert f"the adapter {adapter} was trained with energy gates" in captured.out and "'layers': [1]" in captured.out
    assert has_energy_gates(restored.get_base_model())
    torch.testing.assert_close(logits(restored, ids, mask), expected, atol=1e-6, rtol=0)
    # the model's own gates are the identity (the adapter's started at α = 0.5): without the adapter, the stock model
    assert identity_gates(restored.get_base_model())
    with restored.disable_adapter():
        torch.testing.assert_close(logits(restored, ids, mask), stock, atol=1e-6, rtol=0)
    # the trained gates matter: the same LoRA on fresh gates gives other logits
    untrained = add_energy_gates(AutoModelForCausalLM.from_pretrained(base_path),
                                 EnergyGateConfig(alpha_init=0.5, layers=[1])).eval()
    assert (logits(untrained, ids, mask) - expected).abs().max() > 1e-4

    auto = AutoPeftModelForCausalLM.from_pretrained(adapter).eval()  # base loaded from base_model_name_or_path
    torch.testing.assert_close(logits(auto, ids, mask), expected, atol=1e-6, rtol=0)
    explicit = load_gated_adapter(AutoModelForCausalLM.from_pretrained(base_path), adapter).eval()
    torch.testing.assert_close(logits(explicit, ids, mask), expected, atol=1e-6, rtol=0)


def test_every_named_adapter_folder_records_the_gate_config_and_loads_alone(tmp_path):
    """PEFT saves an adapter other than "default" in a subfolder named after it: that folder needs the gate config
    too, or the adapter loaded from it onto a model without gates would lose its trained gates."""
    base_path = gpt2_checkpoint(tmp_path / "base")
    gate_config = EnergyGateConfig(alpha_init=0.5, layers=[1])
    model = add_energy_gates(AutoModelForCausalLM.from_pretrained(base_path), gate_config)
    lora = LoraConfig(task_type="CAUSAL_LM", r=4, modules_to_save=["energy_gate"])
    peft_model = get_peft_model(model, lora)
    train_steps(peft_model)
    peft_model.add_adapter("other", lora)
    peft_model.set_adapter("other")
    train_steps(peft_model, steps=5)
    ids, mask = batch()
    expected = logits(peft_model, ids, mask)
    peft_model.save_pretrained(tmp_path / "adapters")
    for folder in (tmp_path / "adapters", tmp_path / "adapters" / "other"):
        assert EnergyGateConfig.from_pretrained(folder) == gate_config, folder
    fresh = AutoModelForCausalLM.from_pretrained(base_path)
    restored = PeftModel.from_pretrained(fresh, tmp_path / "adapters" / "other").eval()
    assert has_energy_gates(restored.get_base_model())
    torch.testing.assert_close(logits(restored, ids, mask), expected, atol=1e-6, rtol=0)


def test_transformers_load_adapter_restores_the_gates_too(tmp_path):
    base_path, adapter, expected = trained_gated_adapter(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(base_path)
    assert type(model) is GPT2LMHeadModel
    with CaptureLogger(INTEGRATION_LOGGER) as captured:
        model.load_adapter(str(adapter))
    assert f"the adapter {adapter} was trained with energy gates: added them to the model" in captured.out
    model.eval()
    ids, mask = batch()
    assert has_energy_gates(model) and identity_gates(model)
    torch.testing.assert_close(logits(model, ids, mask), expected, atol=1e-6, rtol=0)
    # an adapter folder given to the Auto class: transformers loads the base, then the adapter through load_adapter
    auto = AutoModelForCausalLM.from_pretrained(adapter).eval()
    assert has_energy_gates(auto)
    torch.testing.assert_close(logits(auto, ids, mask), expected, atol=1e-6, rtol=0)


def test_a_corrupt_gate_config_is_named(tmp_path):
    base_path, adapter, _ = trained_gated_adapter(tmp_path)
    (adapter / GATE_CONFIG_NAME).write_text('{"normalization": "cau')  # a truncated copy
    with pytest.raises(ValueError, match=f"{adapter / GATE_CONFIG_NAME} is not a valid {GATE_CONFIG_NAME}"):
        PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path), adapter)


def test_differently_configured_gates_are_refused(tmp_path):
    base_path, adapter, _ = trained_gated_adapter(tmp_path)
    model = add_energy_gates(AutoModelForCausalLM.from_pretrained(base_path), EnergyGateConfig(layers=[0]))
    with pytest.raises(ValueError, match="configured as"):
        PeftModel.from_pretrained(model, adapter)


def test_gates_that_differ_only_in_their_starting_values_take_the_adapter(tmp_path):
    """τ and α of the adapter's gates start at its tau_init / alpha_init, then come from its weights: a model whose
    gates started elsewhere has the same gates."""
    base_path, adapter, expected = trained_gated_adapter(tmp_path)  # alpha_init=0.5
    model = add_energy_gates(AutoModelForCausalLM.from_pretrained(base_path),
                             EnergyGateConfig(layers=[1], alpha_init=0.0, tau_init=1.0))
    restored = PeftModel.from_pretrained(model, adapter).eval()
    ids, mask = batch()
    torch.testing.assert_close(logits(restored, ids, mask), expected, atol=1e-6, rtol=0)


def test_gates_that_live_in_the_base_checkpoint_are_not_silently_missing(tmp_path):
    base_path, adapter, _ = trained_gated_adapter(tmp_path, modules_to_save=())  # gates frozen in the base model
    loads = (lambda model: PeftModel.from_pretrained(model, adapter), lambda model: model.load_adapter(str(adapter)),
             lambda model: get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=4)).load_adapter(adapter, "gated"))
    for load in loads:
        base = AutoModelForCausalLM.from_pretrained(base_path)
        with pytest.raises(ValueError, match=r"holds no trained weights for .*part of the base checkpoint.*"
                                             r"add_energy_gates\(model, EnergyGateConfig.from_pretrained"):
            load(base)
        assert type(base) is GPT2LMHeadModel and not has_energy_gates(base)


def test_lora_on_the_gates_projections_does_not_carry_the_gates(tmp_path):
    """LoRA deltas on a gate's energy projection (target_modules="all-linear") adapt gates of the base checkpoint:
    adding fresh gates to a stock base would give other outputs, so the load is refused."""
    base_path, adapter, _ = trained_gated_adapter(tmp_path, modules_to_save=(), target_modules="all-linear")
    from safetensors import safe_open

    with safe_open(adapter / "adapter_model.safetensors", framework="pt") as handle:
        assert any(".energy_gate.energy.proj.lora_A" in key for key in handle.keys())
    with pytest.raises(ValueError, match="holds no trained weights for .*part of the base checkpoint"):
        PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path), adapter)


def test_a_failed_load_leaves_the_base_model_as_it_was(tmp_path):
    """Gates added for an adapter are removed again when PEFT then fails (here: its config has rank 0, which PEFT
    refuses when it injects the layers, after the gates were added)."""
    import json

    base_path, adapter, _ = trained_gated_adapter(tmp_path)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "r": 0}))
    loads = (lambda model: PeftModel.from_pretrained(model, adapter), lambda model: load_gated_adapter(model, adapter),
             lambda model: model.load_adapter(str(adapter)),
             lambda model: get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=4)).load_adapter(adapter, "gated"))
    for load in loads:
        base = AutoModelForCausalLM.from_pretrained(base_path)
        with pytest.raises(ValueError, match="`r` should be a positive integer"):
            load(base)
        assert type(base) is GPT2LMHeadModel and not has_energy_gates(base)


def test_a_further_gated_adapter_adds_the_gates_under_a_peft_model(tmp_path):
    """PeftModel.load_adapter of a gated adapter into a PEFT model whose base has no gates: the gates go into the base
    model as the identity, so the first adapter and the model without adapters compute what they did."""
    base_path, adapter, expected = trained_gated_adapter(tmp_path)
    ids, mask = batch()
    stock = logits(AutoModelForCausalLM.from_pretrained(base_path).eval(), ids, mask)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_path), LoraConfig(task_type="CAUSAL_LM", r=4))
    first = logits(train_steps(peft_model), ids, mask)
    with CaptureLogger(INTEGRATION_LOGGER) as captured:
        peft_model.load_adapter(adapter, adapter_name="gated")
    assert f"the adapter {adapter} was trained with energy gates" in captured.out
    assert has_energy_gates(peft_model.get_base_model()) and identity_gates(peft_model.get_base_model())
    torch.testing.assert_close(logits(peft_model, ids, mask), first, atol=1e-6, rtol=0)
    peft_model.set_adapter("gated")
    torch.testing.assert_close(logits(peft_model, ids, mask), expected, atol=1e-6, rtol=0)
    with peft_model.disable_adapter():
        torch.testing.assert_close(logits(peft_model, ids, mask), stock, atol=1e-6, rtol=0)

    # saved together, each adapter loads alone onto the stock model: the first needs no gates (the model's were the
    # identity while it trained), the second brings its own
    peft_model.save_pretrained(tmp_path / "both")
    assert not (tmp_path / "both" / GATE_CONFIG_NAME).exists()
    assert (tmp_path / "both" / "gated" / GATE_CONFIG_NAME).exists()
    alone = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path), tmp_path / "both").eval()
    assert not has_energy_gates(alone.get_base_model())
    torch.testing.assert_close(logits(alone, ids, mask), first, atol=1e-6, rtol=0)
    gated = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path), tmp_path / "both" / "gated")
    torch.testing.assert_close(logits(gated.eval(), ids, mask), expected, atol=1e-6, rtol=0)


def test_adapters_of_ungated_models_and_of_ega_gpt_load_as_before(tmp_path):
    base_path = gpt2_checkpoint(tmp_path / "base")
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_path), LoraConfig(task_type="CAUSAL_LM", r=4))
    peft_model.save_pretrained(tmp_path / "plain")
    assert not (tmp_path / "plain" / GATE_CONFIG_NAME).exists()
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path), tmp_path / "plain")

    # EGA-GPT's gates are part of the architecture: they train through modules_to_save and load like any module
    ega = get_peft_model(ega_model(), LoraConfig(task_type="CAUSAL_LM", r=4, modules_to_save=["energy_gate"]))
    train_steps(ega)
    ids, mask = batch()
    expected = logits(ega, ids, mask)
    ega.save_pretrained(tmp_path / "ega")
    assert not (tmp_path / "ega" / GATE_CONFIG_NAME).exists()
    restored = PeftModel.from_pretrained(ega_model(), tmp_path / "ega").eval()
    torch.testing.assert_close(logits(restored, ids, mask), expected, atol=1e-6, rtol=0)
