/* The forward pass of the Llama-family model on one tensor-parallel rank, with the KV cache in
 * the paged pool: one function per block, every buffer with its shape.
 *
 * Determinism rules. Disaggregated serving compares prefill on one TP size with decode on
 * another, and chunked prefill with one-token decode, token for token; so:
 * 1. A token's result never depends on how tokens are batched or chunked or on which other
 *    sequences share the call: every op computes each row from that row alone with a fixed
 *    order of operations (ops.h), and attention reads K/V back from the pool, where they were
 *    written as the same floats whichever call produced them.
 * 2. Column-split projections (q, k, v, gate, up and the logits) compute every output on one
 *    rank as the full dot product over the replicated input, 8 float accumulators combined in
 *    a fixed order, so each output is the same float on any TP size.
 * 3. Row-split projections (Wo over heads, Wdown over ffn columns) leave each rank a partial
 *    sum, computed in double block by block (blocks of up to 32 inputs that no rank boundary
 *    splits: a divisor of head_dim for Wo, of ffn_dim / T for Wdown), each block's sum
 *    rounded to a multiple of 2^-36. The all-reduce adds the ranks' doubles in rank order and
 *    only then is the sum rounded to float, joining the residual. Every addend being an
 *    integer multiple of 2^-36, held exactly in a double while below 2^17, these additions
 *    are exact: the sum does not depend on where the rank boundaries fall, and TP1 and TP3
 *    give bitwise the same float. (Past that range, activations above about 2^15, the result
 *    is merely accurate; see ops.h.)
 * 4. Everything else (embedding, norms, RoPE, attention, SwiGLU, the residual) is computed
 *    whole and identically on every rank from replicated inputs.
 */
#include <math.h>
#include <string.h>

#include "kvstage/alloc.h"
#include "kvstage/log.h"
#include "model/cuda/model_cuda.h"
#include "model/model_internal.h"

/* Most tokens one forward call takes (keeps every scratch size far from overflow). */
#define MAX_BATCH_TOKENS (1u << 24)

/* ---- scratch ---- */

static void free_token_buffers(kvs_model_scratch_t *s)
{
    kvs_free(s->x);
    kvs_free(s->h);
    kvs_free(s->q);
    kvs_free(s->k);
    kvs_free(s->v);
    kvs_free(s->att);
    kvs_free(s->gate);
    kvs_free(s->up);
    kvs_free(s->partial);
    kvs_free(s->pos);
    kvs_free(s->tok);
    kvs_free((void *) s->pages);
    s->x = s->h = s->q = s->k = s->v = s->att = s->gate = s->up = NULL;
    s->partial = NULL;
    s->pos = s->tok = NULL;
    s->pages = NULL;
    s->tokens = 0;
}

void kvs__model_scratch_free(kvs_model_scratch_t *s)
{
    free_token_buffers(s);
    kvs_free(s->last);
    kvs_free(s->last_norm);
    kvs_free(s->scores);
    memset(s, 0, sizeof(*s));
}

/* Grows the scratch to `tokens` tokens, `positions` attention positions and `seqs` sequences.
 * On failure the model holds no half-grown group and can try again. */
