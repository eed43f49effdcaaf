import os

# Tests must never reach the network; every loader takes local paths.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The compiled kernels (hf_spectral/models/ega_gpt/compiled_kernels.py) are built into a folder of this run,
# not the user's cache: the tests then also cover the build itself and never depend on a writable home.
if "HF_SPECTRAL_KERNEL_CACHE" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["HF_SPECTRAL_KERNEL_CACHE"] = tempfile.mkdtemp(prefix="hf_spectral_kernels_")
    atexit.register(shutil.rmtree, os.environ["HF_SPECTRAL_KERNEL_CACHE"], ignore_errors=True)
