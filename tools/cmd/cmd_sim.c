/* `kvstage sim`: runs the deterministic whole-system simulation (sim/sim.h) from flags,
 * shows progress on stderr and prints a summary table or one JSON object. `kvstage demo` is
 * this command with its defaults. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/args.h"
#include "cmd/commands.h"
#include "common/json.h"
#include "kvstage/log.h"
#include "sim/sim.h"

typedef struct {
    int tty;
    uint32_t last_drawn; /* concluded count last drawn */
    int drawn;
} progress_t;

static void draw_progress(void *arg, const kvs_sim_progress_t *p)
{
    progress_t *pr = arg;
    /* Redraw at most ~100 times per run (and on the last room) to keep stderr cheap. */
    uint32_t step = p->requests / 100 ? p->requests / 100 : 1;
    if (p->concluded != p->requests && p->concluded - pr->last_drawn < step && pr->drawn) return;
    pr->last_drawn = p->concluded;
    pr->drawn = 1;
    const int width = 30;
    int fill = p->requests ? (int) ((uint64_t) p->concluded * width / p->requests) : width;
    char bar[64];
    for (int i = 0; i < width; i++) bar[i] = i < fill ? '#' : '.';
    bar[width] = '\0';
    fprintf(stderr, "\r[%s] %u/%u rooms (%u ok, %u failed) %8.3f ms virtual", bar, p->concluded,
            p->requests, p->succeeded, p->failed, (double) p->virtual_ns / 1e6);
    fflush(stderr);
}

static const char *const write_modes[] = {"auto", "staged", "direct"};

static void print_json(const kvs_sim_config_t *c, const kvs_sim_result_t *r, int ok)
{
    kvs_json_t j;
    char faults[64];
    kvs_sim_faults_str(c->faults, faults, sizeof(faults));
    kvs_json_begin(&j, stdout);
    kvs_json_bool(&j, "ok", ok);
    kvs_json_u64(&j, "seed", c->seed);
    kvs_json_str(&j, "workload", kvs_workload_kind_str(c->workload.kind));
    kvs_json_str(&j, "faults", faults);
    kvs_json_str(&j, "device", c->mem == KVS_MEM_DEVICE ? "cuda" : "cpu");
    if (c->mem == KVS_MEM_DEVICE) {
        kvs_json_u64(&j, "prefill_gpu", (uint64_t) c->prefill_device);
        kvs_json_u64(&j, "decode_gpu", (uint64_t) c->decode_device);
    }
    kvs_json_str(&j, "write_mode", write_modes[c->write_mode]);
    kvs_json_u64(&j, "prefill_tp", c->prefill_tp);
    kvs_json_u64(&j, "prefill_pp", c->prefill_pp ? c->prefill_pp : 1);
    kvs_json_u64(&j, "decode_tp", c->decode_tp);
    kvs_json_u64(&j, "prefill_page_size",
                 c->prefill_page_size ? c->prefill_page_size : c->page_size);
    kvs_json_u64(&j, "decode_page_size", c->page_size);
    kvs_json_u64(&j, "decode_dcp", c->decode_dcp ? c->decode_dcp : 1);
    kvs_json_u64(&j, "dcp_interleave", c->dcp_interleave ? c->dcp_interleave : 1);
    kvs_json_u64(&j, "requests", r->requests);
    kvs_json_u64(&j, "succeeded", r->succeeded);
    kvs_json_u64(&j, "failed", r->failed);
    kvs_json_u64(&j, "expected_failures", r->expected_failures);
    kvs_json_u64(&j, "unexpected_failures", r->unexpected_failures);
    kvs_json_bool(&j, "exact", r->exact);
    kvs_json_u64(&j, "mismatched_bytes", r->mismatched_bytes);
    kvs_json_u64(&j, "meta_mismatches", r->meta_mismatches);
    kvs_json_u64(&j, "leaked_slots", r->leaked_slots);
    kvs_json_u64(&j, "leaked_pages", r->leaked_pages);
    kvs_json_u64(&j, "leaked_rooms", r->leaked_rooms);
    kvs_json_u64(&j, "leaked_allocs", r->leaked_allocs);
    kvs_json_u64(&j, "chunks", r->chunks);
    kvs_json_u64(&j, "expected_chunks", r->expected_chunks);
    kvs_json_u64(&j, "bulk_writes", r->bulk_writes);
    kvs_json_u64(&j, "direct_writes", r->direct_writes);
    kvs_json_u64(&j, "per_page_writes", r->per_page_writes);
    kvs_json_u64(&j, "control_messages", r->control_messages);
    kvs_json_u64(&j, "retries", r->retries);
    kvs_json_u64(&j, "rejected_messages", r->rejected_messages);
    kvs_json_u64(&j, "ignored_messages", r->ignored_messages);
    kvs_json_u64(&j, "bytes_moved", r->bytes_moved);
    kvs_json_u64(&j, "ring_capacity", r->ring_capacity);
    kvs_json_u64(&j, "ring_high_water", r->ring_high_water);
    kvs_json_u64(&j, "decode_hit_tokens", r->decode_hit_tokens);
    kvs_json_u64(&j, "prefill_hit_tokens", r->prefill_hit_tokens);
    kvs_json_u64(&j, "full_decode_hits", r->full_decode_hits);
    kvs_json_u64(&j, "net_dropped", r->net_dropped);
    kvs_json_u64(&j, "net_duplicated", r->net_duplicated);
    kvs_json_u64(&j, "corrupt_injected", r->corrupt_injected);
    kvs_json_u64(&j, "corrupt_detected", r->corrupt_detected);
    kvs_json_u64(&j, "write_failures", r->write_failures);
    kvs_json_object_begin(&j, "fail_reasons");
    for (int i = 0; i < 16; i++) {
        if (r->fail_reasons[i] == 0) continue;
        kvs_json_u64(&j, kvs_status_str((kvs_status_t) -i), r->fail_reasons[i]);
    }
    kvs_json_object_end(&j);
    kvs_json_bool(&j, "stalled", r->stalled);
    kvs_json_u64(&j, "unconcluded", r->unconcluded);
    kvs_json_u64(&j, "iterations", r->iterations);
    kvs_json_u64(&j, "virtual_ns", r->virtual_ns);
    kvs_json_u64(&j, "drain_ns", r->drain_ns);
    kvs_json_double(&j, "wall_s", r->wall_s);
    kvs_json_end(&j);
}

