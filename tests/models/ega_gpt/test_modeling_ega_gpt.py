import pytest
import torch

from hf_spectral import EGAConfig, EGAForCausalLM, EGAForSequenceClassification, EGAModel
from hf_spectral.evaluation import causal_lm_losses, leak_free_logits
from tests.helpers import (
    INDUCTOR_ISA_FORCED,
    INDUCTOR_SKIP_REASON,
    assert_cache_continues_across_an_autocast_boundary,
    gates_decoded_token_by_token,
    load_without_plugin,
    perturb_after,
)

VOCAB = 37
KINDS = {
    "EGA-1": {},
    "EGA-2": {},
    "EGA-C": {"energy_scales": [3, 5]},
    "EGA-M": {"energy_scales": [3, 7]},
    "EGA-M-F": {"energy_scales": [3, 7]},
    "EGA-DB2": {"energy_scales": [1, 2]},
    "EGA-DB4": {},
}


def tiny_config(variant="EGA-1", **overrides):
    values = dict(
        vocab_size=VOCAB, hidden_size=24, num_hidden_layers=2, num_attention_heads=3, max_position_embeddings=48,
        embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0, **KINDS.get(variant, {}),
    )
    values.update(overrides)
    return EGAConfig.from_variant(variant, **values)


def tiny_model(variant="EGA-1", seed=0, **overrides):
    """A model whose gates are far from the identity (random α), so that tests see them act."""
    torch.manual_seed(seed)
    model = EGAForCausalLM(tiny_config(variant, **overrides)).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith((".alpha", ".tau", ".mix_logits")):
                parameter.normal_(0, 1.5)
    return model


def padded_batch(seed=0, length=14):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (3, length), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding
    mask[1, :2] = 0
    return ids.masked_fill(mask == 0, 0), mask


def assert_close_on_tokens(a, b, mask, atol=1e-5):
    torch.testing.assert_close(a * mask[..., None], b * mask[..., None], atol=atol, rtol=0)


def assert_generation_matches_the_forward(model, ids, max_new_tokens=4):
    """Greedy generate() from unpadded ``ids``: every step's logits equal the uncached forward's over the generated
    sequence. Returns the sequences."""
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    with torch.no_grad():
        full = model(out.sequences).logits
    for step, logits in enumerate(out.logits):
        torch.testing.assert_close(logits, full[:, ids.shape[1] - 1 + step], atol=1e-5, rtol=0)
    return out.sequences


@pytest.mark.parametrize("variant", list(KINDS))
def test_alpha_zero_gives_the_ungated_model(variant):
    """At α = 0 the gate's bias is exactly 0; the gated attention runs another kernel (SDPA over a folded channel),
    so the logits agree to a few float32 ulps and greedy generations are identical."""
    gated = tiny_model(variant, gate_alpha_init=0.0)
    with torch.no_grad():
        for name, parameter in gated.named_parameters():
            if name.endswith(".alpha"):
                parameter.zero_()
    baseline = EGAForCausalLM(tiny_config("BASE")).eval()
    missing, unexpected = baseline.load_state_dict(gated.state_dict(), strict=False)
    assert not missing and all(".energy_gate." in key for key in unexpected)
    ids, mask = padded_batch()
    with torch.no_grad():
        torch.testing.assert_close(
            gated(ids, attention_mask=mask).logits, baseline(ids, attention_mask=mask).logits, atol=1e-6, rtol=1e-5
        )
    settings = dict(attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert torch.equal(gated.generate(ids, **settings), baseline.generate(ids, **settings))


@pytest.mark.parametrize("normalization", ["causal", "none"])
@pytest.mark.parametrize("variant", list(KINDS))
def test_changing_future_tokens_never_moves_earlier_logits(variant, normalization):
    model = tiny_model(variant, energy_normalization=normalization)
    ids, mask = padded_batch()
    with torch.no_grad():
        reference = model(ids, attention_mask=mask).logits
        for position in (5, 9):
            changed = model(perturb_after(ids, position, VOCAB), attention_mask=mask).logits
            assert torch.equal(changed[:, : position + 1], reference[:, : position + 1])
            assert not torch.allclose(changed[:, position + 1 :], reference[:, position + 1 :])


def test_window_statistics_see_the_future():
    model = tiny_model("EGA-1", energy_normalization="window")
    ids, mask = padded_batch()
    with torch.no_grad():
        reference = model(ids, attention_mask=mask).logits
        changed = model(perturb_after(ids, 8, VOCAB), attention_mask=mask).logits
    assert (changed[:, :9] - reference[:, :9]).abs().max() > 1e-4


@pytest.mark.parametrize("normalization", ["causal", "none"])
@pytest.mark.parametrize("variant", list(KINDS))
def test_cached_decoding_equals_the_uncached_forward(variant, normalization):
    model = tiny_model(variant, energy_normalization=normalization)
    ids, mask = padded_batch()
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        out = model(ids[:, :6], attention_mask=mask[:, :6], use_cache=True)
        cache, pieces = out.cache, [out.logits]
        for start, stop in ((6, 7), (7, 10), (10, 11), (11, 14)):  # single tokens and chunks
            out = model(ids[:, start:stop], attention_mask=mask[:, :stop], cache=cache, use_cache=True)
            cache = out.cache
            pieces.append(out.logits)
    assert_close_on_tokens(torch.cat(pieces, 1), full, mask)


@pytest.mark.parametrize("cache_implementation", ["dynamic", "static"])
@pytest.mark.parametrize("variant", list(KINDS))
def test_cached_generation_with_the_folded_head_padded_as_on_cuda(variant, cache_implementation, monkeypatch):
    """On CUDA a prefill's folded head is padded to a multiple of 8 channels (CUDA's rule, run here): the cache still
    gets the keys at the head size, and cached generation equals the forward."""
    from hf_spectral.ops import gated_attention

    monkeypatch.setattr(gated_attention, "fused_kernel_alignment", lambda device: 8)
    model = tiny_model(variant)
    ids = padded_batch()[0][:, 5:]
    if cache_implementation == "dynamic":
        assert_generation_matches_the_forward(model, ids)
        return
    out = model.generate(ids, max_new_tokens=4, do_sample=False, cache_implementation="static", output_logits=True,
                         return_dict_in_generate=True)
    with torch.no_grad():
        full = model(out.sequences).logits
    for step, logits in enumerate(out.logits):
        torch.testing.assert_close(logits, full[:, ids.shape[1] - 1 + step], atol=1e-5, rtol=0)


@pytest.mark.parametrize("mask_kind", ["all ones", "none"])
@pytest.mark.parametrize("variant", ["EGA-1", "EGA-2", "EGA-C"])
def test_unpadded_token_by_token_decoding_equals_the_uncached_forward(variant, mask_kind):
    model = tiny_model(variant)
    ids = padded_batch()[0][:, 5:]
    mask = torch.ones_like(ids) if mask_kind == "all ones" else None
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        out = model(ids[:, :3], attention_mask=None if mask is None else mask[:, :3], use_cache=True)
        pieces = [out.logits]
        for stop in range(4, ids.shape[1] + 1):
            out = model(ids[:, stop - 1 : stop], attention_mask=None if mask is None else mask[:, :stop],
                        cache=out.cache, use_cache=True)
            pieces.append(out.logits)
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-5, rtol=0)


