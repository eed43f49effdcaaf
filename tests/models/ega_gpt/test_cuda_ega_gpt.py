"""EGA-GPT and the retrofit on CUDA: backends agree, cached generation equals the forward, bfloat16 statistics stay
float32, and the gated SDPA call runs in a fused kernel (flash or memory-efficient), never the math fallback."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from hf_spectral import EGAForCausalLM
from tests.helpers import gates_decoded_token_by_token
from tests.models.ega_gpt.test_modeling_ega_gpt import VOCAB, padded_batch, tiny_config, tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

FUSED = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def cuda_model(variant="EGA-1", dtype=torch.float32, seed=0, **overrides):
    """Head size 16 (48 channels, 3 heads): a folded head of 17 channels, padded to 24 for the fused kernels."""
    model = tiny_model(variant, seed, hidden_size=48, num_attention_heads=3, max_position_embeddings=1024, **overrides)
    return model.to(device="cuda", dtype=dtype)


def test_backends_agree_on_cuda():
    ids, mask = (t.cuda() for t in padded_batch())
    model = cuda_model("EGA-M", energy_scales=[3, 7])
    outputs = {}
    for backend in ("eager", "sdpa", "flex_attention"):
        model.set_attn_implementation(backend)
        with torch.no_grad():
            outputs[backend] = model(ids, attention_mask=mask).logits
    for backend in ("sdpa", "flex_attention"):
        torch.testing.assert_close(outputs[backend] * mask[..., None], outputs["eager"] * mask[..., None],
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ["sdpa", "flex_attention"])
@pytest.mark.parametrize("variant", ["EGA-1", "EGA-C"])
def test_cached_generation_equals_the_forward_on_cuda(variant, backend):
    model = cuda_model(variant, **({"energy_scales": [3, 5]} if variant == "EGA-C" else {}))
    model.set_attn_implementation(backend)
    ids, mask = (t.cuda() for t in padded_batch())
    for cache_implementation in ("dynamic", "static"):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, cache_implementation=cache_implementation)
        full_mask = torch.cat([mask, torch.ones(3, 4, dtype=mask.dtype, device="cuda")], 1)
        with torch.no_grad():
            full = model(out.sequences, attention_mask=full_mask).logits
        for step, logits in enumerate(out.logits):
            torch.testing.assert_close(logits, full[:, ids.shape[1] - 1 + step], atol=1e-4, rtol=1e-4)


def test_bfloat16_statistics_stay_within_0_02_of_float32_on_cuda():
    """1,024 tokens one at a time through a bfloat16 cache: every gate within 0.02 of a float32 forward."""
    reference = cuda_model("EGA-1", num_hidden_layers=1)
    with torch.no_grad():
        for name, parameter in reference.named_parameters():
            if ".ln_" in name:
                parameter.normal_(0.5 if name.endswith("weight") else 0.0, 0.5)
    low = cuda_model("EGA-1", num_hidden_layers=1)
    low.load_state_dict(reference.state_dict())
    low.to(torch.bfloat16)
    reference.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in reference.state_dict().items()})
    ids = torch.randint(1, VOCAB, (2, 1024), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        expected = reference(ids, output_gate_values=True).gate_values[0]
    gates, _ = gates_decoded_token_by_token(low, ids)
    assert (gates - expected).abs().max() < 0.02


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gated_sdpa_runs_in_a_fused_kernel(dtype):
    """With only the flash and memory-efficient kernels allowed, SDPA raises if the folded shapes (a padded batch, an
    unpadded one, a prefill, a training step) or a decoding step's bias mask would need the math fallback."""
    model = cuda_model("EGA-1", dtype=dtype)
    model.set_attn_implementation("sdpa")
    ids, mask = (t.cuda() for t in padded_batch())
    with sdpa_kernel(FUSED):
        with torch.no_grad():
            model(ids, attention_mask=mask)
            out = model(ids[:, 5:], use_cache=True)
            assert out.cache.layers[0].keys.shape[-1] == model.config.hidden_size // model.config.num_attention_heads
            model(ids[:, -1:], cache=out.cache, use_cache=True)
            model.generate(ids[:, 5:], max_new_tokens=3, do_sample=False)
        model.train()
        model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.backward()


