/* The model object: configuration from GGUF metadata and its validation against a TP layout,
 * this rank's slice of heads and feed-forward columns, and its weights, either dequantised
 * from a GGUF file or seeded. Both sources walk one list of shards (for_each_shard), so the
 * slicing rule is written once. On the CPU the weights are f32, dequantised on the host; on a
 * CUDA device the backend holds them (bf16 matrices, f32 norms), a GGUF shard's raw blocks
 * decoded there (cuda/dequant.cu) and seeded ones generated there. */
#include <assert.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "kvstage/alloc.h"
#include "kvstage/log.h"
#include "model/cuda/model_cuda.h"
#include "model/model_internal.h"

/* Bounds that keep every size computation below 2^62 (and are far above real models). */
#define MAX_LAYERS   4096u
#define MAX_DIM      (1u << 20)
#define MAX_FFN      (1u << 22)
#define MAX_HEADS    4096u
#define MAX_HEAD_DIM KVS_MODEL_MAX_HEAD_DIM
#define MAX_VOCAB    (1u << 24)
#define MAX_CTX      (1u << 24)

/* Weight tensors start on 64-byte boundaries. */
#define ARENA_ALIGN_FLOATS 16u

/* ---- configuration ---- */

static kvs_status_t need_u32(const kvs_gguf_t *g, const char *key, uint32_t *value_p)
{
    kvs_status_t st = kvs_gguf_u32(g, key, value_p);
    if (st == KVS_ERR_NOT_FOUND) {
        kvs_error("model: GGUF metadata lacks %s", key);
        return KVS_ERR_INVALID;
    }
    return st;
}

/* Leaves *value_p (the default) alone when the key is absent. */
static kvs_status_t opt_u32(const kvs_gguf_t *g, const char *key, uint32_t *value_p)
{
    kvs_status_t st = kvs_gguf_u32(g, key, value_p);
    return st == KVS_ERR_NOT_FOUND ? KVS_OK : st;
}

static kvs_status_t opt_f32(const kvs_gguf_t *g, const char *key, float *value_p)
{
    kvs_status_t st = kvs_gguf_f32(g, key, value_p);
    return st == KVS_ERR_NOT_FOUND ? KVS_OK : st;
}

static int str_is(kvs_gguf_str_t s, const char *lit)
{
    return s.len == strlen(lit) && memcmp(s.ptr, lit, s.len) == 0;
}

