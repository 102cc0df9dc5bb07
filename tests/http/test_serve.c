/* `kvstage serve` and `kvstage router` as processes (the binary in KVS_TOOL) on loopback:
 * seeded models where the model does not matter, and `kvstage serve-demo` (SmolLM2 through the
 * router, what `make demo` runs) for one real chat. Two prefill+decode pairs (prefill TP2 ->
 * decode TP1, prefill TP1 -> decode TP2) behind a prefix-aware router and a colocated server:
 * greedy answers through the router, streamed or not, equal the colocated server's; concurrent
 * clients all get theirs; the router sends a prompt to the pair whose prefill cache holds its
 * prefix; /metrics parses and its counters move; the servers refuse requests that are not for
 * them; a killed decode server fails its requests with a 5xx JSON error while the other pair
 * keeps serving; the HTTP flags (--strict, --api-key or KVS_API_KEY, --server-api-key, limits)
 * act and their bad values are usage errors. The SmolLM2 fleets: two prefill instances feeding
 * one decode server bound to neither, and one prefill instance feeding two decode servers (the
 * decode side spread round robin, chats sent back by prefix to the decode radix holding them).
 * A rank of a TP2 server killed under load takes the server down at once (or, with
 * --restart-ranks, the server restarts its ranks and serves again) while the other side keeps
 * serving. Every process a test starts leads its own process group, and the teardown kills
 * every group, whatever happened. */
#include "http/server_test.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "model/gguf.h"
#include "model/tpgroup.h"

#define MAX_PROCS 12
#define SEEDED    "2,64,128,4,2,16,257" /* vocab 257: the byte tokenizer's, every id a byte */
#define START_S   60
#define MAX_LEN   "320" /* --max-model-len of every server: prompt + max_tokens at most */

typedef struct {
    pid_t pid; /* also the process group */
    int out_fd;
    char line[512];
    char url[128];
    uint16_t port;
    char bootstrap[128];
} proc_t;

static proc_t g_procs[MAX_PROCS];
static int g_nprocs;
static pid_t g_spawned[256]; /* every server, router and demo started, for the /dev/shm check */
static size_t g_nspawned;

static const char *tool(void)
{
    const char *t = getenv("KVS_TOOL");
    if (t == NULL) fail_msg("KVS_TOOL is not set (run through ctest)");
    return t;
}

/* Starts `kvstage ARGS...` (NULL-terminated) in a process group of its own, stdout on a pipe;
 * stderr into the file err (NULL: the test's). */
static proc_t *spawn_tool_err(const char *const *args, const char *err)
{
    assert_true(g_nprocs < MAX_PROCS);
    int fds[2];
    assert_int_equal(pipe(fds), 0);
    const char *argv[40];
    int n = 0;
    argv[n++] = tool();
    for (; args[n - 1] != NULL; n++) {
        assert_true(n < 39);
        argv[n] = args[n - 1];
    }
    argv[n] = NULL;
    fflush(stdout);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        setpgid(0, 0);
        int null = open("/dev/null", O_RDONLY);
        dup2(null, STDIN_FILENO);
        dup2(fds[1], STDOUT_FILENO);
        int efd = err ? open(err, O_WRONLY | O_CREAT | O_TRUNC, 0644) : -1;
        if (efd >= 0) dup2(efd, STDERR_FILENO);
        close(fds[0]);
        close(fds[1]);
        execv(argv[0], (char *const *) argv);
        _exit(127);
    }
    setpgid(pid, pid);
    close(fds[1]);
    fcntl(fds[0], F_SETFD, FD_CLOEXEC);
    if (g_nspawned < sizeof(g_spawned) / sizeof(g_spawned[0])) g_spawned[g_nspawned++] = pid;
    proc_t *p = &g_procs[g_nprocs++];
    memset(p, 0, sizeof(*p));
    p->pid = pid;
    p->out_fd = fds[0];
    return p;
}

static proc_t *spawn_tool(const char *const *args)
{
    return spawn_tool_err(args, NULL);
}

/* Waits for the process's "serving on" / "routing on" line and takes its URL and bootstrap. */
static void wait_up(proc_t *p, const char *prefix)
{
    size_t len = 0;
    uint64_t end = kvs_now_ns() + (uint64_t) START_S * 1000000000ull;
    while (kvs_now_ns() < end) {
        struct pollfd pfd = {p->out_fd, POLLIN, 0};
        if (poll(&pfd, 1, 100) <= 0) continue;
        ssize_t r = read(p->out_fd, p->line + len, sizeof(p->line) - 1 - len);
        if (r <= 0) fail_msg("kvstage exited before printing '%s'", prefix);
        len += (size_t) r;
        p->line[len] = '\0';
        char *nl = strchr(p->line, '\n');
        if (nl == NULL) continue;
        *nl = '\0';
        if (strncmp(p->line, prefix, strlen(prefix)) != 0) fail_msg("unexpected line: %s", p->line);
        const char *u = strstr(p->line, "http://");
        assert_non_null(u);
        snprintf(p->url, sizeof(p->url), "%.*s", (int) strcspn(u, " "), u);
        const char *colon = strrchr(p->url, ':');
        p->port = (uint16_t) atoi(colon + 1);
        const char *b = strstr(p->line, "bootstrap ");
        if (b != NULL)
            snprintf(p->bootstrap, sizeof(p->bootstrap), "%.*s", (int) strcspn(b + 10, ")"),
                     b + 10);
        return;
    }
    fail_msg("no '%s' line within %d s", prefix, START_S);
}

/* How many TP group segments a server of pid named for itself (tools/common/instance.c:
 * "kvs-PID-" and its role, then the instance's generation once it restarted) are in /dev/shm;
 * the first one's name in first[cap] (when not NULL). */
static int groups_left(pid_t pid, char *first, size_t cap)
{
    char prefix[32];
    int n = snprintf(prefix, sizeof(prefix), "kvs-%ld-", (long) pid), left = 0;
    DIR *d = opendir("/dev/shm");
    if (d == NULL) return 0;
    for (struct dirent *e; (e = readdir(d)) != NULL;) {
        if (strncmp(e->d_name, prefix, (size_t) n) != 0 || strchr("pdc", e->d_name[n]) == NULL)
            continue;
        if (left++ == 0 && first != NULL) snprintf(first, cap, "%.*s", (int) cap - 1, e->d_name);
    }
    closedir(d);
    return left;
}

static int group_left(pid_t pid)
{
    return groups_left(pid, NULL, 0) > 0;
}

static void kill_proc(proc_t *p)
{
    if (p->pid <= 0) return;
    kill(-p->pid, SIGKILL);
    kill(p->pid, SIGKILL);
    while (waitpid(p->pid, NULL, 0) < 0 && errno == EINTR) {
    }
    if (p->out_fd >= 0) close(p->out_fd);
    p->pid = 0;
    p->out_fd = -1;
}

/* Rank processes are in their server's group; give their exits a moment to be complete. */
static void kill_all(void)
{
    for (int i = g_nprocs - 1; i >= 0; i--) kill_proc(&g_procs[i]);
    g_nprocs = 0;
}

static int teardown(void **state)
{
    (void) state;
    kill_all();
    return 0;
}

/* ---- the deployment ---- */

typedef struct {
    proc_t *pre[2], *dec[2], *colo, *router;
} deploy_t;

static deploy_t g_d;

static proc_t *start_prefill(const char *tp, const char *peer_tp)
{
    const char *args[] = {
        "serve", "--role",          "prefill", "--seeded", SEEDED, "--model-seed", "11", "--tp",
        tp,      "--peer-tp",       peer_tp,   "--port",   "0",    "--page-size",  "4",  "--chunk",
        "8",     "--max-model-len", MAX_LEN,   NULL};
    proc_t *p = spawn_tool(args);
    wait_up(p, "serving on");
    assert_true(strncmp(p->bootstrap, "tcp://", 6) == 0);
    return p;
}

static proc_t *start_decode(const char *tp, const char *bootstrap)
{
    const char *args[] = {
        "serve", "--role", "decode", "--seeded",    SEEDED,    "--model-seed",    "11",    "--tp",
        tp,      "--port", "0",      "--bootstrap", bootstrap, "--max-model-len", MAX_LEN, NULL};
    proc_t *p = spawn_tool(args);
    wait_up(p, "serving on");
    assert_string_equal(p->bootstrap, bootstrap);
    return p;
}

static int setup(void **state)
{
    (void) state;
    kvs__json_init();
    memset(&g_d, 0, sizeof(g_d));
    g_d.pre[0] = start_prefill("2", "1");
    g_d.pre[1] = start_prefill("1", "2");
    g_d.dec[0] = start_decode("1", g_d.pre[0]->bootstrap);
    g_d.dec[1] = start_decode("2", g_d.pre[1]->bootstrap);
    const char *cargs[] = {"serve", "--role",          "colocated", "--seeded",
                           SEEDED,  "--model-seed",    "11",        "--port",
                           "0",     "--page-size",     "4",         "--chunk",
                           "8",     "--max-model-len", MAX_LEN,     NULL};
    g_d.colo = spawn_tool(cargs);
    wait_up(g_d.colo, "serving on");
    char pre[300], dec[300];
    snprintf(pre, sizeof(pre), "%s,%s", g_d.pre[0]->url, g_d.pre[1]->url);
    snprintf(dec, sizeof(dec), "%s,%s", g_d.dec[0]->url, g_d.dec[1]->url);
    /* Health checks rarely: a dead server must leave the rotation by its failed request. */
    const char *rargs[] = {"router", "--prefill",
                           pre,      "--decode",
                           dec,      "--port",
                           "0",      "--policy",
                           "prefix", "--health-interval-ms",
                           "60000",  "--match-timeout-ms",
                           "500",    NULL};
    g_d.router = spawn_tool(rargs);
    wait_up(g_d.router, "routing on");
    return 0;
}

/* Appends a JSON string's bytes to text (NUL-terminated), a NUL byte written as "<NUL>". */
static size_t append_text(char *text, size_t at, size_t cap, json_t *str)
{
    const char *t = json_string_value(str);
    size_t n = json_string_length(str);
    for (size_t i = 0; t != NULL && i < n; i++)
        at += (size_t) snprintf(text + at, at < cap ? cap - at : 0, "%s",
                                t[i] ? (char[]){t[i], 0} : "<NUL>");
    return at;
}

static json_t *parse_nul(const char *s, size_t len)
{
    json_error_t err;
    json_t *j = json_loadb(s, len, JSON_ALLOW_NUL, &err);
    if (j == NULL) fail_msg("not JSON (%s): %s", err.text, s);
    return j;
}

/* A completion (non-streaming) or its streamed text; returns the status. */
static long complete(uint16_t port, const char *prompt, int max_tokens, int stream, char *text,
                     size_t cap, json_t **answer_p)
{
    char body[2048];
    snprintf(body, sizeof(body),
             "{\"prompt\":\"%s\",\"max_tokens\":%d,\"temperature\":0,\"stream\":%s%s}", prompt,
             max_tokens, stream ? "true" : "false",
             stream ? ",\"stream_options\":{\"include_usage\":true}" : "");
    http_resp_t r = {0};
    http_call(port, NULL, "/v1/completions", body, &r);
    long status = r.status;
    text[0] = '\0';
    if (answer_p) *answer_p = NULL;
    if (status != 200) {
        snprintf(text, cap, "%s", r.body.ptr);
        http_resp_fini(&r);
        return status;
    }
    if (!stream) {
        json_t *j = parse_nul(r.body.ptr, r.body.len);
        json_t *c = json_array_get(json_object_get(j, "choices"), 0);
        append_text(text, 0, cap, json_object_get(c, "text"));
        if (answer_p)
            *answer_p = j;
        else
            json_decref(j);
    } else {
        char *events[512];
        size_t n = sse_split(&r.body, events, 512);
        size_t at = 0;
        for (size_t i = 0; i + 1 < n; i++) {
            json_t *j = parse_nul(events[i], strlen(events[i]));
            json_t *c = json_array_get(json_object_get(j, "choices"), 0);
            at = append_text(text, at, cap, json_object_get(c, "text"));
            if (json_object_get(j, "usage") && answer_p) *answer_p = json_incref(j);
            json_decref(j);
        }
    }
    http_resp_fini(&r);
    return status;
}

