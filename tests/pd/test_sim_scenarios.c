/* Whole-system protocol scenarios through the simulation (kvs_sim_run): the configuration of the
 * original fix, every TP shape class, page and ring extremes, radix hits of every kind, and
 * failures that must stay local to their room and leak nothing. Direct message-level tests of
 * the sender and receiver live in test_sender.c and test_receiver.c. */
#include "kvs_test.h"

#include <string.h>

#include "kvstage/log.h"
#include "sim/engine.h"
#include "sim/sim.h"

/* A small model shape so that many scenarios fit in a few seconds, even under ASan. */
static kvs_sim_config_t small_config(void)
{
    kvs_sim_config_t c;
    kvs_sim_config_default(&c);
    c.shape = (kvs_kv_shape_t){.layers = 2,
                               .kv_heads = 8,
                               .head_dim_k = 16,
                               .head_dim_v = 8,
                               .elem_bytes = 2,
                               .attn = KVS_ATTN_MHA};
    c.workload.requests = 40;
    c.workload.prompt_len = 700;
    c.workload.prefix_len = 300;
    c.concurrency = 16;
    c.max_iterations = 2000000;
    return c;
}

static void dump(const kvs_sim_config_t *c, const kvs_sim_result_t *r)
{
    char cmd[1024];
    kvs_sim_config_cmdline(c, cmd, sizeof(cmd));
    print_message("reproduce: %s\n", cmd);
    print_message("result: %u/%u succeeded, %u failed (%u expected, %u unexpected), exact %d, "
                  "%llu mismatched bytes, %u bad metadata, leaks: slots %llu pages %llu rooms "
                  "%llu allocs %llu, chunks %llu (expected %llu), stalled %d\n",
                  r->succeeded, r->requests, r->failed, r->expected_failures,
                  r->unexpected_failures, r->exact, (unsigned long long) r->mismatched_bytes,
                  r->meta_mismatches, (unsigned long long) r->leaked_slots,
                  (unsigned long long) r->leaked_pages, (unsigned long long) r->leaked_rooms,
                  (unsigned long long) r->leaked_allocs, (unsigned long long) r->chunks,
                  (unsigned long long) r->expected_chunks, r->stalled);
}

/* Runs a configuration that must fully succeed: every room byte-exact, every chunk scattered
 * exactly once, nothing leaked. */
static kvs_sim_result_t run_all_succeed(const kvs_sim_config_t *c)
{
    kvs_sim_result_t r;
    assert_int_equal(kvs_sim_run(c, &r), KVS_OK);
    if (!kvs_sim_result_ok(&r) || r.succeeded != r.requests || r.chunks != r.expected_chunks ||
        r.rejected_messages != 0) {
        dump(c, &r);
        fail_msg("the simulation did not fully succeed");
    }
    assert_true(r.bulk_writes > 0 || r.expected_chunks == 0);
    kvs_assert_no_leaks();
    return r;
}

/* Runs a configuration where only fault rooms may fail: the rest must be exact and nothing may
 * leak. */
static kvs_sim_result_t run_local_failures(const kvs_sim_config_t *c)
{
    kvs_sim_result_t r;
    assert_int_equal(kvs_sim_run(c, &r), KVS_OK);
    if (!kvs_sim_result_ok(&r)) {
        dump(c, &r);
        fail_msg("a failure was not local to its room, or something leaked");
    }
    kvs_assert_no_leaks();
    return r;
}

/* The configuration of the original bug: prefill TP4 -> decode TP2, chunk 256, page 16, decode
 * radix on, a ~900-token shared prefix that spans several slots, 200 requests with 128 in
 * flight. Prefix hits end off the grid on both sides, so sends straddle slots unless they are
 * split per slot. */
static void test_original_fix_configuration(void **state)
{
    (void) state;
    kvs_sim_config_t c = small_config();
    c.prefill_tp = 4;
    c.decode_tp = 2;
    c.chunk_tokens = 256;
    c.page_size = 16;
    c.decode_radix = 1;
    c.prefill_radix = 1;
    c.workload.kind = KVS_WORKLOAD_SHARED_PREFIX;
    c.workload.requests = 200;
    c.workload.prompt_len = 2000;
    c.workload.prefix_len = 900;
    c.concurrency = 128;
    kvs_sim_result_t r = run_all_succeed(&c);
    assert_int_equal(r.succeeded, 200);
    assert_true(r.decode_hit_tokens > 0);  /* decode held prefixes ... */
    assert_true(r.prefill_hit_tokens > 0); /* ... and so did prefill */
    assert_true(r.ring_high_water > 0);
    /* Staging makes one bulk write per chunk and destination instead of per page. */
    assert_true(r.per_page_writes > 20 * r.bulk_writes);
}