kvs_status_t kvs_model_config_from_gguf(const kvs_gguf_t *gguf, kvs_model_config_t *cfg_p)
{
    if (gguf == NULL || cfg_p == NULL) {
        kvs_error("model: NULL gguf or output pointer");
        return KVS_ERR_INVALID;
    }
    kvs_gguf_str_t arch;
    kvs_status_t st = kvs_gguf_str(gguf, "general.architecture", &arch);
    if (st == KVS_ERR_NOT_FOUND) {
        kvs_error("model: GGUF metadata lacks general.architecture");
        return KVS_ERR_INVALID;
    }
    if (st != KVS_OK) return st;
    if (!str_is(arch, "llama")) {
        kvs_error("model: architecture \"%.*s\" is not supported (only \"llama\")",
                  (int) (arch.len > 64 ? 64 : arch.len), arch.ptr);
        return KVS_ERR_UNSUPPORTED;
    }

    kvs_model_config_t c;
    memset(&c, 0, sizeof(c));
    c.rope_theta = 10000.0f;
    c.norm_eps = 1e-5f;
    uint32_t experts = 0, key_len = 0, value_len = 0, rope_dims = 0, vocab_key = 0;
    if ((st = need_u32(gguf, "llama.block_count", &c.layers)) != KVS_OK ||
        (st = need_u32(gguf, "llama.embedding_length", &c.dim)) != KVS_OK ||
        (st = need_u32(gguf, "llama.feed_forward_length", &c.ffn_dim)) != KVS_OK ||
        (st = need_u32(gguf, "llama.attention.head_count", &c.heads)) != KVS_OK ||
        (st = need_u32(gguf, "llama.context_length", &c.max_ctx)) != KVS_OK)
        return st;
    c.kv_heads = c.heads;
    if ((st = opt_u32(gguf, "llama.attention.head_count_kv", &c.kv_heads)) != KVS_OK ||
        (st = opt_u32(gguf, "llama.attention.key_length", &key_len)) != KVS_OK ||
        (st = opt_u32(gguf, "llama.attention.value_length", &value_len)) != KVS_OK ||
        (st = opt_u32(gguf, "llama.rope.dimension_count", &rope_dims)) != KVS_OK ||
        (st = opt_u32(gguf, "llama.expert_count", &experts)) != KVS_OK ||
        (st = opt_u32(gguf, "llama.vocab_size", &vocab_key)) != KVS_OK ||
        (st = opt_f32(gguf, "llama.rope.freq_base", &c.rope_theta)) != KVS_OK ||
        (st = opt_f32(gguf, "llama.attention.layer_norm_rms_epsilon", &c.norm_eps)) != KVS_OK)
        return st;

    if (experts > 0) {
        kvs_error("model: mixture of experts (llama.expert_count = %u) is not supported", experts);
        return KVS_ERR_UNSUPPORTED;
    }
    kvs_gguf_str_t scaling;
    if (kvs_gguf_str(gguf, "llama.rope.scaling.type", &scaling) == KVS_OK &&
        !str_is(scaling, "none")) {
        kvs_error("model: RoPE scaling \"%.*s\" is not supported",
                  (int) (scaling.len > 64 ? 64 : scaling.len), scaling.ptr);
        return KVS_ERR_UNSUPPORTED;
    }
    kvs_gguf_tensor_t t;
    if (kvs_gguf_tensor(gguf, "rope_freqs.weight", &t) == KVS_OK) {
        kvs_error("model: per-frequency RoPE factors (rope_freqs.weight) are not supported");
        return KVS_ERR_UNSUPPORTED;
    }

    if (key_len != 0) {
        c.head_dim = key_len;
    } else if (c.heads != 0 && c.dim % c.heads == 0) {
        c.head_dim = c.dim / c.heads;
    } else {
        kvs_error("model: llama.embedding_length %u is not a multiple of head_count %u and "
                  "llama.attention.key_length is absent",
                  c.dim, c.heads);
        return KVS_ERR_INVALID;
    }
    if (value_len != 0 && value_len != c.head_dim) {
        kvs_error("model: value_length %u differs from key_length %u (not supported)", value_len,
                  c.head_dim);
        return KVS_ERR_UNSUPPORTED;
    }
    if (rope_dims != 0 && rope_dims != c.head_dim) {
        kvs_error("model: partial rotary (rope.dimension_count %u of head_dim %u) is not "
                  "supported",
                  rope_dims, c.head_dim);
        return KVS_ERR_UNSUPPORTED;
    }

    st = kvs_gguf_tensor(gguf, "token_embd.weight", &t);
    if (st == KVS_ERR_NOT_FOUND) {
        kvs_error("model: GGUF lacks tensor token_embd.weight");
        return KVS_ERR_INVALID;
    }
    if (st != KVS_OK) return st;
    if (t.ne[0] != c.dim || t.ne[1] > UINT32_MAX || t.ne[2] != 1 || t.ne[3] != 1) {
        kvs_error("model: token_embd.weight is [%llu x %llu], expected [%u x vocab]",
                  (unsigned long long) t.ne[0], (unsigned long long) t.ne[1], c.dim);
        return KVS_ERR_INVALID;
    }
    c.vocab = (uint32_t) t.ne[1];
    if (vocab_key != 0 && vocab_key != c.vocab) {
        kvs_error("model: llama.vocab_size %u disagrees with token_embd.weight (%u rows)",
                  vocab_key, c.vocab);
        return KVS_ERR_INVALID;
    }
    kvs_tp_t tp1 = {.tp_size = 1, .tp_rank = 0};
    st = kvs_model_config_validate(&c, tp1);
    if (st != KVS_OK) return st;
    *cfg_p = c;
    return KVS_OK;
}

