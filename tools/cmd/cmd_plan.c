/* `kvstage plan`: prints the transfer plan between a prefill layout (PP x TP) and a decode TP
 * layout with its DCP groups (who writes which heads of which layers and which tokens where,
 * slot layout, status peers) and what staging saves over per-page writes. */
#include "cmd/commands.h"

#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "common/args.h"
#include "common/json.h"
#include "kvstage/grid.h"
#include "kvstage/layout.h"
#include "kvstage/log.h"

typedef struct {
    uint32_t prefill_tp, decode_tp;
    kvs_kv_shape_t shape;
    uint32_t page, prefill_page, chunk; /* page: decode's; prefill_page 0: the same */
    uint32_t pp;                        /* prefill pipeline stages */
    uint32_t dcp, interleave;           /* decode context parallelism (0: none) */
    uint64_t room;
    int json;
} plan_cfg_t;

/* The whole plan, computed once through the library and then printed either way. */
typedef struct {
    uint64_t grid_tokens, pages_per_slot;
    /* A page size per side: the most prefill pages one full slot's gather reads (slots start
     * on decode pages, so anywhere in a prefill page that is a multiple of gcd(Pd, Pp)), and
     * the pieces a per-page path would cut a slot into (at either side's page boundaries). */
    uint64_t prefill_pages_per_slot, pieces_per_slot;
    /* Decode context parallelism: each decode rank's tokens of a full slot (G / N), and the
     * per-page path's pieces of them per decode rank (a run of T tokens is contiguous on
     * decode but not next to the rank's previous run on prefill). */
    uint64_t rank_tokens, rank_pieces[KVS_MAX_TP];
    kvs_writer_t writers[KVS_MAX_TP][KVS_MAX_WRITERS];
    uint64_t offsets[KVS_MAX_TP][KVS_MAX_WRITERS];
    uint32_t writer_count[KVS_MAX_TP];
    uint64_t slot_bytes[KVS_MAX_TP];
    uint32_t peers[KVS_MAX_TP][KVS_MAX_TP], peer_count[KVS_MAX_TP];
    kvs_dest_t dests[KVS_MAX_TP][KVS_MAX_TP];
    uint32_t dest_count[KVS_MAX_TP];
    uint32_t decode_peers[KVS_MAX_TP][KVS_MAX_TP], decode_peer_count[KVS_MAX_TP];
    uint64_t bulk_writes, per_page_writes;
    uint64_t writer_layers; /* over every writer of every decode rank: the layers it writes */
} plan_t;

static kvs_pd_geometry_t plan_geo(const plan_cfg_t *cfg)
{
    return (kvs_pd_geometry_t){.shape = cfg->shape,
                               .prefill_tp = cfg->prefill_tp,
                               .decode_tp = cfg->decode_tp,
                               .page_size = cfg->page,
                               .prefill_page_size = cfg->prefill_page,
                               .chunk_tokens = cfg->chunk,
                               .prefill_pp = cfg->pp,
                               .decode_dcp = cfg->dcp,
                               .dcp_interleave = cfg->interleave};
}

static int mul_ok(uint64_t a, uint64_t b, uint64_t *out)
{
    if (a != 0 && b > UINT64_MAX / a) return 0;
    *out = a * b;
    return 1;
}

/* Validates the configuration through the library; on error prints the one error line (the
 * library's reason in it) and returns 0. Page and chunk ranges are the flag table's; stages and
 * the chunk are checked as every command checks them (kvs_args_check_layout). */
static int plan_validate(const plan_cfg_t *cfg, int mla)
{
    kvs_args_capture_t cap;
    kvs_args_capture_begin(&cap);
    const char *flag = mla ? "--mla" : "--head-dim-v"; /* the shape check names its fields */
    uint32_t tp = 0;
    kvs_status_t st = kvs_kv_shape_validate(&cfg->shape);
    if (st == KVS_OK) {
        flag = "--prefill-tp";
        tp = cfg->prefill_tp;
        st = kvs_tp_validate(&cfg->shape, &(kvs_tp_t){.tp_size = cfg->prefill_tp});
    }
    if (st == KVS_OK) {
        flag = "--decode-tp";
        tp = cfg->decode_tp;
        st = kvs_tp_validate(&cfg->shape, &(kvs_tp_t){.tp_size = cfg->decode_tp});
    }
    kvs_args_capture_end(&cap, st != KVS_OK);
    if (st == KVS_OK) {
        const kvs_pd_geometry_t geo = plan_geo(cfg);
        return kvs_args_check_layout(&geo) == 0;
    }
    const char *why = cap.msg[0] ? cap.msg : kvs_status_str(st);
    if (tp == 0) {
        kvs_args_error(flag, mla ? "--kv-heads 1 and --head-dim-v 0 (or neither)" : NULL, "%s",
                       why);
    } else {
        char sizes[512];
        kvs_args_error(flag, kvs_args_tp_sizes(&cfg->shape, sizes, sizeof(sizes)), "%u: %s", tp,
                       why);
    }
    return 0;
}

