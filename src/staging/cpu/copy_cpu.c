/* The CPU reference copy backend: gather and scatter on the calling thread. Every copy
 * completes inside submit, so poll only checks that the ticket was issued.
 *
 * Destinations are written with non-temporal (streaming) stores where alignment allows: a
 * chunk is megabytes, far larger than the caches, and is read next by another process or the
 * transport, so ordinary stores would only add a read of every destination line (about half
 * the memory traffic of a copy) and evict the pool. */
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "kvstage/alloc.h"
#include "kvstage/log.h"
#include "staging/checksum.h"
#include "staging/copy.h"

typedef struct {
    uint64_t issued; /* last ticket handed out; tickets start at 1 */
} cpu_ctx_t;

/* Copies n bytes; streaming stores when dst and n are multiples of 16 bytes. */
static inline void copy_bytes(uint8_t *dst, const uint8_t *src, uint64_t n)
{
#if defined(__x86_64__)
    if ((((uintptr_t) dst | n) & 15) == 0) {
        for (uint64_t i = 0; i < n; i += 16)
            _mm_stream_si128((__m128i *) (dst + i), _mm_loadu_si128((const __m128i *) (src + i)));
        return;
    }
#endif
    memcpy(dst, src, n);
}

/* The checksum while one copy runs: the scalar sums, plus the AVX2 loop's four 64-bit lanes,
 * which stay apart (in memory, between the loop's calls) until the copy ends, so a call does
 * no horizontal reduction; kvs_csum_t is linear, so the lanes just add in at the end. */
typedef struct {
    kvs_csum_t c;
    uint64_t lanes[4];
    int avx2; /* the CPU has AVX2: asked once per copy, not per call */
} sum_t;

#if defined(__x86_64__)
#define KVS_AVX2 __attribute__((target("avx2")))

/* Adds the eight words of v with keys k (one key per 32-bit lane) to acc: two widening
 * multiplies, the even words and then the odd ones. */
KVS_AVX2 static inline __m256i sum_step_avx2(__m256i acc, __m256i v, __m256i k)
{
    acc = _mm256_add_epi64(acc, _mm256_mul_epu32(v, k));
    return _mm256_add_epi64(acc,
                            _mm256_mul_epu32(_mm256_srli_epi64(v, 32), _mm256_srli_epi64(k, 32)));
}

/* The keys of the eight words from word j on: one broadcast and one add. */
KVS_AVX2 static inline __m256i keys_avx2(uint64_t j)
{
    const __m256i steps = _mm256_setr_epi32(
        0, (int) KVS_CSUM_D, (int) (2 * KVS_CSUM_D), (int) (3 * KVS_CSUM_D), (int) (4 * KVS_CSUM_D),
        (int) (5 * KVS_CSUM_D), (int) (6 * KVS_CSUM_D), (int) (7 * KVS_CSUM_D));
    return _mm256_add_epi32(_mm256_set1_epi32((int) kvs_csum_key(j)), steps);
}

/* Copies n bytes (a multiple of 32) from src to dst, adding them to acc with keys k (advanced
 * past them): 32 bytes, eight words and two multiplies a step, each load feeding the
 * streaming stores (one of 32 bytes where dst allows, else two of 16) and the sum. */
KVS_AVX2 static inline void copy_run_avx2(uint8_t *dst, const uint8_t *src, uint64_t n,
                                          __m256i *acc, __m256i *k)
{
    const __m256i step = _mm256_set1_epi32((int) (8 * KVS_CSUM_D));
    __m256i a = *acc, keys = *k;
    if (((uintptr_t) dst & 31) == 0) {
        for (uint64_t i = 0; i < n; i += 32) {
            const __m256i v = _mm256_loadu_si256((const __m256i *) (src + i));
            _mm256_stream_si256((__m256i *) (dst + i), v);
            a = sum_step_avx2(a, v, keys);
            keys = _mm256_add_epi32(keys, step);
        }
    } else {
        for (uint64_t i = 0; i < n; i += 32) {
            const __m256i v = _mm256_loadu_si256((const __m256i *) (src + i));
            _mm_stream_si128((__m128i *) (dst + i), _mm256_castsi256_si128(v));
            _mm_stream_si128((__m128i *) (dst + i + 16), _mm256_extracti128_si256(v, 1));
            a = sum_step_avx2(a, v, keys);
            keys = _mm256_add_epi32(keys, step);
        }
    }
    *acc = a;
    *k = keys;
}

/* copy_bytes_sum's AVX2 part: the bytes up to the last multiple of 32, which it returns. */
KVS_AVX2 static uint64_t copy_sum_avx2(uint8_t *dst, const uint8_t *src, uint64_t n, sum_t *s,
                                       uint64_t off)
{
    const uint64_t done = n & ~(uint64_t) 31;
    __m256i acc = _mm256_loadu_si256((const __m256i *) s->lanes);
    __m256i keys = keys_avx2(off >> 2);
    copy_run_avx2(dst, src, done, &acc, &keys);
    _mm256_storeu_si256((__m256i *) s->lanes, acc);
    return done;
}

