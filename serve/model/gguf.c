/* The GGUF reader: maps a file (or takes a caller's buffer), validates the header, metadata
 * and tensor directory in one bounds-checked pass, and indexes keys, tensor names and the
 * elements of string arrays so that every lookup afterwards is O(log n) or O(1). Values are
 * never copied: strings and tensor data point into the mapping. */
#include "model/gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/bytes.h"
#include "kvstage/alloc.h"
#include "kvstage/log.h"

#define DEFAULT_ALIGNMENT 32
#define MAX_ALIGNMENT     (1u << 20)
/* Real files have tens of keys and at most a few thousand tensors; the caps keep a hostile
 * header from making us allocate in proportion to a forged count. */
#define MAX_KV          (1u << 16)
#define MAX_TENSORS     (1u << 20)
#define MAX_KEY_LEN     65535 /* the format's own limit */
#define MAX_NAME_LEN    1024
#define MAX_ARRAY_DEPTH 8
/* Smallest encodings: a kv (key length, type, one-byte value), a tensor info (name length,
 * n_dims, type, offset), a string (its length), an array (element type, count). */
#define MIN_KV_BYTES     13
#define MIN_TENSOR_BYTES 24
#define MIN_STRING_BYTES 8
#define MIN_ARRAY_BYTES  12

typedef struct {
    kvs_gguf_str_t key;
    kvs_gguf_type_t type;
    uint64_t pos;              /* file offset of the value; of the first element for arrays */
    kvs_gguf_type_t elem_type; /* arrays only */
    uint64_t count;            /* arrays only */
    uint64_t *elem_pos;        /* [count] string arrays only: offset of each element */
} kv_t;

struct kvs_gguf {
    const uint8_t *base;
    uint64_t size;
    void *map; /* non-NULL when this handle mapped the file itself */
    uint32_t version;
    uint32_t alignment;
    uint64_t data_pos;
    uint64_t n_kv;
    kv_t *kv;         /* [n_kv] in file order */
    kv_t **kv_sorted; /* [n_kv] by key */
    uint64_t n_tensors;
    kvs_gguf_tensor_t *tensors;         /* [n_tensors] in file order */
    kvs_gguf_tensor_t **tensors_sorted; /* [n_tensors] by name */
};

/* The parse cursor; ctx names the item being read for error messages. */
typedef struct {
    const uint8_t *base;
    uint64_t size;
    uint64_t pos;
    const char *src;
    char ctx[128];
} rd_t;

static const char *type_str(uint32_t type)
{
    static const char *names[] = {"u8",   "i8",     "u16",   "i16", "u32", "i32", "f32",
                                  "bool", "string", "array", "u64", "i64", "f64"};
    return type < sizeof(names) / sizeof(names[0]) ? names[type] : "invalid";
}

/* Bytes of one value of a fixed-size type; 0 for string, array and invalid types. */
static uint32_t scalar_size(uint32_t type)
{
    switch (type) {
    case KVS_GGUF_U8:
    case KVS_GGUF_I8:
    case KVS_GGUF_BOOL:
        return 1;
    case KVS_GGUF_U16:
    case KVS_GGUF_I16:
        return 2;
    case KVS_GGUF_U32:
    case KVS_GGUF_I32:
    case KVS_GGUF_F32:
        return 4;
    case KVS_GGUF_U64:
    case KVS_GGUF_I64:
    case KVS_GGUF_F64:
        return 8;
    }
    return 0;
}

/* A printable copy of at most 64 bytes of a file string, for messages. */
static void printable(kvs_gguf_str_t s, char *out, size_t cap)
{
    size_t n = s.len < cap - 1 ? (size_t) s.len : cap - 1;
    for (size_t i = 0; i < n; i++) {
        char c = s.ptr[i];
        out[i] = c >= 0x20 && c < 0x7f ? c : '?';
    }
    out[n] = 0;
}

static uint64_t left(const rd_t *rd)
{
    return rd->size - rd->pos;
}

static kvs_status_t truncated(const rd_t *rd, const char *what, uint64_t need)
{
    kvs_error("gguf %s: %s: %s needs %llu bytes at offset %llu, %llu left", rd->src, rd->ctx, what,
              (unsigned long long) need, (unsigned long long) rd->pos,
              (unsigned long long) left(rd));
    return KVS_ERR_PROTOCOL;
}