kvs_kv_shape_t kvs_model_config_kv_shape(const kvs_model_config_t *c, uint32_t kv_bytes)
{
    kvs_kv_shape_t s = {.layers = c->layers,
                        .kv_heads = c->kv_heads,
                        .head_dim_k = c->head_dim,
                        .head_dim_v = c->head_dim,
                        .elem_bytes = kv_bytes,
                        .attn = KVS_ATTN_MHA};
    return s;
}

static kvs_status_t check_range(const char *what, uint32_t v, uint32_t max)
{
    if (v == 0 || v > max) {
        kvs_error("model: %s = %u is out of range [1, %u]", what, v, max);
        return KVS_ERR_INVALID;
    }
    return KVS_OK;
}

kvs_status_t kvs_model_config_validate(const kvs_model_config_t *c, kvs_tp_t tp)
{
    if (c == NULL) {
        kvs_error("model: NULL config");
        return KVS_ERR_INVALID;
    }
    kvs_status_t st;
    if ((st = check_range("layers", c->layers, MAX_LAYERS)) != KVS_OK ||
        (st = check_range("dim", c->dim, MAX_DIM)) != KVS_OK ||
        (st = check_range("ffn_dim", c->ffn_dim, MAX_FFN)) != KVS_OK ||
        (st = check_range("heads", c->heads, MAX_HEADS)) != KVS_OK ||
        (st = check_range("kv_heads", c->kv_heads, c->heads)) != KVS_OK ||
        (st = check_range("head_dim", c->head_dim, MAX_HEAD_DIM)) != KVS_OK ||
        (st = check_range("vocab", c->vocab, MAX_VOCAB)) != KVS_OK ||
        (st = check_range("max_ctx", c->max_ctx, MAX_CTX)) != KVS_OK)
        return st;
    if (c->head_dim % 2 != 0) {
        kvs_error("model: head_dim = %u must be even (RoPE rotates pairs)", c->head_dim);
        return KVS_ERR_INVALID;
    }
    if (c->heads % c->kv_heads != 0) {
        kvs_error("model: heads = %u is not a multiple of kv_heads = %u", c->heads, c->kv_heads);
        return KVS_ERR_INVALID;
    }
    if (!(c->rope_theta > 0.0f) || !isfinite(c->rope_theta)) {
        kvs_error("model: rope_theta = %g must be positive and finite", (double) c->rope_theta);
        return KVS_ERR_INVALID;
    }
    if (!(c->norm_eps >= 0.0f) || !isfinite(c->norm_eps)) {
        kvs_error("model: norm_eps = %g must be >= 0 and finite", (double) c->norm_eps);
        return KVS_ERR_INVALID;
    }
    kvs_kv_shape_t shape = kvs_model_config_kv_shape(c, sizeof(float));
    st = kvs_tp_validate(&shape, &tp);
    if (st != KVS_OK) return st;
    if (c->heads % tp.tp_size != 0) {
        kvs_error("model: %u query heads cannot be split evenly over TP %u", c->heads, tp.tp_size);
        return KVS_ERR_INVALID;
    }
    if (c->ffn_dim % tp.tp_size != 0) {
        kvs_error("model: ffn_dim = %u cannot be split evenly over TP %u", c->ffn_dim, tp.tp_size);
        return KVS_ERR_INVALID;
    }
    return KVS_OK;
}

/* ---- the model object and its weight arena ---- */

static size_t round_up(size_t n)
{
    return (n + ARENA_ALIGN_FLOATS - 1) / ARENA_ALIGN_FLOATS * ARENA_ALIGN_FLOATS;
}

