"""Saved checkpoints carry their code: every class loads with ``trust_remote_code=True`` where hf_spectral is not
installed (a subprocess in which ``import hf_spectral`` fails), with the outputs of the model that was saved.

One subprocess per model family runs every load of that family (it pays the torch/transformers import once).
"""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.dynamic_module_utils import get_imports, get_relative_import_files

import hf_spectral
from hf_spectral import CharTokenizer
from hf_spectral.models.chiar_former import (
    ChiarConfig,
    ChiarForCausalLM,
    ChiarForSequenceClassification,
    ChiarModel,
)
from hf_spectral.models.ega_gpt import EGAConfig, EGAForCausalLM, EGAForSequenceClassification, EGAModel
from hf_spectral.ops import remote_code
from hf_spectral.ops.remote_code import RemoteCodeError, flatten_imports, save_model_code
from hf_spectral.retrofit import EnergyGateConfig, add_energy_gates
from tests.helpers import load_without_plugin

PACKAGE = Path(hf_spectral.__file__).parent
OPS = PACKAGE / "ops"
TEXT = "to be, or not to be: that is the question\n"
# Same code, weights and machine on both sides; the tolerance only absorbs a kernel choice that could differ
# between two processes (none is expected).
ATOL, RTOL = 1e-6, 1e-5
# What the saved code may import besides the standard library: transformers and its own requirements.
ALLOWED_IMPORTS = {"torch", "transformers", "huggingface_hub", "safetensors", "numpy", "packaging"}

# Runs in a fresh interpreter where `import hf_spectral` fails, as on a machine without the plugin. Each job loads
# one folder through one Auto class and records what the parent compares.
_LOADER = textwrap.dedent(
    """
    import json, sys
    sys.modules["hf_spectral"] = None  # any import of the plugin now raises ImportError
    import torch, transformers

    jobs_file, out_file = sys.argv[1:3]
    results = {}
    for job in json.load(open(jobs_file)):
        if job.get("from_config"):  # a folder holding only a config: a new model built from it
            config = transformers.AutoConfig.from_pretrained(job["path"], trust_remote_code=True)
            model = getattr(transformers, job["auto"]).from_config(config, trust_remote_code=True)
            results[job["name"]] = {"class": type(model).__module__ + "." + type(model).__name__,
                                    "gate_parameters": [n for n, _ in model.named_parameters() if ".energy_gate." in n]}
            if job.get("resave"):  # the remotely loaded config saved alone
                config.save_pretrained(job["resave"])
            continue
        loaded = getattr(transformers, job["auto"]).from_pretrained(job["path"], trust_remote_code=True)
        result = {"class": type(loaded).__module__ + "." + type(loaded).__name__}
        if job["auto"] == "AutoTokenizer":
            result["input_ids"] = loaded(job["text"])["input_ids"]
            result["decoded"] = loaded.decode(result["input_ids"])
            results[job["name"]] = result
            continue
        model = loaded.eval()
        saved = torch.load(job["inputs"])
        inputs = saved["inputs"]
        with torch.no_grad():
            result["output"] = getattr(model(**inputs), job["output"])
            if job.get("generate"):
                prompt = {"input_ids": saved["prompt"], "max_new_tokens": 6, "do_sample": False}
                result["generated"] = model.generate(**prompt)
                result["generated_without_cache"] = model.generate(**prompt, use_cache=False)
        if job.get("resave"):  # save_pretrained of a model that was itself loaded as remote code
            model.save_pretrained(job["resave"])
            again = getattr(transformers, job["auto"]).from_pretrained(job["resave"], trust_remote_code=True).eval()
            result["resaved_class"] = type(again).__module__ + "." + type(again).__name__
            with torch.no_grad():
                result["resaved_output"] = getattr(again(**inputs), job["output"])
        results[job["name"]] = result
    leaked = [name for name, module in sys.modules.items()
              if name.split(".")[0] == "hf_spectral" and module is not None]
    assert not leaked, f"hf_spectral was imported: {leaked}"
    torch.save(results, out_file)
    """
)


def run_without_plugin(jobs: list[dict], tmp_path: Path) -> dict:
    jobs_file, out_file = tmp_path / "jobs.json", tmp_path / "results.pt"
    jobs_file.write_text(json.dumps(jobs))
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    result = subprocess.run(
        [sys.executable, "-c", _LOADER, str(jobs_file), str(out_file)],
        cwd=tmp_path,  # not the checkout: only the installed packages are importable
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-6000:]
    return torch.load(out_file)


def tokenizer_in(folder: Path) -> CharTokenizer:
    tokenizer = CharTokenizer.from_text(TEXT, folder / "vocab", pad_token="<pad>")
    tokenizer.save_pretrained(folder)
    return tokenizer


def inputs_file(folder: Path, inputs: dict, prompt: torch.Tensor) -> str:
    path = folder / "inputs.pt"
    torch.save({"inputs": inputs, "prompt": prompt}, path)
    return str(path)


