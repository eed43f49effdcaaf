"""The energy-gate retrofit on stock checkpoints (built with random weights and saved first: nothing can be
downloaded here)."""

import json
import os
import pickle
import re
import subprocess
from copy import deepcopy
import sys

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    BertConfig,
    BertModel,
    DynamicCache,
    GPT2Config,
    GPT2ForSequenceClassification,
    GPT2LMHeadModel,
    GPT2Model,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    pipeline,
)

import hf_spectral  # noqa: F401  (registers the energy-gated model types)
from hf_spectral.ops import gated_attention
from hf_spectral.retrofit.modeling_energy_gated import EnergyGatedLlamaForCausalLM, check_class_supported
from hf_spectral.retrofit import (
    EnergyGateConfig,
    add_energy_gates,
    has_energy_gates,
    load_energy_gates,
    mark_only_gates_trainable,
    remove_energy_gates,
    save_energy_gates,
)
from tests.helpers import (
    INDUCTOR_ISA_FORCED,
    INDUCTOR_SKIP_REASON,
    assert_cache_continues_across_an_autocast_boundary,
    assert_fullgraph_static_generation_matches_eager,
    load_without_plugin,
    perturb_after,
)

VOCAB = 50
SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def gpt2_checkpoint(path, head="lm"):
    torch.manual_seed(0)
    config = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64, num_labels=3, **SPECIAL)
    model = (GPT2LMHeadModel if head == "lm" else GPT2ForSequenceClassification)(config)
    model.save_pretrained(path)
    return path


def llama_checkpoint(path, family="llama"):
    torch.manual_seed(0)
    size = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, **SPECIAL)
    config_class, model_class = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }[family]
    model_class(config_class(**size)).save_pretrained(path)
    return path


def padded_batch(length=12):
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (3, length), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :1] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def randomise_gates(model, seed=0):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith((".alpha", ".tau")):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 2)


def logits(model, ids, mask, positions):
    with torch.no_grad():
        return model(ids, attention_mask=mask, position_ids=positions).logits * mask[..., None]


CHECKPOINTS = {"gpt2": gpt2_checkpoint, "llama": llama_checkpoint,
               "mistral": lambda p: llama_checkpoint(p, "mistral"), "qwen2": lambda p: llama_checkpoint(p, "qwen2")}


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("family", list(CHECKPOINTS))
def test_fresh_gates_leave_logits_and_generation_exactly_unchanged(family, backend, tmp_path):
    path = CHECKPOINTS[family](tmp_path / family)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=backend).eval()
    ids, mask, positions = padded_batch()
    before = logits(model, ids, mask, positions)
    generated = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    add_energy_gates(model)
    assert type(model).__name__.startswith("EnergyGated") and has_energy_gates(model)
    # The bias is exactly 0; under SDPA it rides in a folded channel (another kernel): a few float32 ulps apart.
    torch.testing.assert_close(logits(model, ids, mask, positions), before, atol=1e-6, rtol=1e-5)
    assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False), generated)
    randomise_gates(model)
    assert (logits(model, ids, mask, positions) - before).abs().max() > 1e-3


@pytest.mark.parametrize("head_alignment", [1, 8], ids=["cpu-head", "cuda-head"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_gated_model_is_causal_and_its_cache_matches_the_forward(family, head_alignment, tmp_path, monkeypatch):
    # CUDA pads a prefill's folded head to a multiple of 8 channels (run here on the CPU): the cache still gets keys
    # at the head size, and the conv gate's filter history beside them
    monkeypatch.setattr(gated_attention, "fused_kernel_alignment", lambda device: head_alignment)
    model = AutoModelForCausalLM.from_pretrained(CHECKPOINTS[family](tmp_path / family)).eval()
    add_energy_gates(model, EnergyGateConfig(energy_kind="conv", scales=[3, 5]))
    randomise_gates(model)
    ids, mask, positions = padded_batch()
    full = logits(model, ids, mask, positions)
    changed = logits(model, perturb_after(ids, 7, VOCAB), mask, positions)
    assert torch.equal(changed[:, :8], full[:, :8])
    with torch.no_grad():
        out = model(ids[:, :5], attention_mask=mask[:, :5], position_ids=positions[:, :5], use_cache=True)
        pieces, cache = [out.logits], out.cache
        for t in range(5, ids.shape[1]):
            out = model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], position_ids=positions[:, t : t + 1],
                        cache=cache, use_cache=True)
            pieces.append(out.logits)
            cache = out.cache
    torch.testing.assert_close(torch.cat(pieces, 1) * mask[..., None], full, atol=1e-5, rtol=0)
    torch.manual_seed(0)
    beams = model.generate(ids, attention_mask=mask, max_new_tokens=4, num_beams=3, do_sample=False)
    torch.manual_seed(0)
    uncached = model.generate(ids, attention_mask=mask, max_new_tokens=4, num_beams=3, do_sample=False, use_cache=False)
    assert torch.equal(beams, uncached)


@pytest.mark.parametrize("family, backend", [
    ("gpt2", "sdpa"), ("llama", "sdpa"),
    pytest.param("llama", "flex_attention", marks=pytest.mark.skipif(INDUCTOR_ISA_FORCED, reason=INDUCTOR_SKIP_REASON)),
])
def test_static_cache_generation_matches_the_forward(family, backend, tmp_path):
    """With a StaticCache the gates read their padding from the 2D mask, which a retrofitted model keeps for the
    forward (``create_masks_for_generate``: under flex_attention generate() would otherwise hand it a BlockMask,
    which has no padding to read), and their state at the last filled key."""
    model = AutoModelForCausalLM.from_pretrained(CHECKPOINTS[family](tmp_path / family), attn_implementation=backend)
    add_energy_gates(model.eval())
    randomise_gates(model)
    ids, mask, _ = padded_batch()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, cache_implementation="static",
                         output_logits=True, return_dict_in_generate=True)
    full_mask = torch.cat([mask, torch.ones(3, 4, dtype=mask.dtype)], 1)
    full = logits(model, out.sequences, full_mask, (full_mask.cumsum(-1) - 1).clamp(min=0))
    for step, step_logits in enumerate(out.logits):
        torch.testing.assert_close(step_logits, full[:, ids.shape[1] - 1 + step], atol=1e-5, rtol=0)


