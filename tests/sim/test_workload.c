/* Tests for the workloads: deterministic per seed, and each kind has the sharing structure it
 * promises (the radix scenarios of the simulation depend on it). */
#include "kvs_test.h"

#include <string.h>

#include "sim/sim.h"

static uint32_t lcp(const kvs_request_t *a, const kvs_request_t *b)
{
    uint32_t n = a->len < b->len ? a->len : b->len, i = 0;
    while (i < n && a->tokens[i] == b->tokens[i]) i++;
    return i;
}

static kvs_workload_t *make(kvs_workload_kind_t kind, uint32_t requests, uint32_t prompt,
                            uint32_t prefix, uint64_t seed)
{
    kvs_workload_config_t c = {.kind = kind,
                               .requests = requests,
                               .prompt_len = prompt,
                               .prefix_len = prefix,
                               .seed = seed};
    kvs_workload_t *w = NULL;
    assert_int_equal(kvs_workload_create(&c, &w), KVS_OK);
    assert_int_equal(w->count, requests);
    for (uint32_t i = 0; i < requests; i++) {
        assert_int_equal(w->requests[i].index, i);
        assert_true(w->requests[i].len >= 1 && w->requests[i].len <= prompt);
    }
    return w;
}

static void test_deterministic_per_seed(void **state)
{
    (void) state;
    for (int kind = 0; kind < 4; kind++) {
        kvs_workload_t *a = make((kvs_workload_kind_t) kind, 40, 300, 100, 7);
        kvs_workload_t *b = make((kvs_workload_kind_t) kind, 40, 300, 100, 7);
        kvs_workload_t *c = make((kvs_workload_kind_t) kind, 40, 300, 100, 8);
        int differs = 0;
        for (uint32_t i = 0; i < 40; i++) {
            assert_int_equal(a->requests[i].len, b->requests[i].len);
            assert_true(a->requests[i].room == b->requests[i].room);
            assert_memory_equal(a->requests[i].tokens, b->requests[i].tokens,
                                a->requests[i].len * sizeof(int32_t));
            differs |= a->requests[i].len != c->requests[i].len ||
                       memcmp(a->requests[i].tokens, c->requests[i].tokens,
                              a->requests[i].len * sizeof(int32_t)) != 0;
            /* Room ids are distinct. */
            for (uint32_t j = 0; j < i; j++)
                assert_true(a->requests[i].room != a->requests[j].room);
        }
        assert_true(differs);
        kvs_workload_destroy(a);
        kvs_workload_destroy(b);
        kvs_workload_destroy(c);
    }
    kvs_assert_no_leaks();
}

static void test_shared_prefix_structure(void **state)
{
    (void) state;
    kvs_workload_config_t c = {.kind = KVS_WORKLOAD_SHARED_PREFIX,
                               .requests = 60,
                               .prompt_len = 400,
                               .prefix_len = 150,
                               .groups = 3,
                               .seed = 3};
    kvs_workload_t *w = NULL;
    assert_int_equal(kvs_workload_create(&c, &w), KVS_OK);
    uint32_t per_group[3] = {0};
    for (uint32_t i = 0; i < w->count; i++) {
        const kvs_request_t *a = &w->requests[i];
        assert_true(a->group < 3);
        per_group[a->group]++;
        assert_true(a->len > 150 && a->len <= 400);
        for (uint32_t j = 0; j < i; j++) {
            const kvs_request_t *b = &w->requests[j];
            /* Same group: exactly the prefix is shared (tails are unique from their first
             * token); different groups share nothing. */
            assert_int_equal(lcp(a, b), a->group == b->group ? 150 : 0);
        }
    }
    for (int g = 0; g < 3; g++) assert_true(per_group[g] > 0);
    kvs_workload_destroy(w);

    /* prefix_len must leave room for a tail. */
    c.prefix_len = 400;
    assert_int_equal(kvs_workload_create(&c, &w), KVS_ERR_INVALID);
    kvs_assert_no_leaks();
}

static void test_multi_turn_extends(void **state)
{
    (void) state;
    kvs_workload_t *w = make(KVS_WORKLOAD_MULTI_TURN, 80, 1000, 0, 11);
    uint32_t turns = 0;
    for (uint32_t i = 0; i < w->count; i++) {
        const kvs_request_t *r = &w->requests[i];
        if (r->parent < 0) continue;
        turns++;
        const kvs_request_t *p = &w->requests[r->parent];
        assert_true(p->index < r->index);
        assert_int_equal(p->group, r->group);
        /* The next turn is the previous prompt + answer + user message. */
        assert_true(r->len > p->len);
        assert_memory_equal(r->tokens, p->tokens, p->len * sizeof(int32_t));
    }
    assert_true(turns > w->count / 2);
    /* Different clients' conversations share nothing. */
    for (uint32_t i = 0; i < w->count; i++)
        for (uint32_t j = 0; j < i; j++)
            if (w->requests[i].group != w->requests[j].group)
                assert_int_equal(lcp(&w->requests[i], &w->requests[j]), 0);
    kvs_workload_destroy(w);
    kvs_assert_no_leaks();
}

