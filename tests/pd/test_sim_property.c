/* Seeded property test: random small deployments (TP pairs with non-integer ratios and
 * replication, MLA, page and chunk sizes, a page size per side, prefill pipeline stages, decode
 * context parallelism, ring sizes, workloads, radix on/off, pool layouts) under random fault mixes,
 * and random large ones (prompts of hundreds of chunks, dozens of rooms sharing rings of a few
 * slots, uneven TP pairs), each checked against every protocol.md §7 invariant the simulation can
 * observe. KVS_SEED picks the seed, KVS_ITERS the scenario count (a soak); a failure prints the
 * `kvstage sim` command line that replays it. */
#include "kvs_test.h"

#include <string.h>

#include "kvstage/log.h"
#include "kvstage/rng.h"
#include "sim/sim.h"

/* Scenarios of the long-prompt generator in a default run. */
#define LARGE_ITERS 20

static uint32_t pick(kvs_rng_t *rng, const uint32_t *v, size_t n)
{
    return v[kvs_rng_below(rng, n)];
}

/* A ring of 1..max_slots full slots (a third of the time plus part of one), each fault kind
 * with a chance of 3 in 10 over 1..max_fault_rooms rooms, a quarter of the time late writes of
 * up to max_delay ticks (abort quarantine must hold), and now and then a misaligned decode base.
 */
static void random_ring_and_faults(kvs_rng_t *rng, kvs_sim_config_t *c, uint32_t max_slots,
                                   uint32_t max_fault_rooms, uint64_t max_delay)
{
    uint64_t slot = kvs_sim_full_slot_bytes(c);
    assert_true(slot > 0);
    uint32_t slots = (uint32_t) kvs_rng_range(rng, 1, max_slots);
    if (kvs_rng_chance(rng, 1, 3))
        c->ring_bytes = slots * slot + kvs_rng_below(rng, slot); /* not a slot multiple */
    else
        c->ring_slots = slots;
    for (uint32_t bit = 0; bit < 5; bit++)
        if (kvs_rng_chance(rng, 3, 10)) c->faults |= 1u << bit;
    /* corruption too, combined with every other fault (a separate draw keeps the rest of
     * each scenario as it was) */
    if (kvs_rng_chance(rng, 1, 4)) c->faults |= KVS_SIM_FAULT_CORRUPT;
    /* broken writes too, from the scenario's own seed so that no other draw moves */
    if (kvs_mix64(c->seed ^ 0x7772697465ull) % 5 == 0) c->faults |= KVS_SIM_FAULT_WRITEFAIL;
    c->fault_rooms = (uint32_t) kvs_rng_range(rng, 1, max_fault_rooms);
    if (kvs_rng_chance(rng, 1, 4))
        c->write_delay_ns = kvs_rng_range(rng, 1, max_delay) * c->tick_ns;
    if (c->page_size > 1 && kvs_rng_chance(rng, 1, 10))
        c->misaligned_request = (int64_t) kvs_rng_below(rng, c->workload.requests);
}

/* Half the time a prefill page size of its own (protocol.md §1): a power of two from 1 to
 * max_pow2, or now and then any size up to max_any, so that chunk boundaries fall anywhere in
 * a prefill page and the last chunk may end inside either side's last page. Drawn before the
 * ring, which is sized in full slots. */
static void random_prefill_page(kvs_rng_t *rng, kvs_sim_config_t *c, uint32_t max_pow2,
                                uint32_t max_any)
{
    if (!kvs_rng_chance(rng, 1, 2)) return;
    if (kvs_rng_chance(rng, 1, 4))
        c->prefill_page_size = (uint32_t) kvs_rng_range(rng, 1, max_any);
    else
        c->prefill_page_size = 1u << kvs_rng_below(rng, (uint64_t) __builtin_ctz(max_pow2) + 1);
}

