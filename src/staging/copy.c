/* Backend-independent parts of gather/scatter: region sizing and descriptor validation, so
 * every backend refuses the same descriptors with the same messages. */
#include "staging/copy.h"

#include "kvstage/alloc.h"
#include "kvstage/log.h"

uint64_t kvs_copy_region_bytes(const kvs_kv_shape_t *shape, uint32_t heads, uint64_t tokens)
{
    uint64_t dims = 0;
    for (uint32_t c = 0; c < kvs_kv_shape_components(shape); c++)
        dims += kvs_kv_shape_dim(shape, c);
    return tokens * heads * shape->elem_bytes * shape->layers * dims;
}

/* a*b into *out; 0 on overflow. */
static int mul_u64(uint64_t a, uint64_t b, uint64_t *out)
{
    if (a != 0 && b > UINT64_MAX / a) return 0;
    *out = a * b;
    return 1;
}

static const char *dir_name(kvs_copy_dir_t dir)
{
    return dir == KVS_COPY_GATHER ? "gather" : "scatter";
}

kvs_status_t kvs_copy_desc_validate(kvs_copy_dir_t dir, const kvs_copy_desc_t *d)
{
    if (dir != KVS_COPY_GATHER && dir != KVS_COPY_SCATTER) {
        kvs_error("copy: unknown direction %d", (int) dir);
        return KVS_ERR_INVALID;
    }
    const char *what = dir_name(dir);
    if (d == NULL || d->shape == NULL || d->regions == NULL) {
        kvs_error("copy: %s descriptor, shape or regions is NULL", what);
        return KVS_ERR_INVALID;
    }
    if (kvs_kv_shape_validate(d->shape) != KVS_OK) return KVS_ERR_INVALID;
    if (d->layers != d->shape->layers || d->components != kvs_kv_shape_components(d->shape)) {
        kvs_error("copy: %s has %u layers x %u components, the shape %u x %u", what, d->layers,
                  d->components, d->shape->layers, kvs_kv_shape_components(d->shape));
        return KVS_ERR_INVALID;
    }
    if (d->page_size == 0 || d->heads == 0) {
        kvs_error("copy: %s needs page_size (%u) and heads (%u) > 0", what, d->page_size, d->heads);
        return KVS_ERR_INVALID;
    }
    for (uint32_t i = 0; i < d->layers * d->components; i++) {
        const kvs_region_t *r = &d->regions[i];
        uint32_t c = i % d->components;
        if (r->base == NULL || r->dim != kvs_kv_shape_dim(d->shape, c) ||
            r->elem_bytes != d->shape->elem_bytes) {
            kvs_error("copy: %s region (layer %u, component %u) has base %p, dim %u, E %u; the "
                      "shape wants dim %u, E %u",
                      what, i / d->components, c, (void *) r->base, r->dim, r->elem_bytes,
                      kvs_kv_shape_dim(d->shape, c), d->shape->elem_bytes);
            return KVS_ERR_INVALID;
        }
        if (d->pool_head > r->heads || d->heads > r->heads - d->pool_head) {
            kvs_error("copy: %s of heads [%u, %u) but the pool rank holds %u heads", what,
                      d->pool_head, d->pool_head + d->heads, r->heads);
            return KVS_ERR_INVALID;
        }
    }
    if (d->npages == 0) return KVS_OK;
    if (d->pages == NULL || d->region == NULL) {
        kvs_error("copy: %s of %u pages with a NULL page list or region", what, d->npages);
        return KVS_ERR_INVALID;
    }
    for (uint32_t i = 0; i < d->npages; i++) {
        if (d->pages[i] >= d->pool_pages) {
            kvs_error("copy: %s page %u (index %u) is outside the pool of %u pages", what,
                      d->pages[i], i, d->pool_pages);
            return KVS_ERR_INVALID;
        }
    }
    if (d->run > d->stride || (d->run == 0) != (d->stride == 0)) {
        kvs_error("copy: %s in runs of %u tokens every %u: need 1 <= run <= stride (or both 0)",
                  what, d->run, d->stride);
        return KVS_ERR_INVALID;
    }
    const uint64_t tokens = kvs_copy_desc_tokens(d);
    const uint64_t span = (uint64_t) d->npages * d->page_size;
    /* the pool tokens the copy reaches: from first_token to one past its last token (runs
     * that would pass 2^64 reach past any pool) */
    const int huge = d->run != 0 && tokens > 0 &&
                     (tokens - 1) / d->run > (UINT64_MAX - (uint64_t) d->page_size) / d->stride;
    const uint64_t reach = tokens == 0 || huge ? UINT64_MAX : kvs_copy_desc_pos(d, tokens - 1) + 1;
    if (d->first_token >= d->page_size || tokens == 0 || reach > span ||
        reach <= span - d->page_size) {
        kvs_error("copy: %s of %llu tokens from token %u of %u pages of %u tokens: the tokens "
                  "must start in the first page and end in the last",
                  what, (unsigned long long) tokens, d->first_token, d->npages, d->page_size);
        return KVS_ERR_INVALID;
    }
    uint64_t row = 0, need = 0;
    uint64_t dims = (uint64_t) kvs_kv_shape_dim(d->shape, 0) +
                    (d->components > 1 ? kvs_kv_shape_dim(d->shape, 1) : 0);
    int fits = mul_u64(tokens, (uint64_t) d->heads * d->shape->elem_bytes, &row) &&
               mul_u64(row, (uint64_t) d->shape->layers * dims, &need);
    if (!fits || d->region_bytes < need) {
        kvs_error("copy: %s of %llu tokens x %u heads needs a %llu-byte region, got %llu", what,
                  (unsigned long long) tokens, d->heads,
                  fits ? (unsigned long long) need : (unsigned long long) UINT64_MAX,
                  (unsigned long long) d->region_bytes);
        return KVS_ERR_INVALID;
    }
    return KVS_OK;
}

