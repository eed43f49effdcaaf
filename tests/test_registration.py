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


_CIRCLE = ("hf_spectral.registration", "hf_spectral.peft_integration", "hf_spectral.retrofit")


def _imports_of(module_name: str) -> set[str]:
    """The hf_spectral modules that ``module_name``'s source imports (anywhere in it, functions included), among
    the three modules of the former import circle."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec(module_name)
    paths = [spec.origin]
    if spec.submodule_search_locations:  # a package: every file of it
        import pathlib

        paths = [str(path) for location in spec.submodule_search_locations for path in pathlib.Path(location).glob("*.py")]
    package = module_name if spec.submodule_search_locations else module_name.rpartition(".")[0]
    found = set()
    for path in paths:
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")
                if node.level:
                    base = base[: len(base) - node.level + 1] if node.level > 1 else base
                name = ".".join(base + ([node.module] if node.module else [])) if node.level else node.module
                found.update(other for other in _CIRCLE if name and (name == other or name.startswith(other + ".")))
    return found - {module_name}


def test_registration_peft_integration_and_retrofit_import_in_no_circle():
    """Each of the three imports alone in a fresh interpreter, and none imports one that imports it back."""
    import subprocess
    import sys

    for name in _CIRCLE:
        result = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, (name, result.stderr[-2000:])
    edges = {name: _imports_of(name) for name in _CIRCLE}
    for name, imported in edges.items():
        for other in imported:
            assert name not in edges[other], f"{name} imports {other}, which imports {name} back"
    assert edges["hf_spectral.retrofit"] == set()  # the retrofit needs neither PEFT's helpers nor the registration