/* What made a run fail, one clause per check that did not hold (kvs_sim_result_ok). */
static void print_failure(const kvs_sim_config_t *c, const kvs_sim_result_t *r)
{
    printf("\nFAIL:");
    const char *sep = " ";
    if (r->unexpected_failures) {
        printf("%s%u rooms failed that should have succeeded", sep, r->unexpected_failures);
        sep = "; ";
    }
    if (r->mismatched_bytes || r->meta_mismatches || !r->exact) {
        printf("%s%llu bytes and %u final metadata differ in rooms that succeeded", sep,
               (unsigned long long) r->mismatched_bytes, r->meta_mismatches);
        if ((c->faults & KVS_SIM_FAULT_CORRUPT) && c->no_checksum)
            printf(" (the corruption fault's flipped bits went undetected: --checksum off)");
        sep = "; ";
    }
    if (r->leaked_slots || r->leaked_pages || r->leaked_rooms || r->leaked_allocs) {
        printf("%sleaks (see the leaks line)", sep);
        sep = "; ";
    }
    if (r->stalled || r->succeeded + r->failed != r->requests)
        printf("%s%u requests never concluded", sep, r->requests - r->succeeded - r->failed);
    printf("\n");
}

static void print_table(const kvs_sim_config_t *c, const kvs_sim_result_t *r, int ok)
{
    char faults[64];
    kvs_sim_faults_str(c->faults, faults, sizeof(faults));
    const kvs_kv_shape_t *s = &c->shape;
    char pages[48];
    if (c->prefill_page_size != 0 && c->prefill_page_size != c->page_size)
        snprintf(pages, sizeof(pages), "pages %u prefill / %u decode", c->prefill_page_size,
                 c->page_size);
    else
        snprintf(pages, sizeof(pages), "page %u", c->page_size);
    char pp[24] = "", dcp[48] = "";
    if (c->prefill_pp > 1) snprintf(pp, sizeof(pp), "PP%u x ", c->prefill_pp);
    if (c->decode_dcp > 1)
        snprintf(dcp, sizeof(dcp), " (DCP%u, interleave %u)", c->decode_dcp,
                 c->dcp_interleave ? c->dcp_interleave : 1);
    if (s->attn == KVS_ATTN_MLA)
        printf("kvstage sim: prefill %sTP%u -> decode TP%u%s, MLA latent %u x %u layers x %u B, "
               "%s, chunk %u\n",
               pp, c->prefill_tp, c->decode_tp, dcp, s->head_dim_k, s->layers, s->elem_bytes, pages,
               c->chunk_tokens);
    else
        printf(
            "kvstage sim: prefill %sTP%u -> decode TP%u%s, %u KV heads x %u layers x %u/%u dim x "
            "%u B, %s, chunk %u\n",
            pp, c->prefill_tp, c->decode_tp, dcp, s->kv_heads, s->layers, s->head_dim_k,
            s->head_dim_v, s->elem_bytes, pages, c->chunk_tokens);
    if (c->mem == KVS_MEM_DEVICE)
        printf("memory: CUDA devices, prefill ranks on GPU %d, decode ranks on GPU %d; write "
               "mode %s\n",
               c->prefill_device, c->decode_device, write_modes[c->write_mode]);
    else
        printf("memory: host, CPU copy backend\n");
    printf("workload %s: %u requests (prompt <= %u, prefix %u), concurrency %u, radix "
           "prefill %s / decode %s, faults %s, seed %llu\n\n",
           kvs_workload_kind_str(c->workload.kind), r->requests, c->workload.prompt_len,
           c->workload.prefix_len, c->concurrency, c->prefill_radix ? "on" : "off",
           c->decode_radix ? "on" : "off", faults, (unsigned long long) c->seed);
    printf("  %-20s %u\n", "requests", r->requests);
    printf("  %-20s %u\n", "succeeded", r->succeeded);
    printf("  %-20s %u (expected %u, unexpected %u)\n", "failed", r->failed, r->expected_failures,
           r->unexpected_failures);
    for (int i = 1; i < 16; i++) {
        if (r->fail_reasons[i] != 0)
            printf("  %-20s %u\n", kvs_status_str((kvs_status_t) -i), r->fail_reasons[i]);
    }
    printf("  %-20s %s (%llu mismatched bytes, %u wrong final metadata)\n", "exact",
           r->exact ? "yes" : "NO", (unsigned long long) r->mismatched_bytes, r->meta_mismatches);
    printf("  %-20s slots %llu, pages %llu, rooms %llu, heap blocks %llu\n", "leaks",
           (unsigned long long) r->leaked_slots, (unsigned long long) r->leaked_pages,
           (unsigned long long) r->leaked_rooms, (unsigned long long) r->leaked_allocs);
    printf("  %-20s %llu (succeeded rooms need %llu)\n", "chunks scattered",
           (unsigned long long) r->chunks, (unsigned long long) r->expected_chunks);
    printf("  %-20s %llu (a per-page path: %llu, %.0fx more)\n", "bulk writes",
           (unsigned long long) r->bulk_writes, (unsigned long long) r->per_page_writes,
           r->bulk_writes ? (double) r->per_page_writes / (double) r->bulk_writes : 0.0);
    if (r->direct_writes)
        printf("  %-20s %llu of them gathered straight into the decode ring\n", "direct writes",
               (unsigned long long) r->direct_writes);
    printf("  %-20s %llu (retries %llu, rejected %llu, ignored %llu)\n", "control messages",
           (unsigned long long) r->control_messages, (unsigned long long) r->retries,
           (unsigned long long) r->rejected_messages, (unsigned long long) r->ignored_messages);
    printf("  %-20s dropped %llu, duplicated %llu\n", "network faults",
           (unsigned long long) r->net_dropped, (unsigned long long) r->net_duplicated);
    if (r->corrupt_injected || r->corrupt_detected)
        printf("  %-20s %llu writes corrupted, %llu caught by their checksum\n", "corruption",
               (unsigned long long) r->corrupt_injected, (unsigned long long) r->corrupt_detected);
    if (r->write_failures)
        printf("  %-20s %llu writes failed\n", "broken writes",
               (unsigned long long) r->write_failures);
    printf("  %-20s %.1f MiB\n", "bytes moved", (double) r->bytes_moved / (1024.0 * 1024.0));
    printf("  %-20s decode %llu tokens (%u full hits), prefill %llu tokens\n", "radix hits",
           (unsigned long long) r->decode_hit_tokens, r->full_decode_hits,
           (unsigned long long) r->prefill_hit_tokens);
    printf("  %-20s %.1f KiB per decode rank, high water %.1f KiB\n", "staging ring",
           (double) r->ring_capacity / 1024.0, (double) r->ring_high_water / 1024.0);
    printf("  %-20s %.3f ms virtual (%.3f ms draining late messages), %.2f s wall, %llu "
           "iterations\n",
           "time", (double) r->virtual_ns / 1e6, (double) r->drain_ns / 1e6, r->wall_s,
           (unsigned long long) r->iterations);
    if (r->stalled)
        printf("  %-20s gave up with %u requests unconcluded\n", "STALLED", r->unconcluded);
    if (ok) {
        printf("\nPASS: every room that should succeed succeeded byte-exact, nothing leaked\n");
        return;
    }
    print_failure(c, r);
}