def test_past_key_values_is_honoured_like_transformers_own_models():
    """``past_key_values=`` (the name transformers 5 deprecates in favour of ``cache``, with a warning) still feeds the
    cache: incremental decoding through it equals the full forward."""
    model = tiny_model("EGA-C")
    ids, mask = padded_batch()
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        out = model(ids[:, :8], attention_mask=mask[:, :8], use_cache=True)
        pieces = [out.logits]
        for t in range(8, ids.shape[1]):
            with pytest.warns(FutureWarning, match="past_key_values"):
                out = model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], past_key_values=out.cache,
                            use_cache=True)
            pieces.append(out.logits)
        assert out.cache.get_seq_length() == ids.shape[1]
        base = model.model(ids[:, :8], attention_mask=mask[:, :8], use_cache=True)
        with pytest.warns(FutureWarning, match="past_key_values"):
            step = model.model(ids[:, 8:9], attention_mask=mask[:, :9], past_key_values=base.cache, use_cache=True)
    assert_close_on_tokens(torch.cat(pieces, 1), full, mask)
    torch.testing.assert_close(model.lm_head(step.last_hidden_state)[:, 0], full[:, 8], atol=1e-5, rtol=0)


def test_a_cropped_cache_continues_like_the_forward():
    model = tiny_model("EGA-M")
    ids = padded_batch()[0][:, 2:]
    with torch.no_grad():
        full = model(ids).logits
        cache = model(ids, use_cache=True).cache
        cache.crop(-(ids.shape[1] - 7))  # keep the first 7 positions
        step = model(ids[:, 7:9], cache=cache, use_cache=True).logits
    torch.testing.assert_close(step, full[:, 7:9], atol=1e-5, rtol=0)