def generate(model, prompt: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(input_ids=prompt, max_new_tokens=6, do_sample=False)


def padded_inputs(tokenizer: CharTokenizer) -> dict:
    batch = tokenizer(["to be, or not", "that is"], padding=True, padding_side="left", return_tensors="pt")
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


# ----------------------------------------------------------------------------------------------------------------
# EGA-GPT and CHIAR-Former: every class, and the tokenizer
# ----------------------------------------------------------------------------------------------------------------

FAMILIES = {
    "ega_gpt": (
        lambda vocab, pad: EGAConfig(
            vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=64,
            energy_kind="conv", energy_scales=[3, 7], gate_alpha_init=1.5, pad_token_id=pad,
        ),
        EGAModel, EGAForCausalLM, EGAForSequenceClassification,
    ),
    "chiar_former": (
        lambda vocab, pad: ChiarConfig(  # DCT, a layer routed among DCT / RBF / attention, attention
            vocab_size=vocab, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, max_position_embeddings=64,
            routed_operators=["dct", "rbf", "attention"], rbf_num_features=16, pad_token_id=pad,
        ),
        ChiarModel, ChiarForCausalLM, ChiarForSequenceClassification,
    ),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_class_and_the_tokenizer_load_without_the_plugin(tmp_path, family):
    make_config, base_class, causal_class, classifier_class = FAMILIES[family]
    tokenizer = tokenizer_in(tmp_path / "tokenizer")
    config = make_config(len(tokenizer), tokenizer.pad_token_id)
    inputs = padded_inputs(tokenizer)
    prompt = torch.tensor([tokenizer("to be")["input_ids"], tokenizer("or no")["input_ids"]])
    expected, jobs = {}, []
    for seed, (auto, model_class, output) in enumerate(
        [
            ("AutoModel", base_class, "last_hidden_state"),
            ("AutoModelForCausalLM", causal_class, "logits"),
            ("AutoModelForSequenceClassification", classifier_class, "logits"),
        ]
    ):
        torch.manual_seed(seed)
        model = model_class(config).eval()
        folder = tmp_path / auto
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        auto_map = json.loads((folder / "config.json").read_text())["auto_map"]
        assert auto_map[auto].endswith(f".{model_class.__name__}")
        assert set(auto_map) == {"AutoConfig", *remote_code.AUTO_MODEL_CLASSES}
        with torch.no_grad():
            expected[auto] = getattr(model(**inputs), output)
        job = {"name": auto, "auto": auto, "path": str(folder), "inputs": inputs_file(folder, inputs, prompt),
               "output": output}
        if auto == "AutoModelForCausalLM":
            expected["generated"] = generate(model, prompt)
            with torch.no_grad():
                expected["bare model of the causal LM"] = model.base_model(**inputs).last_hidden_state
            job.update(generate=True, resave=str(tmp_path / "resaved"))
            # The bare model and a fresh classification head out of the language model's checkpoint.
            jobs.append({**job, "name": "bare model of the causal LM", "auto": "AutoModel",
                         "output": "last_hidden_state", "generate": False, "resave": None})
            jobs.append({**job, "name": "classifier from the causal LM", "auto": "AutoModelForSequenceClassification",
                         "generate": False, "resave": None})
        jobs.append(job)
    jobs.append({"name": "tokenizer", "auto": "AutoTokenizer", "path": str(tmp_path / "AutoModelForCausalLM"),
                 "text": TEXT})
    config.save_pretrained(tmp_path / "config only")  # a config saved alone carries the model code too
    jobs.append({"name": "config only", "path": str(tmp_path / "config only"), "from_config": True,
                 "auto": "AutoModelForCausalLM", "resave": str(tmp_path / "config resaved")})

    results = run_without_plugin(jobs, tmp_path)

    for auto, model_class in (("AutoModel", base_class), ("AutoModelForCausalLM", causal_class),
                              ("AutoModelForSequenceClassification", classifier_class)):
        loaded = results[auto]
        assert loaded["class"].startswith("transformers_modules.")
        assert loaded["class"].endswith(f".{model_class.__name__}")
        torch.testing.assert_close(loaded["output"], expected[auto], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(
        results["bare model of the causal LM"]["output"], expected["bare model of the causal LM"], atol=ATOL, rtol=RTOL
    )
    assert results["bare model of the causal LM"]["class"].endswith(f".{base_class.__name__}")
    assert results["classifier from the causal LM"]["output"].shape == (2, config.num_labels)

    causal = results["AutoModelForCausalLM"]
    assert torch.equal(causal["generated"], expected["generated"])
    assert torch.equal(causal["generated_without_cache"], expected["generated"])
    # Saved again from the remotely loaded model: same code, complete auto_map, same outputs.
    assert causal["resaved_class"].startswith("transformers_modules.resaved.")
    torch.testing.assert_close(causal["resaved_output"], expected["AutoModelForCausalLM"], atol=ATOL, rtol=RTOL)
    first, second = tmp_path / "AutoModelForCausalLM", tmp_path / "resaved"
    model_code = sorted(p.name for p in first.glob("*.py") if p.name != "tokenization_char.py")  # no tokenizer resaved
    assert sorted(p.name for p in second.glob("*.py")) == model_code
    for name in model_code:
        assert (second / name).read_bytes() == (first / name).read_bytes(), name
    assert json.loads((second / "config.json").read_text())["auto_map"] == json.loads(
        (first / "config.json").read_text()
    )["auto_map"]

    assert results["config only"]["class"].endswith(f".{causal_class.__name__}")
    resaved_map = json.loads((tmp_path / "config resaved" / "config.json").read_text())["auto_map"]
    # The remotely loaded config keeps its model classes (transformers caches the modeling file in another folder)
    assert resaved_map == json.loads((first / "config.json").read_text())["auto_map"]
    for reference in resaved_map.values():  # every entry names a file the folder holds
        assert (tmp_path / "config resaved" / f"{reference.rpartition('.')[0]}.py").is_file(), reference

    loaded_tokenizer = results["tokenizer"]
    assert loaded_tokenizer["class"].endswith(".tokenization_char.CharTokenizer")
    assert loaded_tokenizer["input_ids"] == tokenizer(TEXT)["input_ids"]
    assert loaded_tokenizer["decoded"] == TEXT
    tokenizer_map = json.loads((first / "tokenizer_config.json").read_text())["auto_map"]
    assert tokenizer_map["AutoTokenizer"] == ["tokenization_char.CharTokenizer", None]


# ----------------------------------------------------------------------------------------------------------------
# The copies are the package's files
# ----------------------------------------------------------------------------------------------------------------


def _package_source(name: str) -> Path:
    if (OPS / name).is_file():
        return OPS / name
    matches = [path for path in PACKAGE.rglob(name) if OPS not in path.parents]
    assert len(matches) == 1, f"{name}: {matches}"
    return matches[0]


def _relative_imports_flattened(text: str) -> str:
    # The test's own statement of the rewrite: `from ...ops.x import` / `from ..retrofit.x import` -> `from .x import`.
    return re.sub(r"^([ \t]*from[ \t]+)\.+(?:\w+\.)*(\w+)([ \t]+import\b)", r"\1.\2\3", text, flags=re.M)


def _imported_ops(path: Path) -> set:
    return set(re.findall(r"^[ \t]*from[ \t]+\.+ops\.(\w+)[ \t]+import\b", path.read_text(), flags=re.M))


def _saved(tmp_path: Path, model) -> Path:
    model.save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize(
    "build",
    [
        lambda: EGAForCausalLM(FAMILIES["ega_gpt"][0](40, None)),
        lambda: ChiarForSequenceClassification(FAMILIES["chiar_former"][0](40, None)),
        lambda: add_energy_gates(GPT2LMHeadModel(GPT2Config(vocab_size=40, n_embd=32, n_layer=2, n_head=2))),
    ],
    ids=["ega_gpt", "chiar_former", "retrofit"],
)
def test_saved_code_is_the_package_code_with_sibling_imports(tmp_path, build):
    model = build()
    folder = _saved(tmp_path, model)
    saved = {path.name: path for path in folder.glob("*.py")}
    modeling_file = Path(sys.modules[type(model).__module__].__file__)
    config_file = Path(sys.modules[type(model.config).__module__].__file__)
    assert {modeling_file.name, config_file.name, "remote_code.py"} <= set(saved)
    assert {f"{name}.py" for name in _imported_ops(modeling_file) | _imported_ops(config_file)} <= set(saved)
    for name, path in saved.items():
        source = _package_source(name)
        if source.parent == OPS:  # ops files import each other with single dots: byte-identical copies
            assert path.read_bytes() == source.read_bytes(), name
        else:
            assert path.read_text() == _relative_imports_flattened(source.read_text()), name
        assert not re.search(r"^[ \t]*from[ \t]+\.\.", path.read_text(), flags=re.M), name
        needed = set(get_imports(path)) - set(sys.stdlib_module_names)
        assert needed <= ALLOWED_IMPORTS, f"{name} needs {sorted(needed - ALLOWED_IMPORTS)}"
        # What transformers fetches from a Hub repository for this file (its own regex over the text): all present.
        for needed_file in get_relative_import_files(path):
            assert Path(needed_file).is_file(), f"{name} makes transformers look for {Path(needed_file).name}"


# ----------------------------------------------------------------------------------------------------------------
# Retrofitted checkpoints
# ----------------------------------------------------------------------------------------------------------------


def _tiny_llama() -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
    ))


def test_retrofitted_checkpoints_load_without_the_plugin(tmp_path):
    ids = torch.randint(1, 40, (2, 10), generator=torch.Generator().manual_seed(0))
    prompt = ids[:, :4]
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding: the gates see the padding mask
    inputs = {"input_ids": ids, "attention_mask": mask}
    cases = {
        "gpt2": (lambda: GPT2LMHeadModel(GPT2Config(vocab_size=40, n_embd=32, n_layer=2, n_head=2, n_positions=64)),
                 EnergyGateConfig(alpha_init=1.5, tau_init=0.2), "EnergyGatedGPT2LMHeadModel"),
        "gpt2 morlet, one layer": (
            lambda: GPT2LMHeadModel(GPT2Config(vocab_size=40, n_embd=32, n_layer=2, n_head=2, n_positions=64)),
            EnergyGateConfig(energy_kind="morlet", scales=[3, 7], layers=[1], alpha_init=1.0),
            "EnergyGatedGPT2LMHeadModel",
        ),
        "gpt2 classifier": (
            lambda: GPT2ForSequenceClassification(GPT2Config(vocab_size=40, n_embd=32, n_layer=2, n_head=2,
                                                             n_positions=64, pad_token_id=0, num_labels=3)),
            EnergyGateConfig(alpha_init=1.0), "EnergyGatedGPT2ForSequenceClassification",
        ),
        "llama, some heads": (_tiny_llama, EnergyGateConfig(alpha_init=1.5, heads=[1]), "EnergyGatedLlamaForCausalLM"),
        "qwen2": (lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64,
        )), EnergyGateConfig(energy_kind="conv", scales=[3, 5], alpha_init=1.0), "EnergyGatedQwen2ForCausalLM"),
    }
    expected, jobs = {}, []
    for seed, (name, (build, gate_config, class_name)) in enumerate(cases.items()):
        torch.manual_seed(seed)
        model = add_energy_gates(build(), gate_config).eval()
        with torch.no_grad():  # gates away from the identity, so that a checkpoint without them would differ
            for parameter_name, parameter in model.named_parameters():
                if ".energy_gate." in parameter_name:
                    parameter.add_(0.3 * torch.randn_like(parameter))
        folder = tmp_path / name.replace(" ", "_").replace(",", "")
        model.save_pretrained(folder)
        auto_map = json.loads((folder / "config.json").read_text())["auto_map"]
        assert auto_map[
            "AutoModelForSequenceClassification" if "classifier" in name else "AutoModelForCausalLM"
        ] == f"modeling_energy_gated.{class_name}"
        causal = "classifier" not in name
        with torch.no_grad():
            expected[name] = model(**inputs).logits
        if causal:
            expected[name + " generated"] = generate(model, prompt)
        jobs.append({"name": name, "path": str(folder), "inputs": inputs_file(folder, inputs, prompt),
                     "output": "logits",
                     "auto": "AutoModelForCausalLM" if causal else "AutoModelForSequenceClassification",
                     "generate": causal, "resave": str(tmp_path / "resaved") if name == "gpt2" else None})
        if name == "gpt2":
            with torch.no_grad():
                expected["gpt2 bare"] = model.transformer(**inputs).last_hidden_state
            jobs.append({**jobs[-1], "name": "gpt2 bare", "auto": "AutoModel", "output": "last_hidden_state",
                         "generate": False, "resave": None})
            model.config.save_pretrained(tmp_path / "config only")  # the config alone carries the code too
            expected["gate parameters"] = [n for n, _ in model.named_parameters() if ".energy_gate." in n]
            jobs.append({"name": "config only", "path": str(tmp_path / "config only"), "from_config": True,
                         "auto": "AutoModelForCausalLM"})

    results = run_without_plugin(jobs, tmp_path)

    for name, (_, _, class_name) in cases.items():
        loaded = results[name]
        assert loaded["class"].startswith("transformers_modules.") and loaded["class"].endswith(f".{class_name}")
        torch.testing.assert_close(loaded["output"], expected[name], atol=ATOL, rtol=RTOL)
        if "classifier" not in name:
            assert torch.equal(loaded["generated"], expected[name + " generated"])
            assert torch.equal(loaded["generated_without_cache"], expected[name + " generated"])
    assert results["gpt2 bare"]["class"].endswith(".EnergyGatedGPT2Model")
    torch.testing.assert_close(results["gpt2 bare"]["output"], expected["gpt2 bare"], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(results["gpt2"]["resaved_output"], expected["gpt2"], atol=ATOL, rtol=RTOL)
    assert results["config only"]["class"].endswith(".EnergyGatedGPT2LMHeadModel")
    assert results["config only"]["gate_parameters"] == expected["gate parameters"]


# ----------------------------------------------------------------------------------------------------------------
# save_model_code itself
# ----------------------------------------------------------------------------------------------------------------


class UserEGAConfig(EGAConfig):
    """A user's subclasses, in a module that imports hf_spectral by name (which a saved copy could not)."""

    @property
    def doubled(self) -> int:
        return 2 * self.hidden_size


class UserEGAForCausalLM(EGAForCausalLM):
    config_class = UserEGAConfig


class UserChiarForCausalLM(ChiarForCausalLM):
    pass


@pytest.mark.parametrize("family", ["ega_gpt", "chiar_former"])
def test_a_user_subclass_saves_as_its_hf_spectral_base(tmp_path, family):
    """Its checkpoint carries the base's code and loads back as the base, with and without the plugin (as a stock
    subclass's loads as the stock class); saving had refused the subclass's module after writing config.json."""
    torch.manual_seed(0)
    if family == "ega_gpt":
        model = UserEGAForCausalLM(UserEGAConfig(**FAMILIES["ega_gpt"][0](40, None).to_dict())).eval()
        base = ("EGAConfig", "EGAForCausalLM")
    else:
        model = UserChiarForCausalLM(FAMILIES["chiar_former"][0](40, None)).eval()
        base = ("ChiarConfig", "ChiarForCausalLM")
    model.save_pretrained(tmp_path / "saved")
    auto_map = json.loads((tmp_path / "saved" / "config.json").read_text())["auto_map"]
    assert auto_map["AutoConfig"].endswith(f".{base[0]}") and auto_map["AutoModelForCausalLM"].endswith(f".{base[1]}")
    ids = torch.randint(0, 40, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids).logits
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
        assert type(reloaded).__name__ == base[1]
        torch.testing.assert_close(reloaded(ids).logits, expected, atol=1e-6, rtol=1e-5)
    logits, name = load_without_plugin(str(tmp_path / "saved"), "AutoModelForCausalLM", {"input_ids": ids}, tmp_path)
    assert name.startswith("transformers_modules.") and name.endswith(f".{base[1]}")
    torch.testing.assert_close(logits, expected, atol=1e-6, rtol=1e-5)


def test_refuses_what_it_cannot_save(tmp_path):
    model = EGAForCausalLM(FAMILIES["ega_gpt"][0](40, None))
    with pytest.raises(FileNotFoundError, match="call save_pretrained"):
        save_model_code(model, tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        save_model_code(model, tmp_path / "empty")
    assert list((tmp_path / "empty").iterdir()) == []  # nothing written when it refuses
    with pytest.raises(TypeError, match="a model, a config or a tokenizer"):
        save_model_code(object(), tmp_path / "empty")
    stock = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_embd=32, n_layer=1, n_head=2))
    stock.save_pretrained(tmp_path / "stock")
    with pytest.raises(RemoteCodeError, match="GPT2LMHeadModel is a transformers class"):
        save_model_code(stock, tmp_path / "stock")
    assert not list((tmp_path / "stock").glob("*.py"))