/* Flag values that do not map one-to-one onto kvs_sim_config_t: they are checked against each
 * other (seen_*: given on the command line) before the config is built from them. */
typedef struct {
    kvs_sim_config_t c;
    uint32_t kv_heads, layers, head_dim, head_dim_k, head_dim_v, pool_pages;
    int dtype_idx; /* --dtype-bytes as an index into KVS_ARGS_DTYPES */
    int mla, json, layout, prefill_layout, decode_layout, workload, device, write_mode, checksum;
    int seen_ring_bytes, seen_ring_slots, seen_hd, seen_hdk, seen_hdv, seen_layout, seen_pl,
        seen_dl, seen_pool, seen_mis, seen_gpus;
    const char *faults, *gpus;
    kvs_args_pages_t pages;
    kvs_arg_t page_rows[3], dcp_rows[2];
    uint64_t misaligned;
    uint64_t to_us[6]; /* retry, bootstrap, transfer, waiting, completion, release */
    uint64_t write_delay_us, step_us;
} sim_opts_t;

static void sim_opts_default(sim_opts_t *o)
{
    memset(o, 0, sizeof(*o));
    kvs_sim_config_default(&o->c);
    o->kv_heads = o->c.shape.kv_heads;
    o->layers = o->c.shape.layers;
    o->dtype_idx = o->c.shape.elem_bytes == 4 ? 2 : o->c.shape.elem_bytes == 2 ? 1 : 0;
    o->prefill_layout = o->c.prefill_layout;
    o->decode_layout = o->c.decode_layout;
    o->workload = o->c.workload.kind;
    o->faults = "none";
    o->gpus = "0";
    o->step_us = o->c.step_ns / 1000;
    o->checksum = 1;
    o->misaligned = UINT64_MAX;
}