/* Lays every tensor of this rank out in one arena: with base NULL only counts, else also points
 * the tensors into base. Returns the arena size in floats. */
static size_t carve(kvs_model_t *m, float *base, int tied)
{
    const kvs_model_config_t *c = &m->config;
    const size_t dim = c->dim, q = (size_t) m->q_heads * c->head_dim;
    const size_t kv = (size_t) m->kv_heads * c->head_dim, f = m->ffn_cols;
    size_t off = 0;
#define TAKE(ptr, count)                                                                           \
    do {                                                                                           \
        if (base != NULL) (ptr) = base + off;                                                      \
        off += round_up(count);                                                                    \
    } while (0)
    TAKE(m->embed, (size_t) c->vocab * dim);
    if (tied) {
        if (base != NULL) m->output = m->embed;
    } else {
        TAKE(m->output, (size_t) c->vocab * dim);
    }
    TAKE(m->output_norm, dim);
    for (uint32_t l = 0; l < c->layers; l++) {
        kvs_model_layer_t *L = &m->layers[l];
        TAKE(L->attn_norm, dim);
        TAKE(L->wq, q * dim);
        TAKE(L->wk, kv * dim);
        TAKE(L->wv, kv * dim);
        TAKE(L->wo, dim * q);
        TAKE(L->ffn_norm, dim);
        TAKE(L->w_gate, f * dim);
        TAKE(L->w_up, f * dim);
        TAKE(L->w_down, dim * f);
    }
#undef TAKE
    return off;
}