static kvs_status_t rd_u32(rd_t *rd, const char *what, uint32_t *v_p)
{
    if (left(rd) < 4) return truncated(rd, what, 4);
    *v_p = kvs_get_u32(rd->base + rd->pos);
    rd->pos += 4;
    return KVS_OK;
}

static kvs_status_t rd_u64(rd_t *rd, const char *what, uint64_t *v_p)
{
    if (left(rd) < 8) return truncated(rd, what, 8);
    *v_p = kvs_get_u64(rd->base + rd->pos);
    rd->pos += 8;
    return KVS_OK;
}

static kvs_status_t rd_skip(rd_t *rd, const char *what, uint64_t n)
{
    if (left(rd) < n) return truncated(rd, what, n);
    rd->pos += n;
    return KVS_OK;
}

/* A length-prefixed string of at most max bytes. */
static kvs_status_t rd_str(rd_t *rd, const char *what, uint64_t max, kvs_gguf_str_t *s_p)
{
    uint64_t len;
    kvs_status_t st = rd_u64(rd, what, &len);
    if (st != KVS_OK) return st;
    if (len > max) {
        kvs_error("gguf %s: %s: %s length %llu exceeds %llu", rd->src, rd->ctx, what,
                  (unsigned long long) len, (unsigned long long) max);
        return KVS_ERR_PROTOCOL;
    }
    const char *ptr = (const char *) rd->base + rd->pos;
    st = rd_skip(rd, what, len);
    if (st != KVS_OK) return st;
    s_p->ptr = ptr;
    s_p->len = len;
    return KVS_OK;
}

/* A count of items of at least min_bytes each, checked against the bytes left (and cap). */
static kvs_status_t check_count(const rd_t *rd, const char *what, uint64_t count,
                                uint64_t min_bytes, uint64_t cap)
{
    if (count > cap || count > left(rd) / min_bytes) {
        kvs_error("gguf %s: %s: %s %llu impossible (%llu bytes left, cap %llu)", rd->src, rd->ctx,
                  what, (unsigned long long) count, (unsigned long long) left(rd),
                  (unsigned long long) cap);
        return KVS_ERR_PROTOCOL;
    }
    return KVS_OK;
}

static kvs_status_t check_bools(const rd_t *rd, uint64_t count)
{
    for (uint64_t i = 0; i < count; i++) {
        uint8_t b = rd->base[rd->pos + i];
        if (b > 1) {
            kvs_error("gguf %s: %s: bool value %u at offset %llu is not 0 or 1", rd->src, rd->ctx,
                      b, (unsigned long long) (rd->pos + i));
            return KVS_ERR_PROTOCOL;
        }
    }
    return KVS_OK;
}

/* Skips over (validating) one value of the given type; kv, when given, is the top-level entry
 * whose array header and string element offsets are recorded. */
static kvs_status_t parse_value(rd_t *rd, uint32_t type, int depth, kv_t *kv)
{
    kvs_status_t st;
    uint32_t size = scalar_size(type);
    if (size != 0) {
        if (left(rd) < size) return truncated(rd, type_str(type), size);
        if (type == KVS_GGUF_BOOL && (st = check_bools(rd, 1)) != KVS_OK) return st;
        rd->pos += size;
        return KVS_OK;
    }
    if (type == KVS_GGUF_STRING) {
        kvs_gguf_str_t s;
        return rd_str(rd, "string", UINT64_MAX, &s);
    }
    if (type != KVS_GGUF_ARRAY) {
        kvs_error("gguf %s: %s: value type %u invalid", rd->src, rd->ctx, type);
        return KVS_ERR_PROTOCOL;
    }
    if (depth >= MAX_ARRAY_DEPTH) {
        kvs_error("gguf %s: %s: arrays nested deeper than %d", rd->src, rd->ctx, MAX_ARRAY_DEPTH);
        return KVS_ERR_PROTOCOL;
    }
    uint32_t elem_type;
    uint64_t count;
    if ((st = rd_u32(rd, "array element type", &elem_type)) != KVS_OK) return st;
    if ((st = rd_u64(rd, "array count", &count)) != KVS_OK) return st;
    if (kv != NULL) {
        kv->elem_type = (kvs_gguf_type_t) elem_type;
        kv->count = count;
        kv->pos = rd->pos;
    }
    size = scalar_size(elem_type);
    if (size != 0) {
        if ((st = check_count(rd, "array count", count, size, UINT64_MAX)) != KVS_OK) return st;
        if (elem_type == KVS_GGUF_BOOL && (st = check_bools(rd, count)) != KVS_OK) return st;
        rd->pos += count * size;
        return KVS_OK;
    }
    if (elem_type == KVS_GGUF_STRING) {
        st = check_count(rd, "string array count", count, MIN_STRING_BYTES, UINT64_MAX);
        if (st != KVS_OK) return st;
        uint64_t *elem_pos = NULL;
        if (kv != NULL && count > 0) {
            /* Bounded by the file size: count <= bytes left / 8. */
            elem_pos = kv->elem_pos = kvs_malloc((size_t) count * sizeof(*elem_pos));
            if (elem_pos == NULL) {
                kvs_error("gguf %s: %s: out of memory indexing %llu strings", rd->src, rd->ctx,
                          (unsigned long long) count);
                return KVS_ERR_NOMEM;
            }
        }
        for (uint64_t i = 0; i < count; i++) {
            if (elem_pos != NULL) elem_pos[i] = rd->pos;
            kvs_gguf_str_t s;
            if ((st = rd_str(rd, "string element", UINT64_MAX, &s)) != KVS_OK) return st;
        }
        return KVS_OK;
    }
    if (elem_type == KVS_GGUF_ARRAY) {
        st = check_count(rd, "nested array count", count, MIN_ARRAY_BYTES, UINT64_MAX);
        if (st != KVS_OK) return st;
        for (uint64_t i = 0; i < count; i++)
            if ((st = parse_value(rd, KVS_GGUF_ARRAY, depth + 1, NULL)) != KVS_OK) return st;
        return KVS_OK;
    }
    kvs_error("gguf %s: %s: array element type %u invalid", rd->src, rd->ctx, elem_type);
    return KVS_ERR_PROTOCOL;
}