/* Half the time pipeline stages on prefill (protocol.md §2): 2 to one per layer, within the
 * prefill rank limit, so stages hold uneven layer counts and send each chunk at different
 * times. Drawn before the ring: stages add writers, so region padding, to a slot. */
static void random_prefill_pp(kvs_rng_t *rng, kvs_sim_config_t *c)
{
    if (c->shape.layers < 2 || !kvs_rng_chance(rng, 1, 2)) return;
    uint32_t most =
        c->shape.layers < KVS_MAX_TP / c->prefill_tp ? c->shape.layers : KVS_MAX_TP / c->prefill_tp;
    if (most >= 2) c->prefill_pp = (uint32_t) kvs_rng_range(rng, 2, most);
}

/* Half the time, where decode holds each head on more than one rank (always for MLA with TP
 * > 1), decode context parallelism (protocol.md §1): a DCP size dividing those ranks, an
 * interleave dividing the decode page, and the chunk redrawn as 1..max_units multiples of
 * DCP x page. Drawn before the ring: a rank's slot holds its share of the tokens. */
static void random_decode_dcp(kvs_rng_t *rng, kvs_sim_config_t *c, uint32_t max_units)
{
    const uint32_t replicas = kvs_tp_replication(&c->shape, c->decode_tp);
    if (replicas < 2 || !kvs_rng_chance(rng, 1, 2)) return;
    uint32_t divisors[KVS_MAX_TP], n = 0;
    for (uint32_t d = 2; d <= replicas; d++)
        if (replicas % d == 0) divisors[n++] = d;
    c->decode_dcp = pick(rng, divisors, n);
    c->dcp_interleave = 1u << kvs_rng_below(rng, (uint64_t) __builtin_ctz(c->page_size) + 1);
    c->chunk_tokens = c->decode_dcp * c->page_size * (uint32_t) kvs_rng_range(rng, 1, max_units);
}

/* Room-level timeouts from the waiting timeout (in ticks): completion half of it, release a
 * quarter, bootstrap and transfer twice; and the iteration limit. */
static void set_timeouts(kvs_sim_config_t *c, uint64_t waiting, uint64_t max_iterations)
{
    c->timeouts.waiting_timeout_ns = waiting * c->tick_ns;
    c->timeouts.completion_timeout_ns = waiting / 2 * c->tick_ns;
    c->timeouts.release_timeout_ns = waiting / 4 * c->tick_ns;
    c->timeouts.bootstrap_timeout_ns = 2 * waiting * c->tick_ns;
    c->timeouts.transfer_timeout_ns = 2 * waiting * c->tick_ns;
    c->max_iterations = max_iterations;
}

