"""Optional dependencies: a feature whose extra is not installed says which extra to install."""

import pathlib
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]

# One interpreter, each optional package made unimportable in turn (sys.modules[name] = None).
SCRIPT = textwrap.dedent(
    """
    import sys

    def attempt(label, action):
        try:
            action()
        except ImportError as error:
            print(label, error)
        else:
            print(label, "imported")

    sys.modules["scipy"] = None
    attempt("rmt:", lambda: __import__("hf_spectral.rmt"))
    del sys.modules["scipy"]
    sys.modules["matplotlib"] = None
    attempt("rmt.plots:", lambda: __import__("hf_spectral.rmt.plots"))
    attempt("recipe plots:", lambda: __import__("training.common.plots"))
    del sys.modules["matplotlib"]
    sys.modules["datasets"] = None
    from hf_spectral.cli import main
    print("train:", main(["train", "tinyshakespeare", "--smoke"]))
    """
)


def test_missing_optional_packages_name_their_extra():
    result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in result.stdout.splitlines() if ": " in line)
    assert lines["rmt"] == 'hf_spectral.rmt needs scipy, which is not installed: pip install "hf_spectral[rmt]"'
    assert lines["rmt.plots"].endswith('needs matplotlib, which is not installed: pip install "hf_spectral[rmt]"')
    assert lines["recipe plots"].endswith('needs matplotlib, which is not installed: pip install "hf_spectral[train]"')
    assert lines["train"] == "2"
    assert 'the recipes need datasets, which is not installed: pip install "hf_spectral[train]"' in result.stderr
