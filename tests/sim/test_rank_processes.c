/* Multi-process deployments through the real tool: every rank its own process, ZeroMQ control,
 * UCX data over shared memory and over TCP on loopback, bootstrap through the registry. Each run
 * must verify every room byte for byte on every decode rank and leak nothing; an incompatible
 * decode rank must be refused with a message naming the mismatch. */
#include "kvs_test.h"

#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "base/mem.h"

static const char *tool(void)
{
    return getenv("KVS_TOOL");
}

/* Runs `kvstage ARGS` with a shell, captures stdout (and stderr when merge), returns the exit
 * status. */
static int run(const char *args, char *out, size_t cap, int merge)
{
    char cmd[2048];
    snprintf(cmd, sizeof(cmd), "%s %s%s", tool(), args, merge ? " 2>&1" : " 2>/dev/null");
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    size_t n = fread(out, 1, cap - 1, p);
    out[n] = '\0';
    int status = pclose(p);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

static void expect(const char *out, const char *what)
{
    if (strstr(out, what) == NULL) fail_msg("output lacks '%s':\n%s", what, out);
}

/* Runs a demo that must pass; its JSON stays in the returned buffer. */
static const char *demo_ok(const char *flags)
{
    static char out[1 << 16];
    char args[1024];
    snprintf(args, sizeof(args), "demo --json --deadline-s 120 %s", flags);
    int rc = run(args, out, sizeof(out), 0);
    if (rc != 0) fail_msg("'kvstage %s' exited %d:\n%s", args, rc, out);
    expect(out, "\"ok\":true");
    expect(out, "\"failed\":0");
    expect(out, "\"exact\":true");
    expect(out, "\"leaked_slots\":0,\"leaked_pages\":0,\"leaked_rooms\":0");
    return out;
}

/* The default demo on a reliable network (loopback, shared memory): resends are for real
 * losses only, so at most 2% of the control messages. (Smaller runs over tcp can spend a
 * round of metadata resends on connection setup, a larger share of a short run.) */
static void test_demo_retries_at_most_2_percent(void **state)
{
    (void) state;
    if (tool() == NULL) skip();
    const char *out = demo_ok("");
    const char *m = strstr(out, "\"control_messages\":"), *r = strstr(out, "\"retries\":");
    if (m == NULL || r == NULL) fail_msg("no control_messages or retries in:\n%s", out);
    unsigned long long msgs = strtoull(m + strlen("\"control_messages\":"), NULL, 10);
    unsigned long long retries = strtoull(r + strlen("\"retries\":"), NULL, 10);
    print_message("demo: %llu retries among %llu control messages\n", retries, msgs);
    if (msgs == 0 || retries * 50 > msgs)
        fail_msg("%llu retries among %llu control messages (over 2%%)", retries, msgs);
}

/* GPU pools in every rank process: the net link's data plane is CUDA IPC (peer copies, or the
 * gather kernel storing straight into the imported decode ring). Prefill ranks share GPU 0 and
 * decode ranks GPU 1 (one GPU: both on 0): fan-in and fan-out between processes. */
static void test_gpu_cuda_ipc(void **state)
{
    (void) state;
    if (tool() == NULL || kvs_mem_device_count() == 0) {
        print_message("no CUDA device here: the cross-process GPU deployment is skipped\n");
        skip();
    }
    static char out[1 << 16];
    demo_ok("--device cuda --requests 16 --concurrency 8");
    assert_int_equal(
        run("demo --json --device cuda --requests 16 --concurrency 8", out, sizeof(out), 0), 0);
    if (strstr(out, "\"direct_writes\":0,") != NULL)
        fail_msg("auto mode wrote nothing straight into the imported rings:\n%s", out);
    demo_ok("--device cuda --write-mode staged --prefill-tp 2 --decode-tp 4 --requests 12");
    assert_int_equal(
        run("demo --json --device cuda --write-mode staged --requests 8", out, sizeof(out), 0), 0);
    expect(out, "\"direct_writes\":0,");
    demo_ok("--device cuda --prefill-tp 4 --decode-tp 1 --kv-heads 2 --layout hnd --requests 8");
    demo_ok("--device cuda --prefill-tp 2 --decode-tp 2 --mla --head-dim 48 --requests 8");
}

static void test_tp4_to_tp2_shm(void **state)
{
    (void) state;
    if (tool() == NULL) skip();
    demo_ok("--requests 24 --concurrency 8 --data shm");
}

/* Direct writes from host pools: each gather stores straight into the decode ring through its
 * shared-memory mapping. A chunk granted before its ring is wired up waits for the wireup (it
 * used to fail its room as unsupported). */
static void test_direct_writes_shm(void **state)
{
    (void) state;
    if (tool() == NULL) skip();
    static const char *const runs[] = {
        "--requests 32 --concurrency 16 --prefill-tp 4 --decode-tp 1 --kv-heads 4 --chunk 32 "
        "--prompt-len 1000 --data shm --write-mode direct",
        "--requests 16 --prefill-tp 2 --decode-tp 2 --mla --head-dim 48 --chunk 32 "
        "--prompt-len 1000 --data shm --write-mode direct"};
    for (size_t i = 0; i < sizeof(runs) / sizeof(runs[0]); i++) {
        const char *out = demo_ok(runs[i]);
        const char *b = strstr(out, "\"bulk_writes\":"), *d = strstr(out, "\"direct_writes\":");
        if (b == NULL || d == NULL) fail_msg("no bulk_writes or direct_writes in:\n%s", out);
        unsigned long long bulk = strtoull(b + strlen("\"bulk_writes\":"), NULL, 10);
        unsigned long long direct = strtoull(d + strlen("\"direct_writes\":"), NULL, 10);
        if (bulk == 0 || direct != bulk) fail_msg("%llu of %llu writes direct", direct, bulk);
    }
}

static void test_tp2_to_tp4_tcp(void **state)
{
    (void) state;
    if (tool() == NULL) skip();
    demo_ok("--requests 16 --prefill-tp 2 --decode-tp 4 --data tcp --net-device lo");
}

static void test_replicated_and_mla(void **state)
{
    (void) state;
    if (tool() == NULL) skip();
    /* 2 KV heads over prefill TP4: replicas, one of which ships each head. */
    demo_ok("--requests 12 --prefill-tp 4 --decode-tp 1 --kv-heads 2 --layout hnd");
    demo_ok("--requests 12 --prefill-tp 2 --decode-tp 2 --mla --head-dim 48 --page-size 8 "
            "--chunk 64");
}

/* A page size per side (protocol.md §1), over shared memory and over TCP with staged writes:
 * prefill pages larger than decode's (slots start inside prefill pages), and smaller, with
 * MLA over an uneven TP pair (the last slot ends inside a decode page). */
static void test_page_sizes_per_side(void **state)
{
    (void) state;
    if (tool() == NULL) skip();
    demo_ok("--requests 12 --prefill-page-size 64 --decode-page-size 16 --chunk 48 --data shm");
    demo_ok("--requests 12 --prefill-tp 3 --decode-tp 2 --mla --head-dim 48 --prefill-page-size 4 "
            "--decode-page-size 64 --data tcp --net-device lo --write-mode staged");
}

/* Pipeline-parallel prefill (protocol.md §2): every (stage, TP rank) a process writing its
 * layers, uneven stages, over shared memory and over TCP; and with a page size per side. */
static void test_prefill_pipeline_stages(void **state)
{
    (void) state;
    if (tool() == NULL) skip();
    demo_ok("--requests 12 --prefill-pp 2 --data shm");
    demo_ok("--requests 12 --prefill-pp 3 --prefill-tp 2 --decode-tp 4 --layers 5 --data tcp "
            "--net-device lo --write-mode staged");
    demo_ok("--requests 8 --prefill-pp 2 --prefill-tp 3 --decode-tp 2 --mla --head-dim 48 "
            "--prefill-page-size 4 --decode-page-size 64");
}

/* Decode context parallelism (protocol.md §1): each decode rank a process receiving only its
 * tokens; MLA over TCP with staged writes, interleave and a page size per side; GQA replicas
 * with prefill stages over shared memory. */
static void test_decode_context_parallel(void **state)
{
    (void) state;
    if (tool() == NULL) skip();
    demo_ok("--requests 12 --prefill-tp 2 --decode-tp 4 --mla --head-dim 48 --decode-dcp 4 "
            "--dcp-interleave 2 --prefill-page-size 24 --chunk 128 --data tcp --net-device lo "
            "--write-mode staged");
    demo_ok("--requests 8 --prefill-pp 2 --prefill-tp 2 --decode-tp 4 --kv-heads 2 --decode-dcp 2 "
            "--chunk 64 --layout hnd --data shm");
}

static void test_incompatible_decode_refused(void **state)
{
    (void) state;
    if (tool() == NULL) skip();
    char registry[64];
    snprintf(registry, sizeof(registry), "tcp://127.0.0.1:%u", kvs_test_free_port());
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        int devnull = open("/dev/null", O_WRONLY);
        if (devnull >= 0) {
            dup2(devnull, 1);
            dup2(devnull, 2);
        }
        execl(tool(), "kvstage", "prefill", "--rank", "0", "--serve-registry", "--registry",
              registry, "--prefill-tp", "1", "--decode-tp", "1", "--requests", "2", "--deadline-s",
              "30", (char *) NULL);
        _exit(127);
    }
    static char out[1 << 14];
    char args[512];
    snprintf(args, sizeof(args),
             "decode --rank 0 --registry %s --prefill-tp 1 --decode-tp 1 --requests 2 "
             "--page-size 32",
             registry);
    int rc = run(args, out, sizeof(out), 1);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    assert_int_equal(rc, 1);
    expect(out, "incompatible");
    expect(out, "page size 16 vs 32 here");
}