static void random_config(kvs_rng_t *rng, kvs_sim_config_t *c)
{
    static const uint32_t heads[] = {1, 2, 3, 4, 6, 8};
    static const uint32_t tps[] = {1, 2, 3, 4, 6, 8};
    static const uint32_t elem[] = {1, 2, 4};
    static const uint32_t pages[] = {1, 2, 4, 8, 16, 32};
    kvs_sim_config_default(c);
    c->seed = kvs_rng_next(rng);
    c->shape.layers = (uint32_t) kvs_rng_range(rng, 1, 5);
    c->shape.elem_bytes = pick(rng, elem, 3);
    if (kvs_rng_chance(rng, 1, 6)) {
        c->shape.attn = KVS_ATTN_MLA;
        c->shape.kv_heads = 1;
        c->shape.head_dim_k = (uint32_t) kvs_rng_range(rng, 1, 24);
        c->shape.head_dim_v = 0;
        c->prefill_tp = (uint32_t) kvs_rng_range(rng, 1, 8);
        c->decode_tp = (uint32_t) kvs_rng_range(rng, 1, 8);
    } else {
        c->shape.attn = KVS_ATTN_MHA;
        c->shape.kv_heads = pick(rng, heads, 6);
        c->shape.head_dim_k = (uint32_t) kvs_rng_range(rng, 1, 12);
        c->shape.head_dim_v = (uint32_t) kvs_rng_range(rng, 1, 12);
        /* A TP size must divide the heads or be divided by them. */
        do c->prefill_tp = pick(rng, tps, 6);
        while (c->shape.kv_heads % c->prefill_tp && c->prefill_tp % c->shape.kv_heads);
        do c->decode_tp = pick(rng, tps, 6);
        while (c->shape.kv_heads % c->decode_tp && c->decode_tp % c->shape.kv_heads);
    }
    c->page_size = pick(rng, pages, 6);
    c->chunk_tokens = c->page_size * (uint32_t) kvs_rng_range(rng, 1, 6);
    c->prefill_layout = (kvs_pool_layout_t) kvs_rng_below(rng, 2);
    c->decode_layout = (kvs_pool_layout_t) kvs_rng_below(rng, 2);
    c->prefill_radix = (int) kvs_rng_below(rng, 2);
    c->decode_radix = (int) kvs_rng_below(rng, 2);
    c->prefill_batch = (uint32_t) kvs_rng_range(rng, 1, 6);
    c->window_chunks = (uint32_t) kvs_rng_range(rng, 1, 3);
    c->staging_buffers = (uint32_t) kvs_rng_range(rng, 1, 3);

    kvs_workload_config_t *w = &c->workload;
    w->kind = (kvs_workload_kind_t) kvs_rng_below(rng, 4);
    w->requests = (uint32_t) kvs_rng_range(rng, 3, 14);
    /* At most about a dozen chunks per prompt keeps every scenario to a few ms of virtual time. */
    uint32_t max_len = c->chunk_tokens * 12 < 260 ? c->chunk_tokens * 12 : 260;
    w->prompt_len =
        (uint32_t) kvs_rng_range(rng, w->kind == KVS_WORKLOAD_SHARED_PREFIX ? 2 : 1, max_len);
    w->prefix_len = (uint32_t) kvs_rng_below(rng, w->prompt_len);
    w->groups = (uint32_t) kvs_rng_range(rng, 0, 3);
    w->repeat_permille = kvs_rng_chance(rng, 1, 3) ? 250 : 0;
    c->concurrency = (uint32_t) kvs_rng_range(rng, 1, 12);

    random_prefill_page(rng, c, 64, 48);
    random_prefill_pp(rng, c);
    random_decode_dcp(rng, c, 3);
    random_ring_and_faults(rng, c, 5, 3, 400);
    /* Timeouts far above a healthy room's life here, far below the defaults (1 s) so that
     * stalled rooms end quickly. */
    set_timeouts(c, 200000, 3000000);
}

/* Long prompts and crowded rings: hundreds of chunks per prompt (pages of 1-4 tokens, chunks of
 * one or two pages, prompts of 200-1000 tokens), 16-64 rooms in flight whose transfers share
 * rings of 1-4 slots, over uneven TP pairs, under random fault mixes. Tiny heads keep the bytes
 * cheap; the work is in the protocol: tens of thousands of chunks per scenario. */
