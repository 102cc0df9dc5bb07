/* Tests for src/base/mem.c: host allocation (zeroed, aligned, accounted, failure injected),
 * copies and the host copy queue everywhere; device memory refused cleanly where there is no
 * CUDA or no GPU. On a GPU: zeroed device allocations, copies between host and device, within
 * one GPU and between two (peer access), pointer queries, and the device copy queue with more
 * copies in flight than it has events, whose sources are rewritten only after their tickets
 * complete. */
#include "kvs_test.h"

#include <string.h>

#include "base/mem.h"
#include "kvstage/log.h"
#include "kvstage/rng.h"

static void fill(kvs_rng_t *rng, uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++) p[i] = (uint8_t) kvs_rng_next(rng);
}

static void test_host_alloc_zeroed_aligned(void **state)
{
    (void) state;
    size_t sizes[] = {0, 1, 4095, 4096, 100000};
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
        void *p = NULL;
        assert_int_equal(kvs_mem_alloc(KVS_MEM_HOST, 0, sizes[i], &p), KVS_OK);
        assert_non_null(p);
        assert_int_equal((uintptr_t) p % KVS_MEM_ALIGN, 0);
        for (size_t b = 0; b < sizes[i]; b++) assert_int_equal(((uint8_t *) p)[b], 0);
        assert_int_equal(kvs_mem_device_of(p), -1);
        kvs_mem_free(KVS_MEM_HOST, 0, p);
    }
    kvs_mem_free(KVS_MEM_HOST, 0, NULL);
    kvs_assert_no_leaks();
}

static void test_host_alloc_refusals(void **state)
{
    (void) state;
    kvs_log_capture_t cap = {0};
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    void *p = (void *) 0x1;
    assert_int_equal(kvs_mem_alloc((kvs_mem_kind_t) 5, 0, 16, &p), KVS_ERR_INVALID);
    assert_int_equal(kvs_mem_alloc(KVS_MEM_HOST, 0, 16, NULL), KVS_ERR_INVALID);
    assert_ptr_equal(p, (void *) 0x1); /* outputs are written only on success */
    kvs_alloc_fail_at(1);
    assert_int_equal(kvs_mem_alloc(KVS_MEM_HOST, 0, 1024, &p), KVS_ERR_NOMEM);
    assert_ptr_equal(p, (void *) 0x1);
    assert_non_null(strstr(cap.msg, "out of memory"));
    assert_int_equal(cap.calls, 3); /* each failure logged once */
    kvs_alloc_fail_at(0);
    kvs_log_set_sink(NULL, NULL);
    kvs_assert_no_leaks();
}

static void test_host_copy_and_queue(void **state)
{
    (void) state;
    kvs_rng_t rng;
    uint64_t seed = kvs_test_seed(11);
    kvs_rng_seed(&rng, seed);
    uint8_t a[3000], b[3000];
    fill(&rng, a, sizeof(a));
    memset(b, 0, sizeof(b));
    assert_int_equal(kvs_mem_copy(b, a, sizeof(a)), KVS_OK);
    assert_memory_equal(a, b, sizeof(a));
    assert_int_equal(kvs_mem_copy(b, a, 0), KVS_OK);

    kvs_mem_queue_t *q = NULL;
    assert_int_equal(kvs_mem_queue_create(-1, &q), KVS_OK);
    assert_int_equal(kvs_mem_queue_device(q), -1);
    uint64_t last = 0;
    for (int i = 0; i < 10; i++) {
        uint64_t t = 0;
        fill(&rng, a, sizeof(a));
        assert_int_equal(kvs_mem_queue_copy(q, b, a, sizeof(a), &t), KVS_OK);
        assert_true(t > last);
        last = t;
        assert_int_equal(kvs_mem_queue_poll(q, t), KVS_OK);
        assert_memory_equal(a, b, sizeof(a));
    }
    kvs_log_capture_t cap = {0};
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    assert_int_equal(kvs_mem_queue_poll(q, 0), KVS_ERR_INVALID);
    assert_int_equal(kvs_mem_queue_poll(q, last + 1), KVS_ERR_INVALID);
    assert_int_equal(cap.calls, 2);
    kvs_log_set_sink(NULL, NULL);
    kvs_mem_queue_destroy(q);
    kvs_mem_queue_destroy(NULL);
    kvs_assert_no_leaks();
}

