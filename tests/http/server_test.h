/* Helpers for the server and router tests: a libcurl client that collects status, content type,
 * a few headers and the body (optionally hanging up after some bytes, optionally with an API
 * key), SSE splitting, raw half-open connections, and a Prometheus text checker. */
#ifndef KVSTAGE_TESTS_SERVER_TEST_H
#define KVSTAGE_TESTS_SERVER_TEST_H

#include "kvs_test.h"

#include <arpa/inet.h>
#include <curl/curl.h>
#include <netinet/in.h>
#include <poll.h>
#include <regex.h>
#include <string.h>
#include <strings.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "kvstage/clock.h"
#include "http/fake_backend.h"
#include "http/server_internal.h"

typedef struct {
    long status;
    kvs__sb_t body;
    char ctype[128];
    char allow[64];
    char www_auth[64];
    char ignored[600]; /* X-Kvstage-Ignored-Fields; "" when absent */
    CURLcode result;
    size_t hang_up_after; /* 0: read everything */
    const char *api_key;  /* sent as "Authorization: Bearer KEY"; NULL: no header */
    long timeout_ms;      /* the client gives up (closing the connection) after this; 0: 20 s */
} http_resp_t;

static inline size_t http_test_write(char *data, size_t size, size_t n, void *ud)
{
    http_resp_t *r = ud;
    kvs__sb_append(&r->body, data, size * n);
    if (r->hang_up_after && r->body.len >= r->hang_up_after) return 0;
    return size * n;
}

static inline size_t http_test_header(char *data, size_t size, size_t n, void *ud)
{
    http_resp_t *r = ud;
    size_t len = size * n;
    char line[1024];
    snprintf(line, sizeof(line), "%.*s", (int) (len < 1023 ? len : 1023), data);
    char *end = line + strlen(line);
    while (end > line && (end[-1] == '\r' || end[-1] == '\n')) *--end = '\0';
    if (strncasecmp(line, "Content-Type: ", 14) == 0)
        snprintf(r->ctype, sizeof(r->ctype), "%.127s", line + 14);
    if (strncasecmp(line, "Allow: ", 7) == 0)
        snprintf(r->allow, sizeof(r->allow), "%.63s", line + 7);
    if (strncasecmp(line, "WWW-Authenticate: ", 18) == 0)
        snprintf(r->www_auth, sizeof(r->www_auth), "%.63s", line + 18);
    static const char ign[] = KVS_SERVER_IGNORED_HEADER ": ";
    if (strncasecmp(line, ign, sizeof(ign) - 1) == 0)
        snprintf(r->ignored, sizeof(r->ignored), "%.599s", line + sizeof(ign) - 1);
    return len;
}

/* One request to 127.0.0.1:port; body NULL means no body (GET unless method says). The header
 * buffer is large enough for the longest ignored-fields list. */
static inline void http_call(uint16_t port, const char *method, const char *path, const char *body,
                             http_resp_t *r)
{
    size_t hang = r->hang_up_after;
    const char *key = r->api_key;
    long timeout_ms = r->timeout_ms;
    memset(r, 0, sizeof(*r));
    r->hang_up_after = hang;
    r->api_key = key;
    r->timeout_ms = timeout_ms;
    kvs__sb_init(&r->body);
    CURL *e = curl_easy_init();
    if (e == NULL) {
        r->result = CURLE_OUT_OF_MEMORY;
        return;
    }
    char url[256];
    snprintf(url, sizeof(url), "http://127.0.0.1:%u%s", (unsigned) port, path);
    curl_easy_setopt(e, CURLOPT_URL, url);
    curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, timeout_ms ? timeout_ms : 60000L);
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, http_test_write);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, r);
    curl_easy_setopt(e, CURLOPT_HEADERFUNCTION, http_test_header);
    curl_easy_setopt(e, CURLOPT_HEADERDATA, r);
    struct curl_slist *hdrs = NULL;
    char auth[256];
    if (key != NULL) {
        snprintf(auth, sizeof(auth), "Authorization: Bearer %s", key);
        hdrs = curl_slist_append(hdrs, auth);
    }
    if (body != NULL) hdrs = curl_slist_append(hdrs, "Content-Type: application/json");
    if (hdrs != NULL) curl_easy_setopt(e, CURLOPT_HTTPHEADER, hdrs);
    if (body != NULL) {
        curl_easy_setopt(e, CURLOPT_POSTFIELDS, body);
        curl_easy_setopt(e, CURLOPT_POSTFIELDSIZE, (long) strlen(body));
    }
    if (method != NULL) curl_easy_setopt(e, CURLOPT_CUSTOMREQUEST, method);
    r->result = curl_easy_perform(e);
    curl_easy_getinfo(e, CURLINFO_RESPONSE_CODE, &r->status);
    curl_slist_free_all(hdrs);
    curl_easy_cleanup(e);
    if (r->body.ptr == NULL) kvs__sb_append(&r->body, "", 0);
}

