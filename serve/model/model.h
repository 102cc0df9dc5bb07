/* The Llama-family reference model: configuration, the weights of one tensor-parallel rank
 * (loaded from a GGUF file or seeded), a forward pass whose KV cache lives in a kvs_pool_t,
 * and token sampling. Written for clarity first; results are bitwise independent of batching,
 * chunking and the TP size (the rules and their limits are in serve/model/forward.c). */
#ifndef KVSTAGE_MODEL_H
#define KVSTAGE_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "model/gguf.h"
#include "kvstage/layout.h"
#include "kvstage/pool.h"
#include "kvstage/rng.h"
#include "kvstage/status.h"

typedef struct {
    uint32_t layers;
    uint32_t dim;      /* residual stream width */
    uint32_t ffn_dim;  /* hidden width of the SwiGLU feed-forward */
    uint32_t heads;    /* query heads */
    uint32_t kv_heads; /* K/V heads (GQA when < heads) */
    uint32_t head_dim; /* even: RoPE rotates adjacent pairs */
    uint32_t vocab;
    uint32_t max_ctx; /* positions the model accepts: 0..max_ctx-1 */
    float rope_theta;
    float norm_eps;
} kvs_model_config_t;

typedef struct kvs_model kvs_model_t;

/* Reads the llama.* metadata (general.architecture must be "llama"); vocab comes from
 * token_embd.weight. KVS_ERR_UNSUPPORTED for another architecture, RoPE scaling or partial
 * rotary; KVS_ERR_INVALID (naming the key) for a missing or out-of-range value. */
kvs_status_t kvs_model_config_from_gguf(const kvs_gguf_t *gguf, kvs_model_config_t *cfg_p);

/* Checks the configuration and that it can be split over tp: heads % T == 0,
 * ffn_dim % T == 0 and the KV heads as kvs_tp_validate says (replicated when T > kv_heads).
 * KVS_ERR_INVALID with a message naming the mismatch. */
kvs_status_t kvs_model_config_validate(const kvs_model_config_t *cfg, kvs_tp_t tp);

/* Dequantises this rank's shard of every tensor to f32: query heads
 * [r*heads/T, (r+1)*heads/T), the KV heads of protocol.md §1, feed-forward columns
 * [r*ffn/T, (r+1)*ffn/T); embeddings, norms and output are whole. The GGUF may be closed
 * afterwards. Output weights are tied to the embeddings unless output.weight exists. */
kvs_status_t kvs_model_load(const kvs_gguf_t *gguf, kvs_tp_t tp, kvs_model_t **model_p);
/* The same on CUDA device `device` (-1: the CPU, as kvs_model_load): every tensor dequantised
 * to f32 on the host one shard at a time and stored on the device in bf16 (norm weights in
 * f32); the forward pass then runs there (model/cuda/model_cuda.h). KVS_ERR_UNSUPPORTED in a
 * build without CUDA, for a missing device, or for a shape the CUDA kernels do not cover (head
 * dim other than 64 or 128). */
kvs_status_t kvs_model_load_on(const kvs_gguf_t *gguf, kvs_tp_t tp, int device,
                               kvs_model_t **model_p);

/* Random weights for tests: every element of the full (TP1) tensors is a function of (seed,
 * tensor, element index) only, so shard r of TP T equals the same slice of the TP1 weights.
 * Matrices (the output matrix too: it is not tied) are uniform with variance 1/fan_in, norm
 * weights near 1, embeddings variance 1. */
kvs_status_t kvs_model_seeded(const kvs_model_config_t *cfg, uint64_t seed, kvs_tp_t tp,
                              kvs_model_t **model_p);
/* The same weights, generated on CUDA device `device` by the same rule and stored in bf16 (no
 * host copy: an 8B shape needs no file and no host memory); -1: the CPU. */
kvs_status_t kvs_model_seeded_on(const kvs_model_config_t *cfg, uint64_t seed, kvs_tp_t tp,
                                 int device, kvs_model_t **model_p);

void kvs_model_destroy(kvs_model_t *model);

