/* Tests for the decode staging ring: table tests of the placement policy (wrap, tail gap skip,
 * restart at 0, exact fill, oversize requests, FIFO head-of-line blocking, out-of-order frees),
 * allocation-failure injection, and a seeded property test against a byte-level model. */
#include "kvs_test.h"

#include <string.h>

#include "kvstage/log.h"
#include "kvstage/ring.h"
#include "kvstage/rng.h"

static kvs_ring_t *make_ring(uint64_t capacity)
{
    kvs_ring_t *ring = NULL;
    assert_int_equal(kvs_ring_create(capacity, &ring), KVS_OK);
    assert_non_null(ring);
    return ring;
}

static void enq(kvs_ring_t *ring, uint64_t size, uint64_t cookie)
{
    assert_int_equal(kvs_ring_enqueue(ring, size, cookie), KVS_OK);
}

static void expect_grant(kvs_ring_t *ring, uint64_t cookie, uint64_t offset, uint64_t size)
{
    uint64_t c = 0, o = 0, s = 0;
    assert_int_equal(kvs_ring_grant(ring, &c, &o, &s), KVS_OK);
    assert_int_equal(c, cookie);
    assert_int_equal(o, offset);
    assert_int_equal(s, size);
}

static void expect_no_grant(kvs_ring_t *ring, kvs_status_t want)
{
    uint64_t c = 77, o = 77, s = 77;
    assert_int_equal(kvs_ring_grant(ring, &c, &o, &s), want);
    assert_int_equal(c, 77); /* outputs untouched */
    assert_int_equal(o, 77);
    assert_int_equal(s, 77);
}

static void expect_stats(kvs_ring_t *ring, uint64_t used, uint64_t live, uint64_t queued)
{
    kvs_ring_stats_t st;
    kvs_ring_stats(ring, &st);
    assert_int_equal(st.used_bytes, used);
    assert_int_equal(st.live_grants, live);
    assert_int_equal(st.queued, queued);
    assert_true(st.high_water_bytes >= used);
    assert_true(st.high_water_bytes <= st.capacity);
}

static void test_restart_at_zero_and_exact_fill(void **state)
{
    (void) state;
    kvs_ring_t *ring = make_ring(64);
    expect_no_grant(ring, KVS_ERR_NOT_FOUND);
    for (uint64_t i = 0; i < 4; i++) enq(ring, 16, 100 + i);
    for (uint64_t i = 0; i < 4; i++) expect_grant(ring, 100 + i, 16 * i, 16);
    expect_stats(ring, 64, 4, 0);
    expect_no_grant(ring, KVS_ERR_NOT_FOUND);
    enq(ring, 1, 200);
    expect_no_grant(ring, KVS_INPROGRESS); /* exactly full */
    /* freeing the oldest opens [0, 16): the write position is at the end, so it wraps */
    assert_int_equal(kvs_ring_free(ring, 0), KVS_OK);
    expect_stats(ring, 48, 3, 1);
    expect_grant(ring, 200, 0, 1);
    expect_stats(ring, 49, 4, 0);
    /* free everything out of order: the ring empties and restarts at 0 */
    assert_int_equal(kvs_ring_free(ring, 32), KVS_OK);
    assert_int_equal(kvs_ring_free(ring, 0), KVS_OK);
    assert_int_equal(kvs_ring_free(ring, 48), KVS_OK);
    expect_stats(ring, 49, 1, 0); /* [16, 64) + [0, 1): still up to the newest grant */
    assert_int_equal(kvs_ring_free(ring, 16), KVS_OK);
    expect_stats(ring, 0, 0, 0);
    enq(ring, 5, 300);
    expect_grant(ring, 300, 0, 5);
    assert_int_equal(kvs_ring_free(ring, 0), KVS_OK);
    /* a request of exactly the capacity fits an empty ring */
    enq(ring, 64, 301);
    expect_grant(ring, 301, 0, 64);
    expect_stats(ring, 64, 1, 0);
    assert_int_equal(kvs_ring_free(ring, 0), KVS_OK);
    kvs_ring_stats_t st;
    kvs_ring_stats(ring, &st);
    assert_int_equal(st.capacity, 64);
    assert_int_equal(st.high_water_bytes, 64);
    kvs_ring_destroy(ring);
    kvs_assert_no_leaks();
}

