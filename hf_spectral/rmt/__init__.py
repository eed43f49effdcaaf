"""hf_spectral.rmt: random-matrix theory of attention pooling as signal recovery (SPEC section 3).

The theory and the simulations need NumPy/SciPy only; the model-facing tools of ``hf_spectral.rmt.models`` need
torch. (Importing this subpackage imports ``hf_spectral`` first, which registers the models with transformers and
so loads torch and transformers anyway; ``models`` is still loaded only on first use.)

* ``generative``: the sampler of SPEC 3.1 (vocabulary table, position-correlation models R, pooled sequences);
* ``pooling``: mean / harmonic-causal / optimal weights and α, κ, α/κ;
* ``theory``: bulk density, edges, thresholds, outlier locations and overlaps;
* ``simulation``: spectra of S, Kolmogorov-Smirnov distance to the bulk law, sweeps over ρ;
* ``downstream``: ridge classification on pooled representations;
* ``plots``: the reproduction's figures;
* ``models``: effective pooling weights of a model's attention, R̂ from data, ``fit_rmt_pooling``.
"""

from ..dependencies import require

require("scipy", extra="rmt", feature="hf_spectral.rmt")  # a clear error before the modules below import it

from .downstream import *  # noqa: E402,F401,F403
from .downstream import __all__ as _downstream_all  # noqa: E402
from .generative import *  # noqa: E402,F401,F403
from .generative import __all__ as _generative_all  # noqa: E402
from .pooling import *  # noqa: E402,F401,F403
from .pooling import __all__ as _pooling_all  # noqa: E402
from .simulation import *  # noqa: E402,F401,F403
from .simulation import __all__ as _simulation_all  # noqa: E402
from .theory import *  # noqa: E402,F401,F403
from .theory import __all__ as _theory_all  # noqa: E402

_MODEL_TOOLS = (
    "AttentionPoolingWeights",
    "attention_pooling_weights",
    "PositionCorrelationEstimate",
    "estimate_position_correlation",
    "RMTPoolingFit",
    "fit_rmt_pooling",
    "attention_pooling_report",
)


def __getattr__(name):
    # torch is imported only when a model-facing tool is asked for
    if name in _MODEL_TOOLS:
        from . import models

        return getattr(models, name)
    raise AttributeError(f"module 'hf_spectral.rmt' has no attribute {name!r}")


__all__ = [*_generative_all, *_pooling_all, *_theory_all, *_simulation_all, *_downstream_all, *_MODEL_TOOLS]
