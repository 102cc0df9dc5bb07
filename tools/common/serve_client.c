/* Child servers and a small streaming HTTP client for the serving commands (serve_client.h). */
#include "common/serve_client.h"

#include <curl/curl.h>
#include <errno.h>
#include <jansson.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvstage/alloc.h"
#include "kvstage/clock.h"
#include "common/serve_signal.h"
#include "common/spawn.h"

/* ---- children ---- */

int kvs_child_start(kvs_child_t *c, char **argv)
{
    kvs_spawned_t k;
    if (kvs_spawn_self_group(c->name, argv, KVS_SPAWN_DEVNULL, KVS_SPAWN_PIPE, &k) != 0) {
        fprintf(stderr, "error: cannot start the %s: %s\n", c->name, strerror(errno));
        return -1;
    }
    c->pid = k.pid;
    c->out_fd = k.out_fd;
    c->exited = 0;
    return 0;
}

static int reap(kvs_child_t *c)
{
    if (c->pid <= 0 || c->exited) return 1;
    if (waitpid(c->pid, &c->status, WNOHANG) == c->pid) c->exited = 1;
    return c->exited;
}

static void parse_line(kvs_child_t *c)
{
    const char *u = strstr(c->line, "http://");
    size_t n = u ? strcspn(u, " ") : 0;
    snprintf(c->url, sizeof(c->url), "%.*s", (int) n, u ? u : "");
    c->bootstrap[0] = '\0';
    const char *b = strstr(c->line, "bootstrap ");
    if (b != NULL) {
        b += 10;
        snprintf(c->bootstrap, sizeof(c->bootstrap), "%.*s", (int) strcspn(b, ")"), b);
    }
}

