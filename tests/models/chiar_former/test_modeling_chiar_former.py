"""CHIAR-Former models: routing, sparse execution, causality, cache, generation, heads, save/load, FLOP counter."""

import math
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, DynamicCache

import hf_spectral.ops
from hf_spectral import ChiarConfig, ChiarForCausalLM, ChiarForSequenceClassification, ChiarModel
from hf_spectral.models.chiar_former import calibrate_thresholds, count_flops, modeling_chiar_former
from hf_spectral.ops.routing import threshold_routes

from ...helpers import INDUCTOR_ISA_FORCED, INDUCTOR_SKIP_REASON, assert_causal, load_without_plugin, perturb_after
from .chiar_testing import CAUSAL_VARIANTS, PAD, VOCAB, build, random_ids, tiny_config

ROUTED_SPARSE_VARIANTS = ["threshold-2", "threshold-3", "hard-2", "hard-3", "pre-ln-threshold-3", "fft-dct"]


def _left_padded(ids: torch.Tensor, pads: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad row b with pads[b] pad tokens (the rows keep their length: the first tokens are replaced)."""
    padded, mask = ids.clone(), torch.ones_like(ids)
    for row, count in enumerate(pads):
        padded[row, :count], mask[row, :count] = PAD, 0
    return padded, mask


def _dense_twin(model, model_class=ChiarForCausalLM):
    """The same weights and thresholds executed in the authors' dense one-hot-select formulation."""
    twin = model_class(ChiarConfig(**{**model.config.to_dict(), "routed_execution": "dense"})).eval()
    twin.load_state_dict(model.state_dict())
    return twin


# --- sparse execution ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ROUTED_SPARSE_VARIANTS)
def test_sparse_execution_equals_the_dense_one_hot_formulation(variant):
    ids = random_ids(3, 20, seed=1)
    padded, mask = _left_padded(ids, [0, 5, 2])
    sparse = build(ChiarForCausalLM, tiny_config(**CAUSAL_VARIANTS[variant]), calibrate_on=ids)
    dense = _dense_twin(sparse)
    assert sparse.model.layers[1].dense_routing is False and dense.model.layers[1].dense_routing is True

    out_sparse = sparse(padded, attention_mask=mask, labels=padded, output_routing=True)
    out_dense = dense(padded, attention_mask=mask, labels=padded, output_routing=True)
    for routes in out_sparse.routing_decisions:  # every operator is exercised
        assert len(torch.unique(routes[mask.bool()])) == len(sparse.config.routed_operators)
    for a, b in zip(out_sparse.routing_decisions, out_dense.routing_decisions):
        assert torch.equal(a, b)
    valid = mask.bool()
    torch.testing.assert_close(out_sparse.logits[valid], out_dense.logits[valid], atol=1e-5, rtol=1e-5)

    out_sparse.loss.backward()
    out_dense.loss.backward()
    dense_grads = dict(dense.named_parameters())
    for name, param in sparse.named_parameters():
        other = dense_grads[name].grad
        if param.grad is None:
            assert other is None or not other.any(), name
            continue
        torch.testing.assert_close(param.grad, other, atol=1e-5, rtol=1e-4, msg=name)


def test_tokens_routed_elsewhere_are_not_attention_queries():
    ids = random_ids(2, 24, seed=2)
    model = build(ChiarForCausalLM, tiny_config(), calibrate_on=ids, percentiles=(75.0,))
    attention = model.model.layers[1].attention
    projected = {}
    hooks = [
        getattr(attention, name).register_forward_hook(
            lambda module, args, output, name=name: projected.__setitem__(name, args[0].shape[:-1].numel())
        )
        for name in ("q_proj", "kv_proj", "o_proj")
    ]
    out = model(ids, output_routing=True)
    for hook in hooks:
        hook.remove()
    routed = out.routing_decisions[0] == 1
    assert 0 < int(routed.sum()) < ids.numel() // 2  # ≈ 25% routed to attention
    # Queries and outputs only for the gathered layout of the routed tokens (in eager mode on CPU: each row padded to
    # the batch's largest count); keys and values for every token.
    gathered = ids.shape[0] * int(routed.sum(1).max())
    assert gathered < ids.numel() // 2
    assert projected == {"q_proj": gathered, "o_proj": gathered, "kv_proj": ids.numel()}


# --- routing ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("routed_operators", [["dct", "attention"], ["dct", "rbf", "attention"]])
def test_routing_fractions_match_the_thresholds(routed_operators):
    ids = random_ids(4, 16, seed=3)
    padded, mask = _left_padded(ids, [0, 3, 0, 7])
    model = build(ChiarForCausalLM, tiny_config(routed_operators=routed_operators), calibrate_on=ids)
    out = model(padded, attention_mask=mask, output_routing=True)
    valid = mask.bool()
    for layer_idx, routes, entropy, fractions in zip(
        model.config.routed_layers, out.routing_decisions, out.routing_entropies, out.routing_fractions
    ):
        thresholds = model.config.thresholds_for(layer_idx)
        expected = threshold_routes(entropy, thresholds)
        assert torch.equal(routes[valid], expected[valid])
        assert (routes[~valid] == 0).all()  # padding takes the cheapest operator
        counts = torch.stack([(expected[valid] == k).sum() for k in range(len(routed_operators))])
        torch.testing.assert_close(fractions, counts.float() / valid.sum())
        assert ((entropy >= 0) & (entropy <= 1)).all()


def test_per_layer_calibration_hits_the_percentile_in_every_routed_layer():
    ids = random_ids(4, 32, seed=4)
    model = build(ChiarForCausalLM, tiny_config(num_hidden_layers=5), calibrate_on=None)
    result = calibrate_thresholds(model, [ids[:2], ids[2:]], percentiles=(75.0,), per_layer=True)
    assert sorted(result["thresholds"]) == model.config.routed_layers == [1, 2, 3]
    for fractions in model(ids, output_routing=True).routing_fractions:
        assert fractions[1].item() == pytest.approx(0.25, abs=1.5 / ids.numel())


def test_calibration_measures_the_tokens_and_not_the_padding():
    """Left padding changes neither a causal model's entropies at the tokens nor, therefore, the thresholds."""
    from hf_spectral.models.chiar_former.calibration import measure_entropies

    ids = random_ids(2, 16, seed=4)
    padded, mask = _left_padded(ids, [6, 0])
    model = build(ChiarForCausalLM, tiny_config(num_hidden_layers=3))
    plain = measure_entropies(model, [ids[:1, 6:], ids[1:]])
    batch = measure_entropies(model, [{"input_ids": padded, "attention_mask": mask}])
    for alone, together in zip(plain, batch):
        assert together.numel() == alone.numel() == 10 + 16
        torch.testing.assert_close(together.sort().values, alone.sort().values, atol=1e-5, rtol=0)


def test_shared_calibration_hits_the_pooled_percentile_whatever_the_thresholds_before():
    """The entropies of the routed layers after the first depend on the thresholds being set: the shared calibration
    repeats its pass until the thresholds reproduce themselves (one pass had left the pooled share at the
    thresholds before, 70% instead of 75% below τ_mid here, and a second calibration moved τ_mid again)."""
    ids = random_ids(4, 32, seed=4)
    model = build(ChiarForCausalLM, tiny_config(num_hidden_layers=5), calibrate_on=None)
    batches = [ids[:2], ids[2:]]
    result = calibrate_thresholds(model, batches, percentiles=(75.0,))
    assert 1 < result["passes"] < 10
    pooled = torch.cat([entropy.flatten() for entropy in model(ids, output_routing=True).routing_entropies])
    assert (pooled <= model.config.tau_mid).float().mean().item() == pytest.approx(0.75, abs=1.5 / pooled.numel())
    tau_mid = model.config.tau_mid
    assert calibrate_thresholds(model, batches, percentiles=(75.0,))["passes"] == 1  # already a fixed point
    assert model.config.tau_mid == tau_mid
    model.config.tau_mid = 0.99  # from other thresholds, the same fixed point
    calibrate_thresholds(model, (batch for batch in batches), percentiles=(75.0,))  # a generator: read once
    assert model.config.tau_mid == tau_mid


def _calibrate_in_process(rank: int, init_file: str, results: str):
    """One of two gloo processes: the same model, each process its own batches (rank 1 none in the last call)."""
    import json

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        ids = random_ids(4, 32, seed=4 + rank)
        model = build(ChiarForCausalLM, tiny_config(num_hidden_layers=5), calibrate_on=None)
        pooled = dict(percentiles=(75.0,), across_processes=True)
        found = {
            "shared": calibrate_thresholds(model, [ids[:2], ids[2:]], **pooled)["thresholds"],
            "per_layer": calibrate_thresholds(model, [ids[:2], ids[2:]], per_layer=True, **pooled)["thresholds"],
        }
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            found["local"] = calibrate_thresholds(model, [ids], percentiles=(75.0,))["thresholds"]
            calibrate_thresholds(model, [ids], percentiles=(75.0,), across_processes=False)  # meant: no warning
        found["warnings"] = [str(warning.message) for warning in caught]
        found["rank_0_only"] = calibrate_thresholds(model, [ids] if rank == 0 else [], **pooled)["thresholds"]
    finally:
        torch.distributed.destroy_process_group()
    Path(results, f"rank{rank}.json").write_text(json.dumps(found))


def test_calibration_in_a_data_parallel_run_pools_the_entropies_of_every_process(tmp_path):
    """With across_processes=True, processes that each calibrate on their own shard set one threshold set, the one
    a single process sets on the batches of all of them (shared and per layer); a process without batches takes
    part. Unset, each process keeps its own, with a warning (pooling by default would leave a call made on one
    process waiting for the others); across_processes=False keeps its own silently."""
    import json

    torch.multiprocessing.spawn(_calibrate_in_process, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2)
    found = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert found[0]["shared"] == found[1]["shared"] and found[0]["per_layer"] == found[1]["per_layer"]
    assert found[0]["rank_0_only"] == found[1]["rank_0_only"]
    assert found[0]["local"] != found[1]["local"]
    for rank in (0, 1):
        assert sum("calibrates on its own data" in message for message in found[rank]["warnings"]) == 1

    ids = [random_ids(4, 32, seed=4 + rank) for rank in (0, 1)]
    model = build(ChiarForCausalLM, tiny_config(num_hidden_layers=5), calibrate_on=None)
    alone = {
        "shared": calibrate_thresholds(model, [ids[0][:2], ids[0][2:], ids[1][:2], ids[1][2:]], percentiles=(75.0,)),
        "per_layer": calibrate_thresholds(
            model, [ids[0][:2], ids[0][2:], ids[1][:2], ids[1][2:]], percentiles=(75.0,), per_layer=True),
        "local": calibrate_thresholds(model, [ids[0]], percentiles=(75.0,)),  # rank 0's: where the next one starts
        "rank_0_only": calibrate_thresholds(model, [ids[0]], percentiles=(75.0,)),
    }
    for name, result in alone.items():
        expected = {str(layer): taus for layer, taus in result["thresholds"].items()}
        # Another process, another thread count: entropies may differ in the last bits, thresholds (middles of the
        # gaps between them) by as much.
        torch.testing.assert_close(found[0][name], expected, rtol=0, atol=1e-6)


def test_shared_calibration_reads_the_same_batches_in_every_pass_and_warns_without_a_fixed_point(monkeypatch):
    import warnings

    from torch.utils.data import DataLoader

    from hf_spectral.models.chiar_former import calibration

    ids = random_ids(8, 32, seed=4)
    model = build(ChiarForCausalLM, tiny_config(num_hidden_layers=5), calibrate_on=None)
    shuffled = DataLoader(ids, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a shuffled sample per pass would chase the thresholds to the last pass
        result = calibrate_thresholds(model, shuffled, percentiles=(75.0,), max_batches=2)
    assert result["passes"] < calibration.MAX_SHARED_PASSES
    monkeypatch.setattr(calibration, "MAX_SHARED_PASSES", 1)
    model.config.tau_mid = 0.99
    with pytest.warns(UserWarning, match="reached no fixed point in 1 passes"):
        calibrate_thresholds(model, [ids], percentiles=(75.0,))


@pytest.mark.parametrize("per_layer", [False, True])
def test_calibrated_thresholds_never_sit_on_a_measured_entropy(per_layer):
    # Few token ids, many repeats: in the first routed layer a token's entropy depends on its id alone, so the
    # percentiles fall on tied values. A threshold equal to an entropy would route that token by its last bit,
    # which a compiled graph or a GPU can flip; it is set in the gap next to it instead.
    ids = torch.randint(2, 7, (4, 32), generator=torch.Generator().manual_seed(3))
    model = build(ChiarForCausalLM, tiny_config(num_hidden_layers=4, routed_operators=["dct", "rbf", "attention"]))
    calibrate_thresholds(model, [ids], percentiles=(33.0, 67.0), per_layer=per_layer)
    entropies = model(ids, output_routing=True).routing_entropies
    for layer, measured in zip(model.config.routed_layers, entropies):
        thresholds = torch.tensor(model.config.thresholds_for(layer), dtype=measured.dtype)
        gaps = (measured.flatten()[:, None] - thresholds[None, :]).abs()
        assert gaps.min() > 0, (layer, thresholds)
    first = entropies[0].flatten()
    assert len(torch.unique(first)) <= 5  # the ties the test is about


@pytest.mark.parametrize("per_layer", [False, True])
@pytest.mark.parametrize("percentiles", [(75.0,), (100.0,), (0.0,)])
def test_calibrated_thresholds_stay_in_the_unit_interval(per_layer, percentiles, tmp_path):
    # One repeated token: every first-layer entropy is the same value, with no gap on either side of it. The
    # threshold once went half a unit past it (1.3), routed everything to DCT and made save_pretrained fail.
    ids = torch.full((2, 16), 5)
    model = build(ChiarForCausalLM, tiny_config())
    result = calibrate_thresholds(model, [ids], percentiles=percentiles, per_layer=per_layer)
    thresholds = [t for values in result["thresholds"].values() for t in values]
    assert all(0 <= t <= 1 for t in thresholds), thresholds
    measured = model(ids, output_routing=True).routing_entropies[0]
    assert (measured - thresholds[0]).abs().min() > 0, "not on the measured value"
    model.save_pretrained(tmp_path)


@pytest.mark.parametrize("values, percentile", [([0.0] * 6 + [0.5, 0.6], 10.0), ([0.4, 0.6, 1.0, 1.0], 100.0)])
def test_a_threshold_next_to_an_entropy_of_0_or_1_takes_the_gap_on_its_other_side(values, percentile):
    # A state with one DCT coefficient has H = 0 exactly, a flat spectrum H = 1: the outer gap there has no width.
    from hf_spectral.models.chiar_former.calibration import _percentiles

    (threshold,) = _percentiles(torch.tensor(values, dtype=torch.float64), [percentile])
    assert 0 < threshold < 1 and threshold not in values


def test_calibration_on_batches_without_tokens_is_a_clear_error():
    model = build(ChiarForCausalLM, tiny_config())
    before = model.config.tau_mid
    batch = {"input_ids": random_ids(2, 8), "attention_mask": torch.zeros(2, 8, dtype=torch.long)}
    with pytest.raises(ValueError, match="hold no token: every attention_mask entry is 0"):
        calibrate_thresholds(model, [batch])
    assert model.config.tau_mid == before


def test_bfloat16_routing_reads_a_float32_entropy():
    # bfloat16 values near the authors' thresholds lie 0.004 apart: a 16-bit entropy would move tokens across them.
    model = build(ChiarForCausalLM, tiny_config(routed_operators=["dct", "rbf", "attention"])).to(torch.bfloat16)
    entropies = model(random_ids(2, 16, seed=9), output_routing=True).routing_entropies
    assert all(entropy.dtype == torch.float32 for entropy in entropies)
    assert len(torch.unique(torch.cat([e.flatten() for e in entropies]))) > len(
        torch.unique(torch.cat([e.flatten() for e in entropies]).bfloat16()))


def test_shared_calibration_sets_tau_lo_and_tau_hi_to_pooled_percentiles():
    ids = random_ids(4, 32, seed=5)
    model = build(ChiarForCausalLM, tiny_config(routed_operators=["dct", "rbf", "attention"]))
    entropies = torch.cat([e.flatten() for e in model(ids, output_routing=True).routing_entropies])
    first_layer = model(ids, output_routing=True).routing_entropies[0].flatten()
    calibrate_thresholds(model, [ids], percentiles=(33.0, 67.0))
    # Layer 2 (the first routed one) is unaffected by the new thresholds, so its entropies are the measured ones.
    assert model.config.layer_thresholds is None
    assert model.config.tau_lo == pytest.approx(torch.quantile(entropies.double(), 0.33).item(), abs=2e-3)
    assert model.config.tau_hi == pytest.approx(torch.quantile(entropies.double(), 0.67).item(), abs=2e-3)
    assert model.config.tau_lo < model.config.tau_hi
    torch.testing.assert_close(model(ids, output_routing=True).routing_entropies[0].flatten(), first_layer)


def test_calibration_rejects_learned_routers_and_bad_percentiles():
    ids = random_ids(1, 8)
    with pytest.raises(ValueError, match="threshold"):
        calibrate_thresholds(build(ChiarForCausalLM, tiny_config(router_type="hard")), [ids])
    with pytest.raises(ValueError, match="percentiles"):
        calibrate_thresholds(build(ChiarForCausalLM, tiny_config()), [ids], percentiles=(33.0, 67.0))



@pytest.mark.parametrize("percentiles", [75, 75.0, "75", ["75"], [True], [float("nan")], [101.0], (25.0, 75.0)])
def test_calibration_refuses_percentiles_that_are_not_a_sequence_of_numbers_in_range(percentiles):
    # A bare number or a string once failed with a raw TypeError from `tuple()` or a comparison.
    model = build(ChiarForCausalLM, tiny_config())
    with pytest.raises(ValueError, match="`percentiles` must be a sequence of 1 real number"):
        calibrate_thresholds(model, [random_ids(1, 8)], percentiles=percentiles)
    assert model.config.layer_thresholds is None and model.config.tau_mid == tiny_config().tau_mid


def test_per_layer_calibration_reads_a_generator_once_for_every_layer():
    # Every routed layer needs its own pass; a generator is exhausted after the first one and once made the second
    # layer's pass fail with "the dataloader yielded no batches", the first layer already recalibrated.
    ids = random_ids(4, 32, seed=4)
    from_list = build(ChiarForCausalLM, tiny_config())
    from_generator = build(ChiarForCausalLM, tiny_config())
    expected = calibrate_thresholds(from_list, [ids[:2], ids[2:]], per_layer=True)
    result = calibrate_thresholds(from_generator, (batch for batch in (ids[:2], ids[2:])), per_layer=True)
    assert result == expected and from_generator.config.layer_thresholds == from_list.config.layer_thresholds
    # With max_batches, only that many batches are read from the generator (the pass of each layer sees the same).
    limited = build(ChiarForCausalLM, tiny_config())
    calibrate_thresholds(limited, (batch for batch in (ids[:2], ids[2:])), per_layer=True, max_batches=1)
    calibrate_thresholds(from_list, [ids[:2]], per_layer=True)
    assert limited.config.layer_thresholds == from_list.config.layer_thresholds


class _FailingOnPass:
    """A re-iterable dataloader whose pass number ``failing_pass`` (1-based) raises after one batch."""

    def __init__(self, batch: torch.Tensor, failing_pass: int):
        self.batch, self.failing_pass, self.passes = batch, failing_pass, 0

    def __iter__(self):
        self.passes += 1
        yield self.batch
        if self.passes == self.failing_pass:
            raise RuntimeError("the data source failed")


@pytest.mark.parametrize("per_layer", [True, False])
def test_failed_calibration_restores_the_thresholds(per_layer):
    # Per layer, the first routed layer is calibrated before the second layer's pass fails: the config must not be
    # left half-calibrated (the shared calibration fails in its only pass, before setting anything).
    model = build(ChiarForCausalLM, tiny_config(routed_operators=["dct", "rbf", "attention"]))
    model.config.layer_thresholds = [None, [0.1, 0.2], None, None]
    before = {name: getattr(model.config, name) for name in ("layer_thresholds", "tau_lo", "tau_mid", "tau_hi")}
    with pytest.raises(RuntimeError, match="the data source failed"):
        calibrate_thresholds(model, _FailingOnPass(random_ids(2, 16), 2 if per_layer else 1), per_layer=per_layer)
    assert {name: getattr(model.config, name) for name in before} == before

def test_straight_through_estimator_passes_gradients_to_the_router():
    ids = random_ids(2, 16, seed=6)
    model = build(ChiarForCausalLM, tiny_config(router_type="hard", routed_operators=["dct", "rbf", "attention"]))
    model.train()
    out = model(ids, labels=ids, output_routing=True)
    for probabilities, routes in zip(out.router_probabilities, out.routing_decisions):
        assert torch.equal(probabilities.argmax(-1), routes)  # hard: one operator per token
    out.loss.backward()
    for layer_idx in model.config.routed_layers:
        grad = model.model.layers[layer_idx].router.proj.weight.grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
    # Threshold routing has nothing to learn.
    assert build(ChiarForCausalLM, tiny_config()).model.layers[1].router.proj is None


def test_usage_entropy_regulariser_is_added_to_the_loss():
    ids = random_ids(2, 16, seed=7)
    config = tiny_config(router_type="hard", routed_operators=["dct", "rbf", "attention"])
    plain = build(ChiarForCausalLM, config)
    with torch.no_grad():  # sharpen the routers so that usage is far from uniform and the penalty is not tiny
        for layer_idx in config.routed_layers:
            plain.model.layers[layer_idx].router.proj.weight.mul_(40.0)
    regularised = ChiarForCausalLM(ChiarConfig(**{**config.to_dict(), "router_usage_entropy_weight": 0.01})).eval()
    regularised.load_state_dict(plain.state_dict())
    out_plain = plain(ids, labels=ids, output_routing=True)
    out = regularised(ids, labels=ids, output_routing=True)
    assert out_plain.aux_loss is None
    expected = 0.0
    for probabilities in out.router_probabilities:
        usage = probabilities.double().reshape(-1, 3).mean(0)
        expected += math.log(3) + (usage * usage.log()).sum().item()
    assert expected > 0.05
    assert out.aux_loss.item() == pytest.approx(0.01 * expected, rel=1e-4)
    assert out.loss.item() == pytest.approx(out_plain.loss.item() + out.aux_loss.item(), rel=1e-6)
    unasked = regularised(ids, labels=ids)  # the loss holds the regulariser whether or not the routing is returned
    assert unasked.aux_loss is None and unasked.routing_decisions is None and torch.equal(unasked.loss, out.loss)
    # Under gradient accumulation Trainer normalises by the tokens of the whole step (num_items_in_batch) and adds
    # the micro-batches' losses: the regulariser takes this micro-batch's share, so it is counted once per step.
    tokens = ids[:, 1:].numel()
    half = regularised(ids, labels=ids, num_items_in_batch=torch.tensor(2 * tokens))
    assert half.loss.item() == pytest.approx(out.loss.item() / 2, rel=1e-5)


def test_the_losses_are_the_cross_entropy_plus_the_regulariser():
    """Without the regulariser the LM loss is the next-token cross-entropy; a classifier adds the regulariser too."""
    ids = random_ids(2, 16, seed=7)
    padded, mask = _left_padded(ids, [0, 4])
    labels = padded.masked_fill(mask == 0, -100)
    lm = build(ChiarForCausalLM, tiny_config(router_type="hard", routed_operators=["dct", "rbf", "attention"]))
    with torch.no_grad():
        out = lm(padded, attention_mask=mask, labels=labels)
    expected = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
    torch.testing.assert_close(out.loss, expected)

    config = tiny_config(num_labels=3, router_type="hard", routed_operators=["dct", "rbf", "attention"],
                         router_usage_entropy_weight=0.5)
    classifier = build(ChiarForSequenceClassification, config)
    targets = torch.tensor([0, 2])
    with torch.no_grad():
        out = classifier(padded, attention_mask=mask, labels=targets, output_routing=True)
    assert out.aux_loss.item() > 0
    expected = torch.nn.functional.cross_entropy(out.logits, targets) + out.aux_loss
    torch.testing.assert_close(out.loss, expected)


# --- causality -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", sorted(CAUSAL_VARIANTS))
def test_future_tokens_do_not_change_earlier_outputs(variant):
    ids = random_ids(2, 16, seed=8)
    padded, mask = _left_padded(ids, [0, 4])
    model = build(ChiarForCausalLM, tiny_config(**CAUSAL_VARIANTS[variant]), calibrate_on=ids)
    position = 8
    out = model(padded, attention_mask=mask, output_routing=True)
    changed = perturb_after(padded, position, VOCAB, seed=1)
    out_changed = model(changed, attention_mask=mask, output_routing=True)
    torch.testing.assert_close(out_changed.logits[:, : position + 1], out.logits[:, : position + 1], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out_changed.logits[:, position + 1 :], out.logits[:, position + 1 :])
    for routes, changed_routes in zip(out.routing_decisions, out_changed.routing_decisions):
        assert torch.equal(changed_routes[:, : position + 1], routes[:, : position + 1])


@pytest.mark.parametrize("rbf_variant", ["positive", "authors"])
def test_bidirectional_encoder_reads_future_tokens(rbf_variant):
    ids = random_ids(2, 12, seed=9)
    config = tiny_config(is_causal=False, rbf_variant=rbf_variant, layer_operators=["rbf", "routed"],
                         num_hidden_layers=2, routed_operators=["dct", "rbf", "attention"])
    model = build(ChiarModel, config, calibrate_on=ids)
    out = model(ids).last_hidden_state
    changed = model(perturb_after(ids, 6, VOCAB)).last_hidden_state
    assert not torch.allclose(changed[:, :7], out[:, :7])


@pytest.mark.parametrize("operator", ["attention", "rbf"])
def test_every_token_mixing_operator_of_an_encoder_reads_future_tokens(operator):
    # (DCT mixing acts within each token's state: it reads no other token in either direction)
    ids = random_ids(2, 12, seed=9)
    config = tiny_config(is_causal=False, layer_operators=[operator, operator], num_hidden_layers=2)
    model = build(ChiarModel, config)
    with torch.no_grad():
        out = model(ids).last_hidden_state
        changed = model(perturb_after(ids, 10, VOCAB)).last_hidden_state
    assert (changed[:, :11] - out[:, :11]).abs().amax(-1).min() > 1e-5  # every earlier position moves


def test_encoder_cannot_be_a_causal_lm_or_take_a_cache():
    config = tiny_config(is_causal=False)
    with pytest.raises(ValueError, match="is_causal"):
        ChiarForCausalLM(config)
    with pytest.raises(ValueError, match="cache"):
        ChiarModel(config)(random_ids(1, 4), cache=DynamicCache(config=config))


def test_per_call_is_causal_override_is_refused():
    model = build(ChiarModel, tiny_config())
    with pytest.raises(ValueError, match="is_causal"):
        model(random_ids(1, 4), is_causal=False)


# --- cache and generation ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", sorted(CAUSAL_VARIANTS))
def test_cached_forward_equals_uncached_forward(variant):
    ids = random_ids(2, 14, seed=10)
    padded, mask = _left_padded(ids, [3, 0])
    model = build(ChiarForCausalLM, tiny_config(**CAUSAL_VARIANTS[variant]), calibrate_on=ids)
    full = model(padded, attention_mask=mask, use_cache=False)
    cache = DynamicCache(config=model.config)
    out = model(padded[:, :6], attention_mask=mask[:, :6], cache=cache, use_cache=True)
    logits = [out.logits]
    for t in range(6, 14, 2):  # two tokens at a time: prefill-style chunks after the prompt
        out = model(padded[:, t : t + 2], attention_mask=mask[:, : t + 2], cache=out.cache, use_cache=True)
        logits.append(out.logits)
    valid = mask.bool()
    torch.testing.assert_close(torch.cat(logits, 1)[valid], full.logits[valid], atol=1e-5, rtol=1e-5)


def test_a_cache_without_room_for_prefix_sums_is_refused_by_name():
    """PEFT prefix tuning builds a DynamicCache without the config: a layer with RBF prefix sums refuses it."""
    from peft import PrefixTuningConfig, get_peft_model

    model = build(ChiarForCausalLM, tiny_config(routed_operators=["dct", "rbf", "attention"], router_type="hard"))
    prefixed = get_peft_model(model, PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    ids = random_ids(2, 12, seed=5)
    with pytest.raises(ValueError, match="cannot hold them"):
        prefixed(input_ids=ids, labels=ids)


def test_prefix_tuning_trains_a_model_without_prefix_sums():
    """Without RBF layers PEFT prefix tuning's cache (built without the config) serves: its virtual keys reach the
    attention layers (the loss moves with them and their gradient is nonzero), its DCT layers' cache layers are
    left alone."""
    from peft import PrefixTuningConfig, get_peft_model

    model = build(ChiarForCausalLM, tiny_config())
    prefixed = get_peft_model(model, PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    ids = random_ids(2, 12, seed=5)
    loss = prefixed(input_ids=ids, labels=ids).loss
    loss.backward()
    (prompt,) = [p for p in prefixed.parameters() if p.requires_grad]
    assert prompt.grad is not None and prompt.grad.abs().sum() > 0
    assert not torch.isclose(loss, model(ids, labels=ids).loss)


def test_cache_must_be_built_from_the_config():
    model = build(ChiarForCausalLM, tiny_config())
    with pytest.raises(ValueError, match="DynamicCache\\(config=model.config\\)"):
        model(random_ids(1, 4), cache=DynamicCache(), use_cache=True)


def _uncached_greedy(model, ids, mask, steps):
    for _ in range(steps):
        logits = model(ids, attention_mask=mask, use_cache=False).logits[:, -1]
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], 1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    return ids


@pytest.mark.parametrize("cache_implementation", [None, "static"], ids=["dynamic cache", "static cache"])
@pytest.mark.parametrize("variant", ["threshold-3", "hard-3", "rbf-only", "attention-only"])
def test_generate_with_cache_matches_the_uncached_forward(variant, cache_implementation):
    """Also with a StaticCache, for which generate() hands the model one 4D mask per layer type."""
    ids = random_ids(3, 9, seed=11)
    padded, mask = _left_padded(ids, [0, 4, 2])
    model = build(ChiarForCausalLM, tiny_config(**CAUSAL_VARIANTS[variant]), calibrate_on=ids)
    model.generation_config.cache_implementation = cache_implementation

    greedy = model.generate(padded, attention_mask=mask, max_new_tokens=6, do_sample=False,
                            output_logits=True, return_dict_in_generate=True)
    assert torch.equal(greedy.sequences, _uncached_greedy(model, padded, mask, 6))
    sequences, step_mask = greedy.sequences, torch.cat([mask, torch.ones(3, 6, dtype=mask.dtype)], 1)
    reference = model(sequences, attention_mask=step_mask, use_cache=False).logits[:, 8:-1]
    torch.testing.assert_close(torch.stack(greedy.logits, 1), reference, atol=1e-5, rtol=1e-5)

    # Left padding: each row generates what it generates alone.
    for row, pads in enumerate([0, 4, 2]):
        alone = model.generate(padded[row : row + 1, pads:], max_new_tokens=6, do_sample=False)
        assert torch.equal(greedy.sequences[row, pads:], alone[0])

    torch.manual_seed(3)
    sampled = model.generate(padded, attention_mask=mask, max_new_tokens=6, do_sample=True, top_k=0)
    torch.manual_seed(3)
    sampled_uncached = model.generate(padded, attention_mask=mask, max_new_tokens=6, do_sample=True, top_k=0,
                                      use_cache=False)
    assert torch.equal(sampled, sampled_uncached)

    beams = model.generate(padded, attention_mask=mask, max_new_tokens=5, num_beams=3, do_sample=False,
                           output_scores=True, return_dict_in_generate=True)
    beams_uncached = model.generate(padded, attention_mask=mask, max_new_tokens=5, num_beams=3, do_sample=False,
                                    output_scores=True, return_dict_in_generate=True, use_cache=False)
    assert torch.equal(beams.sequences, beams_uncached.sequences)
    torch.testing.assert_close(beams.sequences_scores, beams_uncached.sequences_scores, atol=1e-5, rtol=1e-5)


def test_a_draft_model_gives_the_greedy_tokens_unless_its_cache_cannot_be_cropped():
    """Assisted decoding crops the draft's cache back to the accepted tokens: a draft of DCT and attention layers
    gives the greedy tokens; a draft with RBF mixing (prefix sums) or without attention is refused (it had failed
    inside transformers' cache with a TypeError)."""
    ids = random_ids(1, 8, seed=11)
    model = build(ChiarForCausalLM, tiny_config(**CAUSAL_VARIANTS["hard-2"]), calibrate_on=ids)
    greedy = model.generate(ids, max_new_tokens=8, do_sample=False)
    for layer_operators in (["attention"], ["dct", "attention"]):
        config = tiny_config(num_hidden_layers=len(layer_operators), layer_operators=layer_operators)
        draft = build(ChiarForCausalLM, config)
        assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False, assistant_model=draft), greedy)
    for layer_operators in (["rbf"], ["dct"], ["rbf", "attention"]):
        config = tiny_config(num_hidden_layers=len(layer_operators), layer_operators=layer_operators)
        draft = build(ChiarForCausalLM, config)
        with pytest.raises(ValueError, match="cannot be an assistant_model"):
            model.generate(ids, max_new_tokens=8, do_sample=False, assistant_model=draft)


@pytest.mark.parametrize("assistance", ["draft", "early exit", "prompt lookup"])
def test_a_model_with_prefix_sums_refuses_assisted_decoding(assistance):
    """The main model's cache is cropped back too when drafts are rejected: RBF mixing's prefix sums cannot be
    (transformers 5.25 crops them to a wrong state, or fails inside its cache), so such a model refuses to generate
    with an assistant_model, early exit (its first layers as the draft) or prompt lookup. Without RBF layers each
    gives the greedy tokens."""
    ids = random_ids(1, 8, seed=0)
    ids = torch.cat([ids, ids[:, :4], ids[:, 1:6]], 1)  # repeated n-grams: prompt lookup finds drafts to verify
    draft = build(ChiarForCausalLM, tiny_config(num_hidden_layers=2, layer_operators=["dct", "attention"]))
    assist = {"draft": dict(assistant_model=draft), "early exit": dict(assistant_early_exit=2),
              "prompt lookup": dict(prompt_lookup_num_tokens=2)}[assistance]
    with_sums = build(ChiarForCausalLM, tiny_config(routed_operators=["dct", "rbf", "attention"]), calibrate_on=ids)
    with pytest.raises(ValueError, match="cannot generate with an assistant_model, early exit or prompt lookup"):
        with_sums.generate(ids, max_new_tokens=8, do_sample=False, **assist)
    without = build(ChiarForCausalLM, tiny_config(), calibrate_on=ids)
    greedy = without.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(without.generate(ids, max_new_tokens=8, do_sample=False, **assist), greedy)


# --- heads, save / load, remote code -----------------------------------------------------------------------------


def test_auto_classes_build_chiar_models():
    fields = {k: v for k, v in tiny_config().to_dict().items() if k != "model_type"}
    config = AutoConfig.for_model("chiar_former", **fields)
    assert isinstance(config, ChiarConfig)
    assert type(AutoModelForCausalLM.from_config(config)) is ChiarForCausalLM
    assert type(AutoModelForSequenceClassification.from_config(config)) is ChiarForSequenceClassification
    assert type(transformers.AutoModel.from_config(config)) is ChiarModel


def test_lm_head_is_tied_to_the_embeddings():
    model = build(ChiarForCausalLM, tiny_config())
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("pooling", ["last", "mean", "learned", "rmt_optimal"])
def test_sequence_classification_pools_real_tokens_only(pooling):
    ids = random_ids(3, 10, seed=12)
    padded, mask = _left_padded(ids, [0, 3, 6])
    config = tiny_config(num_labels=3, classifier_pooling=pooling, routed_operators=["dct", "rbf", "attention"])
    model = build(ChiarForSequenceClassification, config, calibrate_on=ids)
    if pooling == "rmt_optimal":  # an unfitted head refuses to run; any fixed weights show the padding behaviour
        model.pooling.set_position_weights(torch.linspace(1.0, 2.0, config.max_position_embeddings))
    out = model(padded, attention_mask=mask, labels=torch.tensor([0, 2, 1]))
    assert out.logits.shape == (3, 3) and torch.isfinite(out.loss)
    for row, pads in enumerate([3, 6]):
        alone = model(ids[row + 1 : row + 2, pads:]).logits
        torch.testing.assert_close(out.logits[row + 1], alone[0], atol=1e-5, rtol=1e-5)
    # A causal 4D mask holds the same padding: the head pools with it (it had pooled per query row, or failed)
    causal = torch.ones(10, 10, dtype=torch.bool).tril()[None, None] & mask.bool()[:, None, None, :]
    with torch.no_grad():
        torch.testing.assert_close(model(padded, attention_mask=causal).logits, out.logits.detach(), atol=1e-5,
                                   rtol=1e-5)
    out.loss.backward()
    assert model.score.weight.grad.abs().sum() > 0


def test_trainer_evaluation_predicts_the_logits_alone(tmp_path):
    """The routing outputs stay out of Trainer's predictions (`keys_to_ignore_at_inference`): a standard metric
    reads the logits as an array."""
    import numpy as np
    from transformers import Trainer, TrainingArguments, default_data_collator

    config = tiny_config(num_labels=3, router_type="hard", routed_operators=["dct", "attention"])
    model = build(ChiarForSequenceClassification, config)
    data = [{"input_ids": ids, "labels": torch.tensor(i % 3)} for i, ids in enumerate(random_ids(6, 10, seed=4))]

    def accuracy(prediction):
        return {"accuracy": float((np.argmax(prediction.predictions, -1) == prediction.label_ids).mean())}

    args = TrainingArguments(tmp_path, per_device_eval_batch_size=4, use_cpu=True, report_to="none")
    trainer = Trainer(model=model, args=args, eval_dataset=data, data_collator=default_data_collator,
                      compute_metrics=accuracy)
    assert trainer.predict(data).predictions.shape == (6, 3)
    assert 0 <= trainer.evaluate()["eval_accuracy"] <= 1


@pytest.mark.parametrize("variant", ["threshold-3", "hard-3", "soft-3"])
def test_a_model_offloaded_to_disk_computes_the_same_logits(variant, tmp_path):
    # accelerate moves offloaded weights in through each module's forward: a branch called another way would
    # meet its weights still on the meta device.
    ids = random_ids(2, 12, seed=3)
    model = build(ChiarForCausalLM, tiny_config(**CAUSAL_VARIANTS[variant]), calibrate_on=ids)
    model.save_pretrained(tmp_path / "model")
    offloaded = AutoModelForCausalLM.from_pretrained(
        tmp_path / "model", device_map="auto", max_memory={"cpu": "20KB"}, offload_folder=tmp_path / "offload"
    ).eval()
    assert "disk" in set(offloaded.hf_device_map.values())
    with torch.no_grad():
        torch.testing.assert_close(offloaded(ids).logits, model(ids).logits)


def test_save_and_load_round_trip_with_safetensors(tmp_path):
    ids = random_ids(2, 12, seed=13)
    config = tiny_config(routed_operators=["dct", "rbf", "attention"])
    model = build(ChiarForCausalLM, config, calibrate_on=ids)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    # The remote code: the model files import the ops files as siblings, which are real copies of hf_spectral/ops.
    modeling = (tmp_path / "modeling_chiar_former.py").read_text()
    assert "from ...ops." not in modeling
    for name in ("pooling", "random_features", "routing", "spectral"):
        assert f"from .{name} import" in modeling
        copied = tmp_path / f"{name}.py"
        assert copied.is_file() and not copied.is_symlink()
        assert copied.read_text() == (Path(hf_spectral.ops.__file__).parent / f"{name}.py").read_text()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is ChiarForCausalLM
    assert loaded.config.layer_thresholds == model.config.layer_thresholds
    torch.testing.assert_close(loaded.model.layers[1].rbf.omega, model.model.layers[1].rbf.omega)
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize("auto_class, model_class", [
    ("AutoModelForCausalLM", ChiarForCausalLM),
    ("AutoModelForSequenceClassification", ChiarForSequenceClassification),
])
def test_loads_with_trust_remote_code_without_the_plugin(tmp_path, auto_class, model_class):
    ids = random_ids(2, 10, seed=14)
    config = tiny_config(routed_operators=["dct", "rbf", "attention"], num_labels=2, classifier_pooling="mean")
    model = build(model_class, config, calibrate_on=ids)
    model.save_pretrained(tmp_path / "checkpoint")
    logits, class_name = load_without_plugin(tmp_path / "checkpoint", auto_class, {"input_ids": ids}, tmp_path)
    assert class_name.endswith("." + model_class.__name__) and not class_name.startswith("hf_spectral")
    torch.testing.assert_close(logits, model(ids).logits, atol=1e-5, rtol=1e-5)


def test_gradient_checkpointing_gives_the_same_gradients():
    ids = random_ids(2, 12, seed=15)
    config = tiny_config(router_type="hard", routed_operators=["dct", "rbf", "attention"])
    model = build(ChiarForCausalLM, config)
    model.train()
    model(ids, labels=ids).loss.backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model.activation_checkpointing_enable()
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    model(ids, labels=ids, use_cache=False).loss.backward()
    for name, grad in reference.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad, atol=1e-6, rtol=1e-5)


