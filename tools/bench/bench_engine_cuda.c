/* `kvstage bench engine --device cuda`, the model part: the CUDA forward pass of seeded models
 * (Llama-3-8B's shape and SmolLM2's) timed in this process, beside the limits measured in the
 * same run: a cuBLAS bf16 GEMM of the model's largest projection (the FLOP/s ceiling of
 * prefill) and a device-to-device copy (the HBM ceiling of decode, bytes read plus written).
 *
 * Prefill rows: one sequence of N prompt tokens in one forward call; model FLOPs are the
 * projections' 2 x tokens x weights plus causal attention's 4 x layers x heads x head_dim x
 * N (N + 1) / 2, and MFU is their rate over the GEMM ceiling. Decode rows: B sequences of C
 * cached positions each, one token each per call; a call reads every weight once and each
 * sequence's K and V, and the roofline is those bytes at the copy rate. Every call samples its
 * sequences' next tokens greedily on the device, as the engine does for a greedy request. Medians
 * of the timed calls after one warm-up. */
#include "bench/bench_engine.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/json.h"
#include "kvstage/alloc.h"
#include "kvstage/clock.h"
#include "kvstage/pool.h"
#include "model/cuda/model_cuda.h"
#include "model/model.h"

typedef struct {
    const char *name;
    kvs_model_config_t c;
} shape_t;

static const shape_t shapes[] = {
    {"Llama-3-8B", {32, 4096, 14336, 32, 8, 128, 128256, 32768, 500000.0f, 1e-5f}},
    {"SmolLM2-135M", {30, 576, 1536, 9, 3, 64, 49152, 32768, 100000.0f, 1e-5f}},
};
static const uint32_t prefill_lens[] = {512, 4096, 16384};
static const uint32_t decode_batches[] = {1, 8, 32, 128};
#define MAX_BATCH 128

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *) a, y = *(const uint64_t *) b;
    return x < y ? -1 : x > y;
}

/* Bytes of the matrices one forward call reads (bf16), and their multiply-add count per token
 * (the output projection is counted once per sequence, apart). */
static double layer_weights(const kvs_model_config_t *c)
{
    const double q = (double) c->heads * c->head_dim, kv = (double) c->kv_heads * c->head_dim;
    return c->dim * (q + 2 * kv) + q * c->dim + 3.0 * c->dim * c->ffn_dim;
}

typedef struct {
    kvs_model_t *m;
    kvs_pool_t *pool;
    uint32_t *pages; /* [MAX_BATCH][per] */
    uint32_t per;    /* pages per sequence */
    uint32_t *tokens;
    float *logits;
} rig_t;

static int rig_open(rig_t *r, const kvs_model_config_t *c, int gpu, uint32_t seq_tokens,
                    uint32_t nseq)
{
    memset(r, 0, sizeof(*r));
    if (kvs_model_seeded_on(c, 1, (kvs_tp_t){1, 0}, gpu, &r->m) != KVS_OK) return -1;
    const uint32_t P = 16;
    r->per = (seq_tokens + P) / P;
    kvs_pool_config_t pc = {.shape = kvs_model_kv_shape(r->m),
                            .tp = {1, 0},
                            .page_size = P,
                            .num_pages = r->per * nseq,
                            .layout = KVS_POOL_NHD,
                            .mem = KVS_MEM_DEVICE,
                            .device = gpu};
    r->pages = kvs_calloc((size_t) r->per * nseq, sizeof(uint32_t));
    r->tokens = kvs_calloc((size_t) seq_tokens + 1, sizeof(uint32_t));
    r->logits = kvs_calloc((size_t) nseq * c->vocab, sizeof(float));
    if (r->pages == NULL || r->tokens == NULL || r->logits == NULL ||
        kvs_pool_create(&pc, &r->pool) != KVS_OK ||
        kvs_pool_alloc(r->pool, r->per * nseq, r->pages) != KVS_OK)
        return -1;
    for (uint32_t i = 0; i <= seq_tokens; i++) r->tokens[i] = (i * 2654435761u) % c->vocab;
    return 0;
}

static void rig_close(rig_t *r)
{
    kvs_free(r->pages);
    kvs_free(r->tokens);
    kvs_free(r->logits);
    kvs_pool_destroy(r->pool);
    kvs_model_destroy(r->m);
}

/* Median ns of `reps` calls (after one warm-up) of sequences first .. first + nseq - 1, n
 * tokens each at pos0; 0 when a call failed. */
