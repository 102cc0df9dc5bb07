/* A test-only builder of GGUF v2/v3 byte buffers: metadata of every value type (nested arrays
 * through raw values), tensors of every supported type (given as bytes, or as floats that the
 * reference quantisers below encode), and the byte positions of each header field so tests
 * can corrupt exactly one of them. Header-only; allocates through kvstage/alloc.h. */
#ifndef KVSTAGE_TESTS_MODEL_GGUF_WRITER_H
#define KVSTAGE_TESTS_MODEL_GGUF_WRITER_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvstage/alloc.h"
#include "model/gguf.h"

#define GW_MAX_ITEMS 64 /* kvs and tensors whose field positions are recorded */

/* A growable byte buffer; a failed allocation sets oom and later appends are dropped. */
typedef struct {
    uint8_t *p;
    size_t len, cap;
    int oom;
} gw_bytes_t;

/* Absolute positions (in the finished buffer) of one tensor info's fields. */
typedef struct {
    size_t name_len, n_dims, ne0, type, offset;
} gw_tensor_pos_t;

/* Absolute positions of one kv's fields; value is where the value (for arrays: the element
 * type) starts. */
typedef struct {
    size_t key_len, type, value;
} gw_kv_pos_t;

typedef struct {
    uint32_t version;
    uint32_t alignment;
    uint64_t n_kv, n_tensors;
    gw_bytes_t kv, ti, data;
    gw_kv_pos_t kv_pos[GW_MAX_ITEMS];         /* relative to kv until gw_finish */
    gw_tensor_pos_t tensor_pos[GW_MAX_ITEMS]; /* relative to ti until gw_finish */
    size_t data_start;                        /* set by gw_finish */
} gw_t;

/* Header fields, absolute. */
#define GW_POS_VERSION   4
#define GW_POS_N_TENSORS 8
#define GW_POS_N_KV      16
#define GW_HEADER_BYTES  24

static inline void gw_reserve(gw_bytes_t *b, size_t n)
{
    if (b->oom || b->len + n <= b->cap) return;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + n) cap *= 2;
    uint8_t *p = kvs_realloc(b->p, cap);
    if (p == NULL) {
        b->oom = 1;
        return;
    }
    b->p = p;
    b->cap = cap;
}

static inline void gw_put(gw_bytes_t *b, const void *src, size_t n)
{
    gw_reserve(b, n);
    if (b->oom) return;
    if (n) memcpy(b->p + b->len, src, n);
    b->len += n;
}

static inline void gw_put_le(gw_bytes_t *b, uint64_t v, int bytes)
{
    uint8_t tmp[8];
    for (int i = 0; i < bytes; i++) tmp[i] = (uint8_t) (v >> (8 * i));
    gw_put(b, tmp, (size_t) bytes);
}

static inline void gw_put_u8(gw_bytes_t *b, uint8_t v)
{
    gw_put_le(b, v, 1);
}
static inline void gw_put_u16(gw_bytes_t *b, uint16_t v)
{
    gw_put_le(b, v, 2);
}
static inline void gw_put_u32(gw_bytes_t *b, uint32_t v)
{
    gw_put_le(b, v, 4);
}
static inline void gw_put_u64(gw_bytes_t *b, uint64_t v)
{
    gw_put_le(b, v, 8);
}
static inline void gw_put_f32(gw_bytes_t *b, float v)
{
    uint32_t bits;
    memcpy(&bits, &v, 4);
    gw_put_u32(b, bits);
}
static inline void gw_put_f64(gw_bytes_t *b, double v)
{
    uint64_t bits;
    memcpy(&bits, &v, 8);
    gw_put_u64(b, bits);
}
static inline void gw_put_str(gw_bytes_t *b, const char *s)
{
    gw_put_u64(b, strlen(s));
    gw_put(b, s, strlen(s));
}

static inline void gw_init(gw_t *w, uint32_t version)
{
    memset(w, 0, sizeof(*w));
    w->version = version;
    w->alignment = 32;
}

static inline void gw_free(gw_t *w)
{
    kvs_free(w->kv.p);
    kvs_free(w->ti.p);
    kvs_free(w->data.p);
    memset(w, 0, sizeof(*w));
}

