/* Tests for src/radix: unit tests (match/insert/split, namespaces, partial pages, locks, LRU
 * eviction, destroy, allocation failures) and a seeded property test that runs random
 * operation sequences against a flat reference model and checks every step. */
#include "kvs_test.h"

#include <string.h>

#include "kvstage/log.h"
#include "kvstage/radix.h"
#include "kvstage/rng.h"

/* ---- page tracking: every page id the tests hand out, and where it is now ---- */

enum { MAX_IDS = 1 << 16, MAX_LOG = 1 << 16, MAX_GROUPS = 1 << 14 };

enum {
    ST_UNUSED = 0,
    ST_CALLER,   /* allocated by the test, not yet handed to the cache */
    ST_CACHED,   /* owned by the cache */
    ST_FREED,    /* handed back through the free callback */
    ST_RETURNED, /* left with the caller by insert (already-present prefix) and freed by it */
};

typedef struct {
    uint8_t state[MAX_IDS];
    uint32_t next_id;
    size_t ncached;
    uint32_t log[MAX_LOG]; /* pages handed to the callback, in order */
    size_t nlog;
    size_t group_end[MAX_GROUPS]; /* one group per callback call */
    size_t ngroups;
    int bad; /* the callback saw a page the cache did not own */
    uint32_t bad_page;
} tracker_t;

static tracker_t g_tr;

static void tracker_reset(void)
{
    memset(&g_tr, 0, sizeof(g_tr));
    g_tr.next_id = 1; /* 0 stays unused so a zeroed output can never look valid */
}

static void log_reset(void)
{
    g_tr.nlog = 0;
    g_tr.ngroups = 0;
}

static void on_free(void *arg, const uint32_t *pages, size_t count)
{
    (void) arg;
    for (size_t i = 0; i < count; i++) {
        uint32_t id = pages[i];
        if (id >= MAX_IDS || g_tr.state[id] != ST_CACHED) {
            if (!g_tr.bad) g_tr.bad_page = id;
            g_tr.bad = 1;
            continue;
        }
        g_tr.state[id] = ST_FREED;
        g_tr.ncached--;
        if (g_tr.nlog < MAX_LOG) g_tr.log[g_tr.nlog++] = id;
    }
    if (g_tr.ngroups < MAX_GROUPS) g_tr.group_end[g_tr.ngroups++] = g_tr.nlog;
}

static uint32_t fresh_id(void)
{
    assert_true(g_tr.next_id < MAX_IDS);
    uint32_t id = g_tr.next_id++;
    g_tr.state[id] = ST_CALLER;
    return id;
}

/* After an insert: the caller keeps [0, present) and the cache owns the rest. */
static void settle(const uint32_t *pages, size_t npages, size_t present_pages)
{
    for (size_t i = 0; i < npages; i++) {
        uint32_t id = pages[i];
        if (i < present_pages) {
            if (g_tr.state[id] == ST_CALLER) g_tr.state[id] = ST_RETURNED;
        } else {
            assert_int_equal(g_tr.state[id], ST_CALLER);
            g_tr.state[id] = ST_CACHED;
            g_tr.ncached++;
        }
    }
}

/* Error logs are expected in these tests; count them instead of printing them. */
static int g_logged;
static void quiet_sink(void *arg, kvs_log_level_t level, const char *file, int line,
                       const char *msg)
{
    (void) arg, (void) level, (void) file, (void) line, (void) msg;
    g_logged++;
}

/* ---- unit-test helpers ---- */

static kvs_radix_t *make(uint32_t page_size)
{
    tracker_reset();
    kvs_radix_t *r = NULL;
    assert_int_equal(kvs_radix_create(page_size, on_free, NULL, &r), KVS_OK);
    assert_non_null(r);
    return r;
}

/* Inserts with fresh page ids (written to ids_p when not NULL); returns present tokens. */
static size_t put(kvs_radix_t *r, uint32_t P, uint64_t ns, const int32_t *key, size_t len,
                  uint32_t *ids_p, kvs_radix_node_t **node_p)
{
    uint32_t ids[64];
    size_t n = len / P;
    assert_true(n <= 64);
    for (size_t i = 0; i < n; i++) ids[i] = fresh_id();
    size_t present = 999;
    assert_int_equal(kvs_radix_insert(r, ns, key, len, ids, &present, node_p), KVS_OK);
    assert_int_equal(present % P, 0);
    settle(ids, n, present / P);
    if (ids_p) memcpy(ids_p, ids, n * sizeof(uint32_t));
    return present;
}

static size_t get(kvs_radix_t *r, uint64_t ns, const int32_t *key, size_t len, uint32_t *pages,
                  kvs_radix_node_t **node_p)
{
    kvs_radix_match_t m;
    assert_int_equal(kvs_radix_match(r, ns, key, len, pages, &m), KVS_OK);
    if (node_p) *node_p = m.node;
    return m.tokens;
}

static kvs_radix_stats_t stats_of(kvs_radix_t *r)
{
    kvs_radix_stats_t s;
    kvs_radix_stats(r, &s);
    return s;
}

static void seq(int32_t *key, size_t n, int32_t start)
{
    for (size_t i = 0; i < n; i++) key[i] = start + (int32_t) i;
}

/* ---- unit tests ---- */

static void test_create_invalid(void **state)
{
    (void) state;
    kvs_log_set_sink(quiet_sink, NULL);
    kvs_radix_t *r = (kvs_radix_t *) 0x1;
    assert_int_equal(kvs_radix_create(0, on_free, NULL, &r), KVS_ERR_INVALID);
    assert_ptr_equal(r, (kvs_radix_t *) 0x1);
    r = make(4);
    kvs_radix_match_t m;
    assert_int_equal(kvs_radix_match(r, 0, NULL, 8, NULL, &m), KVS_ERR_INVALID);
    size_t present;
    int32_t key[8] = {0};
    assert_int_equal(kvs_radix_insert(r, 0, key, 8, NULL, &present, NULL), KVS_ERR_INVALID);
    kvs_radix_destroy(r);
    kvs_log_set_sink(NULL, NULL);
    kvs_assert_no_leaks();
}