static uint64_t time_calls(rig_t *r, uint32_t first, uint32_t nseq, uint32_t n, uint32_t pos0,
                           int reps)
{
    /* Greedy on the device, as the engine samples a greedy request: only tokens come back. */
    static const kvs_sample_params_t greedy = {.top_p = 1.0f};
    kvs_model_seq_t seqs[MAX_BATCH];
    uint32_t tok[MAX_BATCH];
    for (uint32_t i = 0; i < nseq; i++)
        seqs[i] = (kvs_model_seq_t){.tokens = r->tokens + pos0,
                                    .n = n,
                                    .pos0 = pos0,
                                    .pages = r->pages + (size_t) (first + i) * r->per,
                                    .npages = r->per,
                                    .sample = &greedy,
                                    .token = &tok[i]};
    uint64_t t[16];
    for (int k = 0; k <= reps; k++) {
        const uint64_t t0 = kvs_now_ns();
        if (kvs_model_forward(r->m, r->pool, seqs, nseq, NULL, NULL, r->logits) != KVS_OK) return 0;
        t[k] = kvs_now_ns() - t0;
    }
    if (reps == 0) return t[0];
    qsort(t + 1, (size_t) reps, sizeof(uint64_t), cmp_u64);
    return t[1 + reps / 2];
}

/* Where a decode step's device time goes, at batch 1 and the largest batch: the same calls
 * run eagerly with an event after every op (kvs__model_cuda_profile), so the sum is a little
 * above the graph-replayed time of the table. */
static int breakdown(rig_t *r, uint32_t ctx, int json, kvs_json_t *j, const char *name)
{
    const uint32_t batches[] = {1, MAX_BATCH};
    kvs_model_cuda_t *cu = r->m->cuda;
    for (size_t b = 0; b < 2; b++) {
        double ms[KVS_CUDA_OPS];
        uint64_t calls = 0;
        if (kvs__model_cuda_profile(cu, 1) != KVS_OK) return 1;
        const int ok = time_calls(r, 0, batches[b], 1, ctx, 5) != 0;
        kvs__model_cuda_profile_read(cu, ms, &calls);
        kvs__model_cuda_profile(cu, 0);
        if (!ok || calls == 0) return 1;
        double total = 0;
        for (int k = 0; k < KVS_CUDA_OPS; k++) total += ms[k] / calls;
        if (json) {
            kvs_json_object_begin(j, NULL);
            kvs_json_str(j, "model", name);
            kvs_json_str(j, "step", "decode breakdown");
            kvs_json_u64(j, "batch", batches[b]);
            for (int k = 0; k < KVS_CUDA_OPS; k++)
                kvs_json_double(j, kvs__model_cuda_op_name((kvs_cuda_op_t) k), ms[k] / calls);
            kvs_json_object_end(j);
            continue;
        }
        printf("%-13s decode batch %u, eager with events: %.3f ms =", name, batches[b], total);
        for (int k = 0; k < KVS_CUDA_OPS; k++)
            if (ms[k] > 0)
                printf(" %s %.3f (%.0f%%)%s", kvs__model_cuda_op_name((kvs_cuda_op_t) k),
                       ms[k] / calls, 100 * ms[k] / calls / total, k + 1 < KVS_CUDA_OPS ? "," : "");
        printf("\n");
    }
    return 0;
}

