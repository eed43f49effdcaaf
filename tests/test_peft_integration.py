"""How hf_spectral meets PEFT: imported only when used, the four wrapped methods visible, narrow and switchable, and
transformers' own PEFT integration unchanged by the plugin. (What the wrappers do for gated adapters:
tests/retrofit/test_peft.py.)"""

import inspect
import json
import os
import pathlib
import subprocess
import sys
import textwrap
from unittest import mock

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel
from transformers.integrations.peft import MIN_PEFT_VERSION, PeftAdapterMixin
from transformers.utils.import_utils import is_peft_greater_or_equal

import hf_spectral  # noqa: F401
from hf_spectral.retrofit import EnergyGateConfig, add_energy_gates

ROOT = pathlib.Path(__file__).resolve().parents[1]
GATE_CONFIG = "energy_gate_config.json"
WRAPPED = [(PeftModel, "from_pretrained"), (PeftModel, "load_adapter"), (PeftModel, "save_pretrained"),
           (PeftAdapterMixin, "load_adapter")]


def run_python(script: str, tmp_path, *args, env: dict | None = None) -> subprocess.CompletedProcess:
    environment = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1", **(env or {})}
    environment.pop("PYTHONPATH", None)
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *map(str, args)], cwd=ROOT,
                            env=environment, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


# ----------------------------------------------------------------------------------------------------------------
# PEFT imported only when used
# ----------------------------------------------------------------------------------------------------------------


def test_import_hf_spectral_imports_neither_peft_nor_accelerate(tmp_path):
    """transformers itself imports accelerate with PreTrainedModel where accelerate is installed; hf_spectral adds no
    module of PEFT or accelerate to that."""
    script = """
        import json, sys
        import transformers.modeling_utils
        before = set(sys.modules)
        import hf_spectral
        added = sorted(name for name in set(sys.modules) - before if name.split(".")[0] in ("peft", "accelerate"))
        print(json.dumps(added))
    """
    assert json.loads(run_python(script, tmp_path).stdout.splitlines()[-1]) == []


@pytest.mark.parametrize("order", ["hf_spectral first", "peft first"])
def test_peft_imported_before_or_after_hf_spectral_gets_the_same_integration(order, tmp_path):
    script = """
        import json, sys
        if sys.argv[1] == "peft first":
            import peft
        import hf_spectral
        peft_was_imported = "peft" in sys.modules
        import peft
        from peft import LoraConfig, PeftModel, get_peft_model
        from hf_spectral import EGAConfig, EGAForCausalLM
        from hf_spectral.peft_integration import PeftImportHook

        model = EGAForCausalLM(EGAConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=2))
        peft_model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=4))
        print(json.dumps({
            "peft_was_imported": peft_was_imported,
            "adapted": sorted(name.split(".", 3)[-1] for name, module in peft_model.named_modules()
                              if hasattr(module, "lora_A")),
            "wrapped": PeftModel.from_pretrained.__module__,
            "hooks_left": sum(isinstance(finder, PeftImportHook) for finder in sys.meta_path),
            "peft_loader": [type(loader).__name__ for loader in (peft.__loader__, peft.__spec__.loader)],
        }))
    """
    result = json.loads(run_python(script, tmp_path, order).stdout.splitlines()[-1])
    assert result == {
        "peft_was_imported": order == "peft first",
        "adapted": ["h.0.attn.c_attn", "h.1.attn.c_attn"],
        "wrapped": "hf_spectral.peft_integration",
        "hooks_left": 0,
        "peft_loader": ["SourceFileLoader"] * 2,  # peft keeps its own loader once the hook has run
    }


# ----------------------------------------------------------------------------------------------------------------
# The wrappers: visible, narrow, switchable
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("owner, name", WRAPPED, ids=[f"{o.__name__}.{n}" for o, n in WRAPPED])
def test_each_wrapper_says_what_it_is_and_how_to_switch_it_off(owner, name):
    wrapper = inspect.getattr_static(owner, name)
    wrapper = wrapper.__func__ if isinstance(wrapper, classmethod) else wrapper
    assert wrapper.__module__ == "hf_spectral.peft_integration"
    assert wrapper.__qualname__.startswith(f"{owner.__name__}.{name}_")  # e.g. PeftModel.load_adapter_adding_...
    assert wrapper.__wrapped__.__module__.split(".")[0] in ("peft", "transformers")
    assert wrapper.__doc__.startswith(f"{owner.__module__}.{owner.__name__}.{name}, wrapped by hf_spectral: ")
    assert "HF_SPECTRAL_PEFT_INTEGRATION=0" in wrapper.__doc__ and "unregister_peft_integration()" in wrapper.__doc__
    assert inspect.signature(wrapper) == inspect.signature(wrapper.__wrapped__)  # help() and IDEs show PEFT's


