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
/* ---- Causal attention with a per-key logit bias (the gated attention of a forward pass, without the folded
 * channel). softmax(q·k·scale + bias_k) over the keys up to each query, per (batch, head), in blocks of
 * ATTENTION_BLOCK queries: the block's scores against every key it can see in one BLAS product, the biased,
 * causally cut softmax row by row, the weighted values in a second product. */

/* sgemm_ as a BLAS library exports it (Fortran: column-major, every argument by reference). The integer arguments
 * point to int64 values: an LP64 BLAS reads their low four bytes and an ILP64 one all eight, the same number on a
 * little-endian machine (the Python side checks the byte order and tries the kernel once before using it). */
typedef void (*sgemm_fn)(const char *, const char *, const int64_t *, const int64_t *, const int64_t *,
                         const float *, const float *, const int64_t *, const float *, const int64_t *,
                         const float *, float *, const int64_t *);

#define ATTENTION_BLOCK 64
#define LANES 16

#if defined(__x86_64__) && defined(__linux__) && defined(__has_attribute)
#if __has_attribute(target_clones)
/* one copy of the row softmax per vector width, the widest the CPU has chosen when the library loads */
#define VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
#endif
#ifndef VECTOR_CLONES
#define VECTOR_CLONES
#endif

/* exp(x) for x <= 0 (Cephes' expf: 2^n times a degree-7 polynomial, within 2 ulp), branch-free so that the
 * compiler vectorises the loops that call it; below -87 it returns exp(-87) ~ 1.6e-38 rather than 0, which no sum
 * of probabilities that includes the maximum's 1 can tell apart. */
static inline float exp_nonpositive(float x)
{
    x = x < -87.0f ? -87.0f : x;
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest: 1.5 * 2^23 */
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t bits; float value; } power;
    power.bits = ((int32_t)n + 127) << 23;
    return p * power.value;
}

/* One score row: adds the keys' bias to the first `visible` scores, replaces them by exp(score - max), zeroes the
 * rest of the row up to `width`, and returns the sum (and the maximum in *maximum_out). Maxima and sums run in LANES
 * partial lanes, which the compiler turns into vector registers without reassociating anything the C code does not
 * say. */
VECTOR_CLONES
static float softmax_row(float *scores, const float *bias, int64_t visible, int64_t width, float *maximum_out)
{
    float lanes[LANES], sums[LANES];
    for (int l = 0; l < LANES; ++l) { lanes[l] = -INFINITY; sums[l] = 0.0f; }
    int64_t j = 0;
    for (; j + LANES <= visible; j += LANES)
        for (int l = 0; l < LANES; ++l) {
            const float x = scores[j + l] + bias[j + l];
            scores[j + l] = x;
            lanes[l] = x > lanes[l] ? x : lanes[l];
        }
    for (; j < visible; ++j) {
        const float x = scores[j] + bias[j];
        scores[j] = x;
        lanes[0] = x > lanes[0] ? x : lanes[0];
    }
    float maximum = lanes[0];
    for (int l = 1; l < LANES; ++l) maximum = lanes[l] > maximum ? lanes[l] : maximum;
    for (j = 0; j + LANES <= visible; j += LANES)
        for (int l = 0; l < LANES; ++l) {
            const float p = exp_nonpositive(scores[j + l] - maximum);
            scores[j + l] = p;
            sums[l] += p;
        }
    for (; j < visible; ++j) {
        const float p = exp_nonpositive(scores[j] - maximum);
        scores[j] = p;
        sums[0] += p;
    }
    for (; j < width; ++j) scores[j] = 0.0f;
    float total = 0.0f;
    for (int l = 0; l < LANES; ++l) total += sums[l];
    *maximum_out = maximum;
    return total;
}

/* Attention dropout's factors for one row: 0 for a dropped probability, 1 / (1 - dropout) for a kept one, from a
 * hash of (seed, element index) (splitmix64), so that the backward draws the same mask as the forward without
 * storing it. index: the flat (batch, head, query, key) index of the row's first key. */
VECTOR_CLONES
static void dropout_factors(float *factors, int64_t width, uint64_t seed, uint64_t index, float dropout)
{
    const float kept = 1.0f / (1.0f - dropout);
    for (int64_t j = 0; j < width; ++j) {
        uint64_t z = seed + (index + (uint64_t)j) * 0x9E3779B97F4A7C15ull;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        factors[j] = (float)(z >> 40) * (1.0f / 16777216.0f) < dropout ? 0.0f : kept;
    }
}