static uint32_t gcd_u32(uint32_t a, uint32_t b)
{
    while (b != 0) {
        uint32_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

/* Validates, computes this rank's slices and allocates the (uninitialised) weights: in host
 * memory, or on CUDA device `device` (>= 0) through the CUDA backend. */
static kvs_status_t model_create(const kvs_model_config_t *cfg, kvs_tp_t tp, int tied, int device,
                                 kvs_model_t **model_p)
{
    kvs_status_t st = kvs_model_config_validate(cfg, tp);
    if (st != KVS_OK) return st;
    kvs_model_t *m = kvs_calloc(1, sizeof(*m));
    if (m == NULL) goto err_nomem;
    m->config = *cfg;
    m->tp = tp;
    m->device = device < 0 ? -1 : device;
    m->kv_shape = kvs_model_config_kv_shape(cfg, device < 0 ? sizeof(float) : 2);
    m->q_heads = cfg->heads / tp.tp_size;
    m->q_first = tp.tp_rank * m->q_heads;
    m->kv_heads = kvs_tp_heads_per_rank(&m->kv_shape, tp.tp_size);
    m->kv_first = kvs_tp_first_head(&m->kv_shape, tp.tp_size, tp.tp_rank);
    m->ffn_cols = cfg->ffn_dim / tp.tp_size;
    m->ffn_first = tp.tp_rank * m->ffn_cols;
    /* Row-split blocks must never straddle a rank boundary, on any TP size, or the partial
     * sums stop being TP-independent (forward.c rule 3): Wo's ranks split at whole heads, so
     * a divisor of head_dim always works; Wdown's split at multiples of ffn_dim / T. */
    m->block_o = gcd_u32(cfg->head_dim, KVS_MODEL_FIX_BLOCK);
    const uint32_t block_down = gcd_u32(cfg->ffn_dim, KVS_MODEL_FIX_BLOCK);
    m->block_down = gcd_u32(m->ffn_cols, block_down);
    if (m->block_down != block_down)
        kvs_warn("model: %u ffn columns per rank are not a multiple of %u: logits on TP %u may "
                 "differ from other TP sizes in the last bit",
                 m->ffn_cols, block_down, tp.tp_size);
    m->backend.ops = &kvs_model_ops_cpu;
    m->backend.ctx = NULL;

    m->q_kv = kvs_calloc(m->q_heads, sizeof(uint32_t));
    m->layers = kvs_calloc(cfg->layers, sizeof(kvs_model_layer_t));
    if (m->q_kv == NULL || m->layers == NULL) goto err_free_model;
    const uint32_t group = cfg->heads / cfg->kv_heads;
    for (uint32_t j = 0; j < m->q_heads; j++) {
        const uint32_t kv = (m->q_first + j) / group;
        /* kvs_tp_validate and heads % T == 0 put every query head's KV head on this rank */
        assert(kv >= m->kv_first && kv < m->kv_first + m->kv_heads);
        m->q_kv[j] = kv - m->kv_first;
    }
    if (device >= 0) {
        st = kvs__model_cuda_create(m, device, tied, &m->cuda);
        if (st != KVS_OK) goto err_free_model;
        *model_p = m;
        return KVS_OK;
    }
    const size_t floats = carve(m, NULL, tied);
    if (floats <= SIZE_MAX / sizeof(float))
        m->arena = kvs_aligned_alloc(64, floats * sizeof(float));
    if (m->arena == NULL) {
        kvs_error("model: cannot allocate %zu MiB of weights", floats / (1u << 18));
        st = KVS_ERR_NOMEM;
        goto err_free_model;
    }
    carve(m, m->arena, tied);
    *model_p = m;
    return KVS_OK;

err_free_model:
    kvs_free(m->layers);
    kvs_free(m->q_kv);
    kvs_free(m);
    if (st != KVS_OK) return st; /* already logged */
err_nomem:
    kvs_error("model: out of memory creating the model");
    return KVS_ERR_NOMEM;
}

void kvs_model_destroy(kvs_model_t *m)
{
    if (m == NULL) return;
    if (m->backend.ops != NULL && m->backend.ops->destroy != NULL)
        m->backend.ops->destroy(m->backend.ctx);
    kvs__model_cuda_destroy(m->cuda);
    kvs__model_scratch_free(&m->scratch);
    kvs_free(m->arena);
    kvs_free(m->layers);
    kvs_free(m->q_kv);
    kvs_free(m);
}

const kvs_model_config_t *kvs_model_config(const kvs_model_t *m)
{
    return &m->config;
}

kvs_tp_t kvs_model_tp(const kvs_model_t *m)
{
    return m->tp;
}

kvs_kv_shape_t kvs_model_kv_shape(const kvs_model_t *m)
{
    return m->kv_shape;
}

int kvs_model_device(const kvs_model_t *m)
{
    return m->device;
}

void kvs_model_set_wait(kvs_model_t *m, kvs_model_wait_fn fn, void *arg)
{
    m->wait_fn = fn;
    m->wait_arg = arg;
}

kvs_status_t kvs_model_set_kv_bytes(kvs_model_t *m, uint32_t kv_bytes)
{
    if (kv_bytes != 2 && kv_bytes != sizeof(float)) {
        kvs_error("model: KV elements of %u bytes (2 for bf16, 4 for f32)", kv_bytes);
        return KVS_ERR_INVALID;
    }
    if (m->device >= 0 && kv_bytes != 2) {
        kvs_error("model: the CUDA backend keeps its KV in bf16");
        return KVS_ERR_UNSUPPORTED;
    }
    m->kv_shape.elem_bytes = kv_bytes;
    return KVS_OK;
}

/* ---- shards: which slice of which full tensor each weight buffer holds ---- */

/* One weight buffer of this rank: rows [row0, row0+nrows) and columns [col0, col0+ncols) of
 * the full tensor [rows][cols] (GGUF ne = [cols, rows]). */
typedef struct {
    char name[48];
    uint64_t id; /* seeded-weight stream of the full tensor */
    uint64_t rows, cols;
    uint64_t row0, nrows, col0, ncols;
    int is_norm;
    float *dst; /* [nrows][ncols] */
} shard_t;

typedef kvs_status_t (*shard_fn)(void *arg, const shard_t *s);

/* How a tensor is divided among ranks: whole, a run of rows (output features: column-split
 * projections) or a run of columns (input features: row-split projections). */
typedef enum { SPLIT_NONE, SPLIT_ROWS, SPLIT_COLS } split_t;

typedef struct {
    uint64_t rows, cols;
    split_t split;
    uint64_t first, count; /* the rank's rows or columns */
    float *dst;
} tensor_plan_t;

static kvs_status_t visit(shard_fn fn, void *arg, const char *name, uint64_t id,
                          const tensor_plan_t *t)
{
    shard_t s;
    snprintf(s.name, sizeof(s.name), "%s", name);
    s.id = id;
    s.rows = t->rows;
    s.cols = t->cols;
    s.row0 = t->split == SPLIT_ROWS ? t->first : 0;
    s.nrows = t->split == SPLIT_ROWS ? t->count : t->rows;
    s.col0 = t->split == SPLIT_COLS ? t->first : 0;
    s.ncols = t->split == SPLIT_COLS ? t->count : t->cols;
    s.is_norm = t->rows == 1;
    s.dst = t->dst;
    return fn(arg, &s);
}

/* The tensor kinds of a layer in GGUF naming; the index is part of the seeded stream id. */
enum {
    T_ATTN_NORM = KVS_MODEL_T_ATTN_NORM,
    T_Q = KVS_MODEL_T_Q,
    T_K = KVS_MODEL_T_K,
    T_V = KVS_MODEL_T_V,
    T_O = KVS_MODEL_T_O,
    T_FFN_NORM = KVS_MODEL_T_FFN_NORM,
    T_GATE = KVS_MODEL_T_GATE,
    T_UP = KVS_MODEL_T_UP,
    T_DOWN = KVS_MODEL_T_DOWN,
    T_KINDS = KVS_MODEL_T_KINDS
};
static const char *const kind_names[T_KINDS] = {"attn_norm", "attn_q",      "attn_k",
                                                "attn_v",    "attn_output", "ffn_norm",
                                                "ffn_gate",  "ffn_up",      "ffn_down"};

#define ID_EMBED       KVS_MODEL_ID_EMBED
#define ID_OUTPUT      KVS_MODEL_ID_OUTPUT
#define ID_OUTPUT_NORM KVS_MODEL_ID_OUTPUT_NORM

static kvs_status_t for_each_shard(kvs_model_t *m, int tied, shard_fn fn, void *arg)
{
    const kvs_model_config_t *c = &m->config;
    const uint64_t hd = c->head_dim, dim = c->dim;
    const uint64_t q = c->heads * hd, kv = c->kv_heads * hd, f = c->ffn_dim;
    const uint64_t q0 = m->q_first * hd, qn = m->q_heads * hd;
    const uint64_t kv0 = m->kv_first * hd, kvn = m->kv_heads * hd;
    const uint64_t f0 = m->ffn_first, fn_ = m->ffn_cols;

    tensor_plan_t embed = {c->vocab, dim, SPLIT_NONE, 0, 0, m->embed};
    tensor_plan_t output = {c->vocab, dim, SPLIT_NONE, 0, 0, m->output};
    tensor_plan_t norm = {1, dim, SPLIT_NONE, 0, 0, m->output_norm};
    kvs_status_t st = visit(fn, arg, "token_embd.weight", ID_EMBED, &embed);
    if (st == KVS_OK && !tied) st = visit(fn, arg, "output.weight", ID_OUTPUT, &output);
    if (st == KVS_OK) st = visit(fn, arg, "output_norm.weight", ID_OUTPUT_NORM, &norm);
    for (uint32_t l = 0; l < c->layers && st == KVS_OK; l++) {
        kvs_model_layer_t *L = &m->layers[l];
        const tensor_plan_t plan[T_KINDS] = {
            [T_ATTN_NORM] = {1, dim, SPLIT_NONE, 0, 0, L->attn_norm},
            [T_Q] = {q, dim, SPLIT_ROWS, q0, qn, L->wq},
            [T_K] = {kv, dim, SPLIT_ROWS, kv0, kvn, L->wk},
            [T_V] = {kv, dim, SPLIT_ROWS, kv0, kvn, L->wv},
            [T_O] = {dim, q, SPLIT_COLS, q0, qn, L->wo},
            [T_FFN_NORM] = {1, dim, SPLIT_NONE, 0, 0, L->ffn_norm},
            [T_GATE] = {f, dim, SPLIT_ROWS, f0, fn_, L->w_gate},
            [T_UP] = {f, dim, SPLIT_ROWS, f0, fn_, L->w_up},
            [T_DOWN] = {dim, f, SPLIT_COLS, f0, fn_, L->w_down},
        };
        for (uint32_t k = 0; k < T_KINDS && st == KVS_OK; k++) {
            char name[48];
            snprintf(name, sizeof(name), "blk.%u.%s.weight", l, kind_names[k]);
            st = visit(fn, arg, name, (uint64_t) l * 16 + k, &plan[k]);
        }
    }
    return st;
}

/* ---- loading from GGUF ---- */

typedef struct {
    kvs_model_t *m;
    const kvs_gguf_t *gguf;
    kvs_model_cuda_loader_t *loader; /* a model on a device: its staging */
} load_arg_t;

static kvs_status_t load_shard(void *arg, const shard_t *s)
{
    const load_arg_t *a = arg;
    const kvs_gguf_t *g = a->gguf;
    kvs_gguf_tensor_t t;
    kvs_status_t st = kvs_gguf_tensor(g, s->name, &t);
    if (st == KVS_ERR_NOT_FOUND) {
        kvs_error("model: GGUF lacks tensor %s", s->name);
        return KVS_ERR_INVALID;
    }
    if (st != KVS_OK) return st;
    if (t.ne[0] != s->cols || t.ne[1] != s->rows || t.ne[2] != 1 || t.ne[3] != 1) {
        kvs_error("model: tensor %s is [%llu x %llu x %llu x %llu], expected [%llu x %llu]",
                  s->name, (unsigned long long) t.ne[0], (unsigned long long) t.ne[1],
                  (unsigned long long) t.ne[2], (unsigned long long) t.ne[3],
                  (unsigned long long) s->cols, (unsigned long long) s->rows);
        return KVS_ERR_INVALID;
    }
    /* On a device the raw blocks of the slice go over and are decoded there, to the same
     * floats (then bf16 for a matrix): the host never holds a shard in f32. */
    if (a->loader != NULL)
        return kvs__model_cuda_put_raw(a->loader, s->id, &t, s->row0, s->nrows, s->col0, s->ncols);
    return kvs_gguf_dequant(&t, s->row0, s->nrows, s->col0, s->ncols, s->dst);
}

kvs_status_t kvs_model_load(const kvs_gguf_t *gguf, kvs_tp_t tp, kvs_model_t **model_p)
{
    return kvs_model_load_on(gguf, tp, -1, model_p);
}

kvs_status_t kvs_model_load_on(const kvs_gguf_t *gguf, kvs_tp_t tp, int device,
                               kvs_model_t **model_p)
{
    if (gguf == NULL || model_p == NULL) {
        kvs_error("model: NULL gguf or output pointer");
        return KVS_ERR_INVALID;
    }
    kvs_model_config_t cfg;
    kvs_status_t st = kvs_model_config_from_gguf(gguf, &cfg);
    if (st != KVS_OK) return st;
    kvs_gguf_tensor_t t;
    const int tied = kvs_gguf_tensor(gguf, "output.weight", &t) == KVS_ERR_NOT_FOUND;
    kvs_model_t *m = NULL;
    st = model_create(&cfg, tp, tied, device, &m);
    if (st != KVS_OK) return st;
    load_arg_t arg = {m, gguf, NULL};
    if (m->cuda != NULL) st = kvs__model_cuda_loader_create(m->cuda, &arg.loader);
    if (st == KVS_OK) st = for_each_shard(m, tied, load_shard, &arg);
    kvs__model_cuda_loader_destroy(arg.loader);
    if (st != KVS_OK) {
        kvs_model_destroy(m);
        return st;
    }
    kvs_debug("model: loaded %u layers, dim %u, TP rank %u/%u (q heads %u+%u, kv heads %u+%u, "
              "ffn %u+%u)",
              cfg.layers, cfg.dim, tp.tp_rank, tp.tp_size, m->q_first, m->q_heads, m->kv_first,
              m->kv_heads, m->ffn_first, m->ffn_cols);
    *model_p = m;
    return KVS_OK;
}

/* ---- seeded weights ---- */

typedef struct {
    kvs_model_t *m;
    uint64_t seed;
} seed_arg_t;

static kvs_status_t seed_shard(void *arg, const shard_t *s)
{
    const seed_arg_t *a = arg;
    const uint64_t key = kvs_mix64(a->seed ^ kvs_mix64(s->id * 0xd1b54a32d192ed03ull));
    /* uniform on [-sqrt(3), sqrt(3)) has variance 1 */
    const float spread = 1.7320508f;
    float scale, offset;
    if (s->is_norm) {
        scale = 0.1f;
        offset = 1.0f;
    } else if (s->id == ID_EMBED) {
        scale = 1.0f;
        offset = 0.0f;
    } else {
        scale = (float) (1.0 / sqrt((double) s->cols)); /* fan_in */
        offset = 0.0f;
    }
    if (a->m->cuda != NULL) {
        const kvs_model_seed_rule_t rule = {key, scale, offset};
        return kvs__model_cuda_seed(a->m->cuda, s->id, &rule, s->rows, s->cols, s->row0, s->nrows,
                                    s->col0, s->ncols);
    }
    for (uint64_t r = 0; r < s->nrows; r++) {
        float *row = s->dst + r * s->ncols;
        const uint64_t base = (s->row0 + r) * s->cols + s->col0;
        for (uint64_t c = 0; c < s->ncols; c++) {
            const uint64_t h = kvs_mix64(key + base + c);
            const float u = (float) (h >> 40) * 0x1p-24f; /* [0, 1) */
            row[c] = offset + scale * spread * (2.0f * u - 1.0f);
        }
    }
    return KVS_OK;
}

kvs_status_t kvs_model_seeded(const kvs_model_config_t *cfg, uint64_t seed, kvs_tp_t tp,
                              kvs_model_t **model_p)
{
    return kvs_model_seeded_on(cfg, seed, tp, -1, model_p);
}

kvs_status_t kvs_model_seeded_on(const kvs_model_config_t *cfg, uint64_t seed, kvs_tp_t tp,
                                 int device, kvs_model_t **model_p)
{
    if (cfg == NULL || model_p == NULL) {
        kvs_error("model: NULL config or output pointer");
        return KVS_ERR_INVALID;
    }
    kvs_model_t *m = NULL;
    /* Untied: with tied embeddings of variance 1 the logit of the input token dominates and a
     * greedy continuation of random weights just repeats it, whatever the context; a separate
     * output matrix (variance 1/dim) makes the next token depend on the whole sequence. */
    kvs_status_t st = model_create(cfg, tp, 0, device, &m);
    if (st != KVS_OK) return st;
    seed_arg_t arg = {m, seed};
    st = for_each_shard(m, 0, seed_shard, &arg);
    if (st != KVS_OK) {
        kvs_model_destroy(m);
        return st;
    }
    *model_p = m;
    return KVS_OK;
}
