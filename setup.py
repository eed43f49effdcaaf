"""Package list for setuptools (the rest of the metadata is in setup.cfg).

The recipes live in the repository's ``training/`` folder, so that ``python -m training.tinyshakespeare`` runs from
a checkout, and are installed as the subpackage ``hf_spectral.recipes`` (``package_dir`` in setup.cfg), so that a
wheel never puts a generic top-level ``training`` package into site-packages. The model cards of the repository's
``model_cards/`` folder (Markdown only, no module) are installed the same way, as ``hf_spectral/model_cards/``, where
the recipes' renderer finds them. setup.cfg's ``find:`` cannot list packages under a mapped folder, hence this file.
"""

from setuptools import find_packages, setup

RECIPES = "hf_spectral.recipes"

packages = find_packages(include=["hf_spectral", "hf_spectral.*"])
packages += [RECIPES] + [f"{RECIPES}.{name}" for name in find_packages("training")]
packages += ["hf_spectral.model_cards"]

setup(packages=packages)
