"""The ``hf-spectral`` command line and the recipes' own entry points: version, recipe lookup, errors, options
parsed before the heavy libraries load, and files written with ordinary permissions."""

import importlib.metadata
import json
import os
import pathlib
import stat
import subprocess
import sys

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import hf_spectral
from hf_spectral.cli import RECIPES, SCRIPTS, main
from hf_spectral.retrofit.cli import main as retrofit_main

ROOT = pathlib.Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "datasets", "evaluate", "accelerate", "matplotlib", "hf_spectral")


def test_version_is_the_installed_distributions(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"hf-spectral {hf_spectral.__version__}\n"
    assert hf_spectral.__version__ == importlib.metadata.version("hf_spectral")


def test_help_lists_every_recipe(capsys):
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    assert all(f"  {name} " in text for name in [*RECIPES, *SCRIPTS])


def test_every_listed_recipe_is_a_module_of_the_package_and_every_recipe_module_is_listed():
    import hf_spectral.recipes

    folder = pathlib.Path(hf_spectral.recipes.__file__).parent
    assert folder.resolve() == (ROOT / "training").resolve()
    modules = [*RECIPES, *(module for module, _ in SCRIPTS.values())]
    missing = [name for name in modules if not (folder / f"{name}.py").is_file()]
    assert not missing, f"recipes listed in hf_spectral/cli.py without a module in training/: {missing}"
    # A recipe is a module with a `main(argv)` entry point; helpers (results, *_data generators) are not listed.
    entry_points = {path.stem for path in folder.glob("*.py")
                    if "\ndef main(" in path.read_text() and not path.stem.endswith("_data")}
    assert entry_points <= set(modules), f"modules not listed in hf_spectral/cli.py: {entry_points - set(modules)}"


def test_unknown_command_and_recipe_are_one_line_errors(capsys):
    assert main(["train", "shakespeare"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown recipe 'shakespeare'" in err and "tinyshakespeare" in err
    assert main(["fly"]) == 2
    assert "unknown command 'fly'" in capsys.readouterr().err
    assert main(["train"]) == 2


@pytest.mark.parametrize(
    "command, options, message",
    [
        ("clm", ["--model_type", "gpt-5", "--train_file", "corpus.txt", "--do_train"], "unknown --model_type 'gpt-5'"),
        ("classification", ["--model_type", "gpt2", "--train_file", "/nonexistent.csv", "--do_train"],
         "--train_file /nonexistent.csv: no such file"),
    ],
)
def test_train_clm_and_classification_run_the_scripts_with_one_line_errors(command, options, message, tmp_path):
    """`hf-spectral train clm|classification` run training/run_clm.py and run_classification.py, whose errors name the
    command the user typed."""
    (tmp_path / "corpus.txt").write_text("to be or not to be\n")
    console = os.path.join(os.path.dirname(sys.executable), "hf-spectral")
    result = subprocess.run([console, "train", command, *options, "--output_dir", str(tmp_path / "out")],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(f"hf-spectral train {command}: error: {message}")
    assert not (tmp_path / "out").exists()


def test_train_runs_the_recipe_of_the_package(capsys):
    """`hf-spectral train reproduce_ega` reaches the recipe, which plans its runs as modules of the package it was
    loaded from (hf_spectral.recipes here, as from an installed wheel)."""
    assert main(["train", "reproduce_ega", "--smoke", "--dry_run", "--benchmarks", "tinyshakespeare",
                 "--output_dir", "/nonexistent"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == [
        f"pending tinyshakespeare-{run}-seed0" for run in ("BASE", "EGA-1-causal", "EGA-1-window")]
    assert all(line.endswith(f"-m hf_spectral.recipes.run_clm /nonexistent/tinyshakespeare/{run}-seed0/args.json")
               for line, run in zip(lines, ("BASE", "EGA-1-causal", "EGA-1-window")))


@pytest.mark.parametrize("recipe", [name for name in RECIPES if (ROOT / "training" / f"{name}.py").is_file()])
def test_recipe_help_parses_before_importing_torch_transformers_or_datasets(recipe):
    """`python -m training.<recipe> --help` answers without loading torch, transformers, datasets, evaluate,
    accelerate, matplotlib or hf_spectral (which loads torch): seconds saved on every mistyped option."""
    script = (
        "import runpy, sys\n"
        f"sys.argv = ['{recipe}', '--help']\n"
        "try:\n"
        f"    runpy.run_module('training.{recipe}', run_name='__main__')\n"
        "except SystemExit as stop:\n"
        "    assert stop.code in (0, None), stop.code\n"
        f"print('LOADED', [name for name in {HEAVY!r} if name in sys.modules])\n"
    )
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith(f"usage: python -m training.{recipe} "), "the usage line names the command run"
    assert result.stdout.strip().splitlines()[-1] == "LOADED []"


# ------------------------------------------------------------------------------------------------------------
# hf-spectral retrofit
# ------------------------------------------------------------------------------------------------------------


@pytest.fixture
def tiny_gpt2(tmp_path):
    torch.manual_seed(0)
    config = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=32, bos_token_id=0,
                        eos_token_id=0, pad_token_id=0)
    path = tmp_path / "gpt2"
    GPT2LMHeadModel(config).save_pretrained(path)
    return path


@pytest.mark.parametrize(
    "options, message",
    [
        (["--layers", "5"], "`layers` [5] out of range: the model has 2 attention layers"),
        (["--heads", "4"], "`heads` [4] out of range: the model has 4 key/value heads"),
        (["--energy-kind", "linear", "--scales", "3"], "scales"),
        (["--projections", "0"], "`projections`"),
    ],
)
def test_retrofit_bad_options_are_one_line_errors_with_status_2(tiny_gpt2, tmp_path, capsys, options, message):
    assert retrofit_main([str(tiny_gpt2), str(tmp_path / "dst")] + options) == 2
    # (transformers' weight-loading progress bar may come first)
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("hf-spectral retrofit: error: "), errors
    assert message in errors[0]
    assert not (tmp_path / "dst").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".retrofit-")]  # no staging folder left


def test_retrofit_refuses_corrupt_weights_and_unsupported_models_in_one_line(tiny_gpt2, tmp_path, capsys):
    from transformers import BertConfig, BertModel

    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_bytes((tiny_gpt2 / "config.json").read_bytes())
    (corrupt / "model.safetensors").write_bytes((tiny_gpt2 / "model.safetensors").read_bytes()[:1000])
    bert = tmp_path / "bert"
    BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)).save_pretrained(bert)
    for source, message in ((corrupt, f"cannot load the weights of {corrupt}: "), (bert, "cannot be added to BertModel")):
        assert retrofit_main([str(source), str(tmp_path / "dst")]) == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert len(errors) == 1 and message in errors[0], errors
        assert not (tmp_path / "dst").exists()


def test_retrofit_copies_a_tokenizer_only_when_the_source_has_one(tiny_gpt2, tmp_path, capsys):
    """Without tokenizer files, AutoTokenizer would build an empty GPT-2 tokenizer from the config (a vocabulary of
    1 that encodes any text to nothing): the copy must stay without one. With them, the copy encodes alike."""
    from transformers import AutoTokenizer

    from hf_spectral import CharTokenizer

    assert retrofit_main([str(tiny_gpt2), str(tmp_path / "bare")]) == 0
    assert not [p.name for p in (tmp_path / "bare").iterdir() if p.name.startswith(("tokenizer", "vocab"))]
    CharTokenizer.from_text("to be or not to be", str(tmp_path / "chars")).save_pretrained(tiny_gpt2)
    assert retrofit_main([str(tiny_gpt2), str(tmp_path / "dst")]) == 0
    expected = AutoTokenizer.from_pretrained(tiny_gpt2)("not to be")["input_ids"]
    assert AutoTokenizer.from_pretrained(tmp_path / "dst")("not to be")["input_ids"] == expected != []


def test_retrofit_carries_the_sources_other_files_but_not_its_weights_or_code(tiny_gpt2, tmp_path, capsys):
    """A model card, a license, a chat template stay with the model (an in-place --overwrite had deleted them);
    weights in other formats, a shard index the copy does not use, code and subfolders stay behind."""
    from transformers import AutoModelForCausalLM

    carried = {"README.md": "# card", "LICENSE": "terms", "chat_template.jinja": "{{ messages }}",
               "USE_POLICY.md": "policy"}
    left = {"pytorch_model.bin": "old weights", "model.safetensors.index.json": "{}", "modeling_old.py": "x = 1",
            "rust_model.ot": "weights", "64-8bits.tflite": "weights", "model.onnx_data": "weights",
            "trainer_state.json": "{}"}
    for name, text in {**carried, **left}.items():
        (tiny_gpt2 / name).write_text(text)
    (tiny_gpt2 / "original").mkdir()
    (tiny_gpt2 / "original" / "consolidated.00.pth").write_text("weights")
    for destination in (tmp_path / "dst", tiny_gpt2):  # a copy, then in place
        assert retrofit_main([str(tiny_gpt2), str(destination), "--overwrite"]) == 0
        names = {path.name for path in destination.iterdir()}
        assert all((destination / name).read_text() == text for name, text in carried.items())
        assert "copied from" in capsys.readouterr().out
        if destination != tiny_gpt2:
            assert not names & {*left, "original"}
        assert AutoModelForCausalLM.from_pretrained(destination).config.energy_gates is not None


def test_retrofit_skips_and_names_links_and_never_widens_a_carried_files_mode(tiny_gpt2, tmp_path, capsys):
    """A README.md that links to a private file elsewhere would land in DST as that file's content, ready to push."""
    (tmp_path / "secret.md").write_text("private")
    os.chmod(tmp_path / "secret.md", 0o600)
    (tiny_gpt2 / "README.md").symlink_to(tmp_path / "secret.md")
    (tiny_gpt2 / "NOTICE").symlink_to("config.json")  # a link, even inside SRC
    (tiny_gpt2 / "USE_POLICY.md").write_text("policy")
    os.chmod(tiny_gpt2 / "USE_POLICY.md", 0o600)
    (tiny_gpt2 / "LICENSE").write_text("terms")
    os.chmod(tiny_gpt2 / "LICENSE", 0o755)
    previous = os.umask(0o022)
    try:
        assert retrofit_main([str(tiny_gpt2), str(tmp_path / "dst")]) == 0
    finally:
        os.umask(previous)
    out = capsys.readouterr().out
    assert not (tmp_path / "dst" / "README.md").exists() and not (tmp_path / "dst" / "NOTICE").exists()
    skipped = next(line for line in out.splitlines() if line.startswith(f"not copied from {tiny_gpt2}: "))
    assert f"README.md (a link to {tmp_path / 'secret.md'}: only a Hub cache snapshot's links" in skipped
    assert "NOTICE (a link to config.json:" in skipped
    assert _modes(tmp_path / "dst")["USE_POLICY.md"] == 0o600 and _modes(tmp_path / "dst")["LICENSE"] == 0o644


def test_retrofit_follows_a_hub_snapshots_links_into_its_own_blobs_only(tiny_gpt2, tmp_path, capsys):
    """huggingface_hub's cache: models--org--name/snapshots/<revision>/<file> -> ../../blobs/<hash>."""
    cache = tmp_path / "hub"
    repository, other = cache / "models--org--tiny", cache / "models--org--other"
    for folder in (repository / "blobs", repository / "snapshots" / "abc123", other / "blobs"):
        folder.mkdir(parents=True)
    snapshot = repository / "snapshots" / "abc123"
    files = {path.name: path.read_bytes() for path in tiny_gpt2.iterdir()}
    files.update({"README.md": b"# card", "LICENSE": b"terms"})
    for number, (name, content) in enumerate(files.items()):
        (repository / "blobs" / f"hash{number}").write_bytes(content)
        (snapshot / name).symlink_to(f"../../blobs/hash{number}")
    os.chmod(repository / "blobs" / f"hash{list(files).index('README.md')}", 0o640)
    (other / "blobs" / "hash").write_text("another repository's file")
    (snapshot / "NOTICE").symlink_to("../../../models--org--other/blobs/hash")
    previous = os.umask(0o022)
    try:
        assert retrofit_main([str(snapshot), str(tmp_path / "dst")]) == 0
    finally:
        os.umask(previous)
    out = capsys.readouterr().out
    assert (tmp_path / "dst" / "README.md").read_text() == "# card"
    assert not (tmp_path / "dst" / "README.md").is_symlink()
    assert (tmp_path / "dst" / "LICENSE").read_text() == "terms"
    assert _modes(tmp_path / "dst")["README.md"] == 0o640 and _modes(tmp_path / "dst")["LICENSE"] == 0o644
    assert f"copied from {snapshot}: LICENSE, README.md" in out
    assert f"not copied from {snapshot}: NOTICE (a link to ../../../models--org--other/blobs/hash:" in out
    assert not (tmp_path / "dst" / "NOTICE").exists()


@pytest.mark.parametrize(
    "architectures", [["pipeline"], ["GPT2Config"], ["is_torch_available"], [5], [None], "GPT2LMHeadModel",
                      ["AutoModelForCausalLM"], []],
)
def test_retrofit_names_an_architectures_entry_that_is_no_model_class_in_one_line(
    tiny_gpt2, tmp_path, capsys, architectures
):
    config = json.loads((tiny_gpt2 / "config.json").read_text())
    (tiny_gpt2 / "config.json").write_text(json.dumps({**config, "architectures": architectures}))
    assert retrofit_main([str(tiny_gpt2), str(tmp_path / "dst")]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert errors == [f"hf-spectral retrofit: error: cannot tell the model class of {tiny_gpt2}: "
                      f"config.architectures={architectures!r} does not start with the name of a transformers model "
                      "class"]
    assert not (tmp_path / "dst").exists()


def test_retrofit_that_cannot_copy_the_other_files_is_a_one_line_error(tiny_gpt2, tmp_path, capsys, monkeypatch):
    from hf_spectral.retrofit import cli

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    (tiny_gpt2 / "README.md").write_text("# card")
    monkeypatch.setattr(cli.shutil, "copyfileobj", no_space)
    assert retrofit_main([str(tiny_gpt2), str(tmp_path / "dst")]) == 2
    assert "cannot copy the other files of" in capsys.readouterr().err
    assert not (tmp_path / "dst").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".retrofit-")]


