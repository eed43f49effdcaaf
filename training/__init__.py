"""Training and reproduction recipes for hf_spectral (``python -m training.<recipe> --help``)."""
