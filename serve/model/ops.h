/* The model's compute ops as a table (internal), like the copy backends of staging/copy.h: the
 * CPU forward pass (forward.c) only calls these; ops_cpu.c is the reference. Every op computes
 * each output row from its own input row with a fixed order of operations, so a token's result
 * never depends on which other tokens share the call; the rules below are part of the CPU
 * contract. The CUDA backend (model/cuda/model_cuda.h) runs the whole forward pass on the
 * device instead (bf16, fused projections, one stream), and is held to tolerances against this
 * reference rather than to these bitwise rules: its logits within 0.05 + 3% of the largest CPU
 * logit's magnitude, and the CPU's token wherever the CPU's top-2 gap exceeds twice that
 * (tests/model/test_forward_cuda.c). TP ranks on distinct GPUs that reduce through NCCL
 * (kvs_model_use_group) are held to the same bound: NCCL sums f32 partials in its own order, so
 * their logits are not bitwise those of the host TP group's rank-order double sum, but every
 * rank gets the identical sum, hence identical logits. */
#ifndef KVSTAGE_MODEL_OPS_H
#define KVSTAGE_MODEL_OPS_H

#include <stddef.h>
#include <stdint.h>

#include "kvstage/pool.h"

/* Row-split partial sums are quantised to multiples of 2^-KVS_MODEL_FIX_SHIFT per block of
 * inputs, which makes their sum exact (integers below 2^53 in doubles) and so independent of
 * how the blocks were divided among ranks. Exact while every block sum stays below 2^15 and
 * every output below 2^17 in magnitude; beyond that the result is still correct to double
 * precision, only no longer bitwise TP-independent. */
#define KVS_MODEL_FIX_SHIFT 36
/* Largest head dim a model may have (model.c checks it; the CPU attention's scratch). */
#define KVS_MODEL_MAX_HEAD_DIM 4096u

/* Largest block of inputs quantised as one; the forward pass picks a divisor of it that no
 * rank boundary splits (see forward.c). */
#define KVS_MODEL_FIX_BLOCK 32

/* The K/V of one layer and where each token of a call sits in it. */
typedef struct {
    /* this layer's K and V regions of the pool: f32, or bf16 (elem_bytes 2: stored rounded to
     * nearest even, read back exactly) */
    const kvs_region_t *k, *v;
    uint32_t page_size;
    uint32_t n;                   /* tokens in the call */
    const uint32_t *pos;          /* [n] absolute position of each token in its sequence */
    const uint32_t *const *pages; /* [n] the page table of each token's sequence */
    uint32_t kv_heads;            /* this rank's KV heads (the pool's heads) */
    uint32_t head_dim;
    /* kv_write: the new tokens' K and V, [n][kv_heads][head_dim] */
    const float *k_new, *v_new;
    /* attention: */
    uint32_t q_heads;     /* this rank's query heads */
    const uint32_t *q_kv; /* [q_heads] the local KV head each query head reads */
    float scale;          /* 1/sqrt(head_dim) */
    const float *q;       /* [n][q_heads][head_dim] */
    float *out;           /* [n][q_heads][head_dim] */
    float *scores;        /* scratch, [max pos + 1] */
} kvs_model_kv_desc_t;

typedef struct kvs_model_ops {
    const char *name;
    /* x[t] = table[tokens[t]]: x [n][dim], table [vocab][dim]. */
    void (*embed)(void *ctx, const float *table, uint32_t dim, const uint32_t *tokens, uint32_t n,
                  float *x);
    /* y[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w; the sum of squares in double, in order. */
    void (*rmsnorm)(void *ctx, const float *x, const float *w, uint32_t n, uint32_t dim, float eps,
                    float *y);
    /* Column-split projection y[t][i] = dot(x[t], w[i]) in float over all `in` inputs with 8
     * accumulators (input j goes to accumulator j % 8) combined as
     * ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)). x [n][in], w [out][in], y [n][out]. */
    void (*matmul)(void *ctx, const float *x, const float *w, uint32_t n, uint32_t in, uint32_t out,
                   float *y);
    /* Row-split partial y[t][i] = sum over blocks b of round(2^S * dot_b), where dot_b is the
     * double dot product over inputs [b*block, (b+1)*block) with 4 accumulators by
     * (j - b*block) % 4 combined (a0+a2)+(a1+a3), S = KVS_MODEL_FIX_SHIFT, round to nearest
     * even; blocks summed in order. block divides in. y [n][out]: doubles holding integers. */
    void (*matmul_partial)(void *ctx, const float *x, const float *w, uint32_t n, uint32_t in,
                           uint32_t out, uint32_t block, double *y);
    /* x[t] = (float) (x[t] + 2^-S * d[t]) elementwise: the reduced partial joins the residual
     * with one rounding. x [count], d [count]. */
    void (*add_partial)(void *ctx, float *x, const double *d, size_t count);
    /* Rotates adjacent pairs (x[2i], x[2i+1]) of every head by pos[t] * theta^(-2i/head_dim),
     * angle, cos and sin in double. x [n][heads][head_dim]. */
    void (*rope)(void *ctx, float *x, const uint32_t *pos, uint32_t n, uint32_t heads,
                 uint32_t head_dim, float theta);
    /* Stores k_new and v_new of every token at its position in the pool. */
    void (*kv_write)(void *ctx, const kvs_model_kv_desc_t *d);
    /* For every token and query head: causal softmax attention over positions 0..pos[t] read
     * from the pool. Scores are float dots (matmul's order) times scale; softmax subtracts the
     * max, exps in float, sums in double in position order; the output accumulates p*V in
     * float in position order and is divided by the sum at the end. */
    void (*attention)(void *ctx, const kvs_model_kv_desc_t *d);
    /* g = silu(g) * u elementwise, silu(g) = g / (1 + exp(-g)) in float. */
    void (*silu_mul)(void *ctx, float *g, const float *u, size_t count);
    void (*destroy)(void *ctx);
} kvs_model_ops_t;

typedef struct {
    const kvs_model_ops_t *ops;
    void *ctx;
} kvs_model_backend_t;

/* The CPU reference backend: single-threaded, on the calling thread; ctx is unused. */
extern const kvs_model_ops_t kvs_model_ops_cpu;

#endif