static int str_cmp(kvs_gguf_str_t a, kvs_gguf_str_t b)
{
    uint64_t n = a.len < b.len ? a.len : b.len;
    int c = n ? memcmp(a.ptr, b.ptr, (size_t) n) : 0;
    if (c != 0) return c;
    return a.len < b.len ? -1 : a.len > b.len;
}

static int kv_ptr_cmp(const void *a, const void *b)
{
    return str_cmp((*(kv_t *const *) a)->key, (*(kv_t *const *) b)->key);
}

static int tensor_ptr_cmp(const void *a, const void *b)
{
    return str_cmp((*(kvs_gguf_tensor_t *const *) a)->name,
                   (*(kvs_gguf_tensor_t *const *) b)->name);
}

static const kv_t *find_kv(const kvs_gguf_t *g, const char *key)
{
    kvs_gguf_str_t k = {key, strlen(key)};
    uint64_t lo = 0, hi = g->n_kv;
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        int c = str_cmp(g->kv_sorted[mid]->key, k);
        if (c == 0) return g->kv_sorted[mid];
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

/* Two's complement sign extension of the low `bits` bits of v, without implementation-defined
 * conversions. */
static int64_t sign_extend(uint64_t v, unsigned bits)
{
    uint64_t sign = 1ull << (bits - 1);
    if ((v & sign) == 0) return (int64_t) v;
    uint64_t mag = (bits == 64 ? ~v : (((sign << 1) - 1) ^ v)) + 1; /* 2^bits - v */
    return mag == (1ull << 63) ? INT64_MIN : -(int64_t) mag;
}

/* An integer value of any integer type: *neg_p set for a negative one, whose value is *s_p;
 * otherwise the value is *u_p. Returns -1 for a non-integer type. */
static int read_int(const uint8_t *p, uint32_t type, int *neg_p, int64_t *s_p, uint64_t *u_p)
{
    uint64_t raw;
    unsigned bits;
    int is_signed;
    switch (type) {
    case KVS_GGUF_U8:
    case KVS_GGUF_I8:
        raw = p[0], bits = 8;
        break;
    case KVS_GGUF_U16:
    case KVS_GGUF_I16:
        raw = kvs_get_u16(p), bits = 16;
        break;
    case KVS_GGUF_U32:
    case KVS_GGUF_I32:
        raw = kvs_get_u32(p), bits = 32;
        break;
    case KVS_GGUF_U64:
    case KVS_GGUF_I64:
        raw = kvs_get_u64(p), bits = 64;
        break;
    default:
        return -1;
    }
    is_signed =
        type == KVS_GGUF_I8 || type == KVS_GGUF_I16 || type == KVS_GGUF_I32 || type == KVS_GGUF_I64;
    int64_t s = is_signed ? sign_extend(raw, bits) : 0;
    *neg_p = is_signed && s < 0;
    *s_p = s;
    *u_p = raw;
    return 0;
}

/* A float value of type f32 or f64; -1 for another type or an f64 beyond the f32 range. */
static int read_float(const uint8_t *p, uint32_t type, float *v_p)
{
    if (type == KVS_GGUF_F32) {
        uint32_t bits = kvs_get_u32(p);
        memcpy(v_p, &bits, sizeof(*v_p));
        return 0;
    }
    if (type == KVS_GGUF_F64) {
        uint64_t bits = kvs_get_u64(p);
        double d;
        memcpy(&d, &bits, sizeof(d));
        if (isfinite(d) && fabs(d) > FLT_MAX) return -1;
        *v_p = (float) d;
        return 0;
    }
    return -1;
}

static kvs_status_t parse_alignment(kvs_gguf_t *g, const char *src)
{
    g->alignment = DEFAULT_ALIGNMENT;
    const kv_t *kv = find_kv(g, "general.alignment");
    if (kv == NULL) return KVS_OK;
    int neg;
    int64_t s;
    uint64_t u;
    if (read_int(g->base + kv->pos, kv->type, &neg, &s, &u) != 0 || neg || u == 0 ||
        u > MAX_ALIGNMENT || (u & (u - 1)) != 0) {
        kvs_error("gguf %s: general.alignment (type %s) is not a power of two up to %u", src,
                  type_str(kv->type), MAX_ALIGNMENT);
        return KVS_ERR_PROTOCOL;
    }
    g->alignment = (uint32_t) u;
    return KVS_OK;
}

static kvs_status_t parse_kvs(kvs_gguf_t *g, rd_t *rd)
{
    kvs_status_t st;
    for (uint64_t i = 0; i < g->n_kv; i++) {
        kv_t *kv = &g->kv[i];
        snprintf(rd->ctx, sizeof(rd->ctx), "kv %llu", (unsigned long long) i);
        if ((st = rd_str(rd, "key", MAX_KEY_LEN, &kv->key)) != KVS_OK) return st;
        char key[65];
        printable(kv->key, key, sizeof(key));
        snprintf(rd->ctx, sizeof(rd->ctx), "kv %llu '%s'", (unsigned long long) i, key);
        uint32_t type;
        if ((st = rd_u32(rd, "value type", &type)) != KVS_OK) return st;
        kv->type = (kvs_gguf_type_t) type;
        kv->pos = rd->pos;
        if ((st = parse_value(rd, type, 0, kv)) != KVS_OK) return st;
        g->kv_sorted[i] = kv;
    }
    if (g->n_kv > 1) qsort(g->kv_sorted, (size_t) g->n_kv, sizeof(*g->kv_sorted), kv_ptr_cmp);
    for (uint64_t i = 1; i < g->n_kv; i++) {
        if (str_cmp(g->kv_sorted[i - 1]->key, g->kv_sorted[i]->key) == 0) {
            char key[65];
            printable(g->kv_sorted[i]->key, key, sizeof(key));
            kvs_error("gguf %s: key '%s' appears twice", rd->src, key);
            return KVS_ERR_PROTOCOL;
        }
    }
    return KVS_OK;
}

/* One tensor info: name, dims, type, offset (kept in t->data until the data section is known). */
static kvs_status_t parse_tensor_info(rd_t *rd, uint64_t i, kvs_gguf_tensor_t *t,
                                      uint64_t *offset_p)
{
    kvs_status_t st;
    snprintf(rd->ctx, sizeof(rd->ctx), "tensor %llu", (unsigned long long) i);
    if ((st = rd_str(rd, "name", MAX_NAME_LEN, &t->name)) != KVS_OK) return st;
    char name[65];
    printable(t->name, name, sizeof(name));
    snprintf(rd->ctx, sizeof(rd->ctx), "tensor %llu '%s'", (unsigned long long) i, name);
    if ((st = rd_u32(rd, "n_dims", &t->n_dims)) != KVS_OK) return st;
    if (t->n_dims > KVS_GGUF_MAX_DIMS) {
        kvs_error("gguf %s: %s: n_dims %u > %d", rd->src, rd->ctx, t->n_dims, KVS_GGUF_MAX_DIMS);
        return KVS_ERR_PROTOCOL;
    }
    uint64_t nelem = 1;
    for (uint32_t d = 0; d < KVS_GGUF_MAX_DIMS; d++) {
        t->ne[d] = 1;
        if (d < t->n_dims && (st = rd_u64(rd, "ne", &t->ne[d])) != KVS_OK) return st;
        /* ggml counts elements in int64_t. */
        if (t->ne[d] > (uint64_t) INT64_MAX ||
            (t->ne[d] != 0 && nelem > (uint64_t) INT64_MAX / t->ne[d])) {
            kvs_error("gguf %s: %s: element count overflows at ne[%u] = %llu", rd->src, rd->ctx, d,
                      (unsigned long long) t->ne[d]);
            return KVS_ERR_PROTOCOL;
        }
        nelem *= t->ne[d];
    }
    uint32_t type;
    if ((st = rd_u32(rd, "type", &type)) != KVS_OK) return st;
    t->type = (kvs_ggml_type_t) type;
    uint32_t be = kvs_ggml_block_elems(t->type);
    if (be == 0) {
        kvs_error("gguf %s: %s: tensor type %u not supported (F32, F16, BF16, Q8_0, Q4_0, Q4_1)",
                  rd->src, rd->ctx, type);
        return KVS_ERR_UNSUPPORTED;
    }
    if (t->ne[0] % be != 0) {
        kvs_error("gguf %s: %s: ne[0] %llu is not a multiple of the block size %u", rd->src,
                  rd->ctx, (unsigned long long) t->ne[0], be);
        return KVS_ERR_PROTOCOL;
    }
    /* nelem < 2^63 and a block is never more than 8 bytes per element: no overflow. */
    t->bytes = nelem / be * kvs_ggml_block_bytes(t->type);
    return rd_u64(rd, "offset", offset_p);
}

static kvs_status_t parse_tensors(kvs_gguf_t *g, rd_t *rd, uint64_t *offsets)
{
    kvs_status_t st;
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        if ((st = parse_tensor_info(rd, i, &g->tensors[i], &offsets[i])) != KVS_OK) return st;
        g->tensors_sorted[i] = &g->tensors[i];
    }
    /* The data section starts at the next multiple of the alignment. */
    uint64_t a = g->alignment;
    uint64_t pad = (a - rd->pos % a) % a;
    g->data_pos = rd->pos + pad;
    if (g->n_tensors == 0) return KVS_OK;
    if (pad > left(rd)) {
        kvs_error("gguf %s: data section at offset %llu is past the end of the file (%llu bytes)",
                  rd->src, (unsigned long long) g->data_pos, (unsigned long long) rd->size);
        return KVS_ERR_PROTOCOL;
    }
    uint64_t data_size = rd->size - g->data_pos;
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        kvs_gguf_tensor_t *t = &g->tensors[i];
        char name[65];
        printable(t->name, name, sizeof(name));
        if (offsets[i] % a != 0) {
            kvs_error("gguf %s: tensor '%s': data offset %llu is not a multiple of the "
                      "alignment %llu",
                      rd->src, name, (unsigned long long) offsets[i], (unsigned long long) a);
            return KVS_ERR_PROTOCOL;
        }
        if (offsets[i] > data_size || t->bytes > data_size - offsets[i]) {
            kvs_error("gguf %s: tensor '%s': data [%llu, +%llu) runs past the %llu-byte data "
                      "section",
                      rd->src, name, (unsigned long long) offsets[i], (unsigned long long) t->bytes,
                      (unsigned long long) data_size);
            return KVS_ERR_PROTOCOL;
        }
        t->data = rd->base + g->data_pos + offsets[i];
    }
    if (g->n_tensors > 1)
        qsort(g->tensors_sorted, (size_t) g->n_tensors, sizeof(*g->tensors_sorted), tensor_ptr_cmp);
    for (uint64_t i = 1; i < g->n_tensors; i++) {
        if (str_cmp(g->tensors_sorted[i - 1]->name, g->tensors_sorted[i]->name) == 0) {
            char name[65];
            printable(g->tensors_sorted[i]->name, name, sizeof(name));
            kvs_error("gguf %s: tensor name '%s' appears twice", rd->src, name);
            return KVS_ERR_PROTOCOL;
        }
    }
    return KVS_OK;
}

