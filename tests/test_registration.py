"""What ``import hf_spectral`` registers with transformers."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers.trainer_pt_utils import LabelSmoother

from hf_spectral import ChiarConfig, ChiarForCausalLM, EGAConfig, EGAForCausalLM
from hf_spectral.retrofit import add_energy_gates


def _causal_lms():
    torch.manual_seed(0)
    ega = EGAForCausalLM(EGAConfig.from_variant("EGA-1", vocab_size=40, hidden_size=32, num_hidden_layers=1,
                                                num_attention_heads=2, max_position_embeddings=16))
    chiar = ChiarForCausalLM(ChiarConfig(vocab_size=40, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                         max_position_embeddings=16, rbf_num_features=8))
    gpt2 = add_energy_gates(GPT2LMHeadModel(GPT2Config(vocab_size=40, n_embd=32, n_layer=1, n_head=2, n_positions=16)))
    return {"ega": ega, "chiar": chiar, "retrofitted gpt2": gpt2}


@pytest.mark.parametrize("name", ["ega", "chiar", "retrofitted gpt2"])
def test_trainer_label_smoothing_shifts_the_labels_of_every_causal_lm(name, tmp_path):
    # Trainer shifts labels for label smoothing only for the causal-LM names transformers lists; unlisted, each
    # position would be trained to predict its own token.
    model = _causal_lms()[name].eval()
    ids = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(1))
    arguments = TrainingArguments(output_dir=str(tmp_path), label_smoothing_factor=0.1, use_cpu=True, report_to=[])
    trainer = Trainer(model=model, args=arguments)
    with torch.no_grad():
        loss = trainer.compute_loss(model, {"input_ids": ids, "labels": ids})
        logits = model(ids).logits
    smoother = LabelSmoother(epsilon=0.1)
    shifted = smoother({"logits": logits}, ids, shift_labels=True)
    assert not torch.allclose(shifted, smoother({"logits": logits}, ids))  # the two objectives differ here
    torch.testing.assert_close(loss, shifted)


@pytest.mark.parametrize("config_class", [EGAConfig, ChiarConfig], ids=["ega", "chiar"])
def test_auto_tokenizer_finds_the_char_tokenizer_from_the_config_alone(config_class, tmp_path):
    """A folder with config.json and the vocabulary but no tokenizer_config.json: AutoTokenizer picks the tokenizer
    class from the config's type, which import hf_spectral registers for both model types."""
    from transformers import AutoTokenizer

    from hf_spectral import CharTokenizer

    config_class(vocab_size=40).save_pretrained(tmp_path)
    CharTokenizer.from_text("abc", str(tmp_path))
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("tokenizer")]
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert type(tokenizer) is CharTokenizer
    assert tokenizer("cab")["input_ids"] == [2, 0, 1]
