/* Synthetic but exact KV: every byte is a hash of its prompt prefix and coordinates, so the
 * simulation can stand in for a model and still catch any misplaced, stale or missing byte. */
#include <string.h>

#include "base/mem.h"
#include "kvstage/alloc.h"
#include "kvstage/log.h"
#include "kvstage/rng.h"
#include "sim/sim.h"

#define SYNTH_SEED 0x6b7673796e746821ull /* the hash of the empty prefix */

void kvs_synth_hashes(const int32_t *tokens, uint64_t len, uint64_t *hashes_p)
{
    uint64_t h = SYNTH_SEED;
    for (uint64_t i = 0; i < len; i++) {
        h = kvs_mix64(h ^ (uint64_t) (uint32_t) tokens[i]);
        hashes_p[i] = h;
    }
}

/* The splitmix64 finaliser (as kvs_mix64), inlined: the simulation spends most of its time
 * making and checking synthetic bytes. */
static inline uint64_t synth_mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* One key per (layer, component, global head); distinct coordinates give unrelated keys. */
static inline uint64_t coord_key(uint32_t layer, uint32_t component, uint32_t head)
{
    uint64_t coord = ((uint64_t) layer << 40) | ((uint64_t) component << 32) | head;
    return synth_mix(coord + 0x2545f4914f6cdd1dull);
}

/* Word w (bytes [8w, 8w+8), little-endian) of a head whose key is synth_mix(hash ^ coord). */
static inline uint64_t head_word(uint64_t key, uint32_t w)
{
    return synth_mix(key + w);
}

uint8_t kvs_synth_byte(uint64_t hash, uint32_t layer, uint32_t component, uint32_t head,
                       uint32_t byte)
{
    uint64_t key = synth_mix(hash ^ coord_key(layer, component, head));
    return (uint8_t) (head_word(key, byte / 8) >> (8 * (byte % 8)));
}

/* A head word as it lies in memory: byte b of the word is bits [8b, 8b+8). */
static inline uint64_t to_le(uint64_t v)
{
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    return __builtin_bswap64(v);
#else
    return v;
#endif
}

static inline uint64_t diff_bytes(uint64_t x)
{
    uint64_t n = 0;
    for (; x != 0; x >>= 8) n += (x & 0xff) != 0;
    return n;
}

/* Writes or checks the n bytes of one head; returns the mismatched byte count. */
static inline uint64_t head_walk(uint8_t *dst, uint64_t key, uint32_t n, int write)
{
    uint64_t mismatched = 0;
    uint32_t w = 0;
    for (; (w + 1) * 8 <= n; w++) {
        uint64_t v = to_le(head_word(key, w)), got;
        if (write) {
            memcpy(dst + w * 8, &v, 8);
        } else {
            memcpy(&got, dst + w * 8, 8);
            if (got != v) mismatched += diff_bytes(got ^ v);
        }
    }
    if (w * 8 < n) { /* a head of D*E bytes that is not a multiple of 8 */
        uint64_t v = head_word(key, w);
        for (uint32_t b = 0; w * 8 + b < n; b++) {
            uint8_t x = (uint8_t) (v >> (8 * b));
            if (write)
                dst[w * 8 + b] = x;
            else
                mismatched += dst[w * 8 + b] != x;
        }
    }
    return mismatched;
}

/* Writes or checks positions [pos0, pos1) of every head of one region, where the pages
 * page_table[pos0 / P] onwards lie back to back from `pages` (a run of consecutive page ids:
 * the region's own memory, or a host copy of a device run). */
static uint64_t run_walk(const kvs_region_t *r, uint8_t *pages, uint64_t first_page,
                         const uint64_t *hashes, const kvs_dcp_t *dcp, uint32_t layer,
                         uint32_t comp, uint32_t first_head, uint32_t page_size, uint64_t pos0,
                         uint64_t pos1, int write)
{
    const uint32_t n = r->dim * r->elem_bytes;
    uint64_t mismatched = 0;
    for (uint32_t h = 0; h < r->heads; h++) {
        uint64_t ck = coord_key(layer, comp, first_head + h);
        for (uint64_t pos = pos0; pos < pos1; pos++) {
            uint8_t *dst = pages + (pos / page_size - first_page) * r->page_stride +
                           (pos % page_size) * r->token_stride + h * r->head_stride;
            const uint64_t hash = hashes[dcp->size > 1 ? kvs_dcp_global(dcp, pos) : pos];
            mismatched += head_walk(dst, synth_mix(hash ^ ck), n, write);
        }
    }
    return mismatched;
}