static void test_basic_split(void **state)
{
    (void) state;
    const uint32_t P = 4;
    kvs_radix_t *r = make(P);
    int32_t a[12], b[12];
    seq(a, 12, 100);
    memcpy(b, a, sizeof(b));
    b[9] = -7; /* b diverges from a in its third page */
    uint32_t ida[3], idb[3], out[3];
    kvs_radix_node_t *na, *nb, *n;

    assert_int_equal(get(r, 0, a, 12, out, &n), 0);
    kvs_radix_node_t *root = n;
    assert_int_equal(put(r, P, 0, a, 12, ida, &na), 0);
    assert_true(na != root);
    kvs_radix_stats_t s = stats_of(r);
    assert_int_equal(s.total_pages, 3);
    assert_int_equal(s.evictable_pages, 3);
    assert_int_equal(s.protected_pages, 0);
    assert_int_equal(s.nodes, 1);

    memset(out, 0, sizeof(out));
    assert_int_equal(get(r, 0, a, 12, out, &n), 12);
    assert_ptr_equal(n, na);
    assert_memory_equal(out, ida, sizeof(ida));

    /* b shares two pages of a: the match ends inside a's node and splits it there. */
    memset(out, 0, sizeof(out));
    kvs_radix_node_t *mid;
    assert_int_equal(get(r, 0, b, 12, out, &mid), 8);
    assert_memory_equal(out, ida, 2 * sizeof(uint32_t));
    assert_true(mid != na && mid != root);
    assert_int_equal(stats_of(r).nodes, 2);
    assert_int_equal(stats_of(r).total_pages, 3);

    assert_int_equal(put(r, P, 0, b, 12, idb, &nb), 8);
    assert_int_equal(g_tr.state[idb[0]], ST_RETURNED);
    assert_int_equal(g_tr.state[idb[1]], ST_RETURNED);
    assert_int_equal(g_tr.state[idb[2]], ST_CACHED);
    s = stats_of(r);
    assert_int_equal(s.total_pages, 4);
    assert_int_equal(s.nodes, 3);

    /* The original handle still names the end of a; b's pages are b's own after the split. */
    assert_int_equal(get(r, 0, a, 12, out, &n), 12);
    assert_ptr_equal(n, na);
    assert_memory_equal(out, ida, sizeof(ida));
    assert_int_equal(get(r, 0, b, 12, out, &n), 12);
    assert_ptr_equal(n, nb);
    assert_int_equal(out[0], ida[0]);
    assert_int_equal(out[1], ida[1]);
    assert_int_equal(out[2], idb[2]);
    assert_int_equal(get(r, 0, a, 8, NULL, &n), 8);
    assert_ptr_equal(n, mid);

    /* Inserting a prefix that ends inside a node splits it and returns the new node. */
    kvs_radix_node_t *first;
    assert_int_equal(put(r, P, 0, a, 4, NULL, &first), 4);
    assert_int_equal(stats_of(r).nodes, 4);
    assert_int_equal(get(r, 0, a, 7, NULL, &n), 4);
    assert_ptr_equal(n, first);

    log_reset();
    kvs_radix_destroy(r);
    assert_int_equal(g_tr.nlog, 4);
    assert_int_equal(g_tr.ncached, 0);
    assert_false(g_tr.bad);
    kvs_assert_no_leaks();
}

static void test_namespaces_isolate(void **state)
{
    (void) state;
    const uint32_t P = 2;
    kvs_radix_t *r = make(P);
    int32_t k[8];
    seq(k, 8, 1);
    uint32_t id0[4], id1[4], idx[4], out[4];
    const uint64_t other = UINT64_MAX;
    assert_int_equal(put(r, P, 0, k, 8, id0, NULL), 0);
    assert_int_equal(get(r, 1, k, 8, out, NULL), 0);
    assert_int_equal(get(r, other, k, 8, out, NULL), 0);
    assert_int_equal(put(r, P, other, k, 8, id1, NULL), 0);
    assert_int_equal(put(r, P, 1, k, 4, idx, NULL), 0);
    assert_int_equal(get(r, 0, k, 8, out, NULL), 8);
    assert_memory_equal(out, id0, sizeof(id0));
    assert_int_equal(get(r, other, k, 8, out, NULL), 8);
    assert_memory_equal(out, id1, sizeof(id1));
    assert_int_equal(get(r, 1, k, 8, out, NULL), 4);
    assert_memory_equal(out, idx, 2 * sizeof(uint32_t));
    assert_int_equal(stats_of(r).total_pages, 10);
    kvs_radix_destroy(r);
    assert_int_equal(g_tr.ncached, 0);
    kvs_assert_no_leaks();
}

static void test_partial_page_ignored(void **state)
{
    (void) state;
    const uint32_t P = 4;
    kvs_radix_t *r = make(P);
    int32_t k[11];
    seq(k, 11, 50);
    kvs_radix_node_t *n, *root;
    get(r, 0, k, 0, NULL, &root);
    /* 10 tokens: two full pages cached, the last two tokens are not. */
    assert_int_equal(put(r, P, 0, k, 10, NULL, &n), 0);
    assert_int_equal(stats_of(r).total_pages, 2);
    assert_int_equal(get(r, 0, k, 11, NULL, NULL), 8);
    assert_int_equal(get(r, 0, k, 9, NULL, NULL), 8);
    assert_int_equal(get(r, 0, k, 7, NULL, NULL), 4);
    assert_int_equal(get(r, 0, k, 3, NULL, &n), 0);
    assert_ptr_equal(n, root);
    /* A key shorter than a page inserts nothing and ends at the root. */
    int32_t other[3] = {9, 9, 9};
    assert_int_equal(put(r, P, 0, other, 3, NULL, &n), 0);
    assert_ptr_equal(n, root);
    assert_int_equal(stats_of(r).total_pages, 2);
    assert_int_equal(stats_of(r).nodes, 2); /* the 7-token match split the node */
    /* Tokens past the last full page never take part in a match. */
    int32_t k2[11];
    memcpy(k2, k, sizeof(k2));
    k2[9] = -1;
    assert_int_equal(get(r, 0, k2, 11, NULL, NULL), 8);
    kvs_radix_destroy(r);
    kvs_assert_no_leaks();
}