static void add_device_flags(kvs_arg_table_t *t, sim_opts_t *o)
{
    const kvs_arg_t g[] = {
        {"device", KVS_ARG_CHOICE, &o->device,
         "where pools, rings and staging buffers live: host memory with CPU copies, or CUDA "
         "devices with the copy kernels (cpu)",
         "cpu|cuda", NULL},
        {"gpus", KVS_ARG_STR, &o->gpus,
         "with --device cuda: GPU of the prefill ranks, then of the decode ranks (0 = both on "
         "GPU 0; 0,1 = prefill on 0, decode on 1)",
         KVS_ARGS_GPUS_ACCEPTED, &o->seen_gpus},
        {"write-mode", KVS_ARG_CHOICE, &o->write_mode,
         "auto: gather straight into the decode ring where the link maps it (device rings); "
         "staged: always through a staging buffer; direct: always straight, with --device cuda "
         "(auto)",
         "auto|staged|direct", NULL},
    };
    KVS_ARG_TABLE_ADD(t, g);
}

static void add_shape_flags(kvs_arg_table_t *t, sim_opts_t *o)
{
    kvs_sim_config_t *c = &o->c;
    kvs_args_dcp_rows(&c->decode_dcp, &c->dcp_interleave, o->dcp_rows);
    const kvs_arg_t g[] = {
        {"prefill-tp", KVS_ARG_U32, &c->prefill_tp, "prefill TP size (4)", KVS_ARGS_TP, NULL},
        {"prefill-pp", KVS_ARG_U32, &c->prefill_pp,
         "prefill pipeline stages: PP x TP ranks, each stage a contiguous range of layers (1)",
         "[1,64]", NULL},
        {"decode-tp", KVS_ARG_U32, &c->decode_tp, "decode TP size (2)", KVS_ARGS_TP, NULL},
        o->dcp_rows[0],
        o->dcp_rows[1],
        {"kv-heads", KVS_ARG_U32, &o->kv_heads, "KV heads (8)", "[1,65536]", NULL},
        {"layers", KVS_ARG_U32, &o->layers, "layers (4)", "[1,65536]", NULL},
        {"head-dim", KVS_ARG_U32, &o->head_dim, "head dim for K and V, or the MLA latent (32)",
         "[1,65536]", &o->seen_hd},
        {"head-dim-k", KVS_ARG_U32, &o->head_dim_k, "K head dim", "[1,65536]", &o->seen_hdk},
        {"head-dim-v", KVS_ARG_U32, &o->head_dim_v, "V head dim", "[1,65536]", &o->seen_hdv},
        {"dtype-bytes", KVS_ARG_CHOICE, &o->dtype_idx, "element size in bytes (2)", KVS_ARGS_DTYPES,
         NULL},
        {"mla", KVS_ARG_FLAG, &o->mla, "MLA: one latent per token and layer, on every rank", NULL,
         NULL},
    };
    KVS_ARG_TABLE_ADD(t, g);
}