const kvs_model_config_t *kvs_model_config(const kvs_model_t *model);
kvs_tp_t kvs_model_tp(const kvs_model_t *model);
/* The pool shape this model writes: layers, kv_heads, head_dim for K and V, MHA; f32 (E = 4)
 * on the CPU unless set to bf16 (kvs_model_set_kv_bytes), bf16 (E = 2) on a CUDA device. */
kvs_kv_shape_t kvs_model_kv_shape(const kvs_model_t *model);
/* -1 for a model on the CPU, else its CUDA device (its pool must be device memory there). */
int kvs_model_device(const kvs_model_t *model);
/* The KV element size the model writes: 4 (f32, the CPU's default) or 2 (bf16, the only one on
 * a CUDA device). A CPU model set to bf16 stores its K/V rounded to bf16 and attends over those
 * values (still bitwise independent of batching, chunking and TP), so its pool pairs with a GPU
 * instance's. Before the first forward pass. KVS_ERR_INVALID for another size,
 * KVS_ERR_UNSUPPORTED for f32 on a device. */
kvs_status_t kvs_model_set_kv_bytes(kvs_model_t *model, uint32_t kv_bytes);
/* The same shape from the configuration alone, with K/V elements of kv_bytes (a server checking
 * a peer before any rank loads). */
kvs_kv_shape_t kvs_model_config_kv_shape(const kvs_model_config_t *config, uint32_t kv_bytes);

/* Sums n doubles elementwise over the TP group, adding the ranks' buffers in rank order
 * (rank 0 + rank 1 + ...), and leaves the identical sum in every rank's buf. */
typedef kvs_status_t (*kvs_allreduce_fn)(void *arg, double *buf, size_t n);

/* How a TP model's row-split partial sums (the Wo and Wdown outputs) are summed over its ranks. */
typedef enum {
    /* the forward call's kvs_allreduce_fn (the engine's: the host TP group): on a GPU the
     * partials go to the host and back; the only way for ranks on the CPU or sharing a GPU */
    KVS_MODEL_REDUCE_HOST,
    /* ncclAllReduce on the devices, on the model's stream (ranks on pairwise distinct GPUs, a
     * build with NCCL): no host round trip, and the TP calls replay CUDA graphs too */
    KVS_MODEL_REDUCE_NCCL,
} kvs_model_reduce_t;

/* The choice kvs_model_use_group makes, as a pure function of what every rank knows after the
 * exchange: devices[r] is rank r's CUDA device (-1: the CPU), nccl whether every rank's
 * kvstage has NCCL. NCCL only for n >= 2 ranks all on GPUs, pairwise distinct (NCCL refuses
 * two ranks on one device), with NCCL; else the host. why (why_len bytes, may be NULL) gets
 * one line saying which and why, naming the ranks that decided it. */
kvs_model_reduce_t kvs_model_reduce_choose(const int *devices, uint32_t n, int nccl, char *why,
                                           size_t why_len);

/* Sets up how model (rank r of TP n) reduces over `group` (its TP group: the same size and
 * rank), once, before its first forward pass; collective: every rank of the group calls it.
 * The ranks exchange their devices (and SM counts) over the group and every rank takes the
 * same kvs_model_reduce_choose decision. For NCCL rank 0 makes an ncclUniqueId, the group
 * broadcasts it, each rank creates its communicator on its device (ncclCommInitRank) and one
 * small all-reduce checks it; path_p (may be NULL) gets the path taken. Without a call the
 * model reduces through the host (KVS_MODEL_REDUCE_HOST), as before.
 * Falls back to the host path with a warning on every rank when rank 0 cannot make an id.
 * Errors: KVS_ERR_INVALID (group of another size or rank; called twice), a group error as is
 * (the exchange failed), and, once the ranks went for NCCL, KVS_ERR_IO when this rank's
 * communicator cannot be created or fails its check (logged with NCCL's reason): no fallback
 * then, as the other ranks may be waiting inside NCCL's set-up; the instance does not start. */
struct kvs_tpgroup;
kvs_status_t kvs_model_use_group(kvs_model_t *model, struct kvs_tpgroup *group,
                                 kvs_model_reduce_t *path_p);