/* Starts a kv: key and type; the caller appends the value bytes to w->kv. */
static inline void gw_kv_begin(gw_t *w, const char *key, kvs_gguf_type_t type)
{
    if (w->n_kv < GW_MAX_ITEMS) {
        w->kv_pos[w->n_kv].key_len = w->kv.len;
        w->kv_pos[w->n_kv].type = w->kv.len + 8 + strlen(key);
        w->kv_pos[w->n_kv].value = w->kv.len + 12 + strlen(key);
    }
    w->n_kv++;
    gw_put_str(&w->kv, key);
    gw_put_u32(&w->kv, (uint32_t) type);
}

/* A kv whose value is given as raw bytes (nested arrays, malformed values). */
static inline void gw_kv_raw(gw_t *w, const char *key, kvs_gguf_type_t type, const void *value,
                             size_t len)
{
    gw_kv_begin(w, key, type);
    gw_put(&w->kv, value, len);
}

#define GW_KV_SCALAR(fn, ctype, gtype, bytes)                                                      \
    static inline void fn(gw_t *w, const char *key, ctype v)                                       \
    {                                                                                              \
        gw_kv_begin(w, key, gtype);                                                                \
        gw_put_le(&w->kv, (uint64_t) v, bytes);                                                    \
    }
GW_KV_SCALAR(gw_kv_u8, uint8_t, KVS_GGUF_U8, 1)
GW_KV_SCALAR(gw_kv_i8, int8_t, KVS_GGUF_I8, 1)
GW_KV_SCALAR(gw_kv_u16, uint16_t, KVS_GGUF_U16, 2)
GW_KV_SCALAR(gw_kv_i16, int16_t, KVS_GGUF_I16, 2)
GW_KV_SCALAR(gw_kv_u32, uint32_t, KVS_GGUF_U32, 4)
GW_KV_SCALAR(gw_kv_i32, int32_t, KVS_GGUF_I32, 4)
GW_KV_SCALAR(gw_kv_u64, uint64_t, KVS_GGUF_U64, 8)
GW_KV_SCALAR(gw_kv_i64, int64_t, KVS_GGUF_I64, 8)
#undef GW_KV_SCALAR

static inline void gw_kv_bool(gw_t *w, const char *key, int v)
{
    gw_kv_begin(w, key, KVS_GGUF_BOOL);
    gw_put_u8(&w->kv, v ? 1 : 0);
}

static inline void gw_kv_f32(gw_t *w, const char *key, float v)
{
    gw_kv_begin(w, key, KVS_GGUF_F32);
    gw_put_f32(&w->kv, v);
}

static inline void gw_kv_f64(gw_t *w, const char *key, double v)
{
    gw_kv_begin(w, key, KVS_GGUF_F64);
    gw_put_f64(&w->kv, v);
}

static inline void gw_kv_str(gw_t *w, const char *key, const char *v)
{
    gw_kv_begin(w, key, KVS_GGUF_STRING);
    gw_put_str(&w->kv, v);
}

/* Appends one array value (element type, count, elements) to b. elems is a C array of the
 * matching type: uint8_t[] for U8 and BOOL, int16_t[] for I16, float[] for F32, double[] for
 * F64, const char *[] for STRING... Arrays of arrays are built by hand with gw_put_*. */
static inline void gw_put_array(gw_bytes_t *b, kvs_gguf_type_t elem_type, uint64_t count,
                                const void *elems)
{
    gw_put_u32(b, (uint32_t) elem_type);
    gw_put_u64(b, count);
    for (uint64_t i = 0; i < count; i++) {
        switch (elem_type) {
        case KVS_GGUF_U8:
        case KVS_GGUF_BOOL:
            gw_put_u8(b, ((const uint8_t *) elems)[i]);
            break;
        case KVS_GGUF_I8:
            gw_put_le(b, (uint64_t) ((const int8_t *) elems)[i], 1);
            break;
        case KVS_GGUF_U16:
            gw_put_u16(b, ((const uint16_t *) elems)[i]);
            break;
        case KVS_GGUF_I16:
            gw_put_le(b, (uint64_t) ((const int16_t *) elems)[i], 2);
            break;
        case KVS_GGUF_U32:
            gw_put_u32(b, ((const uint32_t *) elems)[i]);
            break;
        case KVS_GGUF_I32:
            gw_put_le(b, (uint64_t) ((const int32_t *) elems)[i], 4);
            break;
        case KVS_GGUF_U64:
            gw_put_u64(b, ((const uint64_t *) elems)[i]);
            break;
        case KVS_GGUF_I64:
            gw_put_le(b, (uint64_t) ((const int64_t *) elems)[i], 8);
            break;
        case KVS_GGUF_F32:
            gw_put_f32(b, ((const float *) elems)[i]);
            break;
        case KVS_GGUF_F64:
            gw_put_f64(b, ((const double *) elems)[i]);
            break;
        case KVS_GGUF_STRING:
            gw_put_str(b, ((const char *const *) elems)[i]);
            break;
        case KVS_GGUF_ARRAY: /* nested arrays are built by hand */
            abort();
        }
    }
}