static void add_layout_flags(kvs_arg_table_t *t, sim_opts_t *o)
{
    kvs_sim_config_t *c = &o->c;
    kvs_args_page_rows(&o->pages, o->page_rows);
    const kvs_arg_t g[] = {
        o->page_rows[0],
        o->page_rows[1],
        o->page_rows[2],
        {"chunk", KVS_ARG_U32, &c->chunk_tokens, "chunked-prefill tokens (256)", "[1,16777216]",
         NULL},
        {"ring-bytes", KVS_ARG_U64, &c->ring_bytes, "staging ring bytes per decode rank",
         "[1,18446744073709551615]", &o->seen_ring_bytes},
        {"ring-slots", KVS_ARG_U32, &c->ring_slots, "staging ring size in full slots (8)",
         "[1,1024]", &o->seen_ring_slots},
        {"layout", KVS_ARG_CHOICE, &o->layout, "pool layout of both sides", "nhd|hnd",
         &o->seen_layout},
        {"prefill-layout", KVS_ARG_CHOICE, &o->prefill_layout, "prefill pool layout (nhd)",
         "nhd|hnd", &o->seen_pl},
        {"decode-layout", KVS_ARG_CHOICE, &o->decode_layout, "decode pool layout (hnd)", "nhd|hnd",
         &o->seen_dl},
        {"pool-pages", KVS_ARG_U32, &o->pool_pages, "pages per rank on both sides (auto)",
         "[1,4294967295]", &o->seen_pool},
        {"prefill-pool-pages", KVS_ARG_U32, &c->prefill_pool_pages,
         "pages per prefill rank (0 = auto)", NULL, NULL},
        {"decode-pool-pages", KVS_ARG_U32, &c->decode_pool_pages,
         "pages per decode rank (0 = auto)", NULL, NULL},
        {"window", KVS_ARG_U32, &c->window_chunks, "chunks per room with a slot request out (2)",
         "[1,1024]", NULL},
        {"staging-buffers", KVS_ARG_U32, &c->staging_buffers, "gather buffers per prefill rank (2)",
         "[1,1024]", NULL},
        {"prefill-batch", KVS_ARG_U32, &c->prefill_batch, "rooms per prefill forward pass (16)",
         "[1,65536]", NULL},
    };
    KVS_ARG_TABLE_ADD(t, g);
}

static void add_workload_flags(kvs_arg_table_t *t, sim_opts_t *o)
{
    kvs_sim_config_t *c = &o->c;
    const kvs_arg_t g[] = {
        {"requests", KVS_ARG_U32, &c->workload.requests, "requests (200)", "[1,1000000]", NULL},
        {"concurrency", KVS_ARG_U32, &c->concurrency, "requests in flight (128)", "[1,1000000]",
         NULL},
        {"workload", KVS_ARG_CHOICE, &o->workload, "workload (shared-prefix)",
         "shared-prefix|multi-turn|random|needle", NULL},
        {"prompt-len", KVS_ARG_U32, &c->workload.prompt_len, "longest prompt in tokens (2000)",
         "[1,16777216]", NULL},
        {"prefix-len", KVS_ARG_U32, &c->workload.prefix_len, "shared prefix tokens (900)",
         "[0,16777216]", NULL},
        {"groups", KVS_ARG_U32, &c->workload.groups, "prefix groups / documents / clients (auto)",
         NULL, NULL},
        {"repeat-permille", KVS_ARG_U32, &c->workload.repeat_permille,
         "chance (per mille) a request repeats an earlier prompt (0)", "[0,1000]", NULL},
        {"decode-radix", KVS_ARG_ONOFF, &c->decode_radix, "decode radix cache (on)", NULL, NULL},
        {"prefill-radix", KVS_ARG_ONOFF, &c->prefill_radix, "prefill radix cache (on)", NULL, NULL},
    };
    KVS_ARG_TABLE_ADD(t, g);
}