def test_a_static_cache_with_a_sliding_window_generates_inside_and_past_the_window(tmp_path):
    """Mistral's configs carry a sliding window (4096 in Mistral-7B-v0.1): a static cache then has sliding layers;
    inside the window and past it, the gated generation is the one without a cache (the gate's bias and state are
    rolled with the keys)."""
    torch.manual_seed(0)
    config = MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, sliding_window=4096,
                           **SPECIAL)
    model = add_energy_gates(MistralForCausalLM(config).eval())
    randomise_gates(model)
    ids, mask, _ = padded_batch()
    dynamic = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    static = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, cache_implementation="static")
    assert torch.equal(static, dynamic)
    model.config.sliding_window = 14  # the prompt (12) and two new tokens fit, the third does not
    uncached = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, use_cache=False)
    for options in (dict(cache_implementation="static"), {}, dict(cache=DynamicCache())):
        assert torch.equal(model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, **options),
                           uncached)


def test_a_static_cache_decoding_step_of_a_retrofitted_gpt2_has_no_graph_break(tmp_path):
    """The gates read a StaticCache at its on-device length: a decoding step is one graph."""
    from transformers import StaticCache

    model = AutoModelForCausalLM.from_pretrained(gpt2_checkpoint(tmp_path / "g")).eval()
    add_energy_gates(model)
    randomise_gates(model)
    ids, mask, _ = padded_batch()
    cache = StaticCache(config=model.config, max_cache_len=20)
    with torch.no_grad():
        model(ids, attention_mask=mask, cache=cache, use_cache=True)
        step_mask = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], 1)
        explanation = torch._dynamo.explain(model)(ids[:, -1:], attention_mask=step_mask, cache=cache, use_cache=True)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


