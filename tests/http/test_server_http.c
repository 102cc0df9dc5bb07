/* Tests for the HTTP server over the fake backend, through real HTTP on loopback: completions
 * and chat completions (plain and streamed, exact JSON fields, SSE framing), stop strings and
 * stop tokens, concurrent clients, a backend failing mid-stream, a client hanging up mid-stream,
 * every bad input with its status, health, metrics, the internal endpoints, the real tokenizer
 * behind the adapter, shutting down with requests in flight, unknown fields ignored (header,
 * warning) or refused (strict), GET /v1/models/{id}, the API key on every endpoint class, 1200
 * half-open connections, the connection limit and idle timeout, and bodies declared too large
 * or never completed. */
#include "server_test.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "kvstage/rng.h"
#include "http/server.h"

#define MODEL "test-model"

typedef struct {
    kvs_server_fake_t *fake;
    kvs_server_t *srv;
    uint16_t port;
} fixture_t;

/* What some tests change in the server's configuration. */
typedef struct {
    int strict;
    const char *api_key;
    const char *model; /* NULL: MODEL */
    uint32_t max_connections, idle_timeout_s;
} fixture_opts_t;

static void start_full(fixture_t *f, const kvs_server_fake_config_t *fc, uint32_t max_context,
                       size_t max_body, kvs_server_tokenizer_t tok, const fixture_opts_t *o)
{
    memset(f, 0, sizeof(*f));
    assert_int_equal(kvs_server_fake_create(fc, &f->fake), KVS_OK);
    kvs_server_config_t c;
    memset(&c, 0, sizeof(c));
    c.model = MODEL;
    c.max_context = max_context;
    c.max_body = max_body;
    c.threads = 4;
    c.role = KVS_SERVER_ROLE_PREFILL;
    c.bootstrap = "tcp://10.0.0.1:5555";
    c.backend = kvs_server_fake_backend(f->fake);
    c.tokenizer = tok;
    if (o != NULL) {
        c.strict = o->strict;
        c.api_key = o->api_key;
        if (o->model) c.model = o->model;
        c.max_connections = o->max_connections;
        c.idle_timeout_s = o->idle_timeout_s;
    }
    assert_int_equal(kvs_server_create(&c, &f->srv), KVS_OK);
    f->port = kvs_server_port(f->srv);
    assert_true(f->port > 0);
}

static void start_with(fixture_t *f, const kvs_server_fake_config_t *fc, uint32_t max_context,
                       size_t max_body, kvs_server_tokenizer_t tok)
{
    start_full(f, fc, max_context, max_body, tok, NULL);
}

static void start_opts(fixture_t *f, const kvs_server_fake_config_t *fc, const fixture_opts_t *o)
{
    start_full(f, fc, 256, 4096, kvs_server_byte_tokenizer(), o);
}

static void start(fixture_t *f, const kvs_server_fake_config_t *fc)
{
    start_with(f, fc, 256, 4096, kvs_server_byte_tokenizer());
}

static void stop(fixture_t *f)
{
    kvs_server_destroy(f->srv);
    kvs_server_fake_destroy(f->fake);
}

static uint64_t room_of(json_t *obj)
{
    const char *id = json_string_value(json_object_get(obj, "id"));
    assert_non_null(id);
    const char *dash = strrchr(id, '-');
    assert_non_null(dash);
    return strtoull(dash + 1, NULL, 16);
}

/* The text the fake generates for a prompt: the prompt echoed, cycling, n bytes. */
static void echo(const char *prompt, size_t n, char *out)
{
    size_t len = strlen(prompt);
    for (size_t i = 0; i < n; i++) out[i] = prompt[i % len];
    out[n] = '\0';
}

/* The value at a.b.c, with numeric parts for arrays; NULL when there is none. */
static json_t *json_at(json_t *obj, const char *path)
{
    char buf[128];
    snprintf(buf, sizeof(buf), "%s", path);
    json_t *cur = obj;
    char *save = NULL;
    for (char *tok = strtok_r(buf, ".", &save); tok && cur; tok = strtok_r(NULL, ".", &save)) {
        if (json_is_array(cur))
            cur = json_array_get(cur, (size_t) atoi(tok));
        else
            cur = json_object_get(cur, tok);
    }
    return cur;
}

static const char *str_at(json_t *obj, const char *path)
{
    return json_string_value(json_at(obj, path));
}

static json_int_t int_at(json_t *obj, const char *path)
{
    json_t *v = json_at(obj, path);
    if (!json_is_integer(v)) fail_msg("%s is not an integer", path);
    return json_integer_value(v);
}

/* Calls path (a POST with a body, a GET without), requires a 200 and returns the parsed answer (r
 * still owns the body). */
static json_t *call_ok(uint16_t port, const char *path, const char *body, http_resp_t *r)
{
    http_call(port, NULL, path, body, r);
    assert_int_equal(r->status, 200);
    return http_json(r);
}

/* Concatenates the string at path of SSE events [0, n) into text. */
static void sse_concat(char **ev, size_t n, const char *path, char *text)
{
    text[0] = '\0';
    for (size_t i = 0; i < n; i++) {
        json_t *c = json_loads(ev[i], 0, NULL);
        assert_non_null(c);
        strcat(text, str_at(c, path));
        json_decref(c);
    }
}

static void test_completion(void **state)
{
    (void) state;
    fixture_t f;
    start(&f, NULL);
    http_resp_t r = {0};
    http_call(f.port, NULL, "/v1/completions",
              "{\"model\":\"" MODEL "\",\"prompt\":\"hello\",\"max_tokens\":8}", &r);
    assert_int_equal(r.status, 200);
    assert_string_equal(r.ctype, "application/json");
    json_t *j = http_json(&r);
    assert_int_equal(json_object_size(j), 7); /* id object created model choices usage kvstage */
    assert_true(strncmp(str_at(j, "id"), "cmpl-", 5) == 0);
    assert_string_equal(str_at(j, "object"), "text_completion");
    assert_true(int_at(j, "created") > 1600000000);
    assert_string_equal(str_at(j, "model"), MODEL);
    json_t *choices = json_object_get(j, "choices");
    assert_int_equal(json_array_size(choices), 1);
    json_t *c0 = json_array_get(choices, 0);
    assert_int_equal(json_object_size(c0), 4);
    assert_int_equal(int_at(c0, "index"), 0);
    assert_string_equal(str_at(c0, "text"), "hellohel");
    assert_true(json_is_null(json_object_get(c0, "logprobs")));
    assert_string_equal(str_at(c0, "finish_reason"), "length");
    assert_int_equal(int_at(j, "usage.prompt_tokens"), 5);
    assert_int_equal(int_at(j, "usage.completion_tokens"), 8);
    assert_int_equal(int_at(j, "usage.total_tokens"), 13);
    assert_int_equal(int_at(j, "usage.prompt_tokens_details.cached_tokens"), 0);
    uint64_t room = room_of(j);
    assert_int_equal(int_at(j, "kvstage.room"), (json_int_t) room);
    assert_true(room >= (UINT64_C(1) << 62));
    kvs_server_fake_record_t rec;
    assert_int_equal(kvs_server_fake_record(f.fake, room, &rec), KVS_OK);
    assert_int_equal(rec.role, KVS_SERVER_ROLE_NONE);
    assert_int_equal(rec.prompt_len, 5);
    assert_int_equal(rec.max_tokens, 8);
    assert_int_equal(rec.generated, 8);
    json_decref(j);
    http_resp_fini(&r);

    /* The same prompt again: the fake's prefix cache has it; max_tokens defaults to the rest of
     * the context (256 - 5). Token-id prompts are accepted. */
    j = call_ok(f.port, "/v1/completions", "{\"prompt\":[104,101,108,108,111]}", &r);
    assert_int_equal(int_at(j, "usage.completion_tokens"), 251);
    assert_int_equal(int_at(j, "usage.prompt_tokens_details.cached_tokens"), 5);
    assert_int_equal(strlen(str_at(j, "choices.0.text")), 251);
    json_decref(j);
    http_resp_fini(&r);
    stop(&f);
    kvs_assert_no_leaks();
}

static void test_chat(void **state)
{
    (void) state;
    fixture_t f;
    start(&f, NULL);
    http_resp_t r = {0};
    json_t *j = call_ok(f.port, "/v1/chat/completions",
                        "{\"messages\":[{\"role\":\"system\",\"content\":\"be brief\"},"
                        "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"h\"},"
                        "{\"type\":\"text\",\"text\":\"i\"}]}],\"max_tokens\":12,\"temperature\":0,"
                        "\"seed\":7,\"user\":\"u1\",\"n\":1}",
                        &r);
    assert_true(strncmp(str_at(j, "id"), "chatcmpl-", 9) == 0);
    assert_string_equal(str_at(j, "object"), "chat.completion");
    json_t *c0 = json_array_get(json_object_get(j, "choices"), 0);
    assert_int_equal(json_object_size(c0), 4);
    json_t *msg = json_object_get(c0, "message");
    assert_int_equal(json_object_size(msg), 2);
    assert_string_equal(str_at(msg, "role"), "assistant");
    /* The byte tokenizer renders "system: be brief\nuser: hi\nassistant: "; the echo. */
    assert_string_equal(str_at(msg, "content"), "system: be b");
    assert_string_equal(str_at(c0, "finish_reason"), "length");
    const char *rendered = "system: be brief\nuser: hi\nassistant: ";
    assert_int_equal(int_at(j, "usage.prompt_tokens"), (json_int_t) strlen(rendered));
    json_decref(j);
    http_resp_fini(&r);

    /* max_completion_tokens is the newer name. */
    j = call_ok(
        f.port, "/v1/chat/completions",
        "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_completion_tokens\":3}", &r);
    assert_string_equal(str_at(j, "choices.0.message.content"), "use");
    json_decref(j);
    http_resp_fini(&r);
    stop(&f);
    kvs_assert_no_leaks();
}

static void test_stream_completion(void **state)
{
    (void) state;
    kvs_server_fake_config_t fc = {.token_delay_ns = 1000000};
    fixture_t f;
    start(&f, &fc);
    http_resp_t r = {0};
    http_call(f.port, NULL, "/v1/completions",
              "{\"prompt\":\"abcdef\",\"max_tokens\":10,\"stream\":true,"
              "\"stream_options\":{\"include_usage\":true}}",
              &r);
    assert_int_equal(r.status, 200);
    assert_string_equal(r.ctype, "text/event-stream");
    char *ev[64];
    size_t n = sse_split(&r.body, ev, 64);
    assert_true(n >= 4); /* text chunk(s), final chunk, usage, [DONE] */
    char text[64] = "";
    for (size_t i = 0; i + 3 < n; i++) {
        json_t *j = json_loads(ev[i], 0, NULL);
        assert_non_null(j);
        assert_string_equal(str_at(j, "object"), "text_completion");
        assert_true(json_is_null(
            json_object_get(json_array_get(json_object_get(j, "choices"), 0), "finish_reason")));
        strcat(text, str_at(j, "choices.0.text"));
        json_decref(j);
    }
    assert_string_equal(text, "abcdefabcd");
    json_t *last = json_loads(ev[n - 3], 0, NULL);
    assert_string_equal(str_at(last, "choices.0.finish_reason"), "length");
    assert_string_equal(str_at(last, "choices.0.text"), "");
    json_decref(last);
    json_t *usage = json_loads(ev[n - 2], 0, NULL);
    assert_int_equal(json_array_size(json_object_get(usage, "choices")), 0);
    assert_int_equal(int_at(usage, "usage.prompt_tokens"), 6);
    assert_int_equal(int_at(usage, "usage.completion_tokens"), 10);
    assert_int_equal(int_at(usage, "usage.total_tokens"), 16);
    assert_true(int_at(usage, "kvstage.ttft_ns") > 0);
    json_decref(usage);
    http_resp_fini(&r);
    stop(&f);
    kvs_assert_no_leaks();
}

static void test_stream_chat(void **state)
{
    (void) state;
    fixture_t f;
    start(&f, NULL);
    http_resp_t r = {0};
    http_call(f.port, NULL, "/v1/chat/completions",
              "{\"messages\":[{\"role\":\"user\",\"content\":\"yo\"}],\"max_tokens\":6,"
              "\"stream\":true}",
              &r);
    assert_int_equal(r.status, 200);
    char *ev[64];
    size_t n = sse_split(&r.body, ev, 64);
    assert_true(n >= 4); /* role, content, final, [DONE] */
    json_t *first = json_loads(ev[0], 0, NULL);
    assert_string_equal(str_at(first, "object"), "chat.completion.chunk");
    assert_string_equal(str_at(first, "choices.0.delta.role"), "assistant");
    assert_string_equal(str_at(first, "choices.0.delta.content"), "");
    json_decref(first);
    char text[64] = "";
    for (size_t i = 1; i + 2 < n; i++) {
        json_t *j = json_loads(ev[i], 0, NULL);
        assert_non_null(j);
        assert_null(json_object_get(
            json_object_get(json_array_get(json_object_get(j, "choices"), 0), "delta"), "role"));
        strcat(text, str_at(j, "choices.0.delta.content"));
        json_decref(j);
    }
    assert_string_equal(text, "user: ");
    json_t *last = json_loads(ev[n - 2], 0, NULL);
    assert_string_equal(str_at(last, "choices.0.finish_reason"), "length");
    json_t *delta = json_object_get(json_array_get(json_object_get(last, "choices"), 0), "delta");
    assert_true(json_is_object(delta));
    assert_int_equal(json_object_size(delta), 0);
    json_decref(last);
    http_resp_fini(&r);
    stop(&f);
    kvs_assert_no_leaks();
}

