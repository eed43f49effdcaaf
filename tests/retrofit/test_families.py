"""The retrofit on every decoder-only family people fine-tune: tiny random configs (2 layers, width 32, a vocabulary of
100), each model built once for the module. What families differ in is covered by the list: grouped- and
multi-query keys (Llama, Falcon), fused query/key/value projections (GPT-2, GPT-NeoX, Phi-3, Falcon), sliding windows
of 4 keys that generation passes (Mistral, Gemma 2, Gemma 3, Starcoder2, Qwen2 with `use_sliding_window`), soft-capping and custom scaling (Gemma 2),
parallel attention and MLP (GPT-J, Phi, Falcon, Cohere), mixture-of-experts MLPs (Mixtral, Qwen3-MoE), decoder
layers that pass no keyword arguments to their attention (Falcon, StableLM)."""

import copy
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, DynamicCache, StaticCache

import hf_spectral  # noqa: F401  (registers the energy-gated model types)
from hf_spectral.retrofit import EnergyGateConfig, add_energy_gates, has_energy_gates
from hf_spectral.retrofit.cli import main as retrofit_main
from hf_spectral.retrofit.modeling_energy_gated import attention_layers, decoder_of, key_value_heads
from tests.packing import assert_documents_as_alone, documents

VOCAB = 100
SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
SIZE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=VOCAB, max_position_embeddings=64, **SPECIAL)
WINDOW = 4  # keys of a sliding window: the prompts and generations below are longer
TOL = dict(atol=1e-5, rtol=1e-4)

CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64,
                                            **SPECIAL),
    "gptj": lambda: transformers.GPTJConfig(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64,
                                            rotary_dim=4, **SPECIAL),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                   num_attention_heads=4, vocab_size=VOCAB,
                                                   max_position_embeddings=64, **SPECIAL),
    "llama": lambda: transformers.LlamaConfig(**SIZE),
    "mistral": lambda: transformers.MistralConfig(**SIZE, sliding_window=WINDOW),
    "mixtral": lambda: transformers.MixtralConfig(**SIZE, num_local_experts=4, num_experts_per_tok=2),
    "qwen2": lambda: transformers.Qwen2Config(**SIZE),
    "qwen2_sliding": lambda: transformers.Qwen2Config(**SIZE, use_sliding_window=True, sliding_window=WINDOW,
                                                      max_window_layers=1),  # layer 1 slides, layer 0 does not
    "qwen3": lambda: transformers.Qwen3Config(**SIZE, head_dim=8),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**SIZE, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                                     moe_intermediate_size=32),
    "gemma": lambda: transformers.GemmaConfig(**SIZE, head_dim=8),
    "gemma2": lambda: transformers.Gemma2Config(**SIZE, head_dim=8, sliding_window=WINDOW, query_pre_attn_scalar=16,
                                                attn_logit_softcapping=5.0, final_logit_softcapping=30.0),
    "gemma3_text": lambda: transformers.Gemma3TextConfig(**SIZE, head_dim=8, sliding_window=WINDOW,
                                                         layer_types=["sliding_attention", "full_attention"]),
    "phi": lambda: transformers.PhiConfig(**SIZE),
    "phi3": lambda: transformers.Phi3Config(**SIZE),
    "olmo2": lambda: transformers.Olmo2Config(**SIZE),
    "smollm3": lambda: transformers.SmolLM3Config(**SIZE),
    "granite": lambda: transformers.GraniteConfig(**SIZE),
    "stablelm": lambda: transformers.StableLmConfig(**SIZE),
    "starcoder2": lambda: transformers.Starcoder2Config(**SIZE, sliding_window=WINDOW),
    "cohere": lambda: transformers.CohereConfig(**SIZE),
    "falcon": lambda: transformers.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                vocab_size=VOCAB, **SPECIAL),  # multi-query: one key/value head
}
FAMILIES = list(CONFIGS)
_MODELS = {}


def stock_model(family: str):
    """The family's stock causal LM (random weights, eval mode), shared by the module's tests: do not change it."""
    if ("stock", family) not in _MODELS:
        torch.manual_seed(0)
        _MODELS["stock", family] = AutoModelForCausalLM.from_config(CONFIGS[family]()).eval()
    return _MODELS["stock", family]


