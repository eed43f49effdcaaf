"""One folder per model (``configuration_*.py`` + ``modeling_*.py`` + its pure tensor ops).

Each folder imports only its siblings (single-dot relative imports) and ``transformers``/``torch``,
so that ``save_pretrained`` can copy it next to the weights for ``trust_remote_code`` loading.
"""