static void draw_large_config(kvs_rng_t *rng, kvs_sim_config_t *c)
{
    static const struct {
        uint32_t prefill_tp, decode_tp, heads; /* heads 0: MLA */
    } pairs[] = {
        {3, 2, 6}, {2, 3, 6},  {6, 4, 12}, {4, 6, 12}, {6, 4, 2}, {8, 2, 8}, {8, 2, 2},
        {2, 8, 8}, {3, 4, 12}, {4, 3, 12}, {1, 4, 4},  {6, 1, 6}, {3, 2, 0}, {2, 3, 0},
    };
    kvs_sim_config_default(c);
    c->seed = kvs_rng_next(rng);
    size_t k = kvs_rng_below(rng, sizeof(pairs) / sizeof(pairs[0]));
    c->prefill_tp = pairs[k].prefill_tp;
    c->decode_tp = pairs[k].decode_tp;
    c->shape.layers = (uint32_t) kvs_rng_range(rng, 1, 2);
    c->shape.elem_bytes = (uint32_t) kvs_rng_range(rng, 1, 2);
    if (pairs[k].heads == 0) {
        c->shape.attn = KVS_ATTN_MLA;
        c->shape.kv_heads = 1;
        c->shape.head_dim_k = (uint32_t) kvs_rng_range(rng, 1, 8);
        c->shape.head_dim_v = 0;
    } else {
        c->shape.attn = KVS_ATTN_MHA;
        c->shape.kv_heads = pairs[k].heads;
        c->shape.head_dim_k = (uint32_t) kvs_rng_range(rng, 1, 4);
        c->shape.head_dim_v = (uint32_t) kvs_rng_range(rng, 1, 4);
    }
    c->page_size = (uint32_t) kvs_rng_range(rng, 1, 4);
    c->chunk_tokens = c->page_size * (uint32_t) kvs_rng_range(rng, 1, 2);
    c->prefill_layout = (kvs_pool_layout_t) kvs_rng_below(rng, 2);
    c->decode_layout = (kvs_pool_layout_t) kvs_rng_below(rng, 2);
    c->prefill_radix = (int) kvs_rng_below(rng, 2);
    c->decode_radix = (int) kvs_rng_below(rng, 2);
    c->window_chunks = (uint32_t) kvs_rng_range(rng, 1, 3);
    c->staging_buffers = (uint32_t) kvs_rng_range(rng, 1, 3);

    kvs_workload_config_t *w = &c->workload;
    w->kind = (kvs_workload_kind_t) kvs_rng_below(rng, 4);
    w->requests = (uint32_t) kvs_rng_range(rng, 30, 80);
    /* 100-400 chunks of the longest prompt, 200-1000 tokens. The sender scans a room's open
     * chunks on every progress call, so a scenario costs about rooms x chunks^2: a thousand
     * chunks per prompt would take minutes. */
    uint32_t chunks = (uint32_t) kvs_rng_range(rng, 100, 400);
    w->prompt_len = c->chunk_tokens * chunks;
    if (w->prompt_len < 200) w->prompt_len = 200;
    if (w->prompt_len > 1000) w->prompt_len = 1000;
    w->prefix_len = (uint32_t) kvs_rng_below(rng, w->prompt_len);
    w->groups = (uint32_t) kvs_rng_range(rng, 0, 4);
    w->repeat_permille = kvs_rng_chance(rng, 1, 3) ? 250 : 0;
    c->concurrency = (uint32_t) kvs_rng_range(rng, 16, 64);
    /* Many rooms transfer at once: a prefill batch of up to all of them, and (half the time) a
     * decode pool for every room in flight rather than the quarter the default sizes it for. */
    c->prefill_batch = (uint32_t) kvs_rng_range(rng, 4, c->concurrency);
    if (kvs_rng_chance(rng, 1, 2))
        c->decode_pool_pages = (w->prompt_len / c->page_size + 2) * (c->concurrency + 4);
    /* A forward pass of a few ticks: compute never hides the transfer, the rings are the
     * bottleneck. */
    c->step_ns = (uint64_t) kvs_rng_range(rng, 2, 20) * c->tick_ns;

    /* Late writes of at most 40 ticks: longer ones, one slot at a time over tens of thousands
     * of chunks, take minutes. */
    random_prefill_page(rng, c, 8, 6);
    random_prefill_pp(rng, c);
    random_decode_dcp(rng, c, 2);
    random_ring_and_faults(rng, c, 4, 4, 40);
    /* A healthy room here may wait behind dozens of others for each of hundreds of chunks: the
     * room-level timeouts sit far above a whole scenario's virtual time, so only the faults
     * fail rooms (a stalled room then waits this long, which costs idle jumps, not work). */
    set_timeouts(c, 20000000, 30000000);
}

