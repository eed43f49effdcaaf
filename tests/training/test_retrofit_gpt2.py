"""The GPT-2 retrofit comparison (training/retrofit_gpt2.py): pretrain once, fine-tune every arm at equal budget, score
the forgetting, all as run_clm runs; artefacts that reload; reuse of the pretrained model."""

import json

import pytest
import torch

import hf_spectral  # noqa: F401  (registers the energy-gated model types)
from training import retrofit_gpt2


@pytest.fixture(scope="module")
def retrofit_run(tiny_shakespeare, tiny_wikitext, tmp_path_factory):
    out, data = tmp_path_factory.mktemp("retrofit"), tmp_path_factory.mktemp("data")
    arguments = ["--smoke", "--pretrain_data_path", tiny_wikitext, "--finetune_data_path", tiny_shakespeare,
                 "--output_dir", str(out), "--data_dir", str(data)]
    code = retrofit_gpt2.main(arguments + ["--arms", "full", "gates", "gates+lora"])
    return {"dir": out, "code": code, "arguments": arguments}


def test_every_arm_is_fine_tuned_for_the_same_budget_and_tabulated(retrofit_run):
    out = retrofit_run["dir"]
    assert retrofit_run["code"] == 0
    record = json.loads((out / "retrofit_gpt2.json").read_text())
    rows = {row["arm"]: row for row in record["rows"]}
    assert set(rows) == {"pretrained (no fine-tuning)", "full", "gates", "gates+lora"}
    runs = {run["arm"]: run for run in record["runs"]}
    states = {arm: json.loads((out / f"{arm.replace('+', '_')}-seed0" / "trainer_state.json").read_text())
              for arm in runs}
    assert {state["global_step"] for state in states.values()} == {6}
    assert runs["gates"]["trainable_parameters"] < runs["gates+lora"]["trainable_parameters"] < runs["full"][
        "trainable_parameters"]
    assert rows["gates"]["delta_vs_full"] == pytest.approx(runs["full"]["val_loss"] - runs["gates"]["val_loss"])
    forgetting = json.loads((out / "gates-seed0-pretrain_eval" / "all_results.json").read_text())
    assert runs["gates"]["pretrain_val_loss"] == forgetting["eval_loss"]
    start = json.loads((out / "pretrained-seed0-finetune_eval" / "all_results.json").read_text())
    assert rows["pretrained (no fine-tuning)"]["val_loss_mean"] == start["eval_loss"]
    assert (out / "retrofit_gpt2.md").read_text().count("| gates") == 2
    for name in ("retrofit_gpt2_curves.png", "gates_seed0_gate_heatmap.png", "gates_seed0_gate_trajectories.png"):
        assert (out / name).is_file(), name
    arguments = json.loads((out / "gates_lora-seed0" / "args.json").read_text())
    assert (arguments["learning_rate"], arguments["gate_learning_rate"], arguments["lora_r"]) == (1e-3, 1e-2, 8)


def test_the_gates_only_arm_trains_nothing_but_the_gates_and_saves_them_alone(retrofit_run):
    from transformers import AutoModelForCausalLM

    from hf_spectral.retrofit import load_energy_gates

    pretrained = AutoModelForCausalLM.from_pretrained(retrofit_run["dir"] / "pretrained-seed0")
    gated = AutoModelForCausalLM.from_pretrained(retrofit_run["dir"] / "gates-seed0").eval()
    assert type(gated).__name__ == "EnergyGatedGPT2LMHeadModel"
    stock = pretrained.state_dict()
    for name, tensor in gated.state_dict().items():
        if ".energy_gate." not in name:
            assert torch.equal(tensor, stock[name]), name
    assert any(gated.transformer.h[0].attn.energy_gate.alpha.flatten() != 0)  # the gates did move
    load_energy_gates(pretrained, str(retrofit_run["dir"] / "gates-seed0" / "energy_gates.safetensors"))
    ids = torch.randint(0, pretrained.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(pretrained.eval()(ids).logits, gated(ids).logits, atol=1e-6)


def test_gates_with_lora_are_saved_in_the_adapter_and_reload(retrofit_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run_dir = retrofit_run["dir"] / "gates_lora-seed0"
    assert (run_dir / "adapter_model.safetensors").is_file() and (run_dir / "energy_gate_config.json").is_file()
    base = AutoModelForCausalLM.from_pretrained(retrofit_run["dir"] / "pretrained-seed0")
    model = PeftModel.from_pretrained(base, str(run_dir))  # hf_spectral adds the gates the adapter was trained with
    history = json.loads((run_dir / "trainer_state.json").read_text())["log_history"]
    tau = next(p for n, p in model.named_parameters() if n.endswith("h.1.attn.energy_gate.modules_to_save.default.tau"))
    logged = [entry["gates/L1/H0/tau"] for entry in history if "gates/L1/H0/tau" in entry]
    assert float(tau[0].mean()) == pytest.approx(logged[-1], abs=1e-5) != logged[0]
    card = (run_dir / "README.md").read_text()
    assert "model-index" in card and "PeftModel.from_pretrained" in card


def test_the_pretrained_model_and_finished_arms_are_reused_by_later_invocations(retrofit_run, capsys, tmp_path):
    arguments = retrofit_run["arguments"] + ["--results_dir", str(tmp_path)]  # (the shared table stays as it is)
    assert retrofit_gpt2.main(arguments + ["--arms", "gates", "lora"]) == 0
    output = capsys.readouterr().out
    assert "[pretrained-seed0] complete already" in output and "[gates-seed0] complete already" in output
    record = json.loads((tmp_path / "retrofit_gpt2.json").read_text())
    assert [row["arm"] for row in record["rows"]] == ["pretrained (no fine-tuning)", "gates", "lora"]
    # ... but only when made as this command would make it: another schedule is refused, naming the difference
    assert retrofit_gpt2.main(arguments + ["--arms", "gates", "--max_steps", "7"]) == 2
    assert "gates-seed0 holds a run made with other arguments (max_steps: 6 there, 7 now)" in capsys.readouterr().err