# --- FLOP counter ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides", [
    dict(routed_operators=["dct", "rbf", "attention"]),
    dict(router_type="hard", routed_operators=["dct", "rbf", "attention"], layer_norm_position="pre"),
    dict(router_type="soft", routed_operators=["dct", "rbf", "attention"]),
    dict(routed_execution="dense"),
    dict(layer_operators=["dct", "rbf", "routed", "attention"], rbf_variant="authors"),
])
def test_flop_counter_matches_torch_flop_count_of_an_encoder(overrides):
    # In an encoder without padding every query sees every key, so the counter's pairs are what the kernels compute;
    # one row, so that the gathered layout of routed tokens has no padding rows (in eager mode on CPU it is as wide
    # as the batch's largest routed count). Eager attention: torch's FLOP counter has no formula for the CPU SDPA kernel.
    ids = random_ids(1, 12, seed=16)
    config = tiny_config(is_causal=False, attn_implementation="eager", **overrides)
    model = build(ChiarModel, config, calibrate_on=ids)
    assert model.config._attn_implementation == "eager"
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        out = model(ids, output_routing=True)
    counted = count_flops(model.config, 1, 12, out.routing_decisions)
    assert counted["total"] == counter.get_total_flops()


def test_flop_counter_counts_causal_attention_pairs_and_the_lm_head():
    config = tiny_config(layer_operators=["attention"], num_hidden_layers=1)
    counted = count_flops(config, batch_size=2, seq_len=10, lm_head_positions=10)
    d, tokens = 32, 20
    assert counted["attention_core"] == 4 * d * 2 * sum(range(1, 11))
    assert counted["attention"] == 8 * tokens * d * d + counted["attention_core"]
    assert counted["ffn"] == 4 * tokens * d * 64
    assert counted["lm_head"] == 2 * tokens * d * VOCAB
    assert counted["total"] == counted["attention"] + counted["ffn"] + counted["lm_head"]