static int fake_idle(void *arg)
{
    kvs_server_fake_counts_t c;
    kvs_server_fake_counts(arg, &c);
    return c.live == 0;
}

static void test_stop_strings(void **state)
{
    (void) state;
    kvs_server_fake_config_t fc = {.token_delay_ns = 200000};
    fixture_t f;
    start(&f, &fc);
    http_resp_t r = {0};
    /* Non-streaming: cut before the match, generation cancelled at the backend. */
    json_t *j = call_ok(f.port, "/v1/completions",
                        "{\"prompt\":\"hello world\",\"max_tokens\":200,\"stop\":\"wor\"}", &r);
    assert_string_equal(str_at(j, "choices.0.text"), "hello ");
    assert_string_equal(str_at(j, "choices.0.finish_reason"), "stop");
    assert_int_equal(int_at(j, "usage.completion_tokens"), 9); /* "hello wor" */
    kvs_server_fake_record_t rec;
    assert_true(wait_until(fake_idle, f.fake, 2000));
    assert_int_equal(kvs_server_fake_record(f.fake, room_of(j), &rec), KVS_OK);
    assert_true(rec.cancelled);
    assert_true(rec.generated < 200);
    json_decref(j);
    http_resp_fini(&r);

    /* Several stop strings: the earliest match wins. */
    j = call_ok(f.port, "/v1/completions",
                "{\"prompt\":\"hello world\",\"max_tokens\":200,\"stop\":[\"zz\",\"lo w\",\"d\"]}",
                &r);
    assert_string_equal(str_at(j, "choices.0.text"), "hel");
    json_decref(j);
    http_resp_fini(&r);

    /* Streaming: the held-back text of a partial match is never sent. */
    http_call(f.port, NULL, "/v1/completions",
              "{\"prompt\":\"abcabd\",\"max_tokens\":200,\"stop\":[\"abd\"],\"stream\":true}", &r);
    assert_int_equal(r.status, 200);
    char *ev[64];
    size_t n = sse_split(&r.body, ev, 64);
    char text[64];
    assert_true(n >= 2);
    sse_concat(ev, n - 2, "choices.0.text", text);
    assert_string_equal(text, "abc");
    json_t *last = json_loads(ev[n - 2], 0, NULL);
    assert_string_equal(str_at(last, "choices.0.finish_reason"), "stop");
    json_decref(last);
    http_resp_fini(&r);

    /* A stop string spanning tokens and a chat request. */
    j = call_ok(f.port, "/v1/chat/completions",
                "{\"messages\":[{\"role\":\"user\",\"content\":\"q\"}],\"stop\":\"r: \"}", &r);
    assert_string_equal(str_at(j, "choices.0.message.content"), "use");
    json_decref(j);
    http_resp_fini(&r);

    /* Stop tokens: the EOS (256 for the byte tokenizer) and stop_token_ids, not rendered. */
    j = call_ok(f.port, "/v1/completions", "{\"prompt\":[104,105,256,33],\"max_tokens\":50}", &r);
    assert_string_equal(str_at(j, "choices.0.text"), "hi");
    assert_string_equal(str_at(j, "choices.0.finish_reason"), "stop");
    assert_int_equal(int_at(j, "usage.completion_tokens"), 3);
    json_decref(j);
    http_resp_fini(&r);
    j = call_ok(f.port, "/v1/completions",
                "{\"prompt\":\"hey\",\"max_tokens\":50,\"stop_token_ids\":[121]}", &r);
    assert_string_equal(str_at(j, "choices.0.text"), "he");
    assert_string_equal(str_at(j, "choices.0.finish_reason"), "stop");
    json_decref(j);
    http_resp_fini(&r);
    stop(&f);
    kvs_assert_no_leaks();
}

/* The text the fake and the server should produce for a prompt, max_tokens and stop strings:
 * the echo, cut before the first stop string, as valid UTF-8. */
static void expected_text(const char *prompt, size_t max_tokens, char **stops, size_t n_stops,
                          kvs__sb_t *out, int *stopped_p)
{
    char gen[64];
    size_t plen = strlen(prompt);
    for (size_t i = 0; i < max_tokens; i++) gen[i] = prompt[i % plen];
    size_t cut = max_tokens;
    for (size_t k = 0; k < n_stops; k++) {
        const char *hit = NULL;
        for (size_t i = 0; i + strlen(stops[k]) <= max_tokens && !hit; i++)
            if (memcmp(gen + i, stops[k], strlen(stops[k])) == 0) hit = gen + i;
        if (hit && (size_t) (hit - gen) < cut) cut = (size_t) (hit - gen);
    }
    *stopped_p = cut < max_tokens;
    kvs__utf8_sanitize(out, gen, cut);
    kvs__sb_append(out, "", 0);
}

static void test_stream_property(void **state)
{
    (void) state;
    static const char *const pieces[] = {
        "a", "b", " ", "\xC3\xA9", "\xE2\x82\xAC", "\xF0\x9F\x98\x80"};
    uint64_t seed = kvs_test_seed(2024);
    kvs_rng_t rng;
    kvs_rng_seed(&rng, seed);
    fixture_t f;
    start(&f, NULL);
    for (uint64_t it = 0; it < kvs_test_iters(40); it++) {
        char prompt[64] = "", stop_buf[3][32];
        char *stops[3];
        size_t np = 1 + kvs_rng_below(&rng, 6);
        for (size_t i = 0; i < np; i++) strcat(prompt, pieces[kvs_rng_below(&rng, 6)]);
        size_t max_tokens = 1 + kvs_rng_below(&rng, 40);
        size_t n_stops = kvs_rng_below(&rng, 4);
        json_t *stop_arr = json_array();
        for (size_t k = 0; k < n_stops; k++) {
            stop_buf[k][0] = '\0';
            size_t ns = 1 + kvs_rng_below(&rng, 3);
            for (size_t i = 0; i < ns; i++) strcat(stop_buf[k], pieces[kvs_rng_below(&rng, 6)]);
            stops[k] = stop_buf[k];
            json_array_append_new(stop_arr, json_string(stops[k]));
        }
        kvs__sb_t want;
        kvs__sb_init(&want);
        int stopped;
        expected_text(prompt, max_tokens, stops, n_stops, &want, &stopped);
        for (int stream = 0; stream < 2; stream++) {
            json_t *req = json_pack("{s:s, s:i, s:O, s:b}", "prompt", prompt, "max_tokens",
                                    (int) max_tokens, "stop", stop_arr, "stream", stream);
            char *body = json_dumps(req, JSON_COMPACT);
            json_decref(req);
            http_resp_t r = {0};
            http_call(f.port, NULL, "/v1/completions", body, &r);
            kvs_free(body);
            if (r.status != 200)
                fail_msg("seed %llu iteration %llu: status %ld", (unsigned long long) seed,
                         (unsigned long long) it, r.status);
            kvs__sb_t got;
            kvs__sb_init(&got);
            const char *finish = NULL;
            json_t *last = NULL;
            if (stream) {
                char *ev[128];
                size_t n = sse_split(&r.body, ev, 128);
                for (size_t i = 0; i + 1 < n; i++) {
                    json_t *c = json_loads(ev[i], 0, NULL);
                    assert_non_null(c);
                    kvs__sb_puts(&got, str_at(c, "choices.0.text"));
                    json_decref(last);
                    last = c;
                }
            } else {
                last = http_json(&r);
                kvs__sb_puts(&got, str_at(last, "choices.0.text"));
            }
            kvs__sb_append(&got, "", 0);
            finish = str_at(last, "choices.0.finish_reason");
            if (strcmp(got.ptr, want.ptr) != 0 || strcmp(finish, stopped ? "stop" : "length") != 0)
                fail_msg("seed %llu iteration %llu (%s): '%s' %s, expected '%s' %s",
                         (unsigned long long) seed, (unsigned long long) it,
                         stream ? "stream" : "plain", got.ptr, finish, want.ptr,
                         stopped ? "stop" : "length");
            json_decref(last);
            kvs__sb_fini(&got);
            http_resp_fini(&r);
        }
        json_decref(stop_arr);
        kvs__sb_fini(&want);
    }
    stop(&f);
    kvs_assert_no_leaks();
}

typedef struct {
    uint16_t port;
    int index;
    char error[256]; /* "" when every answer was right */
} client_arg_t;

/* The text of a streamed answer, without cmocka asserts (this runs on client threads):
 * returns 0 on a framing or JSON problem. */
static int stream_text(kvs__sb_t *body, char *text, size_t cap)
{
    text[0] = '\0';
    char *p = body->ptr;
    char *end = body->ptr + body->len;
    int done = 0;
    while (p < end) {
        char *sep = strstr(p, "\n\n");
        if (strncmp(p, "data: ", 6) != 0 || sep == NULL || done) return 0;
        *sep = '\0';
        if (strcmp(p + 6, "[DONE]") == 0) {
            done = 1;
        } else {
            json_t *c = json_loads(p + 6, 0, NULL);
            const char *t = c ? str_at(c, "choices.0.text") : NULL;
            if (t == NULL || strlen(text) + strlen(t) >= cap) {
                json_decref(c);
                return 0;
            }
            strcat(text, t);
            json_decref(c);
        }
        p = sep + 2;
    }
    return done;
}

static void *client_thread(void *p)
{
    client_arg_t *a = p;
    a->error[0] = '\0';
    for (int k = 0; k < 5 && a->error[0] == '\0'; k++) {
        char prompt[32], body[160], want[64], text[64] = "";
        snprintf(prompt, sizeof(prompt), "t%dr%d-", a->index, k);
        int stream = (a->index + k) % 2;
        snprintf(body, sizeof(body), "{\"prompt\":\"%s\",\"max_tokens\":20,\"stream\":%s}", prompt,
                 stream ? "true" : "false");
        echo(prompt, 20, want);
        http_resp_t r = {0};
        http_call(a->port, NULL, "/v1/completions", body, &r);
        if (r.status != 200) {
            snprintf(a->error, sizeof(a->error), "request %d: status %ld (curl %d)", k, r.status,
                     (int) r.result);
        } else if (stream) {
            if (!stream_text(&r.body, text, sizeof(text)))
                snprintf(a->error, sizeof(a->error), "request %d: bad stream", k);
        } else {
            json_t *j = json_loadb(r.body.ptr, r.body.len, 0, NULL);
            const char *t = j ? str_at(j, "choices.0.text") : NULL;
            snprintf(text, sizeof(text), "%s", t ? t : "(none)");
            json_decref(j);
        }
        if (a->error[0] == '\0' && strcmp(text, want) != 0)
            snprintf(a->error, sizeof(a->error), "request %d: '%s', expected '%s'", k, text, want);
        http_resp_fini(&r);
    }
    return NULL;
}

static void test_concurrent_clients(void **state)
{
    (void) state;
    kvs_server_fake_config_t fc = {.token_delay_ns = 200000};
    fixture_t f;
    start(&f, &fc);
    pthread_t th[8];
    client_arg_t args[8];
    for (int i = 0; i < 8; i++) {
        args[i] = (client_arg_t){f.port, i, ""};
        assert_int_equal(pthread_create(&th[i], NULL, client_thread, &args[i]), 0);
    }
    for (int i = 0; i < 8; i++) {
        pthread_join(th[i], NULL);
        if (args[i].error[0]) fail_msg("client %d: %s", i, args[i].error);
    }
    kvs_server_fake_counts_t c;
    kvs_server_fake_counts(f.fake, &c);
    assert_int_equal(c.submitted, 40);
    assert_int_equal(c.completed, 40);
    assert_int_equal(c.live, 0);
    stop(&f);
    kvs_assert_no_leaks();
}

