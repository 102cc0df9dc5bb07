/* Tests for `kvstage bench radix` through the real binary (KVS_TOOL, set by CTest): a dumped
 * trace replays to the same results as the built-in run, with and without eviction; malformed
 * traces exit 2 with the line; failed replays exit 1; the bench dispatcher's exit codes. */
#include "kvs_test.h"

#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static const char *g_tool;
static char g_dir[512];

static void path_in_dir(char *out, size_t size, const char *name)
{
    snprintf(out, size, "%s/%s", g_dir, name);
}

static int setup(void **state)
{
    (void) state;
    g_tool = getenv("KVS_TOOL");
    if (g_tool == NULL) return 0;
    const char *tmp = getenv("TMPDIR");
    snprintf(g_dir, sizeof(g_dir), "%s/kvs-bench-radix-XXXXXX", tmp ? tmp : "/tmp");
    return mkdtemp(g_dir) ? 0 : -1;
}

static int teardown(void **state)
{
    (void) state;
    if (g_tool == NULL) return 0;
    const char *names[] = {"out.json", "replay.json", "err.txt", "w.trace", "bad.trace"};
    char p[600];
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        path_in_dir(p, sizeof(p), names[i]);
        unlink(p);
    }
    rmdir(g_dir);
    return 0;
}

/* Runs `kvstage <args>` with stdout to out_name and stderr to err.txt; returns the exit code. */
static int tool(const char *args, const char *out_name)
{
    char out[600], err[600], cmd[2048];
    path_in_dir(out, sizeof(out), out_name);
    path_in_dir(err, sizeof(err), "err.txt");
    snprintf(cmd, sizeof(cmd), "'%s' %s > '%s' 2> '%s'", g_tool, args, out, err);
    int st = system(cmd);
    assert_true(st != -1 && WIFEXITED(st));
    return WEXITSTATUS(st);
}

static char g_buf[1 << 16];

static const char *slurp(const char *name)
{
    char p[600];
    path_in_dir(p, sizeof(p), name);
    FILE *f = fopen(p, "r");
    assert_non_null(f);
    size_t n = fread(g_buf, 1, sizeof(g_buf) - 1, f);
    fclose(f);
    g_buf[n] = '\0';
    return g_buf;
}