def test_flop_counter_counts_the_keys_each_query_sees_after_padding_and_a_cache():
    config = tiny_config(layer_operators=["attention"], num_hidden_layers=1)
    d = 32
    # a padding query attends to its own slot (SDPA needs one key per row); tokens see the tokens up to them
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    counted = count_flops(config, batch_size=2, seq_len=6, attention_mask=mask)
    assert counted["attention_core"] == 4 * d * ((1 + 1 + 1 + 2 + 3 + 4) + sum(range(1, 7)))
    # after 10 cached tokens the 4 new ones see 11, 12, 13 and 14 keys
    assert count_flops(config, batch_size=1, seq_len=4, past_length=10)["attention_core"] == 4 * d * (11 + 12 + 13 + 14)


def test_flop_counter_attention_falls_with_the_routed_fraction():
    ids = random_ids(2, 32, seed=17)
    model = build(ChiarForCausalLM, tiny_config(), calibrate_on=ids, percentiles=(75.0,))
    out = model(ids, output_routing=True)
    sparse = count_flops(model.config, 2, 32, out.routing_decisions)
    dense = count_flops(_dense_twin(model).config, 2, 32, out.routing_decisions)
    routed_core = [sparse["per_layer"][i]["attention_core"] / dense["per_layer"][i]["attention_core"] for i in (1, 2)]
    fractions = [f[1].item() for f in out.routing_fractions]
    assert all(0.15 < r < 0.4 for r in routed_core) and all(abs(f - 0.25) < 0.05 for f in fractions)
    assert sparse["per_layer"][3]["attention"] == dense["per_layer"][3]["attention"]  # layer 4 is all attention
    assert sparse["total"] < dense["total"]
    with pytest.raises(ValueError, match="routing decisions"):
        count_flops(model.config, 2, 32, ())