static void test_insert_present(void **state)
{
    (void) state;
    const uint32_t P = 3;
    kvs_radix_t *r = make(P);
    int32_t k[15];
    seq(k, 15, 7);
    uint32_t ids[5];
    assert_int_equal(put(r, P, 0, k, 7, NULL, NULL), 0); /* 2 pages */
    assert_int_equal(put(r, P, 0, k, 15, ids, NULL), 6); /* 3 new pages */
    assert_int_equal(g_tr.state[ids[0]], ST_RETURNED);
    assert_int_equal(g_tr.state[ids[1]], ST_RETURNED);
    assert_int_equal(g_tr.state[ids[2]], ST_CACHED);
    assert_int_equal(put(r, P, 0, k, 15, NULL, NULL), 15);
    assert_int_equal(put(r, P, 0, k, 14, NULL, NULL), 12);
    assert_int_equal(put(r, P, 0, k, 5, NULL, NULL), 3);
    assert_int_equal(stats_of(r).total_pages, 5);

    /* Passing the cache's own pages back for the present prefix is what engines do. */
    uint32_t own[5], mix[6];
    int32_t longer[18];
    memcpy(longer, k, sizeof(k));
    longer[15] = 1, longer[16] = 2, longer[17] = 3;
    assert_int_equal(get(r, 0, longer, 18, own, NULL), 15);
    memcpy(mix, own, sizeof(own));
    mix[5] = fresh_id();
    size_t present;
    assert_int_equal(kvs_radix_insert(r, 0, longer, 18, mix, &present, NULL), KVS_OK);
    assert_int_equal(present, 15);
    settle(mix, 6, 5);
    for (int i = 0; i < 5; i++) assert_int_equal(g_tr.state[own[i]], ST_CACHED);
    assert_int_equal(stats_of(r).total_pages, 6);
    kvs_radix_destroy(r);
    assert_int_equal(g_tr.ncached, 0);
    assert_false(g_tr.bad);
    kvs_assert_no_leaks();
}

static void test_lock_protects(void **state)
{
    (void) state;
    const uint32_t P = 2;
    kvs_radix_t *r = make(P);
    int32_t a[6] = {1, 1, 2, 2, 3, 3}, b[6] = {1, 1, 2, 2, 4, 4};
    kvs_radix_node_t *na, *nb;
    uint32_t ida[3], idb[3];
    put(r, P, 0, a, 6, ida, &na);
    put(r, P, 0, b, 6, idb, &nb);
    kvs_radix_lock(r, na);
    kvs_radix_stats_t s = stats_of(r);
    assert_int_equal(s.total_pages, 4);
    assert_int_equal(s.protected_pages, 3); /* a's leaf and the shared stem */
    assert_int_equal(s.evictable_pages, 1);

    log_reset();
    assert_int_equal(kvs_radix_evict(r, 100), 1);
    assert_int_equal(g_tr.nlog, 1);
    assert_int_equal(g_tr.log[0], idb[2]);
    assert_int_equal(kvs_radix_evict(r, 100), 0);
    s = stats_of(r);
    assert_int_equal(s.total_pages, 3);
    assert_int_equal(s.evictable_pages, 0);
    assert_int_equal(get(r, 0, a, 6, NULL, NULL), 6);

    assert_int_equal(kvs_radix_unlock(r, na), KVS_OK);
    s = stats_of(r);
    assert_int_equal(s.protected_pages, 0);
    assert_int_equal(s.evictable_pages, 3);
    log_reset();
    assert_int_equal(kvs_radix_evict(r, 100), 3);
    assert_int_equal(g_tr.ngroups, 2); /* a's leaf, then the stem */
    assert_int_equal(g_tr.log[0], ida[2]);
    s = stats_of(r);
    assert_int_equal(s.total_pages, 0);
    assert_int_equal(s.nodes, 0);
    kvs_radix_destroy(r);
    kvs_assert_no_leaks();
}

static void test_unlock_errors(void **state)
{
    (void) state;
    kvs_log_set_sink(quiet_sink, NULL);
    const uint32_t P = 1;
    kvs_radix_t *r = make(P);
    int32_t a[3] = {1, 2, 3};
    kvs_radix_node_t *na, *mid, *root;
    put(r, P, 0, a, 3, NULL, &na);
    get(r, 0, a, 0, NULL, &root);
    assert_int_equal(kvs_radix_unlock(r, na), KVS_ERR_STATE);
    assert_int_equal(kvs_radix_unlock(r, root), KVS_ERR_STATE);
    kvs_radix_lock(r, na);
    kvs_radix_lock(r, na);
    get(r, 0, a, 2, NULL, &mid); /* splits a locked node: the new parent is locked too */
    assert_int_equal(stats_of(r).protected_pages, 3);
    /* mid is protected only through its child's locks: unlocking it is a caller bug. */
    assert_int_equal(kvs_radix_unlock(r, mid), KVS_ERR_STATE);
    assert_int_equal(stats_of(r).protected_pages, 3);
    kvs_radix_lock(r, mid);
    assert_int_equal(kvs_radix_unlock(r, na), KVS_OK);
    assert_int_equal(kvs_radix_unlock(r, na), KVS_OK);
    assert_int_equal(stats_of(r).protected_pages, 2); /* mid's own lock remains */
    assert_int_equal(stats_of(r).evictable_pages, 1);
    assert_int_equal(kvs_radix_unlock(r, na), KVS_ERR_STATE);
    assert_int_equal(kvs_radix_unlock(r, mid), KVS_OK);
    assert_int_equal(kvs_radix_unlock(r, mid), KVS_ERR_STATE);
    kvs_radix_stats_t s = stats_of(r);
    assert_int_equal(s.protected_pages, 0);
    assert_int_equal(s.evictable_pages, 3);
    /* Locking the root (an empty match) nests like any node. */
    kvs_radix_lock(r, root);
    assert_int_equal(kvs_radix_unlock(r, root), KVS_OK);
    assert_int_equal(kvs_radix_unlock(r, root), KVS_ERR_STATE);
    kvs_radix_destroy(r);
    kvs_log_set_sink(NULL, NULL);
    kvs_assert_no_leaks();
}

