"""The GPT-2 retrofit recipe: pretrain once, fine-tune arms at equal budget, artefacts that reload."""

import json
import shutil

import pytest
import torch

import hf_spectral  # noqa: F401  (registers the energy-gated model types)
from training import retrofit_gpt2

from .conftest import synthetic_text


@pytest.fixture(scope="module")
def retrofit_run(tiny_shakespeare, tmp_path_factory):
    wiki = tmp_path_factory.mktemp("wikitext-2")
    for name, size, seed in (("train.txt", 40_000, 5), ("valid.txt", 8_000, 6), ("test.txt", 8_000, 7)):
        (wiki / name).write_text(synthetic_text(size, seed).lower(), encoding="utf-8")
    out = tmp_path_factory.mktemp("retrofit")
    arguments = ["--smoke", "--pretrain_data_path", str(wiki), "--finetune_data_path", tiny_shakespeare,
                 "--output_dir", str(out), "--threads", "2"]
    code = retrofit_gpt2.main(arguments + ["--arms", "full", "gates", "gates+lora"])
    return {"dir": out, "code": code, "arguments": arguments}


def test_every_arm_is_fine_tuned_for_the_same_budget_and_tabulated(retrofit_run):
    assert retrofit_run["code"] == 0
    record = json.loads((retrofit_run["dir"] / "retrofit_gpt2.json").read_text())
    rows = {row["arm"]: row for row in record["rows"]}
    assert set(rows) == {"pretrained (no fine-tuning)", "full", "gates", "gates+lora"}
    runs = {run["arm"]: run for run in record["runs"]}
    assert {run["steps"] for run in runs.values()} == {retrofit_gpt2.PRESETS["smoke"].finetune_steps}
    assert runs["gates"]["trainable_parameters"] < runs["gates+lora"]["trainable_parameters"] < runs["full"]["trainable_parameters"]
    assert rows["gates"]["delta_vs_full"] == pytest.approx(runs["full"]["val_loss"] - runs["gates"]["val_loss"])
    assert all(run["pretrain_val_loss"] > 0 for run in runs.values())
    assert (retrofit_run["dir"] / "retrofit_gpt2.md").read_text().count("| gates") == 2


def test_gates_only_arm_trains_nothing_but_the_gates(retrofit_run):
    from transformers import AutoModelForCausalLM

    pretrained = AutoModelForCausalLM.from_pretrained(retrofit_run["dir"] / "pretrained-seed0")
    gated = AutoModelForCausalLM.from_pretrained(retrofit_run["dir"] / "gates-seed0")
    assert type(gated).__name__ == "EnergyGatedGPT2LMHeadModel"
    stock = pretrained.state_dict()
    for name, tensor in gated.state_dict().items():
        if ".energy_gate." in name:
            continue
        assert torch.equal(tensor, stock[name]), name
    assert any(gated.transformer.h[0].attn.energy_gate.alpha.flatten() != 0)  # the gates did move