def _routes(value: int, shape=(2, 16)) -> list[torch.Tensor]:
    """Decisions of the default 4-layer config (routed layers 1 and 2) that send every token to route ``value``."""
    return [torch.full(shape, value), torch.full(shape, value)]


@pytest.mark.parametrize("arguments, error, match", [
    (dict(config="model"), TypeError, r"`config` must be a ChiarConfig \(a model"),
    (dict(config={"hidden_size": 32}), TypeError, "`config` must be a ChiarConfig"),
    (dict(batch_size=0), ValueError, "`batch_size`"),
    (dict(seq_len=2.0), ValueError, "`seq_len`"),
    (dict(past_length=-1), ValueError, "`past_length`"),
    (dict(lm_head_positions=-1), ValueError, "`lm_head_positions`.*got -1"),
    (dict(lm_head_positions=17), ValueError, "`lm_head_positions`.*seq_len=16.*got 17"),
    (dict(routing_decisions=None), ValueError, "`routing_decisions` is None: .* only when called with `output_routing"),
    (dict(routing_decisions=torch.zeros(2, 16)), TypeError, "`routing_decisions` must be a tuple or list"),
    (dict(routing_decisions=_routes(1)[:1]), ValueError, "`routing_decisions`: expected 2"),
    (dict(routing_decisions=_routes(2)), ValueError, r"`routing_decisions\[0\]`.*\[0, 2\).*\[2, 2\]"),
    (dict(routing_decisions=_routes(-1)), ValueError, r"`routing_decisions\[0\]`.*\[-1, -1\]"),
    (dict(routing_decisions=_routes(1, (16, 2))), ValueError, r"`routing_decisions\[0\]`.*\(2, 16\)"),
    (dict(routing_decisions=[r.float() for r in _routes(1)]), TypeError, r"`routing_decisions\[0\]`.*integer"),
    (dict(attention_mask=torch.ones(2, 10)), ValueError, r"`attention_mask`.*\(2, 16\).*\(2, 10\)"),
    (dict(attention_mask=torch.ones(2, 16), past_length=4), ValueError, r"`attention_mask`.*\(2, 20\)"),
])
def test_flop_counter_refuses_arguments_of_no_possible_forward_pass(arguments, error, match):
    # Each of these once gave a silently wrong count (negative LM head FLOPs, route ids of no operator counted as
    # nothing) or a raw broadcasting error; every one names the argument.
    config = tiny_config()
    valid = dict(config=config, batch_size=2, seq_len=16, routing_decisions=_routes(1), attention_mask=None,
                 past_length=0, lm_head_positions=16)
    if arguments.get("config") == "model":
        arguments = {**arguments, "config": ChiarForCausalLM(config)}
    count_flops(**valid)  # the valid call counts
    with pytest.raises(error, match=match):
        count_flops(**{**valid, **arguments})