static inline void http_resp_fini(http_resp_t *r)
{
    kvs__sb_fini(&r->body);
}

static inline json_t *http_json(const http_resp_t *r)
{
    json_error_t err;
    json_t *j = json_loadb(r->body.ptr, r->body.len, 0, &err);
    if (j == NULL) fail_msg("not JSON (%s): %s", err.text, r->body.ptr);
    return j;
}

/* Checks {"error": {"message", "type", "param", "code"}} and the param (NULL: null). */
static inline void expect_error_json(const http_resp_t *r, long status, const char *type,
                                     const char *param)
{
    if (r->status != status)
        fail_msg("status %ld, expected %ld: %s", r->status, status, r->body.ptr);
    assert_string_equal(r->ctype, "application/json");
    json_t *j = http_json(r);
    json_t *e = json_object_get(j, "error");
    assert_true(json_is_object(e));
    assert_true(json_is_string(json_object_get(e, "message")));
    assert_true(json_string_length(json_object_get(e, "message")) > 0);
    assert_string_equal(json_string_value(json_object_get(e, "type")), type);
    assert_non_null(json_object_get(e, "code"));
    json_t *p = json_object_get(e, "param");
    assert_non_null(p);
    if (param == NULL) {
        assert_true(json_is_null(p));
    } else {
        if (!json_is_string(p) || strcmp(json_string_value(p), param) != 0)
            fail_msg("param %s, expected %s: %s", json_is_string(p) ? json_string_value(p) : "null",
                     param, r->body.ptr);
    }
    json_decref(j);
}

/* Splits an SSE body into its events' data; checks the framing ("data: ...\n\n" only). Returns
 * the count; the payloads are pointers into body (each NUL-terminated in place). */
static inline size_t sse_split_any(kvs__sb_t *body, char **events, size_t cap)
{
    size_t n = 0;
    char *p = body->ptr;
    char *end = body->ptr + body->len;
    while (p < end) {
        if (strncmp(p, "data: ", 6) != 0)
            fail_msg("event %zu does not start with 'data: ': %s", n, p);
        char *sep = strstr(p, "\n\n");
        if (sep == NULL) fail_msg("event %zu is not terminated by a blank line", n);
        *sep = '\0';
        if (strchr(p, '\n') != NULL) fail_msg("event %zu spans lines", n);
        assert_true(n < cap);
        events[n++] = p + 6;
        p = sep + 2;
    }
    return n;
}

/* sse_split_any for a stream that succeeded: the last event is [DONE], and only that one. */
static inline size_t sse_split(kvs__sb_t *body, char **events, size_t cap)
{
    size_t n = sse_split_any(body, events, cap);
    assert_true(n >= 1);
    assert_string_equal(events[n - 1], "[DONE]");
    for (size_t i = 0; i + 1 < n; i++)
        if (strcmp(events[i], "[DONE]") == 0) fail_msg("[DONE] before the end (event %zu)", i);
    return n;
}

/* A stream that failed after it started: the last event is {"error": {...}} of type
 * server_error whose message contains what, and no [DONE] or finish_reason "error" anywhere.
 * Returns the event count. */
static inline size_t sse_expect_failed(kvs__sb_t *body, char **events, size_t cap, const char *what)
{
    size_t n = sse_split_any(body, events, cap);
    assert_true(n >= 1);
    for (size_t i = 0; i < n; i++) {
        if (strcmp(events[i], "[DONE]") == 0) fail_msg("a failed stream has [DONE] (event %zu)", i);
        if (strstr(events[i], "\"finish_reason\":\"error\"") != NULL)
            fail_msg("event %zu has finish_reason \"error\" (only OpenAI's values may appear)", i);
    }
    json_t *e = json_loads(events[n - 1], 0, NULL);
    if (e == NULL) fail_msg("the last event is not JSON: %s", events[n - 1]);
    json_t *err = json_object_get(e, "error");
    assert_true(json_is_object(err));
    assert_string_equal(json_string_value(json_object_get(err, "type")), "server_error");
    const char *msg = json_string_value(json_object_get(err, "message"));
    if (msg == NULL || strstr(msg, what) == NULL)
        fail_msg("error message '%s' does not say '%s'", msg ? msg : "(none)", what);
    json_decref(e);
    return n;
}

/* ---- raw connections ---- */

/* Lets this process open at least n descriptors (the soft limit raised towards the hard one);
 * 0 when the hard limit is lower. */