static void test_eviction_lru_leaves(void **state)
{
    (void) state;
    const uint32_t P = 2;
    kvs_radix_t *r = make(P);
    int32_t a[4] = {1, 1, 2, 2}, b[4] = {3, 3, 4, 4}, c[4] = {5, 5, 6, 6};
    uint32_t ia[2], ib[2], ic[2];
    put(r, P, 0, a, 4, ia, NULL);
    put(r, P, 0, b, 4, ib, NULL);
    put(r, P, 0, c, 4, ic, NULL);
    get(r, 0, a, 4, NULL, NULL); /* a is now the most recently used */
    log_reset();
    assert_int_equal(kvs_radix_evict(r, 1), 2); /* whole nodes: at least 1 page */
    assert_int_equal(g_tr.log[0], ib[0]);
    assert_int_equal(g_tr.log[1], ib[1]);
    assert_int_equal(kvs_radix_evict(r, 3), 4); /* c, then a */
    assert_int_equal(g_tr.log[2], ic[0]);
    assert_int_equal(g_tr.log[4], ia[0]);
    assert_int_equal(kvs_radix_evict(r, 1), 0);
    assert_int_equal(kvs_radix_evict(r, 0), 0);

    /* Leaves go first even when their parent was used more recently. */
    int32_t s1[6] = {7, 7, 8, 8, 9, 9}, s2[6] = {7, 7, 8, 8, 0, 0};
    uint32_t i1[3], i2[3];
    put(r, P, 0, s1, 6, i1, NULL);
    put(r, P, 0, s2, 6, i2, NULL);
    get(r, 0, s1, 6, NULL, NULL);
    get(r, 0, s1, 4, NULL, NULL); /* the stem is the most recent, s2's leaf the least */
    log_reset();
    assert_int_equal(kvs_radix_evict(r, 1), 1);
    assert_int_equal(g_tr.log[0], i2[2]);
    assert_int_equal(kvs_radix_evict(r, 1), 1);
    assert_int_equal(g_tr.log[1], i1[2]);
    assert_int_equal(kvs_radix_evict(r, 1), 2);
    assert_int_equal(stats_of(r).total_pages, 0);
    kvs_radix_destroy(r);
    kvs_assert_no_leaks();
}

/* lookup answers what match would, but splits nothing and leaves the LRU order alone: the
 * eviction order after lookups is the order the inserts and matches alone set. */
static void test_lookup_read_only(void **state)
{
    (void) state;
    const uint32_t P = 2;
    kvs_radix_t *r = make(P);
    int32_t a[6] = {1, 1, 2, 2, 3, 3}, b[6] = {5, 5, 6, 6, 7, 7}, q[6] = {1, 1, 2, 2, 9, 9};
    uint32_t ia[3], ib[3];
    put(r, P, 0, a, 6, ia, NULL);
    put(r, P, 0, b, 6, ib, NULL);
    size_t t = 999;
    assert_int_equal(kvs_radix_lookup(r, 0, a, 6, &t), KVS_OK);
    assert_int_equal(t, 6);
    assert_int_equal(kvs_radix_lookup(r, 0, a, 5, &t), KVS_OK); /* whole pages only */
    assert_int_equal(t, 4);
    assert_int_equal(kvs_radix_lookup(r, 0, q, 6, &t), KVS_OK); /* ends inside a's node */
    assert_int_equal(t, 4);
    assert_int_equal(kvs_radix_lookup(r, 1, a, 6, &t), KVS_OK); /* another namespace */
    assert_int_equal(t, 0);
    assert_int_equal(kvs_radix_lookup(r, 0, NULL, 1, &t), KVS_OK); /* shorter than a page */
    assert_int_equal(t, 0);
    assert_int_equal(stats_of(r).nodes, 2); /* no split */
    /* a was inserted first and only looked up since: it is still the least recently used. */
    log_reset();
    assert_int_equal(kvs_radix_evict(r, 1), 3);
    assert_int_equal(g_tr.log[0], ia[0]);
    /* A match of the same key does split (the contrast that makes the lookup necessary). */
    put(r, P, 0, a, 6, ia, NULL);
    assert_int_equal(get(r, 0, q, 6, NULL, NULL), 4);
    assert_int_equal(stats_of(r).nodes, 3);

    kvs_log_set_sink(quiet_sink, NULL);
    g_logged = 0;
    assert_int_equal(kvs_radix_lookup(NULL, 0, a, 6, &t), KVS_ERR_INVALID);
    assert_int_equal(kvs_radix_lookup(r, 0, a, 6, NULL), KVS_ERR_INVALID);
    assert_int_equal(kvs_radix_lookup(r, 0, NULL, 4, &t), KVS_ERR_INVALID);
    assert_int_equal(g_logged, 3);
    kvs_log_set_sink(NULL, NULL);
    kvs_radix_destroy(r);
    kvs_assert_no_leaks();
}

static void test_destroy_frees_all(void **state)
{
    (void) state;
    const uint32_t P = 3;
    kvs_radix_t *r = make(P);
    kvs_rng_t rng;
    kvs_rng_seed(&rng, 42);
    int32_t key[30];
    for (int i = 0; i < 40; i++) {
        size_t len = kvs_rng_range(&rng, 0, 30);
        for (size_t t = 0; t < len; t++) key[t] = (int32_t) kvs_rng_below(&rng, 2);
        kvs_radix_node_t *n;
        put(r, P, (uint64_t) (i % 3), key, len, NULL, &n);
        if (i % 5 == 0) kvs_radix_lock(r, n); /* destroy ignores locks */
    }
    size_t total = stats_of(r).total_pages;
    assert_true(total > 0);
    assert_int_equal(g_tr.ncached, total);
    log_reset();
    kvs_radix_destroy(r);
    assert_int_equal(g_tr.nlog, total);
    assert_int_equal(g_tr.ncached, 0);
    assert_false(g_tr.bad);
    kvs_assert_no_leaks();
}