def test_an_import_that_cannot_be_flattened_is_named(tmp_path):
    package = tmp_path / "pkg" / "models" / "m"
    package.mkdir(parents=True)
    (tmp_path / "pkg" / "ops").mkdir()
    (tmp_path / "pkg" / "ops" / "helper.py").write_text("X = 1\n")
    good = package / "good.py"
    docstring = '"""from ...nowhere import nothing (a docstring, not an import)"""\n\n'
    good.write_text(docstring + "from ...ops.helper import X\n")
    text, imported = flatten_imports(good)
    assert text == docstring + "from .helper import X\n"
    assert imported == [(tmp_path / "pkg" / "ops" / "helper.py").resolve()]
    for body, message in [
        ("from ...ops.missing import X\n", "does not exist"),
        ("from ...ops import helper\n", "imports a package"),
        ("from .. import m\n", "imports a package"),
        ("import hf_spectral\n", "imports hf_spectral by name"),
        ("def f():\n    from hf_spectral.ops import pooling\n", "line 2"),
    ]:
        bad = package / "bad.py"
        bad.write_text(body)
        with pytest.raises(RemoteCodeError, match=message):
            flatten_imports(bad)


def test_two_different_needed_files_of_one_name_are_refused(tmp_path, monkeypatch):
    """The saved code is flat: two needed files named helper.py would be one file, and the other's code lost."""
    import importlib.util

    def config_importing(package: Path, first: str, second: str):
        (package / "a").mkdir(parents=True)
        (package / "b").mkdir()
        (package / "a" / "helper.py").write_text(first)
        (package / "b" / "helper.py").write_text(second)
        source = package / "a" / "configuration_dup.py"
        # the imports sit in a function that never runs: only the file's text matters to the copy
        source.write_text("from transformers import PreTrainedConfig\n\n\nclass DupConfig(PreTrainedConfig):\n"
                          "    model_type = 'dup_name'\n\n\ndef helpers():\n"
                          "    from .helper import X\n    from ..b.helper import Y\n")
        name = f"_dup_name_{package.name}"
        module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, source))
        monkeypatch.setitem(sys.modules, name, module)
        module.__spec__.loader.exec_module(module)
        config = module.DupConfig()
        config.save_pretrained(package / "saved")
        return config, package / "saved"

    config, saved = config_importing(tmp_path / "same", "X = Y = 1\n", "X = Y = 1\n")
    save_model_code(config, saved)  # two copies of one file (as from two module caches): saved once
    assert sorted(path.name for path in saved.glob("*.py")) == ["configuration_dup.py", "helper.py"]

    config, saved = config_importing(tmp_path / "differ", "X = 1\n", "Y = 2\n")
    with pytest.raises(RemoteCodeError, match="two different files .* same name 'helper.py'"):
        save_model_code(config, saved)
    assert not list(saved.glob("*.py"))  # nothing written when it refuses