/* Visits every (position, layer, component, local head) of [start, end) for the pool's heads,
 * either writing the expected bytes or counting how many differ. Positions are taken in runs
 * of consecutive page ids; for a device pool each run is staged through a host buffer (read,
 * written or checked, written back), so a pool of either kind costs a few copies per run. A
 * DCP rank's pool holds only its positions of [start, end), at their local positions. */
static uint64_t synth_walk(const kvs_pool_t *pool, uint32_t first_layer, const uint64_t *hashes,
                           const uint32_t *page_table, const kvs_dcp_t *dcp, uint64_t start,
                           uint64_t end, int write)
{
    const kvs_pool_config_t *c = kvs_pool_config(pool);
    start = kvs_dcp_count(dcp, start);
    end = kvs_dcp_count(dcp, end);
    if (start >= end) return 0;
    uint32_t comps = kvs_kv_shape_components(&c->shape);
    uint32_t heads = kvs_pool_heads(pool);
    uint32_t first = kvs_tp_first_head(&c->shape, c->tp.tp_size, c->tp.tp_rank);
    const uint64_t P = c->page_size;
    const int device = c->mem == KVS_MEM_DEVICE;
    uint8_t *host = NULL; /* [pages of the range][page_stride] staging for device pools */
    if (device) {
        uint64_t most = 0;
        for (uint32_t comp = 0; comp < comps; comp++) {
            uint64_t stride = kvs_pool_region(pool, 0, comp)->page_stride;
            if (stride > most) most = stride;
        }
        host = kvs_malloc((size_t) ((end - 1) / P - start / P + 1) * most);
        if (host == NULL) {
            kvs_error("synth: out of memory staging %llu positions of a device pool",
                      (unsigned long long) (end - start));
            return (end - start) * heads; /* counted as wrong: nothing could be checked */
        }
    }
    uint64_t mismatched = 0;
    for (uint32_t l = 0; l < c->shape.layers; l++) {
        for (uint32_t comp = 0; comp < comps; comp++) {
            const kvs_region_t *r = kvs_pool_region(pool, l, comp);
            for (uint64_t pos = start; pos < end;) {
                /* the run: pages p0, p0+1, ... holding positions [pos, stop) */
                uint64_t idx = pos / P, p0 = page_table[idx], npages = 1;
                while ((idx + npages) * P < end && page_table[idx + npages] == p0 + npages)
                    npages++;
                uint64_t stop = (idx + npages) * P < end ? (idx + npages) * P : end;
                uint8_t *mem = r->base + p0 * r->page_stride;
                size_t bytes = (size_t) (npages * r->page_stride);
                if (device && kvs_mem_copy(host, mem, bytes) != KVS_OK) {
                    mismatched += (stop - pos) * heads; /* logged by the copy */
                    pos = stop;
                    continue;
                }
                mismatched += run_walk(r, device ? host : mem, idx, hashes, dcp, first_layer + l,
                                       comp, first, (uint32_t) P, pos, stop, write);
                if (device && write) (void) kvs_mem_copy(mem, host, bytes); /* logs failures */
                pos = stop;
            }
        }
    }
    kvs_free(host);
    return mismatched;
}

static const kvs_dcp_t no_dcp = {.size = 1, .interleave = 1, .rank = 0};

void kvs_synth_write(kvs_pool_t *pool, const uint64_t *hashes, const uint32_t *page_table,
                     uint64_t start, uint64_t end)
{
    synth_walk(pool, 0, hashes, page_table, &no_dcp, start, end, 1);
}

void kvs_synth_write_layers(kvs_pool_t *pool, uint32_t first_layer, const uint64_t *hashes,
                            const uint32_t *page_table, uint64_t start, uint64_t end)
{
    synth_walk(pool, first_layer, hashes, page_table, &no_dcp, start, end, 1);
}

uint64_t kvs_synth_verify(const kvs_pool_t *pool, const uint64_t *hashes,
                          const uint32_t *page_table, uint64_t start, uint64_t end)
{
    return synth_walk(pool, 0, hashes, page_table, &no_dcp, start, end, 0);
}

uint64_t kvs_synth_verify_dcp(const kvs_pool_t *pool, const kvs_dcp_t *dcp, const uint64_t *hashes,
                              const uint32_t *page_table, uint64_t start, uint64_t end)
{
    return synth_walk(pool, 0, hashes, page_table, dcp, start, end, 0);
}

int32_t kvs_synth_first_token(uint64_t last_hash)
{
    return (int32_t) (kvs_mix64(last_hash ^ 0x66697273745f746bull) % KVS_WORKLOAD_VOCAB);
}