static kvs_status_t parse(kvs_gguf_t *g, const char *src)
{
    static const uint8_t magic[4] = {'G', 'G', 'U', 'F'};
    rd_t rd = {.base = g->base, .size = g->size, .pos = 0, .src = src, .ctx = "header"};
    kvs_status_t st;
    if (g->size < 4 || memcmp(g->base, magic, 4) != 0) {
        kvs_error("gguf %s: not a GGUF file (bad magic)", src);
        return KVS_ERR_PROTOCOL;
    }
    rd.pos = 4;
    if ((st = rd_u32(&rd, "version", &g->version)) != KVS_OK) return st;
    if (g->version != 2 && g->version != 3) {
        kvs_error("gguf %s: version %u not supported (2 or 3)", src, g->version);
        return KVS_ERR_UNSUPPORTED;
    }
    if ((st = rd_u64(&rd, "tensor count", &g->n_tensors)) != KVS_OK) return st;
    if ((st = rd_u64(&rd, "kv count", &g->n_kv)) != KVS_OK) return st;
    /* The tensor count can only be judged against what the metadata leaves. */
    if ((st = check_count(&rd, "kv count", g->n_kv, MIN_KV_BYTES, MAX_KV)) != KVS_OK) return st;
    if ((st = check_count(&rd, "tensor count", g->n_tensors, MIN_TENSOR_BYTES, MAX_TENSORS)) !=
        KVS_OK)
        return st;
    g->kv = kvs_calloc((size_t) g->n_kv + 1, sizeof(*g->kv));
    g->kv_sorted = kvs_calloc((size_t) g->n_kv + 1, sizeof(*g->kv_sorted));
    if (g->kv == NULL || g->kv_sorted == NULL) {
        kvs_error("gguf %s: out of memory for %llu metadata entries", src,
                  (unsigned long long) g->n_kv);
        return KVS_ERR_NOMEM;
    }
    if ((st = parse_kvs(g, &rd)) != KVS_OK) return st;
    if ((st = parse_alignment(g, src)) != KVS_OK) return st;
    snprintf(rd.ctx, sizeof(rd.ctx), "tensor directory");
    if ((st = check_count(&rd, "tensor count", g->n_tensors, MIN_TENSOR_BYTES, MAX_TENSORS)) !=
        KVS_OK)
        return st;
    size_t n = (size_t) g->n_tensors + 1;
    g->tensors = kvs_calloc(n, sizeof(*g->tensors));
    g->tensors_sorted = kvs_calloc(n, sizeof(*g->tensors_sorted));
    uint64_t *offsets = kvs_calloc(n, sizeof(*offsets)); /* [n_tensors] until data_pos is known */
    if (g->tensors == NULL || g->tensors_sorted == NULL || offsets == NULL) {
        kvs_error("gguf %s: out of memory for %llu tensors", src,
                  (unsigned long long) g->n_tensors);
        kvs_free(offsets);
        return KVS_ERR_NOMEM;
    }
    st = parse_tensors(g, &rd, offsets);
    kvs_free(offsets);
    return st;
}

