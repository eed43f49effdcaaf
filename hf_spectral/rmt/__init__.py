"""hf_spectral.rmt: random-matrix theory of attention pooling as signal recovery (SPEC section 3)."""
from .generative import *  # noqa: F401,F403
from .pooling import *  # noqa: F401,F403
from .theory import *  # noqa: F401,F403
from .simulation import *  # noqa: F401,F403
from .downstream import *  # noqa: F401,F403