static void test_tp_shapes(void **state)
{
    (void) state;
    static const struct {
        uint32_t heads, ptp, dtp;
    } shapes[] = {
        {8, 2, 4},            /* fan-out */
        {8, 1, 1},            /* equal, single rank */
        {8, 4, 4},            /* equal */
        {4, 8, 2},            /* prefill replicates heads (one replica ships) */
        {4, 2, 8},            /* decode replicates heads (each replica receives) */
        {6, 3, 2},            /* non-integer ratio */
        {6, 2, 3}, {1, 4, 2}, /* one KV head replicated on both sides */
    };
    for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++) {
        kvs_sim_config_t c = small_config();
        c.shape.kv_heads = shapes[i].heads;
        c.prefill_tp = shapes[i].ptp;
        c.decode_tp = shapes[i].dtp;
        c.seed = 100 + i;
        run_all_succeed(&c);
    }
}

static void test_mla_fan_in_and_out(void **state)
{
    (void) state;
    static const uint32_t tps[][2] = {{4, 2}, {2, 4}, {1, 3}, {3, 1}};
    for (size_t i = 0; i < sizeof(tps) / sizeof(tps[0]); i++) {
        kvs_sim_config_t c = small_config();
        c.shape = (kvs_kv_shape_t){.layers = 2,
                                   .kv_heads = 1,
                                   .head_dim_k = 36,
                                   .head_dim_v = 0,
                                   .elem_bytes = 2,
                                   .attn = KVS_ATTN_MLA};
        c.prefill_tp = tps[i][0];
        c.decode_tp = tps[i][1];
        c.seed = 200 + i;
        run_all_succeed(&c);
    }
}

static void test_page_sizes_and_layouts(void **state)
{
    (void) state;
    /* Page 1: every hit length is page-aligned, so prefix hits end anywhere. */
    kvs_sim_config_t c = small_config();
    c.page_size = 1;
    c.chunk_tokens = 64;
    c.workload.kind = KVS_WORKLOAD_NEEDLE;
    c.workload.prompt_len = 300;
    run_all_succeed(&c);
    /* Page 64 with chunk 64: one page per slot; chunk 256: four. */
    c = small_config();
    c.page_size = 64;
    c.chunk_tokens = 64;
    run_all_succeed(&c);
    c.chunk_tokens = 256;
    c.prefill_layout = KVS_POOL_HND;
    c.decode_layout = KVS_POOL_NHD;
    run_all_succeed(&c);
}

/* One slot for the whole decode rank: every chunk of every room goes through it in FIFO order,
 * so a granted slot that is not written promptly would wedge everything. */
static void test_one_slot_ring(void **state)
{
    (void) state;
    kvs_sim_config_t c = small_config();
    c.ring_slots = 1;
    kvs_sim_result_t r = run_all_succeed(&c);
    assert_true(r.ring_high_water <= r.ring_capacity);
    c.faults = KVS_SIM_FAULT_REORDER | KVS_SIM_FAULT_DUP;
    c.seed = 9;
    run_all_succeed(&c);
}

/* Prefill TP3 -> decode TP2 over 6 small heads: decode 0 takes heads from prefill 0 and 1, so
 * prefill 1 writes to both decode ranks and its window can wait on either ring. */
static kvs_sim_config_t three_to_two(uint32_t layers)
{
    kvs_sim_config_t c;
    kvs_sim_config_default(&c);
    c.shape = (kvs_kv_shape_t){.layers = layers,
                               .kv_heads = 6,
                               .head_dim_k = 8,
                               .head_dim_v = 8,
                               .elem_bytes = 2,
                               .attn = KVS_ATTN_MHA};
    c.prefill_tp = 3;
    c.decode_tp = 2;
    return c;
}

/* Prefill TP3 -> decode TP2 with 6 heads: prefill rank 1 writes to both decode ranks, rank 0
 * only to decode 0 and rank 2 only to decode 1, so ranks 0 and 2 run ahead of rank 1. A grant
 * goes to every writer of a chunk, requested or not, so rank 1 receives grants for chunks
 * beyond its one-chunk window; if it holds such a slot unwritten until its window gets there
 * (which waits on the other decode rank's small ring, itself held the same way), the two rings
 * wedge each other and healthy rooms time out. No faults: the schedule alone does it. */