void kvs_gguf_close(kvs_gguf_t *g)
{
    if (g == NULL) return;
    if (g->kv != NULL)
        for (uint64_t i = 0; i < g->n_kv; i++) kvs_free(g->kv[i].elem_pos);
    kvs_free(g->kv);
    kvs_free(g->kv_sorted);
    kvs_free(g->tensors);
    kvs_free(g->tensors_sorted);
    if (g->map != NULL) munmap(g->map, (size_t) g->size);
    kvs_free(g);
}

/* Takes ownership of map (if not NULL) whatever the outcome. */
static kvs_status_t open_common(const uint8_t *base, uint64_t size, void *map, const char *src,
                                kvs_gguf_t **gguf_p)
{
    kvs_gguf_t *g = kvs_calloc(1, sizeof(*g));
    if (g == NULL) {
        kvs_error("gguf %s: out of memory", src);
        if (map != NULL) munmap(map, (size_t) size);
        return KVS_ERR_NOMEM;
    }
    g->base = base;
    g->size = size;
    g->map = map;
    kvs_status_t st = parse(g, src);
    if (st != KVS_OK) {
        kvs_gguf_close(g);
        return st;
    }
    *gguf_p = g;
    return KVS_OK;
}

kvs_status_t kvs_gguf_open_buffer(const void *data, size_t size, kvs_gguf_t **gguf_p)
{
    static const uint8_t empty[1];
    if ((data == NULL && size != 0) || gguf_p == NULL) {
        kvs_error("gguf: NULL buffer or handle pointer");
        return KVS_ERR_INVALID;
    }
    return open_common(data ? data : empty, size, NULL, "<buffer>", gguf_p);
}