def test_retrofit_that_cannot_write_its_destination_is_a_one_line_error(tiny_gpt2, tmp_path, capsys, monkeypatch):
    """A file where a folder of DST's path should be, and a failing write (a full disk), end in one line, not a
    traceback; a failed write leaves no staging folder and an existing DST as it was."""
    from hf_spectral.retrofit import cli

    (tmp_path / "afile").write_text("keep me")
    assert retrofit_main([str(tiny_gpt2), str(tmp_path / "afile" / "dst")]) == 2
    assert "cannot create the folder" in capsys.readouterr().err

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "old.txt").write_text("the old DST")
    monkeypatch.setattr(cli.os, "replace", no_space)
    assert retrofit_main([str(tiny_gpt2), str(tmp_path / "dst"), "--overwrite"]) == 2
    error = capsys.readouterr().err
    assert "cannot write" in error and "No space left on device" in error and "Traceback" not in error
    assert (tmp_path / "dst" / "old.txt").read_text() == "the old DST"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".retrofit-")]


def test_retrofit_with_window_statistics_says_that_the_model_sees_future_tokens(tiny_gpt2, tmp_path, caplog):
    with caplog.at_level("WARNING"):
        assert retrofit_main([str(tiny_gpt2), str(tmp_path / "dst"), "--normalization", "window"]) == 0
    assert "SEES FUTURE TOKENS" in caplog.text