def test_chunked_sparse_attention_equals_dense_on_long_sequences():
    # Long enough for the routed queries to be attended in several key-prefix chunks, with left padding.
    ids = random_ids(2, 400, seed=18)
    padded, mask = _left_padded(ids, [0, 37])
    sparse = build(ChiarForCausalLM, tiny_config(max_position_embeddings=512), calibrate_on=ids, percentiles=(40.0,))
    dense = _dense_twin(sparse)
    out_sparse = sparse(padded, attention_mask=mask, output_routing=True)
    out_dense = dense(padded, attention_mask=mask)
    attention_queries = int((out_sparse.routing_decisions[0] == 1).sum(1).max())
    assert attention_queries >= 192  # ≥ 3 chunks of 64 queries
    valid = mask.bool()
    torch.testing.assert_close(out_sparse.logits[valid], out_dense.logits[valid], atol=1e-5, rtol=1e-5)


def test_a_loss_builds_no_cache_unless_asked():
    ids = random_ids(2, 12, seed=3)
    model = build(ChiarForCausalLM, tiny_config(), calibrate_on=ids)
    assert model(ids, labels=ids).cache is None
    assert model(ids, labels=ids, use_cache=True).cache.get_seq_length() == 12
    assert model(ids).cache.get_seq_length() == 12