def gated_model(family: str):
    """A retrofitted copy of the stock model with gates far from the identity (α = 1.5, random τ), shared."""
    if ("gated", family) not in _MODELS:
        model = add_energy_gates(copy.deepcopy(stock_model(family)), EnergyGateConfig(alpha_init=1.5))
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith(".tau"):
                    parameter.copy_(torch.randn(parameter.shape, generator=generator))
        _MODELS["gated", family] = model
    return _MODELS["gated", family]


def prompts(length=7, padded=True):
    """Three rows; with ``padded``, the first two left-padded by 3 and 1 tokens."""
    ids = torch.randint(3, VOCAB, (3, length), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :3] = 0
        mask[1, :1] = 0
    return ids.masked_fill(mask == 0, 0), mask


def forward_logits(model, ids, mask=None, **kwargs):
    with torch.no_grad():
        return model(ids, attention_mask=mask, use_cache=False, **kwargs).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_attention_layers_and_key_heads_are_found_from_the_model(family):
    model = stock_model(family)
    layers = attention_layers(decoder_of(model))
    assert len(layers) == 2
    expected = 1 if family == "falcon" else 4 if family in ("gpt2", "gptj", "gpt_neox") else 2
    assert {key_value_heads(layer, model.config) for layer in layers} == {expected}


@pytest.mark.parametrize("family", FAMILIES)
def test_fresh_gates_are_the_identity_bit_for_bit(family):
    stock = stock_model(family)
    ids, mask = prompts()
    model = add_energy_gates(copy.deepcopy(stock))
    assert has_energy_gates(model) and type(model).__name__ == "EnergyGated" + type(stock).__name__
    assert torch.equal(forward_logits(model, ids, mask), forward_logits(stock, ids, mask))
    with torch.no_grad():
        generated = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        assert torch.equal(generated, stock.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False))