@pytest.mark.parametrize("variant", ["EGA-1", "EGA-M"])
def test_a_bfloat16_model_decoding_1024_tokens_keeps_its_gates_within_0_02(variant):
    """The gate statistics run in float32 and their running moments stay float32 in a bfloat16 KV cache: 1,024
    tokens fed one at a time through the cache keep every gate within 0.02 of a float32 forward of the same weights."""
    torch.manual_seed(0)
    config = tiny_config(variant, max_position_embeddings=1024, num_hidden_layers=1)
    reference = EGAForCausalLM(config).eval()
    with torch.no_grad():  # trained-looking LayerNorms: at (1, 0) the channel mean Morlet filters read is 0
        for name, parameter in reference.named_parameters():
            if ".ln_" in name:
                parameter.normal_(0.5 if name.endswith("weight") else 0.0, 0.5)
    low = EGAForCausalLM(config).eval()
    low.load_state_dict(reference.state_dict())
    low.to(torch.bfloat16)
    reference.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in reference.state_dict().items()})
    ids = torch.randint(1, VOCAB, (1, 1024), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(ids, output_gate_values=True).gate_values[0]
    gates, cache = gates_decoded_token_by_token(low, ids)
    assert cache.layers[0].values.dtype == torch.bfloat16
    assert (gates - expected).abs().max() < 0.02


def test_lora_adapters_on_the_projections_take_effect():
    """PEFT LoRA on the attention and energy projections: the adapted model equals its merged weights."""
    from peft import LoraConfig, get_peft_model

    model = tiny_model("EGA-1")
    ids, mask = padded_batch()
    with torch.no_grad():
        plain = model(ids, attention_mask=mask).logits
    adapted = get_peft_model(model, LoraConfig(r=4, target_modules=["c_attn", "c_proj", "proj"], lora_dropout=0.0))
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
        with_lora = adapted(input_ids=ids, attention_mask=mask).logits
        merged = adapted.merge_and_unload()(ids, attention_mask=mask).logits
    assert not torch.allclose(with_lora * mask[..., None], plain * mask[..., None], atol=1e-3)
    assert_close_on_tokens(with_lora, merged, mask, atol=1e-5)


def test_a_loss_builds_no_cache_unless_asked():
    model = tiny_model("EGA-1")
    ids = padded_batch()[0]
    assert model(ids, labels=ids).cache is None
    assert model(ids, labels=ids, use_cache=True).cache.get_seq_length() == ids.shape[1]
    assert model(ids).cache.get_seq_length() == ids.shape[1]


def test_the_loss_is_the_next_token_cross_entropy():
    model = tiny_model("EGA-1")
    ids, mask = padded_batch()
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        out = model(ids, attention_mask=mask, labels=labels)
    expected = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
    torch.testing.assert_close(out.loss, expected)


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no-cache"])  # the two paths of a gated layer
@pytest.mark.parametrize("variant", ["EGA-1", "EGA-C", "EGA-M"])
def test_left_padding_does_not_change_a_sequence(variant, use_cache):
    model = tiny_model(variant)
    ids, mask = padded_batch()
    with torch.no_grad():
        batched = model(ids, attention_mask=mask, use_cache=use_cache).logits
        alone = model(ids[:1, 5:], use_cache=use_cache).logits
    torch.testing.assert_close(batched[:1, 5:], alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "settings", [{"do_sample": False}, {"do_sample": False, "num_beams": 3}, {"do_sample": True, "top_k": 8}]
)
def test_generate_with_cache_matches_generate_without(settings):
    model = tiny_model("EGA-1")
    ids, mask = padded_batch(length=8)
    results = []
    for use_cache in (True, False):
        torch.manual_seed(123)
        results.append(model.generate(ids, attention_mask=mask, max_new_tokens=6, use_cache=use_cache, **settings))
    assert torch.equal(results[0], results[1])
    if not settings["do_sample"]:  # a left-padded row generates what it generates alone
        alone = model.generate(ids[:1, 5:], max_new_tokens=6, **settings)
        assert torch.equal(alone, results[0][:1, 5:])


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
@pytest.mark.parametrize("variant", ["EGA-1", "EGA-2", "EGA-C", "EGA-M"])
def test_static_cache_generation_equals_the_uncached_forward(variant, padded):
    """A StaticCache holds more positions than it has filled: the gates read their state at the last filled key."""
    model = tiny_model(variant)
    ids, mask = padded_batch()
    ids, mask = (ids, mask) if padded else (ids[:, 5:], None)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, cache_implementation="static",
                         output_logits=True, return_dict_in_generate=True)
    full_mask = None if mask is None else torch.cat([mask, torch.ones(3, 4, dtype=mask.dtype)], 1)
    with torch.no_grad():
        full = model(out.sequences, attention_mask=full_mask).logits
    for step, logits in enumerate(out.logits):
        torch.testing.assert_close(logits, full[:, ids.shape[1] - 1 + step], atol=1e-5, rtol=0)


@pytest.mark.parametrize("variant", ["EGA-1", "EGA-C"])
def test_a_reset_static_cache_starts_like_a_new_one(variant):
    """After ``reset()`` a StaticCache holds zeros and an on-device length of 0, which the gates read as a past
    with a count of 0: the same statistics as no past (identical in exact arithmetic)."""
    from transformers import StaticCache

    model = tiny_model(variant)
    ids = padded_batch()[0][:, 5:]
    cache = StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        fresh = model(ids, cache=cache, use_cache=True, output_gate_values=True)
        model(ids[:, -1:], cache=cache, use_cache=True)
        cache.reset()
        again = model(ids, cache=cache, use_cache=True, output_gate_values=True)
    for a, b in zip(again.gate_values, fresh.gate_values):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    torch.testing.assert_close(again.logits, fresh.logits, atol=1e-6, rtol=0)


@pytest.mark.skipif(INDUCTOR_ISA_FORCED, reason=INDUCTOR_SKIP_REASON)
def test_static_cache_generation_under_flex_attention_keeps_the_padding():
    """For a StaticCache generate() builds the backend's mask ahead of the forward, under flex_attention a BlockMask
    without the padding; the model takes the 2D mask instead (``create_masks_for_generate``), so the gates still
    skip the left padding and a padded row generates what it generates alone."""
    model = tiny_model("EGA-1")
    model.set_attn_implementation("flex_attention")
    ids, mask = padded_batch()
    settings = dict(max_new_tokens=3, do_sample=False, cache_implementation="static")
    out = model.generate(ids, attention_mask=mask, output_logits=True, return_dict_in_generate=True, **settings)
    full_mask = torch.cat([mask, torch.ones(3, 3, dtype=mask.dtype)], 1)
    with torch.no_grad():
        full = model(out.sequences, attention_mask=full_mask).logits
    for step, logits in enumerate(out.logits):
        torch.testing.assert_close(logits, full[:, ids.shape[1] - 1 + step], atol=1e-5, rtol=0)
    assert torch.equal(model.generate(ids[:1, 5:], **settings), out.sequences[:1, 5:])