static double metric_of(uint16_t port, const char *key)
{
    http_resp_t r = {0};
    http_call(port, "GET", "/metrics", NULL, &r);
    assert_int_equal(r.status, 200);
    double v = metric_value(r.body.ptr, key);
    http_resp_fini(&r);
    return v;
}

static uint64_t kvstage_field(json_t *answer, const char *key)
{
    return (uint64_t) json_integer_value(json_object_get(json_object_get(answer, "kvstage"), key));
}

static uint64_t cached_of(json_t *answer)
{
    return (uint64_t) json_integer_value(
        json_object_get(json_object_get(json_object_get(answer, "usage"), "prompt_tokens_details"),
                        "cached_tokens"));
}

/* ---- tests ---- */

/* Greedy answers through the router, streamed and not, equal the colocated server's, on both
 * pairs (round robin between equal cache hits spreads them). */
static void test_disaggregated_equals_colocated(void **state)
{
    (void) state;
    static const char *prompts[] = {"The quick brown fox",
                                    "jumps over the lazy dog again",
                                    "kvstage moves KV caches",
                                    "Lorem ipsum dolor sit amet",
                                    "a",
                                    "0123456789abcdefghij0123456789"};
    double before[2] = {metric_of(g_d.pre[0]->port, "kvstage_prompt_tokens_total"),
                        metric_of(g_d.pre[1]->port, "kvstage_prompt_tokens_total")};
    for (size_t i = 0; i < sizeof(prompts) / sizeof(prompts[0]); i++) {
        char ref[4096], got[4096], streamed[4096];
        json_t *a = NULL, *s = NULL;
        assert_int_equal(complete(g_d.colo->port, prompts[i], 24, 0, ref, sizeof(ref), NULL), 200);
        long st = complete(g_d.router->port, prompts[i], 24, 0, got, sizeof(got), &a);
        if (st != 200) fail_msg("router answered %ld: %s", st, got);
        st = complete(g_d.router->port, prompts[i], 24, 1, streamed, sizeof(streamed), &s);
        if (st != 200) fail_msg("router answered %ld to a stream: %s", st, streamed);
        if (strcmp(ref, got) != 0 || strcmp(ref, streamed) != 0)
            fail_msg("prompt '%s': colocated '%s', disaggregated '%s', streamed '%s'", prompts[i],
                     ref, got, streamed);
        assert_non_null(a);
        assert_non_null(s); /* the usage chunk */
        /* The decode side received whole pages past its cache hit. */
        uint64_t plen = (uint64_t) json_integer_value(
            json_object_get(json_object_get(a, "usage"), "prompt_tokens"));
        assert_int_equal(plen, strlen(prompts[i]));
        uint64_t pages = (plen + 3) / 4 - cached_of(a) / 4;
        assert_int_equal(kvstage_field(a, "kv_bytes"), pages * 4 * (2 * 2 * 16 * 2 * 4));
        assert_true(kvstage_field(a, "ttft_ns") > 0);
        assert_true(kvstage_field(s, "kv_bytes") > 0); /* a hit stops short of the last token */
        json_decref(a);
        json_decref(s);
    }
    /* Both pairs served. */
    assert_true(metric_of(g_d.pre[0]->port, "kvstage_prompt_tokens_total") > before[0]);
    assert_true(metric_of(g_d.pre[1]->port, "kvstage_prompt_tokens_total") > before[1]);
    kvs_assert_no_leaks();
}

typedef struct {
    int id;
    char ref[3][256];
    char got[3][256];
    long status[3];
} client_t;

static void *client_main(void *arg)
{
    client_t *c = arg;
    for (int k = 0; k < 3; k++) {
        char prompt[64];
        snprintf(prompt, sizeof(prompt), "client %d asks question number %d", c->id, k);
        c->status[k] =
            complete(g_d.router->port, prompt, 16, k % 2, c->got[k], sizeof(c->got[k]), NULL);
    }
    return NULL;
}

/* Twelve clients at once, three requests each: every answer comes, each the colocated one. Six
 * at once on a pair of max_running 4: a prefill instance may hold more rooms in the protocol
 * than compute slots (its handoffs hold none), and its TP ranks then agree on them in pieces. */
#define NCLIENTS 12
static void test_concurrent_clients(void **state)
{
    (void) state;
    client_t cs[NCLIENTS];
    for (int i = 0; i < NCLIENTS; i++) {
        cs[i].id = i;
        for (int k = 0; k < 3; k++) {
            char prompt[64];
            snprintf(prompt, sizeof(prompt), "client %d asks question number %d", i, k);
            assert_int_equal(
                complete(g_d.colo->port, prompt, 16, 0, cs[i].ref[k], sizeof(cs[i].ref[k]), NULL),
                200);
        }
    }
    pthread_t th[NCLIENTS];
    for (int i = 0; i < NCLIENTS; i++)
        assert_int_equal(pthread_create(&th[i], NULL, client_main, &cs[i]), 0);
    for (int i = 0; i < NCLIENTS; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < NCLIENTS; i++)
        for (int k = 0; k < 3; k++) {
            if (cs[i].status[k] != 200)
                fail_msg("client %d request %d: %ld %s", i, k, cs[i].status[k], cs[i].got[k]);
            if (strcmp(cs[i].ref[k], cs[i].got[k]) != 0)
                fail_msg("client %d request %d: '%s', colocated '%s'", i, k, cs[i].got[k],
                         cs[i].ref[k]);
        }
    kvs_assert_no_leaks();
}

/* The prefix policy sends a prompt to the pair whose prefill cache holds its prefix: after the
 * first request of a family landed on one pair, the next ones all land there too (round robin
 * would alternate), and both sides of that pair report the cache hit. */
static void test_prefix_aware_choice(void **state)
{
    (void) state;
    const char *prefix = "Shared context for the prefix test: alpha beta gamma delta epsilon "
                         "zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma";
    char prompt[512], text[1024];
    double p0[2], c0[2];
    for (int i = 0; i < 2; i++) p0[i] = metric_of(g_d.pre[i]->port, "kvstage_prompt_tokens_total");
    snprintf(prompt, sizeof(prompt), "%s question zero", prefix);
    assert_int_equal(complete(g_d.router->port, prompt, 8, 0, text, sizeof(text), NULL), 200);
    int p = -1;
    /* The prefill answer may trail the decode one a little. */
    for (int k = 0; k < 200 && p < 0; k++) {
        for (int i = 0; i < 2; i++)
            if (metric_of(g_d.pre[i]->port, "kvstage_prompt_tokens_total") > p0[i]) p = i;
        if (p < 0) sleep_ms(10);
    }
    assert_true(p >= 0);
    for (int k = 1; k <= 4; k++) {
        for (int i = 0; i < 2; i++) {
            p0[i] = metric_of(g_d.pre[i]->port, "kvstage_prompt_tokens_total");
            c0[i] = metric_of(g_d.pre[i]->port, "kvstage_cached_prompt_tokens_total");
        }
        snprintf(prompt, sizeof(prompt), "%s question %d", prefix, k);
        json_t *a = NULL;
        long st = complete(g_d.router->port, prompt, 8, 0, text, sizeof(text), &a);
        if (st != 200) fail_msg("router answered %ld: %s", st, text);
        /* The decode side of the pair holds the first request's prompt and answer. */
        if (cached_of(a) < strlen(prefix) / 4 * 4 - 4)
            fail_msg("request %d: decode cache hit %llu, prefix %zu", k,
                     (unsigned long long) cached_of(a), strlen(prefix));
        json_decref(a);
        int moved = 0;
        for (int w = 0; w < 200 && !moved; w++) {
            moved = metric_of(g_d.pre[p]->port, "kvstage_cached_prompt_tokens_total") > c0[p];
            if (!moved) sleep_ms(10);
        }
        if (!moved) fail_msg("request %d: no cache hit on the prefill server that holds it", k);
        assert_true(metric_of(g_d.pre[1 - p]->port, "kvstage_prompt_tokens_total") == p0[1 - p]);
    }
    /* The router counts its prefix hits. */
    http_resp_t r = {0};
    http_call(g_d.router->port, "GET", "/metrics", NULL, &r);
    assert_int_equal(r.status, 200);
    expect_prometheus(r.body.ptr);
    double hits = 0;
    for (const char *h = r.body.ptr; (h = strstr(h, "\nkvstage_router_prefix_hits_total{")); h++)
        hits += strtod(strstr(h, "} ") + 2, NULL);
    assert_true(hits >= 4);
    http_resp_fini(&r);
    kvs_assert_no_leaks();
}

/* /metrics of every server parses and its counters follow the requests. */
static void test_metrics(void **state)
{
    (void) state;
    proc_t *servers[5] = {g_d.pre[0], g_d.pre[1], g_d.dec[0], g_d.dec[1], g_d.colo};
    double fin[2], bytes[2], chunks[2], sent[2];
    for (int i = 0; i < 2; i++) {
        fin[i] = metric_of(g_d.dec[i]->port, "kvstage_requests_finished_total{reason=\"length\"}");
        bytes[i] = metric_of(g_d.dec[i]->port, "kvstage_kv_bytes_total");
        sent[i] = metric_of(g_d.pre[i]->port, "kvstage_kv_bytes_total");
        chunks[i] = metric_of(g_d.dec[i]->port, "kvstage_kv_chunks_total");
    }
    char text[1024];
    for (int k = 0; k < 4; k++) {
        char prompt[64];
        snprintf(prompt, sizeof(prompt), "metrics request %d with some text", k);
        assert_int_equal(complete(g_d.router->port, prompt, 6, 0, text, sizeof(text), NULL), 200);
    }
    double f = 0, b = 0, c = 0, sb = 0;
    for (int i = 0; i < 2; i++) {
        sb += metric_of(g_d.pre[i]->port, "kvstage_kv_bytes_total") - sent[i];
        f += metric_of(g_d.dec[i]->port, "kvstage_requests_finished_total{reason=\"length\"}") -
             fin[i];
        b += metric_of(g_d.dec[i]->port, "kvstage_kv_bytes_total") - bytes[i];
        c += metric_of(g_d.dec[i]->port, "kvstage_kv_chunks_total") - chunks[i];
    }
    assert_true(f == 4);
    assert_true(b > 0);
    /* Every rank's counters are summed: what the prefill instances sent (TP2 and TP1) is what
     * the decode instances (TP1 and TP2) scattered, whichever pair served which request. */
    if (sb != b) fail_msg("prefill instances sent %.0f KV bytes, decode instances got %.0f", sb, b);
    assert_true(c >= 4);
    for (int i = 0; i < 5; i++) {
        http_resp_t r = {0};
        http_call(servers[i]->port, "GET", "/metrics", NULL, &r);
        assert_int_equal(r.status, 200);
        expect_prometheus(r.body.ptr);
        assert_true(expect_histogram(r.body.ptr, "kvstage_time_to_first_token_seconds") > 0);
        assert_true(metric_value(r.body.ptr, "kvstage_requests_live") == 0);
        if (i < 2) /* prefill: the handoff times */
            assert_true(expect_histogram(r.body.ptr, "kvstage_kv_transfer_seconds") > 0);
        if (i >= 2 && i < 4)
            assert_true(metric_value(r.body.ptr, "kvstage_ring_capacity_bytes") > 0);
        /* The gauges that would show a leak: no room left in kvstage, none in quarantine,
         * pages that add up. */
        assert_true(metric_value(r.body.ptr, "kvstage_rooms_live") == 0);
        assert_true(metric_value(r.body.ptr, "kvstage_rooms_quarantined") == 0);
        double total = metric_value(r.body.ptr, "kvstage_kv_pages_total");
        double free_pages = metric_value(r.body.ptr, "kvstage_kv_pages_free");
        assert_true(total > 0 && free_pages > 0 && free_pages <= total);
        assert_true(metric_value(r.body.ptr, "kvstage_kv_pages_used") == total - free_pages);
        http_resp_fini(&r);
    }
    kvs_assert_no_leaks();
}