/* A (batch, head) slice of a (B, H, T, C) tensor given by its data pointer and element strides (batch, head,
 * position; channels adjacent): where its position 0 starts, and how far apart its positions are. */
typedef struct { float *start; int64_t row; } HeadRows;

static HeadRows head_rows(const float *data, const int64_t *strides, int64_t b, int64_t h)
{
    HeadRows rows = {(float *)data + b * strides[0] + h * strides[1], strides[2]};
    return rows;
}

/* Forward of one (batch, head). work: (ATTENTION_BLOCK + 2) * length floats; log_sum_exp: `length` floats or NULL;
 * dropout > 0 drops probabilities by the mask of (seed, first_index + query * length + key). */
static void attend_head(sgemm_fn sgemm, int64_t length, int64_t head_dim, float scale, HeadRows query,
                        HeadRows key, HeadRows value, HeadRows out, float *log_sum_exp, float dropout, uint64_t seed,
                        uint64_t first_index, float *work)
{
    const float one = 1.0f, zero = 0.0f;
    float *factors = work + ATTENTION_BLOCK * length;
    const float *bias = work + (ATTENTION_BLOCK + 1) * length;
    for (int64_t start = 0; start < length; start += ATTENTION_BLOCK) {
        const int64_t rows = length - start < ATTENTION_BLOCK ? length - start : ATTENTION_BLOCK;
        const int64_t width = start + rows; /* the keys the block's last query sees */
        float inverse_sums[ATTENTION_BLOCK];
        /* scores (rows x width, row-major) = scale * Q_block K^T, i.e. column-major K Q^T */
        sgemm("T", "N", &width, &rows, &head_dim, &scale, key.start, &key.row, query.start + start * query.row,
              &query.row, &zero, work, &width);
        for (int64_t r = 0; r < rows; ++r) {
            float maximum;
            const float sum = softmax_row(work + r * width, bias, start + r + 1, width, &maximum);
            inverse_sums[r] = 1.0f / sum;
            if (log_sum_exp) log_sum_exp[start + r] = maximum + logf(sum);
            if (dropout > 0.0f) {
                float *row = work + r * width;
                dropout_factors(factors, start + r + 1, seed, first_index + (uint64_t)((start + r) * length), dropout);
                for (int64_t j = 0; j <= start + r; ++j) row[j] *= factors[j];
            }
        }
        /* out block (rows x head_dim, row-major) = P V, i.e. column-major V^T P^T */
        float *out_block = out.start + start * out.row;
        sgemm("N", "N", &head_dim, &rows, &width, &one, value.start, &value.row, work, &width, &zero, out_block,
              &out.row);
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t c = 0; c < head_dim; ++c) out_block[r * out.row + c] *= inverse_sums[r];
    }
}

/* Probabilities of a block from its scores and the rows' log-sum-exp: P = exp(S + bias - lse), causally cut. */
VECTOR_CLONES
static void probabilities_row(float *scores, const float *bias, int64_t visible, int64_t width, float log_sum_exp)
{
    for (int64_t j = 0; j < visible; ++j) scores[j] = exp_nonpositive(scores[j] + bias[j] - log_sum_exp);
    for (int64_t j = visible; j < width; ++j) scores[j] = 0.0f;
}

/* dS = P (dP - delta) in place of dP, and the bias gradient's column sums; with dropout factors, dS = P (dP f - delta)
 * and P becomes P f, the probabilities the values were weighted with. */
VECTOR_CLONES
static void score_gradient_row(float *probabilities, float *grad, int64_t width, float delta, float *grad_bias,
                               const float *factors)
{
    if (factors == 0) {
        for (int64_t j = 0; j < width; ++j) {
            const float g = probabilities[j] * (grad[j] - delta);
            grad[j] = g;
            grad_bias[j] += g;
        }
        return;
    }
    for (int64_t j = 0; j < width; ++j) {
        const float g = probabilities[j] * (grad[j] * factors[j] - delta);
        grad[j] = g;
        grad_bias[j] += g;
        probabilities[j] *= factors[j];
    }
}