def test_an_interrupted_save_leaves_the_previous_files_whole(tmp_path, monkeypatch):
    model = EGAForCausalLM(FAMILIES["ega_gpt"][0](40, None))
    model.save_pretrained(tmp_path)
    before = {path.name: path.read_bytes() for path in tmp_path.iterdir()}
    (tmp_path / "config.json").write_text(json.dumps({**json.loads(before["config.json"]), "auto_map": {}}))
    stale = (tmp_path / "config.json").read_bytes()

    def fail_on_config(source, destination):
        if Path(destination).name == "config.json":
            raise OSError("disk full")
        return os_replace(source, destination)

    os_replace = os.replace
    monkeypatch.setattr(remote_code.os, "replace", fail_on_config)
    with pytest.raises(OSError, match="disk full"):
        save_model_code(model, tmp_path)
    assert (tmp_path / "config.json").read_bytes() == stale  # untouched, not truncated
    assert not [path.name for path in tmp_path.iterdir() if path.name.endswith(".tmp")]
    for name, content in before.items():
        if name != "config.json":
            assert (tmp_path / name).read_bytes() == content


def _folder_bytes(folder: Path) -> dict:
    return {str(path.relative_to(folder)): path.read_bytes() for path in folder.rglob("*") if path.is_file()}


def test_a_save_that_fails_midway_leaves_the_folder_as_it_was(tmp_path, monkeypatch):
    folder = tmp_path / "model"
    causal = EGAForCausalLM(EGAConfig.from_variant("EGA-1", vocab_size=40, hidden_size=32, num_hidden_layers=1,
                                                   num_attention_heads=2)).eval()
    causal.save_pretrained(folder)
    (folder / "notes.txt").write_text("the user's own file")
    before = _folder_bytes(folder)
    window = EGAForCausalLM(EGAConfig.from_variant("EGA-1", vocab_size=40, hidden_size=32, num_hidden_layers=1,
                                                   num_attention_heads=2, energy_normalization="window"))

    def full_disk(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full_disk)  # fails writing the weights
    with pytest.raises(OSError, match="No space left"):
        window.save_pretrained(folder)
    with pytest.raises(OSError, match="No space left"):
        window.save_pretrained(tmp_path / "new" / "model")
    monkeypatch.undo()

    assert _folder_bytes(folder) == before  # nothing written, nothing left behind (no staging folder)
    assert not (tmp_path / "new").exists()  # the folders the failed save created are gone
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert loaded.config.energy_normalization == "causal"
    input_ids = torch.randint(0, 40, (1, 8))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids).logits, causal(input_ids).logits)