/* Servers refuse what is not for them, naming their role or their prefill instance. */
static void test_refusals(void **state)
{
    (void) state;
    http_resp_t r = {0};
    http_call(g_d.pre[0]->port, NULL, "/v1/completions", "{\"prompt\":\"x\",\"max_tokens\":2}", &r);
    expect_error_json(&r, 400, "invalid_request_error", "kvstage");
    assert_non_null(strstr(r.body.ptr, "prefill server"));
    http_resp_fini(&r);
    http_call(g_d.dec[0]->port, NULL, "/v1/completions", "{\"prompt\":\"x\",\"max_tokens\":2}", &r);
    expect_error_json(&r, 400, "invalid_request_error", "kvstage");
    assert_non_null(strstr(r.body.ptr, "decode server"));
    http_resp_fini(&r);
    char body[512];
    snprintf(body, sizeof(body),
             "{\"prompt\":\"x\",\"max_tokens\":2,\"kvstage\":{\"room\":7,\"role\":\"decode\","
             "\"bootstrap\":\"%s\"}}",
             g_d.pre[1]->bootstrap);
    http_call(g_d.dec[0]->port, NULL, "/v1/completions", body, &r);
    expect_error_json(&r, 400, "invalid_request_error", "kvstage");
    assert_non_null(strstr(r.body.ptr, g_d.pre[0]->bootstrap));
    assert_non_null(strstr(r.body.ptr, "wrong_bootstrap"));
    http_resp_fini(&r);
    http_call(g_d.colo->port, NULL, "/v1/completions",
              "{\"prompt\":\"x\",\"kvstage\":{\"room\":7,\"role\":\"prefill\"}}", &r);
    expect_error_json(&r, 400, "invalid_request_error", "kvstage");
    assert_non_null(strstr(r.body.ptr, "colocated"));
    http_resp_fini(&r);
    /* Beyond --max-model-len: the server names the field and both numbers before the ranks
     * see it; exactly the context is served (through the router too: every backend agrees). */
    static char big[400];
    memset(big, 'a', 300);
    big[300] = '\0';
    char text[2048];
    assert_int_equal(complete(g_d.colo->port, big, 21, 0, text, sizeof(text), NULL), 400);
    if (strstr(text, "\"param\":\"max_tokens\"") == NULL ||
        strstr(text, "maximum context length is 320 tokens. However, you requested 321 tokens "
                     "(300 in the prompt, 21 in the completion)") == NULL)
        fail_msg("not the context-length error: %s", text);
    assert_int_equal(complete(g_d.colo->port, big, 20, 0, text, sizeof(text), NULL), 200);
    assert_int_equal(complete(g_d.router->port, big, 20, 0, text, sizeof(text), NULL), 200);
    memset(big, 'a', 320);
    big[320] = '\0';
    assert_int_equal(complete(g_d.colo->port, big, 1, 0, text, sizeof(text), NULL), 400);
    if (strstr(text, "\"param\":\"prompt\"") == NULL ||
        strstr(text, "you requested 320 tokens in the prompt") == NULL)
        fail_msg("not the prompt-length error: %s", text);
    /* /internal/info: what the router pairs by. */
    http_call(g_d.dec[1]->port, "GET", "/internal/info", NULL, &r);
    assert_int_equal(r.status, 200);
    json_t *j = http_json(&r);
    assert_string_equal(json_string_value(json_object_get(j, "role")), "decode");
    assert_string_equal(json_string_value(json_object_get(j, "bootstrap")), g_d.pre[1]->bootstrap);
    json_decref(j);
    http_resp_fini(&r);
    kvs_assert_no_leaks();
}

/* A sampled completion (every knob on; seed < 0: none given) through port: its text, and the
 * seed its "kvstage" object reports. */
static uint64_t sampled(uint16_t port, long long seed, char *text, size_t cap)
{
    char body[512], given[64] = "";
    if (seed >= 0) snprintf(given, sizeof(given), ",\"seed\":%lld", seed);
    snprintf(body, sizeof(body),
             "{\"prompt\":\"Tell me a story\",\"max_tokens\":24,\"temperature\":1.2,"
             "\"top_p\":0.95,\"top_k\":100,\"min_p\":0.01,\"presence_penalty\":0.3,"
             "\"frequency_penalty\":0.2,\"repetition_penalty\":1.1,\"logit_bias\":{\"0\":-100},"
             "\"ignore_eos\":true%s}",
             given);
    http_resp_t r = {0};
    http_call(port, NULL, "/v1/completions", body, &r);
    if (r.status != 200) fail_msg("port %u answered %ld: %s", port, r.status, r.body.ptr);
    json_t *j = parse_nul(r.body.ptr, r.body.len);
    json_t *c = json_array_get(json_object_get(j, "choices"), 0);
    text[0] = '\0';
    append_text(text, 0, cap, json_object_get(c, "text"));
    /* ignore_eos: the EOS (256, rendered as nothing) does not end it */
    assert_string_equal(json_string_value(json_object_get(c, "finish_reason")), "length");
    uint64_t got = kvstage_field(j, "seed");
    json_decref(j);
    http_resp_fini(&r);
    return got;
}

/* Unseeded sampled requests through the router each draw a seed (the router gives both legs
 * the same one, or the prefill side's first token would not fit the decode side's stream) and
 * report it; replaying the seed, through the router or on the colocated server, gives the
 * same text. */
static void test_unseeded_sampling(void **state)
{
    (void) state;
    char text[2][4096], again[4096];
    uint64_t seed[2];
    for (int k = 0; k < 2; k++) seed[k] = sampled(g_d.router->port, -1, text[k], sizeof(text[k]));
    assert_true(seed[0] != seed[1]);
    assert_true(seed[0] < (UINT64_C(1) << 53) && seed[1] < (UINT64_C(1) << 53));
    if (strcmp(text[0], text[1]) == 0) fail_msg("two seeds, one text: '%s'", text[0]);
    for (int k = 0; k < 2; k++) {
        assert_true(sampled(g_d.router->port, (long long) seed[k], again, sizeof(again)) ==
                    seed[k]);
        if (strcmp(again, text[k]) != 0)
            fail_msg("seed %llu: '%s', replayed '%s'", (unsigned long long) seed[k], text[k],
                     again);
        assert_true(sampled(g_d.colo->port, (long long) seed[k], again, sizeof(again)) == seed[k]);
        if (strcmp(again, text[k]) != 0)
            fail_msg("seed %llu: '%s' through the router, '%s' colocated",
                     (unsigned long long) seed[k], text[k], again);
    }
    kvs_assert_no_leaks();
}

#define NCH 3

/* A completion of n choices (seed; temperature 0: greedy) through port, streamed or not: each
 * choice's text by its index (every index present once, finish "length"); answer_p (optional)
 * receives the answer, or the streamed usage chunk. */
static void choices_call(uint16_t port, const char *prompt, int n, long long seed,
                         double temperature, int stream, char text[][1024], json_t **answer_p)
{
    char body[1024];
    snprintf(body, sizeof(body),
             "{\"prompt\":\"%s\",\"max_tokens\":20,\"temperature\":%g,\"top_p\":0.95,"
             "\"seed\":%lld,\"ignore_eos\":true,\"n\":%d,\"stream\":%s%s}",
             prompt, temperature, seed, n, stream ? "true" : "false",
             stream ? ",\"stream_options\":{\"include_usage\":true}" : "");
    http_resp_t r = {0};
    http_call(port, NULL, "/v1/completions", body, &r);
    if (r.status != 200) fail_msg("port %u answered %ld: %s", port, r.status, r.body.ptr);
    size_t at[NCH] = {0};
    int finished[NCH] = {0};
    for (int i = 0; i < n; i++) text[i][0] = '\0';
    if (answer_p) *answer_p = NULL;
    char *events[512];
    size_t nev = stream ? sse_split(&r.body, events, 512) - 1 : 1; /* the last: [DONE] */
    for (size_t e = 0; e < nev; e++) {
        json_t *j =
            stream ? parse_nul(events[e], strlen(events[e])) : parse_nul(r.body.ptr, r.body.len);
        json_t *cs = json_object_get(j, "choices");
        if (!stream) assert_int_equal(json_array_size(cs), (size_t) n);
        for (size_t k = 0; k < json_array_size(cs); k++) {
            json_t *c = json_array_get(cs, k);
            json_int_t i = json_integer_value(json_object_get(c, "index"));
            assert_true(i >= 0 && i < n);
            if (!stream) assert_int_equal(i, (json_int_t) k);
            at[i] = append_text(text[i], at[i], 1024, json_object_get(c, "text"));
            const char *fin = json_string_value(json_object_get(c, "finish_reason"));
            if (fin != NULL) {
                assert_string_equal(fin, "length");
                finished[i]++;
            }
        }
        if (answer_p && json_object_get(j, "usage")) *answer_p = json_incref(j);
        json_decref(j);
    }
    for (int i = 0; i < n; i++) assert_int_equal(finished[i], 1);
    http_resp_fini(&r);
}

/* n = 3: the prompt computed and handed over once, the choices sampled as separate sequences.
 * On the colocated server seeded choices differ and choice i is the n = 1 answer with seed + i;
 * greedy choices are all alike; through the router (prefill + decode servers), streamed or not,
 * the choices equal the colocated ones; usage counts the prompt once and every choice's tokens;
 * the KV bytes moved are those of one n = 1 request of a prompt of the same length. */
static void test_choices(void **state)
{
    (void) state;
    char many[NCH][1024], one[1][1024], routed[NCH][1024], streamed[NCH][1024];
    const char *prompt = "Three choices share this prompt";
    json_t *a = NULL, *s = NULL;
    choices_call(g_d.colo->port, prompt, NCH, 77, 1.0, 0, many, &a);
    assert_int_equal(
        json_integer_value(json_object_get(json_object_get(a, "usage"), "completion_tokens")),
        NCH * 20);
    assert_int_equal(
        json_integer_value(json_object_get(json_object_get(a, "usage"), "prompt_tokens")),
        (json_int_t) strlen(prompt));
    json_decref(a);
    for (int i = 0; i < NCH; i++) {
        for (int k = 0; k < i; k++)
            if (strcmp(many[i], many[k]) == 0)
                fail_msg("choices %d and %d alike: '%s'", k, i, many[i]);
        choices_call(g_d.colo->port, prompt, 1, 77 + i, 1.0, 0, one, NULL);
        if (strcmp(one[0], many[i]) != 0)
            fail_msg("choice %d: '%s'; alone with seed %d: '%s'", i, many[i], 77 + i, one[0]);
    }
    choices_call(g_d.colo->port, prompt, NCH, 5, 0, 0, routed, NULL);
    for (int i = 1; i < NCH; i++) assert_string_equal(routed[i], routed[0]);

    /* Through the router, twice (round robin spreads equal cache hits over the pairs): the
     * prompts start differently, so that no cache hit makes the bytes moved differ. */
    static const char *p3s[] = {"Router: three choices, one prompt",
                                "Second pair: three choices here"};
    static const char *p1s[] = {"router: one choice of that length",
                                "second pair: one choice, same n"};
    for (int round = 0; round < 2; round++) {
        const char *p3 = p3s[round], *p1 = p1s[round];
        assert_int_equal(strlen(p3), strlen(p1));
        choices_call(g_d.colo->port, p3, NCH, 91, 1.0, 0, many, NULL);
        choices_call(g_d.router->port, p3, NCH, 91, 1.0, 0, routed, &a);
        choices_call(g_d.router->port, p3, NCH, 91, 1.0, 1, streamed, &s);
        for (int i = 0; i < NCH; i++)
            if (strcmp(many[i], routed[i]) != 0 || strcmp(many[i], streamed[i]) != 0)
                fail_msg("choice %d: colocated '%s', router '%s', streamed '%s'", i, many[i],
                         routed[i], streamed[i]);
        assert_non_null(s);
        assert_int_equal(
            json_integer_value(json_object_get(json_object_get(s, "usage"), "completion_tokens")),
            NCH * 20);
        json_t *b = NULL;
        choices_call(g_d.router->port, p1, 1, 91, 1.0, 0, one, &b);
        uint64_t bytes3 = kvstage_field(a, "kv_bytes"), bytes1 = kvstage_field(b, "kv_bytes");
        assert_true(bytes1 > 0);
        assert_int_equal(cached_of(a), 0);
        assert_int_equal(cached_of(b), 0);
        if (bytes3 != bytes1)
            fail_msg("n = 3 moved %llu KV bytes, n = 1 %llu", (unsigned long long) bytes3,
                     (unsigned long long) bytes1);
        json_decref(a);
        json_decref(b);
        json_decref(s);
    }
    kvs_assert_no_leaks();
}