/* Runs a fixed script with the nth allocation failing; returns 1 once no failure hit. */
static int script_with_failure(uint64_t nth)
{
    const uint32_t P = 2;
    tracker_reset();
    kvs_radix_t *r = NULL;
    kvs_alloc_fail_at(nth);
    kvs_status_t st = kvs_radix_create(P, on_free, NULL, &r);
    if (st != KVS_OK) {
        kvs_alloc_fail_at(0);
        assert_int_equal(st, KVS_ERR_NOMEM);
        assert_null(r);
        return 0;
    }
    int32_t keys[6][8] = {
        {1, 1, 2, 2, 3, 3, 4, 4},
        {1, 1, 2, 2, 5, 5, 6, 6},
        {1, 1, 9, 9},
        {1, 1, 2, 2, 3, 3},
        {7, 7, 7, 7},
        {1, 1, 2, 2, 5, 5, 6, 6},
    };
    size_t lens[6] = {8, 8, 4, 6, 4, 8};
    int failed = 0;
    for (int i = 0; i < 6; i++) {
        uint32_t ids[4];
        size_t n = lens[i] / P;
        for (size_t j = 0; j < n; j++) ids[j] = fresh_id();
        kvs_radix_stats_t before = stats_of(r);
        size_t present;
        st = kvs_radix_insert(r, 0, keys[i], lens[i], ids, &present, NULL);
        if (st == KVS_ERR_NOMEM) {
            failed = 1;
            kvs_radix_stats_t after = stats_of(r);
            assert_memory_equal(&before, &after, sizeof(before));
            for (size_t j = 0; j < n; j++) g_tr.state[ids[j]] = ST_RETURNED;
        } else {
            assert_int_equal(st, KVS_OK);
            settle(ids, n, present / P);
        }
        /* A match that splits can fail too. */
        kvs_radix_match_t m;
        before = stats_of(r);
        st = kvs_radix_match(r, 0, keys[i], lens[i] - 2, NULL, &m);
        if (st == KVS_ERR_NOMEM) {
            failed = 1;
            kvs_radix_stats_t after = stats_of(r);
            assert_memory_equal(&before, &after, sizeof(before));
        } else {
            assert_int_equal(st, KVS_OK);
        }
    }
    kvs_alloc_fail_at(0);
    /* Whatever failed, the cache must still answer exactly from what was inserted. */
    for (int i = 0; i < 6; i++) {
        uint32_t ids[4];
        size_t n = lens[i] / P;
        for (size_t j = 0; j < n; j++) ids[j] = fresh_id();
        size_t present;
        assert_int_equal(kvs_radix_insert(r, 0, keys[i], lens[i], ids, &present, NULL), KVS_OK);
        settle(ids, n, present / P);
        assert_int_equal(get(r, 0, keys[i], lens[i], NULL, NULL), lens[i]);
    }
    kvs_radix_stats_t s = stats_of(r);
    assert_int_equal(s.total_pages, 9);
    assert_int_equal(s.total_pages, g_tr.ncached);
    assert_int_equal(kvs_radix_evict(r, SIZE_MAX), 9);
    assert_int_equal(stats_of(r).nodes, 0);
    kvs_radix_destroy(r);
    assert_int_equal(g_tr.ncached, 0);
    assert_false(g_tr.bad);
    kvs_assert_no_leaks();
    return !failed;
}

static void test_alloc_failures(void **state)
{
    (void) state;
    kvs_log_set_sink(quiet_sink, NULL);
    uint64_t nth = 1;
    while (!script_with_failure(nth)) {
        nth++;
        assert_true(nth < 1000);
    }
    assert_true(nth > 5); /* the script does allocate, so some runs did fail */
    kvs_log_set_sink(NULL, NULL);
}

/* Growing the child table is optional: when that allocation fails the insert still succeeds
 * and lookups stay exact; a later insert grows it. */
static void test_table_growth_failure(void **state)
{
    (void) state;
    const uint32_t P = 1;
    kvs_radix_t *r = make(P);
    int32_t k[1];
    int grew_failed = 0;
    for (int32_t i = 0; i < 300; i++) {
        k[0] = i * 7919;
        kvs_alloc_stats_t before, after;
        kvs_alloc_stats(&before);
        if (i < 150) kvs_alloc_fail_at(2); /* 1: the leaf, 2: the table, if it grows now */
        uint32_t id = fresh_id();
        size_t present;
        assert_int_equal(kvs_radix_insert(r, 0, k, 1, &id, &present, NULL), KVS_OK);
        kvs_alloc_fail_at(0);
        settle(&id, 1, present);
        kvs_alloc_stats(&after);
        grew_failed += after.failed_allocs > before.failed_allocs;
    }
    assert_true(grew_failed >= 1);
    for (int32_t i = 0; i < 300; i++) {
        k[0] = i * 7919;
        assert_int_equal(get(r, 0, k, 1, NULL, NULL), 1);
    }
    assert_int_equal(stats_of(r).nodes, 300);
    kvs_radix_destroy(r);
    assert_int_equal(g_tr.ncached, 0);
    kvs_assert_no_leaks();
}

/* ---- property test: random operations against a flat reference model ---- */

enum { MP_MAX = 4, MD_MAX = 10, ME_MAX = 2048, MH_MAX = 8, RECENT = 16, STEMS = 4 };

/* One cached page: (namespace, prefix of `depth` pages) -> page id. The prefix is the chain of
 * parents; the model is flat (linear scans), nothing like the real structure. */
typedef struct {
    int live;
    uint64_t ns;
    int parent; /* -1 at the top */
    int32_t tok[MP_MAX];
    size_t depth;
    uint32_t page;
    uint64_t stamp; /* last use; the cache evicts the unlocked page with the lowest */
    size_t locks;   /* held handles whose prefix covers this page */
    size_t nchildren;
} ment_t;

typedef struct {
    kvs_radix_node_t *node;
    uint64_t ns;
    size_t depth;
    int path[MD_MAX];
    size_t count;
} hold_t;

typedef struct {
    uint64_t ns;
    int32_t tok[MD_MAX * MP_MAX + MP_MAX];
    size_t len;
} pkey_t;

typedef struct {
    kvs_rng_t rng;
    uint32_t P;
    kvs_radix_t *r;
    kvs_radix_node_t *root;
    ment_t e[ME_MAX];
    size_t nlive;
    uint64_t clock;
    hold_t hold[MH_MAX];
    size_t nhold;
    pkey_t recent[RECENT];
    size_t nrecent;
    pkey_t stem[STEMS];
    uint64_t seed, episode, step;
} prop_t;

static prop_t g_p;

#define PCHECK(cond, ...)                                                                          \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            print_error("property failure (KVS_SEED=%llu, episode %llu, step %llu): ",             \
                        (unsigned long long) g_p.seed, (unsigned long long) g_p.episode,           \
                        (unsigned long long) g_p.step);                                            \
            fail_msg(__VA_ARGS__);                                                                 \
        }                                                                                          \
    } while (0)