static void test_wrap_skips_tail_gap(void **state)
{
    (void) state;
    kvs_ring_t *ring = make_ring(100);
    enq(ring, 30, 1);
    enq(ring, 30, 2);
    enq(ring, 30, 3);
    expect_grant(ring, 1, 0, 30);
    expect_grant(ring, 2, 30, 30);
    expect_grant(ring, 3, 60, 30);
    assert_int_equal(kvs_ring_free(ring, 0), KVS_OK);
    expect_stats(ring, 60, 2, 0);
    /* 20 bytes do not fit in [90, 100): wrap to 0, skipping the 10-byte tail gap */
    enq(ring, 20, 4);
    expect_grant(ring, 4, 0, 20);
    expect_stats(ring, 90, 3, 0); /* [30, 100) + [0, 20): the gap counts as used */
    /* [20, 30) is the only usable space now, and it is filled exactly */
    enq(ring, 10, 5);
    expect_grant(ring, 5, 20, 10);
    expect_stats(ring, 100, 4, 0);
    enq(ring, 1, 6);
    expect_no_grant(ring, KVS_INPROGRESS); /* the skipped gap [90,100) is not reused */
    assert_int_equal(kvs_ring_free(ring, 30), KVS_OK);
    expect_stats(ring, 70, 3, 1);
    expect_grant(ring, 6, 30, 1);
    /* once the grant before the gap is freed, the gap is reclaimed with it */
    assert_int_equal(kvs_ring_free(ring, 60), KVS_OK);
    expect_stats(ring, 31, 3, 0); /* [0, 31) */
    enq(ring, 69, 7);
    expect_grant(ring, 7, 31, 69); /* up to the very end */
    expect_stats(ring, 100, 4, 0);
    kvs_ring_destroy(ring); /* with live grants: destroy still frees everything */
    kvs_assert_no_leaks();
}

static void test_wrap_when_head_too_big_for_front(void **state)
{
    (void) state;
    kvs_ring_t *ring = make_ring(100);
    enq(ring, 50, 1);
    enq(ring, 30, 2);
    expect_grant(ring, 1, 0, 50);
    expect_grant(ring, 2, 50, 30);
    assert_int_equal(kvs_ring_free(ring, 0), KVS_OK); /* free: [0,50) and [80,100) */
    /* 40 does not fit [80, 100) but fits [0, 50): wrap */
    enq(ring, 40, 3);
    expect_grant(ring, 3, 0, 40);
    /* the arc is now [50, 100) + [0, 40): only [40, 50) is free, too small for 15 */
    enq(ring, 15, 4);
    expect_no_grant(ring, KVS_INPROGRESS);
    enq(ring, 5, 5);
    expect_no_grant(ring, KVS_INPROGRESS); /* FIFO: 5 would fit but waits behind 4 */
    assert_int_equal(kvs_ring_cancel(ring, 4), KVS_OK);
    expect_grant(ring, 5, 40, 5);
    expect_stats(ring, 95, 3, 0);
    kvs_ring_destroy(ring);
    kvs_assert_no_leaks();
}

static void test_fifo_head_of_line(void **state)
{
    (void) state;
    kvs_ring_t *ring = make_ring(100);
    enq(ring, 60, 10);
    expect_grant(ring, 10, 0, 60);
    enq(ring, 50, 11); /* needs the first grant gone */
    enq(ring, 10, 12); /* would fit at 60 now */
    enq(ring, 30, 13);
    expect_no_grant(ring, KVS_INPROGRESS);
    expect_stats(ring, 60, 1, 3);
    assert_int_equal(kvs_ring_free(ring, 0), KVS_OK); /* ring empty: restart at 0 */
    expect_grant(ring, 11, 0, 50);
    expect_grant(ring, 12, 50, 10);
    expect_grant(ring, 13, 60, 30);
    expect_no_grant(ring, KVS_ERR_NOT_FOUND);
    expect_stats(ring, 90, 3, 0);
    kvs_ring_stats_t st;
    kvs_ring_stats(ring, &st);
    assert_int_equal(st.high_water_bytes, 90);
    kvs_ring_destroy(ring);
    kvs_assert_no_leaks();
}