static void test_unrequested_grant_beyond_window(void **state)
{
    (void) state;
    static const uint64_t seeds[] = {6, 17, 29};
    for (size_t i = 0; i < sizeof(seeds) / sizeof(seeds[0]); i++) {
        kvs_sim_config_t c = three_to_two(2);
        c.page_size = 1;
        c.chunk_tokens = 2;
        c.ring_slots = 2;
        c.window_chunks = 1;
        c.staging_buffers = 1;
        c.decode_radix = 0;
        c.workload.requests = 16;
        c.workload.prompt_len = 40;
        c.workload.prefix_len = 10;
        c.concurrency = 12;
        c.timeouts.waiting_timeout_ns = 50000 * c.tick_ns;
        c.seed = seeds[i];
        run_all_succeed(&c);
    }
}

/* The same wedge through a lost message: a grant sent to a writer that has not asked yet (its
 * window waits on the other decode rank's ring) is lost; that writer never asks for the chunk
 * until its window moves, which waits on the other ring, held the same way. Without a grant
 * retry it lasts until the waiting timeout (7 of 30 rooms failed with seed 3; 9 of seeds 1-30
 * failed). Every room must succeed under random loss, for every seed. */
static void test_lost_grant_to_writer_that_has_not_asked(void **state)
{
    (void) state;
    kvs_log_set_level(KVS_LOG_ERROR);
    for (uint64_t seed = 1; seed <= 30; seed++) {
        kvs_sim_config_t c = three_to_two(1);
        c.page_size = 16;
        c.chunk_tokens = 16;
        c.ring_slots = 4;
        c.decode_radix = 0;
        c.prefill_radix = 0;
        c.faults = KVS_SIM_FAULT_DROP;
        c.workload.kind = KVS_WORKLOAD_RANDOM;
        c.workload.requests = 30;
        c.workload.prompt_len = 400;
        c.workload.prefix_len = 0;
        c.concurrency = 16;
        c.seed = seed;
        run_all_succeed(&c);
    }
    kvs_log_set_level(KVS_LOG_WARN);
}

/* The corruption fault alone: every room that fails, fails by its checksum, every other room
 * succeeds byte-exact, the checksums catch corrupted writes (never more than were injected:
 * a corrupted chunk of a room that already failed is never scattered), and with checksums off
 * the same schedule delivers wrong bytes, so the checksum is what caught them. */
static void test_corruption_caught_by_checksums(void **state)
{
    (void) state;
    kvs_log_set_level(KVS_LOG_ERROR);
    kvs_sim_config_t c = small_config();
    c.faults = KVS_SIM_FAULT_CORRUPT;
    c.seed = 11;
    kvs_sim_result_t r;
    assert_int_equal(kvs_sim_run(&c, &r), KVS_OK);
    if (!kvs_sim_result_ok(&r)) {
        dump(&c, &r);
        fail_msg("corruption was not contained");
    }
    assert_true(r.corrupt_injected > 0);
    assert_true(r.corrupt_detected > 0 && r.corrupt_detected <= r.corrupt_injected);
    assert_true(r.failed > 0);
    assert_int_equal(r.fail_reasons[-KVS_ERR_CORRUPT], r.failed);
    assert_int_equal(r.expected_failures, r.failed);
    kvs_assert_no_leaks();

    c.no_checksum = 1;
    assert_int_equal(kvs_sim_run(&c, &r), KVS_OK);
    assert_true(r.corrupt_injected > 0);
    assert_int_equal(r.corrupt_detected, 0);
    assert_true(r.mismatched_bytes > 0 && !kvs_sim_result_ok(&r));
    kvs_log_set_level(KVS_LOG_WARN);
    kvs_assert_no_leaks();
}

/* Repeated prompts meet a decode cache that already holds them: with page 1 the whole prompt is
 * a hit and only the final metadata travels; with page 16 only the partial last page does. */
