/* Flags of one rank of a multi-process deployment. */
#include "common/rank_flags.h"

#include <stdio.h>
#include <string.h>

#include "common/args.h"

void kvs_rank_flags_default(kvs_rank_flags_t *f)
{
    memset(f, 0, sizeof(*f));
    kvs_rank_config_t *c = &f->cfg;
    c->geo.shape = (kvs_kv_shape_t){.layers = 4,
                                    .kv_heads = 8,
                                    .head_dim_k = 32,
                                    .head_dim_v = 32,
                                    .elem_bytes = 2,
                                    .attn = KVS_ATTN_MHA};
    c->geo.prefill_tp = 4;
    c->geo.decode_tp = 2;
    c->geo.page_size = 16;
    c->geo.chunk_tokens = 256;
    c->layout = KVS_POOL_NHD;
    c->data = KVS_NET_DATA_AUTO;
    c->workload = (kvs_workload_config_t){.kind = KVS_WORKLOAD_RANDOM,
                                          .requests = 64,
                                          .prompt_len = 2000,
                                          .prefix_len = 0,
                                          .seed = 1};
    c->concurrency = 16;
}

int kvs_rank_flags_parse(kvs_rank_flags_t *f, const char *usage, int argc, char **argv)
{
    kvs_rank_config_t *c = &f->cfg;
    uint32_t head_dim = 0, kv_heads = c->geo.shape.kv_heads, layers = c->geo.shape.layers;
    int dtype = c->geo.shape.elem_bytes == 4 ? 2 : c->geo.shape.elem_bytes == 2 ? 1 : 0;
    int mla = 0, layout = 0, data = 0, workload = (int) c->workload.kind, seen_hd = 0;
    int device = c->mem == KVS_MEM_DEVICE;
    uint32_t gpu = (uint32_t) c->device;
    int write_mode = (int) c->write_mode;
    int checksum = !c->geo.no_checksum;
    uint64_t liveness_ms = 0, deadline_s = 0;
    kvs_args_pages_t pages = {0};
    kvs_arg_t page_rows[3], dcp_rows[2];
    kvs_args_page_rows(&pages, page_rows);
    kvs_args_dcp_rows(&c->geo.decode_dcp, &c->geo.dcp_interleave, dcp_rows);
    const kvs_arg_t args[] = {
        {"rank", KVS_ARG_U32, &c->rank, "this rank on its side (0)", "[0,63]", NULL},
        {"registry", KVS_ARG_STR, &c->registry, "the prefill instance's registry endpoint", NULL,
         NULL},
        {"serve-registry", KVS_ARG_FLAG, &c->serve_registry,
         "prefill rank 0: bind the registry endpoint and serve it", NULL, NULL},
        {"bind", KVS_ARG_STR, &c->bind, "this rank's control endpoint (tcp://127.0.0.1:*)", NULL,
         NULL},
        {"data", KVS_ARG_CHOICE, &data, "UCX transports for data (auto)", "auto|shm|tcp", NULL},
        {"net-device", KVS_ARG_STR, &c->net_device, "UCX_NET_DEVICES for tcp, e.g. lo", NULL, NULL},
        {"device", KVS_ARG_CHOICE, &device,
         "where this rank's pool, ring and staging buffers live (cuda: CUDA IPC between the "
         "processes, so every rank on one host) (cpu)",
         "cpu|cuda", NULL},
        {"gpu", KVS_ARG_U32, &gpu, "with --device cuda: this rank's GPU (0)", "[0,1024]", NULL},
        {"write-mode", KVS_ARG_CHOICE, &write_mode,
         "prefill: auto gathers straight into the decode ring where the link maps it (shared "
         "memory, CUDA IPC), else through a staging buffer and one bulk write (auto)",
         "auto|staged|direct", NULL},
        {"prefill-tp", KVS_ARG_U32, &c->geo.prefill_tp, "prefill TP size (4)", KVS_ARGS_TP, NULL},
        {"prefill-pp", KVS_ARG_U32, &c->geo.prefill_pp,
         "prefill pipeline stages: PP x TP prefill ranks, rank = stage x TP + TP rank (1)",
         "[1,64]", NULL},
        {"decode-tp", KVS_ARG_U32, &c->geo.decode_tp, "decode TP size (2)", KVS_ARGS_TP, NULL},
        dcp_rows[0],
        dcp_rows[1],
        {"kv-heads", KVS_ARG_U32, &kv_heads, "KV heads (8)", "[1,65536]", NULL},
        {"layers", KVS_ARG_U32, &layers, "layers (4)", "[1,65536]", NULL},
        {"head-dim", KVS_ARG_U32, &head_dim, "head dim for K and V, or the MLA latent (32)",
         "[1,65536]", &seen_hd},
        {"dtype-bytes", KVS_ARG_CHOICE, &dtype, "element size in bytes (2)", KVS_ARGS_DTYPES, NULL},
        {"mla", KVS_ARG_FLAG, &mla, "MLA: one latent per token and layer", NULL, NULL},
        page_rows[0],
        page_rows[1],
        page_rows[2],
        {"chunk", KVS_ARG_U32, &c->geo.chunk_tokens, "chunked-prefill tokens (256)", "[1,16777216]",
         NULL},
        {"corrupt-nth", KVS_ARG_U64, &c->corrupt_nth,
         "test hook: each prefill rank flips a bit of its n-th staged data write (a transport "
         "write: tcp, or --write-mode staged) in flight, after its checksum (0: off)",
         NULL, NULL},
        {"checksum", KVS_ARG_ONOFF, &checksum,
         "end-to-end chunk checksums, verified on decode; every rank must agree (on)", NULL, NULL},
        {"layout", KVS_ARG_CHOICE, &layout, "this rank's pool layout (nhd)", "nhd|hnd", NULL},
        {"ring-bytes", KVS_ARG_U64, &c->ring_bytes, "decode staging ring bytes (4 slots)", NULL,
         NULL},
        {"requests", KVS_ARG_U32, &c->workload.requests, "requests (64)", "[1,1000000]", NULL},
        {"concurrency", KVS_ARG_U32, &c->concurrency, "rooms in flight per rank (16)", "[1,65536]",
         NULL},
        {"workload", KVS_ARG_CHOICE, &workload, "workload (random)",
         "shared-prefix|multi-turn|random|needle", NULL},
        {"prompt-len", KVS_ARG_U32, &c->workload.prompt_len, "longest prompt (2000)",
         "[1,16777216]", NULL},
        {"prefix-len", KVS_ARG_U32, &c->workload.prefix_len, "shared prefix tokens (0)",
         "[0,16777216]", NULL},
        {"seed", KVS_ARG_U64, &c->workload.seed, "workload seed (1)", NULL, NULL},
        {"liveness-ms", KVS_ARG_U64, &liveness_ms, "a silent peer is dead after this (3000)",
         "[1,86400000]", NULL},
        {"deadline-s", KVS_ARG_U64, &deadline_s, "give up after this many seconds (600)",
         "[1,31536000]", NULL},
        {"json", KVS_ARG_FLAG, &f->json, "print one JSON object with the result", NULL, NULL},
        {"progress", KVS_ARG_FLAG, &f->progress,
         "print 'progress CONCLUDED REQUESTS' lines while running", NULL, NULL},
    };
    int rc = kvs_args_parse(usage, args, sizeof(args) / sizeof(args[0]), argc, argv, 1);
    if (rc != KVS_ARGS_OK) return rc;
    rc = kvs_args_page_sizes(&pages, &c->geo.page_size, &c->geo.prefill_page_size);
    if (rc != 0) return rc;
    c->geo.no_checksum = !checksum;
    c->geo.shape.kv_heads = mla ? 1 : kv_heads;
    c->geo.shape.layers = layers;
    c->geo.shape.elem_bytes = kvs_args_dtype_bytes(dtype);
    c->geo.shape.attn = mla ? KVS_ATTN_MLA : KVS_ATTN_MHA;
    if (seen_hd) c->geo.shape.head_dim_k = head_dim;
    c->geo.shape.head_dim_v = mla ? 0 : c->geo.shape.head_dim_k;
    c->layout = layout ? KVS_POOL_HND : KVS_POOL_NHD;
    c->mem = device ? KVS_MEM_DEVICE : KVS_MEM_HOST;
    c->device = (int) gpu;
    c->write_mode = (kvs_write_mode_t) write_mode;
    c->data = (kvs_net_data_t) data;
    c->workload.kind = (kvs_workload_kind_t) workload;
    c->liveness_timeout_ns = liveness_ms * 1000000ull;
    c->deadline_ns = deadline_s * 1000000000ull;
    return KVS_ARGS_OK;
}