static void test_backend_failure(void **state)
{
    (void) state;
    kvs_server_fake_config_t fc = {.fail_at = 3};
    fixture_t f;
    start(&f, &fc);
    http_resp_t r = {0};
    http_call(f.port, NULL, "/v1/completions",
              "{\"prompt\":\"xyz\",\"max_tokens\":10,\"stream\":true}", &r);
    assert_int_equal(r.status, 200);
    /* The tokens before the failure, then the error event alone: no chunk with a finish
     * reason, no [DONE]. */
    char *ev[64];
    size_t n = sse_expect_failed(
        &r.body, ev, 64, "generation failed: i/o error (the fake fails every request at token 3)");
    assert_true(n >= 2);
    char text[64];
    sse_concat(ev, n - 1, "choices.0.text", text);
    assert_string_equal(text, "xy");
    for (size_t i = 0; i + 1 < n; i++) {
        json_t *c = json_loads(ev[i], 0, NULL);
        assert_true(json_is_null(json_at(c, "choices.0.finish_reason")));
        json_decref(c);
    }
    http_resp_fini(&r);
    /* Chat likewise, and with usage asked for: no usage chunk either. */
    http_call(f.port, NULL, "/v1/chat/completions",
              "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_tokens\":10,"
              "\"stream\":true,\"stream_options\":{\"include_usage\":true}}",
              &r);
    assert_int_equal(r.status, 200);
    n = sse_expect_failed(&r.body, ev, 64, "generation failed");
    for (size_t i = 0; i + 1 < n; i++) {
        json_t *c = json_loads(ev[i], 0, NULL);
        assert_null(json_object_get(c, "usage"));
        assert_true(json_is_null(json_at(c, "choices.0.finish_reason")));
        json_decref(c);
    }
    http_resp_fini(&r);

    http_call(f.port, NULL, "/v1/chat/completions",
              "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_tokens\":10}", &r);
    expect_error_json(&r, 500, "server_error", NULL);
    http_resp_fini(&r);

    /* The server keeps serving. */
    kvs_server_fake_set_fail_at(f.fake, 0);
    json_t *j0 = call_ok(f.port, "/v1/completions", "{\"prompt\":\"xyz\",\"max_tokens\":4}", &r);
    assert_string_equal(str_at(j0, "choices.0.text"), "xyzx");
    json_decref(j0);
    http_resp_fini(&r);
    kvs_server_fake_counts_t c;
    kvs_server_fake_counts(f.fake, &c);
    assert_int_equal(c.failed, 3);
    stop(&f);

    /* A request the engine finds too large for its whole pool is the client's to shrink: 400,
     * not a server error. */
    fc = (kvs_server_fake_config_t){.fail_at = 1, .fail_status = KVS_ERR_NOSPACE};
    start(&f, &fc);
    http_call(f.port, NULL, "/v1/completions", "{\"prompt\":\"xyz\",\"max_tokens\":4,\"n\":3}", &r);
    expect_error_json(&r, 400, "invalid_request_error", NULL);
    if (strstr(r.body.ptr, "whole pool") == NULL) fail_msg("no reason given: %s", r.body.ptr);
    http_resp_fini(&r);
    kvs_server_fake_set_fail_at(f.fake, 0);
    json_t *j = call_ok(f.port, "/v1/completions", "{\"prompt\":\"xyz\",\"max_tokens\":4}", &r);
    assert_string_equal(str_at(j, "choices.0.text"), "xyzx");
    json_decref(j);
    http_resp_fini(&r);
    kvs_server_fake_counts(f.fake, &c);
    assert_int_equal(c.failed, 1);
    stop(&f);
    kvs_assert_no_leaks();
}

typedef struct {
    kvs_server_fake_t *fake;
    uint64_t room;
} room_arg_t;

static int room_cancelled(void *p)
{
    room_arg_t *a = p;
    kvs_server_fake_record_t rec;
    return kvs_server_fake_record(a->fake, a->room, &rec) == KVS_OK && rec.cancelled && rec.done;
}

static int fake_cancelled_one(void *p)
{
    kvs_server_fake_counts_t c;
    kvs_server_fake_counts(p, &c);
    return c.cancelled == 1 && c.live == 0;
}

static void test_client_disconnect(void **state)
{
    (void) state;
    kvs_server_fake_config_t fc = {.token_delay_ns = 2000000};
    fixture_t f;
    start(&f, &fc);
    http_resp_t r = {.hang_up_after = 300};
    http_call(f.port, NULL, "/v1/completions",
              "{\"prompt\":\"abcdefgh\",\"max_tokens\":240,\"stream\":true}", &r);
    assert_int_equal(r.result, CURLE_WRITE_ERROR);
    assert_int_equal(r.status, 200);
    const char *id = strstr(r.body.ptr, "\"cmpl-");
    assert_non_null(id);
    room_arg_t a = {f.fake, strtoull(id + 6, NULL, 16)};
    http_resp_fini(&r);
    assert_true(wait_until(room_cancelled, &a, 3000));
    kvs_server_fake_record_t rec;
    assert_int_equal(kvs_server_fake_record(f.fake, a.room, &rec), KVS_OK);
    assert_true(rec.generated < 240);
    assert_int_equal(rec.finish, KVS_SERVER_FINISH_STOP);

    /* And a non-streaming request still works afterwards. */
    http_call(f.port, NULL, "/v1/completions", "{\"prompt\":\"ab\",\"max_tokens\":3}", &r);
    assert_int_equal(r.status, 200);
    http_resp_fini(&r);
    stop(&f);

    /* A non-streaming client that gives up: its connection waits suspended, which the HTTP
     * library does not watch, yet its room is cancelled within a poke (0.5 s), not after the
     * 240 tokens (about 5 s). */
    kvs_server_fake_config_t slow = {.token_delay_ns = 20000000};
    start(&f, &slow);
    http_resp_t gone = {.timeout_ms = 300};
    uint64_t t0 = kvs_now_ns();
    http_call(f.port, NULL, "/v1/completions", "{\"prompt\":\"abcdefgh\",\"max_tokens\":240}",
              &gone);
    assert_int_equal(gone.result, CURLE_OPERATION_TIMEDOUT);
    http_resp_fini(&gone);
    assert_true(wait_until(fake_cancelled_one, f.fake, 2500));
    assert_true(kvs_now_ns() - t0 < 3000000000ull);
    stop(&f);
    kvs_assert_no_leaks();
}

typedef struct {
    const char *method;
    const char *path;
    const char *body;
    long status;
    const char *param;
} bad_case_t;

/* Every refusal, against a strict server (unknown fields refused); test_unknown_fields has the
 * lenient counterparts. */
/* n > 1: the choices in order, each its own text (the fake's choice c starts c tokens into the
 * prompt), finish_reason and logprobs; stop strings cut each choice alone; streamed, every chunk
 * names its choice; usage counts the prompt once and every choice's tokens; one failing choice
 * fails the request. */
static void test_choices(void **state)
{
    (void) state;
    kvs_server_fake_config_t fc = {.token_delay_ns = 200000};
    fixture_t f;
    start(&f, &fc);
    http_resp_t r = {0};
    json_t *j = call_ok(f.port, "/v1/completions",
                        "{\"prompt\":\"abc\",\"max_tokens\":4,\"n\":3,\"best_of\":3}", &r);
    assert_int_equal(json_array_size(json_object_get(j, "choices")), 3);
    static const char *want[] = {"abca", "bcab", "cabc"};
    for (int i = 0; i < 3; i++) {
        char path[64];
        snprintf(path, sizeof(path), "choices.%d.index", i);
        assert_int_equal(int_at(j, path), i);
        snprintf(path, sizeof(path), "choices.%d.text", i);
        assert_string_equal(str_at(j, path), want[i]);
        snprintf(path, sizeof(path), "choices.%d.finish_reason", i);
        assert_string_equal(str_at(j, path), "length");
    }
    assert_int_equal(int_at(j, "usage.prompt_tokens"), 3);
    assert_int_equal(int_at(j, "usage.completion_tokens"), 12);
    assert_int_equal(int_at(j, "usage.total_tokens"), 15);
    kvs_server_fake_record_t rec;
    assert_int_equal(kvs_server_fake_record(f.fake, room_of(j), &rec), KVS_OK);
    assert_int_equal(rec.n, 3);
    json_decref(j);
    http_resp_fini(&r);

    /* A stop string cuts each choice where it matches in it; the others go on. */
    j = call_ok(f.port, "/v1/completions",
                "{\"prompt\":\"abcd\",\"max_tokens\":200,\"n\":3,\"stop\":\"c\"}", &r);
    assert_string_equal(str_at(j, "choices.0.text"), "ab");
    assert_string_equal(str_at(j, "choices.1.text"), "b");
    assert_string_equal(str_at(j, "choices.2.text"), "");
    for (int i = 0; i < 3; i++) {
        char path[64];
        snprintf(path, sizeof(path), "choices.%d.finish_reason", i);
        assert_string_equal(str_at(j, path), "stop");
    }
    assert_int_equal(int_at(j, "usage.completion_tokens"), 3 + 2 + 1);
    assert_true(wait_until(fake_idle, f.fake, 2000));
    json_decref(j);
    http_resp_fini(&r);
    /* One choice stops, the other runs to its length. */
    j = call_ok(f.port, "/v1/completions",
                "{\"prompt\":\"abcd\",\"max_tokens\":3,\"n\":2,\"stop\":\"d\"}", &r);
    assert_string_equal(str_at(j, "choices.0.text"), "abc");
    assert_string_equal(str_at(j, "choices.0.finish_reason"), "length");
    assert_string_equal(str_at(j, "choices.1.text"), "bc");
    assert_string_equal(str_at(j, "choices.1.finish_reason"), "stop");
    json_decref(j);
    http_resp_fini(&r);

    /* Logprobs with echo: each choice starts with the prompt's entries. */
    j = call_ok(f.port, "/v1/completions",
                "{\"prompt\":\"ab\",\"max_tokens\":2,\"n\":2,\"echo\":true,\"logprobs\":1}", &r);
    for (int i = 0; i < 2; i++) {
        char path[64];
        snprintf(path, sizeof(path), "choices.%d.logprobs.tokens", i);
        json_t *toks = json_at(j, path);
        assert_int_equal(json_array_size(toks), 4);
        assert_string_equal(json_string_value(json_array_get(toks, 0)), "a");
        assert_string_equal(json_string_value(json_array_get(toks, 2)), i == 0 ? "a" : "b");
        snprintf(path, sizeof(path), "choices.%d.text", i);
        assert_string_equal(str_at(j, path), i == 0 ? "abab" : "abba");
    }
    json_decref(j);
    http_resp_fini(&r);

    /* Streamed chat: a role chunk per choice, every chunk one choice with its index, a last
     * chunk per choice, the usage of all. */
    http_call(f.port, NULL, "/v1/chat/completions",
              "{\"messages\":[{\"role\":\"user\",\"content\":\"yo\"}],\"max_tokens\":6,\"n\":2,"
              "\"stream\":true,\"stream_options\":{\"include_usage\":true}}",
              &r);
    assert_int_equal(r.status, 200);
    char *ev[128];
    size_t n = sse_split(&r.body, ev, 128);
    char text[2][64] = {"", ""};
    int roles[2] = {0, 0}, finals[2] = {0, 0};
    for (size_t i = 0; i + 2 < n; i++) {
        json_t *c = json_loads(ev[i], 0, NULL);
        assert_non_null(c);
        assert_int_equal(json_array_size(json_object_get(c, "choices")), 1);
        json_int_t k = int_at(c, "choices.0.index");
        assert_true(k == 0 || k == 1);
        if (str_at(c, "choices.0.delta.role") != NULL) roles[k]++;
        const char *t = str_at(c, "choices.0.delta.content");
        if (t != NULL) strcat(text[k], t);
        if (str_at(c, "choices.0.finish_reason") != NULL) {
            assert_string_equal(str_at(c, "choices.0.finish_reason"), "length");
            finals[k]++;
        }
        json_decref(c);
    }
    assert_string_equal(text[0], "user: ");
    assert_string_equal(text[1], "ser: y");
    assert_true(roles[0] == 1 && roles[1] == 1 && finals[0] == 1 && finals[1] == 1);
    json_t *usage = json_loads(ev[n - 2], 0, NULL);
    assert_int_equal(int_at(usage, "usage.completion_tokens"), 12);
    json_decref(usage);
    http_resp_fini(&r);
    stop(&f);

    /* A failing choice fails the request: 500, and a stream ends with an error event. */
    kvs_server_fake_config_t failing = {.fail_at = 3};
    start(&f, &failing);
    http_call(f.port, NULL, "/v1/completions", "{\"prompt\":\"abc\",\"max_tokens\":8,\"n\":2}", &r);
    expect_error_json(&r, 500, "server_error", NULL);
    http_resp_fini(&r);
    http_call(f.port, NULL, "/v1/completions",
              "{\"prompt\":\"abc\",\"max_tokens\":8,\"n\":2,\"stream\":true}", &r);
    assert_int_equal(r.status, 200);
    n = sse_expect_failed(&r.body, ev, 128, "generation failed");
    http_resp_fini(&r);
    stop(&f);
    kvs_assert_no_leaks();
}