/* Backward of one (batch, head), recomputing the probabilities from the forward's log-sum-exp (as flash attention
 * does), and the dropout mask from its seed. grad_key/grad_value/grad_bias are overwritten. work:
 * (2 * ATTENTION_BLOCK + 2) * length floats. */
static void attend_head_backward(sgemm_fn sgemm, int64_t length, int64_t head_dim, float scale, HeadRows query,
                                 HeadRows key, HeadRows value, HeadRows out, HeadRows grad_out,
                                 const float *log_sum_exp, float dropout, uint64_t seed, uint64_t first_index,
                                 HeadRows grad_query, HeadRows grad_key, HeadRows grad_value, float *grad_bias,
                                 float *work)
{
    const float one = 1.0f, zero = 0.0f;
    float *probabilities = work, *grad_scores = work + ATTENTION_BLOCK * length;
    float *factors = work + 2 * ATTENTION_BLOCK * length;
    const float *bias = work + (2 * ATTENTION_BLOCK + 1) * length;
    for (int64_t j = 0; j < length; ++j) {
        grad_bias[j] = 0.0f;
        for (int64_t c = 0; c < head_dim; ++c) {
            grad_key.start[j * grad_key.row + c] = 0.0f;
            grad_value.start[j * grad_value.row + c] = 0.0f;
        }
    }
    for (int64_t start = 0; start < length; start += ATTENTION_BLOCK) {
        const int64_t rows = length - start < ATTENTION_BLOCK ? length - start : ATTENTION_BLOCK;
        const int64_t width = start + rows;
        const float *query_block = query.start + start * query.row;
        const float *grad_out_block = grad_out.start + start * grad_out.row;
        sgemm("T", "N", &width, &rows, &head_dim, &scale, key.start, &key.row, query_block, &query.row, &zero,
              probabilities, &width);
        /* dP (rows x width) = dO_block V^T */
        sgemm("T", "N", &width, &rows, &head_dim, &one, value.start, &value.row, grad_out_block, &grad_out.row,
              &zero, grad_scores, &width);
        for (int64_t r = 0; r < rows; ++r) {
            const float *o = out.start + (start + r) * out.row, *d_o = grad_out_block + r * grad_out.row;
            float delta = 0.0f; /* rowsum(dO * O) */
            for (int64_t c = 0; c < head_dim; ++c) delta += d_o[c] * o[c];
            probabilities_row(probabilities + r * width, bias, start + r + 1, width, log_sum_exp[start + r]);
            if (dropout > 0.0f)
                dropout_factors(factors, width, seed, first_index + (uint64_t)((start + r) * length), dropout);
            score_gradient_row(probabilities + r * width, grad_scores + r * width, width, delta, grad_bias,
                               dropout > 0.0f ? factors : 0);
        }
        /* dQ_block = scale dS K, dK[:width] += scale dS^T Q_block, dV[:width] += P^T dO_block */
        sgemm("N", "N", &head_dim, &rows, &width, &scale, key.start, &key.row, grad_scores, &width, &zero,
              grad_query.start + start * grad_query.row, &grad_query.row);
        sgemm("N", "T", &head_dim, &width, &rows, &scale, query_block, &query.row, grad_scores, &width, &one,
              grad_key.start, &grad_key.row);
        sgemm("N", "T", &head_dim, &width, &rows, &one, grad_out_block, &grad_out.row, probabilities, &width, &one,
              grad_value.start, &grad_value.row);
    }
}

/* Runs `body` for every (b, h), heads shared among `threads` OpenMP threads where the library was built with OpenMP,
 * each thread with `work_floats` floats of work space; the bias of (b, h) is gathered into the last `length` of
 * them. Returns 0, or -1 when out of memory. */
#define FOR_EACH_HEAD(work_floats, body)                                                                              \
    int failed = 0;                                                                                                   \
    (void)threads;                                                                                                    \
    _Pragma("omp parallel num_threads(threads) if (threads > 1)")                                                     \
    {                                                                                                                 \
        float *work = malloc(sizeof(float) * (size_t)(work_floats));                                                 \
        if (work == 0) {                                                                                              \
            _Pragma("omp atomic write")                                                                               \
            failed = 1;                                                                                               \
        }                                                                                                             \
        _Pragma("omp for schedule(static)")                                                                           \
        for (int64_t index = 0; index < batch * heads; ++index) {                                                     \
            if (work == 0) continue;                                                                                  \
            const int64_t b = index / heads, h = index % heads;                                                       \
            const float *bias_head = bias + b * bias_strides[0] + h * bias_strides[1];                                \
            float *bias_row = work + (work_floats) - length;                                                          \
            for (int64_t j = 0; j < length; ++j) bias_row[j] = bias_head[j * bias_strides[2]];                        \
            body;                                                                                                     \
        }                                                                                                             \
        free(work);                                                                                                   \
    }                                                                                                                 \
    return failed ? -1 : 0;