static inline void gw_kv_array(gw_t *w, const char *key, kvs_gguf_type_t elem_type, uint64_t count,
                               const void *elems)
{
    gw_kv_begin(w, key, KVS_GGUF_ARRAY);
    gw_put_array(&w->kv, elem_type, count, elems);
}

/* Sets the alignment of tensor data and writes general.alignment; call before any tensor. */
static inline void gw_alignment(gw_t *w, uint32_t alignment)
{
    if (w->n_tensors != 0 || alignment == 0) abort(); /* misuse of the builder */
    w->alignment = alignment;
    gw_kv_u32(w, "general.alignment", alignment);
}

static inline void gw_pad(gw_bytes_t *b, size_t alignment)
{
    while (!b->oom && b->len % alignment != 0) gw_put_u8(b, 0);
}

/* A tensor whose data is given already encoded; n_dims entries of ne are written. */
static inline void gw_tensor(gw_t *w, const char *name, kvs_ggml_type_t type, uint32_t n_dims,
                             const uint64_t *ne, const void *data, size_t bytes)
{
    gw_tensor_pos_t *pos = w->n_tensors < GW_MAX_ITEMS ? &w->tensor_pos[w->n_tensors] : NULL;
    w->n_tensors++;
    if (pos) pos->name_len = w->ti.len;
    gw_put_str(&w->ti, name);
    if (pos) pos->n_dims = w->ti.len;
    gw_put_u32(&w->ti, n_dims);
    if (pos) pos->ne0 = w->ti.len;
    for (uint32_t d = 0; d < n_dims; d++) gw_put_u64(&w->ti, ne[d]);
    if (pos) pos->type = w->ti.len;
    gw_put_u32(&w->ti, (uint32_t) type);
    if (pos) pos->offset = w->ti.len;
    gw_put_u64(&w->ti, w->data.len);
    gw_put(&w->data, data, bytes);
    gw_pad(&w->data, w->alignment);
}

/* Reference quantisers (the ggml reference algorithms): n floats (a multiple of the block
 * size for quantised types) into out[n / block_elems * block_bytes]. */