typedef struct {
    char body[1024];
    http_resp_t r;
} inflight_t;

static void *inflight_main(void *arg)
{
    inflight_t *in = arg;
    http_call(g_d.router->port, NULL, "/v1/completions", in->body, &in->r);
    return NULL;
}

/* A decode server killed while it holds a request: that request fails with a 5xx JSON error
 * (503 server_unavailable), and the other pair serves every request after it, correctly. */
static void test_killed_decode_server(void **state)
{
    (void) state;
    /* Steer a prompt family to one pair (the prefix policy), then kill that pair's decode. */
    const char *prefix = "The request family that the killed decode server was serving, with a "
                         "long shared prefix so that the router keeps choosing its pair";
    char prompt[512], text[2048];
    double p0[2];
    for (int i = 0; i < 2; i++) p0[i] = metric_of(g_d.pre[i]->port, "kvstage_prompt_tokens_total");
    snprintf(prompt, sizeof(prompt), "%s: first", prefix);
    assert_int_equal(complete(g_d.router->port, prompt, 4, 0, text, sizeof(text), NULL), 200);
    int p = -1;
    for (int k = 0; k < 200 && p < 0; k++) {
        for (int i = 0; i < 2; i++)
            if (metric_of(g_d.pre[i]->port, "kvstage_prompt_tokens_total") > p0[i]) p = i;
        if (p < 0) sleep_ms(10);
    }
    assert_true(p >= 0);
    /* Frozen, the decode server takes the next request of the family (its cache answer times
     * out, which is no reason to leave the rotation) and keeps it in flight until it dies. */
    kill(-g_d.dec[p]->pid, SIGSTOP);
    inflight_t in = {0};
    snprintf(in.body, sizeof(in.body),
             "{\"prompt\":\"%s: second\",\"max_tokens\":4,\"temperature\":0,\"stream\":true}",
             prefix);
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, inflight_main, &in), 0);
    sleep_ms(1500);
    kill_proc(g_d.dec[p]);
    pthread_join(th, NULL);
    if (in.r.status < 500)
        fail_msg("the dead server's request answered %ld: %s", in.r.status, in.r.body.ptr);
    expect_error_json(&in.r, in.r.status, "server_error", NULL);
    /* server_unavailable once its request reached it; no_server should a slow router still
     * have been asking it for its cache when it died. */
    if (strstr(in.r.body.ptr, "server_unavailable") == NULL &&
        strstr(in.r.body.ptr, "no_server") == NULL)
        fail_msg("unexpected error: %s", in.r.body.ptr);
    http_resp_fini(&in.r);

    for (int k = 0; k < 6; k++) {
        char ref[2048];
        snprintf(prompt, sizeof(prompt), "%s: after %d", k % 2 ? prefix : "other", k);
        assert_int_equal(complete(g_d.colo->port, prompt, 8, 0, ref, sizeof(ref), NULL), 200);
        long st = complete(g_d.router->port, prompt, 8, k % 2, text, sizeof(text), NULL);
        if (st != 200) fail_msg("request %d after the kill: %ld %s", k, st, text);
        assert_string_equal(text, ref);
    }
    kvs_assert_no_leaks();
}

/* ---- SmolLM2: the demo path ---- */

static void test_serve_demo_smollm2(void **state)
{
    (void) state;
    char path[4096];
    if (kvs_model_default_path(path, sizeof(path)) != KVS_OK)
        fail_msg("SmolLM2 GGUF not found: run scripts/setup.sh (or set KVS_MODEL)");
    const char *args[] = {"serve-demo", NULL};
    proc_t *p = spawn_tool(args);
    static char out[1 << 16];
    size_t len = 0;
    uint64_t end = kvs_now_ns() + 180ull * 1000000000ull;
    for (;;) {
        assert_true(kvs_now_ns() < end);
        struct pollfd pfd = {p->out_fd, POLLIN, 0};
        if (poll(&pfd, 1, 200) <= 0) continue;
        ssize_t n = read(p->out_fd, out + len, sizeof(out) - 1 - len);
        if (n <= 0) break;
        len += (size_t) n;
    }
    out[len] = '\0';
    int status;
    assert_int_equal(waitpid(p->pid, &status, 0), p->pid);
    p->pid = 0;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) fail_msg("serve-demo failed:\n%s", out);
    if (strstr(out, "Paris") == NULL || strstr(out, "Berlin") == NULL)
        fail_msg("serve-demo's answers lack Paris and Berlin:\n%s", out);
    /* The second request hit both radix caches. */
    const char *second = strstr(out, "[2] user:");
    assert_non_null(second);
    unsigned long cp = 0, cd = 0;
    const char *c = strstr(second, "cached ");
    assert_non_null(c);
    assert_int_equal(sscanf(c, "cached %lu on the prefill side, %lu on the decode side", &cp, &cd),
                     2);
    if (cp == 0 || cd == 0) fail_msg("no cache hit on the second request:\n%s", out);
    assert_non_null(strstr(out, "every process exited cleanly"));
}

/* A prefill server killed (SIGKILL to its whole group) and started again on the same HTTP
 * port and registry, with new ports for its ranks: the decode server, never restarted, finds
 * the new instance through the registry and serves correctly again, leaking no room. */
static void test_prefill_restart(void **state)
{
    (void) state;
    char port[8], reg[64];
    snprintf(port, sizeof(port), "%u", kvs_test_free_port());
    snprintf(reg, sizeof(reg), "tcp://127.0.0.1:%u", kvs_test_free_port());
    const char *pargs[] = {"serve", "--role", "prefill", "--seeded",   SEEDED, "--model-seed",
                           "11",    "--port", port,      "--registry", reg,    "--max-model-len",
                           MAX_LEN, "--tp",   "2",       NULL};
    proc_t *pre = spawn_tool(pargs);
    wait_up(pre, "serving on");
    const char *dargs[] = {"serve", "--role", "decode", "--seeded",    SEEDED, "--model-seed",
                           "11",    "--port", "0",      "--bootstrap", reg,    "--max-model-len",
                           MAX_LEN, NULL};
    proc_t *dec = spawn_tool(dargs);
    wait_up(dec, "serving on");
    char pre_url[64];
    snprintf(pre_url, sizeof(pre_url), "http://127.0.0.1:%s", port);
    const char *rargs[] = {"router", "--prefill", pre_url, "--decode",
                           dec->url, "--port",    "0",     "--health-interval-ms",
                           "200",    NULL};
    proc_t *rt = spawn_tool(rargs);
    wait_up(rt, "routing on");
    const char *prompt = "a prompt that outlives its prefill server";
    char want[2048], text[2048];
    assert_int_equal(complete(rt->port, prompt, 8, 0, want, sizeof(want), NULL), 200);

    /* SIGKILL of the whole instance leaves its TP group's segment; the next instance on the host
     * removes it. */
    pid_t old = pre->pid;
    kill_proc(pre);
    assert_true(group_left(old));
    pre = spawn_tool(pargs);
    wait_up(pre, "serving on");
    assert_false(group_left(old));
    /* The router has the server back within its health interval, the decode ranks the new
     * prefill ranks within a second of their silence. */
    long st = 0;
    uint64_t end = kvs_now_ns() + 30ull * 1000000000ull;
    while ((st = complete(rt->port, prompt, 8, 0, text, sizeof(text), NULL)) != 200) {
        if (kvs_now_ns() > end) fail_msg("no request served after the restart: %ld %s", st, text);
        sleep_ms(200);
    }
    assert_string_equal(text, want);
    for (int k = 0; k < 4; k++) {
        st = complete(rt->port, prompt, 8, k % 2, text, sizeof(text), NULL);
        if (st != 200) fail_msg("request %d after the restart: %ld %s", k, st, text);
        assert_string_equal(text, want);
    }
    assert_int_equal(kill(dec->pid, 0), 0); /* the same decode server throughout */
    end = kvs_now_ns() + 10ull * 1000000000ull;
    while (metric_of(dec->port, "kvstage_rooms_live") != 0 ||
           metric_of(dec->port, "kvstage_requests_live") != 0) {
        if (kvs_now_ns() > end) fail_msg("the decode server still holds rooms");
        sleep_ms(100);
    }
    /* The prefill server gone for good: the decode server's /health says so, and why, once its
     * ranks are past the liveness timeout (instead of 200 while every request would fail). */
    http_resp_t h = {0};
    http_call(dec->port, "GET", "/health", NULL, &h);
    assert_int_equal(h.status, 200);
    http_resp_fini(&h);
    kill_proc(pre);
    end = kvs_now_ns() + 25ull * 1000000000ull;
    for (;;) {
        http_call(dec->port, "GET", "/health", NULL, &h);
        if (h.status == 503) break;
        http_resp_fini(&h);
        if (kvs_now_ns() > end) fail_msg("the decode server stayed healthy without its prefill");
        sleep_ms(250);
    }
    if (strstr(h.body.ptr, "prefill rank 0") == NULL) fail_msg("/health: %s", h.body.ptr);
    http_resp_fini(&h);
}

/* A service manager stops a server by signalling its whole process group (its rank processes
 * too): the server still shuts its instance down cleanly and exits 0. */
static void test_sigterm_to_process_group(void **state)
{
    (void) state;
    const char *args[] = {"serve", "--role", "colocated", "--seeded", "2,64,128,4,2,16,300",
                          "--tp",  "2",      "--port",    "0",        NULL};
    proc_t *p = spawn_tool(args);
    wait_up(p, "serving on");
    assert_int_equal(kill(-p->pid, SIGTERM), 0);
    int status = 0;
    uint64_t end = kvs_now_ns() + 30ull * 1000000000ull;
    pid_t got = 0;
    while ((got = waitpid(p->pid, &status, WNOHANG)) == 0 && kvs_now_ns() < end) sleep_ms(20);
    if (got != p->pid) fail_msg("the server did not exit within 30 s of SIGTERM");
    p->pid = 0;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
        fail_msg("the server ended with %s %d", WIFEXITED(status) ? "exit status" : "signal",
                 WIFEXITED(status) ? WEXITSTATUS(status) : WTERMSIG(status));
}

/* One request of test_preemption: its prompt and answer. */
typedef struct {
    uint16_t port;
    int id;
    long status;
    char text[256];
} preempt_req_t;

static void *preempt_main(void *arg)
{
    preempt_req_t *q = arg;
    char prompt[64];
    snprintf(prompt, sizeof(prompt), "request %d of a pool too small for all", q->id);
    q->status = complete(q->port, prompt, 16, q->id % 2, q->text, sizeof(q->text), NULL);
    return NULL;
}

/* A pool that holds one request but not four at once: the server preempts the newest running
 * request when a sequence has no page to grow into and recomputes it later. Every answer is
 * the one it gets alone, and /metrics counts the preemptions. */