/* The path in use: KVS_MODEL_REDUCE_HOST unless kvs_model_use_group chose NCCL. */
kvs_model_reduce_t kvs_model_reduce_path(const kvs_model_t *model);

/* One sequence of a forward batch: tokens at positions pos0..pos0+n-1 (n >= 1). pages cover
 * positions 0..pos0+n-1 of this sequence: position t is token t % P of page pages[t / P];
 * positions below pos0 must already hold this sequence's K and V. */
typedef struct {
    const uint32_t *tokens; /* [n] */
    uint32_t n;
    uint32_t pos0;
    const uint32_t *pages; /* [npages], npages >= ceil((pos0 + n) / P) */
    uint32_t npages;
    /* Optional [n][vocab]: the logits of every new token of this sequence, not only the last
     * (prompt logprobs); each row the same floats as that token's row would be as a last token.
     * NULL: none. */
    float *all_logits;
    /* Optional: this sequence's next token is sampled where the model runs, from its last
     * token's logits, by kvs_sample_at(logits, vocab, sample, NULL, draw): sample must pass
     * kvs_sample_on_device_ok (KVS_ERR_INVALID otherwise), draw is the uniform [0, 1) double
     * kvs_sample would take from its rng (kvs_sample_draw; unused when greedy), and the token
     * lands in *token. On a CUDA device only the token comes back: this sequence's row of
     * logits is left unwritten (the tolerances of model_cuda.h apply to the choice as to the
     * logits). A CPU model computes the row and samples it on the host. NULL: no sampling. */
    const struct kvs_sample_params *sample;
    double draw;
    uint32_t *token;
    /* 1: the caller has no use for this sequence's row of logits (a prompt chunk before the
     * last); a model on a device then leaves it unwritten and does not wait to copy it. */
    uint8_t no_logits;
} kvs_model_seq_t;

/* Runs the model over every new token of every sequence: writes their K and V into the pool
 * and attends over positions 0..pos of their own sequence. logits receives, for each sequence,
 * the logits of its last token: [nseq][vocab], identical on every rank. All ranks of the group
 * call it with the same tokens and positions (page ids are per rank); reduce may be NULL only
 * when tp_size == 1 or the model reduces through NCCL (kvs_model_use_group), which ignores it. The
 * pool must have shape kvs_model_kv_shape() and the model's tp, in host memory (a CPU model) or on
 * the model's CUDA device; pages must be allocated. logits and all_logits are host memory either
 * way. KVS_ERR_INVALID (before any write) for a mismatch; KVS_ERR_NOMEM when scratch cannot grow;
 * an error from reduce is returned as is, and the K/V of the new positions are then unspecified.
 * Not thread-safe per model (scratch is shared). */
kvs_status_t kvs_model_forward(kvs_model_t *model, kvs_pool_t *pool, const kvs_model_seq_t *seqs,
                               uint32_t nseq, kvs_allreduce_fn reduce, void *reduce_arg,
                               float *logits);

/* fn(arg) is called over and over while a forward pass runs: on a device while the host waits
 * for the pass's last kernels, on the CPU after every layer (the engine moves KV meanwhile: it
 * answers the other side, takes grants and writes chunks at rest, or takes the chunks that
 * arrive), so a long pass does not leave the handoff waiting, nor the other side resending
 * what it took for lost. fn must not call the model. NULL fn: none (with NCCL a plain wait). */
typedef void (*kvs_model_wait_fn)(void *arg);
void kvs_model_set_wait(kvs_model_t *model, kvs_model_wait_fn fn, void *arg);

/* Sampling ranges, shared by the engine's checks and the HTTP API's messages. */
#define KVS_SAMPLE_PENALTY_MAX 2.0f   /* |presence|, |frequency| <= it; repetition in (0, it] */
#define KVS_SAMPLE_BIAS_MAX    100.0f /* |logit bias| <= it */
#define KVS_SAMPLE_BIAS_LIMIT  300u   /* logit bias entries per request at most */

typedef struct {
    uint32_t token; /* < vocab */
    float bias;     /* added to the token's logit */
} kvs_logit_bias_t;

/* Every knob's neutral value is its zero, except top_p (1). sample.c says in which order they
 * act. */
