"""The causal energy gate (linear energies, causal statistics) as compiled C functions, for CPU inference.

Outside training, an EGA layer's gate is bound by the number of tensor ops rather than their size: its torch code
(``causal_zscore``/``causal_zscore_step``, ``log_gate_bias``, the writes into the folded q/k/v rows) is about twenty
element-wise ops, each costing microseconds of dispatch; in a decoding step, on a few dozen numbers, that is as
much as the rest of the attention layer. The two C functions below do the same arithmetic in one call each, on the
output of the layer's fused projection (``folded_qkv_weights``), where the linear energies already are:

- ``ega_causal_gate_step``, one decoding step: reads the running moments of the last cached key, writes the new
  key's log-gate bias and the new moments into its q/k/v row;
- ``ega_causal_gate_prefill``, the first positions of sequences without padding (a forward pass, the prompt of a
  generation): runs the moments along each sequence (Welford's update) and writes every key's bias, and its
  moments where a KV cache will keep them.

There is no backward: training keeps the torch code. The source is compiled with the system C compiler on first use
(well under a second) into a cache folder (``$HF_SPECTRAL_KERNEL_CACHE``, else ``~/.cache/hf_spectral/kernels``) and
loaded with ``ctypes``: no torch headers, no build step at install. Without a compiler, or with
``HF_SPECTRAL_COMPILED_KERNELS=0``, nothing is compiled and the layers keep their torch code, which computes the
same numbers (tests compare both).
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
#include <stdlib.h>

static float log_sigmoid(float x) { return fminf(x, 0.0f) - log1pf(expf(-fabsf(x))); }

/* What stays fixed for a layer: the q/k/v row layout and the gate's constants. */
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

/* One position of one row (as causal_zscore_step, then log_gate_bias): per head, Welford's update of the running
 * moments (scales means, then scales M2s) read from old + h*old_stride, written to new + h*new_stride (which may
 * alias old); the causal z-score (0 while fewer than two energies were seen); the log gate, mixed over scales,
 * written into the key's bias channel. count: the positions seen, this one included. */
static void gate_position(const GateLayout *layout, float *row, const float *old, int64_t old_stride,
                          float *new, int64_t new_stride, int64_t count)
{
    const int64_t scales = layout->scales;
    const float inverse_count = (float)(1.0 / (double)count);
    const float sqrt_past = (float)sqrt((double)(count - 1));
    const float m2_floor = (float)((double)layout->eps * (double)layout->eps * (double)(count - 1));
    for (int64_t h = 0; h < layout->heads; ++h) {
        const float *old_h = old + h * old_stride;
        float *new_h = new + h * new_stride;
        float log_gate = 0.0f, running_max = -INFINITY, running_sum = 0.0f;
        for (int64_t s = 0; s < scales; ++s) {
            const int64_t hs = h * scales + s;
            const float energy = row[layout->energy_offset + hs];
            const float delta = energy - old_h[s];
            const float mean = old_h[s] + inverse_count * delta;
            const float deviation = energy - mean;
            const float m2 = old_h[scales + s] + delta * deviation;
            /* z = deviation / sqrt(max(m2 / (count - 1), eps^2)) */
            const float z = count < 2 ? 0.0f : deviation * ((1.0f / sqrtf(fmaxf(m2, m2_floor))) * sqrt_past);
            const float term = log_sigmoid(layout->neg_alpha_tau[hs] + layout->alpha[hs] * z);
            new_h[s] = mean;
            new_h[scales + s] = m2;
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

/* One decoding step for `batch` rows, rows[b*row_stride + column]. values: the layer's cached values
 * (B, H, past_count, head_stride) with the given element strides, whose last key holds the running moments in its
 * channels head_dim .. head_dim + 2*scales - 1; the new moments go to the row's value state channels. */
void ega_causal_gate_step(
    const GateLayout *layout, float *rows, int64_t row_stride, int64_t batch,
    const float *values, int64_t value_batch_stride, int64_t value_head_stride, int64_t value_key_stride,
    int64_t past_count)
{
    const float *last = values + (past_count - 1) * value_key_stride + layout->head_dim;
    for (int64_t b = 0; b < batch; ++b) {
        float *row = rows + b * row_stride;
        gate_position(layout, row, last + b * value_batch_stride, value_head_stride,
                      row + layout->value_offset, layout->head_stride, past_count + 1);
    }
}

/* The first `length` positions of `batch` sequences (no past, no padding), rows[b*batch_stride + t*row_stride +
 * column], position by position; with write_state the running moments at each position also go to the row's
 * value state channels (for the KV cache). Returns 0, or -1 when out of memory. */
int ega_causal_gate_prefill(
    const GateLayout *layout, float *rows, int64_t batch_stride, int64_t row_stride, int64_t batch, int64_t length,
    int write_state)
{
    const int64_t moments_per_head = 2 * layout->scales;
    float *moments = calloc((size_t)(layout->heads * moments_per_head), sizeof(float));
    if (moments == 0) return -1;
    for (int64_t b = 0; b < batch; ++b) {
        for (int64_t i = 0; i < layout->heads * moments_per_head; ++i) moments[i] = 0.0f;
        for (int64_t t = 0; t < length; ++t) {
            float *row = rows + b * batch_stride + t * row_stride;
            gate_position(layout, row, moments, moments_per_head, moments, moments_per_head, t + 1);
            if (write_state)
                for (int64_t h = 0; h < layout->heads; ++h)
                    for (int64_t c = 0; c < moments_per_head; ++c)
                        row[layout->value_offset + h * layout->head_stride + c] = moments[h * moments_per_head + c];
        }
    }
    free(moments);
    return 0;
}
"""