static void test_bad_requests(void **state)
{
    (void) state;
    kvs_ring_t *ring = make_ring(1000);
    kvs_log_capture_t cap = {0};
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    assert_int_equal(kvs_ring_enqueue(ring, 1001, 5), KVS_ERR_NOSPACE);
    assert_non_null(strstr(cap.msg, "1001"));
    assert_non_null(strstr(cap.msg, "1000"));
    assert_int_equal(kvs_ring_enqueue(ring, UINT64_MAX, 6), KVS_ERR_NOSPACE);
    assert_int_equal(kvs_ring_enqueue(ring, 0, 7), KVS_ERR_INVALID);
    enq(ring, 10, 8);
    assert_int_equal(kvs_ring_enqueue(ring, 20, 8), KVS_ERR_INVALID); /* cookie already queued */
    assert_non_null(strstr(cap.msg, "already queued"));
    expect_stats(ring, 0, 0, 1);
    assert_int_equal(kvs_ring_cancel(ring, 99), KVS_ERR_NOT_FOUND);
    expect_grant(ring, 8, 0, 10);
    assert_int_equal(kvs_ring_cancel(ring, 8), KVS_ERR_NOT_FOUND); /* granted, not queued */
    enq(ring, 20, 8); /* a cookie can be reused once its request left the queue */
    expect_grant(ring, 8, 10, 20);
    int before = cap.calls;
    assert_int_equal(kvs_ring_free(ring, 5), KVS_ERR_NOT_FOUND); /* inside a grant */
    assert_int_equal(cap.calls, before + 1);
    assert_int_equal(kvs_ring_free(ring, 30), KVS_ERR_NOT_FOUND); /* the write position */
    assert_int_equal(kvs_ring_free(ring, 10), KVS_OK);
    assert_int_equal(kvs_ring_free(ring, 10), KVS_ERR_NOT_FOUND); /* double free */
    expect_stats(ring, 30, 1, 0); /* freed out of order: not reclaimed yet */
    assert_int_equal(kvs_ring_free(ring, 0), KVS_OK);
    expect_stats(ring, 0, 0, 0);
    assert_int_equal(kvs_ring_free(ring, 0), KVS_ERR_NOT_FOUND);
    kvs_ring_t *none = (kvs_ring_t *) (uintptr_t) 1;
    assert_int_equal(kvs_ring_create(0, &none), KVS_ERR_INVALID);
    assert_ptr_equal(none, (kvs_ring_t *) (uintptr_t) 1);
    assert_int_equal(kvs_ring_create(10, NULL), KVS_ERR_INVALID);
    kvs_log_set_sink(NULL, NULL);
    kvs_ring_destroy(ring);
    kvs_ring_destroy(NULL);
    kvs_assert_no_leaks();
}

static void test_cancel_middle_and_ends(void **state)
{
    (void) state;
    kvs_ring_t *ring = make_ring(10);
    for (uint64_t c = 1; c <= 5; c++) enq(ring, 2, c);
    assert_int_equal(kvs_ring_cancel(ring, 3), KVS_OK);
    assert_int_equal(kvs_ring_cancel(ring, 1), KVS_OK);
    assert_int_equal(kvs_ring_cancel(ring, 5), KVS_OK);
    assert_int_equal(kvs_ring_cancel(ring, 3), KVS_ERR_NOT_FOUND);
    expect_stats(ring, 0, 0, 2);
    enq(ring, 2, 6);
    expect_grant(ring, 2, 0, 2);
    expect_grant(ring, 4, 2, 2);
    expect_grant(ring, 6, 4, 2);
    expect_no_grant(ring, KVS_ERR_NOT_FOUND);
    assert_int_equal(kvs_ring_cancel(ring, 6), KVS_ERR_NOT_FOUND);
    enq(ring, 9, 7);
    kvs_ring_destroy(ring); /* with queued requests and live grants */
    kvs_assert_no_leaks();
}