/* Without CUDA or without a GPU, device memory and device queues are refused with one message
 * and nothing leaks; with a GPU, a device beyond the last is refused. */
static void test_device_refusals(void **state)
{
    (void) state;
    kvs_log_capture_t cap = {0};
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    const int count = kvs_mem_device_count();
    void *p = (void *) 0x1;
    kvs_mem_queue_t *q = NULL;
    if (count == 0) {
        assert_int_equal(kvs_mem_alloc(KVS_MEM_DEVICE, 0, 4096, &p), KVS_ERR_UNSUPPORTED);
        assert_non_null(strstr(cap.msg, "device memory"));
        assert_int_equal(kvs_mem_queue_create(0, &q), KVS_ERR_UNSUPPORTED);
        assert_int_equal(kvs_mem_device_can_access(0, &cap), 0);
        assert_int_equal(cap.calls, 2);
    } else {
        assert_int_equal(kvs_mem_alloc(KVS_MEM_DEVICE, count, 4096, &p), KVS_ERR_INVALID);
        assert_non_null(strstr(cap.msg, "CUDA device(s)"));
        assert_int_equal(kvs_mem_queue_create(count, &q), KVS_ERR_INVALID);
    }
    assert_ptr_equal(p, (void *) 0x1);
    assert_null(q);
    kvs_log_set_sink(NULL, NULL);
    kvs_assert_no_leaks();
}

static void require_gpu(void)
{
    if (kvs_mem_device_count() == 0) {
        print_message("no CUDA device here: GPU memory tests skipped\n");
        skip();
    }
}

static void test_device_alloc_and_copies(void **state)
{
    (void) state;
    require_gpu();
    const int count = kvs_mem_device_count(), other = count > 1 ? 1 : 0;
    const size_t n = (1u << 20) + 123; /* not a multiple of anything nice */
    kvs_rng_t rng;
    uint64_t seed = kvs_test_seed(12);
    kvs_rng_seed(&rng, seed);
    uint8_t *h1 = malloc(n), *h2 = malloc(n);
    assert_non_null(h1);
    assert_non_null(h2);
    void *d0 = NULL, *d0b = NULL, *d1 = NULL;
    assert_int_equal(kvs_mem_alloc(KVS_MEM_DEVICE, 0, n, &d0), KVS_OK);
    assert_int_equal(kvs_mem_alloc(KVS_MEM_DEVICE, 0, n, &d0b), KVS_OK);
    assert_int_equal(kvs_mem_alloc(KVS_MEM_DEVICE, other, n, &d1), KVS_OK);
    assert_int_equal(kvs_mem_device_of(d0), 0);
    assert_int_equal(kvs_mem_device_of(d1), other);
    assert_int_equal(kvs_mem_device_of(h1), -1);

    /* zeroed */
    memset(h2, 0xff, n);
    assert_int_equal(kvs_mem_copy(h2, d1, n), KVS_OK);
    for (size_t i = 0; i < n; i++) assert_int_equal(h2[i], 0);

    /* host -> device -> device (same GPU) -> other GPU -> host */
    fill(&rng, h1, n);
    assert_int_equal(kvs_mem_copy(d0, h1, n), KVS_OK);
    assert_int_equal(kvs_mem_copy(d0b, d0, n), KVS_OK);
    if (other != 0) assert_int_equal(kvs_mem_peer_enable(0, other), KVS_OK);
    assert_int_equal(kvs_mem_copy(d1, d0b, n), KVS_OK);
    memset(h2, 0, n);
    assert_int_equal(kvs_mem_copy(h2, d1, n), KVS_OK);
    if (memcmp(h1, h2, n) != 0)
        fail_msg("round trip through %d GPU(s) differs (seed %llu)", count,
                 (unsigned long long) seed);
    /* an unaligned window inside */
    assert_int_equal(kvs_mem_copy(h2 + 5, (uint8_t *) d0 + 77, 1000), KVS_OK);
    assert_memory_equal(h2 + 5, h1 + 77, 1000);

    assert_int_equal(kvs_mem_device_can_access(0, d0), 1);
    assert_int_equal(kvs_mem_device_can_access(0, d1), 1); /* same GPU, or a peer */
    assert_int_equal(kvs_mem_device_can_access(0, h1), 0);
    assert_int_equal(kvs_mem_device_sync(0), KVS_OK);

    kvs_mem_free(KVS_MEM_DEVICE, 0, d0);
    kvs_mem_free(KVS_MEM_DEVICE, 0, d0b);
    kvs_mem_free(KVS_MEM_DEVICE, other, d1);
    free(h1);
    free(h2);
    kvs_assert_no_leaks();
}