class _GateLayout(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_int64) for name in (
            "heads", "scales", "head_dim", "energy_offset", "key_offset", "value_offset", "head_stride")),
        ("eps", ctypes.c_float),
        *((name, ctypes.c_void_p) for name in ("alpha", "neg_alpha_tau", "log_mix", "log_gate_at_mean")),
    ]


_SIGNATURES = {
    "ega_causal_gate_step": ([ctypes.POINTER(_GateLayout), ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                              ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64], None),
    "ega_causal_gate_prefill": ([ctypes.POINTER(_GateLayout), ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                 ctypes.c_int64, ctypes.c_int64, ctypes.c_int], ctypes.c_int),
}

_lock = threading.Lock()
_loaded = {}  # "library" -> the loaded library, or None once compiling or loading failed


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
    command = [compiler, "-O2", "-shared", "-fPIC"]  # -O2 without -ffast-math: the torch code's IEEE arithmetic
    digest = hashlib.sha256("\n".join([_SOURCE, sys.platform, *command]).encode()).hexdigest()[:16]
    folder = _cache_dir()
    library = os.path.join(folder, f"ega_causal_gate_{digest}{sysconfig.get_config_var('SHLIB_SUFFIX') or '.so'}")
    if os.path.exists(library):
        return library
    os.makedirs(folder, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as work:
        source = os.path.join(work, "ega_causal_gate.c")
        with open(source, "w") as handle:
            handle.write(_SOURCE)
        built = os.path.join(work, "ega_causal_gate.so")
        subprocess.run([*command, "-o", built, source, "-lm"],
                       check=True, capture_output=True, text=True, timeout=120)
        os.replace(built, library)
    return library


def compiled_library():
    """The compiled functions (a ``ctypes`` library with their signatures set), or ``None`` when compiled kernels
    are switched off or cannot be built here; compiled once per process."""
    if not _enabled():
        return None
    if "library" not in _loaded:
        with _lock:
            if "library" not in _loaded:
                try:
                    library = ctypes.CDLL(_build())
                    for name, (argtypes, restype) in _SIGNATURES.items():
                        getattr(library, name).argtypes, getattr(library, name).restype = argtypes, restype
                except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as error:
                    detail = getattr(error, "stderr", None) or error
                    logger.info("EGA layers use their torch code: compiling the causal gate failed (%s)", detail)
                    library = None
                _loaded["library"] = library
    return _loaded["library"]


class CompiledCausalGate:
    """The compiled causal gate bound to one gate's constants and one layer's fused q/k/v layout.

    Rows are outputs of ``folded_qkv_weights``' projection, float32 on CPU with a contiguous last dimension:
    3·H·(D + P) q/k/v columns in the folded layout, then the H·S linear energies. Both methods write, in place, each
    position's log-gate bias into its key's channel D and, where a KV cache will keep them, its running moments
    (S means, then S M2s) into its value's channels D … D + 2S − 1. The caller checks dtypes, devices and layouts
    (``EGAAttention``).
    """

    def __init__(self, library, constants: tuple, num_heads: int, head_dim: int, width: int, eps: float):
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
        self.stores_state = width >= 2 * alpha.shape[1]
        self._layout_pointer = ctypes.pointer(self.layout)
        self._step, self._prefill = library.ega_causal_gate_step, library.ega_causal_gate_prefill

    def step(self, rows: torch.Tensor, values: torch.Tensor, past_length: int) -> None:
        """One decoding step after ``past_length`` ≥ 1 cached keys: rows (B, 1, N); values (B, H, ≥ past_length,
        D + P), the layer's cached values, whose key ``past_length`` − 1 holds the running moments. The new moments
        go to the rows' value channels."""
        strides = values.stride()
        self._step(self._layout_pointer, rows.data_ptr(), rows.stride(0), rows.shape[0],
                   values.data_ptr(), strides[0], strides[1], strides[2], past_length)

    def prefill(self, rows: torch.Tensor) -> None:
        """The first T positions of each sequence, without padding: rows (B, T, N); the running moments go to the
        value channels when the layout has room for them (a KV cache is built)."""
        if self._prefill(self._layout_pointer, rows.data_ptr(), rows.stride(0), rows.stride(1), rows.shape[0],
                         rows.shape[1], int(self.stores_state)) != 0:
            raise MemoryError("out of memory in the compiled causal gate")