static int m_child(int parent, uint64_t ns, const int32_t *tok)
{
    for (int i = 0; i < ME_MAX; i++) {
        const ment_t *x = &g_p.e[i];
        if (x->live && x->parent == parent && x->ns == ns &&
            memcmp(x->tok, tok, g_p.P * sizeof(int32_t)) == 0)
            return i;
    }
    return -1;
}

static size_t m_walk(uint64_t ns, const int32_t *tok, size_t npages, int *path)
{
    int cur = -1;
    size_t d = 0;
    while (d < npages) {
        int c = m_child(cur, ns, tok + d * g_p.P);
        if (c < 0) break;
        path[d++] = c;
        cur = c;
    }
    return d;
}

/* Deepest first, as the cache orders a path it touches. */
static void m_touch(const int *path, size_t depth)
{
    for (size_t d = depth; d-- > 0;) g_p.e[path[d]].stamp = ++g_p.clock;
}

static int m_new(uint64_t ns, int parent, const int32_t *tok, size_t depth, uint32_t page)
{
    for (int i = 0; i < ME_MAX; i++) {
        ment_t *x = &g_p.e[i];
        if (x->live) continue;
        memset(x, 0, sizeof(*x));
        x->live = 1;
        x->ns = ns;
        x->parent = parent;
        memcpy(x->tok, tok, g_p.P * sizeof(int32_t));
        x->depth = depth;
        x->page = page;
        if (parent >= 0) g_p.e[parent].nchildren++;
        g_p.nlive++;
        return i;
    }
    fail_msg("model full");
    return -1;
}

static void m_check_stats(void)
{
    size_t prot = 0;
    for (int i = 0; i < ME_MAX; i++)
        if (g_p.e[i].live && g_p.e[i].locks > 0) prot++;
    kvs_radix_stats_t s;
    kvs_radix_stats(g_p.r, &s);
    PCHECK(s.total_pages == g_p.nlive, "total %zu, model %zu", s.total_pages, g_p.nlive);
    PCHECK(s.protected_pages == prot, "protected %zu, model %zu", s.protected_pages, prot);
    PCHECK(s.evictable_pages == g_p.nlive - prot, "evictable %zu, model %zu", s.evictable_pages,
           g_p.nlive - prot);
    PCHECK(s.nodes <= s.total_pages && (s.nodes == 0) == (s.total_pages == 0), "nodes %zu",
           s.nodes);
    PCHECK(g_tr.ncached == g_p.nlive, "pages owned by the cache %zu, model %zu", g_tr.ncached,
           g_p.nlive);
    PCHECK(!g_tr.bad, "free callback got page %u that the cache did not own", g_tr.bad_page);
}

static void gen_random_pages(pkey_t *k, size_t npages)
{
    for (size_t i = 0; i < npages * g_p.P && k->len < MD_MAX * g_p.P; i++) {
        uint64_t c = kvs_rng_below(&g_p.rng, 40);
        /* Mostly a 3-letter alphabet so keys collide; sometimes extreme ids. */
        k->tok[k->len++] = c == 0   ? INT32_MIN
                           : c == 1 ? INT32_MAX
                           : c == 2 ? -1
                                    : (int32_t) (c % 3);
    }
}

static void gen_key(pkey_t *k)
{
    uint32_t P = g_p.P;
    uint64_t c = kvs_rng_below(&g_p.rng, 10);
    if (c < 3 && g_p.nrecent > 0) {
        /* A prefix of a recent key: matches that end inside nodes. */
        *k = g_p.recent[kvs_rng_below(&g_p.rng, g_p.nrecent)];
        k->len = kvs_rng_range(&g_p.rng, 0, k->len);
    } else if (c < 5 && g_p.nrecent > 0) {
        /* A recent key cut at a page boundary and continued differently: branches. */
        *k = g_p.recent[kvs_rng_below(&g_p.rng, g_p.nrecent)];
        k->len = kvs_rng_range(&g_p.rng, 0, k->len / P) * P;
        gen_random_pages(k, kvs_rng_range(&g_p.rng, 1, 3));
    } else {
        *k = g_p.stem[kvs_rng_below(&g_p.rng, STEMS)];
        uint64_t w = kvs_rng_below(&g_p.rng, 10);
        k->ns = w < 8 ? 0 : w < 9 ? 1 : UINT64_MAX;
        gen_random_pages(k, kvs_rng_range(&g_p.rng, 0, 4));
    }
    if (k->len > MD_MAX * P) k->len = MD_MAX * P;
    /* A partial last page that the cache must ignore. */
    size_t tail = kvs_rng_below(&g_p.rng, P);
    for (size_t i = 0; i < tail; i++) k->tok[k->len++] = (int32_t) kvs_rng_below(&g_p.rng, 3);
    g_p.recent[g_p.nrecent < RECENT ? g_p.nrecent++ : kvs_rng_below(&g_p.rng, RECENT)] = *k;
}

/* Locks node (ending a model path of `depth` pages) in both and remembers the handle. */
static void p_lock(kvs_radix_node_t *node, uint64_t ns, const int *path, size_t depth)
{
    if (g_p.nhold == MH_MAX) return;
    kvs_radix_lock(g_p.r, node);
    for (size_t d = 0; d < depth; d++) g_p.e[path[d]].locks++;
    hold_t *h = &g_p.hold[g_p.nhold++];
    h->node = node;
    h->ns = ns;
    h->depth = depth;
    memcpy(h->path, path, depth * sizeof(int));
    h->count = 1;
}

static void p_unlock(size_t hi)
{
    hold_t *h = &g_p.hold[hi];
    kvs_status_t st = kvs_radix_unlock(g_p.r, h->node);
    PCHECK(st == KVS_OK, "unlock of a held handle: %s", kvs_status_str(st));
    /* Pages whose count falls to 0 go back to the LRU order as just used, deepest first. */
    for (size_t d = h->depth; d-- > 0;) {
        ment_t *x = &g_p.e[h->path[d]];
        PCHECK(x->locks > 0, "model lock underflow");
        if (--x->locks == 0) x->stamp = ++g_p.clock;
    }
    if (--h->count == 0) g_p.hold[hi] = g_p.hold[--g_p.nhold];
}