def test_an_adapter_without_a_gate_config_goes_straight_to_peft(tmp_path):
    """The wrappers only look whether energy_gate_config.json exists: they read no adapter weights, add no gates."""
    torch.manual_seed(0)
    config = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=40, n_positions=32)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "base")
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                                LoraConfig(task_type="CAUSAL_LM", r=4, init_lora_weights=False))
    adapter = tmp_path / "adapter"
    peft_model.save_pretrained(adapter)
    ids = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = peft_model.eval()(ids).logits

    def peft_from_pretrained(model):
        return PeftModel.from_pretrained(model, adapter)

    def peft_load_adapter(model):
        peft_model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", r=2))
        peft_model.load_adapter(adapter, adapter_name="other")
        peft_model.set_adapter("other")
        return peft_model

    def transformers_load_adapter(model):
        model.load_adapter(str(adapter))
        return model

    import safetensors

    for load in (peft_from_pretrained, peft_load_adapter, transformers_load_adapter):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
        with mock.patch.object(safetensors, "safe_open", side_effect=AssertionError("adapter weights read")), \
                mock.patch("hf_spectral.retrofit.add_energy_gates", side_effect=AssertionError("gates added")):
            loaded = load(model).eval()
        assert type(model) is GPT2LMHeadModel, load.__name__
        with torch.no_grad():
            torch.testing.assert_close(loaded(ids).logits, expected, atol=1e-6, rtol=0, msg=load.__name__)


SWITCH_SCRIPT = """
    import json, sys
    from transformers.integrations.peft import PeftAdapterMixin
    order, switch = sys.argv[1:3]

    def methods():  # the attributes as the classes hold them (PeftModel.from_pretrained: a classmethod)
        from peft import PeftModel
        return [PeftModel.__dict__[name] for name in ("from_pretrained", "load_adapter", "save_pretrained")] + [
            PeftAdapterMixin.__dict__["load_adapter"]]

    def wrapped(attribute):
        return getattr(attribute, "__func__", attribute).__module__ == "hf_spectral.peft_integration"

    transformers_own = PeftAdapterMixin.__dict__["load_adapter"]
    if order == "peft first":
        originals = methods()
    import hf_spectral
    from hf_spectral.peft_integration import register_peft_integration, unregister_peft_integration
    if switch == "unregister":
        unregister_peft_integration()
    current = methods()  # imports peft here when hf_spectral came first
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as LORA
    result = {"wrapped": [wrapped(attribute) for attribute in current], "ega_targets": LORA.get("ega_gpt"),
              "identical": current[-1] is transformers_own and (order != "peft first" or
                                                                 all(a is b for a, b in zip(current, originals)))}
    if switch == "unregister":  # switched on again: wrapped again; unregistered again: the very same attributes
        register_peft_integration(wrap_loaders=True)
        result["wrapped_again"] = [wrapped(attribute) for attribute in methods()]
        unregister_peft_integration()
        result["identical_again"] = all(a is b for a, b in zip(methods(), current))
    print(json.dumps(result))
"""


@pytest.mark.parametrize("order", ["peft first", "hf_spectral first"])
@pytest.mark.parametrize("switch", ["environment", "unregister"])
def test_the_wrappers_switch_off_and_leave_peft_s_own_methods(order, switch, tmp_path):
    env = {"HF_SPECTRAL_PEFT_INTEGRATION": "0"} if switch == "environment" else {}
    result = json.loads(run_python(SWITCH_SCRIPT, tmp_path, order, switch, env=env).stdout.splitlines()[-1])
    expected = {"wrapped": [False] * 4, "ega_targets": ["c_attn"], "identical": True}  # target modules still there
    if switch == "unregister":
        expected.update(wrapped_again=[True] * 4, identical_again=True)
    assert result == expected