@pytest.mark.parametrize("cache_class", ["dynamic", "static"])
def test_a_compiled_decoding_step_continues_a_cache_an_identity_gate_filled_eagerly(tmp_path, cache_class):
    """generate() compiles the decoding steps and runs the prefill eagerly: a fresh gate (α = 0) takes the stock
    attention there (bit-exact), and must still leave the gate's data in the cache for the compiled steps, which
    always run the gate. The stock model's cache is the reference: the same keys, and logits within 1e-5."""
    from transformers import DynamicCache, StaticCache

    stock = AutoModelForCausalLM.from_pretrained(gpt2_checkpoint(tmp_path / "g")).eval()
    model = deepcopy(stock)
    add_energy_gates(model)
    ids, mask, _ = padded_batch()
    step_mask = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], 1)
    positions = (step_mask.cumsum(-1) - 1).clamp(min=0)

    def new_cache():
        return DynamicCache() if cache_class == "dynamic" else StaticCache(config=model.config, max_cache_len=20)

    with torch.no_grad():
        caches, logits = [], []
        for net in (stock, model):
            cache = new_cache()
            prefill = net(ids, attention_mask=mask, position_ids=positions[:, :-1], cache=cache, use_cache=True)
            logits.append(prefill.logits)
            caches.append(cache)
        assert torch.equal(logits[1], logits[0])  # the identity gate's prefill is the stock attention's
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        step = compiled(ids[:, -1:], attention_mask=step_mask, position_ids=positions[:, -1:], cache=caches[1],
                        use_cache=True).logits
        reference = stock(ids[:, -1:], attention_mask=step_mask, position_ids=positions[:, -1:], cache=caches[0],
                          use_cache=True).logits
    torch.testing.assert_close(step, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(INDUCTOR_ISA_FORCED, reason=INDUCTOR_SKIP_REASON)
def test_a_fullgraph_compiled_retrofitted_gpt2_generates_with_a_static_cache_what_eager_generates(tmp_path):
    """On a retrofitted model too: the padding hook binds no signature, so the forward compiles as one graph with
    generate()'s keyword arguments."""
    model = AutoModelForCausalLM.from_pretrained(gpt2_checkpoint(tmp_path / "g")).eval()
    add_energy_gates(model)
    randomise_gates(model)
    ids, mask, _ = padded_batch()
    assert_fullgraph_static_generation_matches_eager(model, ids, mask, new_tokens=3)


def test_gated_attention_accepts_positional_arguments(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(gpt2_checkpoint(tmp_path / "g")).eval()
    add_energy_gates(model)
    randomise_gates(model)
    attention = model.transformer.h[0].attn
    hidden = torch.randn(2, 5, 32)
    with torch.no_grad():
        by_name = attention(hidden, cache=None, attention_mask=None)[0]
        by_position = attention(hidden, None, None)[0]
    assert torch.equal(by_name, by_position)


def test_the_padding_mask_reaches_the_gates_in_every_form_gpt2_takes(tmp_path):
    """By name or by position; GPT-2 also takes one row of a batch of one as a 1D mask, and (batch, choices, length)
    inputs and masks."""
    model = AutoModelForCausalLM.from_pretrained(gpt2_checkpoint(tmp_path / "g")).eval()
    add_energy_gates(model)
    randomise_gates(model)
    ids, mask, _ = padded_batch()
    with torch.no_grad():
        rows = model.transformer(ids, attention_mask=mask).last_hidden_state * mask[..., None]
        by_position = model.transformer(ids, None, mask).last_hidden_state  # (input_ids, cache, attention_mask)
        assert torch.equal(by_position * mask[..., None], rows)
        choices = model.transformer(ids[None], attention_mask=mask[None]).last_hidden_state[0]
        torch.testing.assert_close(choices * mask[..., None], rows, atol=1e-6, rtol=1e-5)
        one = model.transformer(ids[:1], attention_mask=mask[0]).last_hidden_state
        torch.testing.assert_close(one * mask[:1, :, None], rows[:1], atol=1e-6, rtol=1e-5)
        # GPT-2 reads any mask below 4D as its sequences' rows: a flat mask, a (batch, choices · length) one
        flat = model.transformer(ids, attention_mask=mask.flatten()).last_hidden_state
        torch.testing.assert_close(flat * mask[..., None], rows, atol=1e-6, rtol=1e-5)
        wide = model.transformer(ids[None], attention_mask=mask.reshape(1, -1)).last_hidden_state[0]
        torch.testing.assert_close(wide * mask[..., None], rows, atol=1e-6, rtol=1e-5)
        # a hook pickled before it counted sequences learns how at its first call
        decoder = model.transformer
        del decoder._forward_pre_hooks[decoder._energy_gate_hook.id].input_positions
        choices = model.transformer(ids[None], attention_mask=mask[None]).last_hidden_state[0]
        torch.testing.assert_close(choices * mask[..., None], rows, atol=1e-6, rtol=1e-5)


def test_only_the_layers_asked_for_are_gated(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(gpt2_checkpoint(tmp_path / "g"))
    add_energy_gates(model, EnergyGateConfig(layers=[1]))
    assert [hasattr(layer.attn, "energy_gate") for layer in model.transformer.h] == [False, True]


def test_sequence_classification_head_is_supported(tmp_path):
    model = GPT2ForSequenceClassification.from_pretrained(gpt2_checkpoint(tmp_path / "cls", head="cls")).eval()
    ids, mask, positions = padded_batch()
    with torch.no_grad():
        before = model(ids, attention_mask=mask, position_ids=positions).logits
        add_energy_gates(model)
        torch.testing.assert_close(model(ids, attention_mask=mask, position_ids=positions).logits, before,
                                   atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_a_gated_classification_head_built_through_automodel_loads_back(family, tmp_path):
    """Llama's, Mistral's and Qwen2's classification heads build their decoder with `AutoModel.from_config`: it
    must come back gated once (not gated twice, nor refused for remote code) with the plugin and without it; a
    gated causal LM folder also loads as a classifier."""
    CHECKPOINTS[family](tmp_path / "lm")
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "lm", num_labels=3).eval()
    add_energy_gates(model)
    randomise_gates(model)
    model.save_pretrained(tmp_path / "gated")
    ids, mask, positions = padded_batch()
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "gated").eval()
    assert type(loaded) is type(model)
    with torch.no_grad():
        expected = model(ids, attention_mask=mask, position_ids=positions).logits
        assert torch.equal(loaded(ids, attention_mask=mask, position_ids=positions).logits, expected)
    inputs = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
    auto_class = "AutoModelForSequenceClassification"
    remote, loaded_class = load_without_plugin(tmp_path / "gated", auto_class, inputs, tmp_path)
    assert loaded_class.endswith(".modeling_energy_gated." + type(model).__name__)
    torch.testing.assert_close(remote, expected, atol=1e-5, rtol=1e-5)
    # Removing the gates makes every class stock again, the decoder the head built through AutoModel included
    remove_energy_gates(loaded)
    assert not any(type(m).__name__.startswith("EnergyGated") for m in loaded.modules())
    assert type(loaded.model).__module__ == f"transformers.models.{family}.modeling_{family}"
    causal = AutoModelForCausalLM.from_pretrained(tmp_path / "lm")
    add_energy_gates(causal)
    causal.save_pretrained(tmp_path / "gated-lm")
    head = AutoModelForSequenceClassification.from_pretrained(tmp_path / "gated-lm", num_labels=3)
    assert len([m for m in head.modules() if hasattr(m, "energy_gate")]) == head.config.num_hidden_layers


def test_only_gates_move_when_only_gates_train(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(gpt2_checkpoint(tmp_path / "g")).train()
    add_energy_gates(model, EnergyGateConfig(alpha_init=0.5))
    trainable = mark_only_gates_trainable(model)
    assert trainable == sum(p.numel() for n, p in model.named_parameters() if ".energy_gate." in n)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids, mask, _ = padded_batch()
    for _ in range(3):
        model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    for name, parameter in model.named_parameters():
        moved = not torch.equal(parameter, before[name])
        assert moved == (".energy_gate." in name and not name.endswith("mix_logits")), name


def test_saved_model_records_its_gates_and_loads_them_back(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(llama_checkpoint(tmp_path / "llama")).eval()
    add_energy_gates(model, EnergyGateConfig(layers=[1], projections=2))
    randomise_gates(model)
    model.save_pretrained(tmp_path / "gated")
    config = json.loads((tmp_path / "gated" / "config.json").read_text())
    assert config["model_type"] == "energy_gated_llama"
    assert config["energy_gates"]["layers"] == [1] and config["energy_gates"]["projections"] == 2
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "gated").eval()
    assert type(loaded) is type(model)
    ids, mask, positions = padded_batch()
    assert torch.equal(logits(loaded, ids, mask, positions), logits(model, ids, mask, positions))


@pytest.mark.parametrize("gates", [dict(energy_kind="db2"), dict(energy_kind="morlet", morlet_learnable=False)])
def test_gates_with_fixed_filters_load_back_exactly(tmp_path, gates):
    """Daubechies taps are not saved (a build on the meta device refills them); fixed Morlet filters are."""
    model = GPT2LMHeadModel.from_pretrained(gpt2_checkpoint(tmp_path / "gpt2")).eval()
    add_energy_gates(model, EnergyGateConfig(**gates))
    randomise_gates(model)
    model.save_pretrained(tmp_path / "gated")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "gated").eval()
    ids, mask, positions = padded_batch()
    assert torch.equal(logits(loaded, ids, mask, positions), logits(model, ids, mask, positions))


def test_a_gated_model_pickles_whole_also_into_a_fresh_process(tmp_path):
    """`torch.save(model)` pickles the gated attention classes (made at run time) and the padding hook; a fresh
    process rebuilds them, and the padded logits come back exactly."""
    model = AutoModelForCausalLM.from_pretrained(llama_checkpoint(tmp_path / "llama")).eval()
    add_energy_gates(model, EnergyGateConfig(energy_kind="conv", scales=[3, 5]))
    randomise_gates(model)
    ids, mask, positions = padded_batch()
    expected = logits(model, ids, mask, positions)
    assert torch.equal(logits(pickle.loads(pickle.dumps(model)), ids, mask, positions), expected)
    torch.save(model, tmp_path / "model.pt")
    torch.save({"ids": ids, "mask": mask, "positions": positions, "expected": expected}, tmp_path / "inputs.pt")
    script = (
        "import sys, torch\n"
        "model = torch.load(sys.argv[1], weights_only=False)\n"
        "inputs = torch.load(sys.argv[2])\n"
        "with torch.no_grad():\n"
        "    out = model(inputs['ids'], attention_mask=inputs['mask'], position_ids=inputs['positions']).logits\n"
        "assert torch.equal(out * inputs['mask'][..., None], inputs['expected']), 'logits differ'\n"
        "print(type(model.model.layers[0].self_attn).__name__)\n"
    )
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path / "model.pt"), str(tmp_path / "inputs.pt")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "EnergyGatedLlamaAttention"


class ScaledLlamaConfig(LlamaConfig):
    """A user's config subclass (importable by name, as pickle needs)."""

    @property
    def logit_scale(self) -> float:
        return 0.5


class ScaledLlamaForCausalLM(LlamaForCausalLM):
    """A user's model subclass whose forward reads what its config subclass adds."""

    config_class = ScaledLlamaConfig

    def forward(self, *args, **kwargs):
        output = super().forward(*args, **kwargs)
        output.logits = output.logits * self.config.logit_scale
        return output


class ScaledGatedLlama(EnergyGatedLlamaForCausalLM):
    """A user's subclass of a gated class."""

    def forward(self, *args, **kwargs):
        output = super().forward(*args, **kwargs)
        output.logits = output.logits * 3
        return output


def test_a_user_subclass_keeps_its_config_class_and_pickles_when_gated(tmp_path):
    """The config keeps the user's class under the gated one (its forward read a property the stock gated config
    lacked), gets it back when the gates go, and a gated subclass pickles (its gated class is made at run time)."""
    size = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)
    torch.manual_seed(0)
    model = ScaledLlamaForCausalLM(ScaledLlamaConfig(**size)).eval()
    ids, mask, positions = padded_batch()
    stock = logits(model, ids, mask, positions)
    add_energy_gates(model, EnergyGateConfig(energy_kind="linear"))
    assert isinstance(model.config, ScaledLlamaConfig) and model.config.model_type == "energy_gated_llama"
    torch.testing.assert_close(logits(model, ids, mask, positions), stock, atol=1e-6, rtol=1e-5)
    randomise_gates(model)
    gated = logits(model, ids, mask, positions)
    for copy in (pickle.loads(pickle.dumps(model)), pickle.loads(pickle.dumps(model.config))):
        assert isinstance(copy, ScaledLlamaForCausalLM | ScaledLlamaConfig)
    assert torch.equal(logits(pickle.loads(pickle.dumps(model)), ids, mask, positions), gated)
    # Saved, it loads back as the family's gated model, as transformers loads a stock subclass's checkpoint
    model.save_pretrained(tmp_path / "scaled")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "scaled").eval()
    assert type(reloaded).__name__ == "EnergyGatedLlamaForCausalLM" and isinstance(model.config, ScaledLlamaConfig)
    torch.testing.assert_close(logits(reloaded, ids, mask, positions) * 0.5, gated, atol=1e-6, rtol=1e-5)
    # A subclass of a gated class (defined by name) pickles and copies as itself
    scaled_gated = ScaledGatedLlama.from_pretrained(tmp_path / "scaled").eval()
    for copy in (pickle.loads(pickle.dumps(scaled_gated)), deepcopy(scaled_gated)):
        assert type(copy) is ScaledGatedLlama
        assert torch.equal(logits(copy, ids, mask, positions), logits(scaled_gated, ids, mask, positions))
    remove_energy_gates(model)
    assert type(model.config) is ScaledLlamaConfig and model.config.model_type == "llama"
    torch.testing.assert_close(logits(model, ids, mask, positions), stock, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("prefill_under_autocast", [True, False])
def test_a_gated_cache_continues_across_an_autocast_boundary(tmp_path, family, prefill_under_autocast):
    # The cache keeps the dtype it was filled in (the stock models' caches promote instead): new keys, values and
    # the packed gate state are cast to it. Mixing two state layouts had failed with a shape error.
    path = gpt2_checkpoint(tmp_path / "g") if family == "gpt2" else llama_checkpoint(tmp_path / "l")
    model = add_energy_gates(AutoModelForCausalLM.from_pretrained(path).eval(), EnergyGateConfig(energy_kind="conv"))
    randomise_gates(model)
    ids = torch.randint(3, VOCAB, (2, 20), generator=torch.Generator().manual_seed(0))
    assert_cache_continues_across_an_autocast_boundary(model, ids, prefill_under_autocast, split=12)


def test_gpt2_keeps_its_float32_scores_under_eager_attention():
    # GPT-2's reorder_and_upcast_attn computes eager attention scores in float32. The gated eager attention once
    # multiplied 16-bit queries and keys: with large projections float16 overflowed (NaN logits at α = 0).
    torch.manual_seed(0)
    config = GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=50, n_positions=64, reorder_and_upcast_attn=True,
                        attn_implementation="eager")
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        model.transformer.h[0].attn.c_attn.weight[:, :64] *= 1500.0  # q·k beyond float16's range
    model = model.half()
    ids = torch.randint(3, 50, (1, 8))
    with torch.no_grad():
        stock = model(ids).logits
        gated = add_energy_gates(model)(ids).logits
    assert stock.isfinite().all() and gated.isfinite().all()
    torch.testing.assert_close(gated, stock)  # float16 tolerances: float32 scores from another matmul kernel