static void test_bad_inputs(void **state)
{
    (void) state;
    fixture_t f;
    const fixture_opts_t strict = {.strict = 1};
    start_opts(&f, NULL, &strict);
    char long_prompt[400];
    memset(long_prompt, 'a', 300);
    long_prompt[300] = '\0';
    char too_long[420];
    snprintf(too_long, sizeof(too_long), "{\"prompt\":\"%s\"}", long_prompt);
    static char huge[10000];
    memset(huge, ' ', sizeof(huge) - 1);
    huge[0] = '{';
    huge[sizeof(huge) - 2] = '}';
    huge[sizeof(huge) - 1] = '\0';
    const bad_case_t cases[] = {
        {NULL, "/v1/completions", "{", 400, NULL},
        {NULL, "/v1/completions", "", 400, NULL},
        {NULL, "/v1/completions", "[1,2]", 400, NULL},
        {NULL, "/v1/completions", "{\"prompt\":\"x\",\"foo\":1}", 400, "foo"},
        {NULL, "/v1/completions", "{\"prompt\":\"x\",\"messages\":[]}", 400, "messages"},
        {NULL, "/v1/completions", "{\"prompt\":5}", 400, "prompt"},
        {NULL, "/v1/completions", "{}", 400, "prompt"},
        {NULL, "/v1/completions", "{\"prompt\":\"\"}", 400, "prompt"},
        {NULL, "/v1/completions", "{\"prompt\":[]}", 400, "prompt"},
        {NULL, "/v1/completions", "{\"prompt\":[1,99999]}", 400, "prompt"},
        {NULL, "/v1/completions", "{\"prompt\":[1,-1]}", 400, "prompt"},
        {NULL, "/v1/completions", "{\"prompt\":[\"a\",\"b\"]}", 400, "prompt"},
        {NULL, "/v1/completions", "{\"prompt\":\"x\",\"temperature\":-0.1}", 400, "temperature"},
        {NULL, "/v1/completions", "{\"prompt\":\"x\",\"temperature\":2.5}", 400, "temperature"},
        {NULL, "/v1/completions", "{\"prompt\":\"x\",\"temperature\":\"hot\"}", 400, "temperature"},
        {NULL, "/v1/completions", "{\"prompt\":\"x\",\"top_p\":0}", 400, "top_p"},
        {NULL, "/v1/completions", "{\"prompt\":\"x\",\"top_p\":1.5}", 400, "top_p"},
        {NULL, "/v1/completions", "{\"prompt\":\"x\",\"max_tokens\":0}", 400, "max_tokens"},
        {NULL, "/v1/completions", "{\"prompt\":\"x\",\"max_tokens\":\"5\"}", 400, "max_tokens"},
        {NULL, "/v1/completions", "{\"prompt\":\"x\",\"max_tokens\":1.5}", 400, "max_tokens"},
        {NULL, "/v1/completions", "{\"prompt\":\"xyz\",\"max_tokens\":254}", 400, "max_tokens"},
        {NULL, "/v1/completions", too_long, 400, "prompt"},
        {NULL, "/v1/completions", "{\"prompt\":\"x\",\"n\":17}", 400, "n"},
        {NULL, "/v1/completions", "{\"prompt\":\"x\",\"n\":0}", 400, "n"},
        {NULL, "/v1/completions", "{\"prompt\":\"x\",\"n\":-1}", 400, "n"},
        {NULL, "/v1/completions", "{\"prompt\":\"x\",\"n\":\"2\"}", 400, "n"},
        {NULL, "/v1/completions", "{\"prompt\":\"x\",\"n\":2.5}", 400, "n"},
        {NULL, "/v1/completions", "{\"prompt\":\"x\",\"n\":2,\"best_of\":3}", 400, "best_of"},
        {NULL, "/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"n\":99}", 400, "n"},
        {NULL, "/v1/completions", "{\"prompt\":\"x\",\"logprobs\":6}", 400, "logprobs"},
        {NULL, "/v1/completions", "{\"prompt\":\"x\",\"logprobs\":-1}", 400, "logprobs"},
        {NULL, "/v1/completions", "{\"prompt\":\"x\",\"logprobs\":true}", 400, "logprobs"},
        {NULL, "/v1/completions", "{\"prompt\":\"x\",\"logprobs\":1.5}", 400, "logprobs"},
        {NULL, "/v1/completions", "{\"prompt\":\"x\",\"echo\":1}", 400, "echo"},
        {NULL, "/v1/completions", "{\"prompt\":\"x\",\"best_of\":3}", 400, "best_of"},
        {NULL, "/v1/completions", "{\"prompt\":\"x\",\"stream\":\"yes\"}", 400, "stream"},
        {NULL, "/v1/completions", "{\"prompt\":\"x\",\"stop\":5}", 400, "stop"},
        {NULL, "/v1/completions", "{\"prompt\":\"x\",\"stop\":[\"a\",\"\"]}", 400, "stop[1]"},
        {NULL, "/v1/completions",
         "{\"prompt\":\"x\",\"stop\":[\"a\",\"b\",\"c\",\"d\",\"e\","
         "\"f\",\"g\",\"h\",\"i\",\"j\",\"k\",\"l\",\"m\",\"n\",\"o\","
         "\"p\",\"q\"]}",
         400, "stop"},
        {NULL, "/v1/completions", "{\"prompt\":\"x\",\"stream_options\":{\"include_usage\":true}}",
         400, "stream_options"},
        {NULL, "/v1/completions", "{\"prompt\":\"x\",\"seed\":\"s\"}", 400, "seed"},
        {NULL, "/v1/completions", "{\"prompt\":\"x\",\"stop_token_ids\":[300]}", 400,
         "stop_token_ids"},
        {NULL, "/v1/completions", "{\"prompt\":\"x\",\"kvstage\":{\"room\":1,\"role\":\"x\"}}", 400,
         "kvstage.role"},
        {NULL, "/v1/completions",
         "{\"prompt\":\"x\",\"kvstage\":{\"room\":1,\"role\":\"decode\",\"zz\":1}}", 400,
         "kvstage.zz"},
        {NULL, "/v1/completions",
         "{\"prompt\":\"x\",\"kvstage\":{\"room\":-1,\"role\":\"decode\"}}", 400, "kvstage.room"},
        {NULL, "/v1/completions", "{\"prompt\":\"x\",\"model\":\"other\"}", 404, "model"},
        {NULL, "/v1/completions", "{\"prompt\":\"x\",\"model\":3}", 400, "model"},
        {NULL, "/v1/chat/completions", "{}", 400, "messages"},
        {NULL, "/v1/chat/completions", "{\"messages\":[]}", 400, "messages"},
        {NULL, "/v1/chat/completions", "{\"messages\":{}}", 400, "messages"},
        {NULL, "/v1/chat/completions", "{\"messages\":[1]}", 400, "messages[0]"},
        {NULL, "/v1/chat/completions", "{\"messages\":[{\"role\":\"bot\",\"content\":\"x\"}]}", 400,
         "messages[0].role"},
        {NULL, "/v1/chat/completions", "{\"messages\":[{\"content\":\"x\"}]}", 400,
         "messages[0].role"},
        {NULL, "/v1/chat/completions", "{\"messages\":[{\"role\":\"user\"}]}", 400,
         "messages[0].content"},
        {NULL, "/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\"}]}]}", 400,
         "messages[0].content"},
        {NULL, "/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\",\"x\":1}]}", 400, "messages[0].x"},
        {NULL, "/v1/completions", "{\"prompt\":\"x\",\"service_tier\":\"auto\"}", 400,
         "service_tier"},
        {NULL, "/v1/completions",
         "{\"prompt\":\"x\",\"stream\":true,\"stream_options\":{\"include_usage\":true,\"zz\":1}}",
         400, "stream_options.zz"},
        {NULL, "/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"echo\":false}", 400, "echo"},
        {NULL, "/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"prompt\":\"x\"}", 400, "prompt"},
        {NULL, "/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{}]}", 400, "tools"},
        {NULL, "/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"response_format\":"
         "{\"type\":\"json_object\"}}",
         400, "response_format"},
        {NULL, "/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_completion_tokens\":0}", 400,
         "max_completion_tokens"},
        {NULL, "/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"logprobs\":1}", 400, "logprobs"},
        {NULL, "/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"logprobs\":true,"
         "\"top_logprobs\":21}",
         400, "top_logprobs"},
        {NULL, "/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"logprobs\":true,"
         "\"top_logprobs\":-1}",
         400, "top_logprobs"},
        {NULL, "/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"top_logprobs\":2}", 400,
         "top_logprobs"},
        {NULL, "/tokenize", "{}", 400, "prompt"},
        {NULL, "/tokenize", "{\"prompt\":\"x\",\"messages\":[]}", 400, "messages"},
        {NULL, "/tokenize", "{\"prompt\":7}", 400, "prompt"},
        {NULL, "/tokenize", "{\"prompt\":\"x\",\"zz\":1}", 400, "zz"},
        {NULL, "/tokenize", "{\"prompt\":\"x\",\"model\":\"other\"}", 404, "model"},
        {NULL, "/tokenize", "[1]", 400, NULL},
        {NULL, "/detokenize", "{\"tokens\":[1,257]}", 400, "tokens"},
        {NULL, "/detokenize", "{\"tokens\":\"ab\"}", 400, "tokens"},
        {NULL, "/detokenize", "{}", 400, "tokens"},
        {"GET", "/tokenize", NULL, 405, NULL},
        {NULL, "/internal/match", "{\"prompt\":7}", 400, "prompt"},
        {"GET", "/v1/completions", NULL, 405, NULL},
        {"PUT", "/v1/chat/completions", "{}", 405, NULL},
        {"POST", "/health", "{}", 405, NULL},
        {"DELETE", "/metrics", NULL, 405, NULL},
        {"GET", "/nope", NULL, 404, NULL},
        {NULL, "/v1/nope", "{}", 404, NULL},
        {NULL, "/v1/completions", huge, 413, NULL},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        const bad_case_t *c = &cases[i];
        http_resp_t r = {0};
        http_call(f.port, c->method, c->path, c->body, &r);
        if (r.status != c->status)
            fail_msg("case %zu (%s %s %.60s): status %ld, expected %ld: %s", i,
                     c->method ? c->method : "POST", c->path, c->body ? c->body : "", r.status,
                     c->status, r.body.ptr);
        expect_error_json(&r, c->status, "invalid_request_error", c->param);
        if (c->status == 405)
            assert_string_equal(
                r.allow, strstr(c->path, "/v1/") || strstr(c->path, "tokenize") ? "POST" : "GET");
        http_resp_fini(&r);
    }
    kvs_server_fake_counts_t counts;
    kvs_server_fake_counts(f.fake, &counts);
    assert_int_equal(counts.submitted, 0);

    /* Neutral values of the compatibility fields are accepted; the server kept serving. */
    http_resp_t r = {0};
    http_call(f.port, NULL, "/v1/completions",
              "{\"prompt\":\"x\",\"n\":1,\"user\":\"u\",\"logprobs\":null,\"echo\":false,"
              "\"best_of\":1,\"suffix\":null,\"presence_penalty\":0.5,\"frequency_penalty\":-1,"
              "\"logit_bias\":{},\"seed\":42,\"stop\":null,\"model\":null,\"max_tokens\":1}",
              &r);
    assert_int_equal(r.status, 200);
    http_resp_fini(&r);
    json_t *j =
        call_ok(f.port, "/v1/chat/completions",
                "{\"messages\":[{\"role\":\"developer\",\"content\":\"d\",\"name\":\"n\"}],"
                "\"logprobs\":false,\"top_logprobs\":0,\"tools\":[],\"tool_choice\":\"none\","
                "\"response_format\":{\"type\":\"text\"},\"parallel_tool_calls\":true,"
                "\"store\":false,\"metadata\":{},\"max_tokens\":2}",
                &r);
    assert_string_equal(str_at(j, "choices.0.message.content"), "sy"); /* developer = system */
    json_decref(j);
    http_resp_fini(&r);
    stop(&f);
    kvs_assert_no_leaks();
}