static void add_fault_flags(kvs_arg_table_t *t, sim_opts_t *o)
{
    const kvs_arg_t g[] = {
        {"faults", KVS_ARG_STR, &o->faults,
         "comma list of " KVS_SIM_FAULT_LIST " (none); corrupt flips a bit in some data writes "
         "after they land, writefail fails some data writes (half their bytes landed)",
         "a comma list of " KVS_SIM_FAULT_LIST, NULL},
        {"checksum", KVS_ARG_ONOFF, &o->checksum,
         "end-to-end chunk checksums: each writer's region is checked before its scatter (on)",
         NULL, NULL},
        {"fault-rooms", KVS_ARG_U32, &o->c.fault_rooms, "rooms hit per abort/timeout fault (auto)",
         NULL, NULL},
        {"misaligned-request", KVS_ARG_U64, &o->misaligned,
         "give this request a misaligned decode prefix (test hook)", NULL, &o->seen_mis},
        {"retry-us", KVS_ARG_U64, &o->to_us[0], "control message retry period, virtual us (200)",
         "[1,18446744073709551]", NULL},
        {"bootstrap-timeout-us", KVS_ARG_U64, &o->to_us[1], "virtual us (2000000)",
         "[1,18446744073709551]", NULL},
        {"transfer-timeout-us", KVS_ARG_U64, &o->to_us[2], "virtual us (2000000)",
         "[1,18446744073709551]", NULL},
        {"waiting-timeout-us", KVS_ARG_U64, &o->to_us[3], "virtual us (1000000)",
         "[1,18446744073709551]", NULL},
        {"completion-timeout-us", KVS_ARG_U64, &o->to_us[4], "virtual us (200000)",
         "[1,18446744073709551]", NULL},
        {"release-timeout-us", KVS_ARG_U64, &o->to_us[5], "virtual us (100000)",
         "[1,18446744073709551]", NULL},
        {"step-us", KVS_ARG_U64, &o->step_us, "virtual us of one prefill forward pass (50)",
         "[0,18446744073709551]", NULL},
        {"write-delay-us", KVS_ARG_U64, &o->write_delay_us,
         "data writes land up to this late, virtual us (20 under reorder, else 0)",
         "[0,18446744073709551]", NULL},
    };
    KVS_ARG_TABLE_ADD(t, g);
}

static void add_run_flags(kvs_arg_table_t *t, sim_opts_t *o)
{
    const kvs_arg_t g[] = {
        {"max-iterations", KVS_ARG_U64, &o->c.max_iterations,
         "give up after this many loop iterations (20000000)", "[1,18446744073709551615]", NULL},
        {"seed", KVS_ARG_U64, &o->c.seed, "seed of the workload, faults and schedule (1)", NULL,
         NULL},
        {"json", KVS_ARG_FLAG, &o->json, "print one JSON object instead of the table", NULL, NULL},
    };
    KVS_ARG_TABLE_ADD(t, g);
}

static const char *sim_usage(int demo)
{
    return demo ? "kvstage demo [flags]\n"
                  "Runs the default simulation: prefill TP4 -> decode TP2, 8 KV heads, page 16, "
                  "chunk 256,\n200 shared-prefix requests with radix caches on both sides, every "
                  "byte verified.\nAccepts every `kvstage sim` flag."
                : "kvstage sim [flags]\n"
                  "Simulates one prefill and one decode instance over the in-process transport "
                  "on a\nvirtual clock; verifies every transferred byte and checks for leaks. "
                  "Exit 0 = pass.";
}