def test_models_sharing_one_config_object_are_gated_and_ungated_independently(tmp_path):
    """Two models built from one config object (a policy and its reference), and a model made with
    `from_config(gated.config)`: gating or ungating one must leave the others' configs, and what they save, alone."""
    config = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64)
    first, second = GPT2LMHeadModel(config).eval(), GPT2LMHeadModel(config).eval()
    add_energy_gates(first, EnergyGateConfig(energy_kind="linear", layers=[0]))
    assert type(second.config) is GPT2Config and not hasattr(second.config, "energy_gates") and config is second.config
    add_energy_gates(second, EnergyGateConfig(energy_kind="conv", layers=[1]))
    assert (first.config.energy_gates["energy_kind"], first.config.energy_gates["layers"]) == ("linear", [0])
    randomise_gates(first)
    first.save_pretrained(tmp_path / "first")
    ids = padded_batch()[0]
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(tmp_path / "first").eval()(ids).logits,
                                   first(ids).logits, atol=1e-6, rtol=1e-5)
    remove_energy_gates(second)
    made_from = AutoModelForCausalLM.from_config(first.config)
    remove_energy_gates(made_from)
    assert first.config.energy_gates["energy_kind"] == "linear" and first.config.model_type == "energy_gated_gpt2"
    assert first.generate(ids[:1], max_new_tokens=3, do_sample=False, pad_token_id=0).shape == (1, 15)
    assert type(second.config) is GPT2Config is type(made_from.config) and not hasattr(second.config, "energy_gates")