static void test_preemption(void **state)
{
    (void) state;
    const char *args[] = {"serve", "--role",          "colocated", "--seeded",
                          SEEDED,  "--model-seed",    "11",        "--port",
                          "0",     "--page-size",     "4",         "--chunk",
                          "8",     "--max-model-len", "64",        "--kv-tokens",
                          "80",    "--max-running",   "4",         NULL};
    proc_t *p = spawn_tool(args);
    wait_up(p, "serving on");
    enum { N = 4 };
    preempt_req_t alone[N], together[N];
    for (int i = 0; i < N; i++) {
        alone[i] = (preempt_req_t){.port = p->port, .id = i};
        preempt_main(&alone[i]);
        assert_int_equal(alone[i].status, 200);
    }
    assert_true(metric_of(p->port, "kvstage_preemptions_total") == 0);
    pthread_t th[N];
    for (int i = 0; i < N; i++) {
        together[i] = (preempt_req_t){.port = p->port, .id = i};
        assert_int_equal(pthread_create(&th[i], NULL, preempt_main, &together[i]), 0);
    }
    for (int i = 0; i < N; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < N; i++) {
        if (together[i].status != 200)
            fail_msg("request %d: %ld %s", i, together[i].status, together[i].text);
        if (strcmp(together[i].text, alone[i].text) != 0)
            fail_msg("request %d: '%s' with the others, '%s' alone", i, together[i].text,
                     alone[i].text);
    }
    assert_true(metric_of(p->port, "kvstage_preemptions_total") > 0);
}

/* The HTTP flags of both commands: --strict, --api-key (or KVS_API_KEY), --server-api-key,
 * --max-connections, --idle-timeout-s. */
static void test_http_flags(void **state)
{
    (void) state;
    const char *args[] = {
        "serve",    "--role",    "colocated", "--seeded",          SEEDED, "--port",           "0",
        "--strict", "--api-key", "k3y",       "--max-connections", "64",   "--idle-timeout-s", "5",
        NULL};
    proc_t *srv = spawn_tool(args);
    wait_up(srv, "serving on");
    http_resp_t r = {0};
    http_call(srv->port, NULL, "/v1/models", NULL, &r);
    expect_error_json(&r, 401, "invalid_request_error", NULL);
    http_resp_fini(&r);
    http_call(srv->port, NULL, "/health", NULL, &r);
    assert_int_equal(r.status, 200);
    http_resp_fini(&r);
    r.api_key = "k3y";
    http_call(srv->port, NULL, "/v1/completions", "{\"prompt\":\"ab\",\"max_tokens\":2,\"foo\":1}",
              &r);
    expect_error_json(&r, 400, "invalid_request_error", "foo");
    http_resp_fini(&r);

    /* The router's own key from the environment, and the servers' key apart. */
    setenv("KVS_API_KEY", "r0uter", 1);
    const char *rargs[] = {"router", "--prefill", srv->url,           "--decode", srv->url,
                           "--port", "0",         "--server-api-key", "k3y",      NULL};
    proc_t *rt = spawn_tool(rargs);
    unsetenv("KVS_API_KEY");
    wait_up(rt, "routing on");
    r.api_key = NULL;
    http_call(rt->port, NULL, "/v1/models", NULL, &r);
    expect_error_json(&r, 401, "invalid_request_error", NULL);
    http_resp_fini(&r);
    r.api_key = "r0uter";
    http_call(rt->port, NULL, "/v1/models", NULL, &r); /* proxied to the server with k3y */
    assert_int_equal(r.status, 200);
    assert_non_null(strstr(r.body.ptr, "\"object\":\"list\""));
    http_resp_fini(&r);

    /* Bad values are usage errors. */
    const char *const bad[][8] = {
        {"serve", "--role", "colocated", "--seeded", SEEDED, "--api-key", "a b", NULL},
        {"serve", "--role", "colocated", "--seeded", SEEDED, "--max-connections", "0", NULL},
        {"router", "--prefill", "http://x:1", "--decode", "http://y:2", "--idle-timeout-s", "0",
         NULL},
        {"router", "--prefill", "http://x:1", "--decode", "http://y:2", "--server-api-key", "",
         NULL},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        proc_t *p = spawn_tool(bad[i]);
        int status = 0;
        while (waitpid(p->pid, &status, 0) < 0 && errno == EINTR) {
        }
        p->pid = 0;
        close(p->out_fd);
        p->out_fd = -1;
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 2)
            fail_msg("case %zu: not a usage error (status %d)", i, status);
    }
}

/* ---- the fleet: decode servers without --bootstrap (per-room bootstrap) ---- */

#define FLEET_LEN "512" /* --max-model-len of the SmolLM2 fleet: small pools */

typedef struct {
    proc_t *pre[2], *dec, *colo, *router;
} fleet_t;

static fleet_t g_f;

/* A SmolLM2 server of the fleet; extra: more flags (NULL-terminated, up to 6). */
static proc_t *start_fleet(const char *role, const char *tp, const char *const *extra)
{
    const char *args[24] = {"serve", "--role",          role,      "--tp", tp, "--port",
                            "0",     "--max-model-len", FLEET_LEN, NULL};
    int n = 9;
    for (; extra && *extra; extra++) args[n++] = *extra;
    args[n] = NULL;
    proc_t *p = spawn_tool(args);
    wait_up(p, "serving on");
    return p;
}

static int fleet_setup(void **state)
{
    (void) state;
    kvs__json_init();
    char path[4096];
    if (kvs_model_default_path(path, sizeof(path)) != KVS_OK)
        fail_msg("SmolLM2 GGUF not found: run scripts/setup.sh (or set KVS_MODEL)");
    memset(&g_f, 0, sizeof(g_f));
    g_f.pre[0] = start_fleet("prefill", "1", NULL);
    g_f.pre[1] = start_fleet("prefill", "3", NULL);
    /* No radix cache on decode: once its rooms end, every page is free again (leak check). */
    const char *dec_extra[] = {"--radix", "off", NULL};
    g_f.dec = start_fleet("decode", "1", dec_extra);
    assert_string_equal(g_f.dec->bootstrap, "none");
    g_f.colo = start_fleet("colocated", "1", NULL);
    char pre[300];
    snprintf(pre, sizeof(pre), "%s,%s", g_f.pre[0]->url, g_f.pre[1]->url);
    /* round robin: the tests count how the rooms spread over the prefill instances */
    const char *rargs[] = {"router",     "--prefill", pre,           "--decode",
                           g_f.dec->url, "--port",    "0",           "--health-interval-ms",
                           "200",        "--policy",  "round-robin", NULL};
    g_f.router = spawn_tool(rargs);
    wait_up(g_f.router, "routing on");
    return 0;
}

/* Which prefill server the router says served an answer (its kvstage report); "" when none. */
static void served_by(json_t *answer, char *url, size_t cap)
{
    json_t *sv = json_object_get(json_object_get(answer, "kvstage"), "servers");
    const char *u = json_string_value(json_object_get(sv, "prefill"));
    snprintf(url, cap, "%s", u ? u : "");
}

/* POST /admin/servers: action ("add", "remove") the server at url on side ("prefill",
 * "decode"). */
static void admin_side(uint16_t port, const char *action, const char *side, const char *url)
{
    char body[256];
    snprintf(body, sizeof(body), "{\"action\":\"%s\",\"side\":\"%s\",\"url\":\"%s\"}", action, side,
             url);
    http_resp_t r = {0};
    http_call(port, NULL, "/admin/servers", body, &r);
    if (r.status != 200) fail_msg("admin %s %s: %ld %s", action, url, r.status, r.body.ptr);
    http_resp_fini(&r);
}

static void admin(uint16_t port, const char *action, const char *url)
{
    admin_side(port, action, "prefill", url);
}

/* Two prefill instances (TP1, TP3) feed one decode server bound to neither: 24 answers through
 * the router, streamed and not, each the colocated one, both instances used, both wired. */
static void test_fleet_two_prefill(void **state)
{
    (void) state;
    int used[2] = {0, 0};
    for (int k = 0; k < 24; k++) {
        char prompt[96], want[512], got[512], url[128];
        snprintf(prompt, sizeof(prompt), "Fleet question %d: name a colour.", k);
        assert_int_equal(complete(g_f.colo->port, prompt, 6, 0, want, sizeof(want), NULL), 200);
        json_t *answer = NULL;
        long st = complete(g_f.router->port, prompt, 6, k % 2, got, sizeof(got), &answer);
        if (st != 200) fail_msg("request %d: %ld %s", k, st, got);
        if (strcmp(got, want) != 0) fail_msg("request %d: '%s', colocated '%s'", k, got, want);
        served_by(answer, url, sizeof(url));
        json_decref(answer);
        for (int i = 0; i < 2; i++) used[i] += strcmp(url, g_f.pre[i]->url) == 0;
    }
    if (used[0] == 0 || used[1] == 0) fail_msg("prefill use %d and %d", used[0], used[1]);
    assert_int_equal(used[0] + used[1], 24);
    assert_true(metric_of(g_f.dec->port, "kvstage_peer_instances") == 2);
}

/* A prefill instance of another page size is refused per room, naming the mismatch, while the
 * compatible ones keep serving through the same decode server. */
static void test_fleet_incompatible(void **state)
{
    (void) state;
    const char *extra[] = {"--page-size", "8", NULL};
    proc_t *bad = start_fleet("prefill", "1", extra);
    /* Straight to the decode server: a 400 before any byte of the answer. */
    char body[512];
    snprintf(body, sizeof(body),
             "{\"prompt\":\"hi\",\"max_tokens\":2,\"kvstage\":{\"room\":77,\"role\":\"decode\","
             "\"bootstrap\":\"%s\"}}",
             bad->bootstrap);
    http_resp_t r = {0};
    http_call(g_f.dec->port, NULL, "/v1/completions", body, &r);
    expect_error_json(&r, 400, "invalid_request_error", "kvstage.bootstrap");
    if (strstr(r.body.ptr, "decode page size 8 expected there vs 16 here") == NULL)
        fail_msg("the refusal does not name the mismatch: %s", r.body.ptr);
    http_resp_fini(&r);
    admin(g_f.router->port, "add", bad->url);
    int refused = 0;
    for (int k = 0; k < 6; k++) {
        char prompt[96], want[512], got[512];
        snprintf(prompt, sizeof(prompt), "Mixed fleet %d: count to three.", k);
        assert_int_equal(complete(g_f.colo->port, prompt, 4, 0, want, sizeof(want), NULL), 200);
        long st = complete(g_f.router->port, prompt, 4, 0, got, sizeof(got), NULL);
        if (st == 200) {
            assert_string_equal(got, want);
        } else {
            if (st < 400 || st >= 500 || strstr(got, "page size") == NULL)
                fail_msg("request %d: %ld %s", k, st, got);
            refused++;
        }
    }
    /* Round robin over three prefill servers: two of six to the incompatible one. */
    assert_int_equal(refused, 2);
    admin(g_f.router->port, "remove", bad->url);
    kill_proc(bad);
    assert_true(metric_of(g_f.dec->port, "kvstage_peer_instances") <= 2);
}

typedef struct {
    int id;
    uint16_t port;     /* the router's */
    uint32_t pause_ms; /* between requests */
    volatile int *stop;
    int n;
    int served; /* atomic: answers 200 so far */
    long status[64];
    uint64_t at[64]; /* when the request started */
    char got[64][256];
    char url[64][128];
} fleet_client_t;

static void *fleet_client(void *arg)
{
    fleet_client_t *c = arg;
    for (c->n = 0; c->n < 64 && !__atomic_load_n(c->stop, __ATOMIC_RELAXED); c->n++) {
        char prompt[96];
        snprintf(prompt, sizeof(prompt), "Client %d, question %d: a fruit?", c->id, c->n % 4);
        json_t *answer = NULL;
        c->at[c->n] = kvs_now_ns();
        /* Not streamed: a whole answer or an error, nothing a thread would have to fail on. */
        c->status[c->n] =
            complete(c->port, prompt, 4, 0, c->got[c->n], sizeof(c->got[c->n]), &answer);
        served_by(answer, c->url[c->n], sizeof(c->url[c->n]));
        json_decref(answer);
        if (c->status[c->n] == 200) __atomic_add_fetch(&c->served, 1, __ATOMIC_RELAXED);
        if (c->pause_ms) sleep_ms(c->pause_ms);
    }
    return NULL;
}