static inline int raise_fd_limit(rlim_t n)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return 0;
    if (rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < n) {
        if (rl.rlim_max != RLIM_INFINITY && rl.rlim_max < n) return 0;
        rl.rlim_cur = n;
        if (setrlimit(RLIMIT_NOFILE, &rl) != 0) return 0;
    }
    return 1;
}

/* A TCP connection to 127.0.0.1:port that sends first (may be NULL) and then nothing; -1 when
 * it cannot connect. */
static inline int raw_connect(uint16_t port, const char *first)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    struct sockaddr_in a;
    memset(&a, 0, sizeof(a));
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    if (connect(fd, (struct sockaddr *) &a, sizeof(a)) != 0) {
        close(fd);
        return -1;
    }
    size_t len = first ? strlen(first) : 0;
    if (len > 0 && write(fd, first, len) != (ssize_t) len) {
        close(fd);
        return -1;
    }
    return fd;
}

/* Reads fd until EOF or ms pass: the bytes (NUL-terminated, at most cap - 1) into buf; returns
 * the count, or -1 when the peer did not close within ms. */
static inline long raw_read_to_eof(int fd, char *buf, size_t cap, unsigned ms)
{
    uint64_t deadline = kvs_now_ns() + (uint64_t) ms * 1000000u;
    size_t n = 0;
    for (;;) {
        uint64_t now = kvs_now_ns();
        if (now >= deadline) break;
        struct pollfd p = {fd, POLLIN, 0};
        if (poll(&p, 1, (int) ((deadline - now) / 1000000u) + 1) <= 0) continue;
        char tmp[4096];
        ssize_t k = read(fd, tmp, sizeof(tmp));
        if (k <= 0) {
            buf[n] = '\0';
            return (long) n;
        }
        size_t take = (size_t) k < cap - 1 - n ? (size_t) k : cap - 1 - n;
        memcpy(buf + n, tmp, take);
        n += take;
    }
    buf[n] = '\0';
    return -1;
}

