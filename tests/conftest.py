import atexit
import os
import shutil
import tempfile

# Tests must never reach the network; every loader takes local paths.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# transformers copies the code of every model loaded with trust_remote_code into its modules cache: a folder of this
# run's own (set before transformers is imported; subprocesses inherit it), so the suite leaves nothing behind in
# ~/.cache/huggingface.
_MODULES_CACHE = tempfile.mkdtemp(prefix="hf_spectral_tests_modules_")
os.environ["HF_MODULES_CACHE"] = _MODULES_CACHE
atexit.register(shutil.rmtree, _MODULES_CACHE, ignore_errors=True)

import pytest  # noqa: E402
import torch  # noqa: E402

_THREADS = torch.get_num_threads()


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """A recipe run in-process with ``--threads`` sets torch's thread count for the whole process: each test
    starts from the count the session began with."""
    torch.set_num_threads(_THREADS)
    yield
    torch.set_num_threads(_THREADS)