# --- attention backends ------------------------------------------------------------------------------------------


def _with_backend(model, implementation, model_class=ChiarForCausalLM):
    """The same weights and thresholds on another attention backend."""
    twin = model_class(ChiarConfig(**{**model.config.to_dict(), "attn_implementation": implementation})).eval()
    twin.load_state_dict(model.state_dict())
    assert twin.config._attn_implementation == implementation
    return twin




@pytest.fixture
def fresh_compilation():
    """On CPU flex_attention is compiled for static shapes, once per shape up to Dynamo's recompilation limit (then
    it runs uncompiled, slowly): each test starts from a reset compiler, so that it compiles its own shapes."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("implementation", [
    "sdpa",
    pytest.param("flex_attention", marks=pytest.mark.skipif(INDUCTOR_ISA_FORCED, reason=INDUCTOR_SKIP_REASON)),
])
@pytest.mark.parametrize("layer_operators", [None, ["attention", "routed"]], ids=["authors-layout", "dense-then-routed"])
def test_eager_sdpa_and_flex_attention_agree(layer_operators, implementation, fresh_compilation):
    """Padded batch, routed and dense attention layers: the three backends of transformers' attention interface give
    the same logits (different kernels: compared with a tolerance). flex_attention runs without gradients: on CPU
    torch implements only its forward."""
    ids = random_ids(3, 20, seed=30)
    padded, mask = _left_padded(ids, [0, 6, 3])
    overrides = dict(routed_operators=["dct", "rbf", "attention"])
    if layer_operators is not None:
        overrides.update(layer_operators=layer_operators, num_hidden_layers=2)
    eager = build(ChiarForCausalLM, tiny_config(attn_implementation="eager", **overrides), calibrate_on=ids)
    valid = mask.bool()
    with torch.no_grad():
        reference = eager(padded, attention_mask=mask, output_routing=True)
        out = _with_backend(eager, implementation)(padded, attention_mask=mask, output_routing=True)
    for a, b in zip(out.routing_decisions, reference.routing_decisions):
        assert torch.equal(a[valid], b[valid])
    torch.testing.assert_close(out.logits[valid], reference.logits[valid], atol=1e-5, rtol=1e-5)


def test_set_attn_implementation_switches_backends_and_flex_generation_takes_new_shapes(fresh_compilation):
    """`model.set_attn_implementation` switches CHIAR's backend like any transformers model's; under flex_attention
    generation keeps working as the batch shape changes (transformers' own flex kernel, recompiled with dynamic
    shapes after a few, fails to compile in torch 2.13's CPU template)."""
    model = build(ChiarForCausalLM, tiny_config(routed_operators=["dct", "attention"], router_type="hard"))
    prompts = [random_ids(batch, length, seed=8 + batch) for batch, length in ((4, 20), (3, 10), (1, 7))]
    expected = [model.generate(ids, max_new_tokens=4, do_sample=False) for ids in prompts]
    backends = ["eager"] if INDUCTOR_ISA_FORCED else ["eager", "flex_attention"]
    for implementation in backends:
        model.set_attn_implementation(implementation)
        assert model.model.layers[-1].attention.config._attn_implementation == implementation
        for ids, tokens in zip(prompts, expected):
            assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), tokens), implementation