int kvs_rank_flags_check(const kvs_rank_flags_t *f, const char *cmd)
{
    const kvs_rank_config_t *c = &f->cfg;
    /* The library's messages name the rank, as the rank itself would. */
    char who[32];
    if (strcmp(cmd, "demo") == 0)
        snprintf(who, sizeof(who), "demo");
    else
        snprintf(who, sizeof(who), "%s rank %u", cmd, c->rank);
    const uint32_t tps[2] = {c->geo.prefill_tp, c->geo.decode_tp};
    const char *names[2] = {"--prefill-tp", "--decode-tp"};
    char sizes[512];
    for (int i = 0; i < 2; i++) {
        kvs_args_capture_t cap;
        kvs_args_capture_begin(&cap);
        kvs_status_t st = kvs_tp_validate(&c->geo.shape, &(kvs_tp_t){.tp_size = tps[i]});
        kvs_args_capture_end(&cap, st != KVS_OK);
        if (st != KVS_OK)
            return kvs_args_error(names[i], kvs_args_tp_sizes(&c->geo.shape, sizes, sizeof(sizes)),
                                  "%u: %s", tps[i], cap.msg);
    }
    if (kvs_args_check_layout(&c->geo) != 0) return 2;
    /* A host pool's direct write stores through a mapping of the decode ring; UCX over tcp has
     * none, so every room would fail (KVS_ERR_UNSUPPORTED). */
    if (c->write_mode == KVS_WRITE_DIRECT && c->mem == KVS_MEM_HOST && c->data == KVS_NET_DATA_TCP)
        return kvs_args_error("--write-mode", "auto or staged with --data tcp",
                              "direct stores into a mapping of the decode ring, which --data tcp "
                              "does not give (it needs --data shm or auto on one host, or "
                              "--device cuda)");
    const kvs_workload_config_t *w = &c->workload;
    if (w->kind == KVS_WORKLOAD_SHARED_PREFIX && w->prefix_len >= w->prompt_len)
        return kvs_args_error("--prefix-len", "below --prompt-len",
                              "%u is not below --prompt-len %u", w->prefix_len, w->prompt_len);
    kvs_args_capture_t cap;
    kvs_args_capture_begin(&cap);
    kvs_status_t st = kvs_rank_check(c, who);
    kvs_args_capture_end(&cap, st != KVS_OK);
    if (st != KVS_OK)
        return kvs_args_error(NULL, NULL, "%s (see `kvstage %s --help`)",
                              cap.msg[0] ? cap.msg : kvs_status_str(st), cmd);
    return 0;
}

int kvs_rank_result_ok(const kvs_rank_result_t *r)
{
    return !r->timed_out && r->failed == 0 && r->succeeded == r->requests &&
           r->mismatched_bytes == 0 && r->meta_mismatches == 0 && r->leaked_pages == 0 &&
           r->leaked_slots == 0 && r->leaked_rooms == 0;
}
