/* `kvstage bench protocol`: what the protocol itself costs. For a few request sizes it runs
 * the simulation (no radix hits, so every token moves) and reports control messages and
 * control-plane CPU time per chunk and per room, and the bulk writes issued against what a
 * per-page path would have issued for the same bytes. */
#include "bench/bench_protocol.h"

#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "common/args.h"
#include "bench/bench_util.h"
#include "common/json.h"
#include "kvstage/log.h"
#include "sim/sim.h"

typedef struct {
    uint32_t tokens;
    uint32_t rooms;
    kvs_sim_result_t res;
} row_t;

typedef struct {
    uint32_t prefill_tp, decode_tp, kv_heads, layers, head_dim;
    uint32_t page, chunk, requests;
    uint64_t seed;
    int json;
} proto_opts_t;

static void protocol_flags(kvs_arg_table_t *t, proto_opts_t *o)
{
    const kvs_arg_t g[] = {
        {"prefill-tp", KVS_ARG_U32, &o->prefill_tp, "prefill TP size (default 4)", KVS_ARGS_TP,
         NULL},
        {"decode-tp", KVS_ARG_U32, &o->decode_tp, "decode TP size (default 2)", KVS_ARGS_TP, NULL},
        {"kv-heads", KVS_ARG_U32, &o->kv_heads, "KV heads (default 8)", "[1,65536]", NULL},
        {"layers", KVS_ARG_U32, &o->layers, "layers (default 32)", "[1,65536]", NULL},
        {"head-dim", KVS_ARG_U32, &o->head_dim,
         "head dim, K and V (default 8: small, so copying does not hide the control plane)",
         "[1,65536]", NULL},
        {"page-size", KVS_ARG_U32, &o->page, "tokens per page (default 16)", "[1,1048576]", NULL},
        {"chunk", KVS_ARG_U32, &o->chunk, "chunked-prefill size (default 256)", "[1,16777216]",
         NULL},
        {"requests", KVS_ARG_U32, &o->requests, "requests per size (default 8)", "[1,100000]",
         NULL},
        {"seed", KVS_ARG_U64, &o->seed, "seed (default 1)", NULL, NULL},
        {"json", KVS_ARG_FLAG, &o->json, "print one JSON object instead of the table", NULL, NULL},
    };
    KVS_ARG_TABLE_ADD(t, g);
}

/* Simulates o->requests rooms of exactly `tokens` tokens into row; 0, or the exit code after
 * saying why (2: the configuration did not run, 1: it failed its checks). */
static int run_size(const proto_opts_t *o, uint32_t tokens, row_t *row)
{
    kvs_sim_config_t c;
    kvs_sim_config_default(&c);
    c.shape = (kvs_kv_shape_t){.layers = o->layers,
                               .kv_heads = o->kv_heads,
                               .head_dim_k = o->head_dim,
                               .head_dim_v = o->head_dim,
                               .elem_bytes = 2,
                               .attn = KVS_ATTN_MHA};
    c.prefill_tp = o->prefill_tp;
    c.decode_tp = o->decode_tp;
    c.page_size = o->page;
    c.chunk_tokens = o->chunk;
    c.prefill_radix = c.decode_radix = 0;
    /* The needle workload gives every request exactly prompt_len tokens. */
    c.workload.kind = KVS_WORKLOAD_NEEDLE;
    c.workload.requests = o->requests;
    c.workload.prompt_len = tokens;
    c.workload.prefix_len = 0;
    c.concurrency = o->requests;
    c.seed = o->seed;
    row->tokens = tokens;
    row->rooms = o->requests;
    kvs_status_t st = kvs_sim_run(&c, &row->res);
    if (st != KVS_OK) {
        fprintf(stderr, "error: simulation for %u tokens could not run: %s\n", tokens,
                kvs_status_str(st));
        return 2;
    }
    if (!kvs_sim_result_ok(&row->res)) {
        fprintf(stderr, "error: simulation for %u tokens failed its checks\n", tokens);
        return 1;
    }
    return 0;
}

static void print_json(const proto_opts_t *o, const row_t *rows, size_t nrows, const char *cpu,
                       long cores)
{
    kvs_json_t j;
    kvs_json_begin(&j, stdout);
    kvs_json_str(&j, "cpu", cpu);
    kvs_json_i64(&j, "cores", cores);
    kvs_json_u64(&j, "prefill_tp", o->prefill_tp);
    kvs_json_u64(&j, "decode_tp", o->decode_tp);
    kvs_json_array_begin(&j, "rows");
    for (size_t i = 0; i < nrows; i++) {
        const kvs_sim_result_t *r = &rows[i].res;
        kvs_json_object_begin(&j, NULL);
        kvs_json_u64(&j, "tokens", rows[i].tokens);
        kvs_json_u64(&j, "rooms", rows[i].rooms);
        kvs_json_u64(&j, "chunks", r->chunks);
        kvs_json_u64(&j, "control_messages", r->control_messages);
        kvs_json_u64(&j, "control_ns", r->protocol_ns - r->data_ns);
        kvs_json_u64(&j, "data_ns", r->data_ns);
        kvs_json_u64(&j, "bulk_writes", r->bulk_writes);
        kvs_json_u64(&j, "per_page_writes", r->per_page_writes);
        kvs_json_object_end(&j);
    }
    kvs_json_array_end(&j);
    kvs_json_end(&j);
}

