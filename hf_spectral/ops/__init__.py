"""Every mechanism of hf_spectral once, as pure tensor functions (and the small modules that hold a mechanism's
parameters), shared by the models and the retrofit.

The files here import each other only with single-dot relative imports and nothing else from hf_spectral: a saved
checkpoint carries copies of the ones its model needs as sibling files (``remote_code.save_model_code``), so that it
loads with ``trust_remote_code=True`` where hf_spectral is not installed.
"""