def test_a_new_save_replaces_the_weights_files_of_the_earlier_one(tmp_path):
    model = EGAForCausalLM(EGAConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2))
    model.save_pretrained(tmp_path, max_shard_size="20KB")  # sharded, with an index
    assert (tmp_path / "model.safetensors.index.json").is_file()
    (tmp_path / "tokenizer_config.json").write_text("{}")  # not a weights file: stays
    model.save_pretrained(tmp_path)
    names = sorted(path.name for path in tmp_path.iterdir())
    assert [name for name in names if "safetensors" in name] == ["model.safetensors"]
    assert "tokenizer_config.json" in names and not [name for name in names if name.startswith(".saving")]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_saved_files_get_ordinary_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        EGAForCausalLM(FAMILIES["ega_gpt"][0](40, None)).save_pretrained(tmp_path)
    finally:
        os.umask(old)
    for path in tmp_path.glob("*.py"):
        assert path.stat().st_mode & 0o777 == 0o644, path.name


def test_the_plugin_still_loads_its_own_classes_from_a_folder_with_remote_code(tmp_path):
    model = EGAForCausalLM(FAMILIES["ega_gpt"][0](40, None)).eval()
    model.save_pretrained(tmp_path)
    for auto, expected_class in (("AutoModelForCausalLM", EGAForCausalLM), ("AutoModel", EGAModel),
                                 ("AutoModelForSequenceClassification", EGAForSequenceClassification)):
        loaded = getattr(transformers, auto).from_pretrained(tmp_path)  # no trust_remote_code: the plugin's classes
        assert type(loaded) is expected_class