def test_retrofit_refuses_a_destination_that_is_a_file(tiny_gpt2, tmp_path, capsys):
    (tmp_path / "afile").write_text("keep me")
    assert retrofit_main([str(tiny_gpt2), str(tmp_path / "afile"), "--overwrite"]) == 2
    assert "exists and is not a folder" in capsys.readouterr().err
    assert (tmp_path / "afile").read_text() == "keep me"


def test_retrofit_never_deletes_the_current_folder_or_the_source_and_leaves_nothing_on_failure(
    tiny_gpt2, tmp_path, capsys, monkeypatch
):
    (tmp_path / "precious.txt").write_text("keep me")
    monkeypatch.chdir(tmp_path)
    for destination in (".", str(tmp_path)):  # DST is (or holds) the working folder: replacing it would delete it
        assert retrofit_main([str(tiny_gpt2), destination, "--overwrite"]) == 2
        assert "holds the current folder" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path.parent)
    assert retrofit_main([str(tiny_gpt2), str(tmp_path), "--overwrite"]) == 2  # DST holds SRC
    assert "holds SRC" in capsys.readouterr().err
    assert (tmp_path / "precious.txt").read_text() == "keep me" and (tiny_gpt2 / "config.json").is_file()
    # A gated checkpoint is not gated again; a failure leaves none of the folders it created.
    assert retrofit_main([str(tiny_gpt2), str(tmp_path / "gated")]) == 0
    assert retrofit_main([str(tmp_path / "gated"), str(tmp_path / "twice")]) == 2
    assert "already has energy gates" in capsys.readouterr().err
    (tiny_gpt2 / "tokenizer_config.json").write_text("{not json")
    assert retrofit_main([str(tiny_gpt2), str(tmp_path / "new" / "deeper" / "dst")]) == 2
    assert not (tmp_path / "new").exists()
    # Replacing an existing DST: the old folder goes only once the new one is in place.
    (tiny_gpt2 / "tokenizer_config.json").unlink()
    assert retrofit_main([str(tiny_gpt2), str(tmp_path / "gated"), "--overwrite", "--layers", "0"]) == 0
    assert json.loads((tmp_path / "gated" / "config.json").read_text())["energy_gates"]["layers"] == [0]
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".retrofit")]


