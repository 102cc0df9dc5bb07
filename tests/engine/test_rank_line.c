/* Tests for serve/engine/rank_line.c: a round trip of every request and event kind, literal
 * lines that pin the text format, the decoders' refusal of truncated, malformed, over-long and
 * mismatched input (exact-size heap copies, so ASan sees any over-read), and the transfer
 * counters' table (kvstage/pd.h) that the stats line is written from. */
#include "kvs_test.h"

#include <string.h>

#include "engine/rank_line.h"

/* A heap copy of s without its NUL: a decoder reading past len trips ASan. */
static char *exact(const char *s, size_t *len_p)
{
    size_t n = strlen(s);
    char *p = malloc(n ? n : 1);
    assert_non_null(p);
    memcpy(p, s, n);
    *len_p = n;
    return p;
}

static kvs_logit_bias_t g_bias[KVS_SAMPLE_BIAS_LIMIT]; /* decoded logit biases */

static kvs_status_t req_decode(const char *s, uint32_t *ids, uint32_t cap,
                               kvs_rank_line_request_t *q, const char **why)
{
    size_t n;
    char *p = exact(s, &n);
    kvs_status_t st = kvs_rank_line_request_decode(p, n, ids, cap, g_bias, q, why);
    free(p);
    return st;
}

static kvs_status_t ev_decode(const char *s, kvs_rank_line_event_t *ev)
{
    size_t n;
    char *p = exact(s, &n);
    const char *why = NULL;
    kvs_status_t st = kvs_rank_line_event_decode(p, n, ev, &why);
    if (st != KVS_OK) assert_non_null(why);
    free(p);
    return st;
}

/* Encodes, checks the text, decodes it again (without its newline). */
static void req_round_trip(const kvs_rank_line_request_t *q, const char *want,
                           kvs_rank_line_request_t *back_p, uint32_t *ids, uint32_t cap)
{
    char buf[1024];
    size_t n = 0;
    assert_true(kvs_rank_line_request_size(q) <= sizeof(buf));
    assert_int_equal(kvs_rank_line_request_encode(q, buf, sizeof(buf), &n), KVS_OK);
    assert_int_equal(n, strlen(buf));
    assert_true(n > 0 && buf[n - 1] == '\n');
    assert_true(n < kvs_rank_line_request_size(q));
    if (want != NULL) assert_string_equal(buf, want);
    buf[n - 1] = '\0';
    const char *why = NULL;
    assert_int_equal(req_decode(buf, ids, cap, back_p, &why), KVS_OK);
    assert_null(why);
    /* Too short a buffer, by one byte: refused. */
    assert_int_equal(kvs_rank_line_request_encode(q, buf, n, &n), KVS_ERR_NOSPACE);
}