def test_remove_energy_gates_restores_the_stock_model(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(gpt2_checkpoint(tmp_path / "g")).eval()
    ids, mask, positions = padded_batch()
    before = logits(model, ids, mask, positions)
    add_energy_gates(model)
    randomise_gates(model)
    remove_energy_gates(model)
    assert type(model) is GPT2LMHeadModel and type(model.config) is GPT2Config
    assert not hasattr(model.config, "energy_gates") and not has_energy_gates(model)
    # the attention modules read the model's own config again (not a view that names the gated backend)
    assert all(layer.attn.config is model.config for layer in model.transformer.h)
    assert torch.equal(logits(model, ids, mask, positions), before)
    model.save_pretrained(tmp_path / "stock")
    assert json.loads((tmp_path / "stock" / "config.json").read_text())["model_type"] == "gpt2"
    # A model loaded from a gated checkpoint: its config read the gated model type from config.json
    add_energy_gates(model).save_pretrained(tmp_path / "gated")
    loaded = remove_energy_gates(AutoModelForCausalLM.from_pretrained(tmp_path / "gated"))
    assert type(loaded.config) is GPT2Config and loaded.config.model_type == "gpt2"


def test_a_gated_model_loaded_as_remote_code_before_the_plugin_keeps_its_gates(tmp_path):
    """Loaded with trust_remote_code before `import hf_spectral`, a retrofitted model runs its folder's copy of the
    gated classes. The retrofit functions imported afterwards must still see its gates: they had reported none, and
    add_energy_gates replaced the trained gates with fresh ones."""
    model = AutoModelForCausalLM.from_pretrained(gpt2_checkpoint(tmp_path / "g")).eval()
    ids = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        stock = model(ids).logits
        randomise_gates(add_energy_gates(model))
        gated = model(ids).logits
    model.save_pretrained(tmp_path / "gated")
    save_energy_gates(model, tmp_path / "expected.safetensors")
    torch.save({"ids": ids, "stock": stock, "gated": gated}, tmp_path / "inputs.pt")
    script = (
        "import sys, torch, transformers\n"
        "from safetensors.torch import load_file\n"
        "folder, inputs = sys.argv[1], torch.load(sys.argv[2])\n"
        "model = transformers.AutoModelForCausalLM.from_pretrained(folder + '/gated', trust_remote_code=True)\n"
        "assert type(model).__module__.startswith('transformers_modules'), type(model).__module__\n"
        "from hf_spectral.retrofit import (add_energy_gates, has_energy_gates, remove_energy_gates,\n"
        "                                  save_energy_gates)\n"
        "assert has_energy_gates(model.eval())\n"
        "saved, expected = load_file(save_energy_gates(model, folder + '/late.safetensors')), "
        "load_file(folder + '/expected.safetensors')\n"
        "assert saved.keys() == expected.keys() and all(torch.equal(saved[k], expected[k]) for k in saved)\n"
        "try:\n"
        "    add_energy_gates(model)\n"
        "    raise SystemExit('add_energy_gates accepted a gated model')\n"
        "except ValueError as error:\n"
        "    assert 'already has energy gates' in str(error), error\n"
        # (another process, whose thread count may differ from this one's: tolerances, not bit equality)
        "with torch.no_grad():\n"
        "    torch.testing.assert_close(model(inputs['ids']).logits, inputs['gated'], atol=1e-6, rtol=1e-5)\n"
        "    torch.testing.assert_close(remove_energy_gates(model)(inputs['ids']).logits, inputs['stock'],\n"
        "                               atol=1e-6, rtol=1e-5)\n"
        "print(type(model).__name__, type(model.transformer.h[0].attn).__name__)\n"
    )
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path), str(tmp_path / "inputs.pt")],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["GPT2LMHeadModel", "GPT2Attention"]