static void test_alloc_failures(void **state)
{
    (void) state;
    kvs_ring_t *ring = NULL;
    kvs_log_capture_t cap = {0};
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    kvs_alloc_fail_at(1);
    assert_int_equal(kvs_ring_create(100, &ring), KVS_ERR_NOMEM);
    assert_null(ring);
    kvs_assert_no_leaks();
    ring = make_ring(100);
    /* enqueue makes a node and grows the cookie map: fail each in turn */
    for (uint64_t nth = 1; nth <= 2; nth++) {
        kvs_alloc_fail_at(nth);
        assert_int_equal(kvs_ring_enqueue(ring, 10, 1), KVS_ERR_NOMEM);
        kvs_alloc_fail_at(0);
        expect_stats(ring, 0, 0, 0);
        expect_no_grant(ring, KVS_ERR_NOT_FOUND);
    }
    enq(ring, 10, 1);
    enq(ring, 10, 2);
    /* the first grant grows the offset map: a failure there grants nothing */
    kvs_alloc_fail_at(1);
    uint64_t c = 9, o = 9, s = 9;
    assert_int_equal(kvs_ring_grant(ring, &c, &o, &s), KVS_ERR_NOMEM);
    kvs_alloc_fail_at(0);
    assert_int_equal(c, 9);
    kvs_log_set_sink(NULL, NULL);
    assert_int_equal(cap.calls, 4);
    assert_non_null(strstr(cap.msg, "out of memory granting"));
    expect_stats(ring, 0, 0, 2);
    expect_grant(ring, 1, 0, 10);
    expect_grant(ring, 2, 10, 10);
    kvs_ring_destroy(ring);
    kvs_assert_no_leaks();
}

/* ---- property test ---- */

typedef struct {
    uint64_t cookie, size;
} model_req_t;

typedef struct {
    uint64_t offset, size, seq; /* seq: allocation order */
} model_grant_t;

#define MODEL_MAX 512

typedef struct {
    uint64_t cap;
    model_req_t q[MODEL_MAX];
    uint32_t nq;
    model_grant_t g[MODEL_MAX]; /* live grants, any order */
    uint32_t ng;
    uint8_t owner[MODEL_MAX]; /* bytes covered by live grants */
    uint64_t last_end;        /* end of the most recent grant */
    uint64_t seq;
    uint64_t high_water;
    uint64_t next_cookie;
} model_t;

/* Per the contract: the space from the oldest live grant to the end of the most recent grant
 * (going forward around the ring) is unavailable; returns its length and marks it. */
static uint64_t model_arc(const model_t *m, uint8_t *blocked)
{
    memset(blocked, 0, m->cap);
    if (m->ng == 0) return 0;
    uint32_t oldest = 0;
    for (uint32_t i = 1; i < m->ng; i++)
        if (m->g[i].seq < m->g[oldest].seq) oldest = i;
    uint64_t start = m->g[oldest].offset;
    uint64_t len = (m->last_end % m->cap + m->cap - start) % m->cap;
    if (len == 0) len = m->cap;
    for (uint64_t k = 0; k < len; k++) blocked[(start + k) % m->cap] = 1;
    return len;
}

static int model_fits(const model_t *m, const uint8_t *blocked, uint64_t at, uint64_t size)
{
    if (at + size > m->cap) return 0;
    for (uint64_t k = 0; k < size; k++)
        if (blocked[at + k]) return 0;
    return 1;
}

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "ring property failed (KVS_SEED=0x%llx, step %llu): ",                 \
                    (unsigned long long) seed, (unsigned long long) step);                         \
            fail_msg(__VA_ARGS__);                                                                 \
        }                                                                                          \
    } while (0)