static void test_requests_round_trip(void **state)
{
    (void) state;
    char line_buf[256];
    size_t line_len;
    uint32_t ids[16], prompt[5] = {1, 22, 333, 4294967295u, 0};
    kvs_rank_line_request_t back;
    const kvs_logit_bias_t bias[2] = {{4294967295u, -100.0f}, {0, 0.1f}};

    kvs_rank_line_request_t q = {.kind = KVS_RANK_LINE_SUBMIT,
                                 .submit = {.room = 18446744073709551615ull,
                                            .max_new = 4294967295u,
                                            .sampling = {.temperature = 0.5f,
                                                         .top_p = 0.9f,
                                                         .top_k = 4294967295u,
                                                         .min_p = 0.05f,
                                                         .presence_penalty = -2.0f,
                                                         .frequency_penalty = 1.5f,
                                                         .repetition_penalty = 1.25f,
                                                         .bias = bias,
                                                         .n_bias = 2},
                                            .seed = 7,
                                            .eos = -1,
                                            .prompt_len = 5,
                                            .prompt = prompt}};
    req_round_trip(&q,
                   "submit 18446744073709551615 1 4294967295 0.5 0.899999976 4294967295 "
                   "0.0500000007 -2 1.5 1.25 7 -1 -1 0 2 4294967295 -100 0 0.100000001 5 1 22 333 "
                   "4294967295 0\n",
                   &back, ids, 16);
    assert_int_equal(back.kind, KVS_RANK_LINE_SUBMIT);
    assert_true(back.submit.room == q.submit.room);
    assert_int_equal(back.submit.max_new, q.submit.max_new);
    const kvs_sample_params_t *a = &q.submit.sampling, *b = &back.submit.sampling;
    assert_true(b->temperature == a->temperature && b->top_p == a->top_p && b->top_k == a->top_k &&
                b->min_p == a->min_p && b->presence_penalty == a->presence_penalty &&
                b->frequency_penalty == a->frequency_penalty &&
                b->repetition_penalty == a->repetition_penalty);
    assert_int_equal(b->n_bias, 2);
    assert_ptr_equal(b->bias, g_bias);
    assert_memory_equal(g_bias, bias, sizeof(bias));
    assert_int_equal(back.submit.seed, 7);
    assert_int_equal(back.submit.eos, -1);
    assert_int_equal(back.submit.prompt_len, 5);
    assert_ptr_equal(back.submit.prompt, ids);
    assert_memory_equal(ids, prompt, sizeof(prompt));

    q.submit.eos = 4294967294ll;
    q.submit.sampling = (kvs_sample_params_t){.temperature = 0, .top_p = 1};
    q.submit.prompt_len = 1;
    req_round_trip(
        &q, "submit 18446744073709551615 1 4294967295 0 1 0 0 0 0 0 7 4294967294 -1 0 0 1 1\n",
        &back, ids, 16);
    assert_int_equal(back.submit.eos, 4294967294ll);
    assert_int_equal(back.submit.peer_len, 0);

    /* A per-room decode submit carries its prefill instance's description, whole. */
    static const char peer[] = "tcp://127.0.0.1:5,1,1,tcp://127.0.0.1:6";
    q.submit.peer = peer;
    q.submit.peer_len = strlen(peer);
    req_round_trip(&q,
                   "submit 18446744073709551615 1 4294967295 0 1 0 0 0 0 0 7 4294967294 -1 0 0 1 1 "
                   "peer tcp://127.0.0.1:5,1,1,tcp://127.0.0.1:6\n",
                   &back, ids, 16);
    assert_int_equal(back.submit.peer_len, strlen(peer));
    assert_memory_equal(back.submit.peer, peer, strlen(peer));
    static const char spaced[] = "tcp://a b";
    q.submit.peer = spaced; /* a description cannot hold a space */
    q.submit.peer_len = strlen(spaced);
    char sb[256];
    size_t sn;
    assert_int_equal(kvs_rank_line_request_encode(&q, sb, sizeof(sb), &sn), KVS_ERR_INVALID);
    q.submit.peer = NULL;
    q.submit.peer_len = 0;

    kvs_rank_line_request_t stop = {
        .kind = KVS_RANK_LINE_STOP, .room = 42, .choice = KVS_LLM_CHOICE_ALL};
    req_round_trip(&stop, "stop 42\n", &back, ids, 16);
    assert_int_equal(back.kind, KVS_RANK_LINE_STOP);
    assert_int_equal(back.room, 42);
    assert_true(back.choice == KVS_LLM_CHOICE_ALL);
    stop.choice = 15; /* one choice of the room */
    req_round_trip(&stop, "stop 42 15\n", &back, ids, 16);
    assert_int_equal(back.choice, 15);
    stop.choice = 0;
    req_round_trip(&stop, "stop 42 0\n", &back, ids, 16);
    assert_int_equal(back.choice, 0);

    /* Choices: 0 is written as 1; 16 at most. */
    q.submit.choices = 16;
    req_round_trip(&q,
                   "submit 18446744073709551615 16 4294967295 0 1 0 0 0 0 0 7 4294967294 -1 0 0 1 "
                   "1\n",
                   &back, ids, 16);
    assert_int_equal(back.submit.choices, 16);
    q.submit.choices = 17;
    assert_int_equal(kvs_rank_line_request_encode(&q, line_buf, sizeof(line_buf), &line_len),
                     KVS_ERR_INVALID);
    q.submit.choices = 0;

    kvs_rank_line_request_t match = {.kind = KVS_RANK_LINE_MATCH, .match_len = 3, .match = prompt};
    req_round_trip(&match, "match 3 1 22 333\n", &back, ids, 16);
    assert_int_equal(back.kind, KVS_RANK_LINE_MATCH);
    assert_int_equal(back.match_len, 3);
    assert_memory_equal(back.match, prompt, 3 * sizeof(uint32_t));

    kvs_rank_line_request_t stats = {.kind = KVS_RANK_LINE_STATS};
    req_round_trip(&stats, "stats\n", &back, ids, 16);
    assert_int_equal(back.kind, KVS_RANK_LINE_STATS);
    kvs_rank_line_request_t quit = {.kind = KVS_RANK_LINE_QUIT};
    req_round_trip(&quit, "quit\n", &back, ids, 16);
    assert_int_equal(back.kind, KVS_RANK_LINE_QUIT);

    /* Encoder refusals. */
    char buf[64];
    size_t n;
    kvs_rank_line_request_t none = {.kind = KVS_RANK_LINE_NONE};
    assert_int_equal(kvs_rank_line_request_encode(&none, buf, sizeof(buf), &n), KVS_ERR_INVALID);
    q.submit.eos = -2;
    assert_int_equal(kvs_rank_line_request_encode(&q, buf, sizeof(buf), &n), KVS_ERR_INVALID);
    q.submit.eos = -1;
    q.submit.sampling.n_bias = 1; /* biases missing */
    assert_int_equal(kvs_rank_line_request_encode(&q, buf, sizeof(buf), &n), KVS_ERR_INVALID);
    q.submit.sampling.n_bias = 0;
    q.submit.prompt = NULL;
    assert_int_equal(kvs_rank_line_request_encode(&q, buf, sizeof(buf), &n), KVS_ERR_INVALID);
    assert_int_equal(kvs_rank_line_request_encode(&stats, buf, 0, &n), KVS_ERR_NOSPACE);
}

/* Literal lines as `kvstage generate` and the server write them. */
static void test_request_literals(void **state)
{
    (void) state;
    uint32_t ids[16];
    kvs_rank_line_request_t q;
    const char *why;
    assert_int_equal(
        req_decode(
            "submit 5 1 5 0.5 0.899999976 40 0.1 0.5 -0.25 1.1 7 99 -1 0 1 3 2.5 10 1 2 3 4 5 6 7 "
            "8 9 10",
            ids, 16, &q, &why),
        KVS_OK);
    assert_int_equal(q.submit.room, 5);
    assert_int_equal(q.submit.max_new, 5);
    const kvs_sample_params_t *sp = &q.submit.sampling;
    assert_true(sp->temperature == 0.5f && sp->top_p == 0.9f && sp->top_k == 40 &&
                sp->min_p == 0.1f && sp->presence_penalty == 0.5f &&
                sp->frequency_penalty == -0.25f && sp->repetition_penalty == 1.1f);
    assert_int_equal(sp->n_bias, 1);
    assert_int_equal(sp->bias[0].token, 3);
    assert_true(sp->bias[0].bias == 2.5f);
    assert_int_equal(q.submit.seed, 7);
    assert_int_equal(q.submit.eos, 99);
    assert_int_equal(q.submit.prompt_len, 10);
    assert_int_equal(ids[9], 10);
    assert_int_equal(req_decode("match 9 9 8 7 6 5 4 3 2 1", ids, 16, &q, &why), KVS_OK);
    assert_int_equal(q.match_len, 9);
    assert_int_equal(ids[0], 9);
    assert_int_equal(req_decode("stop 18446744073709551615", ids, 16, &q, &why), KVS_OK);
    assert_true(q.room == 18446744073709551615ull);
}

typedef struct {
    const char *line;
    kvs_rank_line_kind_t kind;
    kvs_status_t st;
    const char *why;
} bad_req_t;