def test_retrofit_layer_out_of_range_through_the_console_command(tiny_gpt2, tmp_path):
    result = subprocess.run([sys.executable, "-m", "hf_spectral.cli", "retrofit", str(tiny_gpt2), str(tmp_path / "dst"),
                             "--layers", "5"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "hf-spectral retrofit: error: `layers` [5] out of range: the model has 2 attention layers")


def _modes(folder: pathlib.Path) -> dict:
    return {str(path.relative_to(folder)): stat.S_IMODE(path.stat().st_mode)
            for path in [folder, *folder.rglob("*")]}


def test_retrofit_and_gate_files_have_the_umasks_permissions(tiny_gpt2, tmp_path):
    from transformers import AutoModelForCausalLM

    from hf_spectral.retrofit import save_energy_gates

    previous = os.umask(0o022)
    try:
        assert retrofit_main([str(tiny_gpt2), str(tmp_path / "dst"), "--layers", "0"]) == 0
        gates = save_energy_gates(AutoModelForCausalLM.from_pretrained(tmp_path / "dst"), str(tmp_path / "g" / "gates.safetensors"))
    finally:
        os.umask(previous)
    modes = _modes(tmp_path / "dst")
    assert modes["."] == 0o755 and "config.json" in modes and "model.safetensors" in modes
    assert all(mode == 0o755 if (tmp_path / "dst" / name).is_dir() else mode == 0o644 for name, mode in modes.items()), modes
    assert stat.S_IMODE(os.stat(gates).st_mode) == 0o644
    assert json.loads((tmp_path / "dst" / "config.json").read_text())["energy_gates"]["layers"] == [0]


def test_train_returns_the_recipes_exit_status(tmp_path, capsys):
    """A recipe that fails (here: no corpus at --data_path) makes `hf-spectral train` fail with its status."""
    assert main(["train", "tinyshakespeare", "--smoke", "--data_path", "/nonexistent/input.txt", "--no_download",
                 "--output_dir", str(tmp_path / "out")]) == 2
    assert "/nonexistent/input.txt" in capsys.readouterr().err


@pytest.mark.parametrize(
    "options, values",
    [
        (["--energy-kind", "linear", "--projections", "2"], {"energy_kind": "linear", "projections": 2}),
        (["--energy-kind", "conv", "--scales", "3,5"], {"energy_kind": "conv", "scales": [3, 5]}),
    ],
)
def test_retrofit_writes_every_gate_option_into_the_config(tiny_gpt2, tmp_path, options, values):
    from hf_spectral.retrofit import EnergyGateConfig

    common = ["--normalization", "none", "--layers", "1", "--heads", "0,2", "--tau-init", "0.25", "--alpha-init", "0.5"]
    assert retrofit_main([str(tiny_gpt2), str(tmp_path / "dst")] + options + common) == 0
    saved = json.loads((tmp_path / "dst" / "config.json").read_text())["energy_gates"]
    expected = EnergyGateConfig(normalization="none", layers=[1], heads=[0, 2], tau_init=0.25, alpha_init=0.5, **values)
    assert EnergyGateConfig.from_dict(saved) == expected
