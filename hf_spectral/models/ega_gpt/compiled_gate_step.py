"""The causal energy gate's decoding step as one compiled C function, for CPU generation.

A decoding step of an EGA layer is bound by the number of tensor ops, not by their size: per layer and step the
gate's torch code (``causal_zscore_step``, ``log_gate_bias``, the writes into the folded q/k/v row) is about
twenty element-wise ops on a few dozen numbers, each costing several microseconds of dispatch — as much as the
rest of the attention layer. The C function below does the same arithmetic in one call: it reads the new
position's linear energies and the running moments of the last cached key, and writes the key's log-gate bias
and the new moments into the projected q/k/v row, where ``EGAAttention`` expects them.

The source is compiled with the system C compiler on first use (well under a second) into a cache folder
(``$HF_SPECTRAL_KERNEL_CACHE``, else ``~/.cache/hf_spectral/kernels``) and loaded with ``ctypes``; no torch
headers, no build step at install. Without a compiler, or with ``HF_SPECTRAL_COMPILED_KERNELS=0``, nothing is
compiled and the layers keep their torch code, which computes the same numbers (tests compare both).
"""

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading

import torch

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <math.h>
#include <stdint.h>

static float log_sigmoid(float x) { return fminf(x, 0.0f) - log1pf(expf(-fabsf(x))); }

/* What stays fixed through a generation: the q/k/v row layout and the gate's constants. */
typedef struct {
    int64_t heads, scales, head_dim;
    int64_t energy_offset;  /* column of head 0's first energy; head h, scale s at energy_offset + h*scales + s */
    int64_t key_offset;     /* column of head 0's key bias channel */
    int64_t value_offset;   /* column of head 0's first value state channel (means, then M2s) */
    int64_t head_stride;    /* columns between heads: head_dim + extra channels */
    float eps;
    const float *alpha, *neg_alpha_tau, *log_mix;  /* (heads, scales); log_mix NULL with one scale */
    const float *log_gate_at_mean;                 /* (heads) */
} GateLayout;

/* One decoding step of the causal energy gate (SPEC 1.1-1.2) for `batch` rows of a fused q/k/v projection,
 * rows[b*row_stride + column]. values: the layer's cached values (B, H, past_count, head_stride) with the given
 * element strides; channels head_dim .. head_dim + 2*scales - 1 of the last key hold the running means and M2s. */
void ega_causal_gate_step(
    const GateLayout *layout, float *rows, int64_t row_stride, int64_t batch,
    const float *values, int64_t value_batch_stride, int64_t value_head_stride, int64_t value_key_stride,
    int64_t past_count)
{
    const int64_t heads = layout->heads, scales = layout->scales;
    const float inverse_count = (float)(1.0 / (double)(past_count + 1));
    const float sqrt_past = (float)sqrt((double)past_count);
    const float m2_floor = (float)((double)layout->eps * (double)layout->eps * (double)past_count);
    const float *last = values + (past_count - 1) * value_key_stride + layout->head_dim;
    /* Every (row, head) reads its moments from a different place in the cache: ask for all of them first, so that
     * the memory reads overlap instead of stalling one by one. */
    for (int64_t b = 0; b < batch; ++b)
        for (int64_t h = 0; h < heads; ++h) __builtin_prefetch(last + b * value_batch_stride + h * value_head_stride);
    for (int64_t b = 0; b < batch; ++b) {
        float *row = rows + b * row_stride;
        for (int64_t h = 0; h < heads; ++h) {
            const float *moments = last + b * value_batch_stride + h * value_head_stride;
            float *value_state = row + layout->value_offset + h * layout->head_stride;
            float log_gate = 0.0f, running_max = -INFINITY, running_sum = 0.0f;
            for (int64_t s = 0; s < scales; ++s) {
                const int64_t hs = h * scales + s;
                /* Welford's update, as causal_zscore_step */
                const float energy = row[layout->energy_offset + hs];
                const float delta = energy - moments[s];
                const float mean = moments[s] + inverse_count * delta;
                const float deviation = energy - mean;
                const float m2 = moments[scales + s] + delta * deviation;
                const float z = deviation * ((1.0f / sqrtf(fmaxf(m2, m2_floor))) * sqrt_past);
                const float term = log_sigmoid(layout->neg_alpha_tau[hs] + layout->alpha[hs] * z);
                value_state[s] = mean;
                value_state[scales + s] = m2;
                if (layout->log_mix == 0) {
                    log_gate = term;
                } else {  /* log-sum-exp over the scales in one pass */
                    const float x = layout->log_mix[hs] + term;
                    if (x > running_max) {
                        running_sum = running_sum * expf(running_max - x) + 1.0f;
                        running_max = x;
                    } else {
                        running_sum += expf(x - running_max);
                    }
                }
            }
            if (layout->log_mix != 0) log_gate = running_max + logf(running_sum);
            row[layout->key_offset + h * layout->head_stride] = log_gate - layout->log_gate_at_mean[h];
        }
    }
}
"""


class _GateLayout(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_int64) for name in (
            "heads", "scales", "head_dim", "energy_offset", "key_offset", "value_offset", "head_stride")),
        ("eps", ctypes.c_float),
        *((name, ctypes.c_void_p) for name in ("alpha", "neg_alpha_tau", "log_mix", "log_gate_at_mean")),
    ]


_ARGTYPES = [ctypes.POINTER(_GateLayout), ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
             ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]

_lock = threading.Lock()
_loaded = {}  # "function" -> the ctypes function, or None once compiling or loading failed


def _enabled() -> bool:
    return os.environ.get("HF_SPECTRAL_COMPILED_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def _cache_dir() -> str:
    return os.environ.get("HF_SPECTRAL_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "hf_spectral", "kernels"
    )


def _compiler() -> str | None:
    for candidate in (os.environ.get("CC"), sysconfig.get_config_var("CC"), "cc", "gcc", "clang"):
        if candidate:
            path = shutil.which(candidate.split()[0])
            if path:
                return path
    return None


def _build() -> str:
    """Compile the source into the cache folder (once per source and platform) and return the library's path.
    The library is written under a temporary name and renamed into place, so that no process (this one or another
    compiling at the same time) ever loads a half-written file."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found (set CC)")
    digest = hashlib.sha256((_SOURCE + sys.platform + compiler).encode()).hexdigest()[:16]
    folder = _cache_dir()
    library = os.path.join(folder, f"ega_gate_step_{digest}{sysconfig.get_config_var('SHLIB_SUFFIX') or '.so'}")
    if os.path.exists(library):
        return library
    os.makedirs(folder, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as work:
        source = os.path.join(work, "ega_gate_step.c")
        with open(source, "w") as handle:
            handle.write(_SOURCE)
        built = os.path.join(work, "ega_gate_step.so")
        # -O2 without -ffast-math: the same IEEE arithmetic as the torch code, to float rounding.
        subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", built, source, "-lm"],
                       check=True, capture_output=True, text=True, timeout=120)
        os.replace(built, library)
    return library