def test_gates_only_file_round_trip_and_refusals(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(gpt2_checkpoint(tmp_path / "g")).eval()
    add_energy_gates(model)
    randomise_gates(model)
    path = save_energy_gates(model, tmp_path / "gates.safetensors")
    assert path.stat().st_size < 8 * 1024  # a few kilobytes
    fresh = AutoModelForCausalLM.from_pretrained(tmp_path / "g").eval()
    load_energy_gates(fresh, path)  # adds the gates recorded in the file, then loads them
    ids, mask, positions = padded_batch()
    assert torch.equal(logits(fresh, ids, mask, positions), logits(model, ids, mask, positions))

    other = AutoModelForCausalLM.from_pretrained(llama_checkpoint(tmp_path / "l"))
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        load_energy_gates(other, path)
    wider = GPT2LMHeadModel(GPT2Config(n_embd=48, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64))
    with pytest.raises(ValueError, match="hidden_size=32"):
        load_energy_gates(wider, path)
    differently_gated = AutoModelForCausalLM.from_pretrained(tmp_path / "g")
    add_energy_gates(differently_gated, EnergyGateConfig(projections=2))
    with pytest.raises(ValueError, match="configured"):
        load_energy_gates(differently_gated, path)
    with pytest.raises(ValueError, match="not an energy-gate file"):
        load_energy_gates(AutoModelForCausalLM.from_pretrained(tmp_path / "g"), tmp_path / "g" / "model.safetensors")
    (tmp_path / "corrupt.safetensors").write_bytes(b"\x00\x01not a safetensors file")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_energy_gates(AutoModelForCausalLM.from_pretrained(tmp_path / "g"), tmp_path / "corrupt.safetensors")
    with pytest.raises(FileNotFoundError):
        load_energy_gates(model, tmp_path / "missing.safetensors")
    bare = GPT2Model.from_pretrained(tmp_path / "g")  # the same family without the LM head: other weight names
    with pytest.raises(ValueError, match="saved from a GPT2LMHeadModel, this model is a GPT2Model"):
        load_energy_gates(bare, path)
    assert not has_energy_gates(bare)
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(path, framework="pt") as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
        metadata = handle.metadata()
    description = json.loads(metadata["hf_spectral_energy_gates"])
    metadata["hf_spectral_energy_gates"] = json.dumps({**description, "format_version": 99})
    save_file(tensors, tmp_path / "future.safetensors", metadata=metadata)
    with pytest.raises(ValueError, match="format version 99"):
        load_energy_gates(AutoModelForCausalLM.from_pretrained(tmp_path / "g"), tmp_path / "future.safetensors")


def test_gates_train_next_to_lora_and_live_in_the_adapter(tmp_path):
    base_path = gpt2_checkpoint(tmp_path / "g")
    gate_config = EnergyGateConfig(alpha_init=0.5)
    model = add_energy_gates(AutoModelForCausalLM.from_pretrained(base_path), gate_config)
    peft_model = get_peft_model(model, LoraConfig(target_modules=["c_attn"], modules_to_save=["energy_gate"], r=4))
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert any("lora_" in n for n in trainable) and any(".energy_gate." in n for n in trainable)
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    ids, mask, positions = padded_batch()
    for _ in range(3):
        peft_model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    peft_model.eval()
    expected = logits(peft_model, ids, mask, positions)
    peft_model.save_pretrained(tmp_path / "adapter")
    gate_config.save_pretrained(tmp_path / "adapter")

    base = AutoModelForCausalLM.from_pretrained(base_path)
    add_energy_gates(base, EnergyGateConfig.from_pretrained(tmp_path / "adapter"))
    restored = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    torch.testing.assert_close(logits(restored, ids, mask, positions), expected, atol=1e-6, rtol=0)
    untrained = add_energy_gates(AutoModelForCausalLM.from_pretrained(base_path), gate_config).eval()
    assert (logits(untrained, ids, mask, positions) - expected).abs().max() > 1e-4


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_attention_probabilities_come_per_layer_as_from_the_stock_model(family, backend, tmp_path):
    """output_attentions: eager gives every layer's probabilities, SDPA none, whichever layers are gated (gated layers
    that ran through eager under SDPA gave a list of the gated layers alone, read as layers 0, 1, ...)."""
    ids = padded_batch()[0][1:2]
    for layers in (None, [1]):
        path = CHECKPOINTS[family](tmp_path / family)
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=backend).eval()
        with torch.no_grad():
            stock = model(ids, output_attentions=True).attentions or ()
            add_energy_gates(model, EnergyGateConfig(layers=layers))
            gated = model(ids, output_attentions=True).attentions or ()
        assert len(gated) == len(stock) == (2 if backend == "eager" else 0)


def test_only_the_chosen_heads_are_gated(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(gpt2_checkpoint(tmp_path / "g"), attn_implementation="eager")
    model.eval()
    ids = padded_batch()[0][1:2]
    with torch.no_grad():
        stock = model(ids, output_attentions=True).attentions[0]
        add_energy_gates(model, EnergyGateConfig(heads=[1, 3], layers=[0]))
        randomise_gates(model)
        gated = model(ids, output_attentions=True).attentions[0]
    for head in (0, 2):  # a zero bias: the stock probabilities (the gated eager kernel is not GPT-2's own)
        torch.testing.assert_close(gated[:, head], stock[:, head], atol=1e-6, rtol=1e-5)
    for head in (1, 3):
        assert not torch.allclose(gated[:, head], stock[:, head])


def test_unsupported_models_and_bad_configs_are_refused(tmp_path):
    bert = BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64))
    with pytest.raises(ValueError, match="BertModel: its attention is bidirectional.*decoder-only"):
        add_energy_gates(bert)
    model = AutoModelForCausalLM.from_pretrained(gpt2_checkpoint(tmp_path / "g"))
    with pytest.raises(ValueError, match="layers"):
        add_energy_gates(model, EnergyGateConfig(layers=[5]))
    with pytest.raises(ValueError, match="heads"):
        add_energy_gates(model, EnergyGateConfig(heads=[4]))
    add_energy_gates(model)
    with pytest.raises(ValueError, match="already has energy gates"):
        add_energy_gates(model)
    # A gated class reads a stock config as the stock config it is, and says how to add gates to it.
    assert type(type(model).config_class.from_pretrained(tmp_path / "g")) is GPT2Config
    with pytest.raises(ValueError, match="stock gpt2 config, without energy gates.*add_energy_gates"):
        type(model).from_pretrained(tmp_path / "g")
    for bad, field in [({"normalization": "global"}, "normalization"), ({"energy_kind": "x"}, "energy_kind"),
                       ({"scales": [0]}, "scales"), ({"projections": 0}, "projections")]:
        with pytest.raises(ValueError, match=field):
            EnergyGateConfig(**bad)