int kvs_child_wait_line(kvs_child_t *c, const char *prefix, uint32_t timeout_s)
{
    size_t len = 0;
    const uint64_t end = kvs_now_ns() + (uint64_t) timeout_s * 1000000000ull;
    while (kvs_now_ns() < end) {
        if (kvs_serve_signal_wait(0)) return -1;
        struct pollfd pfd = {c->out_fd, POLLIN, 0};
        if (poll(&pfd, 1, 200) <= 0) {
            if (reap(c)) break;
            continue;
        }
        ssize_t n = read(c->out_fd, c->line + len, sizeof(c->line) - 1 - len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        len += (size_t) n;
        c->line[len] = '\0';
        char *nl;
        while ((nl = strchr(c->line, '\n')) != NULL) {
            *nl = '\0';
            if (strncmp(c->line, prefix, strlen(prefix)) == 0) {
                parse_line(c);
                return 0;
            }
            size_t used = (size_t) (nl - c->line) + 1;
            memmove(c->line, nl + 1, len - used + 1);
            len -= used;
        }
        if (len == sizeof(c->line) - 1) len = 0;
    }
    reap(c);
    fprintf(stderr, "error: the %s did not come up%s\n", c->name,
            c->exited ? " (it exited; its errors are above)" : " in time");
    return -1;
}

int kvs_child_stop(kvs_child_t *c, uint32_t timeout_s)
{
    if (c->pid <= 0) return 1;
    if (!reap(c)) kill(c->pid, SIGTERM);
    const uint64_t end = kvs_now_ns() + (uint64_t) timeout_s * 1000000000ull;
    while (!reap(c) && kvs_now_ns() < end) {
        struct timespec ts = {0, 20 * 1000000L};
        nanosleep(&ts, NULL);
    }
    int clean = c->exited && WIFEXITED(c->status) && WEXITSTATUS(c->status) == 0;
    if (!c->exited) fprintf(stderr, "error: the %s did not exit; killing it\n", c->name);
    kill(-c->pid, SIGKILL); /* whatever of its group is left */
    while (!reap(c)) {
        struct timespec ts = {0, 10 * 1000000L};
        nanosleep(&ts, NULL);
    }
    if (c->out_fd >= 0) close(c->out_fd);
    c->out_fd = -1;
    c->pid = 0;
    return clean;
}

/* Appends n bytes to a growing NUL-terminated buffer; 0 when out of memory. */
static int buf_append(char **buf, size_t *len, size_t *cap, const char *data, size_t n)
{
    if (*len + n + 1 > *cap) {
        size_t c = (*len + n + 1) * 2;
        char *b = kvs_realloc(*buf, c);
        if (b == NULL) return 0;
        *buf = b;
        *cap = c;
    }
    memcpy(*buf + *len, data, n);
    *len += n;
    (*buf)[*len] = '\0';
    return 1;
}

/* ---- a streamed request ---- */

static void on_event(kvs_stream_t *s, const char *data, size_t len)
{
    if (len == 6 && strncmp(data, "[DONE]", 6) == 0) return;
    json_t *ev = json_loadb(data, len, JSON_ALLOW_NUL, NULL);
    if (ev == NULL) return;
    json_t *err = json_object_get(ev, "error");
    if (err != NULL) {
        const char *m = json_string_value(json_object_get(err, "message"));
        snprintf(s->error, sizeof(s->error), "%s", m ? m : "error");
    }
    json_t *choice = json_array_get(json_object_get(ev, "choices"), 0);
    json_t *t = json_object_get(choice, "text");
    if (t == NULL) t = json_object_get(json_object_get(choice, "delta"), "content");
    size_t n = json_string_length(t);
    if (n > 0) {
        if (s->first_ns == 0) s->first_ns = kvs_now_ns();
        size_t room = sizeof(s->text) - 1 - s->text_len, k = n < room ? n : room;
        memcpy(s->text + s->text_len, json_string_value(t), k);
        s->text_len += k;
        s->text[s->text_len] = '\0';
        if (s->print) {
            fwrite(json_string_value(t), 1, n, stdout);
            fflush(stdout);
        }
    }
    const char *fin = json_string_value(json_object_get(choice, "finish_reason"));
    if (fin != NULL) snprintf(s->finish, sizeof(s->finish), "%s", fin);
    json_t *usage = json_object_get(ev, "usage");
    if (usage != NULL) {
        s->prompt_tokens = (long) json_integer_value(json_object_get(usage, "prompt_tokens"));
        s->completion_tokens =
            (long) json_integer_value(json_object_get(usage, "completion_tokens"));
        s->cached = (long) json_integer_value(
            json_object_get(json_object_get(usage, "prompt_tokens_details"), "cached_tokens"));
    }
    json_t *k = json_object_get(ev, "kvstage");
    if (k != NULL) {
        s->ttft_ns = (unsigned long long) json_integer_value(json_object_get(k, "ttft_ns"));
        s->kv_bytes = (unsigned long long) json_integer_value(json_object_get(k, "kv_bytes"));
    }
    json_decref(ev);
}

static size_t on_bytes(char *data, size_t size, size_t n, void *ud)
{
    kvs_stream_t *s = ud;
    size_t len = size * n;
    if (!buf_append(&s->buf, &s->len, &s->cap, data, len)) return 0;
    char *end;
    while ((end = strstr(s->buf, "\n\n")) != NULL) {
        if (strncmp(s->buf, "data: ", 6) == 0) on_event(s, s->buf + 6, (size_t) (end - s->buf - 6));
        size_t used = (size_t) (end - s->buf) + 2;
        memmove(s->buf, end + 2, s->len - used + 1);
        s->len -= used;
    }
    return len;
}

/* Ends a transfer once SIGINT or SIGTERM came, so that the caller can still stop its servers. */
static int on_progress(void *ud, curl_off_t a, curl_off_t b, curl_off_t c, curl_off_t d)
{
    (void) ud, (void) a, (void) b, (void) c, (void) d;
    return kvs_serve_signal_wait(0);
}

int kvs_stream_request(const char *url, const char *path, const char *body, kvs_stream_t *s)
{
    int print = s->print;
    memset(s, 0, sizeof(*s));
    s->print = print;
    CURL *c = curl_easy_init();
    if (c == NULL) {
        snprintf(s->error, sizeof(s->error), "out of memory");
        return -1;
    }
    char full[512];
    snprintf(full, sizeof(full), "%s%s", url, path);
    struct curl_slist *h = curl_slist_append(NULL, "Content-Type: application/json");
    /* Servers started from this environment require its key (kvstage serve --api-key). */
    const char *key = getenv("KVS_API_KEY");
    char auth[1100];
    if (key != NULL && key[0] != '\0' && h != NULL) {
        snprintf(auth, sizeof(auth), "Authorization: Bearer %s", key);
        struct curl_slist *h2 = curl_slist_append(h, auth);
        if (h2 != NULL) h = h2;
    }
    curl_easy_setopt(c, CURLOPT_URL, full);
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, h);
    curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_TIMEOUT, 600L);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_bytes);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, s);
    curl_easy_setopt(c, CURLOPT_XFERINFOFUNCTION, on_progress);
    curl_easy_setopt(c, CURLOPT_NOPROGRESS, 0L);
    s->t0 = kvs_now_ns();
    CURLcode rc = curl_easy_perform(c);
    s->end_ns = kvs_now_ns();
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &s->status);
    curl_easy_cleanup(c);
    curl_slist_free_all(h);
    if (rc != CURLE_OK) {
        snprintf(s->error, sizeof(s->error), "%s", curl_easy_strerror(rc));
    } else if (s->status != 200 && s->error[0] == '\0') {
        /* An error answer is one JSON object, not an event stream. */
        json_t *j = s->buf ? json_loadb(s->buf, s->len, 0, NULL) : NULL;
        const char *m = json_string_value(json_object_get(json_object_get(j, "error"), "message"));
        snprintf(s->error, sizeof(s->error), "HTTP %ld: %s", s->status, m ? m : "no message");
        json_decref(j);
    } else if (s->error[0] == '\0' && s->text_len == 0) {
        snprintf(s->error, sizeof(s->error), "no text came back");
    }
    kvs_free(s->buf);
    s->buf = NULL;
    s->len = s->cap = 0;
    return rc == CURLE_OK && s->status == 200 && s->error[0] == '\0' &&
                   strcmp(s->finish, "error") != 0
               ? 0
               : -1;
}

/* ---- metrics ---- */

typedef struct {
    char *buf;
    size_t len, cap;
} text_t;

static size_t on_text(char *data, size_t size, size_t n, void *ud)
{
    text_t *t = ud;
    size_t len = size * n;
    return buf_append(&t->buf, &t->len, &t->cap, data, len) ? len : 0;
}

double kvs_metric_get(const char *url, const char *name)
{
    char full[256];
    snprintf(full, sizeof(full), "%s/metrics", url);
    text_t t = {0};
    CURL *c = curl_easy_init();
    if (c == NULL) return -1;
    curl_easy_setopt(c, CURLOPT_URL, full);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_TIMEOUT, 30L);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_text);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &t);
    CURLcode rc = curl_easy_perform(c);
    curl_easy_cleanup(c);
    double v = -1;
    char pat[160];
    snprintf(pat, sizeof(pat), "\n%s ", name);
    const char *p = rc == CURLE_OK && t.buf ? strstr(t.buf, pat) : NULL;
    if (p != NULL) v = strtod(p + strlen(pat), NULL);
    kvs_free(t.buf);
    return v;
}