static kvs_status_t scratch_reserve(kvs_model_t *m, uint32_t tokens, uint32_t positions,
                                    uint32_t seqs)
{
    kvs_model_scratch_t *s = &m->scratch;
    const size_t dim = m->config.dim, hd = m->config.head_dim;
    const size_t q = m->q_heads * hd, kv = m->kv_heads * hd, f = m->ffn_cols;
    if (tokens > s->tokens) {
        free_token_buffers(s);
        const size_t n = tokens;
        s->x = kvs_malloc(n * dim * sizeof(float));
        s->h = kvs_malloc(n * dim * sizeof(float));
        s->q = kvs_malloc(n * q * sizeof(float));
        s->k = kvs_malloc(n * kv * sizeof(float));
        s->v = kvs_malloc(n * kv * sizeof(float));
        s->att = kvs_malloc(n * q * sizeof(float));
        s->gate = kvs_malloc(n * f * sizeof(float));
        s->up = kvs_malloc(n * f * sizeof(float));
        s->partial = kvs_malloc(n * dim * sizeof(double));
        s->pos = kvs_malloc(n * sizeof(uint32_t));
        s->tok = kvs_malloc(n * sizeof(uint32_t));
        s->pages = kvs_malloc(n * sizeof(*s->pages));
        if (!s->x || !s->h || !s->q || !s->k || !s->v || !s->att || !s->gate || !s->up ||
            !s->partial || !s->pos || !s->tok || !s->pages) {
            free_token_buffers(s);
            goto err_nomem;
        }
        s->tokens = tokens;
    }
    if (positions > s->positions) {
        kvs_free(s->scores);
        s->positions = 0;
        s->scores = kvs_malloc((size_t) positions * sizeof(float));
        if (s->scores == NULL) goto err_nomem;
        s->positions = positions;
    }
    if (seqs > s->seqs) {
        kvs_free(s->last);
        kvs_free(s->last_norm);
        s->seqs = 0;
        s->last = kvs_malloc((size_t) seqs * dim * sizeof(float));
        s->last_norm = kvs_malloc((size_t) seqs * dim * sizeof(float));
        if (s->last == NULL || s->last_norm == NULL) {
            kvs_free(s->last);
            kvs_free(s->last_norm);
            s->last = s->last_norm = NULL;
            goto err_nomem;
        }
        s->seqs = seqs;
    }
    return KVS_OK;

err_nomem:
    kvs_error("model: out of memory growing forward scratch to %u tokens, %u positions, %u "
              "sequences",
              tokens, positions, seqs);
    return KVS_ERR_NOMEM;
}

/* ---- input checks ---- */

static int same_shape(const kvs_kv_shape_t *a, const kvs_kv_shape_t *b)
{
    return a->layers == b->layers && a->kv_heads == b->kv_heads && a->head_dim_k == b->head_dim_k &&
           a->head_dim_v == b->head_dim_v && a->elem_bytes == b->elem_bytes && a->attn == b->attn;
}

static kvs_status_t check_pool(const kvs_model_t *m, const kvs_pool_t *pool)
{
    const kvs_pool_config_t *pc = kvs_pool_config(pool);
    if (m->device < 0 && pc->mem != KVS_MEM_HOST) {
        kvs_error("model: the CPU forward pass needs a host-memory pool");
        return KVS_ERR_INVALID;
    }
    if (m->device >= 0 && (pc->mem != KVS_MEM_DEVICE || pc->device != m->device)) {
        kvs_error("model: a model on CUDA device %d needs its pool in that device's memory",
                  m->device);
        return KVS_ERR_INVALID;
    }
    if (!same_shape(&pc->shape, &m->kv_shape)) {
        kvs_error("model: pool shape (L %u, H %u, D %u/%u, E %u, attn %d) differs from the "
                  "model's (L %u, H %u, D %u/%u, E %u, MHA)",
                  pc->shape.layers, pc->shape.kv_heads, pc->shape.head_dim_k, pc->shape.head_dim_v,
                  pc->shape.elem_bytes, (int) pc->shape.attn, m->kv_shape.layers,
                  m->kv_shape.kv_heads, m->kv_shape.head_dim_k, m->kv_shape.head_dim_v,
                  m->kv_shape.elem_bytes);
        return KVS_ERR_INVALID;
    }
    if (pc->tp.tp_size != m->tp.tp_size || pc->tp.tp_rank != m->tp.tp_rank) {
        kvs_error("model: pool is TP rank %u/%u, model is rank %u/%u", pc->tp.tp_rank,
                  pc->tp.tp_size, m->tp.tp_rank, m->tp.tp_size);
        return KVS_ERR_INVALID;
    }
    return KVS_OK;
}