/* Rough cost of a large scenario in sender chunk visits: every progress call scans the open
 * chunks of each room decode admitted, per writer, and the run lasts about a chunk latency per
 * chunk of every request, over the ring's slots. */
static double large_cost(const kvs_sim_config_t *c)
{
    const kvs_workload_config_t *w = &c->workload;
    double chunks = (double) ((w->prompt_len + c->chunk_tokens - 1) / c->chunk_tokens);
    uint32_t prompt_pages = (w->prompt_len + c->page_size - 1) / c->page_size + 1;
    uint32_t inflight = c->concurrency < w->requests ? c->concurrency : w->requests;
    double admitted = inflight / 4 > 4 ? inflight / 4 : 4;
    if (c->decode_pool_pages != 0) admitted = c->decode_pool_pages / prompt_pages;
    if (admitted > inflight) admitted = inflight;
    double writers = c->prefill_tp * (c->prefill_pp ? c->prefill_pp : 1) + c->decode_tp - 1;
    double latency = 6 + (c->faults & KVS_SIM_FAULT_REORDER ? 20 : 0) +
                     (double) (c->write_delay_ns / c->tick_ns) / 2;
    uint64_t slot = kvs_sim_full_slot_bytes(c);
    double slots = c->ring_bytes ? (double) (c->ring_bytes / slot) : c->ring_slots;
    double iterations = w->requests * chunks * latency / slots;
    return admitted * chunks / 2 * writers * iterations;
}

/* About 2 s of this machine's time (2 ns a visit); the generator redraws what costs more. */
#define LARGE_BUDGET 1e9

static void random_large_config(kvs_rng_t *rng, kvs_sim_config_t *c)
{
    /* Redrawing keeps every shape in play, only not all at their largest at once. */
    do draw_large_config(rng, c);
    while (large_cost(c) > LARGE_BUDGET);
}

/* Every invariant of protocol.md §7 that is visible from outside the protocol; returns the
 * first one violated, or NULL. */
static const char *violated(const kvs_sim_config_t *c, const kvs_sim_result_t *r)
{
    if (r->stalled) return "the run did not finish (a room wedged)";
    if (r->succeeded + r->failed != r->requests) return "not every request concluded";
    if (!r->exact || r->mismatched_bytes != 0) return "7.2: decode KV differs from prefill KV";
    if (r->meta_mismatches != 0) return "7.2: wrong final metadata";
    if (r->leaked_slots != 0) return "7.1: a ring slot is still live";
    if (r->leaked_pages != 0) return "7.1: a pool page is neither free nor cached";
    if (r->leaked_rooms != 0) return "7.1: room state remains";
    if (r->leaked_allocs != 0) return "7.1: heap blocks leaked";
    if (r->unexpected_failures != 0) return "7.5: a failure was not local to a faulted room";
    if (r->rejected_messages != 0) return "a well-formed message was rejected";
    if (r->failed == 0 && r->chunks != r->expected_chunks)
        return "7.4: chunks were not scattered exactly once";
    if (r->chunks < r->expected_chunks) return "7.4: a succeeded room misses a scatter";
    uint32_t reasons = 0;
    for (int i = 0; i < 16; i++) reasons += r->fail_reasons[i];
    if (reasons != r->failed || r->fail_reasons[0] != 0) return "7.5: a failed room has no reason";
    /* Checksums catch corruption or the bytes would differ above; never more than injected. */
    if (r->corrupt_detected > r->corrupt_injected) return "more checksum failures than corruptions";
    if (!(c->faults & KVS_SIM_FAULT_CORRUPT) && (r->corrupt_injected || r->corrupt_detected))
        return "corruption without the fault";
    /* A broken write fails its own room (as an expected failure above), no other. */
    if (r->fail_reasons[-KVS_ERR_IO] > r->write_failures)
        return "more rooms failed with KVS_ERR_IO than writes broke";
    if (!(c->faults & KVS_SIM_FAULT_WRITEFAIL) && r->write_failures)
        return "broken writes without the fault";
    return NULL;
}

