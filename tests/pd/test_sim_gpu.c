/* The simulation's exactness suite on GPUs (`kvstage sim --device cuda`): pools, staging
 * buffers and rings in device memory, the CUDA copy kernels, inproc writes as CUDA copies and
 * direct writes of the gather kernel into the decode ring; prefill ranks on GPU 0 and decode
 * ranks on GPU 1 when there are two. A handful of the CPU scenarios (tests/pd/
 * test_sim_scenarios.c): TP fan-in and fan-out, replicated heads, MLA, page sizes 1 and 64 with
 * mixed layouts, hostile networks, aborts and timeouts with writes in flight, each staged and
 * direct, every room byte-exact and nothing leaked. A device simulation on a GPU the machine lacks
 * is refused cleanly; without a GPU the other tests report skipped. */
#include "kvs_test.h"

#include <string.h>

#include "base/mem.h"
#include "kvstage/log.h"
#include "sim/sim.h"

static kvs_sim_config_t gpu_config(kvs_write_mode_t mode)
{
    kvs_sim_config_t c;
    kvs_sim_config_default(&c);
    c.shape = (kvs_kv_shape_t){.layers = 2,
                               .kv_heads = 8,
                               .head_dim_k = 16,
                               .head_dim_v = 8,
                               .elem_bytes = 2,
                               .attn = KVS_ATTN_MHA};
    c.workload.requests = 24;
    c.workload.prompt_len = 600;
    c.workload.prefix_len = 250;
    c.concurrency = 12;
    c.max_iterations = 2000000;
    c.mem = KVS_MEM_DEVICE;
    c.prefill_device = 0;
    c.decode_device = kvs_mem_device_count() > 1 ? 1 : 0;
    c.write_mode = mode;
    return c;
}

static void dump(const kvs_sim_config_t *c, const kvs_sim_result_t *r)
{
    char cmd[1200];
    kvs_sim_config_cmdline(c, cmd, sizeof(cmd));
    print_message("reproduce: %s\n", cmd);
    print_message("result: %u/%u succeeded, %u failed (%u expected, %u unexpected), exact %d, "
                  "%llu mismatched bytes, leaks: slots %llu pages %llu rooms %llu allocs %llu, "
                  "chunks %llu (expected %llu), direct writes %llu of %llu, stalled %d\n",
                  r->succeeded, r->requests, r->failed, r->expected_failures,
                  r->unexpected_failures, r->exact, (unsigned long long) r->mismatched_bytes,
                  (unsigned long long) r->leaked_slots, (unsigned long long) r->leaked_pages,
                  (unsigned long long) r->leaked_rooms, (unsigned long long) r->leaked_allocs,
                  (unsigned long long) r->chunks, (unsigned long long) r->expected_chunks,
                  (unsigned long long) r->direct_writes, (unsigned long long) r->bulk_writes,
                  r->stalled);
}

/* Runs c; every room must succeed (all_succeed) or only fault rooms may fail. Staged runs must
 * issue no direct write; direct runs nothing else. */
static kvs_sim_result_t run(const kvs_sim_config_t *c, int all_succeed)
{
    kvs_sim_result_t r;
    assert_int_equal(kvs_sim_run(c, &r), KVS_OK);
    int ok = kvs_sim_result_ok(&r);
    if (all_succeed)
        ok = ok && r.succeeded == r.requests && r.chunks == r.expected_chunks &&
             r.rejected_messages == 0;
    if (c->write_mode == KVS_WRITE_STAGED) ok = ok && r.direct_writes == 0;
    if (c->write_mode == KVS_WRITE_DIRECT) ok = ok && r.direct_writes == r.bulk_writes;
    if (!ok) {
        dump(c, &r);
        fail_msg("the GPU simulation did not pass");
    }
    kvs_assert_no_leaks();
    return r;
}

static int have_gpu(void)
{
    if (kvs_mem_device_count() > 0) return 1;
    static int told;
    if (!told++) print_message("no CUDA device here: GPU simulation tests skipped\n");
    return 0;
}

/* A device simulation where the machine has no such GPU is refused before anything runs:
 * without CUDA or a GPU as unsupported, on a GPU machine (a GPU beyond the last) as invalid. */
static void test_refused_without_the_gpu(void **state)
{
    (void) state;
    const int count = kvs_mem_device_count();
    kvs_sim_config_t c = gpu_config(KVS_WRITE_AUTO);
    c.decode_device = count;
    kvs_log_capture_t cap = {0};
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    kvs_sim_result_t r;
    memset(&r, 0, sizeof(r));
    assert_int_equal(kvs_sim_run(&c, &r), count == 0 ? KVS_ERR_UNSUPPORTED : KVS_ERR_INVALID);
    kvs_log_set_sink(NULL, NULL);
    assert_true(cap.calls >= 1);
    assert_int_equal(r.requests, 0); /* the result is written only on success */
    kvs_assert_no_leaks();
}

