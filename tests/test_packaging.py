"""The built wheel is a complete package: installed into a fresh environment and run from a folder outside the
checkout, it answers `hf-spectral --version`, trains a benchmark (`hf-spectral train tinyshakespeare --smoke`) and
retrofits a checkpoint (`hf-spectral retrofit SRC DST`).

The fresh environment gets hf_spectral from the wheel only. Third-party packages (torch, transformers, ...) come
from the project's environment: its site-packages folder is put on the path of the new one, without running its
.pth files, so the editable install of the checkout stays out (checked below).
"""

import json
import os
import pathlib
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from tests.training.conftest import synthetic_text

ROOT = pathlib.Path(__file__).resolve().parents[1]
# What setuptools reads to build the wheel; copied so that the build never writes into the checkout.
BUILD_INPUTS = ("hf_spectral", "training", "model_cards", "setup.py", "setup.cfg", "pyproject.toml", "README.md")


def _run(command, cwd, env, timeout=300):
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv python, hf-spectral executable, environment, outside folder, wheel path)."""
    work = tmp_path_factory.mktemp("packaging")
    source = work / "source"
    source.mkdir()
    for name in BUILD_INPUTS:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, source / name)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    # The build uses this environment's setuptools (no download): what `pip wheel` does with build isolation,
    # from the same pyproject.toml / setup.cfg / setup.py.
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", str(work / "dist"), str(source)], cwd=work, env=env)
    (wheel,) = (work / "dist").glob("hf_spectral-*.whl")

    venv = work / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=work, env=env)
    python = venv / "bin" / "python"
    purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd=work,
                   env=env).stdout.strip()
    # A plain path line in a .pth file adds the folder without processing the .pth files inside it.
    project_site = [p for p in site.getsitepackages() + [sysconfig.get_path("purelib")] if os.path.isdir(p)]
    pathlib.Path(purelib, "project_dependencies.pth").write_text("\n".join(dict.fromkeys(project_site)) + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q",
          str(wheel)], cwd=work, env=env)
    outside = work / "elsewhere"
    outside.mkdir()
    return python, venv / "bin" / "hf-spectral", env, outside, wheel


def test_wheel_holds_the_recipes_under_the_package_and_no_top_level_training(installed):
    *_, wheel = installed
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names}
    assert top_level == {"hf_spectral", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}
    for required in ("hf_spectral/recipes/__init__.py", "hf_spectral/recipes/common/__init__.py",
                     "hf_spectral/recipes/tinyshakespeare.py", "hf_spectral/recipes/reproduce_ega.py",
                     "hf_spectral/model_cards/ega_gpt.md", "hf_spectral/model_cards/chiar_former.md",
                     "hf_spectral/model_cards/energy_gated.md",
                     "hf_spectral/recipes/metrics/accuracy/accuracy.py",
                     "hf_spectral/recipes/configs/tinyshakespeare_demo.json"):
        assert required in names, required
    # Every file of the source tree (modules, model cards, metric scripts, data) is in the wheel.
    for folder, prefix in (("hf_spectral", "hf_spectral"), ("training", "hf_spectral/recipes"),
                           ("model_cards", "hf_spectral/model_cards")):
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                assert f"{prefix}/{path.relative_to(ROOT / folder).as_posix()}" in names, path
    metadata = zipfile.ZipFile(wheel).read(f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info/METADATA")
    # torch itself (not torchao, whose extra's marker reads `extra == "quantization"`): never pinned
    requirements = [line for line in metadata.decode().splitlines()
                    if re.match(r"Requires-Dist: torch(?![\w.-])", line)]
    assert requirements and all("==" not in line for line in requirements), requirements


def test_installed_package_comes_from_the_wheel_not_the_checkout(installed):
    python, _, env, outside, _ = installed
    script = ("import importlib.util, hf_spectral, hf_spectral.recipes\n"
              "print(hf_spectral.__file__); print(hf_spectral.recipes.__file__)\n"
              "print(importlib.util.find_spec('training'))\n")
    lines = _run([str(python), "-c", script], cwd=outside, env=env).stdout.splitlines()
    venv = str(python.parent.parent)
    assert lines[0].startswith(venv) and lines[1].startswith(venv), lines
    assert lines[2] == "None"  # no generic top-level `training` package


def test_console_command_prints_the_version(installed):
    _, command, env, outside, _ = installed
    import hf_spectral

    assert _run([str(command), "--version"], cwd=outside, env=env).stdout == f"hf-spectral {hf_spectral.__version__}\n"


def test_installed_recipe_trains_and_writes_its_model_card(installed):
    _, command, env, outside, _ = installed
    data = outside / "input.txt"
    data.write_text(synthetic_text(30_000), encoding="utf-8")
    out = outside / "runs"
    _run([str(command), "train", "tinyshakespeare", "--smoke", "--variants", "EGA-1", "--max_steps", "4",
          "--eval_steps", "2", "--save_steps", "4", "--data_path", str(data), "--output_dir", str(out),
          "--threads", "1"], cwd=outside, env=env, timeout=600)
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [row["model"] for row in rows] == ["EGA-1 (causal)"]
    run = out / "EGA-1-causal-seed0"
    arguments = json.loads((run / "args.json").read_text())  # the packaged configuration, with the run's options
    assert arguments["config_overrides"].startswith("num_hidden_layers=2,") and arguments["max_steps"] == 4
    assert arguments["train_file"] == str(outside / "data" / "tinyshakespeare" / "train.txt")
    metrics = json.loads((run / "all_results.json").read_text())
    assert metrics["eval_loss"] > 0 and metrics["eval_accuracy"] is not None  # the local metric module ran
    card = (run / "README.md").read_text()
    assert "EGA-1" in card and "## Measured results" in card  # the model's card, from the packaged family card
    assert (run / "model.safetensors").is_file()


def test_installed_recipes_render_every_family_card_from_the_package(installed):
    python, _, env, outside, _ = installed
    from training.common.model_card import FAMILIES

    script = ("from hf_spectral.recipes.common.model_card import CARDS_DIR, FAMILIES, render_model_card\n"
              "print(CARDS_DIR)\n"
              "for family in FAMILIES:\n"
              "    print(family, render_model_card(family).data.library_name)\n")
    lines = _run([str(python), "-c", script], cwd=outside, env=env).stdout.splitlines()
    cards = pathlib.Path(lines[0])  # the installed package's folder, not the checkout's model_cards/
    assert cards.parts[-2:] == ("hf_spectral", "model_cards") and cards.is_relative_to(python.parent.parent), cards
    assert lines[1:] == [f"{family} transformers" for family in FAMILIES]


def test_installed_retrofit_command_writes_a_loadable_gated_copy(installed, tmp_path):
    python, command, env, outside, _ = installed
    torch.manual_seed(0)
    source = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=32)).save_pretrained(source)
    destination = outside / "gated"
    _run([str(command), "retrofit", str(source), str(destination), "--layers", "1"], cwd=outside, env=env)
    assert json.loads((destination / "config.json").read_text())["energy_gates"]["layers"] == [1]
    check = ("import sys, torch, hf_spectral\n"
             "from transformers import AutoModelForCausalLM\n"
             "ids = torch.arange(12).view(1, 12)\n"
             "a = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()\n"
             "b = AutoModelForCausalLM.from_pretrained(sys.argv[2]).eval()\n"
             "assert any('energy_gate' in name for name, _ in b.named_parameters())\n"
             "with torch.no_grad():\n"
             # alpha = 0: the identity, up to the kernels (the gated layer attends over a folded head: another
             # SDPA kernel, which on some CPUs differs in the last bit)
             "    torch.testing.assert_close(a(ids).logits, b(ids).logits, atol=1e-6, rtol=1e-5)\n")
    _run([str(python), "-c", check, str(source), str(destination)], cwd=outside, env=env)