int kvs_bench_engine_cuda_model(int gpu, int json, kvs_json_t *j)
{
    double flops = 0, bw = 0;
    const kvs_model_config_t *big = &shapes[0].c;
    if (kvs__model_cuda_gemm_flops(gpu, 4096, 2 * big->ffn_dim, big->dim, &flops) != KVS_OK ||
        kvs__model_cuda_copy_bytes_s(gpu, (size_t) 1 << 30, &bw) != KVS_OK) {
        fprintf(stderr, "error: bench engine --device cuda: GPU %d is not usable\n", gpu);
        return -1;
    }
    if (json) {
        kvs_json_double(j, "gemm_ceiling_tflops", flops / 1e12);
        kvs_json_double(j, "copy_ceiling_gb_s", bw / 1e9);
        kvs_json_array_begin(j, "model_rows");
    } else {
        printf("kvstage bench engine --device cuda: the CUDA forward pass, seeded weights, one "
               "process on GPU %d\nlimits measured now: cuBLAS bf16 GEMM 4096 x %u x %u = %.0f "
               "TFLOP/s; device copy %.0f GB/s (read + written)\n\n",
               gpu, 2 * big->ffn_dim, big->dim, flops / 1e12, bw / 1e9);
        printf("%-13s %-18s %10s %12s %14s %9s\n", "model", "step", "time ms", "tok/s", "achieved",
               "of limit");
    }
    int failed = 0;
    for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
        const kvs_model_config_t *c = &shapes[s].c;
        const double lw = layer_weights(c);
        /* prefill: one sequence */
        rig_t r;
        const uint32_t longest = prefill_lens[sizeof(prefill_lens) / sizeof(prefill_lens[0]) - 1];
        if (rig_open(&r, c, gpu, longest, 1) != 0) {
            rig_close(&r);
            fprintf(stderr, "error: %s does not fit on GPU %d\n", shapes[s].name, gpu);
            failed = 1;
            continue;
        }
        for (size_t k = 0; k < sizeof(prefill_lens) / sizeof(prefill_lens[0]); k++) {
            const uint32_t n = prefill_lens[k];
            const uint64_t ns = time_calls(&r, 0, 1, n, 0, 3);
            const double fl = 2.0 * n * lw * c->layers + 2.0 * c->dim * c->vocab +
                              4.0 * c->layers * c->heads * c->head_dim * (double) n * (n + 1) / 2;
            const double rate = ns ? fl / (ns * 1e-9) : 0;
            char step[32];
            snprintf(step, sizeof(step), "prefill %u", n);
            failed |= ns == 0;
            if (json) {
                kvs_json_object_begin(j, NULL);
                kvs_json_str(j, "model", shapes[s].name);
                kvs_json_str(j, "step", "prefill");
                kvs_json_u64(j, "tokens", n);
                kvs_json_double(j, "ms", ns / 1e6);
                kvs_json_double(j, "tflops", rate / 1e12);
                kvs_json_double(j, "mfu", rate / flops);
                kvs_json_object_end(j);
            } else {
                printf("%-13s %-18s %10.2f %12.0f %8.0f TFLOP/s %8.1f%%\n", shapes[s].name, step,
                       ns / 1e6, ns ? n / (ns * 1e-9) : 0, rate / 1e12, 100 * rate / flops);
            }
            fflush(stdout);
        }
        rig_close(&r);
        /* decode: B sequences of a 1024-token context */
        const uint32_t ctx = 1024;
        if (rig_open(&r, c, gpu, ctx + 8, MAX_BATCH) != 0) {
            rig_close(&r);
            fprintf(stderr, "error: %s decode does not fit on GPU %d\n", shapes[s].name, gpu);
            failed = 1;
            continue;
        }
        for (uint32_t b = 0; b < MAX_BATCH; b += 8) /* fill the contexts */
            failed |= time_calls(&r, b, 8, ctx, 0, 0) == 0;
        const double kv_tok = 2.0 * c->layers * c->kv_heads * c->head_dim * 2;
        for (size_t k = 0; k < sizeof(decode_batches) / sizeof(decode_batches[0]); k++) {
            const uint32_t B = decode_batches[k];
            const uint64_t ns = time_calls(&r, 0, B, 1, ctx, 5);
            const double bytes =
                2.0 * (lw * c->layers + (double) c->dim * c->vocab) + B * kv_tok * (ctx + 1);
            const double roof = bytes / bw;
            char step[32];
            snprintf(step, sizeof(step), "decode batch %u", B);
            failed |= ns == 0;
            if (json) {
                kvs_json_object_begin(j, NULL);
                kvs_json_str(j, "model", shapes[s].name);
                kvs_json_str(j, "step", "decode");
                kvs_json_u64(j, "batch", B);
                kvs_json_u64(j, "context", ctx);
                kvs_json_double(j, "ms", ns / 1e6);
                kvs_json_double(j, "gb_s", ns ? bytes / (ns * 1e-9) / 1e9 : 0);
                kvs_json_double(j, "of_roofline", ns ? roof / (ns * 1e-9) : 0);
                kvs_json_object_end(j);
            } else {
                printf("%-13s %-18s %10.3f %12.0f %10.0f GB/s %8.1f%%\n", shapes[s].name, step,
                       ns / 1e6, ns ? B / (ns * 1e-9) : 0, ns ? bytes / (ns * 1e-9) / 1e9 : 0,
                       ns ? 100 * roof / (ns * 1e-9) : 0);
            }
            fflush(stdout);
        }
        failed |= breakdown(&r, ctx, json, j, shapes[s].name);
        rig_close(&r);
    }
    if (json)
        kvs_json_array_end(j);
    else
        printf("\nprefill: one sequence per call, MFU against the GEMM above; decode: one token "
               "for each of B sequences\nwith 1024 cached positions, weights + KV read per call "
               "against the copy rate (the roofline)\n\n");
    return failed;
}