/* Every sampling field outside its range: 400 naming the field, the message the range. */
static void test_bad_sampling(void **state)
{
    (void) state;
    fixture_t f;
    start(&f, NULL);
    static char many[4096];
    size_t at = (size_t) snprintf(many, sizeof(many), "{\"prompt\":\"x\",\"logit_bias\":{");
    for (int i = 0; i <= 300; i++)
        at += (size_t) snprintf(many + at, sizeof(many) - at, "%s\"%d\":1", i ? "," : "", i);
    snprintf(many + at, sizeof(many) - at, "}}");
    static const struct {
        const char *fields, *param, *says;
    } cases[] = {
        {"\"temperature\":2.5", "temperature", "[0, 2]"},
        {"\"top_p\":0", "top_p", "(0, 1]"},
        {"\"presence_penalty\":3", "presence_penalty", "[-2, 2]"},
        {"\"presence_penalty\":-2.01", "presence_penalty", "[-2, 2]"},
        {"\"frequency_penalty\":-2.5", "frequency_penalty", "[-2, 2]"},
        {"\"frequency_penalty\":\"x\"", "frequency_penalty", "must be a number"},
        {"\"repetition_penalty\":0", "repetition_penalty", "(0, 2]"},
        {"\"repetition_penalty\":2.5", "repetition_penalty", "(0, 2]"},
        {"\"min_p\":1.5", "min_p", "[0, 1]"},
        {"\"min_p\":-0.1", "min_p", "[0, 1]"},
        {"\"top_k\":-2", "top_k", "-1 or 0 (off), or at least 1"},
        {"\"top_k\":1.5", "top_k", "-1 or 0 (off), or at least 1"},
        {"\"top_k\":\"5\"", "top_k", "-1 or 0 (off), or at least 1"},
        {"\"logit_bias\":[]", "logit_bias", "must be an object"},
        {"\"logit_bias\":{\"257\":1}", "logit_bias", "not a token id below 257"},
        {"\"logit_bias\":{\"01\":1}", "logit_bias", "not a token id below 257"},
        {"\"logit_bias\":{\"a\":1}", "logit_bias", "not a token id below 257"},
        {"\"logit_bias\":{\"\":1}", "logit_bias", "not a token id below 257"},
        {"\"logit_bias\":{\"1\":100.5}", "logit_bias", "[-100, 100]"},
        {"\"logit_bias\":{\"1\":-101}", "logit_bias", "[-100, 100]"},
        {"\"logit_bias\":{\"1\":\"x\"}", "logit_bias", "[-100, 100]"},
        {"\"ignore_eos\":1", "ignore_eos", "must be a boolean"},
        {"\"seed\":1.5", "seed", "must be an integer"},
        {NULL, "logit_bias", "at most 300"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        char body[256];
        snprintf(body, sizeof(body), "{\"prompt\":\"x\",%s}", cases[i].fields);
        http_resp_t r = {0};
        http_call(f.port, NULL, "/v1/completions", cases[i].fields ? body : many, &r);
        expect_error_json(&r, 400, "invalid_request_error", cases[i].param);
        json_t *j = http_json(&r);
        const char *msg = str_at(j, "error.message");
        if (strstr(msg, cases[i].says) == NULL || strstr(msg, cases[i].param) == NULL)
            fail_msg("%s: message '%s' lacks '%s'", cases[i].fields ? body : "301 biases", msg,
                     cases[i].says);
        json_decref(j);
        http_resp_fini(&r);
    }
    kvs_server_fake_counts_t counts;
    kvs_server_fake_counts(f.fake, &counts);
    assert_int_equal(counts.submitted, 0);
    stop(&f);
    kvs_assert_no_leaks();
}

/* The sampling fields reach the backend as given; the seed, given or drawn, comes back in
 * "kvstage" (non-streaming, and the usage chunk). */
static void test_sampling_fields(void **state)
{
    (void) state;
    fixture_t f;
    start(&f, NULL);
    http_resp_t r = {0};
    json_t *j = call_ok(f.port, "/v1/completions",
                        "{\"prompt\":\"x\",\"max_tokens\":2,\"temperature\":0.7,\"top_p\":0.9,"
                        "\"top_k\":40,\"min_p\":0.05,\"presence_penalty\":0.5,"
                        "\"frequency_penalty\":-0.5,\"repetition_penalty\":1.2,"
                        "\"logit_bias\":{\"10\":-100,\"256\":2.5},\"ignore_eos\":true,\"seed\":42}",
                        &r);
    assert_int_equal(int_at(j, "kvstage.seed"), 42);
    kvs_server_fake_record_t rec;
    assert_int_equal(kvs_server_fake_record(f.fake, room_of(j), &rec), KVS_OK);
    const kvs_sample_params_t *sp = &rec.sampling;
    assert_true(sp->temperature == 0.7f && sp->top_p == 0.9f && sp->top_k == 40 &&
                sp->min_p == 0.05f && sp->presence_penalty == 0.5f &&
                sp->frequency_penalty == -0.5f && sp->repetition_penalty == 1.2f);
    assert_int_equal(sp->n_bias, 2);
    assert_int_equal(rec.seed, 42);
    assert_int_equal(rec.n_stop_ids, 0); /* ignore_eos: not even the EOS */
    json_decref(j);
    http_resp_fini(&r);

    /* No seed: each request draws its own and reports it. */
    uint64_t seeds[2];
    for (int k = 0; k < 2; k++) {
        j = call_ok(f.port, "/v1/completions", "{\"prompt\":\"x\",\"max_tokens\":1}", &r);
        seeds[k] = (uint64_t) int_at(j, "kvstage.seed");
        assert_int_equal(kvs_server_fake_record(f.fake, room_of(j), &rec), KVS_OK);
        assert_true(rec.seed == seeds[k]);
        assert_int_equal(rec.n_stop_ids, 1); /* the EOS */
        assert_true(rec.sampling.repetition_penalty == 1.0f && rec.sampling.top_k == 0);
        json_decref(j);
        http_resp_fini(&r);
    }
    assert_true(seeds[0] != seeds[1]);
    http_call(f.port, NULL, "/v1/completions",
              "{\"prompt\":\"x\",\"max_tokens\":1,\"stream\":true,\"seed\":-7,"
              "\"stream_options\":{\"include_usage\":true}}",
              &r);
    assert_int_equal(r.status, 200);
    char *ev[16];
    size_t n = sse_split(&r.body, ev, 16);
    assert_true(n >= 3);
    json_t *usage = json_loads(ev[n - 2], 0, NULL);
    assert_int_equal(int_at(usage, "kvstage.seed"), -7); /* as given */
    json_decref(usage);
    http_resp_fini(&r);
    stop(&f);
    kvs_assert_no_leaks();
}

static void test_health(void **state)
{
    (void) state;
    fixture_t f;
    start(&f, NULL);
    http_resp_t r = {0};
    http_call(f.port, NULL, "/health", NULL, &r);
    assert_int_equal(r.status, 200);
    assert_string_equal(r.body.ptr, "{\"status\":\"ok\"}");
    http_resp_fini(&r);
    kvs_server_fake_set_healthy(f.fake, 0);
    http_call(f.port, NULL, "/health", NULL, &r);
    assert_int_equal(r.status, 503);
    json_t *j = http_json(&r);
    assert_string_equal(str_at(j, "status"), "unavailable");
    json_decref(j);
    http_resp_fini(&r);
    kvs_server_fake_set_healthy(f.fake, 1);
    http_call(f.port, NULL, "/health", NULL, &r);
    assert_int_equal(r.status, 200);
    http_resp_fini(&r);

    j = call_ok(f.port, "/v1/models", NULL, &r);
    assert_string_equal(str_at(j, "object"), "list");
    assert_string_equal(str_at(j, "data.0.id"), MODEL);
    assert_string_equal(str_at(j, "data.0.object"), "model");
    json_decref(j);
    http_resp_fini(&r);

    j = call_ok(f.port, "/internal/info", NULL, &r);
    assert_string_equal(str_at(j, "role"), "prefill");
    assert_string_equal(str_at(j, "bootstrap"), "tcp://10.0.0.1:5555");
    json_decref(j);
    http_resp_fini(&r);

    /* /internal/match answers from the backend's prefix cache. */
    j = call_ok(f.port, "/internal/match", "{\"prompt\":\"the cat sat\"}", &r);
    assert_int_equal(int_at(j, "cached_tokens"), 0);
    assert_int_equal(int_at(j, "prompt_tokens"), 11);
    json_decref(j);
    http_resp_fini(&r);
    http_call(f.port, NULL, "/v1/completions", "{\"prompt\":\"the cat sat\",\"max_tokens\":2}", &r);
    assert_int_equal(r.status, 200);
    http_resp_fini(&r);
    j = call_ok(f.port, "/internal/match", "{\"prompt\":\"the cat ran\",\"max_tokens\":2}", &r);
    assert_int_equal(int_at(j, "cached_tokens"), 8);
    json_decref(j);
    http_resp_fini(&r);
    j = call_ok(f.port, "/internal/match", "{\"messages\":[{\"role\":\"user\",\"content\":\"z\"}]}",
                &r);
    assert_int_equal(int_at(j, "prompt_tokens"), 19); /* "user: z\nassistant: " */
    json_decref(j);
    http_resp_fini(&r);
    stop(&f);
    kvs_assert_no_leaks();
}

static double fetch_metric(uint16_t port, const char *key, char **text_p)
{
    http_resp_t r = {0};
    http_call(port, NULL, "/metrics", NULL, &r);
    assert_int_equal(r.status, 200);
    assert_true(strncmp(r.ctype, "text/plain", 10) == 0);
    expect_prometheus(r.body.ptr);
    double v = metric_value(r.body.ptr, key);
    if (text_p)
        *text_p = kvs__sb_take(&r.body);
    else
        http_resp_fini(&r);
    return v;
}

static int server_quiet(void *arg)
{
    char *text = NULL;
    if (kvs_server_metrics(arg, &text) != KVS_OK) return 0;
    int quiet = metric_value(text, "kvstage_requests_live") == 0;
    kvs_free(text);
    return quiet;
}

static void test_metrics(void **state)
{
    (void) state;
    kvs_server_fake_config_t fc = {.token_delay_ns = 500000};
    fixture_t f;
    start(&f, &fc);
    char *before = NULL;
    double ok0 = fetch_metric(f.port, "kvstage_http_requests_total{code=\"200\"}", &before);
    assert_true(ok0 >= 0);
    double gen0 = metric_value(before, "kvstage_generation_tokens_total");
    double prompt0 = metric_value(before, "kvstage_prompt_tokens_total");
    double ttft0 = expect_histogram(before, "kvstage_time_to_first_token_seconds");
    double itl0 = expect_histogram(before, "kvstage_inter_token_latency_seconds");
    assert_true(metric_value(before, "kvstage_ring_capacity_bytes") > 0);
    kvs_free(before);

    http_resp_t r = {0};
    http_call(f.port, NULL, "/v1/completions", "{\"prompt\":\"abc\",\"max_tokens\":6}", &r);
    assert_int_equal(r.status, 200);
    http_resp_fini(&r);
    http_call(f.port, NULL, "/v1/completions",
              "{\"prompt\":\"abcd\",\"max_tokens\":4,\"stream\":true}", &r);
    assert_int_equal(r.status, 200);
    http_resp_fini(&r);
    http_call(f.port, NULL, "/v1/completions", "{\"prompt\":\"x\",\"top_p\":9}", &r);
    assert_int_equal(r.status, 400);
    http_resp_fini(&r);
    http_call(f.port, NULL, "/v1/completions",
              "{\"prompt\":\"pp\",\"max_tokens\":3,\"kvstage\":{\"room\":77,\"role\":\"decode\","
              "\"bootstrap\":\"tcp://b\"}}",
              &r);
    assert_int_equal(r.status, 200);
    http_resp_fini(&r);

    /* A request leaves the live list just after its answer went out. */
    assert_true(wait_until(server_quiet, f.srv, 2000));
    char *after = NULL;
    double ok1 = fetch_metric(f.port, "kvstage_http_requests_total{code=\"200\"}", &after);
    /* The three generations and the first /metrics itself. */
    assert_true(ok1 == ok0 + 4);
    assert_true(metric_value(after, "kvstage_http_requests_total{code=\"400\"}") == 1);
    assert_true(metric_value(after, "kvstage_generation_tokens_total") == gen0 + 13);
    assert_true(metric_value(after, "kvstage_prompt_tokens_total") == prompt0 + 9);
    assert_true(metric_value(after, "kvstage_requests_finished_total{reason=\"length\"}") == 3);
    assert_true(expect_histogram(after, "kvstage_time_to_first_token_seconds") == ttft0 + 3);
    assert_true(expect_histogram(after, "kvstage_inter_token_latency_seconds") == itl0 + 10);
    assert_true(expect_histogram(after, "kvstage_request_duration_seconds") == 3);
    assert_true(expect_histogram(after, "kvstage_kv_transfer_seconds") == 1);
    assert_true(metric_value(after, "kvstage_kv_bytes_total") == 2 * 1024);
    assert_true(metric_value(after, "kvstage_requests_live") == 0);
    kvs_free(after);

    /* kvs_server_metrics gives the same text without HTTP. */
    char *text = NULL;
    assert_int_equal(kvs_server_metrics(f.srv, &text), KVS_OK);
    expect_prometheus(text);
    /* Every transfer counter the table exports is there, with its type and help, in order. */
    uint32_t nf, exported = 0;
    const kvs_pd_metric_field_t *mf = kvs_pd_metrics_fields(&nf);
    const char *last = text;
    for (uint32_t at = 1; at <= nf; at++) {
        for (uint32_t i = 0; i < nf; i++) {
            if (mf[i].prom == NULL || mf[i].prom_at != at) continue;
            char want[256];
            snprintf(want, sizeof(want), "# HELP %s %s\n# TYPE %s %s\n%s ", mf[i].prom, mf[i].help,
                     mf[i].prom, mf[i].kind == KVS_PD_COUNTER ? "counter" : "gauge", mf[i].prom);
            const char *p = strstr(text, want);
            if (p == NULL || p < last) fail_msg("/metrics lacks %s in its place:\n%s", want, text);
            last = p;
            exported++;
        }
    }
    assert_int_equal(exported, 11);
    kvs_free(text);
    stop(&f);
    kvs_assert_no_leaks();
}

/* ---- the real tokenizer behind the adapter ---- */

/* GPT-2's byte-to-unicode mapping for one byte, as stored token text. */
static void stored_byte(int b, char out[3])
{
    int direct = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
    int cp = b;
    if (!direct) {
        cp = 256;
        for (int i = 0; i < b; i++)
            cp += !((i >= 33 && i <= 126) || (i >= 161 && i <= 172) || i >= 174);
    }
    if (cp < 0x80) {
        out[0] = (char) cp;
        out[1] = 0;
    } else {
        out[0] = (char) (0xC0 | cp >> 6);
        out[1] = (char) (0x80 | (cp & 0x3F));
        out[2] = 0;
    }
}

static void test_real_tokenizer(void **state)
{
    (void) state;
    /* ids 0, 1: <|im_start|>, <|im_end|> (control, 1 is the EOS); then bytes 0x00..0x7F. */
    static char bytes[128][3];
    kvs_tokenizer_str_t tokens[130];
    int32_t types[130];
    tokens[0] = (kvs_tokenizer_str_t){"<|im_start|>", 12};
    tokens[1] = (kvs_tokenizer_str_t){"<|im_end|>", 10};
    types[0] = types[1] = KVS_TOKEN_CONTROL;
    for (int b = 0; b < 128; b++) {
        stored_byte(b, bytes[b]);
        tokens[2 + b] = (kvs_tokenizer_str_t){bytes[b], strlen(bytes[b])};
        types[2 + b] = KVS_TOKEN_NORMAL;
    }
    kvs_tokenizer_vocab_t vocab = {.n_tokens = 130, .tokens = tokens, .types = types, .eos = 1};
    kvs_tokenizer_t *tok;
    assert_int_equal(kvs_tokenizer_create(&vocab, &tok), KVS_OK);
    kvs_server_tokenizer_t st;
    assert_int_equal(kvs_server_tokenizer_from(tok, &st), KVS_OK);
    assert_int_equal(st.vocab_size, 130);
    assert_int_equal(st.eos, 1);
    fixture_t f;
    start_with(&f, NULL, 256, 4096, st);
    /* ChatML: "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"; the echo starts with
     * <|im_start|> (rendered as nothing), then "user\nhi", then <|im_end|>, the EOS. */
    http_resp_t r = {0};
    json_t *j = call_ok(f.port, "/v1/chat/completions",
                        "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}", &r);
    assert_string_equal(str_at(j, "choices.0.message.content"), "user\nhi");
    assert_string_equal(str_at(j, "choices.0.finish_reason"), "stop");
    assert_int_equal(int_at(j, "usage.prompt_tokens"), 1 + 5 + 2 + 1 + 1 + 1 + 10);
    assert_int_equal(int_at(j, "usage.completion_tokens"), 9);
    json_decref(j);
    http_resp_fini(&r);
    stop(&f);
    kvs_tokenizer_destroy(tok);
    kvs_assert_no_leaks();
}

typedef struct {
    uint16_t port;
    const char *body;
    http_resp_t resp;
} pending_arg_t;

static void *pending_thread(void *p)
{
    pending_arg_t *a = p;
    http_call(a->port, NULL, "/v1/completions", a->body, &a->resp);
    return NULL;
}

static int fake_has_live(void *arg)
{
    kvs_server_fake_counts_t c;
    kvs_server_fake_counts(arg, &c);
    return c.live == 2;
}

static void test_shutdown_in_flight(void **state)
{
    (void) state;
    kvs_server_fake_config_t fc = {.token_delay_ns = 5000000};
    fixture_t f;
    start(&f, &fc);
    pending_arg_t plain = {f.port, "{\"prompt\":\"slow\",\"max_tokens\":250}", {0}};
    pending_arg_t streamed = {
        f.port, "{\"prompt\":\"slow\",\"max_tokens\":250,\"stream\":true}", {0}};
    pthread_t t1, t2;
    assert_int_equal(pthread_create(&t1, NULL, pending_thread, &plain), 0);
    assert_int_equal(pthread_create(&t2, NULL, pending_thread, &streamed), 0);
    assert_true(wait_until(fake_has_live, f.fake, 3000));
    sleep_ms(20);
    uint64_t t0 = kvs_now_ns();
    kvs_server_destroy(f.srv);
    assert_true(kvs_now_ns() - t0 < 2000000000u);
    pthread_join(t1, NULL);
    pthread_join(t2, NULL);
    expect_error_json(&plain.resp, 503, "server_error", NULL);
    char *ev[300];
    sse_expect_failed(&streamed.resp.body, ev, 300, "shutting down");
    http_resp_fini(&plain.resp);
    http_resp_fini(&streamed.resp);
    kvs_server_fake_destroy(f.fake);
    kvs_assert_no_leaks();
}

static void test_overload_and_config(void **state)
{
    (void) state;
    /* The backend refusing a request (full): 503. */
    kvs_server_fake_config_t fc = {.token_delay_ns = 3000000, .max_live = 1};
    fixture_t f;
    start(&f, &fc);
    pending_arg_t slow = {f.port, "{\"prompt\":\"s\",\"max_tokens\":60}", {0}};
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, pending_thread, &slow), 0);
    kvs_server_fake_counts_t c;
    do {
        sleep_ms(2);
        kvs_server_fake_counts(f.fake, &c);
    } while (c.live == 0);
    http_resp_t r = {0};
    kvs_log_capture_t refused = {0};
    kvs_log_set_sink(kvs_log_capture_sink, &refused);
    http_call(f.port, NULL, "/v1/completions", "{\"prompt\":\"x\",\"max_tokens\":2}", &r);
    kvs_log_set_sink(NULL, NULL);
    assert_non_null(strstr(refused.msg, "refused"));
    expect_error_json(&r, 503, "server_error", NULL);
    http_resp_fini(&r);
    pthread_join(t, NULL);
    assert_int_equal(slow.resp.status, 200);
    http_resp_fini(&slow.resp);
    stop(&f);

    /* Bad configurations. */
    kvs_server_config_t cfg;
    memset(&cfg, 0, sizeof(cfg));
    kvs_server_t *srv = NULL;
    kvs_log_capture_t cap = {.errors_only = 1};
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    assert_int_equal(kvs_server_create(&cfg, &srv), KVS_ERR_INVALID);
    assert_int_equal(kvs_server_create(NULL, &srv), KVS_ERR_INVALID);
    kvs_server_fake_t *fake;
    assert_int_equal(kvs_server_fake_create(NULL, &fake), KVS_OK);
    cfg.backend = kvs_server_fake_backend(fake);
    assert_int_equal(kvs_server_create(&cfg, &srv), KVS_ERR_INVALID); /* no tokenizer */
    cfg.tokenizer = kvs_server_byte_tokenizer();
    cfg.host = "not-an-address";
    assert_int_equal(kvs_server_create(&cfg, &srv), KVS_ERR_INVALID);
    cfg.host = "127.0.0.1";
    assert_int_equal(kvs_server_create(&cfg, &srv), KVS_OK);
    kvs_server_config_t same = cfg;
    same.port = kvs_server_port(srv);
    kvs_server_t *srv2 = NULL;
    assert_int_equal(kvs_server_create(&same, &srv2), KVS_ERR_IO); /* port taken */
    assert_null(srv2);
    kvs_log_set_sink(NULL, NULL);
    assert_true(cap.calls >= 5);
    kvs_server_destroy(srv);
    kvs_server_fake_destroy(fake);
    kvs_assert_no_leaks();
}