static inline void sleep_ms(unsigned ms)
{
    struct timespec ts = {(time_t) (ms / 1000), (long) (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Polls pred(arg) every 2 ms for up to ms; returns its last value. */
static inline int wait_until(int (*pred)(void *), void *arg, unsigned ms)
{
    uint64_t deadline = kvs_now_ns() + (uint64_t) ms * 1000000u;
    int ok;
    while (!(ok = pred(arg)) && kvs_now_ns() < deadline) sleep_ms(2);
    return ok;
}

/* Every line of a Prometheus text exposition: # HELP / # TYPE, or a sample with a valid name,
 * optional well-formed labels and a float value. */
static inline void expect_prometheus_min(const char *text, int min_lines)
{
    regex_t sample, help, type;
    assert_int_equal(regcomp(&sample,
                             "^[a-zA-Z_:][a-zA-Z0-9_:]*"
                             "(\\{[a-zA-Z_][a-zA-Z0-9_]*=\"([^\"\\\\]|\\\\.)*\""
                             "(,[a-zA-Z_][a-zA-Z0-9_]*=\"([^\"\\\\]|\\\\.)*\")*\\})?"
                             " (([-+]?[0-9]+(\\.[0-9]*)?([eE][-+]?[0-9]+)?)|[-+]?Inf|NaN)$",
                             REG_EXTENDED | REG_NOSUB),
                     0);
    assert_int_equal(
        regcomp(&help, "^# HELP [a-zA-Z_:][a-zA-Z0-9_:]* .+$", REG_EXTENDED | REG_NOSUB), 0);
    assert_int_equal(
        regcomp(&type,
                "^# TYPE [a-zA-Z_:][a-zA-Z0-9_:]* (counter|gauge|histogram|summary|untyped)$",
                REG_EXTENDED | REG_NOSUB),
        0);
    const char *p = text;
    int lines = 0;
    while (*p) {
        const char *nl = strchr(p, '\n');
        if (nl == NULL) fail_msg("the metrics text does not end with a newline");
        char line[512];
        snprintf(line, sizeof(line), "%.*s", (int) (nl - p), p);
        regex_t *re = strncmp(line, "# HELP ", 7) == 0   ? &help
                      : strncmp(line, "# TYPE ", 7) == 0 ? &type
                                                         : &sample;
        if (regexec(re, line, 0, NULL, 0) != 0) fail_msg("bad metrics line: '%s'", line);
        lines++;
        p = nl + 1;
    }
    assert_true(lines >= min_lines);
    regfree(&sample);
    regfree(&help);
    regfree(&type);
}

static inline void expect_prometheus(const char *text)
{
    expect_prometheus_min(text, 10);
}

/* The value of the sample whose name-and-labels part is exactly key; -1 when absent. */
static inline double metric_value(const char *text, const char *key)
{
    size_t kl = strlen(key);
    const char *p = text;
    while (p && *p) {
        if (strncmp(p, key, kl) == 0 && p[kl] == ' ') return strtod(p + kl + 1, NULL);
        p = strchr(p, '\n');
        if (p) p++;
    }
    return -1;
}

/* Histogram name: buckets non-decreasing, the +Inf bucket equal to _count; returns _count. */
static inline double expect_histogram(const char *text, const char *name)
{
    char key[160];
    double prev = 0;
    int buckets = 0;
    const char *p = text;
    snprintf(key, sizeof(key), "%s_bucket{le=\"", name);
    double inf = -1;
    while ((p = strstr(p, key)) != NULL) {
        const char *v = strstr(p, "} ");
        assert_non_null(v);
        double x = strtod(v + 2, NULL);
        if (x < prev) fail_msg("%s: buckets decrease (%g after %g)", name, x, prev);
        prev = x;
        buckets++;
        if (strncmp(p + strlen(key), "+Inf\"", 5) == 0) inf = x;
        p = v;
    }
    assert_true(buckets >= 2);
    snprintf(key, sizeof(key), "%s_count", name);
    double count = metric_value(text, key);
    if (inf != count) fail_msg("%s: +Inf bucket %g, _count %g", name, inf, count);
    snprintf(key, sizeof(key), "%s_sum", name);
    assert_true(metric_value(text, key) >= 0);
    return count;
}

/* ---- shared checks ---- */

typedef struct {
    const char *method, *path, *body;
    long status; /* with the key */
} endpoint_case_t;

/* Every case answers 401 (OpenAI error, WWW-Authenticate: Bearer, code invalid_api_key)
 * without the key or with a wrong one, and its own status with key; /health and /metrics need
 * none. */
static inline void expect_key_required(uint16_t port, const char *key, const endpoint_case_t *cases,
                                       size_t n)
{
    const char *wrong[] = {NULL, "", "wrong", "sekrit-but-longer"};
    for (size_t i = 0; i < n; i++) {
        const endpoint_case_t *c = &cases[i];
        for (size_t w = 0; w < sizeof(wrong) / sizeof(wrong[0]); w++) {
            http_resp_t r = {.api_key = wrong[w]};
            http_call(port, c->method, c->path, c->body, &r);
            if (r.status != 401)
                fail_msg("%s %s with key '%s': status %ld, expected 401",
                         c->method ? c->method : "", c->path, wrong[w] ? wrong[w] : "(none)",
                         r.status);
            expect_error_json(&r, 401, "invalid_request_error", NULL);
            assert_string_equal(r.www_auth, "Bearer");
            json_t *j = http_json(&r);
            assert_string_equal(
                json_string_value(json_object_get(json_object_get(j, "error"), "code")),
                "invalid_api_key");
            json_decref(j);
            http_resp_fini(&r);
        }
        http_resp_t r = {.api_key = key};
        http_call(port, c->method, c->path, c->body, &r);
        if (r.status != c->status)
            fail_msg("%s with the key: status %ld, expected %ld: %s", c->path, r.status, c->status,
                     r.body.ptr);
        http_resp_fini(&r);
    }
    /* /health and /metrics need none. */
    const char *open_paths[] = {"/health", "/metrics"};
    for (int i = 0; i < 2; i++) {
        http_resp_t r = {0};
        http_call(port, NULL, open_paths[i], NULL, &r);
        assert_int_equal(r.status, 200);
        http_resp_fini(&r);
    }
}

#define HALF_OPEN 1200

/* HALF_OPEN connections that sent part of a request line and then nothing, more than
 * libmicrohttpd's default limit (FD_SETSIZE - 4, 1020) would take; a normal request still gets
 * its answer at once. */
static inline void expect_answers_past_half_open(uint16_t port, const char *path, const char *body)
{
    if (!raise_fd_limit(2 * HALF_OPEN + 512)) {
        print_message("skipped: the open-file hard limit is below %d (ulimit -Hn)\n",
                      2 * HALF_OPEN + 512);
        return;
    }
    static int fds[HALF_OPEN];
    for (int i = 0; i < HALF_OPEN; i++) {
        fds[i] = raw_connect(port, "GET /v1/mo");
        if (fds[i] < 0) fail_msg("connection %d failed", i);
    }
    sleep_ms(300); /* let the server accept them all */
    uint64_t t0 = kvs_now_ns();
    http_resp_t r = {0};
    http_call(port, NULL, path, body, &r);
    uint64_t ms = (kvs_now_ns() - t0) / 1000000u;
    if (r.status != 200)
        fail_msg("status %ld (curl %d) after %llu ms", r.status, (int) r.result,
                 (unsigned long long) ms);
    assert_true(ms < 3000);
    http_resp_fini(&r);
    for (int i = 0; i < HALF_OPEN; i++) close(fds[i]);
}

#endif