static void test_random_little_sharing(void **state)
{
    (void) state;
    kvs_workload_t *w = make(KVS_WORKLOAD_RANDOM, 100, 500, 0, 5);
    uint32_t min = 500, max = 0;
    for (uint32_t i = 0; i < w->count; i++) {
        const kvs_request_t *a = &w->requests[i];
        if (a->len < min) min = a->len;
        if (a->len > max) max = a->len;
        for (uint32_t j = 0; j < i; j++) assert_true(lcp(a, &w->requests[j]) < 4);
    }
    assert_true(min < 150 && max > 350); /* lengths spread over [1, prompt_len] */
    kvs_workload_destroy(w);
    kvs_assert_no_leaks();
}

/* Documents start with a marker token (so groups never share); the needle is the other run of
 * markers. Returns where the needle starts and sets *len_p to its length. */
static uint32_t find_needle(const kvs_request_t *r, uint32_t *len_p)
{
    uint32_t run = 0;
    while (run < r->len && r->tokens[run] >= KVS_WORKLOAD_VOCAB) run++;
    if (run > 1) { /* needle at 0, then the document's marker */
        *len_p = run - 1;
        return 0;
    }
    uint32_t at = 1;
    while (r->tokens[at] < KVS_WORKLOAD_VOCAB) at++;
    uint32_t end = at;
    while (end < r->len && r->tokens[end] >= KVS_WORKLOAD_VOCAB) end++;
    *len_p = end - at;
    return at;
}

static void test_needle_hits_end_anywhere(void **state)
{
    (void) state;
    kvs_workload_t *w = make(KVS_WORKLOAD_NEEDLE, 50, 777, 0, 9);
    uint32_t unaligned = 0;
    for (uint32_t i = 0; i < w->count; i++) {
        const kvs_request_t *a = &w->requests[i];
        assert_int_equal(a->len, 777);
        uint32_t alen, blen;
        uint32_t at = find_needle(a, &alen);
        assert_true(alen >= 1 && alen <= 8);
        for (uint32_t j = 0; j < i; j++) {
            const kvs_request_t *b = &w->requests[j];
            uint32_t bt = find_needle(b, &blen);
            /* Identical documents up to the earlier needle. */
            assert_int_equal(lcp(a, b), at < bt ? at : bt);
            /* Apart from the needles, both are the same document. */
            if (at + alen < a->len && at < bt)
                assert_int_equal(a->tokens[at + alen], b->tokens[at]);
        }
        unaligned += at % 16 != 0;
    }
    assert_true(unaligned > w->count / 2);
    kvs_workload_destroy(w);
    kvs_assert_no_leaks();
}

static void test_repeats(void **state)
{
    (void) state;
    kvs_workload_config_t c = {.kind = KVS_WORKLOAD_RANDOM,
                               .requests = 100,
                               .prompt_len = 64,
                               .repeat_permille = 500,
                               .seed = 4};
    kvs_workload_t *w = NULL;
    assert_int_equal(kvs_workload_create(&c, &w), KVS_OK);
    uint32_t repeats = 0;
    for (uint32_t i = 0; i < w->count; i++) {
        const kvs_request_t *r = &w->requests[i];
        if (r->parent < 0) continue;
        repeats++;
        const kvs_request_t *o = &w->requests[r->parent];
        assert_int_equal(r->len, o->len);
        assert_memory_equal(r->tokens, o->tokens, r->len * sizeof(int32_t));
        assert_true(r->room != o->room);
    }
    assert_true(repeats > 25 && repeats < 75);
    kvs_workload_destroy(w);
    kvs_assert_no_leaks();
}

static void test_invalid_and_names(void **state)
{
    (void) state;
    kvs_workload_config_t c = {.kind = KVS_WORKLOAD_RANDOM, .requests = 0, .prompt_len = 10};
    kvs_workload_t *w = (kvs_workload_t *) 0x1;
    assert_int_equal(kvs_workload_create(&c, &w), KVS_ERR_INVALID);
    assert_ptr_equal(w, (kvs_workload_t *) 0x1); /* untouched on error */
    for (int k = 0; k < 4; k++) {
        kvs_workload_kind_t parsed;
        assert_int_equal(
            kvs_workload_kind_parse(kvs_workload_kind_str((kvs_workload_kind_t) k), &parsed),
            KVS_OK);
        assert_int_equal(parsed, k);
    }
    kvs_workload_kind_t parsed;
    assert_int_equal(kvs_workload_kind_parse("bogus", &parsed), KVS_ERR_INVALID);
    /* Allocation failures are clean. */
    kvs_workload_config_t ok = {.kind = KVS_WORKLOAD_MULTI_TURN, .requests = 5, .prompt_len = 50};
    for (uint64_t n = 1; n <= 8; n++) {
        kvs_alloc_fail_at(n);
        kvs_status_t st = kvs_workload_create(&ok, &w);
        kvs_alloc_fail_at(0);
        if (st == KVS_OK)
            kvs_workload_destroy(w);
        else
            assert_int_equal(st, KVS_ERR_NOMEM);
    }
    kvs_assert_no_leaks();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_deterministic_per_seed),
        cmocka_unit_test(test_shared_prefix_structure),
        cmocka_unit_test(test_multi_turn_extends),
        cmocka_unit_test(test_random_little_sharing),
        cmocka_unit_test(test_needle_hits_end_anywhere),
        cmocka_unit_test(test_repeats),
        cmocka_unit_test(test_invalid_and_names),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
