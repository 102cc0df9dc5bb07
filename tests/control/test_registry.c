/* Tests for the bootstrap registry: registration and queries over loopback with the registry
 * served from a thread, re-registration after a restart, deadlines, rejection of garbage, and
 * the compatibility check naming each kind of mismatch. */
#include "kvs_test.h"

#include <pthread.h>
#include <string.h>
#include <zmq.h>

#include "kvstage/log.h"
#include "kvstage/clock.h"
#include "kvstage/registry.h"

typedef struct {
    kvs_registry_t *reg;
    volatile int stop;
} server_t;

static void *serve(void *arg)
{
    server_t *s = arg;
    while (!s->stop) kvs_registry_serve(s->reg, 20);
    return NULL;
}

static void geo_default(kvs_pd_geometry_t *g)
{
    memset(g, 0, sizeof(*g));
    g->shape = (kvs_kv_shape_t){.layers = 32,
                                .kv_heads = 8,
                                .head_dim_k = 128,
                                .head_dim_v = 128,
                                .elem_bytes = 2,
                                .attn = KVS_ATTN_MHA};
    g->prefill_tp = 4;
    g->decode_tp = 2;
    g->page_size = 16;
    g->chunk_tokens = 256;
}

static void test_register_and_query(void **state)
{
    (void) state;
    server_t s = {0};
    assert_int_equal(kvs_registry_create("tcp://127.0.0.1:*", &s.reg), KVS_OK);
    const char *ep = kvs_registry_endpoint(s.reg);
    assert_non_null(strstr(ep, "tcp://127.0.0.1:"));
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, serve, &s), 0);

    kvs_pd_geometry_t g;
    geo_default(&g);
    const uint64_t sec = 1000000000ull;
    for (uint32_t r = 0; r < 4; r++) {
        char endpoint[64];
        snprintf(endpoint, sizeof(endpoint), "tcp://127.0.0.1:%u", 7000 + r);
        kvs_msg_register_t reg;
        kvs_registry_describe(&g, r, endpoint, &reg);
        assert_int_equal(kvs_registry_register(ep, &reg, 5 * sec), KVS_OK);
    }
    for (uint32_t r = 0; r < 4; r++) {
        kvs_msg_register_t got;
        assert_int_equal(kvs_registry_query(ep, r, 5 * sec, &got), KVS_OK);
        assert_int_equal(got.rank, r);
        assert_int_equal(got.tp_size, 4);
        char want[64];
        snprintf(want, sizeof(want), "tcp://127.0.0.1:%u", 7000 + r);
        assert_string_equal(got.endpoint, want);
        char why[256];
        assert_int_equal(kvs_registry_check(&got, &g, why, sizeof(why)), KVS_OK);
    }
    /* A restarted rank registers again with a new endpoint; queries see the new one. */
    kvs_msg_register_t reg;
    kvs_registry_describe(&g, 2, "tcp://127.0.0.1:7999", &reg);
    assert_int_equal(kvs_registry_register(ep, &reg, 5 * sec), KVS_OK);
    kvs_msg_register_t got;
    assert_int_equal(kvs_registry_query(ep, 2, 5 * sec, &got), KVS_OK);
    assert_string_equal(got.endpoint, "tcp://127.0.0.1:7999");
    /* A rank that never registers: the query gives up at its deadline. */
    uint64_t t0 = kvs_now_ns();
    assert_int_equal(kvs_registry_query(ep, 5, sec / 2, &got), KVS_ERR_TIMEOUT);
    assert_true(kvs_now_ns() - t0 >= sec / 2);
    /* A registration of a different TP size is refused (no answer: it times out). */
    kvs_pd_geometry_t other = g;
    other.prefill_tp = 8;
    kvs_registry_describe(&other, 6, "tcp://127.0.0.1:7006", &reg);
    assert_int_equal(kvs_registry_register(ep, &reg, sec / 4), KVS_ERR_TIMEOUT);
    assert_int_equal(kvs_registry_count(s.reg), 4);

    s.stop = 1;
    pthread_join(th, NULL);
    kvs_registry_destroy(s.reg);
    kvs_assert_no_leaks();
}