static kvs_status_t check_seq(const kvs_model_t *m, const kvs_pool_t *pool,
                              const kvs_model_seq_t *sq, uint32_t i)
{
    const kvs_model_config_t *c = &m->config;
    const uint32_t P = kvs_pool_config(pool)->page_size;
    if (sq->n == 0 || sq->tokens == NULL) {
        kvs_error("model: sequence %u has no tokens", i);
        return KVS_ERR_INVALID;
    }
    if (sq->n > c->max_ctx || sq->pos0 > c->max_ctx - sq->n) {
        kvs_error("model: sequence %u reaches position %llu, the model's context is %u", i,
                  (unsigned long long) sq->pos0 + sq->n - 1, c->max_ctx);
        return KVS_ERR_INVALID;
    }
    const uint32_t end = sq->pos0 + sq->n;
    const uint32_t need = (uint32_t) (((uint64_t) end + P - 1) / P);
    if (sq->npages < need || sq->pages == NULL) {
        kvs_error("model: sequence %u needs %u pages for positions 0..%u, has %u", i, need, end - 1,
                  sq->npages);
        return KVS_ERR_INVALID;
    }
    for (uint32_t p = 0; p < need; p++) {
        if (sq->pages[p] >= kvs_pool_total_pages(pool) ||
            !kvs_pool_page_allocated(pool, sq->pages[p])) {
            kvs_error("model: sequence %u page %u (id %u) is not an allocated page of the pool", i,
                      p, sq->pages[p]);
            return KVS_ERR_INVALID;
        }
    }
    for (uint32_t t = 0; t < sq->n; t++) {
        if (sq->tokens[t] >= c->vocab) {
            kvs_error("model: sequence %u token %u is id %u, vocab is %u", i, t, sq->tokens[t],
                      c->vocab);
            return KVS_ERR_INVALID;
        }
    }
    return KVS_OK;
}

/* ---- blocks ---- */

/* Sums the row-split partials over the TP group (in place) and adds them to the residual. */
static kvs_status_t reduce_into_residual(kvs_model_t *m, uint32_t n, kvs_allreduce_fn reduce,
                                         void *reduce_arg)
{
    kvs_model_scratch_t *s = &m->scratch;
    const size_t count = (size_t) n * m->config.dim;
    if (m->tp.tp_size > 1) {
        kvs_status_t st = reduce(reduce_arg, s->partial, count); /* [n][dim] */
        if (st != KVS_OK) {
            kvs_error("model: all-reduce of %zu partial sums failed: %s", count,
                      kvs_status_str(st));
            return st;
        }
    }
    m->backend.ops->add_partial(m->backend.ctx, s->x, s->partial, count);
    return KVS_OK;
}

/* x += Wo · attention(rope(Wq h), rope(Wk h), Wv h) with h = rmsnorm(x); the new K and V go to
 * the pool first, so a token attends to itself and to earlier tokens of its own call. */