/* The demo's shape (prefill TP4 -> decode TP2, NHD -> HND, radix hits on both sides): auto
 * picks direct writes where the prefill GPU reaches the decode ring; staged and direct too. */
static void test_fan_in_each_mode(void **state)
{
    (void) state;
    if (!have_gpu()) skip();
    for (int mode = KVS_WRITE_AUTO; mode <= KVS_WRITE_DIRECT; mode++) {
        kvs_sim_config_t c = gpu_config((kvs_write_mode_t) mode);
        c.seed = 500 + (uint64_t) mode;
        kvs_sim_result_t r = run(&c, 1);
        if (mode == KVS_WRITE_AUTO) assert_int_equal(r.direct_writes, r.bulk_writes);
        assert_true(r.decode_hit_tokens > 0 && r.prefill_hit_tokens > 0);
    }
}

/* Fan-out, a non-integer ratio with replicated prefill heads, MLA. */
static void test_tp_shapes(void **state)
{
    (void) state;
    if (!have_gpu()) skip();
    const struct {
        uint32_t heads, ptp, dtp;
        int mla;
    } shapes[] = {{8, 1, 4, 0}, {6, 3, 2, 0}, {2, 4, 1, 0}, {1, 2, 4, 1}};
    for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++) {
        kvs_sim_config_t c = gpu_config(i % 2 ? KVS_WRITE_STAGED : KVS_WRITE_DIRECT);
        if (shapes[i].mla)
            c.shape = (kvs_kv_shape_t){.layers = 2,
                                       .kv_heads = 1,
                                       .head_dim_k = 40,
                                       .elem_bytes = 2,
                                       .attn = KVS_ATTN_MLA};
        else
            c.shape.kv_heads = shapes[i].heads;
        c.prefill_tp = shapes[i].ptp;
        c.decode_tp = shapes[i].dtp;
        c.seed = 600 + i;
        run(&c, 1);
    }
}

/* Page size 1 (a page is one token row) and 64 (larger than some prompts' suffix), layouts
 * crossed, element size 1 and 4. */
static void test_pages_and_layouts(void **state)
{
    (void) state;
    if (!have_gpu()) skip();
    kvs_sim_config_t c = gpu_config(KVS_WRITE_AUTO);
    c.page_size = 1;
    c.chunk_tokens = 64;
    c.shape.elem_bytes = 1;
    c.workload.kind = KVS_WORKLOAD_NEEDLE;
    c.workload.prompt_len = 300;
    run(&c, 1);
    c = gpu_config(KVS_WRITE_STAGED);
    c.page_size = 64;
    c.chunk_tokens = 128;
    c.shape.elem_bytes = 4;
    c.prefill_layout = KVS_POOL_HND;
    c.decode_layout = KVS_POOL_NHD;
    run(&c, 1);
}

/* Reordered, duplicated and dropped control messages with late-landing (staged) writes; then
 * the same network with direct writes. */
static void test_hostile_network(void **state)
{
    (void) state;
    if (!have_gpu()) skip();
    for (int mode = KVS_WRITE_STAGED; mode <= KVS_WRITE_DIRECT; mode++) {
        kvs_sim_config_t c = gpu_config((kvs_write_mode_t) mode);
        c.faults = KVS_SIM_FAULT_REORDER | KVS_SIM_FAULT_DUP | KVS_SIM_FAULT_DROP;
        c.ring_slots = 2;
        c.seed = 700 + (uint64_t) mode;
        kvs_sim_result_t r = run(&c, 1);
        assert_true(r.net_dropped > 0 && r.net_duplicated > 0);
    }
}

/* Aborts mid-transfer and stalled prefills while writes (or direct gathers) are in flight:
 * failures stay local, quarantined slots come back, nothing leaks. */
static void test_aborts_and_timeouts(void **state)
{
    (void) state;
    if (!have_gpu()) skip();
    for (int mode = KVS_WRITE_STAGED; mode <= KVS_WRITE_DIRECT; mode++) {
        kvs_sim_config_t c = gpu_config((kvs_write_mode_t) mode);
        c.faults = KVS_SIM_FAULT_ABORT | KVS_SIM_FAULT_TIMEOUT | KVS_SIM_FAULT_REORDER;
        c.fault_rooms = 4;
        c.ring_slots = 2;
        c.timeouts.waiting_timeout_ns = 20000 * c.tick_ns;
        c.seed = 800 + (uint64_t) mode;
        kvs_sim_result_t r = run(&c, 0);
        assert_true(r.expected_failures > 0);
        assert_int_equal(r.unexpected_failures, 0);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_refused_without_the_gpu),
        cmocka_unit_test(test_fan_in_each_mode),
        cmocka_unit_test(test_tp_shapes),
        cmocka_unit_test(test_pages_and_layouts),
        cmocka_unit_test(test_hostile_network),
        cmocka_unit_test(test_aborts_and_timeouts),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