static int fleet_served(fleet_client_t *cs, int n)
{
    int sum = 0;
    for (int i = 0; i < n; i++) sum += __atomic_load_n(&cs[i].served, __ATOMIC_RELAXED);
    return sum;
}

static int fleet_idle_rooms(void *arg)
{
    uint16_t port = *(uint16_t *) arg;
    return metric_of(port, "kvstage_rooms_live") == 0 &&
           metric_of(port, "kvstage_rooms_quarantined") == 0 &&
           metric_of(port, "kvstage_requests_live") == 0;
}

static int fleet_idle(void *arg)
{
    uint16_t port = *(uint16_t *) arg;
    return metric_of(port, "kvstage_rooms_live") == 0 &&
           metric_of(port, "kvstage_rooms_quarantined") == 0 &&
           metric_of(port, "kvstage_requests_live") == 0 &&
           metric_of(port, "kvstage_kv_pages_free") == metric_of(port, "kvstage_kv_pages_total");
}

/* kill -9 of one prefill server under four clients: only requests on it fail, cleanly; started
 * again on new ports and added to the router, it serves again through the same decode server,
 * and nothing leaks there. */
static void test_fleet_prefill_killed(void **state)
{
    (void) state;
    char want[4][4][256];
    for (int i = 0; i < 4; i++)
        for (int q = 0; q < 4; q++) {
            char prompt[96];
            snprintf(prompt, sizeof(prompt), "Client %d, question %d: a fruit?", i, q);
            assert_int_equal(
                complete(g_f.colo->port, prompt, 4, 0, want[i][q], sizeof(want[i][q]), NULL), 200);
        }
    const pid_t dec_pid = g_f.dec->pid;
    volatile int stop = 0;
    fleet_client_t *cs = calloc(4, sizeof(*cs));
    assert_non_null(cs);
    pthread_t th[4];
    for (int i = 0; i < 4; i++) {
        cs[i].id = i;
        cs[i].port = g_f.router->port;
        cs[i].stop = &stop;
        assert_int_equal(pthread_create(&th[i], NULL, fleet_client, &cs[i]), 0);
    }
    sleep_ms(3000);
    char dead_url[128];
    snprintf(dead_url, sizeof(dead_url), "%s", g_f.pre[0]->url);
    const uint64_t killed = kvs_now_ns();
    const int before = fleet_served(cs, 4);
    kill_proc(g_f.pre[0]);
    /* 6 s, and on a slow machine (a sanitizer build) until the survivor served 4 more (60 s) */
    sleep_ms(6000);
    for (int w = 0; w < 540 && fleet_served(cs, 4) < before + 4; w++) sleep_ms(100);
    __atomic_store_n(&stop, 1, __ATOMIC_RELAXED);
    for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
    int ok = 0, failed = 0;
    for (int i = 0; i < 4; i++)
        for (int k = 0; k < cs[i].n; k++) {
            if (cs[i].status[k] == 200) {
                if (strcmp(cs[i].got[k], want[i][k % 4]) != 0)
                    fail_msg("client %d request %d: '%s', colocated '%s'", i, k, cs[i].got[k],
                             want[i][k % 4]);
                ok++;
                continue;
            }
            /* A failure is a clean error, and only while the dead server was in rotation. */
            if (cs[i].status[k] < 400 || strstr(cs[i].got[k], "\"error\"") == NULL)
                fail_msg("client %d request %d: %ld '%s'", i, k, cs[i].status[k], cs[i].got[k]);
            if (cs[i].at[k] > killed + 2000000000ull)
                fail_msg("client %d request %d failed %.1f s after the kill: %s", i, k,
                         (double) (cs[i].at[k] - killed) / 1e9, cs[i].got[k]);
            failed++;
        }
    if (ok < before + 4)
        fail_msg("%d requests served (%d before the kill), %d failed", ok, before, failed);
    free(cs);

    /* Back on new ports (a new instance), added to the router; the decode server not restarted. */
    g_f.pre[0] = start_fleet("prefill", "1", NULL);
    admin(g_f.router->port, "remove", dead_url);
    admin(g_f.router->port, "add", g_f.pre[0]->url);
    int used = 0;
    for (int k = 0; k < 6; k++) {
        char prompt[96], got[256], url[128];
        json_t *answer = NULL;
        snprintf(prompt, sizeof(prompt), "Client %d, question %d: a fruit?", k % 4, k % 4);
        long st = complete(g_f.router->port, prompt, 4, 0, got, sizeof(got), &answer);
        if (st != 200) fail_msg("request %d after the restart: %ld %s", k, st, got);
        assert_string_equal(got, want[k % 4][k % 4]);
        served_by(answer, url, sizeof(url));
        json_decref(answer);
        used += strcmp(url, g_f.pre[0]->url) == 0;
    }
    assert_true(used > 0);
    assert_int_equal(g_f.dec->pid, dec_pid);
    assert_int_equal(kill(dec_pid, 0), 0);
    /* The killed instance's rooms end at the liveness timeout (10 s) on both sides. */
    uint64_t end = kvs_now_ns() + 25ull * 1000000000ull;
    for (uint16_t port = g_f.dec->port; !fleet_idle(&port); sleep_ms(250))
        if (kvs_now_ns() > end) fail_msg("the decode server holds rooms or pages");
    for (uint16_t port = g_f.pre[1]->port; !fleet_idle_rooms(&port); sleep_ms(250))
        if (kvs_now_ns() > end) fail_msg("the surviving prefill server holds rooms");
}

/* More prefill instances than the decode server may wire (--max-peer-instances 2): each room
 * still served, the wired count bounded, and every instance closed after --peer-idle-s. */
static void test_fleet_peer_limit(void **state)
{
    (void) state;
    proc_t *pre[3];
    char urls[400] = "";
    for (int i = 0; i < 3; i++) {
        pre[i] = start_prefill("1", "1");
        snprintf(urls + strlen(urls), sizeof(urls) - strlen(urls), "%s%s", i ? "," : "",
                 pre[i]->url);
    }
    const char *dargs[] = {"serve", "--role",          "decode", "--seeded",
                           SEEDED,  "--model-seed",    "11",     "--port",
                           "0",     "--page-size",     "4",      "--chunk",
                           "8",     "--max-model-len", MAX_LEN,  "--max-peer-instances",
                           "2",     "--peer-idle-s",   "1",      NULL};
    proc_t *dec = spawn_tool(dargs);
    wait_up(dec, "serving on");
    const char *cargs[] = {"serve", "--role",          "colocated", "--seeded",
                           SEEDED,  "--model-seed",    "11",        "--port",
                           "0",     "--page-size",     "4",         "--chunk",
                           "8",     "--max-model-len", MAX_LEN,     NULL};
    proc_t *colo = spawn_tool(cargs);
    wait_up(colo, "serving on");
    const char *rargs[] = {"router", "--prefill", urls,       "--decode",    dec->url,
                           "--port", "0",         "--policy", "round-robin", NULL};
    proc_t *rt = spawn_tool(rargs);
    wait_up(rt, "routing on");
    int used[3] = {0, 0, 0};
    for (int k = 0; k < 9; k++) {
        char prompt[64], want[512], got[512], url[128];
        snprintf(prompt, sizeof(prompt), "instance limit %d", k);
        assert_int_equal(complete(colo->port, prompt, 6, 0, want, sizeof(want), NULL), 200);
        json_t *answer = NULL;
        long st = complete(rt->port, prompt, 6, 0, got, sizeof(got), &answer);
        if (st != 200) fail_msg("request %d: %ld %s", k, st, got);
        assert_string_equal(got, want);
        served_by(answer, url, sizeof(url));
        json_decref(answer);
        for (int i = 0; i < 3; i++) used[i] += strcmp(url, pre[i]->url) == 0;
        double wired = metric_of(dec->port, "kvstage_peer_instances");
        if (wired < 1 || wired > 2) fail_msg("after request %d: %g instances wired", k, wired);
    }
    for (int i = 0; i < 3; i++) assert_int_equal(used[i], 3);
    uint64_t end = kvs_now_ns() + 10ull * 1000000000ull;
    while (metric_of(dec->port, "kvstage_peer_instances") != 0) {
        if (kvs_now_ns() > end) fail_msg("idle prefill instances were not closed");
        sleep_ms(200);
    }
}

/* ---- rank death: a rank of a TP2 server killed under load ---- */

/* The killed server's stderr, in the test's directory: rank_death-PID.err, this process's own
 * (CTest may run several groups of this test in one directory at once). */
static char g_err_file[64];
#define ERR_FILE g_err_file

typedef struct {
    proc_t *pre, *dec, *colo, *router;
    char want[4][4][256]; /* the colocated answers to fleet_client's prompts */
    fleet_client_t *cs;   /* [4] */
    pthread_t th[4];
    volatile int stop;
} rd_t;

/* A seeded prefill server and a decode server (bound to it through --bootstrap, or taking rooms
 * from any instance), a colocated one for the expected answers, and a round-robin router with
 * health checks every 200 ms. The server whose rank is to die (err_pre: the prefill one) writes
 * its stderr to ERR_FILE. */
static void rd_start(rd_t *d, const char *pre_tp, const char *dec_tp, int bound, int err_pre,
                     const char *const *pre_extra)
{
    memset(d, 0, sizeof(*d));
    const char *pargs[24] = {
        "serve", "--role",    "prefill", "--seeded", SEEDED, "--model-seed",    "11",   "--tp",
        pre_tp,  "--peer-tp", dec_tp,    "--port",   "0",    "--max-model-len", MAX_LEN};
    int n = 15;
    for (; pre_extra && *pre_extra; pre_extra++) pargs[n++] = *pre_extra;
    pargs[n] = NULL;
    d->pre = spawn_tool_err(pargs, err_pre ? ERR_FILE : NULL);
    wait_up(d->pre, "serving on");
    /* No radix cache on decode: once its rooms end, every page is free again (leak check). */
    const char *dargs[] = {"serve",
                           "--role",
                           "decode",
                           "--seeded",
                           SEEDED,
                           "--tp",
                           dec_tp,
                           "--model-seed",
                           "11",
                           "--port",
                           "0",
                           "--radix",
                           "off",
                           "--max-model-len",
                           MAX_LEN,
                           bound ? "--bootstrap" : NULL,
                           d->pre->bootstrap,
                           NULL};
    d->dec = spawn_tool_err(dargs, err_pre ? NULL : ERR_FILE);
    wait_up(d->dec, "serving on");
    const char *cargs[] = {"serve", "--role",          "colocated", "--seeded",
                           SEEDED,  "--model-seed",    "11",        "--port",
                           "0",     "--max-model-len", MAX_LEN,     NULL};
    d->colo = spawn_tool(cargs);
    wait_up(d->colo, "serving on");
    const char *rargs[] = {
        "router", "--prefill", d->pre->url, "--decode",    d->dec->url,
        "--port", "0",         "--policy",  "round-robin", "--health-interval-ms",
        "200",    NULL};
    d->router = spawn_tool(rargs);
    wait_up(d->router, "routing on");
    for (int i = 0; i < 4; i++)
        for (int q = 0; q < 4; q++) {
            char prompt[96];
            snprintf(prompt, sizeof(prompt), "Client %d, question %d: a fruit?", i, q);
            assert_int_equal(
                complete(d->colo->port, prompt, 4, 0, d->want[i][q], sizeof(d->want[i][q]), NULL),
                200);
        }
}

/* Four clients through the router, a request every 150 ms each. */
static void rd_load(rd_t *d)
{
    d->cs = calloc(4, sizeof(*d->cs));
    assert_non_null(d->cs);
    for (int i = 0; i < 4; i++) {
        d->cs[i] =
            (fleet_client_t){.id = i, .port = d->router->port, .pause_ms = 150, .stop = &d->stop};
        assert_int_equal(pthread_create(&d->th[i], NULL, fleet_client, &d->cs[i]), 0);
    }
}

/* Stops the clients: every request answered the colocated text or failed cleanly (an error
 * status with a JSON error; a hang would be curl's timeout, status 0), and every one that started
 * after ok_after (0: none) succeeded. *late_p: the successes after ok_after. Returns the
 * successes. */