def test_retrofitted_gpt2_gated_sdpa_runs_in_a_fused_kernel(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_spectral.retrofit import EnergyGateConfig, add_energy_gates

    torch.manual_seed(0)
    config = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64, attn_implementation="sdpa")
    model = GPT2LMHeadModel(config).to(device="cuda", dtype=torch.bfloat16).eval()
    add_energy_gates(model, EnergyGateConfig(alpha_init=0.5))
    ids, mask = (t.cuda() for t in padded_batch())
    with sdpa_kernel(FUSED), torch.no_grad():
        model(ids, attention_mask=mask)
        out = model(ids[:, 5:], use_cache=True)
        model(ids[:, -1:], cache=out.cache, use_cache=True)
        model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    model.float()  # the fused kernel computes what the math kernel does (float32: the memory-efficient kernel)
    with torch.no_grad():
        with sdpa_kernel(FUSED):
            fused = model(ids, attention_mask=mask).logits
        with sdpa_kernel([SDPBackend.MATH]):
            reference = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(fused * mask[..., None], reference * mask[..., None], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", ["EGA-1", "EGA-C"])
def test_a_static_cache_decoding_step_of_a_gated_layer_never_synchronises_on_cuda(variant):
    """A gated attention layer's decoding step with a StaticCache: the gates gather their state at the cache's
    on-device length; no host read, which ``set_sync_debug_mode("error")`` turns into an error."""
    from transformers import StaticCache

    model = cuda_model(variant, **({"energy_scales": [3, 5]} if variant == "EGA-C" else {})).eval()
    model.set_attn_implementation("sdpa")
    attention = model.model.h[0].attn
    ids, mask = (t.cuda() for t in padded_batch())
    cache = StaticCache(config=model.config, max_cache_len=32)
    hidden = torch.randn(3, ids.shape[1] + 1, model.config.hidden_size, device="cuda")
    token_mask = torch.nn.functional.pad(mask.bool(), (0, 32 - ids.shape[1]), value=False)
    token_mask[:, ids.shape[1]] = True
    keys = torch.arange(32, device="cuda")
    prefill = (keys[None, :] <= torch.arange(ids.shape[1], device="cuda")[:, None]) & token_mask[:, None]
    step = (keys <= ids.shape[1]) & token_mask
    with torch.no_grad():
        attention(hidden[:, :-1], attention_mask=prefill[:, None], token_mask=token_mask, cache=cache)
        full = prefill[:, :, : ids.shape[1] + 1]
        full = torch.cat([full, step[:, None, : ids.shape[1] + 1]], 1)[:, None]  # the prompt's rows, then the step's
        expected, _ = attention(hidden, attention_mask=full, token_mask=token_mask[:, : ids.shape[1] + 1])
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            output, _ = attention(
                hidden[:, -1:], attention_mask=step[:, None, None], token_mask=token_mask, cache=cache
            )
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(output[:, 0], expected[:, -1], atol=1e-4, rtol=1e-4)


def test_a_model_larger_than_the_gpus_free_memory_is_refused_there_before_allocating():
    free, _ = torch.cuda.mem_get_info()
    too_large = tiny_config(vocab_size=2 * free // (24 * 4))  # its embedding alone takes twice the free memory
    allocated = torch.cuda.memory_allocated()
    with torch.device("cuda"), pytest.raises(ValueError, match="of torch.float32 on cuda.*vocab_size × hidden_size"):
        EGAForCausalLM(too_large)
    assert torch.cuda.memory_allocated() == allocated
    with torch.device("cuda"):
        assert EGAForCausalLM(tiny_config()).lm_head.weight.is_cuda