static void test_ring_property(void **state)
{
    (void) state;
    const uint64_t seed = kvs_test_seed(0x51a9e);
    const uint64_t episodes = kvs_test_iters(1000);
    kvs_rng_t rng;
    kvs_rng_seed(&rng, seed);
    kvs_log_capture_t cap = {0};
    kvs_log_set_sink(kvs_log_capture_sink,
                     &cap); /* invalid calls are part of the test: keep quiet */
    static model_t m;
    uint8_t blocked[MODEL_MAX];
    uint64_t step = 0;
    for (uint64_t ep = 0; ep < episodes; ep++) {
        memset(&m, 0, sizeof(m));
        m.cap = kvs_rng_range(&rng, 1, MODEL_MAX);
        uint64_t max_req = kvs_rng_chance(&rng, 1, 2) ? m.cap : (m.cap + 3) / 4;
        kvs_ring_t *ring = make_ring(m.cap);
        for (int it = 0; it < 400; it++, step++) {
            uint64_t op = kvs_rng_below(&rng, 10);
            if (op < 4 && m.nq < MODEL_MAX) {
                uint64_t size = kvs_rng_range(&rng, 1, max_req);
                uint64_t cookie = m.next_cookie++;
                kvs_status_t st = kvs_ring_enqueue(ring, size, cookie);
                CHECK(st == KVS_OK, "enqueue failed: %d", st);
                m.q[m.nq].cookie = cookie;
                m.q[m.nq].size = size;
                m.nq++;
            } else if (op == 4) {
                /* invalid enqueues change nothing */
                if (m.nq > 0) {
                    uint64_t c = m.q[kvs_rng_below(&rng, m.nq)].cookie;
                    CHECK(kvs_ring_enqueue(ring, 1, c) == KVS_ERR_INVALID, "duplicate cookie");
                }
                CHECK(kvs_ring_enqueue(ring, m.cap + kvs_rng_range(&rng, 1, 9), 1u << 30) ==
                          KVS_ERR_NOSPACE,
                      "oversize accepted");
                CHECK(kvs_ring_enqueue(ring, 0, 1u << 30) == KVS_ERR_INVALID, "size 0 accepted");
            } else if (op < 7) {
                /* grant until the ring says stop, checking each against the model */
                for (;;) {
                    uint64_t used = model_arc(&m, blocked);
                    uint64_t c, o, s;
                    kvs_status_t st = kvs_ring_grant(ring, &c, &o, &s);
                    if (m.nq == 0) {
                        CHECK(st == KVS_ERR_NOT_FOUND, "grant from empty queue: %d", st);
                        break;
                    }
                    uint64_t want = m.q[0].size;
                    int at_end = m.ng > 0 && model_fits(&m, blocked, m.last_end, want);
                    int at_zero = m.ng == 0 || (!at_end && model_fits(&m, blocked, 0, want));
                    if (!at_end && !at_zero) {
                        CHECK(st == KVS_INPROGRESS, "head of %llu should wait (used %llu): %d",
                              (unsigned long long) want, (unsigned long long) used, st);
                        break;
                    }
                    CHECK(st == KVS_OK, "head of %llu should be granted: %d",
                          (unsigned long long) want, st);
                    CHECK(c == m.q[0].cookie, "out of FIFO order: got %llu, want %llu",
                          (unsigned long long) c, (unsigned long long) m.q[0].cookie);
                    CHECK(s == want, "size %llu, want %llu", (unsigned long long) s,
                          (unsigned long long) want);
                    CHECK(o == (at_end ? m.last_end : 0), "offset %llu (last end %llu)",
                          (unsigned long long) o, (unsigned long long) m.last_end);
                    CHECK(o + s <= m.cap, "grant outside the ring");
                    for (uint64_t k = 0; k < s; k++) {
                        CHECK(!m.owner[o + k], "grant overlaps a live grant at byte %llu",
                              (unsigned long long) (o + k));
                        m.owner[o + k] = 1;
                    }
                    memmove(&m.q[0], &m.q[1], (m.nq - 1) * sizeof(m.q[0]));
                    m.nq--;
                    m.g[m.ng].offset = o;
                    m.g[m.ng].size = s;
                    m.g[m.ng].seq = m.seq++;
                    m.ng++;
                    m.last_end = o + s;
                    uint64_t now = model_arc(&m, blocked);
                    if (now > m.high_water) m.high_water = now;
                }
            } else if (op < 9 && m.ng > 0) {
                uint32_t i = (uint32_t) kvs_rng_below(&rng, m.ng);
                CHECK(kvs_ring_free(ring, m.g[i].offset) == KVS_OK, "free of a live grant");
                for (uint64_t k = 0; k < m.g[i].size; k++) m.owner[m.g[i].offset + k] = 0;
                m.g[i] = m.g[--m.ng];
                /* a bogus offset: not the start of any live grant */
                uint64_t bogus = kvs_rng_below(&rng, m.cap + 2);
                int live = 0;
                for (uint32_t j = 0; j < m.ng; j++) live |= m.g[j].offset == bogus;
                if (!live)
                    CHECK(kvs_ring_free(ring, bogus) == KVS_ERR_NOT_FOUND, "bogus free accepted");
            } else if (m.nq > 0) {
                uint32_t i = (uint32_t) kvs_rng_below(&rng, m.nq);
                CHECK(kvs_ring_cancel(ring, m.q[i].cookie) == KVS_OK, "cancel of queued");
                CHECK(kvs_ring_cancel(ring, m.q[i].cookie) == KVS_ERR_NOT_FOUND, "second cancel");
                memmove(&m.q[i], &m.q[i + 1], (m.nq - i - 1) * sizeof(m.q[0]));
                m.nq--;
            }
            kvs_ring_stats_t st;
            kvs_ring_stats(ring, &st);
            uint64_t used = model_arc(&m, blocked);
            CHECK(st.capacity == m.cap, "capacity");
            CHECK(st.used_bytes == used, "used %llu, model %llu",
                  (unsigned long long) st.used_bytes, (unsigned long long) used);
            CHECK(st.live_grants == m.ng, "live grants %llu, model %u",
                  (unsigned long long) st.live_grants, m.ng);
            CHECK(st.queued == m.nq, "queued %llu, model %u", (unsigned long long) st.queued, m.nq);
            CHECK(st.high_water_bytes == m.high_water, "high water %llu, model %llu",
                  (unsigned long long) st.high_water_bytes, (unsigned long long) m.high_water);
            for (uint64_t k = 0; k < m.cap; k++)
                CHECK(!m.owner[k] || blocked[k], "live byte %llu outside the used arc",
                      (unsigned long long) k);
        }
        /* drain: free everything; the ring must come back empty and grant at 0 */
        while (m.ng > 0) {
            uint32_t i = (uint32_t) kvs_rng_below(&rng, m.ng);
            CHECK(kvs_ring_free(ring, m.g[i].offset) == KVS_OK, "drain free");
            m.g[i] = m.g[--m.ng];
        }
        kvs_ring_stats_t st;
        kvs_ring_stats(ring, &st);
        CHECK(st.used_bytes == 0 && st.live_grants == 0, "not empty after draining");
        if (m.nq > 0) {
            uint64_t c, o, s;
            CHECK(kvs_ring_grant(ring, &c, &o, &s) == KVS_OK && o == 0 && c == m.q[0].cookie,
                  "empty ring must grant the head at 0");
            CHECK(kvs_ring_free(ring, 0) == KVS_OK, "free after drain");
        }
        kvs_ring_destroy(ring);
    }
    kvs_log_set_sink(NULL, NULL);
    kvs_assert_no_leaks();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_restart_at_zero_and_exact_fill),
        cmocka_unit_test(test_wrap_skips_tail_gap),
        cmocka_unit_test(test_wrap_when_head_too_big_for_front),
        cmocka_unit_test(test_fifo_head_of_line),
        cmocka_unit_test(test_bad_requests),
        cmocka_unit_test(test_cancel_middle_and_ends),
        cmocka_unit_test(test_alloc_failures),
        cmocka_unit_test(test_ring_property),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
