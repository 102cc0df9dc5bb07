/* Tests for src/base: status strings, logging sink and levels, the accounted allocator with
 * fault injection, the clock and the seeded PRNG. */
#include "kvs_test.h"

#include <string.h>

#include "kvstage/clock.h"
#include "kvstage/log.h"
#include "kvstage/rng.h"
#include "kvstage/status.h"

static void test_status_str(void **state)
{
    (void) state;
    assert_string_equal(kvs_status_str(KVS_OK), "ok");
    assert_string_equal(kvs_status_str(KVS_ERR_NOSPACE), "no space");
    assert_string_equal(kvs_status_str((kvs_status_t) -999), "unknown status");
    for (int s = KVS_ERR_STATE; s <= KVS_INPROGRESS; s++) {
        assert_non_null(kvs_status_str((kvs_status_t) s));
        assert_string_not_equal(kvs_status_str((kvs_status_t) s), "unknown status");
    }
}

typedef struct {
    int calls;
    kvs_log_level_t level;
    char msg[256];
} sink_capture_t;

static void capture_sink(void *arg, kvs_log_level_t level, const char *file, int line,
                         const char *msg)
{
    sink_capture_t *c = arg;
    c->calls++;
    c->level = level;
    snprintf(c->msg, sizeof(c->msg), "%s", msg);
    assert_non_null(file);
    assert_true(line > 0);
}

static void test_log_sink_and_level(void **state)
{
    (void) state;
    sink_capture_t cap = {0};
    kvs_log_level_t old = kvs_log_get_level();
    kvs_log_set_sink(capture_sink, &cap);
    kvs_log_set_level(KVS_LOG_WARN);
    kvs_error("room %d failed", 7);
    assert_int_equal(cap.calls, 1);
    assert_int_equal(cap.level, KVS_LOG_ERROR);
    assert_string_equal(cap.msg, "room 7 failed");
    kvs_debug("hidden %d", 1);
    assert_int_equal(cap.calls, 1);
    kvs_log_set_level(KVS_LOG_TRACE);
    kvs_debug("shown");
    assert_int_equal(cap.calls, 2);
    assert_int_equal(cap.level, KVS_LOG_DEBUG);
    kvs_log_set_sink(NULL, NULL);
    kvs_log_set_level(old);
}

static void test_alloc_accounting(void **state)
{
    (void) state;
    kvs_alloc_stats_t before, mid, after;
    kvs_alloc_stats(&before);
    char *a = kvs_malloc(100);
    int *b = kvs_calloc(10, sizeof(int));
    assert_non_null(a);
    assert_non_null(b);
    for (int i = 0; i < 10; i++) assert_int_equal(b[i], 0);
    void *c = kvs_aligned_alloc(4096, 5000);
    assert_non_null(c);
    assert_int_equal((uintptr_t) c % 4096, 0);
    memset(c, 0xab, 5000);
    kvs_alloc_stats(&mid);
    assert_int_equal(mid.live_blocks, before.live_blocks + 3);
    assert_int_equal(mid.live_bytes, before.live_bytes + 100 + 10 * sizeof(int) + 5000);
    memcpy(a, "hello", 6);
    a = kvs_realloc(a, 4000);
    assert_non_null(a);
    assert_string_equal(a, "hello");
    char *d = kvs_strdup("kvstage");
    assert_string_equal(d, "kvstage");
    kvs_free(a);
    kvs_free(b);
    kvs_free(c);
    kvs_free(d);
    kvs_free(NULL);
    kvs_alloc_stats(&after);
    assert_int_equal(after.live_blocks, before.live_blocks);
    assert_int_equal(after.live_bytes, before.live_bytes);
    assert_true(after.peak_bytes >= mid.live_bytes);
    assert_null(kvs_calloc(SIZE_MAX / 2, 4));
    assert_null(kvs_aligned_alloc(3, 16));
}

static void test_alloc_fail_at(void **state)
{
    (void) state;
    kvs_alloc_stats_t before, after;
    kvs_alloc_stats(&before);
    kvs_alloc_fail_at(3);
    void *p1 = kvs_malloc(8);
    void *p2 = kvs_malloc(8);
    void *p3 = kvs_malloc(8);
    void *p4 = kvs_malloc(8);
    assert_non_null(p1);
    assert_non_null(p2);
    assert_null(p3);
    assert_non_null(p4);
    kvs_free(p1);
    kvs_free(p2);
    kvs_free(p4);
    kvs_alloc_fail_all(1);
    assert_null(kvs_malloc(1));
    assert_null(kvs_strdup("x"));
    kvs_alloc_fail_all(0);
    void *p5 = kvs_malloc(1);
    assert_non_null(p5);
    kvs_free(p5);
    kvs_alloc_stats(&after);
    assert_int_equal(after.failed_allocs, before.failed_allocs + 3);
    assert_int_equal(after.live_blocks, before.live_blocks);
}

static void test_realloc_failure_keeps_block(void **state)
{
    (void) state;
    char *a = kvs_malloc(16);
    assert_non_null(a);
    memcpy(a, "keep", 5);
    kvs_alloc_fail_at(1);
    char *b = kvs_realloc(a, 64);
    assert_null(b);
    assert_string_equal(a, "keep");
    kvs_free(a);
    kvs_assert_no_leaks();
}

static void test_clock_monotonic(void **state)
{
    (void) state;
    kvs_clock_t c = kvs_clock_monotonic();
    uint64_t t0 = kvs_clock_now(&c);
    uint64_t t1 = kvs_now_ns();
    assert_true(t1 >= t0);
    assert_true(t0 > 0);
}

static void test_rng_reproducible_and_bounded(void **state)
{
    (void) state;
    kvs_rng_t a, b;
    kvs_rng_seed(&a, 42);
    kvs_rng_seed(&b, 42);
    for (int i = 0; i < 1000; i++) assert_int_equal(kvs_rng_next(&a), kvs_rng_next(&b));
    kvs_rng_seed(&b, 43);
    int differ = 0;
    for (int i = 0; i < 16; i++) differ |= kvs_rng_next(&a) != kvs_rng_next(&b);
    assert_true(differ);
    int hist[7] = {0};
    for (int i = 0; i < 70000; i++) {
        uint64_t v = kvs_rng_below(&a, 7);
        assert_true(v < 7);
        hist[v]++;
    }
    for (int i = 0; i < 7; i++) assert_true(hist[i] > 9000 && hist[i] < 11000);
    for (int i = 0; i < 1000; i++) {
        uint64_t v = kvs_rng_range(&a, 5, 9);
        assert_true(v >= 5 && v <= 9);
    }
    assert_int_equal(kvs_rng_below(&a, 0), 0);
    assert_int_equal(kvs_rng_range(&a, 3, 3), 3);
    assert_false(kvs_rng_chance(&a, 0, 10));
    assert_true(kvs_rng_chance(&a, 10, 10));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_status_str),
        cmocka_unit_test(test_log_sink_and_level),
        cmocka_unit_test(test_alloc_accounting),
        cmocka_unit_test(test_alloc_fail_at),
        cmocka_unit_test(test_realloc_failure_keeps_block),
        cmocka_unit_test(test_clock_monotonic),
        cmocka_unit_test(test_rng_reproducible_and_bounded),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
