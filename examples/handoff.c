/* One request's KV handed over from prefill TP2 to decode TP1 in one process, using only the
 * installed libkvstage: the transfer plan, host pools, the in-process link, a sender per
 * prefill rank and a receiver, driven by hand until the room concludes; then every byte the
 * decode pool received is checked against what prefill held.
 *
 *   cc handoff.c $(pkg-config --cflags --libs kvstage) -o handoff && ./handoff
 *
 * Exit status 0 when the room succeeded and every byte matches. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kvstage/inproc.h>
#include <kvstage/layout.h>
#include <kvstage/pd.h>
#include <kvstage/pool.h>
#include <kvstage/status.h>

enum { PREFILL_TP = 2, DECODE_TP = 1, PROMPT = 100, POOL_PAGES = 64 };

static uint64_t g_now = 1; /* a virtual clock: the example decides when time passes */

static uint64_t now_ns(void *arg)
{
    (void) arg;
    return g_now;
}

/* The byte prefill computed for (position, layer, component, global head, byte). */
static uint8_t kv_byte(uint64_t pos, uint32_t layer, uint32_t comp, uint32_t head, uint32_t b)
{
    return (uint8_t) (pos * 131 + layer * 31 + comp * 17 + head * 7 + b);
}

/* Visits every byte of positions [0, n) held by one rank; fill writes them, check counts
 * differences. pages: the rank's page table for the room. */
static uint64_t visit(kvs_pool_t *pool, const kvs_pd_geometry_t *geo, uint32_t tp, uint32_t rank,
                      const uint32_t *pages, uint64_t n, int fill)
{
    uint32_t first = kvs_tp_first_head(&geo->shape, tp, rank), bad = 0;
    for (uint64_t pos = 0; pos < n; pos++)
        for (uint32_t l = 0; l < geo->shape.layers; l++)
            for (uint32_t c = 0; c < kvs_kv_shape_components(&geo->shape); c++) {
                const kvs_region_t *r = kvs_pool_region(pool, l, c);
                for (uint32_t h = 0; h < r->heads; h++) {
                    uint8_t *p =
                        kvs_region_addr(r, pages[pos / geo->page_size], pos % geo->page_size, h);
                    for (uint32_t b = 0; b < r->dim * r->elem_bytes; b++) {
                        uint8_t want = kv_byte(pos, l, c, first + h, b);
                        if (fill)
                            p[b] = want;
                        else
                            bad += p[b] != want;
                    }
                }
            }
    return bad;
}

static int check(kvs_status_t st, const char *what)
{
    if (st != KVS_OK) fprintf(stderr, "handoff: %s: %s\n", what, kvs_status_str(st));
    return st == KVS_OK;
}

