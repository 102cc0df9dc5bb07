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

int kvs_bench_protocol(int argc, char **argv)
{
    uint32_t prefill_tp = 4, decode_tp = 2, kv_heads = 8, layers = 32, head_dim = 8;
    uint32_t page = 16, chunk = 256, requests = 8;
    uint64_t seed = 1;
    int json = 0;
    const kvs_arg_t args[] = {
        {"prefill-tp", KVS_ARG_U32, &prefill_tp, "prefill TP size (default 4)", NULL, NULL},
        {"decode-tp", KVS_ARG_U32, &decode_tp, "decode TP size (default 2)", NULL, NULL},
        {"kv-heads", KVS_ARG_U32, &kv_heads, "KV heads (default 8)", NULL, NULL},
        {"layers", KVS_ARG_U32, &layers, "layers (default 32)", NULL, NULL},
        {"head-dim", KVS_ARG_U32, &head_dim,
         "head dim, K and V (default 8: small, so copying does not hide the control plane)", NULL,
         NULL},
        {"page-size", KVS_ARG_U32, &page, "tokens per page (default 16)", NULL, NULL},
        {"chunk", KVS_ARG_U32, &chunk, "chunked-prefill size (default 256)", NULL, NULL},
        {"requests", KVS_ARG_U32, &requests, "requests per size (default 8)", NULL, NULL},
        {"seed", KVS_ARG_U64, &seed, "seed (default 1)", NULL, NULL},
        {"json", KVS_ARG_FLAG, &json, "print one JSON object instead of the table", NULL, NULL},
    };
    int rc = kvs_args_parse("kvstage bench protocol [flags]", args, sizeof(args) / sizeof(args[0]),
                            argc, argv, 1);
    if (rc == KVS_ARGS_HELP) return 0;
    if (rc != KVS_ARGS_OK) return 2;
    if (requests == 0) {
        fprintf(stderr, "error: --requests must be > 0\n");
        return 2;
    }

    static const uint32_t sizes[] = {128, 1024, 4096, 16384};
    row_t rows[sizeof(sizes) / sizeof(sizes[0])];
    size_t nrows = sizeof(sizes) / sizeof(sizes[0]);
    for (size_t i = 0; i < nrows; i++) {
        kvs_sim_config_t c;
        kvs_sim_config_default(&c);
        c.shape = (kvs_kv_shape_t){.layers = layers,
                                   .kv_heads = kv_heads,
                                   .head_dim_k = head_dim,
                                   .head_dim_v = head_dim,
                                   .elem_bytes = 2,
                                   .attn = KVS_ATTN_MHA};
        c.prefill_tp = prefill_tp;
        c.decode_tp = decode_tp;
        c.page_size = page;
        c.chunk_tokens = chunk;
        c.prefill_radix = c.decode_radix = 0;
        /* The needle workload gives every request exactly prompt_len tokens. */
        c.workload.kind = KVS_WORKLOAD_NEEDLE;
        c.workload.requests = requests;
        c.workload.prompt_len = sizes[i];
        c.workload.prefix_len = 0;
        c.concurrency = requests;
        c.seed = seed;
        rows[i].tokens = sizes[i];
        rows[i].rooms = requests;
        kvs_status_t st = kvs_sim_run(&c, &rows[i].res);
        if (st != KVS_OK) {
            fprintf(stderr, "error: simulation for %u tokens could not run: %s\n", sizes[i],
                    kvs_status_str(st));
            return 2;
        }
        if (!kvs_sim_result_ok(&rows[i].res)) {
            fprintf(stderr, "error: simulation for %u tokens failed its checks\n", sizes[i]);
            return 1;
        }
    }

    char cpu[256];
    long cores;
    kvs_bench_cpu_info(cpu, sizeof(cpu), &cores);
    if (json) {
        kvs_json_t j;
        kvs_json_begin(&j, stdout);
        kvs_json_str(&j, "cpu", cpu);
        kvs_json_i64(&j, "cores", cores);
        kvs_json_u64(&j, "prefill_tp", prefill_tp);
        kvs_json_u64(&j, "decode_tp", decode_tp);
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
        return 0;
    }
    printf("kvstage bench protocol: prefill TP%u -> decode TP%u, %u KV heads x %u layers x dim %u "
           "x 2 B, page %u, chunk %u\n",
           prefill_tp, decode_tp, kv_heads, layers, head_dim, page, chunk);
    printf("%u requests per size, no radix hits, in-process transport, CPU copy backend\n",
           requests);
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
    return 0;
}