static kvs_status_t attention_block(kvs_model_t *m, kvs_pool_t *pool, uint32_t layer, uint32_t n,
                                    kvs_allreduce_fn reduce, void *reduce_arg)
{
    const kvs_model_ops_t *ops = m->backend.ops;
    void *ctx = m->backend.ctx;
    const kvs_model_config_t *c = &m->config;
    const kvs_model_layer_t *L = &m->layers[layer];
    kvs_model_scratch_t *s = &m->scratch;
    const uint32_t hd = c->head_dim, qd = m->q_heads * hd, kvd = m->kv_heads * hd;

    ops->rmsnorm(ctx, s->x, L->attn_norm, n, c->dim, c->norm_eps, s->h); /* [n][dim] */
    ops->matmul(ctx, s->h, L->wq, n, c->dim, qd, s->q);                  /* [n][q_heads][hd] */
    ops->matmul(ctx, s->h, L->wk, n, c->dim, kvd, s->k);                 /* [n][kv_heads][hd] */
    ops->matmul(ctx, s->h, L->wv, n, c->dim, kvd, s->v);                 /* [n][kv_heads][hd] */
    ops->rope(ctx, s->q, s->pos, n, m->q_heads, hd, c->rope_theta);
    ops->rope(ctx, s->k, s->pos, n, m->kv_heads, hd, c->rope_theta);

    kvs_model_kv_desc_t d = {
        .k = kvs_pool_region(pool, layer, 0),
        .v = kvs_pool_region(pool, layer, 1),
        .page_size = kvs_pool_config(pool)->page_size,
        .n = n,
        .pos = s->pos,
        .pages = s->pages,
        .kv_heads = m->kv_heads,
        .head_dim = hd,
        .k_new = s->k,
        .v_new = s->v,
        .q_heads = m->q_heads,
        .q_kv = m->q_kv,
        .scale = (float) (1.0 / sqrt((double) hd)),
        .q = s->q,
        .out = s->att, /* [n][q_heads][hd] */
        .scores = s->scores,
    };
    ops->kv_write(ctx, &d);
    ops->attention(ctx, &d);
    ops->matmul_partial(ctx, s->att, L->wo, n, qd, c->dim, m->block_o, s->partial); /* [n][dim] */
    return reduce_into_residual(m, n, reduce, reduce_arg);
}

/* x += Wdown · (silu(Wgate h) * Wup h) with h = rmsnorm(x), over this rank's ffn columns. */
static kvs_status_t ffn_block(kvs_model_t *m, uint32_t layer, uint32_t n, kvs_allreduce_fn reduce,
                              void *reduce_arg)
{
    const kvs_model_ops_t *ops = m->backend.ops;
    void *ctx = m->backend.ctx;
    const kvs_model_config_t *c = &m->config;
    const kvs_model_layer_t *L = &m->layers[layer];
    kvs_model_scratch_t *s = &m->scratch;
    const uint32_t f = m->ffn_cols;

    ops->rmsnorm(ctx, s->x, L->ffn_norm, n, c->dim, c->norm_eps, s->h); /* [n][dim] */
    ops->matmul(ctx, s->h, L->w_gate, n, c->dim, f, s->gate);           /* [n][f] */
    ops->matmul(ctx, s->h, L->w_up, n, c->dim, f, s->up);               /* [n][f] */
    ops->silu_mul(ctx, s->gate, s->up, (size_t) n * f);                 /* [n][f] */
    ops->matmul_partial(ctx, s->gate, L->w_down, n, f, c->dim, m->block_down,
                        s->partial); /* [n][dim] */
    return reduce_into_residual(m, n, reduce, reduce_arg);
}

/* logits = rmsnorm(x of each sequence's last token) · output^T, whole on every rank; and for a
 * sequence with all_logits, the same of each of its tokens (rows are computed alone, so a row
 * is the same float either way). */
static void output_block(kvs_model_t *m, const kvs_model_seq_t *seqs, uint32_t nseq, float *logits)
{
    const kvs_model_ops_t *ops = m->backend.ops;
    void *ctx = m->backend.ctx;
    const kvs_model_config_t *c = &m->config;
    kvs_model_scratch_t *s = &m->scratch;
    size_t row = 0;
    for (uint32_t i = 0; i < nseq; i++) {
        row += seqs[i].n;
        memcpy(s->last + (size_t) i * c->dim, s->x + (row - 1) * c->dim,
               c->dim * sizeof(float)); /* [nseq][dim] */
    }
    ops->rmsnorm(ctx, s->last, m->output_norm, nseq, c->dim, c->norm_eps, s->last_norm);
    ops->matmul(ctx, s->last_norm, m->output, nseq, c->dim, c->vocab, logits); /* [nseq][vocab] */
    row = 0;
    for (uint32_t i = 0; i < nseq; row += seqs[i].n, i++) {
        if (seqs[i].all_logits == NULL) continue;
        ops->rmsnorm(ctx, s->x + row * c->dim, m->output_norm, seqs[i].n, c->dim, c->norm_eps,
                     s->h); /* [n][dim] */
        ops->matmul(ctx, s->h, m->output, seqs[i].n, c->dim, c->vocab,
                    seqs[i].all_logits); /* [n][vocab] */
    }
}