static int rd_check(rd_t *d, uint64_t ok_after, int *late_p)
{
    __atomic_store_n(&d->stop, 1, __ATOMIC_RELAXED);
    for (int i = 0; i < 4; i++) pthread_join(d->th[i], NULL);
    int ok = 0, late = 0;
    for (int i = 0; i < 4; i++) {
        fleet_client_t *c = &d->cs[i];
        for (int k = 0; k < c->n; k++) {
            const int after = ok_after != 0 && c->at[k] > ok_after;
            if (c->status[k] == 200) {
                if (strcmp(c->got[k], d->want[i][k % 4]) != 0)
                    fail_msg("client %d request %d: '%s', colocated '%s'", i, k, c->got[k],
                             d->want[i][k % 4]);
                ok++;
                late += after;
                continue;
            }
            if (c->status[k] < 400 || strstr(c->got[k], "\"error\"") == NULL)
                fail_msg("client %d request %d: %ld '%s'", i, k, c->status[k], c->got[k]);
            if (after)
                fail_msg("client %d request %d failed %.1f s after the restart: %s", i, k,
                         (double) (c->at[k] - ok_after) / 1e9, c->got[k]);
        }
    }
    free(d->cs);
    d->cs = NULL;
    if (late_p) *late_p = late;
    return ok;
}

/* The pid of rank `rank` of the instance that server launched: its child running
 * `kvstage llm-rank ... --rank R`. */
static pid_t rank_pid(pid_t server, unsigned rank)
{
    char want[16];
    int wn = snprintf(want, sizeof(want), "--rank%c%u", '\0', rank) + 1; /* with its NUL */
    DIR *d = opendir("/proc");
    assert_non_null(d);
    pid_t found = 0;
    for (struct dirent *e; found == 0 && (e = readdir(d)) != NULL;) {
        char path[300], buf[4096];
        if (e->d_name[0] < '1' || e->d_name[0] > '9') continue;
        snprintf(path, sizeof(path), "/proc/%s/stat", e->d_name);
        FILE *f = fopen(path, "r");
        if (f == NULL) continue;
        size_t n = fread(buf, 1, sizeof(buf) - 1, f);
        fclose(f);
        buf[n] = '\0';
        const char *rp = strrchr(buf, ')');
        long ppid = 0;
        if (rp == NULL || sscanf(rp + 1, " %*c %ld", &ppid) != 1 || ppid != (long) server) continue;
        snprintf(path, sizeof(path), "/proc/%s/cmdline", e->d_name);
        if ((f = fopen(path, "r")) == NULL) continue;
        n = fread(buf, 1, sizeof(buf), f);
        fclose(f);
        int is_rank = 0, is_llm = 0;
        for (size_t i = 0; i < n; i += strlen(buf + i) + 1) {
            is_llm |= strcmp(buf + i, "llm-rank") == 0;
            is_rank |= n - i >= (size_t) wn && memcmp(buf + i, want, (size_t) wn) == 0;
        }
        if (is_llm && is_rank) found = (pid_t) atol(e->d_name);
    }
    closedir(d);
    if (found == 0) fail_msg("no rank %u under server %ld", rank, (long) server);
    return found;
}

/* The file's text (NUL-terminated, cut at cap - 1). */
static void read_text(const char *path, char *buf, size_t cap)
{
    buf[0] = '\0';
    FILE *f = fopen(path, "r");
    if (f == NULL) return;
    size_t n = fread(buf, 1, cap - 1, f);
    buf[n] = '\0';
    fclose(f);
}

/* Kills rank 1 of p's instance; p must exit 1 within a second, saying so (and `also`, when not
 * NULL) on its stderr (ERR_FILE), leaving no TP group segment. */
static void kill_rank_expect_exit(proc_t *p, const char *also)
{
    const pid_t server = p->pid;
    assert_int_equal(kill(rank_pid(server, 1), SIGKILL), 0);
    const uint64_t t0 = kvs_now_ns();
    int status = 0;
    pid_t got = 0;
    while ((got = waitpid(server, &status, WNOHANG)) == 0 && kvs_now_ns() - t0 < 3000000000ull)
        sleep_ms(5);
    const double s = (double) (kvs_now_ns() - t0) / 1e9;
    static char err[1 << 16];
    read_text(ERR_FILE, err, sizeof(err));
    if (got != server) fail_msg("the server did not exit within 3 s of its rank's death:\n%s", err);
    p->pid = 0;
    close(p->out_fd);
    p->out_fd = -1;
    kill(-server, SIGKILL); /* should a rank have outlived it */
    if (s > 1.0) fail_msg("the server took %.2f s to exit", s);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 1)
        fail_msg("the server ended with status %d:\n%s", status, err);
    if (strstr(err, "the instance failed (rank 1 was killed by signal 9)") == NULL ||
        (also != NULL && strstr(err, also) == NULL))
        fail_msg("the server's stderr does not say what happened:\n%s", err);
    char left[64];
    if (groups_left(server, left, sizeof(left)) != 0) fail_msg("%s is left in /dev/shm", left);
}

/* Without --restart-ranks: rank 1 of a TP2 server (prefill, or decode) killed under four clients;
 * the server exits 1 within a second naming the rank and the signal, the requests on it fail
 * cleanly, and a new server added to the router serves with the surviving side, never
 * restarted, which leaks nothing. */
static void rank_death(int kill_decode)
{
    rd_t d;
    /* Decode without --bootstrap: the new prefill server is a new instance on a new registry. */
    rd_start(&d, kill_decode ? "1" : "2", kill_decode ? "2" : "1", 0, !kill_decode, NULL);
    proc_t *victim = kill_decode ? d.dec : d.pre, *survivor = kill_decode ? d.pre : d.dec;
    const pid_t survivor_pid = survivor->pid;
    char dead_url[128];
    snprintf(dead_url, sizeof(dead_url), "%s", victim->url);
    rd_load(&d);
    sleep_ms(1500);
    kill_rank_expect_exit(victim, NULL);
    sleep_ms(1500);
    if (rd_check(&d, 0, NULL) < 4) fail_msg("fewer than 4 requests served before the kill");

    const char *side = kill_decode ? "decode" : "prefill";
    proc_t *fresh;
    if (kill_decode) {
        const char *dargs[] = {"serve", "--role",          "decode", "--seeded", SEEDED, "--tp",
                               "2",     "--model-seed",    "11",     "--port",   "0",    "--radix",
                               "off",   "--max-model-len", MAX_LEN,  NULL};
        fresh = spawn_tool(dargs);
    } else {
        const char *pargs[] = {"serve", "--role", "prefill", "--seeded", SEEDED, "--model-seed",
                               "11",    "--tp",   "2",       "--port",   "0",    "--max-model-len",
                               MAX_LEN, NULL};
        fresh = spawn_tool(pargs);
    }
    wait_up(fresh, "serving on");
    admin_side(d.router->port, "remove", side, dead_url);
    admin_side(d.router->port, "add", side, fresh->url);
    for (int k = 0; k < 4; k++) {
        char prompt[96], got[256];
        snprintf(prompt, sizeof(prompt), "Client %d, question %d: a fruit?", k, (k + 1) % 4);
        long st = complete(d.router->port, prompt, 4, k % 2, got, sizeof(got), NULL);
        if (st != 200) fail_msg("request %d with the new %s server: %ld %s", k, side, st, got);
        assert_string_equal(got, d.want[k][(k + 1) % 4]);
    }
    assert_int_equal(survivor->pid, survivor_pid);
    assert_int_equal(kill(survivor_pid, 0), 0);
    /* The dead instance's rooms end on the survivor (cancelled by the router or at the liveness
     * timeout, 10 s). */
    uint64_t end = kvs_now_ns() + 25ull * 1000000000ull;
    uint16_t port = survivor->port;
    while (!(kill_decode ? fleet_idle_rooms(&port) : fleet_idle(&port))) {
        if (kvs_now_ns() > end)
            fail_msg("the surviving %s server holds rooms or pages",
                     kill_decode ? "prefill" : "decode");
        sleep_ms(250);
    }
}

static void test_rank_death_prefill(void **state)
{
    (void) state;
    rank_death(0);
}

static void test_rank_death_decode(void **state)
{
    (void) state;
    rank_death(1);
}

/* --restart-ranks (--max-restarts 1): rank 1 of a TP2 prefill server killed under four clients.
 * Its requests fail cleanly, /health is 503 while it restarts, then it serves again on the same
 * port and registry, where the decode ranks find the new instance: later requests all succeed,
 * equal to the colocated answers, through the same decode server; the restart is counted and
 * nothing leaks. A second death within the window is past the limit: the server exits 1. */
static void test_restart_ranks(void **state)
{
    (void) state;
    rd_t d;
    const char *extra[] = {"--restart-ranks", "--max-restarts", "1", NULL};
    rd_start(&d, "2", "1", 1, 1, extra);
    const pid_t pre_pid = d.pre->pid, dec_pid = d.dec->pid;
    rd_load(&d);
    sleep_ms(1500);
    assert_int_equal(kill(rank_pid(pre_pid, 1), SIGKILL), 0);
    const uint64_t killed = kvs_now_ns();
    int restarting = 0;
    for (;;) {
        if (kvs_now_ns() - killed > 30ull * 1000000000ull)
            fail_msg("the prefill server was not healthy again within 30 s");
        http_resp_t h = {0};
        http_call(d.pre->port, "GET", "/health", NULL, &h);
        /* Ended (rank 0 may notice before the server does), then restarting. */
        if (h.status == 503 &&
            strstr(h.body.ptr, "restarting (restart 1; rank 1 was killed by signal 9)") != NULL)
            restarting = 1;
        else if (h.status == 503 && (restarting || strstr(h.body.ptr, "has ended") == NULL))
            fail_msg("/health while restarting: %s", h.body.ptr);
        long st = h.status;
        http_resp_fini(&h);
        if (st == 200 && restarting) break;
        sleep_ms(5);
    }
    const uint64_t healthy = kvs_now_ns();
    /* The decode ranks find the new prefill ranks within a second of their silence. */
    sleep_ms(5000);
    int late = 0;
    rd_check(&d, healthy + 3000000000ull, &late);
    if (late < 4) fail_msg("%d requests served after the restart", late);
    for (int k = 0; k < 4; k++) {
        char prompt[96], got[256];
        snprintf(prompt, sizeof(prompt), "Client %d, question %d: a fruit?", k, (k + 2) % 4);
        long st = complete(d.router->port, prompt, 4, k % 2, got, sizeof(got), NULL);
        if (st != 200) fail_msg("request %d after the restart: %ld %s", k, st, got);
        assert_string_equal(got, d.want[k][(k + 2) % 4]);
    }
    assert_int_equal(d.pre->pid, pre_pid);
    assert_int_equal(d.dec->pid, dec_pid);
    assert_int_equal(kill(dec_pid, 0), 0);
    assert_true(metric_of(d.pre->port, "kvstage_instance_restarts_total") == 1);
    /* One TP group: the new instance's. */
    char left[64];
    assert_int_equal(groups_left(pre_pid, left, sizeof(left)), 1);
    char want_name[64];
    snprintf(want_name, sizeof(want_name), "kvs-%ld-p1", (long) pre_pid);
    assert_string_equal(left, want_name);
    uint64_t end = kvs_now_ns() + 25ull * 1000000000ull;
    for (uint16_t port = d.dec->port; !fleet_idle(&port); sleep_ms(250))
        if (kvs_now_ns() > end) fail_msg("the decode server holds rooms or pages");
    for (uint16_t port = d.pre->port; !fleet_idle_rooms(&port); sleep_ms(250))
        if (kvs_now_ns() > end) fail_msg("the prefill server holds rooms");

    kill_rank_expect_exit(d.pre, "giving up after 1 restart within 600 s (--max-restarts)");
}

/* ---- one prefill instance feeding two decode instances ---- */