def test_push_to_hub_uploads_the_code_with_the_weights(tmp_path, monkeypatch):
    import transformers.utils.hub as hub

    uploads = []

    class FakeApi:
        def create_repo(self, repo_id, **kwargs):
            return type("RepoUrl", (), {"repo_id": repo_id})()

    class FakeCard:
        def save(self, path):
            Path(path).write_text("card\n")

    def upload(self, working_dir, repo_id, files_timestamps, **kwargs):
        folder = Path(working_dir)
        files = [p for p in folder.iterdir() if p.name not in files_timestamps or
                 p.stat().st_mtime > files_timestamps[p.name]]  # what transformers' upload sends
        uploads.append({"folder": folder, "repo_id": repo_id, "files": sorted(p.name for p in files),
                        "auto_map": json.loads((folder / "config.json").read_text())["auto_map"],
                        "commit_message": kwargs.get("commit_message")})

    monkeypatch.setattr(hub, "hf_api", FakeApi)
    monkeypatch.setattr(hub, "create_and_tag_model_card", lambda *args, **kwargs: FakeCard())
    monkeypatch.setattr(hub.PushToHubMixin, "_upload_modified_files", upload)
    model = EGAForCausalLM(FAMILIES["ega_gpt"][0](40, None))
    model.save_pretrained(tmp_path / "local", push_to_hub=True, repo_id="someone/ega", commit_message="first")
    assert len(uploads) == 1  # the upload happens once, after the code is written
    pushed = uploads[0]
    assert pushed["repo_id"] == "someone/ega" and pushed["commit_message"] == "first"
    expected_files = {"modeling_ega_gpt.py", "configuration_ega_gpt.py", "remote_code.py", "model.safetensors"}
    assert expected_files <= set(pushed["files"])
    assert pushed["auto_map"]["AutoModel"] == "modeling_ega_gpt.EGAModel"
    assert (tmp_path / "local" / "modeling_ega_gpt.py").is_file()  # the local folder is complete as well
    # The folder saved is the folder uploaded: a given state_dict and variant are kept, and the code goes up again
    # even where it was written by an earlier save.
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    state["model.ln_f.weight"].zero_()
    model.save_pretrained(tmp_path / "local", push_to_hub=True, repo_id="someone/ega", state_dict=state,
                          variant="v1")
    pushed = uploads[1]
    assert pushed["folder"] == tmp_path / "local"
    assert {"model.v1.safetensors", "modeling_ega_gpt.py", "configuration_ega_gpt.py"} <= set(pushed["files"])
    from safetensors.torch import load_file

    assert not load_file(tmp_path / "local" / "model.v1.safetensors")["model.ln_f.weight"].any()
    # A process other than the main one writes no code (transformers writes nothing either).
    model.save_pretrained(tmp_path / "other rank", is_main_process=False)
    assert not list((tmp_path / "other rank").glob("*.py"))