def causal_gate_step_function():
    """The compiled ``ega_causal_gate_step`` (a ``ctypes`` function), or ``None`` when compiled kernels are switched
    off or cannot be built here; compiled once per process."""
    if not _enabled():
        return None
    if "function" not in _loaded:
        with _lock:
            if "function" not in _loaded:
                try:
                    function = ctypes.CDLL(_build()).ega_causal_gate_step
                    function.argtypes, function.restype = _ARGTYPES, None
                except (OSError, RuntimeError, subprocess.SubprocessError) as error:
                    detail = getattr(error, "stderr", None) or error
                    logger.info("EGA decoding uses its torch code: compiling the gate step failed (%s)", detail)
                    function = None
                _loaded["function"] = function
    return _loaded["function"]


class CausalGateStep:
    """``ega_causal_gate_step`` bound to one gate's constants and one layer's q/k/v layout.

    ``step(rows, values)`` updates, in place, rows (B, 1, N) float32 of ``folded_qkv_weights``' projection — 3·H·(D + P)
    q/k/v columns, then the H·S linear energies — from the layer's cached values (B, H, T_past ≥ 1, D + P) float32,
    whose channels D … D + 2S − 1 at the last key hold the running means and M2s: it writes the new key's log-gate
    bias into its channel D and the new running moments into the value's. Both must be CPU tensors with a
    contiguous last dimension; the caller checks (``EGAAttention._compiled_decoding_plan``).
    """

    def __init__(self, function, constants: tuple, num_heads: int, head_dim: int, width: int, eps: float):
        # Contiguous float32 copies, held here so that the addresses handed to C stay valid.
        self.constants = tuple(
            None if t is None else t.detach().to(torch.float32).reshape(num_heads, -1).contiguous() for t in constants
        )
        alpha, neg_alpha_tau, log_mix, log_gate_at_mean = self.constants
        block = num_heads * (head_dim + width)
        self.layout = _GateLayout(
            num_heads, alpha.shape[1], head_dim, 3 * block, block + head_dim, 2 * block + head_dim, head_dim + width,
            eps, alpha.data_ptr(), neg_alpha_tau.data_ptr(), None if log_mix is None else log_mix.data_ptr(),
            log_gate_at_mean.data_ptr(),
        )
        self._function, self._layout_pointer = function, ctypes.pointer(self.layout)

    def __call__(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        strides = values.stride()
        self._function(self._layout_pointer, rows.data_ptr(), rows.stride(0), rows.shape[0],
                       values.data_ptr(), strides[0], strides[1], strides[2], values.shape[2])
