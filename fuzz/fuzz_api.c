/* libFuzzer target for the OpenAI request parser (serve/http/api.c): kvs__api_parse over any
 * body, as a completions or a chat request, with the byte tokenizer. The first input byte picks
 * the endpoint (bit 0), the limits (bits 1-2) and whether an allocation fails (bits 3-7: the
 * Nth after those jansson makes to read the body: jansson 2.14 asserts, and so aborts, when one
 * of its own fails in the middle of a token, which no caller can prevent); the rest is the
 * body. Every accepted request must satisfy
 * what the server relies on (prompt ids below the vocabulary, prompt + max_tokens within the
 * context, sampling values in range, stop strings and ids within their bounds, a room only with
 * a role); every refusal must be a 4xx with a message (a 500 only when an allocation failed);
 * nothing may leak. Without a failed allocation it parses the body strictly and leniently and
 * checks that they agree: strict accepts exactly what lenient accepts without ignoring
 * anything, and a lenient parse names only header-safe bytes. The body with its unknown fields
 * removed (the router's path) must then draw no unknown-field refusal from a strict parse.
 *
 * Built with -DKVS_FUZZ_WRITE_SEEDS and without -fsanitize=fuzzer, the file is instead a
 * program that writes the seed corpus (requests using every field of both endpoints) into the
 * directory given as its argument. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvstage/alloc.h"
#include "kvstage/log.h"
#include "http/server_internal.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void drop_log(void *arg, kvs_log_level_t level, const char *file, int line, const char *msg)
{
    (void) arg, (void) level, (void) file, (void) line, (void) msg;
}

static const kvs__api_limits_t k_limits[4] = {
    {256, 0, NULL, 0},
    {16, 4, "m", 0},
    {4096, 0, "test-model", 0},
    {2, 0, NULL, 0},
};

static void check_accepted(const kvs__api_limits_t *lim, const kvs_server_tokenizer_t *tok,
                           int chat, const kvs__api_req_t *q)
{
    if (q->chat != chat || q->prompt == NULL || q->prompt_len == 0) abort();
    for (uint32_t i = 0; i < q->prompt_len; i++)
        if (q->prompt[i] >= tok->vocab_size) abort();
    if (q->max_tokens < 1 || (uint64_t) q->prompt_len + q->max_tokens > lim->max_context) abort();
    const kvs_sample_params_t *sp = &q->sampling;
    if (!(sp->temperature >= 0 && sp->temperature <= 2) || !(sp->top_p > 0 && sp->top_p <= 1))
        abort();
    if (kvs_sample_params_invalid(sp, tok->vocab_size) != NULL) abort();
    if (q->include_usage && !q->stream) abort();
    if (q->n_stops > KVS__MAX_STOPS) abort();
    for (uint32_t i = 0; i < q->n_stops; i++)
        if (q->stop_lens[i] < 1 || q->stop_lens[i] > KVS__MAX_STOP_LEN ||
            strlen(q->stops[i]) != q->stop_lens[i])
            abort();
    if (q->stop_ids == NULL) abort(); /* the EOS first, unless ignore_eos dropped it */
    for (uint32_t i = 0; i < q->n_stop_ids; i++)
        if (q->stop_ids[i] >= tok->vocab_size) abort();
    if (q->has_room != (q->role != KVS_SERVER_ROLE_NONE)) abort();
    if (q->has_room && q->room >= (UINT64_C(1) << 62)) abort();
    if (q->bootstrap && !q->has_room) abort();
    /* The ignored list goes into a header as it is. */
    size_t n = strnlen(q->ignored.names, sizeof(q->ignored.names));
    if (n == sizeof(q->ignored.names) || (n == 0) != (q->ignored.n == 0)) abort();
    for (size_t i = 0; i < n; i++)
        if ((unsigned char) q->ignored.names[i] < 0x20 ||
            (unsigned char) q->ignored.names[i] > 0x7E)
            abort();
}

static void check_refused(const kvs__api_err_t *e, int alloc_failed)
{
    if (e->status != 400 && e->status != 404 && !(alloc_failed && e->status == 500)) abort();
    if (e->type == NULL || e->message[0] == '\0') abort();
    if (strnlen(e->message, sizeof(e->message)) == sizeof(e->message) ||
        strnlen(e->param, sizeof(e->param)) == sizeof(e->param))
        abort();
}