_RESAVE_CONFIGS = textwrap.dedent(
    """
    import json, sys
    sys.modules["hf_spectral"] = None
    import transformers

    own, other, out = sys.argv[1:4]
    config = transformers.AutoConfig.from_pretrained(own, trust_remote_code=True)
    if other == "-":  # (a process of its own: transformers would load the other's code for it after the other's)
        transformers.AutoModelForCausalLM.from_pretrained(own, trust_remote_code=True)
        config.save_pretrained(f"{out}/with its model")
        sys.exit()
    before = set(sys.modules)
    config.save_pretrained(f"{out}/alone")
    imported = sorted(name for name in set(sys.modules) - before if name.startswith("transformers_modules"))
    transformers.AutoModelForCausalLM.from_pretrained(other, trust_remote_code=True)
    config.save_pretrained(f"{out}/beside the other")
    json.dump(imported, open(f"{out}/imported.json", "w"))
    """
)


def test_a_remotely_loaded_config_saves_the_code_it_was_loaded_with_and_imports_none(tmp_path):
    # Two checkpoints of one folder name (transformers caches both under it) with different modeling code.
    model = EGAForCausalLM(EGAConfig(vocab_size=40, hidden_size=32, num_hidden_layers=1, num_attention_heads=2))
    own, other = tmp_path / "a" / "ckpt", tmp_path / "b" / "ckpt"
    model.save_pretrained(own)
    model.save_pretrained(other)
    with open(other / "modeling_ega_gpt.py", "a", encoding="utf-8") as handle:
        handle.write("\n# another checkpoint's modeling code\n")
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    result, resaved = (
        subprocess.run([sys.executable, "-c", _RESAVE_CONFIGS, str(own), second, str(tmp_path)], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=300)
        for second in (str(other), "-")
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert resaved.returncode == 0, resaved.stderr[-4000:]

    assert json.loads((tmp_path / "imported.json").read_text()) == []  # saving ran no checkpoint code
    config_only = {"AutoConfig": "configuration_ega_gpt.EGAConfig"}
    for name in ("alone", "beside the other"):  # its modeling code never loaded: it is not shipped, nor the other's
        assert json.loads((tmp_path / name / "config.json").read_text())["auto_map"] == config_only
        assert not (tmp_path / name / "modeling_ega_gpt.py").exists()
        assert "saved without AutoModelForCausalLM" in result.stderr
    with_model = tmp_path / "with its model"
    assert json.loads((with_model / "config.json").read_text())["auto_map"] == json.loads(
        (own / "config.json").read_text())["auto_map"]
    assert (with_model / "modeling_ega_gpt.py").read_bytes() == (own / "modeling_ega_gpt.py").read_bytes()


def test_a_tokenizer_gets_its_file_and_auto_map(tmp_path):
    tokenizer = tokenizer_in(tmp_path)
    config_file = tmp_path / "tokenizer_config.json"
    values = json.loads(config_file.read_text())
    assert values["auto_map"] == {"AutoTokenizer": ["tokenization_char.CharTokenizer", None]}  # transformers' save
    (tmp_path / "tokenization_char.py").unlink()
    config_file.write_text(json.dumps({key: value for key, value in values.items() if key != "auto_map"}))
    written = save_model_code(tokenizer, tmp_path)
    assert sorted(Path(path).name for path in written) == ["tokenization_char.py", "tokenizer_config.json"]
    assert (tmp_path / "tokenization_char.py").read_bytes() == (PACKAGE / "tokenization_char.py").read_bytes()
    assert json.loads(config_file.read_text()) == values


def test_a_model_whose_gates_were_removed_saves_as_the_stock_model(tmp_path):
    from hf_spectral.retrofit import remove_energy_gates

    gated = add_energy_gates(GPT2LMHeadModel(GPT2Config(vocab_size=40, n_embd=32, n_layer=1, n_head=2)))
    gated.save_pretrained(tmp_path / "gated")
    stock = remove_energy_gates(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "gated"))
    stock.save_pretrained(tmp_path / "stock")
    assert not list((tmp_path / "stock").glob("*.py"))
    assert "auto_map" not in json.loads((tmp_path / "stock" / "config.json").read_text())


# ----------------------------------------------------------------------------------------------------------------
# Model cards: the usage blocks run as written, where hf_spectral is not installed and where it is
# ----------------------------------------------------------------------------------------------------------------


def _usage_block(card_text: str, heading: str) -> str:
    """The first python block below the subsection ``### {heading}`` of a model card."""
    section = card_text.split(f"\n### {heading}", 1)
    assert len(section) == 2, f"the card has no subsection {heading!r}"
    block = re.search(r"```python\n(.*?)```", section[1], flags=re.S)
    assert block, f"no python block under {heading!r}"
    return block.group(1)