/* Causal attention of `length` queries over as many keys with a per-key logit bias, for every (batch, head):
 * tensors given by their data pointer and element strides (batch, head, position; channels adjacent), bias by
 * (batch, head, position); log_sum_exp (B, H, T) contiguous, or NULL when no backward will follow; attention dropout
 * with probability `dropout` (0: none) drawn from `seed`. */
int ega_causal_attention_key_bias(
    sgemm_fn sgemm, int64_t batch, int64_t heads, int64_t length, int64_t head_dim, float scale,
    const float *query, const int64_t *query_strides, const float *key, const int64_t *key_strides,
    const float *value, const int64_t *value_strides, const float *bias, const int64_t *bias_strides,
    float *out, const int64_t *out_strides, float *log_sum_exp, float dropout, uint64_t seed, int threads)
{
    FOR_EACH_HEAD((ATTENTION_BLOCK + 2) * length,
        attend_head(sgemm, length, head_dim, scale, head_rows(query, query_strides, b, h),
                    head_rows(key, key_strides, b, h), head_rows(value, value_strides, b, h),
                    head_rows(out, out_strides, b, h),
                    log_sum_exp ? log_sum_exp + (b * heads + h) * length : 0, dropout, seed,
                    (uint64_t)(index * length * length), work))
}

/* The gradients of ega_causal_attention_key_bias with respect to query, key, value (written with their strides) and
 * bias (B, H, T, contiguous), from the forward's out and log_sum_exp and the output's gradient. */
