/* Tests for the server's pure pieces: the string builder, UTF-8 hold-back and sanitising of
 * streamed text, stop-string search and hold-back, request parsing (defaults, extensions and
 * every allocation failure), histograms in Prometheus form, the fake backend on its own, and
 * server creation under allocation failures. */
#include "server_test.h"

#include <string.h>

#include "kvstage/rng.h"
#include "http/server.h"

static void test_string_builder(void **state)
{
    (void) state;
    kvs__sb_t sb;
    kvs__sb_init(&sb);
    kvs__sb_puts(&sb, "ab");
    kvs__sb_printf(&sb, "%d-%s", 42, "x");
    assert_string_equal(sb.ptr, "ab42-x");
    char big[1000];
    memset(big, 'q', sizeof(big) - 1);
    big[sizeof(big) - 1] = '\0';
    kvs__sb_printf(&sb, "[%s]", big);
    assert_int_equal(sb.len, 6 + 2 + 999);
    assert_int_equal(sb.ptr[6], '[');
    assert_int_equal(sb.ptr[sb.len - 1], ']');
    kvs__sb_consume(&sb, 7);
    assert_int_equal(sb.len, 1000);
    assert_int_equal(sb.ptr[0], 'q');
    kvs__sb_consume(&sb, 5000);
    assert_int_equal(sb.len, 0);
    kvs__sb_append(&sb, "z", 1);
    char *t = kvs__sb_take(&sb);
    assert_string_equal(t, "z");
    assert_null(sb.ptr);
    kvs_free(t);
    t = kvs__sb_take(&sb); /* empty: "" */
    assert_string_equal(t, "");
    kvs_free(t);
    /* An allocation failure truncates and is remembered; take gives NULL. */
    kvs_alloc_fail_at(1);
    kvs__sb_puts(&sb, "lost");
    assert_true(sb.oom);
    kvs__sb_puts(&sb, "also lost");
    assert_null(kvs__sb_take(&sb));
    kvs_assert_no_leaks();
}

static void test_utf8_tail(void **state)
{
    (void) state;
    static const struct {
        const char *s;
        size_t tail;
    } cases[] = {
        {"", 0},
        {"a", 0},
        {"\xC3", 1},
        {"a\xC3", 1},
        {"\xC3\xA9", 0},
        {"\xE2\x82", 2},
        {"\xE2", 1},
        {"\xE2\x82\xAC", 0},
        {"\xF0\x9F\x98", 3},
        {"\xF0\x9F", 2},
        {"\xF0\x9F\x98\x80", 0},
        {"\x80", 0},     /* a stray continuation byte: invalid, not pending */
        {"\xC3\x28", 0}, /* invalid continuation */
        {"\xED\xA0", 0}, /* a surrogate can never complete */
        {"\xE0\x80", 0}, /* overlong */
        {"\xF4\x90", 0}, /* past U+10FFFF */
        {"\xFF", 0},     /* never a lead byte */
        {"ab\xF0\x9F\x98", 3},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        size_t got = kvs__utf8_incomplete_tail(cases[i].s, strlen(cases[i].s));
        if (got != cases[i].tail)
            fail_msg("case %zu: tail %zu, expected %zu", i, got, cases[i].tail);
    }
}