@pytest.mark.parametrize("family", FAMILIES)
def test_gates_change_the_outputs_and_keep_causality(family):
    model, stock = gated_model(family), stock_model(family)
    ids, _ = prompts(length=10, padded=False)
    reference = forward_logits(model, ids)
    assert (reference - forward_logits(stock, ids)).abs().max() > 1e-3
    changed = ids.clone()
    changed[:, 6] = (changed[:, 6] + 1) % VOCAB  # a future token for positions 0-5
    moved = forward_logits(model, changed)
    torch.testing.assert_close(moved[:, :6], reference[:, :6], **TOL)
    assert (moved[:, 6:] - reference[:, 6:]).abs().max() > 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_left_padding_leaves_each_row_as_it_is_alone(family):
    model = gated_model(family)
    ids, mask = prompts()
    padded = forward_logits(model, ids, mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    for row, pad in enumerate((3, 1, 0)):
        alone = forward_logits(model, ids[row : row + 1, pad:])
        torch.testing.assert_close(padded[row, pad:], alone[0], **TOL)


def _generated_logits_match_the_forward(model, ids, mask, output, new):
    """The logits generate() reports for each new token equal the uncached forward's over the generated sequence."""
    sequences = output.sequences
    full_mask = torch.cat([mask, torch.ones(mask.shape[0], new, dtype=mask.dtype)], dim=1)
    positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
    reference = forward_logits(model, sequences[:, :-1], full_mask[:, :-1], position_ids=positions[:, :-1])
    generated = torch.stack(output.logits, dim=1)
    torch.testing.assert_close(generated, reference[:, -new:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("family", FAMILIES)
def test_cached_greedy_generation_equals_the_uncached_forward(family, cache):
    model = gated_model(family)
    ids, mask = prompts()
    new = 6  # 7 + 6 positions: past every sliding window of 4
    options = dict(cache_implementation="static") if cache == "static" else {}
    with torch.no_grad():
        output = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                return_dict_in_generate=True, output_logits=True, **options)
    if cache == "dynamic":
        assert isinstance(output.past_key_values, DynamicCache)
    else:
        assert isinstance(output.past_key_values, StaticCache)
    _generated_logits_match_the_forward(model, ids, mask, output, new)


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_beam_search_equals_beam_search_without_a_cache(family):
    model = gated_model(family)
    ids, mask = prompts()
    options = dict(attention_mask=mask, max_new_tokens=5, min_new_tokens=5, num_beams=2, do_sample=False)
    with torch.no_grad():
        cached = model.generate(ids, **options)
        uncached = model.generate(ids, use_cache=False, **options)
    assert torch.equal(cached, uncached)


@pytest.mark.parametrize("family", FAMILIES)
def test_save_and_load_keeps_the_gates(family, tmp_path):
    model = gated_model(family)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "energy_gated_" + CONFIGS[family]().model_type
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(model)
    ids, mask = prompts()
    assert torch.equal(forward_logits(loaded, ids, mask), forward_logits(model, ids, mask))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_gates_only_file_loads_into_the_stock_model(family, tmp_path):
    from hf_spectral.retrofit import load_energy_gates, save_energy_gates

    model = gated_model(family)
    path = save_energy_gates(model, str(tmp_path / "gates.safetensors"))
    loaded = load_energy_gates(copy.deepcopy(stock_model(family)), path)
    ids, mask = prompts()
    assert torch.equal(forward_logits(loaded, ids, mask), forward_logits(model, ids, mask))


# Loads every family's folder with trust_remote_code where hf_spectral cannot be imported, and records, per folder,
# which of transformers' model modules the load imported: only the folder's own family's.
_REMOTE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.modules["hf_spectral"] = None  # any import of the plugin now raises ImportError
    import torch, transformers
    folders, inputs_file, out_file = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
    inputs = {k: torch.tensor(v) for k, v in json.load(open(inputs_file)).items()}
    result = {}
    for family, path in folders.items():
        before = set(sys.modules)
        model = transformers.AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
        with torch.no_grad():
            logits = model(**inputs, use_cache=False).logits
        imported = sorted(name for name in set(sys.modules) - before if name.startswith("transformers.models.")
                          and ".modeling_" in name and not name.startswith("transformers.models.auto."))
        plugin = [name for name in sys.modules if name.startswith("hf_spectral") and sys.modules[name] is not None]
        result[family] = {"logits": logits.tolist(), "class": type(model).__name__, "imported": imported,
                          "plugin": plugin}
    json.dump(result, open(out_file, "w"))
    """
)


def test_each_family_loads_as_remote_code_importing_only_its_own_family(tmp_path):
    ids, mask = prompts()
    folders = {}
    for family in FAMILIES:
        folders[family] = str(tmp_path / family)
        gated_model(family).save_pretrained(folders[family])
    (tmp_path / "inputs.json").write_text(json.dumps({"input_ids": ids.tolist(), "attention_mask": mask.tolist()}))
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    result = subprocess.run(
        [sys.executable, "-c", _REMOTE_SCRIPT, json.dumps(folders), str(tmp_path / "inputs.json"),
         str(tmp_path / "out.json")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    out = json.loads((tmp_path / "out.json").read_text())
    for family in FAMILIES:
        model = gated_model(family)
        assert out[family]["class"] == type(model).__name__ and out[family]["plugin"] == []
        own = type(model).stock_class.__module__
        assert set(out[family]["imported"]) <= {own}, (family, out[family]["imported"])
        torch.testing.assert_close(torch.tensor(out[family]["logits"]), forward_logits(model, ids, mask), **TOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_default_lora_targets_train_next_to_the_gates(family):
    """PEFT's default targets of the stock family where it has them (the gated type gets the same); PEFT has none
    for some families (Phi-3, OLMo 2, ...), whose stock model needs targets too: those get "all-linear"."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS

    model = copy.deepcopy(gated_model(family))
    stock_type = stock_model(family).config.model_type
    assert DEFAULTS.get(model.config.model_type) == DEFAULTS.get(stock_type)
    targets = None if stock_type in DEFAULTS else "all-linear"
    peft_model = get_peft_model(model, LoraConfig(r=2, task_type="CAUSAL_LM", target_modules=targets,
                                                  modules_to_save=["energy_gate"]))
    trainable = {name for name, parameter in peft_model.named_parameters() if parameter.requires_grad}
    assert any("lora_" in name for name in trainable)
    assert any(".energy_gate.modules_to_save." in name for name in trainable)
    ids, _ = prompts(padded=False)
    peft_model.train()
    peft_model(ids, labels=ids).loss.backward()
    gate_grads = [parameter.grad for name, parameter in peft_model.named_parameters()
                  if ".energy_gate.modules_to_save." in name and name.endswith(".alpha")]
    assert gate_grads and all(grad is not None and grad.abs().sum() > 0 for grad in gate_grads)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_command_line_retrofits_each_family(family, tmp_path):
    stock_model(family).save_pretrained(tmp_path / "src")
    assert retrofit_main([str(tmp_path / "src"), str(tmp_path / "dst")]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "dst").eval()
    assert has_energy_gates(loaded)
    ids, mask = prompts()
    assert torch.equal(forward_logits(loaded, ids, mask), forward_logits(stock_model(family), ids, mask))


@pytest.mark.parametrize("family", FAMILIES)
def test_each_packed_document_gets_what_it_gets_alone(family):
    with torch.no_grad():
        assert_documents_as_alone(gated_model(family), documents(VOCAB))


def _refusal(model) -> str:
    with pytest.raises(ValueError) as error:
        add_energy_gates(model)
    message = str(error.value)
    assert "decoder-only (causal) transformers models" in message  # and says what is supported
    return message


def test_models_that_cannot_take_gates_are_refused_naming_why():
    from hf_spectral import EGAConfig, EGAForCausalLM
    from hf_spectral.retrofit.modeling_energy_gated import check_config_supported

    bert = transformers.BertModel(transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                          intermediate_size=64, vocab_size=VOCAB))
    assert "bidirectional" in _refusal(bert)
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2,
                                                                       d_kv=16, vocab_size=VOCAB))
    assert "encoder-decoder" in _refusal(t5)
    cross = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=VOCAB,
                                                                 add_cross_attention=True))
    assert "cross-attention" in _refusal(cross)
    alibi = transformers.FalconForCausalLM(transformers.FalconConfig(hidden_size=32, num_hidden_layers=1,
                                                                     num_attention_heads=4, vocab_size=VOCAB,
                                                                     alibi=True))
    assert "ALiBi" in _refusal(alibi)
    mamba = transformers.MambaForCausalLM(transformers.MambaConfig(hidden_size=32, num_hidden_layers=1,
                                                                   vocab_size=VOCAB, state_size=4))
    assert "attention interface" in _refusal(mamba)
    assert "not a model class of transformers" in _refusal(EGAForCausalLM(EGAConfig(n_embd=32, n_layer=1, n_head=2,
                                                                                    vocab_size=VOCAB)))
    sinks = transformers.GptOssForCausalLM(transformers.GptOssConfig(**SIZE, head_dim=8, num_local_experts=4,
                                                                     num_experts_per_tok=2))
    assert "attention sinks" in _refusal(sinks)
    hybrid = transformers.LlamaConfig(**SIZE)
    hybrid.layer_types = ["full_attention", "mamba"]
    with pytest.raises(ValueError, match=r"layers of the types \['mamba'\]"):
        check_config_supported(hybrid, "a hybrid")