@pytest.mark.parametrize(
    "not_a_model, named",
    [(pipeline, "'pipeline' (function)"), (GPT2Config(n_layer=1), "a GPT2Config object"), ("GPT2LMHeadModel",
     "'GPT2LMHeadModel' (str)"), (5, "5 (int)")],
)
def test_a_value_that_is_no_model_class_or_model_is_refused_naming_it(not_a_model, named):
    with pytest.raises(TypeError, match=re.escape(f"go into a model class (such as LlamaForCausalLM), not {named}")):
        check_class_supported(not_a_model)
    with pytest.raises(TypeError, match=re.escape(f"(a torch.nn.Module such as LlamaForCausalLM), not {named}")):
        add_energy_gates(not_a_model)


def test_a_model_class_instead_of_a_model_is_refused_with_what_to_do():
    with pytest.raises(TypeError, match=re.escape("not the class GPT2LMHeadModel (build the model first)")):
        add_energy_gates(GPT2LMHeadModel)
    with pytest.raises(ValueError, match="energy gates cannot be added to GPT2Config"):  # a class, but no model's
        check_class_supported(GPT2Config)


def test_command_line_writes_a_retrofitted_copy(tmp_path):
    source = gpt2_checkpoint(tmp_path / "src")
    command = [sys.executable, "-m", "hf_spectral.cli", "retrofit", str(source), str(tmp_path / "dst"),
               "--layers", "0", "--energy-kind", "morlet", "--scales", "3,7"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    config = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert config["energy_gates"]["energy_kind"] == "morlet" and config["energy_gates"]["layers"] == [0]
    ids, mask, positions = padded_batch()
    original = AutoModelForCausalLM.from_pretrained(source).eval()
    copy = AutoModelForCausalLM.from_pretrained(tmp_path / "dst").eval()
    torch.testing.assert_close(logits(copy, ids, mask, positions), logits(original, ids, mask, positions),
                               atol=1e-6, rtol=1e-5)
    again = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert again.returncode != 0 and "exists" in again.stderr
    missing = subprocess.run(command[:4] + [str(tmp_path / "nowhere"), str(tmp_path / "dst2")],
                             capture_output=True, text=True, timeout=300)
    assert missing.returncode != 0 and "no config.json" in missing.stderr
    assert not (tmp_path / "dst2").exists()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_gated_attention_backends_agree(family, tmp_path):
    """The retrofit's gated attention on eager (bias on the scores), sdpa (folded channel) and flex_attention
    (score_mod, grouped-query heads; transformers' GPT-2 refuses flex_attention), padded and uncached, and through a
    cache."""
    path = CHECKPOINTS[family](tmp_path / family)
    ids, mask, positions = padded_batch()
    outputs, steps = {}, {}
    backends = ("eager", "sdpa") if family == "gpt2" or INDUCTOR_ISA_FORCED else ("eager", "sdpa", "flex_attention")
    for backend in backends:
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=backend).eval()
        add_energy_gates(model, EnergyGateConfig(energy_kind="morlet", scales=[3, 5]))
        randomise_gates(model)
        outputs[backend] = logits(model, ids, mask, positions)
        with torch.no_grad():
            unpadded = ids[2:, 1:]
            cache = model(unpadded[:, :-1], use_cache=True).cache
            steps[backend] = model(unpadded[:, -1:], cache=cache, use_cache=True).logits
    for backend in backends[1:]:
        torch.testing.assert_close(outputs[backend], outputs["eager"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(steps[backend], steps["eager"], atol=1e-5, rtol=1e-5)


def test_window_statistics_rebias_every_cached_key(tmp_path):
    """With window statistics each decoding step normalises every key again: every cached key's bias is
    replaced, and the last step of a token-by-token decoding equals the forward over the whole sequence. (Only the
    last layer is gated: a gated earlier layer would feed later layers outputs that saw a partial window.)"""
    model = AutoModelForCausalLM.from_pretrained(gpt2_checkpoint(tmp_path / "g")).eval()
    add_energy_gates(model, EnergyGateConfig(normalization="window", layers=[1]))
    randomise_gates(model)
    ids, mask, positions = padded_batch()
    full = logits(model, ids, mask, positions)
    with torch.no_grad():
        out = model(ids[:, :5], attention_mask=mask[:, :5], position_ids=positions[:, :5], use_cache=True)
        for t in range(5, ids.shape[1]):
            out = model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], position_ids=positions[:, t : t + 1],
                        cache=out.cache, use_cache=True)
    torch.testing.assert_close(out.logits[:, -1], full[:, -1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("normalization", ["causal", "window"])
def test_prompt_lookup_and_chunked_prefill_give_the_greedy_tokens_and_are_refused_under_window_statistics(
        normalization, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(gpt2_checkpoint(tmp_path / "g")).eval()
    add_energy_gates(model, EnergyGateConfig(normalization=normalization))
    randomise_gates(model)
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])  # repeats, so that prompt lookup proposes drafts
    greedy = model.generate(ids, max_new_tokens=8, do_sample=False)
    # Drafts; the prompt in 3 calls (into a StaticCache too, which generate() would allocate ahead at the head size)
    for option in ({"prompt_lookup_num_tokens": 3}, {"prefill_chunk_size": 4},
                   {"prefill_chunk_size": 4, "cache_implementation": "static"}):
        if normalization == "window":
            with pytest.raises(ValueError, match="window statistics"):
                model.generate(ids, max_new_tokens=8, do_sample=False, **option)
        else:
            assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False, **option), greedy)