static void test_utf8_sanitize(void **state)
{
    (void) state;
    static const struct {
        const char *in, *out;
    } cases[] = {
        {"abc", "abc"},
        {"caf\xC3\xA9", "caf\xC3\xA9"},
        {"a\xFF"
         "b",
         "a\xEF\xBF\xBD"
         "b"},
        {"\xC3\x28", "\xEF\xBF\xBD("},
        {"\xE2\x82", "\xEF\xBF\xBD"}, /* one replacement for the truncated character */
        {"\xE2\x82x", "\xEF\xBF\xBDx"},
        {"\xF0\x9F\x98\x80!", "\xF0\x9F\x98\x80!"},
        {"\xC0\xAF", "\xEF\xBF\xBD\xEF\xBF\xBD"},
        {"\xED\xA0\x80", "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        kvs__sb_t sb;
        kvs__sb_init(&sb);
        kvs__utf8_sanitize(&sb, cases[i].in, strlen(cases[i].in));
        kvs__sb_append(&sb, "", 0);
        if (strcmp(sb.ptr, cases[i].out) != 0) fail_msg("case %zu: got '%s'", i, sb.ptr);
        kvs__sb_fini(&sb);
    }
    /* Whatever goes in, jansson accepts what comes out. */
    kvs_rng_t rng;
    uint64_t seed = kvs_test_seed(11);
    kvs_rng_seed(&rng, seed);
    for (uint64_t it = 0; it < kvs_test_iters(2000); it++) {
        char in[16];
        size_t n = kvs_rng_next(&rng) % sizeof(in);
        for (size_t k = 0; k < n; k++) in[k] = (char) (kvs_rng_next(&rng) & 0xFF);
        kvs__sb_t sb;
        kvs__sb_init(&sb);
        kvs__utf8_sanitize(&sb, in, n);
        kvs__sb_append(&sb, "", 0);
        json_t *s = json_stringn(sb.ptr, sb.len);
        if (s == NULL)
            fail_msg("seed %llu: invalid UTF-8 out of sanitize", (unsigned long long) seed);
        json_decref(s);
        kvs__sb_fini(&sb);
    }
    kvs_assert_no_leaks();
}

static void test_stop_search(void **state)
{
    (void) state;
    char *stops[] = {"wor", "lo"};
    size_t lens[] = {3, 2};
    const char *t = "hello world";
    assert_int_equal(kvs__stop_find(t, 11, 0, stops, lens, 2), 3);
    assert_int_equal(kvs__stop_find(t, 11, 4, stops, lens, 2), 6);
    assert_int_equal(kvs__stop_find(t, 11, 7, stops, lens, 2), SIZE_MAX);
    assert_int_equal(kvs__stop_find(t, 4, 0, stops, lens, 2), SIZE_MAX);
    assert_int_equal(kvs__stop_find(t, 5, 0, stops, lens, 2), 3);
    assert_int_equal(kvs__stop_find(t, 11, 0, stops, lens, 0), SIZE_MAX);

    char *world[] = {"world"};
    size_t wl[] = {5};
    assert_int_equal(kvs__stop_hold("hello wo", 8, 0, world, wl, 1), 2);
    assert_int_equal(kvs__stop_hold("hello w", 7, 0, world, wl, 1), 1);
    assert_int_equal(kvs__stop_hold("hello", 5, 0, world, wl, 1), 0);
    assert_int_equal(kvs__stop_hold("hello worl", 10, 0, world, wl, 1), 4);
    /* Never more than what follows from. */
    assert_int_equal(kvs__stop_hold("hello worl", 10, 8, world, wl, 1), 0);
    assert_int_equal(kvs__stop_hold("hello worl", 10, 7, world, wl, 1), 0);
    assert_int_equal(kvs__stop_hold("hello worl", 10, 6, world, wl, 1), 4);
    char *two[] = {"abc", "bx"};
    size_t tl[] = {3, 2};
    assert_int_equal(kvs__stop_hold("zab", 3, 0, two, tl, 2), 2);
    assert_int_equal(kvs__stop_hold("zzb", 3, 0, two, tl, 2), 1);
}

static kvs__api_limits_t limits(void)
{
    kvs__api_limits_t l = {.max_context = 64, .default_max_tokens = 16, .model = "m"};
    return l;
}

static void test_parse_defaults(void **state)
{
    (void) state;
    kvs_server_tokenizer_t tok = kvs_server_byte_tokenizer();
    kvs__api_limits_t l = limits();
    kvs__api_req_t q;
    kvs__api_err_t err;
    const char *body = "{\"prompt\":\"abc\"}";
    assert_int_equal(kvs__api_parse(&l, &tok, 0, body, strlen(body), &q, &err), KVS_OK);
    assert_int_equal(q.prompt_len, 3);
    assert_int_equal(q.prompt[2], 'c');
    assert_int_equal(q.max_tokens, 16);
    const kvs_sample_params_t *sp = &q.sampling;
    assert_true(sp->temperature == 1.0f && sp->top_p == 1.0f && sp->top_k == 0 && sp->min_p == 0 &&
                sp->presence_penalty == 0 && sp->frequency_penalty == 0 &&
                sp->repetition_penalty == 1.0f && sp->n_bias == 0 && sp->bias == NULL);
    assert_int_equal(q.n_stop_ids, 1);
    assert_int_equal(q.stop_ids[0], 256);
    assert_false(q.stream);
    assert_false(q.has_room);
    assert_int_equal(q.role, KVS_SERVER_ROLE_NONE);
    /* No seed: a fresh one each time, exact as a JSON number. */
    const uint64_t seed = q.seed;
    assert_true(seed < (UINT64_C(1) << 53));
    kvs__api_req_fini(&q);
    assert_int_equal(kvs__api_parse(&l, &tok, 0, body, strlen(body), &q, &err), KVS_OK);
    assert_true(q.seed != seed && q.seed < (UINT64_C(1) << 53));
    kvs__api_req_fini(&q);

    /* The default is bounded by the context. */
    body = "{\"prompt\":\"0123456789012345678901234567890123456789012345678901\"}";
    assert_int_equal(kvs__api_parse(&l, &tok, 0, body, strlen(body), &q, &err), KVS_OK);
    assert_int_equal(q.max_tokens, 64 - 52);
    kvs__api_req_fini(&q);

    body = "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"stop\":[\"a\",\"bc\"],"
           "\"stop_token_ids\":[7,9],\"temperature\":0.5,\"top_p\":0.25,\"seed\":-3,"
           "\"top_k\":-1,\"min_p\":0.5,\"presence_penalty\":-2,\"frequency_penalty\":2,"
           "\"repetition_penalty\":0.5,\"logit_bias\":{\"0\":-100,\"255\":100,\"7\":0.5},"
           "\"stream\":true,\"stream_options\":{\"include_usage\":true},\"max_tokens\":5,"
           "\"kvstage\":{\"room\":123,\"role\":\"decode\",\"bootstrap\":\"tcp://h:1\","
           "\"prefill\":\"http://p\"}}";
    assert_int_equal(kvs__api_parse(&l, &tok, 1, body, strlen(body), &q, &err), KVS_OK);
    assert_int_equal(q.prompt_len, strlen("user: hi\nassistant: "));
    assert_int_equal(q.n_stops, 2);
    assert_string_equal(q.stops[1], "bc");
    assert_int_equal(q.stop_lens[1], 2);
    assert_int_equal(q.n_stop_ids, 3);
    assert_int_equal(q.stop_ids[2], 9);
    assert_true(sp->temperature == 0.5f && sp->top_p == 0.25f && sp->top_k == 0 &&
                sp->min_p == 0.5f && sp->presence_penalty == -2 && sp->frequency_penalty == 2 &&
                sp->repetition_penalty == 0.5f);
    assert_int_equal(sp->n_bias, 3);
    assert_int_equal(sp->bias[0].token, 0);
    assert_true(sp->bias[0].bias == -100);
    assert_int_equal(sp->bias[1].token, 255);
    assert_int_equal(sp->bias[2].token, 7);
    assert_true(sp->bias[2].bias == 0.5f);
    assert_true(q.seed == (uint64_t) -3);
    assert_true(q.stream && q.include_usage);
    assert_int_equal(q.max_tokens, 5);
    assert_true(q.has_room);
    assert_int_equal(q.room, 123);
    assert_int_equal(q.role, KVS_SERVER_ROLE_DECODE);
    assert_string_equal(q.bootstrap, "tcp://h:1");
    kvs__api_req_fini(&q);

    /* top_k above the vocabulary keeps it all; ignore_eos leaves the EOS out of the stop ids. */
    body = "{\"prompt\":\"abc\",\"top_k\":100000,\"ignore_eos\":true,\"stop_token_ids\":[5]}";
    assert_int_equal(kvs__api_parse(&l, &tok, 0, body, strlen(body), &q, &err), KVS_OK);
    assert_int_equal(q.sampling.top_k, tok.vocab_size);
    assert_int_equal(q.n_stop_ids, 1);
    assert_int_equal(q.stop_ids[0], 5);
    kvs__api_req_fini(&q);

    /* Token ids nested one deep; one string in an array. */
    body = "{\"prompt\":[[1,2,3]],\"kvstage\":{\"room\":0,\"role\":\"prefill\"}}";
    assert_int_equal(kvs__api_parse(&l, &tok, 0, body, strlen(body), &q, &err), KVS_OK);
    assert_int_equal(q.prompt_len, 3);
    assert_int_equal(q.role, KVS_SERVER_ROLE_PREFILL);
    kvs__api_req_fini(&q);
    body = "{\"prompt\":[\"xy\"]}";
    assert_int_equal(kvs__api_parse(&l, &tok, 0, body, strlen(body), &q, &err), KVS_OK);
    assert_int_equal(q.prompt_len, 2);
    kvs__api_req_fini(&q);

    /* The error carries status, type, param and code. */
    body = "{\"prompt\":\"abc\",\"max_tokens\":62}";
    assert_int_equal(kvs__api_parse(&l, &tok, 0, body, strlen(body), &q, &err), KVS_ERR_INVALID);
    assert_int_equal(err.status, 400);
    assert_string_equal(err.type, "invalid_request_error");
    assert_string_equal(err.param, "max_tokens");
    assert_string_equal(err.code, "context_length_exceeded");
    assert_string_equal(err.message,
                        "This model's maximum context length is 64 tokens. However, you requested "
                        "65 tokens (3 in the prompt, 62 in the completion). Please reduce the "
                        "length of the prompt or completion ('max_tokens' at most 61).");
    kvs_assert_no_leaks();
}

/* prompt + max_tokens beyond the context: a 400 naming the client's field and both numbers;
 * exactly the context is accepted. */
static void test_parse_context_length(void **state)
{
    (void) state;
    kvs_server_tokenizer_t tok = kvs_server_byte_tokenizer();
    kvs__api_limits_t l = limits();
    kvs__api_req_t q;
    kvs__api_err_t err;
    static const struct {
        int chat;
        const char *body, *param, *says;
    } bad[] = {
        {1,
         "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_completion_tokens\":"
         "45}",
         "max_completion_tokens",
         "However, you requested 65 tokens (20 in the messages, 45 in the completion). Please "
         "reduce the length of the messages or completion ('max_completion_tokens' at most 44)."},
        {1, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":100}",
         "max_tokens", "you requested 120 tokens (20 in the messages, 100 in the completion)"},
        {0, "{\"prompt\":\"0123456789012345678901234567890123456789012345678901234567890123\"}",
         "prompt",
         "This model's maximum context length is 64 tokens. However, you requested 64 tokens in "
         "the prompt, which leaves no room for the completion. Please reduce the length of the "
         "prompt."},
        {1,
         "{\"messages\":[{\"role\":\"user\",\"content\":\"0123456789012345678901234567890123"
         "45678901234567890123456789\"}],\"max_tokens\":1}",
         "messages", "you requested 78 tokens in the messages, which leaves no room"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        assert_int_equal(
            kvs__api_parse(&l, &tok, bad[i].chat, bad[i].body, strlen(bad[i].body), &q, &err),
            KVS_ERR_INVALID);
        assert_int_equal(err.status, 400);
        assert_string_equal(err.param, bad[i].param);
        assert_string_equal(err.code, "context_length_exceeded");
        if (strstr(err.message, bad[i].says) == NULL)
            fail_msg("case %zu: '%s' does not say '%s'", i, err.message, bad[i].says);
    }
    /* "user: hi\nassistant: " is 20 tokens: 44 more fill the context of 64 exactly. */
    const char *body =
        "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_completion_tokens\":44}";
    assert_int_equal(kvs__api_parse(&l, &tok, 1, body, strlen(body), &q, &err), KVS_OK);
    assert_int_equal(q.max_tokens, 44);
    kvs__api_req_fini(&q);
    /* Without max_tokens and without a server default: the rest of the context. */
    l.default_max_tokens = 0;
    body = "{\"prompt\":\"abc\"}";
    assert_int_equal(kvs__api_parse(&l, &tok, 0, body, strlen(body), &q, &err), KVS_OK);
    assert_int_equal(q.max_tokens, 61);
    kvs__api_req_fini(&q);
    kvs_assert_no_leaks();
}

static void test_parse_alloc_failures(void **state)
{
    (void) state;
    kvs_server_tokenizer_t tok = kvs_server_byte_tokenizer();
    kvs__api_limits_t l = limits();
    const char *bodies[2] = {
        "{\"messages\":[{\"role\":\"system\",\"content\":\"s\"},{\"role\":\"user\",\"content\":"
        "[{\"type\":\"text\",\"text\":\"a\"},{\"type\":\"text\",\"text\":\"b\"}]}],"
        "\"stop\":[\"x\",\"yz\"],\"stop_token_ids\":[3],\"kvstage\":{\"room\":9,\"role\":"
        "\"decode\",\"bootstrap\":\"b\"}}",
        "{\"prompt\":\"hello\",\"stop\":\"l\",\"max_tokens\":3}",
    };
    kvs_log_capture_t cap = {.errors_only = 1};
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    for (int b = 0; b < 2; b++) {
        int chat = b == 0, ok = 0;
        /* jansson 2.14's parser does not survive a failed allocation while growing a token
         * buffer (lex_save ignores the failure and the string scan then runs past the buffer),
         * so failures are injected only after the body is parsed: into our own handling and
         * jansson's object access. */
        kvs_alloc_stats_t a0, a1;
        kvs_alloc_stats(&a0);
        json_t *probe = json_loadb(bodies[b], strlen(bodies[b]), 0, NULL);
        kvs_alloc_stats(&a1);
        assert_non_null(probe);
        json_decref(probe);
        uint64_t parse_allocs = a1.total_allocs - a0.total_allocs;
        for (uint64_t nth = parse_allocs + 1; nth < parse_allocs + 400 && !ok; nth++) {
            kvs__api_req_t q;
            kvs__api_err_t err;
            kvs_alloc_fail_at(nth);
            kvs_status_t st =
                kvs__api_parse(&l, &tok, chat, bodies[b], strlen(bodies[b]), &q, &err);
            kvs_alloc_fail_at(0);
            if (st == KVS_OK) {
                ok = 1;
                assert_true(q.prompt_len > 0);
                kvs__api_req_fini(&q);
            } else {
                if (st != KVS_ERR_NOMEM)
                    fail_msg("body %d, allocation %llu failed: %s (%d: %s)", b,
                             (unsigned long long) nth, kvs_status_str(st), err.status, err.message);
                assert_int_equal(err.status, 500);
                assert_string_equal(err.type, "server_error");
            }
            kvs_assert_no_leaks();
        }
        assert_true(ok);
    }
    kvs_log_set_sink(NULL, NULL);
}

static void test_histogram(void **state)
{
    (void) state;
    static const double bounds[] = {0.001, 0.01, 0.1};
    kvs__hist_t h;
    kvs__hist_init(&h, bounds, 3);
    kvs__hist_observe(&h, 500000);     /* 0.5 ms */
    kvs__hist_observe(&h, 1000000);    /* exactly 1 ms: le="0.001" */
    kvs__hist_observe(&h, 5000000);    /* 5 ms */
    kvs__hist_observe(&h, 2000000000); /* 2 s: +Inf only */
    kvs__sb_t sb;
    kvs__sb_init(&sb);
    kvs__hist_render(&sb, "x_seconds", "Test.", &h);
    kvs__metric_header(&sb, "y_total", "counter", "Another.");
    kvs__sb_puts(&sb, "y_total 1\n");
    expect_prometheus_min(sb.ptr, 5);
    assert_true(metric_value(sb.ptr, "x_seconds_bucket{le=\"0.001\"}") == 2);
    assert_true(metric_value(sb.ptr, "x_seconds_bucket{le=\"0.01\"}") == 3);
    assert_true(metric_value(sb.ptr, "x_seconds_bucket{le=\"0.1\"}") == 3);
    assert_true(expect_histogram(sb.ptr, "x_seconds") == 4);
    double sum = metric_value(sb.ptr, "x_seconds_sum");
    assert_true(sum > 2.0064 && sum < 2.0066);
    kvs__sb_fini(&sb);
    kvs_assert_no_leaks();
}

/* ---- the fake backend on its own ---- */

typedef struct {
    uint32_t tokens[64];
    uint32_t n;
    int done;
    kvs_server_done_t d;
} sink_state_t;

static void on_token(void *arg, uint32_t choice, uint32_t token, const char *piece, size_t len,
                     const kvs_logprobs_t *lp)
{
    (void) choice;
    (void) piece;
    (void) len;
    (void) lp;
    sink_state_t *s = arg;
    if (s->n < 64) s->tokens[s->n] = token;
    s->n++;
}

static void on_done(void *arg, const kvs_server_done_t *d)
{
    sink_state_t *s = arg;
    s->d = *d;
    __atomic_store_n(&s->done, 1, __ATOMIC_RELEASE);
}

static int sink_done(void *arg)
{
    sink_state_t *s = arg;
    return __atomic_load_n(&s->done, __ATOMIC_ACQUIRE);
}

static void test_fake_backend(void **state)
{
    (void) state;
    kvs_server_fake_t *fake;
    kvs_server_fake_config_t fc = {.kv_bytes_per_token = 100};
    assert_int_equal(kvs_server_fake_create(&fc, &fake), KVS_OK);
    kvs_server_backend_t b = kvs_server_fake_backend(fake);
    uint32_t prompt[] = {10, 20, 30};
    uint32_t stops[] = {99};
    kvs_server_request_t q = {.room = 1,
                              .prompt = prompt,
                              .prompt_len = 3,
                              .max_tokens = 7,
                              .stop_ids = stops,
                              .n_stop_ids = 1,
                              .n = 1};
    sink_state_t s1 = {0};
    kvs_server_sink_t sink = {on_token, on_done, &s1, NULL};
    assert_int_equal(b.submit(b.ctx, &q, &sink), KVS_OK);
    assert_true(wait_until(sink_done, &s1, 2000));
    assert_int_equal(s1.n, 7);
    for (uint32_t i = 0; i < 7; i++) assert_int_equal(s1.tokens[i], prompt[i % 3]);
    assert_int_equal(s1.d.finish, KVS_SERVER_FINISH_LENGTH);
    assert_int_equal(s1.d.generated, 7);
    assert_int_equal(s1.d.prompt_tokens, 3);
    assert_int_equal(s1.d.kv_bytes, 0); /* colocated: nothing moved */

    /* PREFILL: one token, HANDOFF, KV bytes for the uncached part; the cache answers match. */
    uint32_t cached = 0;
    uint32_t longer[] = {10, 20, 30, 40};
    assert_int_equal(b.match(b.ctx, longer, 4, &cached), KVS_OK);
    assert_int_equal(cached, 3);
    sink_state_t s2 = {0};
    sink.arg = &s2;
    q.room = 2;
    q.role = KVS_SERVER_ROLE_PREFILL;
    q.prompt = longer;
    q.prompt_len = 4;
    assert_int_equal(b.submit(b.ctx, &q, &sink), KVS_OK);
    assert_true(wait_until(sink_done, &s2, 2000));
    assert_int_equal(s2.n, 1);
    assert_int_equal(s2.d.finish, KVS_SERVER_FINISH_HANDOFF);
    assert_int_equal(s2.d.cached_tokens, 3);
    assert_int_equal(s2.d.kv_bytes, 100);
    kvs_server_backend_stats_t bs;
    b.stats(b.ctx, &bs);
    assert_int_equal(bs.metrics.bytes, 100);

    /* A stop id, a duplicate live room, cancel, and the records. */
    kvs_server_fake_config_t slow = {.token_delay_ns = 50000000};
    kvs_server_fake_t *f2;
    assert_int_equal(kvs_server_fake_create(&slow, &f2), KVS_OK);
    kvs_server_backend_t b2 = kvs_server_fake_backend(f2);
    uint32_t with_stop[] = {5, 99, 6};
    q.role = KVS_SERVER_ROLE_DECODE;
    q.bootstrap = "tcp://x:1";
    q.prompt = with_stop;
    q.prompt_len = 3;
    q.room = 3;
    sink_state_t s3 = {0};
    sink.arg = &s3;
    assert_int_equal(b2.submit(b2.ctx, &q, &sink), KVS_OK);
    kvs_log_capture_t cap = {0};
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    sink_state_t s4 = {0};
    kvs_server_sink_t sink4 = {on_token, on_done, &s4, NULL};
    assert_int_equal(b2.submit(b2.ctx, &q, &sink4), KVS_ERR_INVALID);
    kvs_log_set_sink(NULL, NULL);
    assert_true(cap.calls >= 1);
    assert_true(wait_until(sink_done, &s3, 2000));
    assert_int_equal(s3.n, 2);
    assert_int_equal(s3.d.finish, KVS_SERVER_FINISH_STOP);
    kvs_server_fake_record_t rec;
    assert_int_equal(kvs_server_fake_record(f2, 3, &rec), KVS_OK);
    assert_string_equal(rec.bootstrap, "tcp://x:1");
    assert_int_equal(rec.role, KVS_SERVER_ROLE_DECODE);
    assert_true(rec.done);
    assert_int_equal(kvs_server_fake_record(f2, 4, &rec), KVS_ERR_NOT_FOUND);

    q.room = 4;
    q.prompt = prompt;
    q.max_tokens = 60;
    sink_state_t s5 = {0};
    sink.arg = &s5;
    assert_int_equal(b2.submit(b2.ctx, &q, &sink), KVS_OK);
    assert_int_equal(b2.cancel(b2.ctx, 4, KVS_SERVER_CHOICE_ALL), KVS_OK);
    assert_int_equal(b2.cancel(b2.ctx, 12345, KVS_SERVER_CHOICE_ALL), KVS_ERR_NOT_FOUND);
    assert_true(wait_until(sink_done, &s5, 2000));
    assert_int_equal(s5.d.finish, KVS_SERVER_FINISH_STOP);
    assert_true(s5.n < 60);

    /* Destroying with a live request ends it with an error. */
    q.room = 5;
    sink_state_t s6 = {0};
    sink.arg = &s6;
    assert_int_equal(b2.submit(b2.ctx, &q, &sink), KVS_OK);
    kvs_server_fake_counts_t c;
    kvs_server_fake_counts(f2, &c);
    assert_int_equal(c.submitted, 3);
    assert_int_equal(c.cancelled, 1);
    kvs_server_fake_destroy(f2);
    assert_true(s6.done);
    assert_int_equal(s6.d.finish, KVS_SERVER_FINISH_ERROR);
    assert_int_equal(s6.d.status, KVS_ERR_ABORTED);
    assert_int_equal(b.health(b.ctx), KVS_OK);
    kvs_server_fake_set_healthy(fake, 0);
    assert_int_not_equal(b.health(b.ctx), KVS_OK);
    kvs_server_fake_destroy(fake);
    kvs_assert_no_leaks();
}

static void test_create_alloc_failures(void **state)
{
    (void) state;
    kvs_server_fake_t *fake;
    assert_int_equal(kvs_server_fake_create(NULL, &fake), KVS_OK);
    kvs_server_config_t c;
    memset(&c, 0, sizeof(c));
    c.backend = kvs_server_fake_backend(fake);
    c.tokenizer = kvs_server_byte_tokenizer();
    c.bootstrap = "tcp://b:1";
    int ok = 0;
    for (uint64_t nth = 1; nth < 20 && !ok; nth++) {
        kvs_server_t *srv = NULL;
        kvs_alloc_fail_at(nth);
        kvs_status_t st = kvs_server_create(&c, &srv);
        kvs_alloc_fail_at(0);
        if (st == KVS_OK) {
            ok = 1;
            kvs_server_destroy(srv);
        } else {
            assert_int_equal(st, KVS_ERR_NOMEM);
            assert_null(srv);
        }
    }
    assert_true(ok);
    kvs_server_fake_destroy(fake);
    kvs_assert_no_leaks();
}

int main(void)
{
    kvs__json_init();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_string_builder),       cmocka_unit_test(test_utf8_tail),
        cmocka_unit_test(test_utf8_sanitize),        cmocka_unit_test(test_stop_search),
        cmocka_unit_test(test_parse_defaults),       cmocka_unit_test(test_parse_context_length),
        cmocka_unit_test(test_parse_alloc_failures), cmocka_unit_test(test_histogram),
        cmocka_unit_test(test_fake_backend),         cmocka_unit_test(test_create_alloc_failures),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