/* More copies than the queue has events, each from its own source slice; a slice is rewritten
 * (for the next round) only once its ticket reported complete, and the destination must hold
 * exactly what each slice held when its copy was issued. */
static void test_device_queue(void **state)
{
    (void) state;
    require_gpu();
    const int count = kvs_mem_device_count(), other = count > 1 ? 1 : 0;
    const uint32_t copies = 200, slice = 4096 + 16;
    const size_t n = (size_t) copies * slice;
    kvs_rng_t rng;
    uint64_t seed = kvs_test_seed(13);
    kvs_rng_seed(&rng, seed);
    uint8_t *host = malloc(n), *back = malloc(n);
    assert_non_null(host);
    assert_non_null(back);
    void *src = NULL, *dst = NULL;
    assert_int_equal(kvs_mem_alloc(KVS_MEM_DEVICE, 0, n, &src), KVS_OK);
    assert_int_equal(kvs_mem_alloc(KVS_MEM_DEVICE, other, n, &dst), KVS_OK);
    kvs_mem_queue_t *q = NULL;
    assert_int_equal(kvs_mem_queue_create(0, &q), KVS_OK);
    assert_int_equal(kvs_mem_queue_device(q), 0);
    uint64_t *tickets = calloc(copies, sizeof(uint64_t));
    assert_non_null(tickets);
    for (int round = 0; round < 2; round++) {
        fill(&rng, host, n);
        assert_int_equal(kvs_mem_copy(src, host, n), KVS_OK);
        for (uint32_t i = 0; i < copies; i++) {
            /* reversed order in the destination, so a misplaced copy shows */
            uint8_t *d = (uint8_t *) dst + (size_t) (copies - 1 - i) * slice;
            assert_int_equal(
                kvs_mem_queue_copy(q, d, (uint8_t *) src + (size_t) i * slice, slice, &tickets[i]),
                KVS_OK);
            if (i > 0) assert_true(tickets[i] > tickets[i - 1]);
        }
        kvs_status_t st;
        while ((st = kvs_mem_queue_poll(q, tickets[copies - 1])) == KVS_INPROGRESS) {
        }
        assert_int_equal(st, KVS_OK);
        for (uint32_t i = 0; i < copies; i++)
            assert_int_equal(kvs_mem_queue_poll(q, tickets[i]), KVS_OK);
        assert_int_equal(kvs_mem_copy(back, dst, n), KVS_OK);
        for (uint32_t i = 0; i < copies; i++)
            if (memcmp(back + (size_t) (copies - 1 - i) * slice, host + (size_t) i * slice,
                       slice) != 0)
                fail_msg("queued copy %u landed wrong (round %d, seed %llu)", i, round,
                         (unsigned long long) seed);
    }
    kvs_mem_queue_destroy(q);
    kvs_mem_free(KVS_MEM_DEVICE, 0, src);
    kvs_mem_free(KVS_MEM_DEVICE, other, dst);
    free(tickets);
    free(host);
    free(back);
    kvs_assert_no_leaks();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_host_alloc_zeroed_aligned),
        cmocka_unit_test(test_host_alloc_refusals),
        cmocka_unit_test(test_host_copy_and_queue),
        cmocka_unit_test(test_device_refusals),
        cmocka_unit_test(test_device_alloc_and_copies),
        cmocka_unit_test(test_device_queue),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
