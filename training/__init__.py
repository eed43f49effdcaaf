"""Training and reproduction recipes of hf_spectral.

In a checkout: ``python -m training.<recipe> --help``. Installed, the same modules are ``hf_spectral.recipes``:
``hf-spectral train <recipe> --help``. Modules here import each other relatively, so both names work.
"""