/* One parse; returns its status with *q filled (the caller finishes it) on success. */
static kvs_status_t parse(const kvs__api_limits_t *lim, int strict, int chat, const char *body,
                          size_t len, int alloc_failed, kvs__api_req_t *q, kvs__api_err_t *e)
{
    kvs__api_limits_t l = *lim;
    l.strict = strict;
    kvs_server_tokenizer_t tok = kvs_server_byte_tokenizer();
    memset(q, 0, sizeof(*q));
    kvs_status_t st = kvs__api_parse(&l, &tok, chat, body, len, q, e);
    if (st == KVS_OK)
        check_accepted(&l, &tok, chat, q);
    else if (st == KVS_ERR_INVALID || st == KVS_ERR_NOMEM)
        check_refused(e, alloc_failed);
    else
        abort();
    if (st == KVS_OK && strict && q->ignored.n != 0) abort();
    return st;
}

/* The router's path: unknown fields removed, then nothing left for a strict parse to call
 * unknown. */
static void check_cleaned(const kvs__api_limits_t *lim, int chat, const char *body, size_t len)
{
    json_t *root = json_loadb(body, len, 0, NULL);
    if (!json_is_object(root)) {
        json_decref(root);
        return;
    }
    kvs__api_ignored_t ign;
    memset(&ign, 0, sizeof(ign));
    kvs__api_err_t e;
    if (kvs__api_check_fields(root, chat, 0, 1, &ign, &e) == KVS_OK) {
        char *text = json_dumps(root, JSON_COMPACT);
        if (text != NULL) {
            kvs__api_req_t q;
            kvs_status_t st = parse(lim, 1, chat, text, strlen(text), 0, &q, &e);
            if (st == KVS_OK) kvs__api_req_fini(&q);
            if (st != KVS_OK && e.code != NULL && strcmp(e.code, "unknown_field") == 0) abort();
            kvs_free(text);
        }
    }
    json_decref(root);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kvs_log_set_sink(drop_log, NULL); /* refusals are logged at debug level, NOMEM as errors */
    kvs__json_init();
    if (size < 1) return 0;
    int chat = data[0] & 1;
    const kvs__api_limits_t *lim = &k_limits[(data[0] >> 1) & 3];
    unsigned fail_at = data[0] >> 3;
    const char *body = (const char *) data + 1;
    size_t len = size - 1;
    kvs_alloc_stats_t before, after;
    kvs_alloc_stats(&before);
    kvs__api_req_t q;
    kvs__api_err_t e;
    if (fail_at != 0) {
        kvs_alloc_stats_t a, b;
        kvs_alloc_stats(&a);
        json_decref(json_loadb(body, len, 0, NULL));
        kvs_alloc_stats(&b);
        kvs_alloc_fail_at(b.total_allocs - a.total_allocs + fail_at);
        kvs_status_t st = parse(lim, fail_at & 1, chat, body, len, 1, &q, &e);
        kvs_alloc_fail_at(0);
        if (st == KVS_OK) kvs__api_req_fini(&q);
    } else {
        kvs__api_req_t lq;
        kvs__api_err_t le;
        kvs_status_t ss = parse(lim, 1, chat, body, len, 0, &q, &e);
        kvs_status_t ls = parse(lim, 0, chat, body, len, 0, &lq, &le);
        /* Strict accepts exactly the lenient acceptances that ignored nothing, with the same
         * result; when both refuse without an unknown field in play, for the same reason. */
        if (ss == KVS_OK && (ls != KVS_OK || lq.ignored.n != 0)) abort();
        if (ls == KVS_OK && lq.ignored.n == 0 && ss != KVS_OK) abort();
        if (ss == KVS_OK && (q.prompt_len != lq.prompt_len || q.max_tokens != lq.max_tokens ||
                             memcmp(q.prompt, lq.prompt, q.prompt_len * sizeof(uint32_t)) != 0))
            abort();
        if (ss != KVS_OK && ls != KVS_OK && (e.code == NULL || strcmp(e.code, "unknown_field")) &&
            (e.status != le.status || strcmp(e.param, le.param) != 0))
            abort();
        if (ss == KVS_OK) kvs__api_req_fini(&q);
        if (ls == KVS_OK) kvs__api_req_fini(&lq);
        check_cleaned(lim, chat, body, len);
    }
    kvs_alloc_stats(&after);
    if (after.live_blocks != before.live_blocks) abort();
    return 0;
}