kvs_status_t kvs_gguf_open(const char *path, kvs_gguf_t **gguf_p)
{
    static const uint8_t empty[1];
    if (path == NULL || gguf_p == NULL) {
        kvs_error("gguf: NULL path or handle pointer");
        return KVS_ERR_INVALID;
    }
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        kvs_error("gguf %s: cannot open: %s", path, strerror(errno));
        return KVS_ERR_IO;
    }
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        kvs_error("gguf %s: not a regular file", path);
        close(fd);
        return KVS_ERR_IO;
    }
    uint64_t size = (uint64_t) sb.st_size;
    if (size > SIZE_MAX) {
        kvs_error("gguf %s: %llu bytes cannot be mapped", path, (unsigned long long) size);
        close(fd);
        return KVS_ERR_IO;
    }
    void *map = NULL;
    if (size > 0) { /* mmap refuses a zero length; an empty file fails the magic check */
        map = mmap(NULL, (size_t) size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (map == MAP_FAILED) {
            kvs_error("gguf %s: mmap of %llu bytes failed: %s", path, (unsigned long long) size,
                      strerror(errno));
            close(fd);
            return KVS_ERR_IO;
        }
    }
    close(fd); /* the mapping keeps the file */
    return open_common(map ? map : empty, size, map, path, gguf_p);
}