/* Ring, layout and pool flags into the config; 0, or 2 after saying why. */
static int build_layout(sim_opts_t *o)
{
    kvs_sim_config_t *c = &o->c;
    int rc = kvs_args_page_sizes(&o->pages, &c->page_size, &c->prefill_page_size);
    if (rc != 0) return rc;
    if (o->seen_ring_bytes && o->seen_ring_slots)
        return kvs_args_error("--ring-slots", "--ring-bytes or --ring-slots",
                              "excludes --ring-bytes");
    if (o->seen_ring_slots) c->ring_bytes = 0;
    if (o->seen_layout && (o->seen_pl || o->seen_dl))
        return kvs_args_error("--layout", "--layout, or --prefill-layout and --decode-layout",
                              "sets both sides: it excludes --prefill-layout and "
                              "--decode-layout");
    if (o->seen_layout) o->prefill_layout = o->decode_layout = o->layout;
    c->prefill_layout = (kvs_pool_layout_t) o->prefill_layout;
    c->decode_layout = (kvs_pool_layout_t) o->decode_layout;
    if (o->seen_pool) c->prefill_pool_pages = c->decode_pool_pages = o->pool_pages;
    return 0;
}

/* Timeouts (us on the command line, ns in the config) and faults; 0, or 2 after saying why. */
static int build_faults(sim_opts_t *o)
{
    kvs_sim_config_t *c = &o->c;
    if (o->seen_mis)
        c->misaligned_request = o->misaligned > INT64_MAX ? -1 : (int64_t) o->misaligned;
    c->workload.kind = (kvs_workload_kind_t) o->workload;
    c->write_delay_ns = o->write_delay_us * 1000;
    c->step_ns = o->step_us * 1000;
    /* The flag table bounds every microsecond value to what nanoseconds can hold. */
    const uint64_t *us = o->to_us;
    c->timeouts = (kvs_pd_timeouts_t){.retry_ns = us[0] * 1000,
                                      .bootstrap_timeout_ns = us[1] * 1000,
                                      .transfer_timeout_ns = us[2] * 1000,
                                      .waiting_timeout_ns = us[3] * 1000,
                                      .completion_timeout_ns = us[4] * 1000,
                                      .release_timeout_ns = us[5] * 1000};
    kvs_args_capture_t cap;
    kvs_args_capture_begin(&cap);
    kvs_status_t st = kvs_sim_faults_parse(o->faults, &c->faults);
    kvs_args_capture_end(&cap, st != KVS_OK);
    if (st != KVS_OK)
        return kvs_args_error("--faults", "a comma list of " KVS_SIM_FAULT_LIST, "%s",
                              cap.msg[0] ? cap.msg : kvs_status_str(st));
    c->no_checksum = !o->checksum;
    return 0;
}

/* Memory, GPUs and the KV shape; 0, or 2 after saying why. */
static int build_device_shape(sim_opts_t *o)
{
    kvs_sim_config_t *c = &o->c;
    c->mem = o->device ? KVS_MEM_DEVICE : KVS_MEM_HOST;
    c->write_mode = (kvs_write_mode_t) o->write_mode;
    if (o->seen_gpus && !o->device)
        return kvs_args_error("--gpus", "--gpus with --device cuda", "needs --device cuda");
    /* The in-process link maps only device rings: host rings take the delayable write path. */
    if (c->write_mode == KVS_WRITE_DIRECT && !o->device)
        return kvs_args_error("--write-mode", "direct with --device cuda",
                              "direct needs --device cuda (host rings are written through the "
                              "simulated transport)");
    if (kvs_args_parse_gpus(o->gpus, &c->prefill_device, &c->decode_device) != 0)
        return kvs_args_error("--gpus", KVS_ARGS_GPUS_ACCEPTED, "'%s' is malformed", o->gpus);
    c->shape.layers = o->layers;
    c->shape.elem_bytes = kvs_args_dtype_bytes(o->dtype_idx);
    if (o->mla) {
        if (o->seen_hdv || (o->seen_hdk && o->seen_hd))
            return kvs_args_error("--mla", "--head-dim or --head-dim-k, and no --head-dim-v",
                                  "takes the latent width from --head-dim (or --head-dim-k) and "
                                  "has no V dim");
        c->shape.attn = KVS_ATTN_MLA;
        c->shape.kv_heads = 1;
        c->shape.head_dim_k = o->seen_hd ? o->head_dim : o->seen_hdk ? o->head_dim_k : 64;
        c->shape.head_dim_v = 0;
    } else {
        c->shape.kv_heads = o->kv_heads;
        if (o->seen_hd) c->shape.head_dim_k = c->shape.head_dim_v = o->head_dim;
        if (o->seen_hdk) c->shape.head_dim_k = o->head_dim_k;
        if (o->seen_hdv) c->shape.head_dim_v = o->head_dim_v;
    }
    return 0;
}