/* A handle naming the same prefix must be the very node the cache returned. */
static void check_same_node(kvs_radix_node_t *node, uint64_t ns, const int *path, size_t depth)
{
    if (depth == 0) {
        PCHECK(node == g_p.root, "empty result is not the root");
        return;
    }
    PCHECK(node != g_p.root, "non-empty result is the root");
    for (size_t i = 0; i < g_p.nhold; i++) {
        const hold_t *h = &g_p.hold[i];
        if (h->ns == ns && h->depth == depth && h->path[depth - 1] == path[depth - 1])
            PCHECK(h->node == node, "a held handle for the same prefix is another node");
    }
}

static void inject_maybe(int *armed)
{
    *armed = kvs_rng_below(&g_p.rng, 12) == 0;
    if (*armed) kvs_alloc_fail_at(kvs_rng_range(&g_p.rng, 1, 3));
}

static void op_match(void)
{
    pkey_t k;
    gen_key(&k);
    uint32_t P = g_p.P;
    size_t npages = k.len / P;
    int path[MD_MAX];
    size_t mm = m_walk(k.ns, k.tok, npages, path);
    uint32_t out[MD_MAX + 1];
    int want_pages = kvs_rng_below(&g_p.rng, 4) != 0;
    memset(out, 0, sizeof(out));
    out[npages] = 0xdeadbeef; /* nothing past len/P is written */
    /* The read-only lookup agrees with the model (and so with the match below), and it never
     * allocates, so it cannot fail under injection. */
    size_t looked = 999;
    PCHECK(kvs_radix_lookup(g_p.r, k.ns, k.tok, k.len, &looked) == KVS_OK, "lookup failed");
    PCHECK(looked == mm * P, "lookup length %zu, model %zu", looked, mm * P);
    int armed;
    inject_maybe(&armed);
    kvs_radix_match_t m;
    kvs_status_t st = kvs_radix_match(g_p.r, k.ns, k.tok, k.len, want_pages ? out : NULL, &m);
    kvs_alloc_fail_at(0);
    log_reset();
    if (armed && st == KVS_ERR_NOMEM) return;
    PCHECK(st == KVS_OK, "match: %s", kvs_status_str(st));
    PCHECK(m.tokens == mm * P, "match length %zu, model %zu", m.tokens, mm * P);
    if (want_pages) {
        for (size_t d = 0; d < mm; d++)
            PCHECK(out[d] == g_p.e[path[d]].page, "match page %zu: %u, model %u", d, out[d],
                   g_p.e[path[d]].page);
        PCHECK(out[npages] == 0xdeadbeef, "match wrote past len/P pages");
    }
    m_touch(path, mm);
    check_same_node(m.node, k.ns, path, mm);

    uint64_t c = kvs_rng_below(&g_p.rng, 10);
    if (c < 3) {
        p_lock(m.node, k.ns, path, mm);
    } else if (c == 3) {
        /* Unlocking a node nobody locked (even with locks below it) must be refused and
         * change nothing. */
        int held = 0;
        for (size_t i = 0; i < g_p.nhold; i++)
            if (g_p.hold[i].depth == mm && (mm == 0 || g_p.hold[i].path[mm - 1] == path[mm - 1]))
                held = 1;
        if (!held) {
            st = kvs_radix_unlock(g_p.r, m.node);
            PCHECK(st == KVS_ERR_STATE, "unlock of an unlocked node: %s", kvs_status_str(st));
        }
    }
}

static void op_insert(void)
{
    pkey_t k;
    gen_key(&k);
    uint32_t P = g_p.P;
    size_t npages = k.len / P;
    int path[MD_MAX];
    size_t pm = m_walk(k.ns, k.tok, npages, path);
    /* Like an engine, sometimes hand back the cache's own pages for the cached prefix. */
    size_t reuse = kvs_rng_below(&g_p.rng, 2) ? kvs_rng_range(&g_p.rng, 0, pm) : 0;
    uint32_t pages[MD_MAX];
    for (size_t d = 0; d < npages; d++) pages[d] = d < reuse ? g_p.e[path[d]].page : fresh_id();
    int armed;
    inject_maybe(&armed);
    size_t present = 12345;
    kvs_radix_node_t *node = NULL;
    kvs_radix_node_t **node_p = kvs_rng_below(&g_p.rng, 4) ? &node : NULL;
    kvs_status_t st = kvs_radix_insert(g_p.r, k.ns, k.tok, k.len, pages, &present, node_p);
    kvs_alloc_fail_at(0);
    log_reset();
    if (armed && st == KVS_ERR_NOMEM) {
        for (size_t d = reuse; d < npages; d++) g_tr.state[pages[d]] = ST_RETURNED;
        return;
    }
    PCHECK(st == KVS_OK, "insert: %s", kvs_status_str(st));
    PCHECK(present == pm * P, "insert present %zu, model %zu", present, pm * P);
    for (size_t d = 0; d < npages; d++) {
        uint8_t s = g_tr.state[pages[d]];
        if (d < reuse)
            PCHECK(s == ST_CACHED, "reused page %u is not cached", pages[d]);
        else
            PCHECK(s == ST_CALLER, "fresh page %u in state %d", pages[d], s);
    }
    settle(pages, npages, pm);
    for (size_t d = pm; d < npages; d++)
        path[d] = m_new(k.ns, d ? path[d - 1] : -1, k.tok + d * P, d + 1, pages[d]);
    m_touch(path, npages);
    if (node_p) {
        check_same_node(node, k.ns, path, npages);
        if (kvs_rng_below(&g_p.rng, 4) == 0) p_lock(node, k.ns, path, npages);
    }
}