/* One token's heads between the pool, where head h sits at pool + h * head_stride, and the
 * region, where they are one run of heads * head_bytes bytes from region offset `off`
 * (head_bytes a multiple of 32): the keys run on from head to head, so they are set up, and
 * the lanes loaded and stored, once per token rather than once per head. */
KVS_AVX2 static void copy_heads_sum_avx2(int gather, uint8_t *pool, uint64_t head_stride,
                                         uint8_t *region, uint32_t heads, uint64_t head_bytes,
                                         sum_t *s, uint64_t off)
{
    __m256i acc = _mm256_loadu_si256((const __m256i *) s->lanes);
    __m256i keys = keys_avx2(off >> 2);
    for (uint32_t h = 0; h < heads; h++) {
        uint8_t *p = pool + h * head_stride, *r = region + h * head_bytes;
        copy_run_avx2(gather ? r : p, gather ? p : r, head_bytes, &acc, &keys);
    }
    _mm256_storeu_si256((__m256i *) s->lanes, acc);
}
#endif

/* Copies n bytes and adds them, as they sit at region offset `off`, to the checksum, in one
 * pass: each load feeds the streaming store and the widening multiplies (AVX2 where the CPU
 * has it, then SSE2 for what is left: two words a multiply). Falls back to a copy and a sum
 * over the bytes just copied where dst, n or the offset are not aligned for that. */
static inline void copy_bytes_sum(uint8_t *dst, const uint8_t *src, uint64_t n, sum_t *s,
                                  uint64_t off)
{
#if defined(__x86_64__)
    if ((((uintptr_t) dst | n) & 15) == 0 && (off & 3) == 0) {
        if (s->avx2) {
            const uint64_t done = copy_sum_avx2(dst, src, n, s, off);
            if (done == n) return;
            dst += done;
            src += done;
            off += done;
            n -= done;
        }
        const uint32_t k0 = kvs_csum_key(off >> 2);
        __m128i keys = _mm_setr_epi32((int) k0, (int) (k0 + KVS_CSUM_D),
                                      (int) (k0 + 2 * KVS_CSUM_D), (int) (k0 + 3 * KVS_CSUM_D));
        const __m128i step = _mm_set1_epi32((int) (4 * KVS_CSUM_D));
        __m128i acc = _mm_setzero_si128();
        for (uint64_t i = 0; i < n; i += 16) {
            const __m128i v = _mm_loadu_si128((const __m128i *) (src + i));
            _mm_stream_si128((__m128i *) (dst + i), v);
            acc = _mm_add_epi64(acc, _mm_mul_epu32(v, keys)); /* words 0 and 2 */
            acc = _mm_add_epi64(
                acc, _mm_mul_epu32(_mm_srli_epi64(v, 32), _mm_srli_epi64(keys, 32))); /* 1 and 3 */
            keys = _mm_add_epi32(keys, step);
        }
        uint64_t lanes[2];
        _mm_storeu_si128((__m128i *) lanes, acc);
        s->c.a += lanes[0] + lanes[1];
        return;
    }
#endif
    copy_bytes(dst, src, n);
    kvs_csum_add(&s->c, off, src, n);
}

/* Orders the streaming stores before whatever announces the copy (CHUNK_READY, a free). */
static inline void copy_fence(void)
{
#if defined(__x86_64__)
    _mm_sfence();
#endif
}

/* Moves n bytes between a pool address and a region address in the direction asked, adding
 * them to the region's checksum when one is wanted, in the same pass. */
static inline void move(kvs_copy_dir_t dir, const kvs_copy_desc_t *d, sum_t *cs, uint8_t *pool,
                        uint8_t *region, uint64_t n)
{
    const uint64_t off = (uint64_t) (region - d->region);
    if (cs == NULL)
        copy_bytes(dir == KVS_COPY_GATHER ? region : pool, dir == KVS_COPY_GATHER ? pool : region,
                   n);
    else if (dir == KVS_COPY_GATHER)
        copy_bytes_sum(region, pool, n, cs, off);
    else
        copy_bytes_sum(pool, region, n, cs, off);
}

/* One token's heads: head h at pool + h * head_stride, the region's run of them at region.
 * With a checksum and AVX2, one call over the whole run when every head is whole vectors. */
static inline void move_heads(kvs_copy_dir_t dir, const kvs_copy_desc_t *d, sum_t *cs,
                              uint8_t *pool, uint64_t head_stride, uint8_t *region,
                              uint64_t head_bytes)
{
#if defined(__x86_64__)
    const uint64_t off = (uint64_t) (region - d->region);
    if (cs != NULL && cs->avx2 &&
        (((uintptr_t) pool | (uintptr_t) region | head_stride | head_bytes) & 15) == 0 &&
        (head_bytes & 31) == 0 && (off & 3) == 0) {
        copy_heads_sum_avx2(dir == KVS_COPY_GATHER, pool, head_stride, region, d->heads, head_bytes,
                            cs, off);
        return;
    }
#endif
    for (uint32_t j = 0; j < d->heads; j++)
        move(dir, d, cs, pool + j * head_stride, region + j * head_bytes, head_bytes);
}