/* Checks the parsed flags and builds o->c from them; 0, or 2 (a usage error) after saying why. */
static int sim_config_build(sim_opts_t *o)
{
    int rc;
    if ((rc = build_layout(o)) != 0 || (rc = build_faults(o)) != 0 ||
        (rc = build_device_shape(o)) != 0)
        return rc;
    const kvs_workload_config_t *w = &o->c.workload;
    if (w->kind == KVS_WORKLOAD_SHARED_PREFIX && w->prefix_len >= w->prompt_len)
        return kvs_args_error("--prefix-len", "below --prompt-len",
                              "%u is not below --prompt-len %u", w->prefix_len, w->prompt_len);
    const char *names[2] = {"--prefill-tp", "--decode-tp"};
    const uint32_t tps[2] = {o->c.prefill_tp, o->c.decode_tp};
    for (int i = 0; i < 2; i++) {
        kvs_args_capture_t cap;
        kvs_args_capture_begin(&cap);
        kvs_status_t st = kvs_tp_validate(&o->c.shape, &(kvs_tp_t){.tp_size = tps[i]});
        kvs_args_capture_end(&cap, st != KVS_OK);
        char sizes[512];
        if (st != KVS_OK)
            return kvs_args_error(names[i], kvs_args_tp_sizes(&o->c.shape, sizes, sizeof(sizes)),
                                  "%u: %s", tps[i], cap.msg);
    }
    const kvs_pd_geometry_t geo = kvs_sim_geometry(&o->c);
    return kvs_args_check_layout(&geo);
}

/* Runs the simulation and prints its result; the exit code: 0 pass, 1 fail, 2 a configuration
 * the library refused. name is the command, for the hint; `intro` (or NULL) leads the table, so
 * that it shows only once the configuration was accepted, never before a usage error. */
static int sim_run(kvs_sim_config_t *c, int json, const char *name, const char *intro)
{
    progress_t pr = {.tty = isatty(fileno(stderr))};
    if (!json && pr.tty) {
        c->progress = draw_progress;
        c->progress_arg = &pr;
    }
    kvs_sim_result_t r;
    /* A configuration the library refuses is a usage error: its reason goes in the one line. */
    kvs_args_capture_t cap;
    kvs_args_capture_begin(&cap);
    kvs_status_t st = kvs_sim_run(c, &r);
    const int refused =
        st == KVS_ERR_INVALID || st == KVS_ERR_INCOMPATIBLE || st == KVS_ERR_UNSUPPORTED;
    kvs_args_capture_end(&cap, refused);
    if (pr.drawn) fprintf(stderr, "\n");
    if (refused)
        return kvs_args_error(NULL, NULL, "%s (%s; see `kvstage %s --help`)",
                              cap.msg[0] ? cap.msg : "invalid configuration", kvs_status_str(st),
                              name);
    if (st != KVS_OK) {
        fprintf(stderr, "error: simulation could not run: %s\n", kvs_status_str(st));
        return 1;
    }
    int ok = kvs_sim_result_ok(&r);
    if (json) {
        print_json(c, &r, ok);
    } else {
        if (intro != NULL) printf("%s", intro);
        print_table(c, &r, ok);
    }
    if (!ok && !json) {
        char cmd[1024];
        kvs_sim_config_cmdline(c, cmd, sizeof(cmd));
        fprintf(stderr, "reproduce with: %s\n", cmd);
    }
    return ok ? 0 : 1;
}

int kvs_cmd_sim_intro(int argc, char **argv, const char *intro)
{
    sim_opts_t o;
    sim_opts_default(&o);
    kvs_arg_table_t t = {.count = 0};
    add_device_flags(&t, &o);
    add_shape_flags(&t, &o);
    add_layout_flags(&t, &o);
    add_workload_flags(&t, &o);
    add_fault_flags(&t, &o);
    add_run_flags(&t, &o);
    int rc = kvs_arg_table_parse(&t, sim_usage(strcmp(argv[0], "demo") == 0), argc, argv, 1);
    if (rc == KVS_ARGS_HELP) return 0;
    if (rc != KVS_ARGS_OK) return 2;
    if (sim_config_build(&o) != 0) return 2;
    return sim_run(&o.c, o.json, argv[0], intro);
}

int kvs_cmd_sim(int argc, char **argv)
{
    return kvs_cmd_sim_intro(argc, argv, NULL);
}