static void op_evict(size_t want)
{
    log_reset();
    size_t got = kvs_radix_evict(g_p.r, want);
    PCHECK(!g_tr.bad, "evicted page %u was not owned by the cache", g_tr.bad_page);
    PCHECK(g_tr.nlog == got, "evict returned %zu, callback got %zu", got, g_tr.nlog);
    size_t done = 0, start = 0;
    for (size_t g = 0; g < g_tr.ngroups; g++) {
        PCHECK(done < want, "evicted another node after reaching %zu pages", want);
        size_t end = g_tr.group_end[g];
        PCHECK(end > start, "empty callback");
        /* Map the group to model pages, deepest first. */
        int ent[MD_MAX];
        size_t n = end - start;
        PCHECK(n <= MD_MAX, "group of %zu pages", n);
        for (size_t i = 0; i < n; i++) {
            ent[i] = -1;
            for (int j = 0; j < ME_MAX; j++)
                if (g_p.e[j].live && g_p.e[j].page == g_tr.log[start + i]) ent[i] = j;
            PCHECK(ent[i] >= 0, "evicted page %u is not in the model", g_tr.log[start + i]);
        }
        for (size_t i = 0; i < n; i++)
            for (size_t j = i + 1; j < n; j++)
                if (g_p.e[ent[j]].depth > g_p.e[ent[i]].depth) {
                    int t = ent[i];
                    ent[i] = ent[j];
                    ent[j] = t;
                }
        for (size_t i = 0; i < n; i++) {
            ment_t *x = &g_p.e[ent[i]];
            /* One node: a chain. */
            if (i + 1 < n) PCHECK(x->parent == ent[i + 1], "evicted group is not one path segment");
            PCHECK(x->locks == 0, "evicted a locked page");
            PCHECK(x->nchildren == 0, "evicted page %u is not a leaf", x->page);
            uint64_t min = UINT64_MAX;
            for (int j = 0; j < ME_MAX; j++)
                if (g_p.e[j].live && g_p.e[j].locks == 0 && g_p.e[j].stamp < min)
                    min = g_p.e[j].stamp;
            PCHECK(x->stamp == min, "evicted page %u is not the least recently used", x->page);
            x->live = 0;
            if (x->parent >= 0) g_p.e[x->parent].nchildren--;
            g_p.nlive--;
        }
        done += n;
        start = end;
    }
    if (got < want) {
        for (int j = 0; j < ME_MAX; j++)
            PCHECK(!(g_p.e[j].live && g_p.e[j].locks == 0), "stopped with evictable pages left");
    }
}

static void episode(void)
{
    tracker_reset();
    memset(g_p.e, 0, sizeof(g_p.e));
    g_p.nlive = 0;
    g_p.clock = 0;
    g_p.nhold = 0;
    g_p.nrecent = 0;
    g_p.P = (uint32_t) kvs_rng_range(&g_p.rng, 1, MP_MAX);
    for (int s = 0; s < STEMS; s++) {
        g_p.stem[s].ns = 0;
        g_p.stem[s].len = 0;
        gen_random_pages(&g_p.stem[s], kvs_rng_range(&g_p.rng, 0, 5));
    }
    PCHECK(kvs_radix_create(g_p.P, on_free, NULL, &g_p.r) == KVS_OK, "create");
    kvs_radix_match_t m;
    PCHECK(kvs_radix_match(g_p.r, 0, NULL, 0, NULL, &m) == KVS_OK, "empty match");
    g_p.root = m.node;
}

static void test_property(void **state)
{
    (void) state;
    kvs_log_set_sink(quiet_sink, NULL);
    g_p.seed = kvs_test_seed(0x5eed);
    kvs_rng_seed(&g_p.rng, g_p.seed);
    uint64_t steps = kvs_test_iters(150000);
    const uint64_t per_episode = 500;
    g_p.episode = 0;
    g_p.step = 0;
    episode();
    for (uint64_t i = 0; i < steps; i++) {
        g_p.step = i;
        uint64_t c = kvs_rng_below(&g_p.rng, 100);
        if (c < 35) {
            op_match();
        } else if (c < 70) {
            op_insert();
        } else if (c < 78 && g_p.nhold > 0) {
            p_unlock(kvs_rng_below(&g_p.rng, g_p.nhold));
        } else if (c < 81 && g_p.nhold > 0) {
            hold_t *h = &g_p.hold[kvs_rng_below(&g_p.rng, g_p.nhold)];
            kvs_radix_lock(g_p.r, h->node);
            for (size_t d = 0; d < h->depth; d++) g_p.e[h->path[d]].locks++;
            h->count++;
        } else if (c < 92) {
            op_evict(kvs_rng_below(&g_p.rng, 12));
        }
        if (g_p.nlive > 300) op_evict(g_p.nlive - 200);
        m_check_stats();

        if ((i + 1) % per_episode == 0 || i + 1 == steps) {
            /* Release half of the time; destroy must free everything either way. */
            if (kvs_rng_below(&g_p.rng, 2))
                while (g_p.nhold > 0) p_unlock(g_p.nhold - 1);
            m_check_stats();
            log_reset();
            kvs_radix_destroy(g_p.r);
            g_p.r = NULL;
            PCHECK(!g_tr.bad, "destroy freed page %u it did not own", g_tr.bad_page);
            PCHECK(g_tr.nlog == g_p.nlive, "destroy freed %zu pages, model %zu", g_tr.nlog,
                   g_p.nlive);
            PCHECK(g_tr.ncached == 0, "pages left after destroy");
            for (uint32_t id = 1; id < g_tr.next_id; id++)
                PCHECK(g_tr.state[id] == ST_FREED || g_tr.state[id] == ST_RETURNED,
                       "page %u lost (state %d)", id, g_tr.state[id]);
            kvs_assert_no_leaks();
            if (i + 1 < steps) {
                g_p.episode++;
                episode();
            }
        }
    }
    kvs_log_set_sink(NULL, NULL);
    kvs_assert_no_leaks();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_create_invalid),
        cmocka_unit_test(test_basic_split),
        cmocka_unit_test(test_namespaces_isolate),
        cmocka_unit_test(test_partial_page_ignored),
        cmocka_unit_test(test_insert_present),
        cmocka_unit_test(test_lock_protects),
        cmocka_unit_test(test_unlock_errors),
        cmocka_unit_test(test_eviction_lru_leaves),
        cmocka_unit_test(test_destroy_frees_all),
        cmocka_unit_test(test_alloc_failures),
        cmocka_unit_test(test_table_growth_failure),
        cmocka_unit_test(test_lookup_read_only),
        cmocka_unit_test(test_property),
    };
    /* KVS_TEST_FILTER=test_property runs one test (e.g. a long soak with KVS_ITERS). */
    const char *filter = getenv("KVS_TEST_FILTER");
    if (filter) cmocka_set_test_filter(filter);
    return cmocka_run_group_tests(tests, NULL, NULL);
}