/* ---- unknown fields ---- */

typedef struct {
    pthread_mutex_t mu;
    int warnings; /* warnings that name ignored fields */
    char last[512];
} warn_capture_t;

static void warn_sink(void *arg, kvs_log_level_t level, const char *file, int line, const char *msg)
{
    (void) file, (void) line;
    warn_capture_t *c = arg;
    if (level != KVS_LOG_WARN || strstr(msg, "unknown field") == NULL) return;
    pthread_mutex_lock(&c->mu);
    c->warnings++;
    snprintf(c->last, sizeof(c->last), "%s", msg);
    pthread_mutex_unlock(&c->mu);
}

typedef struct {
    const char *path;
    const char *body;
    const char *ignored; /* the header, exactly */
    const char *param;   /* the strict server's refusal */
} unknown_case_t;

static void test_unknown_fields(void **state)
{
    (void) state;
    static const unknown_case_t cases[] = {
        {"/v1/completions", "{\"prompt\":\"ab\",\"max_tokens\":2,\"foo\":1}", "foo", "foo"},
        {"/v1/completions",
         "{\"prompt\":\"ab\",\"service_tier\":\"auto\",\"max_tokens\":2,\"reasoning_effort\":"
         "\"low\"}",
         "service_tier, reasoning_effort", "service_tier"},
        {"/v1/completions",
         "{\"prompt\":\"ab\",\"max_tokens\":2,\"kvstage\":{\"room\":5,\"role\":\"decode\",\"zz\":1}"
         "}",
         "kvstage.zz", "kvstage.zz"},
        {"/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"ab\"},{\"role\":\"assistant\","
         "\"content\":\"c\",\"refusal\":null}],\"max_tokens\":2,\"echo\":false}",
         "echo, messages[1].refusal", "echo"},
        {"/v1/completions",
         "{\"prompt\":\"ab\",\"max_tokens\":2,\"stream\":true,\"stream_options\":"
         "{\"include_usage\":true,\"continuous_usage_stats\":true}}",
         "stream_options.continuous_usage_stats", "stream_options.continuous_usage_stats"},
        /* Bytes a header cannot carry as they are. */
        {"/v1/completions", "{\"prompt\":\"ab\",\"max_tokens\":2,\"a b,c%\\u00e9\\r\\n\":1}",
         "a%20b%2Cc%25%C3%A9%0D%0A", "a b,c%\xC3\xA9\r\n"},
    };
    fixture_t lenient, strict;
    start(&lenient, NULL);
    const fixture_opts_t so = {.strict = 1};
    start_opts(&strict, NULL, &so);
    warn_capture_t cap = {.mu = PTHREAD_MUTEX_INITIALIZER};
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        const unknown_case_t *c = &cases[i];
        http_resp_t r = {0};
        kvs_log_set_sink(warn_sink, &cap);
        http_call(lenient.port, NULL, c->path, c->body, &r);
        kvs_log_set_sink(NULL, NULL);
        if (r.status != 200) fail_msg("case %zu: status %ld: %s", i, r.status, r.body.ptr);
        assert_string_equal(r.ignored, c->ignored);
        /* One warning per request, naming the fields as the header does. */
        assert_int_equal(cap.warnings, (int) i + 1);
        assert_non_null(strstr(cap.last, c->ignored));
        http_resp_fini(&r);

        http_call(strict.port, NULL, c->path, c->body, &r);
        expect_error_json(&r, 400, "invalid_request_error", c->param);
        json_t *j = http_json(&r);
        assert_string_equal(str_at(j, "error.code"), "unknown_field");
        json_decref(j);
        assert_string_equal(r.ignored, "");
        http_resp_fini(&r);
    }
    /* The streamed answer carries the header too; a request without unknown fields neither
     * carries it nor warns. */
    http_resp_t r = {0};
    http_call(lenient.port, NULL, "/v1/completions", "{\"prompt\":\"ab\",\"max_tokens\":2}", &r);
    assert_int_equal(r.status, 200);
    assert_string_equal(r.ignored, "");
    http_resp_fini(&r);
    assert_int_equal(cap.warnings, (int) (sizeof(cases) / sizeof(cases[0])));

    /* Known fields OpenAI or vLLM define keep their checks when lenient: a value kvstage does
     * not support is refused, naming it; so is the other endpoint's input. */
    static const struct {
        const char *path, *body, *param;
    } still_refused[] = {
        {"/v1/completions", "{\"prompt\":\"x\",\"n\":17,\"foo\":1}", "n"},
        {"/v1/completions", "{\"prompt\":\"x\",\"echo\":1}", "echo"},
        {"/v1/completions", "{\"prompt\":\"x\",\"logprobs\":6}", "logprobs"},
        {"/v1/completions", "{\"prompt\":\"x\",\"messages\":[]}", "messages"},
        {"/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"prompt\":\"x\"}", "prompt"},
        {"/v1/chat/completions",
         "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[{}]}", "tools"},
        {"/v1/completions", "{\"prompt\":\"x\",\"kvstage\":{\"room\":-1,\"zz\":1}}",
         "kvstage.room"},
    };
    for (size_t i = 0; i < sizeof(still_refused) / sizeof(still_refused[0]); i++) {
        http_call(lenient.port, NULL, still_refused[i].path, still_refused[i].body, &r);
        expect_error_json(&r, 400, "invalid_request_error", still_refused[i].param);
        http_resp_fini(&r);
    }

    /* Many unknown fields: the list is cut with "...", the count stays exact in the log. */
    kvs__sb_t body;
    kvs__sb_init(&body);
    kvs__sb_puts(&body, "{\"prompt\":\"ab\",\"max_tokens\":1");
    for (int k = 0; k < 120; k++) kvs__sb_printf(&body, ",\"unknown_field_%03d\":%d", k, k);
    kvs__sb_puts(&body, "}");
    kvs_log_set_sink(warn_sink, &cap);
    http_call(lenient.port, NULL, "/v1/completions", body.ptr, &r);
    kvs_log_set_sink(NULL, NULL);
    kvs__sb_fini(&body);
    assert_int_equal(r.status, 200);
    size_t hl = strlen(r.ignored);
    assert_true(hl > 400 && hl < KVS__IGNORED_CAP);
    assert_true(strncmp(r.ignored, "unknown_field_000, unknown_field_001, ", 38) == 0);
    assert_string_equal(r.ignored + hl - 5, ", ...");
    assert_non_null(strstr(cap.last, "ignored 120 unknown fields"));
    http_resp_fini(&r);
    kvs_server_fake_counts_t counts;
    kvs_server_fake_counts(strict.fake, &counts);
    assert_int_equal(counts.submitted, 0);
    stop(&lenient);
    stop(&strict);
    kvs_assert_no_leaks();
}