static void spit(const char *name, const char *text)
{
    char p[600];
    path_in_dir(p, sizeof(p), name);
    FILE *f = fopen(p, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

enum { MAXW = 8 };

typedef struct {
    size_t n;
    uint64_t requests[MAXW], lookup[MAXW], matched[MAXW], ideal[MAXW], evicted[MAXW];
    char hit[MAXW][32];
} report_t;

/* Every value of "key": in the JSON, in order. */
static size_t json_values(const char *json, const char *key, uint64_t *out, char (*raw)[32])
{
    char pat[64];
    snprintf(pat, sizeof(pat), "\"%s\":", key);
    size_t n = 0;
    for (const char *p = strstr(json, pat); p && n < MAXW; p = strstr(p + 1, pat)) {
        const char *v = p + strlen(pat);
        if (out) out[n] = strtoull(v, NULL, 10);
        if (raw) snprintf(raw[n], 32, "%.*s", (int) strcspn(v, ",}"), v);
        n++;
    }
    return n;
}

static report_t report_of(const char *name)
{
    const char *json = slurp(name);
    report_t r;
    memset(&r, 0, sizeof(r));
    r.n = json_values(json, "requests", r.requests, NULL);
    assert_true(r.n > 0);
    assert_int_equal(json_values(json, "lookup_tokens", r.lookup, NULL), r.n);
    assert_int_equal(json_values(json, "matched_tokens", r.matched, NULL), r.n);
    assert_int_equal(json_values(json, "ideal_matched_tokens", r.ideal, NULL), r.n);
    assert_int_equal(json_values(json, "evicted_pages", r.evicted, NULL), r.n);
    assert_int_equal(json_values(json, "hit_rate", NULL, r.hit), r.n);
    return r;
}

static void assert_same(const report_t *a, const report_t *b)
{
    assert_int_equal(a->n, b->n);
    for (size_t i = 0; i < a->n; i++) {
        assert_int_equal(a->requests[i], b->requests[i]);
        assert_int_equal(a->lookup[i], b->lookup[i]);
        assert_int_equal(a->matched[i], b->matched[i]);
        assert_int_equal(a->ideal[i], b->ideal[i]);
        assert_int_equal(a->evicted[i], b->evicted[i]);
        assert_string_equal(a->hit[i], b->hit[i]);
    }
}

#define NEED_TOOL()                                                                                \
    do {                                                                                           \
        if (g_tool == NULL) skip();                                                                \
    } while (0)

static void test_dump_replay_all(void **state)
{
    (void) state;
    NEED_TOOL();
    char args[1024], trace[600];
    path_in_dir(trace, sizeof(trace), "w.trace");
    snprintf(args, sizeof(args), "bench radix --scale 0.03 --repeat 1 --json --dump-trace '%s'",
             trace);
    assert_int_equal(tool(args, "out.json"), 0);
    report_t built = report_of("out.json");
    assert_int_equal(built.n, 3);
    for (size_t i = 0; i < built.n; i++) {
        /* No capacity given: nothing evicted, so the cache reaches the ideal hit rate, and
         * every workload shares prefixes. */
        assert_int_equal(built.evicted[i], 0);
        assert_int_equal(built.matched[i], built.ideal[i]);
        assert_true(built.matched[i] > 0 && built.matched[i] < built.lookup[i]);
    }
    snprintf(args, sizeof(args), "bench radix --trace '%s' --repeat 1 --json", trace);
    assert_int_equal(tool(args, "replay.json"), 0);
    report_t replay = report_of("replay.json");
    assert_same(&built, &replay);
    assert_non_null(strstr(slurp("replay.json"), "\"name\":\"multi-turn\""));
}

static void test_dump_replay_with_eviction(void **state)
{
    (void) state;
    NEED_TOOL();
    char args[1024], trace[600];
    path_in_dir(trace, sizeof(trace), "w.trace");
    snprintf(args, sizeof(args),
             "bench radix --workload multi-turn --scale 0.05 --capacity-pages 300 --page-size 8 "
             "--repeat 2 --json --dump-trace '%s'",
             trace);
    assert_int_equal(tool(args, "out.json"), 0);
    report_t built = report_of("out.json");
    assert_int_equal(built.n, 1);
    assert_true(built.evicted[0] > 0);
    assert_true(built.matched[0] < built.ideal[0]); /* the small pool costs hits */
    snprintf(args, sizeof(args),
             "bench radix --trace '%s' --capacity-pages 300 --page-size 8 --repeat 1 --json",
             trace);
    assert_int_equal(tool(args, "replay.json"), 0);
    report_t replay = report_of("replay.json");
    assert_same(&built, &replay);
}

/* Writes text as a trace, replays it and checks the exit code and the error's location. */
static void replay_expect(const char *text, int code, const char *where)
{
    char args[1024], trace[600];
    spit("bad.trace", text);
    path_in_dir(trace, sizeof(trace), "bad.trace");
    snprintf(args, sizeof(args), "bench radix --trace '%s' --page-size 1 --repeat 1", trace);
    int rc = tool(args, "out.json");
    const char *err = slurp("err.txt");
    if (rc != code || (where && !strstr(err, where)))
        fail_msg("trace:\n%s\nexpected exit %d and '%s', got %d: %s", text, code,
                 where ? where : "", rc, err);
}

static void test_malformed_trace(void **state)
{
    (void) state;
    NEED_TOOL();
    replay_expect("# ok\nmatch 0 2 1 2\nmatch 0 3 1 2\n", 2, "bad.trace:3: expected 3 tokens");
    replay_expect("match 0 2 1 2 3\n", 2, "bad.trace:1: more tokens");
    replay_expect("match 0 1 1\nfetch 0 1 1\n", 2, "bad.trace:2: unknown operation");
    replay_expect("match 0 1 1\nlock 1\n", 2, "bad.trace:2: handle 1");
    replay_expect("workload a\nmatch 0 1 1\nworkload b\nmatch 0 1 1\nlock 1\n", 2,
                  "bad.trace:5: handle 1");
    replay_expect("match 0 2 1 x\n", 2, "bad.trace:1: bad token");
    replay_expect("match 0 1 2147483648\n", 2, "bad.trace:1: bad token");
    replay_expect("match -1 1 1\n", 2, "bad.trace:1: bad namespace");
    replay_expect("match 0 1 1\nevict\n", 2, "bad.trace:2: missing page count");
    replay_expect("match 0 1 1\nunlock 0 0\n", 2, "bad.trace:2: unexpected extra field");
    replay_expect("workload a\ninsert 0 1 1\nworkload b\nmatch 0 1 1\n", 2,
                  "bad.trace:3: workload 'a' has no match line");
    replay_expect("# nothing\n\n", 2, "no operations");
}

static void test_failed_replay(void **state)
{
    (void) state;
    NEED_TOOL();
    replay_expect("match 0 2 1 2\nunlock 0\n", 1, "bad.trace:2: unlock of handle 0");
    replay_expect("match 0 1 1\nlock 0\nunlock 0\nunlock 0\n", 1, "bad.trace:4:");
    /* The insert's node may be gone after an eviction: locking it is refused. */
    replay_expect("insert 0 2 1 2\nevict 1\nmatch 0 2 1 2\nlock 0\n", 1,
                  "bad.trace:4: lock of handle 0");
    /* Well-formed and valid, CRLF line ends and nested locks included. */
    replay_expect("match 0 2 1 2\r\nlock 0\nlock 0\ninsert 0 2 1 2\nunlock 0\nunlock 0\r\n"
                  "match 7 2 1 2\nevict 100\nlock 0\nunlock 0\n",
                  0, NULL);
}

static void test_dispatch(void **state)
{
    (void) state;
    NEED_TOOL();
    assert_int_equal(tool("bench", "out.json"), 2);
    assert_int_equal(tool("bench nosuch", "out.json"), 2);
    assert_non_null(strstr(slurp("err.txt"), "unknown name 'nosuch'"));
    assert_int_equal(tool("bench --help", "out.json"), 0);
    assert_non_null(strstr(slurp("out.json"), "radix"));
    assert_int_equal(tool("bench radix --help", "out.json"), 0);
    assert_int_equal(tool("bench radix --bogus", "out.json"), 2);
    assert_int_equal(tool("bench radix --page-size 0", "out.json"), 2);
    assert_int_equal(tool("bench radix --trace x --seed 3", "out.json"), 2);
    assert_int_equal(tool("bench radix --trace /nonexistent/t --repeat 1", "out.json"), 2);
    /* The table states the hardware. */
    assert_int_equal(tool("bench radix --workload few-shot --scale 0.01 --repeat 1", "out.json"),
                     0);
    const char *out = slurp("out.json");
    assert_non_null(strstr(out, "hardware: "));
    assert_non_null(strstr(out, "few-shot"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dump_replay_all), cmocka_unit_test(test_dump_replay_with_eviction),
        cmocka_unit_test(test_malformed_trace), cmocka_unit_test(test_failed_replay),
        cmocka_unit_test(test_dispatch),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