static void test_full_decode_prefix_hit(void **state)
{
    (void) state;
    kvs_sim_config_t c = small_config();
    c.page_size = 1;
    c.chunk_tokens = 32;
    c.workload.kind = KVS_WORKLOAD_RANDOM;
    c.workload.prompt_len = 200;
    c.workload.repeat_permille = 600;
    c.concurrency = 2; /* the original has concluded (and is cached) when its repeat arrives */
    kvs_sim_result_t r = run_all_succeed(&c);
    assert_true(r.full_decode_hits > 0);
    c.page_size = 16;
    c.chunk_tokens = 64;
    r = run_all_succeed(&c);
    assert_true(r.decode_hit_tokens > 0);
}

/* Prefill holds a cached prefix of several slots that decode lacks: it ships right after
 * bootstrap as a multi-slot early send, before the first forward pass completes. */
static void test_prefill_hit_of_several_slots(void **state)
{
    (void) state;
    kvs_sim_config_t c = small_config();
    c.page_size = 16;
    c.chunk_tokens = 64; /* G = 64 */
    c.decode_radix = 0;
    c.prefill_radix = 1;
    c.workload.kind = KVS_WORKLOAD_SHARED_PREFIX;
    c.workload.prefix_len = 500; /* about 7 slots */
    c.workload.prompt_len = 700;
    c.workload.groups = 1;
    c.concurrency = 4;
    kvs_sim_result_t r = run_all_succeed(&c);
    assert_true(r.max_prefill_hit_tokens >= 4 * 64);
    assert_int_equal(r.decode_hit_tokens, 0);
}

/* A decode prefix that is not a page multiple fails that room only. */
static void test_misaligned_decode_prefix(void **state)
{
    (void) state;
    kvs_sim_config_t c = small_config();
    c.misaligned_request = 5;
    kvs_sim_result_t r = run_local_failures(&c);
    assert_int_equal(r.failed, 1);
    assert_int_equal(r.expected_failures, 1);
    assert_int_equal(r.fail_reasons[-KVS_ERR_INVALID], 1);
    assert_int_equal(r.succeeded, r.requests - 1);
}

static void drop_log(void *arg, kvs_log_level_t level, const char *file, int line, const char *msg);

/* A configuration that can never succeed is refused before it runs: KVS_ERR_INVALID, the result
 * untouched, and one error that says what it needs and what it was given. */
static void expect_refused(const kvs_sim_config_t *c, const char *given, const char *needed)
{
    kvs_sim_result_t r;
    memset(&r, 0x5a, sizeof(r));
    kvs_log_capture_t cap = {.errors_only = 1};
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    kvs_status_t st = kvs_sim_run(c, &r);
    kvs_log_set_sink(getenv("KVS_LOG") ? NULL : drop_log, NULL);
    if (st != KVS_ERR_INVALID) {
        if (st == KVS_OK) dump(c, &r);
        fail_msg("expected the configuration to be refused, got %s", kvs_status_str(st));
    }
    assert_int_equal(r.requests, 0x5a5a5a5a);
    assert_int_equal(cap.calls, 1);
    if (strstr(cap.msg, given) == NULL || strstr(cap.msg, needed) == NULL)
        fail_msg("the refusal '%s' should name '%s' and '%s'", cap.msg, given, needed);
    kvs_assert_no_leaks();
}

/* A ring smaller than one slot can never move a chunk: refused up front rather than failing
 * every room. Prompts shorter than a chunk only ever ask for their own pages, so a ring of that
 * smaller slot runs, and one byte less is refused. */
static void test_slot_larger_than_ring(void **state)
{
    (void) state;
    kvs_sim_config_t c = small_config();
    uint64_t full = kvs_sim_full_slot_bytes(&c);
    char needed[64];
    snprintf(needed, sizeof(needed), "--ring-bytes >= %llu", (unsigned long long) full);
    c.ring_bytes = full - 256;
    char given[64];
    snprintf(given, sizeof(given), "ring of %llu bytes", (unsigned long long) c.ring_bytes);
    expect_refused(&c, given, needed);
    c.ring_bytes = 100;
    expect_refused(&c, "ring of 100 bytes", needed);
    c.ring_bytes = full;
    c.workload.requests = 10;
    run_all_succeed(&c);

    /* 40-token prompts on a 256-token grid only ever ask for three pages of 16 per slot. */
    c = small_config();
    c.workload =
        (kvs_workload_config_t){.kind = KVS_WORKLOAD_RANDOM, .requests = 10, .prompt_len = 40};
    kvs_pd_geometry_t geo = {.shape = c.shape,
                             .prefill_tp = c.prefill_tp,
                             .decode_tp = c.decode_tp,
                             .page_size = c.page_size,
                             .chunk_tokens = c.chunk_tokens};
    uint64_t small = 0;
    for (uint32_t d = 0; d < c.decode_tp; d++) {
        uint64_t bytes = kvs_engine_slot_bytes(&geo, d, 40);
        if (bytes > small) small = bytes;
    }
    assert_true(small > 0 && small < full);
    c.ring_bytes = small;
    run_all_succeed(&c);
    c.ring_bytes = small - 1;
    snprintf(needed, sizeof(needed), "--ring-bytes >= %llu", (unsigned long long) small);
    expect_refused(&c, "ring of", needed);
}

