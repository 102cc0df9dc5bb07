/* The model object as model.c builds it and forward.c runs it (internal): this rank's slice of
 * the heads and feed-forward columns, its f32 weights, the ops backend and the scratch buffers
 * of the forward pass. */
#ifndef KVSTAGE_MODEL_INTERNAL_H
#define KVSTAGE_MODEL_INTERNAL_H

#include <stdint.h>

#include "model/model.h"
#include "model/ops.h"

/* The stream ids of the weight tensors (model.c walks them; the CUDA backend places them):
 * layer l's tensor of kind k is l * 16 + k, the others the ID_* below. */
enum {
    KVS_MODEL_T_ATTN_NORM,
    KVS_MODEL_T_Q,
    KVS_MODEL_T_K,
    KVS_MODEL_T_V,
    KVS_MODEL_T_O,
    KVS_MODEL_T_FFN_NORM,
    KVS_MODEL_T_GATE,
    KVS_MODEL_T_UP,
    KVS_MODEL_T_DOWN,
    KVS_MODEL_T_KINDS
};
#define KVS_MODEL_ID_EMBED       0xffff0001u
#define KVS_MODEL_ID_OUTPUT      0xffff0002u
#define KVS_MODEL_ID_OUTPUT_NORM 0xffff0003u

/* The seeded weights' rule (model.c): element (row, col) of a full tensor [rows][cols] is
 * offset + scale * 1.7320508 * (2u - 1) with u = (mix64(key + row * cols + col) >> 40) * 2^-24
 * in float (uniform with variance scale^2 around offset). */
typedef struct {
    uint64_t key;
    float scale, offset;
} kvs_model_seed_rule_t;

typedef struct kvs_model_cuda kvs_model_cuda_t; /* model/cuda/model_cuda.h */

/* One layer's weights on this rank (host memory; all NULL for a model on a CUDA device, whose
 * weights the backend holds). Matrices are [out][in] (a row per output feature), so a
 * column-split shard is a run of rows and a row-split shard a run of columns. q = q_heads *
 * head_dim and kv = kv_heads * head_dim of this rank; f = this rank's ffn columns. */
typedef struct {
    float *attn_norm; /* [dim] */
    float *wq;        /* [q][dim] */
    float *wk;        /* [kv][dim] */
    float *wv;        /* [kv][dim] */
    float *wo;        /* [dim][q] */
    float *ffn_norm;  /* [dim] */
    float *w_gate;    /* [f][dim] */
    float *w_up;      /* [f][dim] */
    float *w_down;    /* [dim][f] */
} kvs_model_layer_t;

/* Forward-pass buffers, grown to the largest batch seen (tokens) and context (positions). */
typedef struct {
    uint32_t tokens;        /* capacity in tokens */
    uint32_t positions;     /* capacity of scores */
    uint32_t seqs;          /* capacity of the per-sequence buffers */
    float *x;               /* [tokens][dim] the residual stream */
    float *h;               /* [tokens][dim] normed input of a block */
    float *q;               /* [tokens][q] */
    float *k;               /* [tokens][kv] */
    float *v;               /* [tokens][kv] */
    float *att;             /* [tokens][q] attention output */
    float *gate;            /* [tokens][f] */
    float *up;              /* [tokens][f] */
    double *partial;        /* [tokens][dim] row-split partial sums, all-reduced in place */
    uint32_t *pos;          /* [tokens] position of each token */
    uint32_t *tok;          /* [tokens] token id of each token */
    const uint32_t **pages; /* [tokens] page table of each token's sequence */
    float *last;            /* [seqs][dim] the final residual of each sequence's last token */
    float *last_norm;       /* [seqs][dim] */
    float *scores;          /* [positions] */
} kvs_model_scratch_t;

struct kvs_model {
    kvs_model_config_t config;
    kvs_tp_t tp;
    kvs_kv_shape_t kv_shape;
    uint32_t q_first, q_heads;    /* query heads [q_first, q_first + q_heads) */
    uint32_t kv_first, kv_heads;  /* KV heads (protocol.md §1) */
    uint32_t ffn_first, ffn_cols; /* feed-forward columns */
    uint32_t *q_kv;               /* [q_heads] local KV head read by each local query head */
    uint32_t block_o, block_down; /* quantisation blocks of the row-split Wo and Wdown */
    float *arena;                 /* every weight below, one allocation */
    float *embed;                 /* [vocab][dim] */
    float *output;                /* [vocab][dim]; == embed when tied */
    float *output_norm;           /* [dim] */
    kvs_model_layer_t *layers;    /* [layers] */
    kvs_model_backend_t backend;
    kvs_model_scratch_t scratch;
    int device;             /* -1: the CPU; else the CUDA device the weights and forward are on */
    kvs_model_cuda_t *cuda; /* device >= 0: the CUDA backend (weights, scratch, streams) */
    kvs_model_reduce_t reduce; /* kvs_model_use_group's choice; HOST until then */
    int grouped;               /* kvs_model_use_group was called */
    kvs_model_wait_fn wait_fn; /* kvs_model_set_wait: the CPU pass calls it after each layer, the
                                * CUDA one while it waits for the pass's end */
    void *wait_arg;
};

/* Frees the scratch buffers (forward.c); the model stays usable and regrows them. */
void kvs__model_scratch_free(kvs_model_scratch_t *s);

#endif