static void test_bad_requests(void **state)
{
    (void) state;
    static const bad_req_t cases[] = {
        {"", KVS_RANK_LINE_NONE, KVS_ERR_INVALID, "expected submit, stop, match, stats or quit"},
        {"hello", KVS_RANK_LINE_NONE, KVS_ERR_INVALID, "expected"},
        {"submit", KVS_RANK_LINE_NONE, KVS_ERR_INVALID, "expected"},
        {"stats ", KVS_RANK_LINE_NONE, KVS_ERR_INVALID, "expected"},
        {"quit now", KVS_RANK_LINE_NONE, KVS_ERR_INVALID, "expected"},
        /* truncated */
        {"submit 1 1 2 0.5 1", KVS_RANK_LINE_SUBMIT, KVS_ERR_INVALID, "submit needs"},
        {"submit 1 1 2 0.5 1 0 0 0 0 0 3", KVS_RANK_LINE_SUBMIT, KVS_ERR_INVALID, "EOS must be"},
        {"submit 1 1 2 0.5 1 0 0 0 0 0 3 -1 -1 0 0 3 1 2", KVS_RANK_LINE_SUBMIT, KVS_ERR_INVALID,
         "prompt token ids"},
        {"stop", KVS_RANK_LINE_NONE, KVS_ERR_INVALID, "expected"},
        {"stop ", KVS_RANK_LINE_STOP, KVS_ERR_INVALID, "stop needs ROOM"},
        {"match 3 1 2", KVS_RANK_LINE_MATCH, KVS_ERR_INVALID, "match: prompt token ids"},
        {"submit 1 1 2 0.5 1 0 0 0 0 0 3 -1 -1 0 0 1 1 peer ", KVS_RANK_LINE_SUBMIT,
         KVS_ERR_INVALID, "PEER must be"},
        {"submit 1 1 2 0.5 1 0 0 0 0 0 3 -1 -1 0 0 1 1 peer a b", KVS_RANK_LINE_SUBMIT,
         KVS_ERR_INVALID, "PEER must be"},
        {"submit 1 1 2 0.5 1 0 0 0 0 0 3 -1 -1 0 0 1 1 pear a", KVS_RANK_LINE_SUBMIT,
         KVS_ERR_INVALID, "more token ids"},
        /* bad numbers */
        {"submit x 1 2 0.5 1 0 0 0 0 0 3 -1 -1 0 0 1 1", KVS_RANK_LINE_SUBMIT, KVS_ERR_INVALID,
         "submit needs"},
        {"submit 1 1 2 zero 1 0 0 0 0 0 3 -1 -1 0 0 1 1", KVS_RANK_LINE_SUBMIT, KVS_ERR_INVALID,
         "submit needs"},
        {"submit 1 1 2 0.5x 1 0 0 0 0 0 3 -1 -1 0 0 1 1", KVS_RANK_LINE_SUBMIT, KVS_ERR_INVALID,
         "submit needs"},
        {"submit 1 1 2 1e99 1 0 0 0 0 0 3 -1 -1 0 0 1 1", KVS_RANK_LINE_SUBMIT, KVS_ERR_INVALID,
         "submit needs"},
        {"submit 1 1 4294967296 0.5 1 0 0 0 0 0 3 -1 -1 0 0 1 1", KVS_RANK_LINE_SUBMIT,
         KVS_ERR_INVALID, "submit"},
        {"submit 18446744073709551616 1 2 0.5 1 0 0 0 0 0 3 -1 -1 0 0 1 1", KVS_RANK_LINE_SUBMIT,
         KVS_ERR_INVALID, "submit needs"},
        {"submit 1 1 2 0.5 1 0 0 0 0 0 3 -2 -1 0 0 1 1", KVS_RANK_LINE_SUBMIT, KVS_ERR_INVALID,
         "EOS must be"},
        {"submit 1 1 2 0.5 1 0 0 0 0 0 3 4294967295 -1 0 0 1 1", KVS_RANK_LINE_SUBMIT,
         KVS_ERR_INVALID, "EOS"},
        {"submit 1 1 2 0.5 1 0 0 0 0 0 3 -1 -1 0 0 1 4294967296", KVS_RANK_LINE_SUBMIT,
         KVS_ERR_INVALID, "prompt token ids"},
        {"submit 1 1 2 0.5 1 0 0 0 0 0 3 -1 -1 0 0 1 -4", KVS_RANK_LINE_SUBMIT, KVS_ERR_INVALID,
         "prompt token ids"},
        {"submit 1 1 2 0.5 1 -1 0 0 0 0 3 -1 -1 0 0 1 1", KVS_RANK_LINE_SUBMIT, KVS_ERR_INVALID,
         "submit needs"},
        {"submit 1 1 2 0.5 1 4294967296 0 0 0 0 3 -1 -1 0 0 1 1", KVS_RANK_LINE_SUBMIT,
         KVS_ERR_INVALID, "submit needs"},
        {"submit 1 1 2 0.5 1 0 0 0 0 x 3 -1 -1 0 0 1 1", KVS_RANK_LINE_SUBMIT, KVS_ERR_INVALID,
         "submit needs"},
        {"submit 1 1 2 0.5 1 0 0 0 0 0 3 -1 -1 0 301 1 1", KVS_RANK_LINE_SUBMIT, KVS_ERR_INVALID,
         "at most 300"},
        {"submit 1 1 2 0.5 1 0 0 0 0 0 3 -1 -1 0 x 1 1", KVS_RANK_LINE_SUBMIT, KVS_ERR_INVALID,
         "B must be"},
        {"submit 1 1 2 0.5 1 0 0 0 0 0 3 -1 -1 0 1 7", KVS_RANK_LINE_SUBMIT, KVS_ERR_INVALID,
         "logit biases"},
        {"submit 1 1 2 0.5 1 0 0 0 0 0 3 -1 -1 0 1 7 x 1 1", KVS_RANK_LINE_SUBMIT, KVS_ERR_INVALID,
         "logit biases"},
        {"submit 1 1 2 0.5 1 0 0 0 0 0 3 -1 -1 0 1 -7 1 1 1", KVS_RANK_LINE_SUBMIT, KVS_ERR_INVALID,
         "logit biases"},
        {"submit  1 2 0.5 1 3 -1 1 1", KVS_RANK_LINE_SUBMIT, KVS_ERR_INVALID, "submit needs"},
        {"stop 1x", KVS_RANK_LINE_STOP, KVS_ERR_INVALID, "stop needs ROOM"},
        {"stop 1 2 3", KVS_RANK_LINE_STOP, KVS_ERR_INVALID, "stop needs ROOM [CHOICE]"},
        {"stop 1 16", KVS_RANK_LINE_STOP, KVS_ERR_INVALID, "CHOICE 0..15"},
        {"stop 1 x", KVS_RANK_LINE_STOP, KVS_ERR_INVALID, "CHOICE 0..15"},
        {"submit 1 0 2 0.5 1 0 0 0 0 0 3 -1 -1 0 0 1 1", KVS_RANK_LINE_SUBMIT, KVS_ERR_INVALID,
         "CHOICES must be 1..16"},
        {"submit 1 17 2 0.5 1 0 0 0 0 0 3 -1 -1 0 0 1 1", KVS_RANK_LINE_SUBMIT, KVS_ERR_INVALID,
         "CHOICES must be 1..16"},
        {"match x 1", KVS_RANK_LINE_MATCH, KVS_ERR_INVALID, "match needs N"},
        {"match 0", KVS_RANK_LINE_MATCH, KVS_ERR_INVALID, "match needs N"},
        /* N mismatching the ids */
        {"submit 1 1 2 0.5 1 0 0 0 0 0 3 -1 -1 0 0 1 1 2", KVS_RANK_LINE_SUBMIT, KVS_ERR_INVALID,
         "more token ids than N"},
        {"submit 1 1 2 0.5 1 0 0 0 0 0 3 -1 -1 0 0 1 1 ", KVS_RANK_LINE_SUBMIT, KVS_ERR_INVALID,
         "more token ids"},
        {"match 1 1 2", KVS_RANK_LINE_MATCH, KVS_ERR_INVALID, "match: more token ids than N"},
        /* N the rank refuses: submit's ids are not read, match's are checked */
        {"submit 1 1 2 0.5 1 0 0 0 0 0 3 -1 -1 0 0 0", KVS_RANK_LINE_SUBMIT, KVS_ERR_NOSPACE,
         "prompt length"},
        {"submit 1 1 2 0.5 1 0 0 0 0 0 3 -1 -1 0 0 x 1", KVS_RANK_LINE_SUBMIT, KVS_ERR_NOSPACE,
         "prompt length"},
        {"submit 1 1 2 0.5 1 0 0 0 0 0 3 -1 -1 0 0 5 1 2 3 4 5", KVS_RANK_LINE_SUBMIT,
         KVS_ERR_NOSPACE, "prompt"},
        {"match 5 1 2 3 4 5", KVS_RANK_LINE_MATCH, KVS_ERR_NOSPACE, "match: more token ids"},
        {"match 5 1 2 3 4 x", KVS_RANK_LINE_MATCH, KVS_ERR_INVALID, "match: prompt token ids"},
    };
    uint32_t ids[4];
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        kvs_rank_line_request_t q;
        const char *why = NULL;
        kvs_status_t st = req_decode(cases[i].line, ids, 4, &q, &why);
        if (st != cases[i].st || q.kind != cases[i].kind || why == NULL ||
            strstr(why, cases[i].why) == NULL)
            fail_msg("\"%s\": status %d kind %d why \"%s\"", cases[i].line, st, q.kind,
                     why ? why : "(null)");
    }
    kvs_rank_line_request_t q;
    const char *why;
    /* A refused submit still names its room (rank 0 answers with a rejected line). */
    assert_int_equal(req_decode("submit 9 1 2 0.5 1 0 0 0 0 0 3 -1 -1 0 0 5 1", ids, 4, &q, &why),
                     KVS_ERR_NOSPACE);
    assert_int_equal(q.submit.room, 9);
    assert_int_equal(req_decode("match 5 1 2 3 4 5", ids, 4, &q, &why), KVS_ERR_NOSPACE);
    assert_int_equal(q.match_len, 5);
    /* A NUL ends the line; a line over the limit is refused without being read. */
    assert_int_equal(kvs_rank_line_request_decode("stop 3\0 junk", 12, ids, 4, g_bias, &q, &why),
                     KVS_OK);
    assert_int_equal(q.room, 3);
    assert_int_equal(kvs_rank_line_request_decode("stats", (size_t) KVS_RANK_LINE_MAX + 1, ids, 4,
                                                  g_bias, &q, &why),
                     KVS_ERR_INVALID);
    /* Every truncation of a good submit that loses an id or more is refused. */
    const char *good = "submit 12 1 3 0.25 0.75 0 0 0 0 0 99 7 -1 0 0 3 10 20 30";
    for (size_t cut = 0; cut + 2 <= strlen(good); cut++) {
        char buf[64];
        memcpy(buf, good, cut);
        buf[cut] = '\0';
        if (req_decode(buf, ids, 4, &q, &why) == KVS_OK)
            fail_msg("truncated to \"%s\": decoded", buf);
    }
}