/* The completion timeout counts from "every writer reported Success", not from the room's
 * start: even a one-tick completion timeout fails nothing when scatters finish at once. */
static void test_completion_timeout_starts_late(void **state)
{
    (void) state;
    kvs_sim_config_t c = small_config();
    c.timeouts.completion_timeout_ns = c.tick_ns;
    c.faults = KVS_SIM_FAULT_REORDER;
    run_all_succeed(&c);
}

/* Prefill rooms that stall forever: decode's waiting timeout fails exactly them, prefill then
 * aborts them, and the others are untouched. Radix caches off: every forward pass ends on the
 * grid. */
static void test_waiting_timeout(void **state)
{
    (void) state;
    kvs_sim_config_t c = small_config();
    c.faults = KVS_SIM_FAULT_TIMEOUT;
    c.fault_rooms = 4;
    c.prefill_radix = c.decode_radix = 0;
    c.timeouts.waiting_timeout_ns = 20000 * c.tick_ns;
    kvs_sim_result_t r = run_local_failures(&c);
    assert_true(r.failed > 0);
    assert_int_equal(r.fail_reasons[-KVS_ERR_TIMEOUT], r.failed);
    assert_true(r.virtual_ns >= c.timeouts.waiting_timeout_ns);
}

/* The same with radix caches on: a prefill hit and a decode hit that differ put forward passes
 * off the grid, so a stalled room's last pass covers only part of a grid chunk. The sender must
 * not hold a ring slot for that chunk (its compute is not scheduled), or the FIFO ring wedges
 * and healthy rooms queued behind it time out too. */
static void test_waiting_timeout_off_grid(void **state)
{
    (void) state;
    for (uint64_t seed = 1; seed <= 16; seed++) { /* seeds 8 and 14 wedged the ring */
        kvs_sim_config_t c = small_config();
        c.faults = KVS_SIM_FAULT_TIMEOUT;
        c.seed = seed;
        c.timeouts.waiting_timeout_ns = 20000 * c.tick_ns;
        kvs_sim_result_t r = run_local_failures(&c);
        assert_int_equal(r.fail_reasons[-KVS_ERR_TIMEOUT], r.failed);
    }
}

/* Rooms aborted mid-transfer (by decode or by prefill) while writes land late: the aborted
 * rooms' pages and slots stay quarantined until prefill acknowledged, so no late write lands in
 * a page or slot another room reuses (which the byte checks of every other room would catch). */
static void test_abort_mid_transfer(void **state)
{
    (void) state;
    /* Without quarantine (slots freed at the abort), seeds 1, 2, 5 and 6 corrupt other rooms. */
    for (uint64_t seed = 1; seed <= 6; seed++) {
        kvs_sim_config_t c = small_config();
        c.faults = KVS_SIM_FAULT_ABORT | KVS_SIM_FAULT_REORDER;
        c.fault_rooms = 10;
        c.ring_slots = 2;
        /* Writes land far later than a slot or page could be handed to the next room. */
        c.write_delay_ns = 300 * c.tick_ns;
        c.seed = seed;
        kvs_sim_result_t r = run_local_failures(&c);
        assert_true(r.fail_reasons[-KVS_ERR_ABORTED] > 0);
        /* A room prefill aborted before decode registered it only ends at decode's waiting
         * timeout: decode acknowledged the Failed STATUS of a room it did not know yet. */
        assert_int_equal(r.fail_reasons[-KVS_ERR_ABORTED] + r.fail_reasons[-KVS_ERR_TIMEOUT],
                         r.failed);
    }
}

/* Duplicated and delayed control messages: duplicate and late CHUNK_READY, late duplicate
 * STAGING_REQ after the chunk was scattered, repeated grants and statuses. Each is ignored;
 * every chunk is scattered exactly once. */
