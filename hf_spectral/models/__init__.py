"""One folder per model (``configuration_*.py`` + ``modeling_*.py``); the mechanisms live in ``hf_spectral/ops``.

A model folder imports its siblings with single-dot imports, the ops with ``from ...ops.<module> import``, and
otherwise only ``transformers``/``torch``: ``save_pretrained`` then copies the two files next to the weights with the
ops imports rewritten to sibling imports, and the ops files they need beside them (``ops/remote_code.py``), so that
the folder loads with ``trust_remote_code=True`` where hf_spectral is not installed.
"""