static inline void gw_quantize(kvs_ggml_type_t type, const float *x, uint64_t n, uint8_t *out)
{
    uint64_t nb = n / 32;
    switch (type) {
    case KVS_GGML_F32:
        for (uint64_t i = 0; i < n; i++) {
            uint32_t bits;
            memcpy(&bits, &x[i], 4);
            for (int k = 0; k < 4; k++) out[4 * i + k] = (uint8_t) (bits >> (8 * k));
        }
        return;
    case KVS_GGML_F16:
    case KVS_GGML_BF16:
        for (uint64_t i = 0; i < n; i++) {
            uint16_t h = type == KVS_GGML_F16 ? kvs_f32_to_f16(x[i]) : kvs_f32_to_bf16(x[i]);
            out[2 * i] = (uint8_t) h;
            out[2 * i + 1] = (uint8_t) (h >> 8);
        }
        return;
    case KVS_GGML_Q8_0:
        for (uint64_t b = 0; b < nb; b++, x += 32, out += 34) {
            float amax = 0;
            for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
            float d = amax / 127, id = d != 0 ? 1 / d : 0;
            uint16_t h = kvs_f32_to_f16(d);
            out[0] = (uint8_t) h;
            out[1] = (uint8_t) (h >> 8);
            for (int j = 0; j < 32; j++) out[2 + j] = (uint8_t) (int8_t) roundf(x[j] * id);
        }
        return;
    case KVS_GGML_Q4_0:
        for (uint64_t b = 0; b < nb; b++, x += 32, out += 18) {
            float amax = 0, max = 0; /* the value of largest magnitude, with its sign */
            for (int j = 0; j < 32; j++)
                if (fabsf(x[j]) > amax) amax = fabsf(x[j]), max = x[j];
            float d = max / -8, id = d != 0 ? 1 / d : 0;
            uint16_t h = kvs_f32_to_f16(d);
            out[0] = (uint8_t) h;
            out[1] = (uint8_t) (h >> 8);
            for (int j = 0; j < 16; j++) {
                int lo = (int) (x[j] * id + 8.5f), hi = (int) (x[j + 16] * id + 8.5f);
                lo = lo > 15 ? 15 : lo;
                hi = hi > 15 ? 15 : hi;
                out[2 + j] = (uint8_t) (lo | (hi << 4));
            }
        }
        return;
    case KVS_GGML_Q4_1:
        for (uint64_t b = 0; b < nb; b++, x += 32, out += 20) {
            float min = x[0], max = x[0];
            for (int j = 1; j < 32; j++) min = fminf(min, x[j]), max = fmaxf(max, x[j]);
            float d = (max - min) / 15, id = d != 0 ? 1 / d : 0;
            uint16_t hd = kvs_f32_to_f16(d), hm = kvs_f32_to_f16(min);
            out[0] = (uint8_t) hd;
            out[1] = (uint8_t) (hd >> 8);
            out[2] = (uint8_t) hm;
            out[3] = (uint8_t) (hm >> 8);
            for (int j = 0; j < 16; j++) {
                int lo = (int) ((x[j] - min) * id + 0.5f),
                    hi = (int) ((x[j + 16] - min) * id + 0.5f);
                lo = lo > 15 ? 15 : lo;
                hi = hi > 15 ? 15 : hi;
                out[4 + j] = (uint8_t) (lo | (hi << 4));
            }
        }
        return;
    }
    abort(); /* unsupported type */
}

/* A tensor given as n = ne[0] * ... floats, encoded with gw_quantize. */
static inline void gw_tensor_f32(gw_t *w, const char *name, kvs_ggml_type_t type, uint32_t n_dims,
                                 const uint64_t *ne, const float *x)
{
    uint64_t n = 1;
    for (uint32_t d = 0; d < n_dims; d++) n *= ne[d];
    size_t bytes = (size_t) (n / kvs_ggml_block_elems(type) * kvs_ggml_block_bytes(type));
    uint8_t *buf = kvs_malloc(bytes ? bytes : 1);
    if (buf == NULL) {
        w->ti.oom = 1;
        return;
    }
    gw_quantize(type, x, n, buf);
    gw_tensor(w, name, type, n_dims, ne, buf, bytes);
    kvs_free(buf);
}

/* Assembles the file (call once): header, kvs, tensor infos, padding, data. Returns a kvs_malloc'd
 * buffer (free with kvs_free) and fills the absolute field positions, or NULL on allocation
 * failure. */
static inline uint8_t *gw_finish(gw_t *w, size_t *len_p)
{
    gw_bytes_t out = {0};
    gw_put(&out, "GGUF", 4);
    gw_put_u32(&out, w->version);
    gw_put_u64(&out, w->n_tensors);
    gw_put_u64(&out, w->n_kv);
    size_t kv_start = out.len;
    gw_put(&out, w->kv.p, w->kv.len);
    size_t ti_start = out.len;
    gw_put(&out, w->ti.p, w->ti.len);
    gw_pad(&out, w->alignment);
    w->data_start = out.len;
    gw_put(&out, w->data.p, w->data.len);
    if (out.oom || w->kv.oom || w->ti.oom || w->data.oom) {
        kvs_free(out.p);
        return NULL;
    }
    for (uint64_t i = 0; i < w->n_kv && i < GW_MAX_ITEMS; i++) {
        w->kv_pos[i].key_len += kv_start;
        w->kv_pos[i].type += kv_start;
        w->kv_pos[i].value += kv_start;
    }
    for (uint64_t i = 0; i < w->n_tensors && i < GW_MAX_ITEMS; i++) {
        gw_tensor_pos_t *p = &w->tensor_pos[i];
        p->name_len += ti_start;
        p->n_dims += ti_start;
        p->ne0 += ti_start;
        p->type += ti_start;
        p->offset += ti_start;
    }
    *len_p = out.len;
    return out.p;
}