@pytest.mark.parametrize("normalization", ["causal", "window"])
def test_drafts_and_chunked_prefill_give_the_greedy_tokens_and_are_refused_under_window_statistics(normalization):
    # Assisted, early-exit and prompt-lookup decoding verify several drafts in one cached call, a chunked prefill
    # runs the prompt in several (with a StaticCache, generate() allocates it ahead, at the head size the gated
    # layers store their keys at): causal gates give each position what plain decoding gives; window gates would
    # see the later drafts, or miss the later chunks.
    model = tiny_model("EGA-1", energy_normalization=normalization)
    ids = torch.randint(1, VOCAB, (1, 8), generator=torch.Generator().manual_seed(4))
    greedy = model.generate(ids, max_new_tokens=10, do_sample=False)
    for assistance in ({"assistant_model": tiny_model("EGA-1", seed=1)}, {"prompt_lookup_num_tokens": 3},
                       {"assistant_early_exit": 1}, {"prefill_chunk_size": 3},
                       {"prefill_chunk_size": 3, "cache_implementation": "static"}):
        if normalization == "window":
            with pytest.raises(ValueError, match="window statistics"):
                model.generate(ids, max_new_tokens=10, do_sample=False, **assistance)
        else:
            assert torch.equal(model.generate(ids, max_new_tokens=10, do_sample=False, **assistance), greedy)


def test_a_sliding_window_cache_continues_causal_statistics_and_refuses_window_statistics():
    """A cache whose layers slide (a user's choice: EGA-GPT has no window of its own) keeps the latest keys: the causal
    statistics need only the last key's running moments and continue past the window; window statistics re-bias every
    earlier key, which the window no longer holds, and are refused naming the way out."""
    from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer

    ids = padded_batch()[0][:, 5:]
    for normalization in ("causal", "window"):
        model = tiny_model("EGA-1", energy_normalization=normalization)
        cache = DynamicCache(config=model.config)
        cache.layers = [DynamicSlidingWindowLayer(sliding_window=4) for _ in cache.layers]
        with torch.no_grad():
            out = model(ids, cache=cache, use_cache=True)
            if normalization == "causal":
                step = model(ids[:, -1:], cache=out.cache, use_cache=True)
                assert torch.isfinite(step.logits).all() and cache.layers[0].keys.shape[-2] == 3  # window - 1 kept
            else:
                with pytest.raises(ValueError, match="sliding window keeps 3 key.* causal statistics"):
                    model(ids[:, -1:], cache=out.cache, use_cache=True)