static void drop_log(void *arg, kvs_log_level_t level, const char *file, int line, const char *msg)
{
    (void) arg, (void) level, (void) file, (void) line, (void) msg;
}

typedef void (*generator_fn)(kvs_rng_t *rng, kvs_sim_config_t *c);

/* Runs `iters` scenarios of `gen` from one property seed; the first violation fails with the
 * command that replays its scenario. */
static void run_scenarios(const char *name, generator_fn gen, uint64_t seed, uint64_t iters)
{
    if (getenv("KVS_LOG") == NULL) kvs_log_set_sink(drop_log, NULL);
    kvs_rng_t rng;
    kvs_rng_seed(&rng, seed);
    uint64_t faulted = 0, failed_rooms = 0, rooms = 0, chunks = 0, broken = 0;
    for (uint64_t i = 0; i < iters; i++) {
        kvs_sim_config_t c;
        gen(&rng, &c);
        kvs_sim_result_t r;
        memset(&r, 0, sizeof(r));
        kvs_status_t st = kvs_sim_run(&c, &r);
        const char *why = st != KVS_OK ? "kvs_sim_run failed" : violated(&c, &r);
        if (why != NULL) {
            char cmd[1200];
            kvs_sim_config_cmdline(&c, cmd, sizeof(cmd));
            kvs_log_set_sink(NULL, NULL);
            fail_msg("%s: scenario %llu of property seed 0x%llx (KVS_SEED=0x%llx): %s\n"
                     "  result: %u/%u succeeded, %u failed (%u unexpected), chunks %llu (need "
                     "%llu), leaks slots %llu pages %llu rooms %llu allocs %llu\n"
                     "  replay: %s",
                     name, (unsigned long long) i, (unsigned long long) seed,
                     (unsigned long long) seed, why, r.succeeded, r.requests, r.failed,
                     r.unexpected_failures, (unsigned long long) r.chunks,
                     (unsigned long long) r.expected_chunks, (unsigned long long) r.leaked_slots,
                     (unsigned long long) r.leaked_pages, (unsigned long long) r.leaked_rooms,
                     (unsigned long long) r.leaked_allocs, cmd);
        }
        faulted += c.faults != 0;
        failed_rooms += r.failed;
        rooms += r.requests;
        chunks += r.chunks;
        broken += r.write_failures;
    }
    kvs_log_set_sink(NULL, NULL);
    print_message("%s: %llu scenarios (seed 0x%llx), %llu with faults; %llu of %llu rooms failed "
                  "under abort/timeout/misalignment/corruption/broken-write faults (%llu writes "
                  "broken); %llu chunks scattered\n",
                  name, (unsigned long long) iters, (unsigned long long) seed,
                  (unsigned long long) faulted, (unsigned long long) failed_rooms,
                  (unsigned long long) rooms, (unsigned long long) broken,
                  (unsigned long long) chunks);
    kvs_assert_no_leaks();
}

static void test_random_scenarios(void **state)
{
    (void) state;
    run_scenarios("small", random_config, kvs_test_seed(0x5eed5151), kvs_test_iters(1000));
}

/* KVS_ITERS scales both tests: this one runs a fiftieth as many (its scenarios are about a
 * hundred times the work). */
static void test_long_prompts_crowded_rings(void **state)
{
    (void) state;
    uint64_t iters = getenv("KVS_ITERS") ? (kvs_test_iters(0) + 49) / 50 : LARGE_ITERS;
    run_scenarios("large", random_large_config, kvs_test_seed(0x1a76e5eed), iters);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_random_scenarios),
        cmocka_unit_test(test_long_prompts_crowded_rings),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