int main(void)
{
    kvs_pd_geometry_t geo = {.shape = {.layers = 4,
                                       .kv_heads = 4,
                                       .head_dim_k = 16,
                                       .head_dim_v = 16,
                                       .elem_bytes = 2,
                                       .attn = KVS_ATTN_MHA},
                             .prefill_tp = PREFILL_TP,
                             .decode_tp = DECODE_TP,
                             .page_size = 8,
                             .chunk_tokens = 32};
    if (!check(kvs_pd_geometry_validate(&geo), "geometry")) return 1;

    /* The plan: who writes which heads of decode rank 0's slot. */
    kvs_writer_t writers[KVS_MAX_WRITERS];
    uint32_t nw = 0;
    if (!check(kvs_plan_writers(&geo.shape, PREFILL_TP, DECODE_TP, 0, 7, writers, &nw), "plan"))
        return 1;
    for (uint32_t i = 0; i < nw; i++)
        printf("plan: decode rank 0 heads %u..%u <- prefill rank %u\n", writers[i].dst_head,
               writers[i].dst_head + writers[i].heads - 1, writers[i].prefill_rank);

    kvs_clock_t clock = {now_ns, NULL};
    kvs_pd_timeouts_t timeouts;
    kvs_pd_timeouts_default(&timeouts);
    kvs_inproc_net_t *net = NULL;
    kvs_pool_t *ppool[PREFILL_TP] = {0}, *dpool = NULL;
    kvs_link_t *plink[PREFILL_TP] = {0}, *dlink = NULL;
    kvs_sender_t *tx[PREFILL_TP] = {0};
    kvs_receiver_t *rx = NULL;
    int ok = check(kvs_inproc_net_create(PREFILL_TP, DECODE_TP, NULL, &clock, &net), "net");
    for (uint32_t r = 0; ok && r < PREFILL_TP; r++) {
        kvs_pool_config_t pc = {.shape = geo.shape,
                                .tp = {PREFILL_TP, r},
                                .page_size = geo.page_size,
                                .num_pages = POOL_PAGES,
                                .layout = KVS_POOL_NHD,
                                .mem = KVS_MEM_HOST};
        kvs_sender_config_t sc = {
            .geo = geo, .rank = r, .timeouts = timeouts, .window_chunks = 2, .staging_buffers = 2};
        ok = check(kvs_pool_create(&pc, &ppool[r]), "prefill pool") &&
             check(kvs_inproc_link_create(net, KVS_SIDE_PREFILL, r, &plink[r]), "link") &&
             check(kvs_sender_create(&sc, ppool[r], plink[r], &clock, &tx[r]), "sender");
    }
    if (ok) {
        /* Decode's pool is head-major (HND) while prefill's is token-major: only strides. */
        kvs_pool_config_t pc = {.shape = geo.shape,
                                .tp = {DECODE_TP, 0},
                                .page_size = geo.page_size,
                                .num_pages = POOL_PAGES,
                                .layout = KVS_POOL_HND,
                                .mem = KVS_MEM_HOST};
        kvs_receiver_config_t rc = {
            .geo = geo, .rank = 0, .timeouts = timeouts, .ring_bytes = 1u << 20};
        ok = check(kvs_pool_create(&pc, &dpool), "decode pool") &&
             check(kvs_inproc_link_create(net, KVS_SIDE_DECODE, 0, &dlink), "link") &&
             check(kvs_receiver_create(&rc, dpool, dlink, &clock, &rx), "receiver");
    }

    /* One room: decode holds no prefix, so every page of the prompt moves. */
    const uint64_t room = 7, pages = (PROMPT + geo.page_size - 1) / geo.page_size;
    uint32_t ptable[PREFILL_TP][POOL_PAGES], dpages[POOL_PAGES];
    for (uint32_t r = 0; ok && r < PREFILL_TP; r++) {
        ok = check(kvs_pool_alloc(ppool[r], (uint32_t) pages, ptable[r]), "prefill pages");
        if (ok) visit(ppool[r], &geo, PREFILL_TP, r, ptable[r], PROMPT, 1);
    }
    ok = ok && check(kvs_pool_alloc(dpool, (uint32_t) pages, dpages), "decode pages") &&
         check(kvs_receiver_add_room(rx, room, 0, PROMPT, dpages), "receiver room");
    for (uint32_t r = 0; ok && r < PREFILL_TP; r++) {
        const uint8_t first_token[4] = {42, 0, 0, 0};
        ok = check(kvs_sender_add_room(tx[r], room, PROMPT, ptable[r]), "sender room") &&
             check(kvs_sender_advance(tx[r], room, PROMPT, PROMPT), "advance") &&
             check(kvs_sender_finish(tx[r], room, first_token, sizeof(first_token)), "finish");
    }

    /* Progress every rank until the room has concluded, and gone quiet, on all of them. */
    kvs_room_info_t info = {.status = KVS_ROOM_BOOTSTRAPPING};
    for (int step = 0, done = 0; ok && !done && step < 100000; step++) {
        g_now += 1000;
        for (uint32_t r = 0; r < PREFILL_TP; r++) kvs_sender_progress(tx[r]);
        kvs_receiver_progress(rx);
        done = 1;
        for (uint32_t r = 0; ok && r <= PREFILL_TP; r++) {
            ok = check(r < PREFILL_TP ? kvs_sender_poll(tx[r], room, &info)
                                      : kvs_receiver_poll(rx, room, &info),
                       "poll");
            done &= info.quiescent &&
                    (info.status == KVS_ROOM_SUCCESS || info.status == KVS_ROOM_FAILED);
        }
    }
    uint64_t bad = ok ? visit(dpool, &geo, DECODE_TP, 0, dpages, PROMPT, 0) : 0;
    int success = ok && info.status == KVS_ROOM_SUCCESS && bad == 0 && info.final_len == 4 &&
                  info.final[0] == 42;
    kvs_pd_metrics_t m = {0};
    if (rx != NULL) kvs_receiver_metrics(rx, &m);
    printf("room %llu: %s, %llu bytes scattered in %llu chunks, %llu mismatching bytes\n",
           (unsigned long long) room, info.status == KVS_ROOM_SUCCESS ? "Success" : "not Success",
           (unsigned long long) m.bytes, (unsigned long long) m.chunks, (unsigned long long) bad);

    /* Both sides release the concluded room, then everything is torn down in reverse order. */
    for (uint32_t r = 0; r < PREFILL_TP; r++) {
        if (tx[r] != NULL) kvs_sender_release(tx[r], room);
        kvs_sender_destroy(tx[r]);
        kvs_link_destroy(plink[r]);
        kvs_pool_destroy(ppool[r]);
    }
    if (rx != NULL) kvs_receiver_release(rx, room);
    kvs_receiver_destroy(rx);
    kvs_link_destroy(dlink);
    kvs_pool_destroy(dpool);
    kvs_inproc_net_destroy(net);
    return success ? 0 : 1;
}