static kvs_rank_line_event_t event_round_trip(const kvs_rank_line_event_t *ev, const char *want)
{
    char buf[4096];
    size_t n = 0;
    assert_int_equal(kvs_rank_line_event_encode(ev, buf, sizeof(buf), &n), KVS_OK);
    assert_int_equal(n, strlen(buf));
    assert_true(n > 0 && buf[n - 1] == '\n');
    if (want != NULL) assert_string_equal(buf, want);
    assert_int_equal(kvs_rank_line_event_encode(ev, buf, n, &n), KVS_ERR_NOSPACE);
    assert_int_equal(kvs_rank_line_event_encode(ev, buf, sizeof(buf), &n), KVS_OK);
    kvs_rank_line_event_t back;
    assert_int_equal(ev_decode(buf, &back), KVS_OK); /* the newline is whitespace */
    assert_int_equal(back.kind, ev->kind);
    return back;
}

/* Logprobs ride on the submit line and on token and prompt events. */
static void test_logprobs_lines(void **state)
{
    (void) state;
    uint32_t ids[4], prompt[2] = {5, 6};
    kvs_rank_line_request_t back;
    kvs_rank_line_request_t q = {.kind = KVS_RANK_LINE_SUBMIT,
                                 .submit = {.room = 3,
                                            .max_new = 2,
                                            .sampling = {.top_p = 1},
                                            .eos = 9,
                                            .logprobs = 1,
                                            .top_logprobs = 20,
                                            .prompt_logprobs = 1,
                                            .prompt_len = 2,
                                            .prompt = prompt}};
    req_round_trip(&q, "submit 3 1 2 0 1 0 0 0 0 0 0 9 20 1 0 2 5 6\n", &back, ids, 4);
    assert_int_equal(back.submit.logprobs, 1);
    assert_int_equal(back.submit.top_logprobs, 20);
    assert_int_equal(back.submit.prompt_logprobs, 1);
    q.submit.top_logprobs = 0;
    q.submit.prompt_logprobs = 0;
    req_round_trip(&q, "submit 3 1 2 0 1 0 0 0 0 0 0 9 0 0 0 2 5 6\n", &back, ids, 4);
    assert_int_equal(back.submit.logprobs, 1);
    assert_int_equal(back.submit.top_logprobs, 0);
    /* Out of range: refused by the encoder and the decoder. */
    char buf[256];
    size_t n;
    q.submit.top_logprobs = 21;
    assert_int_equal(kvs_rank_line_request_encode(&q, buf, sizeof(buf), &n), KVS_ERR_INVALID);
    q.submit.top_logprobs = 0;
    q.submit.logprobs = 0;
    q.submit.prompt_logprobs = 1;
    assert_int_equal(kvs_rank_line_request_encode(&q, buf, sizeof(buf), &n), KVS_ERR_INVALID);
    const char *why = NULL;
    assert_int_equal(req_decode("submit 3 1 2 0 1 0 0 0 0 0 0 9 21 0 0 1 5", ids, 4, &back, &why),
                     KVS_ERR_INVALID);
    assert_non_null(strstr(why, "LOGPROBS must be"));
    assert_int_equal(req_decode("submit 3 1 2 0 1 0 0 0 0 0 0 9 -1 1 0 1 5", ids, 4, &back, &why),
                     KVS_ERR_INVALID);
    assert_non_null(strstr(why, "PROMPT_LOGPROBS"));
    assert_int_equal(req_decode("submit 3 1 2 0 1 0 0 0 0 0 0 9 x 0 0 1 5", ids, 4, &back, &why),
                     KVS_ERR_INVALID);

    kvs_rank_line_event_t ev;
    memset(&ev, 0, sizeof(ev));
    ev.kind = KVS_RANK_LINE_EV_TOKEN;
    ev.llm.room = 7;
    ev.llm.token = 11;
    ev.llm.index = 0;
    ev.llm.has_logprobs = 1;
    ev.llm.lp.logprob = -0.5f;
    ev.llm.lp.n_top = 2;
    ev.llm.lp.top[0] = (kvs_token_logprob_t){11, -0.5f};
    ev.llm.lp.top[1] = (kvs_token_logprob_t){4294967295u, -1.10000002f};
    kvs_rank_line_event_t b = event_round_trip(
        &ev, "{\"event\":\"token\",\"room\":7,\"token\":11,\"index\":0,\"logprob\":-0.5,"
             "\"top\":\"11 -0.5 4294967295 -1.10000002\"}\n");
    assert_int_equal(b.llm.has_logprobs, 1);
    assert_memory_equal(&b.llm.lp, &ev.llm.lp, sizeof(ev.llm.lp));
    /* The most alternatives there are, each float exact. */
    ev.kind = KVS_RANK_LINE_EV_PROMPT;
    ev.llm.index = 4;
    ev.llm.lp.n_top = KVS_LOGPROBS_TOP_MAX;
    for (uint32_t i = 0; i < KVS_LOGPROBS_TOP_MAX; i++)
        ev.llm.lp.top[i] = (kvs_token_logprob_t){100000 + i, -1.0f / 3.0f - (float) i * 7.1f};
    b = event_round_trip(&ev, NULL);
    assert_int_equal(b.llm.kind, KVS_LLM_EV_PROMPT);
    assert_int_equal(b.llm.index, 4);
    assert_memory_equal(&b.llm.lp, &ev.llm.lp, sizeof(ev.llm.lp));
    ev.llm.has_logprobs = 0;
    b = event_round_trip(&ev, "{\"event\":\"prompt\",\"room\":7,\"token\":11,\"index\":4}\n");
    assert_int_equal(b.llm.has_logprobs, 0);
    /* Malformed: one without the other, a bad pair, too many pairs. */
    const char *bad[] = {
        "{\"event\":\"token\",\"room\":1,\"logprob\":-1}",
        "{\"event\":\"token\",\"room\":1,\"top\":\"1 -1\"}",
        "{\"event\":\"token\",\"room\":1,\"logprob\":-1,\"top\":\"1\"}",
        "{\"event\":\"token\",\"room\":1,\"logprob\":-1,\"top\":\"x -1\"}",
        "{\"event\":\"token\",\"room\":1,\"logprob\":\"a\",\"top\":\"\"}",
        "{\"event\":\"token\",\"room\":1,\"logprob\":-1,\"top\":\"1 -1 2 -1 3 -1 4 -1 5 -1 6 -1 "
        "7 -1 8 -1 9 -1 10 -1 11 -1 12 -1 13 -1 14 -1 15 -1 16 -1 17 -1 18 -1 19 -1 20 -1 21 "
        "-1\"}",
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        assert_int_equal(ev_decode(bad[i], &b), KVS_ERR_INVALID);
}

static void test_events_round_trip(void **state)
{
    (void) state;
    kvs_rank_line_event_t ev = {
        .kind = KVS_RANK_LINE_EV_READY, .role = KVS_LLM_DECODE, .tp = 2, .load_s = 1.25};
    kvs_rank_line_event_t b = event_round_trip(
        &ev, "{\"event\":\"ready\",\"role\":\"decode\",\"tp\":2,\"load_s\":1.250}\n");
    assert_int_equal(b.role, KVS_LLM_DECODE);
    assert_int_equal(b.tp, 2);
    assert_true(b.load_s == 1.25);

    memset(&ev, 0, sizeof(ev));
    ev.kind = KVS_RANK_LINE_EV_TOKEN;
    ev.llm.room = 7;
    ev.llm.token = 4294967295u;
    ev.llm.index = 3;
    b = event_round_trip(&ev,
                         "{\"event\":\"token\",\"room\":7,\"token\":4294967295,\"index\":3}\n");
    assert_int_equal(b.llm.room, 7);
    assert_int_equal(b.llm.token, 4294967295u);
    assert_int_equal(b.llm.index, 3);
    assert_int_equal(b.llm.choice, 0);
    ev.llm.choice = 15; /* a further choice says which */
    b = event_round_trip(
        &ev, "{\"event\":\"token\",\"room\":7,\"token\":4294967295,\"index\":3,\"choice\":15}\n");
    assert_int_equal(b.llm.choice, 15);

    memset(&ev, 0, sizeof(ev));
    ev.kind = KVS_RANK_LINE_EV_DONE;
    kvs_llm_event_t *e = &ev.llm;
    e->kind = KVS_LLM_EV_DONE;
    e->room = 1;
    e->status = KVS_OK;
    e->finish = KVS_LLM_FINISH_LENGTH;
    e->prompt_len = 3;
    e->cached_tokens = 1;
    e->generated = 4;
    e->submitted_ns = 10;
    e->admitted_ns = 11;
    e->prefilled_ns = 12;
    e->kv_ready_ns = 13;
    e->first_token_ns = 14;
    e->done_ns = 18446744073709551615ull;
    b = event_round_trip(&ev,
                         "{\"event\":\"done\",\"room\":1,\"status\":\"ok\",\"finish\":\"length\","
                         "\"prompt_len\":3,\"cached\":1,\"generated\":4,\"submitted_ns\":10,"
                         "\"admitted_ns\":11,\"prefilled_ns\":12,\"kv_ready_ns\":13,"
                         "\"first_token_ns\":14,\"done_ns\":18446744073709551615}\n");
    assert_memory_equal(&b.llm, e, sizeof(*e));
    static const kvs_llm_finish_t finishes[] = {KVS_LLM_FINISH_EOS, KVS_LLM_FINISH_STOP,
                                                KVS_LLM_FINISH_HANDOFF, KVS_LLM_FINISH_ERROR};
    for (size_t i = 0; i < 4; i++) {
        e->finish = finishes[i];
        e->status = i == 3 ? KVS_ERR_ABORTED : KVS_OK;
        b = event_round_trip(&ev, NULL);
        assert_int_equal(b.llm.finish, finishes[i]);
        assert_int_equal(b.llm.status, e->status);
    }
    e->choice = 2;
    e->finish = KVS_LLM_FINISH_STOP;
    e->status = KVS_OK;
    b = event_round_trip(&ev, NULL);
    assert_memory_equal(&b.llm, e, sizeof(*e));

    memset(&ev, 0, sizeof(ev));
    ev.kind = KVS_RANK_LINE_EV_REJECTED;
    ev.llm.room = 2;
    ev.llm.status = KVS_ERR_INVALID;
    b = event_round_trip(&ev,
                         "{\"event\":\"rejected\",\"room\":2,\"status\":\"invalid argument\"}\n");
    assert_int_equal(b.llm.room, 2);
    assert_int_equal(b.llm.status, KVS_ERR_INVALID);

    memset(&ev, 0, sizeof(ev));
    ev.kind = KVS_RANK_LINE_EV_ERROR;
    snprintf(ev.text, sizeof(ev.text), "bad request line: more token ids than N");
    b = event_round_trip(
        &ev, "{\"event\":\"error\",\"message\":\"bad request line: more token ids than N\"}\n");
    assert_string_equal(b.text, ev.text);
    /* A message needing escapes comes back as it was. */
    snprintf(ev.text, sizeof(ev.text), "a \"quoted\" \\ tab\t nl\n \x01 é");
    b = event_round_trip(&ev, "{\"event\":\"error\",\"message\":\"a \\\"quoted\\\" \\\\ tab\\u0009 "
                              "nl\\u000a \\u0001 é\"}\n");
    assert_string_equal(b.text, ev.text);

    memset(&ev, 0, sizeof(ev));
    ev.kind = KVS_RANK_LINE_EV_MATCH;
    ev.cached = 8;
    ev.match_len = 9;
    b = event_round_trip(&ev, "{\"event\":\"match\",\"cached\":8,\"prompt_len\":9}\n");
    assert_int_equal(b.cached, 8);
    assert_int_equal(b.match_len, 9);
    assert_string_equal(b.text, "");
    ev.cached = 0;
    snprintf(ev.text, sizeof(ev.text), "match: prompt token ids");
    b = event_round_trip(
        &ev, "{\"event\":\"match\",\"cached\":0,\"error\":\"match: prompt token ids\"}\n");
    assert_string_equal(b.text, "match: prompt token ids");
    assert_int_equal(b.match_len, 0);

    memset(&ev, 0, sizeof(ev));
    ev.kind = KVS_RANK_LINE_EV_PEERS;
    ev.peers_down = 2;
    ev.peers_of = 3;
    ev.first_down = 1;
    b = event_round_trip(&ev, "{\"event\":\"peers\",\"down\":2,\"of\":3,\"first\":1}\n");
    assert_int_equal(b.peers_down, 2);
    assert_int_equal(b.peers_of, 3);
    assert_int_equal(b.first_down, 1);

    memset(&ev, 0, sizeof(ev));
    ev.kind = KVS_RANK_LINE_EV_STATS;
    ev.role = KVS_LLM_PREFILL;
    ev.rank = 1;
    ev.load_s = 0.5;
    ev.wall_s = 2.0;
    ev.final = 1;
    kvs_llm_stats_t *s = &ev.stats;
    s->steps = 1;
    s->forward_passes = 2;
    s->forward_ns = 3;
    s->prompt_tokens = 4;
    s->cached_tokens = 5;
    s->decode_tokens = 6;
    s->requests_ok = 7;
    s->requests_failed = 8;
    s->radix_pages = 9;
    s->preemptions = 26;
    s->pages_total = 30;
    s->pages_free = 29;
    s->queued = 10;
    s->running = 11;
    kvs_pd_metrics_t *m = &ev.metrics;
    m->rooms_succeeded = 12;
    m->rooms_failed = 13;
    m->chunks = 14;
    m->bulk_writes = 15;
    m->direct_writes = 16;
    m->bytes = 17;
    m->msgs_sent = 18;
    m->retries = 19;
    m->rejected = 20;
    m->ring_used = 21;
    m->ring_capacity = 22;
    m->live_rooms = 23;
    m->quarantined_rooms = 24;
    m->stashed_rooms = 25;
    b = event_round_trip(
        &ev, "{\"event\":\"stats\",\"role\":\"prefill\",\"rank\":1,\"steps\":1,"
             "\"forward_passes\":2,\"forward_ns\":3,\"prompt_tokens\":4,\"cached_tokens\":5,"
             "\"decode_tokens\":6,\"requests_ok\":7,\"requests_failed\":8,\"radix_pages\":9,"
             "\"preemptions\":26,\"pages_total\":30,\"pages_free\":29,\"rooms_succeeded\":12,"
             "\"rooms_failed\":13,"
             "\"live_rooms\":23,\"quarantined_rooms\":24,\"stashed_rooms\":25,\"chunks\":14,"
             "\"bulk_writes\":15,"
             "\"direct_writes\":16,\"bytes_moved\":17,\"control_messages\":18,\"retries\":19,"
             "\"rejected\":20,\"ring_used\":21,\"ring_capacity\":22,\"checksum_failures\":0,"
             "\"peer_instances\":0,\"queued\":10,\"running\":11,"
             "\"load_s\":0.500,\"wall_s\":2.000,\"final\":true}\n");
    assert_int_equal(b.role, KVS_LLM_PREFILL);
    assert_int_equal(b.rank, 1);
    assert_memory_equal(&b.stats, s, sizeof(*s));
    assert_memory_equal(&b.metrics, m, sizeof(*m));
    assert_true(b.load_s == 0.5 && b.wall_s == 2.0);
    assert_int_equal(b.final, 1);
    ev.final = 0;
    ev.role = KVS_LLM_COLOCATED;
    b = event_round_trip(&ev, NULL);
    assert_int_equal(b.final, 0);
    assert_int_equal(b.role, KVS_LLM_COLOCATED);

    ev.kind = (kvs_rank_line_event_kind_t) 99;
    char buf[64];
    size_t n;
    assert_int_equal(kvs_rank_line_event_encode(&ev, buf, sizeof(buf), &n), KVS_ERR_INVALID);
}

/* What the decoder takes from lines other writers could produce. */
static void test_event_leniency(void **state)
{
    (void) state;
    kvs_rank_line_event_t ev;
    /* Any order, whitespace, unknown fields skipped, absent numbers 0. */
    assert_int_equal(ev_decode(" { \"room\" : 5 , \"x\":[1], \"event\":\"token\" } ", &ev),
                     KVS_ERR_INVALID); /* arrays are no part of it */
    assert_int_equal(
        ev_decode(" { \"room\" : 5 , \"x\":null, \"y\":\"z\", \"event\":\"token\" } ", &ev),
        KVS_OK);
    assert_int_equal(ev.kind, KVS_RANK_LINE_EV_TOKEN);
    assert_int_equal(ev.llm.room, 5);
    assert_int_equal(ev.llm.token, 0);
    /* A done line without status or finish is a failure. */
    assert_int_equal(ev_decode("{\"event\":\"done\",\"room\":3}", &ev), KVS_OK);
    assert_int_equal(ev.llm.status, KVS_ERR_IO);
    assert_int_equal(ev.llm.finish, KVS_LLM_FINISH_ERROR);
    assert_int_equal(ev_decode("{\"event\":\"done\",\"status\":\"what\",\"finish\":\"why\"}", &ev),
                     KVS_OK);
    assert_int_equal(ev.llm.status, KVS_ERR_IO);
    assert_int_equal(ev.llm.finish, KVS_LLM_FINISH_ERROR);
    /* Only "final":false answers a stats question. */
    assert_int_equal(ev_decode("{\"event\":\"stats\",\"queued\":1}", &ev), KVS_OK);
    assert_int_equal(ev.final, 1);
    assert_int_equal(ev.stats.queued, 1);
    assert_int_equal(ev_decode("{\"event\":\"stats\",\"final\":false}", &ev), KVS_OK);
    assert_int_equal(ev.final, 0);
    /* An event this side does not know. */
    assert_int_equal(ev_decode("{\"event\":\"progress\",\"room\":1}", &ev), KVS_ERR_UNSUPPORTED);
    /* A long message is cut, not refused. */
    char line[1024];
    snprintf(line, sizeof(line), "{\"event\":\"error\",\"message\":\"%0600d\"}", 0);
    assert_int_equal(ev_decode(line, &ev), KVS_OK);
    assert_int_equal(strlen(ev.text), KVS_RANK_LINE_TEXT - 1);
    /* Escapes: \u with a surrogate pair, and a lone surrogate. */
    assert_int_equal(
        ev_decode("{\"event\":\"error\",\"message\":\"\\ud83d\\ude00\\u00e9\\/\\ud800\"}", &ev),
        KVS_OK);
    assert_string_equal(ev.text, "\xf0\x9f\x98\x80\xc3\xa9/\xef\xbf\xbd");
}

static void test_bad_events(void **state)
{
    (void) state;
    static const char *bad[] = {
        "",
        "   ",
        "[]",
        "{",
        "{}",
        "{\"event\":\"token\"",
        "{\"event\":\"token\",}",
        "{\"event\":\"token\",\"room\":}",
        "{\"event\":\"token\",\"room\":1}}",
        "{\"event\":\"token\"} x",
        "{\"event\":token}",
        "{\"event\":1}",
        "{event:\"token\"}",
        "{\"event\":\"tok\\x\"}",
        "{\"event\":\"tok\\u12\"}",
        "{\"event\":\"tok\x01\"}",
        "{\"event\":\"token\" \"room\":1}",
        /* bad numbers */
        "{\"event\":\"token\",\"room\":-1}",
        "{\"event\":\"token\",\"room\":1.5}",
        "{\"event\":\"token\",\"room\":1e3}",
        "{\"event\":\"token\",\"room\":01}",
        "{\"event\":\"token\",\"room\":18446744073709551616}",
        "{\"event\":\"token\",\"token\":4294967296}",
        "{\"event\":\"token\",\"room\":\"1\"}",
        "{\"event\":\"token\",\"room\":+1}",
        "{\"event\":\"ready\",\"load_s\":.5}",
        "{\"event\":\"ready\",\"load_s\":1.}",
        "{\"event\":\"ready\",\"load_s\":1e}",
        "{\"event\":\"ready\",\"load_s\":\"fast\"}",
        "{\"event\":\"ready\",\"role\":\"leader\"}",
        "{\"event\":\"stats\",\"final\":0}",
        "{\"event\":\"stats\",\"final\":tru}",
        "{\"event\":\"done\",\"status\":0}",
        "{\"event\":\"error\",\"message\":5}",
        "{\"event\":\"match\",\"error\":null}",
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        kvs_rank_line_event_t ev;
        if (ev_decode(bad[i], &ev) != KVS_ERR_INVALID) fail_msg("decoded: %s", bad[i]);
    }
    /* Over-long: refused without being read; too many fields. */
    kvs_rank_line_event_t ev;
    const char *why;
    assert_int_equal(kvs_rank_line_event_decode("{}", (size_t) KVS_RANK_LINE_MAX + 1, &ev, &why),
                     KVS_ERR_INVALID);
    char line[4096] = "{\"event\":\"token\"";
    for (int i = 0; i < 200; i++) snprintf(line + strlen(line), 20, ",\"f%d\":1", i);
    strcat(line, "}");
    assert_int_equal(ev_decode(line, &ev), KVS_ERR_INVALID);
    /* Every truncation of a good line is refused. */
    const char *good = "{\"event\":\"done\",\"room\":1,\"status\":\"ok\",\"finish\":\"length\"}";
    for (size_t cut = 0; cut < strlen(good); cut++) {
        char buf[128];
        memcpy(buf, good, cut);
        buf[cut] = '\0';
        if (ev_decode(buf, &ev) == KVS_OK) fail_msg("truncated to %s: decoded", buf);
    }
}

/* The transfer counters' table: one row per member, and every row with a line key in the stats
 * line, each with its own value back. */
static void test_metrics_table(void **state)
{
    (void) state;
    uint32_t nf;
    const kvs_pd_metric_field_t *f = kvs_pd_metrics_fields(&nf);
    assert_int_equal((size_t) nf * sizeof(uint64_t), sizeof(kvs_pd_metrics_t));
    uint32_t in_line = 0, prom = 0;
    for (uint32_t i = 0; i < nf; i++) {
        assert_int_equal(f[i].offset, i * sizeof(uint64_t)); /* the struct's order */
        for (uint32_t k = 0; k < i; k++) {
            assert_string_not_equal(f[i].field, f[k].field);
            if (f[i].line && f[k].line) assert_string_not_equal(f[i].line, f[k].line);
            if (f[i].json && f[k].json) assert_string_not_equal(f[i].json, f[k].json);
            if (f[i].prom && f[k].prom) assert_int_not_equal(f[i].prom_at, f[k].prom_at);
        }
        assert_true((f[i].prom == NULL) == (f[i].prom_at == 0));
        assert_true((f[i].prom == NULL) == (f[i].help == NULL));
        in_line += f[i].line != NULL;
        prom += f[i].prom != NULL;
    }
    assert_int_equal(in_line, 16);
    assert_int_equal(prom, 11);

    kvs_rank_line_event_t ev = {.kind = KVS_RANK_LINE_EV_STATS, .final = 1};
    for (uint32_t i = 0; i < nf; i++) kvs_pd_metrics_set(&ev.metrics, &f[i], 1000 + i);
    char buf[4096];
    size_t n;
    assert_int_equal(kvs_rank_line_event_encode(&ev, buf, sizeof(buf), &n), KVS_OK);
    kvs_rank_line_event_t back;
    assert_int_equal(ev_decode(buf, &back), KVS_OK);
    for (uint32_t i = 0; i < nf; i++) {
        char want[64];
        snprintf(want, sizeof(want), "\"%s\":%u,", f[i].line ? f[i].line : f[i].field, 1000 + i);
        if ((strstr(buf, want) != NULL) != (f[i].line != NULL))
            fail_msg("%s: line key %s in %s", f[i].field, f[i].line ? f[i].line : "(none)", buf);
        assert_int_equal(kvs_pd_metrics_get(&back.metrics, &f[i]), f[i].line ? 1000 + i : 0);
    }

    /* Sums add every field. */
    kvs_pd_metrics_t a = ev.metrics, b = ev.metrics;
    kvs_pd_metrics_add(&a, &b);
    for (uint32_t i = 0; i < nf; i++) assert_int_equal(kvs_pd_metrics_get(&a, &f[i]), 2000 + 2 * i);
}

static void test_names(void **state)
{
    (void) state;
    assert_string_equal(kvs_rank_line_role_str(KVS_LLM_COLOCATED), "colocated");
    assert_string_equal(kvs_rank_line_role_str(KVS_LLM_PREFILL), "prefill");
    assert_string_equal(kvs_rank_line_role_str(KVS_LLM_DECODE), "decode");
    assert_string_equal(kvs_rank_line_finish_str(KVS_LLM_FINISH_HANDOFF), "handoff");
    assert_string_equal(kvs_rank_line_finish_str((kvs_llm_finish_t) 9), "unknown");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_requests_round_trip), cmocka_unit_test(test_request_literals),
        cmocka_unit_test(test_bad_requests),        cmocka_unit_test(test_events_round_trip),
        cmocka_unit_test(test_event_leniency),      cmocka_unit_test(test_bad_events),
        cmocka_unit_test(test_metrics_table),       cmocka_unit_test(test_names),
        cmocka_unit_test(test_logprobs_lines),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