typedef struct {
    proc_t *pre, *dec[2], *colo, *rr, *px;
} multi_t;

static multi_t g_m;

static int multi_setup(void **state)
{
    (void) state;
    kvs__json_init();
    char path[4096];
    if (kvs_model_default_path(path, sizeof(path)) != KVS_OK)
        fail_msg("SmolLM2 GGUF not found: run scripts/setup.sh (or set KVS_MODEL)");
    memset(&g_m, 0, sizeof(g_m));
    /* No radix cache on prefill: once its rooms end, every page is free again (leak check). */
    const char *pre_extra[] = {"--radix", "off", NULL};
    g_m.pre = start_fleet("prefill", "1", pre_extra);
    for (int i = 0; i < 2; i++) {
        g_m.dec[i] = start_fleet("decode", "1", NULL);
        assert_string_equal(g_m.dec[i]->bootstrap, "none");
    }
    g_m.colo = start_fleet("colocated", "1", NULL);
    char dec[300];
    snprintf(dec, sizeof(dec), "%s,%s", g_m.dec[0]->url, g_m.dec[1]->url);
    /* One router spreads the decode side round robin, one sends chats back by prefix. */
    const char *rr[] = {"router", "--prefill", g_m.pre->url, "--decode",    dec,
                        "--port", "0",         "--policy",   "round-robin", NULL};
    g_m.rr = spawn_tool(rr);
    wait_up(g_m.rr, "routing on");
    const char *px[] = {"router",      "--prefill",       g_m.pre->url, "--decode",
                        dec,           "--port",          "0",          "--prefill-policy",
                        "round-robin", "--decode-policy", "prefix",     NULL};
    g_m.px = spawn_tool(px);
    wait_up(g_m.px, "routing on");
    return 0;
}

/* The decode server the router says served an answer; -1 when neither of g_m's. */
static int served_decode(json_t *answer)
{
    json_t *sv = json_object_get(json_object_get(answer, "kvstage"), "servers");
    const char *u = json_string_value(json_object_get(sv, "decode"));
    for (int i = 0; u != NULL && i < 2; i++)
        if (strcmp(u, g_m.dec[i]->url) == 0) return i;
    return -1;
}

/* Round robin over the two decode servers: both serve, every answer (streamed or not) is the
 * colocated one, and the prefill instance serves both decode instances at once. */
static void test_multi_decode_spread(void **state)
{
    (void) state;
    int used[2] = {0, 0};
    for (int k = 0; k < 8; k++) {
        char prompt[96], want[512], got[512];
        snprintf(prompt, sizeof(prompt), "Spread question %d: name a planet.", k);
        assert_int_equal(complete(g_m.colo->port, prompt, 6, 0, want, sizeof(want), NULL), 200);
        json_t *answer = NULL;
        long st = complete(g_m.rr->port, prompt, 6, k % 2, got, sizeof(got), &answer);
        if (st != 200) fail_msg("request %d: %ld %s", k, st, got);
        if (strcmp(got, want) != 0) fail_msg("request %d: '%s', colocated '%s'", k, got, want);
        int d = served_decode(answer);
        json_decref(answer);
        if (d < 0) fail_msg("request %d: no decode server named", k);
        used[d]++;
    }
    assert_int_equal(used[0], 4);
    assert_int_equal(used[1], 4);
}

/* One chat turn (greedy, not streamed): messages so far in, the assistant's text out; the
 * answer in *answer_p (NULL-able). Returns the status. */
static long chat_turn(uint16_t port, json_t *messages, char *text, size_t cap, json_t **answer_p)
{
    json_t *req =
        json_pack("{s:O, s:i, s:i}", "messages", messages, "max_tokens", 8, "temperature", 0);
    char *body = json_dumps(req, JSON_COMPACT);
    json_decref(req);
    http_resp_t r = {0};
    http_call(port, NULL, "/v1/chat/completions", body, &r);
    kvs_free(body);
    long status = r.status;
    if (answer_p) *answer_p = NULL;
    if (status != 200) {
        snprintf(text, cap, "%s", r.body.ptr);
        http_resp_fini(&r);
        return status;
    }
    json_t *j = parse_nul(r.body.ptr, r.body.len);
    json_t *msg = json_object_get(json_array_get(json_object_get(j, "choices"), 0), "message");
    text[0] = '\0';
    append_text(text, 0, cap, json_object_get(msg, "content"));
    if (answer_p)
        *answer_p = j;
    else
        json_decref(j);
    http_resp_fini(&r);
    return status;
}

/* Two chats, turns interleaved, through the prefix router: each later turn goes back to the
 * decode server that served the chat's first one and finds the earlier turns in its radix
 * cache; every answer is the colocated one. Then nothing is left: no room on any server, every
 * prefill page free, and the decode pools hold only their caches (asking the last turns again
 * takes no page more). */
static void test_multi_decode_chats(void **state)
{
    (void) state;
    static const char *const asks[2][3] = {
        {"I am planning a spring trip through France with my brothers. What is its capital?",
         "What river runs through it?", "Name one museum there."},
        {"My garden is full of insects lately, many of them on the tomato leaves. How many "
         "legs "
         "does a spider have?",
         "And an ant?", "Which of them eats the other?"},
    };
    json_t *chat[2] = {json_array(), json_array()};
    int home[2] = {-1, -1};
    for (int turn = 0; turn < 3; turn++) {
        for (int c = 0; c < 2; c++) {
            json_array_append_new(
                chat[c], json_pack("{s:s, s:s}", "role", "user", "content", asks[c][turn]));
            char want[512], got[512];
            assert_int_equal(chat_turn(g_m.colo->port, chat[c], want, sizeof(want), NULL), 200);
            json_t *answer = NULL;
            long st = chat_turn(g_m.px->port, chat[c], got, sizeof(got), &answer);
            if (st != 200) fail_msg("chat %d turn %d: %ld %s", c, turn, st, got);
            if (strcmp(got, want) != 0)
                fail_msg("chat %d turn %d: '%s', colocated '%s'", c, turn, got, want);
            int d = served_decode(answer);
            uint64_t cached = cached_of(answer);
            json_decref(answer);
            if (d < 0) fail_msg("chat %d turn %d: no decode server named", c, turn);
            if (turn == 0) {
                home[c] = d;
            } else {
                if (d != home[c])
                    fail_msg("chat %d turn %d: decode server %d, the chat is on %d", c, turn, d,
                             home[c]);
                if (cached == 0) fail_msg("chat %d turn %d: no decode radix hit", c, turn);
            }
            json_array_append_new(chat[c],
                                  json_pack("{s:s, s:s}", "role", "assistant", "content", got));
        }
    }
    for (int i = 0; i < 2; i++) {
        uint16_t port = g_m.dec[i]->port;
        assert_true(wait_until(fleet_idle_rooms, &port, 10000));
    }
    uint16_t pre = g_m.pre->port;
    assert_true(wait_until(fleet_idle, &pre, 10000));
    assert_true(metric_of(pre, "kvstage_rooms_stashed") == 0);
    /* Asking a chat's last turn again on its server hits the cache whole: no page more. */
    for (int c = 0; c < 2; c++) {
        uint16_t port = g_m.dec[home[c]]->port;
        double used = metric_of(port, "kvstage_kv_pages_used");
        json_array_remove(chat[c], json_array_size(chat[c]) - 1); /* the last answer */
        char got[512];
        for (int k = 0; k < 2; k++)
            assert_int_equal(chat_turn(g_m.px->port, chat[c], got, sizeof(got), NULL), 200);
        assert_true(wait_until(fleet_idle_rooms, &port, 10000));
        double after = metric_of(port, "kvstage_kv_pages_used");
        if (after > used) fail_msg("chat %d: %g pages used, %g before", c, after, used);
        assert_true(metric_of(port, "kvstage_rooms_stashed") == 0);
        json_decref(chat[c]);
    }
    assert_true(wait_until(fleet_idle, &pre, 10000));
    kvs_assert_no_leaks();
}

/* serve-demo's servers lead process groups of their own: SIGTERM lets the demo stop them. */
static int demo_teardown(void **state)
{
    (void) state;
    for (int i = 0; i < g_nprocs; i++) {
        proc_t *p = &g_procs[i];
        if (p->pid <= 0) continue;
        kill(p->pid, SIGTERM);
        uint64_t end = kvs_now_ns() + 60ull * 1000000000ull;
        while (waitpid(p->pid, NULL, WNOHANG) == 0 && kvs_now_ns() < end) sleep_ms(20);
    }
    kill_all();
    return 0;
}

int main(int argc, char **argv)
{
    signal(SIGPIPE, SIG_IGN);
    curl_global_init(CURL_GLOBAL_DEFAULT);
    atexit(kill_all);
    const struct CMUnitTest deployed[] = {
        cmocka_unit_test(test_disaggregated_equals_colocated),
        cmocka_unit_test(test_concurrent_clients),
        cmocka_unit_test(test_prefix_aware_choice),
        cmocka_unit_test(test_metrics),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_unseeded_sampling),
        cmocka_unit_test(test_choices),
        cmocka_unit_test(test_killed_decode_server), /* last: it takes a server down */
    };
    const struct CMUnitTest demo[] = {
        cmocka_unit_test_teardown(test_serve_demo_smollm2, demo_teardown),
        cmocka_unit_test_teardown(test_sigterm_to_process_group, demo_teardown),
        cmocka_unit_test_teardown(test_prefill_restart, demo_teardown),
        cmocka_unit_test_teardown(test_http_flags, demo_teardown),
        cmocka_unit_test_teardown(test_preemption, demo_teardown),
    };
    const struct CMUnitTest fleet[] = {
        cmocka_unit_test(test_fleet_two_prefill), cmocka_unit_test(test_fleet_incompatible),
        cmocka_unit_test(test_fleet_prefill_killed), /* last: it kills a server */
    };
    const struct CMUnitTest multi[] = {
        cmocka_unit_test(test_multi_decode_spread),
        cmocka_unit_test(test_multi_decode_chats),
    };
    const struct CMUnitTest limits[] = {
        cmocka_unit_test_teardown(test_fleet_peer_limit, teardown),
    };
    const struct CMUnitTest rank_death[] = {
        cmocka_unit_test_teardown(test_rank_death_prefill, teardown),
        cmocka_unit_test_teardown(test_rank_death_decode, teardown),
        cmocka_unit_test_teardown(test_restart_ranks, teardown),
    };
    /* One group when named (CTest runs each as its own test: together they outlast one test's
     * timeout under ASan on two cores), else all. */
    const char *only = argc > 1 ? argv[1] : NULL;
    snprintf(g_err_file, sizeof(g_err_file), "rank_death-%ld.err", (long) getpid());
    int failed = 0, ran = 0;
#define GROUP(label, tests, set_up, tear_down)                                                     \
    if (only == NULL || strcmp(only, label) == 0) {                                                \
        ran++;                                                                                     \
        failed += cmocka_run_group_tests_name(label, tests, set_up, tear_down);                    \
    }
    GROUP("deployment", deployed, setup, teardown)
    GROUP("demo", demo, NULL, NULL)
    GROUP("fleet", fleet, fleet_setup, teardown)
    GROUP("multi_decode", multi, multi_setup, teardown)
    GROUP("peer_limit", limits, NULL, NULL)
    GROUP("rank_death", rank_death, NULL, NULL)
#undef GROUP
    if (ran == 0) {
        fprintf(stderr,
                "test_serve: no group '%s' (deployment, demo, fleet, multi_decode, "
                "peer_limit, rank_death)\n",
                only);
        return 2;
    }
    unlink(ERR_FILE);
    kill_all();
    /* Nothing left in /dev/shm: instances killed with SIGKILL left their segments, which the
     * next one started here (as this) removes. */
    kvs_tpgroup_reclaim();
    for (size_t i = 0; i < g_nspawned; i++) {
        if (group_left(g_spawned[i])) {
            fprintf(stderr, "FAIL: the TP group of server %ld is left in /dev/shm\n",
                    (long) g_spawned[i]);
            failed++;
        }
    }
    return failed;
}