@pytest.mark.parametrize("family", ["llama", "gpt2", "falcon"])
def test_base_models_and_classification_heads_take_gates_too(family):
    torch.manual_seed(0)
    config = CONFIGS[family]()
    config.num_labels = 3
    ids, mask = prompts()
    for auto_class in (transformers.AutoModel, transformers.AutoModelForSequenceClassification):
        stock = auto_class.from_config(config).eval()
        with torch.no_grad():
            before = stock(ids, attention_mask=mask)[0]
            gated = add_energy_gates(copy.deepcopy(stock))
            assert type(gated).__name__ == "EnergyGated" + type(stock).__name__
            assert torch.equal(gated(ids, attention_mask=mask)[0], before)


def test_import_hf_spectral_imports_no_family_modeling_code():
    """The retrofit registers every family without importing one: the only modeling module of a family that
    ``import hf_spectral`` imports is Llama's, on which CHIAR-Former's own code builds."""
    script = ("import sys, hf_spectral\n"
              "print(sorted(m for m in sys.modules if m.startswith('transformers.models.') and '.modeling_' in m"
              " and not m.startswith('transformers.models.auto.')))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "['transformers.models.llama.modeling_llama']"


def _supports_sdpa(model) -> bool:
    return bool(getattr(model, "_supports_sdpa", False))


@pytest.mark.parametrize("family", FAMILIES)
def test_gated_eager_attention_is_the_gated_sdpa_attention(family):
    """Eager runs the family's own eager attention with the gate's bias in its mask, SDPA the folded head: the same
    gated attention. (Gemma 2 has eager attention alone: its soft-capping is checked by the next test.)"""
    ids, mask = prompts()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    model = copy.deepcopy(gated_model(family))
    backends = ("eager", "sdpa") if _supports_sdpa(model) else ("eager",)
    outputs = {}
    for backend in backends:
        model.set_attn_implementation(backend)
        outputs[backend] = forward_logits(model, ids, mask, position_ids=positions) * mask[..., None]
    if len(backends) == 2:
        torch.testing.assert_close(outputs["eager"], outputs["sdpa"], atol=1e-4, rtol=1e-4)
    else:
        assert family == "gemma2"  # the one family here without SDPA


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_gated_path_with_zero_gates_is_the_stock_attention(family, backend):
    """With a gradient asked of the gates (training) the gated path runs even at α = 0: it gives the stock outputs,
    to float tolerance, on each backend; on eager through the family's own attention (Gemma 2's soft-capping at 5
    included: without it the logits would move far more)."""
    stock = copy.deepcopy(stock_model(family))
    if backend == "sdpa" and not _supports_sdpa(stock):
        backend = "eager"
    stock.set_attn_implementation(backend)
    model = add_energy_gates(copy.deepcopy(stock))
    ids, mask = prompts()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = stock(ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
    with torch.enable_grad():
        gated = model(ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
    gated.sum().backward()  # the gated path ran: the gates got gradients (the identity shortcut would give none)
    assert all(parameter.grad is not None for name, parameter in model.named_parameters() if name.endswith(".alpha"))
    torch.testing.assert_close((gated * mask[..., None]).detach(), expected * mask[..., None], atol=1e-5, rtol=1e-4)


def test_what_cannot_continue_past_a_sliding_window_is_refused_with_what_to_use():
    """Window statistics re-bias every earlier key, which a sliding layer no longer holds: refused, naming the way
    out (causal statistics, which need only the last key's running moments, generate past the window above)."""
    model = add_energy_gates(copy.deepcopy(stock_model("mistral")), EnergyGateConfig(normalization="window",
                                                                                     alpha_init=1.5))
    ids, mask = prompts()
    with pytest.raises(ValueError, match=r"sliding window keeps 3 key\(s\) and the energy gate needs the state of the latest 7 .*causal statistics"):
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)


def test_layers_that_reuse_another_layers_keys_are_left_ungated():
    """Gemma 3n's last layers read the keys and values of earlier ones (`is_kv_shared_layer`) and write none: they get
    no gate, the others do, and the model with acting gates keeps causality and generates with its cache what the
    uncached forward gives."""
    torch.manual_seed(0)
    config = transformers.Gemma3nTextConfig(
        **{**SIZE, "num_hidden_layers": 4}, head_dim=8, num_kv_shared_layers=2, laurel_rank=4, altup_num_inputs=2,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 2, activation_sparsity_pattern=[0.0] * 4,
    )
    model = add_energy_gates(AutoModelForCausalLM.from_config(config).eval(), EnergyGateConfig(alpha_init=1.5))
    layers = decoder_of(model).layers
    assert [hasattr(layer.self_attn, "energy_gate") for layer in layers] == [True, True, False, False]
    assert [layer.self_attn.is_kv_shared_layer for layer in layers] == [False, False, True, True]
    ids, mask = prompts()
    with torch.no_grad():
        output = model.generate(ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                return_dict_in_generate=True, output_logits=True)
    _generated_logits_match_the_forward(model, ids, mask, output, 6)
