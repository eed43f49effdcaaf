"""Compiled C kernels for CPU float32: EGA's causal energy gate, and causal attention with a per-key bias.

The causal gate (linear energies, causal statistics). Outside training, an EGA layer's gate is bound by the number
of tensor ops rather than their size: its torch code (``causal_zscore``/``causal_zscore_step``, ``log_gate_bias``,
the writes into the folded q/k/v rows) is about twenty element-wise ops, each costing microseconds of dispatch; in
a decoding step, on a few dozen numbers, that is as much as the rest of the attention layer. Two C functions do the
same arithmetic in one call each, on the output of the layer's fused projection (``folded_qkv_weights``), where the
linear energies already are:

- ``ega_causal_gate_step``, one decoding step: reads the running moments of the last cached key, writes the new
  key's log-gate bias and the new moments into its q/k/v row, and hands back contiguous q/k/v;
- ``ega_causal_gate_prefill``, the first positions of sequences without padding (a forward pass, the prompt of a
  generation): runs the moments along each sequence (Welford's update) and writes every key's bias, and its
  moments where a KV cache will keep them. Neither has a backward: training runs the gate's torch code.

The attention. Folding the bias into an extra q/k channel lets any kernel apply it, but SDPA's CPU kernels then work
on D + 1 channels, 10-20% slower than on D. ``ega_attention_forward`` / ``ega_attention_backward`` compute causal
attention with the bias added to the scores, in blocks of 64 queries (one BLAS product for a block's scores against
the keys its last query sees, a vectorised row softmax with the causal cut by index, a second product for the
values; the backward recomputes the probabilities from the saved log-sum-exp, as flash attention does), with
attention dropout drawn from a hash of a seed so that the backward redraws the forward's mask. Queries may sit at
any ascending key positions, and rows may have different query counts: CHIAR's routed tokens use the same kernel
(``causal_attention_at_row_positions``).
``ega_decode_attention_key_bias`` attends one decoding step over a cache in the folded layout. The products call the
``sgemm_`` of the BLAS torch links (MKL in the x86 wheels); heads are shared among torch's threads through OpenMP
where the compiler has it.

The source is compiled with the system C compiler on first use (about a second) into a cache folder
(``$HF_SPECTRAL_KERNEL_CACHE``, else ``~/.cache/hf_spectral/kernels``) and loaded with ``ctypes``: no torch headers,
no build step at install. Without a compiler, without torch's BLAS, when the attention does not reproduce torch's
on a small problem at load, or with ``HF_SPECTRAL_COMPILED_KERNELS=0``, the layers keep their torch code, which
computes the same numbers (tests compare both).
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
#include <string.h>

static inline float exp_nonpositive(float x);

/* log(1 + y) for y in [0, 1] as 2 atanh(s), s = y / (2 + y) <= 1/3: a series in s^2 <= 1/9, branch-free */
static inline float log1p_unit(float y)
{
    const float s = y / (2.0f + y), s2 = s * s;
    float p = 1.0f / 17.0f;
    p = p * s2 + 1.0f / 15.0f;
    p = p * s2 + 1.0f / 13.0f;
    p = p * s2 + 1.0f / 11.0f;
    p = p * s2 + 1.0f / 9.0f;
    p = p * s2 + 1.0f / 7.0f;
    p = p * s2 + 1.0f / 5.0f;
    p = p * s2 + 1.0f / 3.0f;
    p = p * s2 + 1.0f;
    return 2.0f * s * p;
}

/* log sigmoid(x) = min(x, 0) - log(1 + exp(-|x|)) without library calls (a third less time for the gate pass) */
static inline float log_sigmoid(float x) { return fminf(x, 0.0f) - log1p_unit(exp_nonpositive(-fabsf(x))); }

/* Welford's update of one energy's running moments (written to *mean, *m2) and its causal z-score
 * z = deviation / sqrt(max(m2 / (count - 1), eps^2)) = deviation / sqrt(max(m2, m2_floor)) * sqrt(count - 1),
 * with z_scale = sqrt(count - 1), or 0 while fewer than two energies were seen (z is then 0). */
static inline float welford_zscore(float energy, float old_mean, float old_m2, float inverse_count, float z_scale,
                                   float m2_floor, float *mean, float *m2)
{
    const float delta = energy - old_mean;
    *mean = old_mean + inverse_count * delta;
    const float deviation = energy - *mean;
    *m2 = old_m2 + delta * deviation;
    return deviation * ((1.0f / sqrtf(fmaxf(*m2, m2_floor))) * z_scale);
}

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
 * written to bias + h*bias_stride (the key's bias channel in the row, or a separate array). count: the positions
 * seen, this one included. */
static void gate_position(const GateLayout *layout, float *row, const float *old, int64_t old_stride,
                          float *new, int64_t new_stride, int64_t count, float *bias, int64_t bias_stride)
{
    const int64_t scales = layout->scales;
    const float inverse_count = (float)(1.0 / (double)count);
    const float z_scale = count < 2 ? 0.0f : (float)sqrt((double)(count - 1));
    /* (at the first position m2 is 0 and z_scale 0: a floor of 1 keeps 1 / sqrt finite, z then 0) */
    const float m2_floor = count < 2 ? 1.0f : (float)((double)layout->eps * (double)layout->eps * (double)(count - 1));
    if (scales == 1 && layout->log_mix == 0) {  /* one energy per head (EGA-1): one straight loop over the heads */
        const float *energy = row + layout->energy_offset, *alpha = layout->alpha;
        const float *neg_alpha_tau = layout->neg_alpha_tau, *log_gate_at_mean = layout->log_gate_at_mean;
        const int64_t heads = layout->heads;
#pragma omp simd
        for (int64_t h = 0; h < heads; ++h) {
            float mean, m2;
            const float z = welford_zscore(energy[h], old[h * old_stride], old[h * old_stride + 1], inverse_count,
                                           z_scale, m2_floor, &mean, &m2);
            new[h * new_stride] = mean;
            new[h * new_stride + 1] = m2;
            bias[h * bias_stride] = log_sigmoid(neg_alpha_tau[h] + alpha[h] * z) - log_gate_at_mean[h];
        }
        return;
    }
    for (int64_t h = 0; h < layout->heads; ++h) {
        const float *old_h = old + h * old_stride;
        float *new_h = new + h * new_stride;
        float log_gate = 0.0f, running_max = -INFINITY, running_sum = 0.0f;
        for (int64_t s = 0; s < scales; ++s) {
            const int64_t hs = h * scales + s;
            float mean, m2;
            const float z = welford_zscore(row[layout->energy_offset + hs], old_h[s], old_h[scales + s],
                                           inverse_count, z_scale, m2_floor, &mean, &m2);
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
        bias[h * bias_stride] = log_gate - layout->log_gate_at_mean[h];
    }
}

/* One decoding step for `batch` rows, rows[b*row_stride + column], after past_count keys. last_values: the value
 * row (B, H, head_stride; given strides) of the last of them, which holds the running moments in its channels
 * head_dim .. head_dim + 2*scales - 1 (in the cache, or the previous step's output); the new moments go to the
 * row's value state channels. Then the
 * rows' queries, keys and values are copied to qkv_out (3, B, H, head_stride), contiguous: the layouts the
 * attention and the cache take, without the half-dozen tensor ops that would make them. */
void ega_causal_gate_step(
    const GateLayout *layout, float *rows, int64_t row_stride, int64_t batch,
    const float *last_values, int64_t value_batch_stride, int64_t value_head_stride, int64_t past_count,
    float *qkv_out)
{
    const float *last = last_values + layout->head_dim;
    const int64_t part = layout->heads * layout->head_stride;
    /* The moments sit one cache line per (row, head) across a cache of megabytes: ask for all of them at once, so
     * that the misses overlap instead of stalling the gate one after another. */
    for (int64_t b = 0; b < batch; ++b)
        for (int64_t h = 0; h < layout->heads; ++h)
            __builtin_prefetch(last + b * value_batch_stride + h * value_head_stride);
    for (int64_t b = 0; b < batch; ++b) {
        float *row = rows + b * row_stride;
        gate_position(layout, row, last + b * value_batch_stride, value_head_stride,
                      row + layout->value_offset, layout->head_stride, past_count + 1, row + layout->key_offset,
                      layout->head_stride);
        for (int64_t p = 0; p < 3; ++p)
            memcpy(qkv_out + (p * batch + b) * part, row + p * part, sizeof(float) * (size_t)part);
    }
}

/* The first `length` positions of `batch` sequences (no past, no padding), rows[b*batch_stride + t*row_stride +
 * column], position by position; with write_state the running moments at each position also go to the row's
 * value state channels (for the KV cache). The biases go to the rows' key channels, or with bias_out to bias_out
 * (B, T, H), contiguous: without a cache, the attention then reads them from a few kilobytes instead of one cache
 * line per head from rows of megabytes. Returns 0, or -1 when out of memory. */
int ega_causal_gate_prefill(
    const GateLayout *layout, float *rows, int64_t batch_stride, int64_t row_stride, int64_t batch, int64_t length,
    int write_state, float *bias_out)
{
    const int64_t moments_per_head = 2 * layout->scales;
    float *moments = calloc((size_t)(layout->heads * moments_per_head), sizeof(float));
    if (moments == 0) return -1;
    for (int64_t b = 0; b < batch; ++b) {
        for (int64_t i = 0; i < layout->heads * moments_per_head; ++i) moments[i] = 0.0f;
        for (int64_t t = 0; t < length; ++t) {
            float *row = rows + b * batch_stride + t * row_stride;
            if (bias_out)
                gate_position(layout, row, moments, moments_per_head, moments, moments_per_head, t + 1,
                              bias_out + (b * length + t) * layout->heads, 1);
            else
                gate_position(layout, row, moments, moments_per_head, moments, moments_per_head, t + 1,
                              row + layout->key_offset, layout->head_stride);
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
/* one copy of each row loop per vector width, the widest the CPU has chosen when the library loads */
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

/* Replaces scores[0 .. count) by exp(score - maximum) and returns their sum, in LANES partial sums. */
static inline float exp_and_sum(float *scores, int64_t count, float maximum)
{
    float sums[LANES];
    for (int l = 0; l < LANES; ++l) sums[l] = 0.0f;
    int64_t j = 0;
    for (; j + LANES <= count; j += LANES)
        for (int l = 0; l < LANES; ++l) {
            const float p = exp_nonpositive(scores[j + l] - maximum);
            scores[j + l] = p;
            sums[l] += p;
        }
    for (; j < count; ++j) {
        const float p = exp_nonpositive(scores[j] - maximum);
        scores[j] = p;
        sums[0] += p;
    }
    float total = 0.0f;
    for (int l = 0; l < LANES; ++l) total += sums[l];
    return total;
}

/* One score row: adds the keys' bias to the first `visible` scores, replaces them by exp(score - max), zeroes the
 * rest of the row up to `width`, and returns the sum (and the maximum in *maximum_out). Maxima and sums run in LANES
 * partial lanes, which the compiler turns into vector registers without reassociating anything the C code does not
 * say. */
VECTOR_CLONES
static float softmax_row(float *scores, const float *bias, int64_t visible, int64_t width, float *maximum_out)
{
    float lanes[LANES];
    for (int l = 0; l < LANES; ++l) lanes[l] = -INFINITY;
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
    for (j = visible; j < width; ++j) scores[j] = 0.0f;
    *maximum_out = maximum;
    return exp_and_sum(scores, visible, maximum);
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

/* One call's shapes and options. Query r of batch row b sits at key slot positions[b * query_length + r] (ascending
 * within a row) and sees keys 0 ... that slot; positions NULL: query r at slot r (a dense causal pass, as many
 * queries as keys). row_starts (B + 1 offsets) or NULL: rows with their own query counts, row b's queries being
 * queries row_starts[b] ... row_starts[b + 1] - 1 of one sequence of query_length (the caller hands query and out
 * with batch stride 0, log_sum_exp as (B, H, query_length)), so that one call serves rows routed unevenly. */
typedef struct {
    int64_t batch, heads, query_length, key_length, head_dim;
    float scale, dropout;  /* dropout: attention dropout probability, 0 for none */
    uint64_t seed;         /* of the dropout mask */
    const int64_t *positions;
    const int64_t *row_starts;
} AttentionShape;

static int64_t query_slot(const int64_t *positions, int64_t r) { return positions ? positions[r] : r; }

/* Batch row b's first query and query count. */
static int64_t first_query(const AttentionShape *shape, int64_t b)
{
    return shape->row_starts ? shape->row_starts[b] : 0;
}
static int64_t query_count(const AttentionShape *shape, int64_t b)
{
    return shape->row_starts ? shape->row_starts[b + 1] - shape->row_starts[b] : shape->query_length;
}
static const int64_t *row_positions(const AttentionShape *shape, int64_t b)
{
    if (shape->positions == 0) return 0;
    return shape->positions + (shape->row_starts ? shape->row_starts[b] : b * shape->query_length);
}

/* A (batch, head) slice of a (B, H, N, C) tensor given by its data pointer and element strides (batch, head,
 * position; channels adjacent): where its position 0 starts, and how far apart its positions are. */
typedef struct { float *start; int64_t row; } HeadRows;

static HeadRows head_rows(const float *data, const int64_t *strides, int64_t b, int64_t h)
{
    HeadRows rows = {(float *)data + b * strides[0] + h * strides[1], strides[2]};
    return rows;
}

/* Forward of one (batch, head), in blocks of ATTENTION_BLOCK queries: the block's scores against every key its last
 * query sees in one BLAS product, the biased, causally cut softmax row by row, the weighted values in a second
 * product. bias: the head's key bias, contiguous; work: ATTENTION_BLOCK + 1 rows of key_length floats (scores,
 * dropout factors); log_sum_exp: query_length floats or NULL. */
static void attend_head(sgemm_fn sgemm, const AttentionShape *shape, int64_t b, int64_t h, HeadRows query,
                        HeadRows key, HeadRows value, const float *bias, HeadRows out, float *log_sum_exp, float *work)
{
    const float one = 1.0f, zero = 0.0f;
    const int64_t *positions = row_positions(shape, b), count = query_count(shape, b), first = first_query(shape, b);
    const uint64_t first_index = (uint64_t)((b * shape->heads + h) * shape->query_length * shape->key_length);
    float *factors = work + ATTENTION_BLOCK * shape->key_length;
    query.start += first * query.row;
    out.start += first * out.row;
    if (log_sum_exp) log_sum_exp += first;
    for (int64_t start = 0; start < count; start += ATTENTION_BLOCK) {
        const int64_t rows = count - start < ATTENTION_BLOCK ? count - start : ATTENTION_BLOCK;
        const int64_t width = query_slot(positions, start + rows - 1) + 1; /* the keys the block's last query sees */
        float inverse_sums[ATTENTION_BLOCK];
        /* scores (rows x width, row-major) = scale * Q_block K^T, i.e. column-major K Q^T */
        sgemm("T", "N", &width, &rows, &shape->head_dim, &shape->scale, key.start, &key.row,
              query.start + start * query.row, &query.row, &zero, work, &width);
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t visible = query_slot(positions, start + r) + 1;
            float maximum;
            const float sum = softmax_row(work + r * width, bias, visible, width, &maximum);
            inverse_sums[r] = 1.0f / sum;
            if (log_sum_exp) log_sum_exp[start + r] = maximum + logf(sum);
            if (shape->dropout > 0.0f) {
                float *row = work + r * width;
                dropout_factors(factors, visible, shape->seed,
                                first_index + (uint64_t)((start + r) * shape->key_length), shape->dropout);
                for (int64_t j = 0; j < visible; ++j) row[j] *= factors[j];
            }
        }
        /* out block (rows x head_dim, row-major) = P V, i.e. column-major V^T P^T */
        float *out_block = out.start + start * out.row;
        sgemm("N", "N", &shape->head_dim, &rows, &width, &one, value.start, &value.row, work, &width, &zero,
              out_block, &out.row);
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t c = 0; c < shape->head_dim; ++c) out_block[r * out.row + c] *= inverse_sums[r];
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
 * does) and the dropout mask from its seed. grad_key, grad_value and grad_bias (key_length floats) are overwritten.
 * work: 2 * ATTENTION_BLOCK + 2 rows of key_length floats (probabilities, their gradients, dropout factors, a bias
 * gradient nobody reads where grad_bias is not wanted). */
static void attend_head_backward(sgemm_fn sgemm, const AttentionShape *shape, int64_t b, int64_t h, HeadRows query,
                                 HeadRows key, HeadRows value, const float *bias, HeadRows out, HeadRows grad_out,
                                 const float *log_sum_exp, HeadRows grad_query, HeadRows grad_key,
                                 HeadRows grad_value, float *grad_bias, float *work)
{
    const float one = 1.0f, zero = 0.0f;
    const int64_t head_dim = shape->head_dim, key_length = shape->key_length;
    const int64_t *positions = row_positions(shape, b), count = query_count(shape, b), first = first_query(shape, b);
    const uint64_t first_index = (uint64_t)((b * shape->heads + h) * shape->query_length * key_length);
    float *probabilities = work, *grad_scores = work + ATTENTION_BLOCK * key_length;
    float *factors = work + 2 * ATTENTION_BLOCK * key_length;
    query.start += first * query.row;
    out.start += first * out.row;
    grad_out.start += first * grad_out.row;
    grad_query.start += first * grad_query.row;
    log_sum_exp += first;
    for (int64_t j = 0; j < key_length; ++j) {
        grad_bias[j] = 0.0f;
        for (int64_t c = 0; c < head_dim; ++c) {
            grad_key.start[j * grad_key.row + c] = 0.0f;
            grad_value.start[j * grad_value.row + c] = 0.0f;
        }
    }
    for (int64_t start = 0; start < count; start += ATTENTION_BLOCK) {
        const int64_t rows = count - start < ATTENTION_BLOCK ? count - start : ATTENTION_BLOCK;
        const int64_t width = query_slot(positions, start + rows - 1) + 1;
        const float *query_block = query.start + start * query.row;
        const float *grad_out_block = grad_out.start + start * grad_out.row;
        sgemm("T", "N", &width, &rows, &head_dim, &shape->scale, key.start, &key.row, query_block, &query.row, &zero,
              probabilities, &width);
        /* dP (rows x width) = dO_block V^T */
        sgemm("T", "N", &width, &rows, &head_dim, &one, value.start, &value.row, grad_out_block, &grad_out.row,
              &zero, grad_scores, &width);
        for (int64_t r = 0; r < rows; ++r) {
            const float *o = out.start + (start + r) * out.row, *d_o = grad_out_block + r * grad_out.row;
            float delta = 0.0f; /* rowsum(dO * O) */
            for (int64_t c = 0; c < head_dim; ++c) delta += d_o[c] * o[c];
            probabilities_row(probabilities + r * width, bias, query_slot(positions, start + r) + 1, width,
                              log_sum_exp[start + r]);
            if (shape->dropout > 0.0f)
                dropout_factors(factors, width, shape->seed, first_index + (uint64_t)((start + r) * key_length),
                                shape->dropout);
            score_gradient_row(probabilities + r * width, grad_scores + r * width, width, delta, grad_bias,
                               shape->dropout > 0.0f ? factors : 0);
        }
        /* dQ_block = scale dS K, dK[:width] += scale dS^T Q_block, dV[:width] += P^T dO_block */
        sgemm("N", "N", &head_dim, &rows, &width, &shape->scale, key.start, &key.row, grad_scores, &width, &zero,
              grad_query.start + start * grad_query.row, &grad_query.row);
        sgemm("N", "T", &head_dim, &width, &rows, &shape->scale, query_block, &query.row, grad_scores, &width, &one,
              grad_key.start, &grad_key.row);
        sgemm("N", "T", &head_dim, &width, &rows, &one, grad_out_block, &grad_out.row, probabilities, &width, &one,
              grad_value.start, &grad_value.row);
    }
}

/* Asks for the cache lines of `row` (count floats) to come to the caches: the next head's keys and values, one row per
 * row of the current head, so that their memory latency hides behind this head's arithmetic. */
static inline void prefetch_row(const float *row, int64_t count)
{
    for (int64_t c = 0; c < count; c += 16) __builtin_prefetch(row + c);
}

/* One decoding step's attention for one (batch, head) over a cache in the folded layout: the query's first head_dim
 * channels against each cached key's, plus the key's bias in its channel head_dim; the values' first head_dim
 * channels. work: length floats. Reading the cache as it is, rather than through SDPA over head_dim + P channels,
 * also skips the extra channels' arithmetic. next_key, next_value: the next head's rows to prefetch, or NULL. */
VECTOR_CLONES
static void decode_head(int64_t length, int64_t head_dim, float scale, const float *restrict query, HeadRows key,
                        HeadRows value, float *restrict out, float *restrict scores, const float *next_key,
                        const float *next_value)
{
    float maximum = -INFINITY;
    for (int64_t j = 0; j < length; ++j) {
        const float *k = key.start + j * key.row;
        if (next_key) prefetch_row(next_key + j * key.row, head_dim + 1);
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t c = 0; c < head_dim; ++c) dot += query[c] * k[c];
        const float s = dot * scale + k[head_dim];
        scores[j] = s;
        maximum = s > maximum ? s : maximum;
    }
    const float total = exp_and_sum(scores, length, maximum);
    for (int64_t c = 0; c < head_dim; ++c) out[c] = 0.0f;
    for (int64_t j = 0; j < length; ++j) {
        const float *restrict v = value.start + j * value.row;
        if (next_value) prefetch_row(next_value + j * value.row, head_dim);
        const float p = scores[j];
        for (int64_t c = 0; c < head_dim; ++c) out[c] += p * v[c];
    }
    const float inverse = 1.0f / total;
    for (int64_t c = 0; c < head_dim; ++c) out[c] *= inverse;
}

/* One decoding step's attention for every (batch, head): query (B, H, 1, >= head_dim), key and value (B, H, length,
 * > head_dim), the keys' bias in channel head_dim, out (B, H, 1, head_dim), given by data pointer and element
 * strides (batch, head, position; channels adjacent). Returns 0, or -1 when out of memory. */
int ega_decode_attention_key_bias(
    int64_t batch, int64_t heads, int64_t length, int64_t head_dim, float scale, const float *query,
    const int64_t *query_strides, const float *key, const int64_t *key_strides, const float *value,
    const int64_t *value_strides, float *out, const int64_t *out_strides, int threads)
{
    int failed = 0;
    (void)threads;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float *scores = malloc(sizeof(float) * (size_t)length);
        if (scores == 0) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t index = 0; index < batch * heads; ++index) {
            if (scores == 0) continue;
            const int64_t b = index / heads, h = index % heads, next = index + 1 < batch * heads ? index + 1 : index;
            const int64_t next_b = next / heads, next_h = next % heads;
            decode_head(length, head_dim, scale, head_rows(query, query_strides, b, h).start,
                        head_rows(key, key_strides, b, h), head_rows(value, value_strides, b, h),
                        head_rows(out, out_strides, b, h).start, scores,
                        next == index ? 0 : head_rows(key, key_strides, next_b, next_h).start,
                        next == index ? 0 : head_rows(value, value_strides, next_b, next_h).start);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

/* Runs `body` for every (b, h), heads shared among `threads` OpenMP threads where the library was built with OpenMP,
 * each thread with `rows` rows of key_length floats of work space, the last holding the bias of (b, h) (zeros
 * without one). Returns 0, or -1 when out of memory. */
#define FOR_EACH_HEAD(rows, body)                                                                                     \
    const int64_t key_length = shape->key_length;                                                                     \
    int failed = 0;                                                                                                   \
    (void)threads;                                                                                                    \
    _Pragma("omp parallel num_threads(threads) if (threads > 1)")                                                     \
    {                                                                                                                 \
        float *work = malloc(sizeof(float) * (size_t)((rows) * key_length));                                         \
        if (work == 0) {                                                                                              \
            _Pragma("omp atomic write")                                                                               \
            failed = 1;                                                                                               \
        }                                                                                                             \
        _Pragma("omp for schedule(static)")                                                                           \
        for (int64_t index = 0; index < shape->batch * shape->heads; ++index) {                                       \
            if (work == 0) continue;                                                                                  \
            const int64_t b = index / shape->heads, h = index % shape->heads;                                         \
            float *bias_row = work + ((rows) - 1) * key_length;                                                       \
            if (bias) {                                                                                               \
                const float *bias_head = bias + b * bias_strides[0] + h * bias_strides[1];                            \
                for (int64_t j = 0; j < key_length; ++j) bias_row[j] = bias_head[j * bias_strides[2]];                \
            } else {                                                                                                  \
                for (int64_t j = 0; j < key_length; ++j) bias_row[j] = 0.0f;                                          \
            }                                                                                                         \
            body;                                                                                                     \
        }                                                                                                             \
        free(work);                                                                                                   \
    }                                                                                                                 \
    return failed ? -1 : 0;

/* Whether the rows' query counts add up and each row's positions ascend within [0, key_length): checked here, where it
 * costs a pass over a few integers, rather than by torch reductions that each synchronise. */
static int valid_positions(const AttentionShape *shape)
{
    if (shape->row_starts && (shape->row_starts[0] != 0 || shape->row_starts[shape->batch] != shape->query_length))
        return 0;
    for (int64_t b = 0; b < shape->batch; ++b) {
        const int64_t *positions = row_positions(shape, b), count = query_count(shape, b);
        if (count < 0) return 0;
        if (positions == 0) continue;
        for (int64_t r = 0; r < count; ++r)
            if (positions[r] < (r ? positions[r - 1] : 0) || positions[r] >= shape->key_length) return 0;
    }
    return 1;
}

/* Causal attention with a per-key logit bias for every (batch, head): query (B, H, query_length, D), key and value
 * (B, H, key_length, D), out (B, H, query_length, D) given by data pointer and element strides (batch, head,
 * position; channels adjacent), bias (B, H, key_length) by its strides, or NULL; log_sum_exp (B, H, query_length)
 * contiguous, or NULL when no backward will follow. */
int ega_attention_forward(
    sgemm_fn sgemm, const AttentionShape *shape, const float *query, const int64_t *query_strides,
    const float *key, const int64_t *key_strides, const float *value, const int64_t *value_strides,
    const float *bias, const int64_t *bias_strides, float *out, const int64_t *out_strides, float *log_sum_exp,
    int threads)
{
    if (!valid_positions(shape)) return -2;
    FOR_EACH_HEAD(ATTENTION_BLOCK + 2,
        attend_head(sgemm, shape, b, h, head_rows(query, query_strides, b, h), head_rows(key, key_strides, b, h),
                    head_rows(value, value_strides, b, h), bias_row, head_rows(out, out_strides, b, h),
                    log_sum_exp ? log_sum_exp + index * shape->query_length : 0, work))
}

/* The gradients of ega_attention_forward with respect to query, key, value (written with their strides) and bias
 * (B, H, key_length, contiguous; NULL when not needed), from the forward's out and log_sum_exp and the output's
 * gradient. */
int ega_attention_backward(
    sgemm_fn sgemm, const AttentionShape *shape, const float *query, const int64_t *query_strides,
    const float *key, const int64_t *key_strides, const float *value, const int64_t *value_strides,
    const float *bias, const int64_t *bias_strides, const float *out, const int64_t *out_strides,
    const float *grad_out, const int64_t *grad_out_strides, const float *log_sum_exp, float *grad_query,
    const int64_t *grad_query_strides, float *grad_key, const int64_t *grad_key_strides, float *grad_value,
    const int64_t *grad_value_strides, float *grad_bias, int threads)
{
    FOR_EACH_HEAD(2 * ATTENTION_BLOCK + 3,
        attend_head_backward(sgemm, shape, b, h, head_rows(query, query_strides, b, h),
                             head_rows(key, key_strides, b, h), head_rows(value, value_strides, b, h), bias_row,
                             head_rows(out, out_strides, b, h), head_rows(grad_out, grad_out_strides, b, h),
                             log_sum_exp + index * shape->query_length,
                             head_rows(grad_query, grad_query_strides, b, h), head_rows(grad_key, grad_key_strides, b, h),
                             head_rows(grad_value, grad_value_strides, b, h),
                             grad_bias ? grad_bias + index * key_length : work + (2 * ATTENTION_BLOCK + 1) * key_length,
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
                              ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p], None),
    "ega_causal_gate_prefill": ([ctypes.POINTER(_GateLayout), ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                 ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p], ctypes.c_int),
    "ega_attention_forward": ([ctypes.c_void_p] * 13 + [ctypes.c_int], ctypes.c_int),
    "ega_attention_backward": ([ctypes.c_void_p] * 22 + [ctypes.c_int], ctypes.c_int),
    "ega_decode_attention_key_bias": ([ctypes.c_int64] * 4 + [ctypes.c_float] + [ctypes.c_void_p] * 8 + [ctypes.c_int],
                                      ctypes.c_int),
}

_lock = threading.Lock()
_loaded = {}  # "library" -> the loaded library or None; "attention" -> (library, sgemm) or None (_attention_kernel)


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
    # trick needs it too); -fno-math-errno: sqrtf without the errno check
    error = None
    for flags in (["-fopenmp"], []):
        try:
            return _build_with([compiler, "-O3", "-fno-math-errno", "-shared", "-fPIC", *flags])
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
            got, _ = _attention_forward(kernel, query, key, value, bias, None, 8**-0.5, 0.0, 0, False)
            if not torch.allclose(got, expected, atol=1e-5, rtol=1e-4):
                logger.warning("the compiled attention does not reproduce torch here; layers attend with torch")
                kernel = None
        _loaded["attention"] = kernel
    return _loaded["attention"]


def _check_float32_cpu(*tensors):
    if any(t is not None and (t.dtype != torch.float32 or t.device.type != "cpu") for t in tensors):
        raise ValueError("the compiled attention takes float32 CPU tensors")


def causal_attention_with_key_bias(
    qkv: torch.Tensor, bias: torch.Tensor, scaling: float, dropout: float = 0.0
) -> torch.Tensor | None:
    """softmax(q·kᵀ·scaling + bias_k)·v with query i seeing keys 0 … i, in C (``ega_attention_forward`` and its
    backward): EGA's gated attention without the folded channel, which costs SDPA's kernels 10-20% more time than
    the bias itself.

    Args:
        qkv: (B, T, 3, H, D) float32 on CPU, queries, keys and values, channels adjacent, other strides free (a view
            into a fused projection's output); bias: (B, H, T), any strides.
        scaling: the scores' scale (1/√D).
        dropout: attention dropout probability (the mask's seed comes from torch's random generator).

    Returns:
        the attention output (B, T, H, D), contiguous, or ``None`` where the kernel is not available (then the caller
        attends with torch). Differentiable with respect to ``qkv`` and ``bias``; the gradient of ``qkv`` comes as
        one (B, T, 3, H, D) tensor.
    """
    if qkv.dim() != 5 or qkv.shape[2] != 3 or qkv.stride(-1) != 1 or qkv.stride(3) < qkv.shape[-1] or (
        qkv.stride(1) < qkv.shape[-1]
    ):
        raise ValueError(f"qkv must be (B, T, 3, H, D) with adjacent channels, got shape {tuple(qkv.shape)} and "
                         f"strides {qkv.stride()}")
    batch, length, _, heads, _ = qkv.shape
    if bias.shape != (batch, heads, length):
        raise ValueError(f"bias must have shape {(batch, heads, length)}, got {tuple(bias.shape)}")
    _check_float32_cpu(qkv, bias)
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    kernel = _attention_kernel()
    if kernel is None:
        return None
    return _CompiledAttention.apply(qkv, None, None, bias, None, scaling, float(dropout), kernel)


def causal_attention_at_row_positions(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor, row_starts: torch.Tensor,
    scaling: float, dropout: float = 0.0,
) -> torch.Tensor | None:
    """Causal attention of queries gathered from some positions (CHIAR's routed tokens) over all keys, in C: a query
    at key slot p sees keys 0 … p of its row, and only the keys its block of 64 queries can see are computed, so the
    work falls with the number of queries as a dense causal kernel's does with T. The queries are those of batch
    row 0, then of row 1, ... (``mask.nonzero()`` order): rows may have different counts, none pads its queries to
    another's, and one call serves them all.

    Args:
        query: (N, H, D); key, value: (B, H, S, D); float32 on CPU, channels adjacent, other strides free.
        positions: (N,) int64 key slots, contiguous, ascending within each row, each in [0, S) (checked in C, where
            it costs no synchronising torch reductions).
        row_starts: (B + 1,) int64 offsets into the N queries, contiguous: row b's queries are
            ``row_starts[b] … row_starts[b + 1] - 1``; row_starts[0] = 0 and row_starts[B] = N.

    Returns:
        (N, H, D), contiguous, or ``None`` where the kernel is not available. Differentiable with respect to query,
        key and value.
    """
    batch, heads, _, head_dim = key.shape
    if query.dim() != 3 or query.shape[1:] != (heads, head_dim) or value.shape != key.shape:
        raise ValueError(f"query {tuple(query.shape)}, key {tuple(key.shape)} and value {tuple(value.shape)} do not "
                         "fit (N, H, D), (B, H, S, D), (B, H, S, D)")
    if any(t.stride(-1) != 1 or t.stride(-2) < head_dim for t in (query, key, value)):
        raise ValueError("query, key and value need adjacent channels")
    if positions.shape != (query.shape[0],) or row_starts.shape != (batch + 1,) or any(
        t.dtype != torch.int64 or not t.is_contiguous() for t in (positions, row_starts)
    ):
        raise ValueError(f"positions ({query.shape[0]},) and row_starts ({batch + 1},) must be contiguous int64, got "
                         f"{positions.dtype} {tuple(positions.shape)} and {row_starts.dtype} {tuple(row_starts.shape)}")
    _check_float32_cpu(query, key, value)
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    kernel = _attention_kernel()
    if kernel is None:
        return None
    return _CompiledAttention.apply(query, key, value, None, positions, scaling, float(dropout), kernel, row_starts)


def decoding_attention_with_key_bias(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, head_dim: int, scaling: float
) -> torch.Tensor | None:
    """One decoding step of EGA's gated attention over a KV cache in the folded layout, in C: softmax over the cached
    keys of q·k·scaling + bias_k, with q and k their first ``head_dim`` channels and bias_k the key's channel
    ``head_dim``, weighting the values' first ``head_dim`` channels. (SDPA over the head_dim + P folded channels
    costs 20% more than over head_dim at batch 32.)

    Args:
        query: (B, H, 1, ≥ head_dim); key, value: (B, H, S, > head_dim); float32 on CPU, channels adjacent, other
            strides free.

    Returns:
        (B, 1, H, head_dim), contiguous, or ``None`` where the kernel is not available. No autograd.
    """
    batch, heads = query.shape[:2]
    if query.shape[2] != 1 or key.shape[:2] != (batch, heads) or value.shape[:3] != key.shape[:3] or (
        min(query.shape[3], value.shape[3]) < head_dim or key.shape[3] <= head_dim
    ):
        raise ValueError(f"query {tuple(query.shape)}, key {tuple(key.shape)} and value {tuple(value.shape)} are not "
                         f"one decoding step over a folded cache with head_dim {head_dim}")
    if any(t.stride(-1) != 1 for t in (query, key, value)):
        raise ValueError("query, key and value need adjacent channels")
    _check_float32_cpu(query, key, value)
    kernel = _attention_kernel()
    if kernel is None:
        return None
    out = query.new_empty(batch, 1, heads, head_dim)
    pointers = _Pointers(query, key, value, out.transpose(1, 2))
    if kernel[0].ega_decode_attention_key_bias(
        batch, heads, key.shape[2], head_dim, scaling, *pointers.arguments, torch.get_num_threads()
    ) != 0:
        raise MemoryError("out of memory in the compiled attention")
    return out


class _AttentionShape(ctypes.Structure):
    _fields_ = [
        *((name, ctypes.c_int64) for name in ("batch", "heads", "query_length", "key_length", "head_dim")),
        ("scale", ctypes.c_float), ("dropout", ctypes.c_float), ("seed", ctypes.c_uint64), ("positions", ctypes.c_void_p),
        ("row_starts", ctypes.c_void_p),
    ]


def _data_pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


class _Pointers:
    """Data pointers and (batch, head, position) element strides of (B, H, N, …) tensors, as the C functions take
    them (``None`` for a missing tensor); the stride arrays live as long as this object."""

    def __init__(self, *tensors):
        self._strides = [None if t is None else (ctypes.c_int64 * 3)(*t.stride()[:3]) for t in tensors]
        self.arguments = [
            x for t, s in zip(tensors, self._strides)
            for x in ((None, None) if t is None else (t.data_ptr(), ctypes.addressof(s)))
        ]


def _attention_forward(kernel, query, key, value, bias, positions, scaling, dropout, seed, with_log_sum_exp,
                       row_starts=None):
    """Runs ``ega_attention_forward`` on (B, H, ·, D) views; returns the output (B, M, H, D) and the log-sum-exp.
    With ``row_starts``, query is (N, H, D) (every row's queries in turn) and the output (N, H, D)."""
    library, sgemm = kernel
    batch, heads, head_dim = key.shape[0], key.shape[1], key.shape[3]
    count = query.shape[0] if row_starts is not None else query.shape[2]
    shape = _AttentionShape(batch, heads, count, key.shape[2], head_dim, scaling, dropout, seed,
                            _data_pointer(positions), _data_pointer(row_starts))
    log_sum_exp = query.new_empty(batch, heads, count) if with_log_sum_exp else None
    if row_starts is None:
        out = query.new_empty(batch, count, heads, head_dim)
        pointers = _Pointers(query, key, value, bias, out.transpose(1, 2))
    else:
        out = query.new_empty(count, heads, head_dim)
        pointers = _Pointers(_rows_as_batch(query, batch), key, value, bias, _rows_as_batch(out, batch))
    status = library.ega_attention_forward(
        sgemm, ctypes.byref(shape), *pointers.arguments, None if log_sum_exp is None else log_sum_exp.data_ptr(),
        torch.get_num_threads(),
    )
    if status == -2:
        raise ValueError(f"positions must ascend within each row and lie in [0, {key.shape[2]}), and row_starts "
                         f"must run from 0 to {count}")
    if status != 0:
        raise MemoryError("out of memory in the compiled attention")
    return out, log_sum_exp


def _rows_as_batch(rows: torch.Tensor, batch: int) -> torch.Tensor:
    """(N, H, D) rows seen as (batch, H, N, D) with batch stride 0: the C functions' view of ragged rows."""
    return rows.transpose(0, 1)[None].expand(batch, -1, -1, -1)


def _qkv_views(query_or_qkv, key, value):
    """(B, H, ·, D) views of the queries, keys and values: from one (B, T, 3, H, D) tensor when key is None."""
    if key is None:
        return tuple(t.transpose(1, 2) for t in query_or_qkv.unbind(2))
    return query_or_qkv, key, value


class _CompiledAttention(torch.autograd.Function):
    """The C forward and backward as one autograd node. Inputs: either one qkv tensor (B, T, 3, H, D) with key and
    value ``None`` (its gradient then comes as one tensor, not three to stack), or query, key, value (B, H, ·, D).
    The backward recomputes the probabilities from the forward's log-sum-exp, as flash attention does, and the
    dropout mask from its seed, so nothing of size T² is kept."""

    @staticmethod
    def forward(ctx, query_or_qkv, key, value, bias, positions, scaling, dropout, kernel, row_starts=None):
        needs_grad = any(ctx.needs_input_grad[:4])
        # the mask's seed from torch's generator, so that torch.manual_seed makes dropout reproducible
        seed = int(torch.randint(0, 2**62, (1,)).item()) if dropout > 0 else 0
        query, key_view, value_view = _qkv_views(query_or_qkv, key, value)
        out, log_sum_exp = _attention_forward(
            kernel, query, key_view, value_view, bias, positions, scaling, dropout, seed, needs_grad, row_starts
        )
        if needs_grad:
            ctx.save_for_backward(query_or_qkv, key, value, bias, positions, out, log_sum_exp, row_starts)
            ctx.scaling, ctx.dropout, ctx.seed, ctx.kernel = scaling, dropout, seed, kernel
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query_or_qkv, key, value, bias, positions, out, log_sum_exp, row_starts = ctx.saved_tensors
        library, sgemm = ctx.kernel
        query, key_view, value_view = _qkv_views(query_or_qkv, key, value)
        batch, heads, key_length, head_dim = key_view.shape
        if grad_out.stride(-1) != 1:
            grad_out = grad_out.contiguous()
        if key is None:
            grad_first = torch.empty_like(query_or_qkv, memory_format=torch.contiguous_format)
            grads = _qkv_views(grad_first, None, None)
        else:
            grads = tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (query, key, value))
            grad_first = grads[0]
        grad_bias = None if bias is None else bias.new_empty(batch, heads, key_length)
        if row_starts is None:
            count, seen = query.shape[2], (query, out.transpose(1, 2), grad_out.transpose(1, 2), grads[0])
        else:
            count, seen = query.shape[0], (_rows_as_batch(t, batch) for t in (query, out, grad_out, grads[0]))
        query_seen, out_seen, grad_out_seen, grad_query_seen = seen
        shape = _AttentionShape(batch, heads, count, key_length, head_dim, ctx.scaling, ctx.dropout, ctx.seed,
                                _data_pointer(positions), _data_pointer(row_starts))
        tensors = _Pointers(query_seen, key_view, value_view, bias, out_seen, grad_out_seen)
        grad_pointers = _Pointers(grad_query_seen, *grads[1:])
        if library.ega_attention_backward(
            sgemm, ctypes.byref(shape), *tensors.arguments, log_sum_exp.data_ptr(), *grad_pointers.arguments,
            None if grad_bias is None else grad_bias.data_ptr(), torch.get_num_threads(),
        ) != 0:
            raise MemoryError("out of memory in the compiled attention")
        if key is None:
            return grad_first, None, None, grad_bias, None, None, None, None, None
        return grads[0], grads[1], grads[2], grad_bias, None, None, None, None, None


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

    def step(self, rows: torch.Tensor, values: torch.Tensor, position: int, past_length: int) -> torch.Tensor:
        """One decoding step after ``past_length`` ≥ 1 cached keys: rows (B, 1, N); values (B, H, > position, D + P)
        whose position ``position`` holds the last cached key's value row with the running moments (the layer's
        cached values, or the previous step's output). The new moments go to the rows' value channels; returns the
        rows' queries, keys and values, (3, B, H, 1, D + P) contiguous."""
        strides = values.stride()
        qkv = rows.new_empty(3, rows.shape[0], self.layout.heads, 1, self.layout.head_stride)
        self._step(self._layout_pointer, rows.data_ptr(), rows.stride(0), rows.shape[0],
                   values.data_ptr() + position * strides[2] * values.element_size(), strides[0], strides[1],
                   past_length, qkv.data_ptr())
        return qkv

    def prefill(self, rows: torch.Tensor, bias_out: torch.Tensor | None = None) -> None:
        """The first T positions of each sequence, without padding: rows (B, T, N); the running moments go to the
        value channels when the layout has room for them (a KV cache is built), the biases to the key channels or,
        given, to ``bias_out`` (B, T, H), contiguous."""
        if bias_out is not None and (bias_out.shape != (*rows.shape[:2], self.layout.heads)
                                     or not bias_out.is_contiguous() or bias_out.dtype != torch.float32):
            raise ValueError(f"bias_out must be a contiguous float32 tensor of shape "
                             f"{(*rows.shape[:2], self.layout.heads)}, got {tuple(bias_out.shape)}")
        if self._prefill(self._layout_pointer, rows.data_ptr(), rows.stride(0), rows.stride(1), rows.shape[0],
                         rows.shape[1], int(self.stores_state), None if bias_out is None else bias_out.data_ptr()) != 0:
            raise MemoryError("out of memory in the compiled causal gate")