static void print_table(const proto_opts_t *o, const row_t *rows, size_t nrows, const char *cpu,
                        long cores)
{
    printf("kvstage bench protocol: prefill TP%u -> decode TP%u, %u KV heads x %u layers x dim %u "
           "x 2 B, page %u, chunk %u\n",
           o->prefill_tp, o->decode_tp, o->kv_heads, o->layers, o->head_dim, o->page, o->chunk);
    printf("%u requests per size, no radix hits, in-process transport, CPU copy backend\n",
           o->requests);
    printf("host: %s, %ld cores\n\n", cpu, cores);
    printf("%7s %7s %10s %10s %12s %12s %11s %14s %8s\n", "tokens", "chunks", "msgs/room",
           "msgs/chunk", "ctrl us/room", "ctrl us/chunk", "bulk wr", "per-page wr", "ratio");
    for (size_t i = 0; i < nrows; i++) {
        const kvs_sim_result_t *r = &rows[i].res;
        double ctrl_us = (double) (r->protocol_ns - r->data_ns) / 1e3;
        double chunks = r->chunks ? (double) r->chunks : 1.0;
        printf("%7u %7" PRIu64 " %10.1f %10.1f %12.1f %12.2f %11" PRIu64 " %14" PRIu64 " %7.0fx\n",
               rows[i].tokens, r->chunks, (double) r->control_messages / rows[i].rooms,
               (double) r->control_messages / chunks, ctrl_us / rows[i].rooms, ctrl_us / chunks,
               r->bulk_writes, r->per_page_writes,
               r->bulk_writes ? (double) r->per_page_writes / (double) r->bulk_writes : 0.0);
    }
    printf("\nchunks are counted per decode rank. ctrl = real time inside sender and receiver "
           "progress calls\n(idle polls included) minus gather, scatter and write calls, summed "
           "over all ranks.\nper-page wr = one write per page x layer x K/V x writer, the path "
           "staging replaces.\n");
}

int kvs_bench_protocol(int argc, char **argv)
{
    proto_opts_t o = {.prefill_tp = 4,
                      .decode_tp = 2,
                      .kv_heads = 8,
                      .layers = 32,
                      .head_dim = 8,
                      .page = 16,
                      .chunk = 256,
                      .requests = 8,
                      .seed = 1,
                      .json = 0};
    kvs_arg_table_t t = {.count = 0};
    protocol_flags(&t, &o);
    int rc = kvs_arg_table_parse(&t, "kvstage bench protocol [flags]", argc, argv, 1);
    if (rc == KVS_ARGS_HELP) return 0;
    if (rc != KVS_ARGS_OK) return 2;
    const kvs_kv_shape_t shape = {.layers = o.layers,
                                  .kv_heads = o.kv_heads,
                                  .head_dim_k = o.head_dim,
                                  .head_dim_v = o.head_dim,
                                  .elem_bytes = 2,
                                  .attn = KVS_ATTN_MHA};
    const uint32_t tps[2] = {o.prefill_tp, o.decode_tp};
    for (int i = 0; i < 2; i++) {
        kvs_args_capture_t cap;
        kvs_args_capture_begin(&cap);
        kvs_status_t st = kvs_tp_validate(&shape, &(kvs_tp_t){.tp_size = tps[i]});
        kvs_args_capture_end(&cap, st != KVS_OK);
        char sizes[512];
        if (st != KVS_OK)
            return kvs_args_error(i ? "--decode-tp" : "--prefill-tp",
                                  kvs_args_tp_sizes(&shape, sizes, sizeof(sizes)), "%u: %s", tps[i],
                                  cap.msg);
    }

    static const uint32_t sizes[] = {128, 1024, 4096, 16384};
    row_t rows[sizeof(sizes) / sizeof(sizes[0])];
    size_t nrows = sizeof(sizes) / sizeof(sizes[0]);
    for (size_t i = 0; i < nrows; i++)
        if ((rc = run_size(&o, sizes[i], &rows[i])) != 0) return rc;

    char cpu[256];
    long cores;
    kvs_bench_cpu_info(cpu, sizeof(cpu), &cores);
    if (o.json)
        print_json(&o, rows, nrows, cpu, cores);
    else
        print_table(&o, rows, nrows, cpu, cores);
    return 0;
}