/* ---- models ---- */

static void test_model_retrieve(void **state)
{
    (void) state;
    fixture_t f;
    const fixture_opts_t o = {.model = "org/some-model"};
    start_opts(&f, NULL, &o);
    http_resp_t r = {0};
    /* The id may hold a slash, plain or escaped. */
    const char *hits[] = {"/v1/models/org/some-model", "/v1/models/org%2Fsome-model"};
    for (int i = 0; i < 2; i++) {
        json_t *j = call_ok(f.port, hits[i], NULL, &r);
        assert_int_equal(json_object_size(j), 4);
        assert_string_equal(str_at(j, "id"), "org/some-model");
        assert_string_equal(str_at(j, "object"), "model");
        assert_string_equal(str_at(j, "owned_by"), "kvstage");
        assert_true(int_at(j, "created") > 1600000000);
        json_decref(j);
        http_resp_fini(&r);
    }
    /* The same object as in the list. */
    json_t *list = call_ok(f.port, "/v1/models", NULL, &r);
    http_resp_fini(&r);
    json_t *one = call_ok(f.port, hits[0], NULL, &r);
    assert_true(json_equal(json_at(list, "data.0"), one));
    json_decref(list);
    json_decref(one);
    http_resp_fini(&r);
    const char *misses[] = {"/v1/models/org", "/v1/models/org/some-model/x", "/v1/models/other"};
    for (int i = 0; i < 3; i++) {
        http_call(f.port, NULL, misses[i], NULL, &r);
        expect_error_json(&r, 404, "invalid_request_error", "model");
        json_t *j = http_json(&r);
        assert_string_equal(str_at(j, "error.code"), "model_not_found");
        assert_non_null(strstr(str_at(j, "error.message"), misses[i] + strlen("/v1/models/")));
        json_decref(j);
        http_resp_fini(&r);
    }
    http_call(f.port, "POST", hits[0], "{}", &r);
    expect_error_json(&r, 405, "invalid_request_error", NULL);
    assert_string_equal(r.allow, "GET");
    http_resp_fini(&r);
    http_call(f.port, NULL, "/v1/models/", NULL, &r); /* no id: no such path */
    expect_error_json(&r, 404, "invalid_request_error", NULL);
    http_resp_fini(&r);
    stop(&f);
    kvs_assert_no_leaks();
}

/* ---- API key ---- */

/* One request of every kind the server answers, and the status each gets with the right key. */
static const endpoint_case_t k_endpoints[] = {
    {NULL, "/v1/completions", "{\"prompt\":\"ab\",\"max_tokens\":2}", 200},
    {NULL, "/v1/completions", "{\"prompt\":\"ab\",\"max_tokens\":2,\"stream\":true}", 200},
    {NULL, "/v1/chat/completions",
     "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"max_tokens\":2}", 200},
    {NULL, "/v1/models", NULL, 200},
    {NULL, "/v1/models/" MODEL, NULL, 200},
    {NULL, "/v1/models/nope", NULL, 404},
    {NULL, "/internal/match", "{\"prompt\":\"ab\"}", 200},
    {NULL, "/internal/info", NULL, 200},
    {NULL, "/v1/completions", "{\"prompt\":7}", 400},
    {"GET", "/v1/completions", NULL, 405},
    {NULL, "/nowhere", NULL, 404},
};