static void test_garbage_rejected(void **state)
{
    (void) state;
    kvs_registry_t *reg;
    assert_int_equal(kvs_registry_create("tcp://127.0.0.1:*", &reg), KVS_OK);
    void *zctx = zmq_ctx_new();
    void *sock = zmq_socket(zctx, ZMQ_DEALER);
    int zero = 0;
    zmq_setsockopt(sock, ZMQ_LINGER, &zero, sizeof(zero));
    assert_int_equal(zmq_connect(sock, kvs_registry_endpoint(reg)), 0);
    uint8_t junk[2000];
    for (size_t i = 0; i < sizeof(junk); i++) junk[i] = (uint8_t) (i * 31 + 7);
    assert_true(zmq_send(sock, junk, 17, 0) >= 0);
    assert_true(zmq_send(sock, junk, sizeof(junk), 0) >= 0); /* oversized */
    assert_true(zmq_send(sock, junk, 3, ZMQ_SNDMORE) >= 0);  /* extra frames */
    assert_true(zmq_send(sock, junk, 3, 0) >= 0);
    uint64_t deadline = kvs_now_ns() + 5000000000ull;
    while (kvs_registry_rejected(reg) < 3 && kvs_now_ns() < deadline) kvs_registry_serve(reg, 50);
    assert_int_equal(kvs_registry_rejected(reg), 3);
    assert_int_equal(kvs_registry_count(reg), 0);
    zmq_close(sock);
    zmq_ctx_term(zctx);
    kvs_registry_destroy(reg);
    kvs_assert_no_leaks();
}

static void test_compatibility_names_the_mismatch(void **state)
{
    (void) state;
    kvs_pd_geometry_t g;
    geo_default(&g);
    kvs_msg_register_t reg;
    char why[256];
    kvs_pd_geometry_t variants[11];
    for (int i = 0; i < 11; i++) variants[i] = g;
    variants[0].shape.kv_heads = 4;
    variants[1].shape.elem_bytes = 1;
    variants[2].page_size = 32;
    variants[3].chunk_tokens = 512;
    variants[4].shape.attn = KVS_ATTN_MLA;
    variants[5].no_checksum = 1;
    variants[6].prefill_page_size = 64; /* a page size per side: prefill states its own */
    variants[7].prefill_page_size = 16; /* the same prefill pages, another decode page */
    variants[7].page_size = 32;
    variants[8].prefill_pp = 2;
    variants[9].decode_dcp = 2; /* the decode DCP groups prefill splits tokens for */
    variants[10].dcp_interleave = 4;
    const char *expect[11] = {"KV shape",
                              "element size 1 bytes vs 2",
                              "prefill page size 32 vs 16",
                              "chunk size 512 vs 256",
                              "attention kind MLA vs MHA",
                              "chunk checksums off vs on here",
                              "prefill page size 64 vs 16",
                              "decode page size 32 expected there vs 16 here",
                              "prefill pipeline stages 2 vs 1 here",
                              "decode DCP 2, interleave 1 expected there vs 1, 1 here",
                              "decode DCP 1, interleave 4 expected there vs 1, 1 here"};
    kvs_log_level_t old = kvs_log_get_level();
    kvs_log_set_level((kvs_log_level_t) -1);
    for (int i = 0; i < 11; i++) {
        kvs_registry_describe(&variants[i], 1, "tcp://127.0.0.1:1", &reg);
        assert_int_equal(kvs_registry_check(&reg, &g, why, sizeof(why)), KVS_ERR_INCOMPATIBLE);
        if (strstr(why, expect[i]) == NULL) fail_msg("case %d: '%s' lacks '%s'", i, why, expect[i]);
        assert_non_null(strstr(why, "prefill rank 1"));
    }
    /* Same fields, different hash (another protocol version): still refused, by hash. */
    kvs_registry_describe(&g, 0, "tcp://127.0.0.1:1", &reg);
    reg.layout_hash ^= 1;
    assert_int_equal(kvs_registry_check(&reg, &g, why, sizeof(why)), KVS_ERR_INCOMPATIBLE);
    assert_non_null(strstr(why, "layout hash"));
    kvs_log_set_level(old);
    /* Long endpoints are cut to what the wire carries. */
    char longep[300];
    memset(longep, 'x', sizeof(longep) - 1);
    longep[sizeof(longep) - 1] = '\0';
    kvs_registry_describe(&g, 0, longep, &reg);
    assert_int_equal(reg.endpoint_len, KVS_MSG_ENDPOINT_MAX);
    assert_int_equal(strlen(reg.endpoint), KVS_MSG_ENDPOINT_MAX);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_register_and_query),
        cmocka_unit_test(test_garbage_rejected),
        cmocka_unit_test(test_compatibility_names_the_mismatch),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
