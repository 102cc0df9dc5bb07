/* Admission in the simulation's engines (sim/engine.h): a pool smaller than one request of
 * max_prompt_len is refused when the engine is created, and a request longer than
 * max_prompt_len (which no pool was sized for) fails alone at admission instead of blocking
 * every room queued behind it. The engines run over the protocol harness's senders and
 * receivers (tests/pd/pd_harness.h). */
#include "kvs_test.h"

#include <string.h>

#include "pd/pd_harness.h"
#include "sim/engine.h"

#define MAX_PROMPT 64
#define NREQ       6

typedef struct {
    int done[2][NREQ]; /* [prefill, decode][request] */
    kvs_engine_outcome_t out[2][NREQ];
} seen_t;

typedef struct {
    seen_t *seen;
    int side;
} done_arg_t;

static void on_done(void *arg, const kvs_request_t *req, const kvs_engine_outcome_t *o)
{
    done_arg_t *a = arg;
    assert_false(a->seen->done[a->side][req->index]);
    a->seen->done[a->side][req->index] = 1;
    a->seen->out[a->side][req->index] = *o;
}

static void make_engines(h_t *h, seen_t *seen, done_arg_t args[2], kvs_prefill_engine_t **pe,
                         kvs_decode_engine_t **de)
{
    args[0] = (done_arg_t){seen, 0};
    args[1] = (done_arg_t){seen, 1};
    kvs_prefill_engine_config_t pc = {.geo = h->geo, .batch = 4, .max_prompt_len = MAX_PROMPT};
    assert_int_equal(kvs_prefill_engine_create(&pc, h->ppool, h->tx, on_done, &args[0], pe),
                     KVS_OK);
    kvs_decode_engine_config_t dc = {.geo = h->geo, .max_prompt_len = MAX_PROMPT};
    assert_int_equal(kvs_decode_engine_create(&dc, h->dpool, h->rx, on_done, &args[1], de), KVS_OK);
}

/* Request 1 is longer than max_prompt_len; the others fit (and queue behind it). */
static void test_too_long_request_fails_alone(void **state)
{
    (void) state;
    kvs_pd_geometry_t geo;
    h_default_geo(&geo, 2, 2, 4);
    h_t h;
    /* Exactly one request of MAX_PROMPT: any room that waited for more would wait forever. */
    h_setup(&h, &geo, NULL, 1 << 20, MAX_PROMPT / geo.page_size);
    static const uint32_t lens[NREQ] = {30, 200, 64, 17, 50, 64};
    int32_t tokens[NREQ][200];
    kvs_request_t reqs[NREQ];
    for (uint32_t i = 0; i < NREQ; i++) {
        for (uint32_t t = 0; t < lens[i]; t++) tokens[i][t] = (int32_t) (i * 1000 + t);
        reqs[i] = (kvs_request_t){
            .room = 100 + i, .index = i, .len = lens[i], .tokens = tokens[i], .parent = -1};
    }
    seen_t seen;
    memset(&seen, 0, sizeof(seen));
    done_arg_t args[2];
    kvs_prefill_engine_t *pe;
    kvs_decode_engine_t *de;
    make_engines(&h, &seen, args, &pe, &de);
    kvs_log_capture_t cap = {.errors_only = 1};
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    for (uint32_t i = 0; i < NREQ; i++) {
        assert_int_equal(kvs_prefill_engine_submit(pe, &reqs[i], NULL), KVS_OK);
        assert_int_equal(kvs_decode_engine_submit(de, &reqs[i], NULL), KVS_OK);
    }
    int concluded = 0;
    for (int it = 0; it < 200000 && concluded < 2 * NREQ; it++) {
        h_step(&h);
        kvs_prefill_engine_step(pe);
        kvs_decode_engine_step(de);
        concluded = 0;
        for (int s = 0; s < 2; s++)
            for (int i = 0; i < NREQ; i++) concluded += seen.done[s][i];
    }
    kvs_log_set_sink(NULL, NULL);
    assert_int_equal(concluded, 2 * NREQ);
    /* One error per engine, naming the room's length and the limit. */
    assert_int_equal(cap.calls, 2);
    assert_non_null(strstr(cap.msg, "a prompt of 200 tokens is longer than the 64"));
    for (int s = 0; s < 2; s++) {
        for (uint32_t i = 0; i < NREQ; i++) {
            const kvs_engine_outcome_t *o = &seen.out[s][i];
            if (i == 1) {
                assert_int_equal(o->status, KVS_ROOM_FAILED);
                assert_int_equal(o->reason, KVS_ERR_NOSPACE);
                continue;
            }
            if (o->status != KVS_ROOM_SUCCESS)
                fail_msg("%s: request %u failed: %s", s ? "decode" : "prefill", i,
                         kvs_status_str(o->reason));
            if (s == 1) {
                assert_int_equal(o->mismatched_bytes, 0);
                assert_true(o->meta_ok);
            }
        }
    }
    assert_int_equal(kvs_prefill_engine_live_rooms(pe), 0);
    assert_int_equal(kvs_decode_engine_live_rooms(de), 0);
    kvs_prefill_engine_destroy(pe);
    kvs_decode_engine_destroy(de);
    for (uint32_t r = 0; r < geo.prefill_tp; r++)
        assert_int_equal(kvs_pool_free_pages(h.ppool[r]), kvs_pool_total_pages(h.ppool[r]));
    for (uint32_t r = 0; r < geo.decode_tp; r++)
        assert_int_equal(kvs_pool_free_pages(h.dpool[r]), kvs_pool_total_pages(h.dpool[r]));
    h_teardown(&h);
    kvs_assert_no_leaks();
}

/* A pool one page short of a max_prompt_len request is refused at creation, on either side. */
static void test_pool_smaller_than_one_request(void **state)
{
    (void) state;
    kvs_pd_geometry_t geo;
    h_default_geo(&geo, 2, 2, 4);
    h_t h;
    h_setup(&h, &geo, NULL, 1 << 20, MAX_PROMPT / geo.page_size - 1);
    kvs_log_capture_t cap = {.errors_only = 1};
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    kvs_prefill_engine_t *pe = NULL;
    kvs_decode_engine_t *de = NULL;
    kvs_prefill_engine_config_t pc = {.geo = geo, .batch = 4, .max_prompt_len = MAX_PROMPT};
    assert_int_equal(kvs_prefill_engine_create(&pc, h.ppool, h.tx, NULL, NULL, &pe),
                     KVS_ERR_INVALID);
    assert_non_null(strstr(cap.msg, "prefill pool of 15 pages per rank can never hold one"));
    kvs_decode_engine_config_t dc = {.geo = geo, .max_prompt_len = MAX_PROMPT};
    assert_int_equal(kvs_decode_engine_create(&dc, h.dpool, h.rx, NULL, NULL, &de),
                     KVS_ERR_INVALID);
    kvs_log_set_sink(NULL, NULL);
    assert_int_equal(cap.calls, 2);
    assert_non_null(strstr(cap.msg, "decode pool of 15 pages"));
    assert_non_null(strstr(cap.msg, "needs 16 pages of 4 tokens"));
    assert_null(pe);
    assert_null(de);
    h_teardown(&h);
    kvs_assert_no_leaks();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_too_long_request_fails_alone),
        cmocka_unit_test(test_pool_smaller_than_one_request),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