static void test_api_key(void **state)
{
    (void) state;
    fixture_t f;
    const fixture_opts_t o = {.api_key = "sekrit"};
    start_opts(&f, NULL, &o);
    expect_key_required(f.port, "sekrit", k_endpoints,
                        sizeof(k_endpoints) / sizeof(k_endpoints[0]));
    kvs_server_fake_counts_t c;
    kvs_server_fake_counts(f.fake, &c);
    assert_int_equal(c.submitted, 3); /* only the requests with the key */
    /* The scheme is case-insensitive, the key is not. */
    http_resp_t r = {0};
    CURL *e = curl_easy_init();
    char url[128];
    snprintf(url, sizeof(url), "http://127.0.0.1:%u/v1/models", (unsigned) f.port);
    struct curl_slist *h = curl_slist_append(NULL, "Authorization: bearer sekrit");
    curl_easy_setopt(e, CURLOPT_URL, url);
    curl_easy_setopt(e, CURLOPT_HTTPHEADER, h);
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, http_test_write);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, &r);
    kvs__sb_init(&r.body);
    assert_int_equal(curl_easy_perform(e), CURLE_OK);
    curl_easy_getinfo(e, CURLINFO_RESPONSE_CODE, &r.status);
    assert_int_equal(r.status, 200);
    curl_slist_free_all(h);
    curl_easy_cleanup(e);
    http_resp_fini(&r);
    r.api_key = "SEKRIT";
    http_call(f.port, NULL, "/v1/models", NULL, &r);
    assert_int_equal(r.status, 401);
    http_resp_fini(&r);
    /* A body sent without the key is not taken: one declared too large is answered 401 at
     * once, before it is read. */
    int fd = raw_connect(f.port, "POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                 "Content-Length: 100000000\r\n\r\n{");
    assert_true(fd >= 0);
    char buf[1024];
    assert_true(raw_read_to_eof(fd, buf, sizeof(buf), 2000) > 0);
    close(fd);
    assert_true(strncmp(buf, "HTTP/1.1 401", 12) == 0);
    stop(&f);

    /* Keys a header cannot carry are refused at creation. */
    kvs_log_capture_t cap = {.errors_only = 1};
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    const char *bad[] = {"", "two words", "tab\there", "\xC3\xA9"};
    for (int i = 0; i < 4; i++) {
        kvs_server_config_t cfg;
        memset(&cfg, 0, sizeof(cfg));
        kvs_server_fake_t *fake;
        assert_int_equal(kvs_server_fake_create(NULL, &fake), KVS_OK);
        cfg.backend = kvs_server_fake_backend(fake);
        cfg.tokenizer = kvs_server_byte_tokenizer();
        cfg.api_key = bad[i];
        kvs_server_t *srv = NULL;
        assert_int_equal(kvs_server_create(&cfg, &srv), KVS_ERR_INVALID);
        assert_null(srv);
        kvs_server_fake_destroy(fake);
    }
    kvs_log_set_sink(NULL, NULL);
    assert_int_equal(cap.calls, 4);
    kvs_assert_no_leaks();
}

/* ---- connections ---- */

static void test_half_open(void **state)
{
    (void) state;
    fixture_t f;
    start(&f, NULL);
    expect_answers_past_half_open(f.port, "/v1/completions",
                                  "{\"prompt\":\"ab\",\"max_tokens\":2}");
    stop(&f);
    kvs_assert_no_leaks();
}

/* A connection limit is kept, and idle connections are closed after the idle timeout, which
 * frees room for the next client. */
static void test_connection_limit(void **state)
{
    (void) state;
    fixture_t f;
    const fixture_opts_t o = {.max_connections = 8, .idle_timeout_s = 1};
    start_opts(&f, NULL, &o);
    int fds[8];
    for (int i = 0; i < 8; i++) assert_true((fds[i] = raw_connect(f.port, "POST /v1/")) >= 0);
    sleep_ms(100);
    uint64_t t0 = kvs_now_ns();
    http_resp_t r = {0};
    http_call(f.port, NULL, "/health", NULL, &r);
    uint64_t ms = (kvs_now_ns() - t0) / 1000000u;
    assert_int_equal(r.status, 200);
    http_resp_fini(&r);
    /* It waited for the idle ones to be closed (1 s), not for ever. */
    if (ms < 700 || ms > 4000) fail_msg("answered after %llu ms", (unsigned long long) ms);
    char buf[64];
    for (int i = 0; i < 8; i++) {
        assert_int_equal(raw_read_to_eof(fds[i], buf, sizeof(buf), 2000), 0);
        close(fds[i]);
    }
    stop(&f);
    kvs_assert_no_leaks();
}

/* A body declared larger than the limit is answered 413 before it is read; one that stops
 * arriving is closed after the idle timeout (libmicrohttpd cannot answer mid-body). */
static void test_slow_body(void **state)
{
    (void) state;
    fixture_t f;
    const fixture_opts_t o = {.idle_timeout_s = 1};
    start_opts(&f, NULL, &o);
    char buf[2048];
    uint64_t t0 = kvs_now_ns();
    int fd = raw_connect(f.port, "POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                 "Content-Type: application/json\r\n"
                                 "Content-Length: 100000000\r\n\r\n{\"prompt\":");
    assert_true(fd >= 0);
    assert_true(raw_read_to_eof(fd, buf, sizeof(buf), 900) > 0); /* before the idle timeout */
    close(fd);
    assert_true(kvs_now_ns() - t0 < 900000000u);
    assert_true(strncmp(buf, "HTTP/1.1 413", 12) == 0);
    assert_non_null(strstr(buf, "body_too_large"));
    assert_non_null(strstr(buf, "larger than 4096 bytes"));

    /* Within the limit but never completed: closed, unanswered, after about a second. */
    t0 = kvs_now_ns();
    fd = raw_connect(f.port, "POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                             "Content-Length: 1000\r\n\r\n{\"prompt\":");
    assert_true(fd >= 0);
    assert_int_equal(raw_read_to_eof(fd, buf, sizeof(buf), 4000), 0);
    close(fd);
    uint64_t ms = (kvs_now_ns() - t0) / 1000000u;
    if (ms < 700 || ms > 3500) fail_msg("closed after %llu ms", (unsigned long long) ms);

    /* The server kept serving and took nothing from those. */
    http_resp_t r = {0};
    http_call(f.port, NULL, "/v1/completions", "{\"prompt\":\"ab\",\"max_tokens\":2}", &r);
    assert_int_equal(r.status, 200);
    http_resp_fini(&r);
    kvs_server_fake_counts_t c;
    kvs_server_fake_counts(f.fake, &c);
    assert_int_equal(c.submitted, 1);
    stop(&f);
    kvs_assert_no_leaks();
}

static double real_at(json_t *obj, const char *path)
{
    json_t *v = json_at(obj, path);
    if (!json_is_number(v)) fail_msg("%s is not a number", path);
    return json_number_value(v);
}

/* The fake's logprobs of a generated (or prompt) token. */
static double fake_lp(uint32_t token, uint32_t index, int prompt)
{
    kvs_logprobs_t lp;
    kvs_server_fake_logprobs(token, index, prompt, 0, &lp);
    return lp.logprob;
}

/* Chat: choices[0].logprobs.content[] of {token, logprob, bytes, top_logprobs[]}, streamed or
 * not the same entries; without logprobs null. */
static void test_logprobs_chat(void **state)
{
    (void) state;
    fixture_t f;
    start(&f, NULL);
    /* The byte tokenizer renders "user: hi\nassistant: "; the fake echoes it. */
    const char *body = "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":3,"
                       "\"logprobs\":true,\"top_logprobs\":2%s}";
    char buf[256];
    snprintf(buf, sizeof(buf), body, "");
    http_resp_t r = {0};
    json_t *j = call_ok(f.port, "/v1/chat/completions", buf, &r);
    assert_string_equal(str_at(j, "choices.0.message.content"), "use");
    json_t *content = json_at(j, "choices.0.logprobs.content");
    assert_int_equal(json_array_size(content), 3);
    for (uint32_t i = 0; i < 3; i++) {
        json_t *e = json_array_get(content, i);
        char tok[2] = {"use"[i], 0};
        assert_string_equal(str_at(e, "token"), tok);
        assert_true(real_at(e, "logprob") == fake_lp((uint8_t) tok[0], i, 0));
        assert_int_equal(json_array_size(json_at(e, "bytes")), 1);
        assert_int_equal(int_at(e, "bytes.0"), (uint8_t) tok[0]);
        json_t *tops = json_at(e, "top_logprobs");
        assert_int_equal(json_array_size(tops), 2);
        assert_string_equal(str_at(tops, "0.token"), tok);
        char next[2] = {(char) (tok[0] + 1), 0};
        assert_string_equal(str_at(tops, "1.token"), next);
        assert_true(real_at(tops, "1.logprob") == fake_lp((uint8_t) tok[0], i, 0) - 0.5);
        assert_int_equal(int_at(tops, "1.bytes.0"), (uint8_t) next[0]);
    }
    kvs_server_fake_record_t rec;
    assert_int_equal(kvs_server_fake_record(f.fake, room_of(j), &rec), KVS_OK);
    assert_true(rec.logprobs == 1 && rec.top_logprobs == 2 && rec.prompt_logprobs == 0);
    char *want = json_dumps(content, JSON_COMPACT);
    json_decref(j);
    j = NULL;
    http_resp_fini(&r);

    /* Streamed: the chunks' entries, in order, are the same. */
    snprintf(buf, sizeof(buf), body, ",\"stream\":true");
    http_call(f.port, NULL, "/v1/chat/completions", buf, &r);
    assert_int_equal(r.status, 200);
    char *ev[64];
    size_t n = sse_split(&r.body, ev, 64);
    json_t *all = json_array();
    for (size_t i = 0; i + 1 < n; i++) {
        json_t *c = json_loads(ev[i], 0, NULL);
        json_t *lp = json_at(c, "choices.0.logprobs");
        if (i == 0) assert_true(json_is_null(lp)); /* the role chunk */
        if (json_is_object(lp)) json_array_extend(all, json_object_get(lp, "content"));
        json_decref(c);
    }
    char *got = json_dumps(all, JSON_COMPACT);
    assert_string_equal(got, want);
    kvs_free(got);
    kvs_free(want);
    json_decref(all);
    json_decref(j);
    j = NULL;
    http_resp_fini(&r);

    /* logprobs false: null, and top_logprobs 0 alone is accepted. */
    j = call_ok(f.port, "/v1/chat/completions",
                "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":2,"
                "\"logprobs\":false,\"top_logprobs\":0}",
                &r);
    assert_true(json_is_null(json_at(j, "choices.0.logprobs")));
    json_decref(j);
    j = NULL;
    http_resp_fini(&r);
    /* logprobs true without top_logprobs: empty alternatives. */
    j = call_ok(f.port, "/v1/chat/completions",
                "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":2,"
                "\"logprobs\":true}",
                &r);
    assert_int_equal(json_array_size(json_at(j, "choices.0.logprobs.content.1.top_logprobs")), 0);
    assert_true(real_at(j, "choices.0.logprobs.content.1.logprob") == fake_lp('s', 1, 0));
    json_decref(j);
    j = NULL;
    http_resp_fini(&r);
    stop(&f);
    kvs_assert_no_leaks();
}

/* Completions: logprobs {tokens, token_logprobs, top_logprobs (dicts of the top N and the chosen
 * token), text_offset}; echo prepends the prompt, its first token's logprob null, so that echo +
 * logprobs + max_tokens 1 scores a text; streamed, the echo is the first chunk. */
static void test_logprobs_completions(void **state)
{
    (void) state;
    fixture_t f;
    start(&f, NULL);
    http_resp_t r = {0};
    json_t *j = call_ok(f.port, "/v1/completions",
                        "{\"prompt\":\"abc\",\"max_tokens\":4,\"logprobs\":2}", &r);
    assert_string_equal(str_at(j, "choices.0.text"), "abca");
    json_t *lp = json_at(j, "choices.0.logprobs");
    assert_int_equal(json_object_size(lp), 4);
    for (uint32_t i = 0; i < 4; i++) {
        char path[64], tok[2] = {"abca"[i], 0}, next[2] = {(char) (tok[0] + 1), 0};
        snprintf(path, sizeof(path), "tokens.%u", i);
        assert_string_equal(str_at(lp, path), tok);
        snprintf(path, sizeof(path), "token_logprobs.%u", i);
        assert_true(real_at(lp, path) == fake_lp((uint8_t) tok[0], i, 0));
        snprintf(path, sizeof(path), "text_offset.%u", i);
        assert_int_equal(int_at(lp, path), i);
        snprintf(path, sizeof(path), "top_logprobs.%u", i);
        json_t *d = json_at(lp, path);
        assert_int_equal(json_object_size(d), 2);
        assert_true(json_real_value(json_object_get(d, tok)) == fake_lp((uint8_t) tok[0], i, 0));
        assert_true(json_real_value(json_object_get(d, next)) ==
                    fake_lp((uint8_t) tok[0], i, 0) - 0.5);
    }
    json_decref(j);
    j = NULL;
    http_resp_fini(&r);

    /* logprobs 0: the chosen token alone in each dict. */
    j = call_ok(f.port, "/v1/completions", "{\"prompt\":\"abc\",\"max_tokens\":2,\"logprobs\":0}",
                &r);
    assert_int_equal(json_object_size(json_at(j, "choices.0.logprobs.top_logprobs.1")), 1);
    assert_true(real_at(j, "choices.0.logprobs.top_logprobs.1.b") == fake_lp('b', 1, 0));
    json_decref(j);
    j = NULL;
    http_resp_fini(&r);

    /* Scoring: echo, logprobs 1, max_tokens 1. */
    j = call_ok(f.port, "/v1/completions",
                "{\"prompt\":\"abc\",\"max_tokens\":1,\"logprobs\":1,\"echo\":true}", &r);
    assert_string_equal(str_at(j, "choices.0.text"), "abca");
    lp = json_at(j, "choices.0.logprobs");
    assert_int_equal(json_array_size(json_at(lp, "tokens")), 4);
    assert_true(json_is_null(json_at(lp, "token_logprobs.0")));
    assert_true(json_is_null(json_at(lp, "top_logprobs.0")));
    assert_true(real_at(lp, "token_logprobs.1") == fake_lp('b', 1, 1));
    assert_true(real_at(lp, "token_logprobs.2") == fake_lp('c', 2, 1));
    assert_true(real_at(lp, "top_logprobs.2.c") == fake_lp('c', 2, 1));
    assert_true(real_at(lp, "token_logprobs.3") == fake_lp('a', 0, 0));
    assert_int_equal(int_at(lp, "text_offset.3"), 3);
    kvs_server_fake_record_t rec;
    assert_int_equal(kvs_server_fake_record(f.fake, room_of(j), &rec), KVS_OK);
    assert_true(rec.logprobs && rec.top_logprobs == 1 && rec.prompt_logprobs);
    char *want = json_dumps(lp, JSON_COMPACT);
    json_decref(j);
    j = NULL;
    http_resp_fini(&r);

    /* Streamed: the prompt and its logprobs first, then the completion's. */
    http_call(f.port, NULL, "/v1/completions",
              "{\"prompt\":\"abc\",\"max_tokens\":1,\"logprobs\":1,\"echo\":true,\"stream\":true}",
              &r);
    assert_int_equal(r.status, 200);
    char *ev[64];
    size_t n = sse_split(&r.body, ev, 64);
    json_t *first = json_loads(ev[0], 0, NULL);
    assert_string_equal(str_at(first, "choices.0.text"), "abc");
    assert_int_equal(json_array_size(json_at(first, "choices.0.logprobs.tokens")), 3);
    json_decref(first);
    json_t *merged = json_pack("{s:[], s:[], s:[], s:[]}", "tokens", "token_logprobs",
                               "top_logprobs", "text_offset");
    char text[64];
    sse_concat(ev, n - 1, "choices.0.text", text);
    assert_string_equal(text, "abca");
    for (size_t i = 0; i + 1 < n; i++) {
        json_t *c = json_loads(ev[i], 0, NULL);
        json_t *l = json_at(c, "choices.0.logprobs");
        const char *key;
        json_t *val;
        if (json_is_object(l))
            json_object_foreach(l, key, val) json_array_extend(json_object_get(merged, key), val);
        json_decref(c);
    }
    char *got = json_dumps(merged, JSON_COMPACT | JSON_SORT_KEYS);
    json_t *wj = json_loads(want, 0, NULL);
    char *want_sorted = json_dumps(wj, JSON_COMPACT | JSON_SORT_KEYS);
    assert_string_equal(got, want_sorted);
    kvs_free(got);
    kvs_free(want);
    kvs_free(want_sorted);
    json_decref(wj);
    json_decref(merged);
    json_decref(j);
    j = NULL;
    http_resp_fini(&r);

    /* Echo without logprobs; a stop string applies to the completion only. */
    j = call_ok(f.port, "/v1/completions",
                "{\"prompt\":\"abc\",\"max_tokens\":9,\"echo\":true,\"stop\":\"cab\"}", &r);
    assert_string_equal(str_at(j, "choices.0.text"), "abcab"); /* not the "cab" across the join */
    assert_true(json_is_null(json_at(j, "choices.0.logprobs")));
    assert_string_equal(str_at(j, "choices.0.finish_reason"), "stop");
    json_decref(j);
    j = NULL;
    http_resp_fini(&r);
    stop(&f);
    kvs_assert_no_leaks();
}

/* POST /tokenize and /detokenize as vLLM answers them. */
static void test_tokenize(void **state)
{
    (void) state;
    fixture_t f;
    start(&f, NULL);
    http_resp_t r = {0};
    json_t *j = call_ok(f.port, "/tokenize", "{\"model\":\"" MODEL "\",\"prompt\":\"hi\"}", &r);
    assert_int_equal(int_at(j, "count"), 2);
    assert_int_equal(int_at(j, "tokens.0"), 'h');
    assert_int_equal(int_at(j, "tokens.1"), 'i');
    assert_int_equal(int_at(j, "max_model_len"), 256);
    json_decref(j);
    j = NULL;
    http_resp_fini(&r);
    j = call_ok(f.port, "/tokenize", "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}", &r);
    assert_int_equal(int_at(j, "count"), (json_int_t) strlen("user: hi\nassistant: "));
    json_decref(j);
    j = NULL;
    http_resp_fini(&r);
    j = call_ok(f.port, "/tokenize", "{\"prompt\":\"hi\",\"zz\":1}", &r); /* lenient */
    assert_int_equal(int_at(j, "count"), 2);
    json_decref(j);
    j = NULL;
    http_resp_fini(&r);
    j = call_ok(f.port, "/tokenize", "{\"prompt\":[7,8,9]}", &r);
    assert_int_equal(int_at(j, "count"), 3);
    assert_int_equal(int_at(j, "tokens.2"), 9);
    json_decref(j);
    j = NULL;
    http_resp_fini(&r);
    /* A prompt longer than the context is counted, not refused. */
    char big[400] = "{\"prompt\":\"";
    memset(big + 11, 'x', 300);
    strcpy(big + 311, "\"}");
    j = call_ok(f.port, "/tokenize", big, &r);
    assert_int_equal(int_at(j, "count"), 300);
    json_decref(j);
    j = NULL;
    http_resp_fini(&r);
    j = call_ok(f.port, "/detokenize", "{\"tokens\":[104,105,256]}", &r);
    assert_string_equal(str_at(j, "prompt"), "hi"); /* the EOS renders as nothing */
    json_decref(j);
    j = NULL;
    http_resp_fini(&r);
    j = call_ok(f.port, "/detokenize", "{\"tokens\":[195]}", &r);
    assert_string_equal(str_at(j, "prompt"), "\xef\xbf\xbd"); /* half a character: U+FFFD */
    json_decref(j);
    j = NULL;
    http_resp_fini(&r);
    stop(&f);
    kvs_assert_no_leaks();
}

int main(void)
{
    curl_global_init(CURL_GLOBAL_DEFAULT);
    kvs__json_init();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_completion),
        cmocka_unit_test(test_chat),
        cmocka_unit_test(test_stream_completion),
        cmocka_unit_test(test_stream_chat),
        cmocka_unit_test(test_stop_strings),
        cmocka_unit_test(test_stream_property),
        cmocka_unit_test(test_concurrent_clients),
        cmocka_unit_test(test_backend_failure),
        cmocka_unit_test(test_client_disconnect),
        cmocka_unit_test(test_choices),
        cmocka_unit_test(test_bad_inputs),
        cmocka_unit_test(test_bad_sampling),
        cmocka_unit_test(test_sampling_fields),
        cmocka_unit_test(test_health),
        cmocka_unit_test(test_metrics),
        cmocka_unit_test(test_real_tokenizer),
        cmocka_unit_test(test_shutdown_in_flight),
        cmocka_unit_test(test_overload_and_config),
        cmocka_unit_test(test_unknown_fields),
        cmocka_unit_test(test_model_retrieve),
        cmocka_unit_test(test_api_key),
        cmocka_unit_test(test_half_open),
        cmocka_unit_test(test_connection_limit),
        cmocka_unit_test(test_slow_body),
        cmocka_unit_test(test_logprobs_chat),
        cmocka_unit_test(test_logprobs_completions),
        cmocka_unit_test(test_tokenize),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    curl_global_cleanup();
    return rc;
}