/* Lookups */

static kvs_status_t wrong_type(const char *key, const kv_t *kv, const char *want)
{
    if (kv->type == KVS_GGUF_ARRAY)
        kvs_error("gguf: key '%s' is an array of %s, not %s", key, type_str(kv->elem_type), want);
    else
        kvs_error("gguf: key '%s' has type %s, not %s", key, type_str(kv->type), want);
    return KVS_ERR_INVALID;
}

kvs_status_t kvs_gguf_u32(const kvs_gguf_t *g, const char *key, uint32_t *value_p)
{
    const kv_t *kv = find_kv(g, key);
    if (kv == NULL) return KVS_ERR_NOT_FOUND;
    int neg;
    int64_t s;
    uint64_t u;
    if (read_int(g->base + kv->pos, kv->type, &neg, &s, &u) != 0)
        return wrong_type(key, kv, "an integer");
    if (neg || u > UINT32_MAX) {
        kvs_error("gguf: key '%s' value %s%llu out of u32 range", key, neg ? "-" : "",
                  neg ? (unsigned long long) -(s + 1) + 1 : (unsigned long long) u);
        return KVS_ERR_INVALID;
    }
    *value_p = (uint32_t) u;
    return KVS_OK;
}

kvs_status_t kvs_gguf_f32(const kvs_gguf_t *g, const char *key, float *value_p)
{
    const kv_t *kv = find_kv(g, key);
    if (kv == NULL) return KVS_ERR_NOT_FOUND;
    if (read_float(g->base + kv->pos, kv->type, value_p) != 0)
        return wrong_type(key, kv, "a float in f32 range");
    return KVS_OK;
}

kvs_status_t kvs_gguf_bool(const kvs_gguf_t *g, const char *key, int *value_p)
{
    const kv_t *kv = find_kv(g, key);
    if (kv == NULL) return KVS_ERR_NOT_FOUND;
    if (kv->type != KVS_GGUF_BOOL) return wrong_type(key, kv, "bool");
    *value_p = g->base[kv->pos] != 0;
    return KVS_OK;
}

static void str_at(const kvs_gguf_t *g, uint64_t pos, kvs_gguf_str_t *value_p)
{
    value_p->len = kvs_get_u64(g->base + pos);
    value_p->ptr = (const char *) g->base + pos + 8;
}

kvs_status_t kvs_gguf_str(const kvs_gguf_t *g, const char *key, kvs_gguf_str_t *value_p)
{
    const kv_t *kv = find_kv(g, key);
    if (kv == NULL) return KVS_ERR_NOT_FOUND;
    if (kv->type != KVS_GGUF_STRING) return wrong_type(key, kv, "string");
    str_at(g, kv->pos, value_p);
    return KVS_OK;
}

kvs_status_t kvs_gguf_array(const kvs_gguf_t *g, const char *key, kvs_gguf_type_t *type_p,
                            uint64_t *count_p)
{
    const kv_t *kv = find_kv(g, key);
    if (kv == NULL) return KVS_ERR_NOT_FOUND;
    if (kv->type != KVS_GGUF_ARRAY) return wrong_type(key, kv, "array");
    *type_p = kv->elem_type;
    *count_p = kv->count;
    return KVS_OK;
}

