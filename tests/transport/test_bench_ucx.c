/* Smoke test of `kvstage bench transfer --transport ucx` through the real binary (KVS_TOOL, set
 * by CTest): tiny runs over shared memory and tcp exit 0, print one JSON row per request size
 * with every staged row checked byte-exact on decode, and a CUDA device is refused. */
#include "kvs_test.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static const char *g_tool;
static char g_out[1 << 16];

static int setup(void **state)
{
    (void) state;
    g_tool = getenv("KVS_TOOL");
    return 0;
}

/* Runs `kvstage bench transfer <args>`, stdout into g_out; returns the exit code. A run that
 * fails shows its stderr (kept in a temporary file), so a CI failure says why. */
static int bench(const char *args)
{
    char errpath[] = "/tmp/kvs-bench-ucx-XXXXXX";
    int fd = mkstemp(errpath);
    assert_true(fd >= 0);
    close(fd);
    char cmd[1024];
    snprintf(cmd, sizeof(cmd), "'%s' bench transfer %s 2>%s", g_tool, args, errpath);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    size_t n = fread(g_out, 1, sizeof(g_out) - 1, p);
    g_out[n] = '\0';
    int st = pclose(p);
    assert_true(st != -1 && WIFEXITED(st));
    if (WEXITSTATUS(st) != 0 && WEXITSTATUS(st) != 2) {
        FILE *e = fopen(errpath, "r");
        char line[512];
        print_message("'kvstage bench transfer %s' exited %d; its stderr:\n", args,
                      WEXITSTATUS(st));
        while (e != NULL && fgets(line, sizeof(line), e) != NULL) print_message("  %s", line);
        if (e != NULL) fclose(e);
    }
    unlink(errpath);
    return WEXITSTATUS(st);
}

static int count(const char *hay, const char *needle)
{
    int n = 0;
    for (const char *p = strstr(hay, needle); p != NULL; p = strstr(p + 1, needle)) n++;
    return n;
}

/* Value of the first `"key":` after from, as a double. */
static double number_after(const char *from, const char *key)
{
    const char *p = strstr(from, key);
    assert_non_null(p);
    return strtod(p + strlen(key), NULL);
}

static void check_run(const char *args, const char *data)
{
    if (g_tool == NULL) skip();
    assert_int_equal(bench(args), 0);
    char want[64];
    snprintf(want, sizeof(want), "\"data\":\"%s\"", data);
    assert_non_null(strstr(g_out, "\"transport\":\"ucx\""));
    assert_non_null(strstr(g_out, want));
    assert_int_equal(count(g_out, "{\"tokens\":"), 2);
    assert_int_equal(count(g_out, "\"check_ok\":true"), 2);
    assert_int_equal(count(g_out, "\"check_ok\":false"), 0);
    const char *rows[2] = {strstr(g_out, "{\"tokens\":128,"), strstr(g_out, "{\"tokens\":1024,")};
    for (int i = 0; i < 2; i++) {
        assert_non_null(rows[i]);
        assert_true(number_after(rows[i], "\"bulk_gbs\":") > 0);
        assert_true(number_after(rows[i], "\"staged_gbs\":") > 0);
        assert_true(number_after(rows[i], "\"direct_gbs\":") > 0);
        assert_true(number_after(rows[i], "\"per_page_gbs\":") > 0);
        assert_true(number_after(rows[i], "\"staged_writes\":") >= 1);
        assert_true(number_after(rows[i], "\"bytes_wrong\":") == 0);
    }
    /* 128 tokens of 32 layers x 2 x 8 heads x dim 8 x 2 bytes */
    assert_true(number_after(rows[0], "\"bytes\":") == 128.0 * 32 * 2 * 8 * 8 * 2);
}

static void test_shm_tp1(void **state)
{
    (void) state;
    check_run("--transport ucx --tokens 128,1024 --reps 1 --head-dim 8 --json", "shm");
    /* 8 pages, one write per page x layer x K/V */
    const char *row = strstr(g_out, "{\"tokens\":128,");
    assert_true(number_after(row, "\"per_page_writes\":") == 8.0 * 32 * 2);
    /* over shared memory the default mode gathers straight into the mapped decode ring */
    assert_true(number_after(row, "\"direct_writes\":") == number_after(row, "\"staged_writes\":"));
}

/* tcp data and two prefill ranks writing into one decode rank: per page, one write per writer */
static void test_tcp_tp2_to_tp1(void **state)
{
    (void) state;
    check_run("--transport ucx --data tcp --tp 2:1 --tokens 128,1024 --reps 1 --head-dim 8 --json",
              "tcp");
    const char *row = strstr(g_out, "{\"tokens\":128,");
    assert_true(number_after(row, "\"per_page_writes\":") == 8.0 * 2 * 32 * 2);
    /* tcp cannot map the decode ring: every write is a put */
    assert_true(number_after(row, "\"direct_writes\":") == 0);
}

static void test_usage(void **state)
{
    (void) state;
    if (g_tool == NULL) skip();
    assert_int_equal(bench("--transport ucx --device cuda"), 2);
    assert_int_equal(bench("--transport ucx --tp 1:1,2:1"), 2);
    assert_int_equal(bench("--device cpu --data tcp"), 2);
    assert_int_equal(bench("--transport ucx --head-dim 6"), 2);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_shm_tp1),
        cmocka_unit_test(test_tcp_tp2_to_tp1),
        cmocka_unit_test(test_usage),
    };
    return cmocka_run_group_tests(tests, setup, NULL);
}