static void test_bad_flags(void **state)
{
    (void) state;
    if (tool() == NULL) skip();
    static char out[1 << 14];
    assert_int_equal(run("demo --transport carrier-pigeon", out, sizeof(out), 1), 2);
    assert_int_equal(run("demo --rank 1", out, sizeof(out), 1), 2);
    expect(out, "--rank: the demo sets it for each rank itself");
    assert_int_equal(run("decode --rank 0 --bogus 1", out, sizeof(out), 1), 2);
    expect(out, "--bogus: unknown flag");
    /* Values that can never run are usage errors too, said once, before any process starts. */
    assert_int_equal(run("demo --requests 0", out, sizeof(out), 1), 2);
    expect(out, "--requests: '0' is out of range");
    assert_int_equal(run("demo --prefill-tp 0", out, sizeof(out), 1), 2);
    expect(out, "--prefill-tp: '0' is out of range");
    assert_int_equal(run("demo --page-size 0", out, sizeof(out), 1), 2);
    expect(out, "--page-size: '0' is out of range");
    /* Per-room flags on a decode server bound by --bootstrap: a usage error, before any rank. */
    assert_int_equal(run("serve --role decode --seeded 2,64,128,4,2,16,300 --port 0 --bootstrap "
                         "tcp://127.0.0.1:9 --peer-idle-s 5",
                         out, sizeof(out), 1),
                     2);
    expect(out, "--peer-idle-s: ");
}