static void test_duplicates_and_late_messages(void **state)
{
    (void) state;
    kvs_sim_config_t c = small_config();
    c.faults = KVS_SIM_FAULT_DUP | KVS_SIM_FAULT_REORDER;
    kvs_sim_result_t r = run_all_succeed(&c);
    assert_true(r.net_duplicated > 0);
    assert_true(r.ignored_messages > 0);
    assert_int_equal(r.chunks, r.expected_chunks);
}

static void test_dropped_messages_recovered(void **state)
{
    (void) state;
    kvs_sim_config_t c = small_config();
    c.faults = KVS_SIM_FAULT_DROP | KVS_SIM_FAULT_REORDER;
    kvs_sim_result_t r = run_all_succeed(&c);
    assert_true(r.net_dropped > 0);
    assert_true(r.retries > 0);
}

static void test_workloads(void **state)
{
    (void) state;
    for (int k = 0; k < 4; k++) {
        kvs_sim_config_t c = small_config();
        c.workload.kind = (kvs_workload_kind_t) k;
        c.seed = 300 + (uint64_t) k;
        kvs_sim_result_t r = run_all_succeed(&c);
        /* Conversations' turns may overlap in flight, so only these two must hit. */
        if (c.workload.kind == KVS_WORKLOAD_SHARED_PREFIX || c.workload.kind == KVS_WORKLOAD_NEEDLE)
            assert_true(r.decode_hit_tokens > 0);
    }
}

/* Same seed, same run (faults included); another seed, another schedule. */
static void test_deterministic(void **state)
{
    (void) state;
    kvs_sim_config_t c = small_config();
    c.faults = KVS_SIM_FAULT_DROP | KVS_SIM_FAULT_DUP | KVS_SIM_FAULT_REORDER | KVS_SIM_FAULT_ABORT;
    kvs_sim_result_t a, b, d;
    assert_int_equal(kvs_sim_run(&c, &a), KVS_OK);
    assert_int_equal(kvs_sim_run(&c, &b), KVS_OK);
    assert_int_equal(a.succeeded, b.succeeded);
    assert_int_equal(a.control_messages, b.control_messages);
    assert_int_equal(a.retries, b.retries);
    assert_int_equal(a.chunks, b.chunks);
    assert_int_equal(a.virtual_ns, b.virtual_ns);
    assert_int_equal(a.iterations, b.iterations);
    c.seed++;
    assert_int_equal(kvs_sim_run(&c, &d), KVS_OK);
    assert_true(d.control_messages != a.control_messages || d.virtual_ns != a.virtual_ns);
    kvs_assert_no_leaks();
}

/* A run that cannot finish reports it (never hangs) and still tears everything down. */
static void test_gives_up_and_cleans_up(void **state)
{
    (void) state;
    kvs_sim_config_t c = small_config();
    c.max_iterations = 40;
    kvs_sim_result_t r;
    assert_int_equal(kvs_sim_run(&c, &r), KVS_OK);
    assert_true(r.stalled);
    assert_true(r.unconcluded > 0);
    assert_false(kvs_sim_result_ok(&r));
    assert_int_equal(r.leaked_allocs, 0);
    kvs_assert_no_leaks();
}

static void test_invalid_configurations(void **state)
{
    (void) state;
    kvs_sim_result_t r;
    memset(&r, 0x5a, sizeof(r));
    kvs_sim_config_t c = small_config();
    c.shape.kv_heads = 3; /* over TP 4 */
    assert_int_equal(kvs_sim_run(&c, &r), KVS_ERR_INVALID);
    c = small_config();
    c.chunk_tokens = 24; /* not a page multiple */
    assert_int_equal(kvs_sim_run(&c, &r), KVS_ERR_INVALID);
    c = small_config();
    c.concurrency = 0;
    assert_int_equal(kvs_sim_run(&c, &r), KVS_ERR_INVALID);
    c = small_config();
    c.workload.prefix_len = c.workload.prompt_len;
    assert_int_equal(kvs_sim_run(&c, &r), KVS_ERR_INVALID);
    assert_int_equal(r.requests, 0x5a5a5a5a); /* untouched on error */
    /* Pools smaller than one request (700 tokens: 44 pages of 16) can never admit it: refused
     * rather than stalling admission until every later room times out. One request's worth
     * runs. */
    c = small_config();
    c.decode_pool_pages = 3;
    expect_refused(&c, "decode pool of 3 pages", "needs 44 pages");
    c.decode_pool_pages = 43;
    expect_refused(&c, "decode pool of 43 pages", "--decode-pool-pages >= 44");
    c = small_config();
    c.prefill_pool_pages = 3;
    expect_refused(&c, "prefill pool of 3 pages", "--prefill-pool-pages >= 44");
    c.prefill_pool_pages = c.decode_pool_pages = 44;
    c.workload.requests = 8;
    run_all_succeed(&c);
    uint32_t f;
    assert_int_equal(kvs_sim_faults_parse("drop,dup", &f), KVS_OK);
    assert_int_equal(f, KVS_SIM_FAULT_DROP | KVS_SIM_FAULT_DUP);
    assert_int_equal(kvs_sim_faults_parse("none", &f), KVS_OK);
    assert_int_equal(f, 0);
    assert_int_equal(kvs_sim_faults_parse("drop,,dup", &f), KVS_ERR_INVALID);
    assert_int_equal(kvs_sim_faults_parse("lag", &f), KVS_ERR_INVALID);
    kvs_assert_no_leaks();
}