def test_window_statistics_decode_alike_with_dynamic_and_static_caches():
    """With window statistics every step re-normalises all keys from the raw energies the cache keeps; a StaticCache
    (more positions than filled) gives the same generation as a DynamicCache, and leak-free decoding."""
    model = tiny_model("EGA-1", energy_normalization="window")
    ids, mask = padded_batch(length=8)
    settings = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, output_logits=True,
                    return_dict_in_generate=True)
    dynamic = model.generate(ids, **settings)
    static = model.generate(ids, cache_implementation="static", **settings)
    assert torch.equal(dynamic.sequences, static.sequences)
    for a, b in zip(dynamic.logits, static.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.skipif(INDUCTOR_ISA_FORCED, reason=INDUCTOR_SKIP_REASON)
@pytest.mark.parametrize("variant", ["EGA-1", "EGA-M"])
def test_attention_backends_agree(variant):
    """eager (bias added to the scores), sdpa (folded channel) and flex_attention (score_mod): a padded forward, an
    unpadded cached step and a left-padded greedy generation (on CPU flex_attention is compiled for static shapes:
    with dynamic ones torch 2.13's CPU template cannot build the padding mask's kernel)."""
    ids, mask = padded_batch()
    unpadded = ids[:, 5:]
    model = tiny_model(variant, energy_gate_layers=[1])  # an ungated and a gated layer
    outputs, steps, generated = {}, {}, {}
    for backend in ("eager", "sdpa", "flex_attention"):
        model.set_attn_implementation(backend)
        assert model.model.h[0].attn.config._attn_implementation == backend
        with torch.no_grad():
            outputs[backend] = model(ids, attention_mask=mask).logits
            cache = model(unpadded[:, :-1], use_cache=True).cache
            steps[backend] = model(unpadded[:, -1:], cache=cache, use_cache=True).logits
        generated[backend] = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    for backend in ("sdpa", "flex_attention"):
        assert torch.equal(generated[backend], generated["eager"])
        assert_close_on_tokens(outputs[backend], outputs["eager"], mask)
        torch.testing.assert_close(steps[backend], steps["eager"], atol=1e-5, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(steps["eager"][:, 0], model(unpadded).logits[:, -1], atol=1e-5, rtol=0)


def test_output_attentions_are_the_gated_renormalised_probabilities():
    model = tiny_model("EGA-1", num_hidden_layers=1)
    model.set_attn_implementation("eager")
    ids = padded_batch()[0][1:2, 2:]
    with torch.no_grad():
        gated = model(ids, output_attentions=True, output_gate_values=True)
        for parameter in (model.model.h[0].attn.energy_gate.alpha,):
            parameter.zero_()
        plain = model(ids, output_attentions=True).attentions[0]
    gate = gated.gate_values[0]  # (batch, heads, keys)
    expected = plain * gate[:, :, None, :]
    expected = expected / expected.sum(-1, keepdim=True)
    torch.testing.assert_close(gated.attentions[0], expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(gated.attentions[0].sum(-1), torch.ones_like(gated.attentions[0][..., 0]))


@pytest.mark.parametrize("backend", ["sdpa", pytest.param("flex_attention", marks=pytest.mark.skipif(
    INDUCTOR_ISA_FORCED, reason=INDUCTOR_SKIP_REASON))])
def test_output_attentions_under_fused_backends_warn_and_fall_back_to_eager(backend, caplog):
    from transformers.utils import logging

    logging.warning_once.cache_clear()  # an earlier test may have had the warning already
    model = tiny_model("EGA-1", energy_gate_layers=[1])  # an ungated and a gated layer
    ids, mask = padded_batch()
    model.set_attn_implementation("eager")
    with torch.no_grad():
        eager = model(ids, attention_mask=mask, output_attentions=True)
        model.set_attn_implementation(backend)
        logging.enable_propagation()
        try:
            fused = model(ids, attention_mask=mask, output_attentions=True)
        finally:
            logging.disable_propagation()
    assert "runs the eager attention instead" in caplog.text
    assert len(fused.attentions) == 2
    for got, want in zip(fused.attentions, eager.attentions):
        torch.testing.assert_close(got * mask[:, None, :, None], want * mask[:, None, :, None], atol=1e-6, rtol=1e-5)
    assert_close_on_tokens(fused.logits, eager.logits, mask, atol=1e-5)


@pytest.mark.parametrize(
    "inputs, match",
    [
        (dict(input_ids=torch.zeros(2, 0, dtype=torch.long)), r"input_ids is empty \(shape \(2, 0\)\)"),
        (dict(input_ids=torch.zeros(0, 5, dtype=torch.long)), r"input_ids is empty \(shape \(0, 5\)\)"),
        (dict(inputs_embeds=torch.zeros(2, 0, 24)), r"inputs_embeds is empty"),
        (dict(inputs_embeds=torch.zeros(2, 5, 23)), r"inputs_embeds must be \(batch, length, hidden_size = 24\), got "
                                                    r"shape \(2, 5, 23\)"),
        (dict(input_ids=torch.ones(5, dtype=torch.long)), r"input_ids must be \(batch, length\), got shape \(5,\)"),
        (dict(input_ids=torch.ones(2, 5, dtype=torch.long), attention_mask=torch.ones(5)),
         r"attention_mask must be 2D .* got shape \(5,\)"),
        (dict(input_ids=torch.ones(2, 5, dtype=torch.long), attention_mask=torch.ones(3, 5)),
         r"attention_mask has shape \(3, 5\), expected .* \(2, 5\)"),
        (dict(input_ids=torch.ones(2, 5, dtype=torch.long), attention_mask=torch.ones(2, 4)),
         r"attention_mask has shape \(2, 4\)"),
        (dict(input_ids=torch.ones(2, 5, dtype=torch.long), position_ids=torch.tensor([[0, 1, -1, 2, 3]] * 2)),
         r"position_ids must lie in \[0, max_position_embeddings = 48\), got values from -1 to 3$"),
        (dict(input_ids=torch.ones(2, 5, dtype=torch.long), position_ids=torch.tensor([[0, 1, 2, 3, 48]])),
         r"got values from 0 to 48"),
        (dict(input_ids=torch.ones(2, 5, dtype=torch.long), position_ids=torch.arange(5)),
         r"position_ids must be \(batch, length\)"),
        (dict(), r"exactly one of input_ids or inputs_embeds"),
    ],
)
def test_bad_inputs_are_refused_with_the_argument_and_shapes(inputs, match):
    model = tiny_model("EGA-1")
    with torch.no_grad(), pytest.raises(ValueError, match=match):
        model(**inputs)


def test_input_checks_read_no_values_from_a_device():
    """generate() passes position_ids at every step: their range is checked on the host only where that is free (a
    meta tensor has no values, so any read would raise here; on CUDA it would wait for the device)."""
    from hf_spectral.models.ega_gpt.modeling_ega_gpt import check_inputs

    config = tiny_config("EGA-1")
    ids = torch.ones(2, 5, dtype=torch.long, device="meta")
    mask = torch.ones(2, 9, dtype=torch.long, device="meta")
    check_inputs(config, ids, None, mask, torch.arange(4, 9, device="meta")[None], 4)
    with pytest.raises(ValueError, match="got values from 44 to 48"):  # on the CPU it reads them
        check_inputs(config, torch.ones(2, 5, dtype=torch.long), None, None, torch.arange(44, 49)[None], 4)


def test_a_sequence_longer_than_the_context_is_refused_by_its_length():
    model = tiny_model("EGA-1")  # max_position_embeddings = 48
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"reaches position 49 \(0 cached \+ 50 new positions\).* = 48"):
            model(torch.ones(1, 50, dtype=torch.long))
        out = model(torch.ones(1, 48, dtype=torch.long), use_cache=True)
        with pytest.raises(ValueError, match=r"reaches position 48 \(48 cached \+ 1 new positions\)"):
            model(torch.ones(1, 1, dtype=torch.long), cache=out.cache)
        # Positions count tokens: a left-padded row wider than the context but with 48 tokens is fine.
        ids = torch.ones(2, 50, dtype=torch.long)
        mask = torch.ones_like(ids)
        mask[:, :2] = 0
        assert model(ids, attention_mask=mask).logits.shape == (2, 50, VOCAB)


def test_generation_past_the_context_is_announced_up_front_and_named_where_it_stops():
    from transformers.testing_utils import CaptureLogger

    from hf_spectral.models.ega_gpt import modeling_ega_gpt

    model = tiny_model("EGA-1")  # max_position_embeddings = 48
    prompt = torch.ones(1, 40, dtype=torch.long)
    modeling_ega_gpt.logger.warning_once.cache_clear()
    with CaptureLogger(modeling_ega_gpt.logger) as captured:
        assert model.generate(prompt, max_new_tokens=8, do_sample=False).shape == (1, 48)  # fits: no warning
    assert captured.out == ""
    with CaptureLogger(modeling_ega_gpt.logger) as captured:
        with pytest.raises(ValueError, match=r"got values from 48 to 48 \(if from generate\(\): the prompt's tokens"):
            model.generate(prompt, max_new_tokens=10, do_sample=False)
    assert "may run to 50 positions (40 in the input" in captured.out and "at most 8 new tokens" in captured.out


def test_a_packed_sequences_mask_is_refused_not_read_as_padding():
    # Two documents in one row under a block-diagonal mask: the gates read padding from the mask's last row, which
    # would count the first document as padding.
    model = tiny_model("EGA-1")
    causal = torch.ones(8, 8, dtype=torch.bool).tril()
    packed = causal.clone()
    packed[4:, :4] = False
    with torch.no_grad(), pytest.raises(ValueError, match="must be causal plus padding"):
        model(torch.ones(1, 8, dtype=torch.long), attention_mask=packed[None, None])
    with torch.no_grad():  # a causal 4D mask is read as the padding it holds
        torch.testing.assert_close(model(torch.ones(1, 8, dtype=torch.long), attention_mask=causal[None, None]).logits,
                                   model(torch.ones(1, 8, dtype=torch.long)).logits)


def test_a_mask_must_cover_the_cached_positions_too():
    model = tiny_model("EGA-1")
    ids = padded_batch()[0]
    with torch.no_grad():
        cache = model(ids[:, :6], use_cache=True).cache
        with pytest.raises(ValueError, match=r"expected \(batch, cached \+ new\) = \(3, 7\).* after 6 cached"):
            model(ids[:, 6:7], attention_mask=torch.ones(3, 1), cache=cache, use_cache=True)


def test_gate_values_are_returned_for_each_gated_layer():
    model = tiny_model("EGA-2", num_hidden_layers=3, energy_gate_layers=[0, 2])
    ids, mask = padded_batch()
    out = model(ids, attention_mask=mask, output_gate_values=True)
    assert len(out.gate_values) == 2
    for values in out.gate_values:
        assert values.shape == (3, 3, ids.shape[1])
        assert torch.all((values > 0) & (values < 1))
    assert model(ids).gate_values is None


@pytest.mark.parametrize("variant", ["EGA-M", "EGA-M-F", "EGA-DB2", "EGA-DB4"])
def test_save_and_load_round_trip_exactly(tmp_path, variant):
    """Saved tensors, and the filters that are not saved (Daubechies taps: a build on the meta device refills them)."""
    model = tiny_model(variant)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    loaded = EGAForCausalLM.from_pretrained(tmp_path).eval()
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    for (name, a), (_, b) in zip(model.named_buffers(), loaded.named_buffers()):
        assert torch.equal(a, b), name
    ids, mask = padded_batch()
    with torch.no_grad():
        assert torch.equal(model(ids, attention_mask=mask).logits, loaded(ids, attention_mask=mask).logits)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.wte.weight.data_ptr()  # still tied


def test_loads_with_trust_remote_code_where_hf_spectral_is_not_installed(tmp_path):
    model = tiny_model("EGA-C")
    model.save_pretrained(tmp_path / "checkpoint")
    for name in ("modeling_ega_gpt.py", "configuration_ega_gpt.py", "energy_gate.py", "gated_attention.py",
                 "pooling.py"):
        assert (tmp_path / "checkpoint" / name).exists(), name
    ids, mask = padded_batch()
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
    logits, loaded_class = load_without_plugin(
        tmp_path / "checkpoint", "AutoModelForCausalLM", {"input_ids": ids, "attention_mask": mask}, tmp_path
    )
    assert loaded_class.startswith("transformers_modules.") and loaded_class.endswith("EGAForCausalLM")
    torch.testing.assert_close(logits, expected, atol=1e-6, rtol=0)


def test_gradient_checkpointing_gives_the_same_gradients():
    model = tiny_model("EGA-C").train()
    ids, mask = padded_batch()
    grads = []
    for checkpointing in (False, True):
        if checkpointing:
            model.gradient_checkpointing_enable()
        model.zero_grad()
        model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    assert any(".energy_gate." in name for name in grads[0])
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("variant", list(KINDS))
def test_every_trainable_parameter_gets_a_gradient(variant):
    """DistributedDataParallel's default (find_unused_parameters=False) fails at the second step on a parameter
    outside the graph, such as a one-scale gate's mixing logit, whose gradient is exactly 0."""
    model = tiny_model(variant).train()
    ids, mask = padded_batch()
    model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.backward()
    assert [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None] == []


def test_bfloat16_loading_and_training_step(tmp_path):
    tiny_model("EGA-1").save_pretrained(tmp_path)
    model = EGAForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert model.model.h[0].attn.energy_gate.alpha.dtype == torch.bfloat16
    ids, mask = padded_batch()
    reference = EGAForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        low = model.eval()(ids, attention_mask=mask).logits.float()
        assert_close_on_tokens(low, reference(ids, attention_mask=mask).logits, mask, atol=0.1)
    model.train()
    loss = model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
    loss.backward()
    assert torch.isfinite(loss) and model.model.h[0].attn.energy_gate.alpha.grad is not None


def test_bare_model_and_auto_classes(tmp_path):
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

    config = tiny_config("EGA-1")
    config.save_pretrained(tmp_path)
    assert type(AutoConfig.from_pretrained(tmp_path)) is EGAConfig
    assert type(AutoModel.from_config(config)) is EGAModel
    assert type(AutoModelForCausalLM.from_config(config)) is EGAForCausalLM
    assert type(AutoModelForSequenceClassification.from_config(config)) is EGAForSequenceClassification


@pytest.mark.parametrize("pooling", ["last", "mean", "learned", "rmt_optimal"])
def test_sequence_classification_pools_left_and_right_padding_alike(pooling):
    torch.manual_seed(0)
    model = EGAForSequenceClassification(tiny_config("EGA-1", num_labels=3, classifier_pooling=pooling)).eval()
    if pooling == "rmt_optimal":
        model.pooling.set_position_weights(torch.linspace(1.0, 0.1, 10))
    ids = torch.randint(1, VOCAB, (2, 10))
    left = torch.cat([torch.zeros(2, 3, dtype=torch.long), ids], 1)
    right = torch.cat([ids, torch.zeros(2, 3, dtype=torch.long)], 1)
    left_mask, right_mask = (left != 0).long(), (right != 0).long()
    with torch.no_grad():
        alone = model(ids).logits
        torch.testing.assert_close(model(left, attention_mask=left_mask).logits, alone, atol=1e-5, rtol=0)
        torch.testing.assert_close(model(right, attention_mask=right_mask).logits, alone, atol=1e-5, rtol=0)
        # Without a mask, `pad_token_id` (0 here) marks the padding for the attention and the gates as well
        torch.testing.assert_close(model(left).logits, alone, atol=1e-5, rtol=0)
        torch.testing.assert_close(model(right).logits, alone, atol=1e-5, rtol=0)
        # A causal 4D mask holds the same padding: the head pools with it (it had pooled per query row, or failed)
        for padded, mask in ((left, left_mask), (right, right_mask)):
            causal = torch.ones(13, 13, dtype=torch.bool).tril()[None, None] & mask.bool()[:, None, None, :]
            torch.testing.assert_close(model(padded, attention_mask=causal).logits, alone, atol=1e-5, rtol=0)
            torch.testing.assert_close(model(padded[:1], attention_mask=causal[:1]).logits, alone[:1], atol=1e-5,
                                       rtol=0)
    out = model(ids, labels=torch.tensor([0, 2]))
    out.loss.backward()
    assert out.logits.shape == (2, 3) and torch.isfinite(out.loss)
    with pytest.raises(ValueError, match="exactly one of input_ids or inputs_embeds"):
        model()


def test_leak_free_evaluation_equals_the_forward_for_causal_models_only():
    ids = padded_batch()[0][1:, 2:]
    causal = tiny_model("EGA-1")
    with torch.no_grad():
        torch.testing.assert_close(leak_free_logits(causal, ids), causal(ids).logits, atol=1e-5, rtol=0)
    window = tiny_model("EGA-1", energy_normalization="window")
    losses = causal_lm_losses(window, ids)
    assert abs(losses["loss"] - losses["leak_free_loss"]) > 1e-5


def test_evaluation_scores_only_pairs_of_tokens_under_left_padding():
    """A left-padded batch scores the same (token, next token) pairs as its rows alone: not the first token
    predicted from the pad position before it."""
    model = tiny_model("EGA-1")
    ids, mask = padded_batch()
    rows = [ids[row, mask[row].bool()][None] for row in range(ids.shape[0])]
    pairs = [row.shape[1] - 1 for row in rows]
    alone = sum(causal_lm_losses(model, row)["loss"] * n for row, n in zip(rows, pairs)) / sum(pairs)
    with torch.no_grad():
        batched = causal_lm_losses(model, ids, mask)
    assert batched["loss"] == pytest.approx(alone, rel=1e-5)
    assert batched["leak_free_loss"] == pytest.approx(alone, rel=1e-5)
    with pytest.raises(ValueError, match="no \\(token, next token\\) pair"):
        causal_lm_losses(model, ids[:, :1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_training_through_a_16_bit_kv_cache_gives_finite_gradients(dtype):
    """With ``use_cache=True`` the cache holds keys and values at the head size, and the gate state in float32 beside
    them, whatever the activation dtype; the backward through the cached keys stays finite."""
    model = tiny_model("EGA-1").to(dtype).train()
    ids = torch.randint(1, VOCAB, (4, 48), generator=torch.Generator().manual_seed(0))
    out = model(ids, labels=ids, use_cache=True)
    layer = out.cache.layers[0]
    assert layer.values.shape[-1] == model.config.hidden_size // model.config.num_attention_heads
    assert layer.values.dtype == dtype and layer.gate_state.dtype == layer.key_bias.dtype == torch.float32
    out.loss.backward()
    assert [n for n, p in model.named_parameters() if p.grad is not None and not p.grad.isfinite().all()] == []


@pytest.mark.parametrize("variant", ["EGA-1", "EGA-C", "EGA-M"])
def test_cached_decoding_under_bfloat16_autocast_keeps_float32_statistics(variant):
    """Under autocast the gate sees float32 LayerNorm outputs while the cached values are bfloat16: the state stays
    float32 beside them, and the decoded gates follow a float32 forward."""
    model = tiny_model(variant)
    ids = torch.randint(1, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids, output_gate_values=True).gate_values[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        gates, cache = gates_decoded_token_by_token(model, ids)
        generated = model.generate(ids[:, :8], max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert cache.layers[0].values.dtype == torch.bfloat16 and generated.shape == (2, 12)
    assert (gates - expected).abs().max() < 0.05


@pytest.mark.parametrize("prefill_under_autocast", [True, False])
@pytest.mark.parametrize("normalization", ["causal", "window"])
def test_a_cache_continues_across_an_autocast_boundary(prefill_under_autocast, normalization):
    """A cache filled under bfloat16 autocast and continued outside it (or the reverse) keeps its dtype: the new keys
    and values are cast to it; the gate state is float32 either way."""
    ids = torch.randint(1, VOCAB, (2, 20), generator=torch.Generator().manual_seed(0))
    model = tiny_model("EGA-1", energy_normalization=normalization)
    assert_cache_continues_across_an_autocast_boundary(model, ids, prefill_under_autocast, split=12)


def test_a_cache_filled_outside_the_model_is_refused_by_name():
    """PEFT prefix tuning writes virtual keys without the gates' bias and state: a clear error, not a
    failure deep in the gate; ungated layers take them."""
    from peft import PrefixTuningConfig, get_peft_model

    ids = padded_batch()[0]
    gated = get_peft_model(tiny_model("EGA-1"), PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    with pytest.raises(ValueError, match="prefix tuning"):
        gated(input_ids=ids, labels=ids)
    plain = get_peft_model(tiny_model("BASE"), PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    assert torch.isfinite(plain(input_ids=ids, labels=ids).loss)


@pytest.mark.parametrize("variant", ["EGA-1", "EGA-C"])
def test_a_float64_model_keeps_float64_gates_and_passes_gradcheck(variant):
    # The gate's arithmetic is at least float32: a float64 model (for gradcheck, numerics studies) stays float64.
    model = tiny_model(variant, hidden_size=8, num_attention_heads=2, num_hidden_layers=1).double()
    model.set_attn_implementation("eager")
    embeddings = torch.randn(1, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0),
                             requires_grad=True)
    assert model(inputs_embeds=embeddings, output_gate_values=True).gate_values[0].dtype == torch.float64
    assert torch.autograd.gradcheck(lambda e: model(inputs_embeds=e).logits, (embeddings,), eps=1e-6, atol=1e-5)


def test_a_model_too_large_for_the_memory_is_refused_naming_the_field_before_allocating():
    config = tiny_config(vocab_size=10**12)  # a config is only numbers (it may be meant for a larger machine)
    with pytest.raises(ValueError, match="^EGAConfig: the parameters of this model need at least .* of "
                       "torch.float32 on cpu, which has .*; vocab_size × hidden_size alone takes .*: lower vocab_size "
                       "or hidden_size$"):
        EGAForCausalLM(config)
    assert EGAForCausalLM(tiny_config()).model.wte.weight.shape == (VOCAB, 24)


def test_loading_builds_on_the_meta_device_where_no_size_is_checked(tmp_path, monkeypatch):
    from hf_spectral.ops import validation

    model = tiny_model()
    model.save_pretrained(tmp_path)
    monkeypatch.setattr(validation, "available_memory", lambda device: 1000)  # less than this model needs
    with pytest.raises(ValueError, match="which has 1,000 bytes"):
        EGAForCausalLM(tiny_config())
    loaded = EGAForCausalLM.from_pretrained(tmp_path)
    assert model.state_dict().keys() == loaded.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