def test_an_unknown_switch_value_is_named(tmp_path):
    environment = {**os.environ, "HF_SPECTRAL_PEFT_INTEGRATION": "maybe"}
    result = subprocess.run([sys.executable, "-c", "import hf_spectral"], cwd=ROOT, env=environment,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "HF_SPECTRAL_PEFT_INTEGRATION='maybe': expected 1 (wrappers on) or 0 (off)" in result.stderr


# ----------------------------------------------------------------------------------------------------------------
# Adapters of stock and retrofitted models, with and without the plugin
# ----------------------------------------------------------------------------------------------------------------

# One interpreter per case: PEFT's and transformers' adapter machinery on a stock GPT-2 and on a retrofitted one
# (its checkpoint loads with trust_remote_code where hf_spectral is not imported). Each step's logits, or its error.
ROUND_TRIP_SCRIPT = """
    import json, sys
    plugin, base_path, gated_path, out = sys.argv[1:5]
    if plugin == "without":
        sys.modules["hf_spectral"] = None  # any import of the plugin now raises ImportError
    else:
        import hf_spectral
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 40, (2, 10), generator=torch.Generator().manual_seed(1))
    lora = dict(task_type="CAUSAL_LM", r=4, target_modules=["c_attn"])
    results = {}

    def step(name, action):
        try:
            model = action()
            with torch.no_grad():
                results[name] = {"logits": model.eval()(ids).logits.tolist()}
        except Exception as error:
            results[name] = {"error": f"{type(error).__name__}: {error}"}

    for label, path in (("stock", base_path), ("retrofitted", gated_path)):
        def fresh():
            return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)

        def peft_save():
            torch.manual_seed(0)
            peft_model = get_peft_model(fresh(), LoraConfig(**lora))
            optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
            for _ in range(2):
                peft_model(input_ids=ids, labels=ids).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            peft_model.save_pretrained(f"{out}/{label}-peft")
            return peft_model

        def transformers_round_trip(load):
            model = load()
            model.save_pretrained(f"{out}/{label}-{load.__name__}")
            reloaded = fresh()
            reloaded.load_adapter(f"{out}/{label}-{load.__name__}")
            return reloaded

        def transformers_load():
            model = fresh()
            model.load_adapter(f"{out}/{label}-peft")
            return model

        def transformers_add():
            torch.manual_seed(0)
            model = fresh()
            model.add_adapter(LoraConfig(**lora, init_lora_weights=False))
            return model

        step(f"{label}: PeftModel.save_pretrained", peft_save)
        step(f"{label}: PeftModel.from_pretrained", lambda: PeftModel.from_pretrained(fresh(), f"{out}/{label}-peft"))
        step(f"{label}: load_adapter", transformers_load)
        step(f"{label}: load_adapter, save_pretrained, load_adapter",
             lambda: transformers_round_trip(transformers_load))
        step(f"{label}: add_adapter", transformers_add)
        step(f"{label}: add_adapter, save_pretrained, load_adapter", lambda: transformers_round_trip(transformers_add))
    print(json.dumps(results))
"""


def round_trips(plugin: str, base_path, gated_path, tmp_path) -> dict:
    out = tmp_path / plugin
    out.mkdir()
    result = run_python(ROUND_TRIP_SCRIPT, tmp_path, plugin, base_path, gated_path, out)
    folders = {folder.name: sorted(file.name for file in folder.iterdir()) for folder in out.iterdir()}
    # the adapters saved (what a refused save_pretrained leaves behind is transformers' and the model class's)
    return json.loads(result.stdout.splitlines()[-1]), {
        name: files for name, files in folders.items() if "adapter_config.json" in files}


def test_adapter_round_trips_are_the_same_with_and_without_the_plugin(tmp_path):
    """A stock GPT-2 and a retrofitted one through PEFT (get_peft_model, save_pretrained, from_pretrained) and
    transformers' own integration (add_adapter, load_adapter, save_pretrained): the plugin changes no output, no
    saved file and no error. transformers refuses most of its integration below peft MIN_PEFT_VERSION (not
    load_adapter): then its refusal is checked, from that version on the full round trip."""
    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=40, n_positions=32))
    base.save_pretrained(tmp_path / "base")
    add_energy_gates(AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                     EnergyGateConfig(alpha_init=0.5, layers=[1])).save_pretrained(tmp_path / "gated")

    with_plugin, with_folders = round_trips("with", tmp_path / "base", tmp_path / "gated", tmp_path)
    without_plugin, without_folders = round_trips("without", tmp_path / "base", tmp_path / "gated", tmp_path)
    # the same files, but for the gate configuration PeftModel.save_pretrained records for the retrofitted model
    assert with_folders.pop("retrofitted-peft") == sorted(without_folders.pop("retrofitted-peft") + [GATE_CONFIG])
    assert with_folders == without_folders and GATE_CONFIG not in with_folders["stock-peft"]
    assert with_plugin.keys() == without_plugin.keys()
    for step, outcome in with_plugin.items():
        assert outcome.keys() == without_plugin[step].keys(), (step, outcome.get("error"), without_plugin[step])
        if "error" in outcome:
            assert outcome == without_plugin[step], step
        else:
            torch.testing.assert_close(torch.tensor(outcome["logits"]), torch.tensor(without_plugin[step]["logits"]),
                                       atol=1e-6, rtol=0, msg=step)

    refusal = ("ValueError: The version of PEFT you are using is not compatible, please use a version >= "
               f"{MIN_PEFT_VERSION}")
    full_integration = is_peft_greater_or_equal(MIN_PEFT_VERSION)
    for label in ("stock", "retrofitted"):
        outcome = {step.split(": ", 1)[1]: value for step, value in with_plugin.items() if step.startswith(label)}
        trained = torch.tensor(outcome["PeftModel.save_pretrained"]["logits"])
        for step in ("PeftModel.from_pretrained", "load_adapter"):  # PEFT's adapter, loaded by PEFT and transformers
            torch.testing.assert_close(torch.tensor(outcome[step]["logits"]), trained, atol=1e-6, rtol=0)
        for step in ("load_adapter, save_pretrained, load_adapter", "add_adapter, save_pretrained, load_adapter"):
            if full_integration:
                start = torch.tensor(outcome[step.split(",")[0]]["logits"])
                torch.testing.assert_close(torch.tensor(outcome[step]["logits"]), start, atol=1e-6, rtol=0)
            else:
                assert outcome[step] == {"error": refusal}, step
        added = outcome["add_adapter"]
        assert "logits" in added if full_integration else added == {"error": refusal}