def test_output_attentions_under_sdpa_warns_and_falls_back_to_eager(caplog):
    ids = random_ids(2, 12, seed=31)
    config = tiny_config(layer_operators=["attention", "routed"], num_hidden_layers=2)
    sdpa = build(ChiarForCausalLM, config, calibrate_on=ids)
    assert sdpa.config._attn_implementation == "sdpa"
    eager = _with_backend(sdpa, "eager")
    modeling_chiar_former.logger.warning_once.cache_clear()  # warned once per process: make this call the first
    with caplog.at_level("WARNING", logger=modeling_chiar_former.logger.name):
        out = sdpa(ids, output_attentions=True)
    assert "output_attentions=True" in caplog.text and "eager" in caplog.text
    expected = eager(ids, output_attentions=True)
    assert len(out.attentions) == 1 and out.attentions[0].shape == (2, 4, 12, 12)  # the routed layer records none
    torch.testing.assert_close(out.attentions[0], expected.attentions[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out.logits, sdpa(ids).logits, atol=1e-5, rtol=1e-5)
    # Dense execution runs the routed layer's attention with every token as a query: it records that one too.
    dense = build(ChiarForCausalLM, tiny_config(layer_operators=["attention", "routed"], num_hidden_layers=2,
                                                routed_execution="dense"), calibrate_on=ids)
    assert [a.shape for a in dense(ids, output_attentions=True).attentions] == [(2, 4, 12, 12)] * 2


# --- transformers' conventions and input checks -------------------------------------------------------------------


@pytest.mark.parametrize("task, model_class", [
    ("text-classification", ChiarForSequenceClassification), ("feature-extraction", ChiarModel)])
def test_batched_pipelines_give_what_one_text_at_a_time_gives(task, model_class, tmp_path):
    """A pipeline splits a batch's outputs by row: the routing tuples (one entry per routed layer) were split by
    layer, and a batch larger than the routed layers failed. They come with output_routing=True only."""
    from hf_spectral import CharTokenizer

    tokenizer = CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz ", str(tmp_path), pad_token="<pad>")
    config = tiny_config(vocab_size=tokenizer.vocab_size, pad_token_id=tokenizer.pad_token_id, num_labels=2)
    build(model_class, config).save_pretrained(tmp_path)
    pipe = transformers.pipeline(task, model=str(tmp_path), tokenizer=tokenizer, device="cpu")
    texts = ["a b", "cd efg hij", "klm", "nopq rs"]  # more rows than routed layers, of other lengths
    assert tokenizer.padding_side == "right"
    batched, single = pipe(texts, batch_size=len(texts)), [pipe(text) for text in texts]
    if task == "text-classification":  # one text: a list of one result
        single = [row[0] for row in single]
        assert [row["label"] for row in batched] == [row["label"] for row in single]
        batched, single = ([torch.tensor(row["score"]) for row in rows] for rows in (batched, single))
    else:  # (1, padded length, hidden): the positions of each text's own tokens
        single = [torch.tensor(row) for row in single]
        batched = [torch.tensor(row)[:, : own.shape[1]] for row, own in zip(batched, single)]
    # Padded rows against unpadded ones: other kernel shapes, the same values up to rounding.
    torch.testing.assert_close(batched, single, atol=1e-5, rtol=1e-4)



def test_past_key_values_is_the_cache_as_in_transformers_models():
    """`model(ids, past_key_values=cache, use_cache=True)` (transformers' tutorials) continues from the cache: decoding
    token by token through it gives the logits of the full forward."""
    ids = random_ids(2, 12, seed=32)
    model = build(ChiarForCausalLM, tiny_config(routed_operators=["dct", "rbf", "attention"]), calibrate_on=ids)
    full = model(ids).logits
    out = model(ids[:, :5], use_cache=True)
    logits = [out.logits]
    for t in range(5, 12):
        out = model(ids[:, t : t + 1], past_key_values=out.cache, use_cache=True)
        logits.append(out.logits)
    assert out.cache.get_seq_length() == 12
    torch.testing.assert_close(torch.cat(logits, 1), full, atol=1e-5, rtol=1e-5)
    # The base model honours it too.
    base = model.model(ids[:, :5], use_cache=True)
    step = model.model(ids[:, 5:6], past_key_values=base.cache, use_cache=True)
    torch.testing.assert_close(step.last_hidden_state, model.model(ids[:, :6]).last_hidden_state[:, 5:], atol=1e-5,
                               rtol=1e-5)


@pytest.mark.parametrize("make_inputs, message", [
    (lambda ids: dict(input_ids=ids[:, :0]), r"input_ids is empty \(shape \(2, 0\)\)"),
    (lambda ids: dict(input_ids=ids[:0]), r"input_ids is empty \(shape \(0, 6\)\)"),
    (lambda ids: dict(input_ids=ids[0]), r"input_ids must have shape \(batch, positions\).*\(6,\)"),
    (lambda ids: dict(inputs_embeds=torch.zeros(2, 6, 31)),
     r"inputs_embeds must have shape \(batch, positions, hidden_size = 32\).*\(2, 6, 31\)"),
    (lambda ids: dict(input_ids=ids, attention_mask=torch.tensor([0, 1, 1, 1, 1, 1])),
     r"attention_mask must have shape .*\(2, 6\).*got \(6,\)"),
    (lambda ids: dict(input_ids=ids, attention_mask=torch.ones(3, 6, dtype=torch.long)),
     r"attention_mask must have shape .*\(2, 6\).*got \(3, 6\)"),
    (lambda ids: dict(input_ids=ids, position_ids=torch.tensor([[-1, 0, 1, 2, 3, 4]])),
     r"position_ids must be >= 0, got a minimum of -1 in position_ids of shape \(1, 6\)"),
    (lambda ids: dict(input_ids=ids, position_ids=torch.arange(5)[None]),
     r"position_ids must have shape .*\(2, 6\).*got \(1, 5\)"),
], ids=["no-positions", "no-rows", "1-D-ids", "narrow-embeddings", "1-D-mask", "mask-of-3-rows",
        "negative-positions", "short-positions"])
def test_bad_inputs_are_refused_naming_the_argument_and_shapes(make_inputs, message):
    model = build(ChiarForCausalLM, tiny_config())
    with pytest.raises(ValueError, match=message):
        model(**make_inputs(random_ids(2, 6, seed=33)))


@pytest.mark.skipif(INDUCTOR_ISA_FORCED, reason=INDUCTOR_SKIP_REASON)
def test_static_cache_generation_under_flex_attention_equals_the_uncached_forward(fresh_compilation):
    """flex_attention with a StaticCache (one key length, so one compiled kernel for every step): left-padded greedy
    generation gives the uncached forward's logits."""
    ids = random_ids(3, 9, seed=11)
    padded, mask = _left_padded(ids, [0, 4, 2])
    model = _with_backend(build(ChiarForCausalLM, tiny_config(), calibrate_on=ids), "flex_attention")
    greedy = model.generate(padded, attention_mask=mask, max_new_tokens=3, do_sample=False,
                            cache_implementation="static", output_logits=True, return_dict_in_generate=True)
    step_mask = torch.cat([mask, torch.ones(3, 3, dtype=mask.dtype)], 1)
    with torch.no_grad():
        reference = model(greedy.sequences, attention_mask=step_mask, use_cache=False).logits[:, 8:-1]
    torch.testing.assert_close(torch.stack(greedy.logits, 1), reference, atol=1e-5, rtol=1e-5)


def test_static_cache_without_a_mask_reads_only_the_filled_slots():
    """A StaticCache hands back its whole key buffer: without a padding mask, the empty slots after the filled ones
    must still be masked out (the SDPA fast path applies only when the keys are exactly the past and new tokens)."""
    from transformers import StaticCache

    ids = random_ids(2, 10, seed=34)
    config = tiny_config(layer_operators=["attention", "routed"], num_hidden_layers=2)
    model = build(ChiarForCausalLM, config, calibrate_on=ids)
    full = model(ids).logits
    cache = StaticCache(config=model.config, max_cache_len=16)
    logits = [model(ids[:, :4], cache=cache, use_cache=True).logits]
    for t in range(4, 10):
        logits.append(model(ids[:, t : t + 1], cache=cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(logits, 1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(INDUCTOR_ISA_FORCED, reason=INDUCTOR_SKIP_REASON)
def test_flex_attention_decoding_through_the_cache_equals_the_eager_forward(fresh_compilation):
    """Queries from the projections against keys from the cache (other memory layouts), padded rows, one token at a
    time: flex_attention's block masks of gathered and dense queries give the eager model's logits."""
    ids = random_ids(2, 12, seed=35)
    padded, mask = _left_padded(ids, [0, 3])
    eager = build(ChiarForCausalLM, tiny_config(attn_implementation="eager"), calibrate_on=ids)
    flex = _with_backend(eager, "flex_attention")
    valid = mask.bool()
    with torch.no_grad():
        full = eager(padded, attention_mask=mask).logits
        out = flex(padded[:, :6], attention_mask=mask[:, :6], use_cache=True)
        logits = [out.logits]
        for t in range(6, 12):
            out = flex(padded[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=out.cache, use_cache=True)
            logits.append(out.logits)
    torch.testing.assert_close(torch.cat(logits, 1)[valid], full[valid], atol=1e-5, rtol=1e-5)


def test_a_model_too_large_for_the_memory_is_refused_naming_the_field_before_allocating():
    config = tiny_config(vocab_size=10**12)  # a config is only numbers (it may be meant for a larger machine)
    with pytest.raises(ValueError, match="^ChiarConfig: the parameters of this model need at least .* of "
                       "torch.float32 on cpu, which has .*; vocab_size × hidden_size alone takes .*: lower vocab_size "
                       "or hidden_size$"):
        ChiarForCausalLM(config)
    assert ChiarForCausalLM(tiny_config()).model.embed_tokens.weight.shape == (VOCAB, 32)


def test_loading_builds_on_the_meta_device_where_no_size_is_checked(tmp_path, monkeypatch):
    from hf_spectral.ops import validation

    model = build(ChiarForCausalLM, tiny_config())
    model.save_pretrained(tmp_path)
    monkeypatch.setattr(validation, "available_memory", lambda device: 1000)  # less than this model needs
    with pytest.raises(ValueError, match="which has 1,000 bytes"):
        ChiarForCausalLM(tiny_config())
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert model.state_dict().keys() == loaded.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