def test_model_card_usage_blocks_run_with_and_without_the_plugin(tmp_path):
    from training.common.model_card import FAMILIES as CARD_FAMILIES, render_model_card

    tokenizer = tokenizer_in(tmp_path / "tokenizer")
    EGAForCausalLM(EGAConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                             max_position_embeddings=256)).save_pretrained(tmp_path / "ega_gpt")
    ChiarForCausalLM(FAMILIES["chiar_former"][0](len(tokenizer), tokenizer.pad_token_id)).save_pretrained(
        tmp_path / "chiar_former"
    )
    add_energy_gates(GPT2LMHeadModel(GPT2Config(vocab_size=40, n_embd=32, n_layer=1, n_head=2))).save_pretrained(
        tmp_path / "energy_gated"
    )
    for folder in ("ega_gpt", "chiar_former"):
        tokenizer.save_pretrained(tmp_path / folder)
    loaded_class = {"ega_gpt": "EGAForCausalLM", "chiar_former": "ChiarForCausalLM",
                    "energy_gated": "EnergyGatedGPT2LMHeadModel"}
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    for family in CARD_FAMILIES:
        card = render_model_card(family, repo_id=str(tmp_path / family), prompt="to be").text
        without_plugin, with_plugin = _usage_block(card, "Without hf_spectral"), _usage_block(card, "With hf_spectral")
        assert "trust_remote_code=True" in without_plugin and "import hf_spectral" not in without_plugin, family
        assert with_plugin.startswith("import hf_spectral") and "trust_remote_code" not in with_plugin, family
        for block, plugin in ((without_plugin, False), (with_plugin, True)):
            script = ("" if plugin else 'import sys\nsys.modules["hf_spectral"] = None\n') + block
            script += "\nprint(type(model).__name__, type(model).__module__.startswith('hf_spectral'))\n"
            result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True,
                                    text=True, timeout=300)
            assert result.returncode == 0, f"{family}, plugin {plugin}:\n{script}\n{result.stderr[-3000:]}"
            # remote code runs from transformers' modules cache, the plugin's classes from hf_spectral
            assert result.stdout.splitlines()[-1] == f"{loaded_class[family]} {plugin}", (family, result.stdout)


def test_an_older_transformers_is_refused_on_import_naming_both_versions():
    remote_code.check_transformers_version(transformers.__version__)  # the installed one passes
    remote_code.check_transformers_version(remote_code.MINIMUM_TRANSFORMERS)
    with pytest.raises(ImportError, match=r"need transformers >= 5\.24\.0, but transformers 5\.23\.0 is installed"):
        remote_code.check_transformers_version("5.23.0")


def test_the_declared_transformers_floor_is_the_one_the_code_checks():
    setup_cfg = (PACKAGE.parent / "setup.cfg").read_text()
    floor = re.search(r"^\s*transformers>=([\d.]+),<[\d.]+\s*$", setup_cfg, re.MULTILINE)
    assert floor is not None, "setup.cfg must declare transformers>=X,<Y"
    assert Version(floor.group(1)) == Version(remote_code.MINIMUM_TRANSFORMERS)


# ----------------------------------------------------------------------------------------------------------------
# A saved config loads back equal to itself (transformers' ConfigTester checks)
# ----------------------------------------------------------------------------------------------------------------


def _tiny_gated_config(family: str):
    stock = {
        "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=40, n_embd=32, n_layer=1, n_head=2)),
        "llama": _tiny_llama,
        "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(
            vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2)),
        "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
            vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2)),
    }[family]()
    return add_energy_gates(stock, EnergyGateConfig(normalization="causal", layers=[0])).config


CONFIGS = {
    "EGAConfig": lambda: EGAConfig.from_variant("EGA-M", hidden_size=32, num_attention_heads=2),
    "ChiarConfig": lambda: ChiarConfig(hidden_size=32, num_attention_heads=2, routed_operators=["dct", "attention"]),
    **{f"EnergyGated-{family}": (lambda family=family: _tiny_gated_config(family))
       for family in ("gpt2", "llama", "mistral", "qwen2")},
}


@pytest.mark.parametrize("name", CONFIGS)
def test_a_saved_config_loads_back_equal_to_itself(tmp_path, name):
    config = CONFIGS[name]()
    config.save_pretrained(tmp_path)
    for loaded in (type(config).from_pretrained(tmp_path), transformers.AutoConfig.from_pretrained(tmp_path)):
        assert type(loaded) is type(config)
        # AutoConfig records the folder it read (a stock config's too): the one key the save cannot know.
        if loaded._name_or_path == str(tmp_path):
            loaded._name_or_path = config._name_or_path
        assert loaded.to_dict() == config.to_dict()
        assert loaded.to_diff_dict() == config.to_diff_dict()
        assert loaded.to_json_string() == config.to_json_string()
    # The object holds what its file says, the auto_map included, and saving it again writes the same file.
    assert json.loads((tmp_path / "config.json").read_text())["auto_map"] == config.auto_map
    config.save_pretrained(tmp_path / "again")
    assert (tmp_path / "again" / "config.json").read_text() == (tmp_path / "config.json").read_text()


@pytest.mark.parametrize("name", CONFIGS)
def test_a_saved_model_loads_back_with_an_equal_config(tmp_path, name):
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[name]())
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is type(model)
    expected = {**model.config.to_dict(), "_name_or_path": str(tmp_path)}  # from_pretrained records its folder
    assert loaded.config.to_dict() == expected