/* The array entry for key with element i in range, or NOT_FOUND / INVALID. */
static kvs_status_t array_elem(const kvs_gguf_t *g, const char *key, uint64_t i, const kv_t **kv_p)
{
    const kv_t *kv = find_kv(g, key);
    if (kv == NULL) return KVS_ERR_NOT_FOUND;
    if (kv->type != KVS_GGUF_ARRAY) return wrong_type(key, kv, "array");
    if (i >= kv->count) {
        kvs_error("gguf: key '%s': index %llu out of %llu elements", key, (unsigned long long) i,
                  (unsigned long long) kv->count);
        return KVS_ERR_INVALID;
    }
    *kv_p = kv;
    return KVS_OK;
}

kvs_status_t kvs_gguf_array_str(const kvs_gguf_t *g, const char *key, uint64_t i,
                                kvs_gguf_str_t *value_p)
{
    const kv_t *kv;
    kvs_status_t st = array_elem(g, key, i, &kv);
    if (st != KVS_OK) return st;
    if (kv->elem_type != KVS_GGUF_STRING) return wrong_type(key, kv, "strings");
    str_at(g, kv->elem_pos[i], value_p);
    return KVS_OK;
}

kvs_status_t kvs_gguf_array_i64(const kvs_gguf_t *g, const char *key, uint64_t i, int64_t *value_p)
{
    const kv_t *kv;
    kvs_status_t st = array_elem(g, key, i, &kv);
    if (st != KVS_OK) return st;
    int neg;
    int64_t s;
    uint64_t u;
    uint32_t size = scalar_size(kv->elem_type);
    if (kv->elem_type == KVS_GGUF_BOOL || size == 0 ||
        read_int(g->base + kv->pos + i * size, kv->elem_type, &neg, &s, &u) != 0)
        return wrong_type(key, kv, "integers");
    if (!neg && u > (uint64_t) INT64_MAX) {
        kvs_error("gguf: key '%s' element %llu value %llu out of i64 range", key,
                  (unsigned long long) i, (unsigned long long) u);
        return KVS_ERR_INVALID;
    }
    *value_p = neg ? s : (int64_t) u;
    return KVS_OK;
}

kvs_status_t kvs_gguf_array_f32(const kvs_gguf_t *g, const char *key, uint64_t i, float *value_p)
{
    const kv_t *kv;
    kvs_status_t st = array_elem(g, key, i, &kv);
    if (st != KVS_OK) return st;
    uint32_t size = scalar_size(kv->elem_type);
    if (size == 0 || read_float(g->base + kv->pos + i * size, kv->elem_type, value_p) != 0)
        return wrong_type(key, kv, "floats in f32 range");
    return KVS_OK;
}

uint64_t kvs_gguf_kv_count(const kvs_gguf_t *g)
{
    return g->n_kv;
}

kvs_status_t kvs_gguf_kv_at(const kvs_gguf_t *g, uint64_t i, kvs_gguf_str_t *key_p,
                            kvs_gguf_type_t *type_p)
{
    if (i >= g->n_kv) {
        kvs_error("gguf: kv index %llu out of %llu", (unsigned long long) i,
                  (unsigned long long) g->n_kv);
        return KVS_ERR_INVALID;
    }
    *key_p = g->kv[i].key;
    *type_p = g->kv[i].type;
    return KVS_OK;
}

uint64_t kvs_gguf_tensor_count(const kvs_gguf_t *g)
{
    return g->n_tensors;
}

kvs_status_t kvs_gguf_tensor_at(const kvs_gguf_t *g, uint64_t i, kvs_gguf_tensor_t *tensor_p)
{
    if (i >= g->n_tensors) {
        kvs_error("gguf: tensor index %llu out of %llu", (unsigned long long) i,
                  (unsigned long long) g->n_tensors);
        return KVS_ERR_INVALID;
    }
    *tensor_p = g->tensors[i];
    return KVS_OK;
}

kvs_status_t kvs_gguf_tensor(const kvs_gguf_t *g, const char *name, kvs_gguf_tensor_t *tensor_p)
{
    kvs_gguf_str_t k = {name, strlen(name)};
    uint64_t lo = 0, hi = g->n_tensors;
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        int c = str_cmp(g->tensors_sorted[mid]->name, k);
        if (c == 0) {
            *tensor_p = *g->tensors_sorted[mid];
            return KVS_OK;
        }
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return KVS_ERR_NOT_FOUND;
}
