"""The new positions' columns after a cache whose length is an int (DynamicCache) or a tensor (StaticCache)."""

import copy

import pytest
import torch

from hf_spectral.ops.positions import host_length, new_positions, padding_of_causal_mask


def test_new_positions_are_the_same_columns_for_an_int_and_a_tensor_length():
    counts = torch.arange(14).view(2, 7)
    for past in range(0, 5):
        expected = counts[:, past : past + 3]
        assert torch.equal(new_positions(counts, past, 3), expected)
        assert torch.equal(new_positions(counts, torch.tensor(past), 3), expected)


def test_a_tensor_length_traces_without_a_graph_break():
    explanation = torch._dynamo.explain(new_positions)(torch.arange(14).view(2, 7), torch.tensor(2), 3)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


def test_a_length_is_read_on_the_host_only_where_that_is_free():
    assert host_length(3) == 3 and host_length(torch.tensor(4)) == 4  # an int; a CPU tensor in eager mode
    lengths = []

    @torch.compile(backend="eager", fullgraph=True)
    def inside_a_graph(length):
        lengths.append(host_length(length))
        return length + 1

    inside_a_graph(torch.tensor(4))
    assert lengths == [None]


def test_the_padding_of_a_causal_4d_mask_is_its_last_row_and_other_masks_are_refused():
    tokens = torch.tensor([[False, True, True, True, True], [True, True, True, True, True]])
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    mask = causal[None, None] & tokens[:, None, None, :]
    assert torch.equal(padding_of_causal_mask(mask, 5), tokens)
    additive = torch.where(mask, 0.0, torch.finfo(torch.float32).min)
    assert torch.equal(padding_of_causal_mask(additive), tokens)
    # after a past of 3 positions, 2 new queries; a StaticCache's wider mask (False after the new positions)
    assert torch.equal(padding_of_causal_mask(mask[:, :, 3:], 5), tokens)
    wide = torch.nn.functional.pad(mask[:, :, 3:], (0, 4))
    assert torch.equal(padding_of_causal_mask(wide), torch.nn.functional.pad(tokens, (0, 4)))
    # two packed documents (block-diagonal) and a sliding window read as padding would be wrong: refused
    packed = mask.clone()
    packed[:, :, 2:, :2] = False
    window = mask & torch.ones(5, 5, dtype=torch.bool).triu(-1)
    for other in (packed, window):
        with pytest.raises(ValueError, match="must be causal plus padding"):
            padding_of_causal_mask(other, 5)
    with pytest.raises(ValueError, match="covers 5 keys, but the call sees 7"):
        padding_of_causal_mask(mask, 7)


def _compiled_static_generation(model, input_ids, attention_mask, new_tokens):
    """The graphs a fullgraph-compiled ``model.forward`` builds during ``generate`` with a StaticCache (dynamo's
    ``eager`` backend: tracing only), and the tokens generated."""
    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend=counting_backend, fullgraph=True)
    try:
        with torch.no_grad():
            tokens = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=new_tokens,
                                    min_new_tokens=new_tokens, do_sample=False, cache_implementation="static")
    finally:
        del model.forward
    return len(graphs), tokens


def test_compiled_static_cache_generation_builds_no_more_graphs_than_the_stock_models():
    """A growing 2D mask makes dynamo compile a third graph at the step that fills the cache (transformers pads a
    shorter mask to the cache's width: a branch on its length); generate() hands the stock models a 4D mask of the
    cache's width and our models the 2D one padded to it (`keep_padding_mask_for_generate`): the prefill's graph and
    one decoding graph for all steps, as for stock GPT-2 and Llama of the same shape. The tokens are the eager ones."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from hf_spectral import ChiarConfig, ChiarForCausalLM, EGAConfig, EGAForCausalLM
    from hf_spectral.retrofit import EnergyGateConfig, add_energy_gates

    size = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=50, max_position_embeddings=32)
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=50, n_positions=32)).eval()
    llama = LlamaForCausalLM(LlamaConfig(**size, intermediate_size=64, num_key_value_heads=2)).eval()
    models = {
        "EGA-GPT": EGAForCausalLM(EGAConfig(**size)).eval(),
        "CHIAR-Former": ChiarForCausalLM(ChiarConfig(**size, layer_operators=["attention", "routed"],
                                                     routed_operators=["dct", "rbf", "attention"])).eval(),
        "retrofitted GPT-2": add_energy_gates(copy.deepcopy(gpt2), EnergyGateConfig(alpha_init=1.5)),
        "retrofitted Llama": add_energy_gates(copy.deepcopy(llama), EnergyGateConfig(alpha_init=1.5)),
    }
    input_ids = torch.randint(3, 50, (2, 6), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :2] = 0  # left padding
    stock_counts = {name: _compiled_static_generation(model, input_ids, attention_mask, 5)[0]
                    for name, model in (("GPT-2", gpt2), ("Llama", llama))}
    assert set(stock_counts.values()) == {2}, stock_counts  # the prefill and one decoding step
    for name, model in models.items():
        with torch.no_grad():
            eager = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=5, min_new_tokens=5,
                                   do_sample=False, cache_implementation="static")
        count, tokens = _compiled_static_generation(model, input_ids, attention_mask, 5)
        assert count <= 2, f"{name}: {count} graphs"
        assert torch.equal(tokens, eager), name


def test_the_padding_mask_for_generate_is_padded_to_a_static_caches_width_only():
    from transformers import DynamicCache, LlamaConfig, StaticCache

    from hf_spectral.ops.positions import fixed_cache_width, keep_padding_mask_for_generate, mask_width_is_valid

    config = LlamaConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, vocab_size=10)
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    static = StaticCache(config=config, max_cache_len=8)
    assert fixed_cache_width(static) == 8 and fixed_cache_width(DynamicCache()) is None
    padded = keep_padding_mask_for_generate(attention_mask=mask, cache=static)
    assert padded.shape == (2, 8) and torch.equal(padded[:, :3], mask) and not padded[:, 3:].any()
    assert keep_padding_mask_for_generate(attention_mask=mask, cache=DynamicCache()) is mask
    assert mask_width_is_valid(8, 3, 1, static) and mask_width_is_valid(4, 3, 1, static)
    assert not mask_width_is_valid(6, 3, 1, static) and not mask_width_is_valid(8, 3, 1, DynamicCache())