def test_a_gated_attention_reads_the_model_config_through_a_view_with_its_own_instance_dict(tmp_path):
    """torch.compile guards on the __dict__ of the attention module's config: a view without one of its own (slots,
    with attribute reads forwarded to the config) answered with the config's, and torch 2.10's guards failed on it
    ('Guard failed on the same frame it was created')."""
    model = AutoModelForCausalLM.from_pretrained(gpt2_checkpoint(tmp_path / "g"))
    add_energy_gates(model)
    view = model.transformer.h[0].attn.config
    assert vars(view) == {"config": model.config}
    assert view._attn_implementation != model.config._attn_implementation  # the gated wrapper's name
    assert view.n_embd == model.config.n_embd


@pytest.mark.skipif(INDUCTOR_ISA_FORCED, reason=INDUCTOR_SKIP_REASON)
def test_a_compiled_retrofitted_gpt2_trains_and_infers_like_eager(tmp_path):
    """torch.compile of a retrofitted GPT-2: forward logits (atol 1e-5, rtol 1e-5) and one training step's gradients
    (atol 1e-5, rtol 1e-4) equal eager's."""
    path = gpt2_checkpoint(tmp_path / "g")
    models = []
    for _ in range(2):
        model = AutoModelForCausalLM.from_pretrained(path, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
        add_energy_gates(model, EnergyGateConfig(alpha_init=0.5))
        randomise_gates(model)
        models.append(model.train())
    eager, compiled_model = models
    compiled_model.load_state_dict(eager.state_dict())  # the energy projections were drawn at random
    compiled = torch.compile(compiled_model)
    ids, mask, positions = padded_batch()
    labels = ids.masked_fill(mask == 0, -100)
    out_eager = eager(ids, attention_mask=mask, position_ids=positions, labels=labels)
    out_eager.loss.backward()
    out_compiled = compiled(ids, attention_mask=mask, position_ids=positions, labels=labels)
    out_compiled.loss.backward()
    torch.testing.assert_close(out_compiled.logits * mask[..., None], out_eager.logits * mask[..., None],
                               atol=1e-5, rtol=1e-5)
    for (name, a), (_, b) in zip(compiled_model.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    assert any(".energy_gate." in name for name, p in eager.named_parameters() if p.grad is not None)


@pytest.mark.skipif(INDUCTOR_ISA_FORCED, reason=INDUCTOR_SKIP_REASON)
def test_a_compiled_flex_attention_forward_of_a_retrofitted_llama_equals_eager(tmp_path):
    """The gates' bias reaches flex_attention's score_mod; on CPU torch.compile(model) had failed to build that
    kernel (a tensor computed in its graph)."""
    model = AutoModelForCausalLM.from_pretrained(llama_checkpoint(tmp_path), attn_implementation="flex_attention")
    add_energy_gates(model)
    randomise_gates(model)
    compiled = torch.compile(model.eval())
    ids, mask, positions = padded_batch()
    torch.testing.assert_close(logits(compiled, ids, mask, positions), logits(model, ids, mask, positions),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_every_gate_parameter_gets_a_gradient_for_data_parallel_training(tmp_path, family):
    """With only the gates trainable, each of them must be in the graph (DistributedDataParallel's default refuses
    a parameter without a gradient), a one-scale gate's mixing logit included."""
    if family == "gpt2":
        model = GPT2LMHeadModel.from_pretrained(gpt2_checkpoint(tmp_path))
    else:
        model = LlamaForCausalLM.from_pretrained(llama_checkpoint(tmp_path))
    add_energy_gates(model, EnergyGateConfig(energy_kind="linear"))
    assert mark_only_gates_trainable(model) > 0
    ids, mask, _ = padded_batch()
    model.train()(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.backward()
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert any(name.endswith("mix_logits") for name in trainable)
    assert [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None] == []


@pytest.mark.parametrize("family", list(CHECKPOINTS))
def test_gradient_checkpointing_recomputes_with_its_own_batch_padding_after_another_forward(tmp_path, family):
    """A forward on another batch between a training forward and its backward (a reference or KL pass): the
    recomputation of a checkpointed layer must see the padding of the batch it recomputes, so the gradients equal
    those without checkpointing (a mask kept on the modules gave the other batch's: other gradients, or a
    CheckpointError where the other batch had another shape)."""
    ids, mask, _ = padded_batch()
    others = [(ids.roll(1, 0), mask.flip(1)), (ids[:2, :7], None)]  # the same shape padded elsewhere; another shape
    for other_ids, other_mask in others:
        gradients = []
        for checkpointing in (False, True):
            model = AutoModelForCausalLM.from_pretrained(CHECKPOINTS[family](tmp_path / family))
            add_energy_gates(model, EnergyGateConfig(energy_kind="linear"))
            randomise_gates(model)
            if checkpointing:
                model.activation_checkpointing_enable()
            model.train()
            loss = model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
            with torch.no_grad():
                model(other_ids, attention_mask=other_mask)
            loss.backward()
            gradients.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        torch.testing.assert_close(gradients[1], gradients[0], atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_16_bit_retrofitted_model_trains_through_its_cache_and_generates_under_autocast(tmp_path, family):
    """GPT-2 keeps its cache on in training: 16-bit values carrying packed gate state must leave the gradients
    finite. Under autocast the gate's input is float32 while the cached values are bfloat16."""
    path = CHECKPOINTS[family](tmp_path / family)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    add_energy_gates(model)
    randomise_gates(model)
    ids = torch.randint(3, VOCAB, (4, 48), generator=torch.Generator().manual_seed(0))
    model.train()(ids, labels=ids, use_cache=True).loss.backward()
    assert [n for n, p in model.named_parameters() if p.grad is not None and not p.grad.isfinite().all()] == []

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    add_energy_gates(model)
    randomise_gates(model)
    ids, mask, _ = padded_batch()
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits[:, -1]
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        out = model(ids[:, :-1], attention_mask=mask[:, :-1], use_cache=True)
        step = model(ids[:, -1:], attention_mask=mask, cache=out.cache, use_cache=True).logits[:, -1]
        model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert out.cache.layers[0].values.dtype == torch.bfloat16
    torch.testing.assert_close(step.float(), expected, atol=0.1, rtol=0.05)