/* Pool tokens [pos, pos + n) (counted from the first page's start) to or from region tokens
 * [t, t + n) of one (layer, component) block, [tokens][heads][D]; pool pages are strided. */
static void copy_span(kvs_copy_dir_t dir, const kvs_copy_desc_t *d, sum_t *cs,
                      const kvs_region_t *r, uint8_t *block, uint64_t pos, uint64_t t, uint64_t n)
{
    const uint64_t head_bytes = (uint64_t) r->dim * r->elem_bytes;
    const uint64_t row = d->heads * head_bytes; /* one token of the block */
    const uint64_t P = d->page_size;
    /* NHD with every head selected: a page's run of tokens is one run of bytes */
    const int page_contig = r->head_stride == head_bytes && r->token_stride == row;
    const int heads_contig = r->head_stride == head_bytes;
    const uint64_t end = pos + n;
    for (uint64_t i = pos / P; i * P < end; i++) {
        const uint64_t lo = i * P > pos ? 0 : pos - i * P;
        const uint64_t hi = end - i * P < P ? end - i * P : P;
        uint8_t *pool_page = kvs_region_addr(r, d->pages[i], 0, d->pool_head);
        uint8_t *reg_page = block + (t + i * P + lo - pos) * row;
        if (page_contig) {
            move(dir, d, cs, pool_page + lo * r->token_stride, reg_page, (hi - lo) * row);
            continue;
        }
        for (uint64_t x = lo; x < hi; x++) {
            uint8_t *src = pool_page + x * r->token_stride;
            uint8_t *dst = reg_page + (x - lo) * row;
            if (heads_contig) {
                move(dir, d, cs, src, dst, row);
                continue;
            }
            move_heads(dir, d, cs, src, r->head_stride, dst, head_bytes);
        }
    }
}

/* One (layer, component): its region block's tokens, one span, or one per run. */
static void copy_block(kvs_copy_dir_t dir, const kvs_copy_desc_t *d, sum_t *cs,
                       const kvs_region_t *r, uint8_t *block)
{
    const uint64_t tokens = kvs_copy_desc_tokens(d);
    if (d->run == 0) {
        copy_span(dir, d, cs, r, block, d->first_token, 0, tokens);
        return;
    }
    for (uint64_t t = 0; t < tokens; t += d->run) {
        const uint64_t n = tokens - t < d->run ? tokens - t : d->run;
        copy_span(dir, d, cs, r, block, kvs_copy_desc_pos(d, t), t, n);
    }
}

static kvs_status_t cpu_submit(void *ctx, kvs_copy_dir_t dir, const kvs_copy_desc_t *d,
                               uint64_t *ticket_p)
{
    cpu_ctx_t *c = ctx;
    kvs_status_t st = kvs_copy_desc_validate(dir, d);
    if (st != KVS_OK) return st;
    const uint64_t tokens = kvs_copy_desc_tokens(d);
    sum_t cs;
    memset(&cs, 0, sizeof(cs));
#if defined(__x86_64__)
    cs.avx2 = d->checksum != NULL && __builtin_cpu_supports("avx2");
#endif
    for (uint32_t l = 0; l < d->layers && d->npages > 0; l++) {
        for (uint32_t comp = 0; comp < d->components; comp++) {
            uint8_t *block =
                d->region + kvs_region_block_offset(d->shape, d->heads, tokens, l, comp);
            copy_block(dir, d, d->checksum ? &cs : NULL, &d->regions[l * d->components + comp],
                       block);
        }
    }
    copy_fence();
    if (d->checksum != NULL) {
        cs.c.a += cs.lanes[0] + cs.lanes[1] + cs.lanes[2] + cs.lanes[3];
        *d->checksum = kvs_csum_final(&cs.c, kvs_copy_region_bytes(d->shape, d->heads, tokens));
    }
    *ticket_p = ++c->issued;
    return KVS_OK;
}

static kvs_status_t cpu_poll(void *ctx, uint64_t ticket)
{
    cpu_ctx_t *c = ctx;
    if (ticket == 0 || ticket > c->issued) {
        kvs_error("copy(cpu): poll of ticket %llu, never issued (last %llu)",
                  (unsigned long long) ticket, (unsigned long long) c->issued);
        return KVS_ERR_INVALID;
    }
    return KVS_OK;
}

static void cpu_destroy(void *ctx)
{
    kvs_free(ctx);
}

static const kvs_copy_ops_t cpu_ops = {
    .name = "cpu",
    .submit = cpu_submit,
    .poll = cpu_poll,
    .destroy = cpu_destroy,
};

kvs_status_t kvs_copy_cpu_create(kvs_copy_backend_t *backend_p)
{
    cpu_ctx_t *c = kvs_calloc(1, sizeof(*c));
    if (c == NULL) {
        kvs_error("copy(cpu): out of memory creating the backend");
        return KVS_ERR_NOMEM;
    }
    backend_p->ops = &cpu_ops;
    backend_p->ctx = c;
    return KVS_OK;
}
