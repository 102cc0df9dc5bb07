/* `kvstage generate` end to end: a real model (SmolLM2) and seeded models served with every rank
 * a process, the KV handed from prefill to decode through kvstage. Disaggregated greedy output
 * must equal colocated greedy output token for token, whatever the TP sizes on each side and
 * whichever radix caches are on; a request sharing a prefix with the one before it must hit
 * exactly the caches that are on; the KV bytes the senders report must be the pages each
 * request needed; SmolLM2 must continue "The capital of France is" as the reference does. */
#include "kvs_test.h"

#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "model/gguf.h"

#define MAX_REQ 8
#define MAX_IDS 64

static const char *tool(void)
{
    return getenv("KVS_TOOL");
}

/* Runs `kvstage ARGS`, captures stdout (and stderr when merge), returns the exit status. */
static int run(const char *args, char *out, size_t cap, int merge)
{
    char cmd[4096];
    snprintf(cmd, sizeof(cmd), "%s %s%s", tool(), args, merge ? " 2>&1" : " 2>/dev/null");
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    size_t n = fread(out, 1, cap - 1, p);
    out[n] = '\0';
    int status = pclose(p);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

typedef struct {
    uint32_t n;
    uint32_t ids[MAX_REQ][MAX_IDS];
    uint32_t nids[MAX_REQ];
    unsigned long long cached_p[MAX_REQ], cached_d[MAX_REQ], kv_bytes, bytes_moved;
} result_t;

static unsigned long long num_after(const char *from, const char *key, const char **end_p)
{
    const char *p = strstr(from, key);
    if (p == NULL) fail_msg("output lacks %s", key);
    p += strlen(key);
    char *end;
    unsigned long long v = strtoull(p, &end, 10);
    if (end_p) *end_p = end;
    return v;
}

/* Parses generate's --json object: per request its ids, cache hits and KV bytes. */
static void parse(const char *json, result_t *r)
{
    memset(r, 0, sizeof(*r));
    if (strstr(json, "\"ok\":true") == NULL) fail_msg("generate did not succeed:\n%s", json);
    const char *p = strstr(json, "\"requests\":[");
    assert_non_null(p);
    while ((p = strstr(p, "{\"room\":")) != NULL) {
        assert_true(r->n < MAX_REQ);
        uint32_t k = r->n++;
        const char *ids = strstr(p, "\"ids\":[");
        assert_non_null(ids);
        ids += 7;
        while (*ids != ']') {
            char *end;
            assert_true(r->nids[k] < MAX_IDS);
            r->ids[k][r->nids[k]++] = (uint32_t) strtoul(ids, &end, 10);
            ids = *end == ',' ? end + 1 : end;
        }
        r->cached_p[k] = num_after(ids, "\"cached_prefill\":", NULL);
        r->cached_d[k] = num_after(ids, "\"cached_decode\":", NULL);
        r->kv_bytes += num_after(ids, "\"kv_bytes\":", &p);
    }
    r->bytes_moved = num_after(json, "\"bytes_moved\":", NULL);
}

static void generate(const char *args, result_t *r)
{
    static char out[1 << 17];
    char full[4096];
    snprintf(full, sizeof(full), "generate --json --timeout-s 120 %s", args);
    int rc = run(full, out, sizeof(out), 0);
    if (rc != 0) fail_msg("'kvstage %s' exited %d:\n%s", full, rc, out);
    parse(out, r);
}

static void expect_same_tokens(const result_t *a, const result_t *b, const char *what)
{
    assert_int_equal(a->n, b->n);
    for (uint32_t k = 0; k < a->n; k++) {
        if (a->nids[k] != b->nids[k])
            fail_msg("%s: request %u generated %u tokens, the reference %u", what, k + 1,
                     a->nids[k], b->nids[k]);
        for (uint32_t i = 0; i < a->nids[k]; i++)
            if (a->ids[k][i] != b->ids[k][i])
                fail_msg("%s: request %u token %u is %u, the reference has %u", what, k + 1, i,
                         a->ids[k][i], b->ids[k][i]);
    }
}

/* Requests 2 and 3 share a page-aligned prefix with request 1, and run after it. */
static void expect_hits(const result_t *r, int prefill_on, int decode_on, const char *what)
{
    for (uint32_t k = 1; k < 3; k++) {
        if ((r->cached_p[k] > 0) != prefill_on)
            fail_msg("%s: request %u found %llu prompt tokens in the prefill cache", what, k + 1,
                     r->cached_p[k]);
        if ((r->cached_d[k] > 0) != decode_on)
            fail_msg("%s: request %u found %llu prompt tokens in the decode cache", what, k + 1,
                     r->cached_d[k]);
    }
    assert_int_equal(r->cached_p[0], 0);
    assert_int_equal(r->cached_d[0], 0);
}

/* Disaggregated: the senders moved exactly the pages each request needed past its decode hit. */
static void expect_bytes(const result_t *r, const char *what)
{
    if (r->kv_bytes != r->bytes_moved || r->bytes_moved == 0)
        fail_msg("%s: senders moved %llu bytes, the requests needed %llu", what, r->bytes_moved,
                 r->kv_bytes);
}

/* ---- SmolLM2 ---- */

#define SMOL_PREFIX                                                                                \
    "Here is a list of European countries and their capital cities, written one per line for a "   \
    "short geography quiz:"
#define SMOL_PROMPTS                                                                               \
    "--prompt '" SMOL_PREFIX " France:' --prompt '" SMOL_PREFIX                                    \
    " Germany:' --prompt '" SMOL_PREFIX                                                            \
    " Italy:' --prompt 'The capital of France is' --max-tokens 8"

/* tests/model/test_forward.c: the reference's greedy continuation of "The capital of France is"
 * (token ids 504 3575 282 4649 314), " Paris.\n\nThe answer is:". */
static const uint32_t smol_expect[] = {7042, 30, 198, 198, 504, 2988, 314, 42};

static void need_smollm2(void)
{
    char path[4096];
    if (kvs_model_default_path(path, sizeof(path)) != KVS_OK)
        fail_msg("SmolLM2 GGUF not found: run scripts/setup.sh (or set KVS_MODEL)");
}

static void test_smollm2_tp3_to_tp1(void **state)
{
    (void) state;
    if (tool() == NULL) skip();
    need_smollm2();
    result_t ref, r;
    generate("--colocated --tp 3 " SMOL_PROMPTS, &ref);
    assert_int_equal(ref.n, 4);
    assert_int_equal(ref.nids[3], 8);
    assert_memory_equal(ref.ids[3], smol_expect, sizeof(smol_expect));
    expect_hits(&ref, 1, 1, "colocated TP3");
    assert_int_equal(ref.bytes_moved, 0);

    static const int radix[4][2] = {{1, 1}, {0, 0}, {1, 0}, {0, 1}};
    for (int i = 0; i < 4; i++) {
        char args[2048], what[64];
        snprintf(args, sizeof(args),
                 "--prefill-tp 3 --decode-tp 1 --prefill-radix %s --decode-radix %s " SMOL_PROMPTS,
                 radix[i][0] ? "on" : "off", radix[i][1] ? "on" : "off");
        snprintf(what, sizeof(what), "TP3 -> TP1, radix %d/%d", radix[i][0], radix[i][1]);
        generate(args, &r);
        expect_same_tokens(&r, &ref, what);
        expect_hits(&r, radix[i][0], radix[i][1], what);
        expect_bytes(&r, what);
    }
}

/* The sampling knobs on SmolLM2: penalties change the greedy continuation of "The capital of
 * France is"; with penalties, top-k, min-p, top-p and a seed, disaggregated generates exactly
 * the colocated tokens (and they differ from the greedy ones: the sampling acted). */
#define SMOL_PENALTIES "--presence-penalty 0.5 --frequency-penalty 0.5 --repetition-penalty 1.2"
#define SMOL_SAMPLED                                                                               \
    "--temperature 0.9 --top-k 40 --min-p 0.02 --top-p 0.95 --seed 4242 " SMOL_PENALTIES
#define SMOL_TWO "--prompt 'The capital of France is' --prompt 'Once upon a time' --max-tokens 16"

static void test_smollm2_sampling(void **state)
{
    (void) state;
    if (tool() == NULL) skip();
    need_smollm2();
    result_t greedy, ref, r;
    generate("--colocated " SMOL_PENALTIES " " SMOL_TWO, &greedy);
    assert_int_equal(greedy.n, 2);
    assert_int_equal(greedy.nids[0], 16);
    if (memcmp(greedy.ids[0], smol_expect, sizeof(smol_expect)) == 0)
        fail_msg("the penalties left the greedy continuation as it was");
    generate("--colocated " SMOL_SAMPLED " " SMOL_TWO, &ref);
    int differs = 0;
    for (uint32_t k = 0; k < 2; k++)
        differs |= ref.nids[k] != greedy.nids[k] ||
                   memcmp(ref.ids[k], greedy.ids[k], ref.nids[k] * sizeof(uint32_t)) != 0;
    if (!differs) fail_msg("sampling gave the greedy tokens");
    generate("--prefill-tp 1 --decode-tp 1 " SMOL_SAMPLED " " SMOL_TWO, &r);
    expect_same_tokens(&r, &ref, "sampled, disaggregated");
}

/* The human-readable output streams the text and reports the transfer. */
static void test_smollm2_text(void **state)
{
    (void) state;
    if (tool() == NULL) skip();
    need_smollm2();
    static char out[1 << 16];
    int rc =
        run("generate --prompt 'The capital of France is' --max-tokens 3", out, sizeof(out), 0);
    if (rc != 0) fail_msg("generate exited %d:\n%s", rc, out);
    if (strstr(out, "[1] The capital of France is\n Paris.\n\n") == NULL)
        fail_msg("no streamed ' Paris.' continuation:\n%s", out);
    if (strstr(out, "3 tokens (length), prompt 5 tokens") == NULL ||
        strstr(out, "% of TTFT") == NULL || strstr(out, "kvstage moved") == NULL)
        fail_msg("the summary lacks the counts or the transfer:\n%s", out);
}

/* ---- seeded, 8 KV heads: fan-in and fan-out between TP sizes ---- */

#define SEEDED                                                                                     \
    "--seeded 2,128,256,8,8,16,512 --model-seed 7 --max-tokens 8 --page-size 8 --chunk 16"

static void seeded_prompts(char *buf, size_t cap)
{
    /* 37 shared ids (four pages of 8 and more), then a tail of its own for each request. */
    char prefix[512];
    size_t n = 0;
    for (uint32_t i = 0; i < 37; i++)
        n += (size_t) snprintf(prefix + n, sizeof(prefix) - n, "%s%u", i ? "," : "",
                               (i * 131 + 17) % 512);
    snprintf(buf, cap,
             "--prompt-ids %s,5,6,7 --prompt-ids %s,300,301,302,303,304 --prompt-ids %s,42 "
             "--prompt-ids 9,8,7,6,5,4,3,2,1",
             prefix, prefix, prefix);
}

static void test_seeded_tp_changes(void **state)
{
    (void) state;
    if (tool() == NULL) skip();
    char prompts[2048], args[4096];
    seeded_prompts(prompts, sizeof(prompts));
    result_t ref, r;
    snprintf(args, sizeof(args), "--colocated --tp 4 %s %s", SEEDED, prompts);
    generate(args, &ref);
    assert_int_equal(ref.n, 4);
    for (uint32_t k = 0; k < 4; k++) assert_int_equal(ref.nids[k], 8);
    expect_hits(&ref, 1, 1, "colocated TP4");
    snprintf(args, sizeof(args), "--colocated --tp 2 --prefill-radix off %s %s", SEEDED, prompts);
    generate(args, &r);
    expect_same_tokens(&r, &ref, "colocated TP2");
    expect_hits(&r, 0, 0, "colocated TP2 without radix");

    static const struct {
        uint32_t p, d;
        int pr, dr;
    } runs[] = {{4, 2, 1, 1}, {4, 2, 0, 0}, {2, 4, 1, 0}, {2, 4, 0, 1}};
    for (size_t i = 0; i < sizeof(runs) / sizeof(runs[0]); i++) {
        char what[64];
        snprintf(args, sizeof(args),
                 "--prefill-tp %u --decode-tp %u --prefill-radix %s --decode-radix %s %s %s",
                 runs[i].p, runs[i].d, runs[i].pr ? "on" : "off", runs[i].dr ? "on" : "off", SEEDED,
                 prompts);
        snprintf(what, sizeof(what), "TP%u -> TP%u, radix %d/%d", runs[i].p, runs[i].d, runs[i].pr,
                 runs[i].dr);
        generate(args, &r);
        expect_same_tokens(&r, &ref, what);
        expect_hits(&r, runs[i].pr, runs[i].dr, what);
        expect_bytes(&r, what);
    }
}

/* A KV pool too small for the requests running at once (--kv-tokens 64: 8 pages of 8; three
 * 12-token prompts admitted together in 6, each growing to 7 pages as its 40 tokens come):
 * decode ranks preempt and recompute, and the tokens are still those of a colocated run with
 * the default pool, disaggregated (prefill TP2 -> decode TP1) and colocated alike. */
static void test_seeded_small_pool(void **state)
{
    (void) state;
    if (tool() == NULL) skip();
    static const char prompts[] = "--prompt-ids 1,2,3,4,5,6,7,8,9,10,11,12 "
                                  "--prompt-ids 21,22,23,24,25,26,27,28,29,30,31,32 "
                                  "--prompt-ids 41,42,43,44,45,46,47,48,49,50,51,52";
    static const char common[] = "--seeded 2,128,256,8,8,16,512 --model-seed 7 --max-tokens 40 "
                                 "--page-size 8 --chunk 16 --sequential off";
    char args[1024];
    result_t ref, r;
    snprintf(args, sizeof(args), "--colocated %s %s", common, prompts);
    generate(args, &ref);
    assert_int_equal(ref.n, 3);
    for (uint32_t k = 0; k < 3; k++) assert_int_equal(ref.nids[k], 40);
    snprintf(args, sizeof(args), "--colocated --max-model-len 64 --kv-tokens 64 %s %s", common,
             prompts);
    generate(args, &r);
    expect_same_tokens(&r, &ref, "colocated, 8 pages");
    snprintf(args, sizeof(args),
             "--prefill-tp 2 --decode-tp 1 --max-model-len 64 --kv-tokens 64 %s %s", common,
             prompts);
    generate(args, &r);
    expect_same_tokens(&r, &ref, "TP2 -> TP1, 8 pages");
    expect_bytes(&r, "TP2 -> TP1, 8 pages");
}

/* The request pipe of one rank (`kvstage llm-rank`, engine/llm_rank.h) driven by hand. */
static void test_rank_pipe(void **state)
{
    (void) state;
    if (tool() == NULL) skip();
    char path[] = "/tmp/kvs-test-generate-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    char cmd[1024];
    snprintf(cmd, sizeof(cmd),
             "%s llm-rank --role colocated --rank 0 --seeded 2,64,128,4,4,16,512 --max-model-len "
             "104 > %s 2>/dev/null",
             tool(), path);
    FILE *p = popen(cmd, "w");
    assert_non_null(p);
    fputs("hello\n"
          "submit 1 1 4 0 1 0 0 0 0 0 0 -1 -1 0 0 3 1 2 3\n"
          "submit 2 1 4 0 1 0 0 0 0 0 0 -1 -1 0 0 2 1 99999\n"
          "submit 3 1 4 0 1 0 0 0 0 0 0 -1 -1 0 0 2 5 6 7\n"
          "submit 5 1 96 0 1 0 0 0 0 0 0 -1 -1 0 0 9 1 2 3 4 5 6 7 8 9\n"
          "submit 4 1 100 0 1 0 0 0 0 0 0 -1 -1 0 0 3 1 2 3\n"
          /* sampling parameters the engine refuses: min_p 2, a bias outside the vocabulary */
          "submit 6 1 4 0 1 0 2 0 0 0 0 -1 -1 0 0 3 1 2 3\n"
          "submit 7 1 4 0 1 0 0 0 0 0 0 -1 -1 0 1 512 1 3 1 2 3\n"
          /* three choices, sampled; choice 1 stopped alone */
          "submit 8 3 4 1 1 0 0 0 0 0 5 -1 -1 0 0 3 1 2 3\n"
          "stop 8 1\n"
          "stop 4\n"
          "match 3 1 2 3\n"
          "match 3 1 2\n"
          "stats\n"
          "quit\n",
          p);
    int status = pclose(p);
    assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    static char out[1 << 16];
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    size_t n = fread(out, 1, sizeof(out) - 1, f);
    out[n] = '\0';
    fclose(f);
    unlink(path);
    static const char *expect[] = {
        "{\"event\":\"ready\",\"role\":\"colocated\",\"tp\":1,",
        "{\"event\":\"error\",\"message\":\"bad request line: expected submit, stop, match, "
        "stats or quit\"}",
        "{\"event\":\"rejected\",\"room\":2,",
        "{\"event\":\"error\",\"message\":\"bad request line: more token ids than N\"}",
        "{\"event\":\"rejected\",\"room\":5,",
        "{\"event\":\"rejected\",\"room\":6,",
        "{\"event\":\"rejected\",\"room\":7,",
        "{\"event\":\"token\",\"room\":1,\"token\":",
        "\"index\":3}",
        "{\"event\":\"done\",\"room\":1,\"status\":\"ok\",\"finish\":\"length\","
        "\"prompt_len\":3,\"cached\":0,\"generated\":4,",
        "{\"event\":\"done\",\"room\":4,\"status\":\"ok\",\"finish\":\"stop\",",
        "\"index\":3,\"choice\":2}",
        "\"done_ns\":",
        "\"choice\":1}",
        "{\"event\":\"stats\",\"role\":\"colocated\",\"rank\":0,",
        "\"requests_ok\":5,\"requests_failed\":0,",
        /* match and stats: one answer each, in order (prompts shorter than a page hit nothing) */
        "{\"event\":\"match\",\"cached\":0,\"prompt_len\":3}",
        "{\"event\":\"match\",\"cached\":0,\"error\":",
        "\"final\":false}",
        "\"final\":true}",
    };
    for (size_t i = 0; i < sizeof(expect) / sizeof(expect[0]); i++)
        if (strstr(out, expect[i]) == NULL)
            fail_msg("the rank did not write %s:\n%s", expect[i], out);
    if (strstr(out, "\"room\":3") != NULL) fail_msg("a malformed request ran:\n%s", out);
}

static void test_bad_flags(void **state)
{
    (void) state;
    if (tool() == NULL) skip();
    static char out[1 << 14];
    static const struct {
        const char *args, *says;
    } cases[] = {
        {"generate --prompt x --bogus 1", "--bogus: unknown flag"},
        {"generate --max-tokens 4", "give at least one prompt"},
        {"generate --prompt x --prefill-tp 2", "--prefill-tp: 2 does not split this model"},
        {"generate --prompt x --colocated --tp 2", "--tp: 2 does not split this model"},
        {"generate --prompt x --tp 2", "--tp: is for --colocated"},
        {"generate --prompt x --max-tokens 0", "--max-tokens: '0' is out of range"},
        {"generate --prompt x --prefill-radix maybe", "'maybe' is neither on nor off"},
        {"generate --seeded 1,2,3 --prompt-ids 1", "--seeded: '1,2,3' is not a model shape"},
        {"generate --seeded 2,128,256,8,8,16,512 --prompt hello",
         "no tokenizer; accepted: --prompt-ids"},
        {"generate --seeded 2,128,256,8,8,16,512 --prompt-ids 1,x",
         "--prompt-ids: '1,x' is malformed"},
        {"generate --seeded 2,128,256,8,8,16,512 --prompt-ids 1,512", "outside the vocabulary"},
        {"generate --prompt", "needs a value"},
        /* The limit flags, shared by generate and serve (common/instance.c). */
        {"generate --seeded 2,128,256,8,8,16,512 --prompt-ids 1 --max-model-len 4097",
         "--max-model-len: 4097 is outside the model's context length; accepted: [2,4096]"},
        {"generate --seeded 2,128,256,8,8,16,512 --prompt-ids 1,2,3 --max-model-len 10",
         "prompt 1 (3 tokens) plus --max-tokens 32 exceeds the context of 10 tokens"},
        {"generate --seeded 2,128,256,8,8,16,512 --prompt-ids 1 --max-model-len 100 --kv-tokens "
         "99",
         "--kv-tokens: 99 cannot hold one request of the whole context (--max-model-len 100) in "
         "pages of 16 tokens; accepted: [100,68719476720]"},
        {"serve --role colocated --seeded 2,64,128,4,2,16,300 --max-model-len 5000",
         "--max-model-len: 5000 is outside the model's context length; accepted: [2,4096]"},
        {"serve --role colocated --seeded 2,64,128,4,2,16,300 --kv-tokens 1000",
         "--kv-tokens: 1000 cannot hold one request of the whole context (--max-model-len 4096)"},
        {"serve --role colocated --seeded 2,64,128,4,2,16,300 --max-new 64",
         "--max-new: unknown flag"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        int rc = run(cases[i].args, out, sizeof(out), 1);
        if (rc != 2) fail_msg("'kvstage %s' exited %d, not 2:\n%s", cases[i].args, rc, out);
        if (strstr(out, cases[i].says) == NULL)
            fail_msg("'kvstage %s' does not say '%s':\n%s", cases[i].args, cases[i].says, out);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bad_flags),         cmocka_unit_test(test_rank_pipe),
        cmocka_unit_test(test_smollm2_text),      cmocka_unit_test(test_smollm2_tp3_to_tp1),
        cmocka_unit_test(test_smollm2_sampling),  cmocka_unit_test(test_seeded_tp_changes),
        cmocka_unit_test(test_seeded_small_pool),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