static uint64_t gcd_u64(uint64_t a, uint64_t b)
{
    while (b != 0) {
        uint64_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

static uint32_t prefill_page(const plan_cfg_t *cfg)
{
    return cfg->prefill_page ? cfg->prefill_page : cfg->page;
}

static int plan_compute(const plan_cfg_t *cfg, plan_t *plan)
{
    const kvs_kv_shape_t *s = &cfg->shape;
    const kvs_pd_geometry_t geo = plan_geo(cfg);
    plan->grid_tokens = kvs_grid_tokens(cfg->chunk, cfg->page);
    plan->pages_per_slot = plan->grid_tokens / cfg->page;
    const uint64_t G = plan->grid_tokens, pd = cfg->page, pp = prefill_page(cfg);
    const uint64_t g = gcd_u64(pd, pp), lcm = pd / g * pp;
    plan->prefill_pages_per_slot = (pp - g + G + pp - 1) / pp;
    plan->pieces_per_slot = (G - 1) / pd + (G - 1) / pp - (G - 1) / lcm + 1;
    plan->rank_tokens = G / kvs_pd_geometry_dcp(&geo);
    plan->bulk_writes = 0;
    for (uint32_t d = 0; d < cfg->decode_tp; d++) {
        const kvs_dcp_t dcp = kvs_pd_geometry_dcp_of(&geo, d);
        plan->rank_pieces[d] = dcp.size > 1 ? 0 : plan->pieces_per_slot;
        /* the slot from token 0: rank j's runs start at j*T + i*N*T; each is one piece per
         * prefill page it touches (T divides the decode page, so no decode page splits it) */
        for (uint64_t x = 0; dcp.size > 1 && x < plan->rank_tokens; x += dcp.interleave) {
            uint64_t a = kvs_dcp_global(&dcp, x);
            plan->rank_pieces[d] += (a + dcp.interleave - 1) / pp - a / pp + 1;
        }
        if (kvs_plan_geo_writers(&geo, d, cfg->room, plan->writers[d], &plan->writer_count[d]) !=
                KVS_OK ||
            kvs_plan_geo_peers(&geo, d, plan->peers[d], &plan->peer_count[d]) != KVS_OK)
            return 0;
        for (uint32_t i = 0; i < plan->writer_count[d]; i++)
            plan->writer_layers += plan->writers[d][i].layers;
        /* The slot layout is plain uint64 arithmetic: refuse sizes it cannot represent. */
        uint64_t per_token = 0, payload;
        for (uint32_t i = 0; i < plan->writer_count[d]; i++)
            per_token += plan->writers[d][i].bytes_per_token;
        if (!mul_ok(plan->rank_tokens, per_token, &payload) || payload > UINT64_MAX / 2) {
            kvs_args_error("--chunk", "a smaller chunk",
                           "a %" PRIu64 "-token slot of %" PRIu64 " bytes per token is too large",
                           plan->grid_tokens, per_token);
            return 0;
        }
        plan->slot_bytes[d] = kvs_slot_layout(plan->writers[d], plan->writer_count[d],
                                              plan->rank_tokens, plan->offsets[d]);
        plan->bulk_writes += plan->writer_count[d];
    }
    for (uint32_t p = 0; p < kvs_pd_geometry_prefill_ranks(&geo); p++) {
        if (kvs_plan_geo_destinations(&geo, p, cfg->room, plan->dests[p], &plan->dest_count[p]) !=
                KVS_OK ||
            kvs_plan_geo_decode_peers(&geo, p, plan->decode_peers[p],
                                      &plan->decode_peer_count[p]) != KVS_OK)
            return 0;
    }
    /* The per-page path posts one write per page piece x component x layer of every writer
     * (a piece: a run of tokens in one page on both sides). */
    plan->per_page_writes = 0;
    for (uint32_t d = 0; d < cfg->decode_tp; d++) {
        uint64_t layers = 0, per_piece, writes;
        for (uint32_t i = 0; i < plan->writer_count[d]; i++) layers += plan->writers[d][i].layers;
        if (!mul_ok(layers, kvs_kv_shape_components(s), &per_piece) ||
            !mul_ok(per_piece, plan->rank_pieces[d], &writes) ||
            writes > UINT64_MAX - plan->per_page_writes) {
            kvs_args_error("--layers", "fewer layers or a smaller --chunk",
                           "the per-page write count overflows");
            return 0;
        }
        plan->per_page_writes += writes;
    }
    return 1;
}

static uint64_t region_bytes(const plan_t *plan, const kvs_writer_t *w)
{
    return plan->rank_tokens * w->bytes_per_token;
}

static void format_heads(char *buf, size_t cap, const kvs_kv_shape_t *s, uint32_t first,
                         uint32_t count)
{
    if (s->attn == KVS_ATTN_MLA)
        snprintf(buf, cap, "latent");
    else if (count == 1)
        snprintf(buf, cap, "%u", first);
    else
        snprintf(buf, cap, "%u-%u", first, first + count - 1);
}

/* A rank's slice for headings: "heads 0-3", "head 2" or "latent". */
static void format_slice(char *buf, size_t cap, const kvs_kv_shape_t *s, uint32_t first,
                         uint32_t count)
{
    char heads[32];
    format_heads(heads, sizeof(heads), s, first, count);
    if (s->attn == KVS_ATTN_MLA)
        snprintf(buf, cap, "%s", heads);
    else
        snprintf(buf, cap, "head%s %s", count == 1 ? "" : "s", heads);
}

static void format_bytes(char *buf, size_t cap, uint64_t bytes)
{
    static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double v = (double) bytes;
    size_t u = 0;
    while (v >= 1024.0 && u + 1 < sizeof(units) / sizeof(units[0])) {
        v /= 1024.0;
        u++;
    }
    if (u == 0)
        snprintf(buf, cap, "%" PRIu64 " B", bytes);
    else
        snprintf(buf, cap, "%.1f %s", v, units[u]);
}

static void print_ranks(const char *label, const uint32_t *ranks, uint32_t n)
{
    printf("%s ", label);
    for (uint32_t i = 0; i < n; i++) printf("%s%u", i ? "," : "", ranks[i]);
}

static void print_table(const plan_cfg_t *cfg, const plan_t *plan)
{
    const kvs_kv_shape_t *s = &cfg->shape;
    char buf[64], buf2[64];
    const kvs_pd_geometry_t geo = plan_geo(cfg);
    const uint32_t pp = kvs_pd_geometry_pp(&geo);
    if (pp > 1)
        printf("kvstage plan: prefill PP%u x TP%u -> decode TP%u, room %" PRIu64 "\n", pp,
               cfg->prefill_tp, cfg->decode_tp, cfg->room);
    else
        printf("kvstage plan: prefill TP%u -> decode TP%u, room %" PRIu64 "\n", cfg->prefill_tp,
               cfg->decode_tp, cfg->room);
    if (s->attn == KVS_ATTN_MLA)
        printf("  model: MLA latent of %u elements, %u layers, %u-byte elements\n", s->head_dim_k,
               s->layers, s->elem_bytes);
    else
        printf("  model: MHA, %u KV heads, %u layers, head dim K %u / V %u, %u-byte elements\n",
               s->kv_heads, s->layers, s->head_dim_k, s->head_dim_v, s->elem_bytes);
    if (prefill_page(cfg) == cfg->page) {
        printf("  grid: page %u, chunk %u -> G = %" PRIu64 " tokens per slot (%" PRIu64
               " pages per slot)\n",
               cfg->page, cfg->chunk, plan->grid_tokens, plan->pages_per_slot);
    } else {
        printf("  grid: decode page %u, chunk %u -> G = %" PRIu64 " tokens per slot (%" PRIu64
               " decode pages per slot), anchored at the decode prefix\n",
               cfg->page, cfg->chunk, plan->grid_tokens, plan->pages_per_slot);
        printf("  prefill page %u: a slot starts at a multiple of %" PRIu64
               " tokens into a prefill page and its gather reads up to %" PRIu64
               " prefill pages;\n  the last slot ends where both sides' pages cover the prompt "
               "(the shorter of its two page roundings)\n",
               prefill_page(cfg), gcd_u64(cfg->page, prefill_page(cfg)),
               plan->prefill_pages_per_slot);
    }
    printf("  heads per rank: prefill %u (replication %u), decode %u (replication %u)\n",
           kvs_tp_heads_per_rank(s, cfg->prefill_tp), kvs_tp_replication(s, cfg->prefill_tp),
           kvs_tp_heads_per_rank(s, cfg->decode_tp), kvs_tp_replication(s, cfg->decode_tp));
    const uint32_t n_dcp = kvs_pd_geometry_dcp(&geo), t_dcp = kvs_pd_geometry_interleave(&geo);
    if (n_dcp > 1)
        printf("  decode DCP %u, interleave %u: groups of %u decode ranks hold the same heads; "
               "token t lives on\n  group rank (t / %u) mod %u at its local position "
               "(t / %u) * %u + t mod %u, so each rank\n  receives %" PRIu64
               " tokens of a full slot; decode prefix and chunk are multiples of %u x %u = %u\n",
               n_dcp, t_dcp, n_dcp, t_dcp, n_dcp, n_dcp * t_dcp, t_dcp, t_dcp, plan->rank_tokens,
               n_dcp, cfg->page, kvs_pd_geometry_unit(&geo));

    for (uint32_t d = 0; d < cfg->decode_tp; d++) {
        format_slice(buf, sizeof(buf), s, kvs_tp_first_head(s, cfg->decode_tp, d),
                     kvs_tp_heads_per_rank(s, cfg->decode_tp));
        format_bytes(buf2, sizeof(buf2), plan->slot_bytes[d]);
        char tokens[96] = "";
        if (n_dcp > 1)
            snprintf(tokens, sizeof(tokens),
                     ", DCP group %u rank %u: tokens (t / %u) mod %u = %u, %" PRIu64 " per slot",
                     d / n_dcp, d % n_dcp, t_dcp, n_dcp, d % n_dcp, plan->rank_tokens);
        printf("\ndecode rank %u (%s%s): %u writer%s, slot %" PRIu64 " bytes (%s); ", d, buf,
               tokens, plan->writer_count[d], plan->writer_count[d] == 1 ? "" : "s",
               plan->slot_bytes[d], buf2);
        print_ranks("status peers: prefill", plan->peers[d], plan->peer_count[d]);
        printf("\n  %6s %8s %5s %9s %13s %9s %9s %6s %14s %14s\n", "writer", "prefill", "stage",
               "layers", "global heads", "src head", "dst head", "heads", "region offset",
               "bytes/slot");
        for (uint32_t i = 0; i < plan->writer_count[d]; i++) {
            const kvs_writer_t *w = &plan->writers[d][i];
            format_heads(buf, sizeof(buf), s, kvs_tp_first_head(s, cfg->decode_tp, d) + w->dst_head,
                         w->heads);
            snprintf(buf2, sizeof(buf2), "%u-%u", w->first_layer, w->first_layer + w->layers - 1);
            printf("  %6u %8u %5u %9s %13s %9u %9u %6u %14" PRIu64 " %14" PRIu64 "\n", i,
                   w->prefill_rank, w->stage, buf2, buf, w->src_head, w->dst_head, w->heads,
                   plan->offsets[d][i], region_bytes(plan, w));
        }
    }
    printf("\n");
    for (uint32_t p = 0; p < kvs_pd_geometry_prefill_ranks(&geo); p++) {
        const uint32_t tp_rank = p % cfg->prefill_tp;
        format_slice(buf, sizeof(buf), s, kvs_tp_first_head(s, cfg->prefill_tp, tp_rank),
                     kvs_tp_heads_per_rank(s, cfg->prefill_tp));
        if (pp > 1) {
            uint32_t first, layers;
            kvs_pp_stage(s->layers, pp, p / cfg->prefill_tp, &first, &layers);
            printf("prefill rank %u (stage %u, TP rank %u: layers %u-%u, %s): ", p,
                   p / cfg->prefill_tp, tp_rank, first, first + layers - 1, buf);
        } else {
            printf("prefill rank %u (%s): ", p, buf);
        }
        print_ranks("status peers: decode", plan->decode_peers[p], plan->decode_peer_count[p]);
        printf("\n");
        if (plan->dest_count[p] == 0)
            printf("  -> none (replica not chosen; reports status only)\n");
        for (uint32_t i = 0; i < plan->dest_count[p]; i++) {
            const kvs_dest_t *x = &plan->dests[p][i];
            printf("  -> decode %u writer %u: src head %u, dst head %u, %u head%s, region "
                   "offset %" PRIu64 ", %" PRIu64 " bytes/slot\n",
                   x->decode_rank, x->writer, x->w.src_head, x->w.dst_head, x->w.heads,
                   x->w.heads == 1 ? "" : "s", plan->offsets[x->decode_rank][x->writer],
                   region_bytes(plan, &x->w));
        }
    }
    printf("\nwrites per chunk (one full slot of %" PRIu64 " tokens, all decode ranks):\n",
           plan->grid_tokens);
    char label[64];
    snprintf(label, sizeof(label),
             "per-page (page x layer x %s x writer):", s->attn == KVS_ATTN_MLA ? "latent" : "K/V");
    printf("  %-44s %12" PRIu64 "\n", "staged (one bulk write per writer):", plan->bulk_writes);
    if (n_dcp > 1)
        printf("  %-44s %12" PRIu64 "  = over decode ranks, their pieces (runs of %u tokens, "
               "split at prefill pages) x %u x their writers' layers\n",
               label, plan->per_page_writes, t_dcp, kvs_kv_shape_components(s));
    else
        printf("  %-44s %12" PRIu64 "  = %" PRIu64 " pages x %u x %" PRIu64
               " layers of the %" PRIu64 " writers\n",
               label, plan->per_page_writes, plan->pieces_per_slot, kvs_kv_shape_components(s),
               plan->writer_layers, plan->bulk_writes);
    printf("  %-44s %11" PRIu64 "x\n", "reduction:", plan->per_page_writes / plan->bulk_writes);
}

static void json_ranks(kvs_json_t *j, const char *key, const uint32_t *ranks, uint32_t n)
{
    kvs_json_array_begin(j, key);
    for (uint32_t i = 0; i < n; i++) kvs_json_u64(j, NULL, ranks[i]);
    kvs_json_array_end(j);
}

static void json_writer_fields(kvs_json_t *j, const kvs_writer_t *w, uint64_t tokens,
                               uint64_t offset, uint64_t bytes)
{
    kvs_json_u64(j, "stage", w->stage);
    kvs_json_u64(j, "first_layer", w->first_layer);
    kvs_json_u64(j, "layers", w->layers);
    kvs_json_u64(j, "src_head", w->src_head);
    kvs_json_u64(j, "dst_head", w->dst_head);
    kvs_json_u64(j, "heads", w->heads);
    kvs_json_u64(j, "bytes_per_token", w->bytes_per_token);
    kvs_json_u64(j, "tokens", tokens); /* of a full slot, the decode rank's own */
    kvs_json_u64(j, "region_offset", offset);
    kvs_json_u64(j, "region_bytes", bytes);
}

static void print_json(const plan_cfg_t *cfg, const plan_t *plan)
{
    const kvs_kv_shape_t *s = &cfg->shape;
    kvs_json_t j;
    kvs_json_begin(&j, stdout);
    kvs_json_object_begin(&j, "config");
    kvs_json_u64(&j, "prefill_tp", cfg->prefill_tp);
    kvs_json_u64(&j, "prefill_pp", cfg->pp ? cfg->pp : 1);
    kvs_json_u64(&j, "decode_tp", cfg->decode_tp);
    kvs_json_str(&j, "attn", s->attn == KVS_ATTN_MLA ? "mla" : "mha");
    kvs_json_u64(&j, "kv_heads", s->kv_heads);
    kvs_json_u64(&j, "layers", s->layers);
    kvs_json_u64(&j, "head_dim_k", s->head_dim_k);
    kvs_json_u64(&j, "head_dim_v", s->head_dim_v);
    kvs_json_u64(&j, "dtype_bytes", s->elem_bytes);
    kvs_json_u64(&j, "page_size", cfg->page);
    kvs_json_u64(&j, "prefill_page_size", prefill_page(cfg));
    kvs_json_u64(&j, "decode_page_size", cfg->page);
    const kvs_pd_geometry_t geo = plan_geo(cfg);
    const uint32_t n_dcp = kvs_pd_geometry_dcp(&geo);
    kvs_json_u64(&j, "decode_dcp", n_dcp);
    kvs_json_u64(&j, "dcp_interleave", kvs_pd_geometry_interleave(&geo));
    kvs_json_u64(&j, "chunk", cfg->chunk);
    kvs_json_u64(&j, "room", cfg->room);
    kvs_json_object_end(&j);
    kvs_json_u64(&j, "grid_tokens", plan->grid_tokens);
    kvs_json_u64(&j, "pages_per_slot", plan->pages_per_slot);
    kvs_json_u64(&j, "prefill_pages_per_slot", plan->prefill_pages_per_slot);
    kvs_json_u64(&j, "page_pieces_per_slot", plan->pieces_per_slot);

    uint64_t max_slot = 0;
    kvs_json_array_begin(&j, "decode");
    for (uint32_t d = 0; d < cfg->decode_tp; d++) {
        kvs_json_object_begin(&j, NULL);
        kvs_json_u64(&j, "rank", d);
        kvs_json_u64(&j, "first_head", kvs_tp_first_head(s, cfg->decode_tp, d));
        kvs_json_u64(&j, "heads", kvs_tp_heads_per_rank(s, cfg->decode_tp));
        kvs_json_u64(&j, "dcp_group", d / n_dcp);
        kvs_json_u64(&j, "dcp_rank", d % n_dcp);
        kvs_json_u64(&j, "tokens_per_slot", plan->rank_tokens);
        kvs_json_u64(&j, "slot_bytes", plan->slot_bytes[d]);
        json_ranks(&j, "peers", plan->peers[d], plan->peer_count[d]);
        kvs_json_array_begin(&j, "writers");
        for (uint32_t i = 0; i < plan->writer_count[d]; i++) {
            const kvs_writer_t *w = &plan->writers[d][i];
            kvs_json_object_begin(&j, NULL);
            kvs_json_u64(&j, "prefill_rank", w->prefill_rank);
            json_writer_fields(&j, w, plan->rank_tokens, plan->offsets[d][i],
                               region_bytes(plan, w));
            kvs_json_object_end(&j);
        }
        kvs_json_array_end(&j);
        kvs_json_object_end(&j);
        if (plan->slot_bytes[d] > max_slot) max_slot = plan->slot_bytes[d];
    }
    kvs_json_array_end(&j);

    kvs_json_array_begin(&j, "prefill");
    const uint32_t pp = kvs_pd_geometry_pp(&geo);
    for (uint32_t p = 0; p < kvs_pd_geometry_prefill_ranks(&geo); p++) {
        uint32_t first, layers;
        kvs_pp_stage(s->layers, pp, p / cfg->prefill_tp, &first, &layers);
        kvs_json_object_begin(&j, NULL);
        kvs_json_u64(&j, "rank", p);
        kvs_json_u64(&j, "stage", p / cfg->prefill_tp);
        kvs_json_u64(&j, "tp_rank", p % cfg->prefill_tp);
        kvs_json_u64(&j, "first_layer", first);
        kvs_json_u64(&j, "layers", layers);
        kvs_json_u64(&j, "first_head", kvs_tp_first_head(s, cfg->prefill_tp, p % cfg->prefill_tp));
        kvs_json_u64(&j, "heads", kvs_tp_heads_per_rank(s, cfg->prefill_tp));
        json_ranks(&j, "decode_peers", plan->decode_peers[p], plan->decode_peer_count[p]);
        kvs_json_array_begin(&j, "destinations");
        for (uint32_t i = 0; i < plan->dest_count[p]; i++) {
            const kvs_dest_t *x = &plan->dests[p][i];
            kvs_json_object_begin(&j, NULL);
            kvs_json_u64(&j, "decode_rank", x->decode_rank);
            kvs_json_u64(&j, "writer", x->writer);
            json_writer_fields(&j, &x->w, plan->rank_tokens,
                               plan->offsets[x->decode_rank][x->writer], region_bytes(plan, &x->w));
            kvs_json_object_end(&j);
        }
        kvs_json_array_end(&j);
        kvs_json_object_end(&j);
    }
    kvs_json_array_end(&j);

    kvs_json_u64(&j, "max_slot_bytes", max_slot);
    kvs_json_u64(&j, "bulk_writes_per_chunk", plan->bulk_writes);
    kvs_json_u64(&j, "per_page_writes_per_chunk", plan->per_page_writes);
    kvs_json_u64(&j, "reduction", plan->per_page_writes / plan->bulk_writes);
    kvs_json_end(&j);
}

int kvs_cmd_plan(int argc, char **argv)
{
    plan_cfg_t cfg = {.prefill_tp = 4, .decode_tp = 2, .page = 16, .chunk = 256};
    uint32_t kv_heads = 8, layers = 32, head_dim = 128, dim_k = 0, dim_v = 0;
    int mla = 0, seen_heads = 0, seen_k = 0, seen_v = 0, dtype = 1;
    kvs_args_pages_t pages = {0};
    kvs_arg_t page_rows[3], dcp_rows[2];
    kvs_args_page_rows(&pages, page_rows);
    kvs_args_dcp_rows(&cfg.dcp, &cfg.interleave, dcp_rows);
    const kvs_arg_t args[] = {
        {"prefill-tp", KVS_ARG_U32, &cfg.prefill_tp, "prefill attention TP size (4)", KVS_ARGS_TP,
         NULL},
        {"prefill-pp", KVS_ARG_U32, &cfg.pp,
         "prefill pipeline stages, each a contiguous range of layers (1)", "[1,64]", NULL},
        {"decode-tp", KVS_ARG_U32, &cfg.decode_tp, "decode attention TP size (2)", KVS_ARGS_TP,
         NULL},
        dcp_rows[0],
        dcp_rows[1],
        {"kv-heads", KVS_ARG_U32, &kv_heads, "total KV heads H (8; 1 with --mla)", "[1,65536]",
         &seen_heads},
        {"layers", KVS_ARG_U32, &layers, "layers L (32)", "[1,65536]", NULL},
        {"head-dim", KVS_ARG_U32, &head_dim, "head dim for both K and V (128)", "[1,65536]", NULL},
        {"head-dim-k", KVS_ARG_U32, &dim_k, "K head dim (or MLA latent width)", "[1,65536]",
         &seen_k},
        {"head-dim-v", KVS_ARG_U32, &dim_v, "V head dim (0 with --mla)", "[0,65536]", &seen_v},
        {"dtype-bytes", KVS_ARG_CHOICE, &dtype, "element size in bytes (2)", KVS_ARGS_DTYPES, NULL},
        {"mla", KVS_ARG_FLAG, &mla, "MLA: one latent per token, held whole by every rank", NULL,
         NULL},
        page_rows[0],
        page_rows[1],
        page_rows[2],
        {"chunk", KVS_ARG_U32, &cfg.chunk, "chunked-prefill size C in tokens (256)", "[1,16777216]",
         NULL},
        {"room", KVS_ARG_U64, &cfg.room, "room id, picks among prefill replicas (0)", NULL, NULL},
        {"json", KVS_ARG_FLAG, &cfg.json, "print one JSON object instead of the table", NULL, NULL},
    };
    int rc =
        kvs_args_parse("kvstage plan [flags]", args, sizeof(args) / sizeof(args[0]), argc, argv, 1);
    if (rc == KVS_ARGS_HELP) return 0;
    if (rc != KVS_ARGS_OK) return 2;
    if (kvs_args_page_sizes(&pages, &cfg.page, &cfg.prefill_page) != 0) return 2;

    /* MLA has one latent and no V: its defaults follow, but explicit flags still win so that
     * a contradictory request is refused by the shape check rather than silently fixed. */
    cfg.shape = (kvs_kv_shape_t){
        .layers = layers,
        .kv_heads = mla && !seen_heads ? 1 : kv_heads,
        .head_dim_k = seen_k ? dim_k : head_dim,
        .head_dim_v = seen_v ? dim_v : (mla ? 0 : head_dim),
        .elem_bytes = kvs_args_dtype_bytes(dtype),
        .attn = mla ? KVS_ATTN_MLA : KVS_ATTN_MHA,
    };
    if (!plan_validate(&cfg, mla)) return 2;

    static plan_t plan; /* large: keep it off the stack */
    memset(&plan, 0, sizeof(plan));
    if (!plan_compute(&cfg, &plan)) return 2;
    if (cfg.json)
        print_json(&cfg, &plan);
    else
        print_table(&cfg, &plan);
    return 0;
}
