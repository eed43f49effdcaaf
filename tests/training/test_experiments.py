"""What the benchmark entry points and the reproductions share (training/common/experiments.py): a configuration with
a run's overrides, the options passed on to every run, a run folder reused, resumed or refused."""

import json
import math

import pytest

from training.common.cli import UsageError
from training.common.experiments import (
    Run,
    count_parameters,
    driver_parser,
    merge_overrides,
    override_items,
    parse,
    script_options,
    start,
)


def test_config_overrides_are_merged_keeping_json_lists_whole():
    text = 'num_hidden_layers=4,layer_operators=["dct","routed","attention"],hidden_dropout=0.0'
    assert override_items(text) == {"num_hidden_layers": "4", "layer_operators": '["dct","routed","attention"]',
                                    "hidden_dropout": "0.0"}
    merged = merge_overrides(text, {"num_hidden_layers": 3, "is_causal": False, "router_type": "hard"})
    assert merged == ('num_hidden_layers=3,layer_operators=["dct","routed","attention"],hidden_dropout=0.0,'
                      "is_causal=false,router_type=hard")
    with pytest.raises(UsageError, match="KEY=VALUE"):
        override_items("num_hidden_layers")


def test_parameters_of_a_saved_run_are_the_models_not_the_tensors_of_its_weights_file(tmp_path):
    """The weights file also holds buffers (the RBF operator's random features, a fixed Morlet filter): the tables
    count parameters, a tied embedding once."""
    from safetensors import safe_open

    from hf_spectral import ChiarConfig, ChiarForCausalLM, EGAConfig, EGAForCausalLM

    chiar = ChiarForCausalLM(ChiarConfig(vocab_size=40, hidden_size=16, num_hidden_layers=3, num_attention_heads=2,
                                         intermediate_size=32, max_position_embeddings=32, rbf_num_features=8,
                                         layer_operators=["dct", "routed", "attention"],
                                         routed_operators=["dct", "rbf", "attention"]))
    ega = EGAForCausalLM(EGAConfig.from_variant("EGA-M-F", vocab_size=40, hidden_size=16, num_hidden_layers=2,
                                                num_attention_heads=2, max_position_embeddings=32))
    for name, model in (("chiar", chiar), ("ega", ega)):
        model.save_pretrained(tmp_path / name)
        with safe_open(str(tmp_path / name / "model.safetensors"), "pt") as weights:
            stored = sum(math.prod(weights.get_slice(key).get_shape()) for key in weights.keys())
        assert model.state_dict().keys() - dict(model.named_parameters()).keys()  # buffers are saved too
        assert count_parameters(str(tmp_path / name)) == sum(p.numel() for p in model.parameters()) < stored
    gates = count_parameters(str(tmp_path / "ega"), lambda name: ".energy_gate." in name)
    assert gates == sum(p.numel() for n, p in ega.named_parameters() if ".energy_gate." in n) > 0
    (tmp_path / "ega" / "config.json").write_text(json.dumps({"model_type": "ega_gpt", "architectures": ["Nope"]}))
    with pytest.raises(ValueError, match="Nope"):
        count_parameters(str(tmp_path / "ega"))


def test_options_for_every_run_are_typed_by_the_scripts_parser():
    parser = driver_parser("python -m training.benchmark", "")
    args, tokens = parse(parser, ["--seeds", "1", "--max_steps", "3", "--gate_layers", "0", "1", "--bf16", "--",
                                  "--lr_scheduler_type", "linear", "--seed", "5"])  # (no abbreviation of --seeds)
    assert args.seeds == [1]
    assert script_options("run_clm", tokens) == {"max_steps": 3, "gate_layers": [0, 1], "bf16": True,
                                                  "lr_scheduler_type": "linear", "seed": 5}
    assert script_options("run_classification", []) == {}
    with pytest.raises(UsageError, match="unrecognized arguments: --learnin_rate 1"):
        script_options("run_clm", ["--learnin_rate", "1"])
    with pytest.raises(UsageError, match="--max-steps: invalid int value: 'x'"):
        script_options("run_classification", ["--max_steps", "x"])


def _run(folder, **arguments):
    return Run("BASE-seed0", "run_clm", {"output_dir": str(folder), "max_steps": 8, **arguments})


def test_a_run_folder_is_resumed_from_its_newest_complete_checkpoint_under_its_own_arguments_only(tmp_path):
    folder = tmp_path / "BASE-seed0"
    argv = start(_run(folder))
    assert argv == [str(folder / "args.json")] and json.loads((folder / "args.json").read_text())["max_steps"] == 8
    # Nothing to reuse yet: the corrected command takes the folder over
    assert start(_run(folder, max_steps=9)) == [str(folder / "args.json")]
    for step, complete in ((4, True), (10, True), (12, False)):  # checkpoint-12 was cut short: no trainer state
        (folder / f"checkpoint-{step}").mkdir()
        if complete:
            (folder / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    assert start(_run(folder, max_steps=9)) == [str(folder / "args.json"), "--resume_from_checkpoint",
                                                str(folder / "checkpoint-10")]
    with pytest.raises(UsageError, match=r"holds a run made with other arguments \(max_steps: 9 there, 10 now\)"):
        start(_run(folder, max_steps=10))
    (folder / "README.md").write_text("the card: written last")
    assert start(_run(folder, max_steps=9)) is None  # complete: reused
    with pytest.raises(UsageError, match=r"\(learning_rate: None there, 0.1 now; max_steps: 9 there, 8 now\)"):
        start(_run(folder, learning_rate=0.1))