kvs_status_t kvs_copy_submit_batch(const kvs_copy_backend_t *b, kvs_copy_dir_t dir,
                                   const kvs_copy_desc_t *descs, uint32_t n, uint64_t *ticket_p)
{
    if (n == 0) {
        kvs_error("copy: a batch of no copies");
        return KVS_ERR_INVALID;
    }
    if (b->ops->submit_batch != NULL) return b->ops->submit_batch(b->ctx, dir, descs, n, ticket_p);
    uint64_t last = 0;
    for (uint32_t i = 0; i < n; i++) {
        kvs_status_t st = b->ops->submit(b->ctx, dir, &descs[i], ticket_p);
        if (st != KVS_OK) {
            /* the copies already started must not outlive the failed batch */
            if (last != 0)
                while (b->ops->poll(b->ctx, last) == KVS_INPROGRESS) {
                }
            return st;
        }
        last = *ticket_p;
    }
    return KVS_OK;
}

void kvs_copy_backend_destroy(kvs_copy_backend_t *b)
{
    if (b == NULL || b->ops == NULL) return;
    b->ops->destroy(b->ctx);
    b->ops = NULL;
    b->ctx = NULL;
}

/* ---- the failing-copy test hook ---- */

typedef struct {
    kvs_copy_backend_t inner;
    uint64_t fail_nth;   /* 1-based, among the copies submitted since the wrap */
    uint64_t submitted;  /* copies submitted since the wrap */
    uint64_t last;       /* the newest ticket */
    uint64_t fail_first; /* the failing copy's ticket; 0 until it is submitted */
    uint64_t fail_last;  /* the last ticket that fails with it; 0 until a poll reported it */
} fault_ctx_t;

static kvs_status_t fault_submit(void *ctx, kvs_copy_dir_t dir, const kvs_copy_desc_t *desc,
                                 uint64_t *ticket_p)
{
    fault_ctx_t *f = ctx;
    kvs_status_t st = kvs_copy_submit(&f->inner, dir, desc, ticket_p);
    if (st != KVS_OK) return st;
    f->last = *ticket_p;
    if (++f->submitted == f->fail_nth) f->fail_first = *ticket_p;
    return KVS_OK;
}

static kvs_status_t fault_poll(void *ctx, uint64_t ticket)
{
    fault_ctx_t *f = ctx;
    kvs_status_t st = kvs_copy_poll(&f->inner, ticket);
    if (st != KVS_OK || f->fail_first == 0 || ticket < f->fail_first) return st;
    /* Like a device error, the failure takes the copies queued behind it with it: every copy
     * submitted before a poll first reported it. */
    if (f->fail_last == 0) f->fail_last = f->last;
    if (ticket > f->fail_last) return st;
    kvs_error("copy(%s): copy %llu failed (injected by a test)", f->inner.ops->name,
              (unsigned long long) ticket);
    return KVS_ERR_IO;
}

static void fault_destroy(void *ctx)
{
    fault_ctx_t *f = ctx;
    kvs_copy_backend_destroy(&f->inner);
    kvs_free(f);
}

static const kvs_copy_ops_t fault_ops = {
    .name = "failing",
    .submit = fault_submit,
    .poll = fault_poll,
    .destroy = fault_destroy,
};

kvs_status_t kvs__copy_fail_nth(kvs_copy_backend_t *b, uint64_t fail_nth)
{
    fault_ctx_t *f = kvs_calloc(1, sizeof(*f));
    if (f == NULL) return KVS_ERR_NOMEM;
    f->inner = *b;
    f->fail_nth = fail_nth;
    b->ops = &fault_ops;
    b->ctx = f;
    return KVS_OK;
}
