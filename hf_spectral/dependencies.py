"""Optional dependencies: each feature that needs one says which extra of the package installs it."""

from __future__ import annotations

import importlib

# import name -> distribution name, where they differ
_DISTRIBUTIONS = {"pywt": "PyWavelets"}


def require(module: str, extra: str, feature: str):
    """Import and return ``module``; if it is missing, an ``ImportError`` naming ``feature`` and the command
    that installs it (``pip install "hf_spectral[extra]"``)."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        top = module.split(".")[0]
        raise ImportError(
            f"{feature} needs {_DISTRIBUTIONS.get(top, top)}, which is not installed: "
            f'pip install "hf_spectral[{extra}]"'
        ) from error