/* Every allocation the simulation makes may fail: the run reports NOMEM or runs (rooms whose
 * allocation failed fail alone), and nothing leaks either way. */
static void test_allocation_failures(void **state)
{
    (void) state;
    kvs_sim_config_t c = small_config();
    c.workload.requests = 6;
    c.workload.prompt_len = 100;
    c.workload.prefix_len = 40;
    c.concurrency = 3;
    c.max_iterations = 200000;
    kvs_sim_result_t clean;
    kvs_alloc_stats_t before, after;
    kvs_alloc_stats(&before);
    assert_int_equal(kvs_sim_run(&c, &clean), KVS_OK);
    kvs_alloc_stats(&after);
    uint64_t total = after.total_allocs - before.total_allocs;
    /* About 80 runs spread over setup, the run itself and teardown. */
    uint64_t step = total / 80 ? total / 80 : 1;
    for (uint64_t n = 1; n <= total; n += step) {
        kvs_sim_result_t r;
        kvs_alloc_fail_at(n);
        kvs_status_t st = kvs_sim_run(&c, &r);
        kvs_alloc_fail_at(0);
        assert_true(st == KVS_OK || st == KVS_ERR_NOMEM);
        if (st == KVS_OK) assert_int_equal(r.leaked_allocs, 0);
        kvs_assert_no_leaks();
    }
}

static void drop_log(void *arg, kvs_log_level_t level, const char *file, int line, const char *msg)
{
    (void) arg, (void) level, (void) file, (void) line, (void) msg;
}

static int quiet_logs(void **state)
{
    (void) state;
    /* Failure scenarios log every failed room by design; a failing assertion prints the command
     * that replays the run (set KVS_LOG to see the logs here). */
    if (getenv("KVS_LOG") == NULL) kvs_log_set_sink(drop_log, NULL);
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_original_fix_configuration),
        cmocka_unit_test(test_tp_shapes),
        cmocka_unit_test(test_mla_fan_in_and_out),
        cmocka_unit_test(test_page_sizes_and_layouts),
        cmocka_unit_test(test_one_slot_ring),
        cmocka_unit_test(test_unrequested_grant_beyond_window),
        cmocka_unit_test(test_lost_grant_to_writer_that_has_not_asked),
        cmocka_unit_test(test_corruption_caught_by_checksums),
        cmocka_unit_test(test_full_decode_prefix_hit),
        cmocka_unit_test(test_prefill_hit_of_several_slots),
        cmocka_unit_test(test_misaligned_decode_prefix),
        cmocka_unit_test(test_slot_larger_than_ring),
        cmocka_unit_test(test_completion_timeout_starts_late),
        cmocka_unit_test(test_waiting_timeout),
        cmocka_unit_test(test_waiting_timeout_off_grid),
        cmocka_unit_test(test_abort_mid_transfer),
        cmocka_unit_test(test_duplicates_and_late_messages),
        cmocka_unit_test(test_dropped_messages_recovered),
        cmocka_unit_test(test_workloads),
        cmocka_unit_test(test_deterministic),
        cmocka_unit_test(test_gives_up_and_cleans_up),
        cmocka_unit_test(test_invalid_configurations),
        cmocka_unit_test(test_allocation_failures),
    };
    return cmocka_run_group_tests(tests, quiet_logs, NULL);
}