/* A staging ring smaller than one slot can never move a chunk: every rank refuses it at startup
 * (usage error, exit 2) with the bytes it was given and the bytes one slot needs, the demo
 * before starting any process, and nothing waits for peers that are gone. The defaults: TP4 ->
 * TP2, 8 heads of 32, 4 layers, 2 bytes, a 256-token chunk: 2 heads * 4 layers * (32 + 32) * 2
 * bytes * 256 tokens = 262144 bytes per writer region and two writers per decode rank. */
static void test_ring_smaller_than_slot_refused(void **state)
{
    (void) state;
    if (tool() == NULL) skip();
    static char out[1 << 14];
    const char *need = "(--ring-bytes >= 524288)";
    assert_int_equal(run("demo --ring-bytes 100 --deadline-s 20", out, sizeof(out), 1), 2);
    expect(out, "demo: a staging ring of 100 bytes per decode rank can never hold one slot");
    expect(out, need);
    /* Each side on its own, with a registry nobody serves: refused before bootstrap. */
    assert_int_equal(run("decode --rank 1 --registry tcp://127.0.0.1:9 --ring-bytes 524287 "
                         "--deadline-s 20",
                         out, sizeof(out), 1),
                     2);
    expect(out, "decode rank 1: a staging ring of 524287 bytes");
    expect(out, need);
    assert_int_equal(run("prefill --rank 0 --registry tcp://127.0.0.1:9 --ring-bytes 4096 "
                         "--deadline-s 20",
                         out, sizeof(out), 1),
                     2);
    expect(out, "prefill rank 0: a staging ring of 4096 bytes");
    expect(out, need);
    /* One slot is enough (rooms wait for it in turn). */
    demo_ok("--ring-bytes 524288 --requests 8 --concurrency 4");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tp4_to_tp2_shm),
        cmocka_unit_test(test_demo_retries_at_most_2_percent),
        cmocka_unit_test(test_direct_writes_shm),
        cmocka_unit_test(test_tp2_to_tp4_tcp),
        cmocka_unit_test(test_replicated_and_mla),
        cmocka_unit_test(test_page_sizes_per_side),
        cmocka_unit_test(test_prefill_pipeline_stages),
        cmocka_unit_test(test_decode_context_parallel),
        cmocka_unit_test(test_incompatible_decode_refused),
        cmocka_unit_test(test_bad_flags),
        cmocka_unit_test(test_ring_smaller_than_slot_refused),
        cmocka_unit_test(test_gpu_cuda_ipc),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
