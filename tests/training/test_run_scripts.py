"""What run_clm and run_classification share (training/common/run_scripts.py): the optimiser of the additions, what
is logged while training, the saves' file modes, the config of a new model."""

import os
import stat

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from hf_spectral import EGAConfig, EGAForCausalLM
from training.common.run_scripts import (
    ModelArguments,
    SpectralArguments,
    SpectralTrainer,
    build_tokenizer,
    gate_values,
    parse_config_overrides,
)


def ega_model():
    torch.manual_seed(0)
    return EGAForCausalLM(EGAConfig.from_variant("EGA-C", vocab_size=20, hidden_size=16, num_hidden_layers=2,
                                                 num_attention_heads=2, max_position_embeddings=16))


def groups(trainer):
    names = {id(p): name for name, p in trainer.model.named_parameters()}
    return [({names[id(p)] for p in group["params"]}, group["lr"], group["weight_decay"])
            for group in trainer.create_optimizer().param_groups]


def test_the_gates_scalars_get_no_weight_decay_unless_asked(tmp_path):
    arguments = TrainingArguments(output_dir=str(tmp_path), weight_decay=0.1, learning_rate=1e-3, report_to=[])
    decayed = set().union(*(names for names, _, decay in groups(SpectralTrainer(
        model=ega_model(), args=arguments, spectral_args=SpectralArguments())) if decay))
    scalars = {name for name in decayed if name.rsplit(".", 1)[1] in ("tau", "alpha", "mix_logits")}
    assert not scalars and any(".energy_gate.energy.convs" in name for name in decayed)  # matrices are decayed
    everything = SpectralTrainer(model=ega_model(), args=arguments,
                                 spectral_args=SpectralArguments(gate_scalar_weight_decay=True))
    assert any(name.endswith(".energy_gate.tau") for names, _, decay in groups(everything) if decay for name in names)


def test_the_gates_train_at_their_own_learning_rate(tmp_path):
    arguments = TrainingArguments(output_dir=str(tmp_path), weight_decay=0.1, learning_rate=1e-3, report_to=[])
    trainer = SpectralTrainer(model=ega_model(), args=arguments,
                              spectral_args=SpectralArguments(gate_learning_rate=0.5))
    found = groups(trainer)
    gates = [(lr, decay) for names, lr, decay in found for name in names if ".energy_gate." in name]
    others = [(lr, decay) for names, lr, decay in found for name in names if ".energy_gate." not in name]
    assert {lr for lr, _ in gates} == {0.5} and {lr for lr, _ in others} == {1e-3}
    assert {decay for _, decay in gates} == {0.0, 0.1}  # the matrices of the gates still decay, the scalars do not
    assert sum(len(names) for names, _, _ in found) == sum(1 for _ in trainer.model.parameters())
    assert len(trainer.create_optimizer().param_groups) == len(found)  # created once: not split again


def test_gate_values_are_read_per_layer_and_head_from_the_trained_copy():
    model = ega_model()
    with torch.no_grad():
        model.model.h[1].attn.energy_gate.tau[1] = torch.tensor([0.1, 0.2, 0.3, 0.4])
    values = gate_values(model)
    assert set(values) == {f"gates/L{layer}/H{head}/{name}" for layer in (0, 1) for head in (0, 1)
                           for name in ("tau", "alpha")}
    assert values["gates/L1/H1/tau"] == pytest.approx(0.25) and values["gates/L0/H0/alpha"] == 2.0
    assert gate_values(GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=20))) == {}


def test_save_model_gives_the_model_files_the_umasks_modes_and_leaves_the_folders_other_files_alone(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "private_notes.txt").write_text("mine")
    os.chmod(folder / "private_notes.txt", 0o600)
    model = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=32, n_positions=16))
    trainer = SpectralTrainer(model=model, args=TrainingArguments(output_dir=str(folder), report_to=[]),
                              spectral_args=SpectralArguments())
    previous = os.umask(0o022)
    try:
        trainer.save_model()
    finally:
        os.umask(previous)
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in folder.iterdir()}
    assert modes.pop("private_notes.txt") == 0o600
    assert modes["model.safetensors"] == 0o644 and modes == dict.fromkeys(modes, 0o644), modes


def test_the_char_tokenizer_reads_a_literal_unk_in_the_text_as_characters(tmp_path):
    """Penn Treebank writes unknown words as the text "<unk>": a character-level benchmark predicts its five
    characters, as the literature counts them; a character never seen in training is the unknown-token id."""
    tokenizer = build_tokenizer(ModelArguments(model_type="gpt2", tokenizer_name="char"), ["the_<unk>_rose\n"])
    ids = tokenizer("a_<unk>_z")["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == ["<unk>", "_", "<", "u", "n", "k", ">", "_", "<unk>"]
    assert ids[0] == ids[-1] == tokenizer.unk_token_id not in ids[1:-1]
    tokenizer.save_pretrained(tmp_path)
    assert type(tokenizer).from_pretrained(tmp_path)("<unk>")["input_ids"] == ids[2:7]


@pytest.mark.parametrize("pad_token, expected_pad", [(None, "<pad>"), ("[PAD]", "[PAD]")],
                         ids=["run_clm", "a pad token of the recipe's own"])
def test_the_char_tokenizer_ends_with_unk_pad_and_eos_after_the_characters(pad_token, expected_pad):
    """The recipes' models are sized to the tokenizer: the characters keep ids 0..n-1 (the data is unchanged) and
    the special tokens take the three ids after them, so batched generation and lm-eval work with what they save."""
    text = "to be, or not\n"
    tokenizer = build_tokenizer(ModelArguments(model_type="gpt2", tokenizer_name="char"), [text], pad_token)
    characters = len(set(text))
    assert tokenizer.convert_tokens_to_ids(sorted(set(text))) == list(range(characters))
    assert [tokenizer.unk_token_id, tokenizer.pad_token_id, tokenizer.eos_token_id] == [characters, characters + 1,
                                                                                        characters + 2]
    assert tokenizer.pad_token == expected_pad and tokenizer.eos_token == "<eos>" and len(tokenizer) == characters + 3
    assert tokenizer(text)["input_ids"] == tokenizer.convert_tokens_to_ids(list(text))  # nothing added to the text
    bare = build_tokenizer(ModelArguments(model_type="gpt2", tokenizer_name="char", char_eos_and_pad=False), [text])
    assert len(bare) == characters + 1 and bare.eos_token is None and bare.unk_token_id == characters


def test_config_overrides_read_null_as_none():
    defaults = GPT2Config()
    assert parse_config_overrides("bos_token_id=null,n_layer=2,layer_norm_epsilon=1e-6", defaults) == {
        "bos_token_id": None, "n_layer": 2, "layer_norm_epsilon": 1e-6}


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_a_new_model_gets_the_attention_backend_asked_for(implementation, tmp_path):
    from transformers import AutoModelForCausalLM

    from hf_spectral import CharTokenizer
    from training.common.run_scripts import ModelArguments, build_config, build_model

    arguments = ModelArguments(model_type="ega_gpt", variant="EGA-1", attn_implementation=implementation,
                               config_overrides="num_hidden_layers=1,hidden_size=16,num_attention_heads=2")
    tokenizer = CharTokenizer.from_text("abc", str(tmp_path))
    model = build_model(AutoModelForCausalLM, arguments, build_config(arguments), tokenizer)
    assert model.config._attn_implementation == implementation