def test_the_gates_file_rebuilds_the_fine_tuned_model_from_the_pretrained_one(retrofit_run):
    from transformers import AutoModelForCausalLM

    from hf_spectral.retrofit import load_energy_gates

    base = AutoModelForCausalLM.from_pretrained(retrofit_run["dir"] / "pretrained-seed0").eval()
    load_energy_gates(base, str(retrofit_run["dir"] / "gates-seed0" / "energy_gates.safetensors"))
    saved = AutoModelForCausalLM.from_pretrained(retrofit_run["dir"] / "gates-seed0").eval()
    ids = torch.randint(0, base.config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(base(ids).logits, saved(ids).logits, atol=1e-6)


def test_gates_with_lora_are_saved_in_the_adapter_and_reload(retrofit_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hf_spectral.retrofit import EnergyGateConfig, add_energy_gates

    run_dir = retrofit_run["dir"] / "gates_lora-seed0"
    assert (run_dir / "adapter_model.safetensors").is_file() and (run_dir / "energy_gate_config.json").is_file()
    base = AutoModelForCausalLM.from_pretrained(retrofit_run["dir"] / "pretrained-seed0")
    add_energy_gates(base, EnergyGateConfig.from_pretrained(str(run_dir)))
    model = PeftModel.from_pretrained(base, str(run_dir))
    summary = json.loads((run_dir / "summary.json").read_text())
    tau = next(p for n, p in model.named_parameters() if n.endswith("h.1.attn.energy_gate.modules_to_save.default.tau"))
    assert torch.allclose(tau, torch.tensor(summary["gates"]["per_layer"]["1"]["tau"]))
    card = (run_dir / "README.md").read_text()
    assert "model-index" in card and "PeftModel.from_pretrained" in card


def test_the_pretrained_model_is_reused_by_later_invocations(retrofit_run, capsys, tmp_path):
    out = shutil.copytree(retrofit_run["dir"], tmp_path / "copy")  # these runs rewrite the table: not the shared one
    arguments = list(retrofit_run["arguments"])
    arguments[arguments.index("--output_dir") + 1] = str(out)
    assert retrofit_gpt2.main(arguments + ["--arms", "lora", "--no_plots"]) == 0
    output = capsys.readouterr().out
    assert "[pretrained-seed0] complete already" in output
    record = json.loads((out / "retrofit_gpt2.json").read_text())
    assert [row["arm"] for row in record["rows"]] == ["pretrained (no fine-tuning)", "lora"]
    # Finished arms are reused by an invocation that asks for other arms too
    assert retrofit_gpt2.main(arguments + ["--arms", "gates", "lora", "--no_plots"]) == 0
    assert "[gates-seed0] complete already" in capsys.readouterr().out
    # ... but only when made as this command would make it: another size is refused, naming the difference
    with pytest.raises(SystemExit, match="pretrained-seed0 holds a run made with other settings \\(hidden_size: "):
        retrofit_gpt2.main(arguments + ["--arms", "lora", "--no_plots", "--hidden_size", "64"])


def test_arms_from_another_pretrained_model_or_other_data_are_not_reused(retrofit_run, tmp_path):
    """Each arm records the pretraining seed and both corpora; the pretrained model records its data and the
    vocabulary. Arms had been reused silently, next to a pretrained model they did not start from."""
    arguments = retrofit_run["arguments"] + ["--arms", "gates", "--no_plots"]
    with pytest.raises(SystemExit, match="gates-seed0 holds a run made with other settings \\(pretrain_seed: 0 there"):
        retrofit_gpt2.main(arguments + ["--pretrain_seed", "1"])
    shorter = tmp_path / "shakespeare.txt"
    text = open(arguments[arguments.index("--finetune_data_path") + 1], encoding="utf-8").read()
    shorter.write_text(text[: len(text) * 3 // 4], encoding="utf-8")
    arguments[arguments.index("--finetune_data_path") + 1] = str(shorter)
    # Fine-tuning text with the same characters: the pretrained model (its data, the same vocabulary) is reused, the
    # arm is not
    with pytest.raises(SystemExit, match="gates-seed0 holds a run made with other settings \\(data: "):
        retrofit_gpt2.main(arguments)


@pytest.mark.parametrize("threads", ["0", "-2"])
def test_thread_counts_below_one_are_usage_errors(threads, capsys):
    with pytest.raises(SystemExit) as exit_info:
        retrofit_gpt2.main(["--threads", threads])
    assert exit_info.value.code == 2
    assert f"argument --threads: must be a positive integer, got {threads}" in capsys.readouterr().err


@pytest.mark.parametrize("normalization", ["causal", "window"])
def test_a_window_gated_arm_card_marks_its_losses_as_seeing_future_tokens(normalization, tmp_path):
    from huggingface_hub import ModelCard

    args = retrofit_gpt2.build_parser().parse_args(["--smoke", "--gate_normalization", normalization])
    summary = {"val_loss": 2.5, "train_loss": 2.4, "generalization_gap": 0.1, "pretrain_val_loss": 3.0}
    retrofit_gpt2.write_arm_card(str(tmp_path), "gates", 0, retrofit_gpt2.PRESETS["smoke"], args, summary,
                                 retrofit_gpt2.gate_config_from(args), "someone/rf")
    names = [result.metric_name for result in ModelCard.load(tmp_path / "README.md").data.eval_results]
    assert names and all(("sees future tokens" in name) == (normalization == "window") for name in names)