int ega_causal_attention_key_bias_backward(
    sgemm_fn sgemm, int64_t batch, int64_t heads, int64_t length, int64_t head_dim, float scale,
    const float *query, const int64_t *query_strides, const float *key, const int64_t *key_strides,
    const float *value, const int64_t *value_strides, const float *bias, const int64_t *bias_strides,
    const float *out, const int64_t *out_strides, const float *grad_out, const int64_t *grad_out_strides,
    const float *log_sum_exp, float dropout, uint64_t seed, float *grad_query, const int64_t *grad_query_strides,
    float *grad_key, const int64_t *grad_key_strides, float *grad_value, const int64_t *grad_value_strides,
    float *grad_bias, int threads)
{
    FOR_EACH_HEAD((2 * ATTENTION_BLOCK + 2) * length,
        attend_head_backward(sgemm, length, head_dim, scale, head_rows(query, query_strides, b, h),
                             head_rows(key, key_strides, b, h), head_rows(value, value_strides, b, h),
                             head_rows(out, out_strides, b, h), head_rows(grad_out, grad_out_strides, b, h),
                             log_sum_exp + (b * heads + h) * length, dropout, seed,
                             (uint64_t)(index * length * length), head_rows(grad_query, grad_query_strides, b, h),
                             head_rows(grad_key, grad_key_strides, b, h),
                             head_rows(grad_value, grad_value_strides, b, h), grad_bias + (b * heads + h) * length,
                             work))
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
    "ega_causal_attention_key_bias": ([ctypes.c_void_p, *(ctypes.c_int64,) * 4, ctypes.c_float,
                                       *(ctypes.c_void_p,) * 11, ctypes.c_float, ctypes.c_uint64, ctypes.c_int],
                                      ctypes.c_int),
    "ega_causal_attention_key_bias_backward": ([ctypes.c_void_p, *(ctypes.c_int64,) * 4, ctypes.c_float,
                                                *(ctypes.c_void_p,) * 13, ctypes.c_float, ctypes.c_uint64,
                                                *(ctypes.c_void_p,) * 7, ctypes.c_int], ctypes.c_int),
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
    """Compile the source into the cache folder (once per source, platform and flags) and return the library's
    path: with OpenMP where the compiler has it (the attention kernel shares heads among torch's threads), else
    without. The library is written under a temporary name and renamed into place, so that no process (this one or
    another compiling at the same time) ever loads a half-written file."""
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found (set CC)")
    # -O3 without -ffast-math: vectorised loops, but the torch code's IEEE arithmetic (exp_nonpositive's rounding
    # trick needs it too)
    error = None
    for flags in (["-fopenmp"], []):
        try:
            return _build_with([compiler, "-O3", "-shared", "-fPIC", *flags])
        except subprocess.CalledProcessError as failure:
            error = failure
    raise error


def _build_with(command: list[str]) -> str:
    digest = hashlib.sha256("\n".join([_SOURCE, sys.platform, *command]).encode()).hexdigest()[:16]
    folder = _cache_dir()
    library = os.path.join(folder, f"ega_kernels_{digest}{sysconfig.get_config_var('SHLIB_SUFFIX') or '.so'}")
    if os.path.exists(library):
        return library
    os.makedirs(folder, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as work:
        source = os.path.join(work, "ega_kernels.c")
        with open(source, "w") as handle:
            handle.write(_SOURCE)
        built = os.path.join(work, "ega_kernels.so")
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
                    logger.info("EGA layers use their torch code: compiling their C kernels failed (%s)", detail)
                    library = None
                _loaded["library"] = library
    return _loaded["library"]


def _blas_sgemm() -> int | None:
    """The address of ``sgemm_`` in the BLAS library torch carries (MKL in the x86 wheels), or ``None``. The C code
    hands it int64 integers, which an LP64 BLAS reads correctly only on a little-endian machine."""
    if sys.byteorder != "little":
        return None
    folder = os.path.join(os.path.dirname(torch.__file__), "lib")
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if name.startswith(("libtorch_cpu.", "torch_cpu.")):
            try:
                return ctypes.cast(ctypes.CDLL(os.path.join(folder, name)).sgemm_, ctypes.c_void_p).value
            except (OSError, AttributeError):
                return None
    return None


def _attention_kernel():
    """(library, sgemm) when the compiled attention can run here, else ``None``: it needs the compiled library and
    torch's BLAS, and must reproduce the torch code on a small problem (which would catch a BLAS whose calling
    convention differs) before any model uses it; checked once per process."""
    if "attention" not in _loaded:
        library, sgemm = compiled_library(), _blas_sgemm()
        kernel = None if library is None or sgemm is None else (library, sgemm)
        if kernel is not None:
            generator = torch.Generator().manual_seed(0)
            qkv = torch.randn(2, 70, 3, 3, 8, generator=generator)
            bias = -3 * torch.rand(2, 3, 70, generator=generator)
            query, key, value = qkv.permute(2, 0, 3, 1, 4).unbind(0)
            scores = query @ key.transpose(-1, -2) / 8**0.5 + bias[:, :, None, :]
            scores = scores.masked_fill(torch.ones(70, 70, dtype=torch.bool).triu(1), float("-inf"))
            expected = (scores.softmax(-1) @ value).transpose(1, 2)
            got, _ = _attention_forward(kernel, qkv, bias, 8**-0.5, False)
            if not torch.allclose(got, expected, atol=1e-5, rtol=1e-4):
                logger.warning("the compiled attention does not reproduce torch here; EGA layers attend with torch")
                kernel = None
        _loaded["attention"] = kernel
    return _loaded["attention"]


def causal_attention_with_key_bias(
    qkv: torch.Tensor, bias: torch.Tensor, scaling: float, dropout: float = 0.0
) -> torch.Tensor | None:
    """softmax(q·kᵀ·scaling + bias_k)·v with query i seeing keys 0 … i, in C (``ega_causal_attention_key_bias`` and
    its backward): the gated attention without the folded channel, which costs SDPA's kernel 10-15% more time than
    the bias itself.

    Args:
        qkv: (B, T, 3, H, D) float32 on CPU, queries, keys and values, channels adjacent, other strides free (a view
            into a fused projection's output); bias: (B, H, T), any strides.
        scaling: the scores' scale (1/√D).
        dropout: attention dropout probability (the mask comes from torch's random generator).

    Returns:
        the attention output (B, T, H, D), contiguous, or ``None`` where the kernel is not available (then the caller
        attends with torch). Differentiable with respect to ``qkv`` and ``bias``.
    """
    if qkv.dim() != 5 or qkv.shape[2] != 3 or qkv.stride(-1) != 1 or qkv.stride(3) < qkv.shape[-1] or (
        qkv.stride(1) < qkv.shape[-1]
    ):
        raise ValueError(f"qkv must be (B, T, 3, H, D) with adjacent channels, got shape {tuple(qkv.shape)} and "
                         f"strides {qkv.stride()}")
    batch, length, _, heads, _ = qkv.shape
    if bias.shape != (batch, heads, length):
        raise ValueError(f"bias must have shape {(batch, heads, length)}, got {tuple(bias.shape)}")
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in (qkv, bias)):
        raise ValueError("the compiled attention takes float32 CPU tensors")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    kernel = _attention_kernel()
    if kernel is None:
        return None
    return _CausalAttentionWithKeyBias.apply(qkv, bias, scaling, float(dropout), kernel)


class _Pointers:
    """Data pointers and (batch, head, position) element strides of (B, H, T, …) tensors, as the C functions take
    them; the stride arrays live as long as this object."""

    def __init__(self, *tensors):
        self._strides = [(ctypes.c_int64 * 3)(*t.stride()[:3]) for t in tensors]
        self.arguments = [x for t, s in zip(tensors, self._strides) for x in (t.data_ptr(), ctypes.addressof(s))]


def _attention_forward(kernel, qkv, bias, scaling, with_log_sum_exp, dropout=0.0, seed=0):
    library, sgemm = kernel
    batch, length, _, heads, head_dim = qkv.shape
    query, key, value = qkv.unbind(2)
    out = qkv.new_empty(batch, length, heads, head_dim)
    log_sum_exp = qkv.new_empty(batch, heads, length) if with_log_sum_exp else None
    pointers = _Pointers(*(t.transpose(1, 2) for t in (query, key, value)), bias, out.transpose(1, 2))
    if library.ega_causal_attention_key_bias(
        sgemm, batch, heads, length, head_dim, scaling, *pointers.arguments,
        None if log_sum_exp is None else log_sum_exp.data_ptr(), dropout, seed, torch.get_num_threads(),
    ) != 0:
        raise MemoryError("out of memory in the compiled attention")
    return out, log_sum_exp


class _CausalAttentionWithKeyBias(torch.autograd.Function):
    """The C forward and backward as one autograd node; the backward recomputes the probabilities from the
    forward's log-sum-exp, as flash attention does, so nothing of size T² is kept."""

    @staticmethod
    def forward(ctx, qkv, bias, scaling, dropout, kernel):
        needs_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        # the mask's seed from torch's generator, so that torch.manual_seed makes dropout reproducible
        seed = int(torch.randint(0, 2**62, (1,)).item()) if dropout > 0 else 0
        out, log_sum_exp = _attention_forward(kernel, qkv, bias, scaling, needs_grad, dropout, seed)
        if needs_grad:
            ctx.save_for_backward(qkv, bias, out, log_sum_exp)
            ctx.scaling, ctx.dropout, ctx.seed, ctx.kernel = scaling, dropout, seed, kernel
        return out

    @staticmethod
    def backward(ctx, grad_out):
        qkv, bias, out, log_sum_exp = ctx.saved_tensors
        library, sgemm = ctx.kernel
        batch, length, _, heads, head_dim = qkv.shape
        if grad_out.stride(-1) != 1:
            grad_out = grad_out.contiguous()
        grad_qkv = qkv.new_empty(batch, length, 3, heads, head_dim)
        grad_bias = bias.new_empty(batch, heads, length)
        tensors = _Pointers(*(t.transpose(1, 2) for t in qkv.unbind(2)), bias, out.transpose(1, 2),
                            grad_out.transpose(1, 2))
        grads = _Pointers(*(g.transpose(1, 2) for g in grad_qkv.unbind(2)))
        if library.ega_causal_attention_key_bias_backward(
            sgemm, batch, heads, length, head_dim, ctx.scaling, *tensors.arguments, log_sum_exp.data_ptr(),
            ctx.dropout, ctx.seed, *grads.arguments, grad_bias.data_ptr(), torch.get_num_threads(),
        ) != 0:
            raise MemoryError("out of memory in the compiled attention")
        return grad_qkv, grad_bias, None, None, None


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
