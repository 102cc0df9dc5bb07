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
    kvs_json_u64(&j, "decode_tp", c->decode_tp);
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

static void print_table(const kvs_sim_config_t *c, const kvs_sim_result_t *r, int ok)
{
    char faults[64];
    kvs_sim_faults_str(c->faults, faults, sizeof(faults));
    const kvs_kv_shape_t *s = &c->shape;
    if (s->attn == KVS_ATTN_MLA)
        printf("kvstage sim: prefill TP%u -> decode TP%u, MLA latent %u x %u layers x %u B, "
               "page %u, chunk %u\n",
               c->prefill_tp, c->decode_tp, s->head_dim_k, s->layers, s->elem_bytes, c->page_size,
               c->chunk_tokens);
    else
        printf("kvstage sim: prefill TP%u -> decode TP%u, %u KV heads x %u layers x %u/%u dim x "
               "%u B, page %u, chunk %u\n",
               c->prefill_tp, c->decode_tp, s->kv_heads, s->layers, s->head_dim_k, s->head_dim_v,
               s->elem_bytes, c->page_size, c->chunk_tokens);
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
    printf("\n%s\n",
           ok ? "PASS: every room that should succeed succeeded byte-exact, nothing leaked"
              : "FAIL");
}

int kvs_cmd_sim(int argc, char **argv)
{
    kvs_sim_config_t c;
    kvs_sim_config_default(&c);
    const int demo = strcmp(argv[0], "demo") == 0;
    const char *usage =
        demo ? "kvstage demo [flags]\n"
               "Runs the default simulation: prefill TP4 -> decode TP2, 8 KV heads, page 16, "
               "chunk 256,\n200 shared-prefix requests with radix caches on both sides, every "
               "byte verified.\nAccepts every `kvstage sim` flag."
             : "kvstage sim [flags]\n"
               "Simulates one prefill and one decode instance over the in-process transport "
               "on a\nvirtual clock; verifies every transferred byte and checks for leaks. "
               "Exit 0 = pass.";
    uint32_t kv_heads = c.shape.kv_heads, layers = c.shape.layers, dtype = c.shape.elem_bytes;
    uint32_t head_dim = 0, head_dim_k = 0, head_dim_v = 0;
    int mla = 0, json = 0, seen_ring_bytes = 0, seen_ring_slots = 0, seen_hd = 0, seen_hdk = 0,
        seen_hdv = 0, seen_layout = 0, seen_pl = 0, seen_dl = 0;
    int layout = 0, prefill_layout = c.prefill_layout, decode_layout = c.decode_layout;
    int workload = c.workload.kind;
    const char *faults = "none";
    uint32_t pool_pages = 0;
    uint64_t misaligned = UINT64_MAX;
    int seen_pool = 0, seen_mis = 0;
    uint64_t to_us[6] = {0}; /* retry, bootstrap, transfer, waiting, completion, release */
    uint64_t write_delay_us = 0, step_us = c.step_ns / 1000;
    int device = 0, write_mode = 0, seen_gpus = 0;
    const char *gpus = "0";
    const kvs_arg_t args[] = {
        {"device", KVS_ARG_CHOICE, &device,
         "where pools, rings and staging buffers live: host memory with CPU copies, or CUDA "
         "devices with the copy kernels (cpu)",
         "cpu|cuda", NULL},
        {"gpus", KVS_ARG_STR, &gpus,
         "with --device cuda: GPU of the prefill ranks, then of the decode ranks (0 = both on "
         "GPU 0; 0,1 = prefill on 0, decode on 1)",
         NULL, &seen_gpus},
        {"write-mode", KVS_ARG_CHOICE, &write_mode,
         "auto: gather straight into the decode ring where the link maps it (device rings); "
         "staged: always through a staging buffer; direct: always straight (auto)",
         "auto|staged|direct", NULL},
        {"prefill-tp", KVS_ARG_U32, &c.prefill_tp, "prefill TP size (4)", NULL, NULL},
        {"decode-tp", KVS_ARG_U32, &c.decode_tp, "decode TP size (2)", NULL, NULL},
        {"kv-heads", KVS_ARG_U32, &kv_heads, "KV heads (8)", NULL, NULL},
        {"layers", KVS_ARG_U32, &layers, "layers (4)", NULL, NULL},
        {"head-dim", KVS_ARG_U32, &head_dim, "head dim for K and V, or the MLA latent (32)", NULL,
         &seen_hd},
        {"head-dim-k", KVS_ARG_U32, &head_dim_k, "K head dim", NULL, &seen_hdk},
        {"head-dim-v", KVS_ARG_U32, &head_dim_v, "V head dim", NULL, &seen_hdv},
        {"dtype-bytes", KVS_ARG_U32, &dtype, "element size in bytes: 1, 2 or 4 (2)", NULL, NULL},
        {"mla", KVS_ARG_FLAG, &mla, "MLA: one latent per token and layer, on every rank", NULL,
         NULL},
        {"page-size", KVS_ARG_U32, &c.page_size, "tokens per page (16)", NULL, NULL},
        {"chunk", KVS_ARG_U32, &c.chunk_tokens, "chunked-prefill tokens (256)", NULL, NULL},
        {"ring-bytes", KVS_ARG_U64, &c.ring_bytes, "staging ring bytes per decode rank", NULL,
         &seen_ring_bytes},
        {"ring-slots", KVS_ARG_U32, &c.ring_slots, "staging ring size in full slots (8)", NULL,
         &seen_ring_slots},
        {"layout", KVS_ARG_CHOICE, &layout, "pool layout of both sides", "nhd|hnd", &seen_layout},
        {"prefill-layout", KVS_ARG_CHOICE, &prefill_layout, "prefill pool layout (nhd)", "nhd|hnd",
         &seen_pl},
        {"decode-layout", KVS_ARG_CHOICE, &decode_layout, "decode pool layout (hnd)", "nhd|hnd",
         &seen_dl},
        {"pool-pages", KVS_ARG_U32, &pool_pages, "pages per rank on both sides (auto)", NULL,
         &seen_pool},
        {"prefill-pool-pages", KVS_ARG_U32, &c.prefill_pool_pages,
         "pages per prefill rank (0 = auto)", NULL, NULL},
        {"decode-pool-pages", KVS_ARG_U32, &c.decode_pool_pages, "pages per decode rank (0 = auto)",
         NULL, NULL},
        {"window", KVS_ARG_U32, &c.window_chunks, "chunks per room with a slot request out (2)",
         NULL, NULL},
        {"staging-buffers", KVS_ARG_U32, &c.staging_buffers, "gather buffers per prefill rank (2)",
         NULL, NULL},
        {"prefill-batch", KVS_ARG_U32, &c.prefill_batch, "rooms per prefill forward pass (16)",
         NULL, NULL},
        {"requests", KVS_ARG_U32, &c.workload.requests, "requests (200)", NULL, NULL},
        {"concurrency", KVS_ARG_U32, &c.concurrency, "requests in flight (128)", NULL, NULL},
        {"workload", KVS_ARG_CHOICE, &workload, "workload (shared-prefix)",
         "shared-prefix|multi-turn|random|needle", NULL},
        {"prompt-len", KVS_ARG_U32, &c.workload.prompt_len, "longest prompt in tokens (2000)", NULL,
         NULL},
        {"prefix-len", KVS_ARG_U32, &c.workload.prefix_len, "shared prefix tokens (900)", NULL,
         NULL},
        {"groups", KVS_ARG_U32, &c.workload.groups, "prefix groups / documents / clients (auto)",
         NULL, NULL},
        {"repeat-permille", KVS_ARG_U32, &c.workload.repeat_permille,
         "chance (per mille) a request repeats an earlier prompt (0)", NULL, NULL},
        {"decode-radix", KVS_ARG_ONOFF, &c.decode_radix, "decode radix cache (on)", NULL, NULL},
        {"prefill-radix", KVS_ARG_ONOFF, &c.prefill_radix, "prefill radix cache (on)", NULL, NULL},
        {"faults", KVS_ARG_STR, &faults, "comma list of none|reorder|dup|drop|abort|timeout (none)",
         NULL, NULL},
        {"fault-rooms", KVS_ARG_U32, &c.fault_rooms, "rooms hit per abort/timeout fault (auto)",
         NULL, NULL},
        {"misaligned-request", KVS_ARG_U64, &misaligned,
         "give this request a misaligned decode prefix (test hook)", NULL, &seen_mis},
        {"retry-us", KVS_ARG_U64, &to_us[0], "control message retry period, virtual us (200)", NULL,
         NULL},
        {"bootstrap-timeout-us", KVS_ARG_U64, &to_us[1], "virtual us (2000000)", NULL, NULL},
        {"transfer-timeout-us", KVS_ARG_U64, &to_us[2], "virtual us (2000000)", NULL, NULL},
        {"waiting-timeout-us", KVS_ARG_U64, &to_us[3], "virtual us (1000000)", NULL, NULL},
        {"completion-timeout-us", KVS_ARG_U64, &to_us[4], "virtual us (200000)", NULL, NULL},
        {"release-timeout-us", KVS_ARG_U64, &to_us[5], "virtual us (100000)", NULL, NULL},
        {"write-delay-us", KVS_ARG_U64, &write_delay_us,
         "data writes land up to this late, virtual us (20 under reorder, else 0)", NULL, NULL},
        {"step-us", KVS_ARG_U64, &step_us, "virtual us of one prefill forward pass (50)", NULL,
         NULL},
        {"max-iterations", KVS_ARG_U64, &c.max_iterations,
         "give up after this many loop iterations (20000000)", NULL, NULL},
        {"seed", KVS_ARG_U64, &c.seed, "seed of the workload, faults and schedule (1)", NULL, NULL},
        {"json", KVS_ARG_FLAG, &json, "print one JSON object instead of the table", NULL, NULL},
    };
    const size_t nargs = sizeof(args) / sizeof(args[0]);
    int rc = kvs_args_parse(usage, args, nargs, argc, argv, 1);
    if (rc == KVS_ARGS_HELP) return 0;
    if (rc != KVS_ARGS_OK) return 2;
    if (seen_ring_bytes && seen_ring_slots) {
        fprintf(stderr, "error: --ring-bytes and --ring-slots are exclusive; give one\n");
        return 2;
    }
    if (seen_ring_bytes && c.ring_bytes == 0) {
        fprintf(stderr, "error: --ring-bytes must be > 0\n");
        return 2;
    }
    if (seen_ring_slots) c.ring_bytes = 0;
    if (seen_layout && (seen_pl || seen_dl)) {
        fprintf(stderr, "error: --layout sets both sides; do not combine it with "
                        "--prefill-layout/--decode-layout\n");
        return 2;
    }
    if (seen_layout) prefill_layout = decode_layout = layout;
    c.prefill_layout = (kvs_pool_layout_t) prefill_layout;
    c.decode_layout = (kvs_pool_layout_t) decode_layout;
    if (seen_pool) c.prefill_pool_pages = c.decode_pool_pages = pool_pages;
    if (seen_mis) c.misaligned_request = misaligned > INT64_MAX ? -1 : (int64_t) misaligned;
    c.workload.kind = (kvs_workload_kind_t) workload;
    c.write_delay_ns = write_delay_us * 1000;
    c.step_ns = step_us * 1000;
    for (int i = 0; i < 6; i++) {
        if (to_us[i] > UINT64_MAX / 1000 || write_delay_us > UINT64_MAX / 1000 ||
            step_us > UINT64_MAX / 1000) {
            fprintf(stderr, "error: timeout of %llu us is too large\n",
                    (unsigned long long) to_us[i]);
            return 2;
        }
    }
    c.timeouts = (kvs_pd_timeouts_t){.retry_ns = to_us[0] * 1000,
                                     .bootstrap_timeout_ns = to_us[1] * 1000,
                                     .transfer_timeout_ns = to_us[2] * 1000,
                                     .waiting_timeout_ns = to_us[3] * 1000,
                                     .completion_timeout_ns = to_us[4] * 1000,
                                     .release_timeout_ns = to_us[5] * 1000};
    if (kvs_sim_faults_parse(faults, &c.faults) != KVS_OK) return 2; /* it said why */
    c.mem = device ? KVS_MEM_DEVICE : KVS_MEM_HOST;
    c.write_mode = (kvs_write_mode_t) write_mode;
    if (seen_gpus && !device) {
        fprintf(stderr, "error: --gpus needs --device cuda\n");
        return 2;
    }
    if (kvs_args_parse_gpus(gpus, &c.prefill_device, &c.decode_device) != 0) {
        fprintf(stderr, "error: --gpus takes one or two GPU ordinals, e.g. 0 or 0,1 (got '%s')\n",
                gpus);
        return 2;
    }
    c.shape.layers = layers;
    c.shape.elem_bytes = dtype;
    if (mla) {
        if (seen_hdv || (seen_hdk && seen_hd)) {
            fprintf(stderr, "error: --mla takes the latent width from --head-dim (or "
                            "--head-dim-k) and has no V dim\n");
            return 2;
        }
        c.shape.attn = KVS_ATTN_MLA;
        c.shape.kv_heads = 1;
        c.shape.head_dim_k = seen_hd ? head_dim : seen_hdk ? head_dim_k : 64;
        c.shape.head_dim_v = 0;
    } else {
        c.shape.kv_heads = kv_heads;
        if (seen_hd) c.shape.head_dim_k = c.shape.head_dim_v = head_dim;
        if (seen_hdk) c.shape.head_dim_k = head_dim_k;
        if (seen_hdv) c.shape.head_dim_v = head_dim_v;
    }
    if (c.workload.kind == KVS_WORKLOAD_SHARED_PREFIX &&
        c.workload.prefix_len >= c.workload.prompt_len) {
        fprintf(stderr, "error: --prefix-len (%u) must be below --prompt-len (%u)\n",
                c.workload.prefix_len, c.workload.prompt_len);
        return 2;
    }
    if (c.workload.repeat_permille > 1000) {
        fprintf(stderr, "error: --repeat-permille must be <= 1000\n");
        return 2;
    }

    progress_t pr = {.tty = isatty(fileno(stderr))};
    if (!json && pr.tty) {
        c.progress = draw_progress;
        c.progress_arg = &pr;
    }
    kvs_sim_result_t r;
    kvs_status_t st = kvs_sim_run(&c, &r);
    if (pr.drawn) fprintf(stderr, "\n");
    if (st == KVS_ERR_INVALID || st == KVS_ERR_INCOMPATIBLE || st == KVS_ERR_UNSUPPORTED) {
        fprintf(stderr,
                "error: invalid configuration (%s); see the message above and "
                "`kvstage %s --help`\n",
                kvs_status_str(st), argv[0]);
        return 2;
    }
    if (st != KVS_OK) {
        fprintf(stderr, "error: simulation could not run: %s\n", kvs_status_str(st));
        return 1;
    }
    int ok = kvs_sim_result_ok(&r);
    if (json)
        print_json(&c, &r, ok);
    else
        print_table(&c, &r, ok);
    if (!ok && !json) {
        char cmd[1024];
        kvs_sim_config_cmdline(&c, cmd, sizeof(cmd));
        fprintf(stderr, "reproduce with: %s\n", cmd);
    }
    return ok ? 0 : 1;
}