typedef struct kvs_sample_params {
    float temperature;        /* <= 0: greedy (argmax, lowest id on ties) */
    float top_p;              /* nucleus mass in (0, 1]; <= 0 keeps only the most likely tokens */
    uint32_t top_k;           /* keep the k most likely tokens; 0: off */
    float min_p;              /* keep tokens at least min_p times as likely as the top; 0: off */
    float presence_penalty;   /* OpenAI: minus this once for a token generated before */
    float frequency_penalty;  /* OpenAI: minus this for every time a token was generated */
    float repetition_penalty; /* vLLM, over prompt and generated tokens; 0 or 1: off */
    const kvs_logit_bias_t *bias; /* [n_bias]; borrowed */
    uint32_t n_bias;
} kvs_sample_params_t;

/* The tokens a request has seen, for the penalties. */
typedef struct {
    const uint32_t *tokens; /* [len]: the prompt, then the tokens generated so far */
    uint32_t len;
    uint32_t prompt_len; /* tokens[prompt_len, len) are the generated ones */
    uint32_t *counts;    /* [vocab] scratch, all zero, left all zero */
} kvs_sample_history_t;

/* NULL when params are valid for a vocabulary of vocab tokens, else what is wrong (a static
 * string naming the knob and its range): temperature finite and >= 0, top_p and min_p in
 * [0, 1], presence and frequency penalties in [-2, 2], repetition 0 or in (0, 2], at most
 * KVS_SAMPLE_BIAS_LIMIT biases, each finite, |bias| <= 100, for a token < vocab. */
const char *kvs_sample_params_invalid(const kvs_sample_params_t *params, uint32_t vocab);

/* Picks the next token, rewriting logits[vocab] in place (bias, then penalties). params NULL:
 * greedy. history NULL, or its counts NULL: no penalty applies (pass both for penalties).
 * Greedy (temperature <= 0, or rng NULL) draws nothing from rng; otherwise the draw is from
 * softmax(logits / temperature) restricted by top-k, min-p and top-p (tokens tied at a cut are
 * all kept). NaN logits are never picked. Allocation-free. */
uint32_t kvs_sample(float *logits, uint32_t vocab, const kvs_sample_params_t *params,
                    const kvs_sample_history_t *history, kvs_rng_t *rng);
/* The uniform double in [0, 1) kvs_sample takes from rng (its only draw). */
double kvs_sample_draw(kvs_rng_t *rng);
/* kvs_sample with that draw given as u in [0, 1) (unused when greedy): the same token as
 * kvs_sample with an rng whose next draw is u. */
uint32_t kvs_sample_at(float *logits, uint32_t vocab, const kvs_sample_params_t *params,
                       const kvs_sample_history_t *history, double u);
/* Whether params can be sampled on a device (kvs_model_seq_t.sample): no logit bias and no
 * penalties (they need the request's history on the host). */
int kvs_sample_on_device_ok(const kvs_sample_params_t *params);

/* ---- logprobs ---- */

#define KVS_LOGPROBS_TOP_MAX 20 /* alternatives per position at most (OpenAI's top_logprobs) */
#define KVS_LOGPROB_FLOOR    (-9999.0f) /* reported for -inf (OpenAI's value): JSON has no inf */

typedef struct {
    uint32_t token;
    float logprob;
} kvs_token_logprob_t;

/* One position's log-probabilities: of the token there, and of the n_top most likely. */
typedef struct {
    float logprob;
    uint32_t n_top;
    kvs_token_logprob_t top[KVS_LOGPROBS_TOP_MAX]; /* most likely first, lower id on ties */
} kvs_logprobs_t;

/* log_softmax(logits[vocab])[token] and the n_top (<= KVS_LOGPROBS_TOP_MAX, <= vocab) largest
 * entries, in double precision; the raw logits: no bias, penalty or temperature (vLLM's
 * default). NaN logits count as -inf; a logprob below KVS_LOGPROB_FLOOR (-inf) is reported as
 * it. Allocation-free. */
void kvs_logprobs(const float *logits, uint32_t vocab, uint32_t token, uint32_t n_top,
                  kvs_logprobs_t *out_p);

#endif