kvs_status_t kvs_model_forward(kvs_model_t *m, kvs_pool_t *pool, const kvs_model_seq_t *seqs,
                               uint32_t nseq, kvs_allreduce_fn reduce, void *reduce_arg,
                               float *logits)
{
    if (m == NULL || pool == NULL || (nseq > 0 && (seqs == NULL || logits == NULL))) {
        kvs_error("model: forward needs a model, a pool, sequences and a logits buffer");
        return KVS_ERR_INVALID;
    }
    if (m->tp.tp_size > 1 && reduce == NULL && m->reduce != KVS_MODEL_REDUCE_NCCL) {
        kvs_error("model: TP %u needs an all-reduce function", m->tp.tp_size);
        return KVS_ERR_INVALID;
    }
    kvs_status_t st = check_pool(m, pool);
    if (st != KVS_OK) return st;
    uint64_t total = 0;
    uint32_t positions = 0;
    for (uint32_t i = 0; i < nseq; i++) {
        st = check_seq(m, pool, &seqs[i], i);
        if (st != KVS_OK) return st;
        if (seqs[i].sample != NULL &&
            (seqs[i].token == NULL || !kvs_sample_on_device_ok(seqs[i].sample) ||
             kvs_sample_params_invalid(seqs[i].sample, m->config.vocab) != NULL ||
             !(seqs[i].draw >= 0 && seqs[i].draw < 1))) {
            kvs_error("model: sequence %u asks for sampling with bias, penalties, invalid "
                      "parameters, a draw outside [0, 1) or no token to write",
                      i);
            return KVS_ERR_INVALID;
        }
        total += seqs[i].n;
        if (seqs[i].pos0 + seqs[i].n > positions) positions = seqs[i].pos0 + seqs[i].n;
    }
    if (total > MAX_BATCH_TOKENS) {
        kvs_error("model: %llu tokens in one forward call, at most %u", (unsigned long long) total,
                  MAX_BATCH_TOKENS);
        return KVS_ERR_INVALID;
    }
    if (nseq == 0) return KVS_OK;
    if (m->cuda != NULL)
        return kvs__model_cuda_forward(m, pool, seqs, nseq, reduce, reduce_arg, logits);
    const uint32_t n = (uint32_t) total;
    st = scratch_reserve(m, n, positions, nseq);
    if (st != KVS_OK) return st;

    kvs_model_scratch_t *s = &m->scratch;
    for (uint32_t i = 0, t = 0; i < nseq; i++) {
        for (uint32_t j = 0; j < seqs[i].n; j++, t++) {
            s->tok[t] = seqs[i].tokens[j];
            s->pos[t] = seqs[i].pos0 + j;
            s->pages[t] = seqs[i].pages;
        }
    }
    m->backend.ops->embed(m->backend.ctx, m->embed, m->config.dim, s->tok, n, s->x); /* [n][dim] */
    for (uint32_t l = 0; l < m->config.layers; l++) {
        st = attention_block(m, pool, l, n, reduce, reduce_arg);
        if (st != KVS_OK) return st;
        st = ffn_block(m, l, n, reduce, reduce_arg);
        if (st != KVS_OK) return st;
        if (m->wait_fn != NULL) m->wait_fn(m->wait_arg);
    }
    output_block(m, seqs, nseq, logits);
    for (uint32_t i = 0; i < nseq; i++)
        if (seqs[i].sample != NULL)
            *seqs[i].token = kvs_sample_at(logits + (size_t) i * m->config.vocab, m->config.vocab,
                                           seqs[i].sample, NULL, seqs[i].draw);
    return KVS_OK;
}