#ifdef KVS_FUZZ_WRITE_SEEDS
/* [flags byte][body]: flags 0 completions, 1 chat (limits 0, no failed allocation). */
static const struct {
    const char *name;
    int chat;
    const char *body;
} k_seeds[] = {
    {"01_completion_min", 0, "{\"prompt\":\"hello\"}"},
    {"02_completion_all", 0,
     "{\"model\":\"m\",\"prompt\":\"hello\",\"max_tokens\":8,\"temperature\":0.7,\"top_p\":0.9,"
     "\"n\":1,\"stream\":true,\"stream_options\":{\"include_usage\":true},\"stop\":[\"\\n\",\"x\"],"
     "\"presence_penalty\":0.5,\"frequency_penalty\":-1,\"logit_bias\":{},\"logprobs\":0,"
     "\"user\":\"u\",\"seed\":42,\"stop_token_ids\":[1,2],\"echo\":false,\"best_of\":1,"
     "\"suffix\":\"\"}"},
    {"03_completion_ids", 0, "{\"prompt\":[[104,105]],\"max_tokens\":2,\"stop\":\"i\"}"},
    {"04_completion_kvstage", 0,
     "{\"prompt\":\"ab\",\"kvstage\":{\"room\":7,\"role\":\"decode\",\"bootstrap\":\"tcp://h:1\","
     "\"prefill\":\"http://p:2\"}}"},
    {"05_completion_unknown", 0,
     "{\"prompt\":\"ab\",\"service_tier\":\"auto\",\"kvstage\":{\"room\":1,\"role\":\"prefill\","
     "\"x\":1},\"stream\":true,\"stream_options\":{\"y\":2}}"},
    {"06_chat_min", 1, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}"},
    {"07_chat_all", 1,
     "{\"model\":\"m\",\"messages\":[{\"role\":\"system\",\"content\":\"be brief\"},"
     "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"h\"}],\"name\":\"n\"},"
     "{\"role\":\"assistant\",\"content\":\"ok\"},{\"role\":\"developer\",\"content\":\"d\"}],"
     "\"max_completion_tokens\":4,\"temperature\":0,\"top_p\":1,\"n\":1,\"stream\":false,"
     "\"stop\":null,\"logprobs\":false,\"top_logprobs\":0,\"response_format\":{\"type\":\"text\"},"
     "\"tools\":[],\"tool_choice\":\"none\",\"parallel_tool_calls\":true,\"store\":false,"
     "\"metadata\":{},\"seed\":1,\"user\":\"u\"}"},
    {"08_chat_unknown", 1,
     "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\",\"tool_calls\":[]}],\"echo\":false,"
     "\"reasoning_effort\":\"low\"}"},
    {"09_chat_refused", 1,
     "{\"messages\":[{\"role\":\"bot\",\"content\":5}],\"prompt\":\"x\",\"n\":2}"},
};

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s DIR\n", argv[0]);
        return 2;
    }
    int bad = 0;
    for (size_t i = 0; i < sizeof(k_seeds) / sizeof(k_seeds[0]); i++) {
        char path[4096];
        snprintf(path, sizeof(path), "%s/%s", argv[1], k_seeds[i].name);
        FILE *f = fopen(path, "wb");
        unsigned char flags = (unsigned char) k_seeds[i].chat;
        size_t len = strlen(k_seeds[i].body);
        int b =
            f == NULL || fwrite(&flags, 1, 1, f) != 1 || fwrite(k_seeds[i].body, 1, len, f) != len;
        if (f != NULL && fclose(f) != 0) b = 1;
        if (b) perror(path);
        bad |= b;
    }
    return bad;
}
#endif