/* Little-endian patching of a finished buffer, for corruption tests. */
static inline void gw_patch(uint8_t *buf, size_t pos, uint64_t v, int bytes)
{
    for (int i = 0; i < bytes; i++) buf[pos + (size_t) i] = (uint8_t) (v >> (8 * i));
}

/* Reads everything an open file offers through the public API: every key with every getter,
 * every array element (up to 65536 per array), every tensor by index and by name, and a
 * dequantisation of each tensor whole (up to 2^20 elements) and cut. Returns the number of
 * values read; aborts if the API contradicts itself. Errors the getters log are expected
 * (wrong types), so callers usually install a capturing log sink. */
static inline uint64_t gw_walk(const kvs_gguf_t *g)
{
    uint64_t seen = 0;
    char key[512];
    for (uint64_t i = 0; i < kvs_gguf_kv_count(g); i++) {
        kvs_gguf_str_t k, s;
        kvs_gguf_type_t type, elem_type;
        uint64_t count;
        if (kvs_gguf_kv_at(g, i, &k, &type) != KVS_OK) abort();
        if (k.len >= sizeof(key) || memchr(k.ptr, 0, (size_t) k.len) != NULL) continue;
        memcpy(key, k.ptr, (size_t) k.len);
        key[k.len] = 0;
        uint32_t u;
        float f;
        int b;
        kvs_status_t st[5] = {kvs_gguf_u32(g, key, &u), kvs_gguf_f32(g, key, &f),
                              kvs_gguf_bool(g, key, &b), kvs_gguf_str(g, key, &s),
                              kvs_gguf_array(g, key, &elem_type, &count)};
        for (int j = 0; j < 5; j++) {
            if (st[j] != KVS_OK && st[j] != KVS_ERR_INVALID) abort();
            seen += st[j] == KVS_OK;
        }
        if ((st[4] == KVS_OK) != (type == KVS_GGUF_ARRAY)) abort();
        if (st[3] == KVS_OK && s.len > 0)
            seen += ((uint8_t) s.ptr[0] ^ (uint8_t) s.ptr[s.len - 1]) & 1;
        if (st[4] != KVS_OK) continue;
        for (uint64_t e = 0; e < count && e < 65536; e++) {
            int64_t v;
            seen += kvs_gguf_array_i64(g, key, e, &v) == KVS_OK;
            seen += kvs_gguf_array_f32(g, key, e, &f) == KVS_OK;
            if (kvs_gguf_array_str(g, key, e, &s) == KVS_OK && s.len > 0)
                seen += ((uint8_t) s.ptr[0] ^ (uint8_t) s.ptr[s.len - 1]) & 1;
        }
        int64_t v;
        if (kvs_gguf_array_i64(g, key, count, &v) != KVS_ERR_INVALID) abort();
    }
    for (uint64_t i = 0; i < kvs_gguf_tensor_count(g); i++) {
        kvs_gguf_tensor_t t, byname;
        if (kvs_gguf_tensor_at(g, i, &t) != KVS_OK) abort();
        if (t.name.len < sizeof(key) && memchr(t.name.ptr, 0, (size_t) t.name.len) == NULL) {
            memcpy(key, t.name.ptr, (size_t) t.name.len);
            key[t.name.len] = 0;
            if (kvs_gguf_tensor(g, key, &byname) != KVS_OK || byname.data != t.data) abort();
        }
        uint64_t rows = t.ne[1] * t.ne[2] * t.ne[3], ne0 = t.ne[0];
        if (rows == 0 || ne0 == 0 || rows > (1u << 20) / ne0) continue;
        float *x = kvs_malloc((size_t) (rows * ne0) * sizeof(float));
        if (x == NULL) continue;
        if (kvs_gguf_dequant(&t, 0, rows, 0, ne0, x) != KVS_OK) abort();
        for (uint64_t j = 0; j < rows * ne0; j++) seen += x[j] == x[j];
        if (ne0 > 2 && kvs_gguf_dequant(&t, rows - 1, 1, 1, ne0 - 2, x) != KVS_OK) abort();
        if (kvs_gguf_dequant(&t, rows, 1, 0, 1, x) != KVS_ERR_INVALID) abort();
        kvs_free(x);
    }
    return seen;
}

#endif
