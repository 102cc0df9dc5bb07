/* The prefill/decode router: an HTTP front (libmicrohttpd) whose requests each run on a thread
 * of their own (a "job") that picks the servers, forwards the body to a prefill and a decode
 * server at once (libcurl multi) and hands the decode answer to the client connection as it
 * arrives; a health thread keeps the liveness of every server.
 *
 * A job is shared by the client connection and its thread (a reference each). The thread only
 * appends to the job's buffer and wakes the connection; the connection's MHD thread copies out.
 * As in the server, whoever flips job->suspended from 1 to 0 resumes the connection, and the
 * thread resumes before it leaves the router's job count, so the daemon never stops with a
 * suspended connection. */
#include "http/router.h"

#include <curl/curl.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <sys/types.h>
#include <time.h>

#include "kvstage/alloc.h"
#include "kvstage/clock.h"
#include "kvstage/log.h"
#include "http/server_internal.h"

#define MAX_FORWARDED_BYTES ((size_t) 64 << 20)

typedef struct {
    char *url; /* base URL without a trailing slash */
    kvs_router_side_t side;
    int up;          /* atomic */
    char *bootstrap; /* from /internal/info, under router->mu; NULL when not declared */
    int removed;     /* atomic: taken out by kvs_router_remove_server (never chosen, checked) */
    uint64_t chosen, failures, prefix_hits; /* atomic */
    /* Load, for the choice (atomic): the last /internal/info's requests_live (high 32 bits)
     * with this router's requests on the server when it was asked (low 32), its kv_pages_free,
     * and this router's requests on it now. */
    uint64_t info_live;
    uint32_t pages_free;
    uint32_t inflight;
    uint32_t lost;   /* atomic: health checks that found it unreachable; legs on it then fail */
    uint32_t silent; /* under check_mu: health checks in a row that timed out */
    uint32_t checks; /* under check_mu: health checks that came to a verdict */
    int from_config, from_file; /* under router->mu: given at creation; listed by servers_file */
} rserver_t;

typedef enum {
    EP_UNKNOWN = 0,
    EP_COMPLETIONS,
    EP_CHAT,
    EP_MODELS,
    EP_MODEL, /* /v1/models/{id} */
    EP_HEALTH,
    EP_METRICS,
    EP_TOKENIZE,
    EP_DETOKENIZE,
    EP_ADMIN_SERVERS, /* POST /admin/servers */
} ep_t;

#define MODEL_PREFIX "/v1/models/"

struct kvs_router {
    rserver_t *servers[2]; /* [KVS_ROUTER_MAX_SERVERS], the first n[side] in use */
    size_t n[2];           /* atomic (acquire/release): grows under mu by kvs_router_add_server */
    kvs_router_policy_t policy[2];
    uint64_t rr[2]; /* atomic round-robin positions */
    uint32_t health_interval_ms, connect_timeout_ms, request_timeout_ms, match_timeout_ms;
    char *servers_file; /* or NULL */
    size_t max_body;
    int strict;
    char *api_key;      /* required of clients, or NULL */
    char *server_key;   /* sent to the servers, or NULL */
    uint64_t next_room; /* atomic */
    struct MHD_Daemon *daemon;
    uint16_t port;

    pthread_mutex_t mu; /* stopping, n_jobs, bootstrap strings */
    pthread_cond_t cv;
    int stopping;     /* also read with atomics by jobs */
    uint32_t n_jobs;  /* job threads running */
    uint32_t n_conns; /* client requests not yet freed */
    pthread_t health_thread;
    pthread_mutex_t check_mu; /* one health pass at a time */

    uint64_t http_codes[600]; /* atomic */
    uint64_t requests;        /* atomic */
    uint64_t cancels_sent;    /* atomic: POST /internal/cancel sent to a server */
    uint64_t kv_bytes;        /* atomic: KV bytes the decode servers reported */
    kvs__hist_t transfer;     /* handoff time the prefill servers reported */
};

/* How the decode answer reaches the client: as it comes, or held back until the prefill
 * leg's report is in, so that its "kvstage" object can carry both sides. */
typedef enum {
    HOLD_NONE = 0, /* an error answer or another type: passed through */
    HOLD_ALL,      /* a JSON answer: all of it (it comes in one piece at the end anyway) */
    HOLD_SSE,      /* a stream: the events before the one with "kvstage" pass, the rest wait */
} hold_t;

typedef struct {
    kvs_router_t *rt;
    struct MHD_Connection *conn;
    ep_t ep;
    int method_ok;
    int authorized;
    char method[8];
    char path[64];
    char *proxy_path; /* EP_MODEL: the path asked of a server (the id escaped again) */
    kvs__body_t body;
    int body_oom;
    json_t *root; /* the client's body, parsed (unknown fields removed) */
    kvs__api_ignored_t ignored;

    pthread_mutex_t mu;
    int refs;
    int started;
    /* Under mu: */
    int suspended;
    int client_gone;
    int headers_ready; /* the decode answer's status and type are known */
    long status;
    char ctype[128];
    kvs__sb_t buf; /* answer bytes not yet handed to MHD */
    hold_t hold;
    const char *served[2]; /* the prefill and decode servers' URLs (the router's, for its life) */
    kvs__sb_t part;        /* HOLD_SSE: the bytes of an event not complete yet */
    kvs__sb_t held;        /* decode bytes held back for the merge */
    int holding;           /* HOLD_SSE: the "kvstage" event came; everything after it waits */
    int finished;          /* no more bytes will come */
    int broken;            /* finished by a failure after the headers: end the body with an error */
    int failed;            /* finished by a failure before the headers: answer fail_* */
    unsigned fail_status;
    const char *fail_code;
    char fail_msg[256];
    char *fail_body; /* a server's own error answer to pass through, or NULL */
} job_t;

static pthread_once_t g_curl_once = PTHREAD_ONCE_INIT;
static int g_curl_ok;

static void curl_setup(void)
{
    g_curl_ok = curl_global_init(CURL_GLOBAL_DEFAULT) == CURLE_OK;
}

static int stopping(kvs_router_t *rt)
{
    return __atomic_load_n(&rt->stopping, __ATOMIC_RELAXED);
}

/* A completions request with echo and logprobs (the prefill side computes the prompt's). */
static int echo_logprobs(const job_t *j)
{
    json_t *lp = json_object_get(j->root, "logprobs");
    return j->ep == EP_COMPLETIONS && json_is_true(json_object_get(j->root, "echo")) &&
           lp != NULL && !json_is_null(lp) && !json_is_false(lp);
}

/* ---- jobs ---- */

static void job_unref(job_t *j)
{
    pthread_mutex_lock(&j->mu);
    int last = --j->refs == 0;
    pthread_mutex_unlock(&j->mu);
    if (!last) return;
    kvs__body_fini(&j->body);
    kvs_free(j->proxy_path);
    json_decref(j->root);
    kvs__sb_fini(&j->buf);
    kvs__sb_fini(&j->part);
    kvs__sb_fini(&j->held);
    kvs_free(j->fail_body);
    pthread_mutex_destroy(&j->mu);
    kvs_router_t *rt = j->rt;
    kvs_free(j);
    pthread_mutex_lock(&rt->mu);
    rt->n_conns--;
    pthread_cond_broadcast(&rt->cv);
    pthread_mutex_unlock(&rt->mu);
}

/* Under j->mu: whether to resume after unlocking. */
static int take_wake(job_t *j)
{
    int wake = j->suspended;
    j->suspended = 0;
    return wake;
}

static void job_fail(job_t *j, unsigned status, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Ends the job with an error: an error answer when nothing was forwarded yet, else an error
 * event at the end of an event stream (or a broken body). */
static void job_fail(job_t *j, unsigned status, const char *code, const char *fmt, ...)
{
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    if (status >= 500)
        kvs_warn("router: %s", msg);
    else
        kvs_debug("router: %s", msg); /* the client's own mistake, answered by a server */
    pthread_mutex_lock(&j->mu);
    if (!j->finished) {
        if (!j->headers_ready) {
            j->failed = 1;
            j->fail_status = status;
            j->fail_code = code;
            snprintf(j->fail_msg, sizeof(j->fail_msg), "%s", msg);
        } else if (strncmp(j->ctype, "text/event-stream", 17) == 0) {
            /* An error event after the last whole one, and no [DONE]: clients read [DONE] as
             * success. A partial event from the server is dropped. */
            char *err = kvs__json_error(msg, "server_error", NULL, code);
            kvs__sb_consume(&j->part, j->part.len); /* an event cut short is dropped */
            kvs__sb_consume(&j->held, j->held.len);
            kvs__sb_printf(&j->buf, "data: %s\n\n", err ? err : "{}"); /* no [DONE] */
            if (err == NULL || j->buf.oom) j->broken = 1;
            kvs_free(err);
        } else {
            j->broken = 1;
        }
        j->finished = 1;
    }
    int wake = take_wake(j);
    struct MHD_Connection *conn = j->conn;
    pthread_mutex_unlock(&j->mu);
    if (wake) MHD_resume_connection(conn);
}

static void job_finish(job_t *j)
{
    pthread_mutex_lock(&j->mu);
    j->finished = 1;
    int wake = take_wake(j);
    struct MHD_Connection *conn = j->conn;
    pthread_mutex_unlock(&j->mu);
    if (wake) MHD_resume_connection(conn);
}

static int job_abandoned(job_t *j)
{
    pthread_mutex_lock(&j->mu);
    /* A client waiting for the answer's headers on a suspended connection is not watched by
     * libmicrohttpd: look. (Once an answer streams, a hang-up shows at the next write.) */
    if (!j->client_gone && j->suspended && !j->headers_ready && j->conn != NULL &&
        kvs__http_client_left(j->conn))
        j->client_gone = 1;
    int gone = j->client_gone;
    pthread_mutex_unlock(&j->mu);
    return gone || stopping(j->rt);
}

/* ---- one forwarded transfer ---- */

typedef struct {
    job_t *job;
    rserver_t *server;
    CURL *easy;
    struct curl_slist *headers;
    char *payload;  /* the body sent */
    int to_client;  /* the decode leg: bytes go to the client */
    kvs__sb_t resp; /* other legs: the answer, up to 64 KiB */
    char ctype[128];
    int done;
    int dropped;            /* ended by the router before its answer came */
    int lost;               /* ended because a health check found its server unreachable */
    uint32_t lost_at_start; /* the server's lost count when the leg began */
    CURLcode result;
    long status;
} leg_t;

static size_t leg_header(char *data, size_t size, size_t n, void *ud)
{
    leg_t *leg = ud;
    size_t len = size * n;
    if (len >= 5 && strncmp(data, "HTTP/", 5) == 0) {
        leg->ctype[0] = '\0';
    } else if (len > 13 && strncasecmp(data, "Content-Type:", 13) == 0) {
        size_t a = 13, b = len;
        while (a < b && (data[a] == ' ' || data[a] == '\t')) a++;
        while (b > a && (data[b - 1] == '\r' || data[b - 1] == '\n' || data[b - 1] == ' ')) b--;
        snprintf(leg->ctype, sizeof(leg->ctype), "%.*s", (int) (b - a), data + a);
    } else if (leg->to_client && (len == 2 && data[0] == '\r')) {
        long code = 0;
        curl_easy_getinfo(leg->easy, CURLINFO_RESPONSE_CODE, &code);
        if (code >= 200) {
            job_t *j = leg->job;
            pthread_mutex_lock(&j->mu);
            if (!j->finished && !j->headers_ready) {
                j->headers_ready = 1;
                j->status = code;
                snprintf(j->ctype, sizeof(j->ctype), "%s",
                         leg->ctype[0] ? leg->ctype : "application/json");
                if (code >= 200 && code < 300 && (j->ep == EP_COMPLETIONS || j->ep == EP_CHAT))
                    j->hold = strncmp(j->ctype, "text/event-stream", 17) == 0  ? HOLD_SSE
                              : strncmp(j->ctype, "application/json", 16) == 0 ? HOLD_ALL
                                                                               : HOLD_NONE;
                /* A stream that echoes the prompt with logprobs waits whole for the prefill
                 * answer: its first event needs the prompt's logprobs from there. */
                if (j->hold == HOLD_SSE && echo_logprobs(j)) j->holding = 1;
            }
            int wake = take_wake(j);
            struct MHD_Connection *conn = j->conn;
            pthread_mutex_unlock(&j->mu);
            if (wake) MHD_resume_connection(conn);
        }
    }
    return len;
}

/* Under j->mu: the decode answer's next bytes, into buf (to the client now) or held. */
static void take_decode_bytes(job_t *j, const char *data, size_t len)
{
    if (j->hold == HOLD_NONE) {
        kvs__sb_append(&j->buf, data, len);
        return;
    }
    if (j->hold == HOLD_ALL || j->holding) {
        kvs__sb_append(&j->held, data, len);
        return;
    }
    kvs__sb_append(&j->part, data, len);
    if (j->part.oom) return;
    /* Complete events pass until the one that carries "kvstage" (the usage chunk). */
    size_t at = 0;
    for (;;) {
        const char *ev = j->part.ptr + at;
        const char *end = strstr(ev, "\n\n");
        if (end == NULL) break;
        size_t n = (size_t) (end - ev) + 2;
        const char *k = strstr(ev, "\"kvstage\"");
        if (k != NULL && k < end) {
            j->holding = 1;
            kvs__sb_append(&j->held, j->part.ptr + at, j->part.len - at);
            at = j->part.len;
            break;
        }
        kvs__sb_append(&j->buf, ev, n);
        at += n;
    }
    kvs__sb_consume(&j->part, at);
}

static size_t leg_write(char *data, size_t size, size_t n, void *ud)
{
    leg_t *leg = ud;
    size_t len = size * n;
    if (!leg->to_client) {
        /* The prefill answer: its report, and (echo with logprobs) the prompt's logprobs. */
        if (leg->resp.len + len <= MAX_FORWARDED_BYTES) kvs__sb_append(&leg->resp, data, len);
        return len;
    }
    job_t *j = leg->job;
    pthread_mutex_lock(&j->mu);
    int ok = !j->finished && j->buf.len + j->held.len + j->part.len + len <= MAX_FORWARDED_BYTES;
    if (ok) take_decode_bytes(j, data, len);
    if (j->buf.oom || j->held.oom || j->part.oom) ok = 0;
    int wake = ok ? take_wake(j) : 0;
    struct MHD_Connection *conn = j->conn;
    pthread_mutex_unlock(&j->mu);
    if (wake) MHD_resume_connection(conn);
    return ok ? len : 0; /* 0 aborts the transfer */
}

static void leg_fini(leg_t *leg)
{
    if (leg->easy) curl_easy_cleanup(leg->easy);
    curl_slist_free_all(leg->headers);
    kvs_free(leg->payload);
    kvs__sb_fini(&leg->resp);
    memset(leg, 0, sizeof(*leg));
}

/* Sets up a request to server + path (with the router's key for the servers, if any); payload
 * (owned from now on) NULL means GET. */
static kvs_status_t leg_init(leg_t *leg, kvs_router_t *rt, job_t *j, rserver_t *s, const char *path,
                             char *payload, uint32_t timeout_ms, int to_client)
{
    memset(leg, 0, sizeof(*leg));
    leg->job = j;
    leg->server = s;
    leg->lost_at_start = __atomic_load_n(&s->lost, __ATOMIC_RELAXED);
    leg->payload = payload;
    leg->to_client = to_client;
    leg->easy = curl_easy_init();
    char url[512];
    snprintf(url, sizeof(url), "%s%s", s->url, path);
    if (leg->easy == NULL) {
        kvs_error("router: no curl handle for %s", url);
        return KVS_ERR_NOMEM;
    }
    CURL *e = leg->easy;
    curl_easy_setopt(e, CURLOPT_URL, url);
    curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, (long) timeout_ms);
    curl_easy_setopt(e, CURLOPT_HEADERFUNCTION, leg_header);
    curl_easy_setopt(e, CURLOPT_HEADERDATA, leg);
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, leg_write);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, leg);
    const char *key = rt->server_key;
    char auth[1100];
    snprintf(auth, sizeof(auth), "Authorization: Bearer %s", key ? key : "");
    const char *lines[] = {payload ? "Content-Type: application/json" : NULL,
                           payload ? "Expect:" : NULL, key ? auth : NULL};
    for (size_t i = 0; i < sizeof(lines) / sizeof(lines[0]); i++) {
        if (lines[i] == NULL) continue;
        struct curl_slist *h = curl_slist_append(leg->headers, lines[i]);
        if (h == NULL) {
            kvs_error("router: no memory for the headers of %s", url);
            return KVS_ERR_NOMEM;
        }
        leg->headers = h;
    }
    curl_easy_setopt(e, CURLOPT_HTTPHEADER, leg->headers);
    if (payload != NULL) {
        curl_easy_setopt(e, CURLOPT_POSTFIELDS, payload);
        curl_easy_setopt(e, CURLOPT_POSTFIELDSIZE, (long) strlen(payload));
    }
    return KVS_OK;
}

static int connection_failure(CURLcode c)
{
    return c == CURLE_COULDNT_CONNECT || c == CURLE_COULDNT_RESOLVE_HOST ||
           c == CURLE_OPERATION_TIMEDOUT || c == CURLE_GOT_NOTHING || c == CURLE_RECV_ERROR ||
           c == CURLE_SEND_ERROR || c == CURLE_PARTIAL_FILE;
}

static const char *side_name(kvs_router_side_t side)
{
    return side == KVS_ROUTER_PREFILL ? "prefill" : "decode";
}

static void mark_down(rserver_t *s, const char *why)
{
    __atomic_add_fetch(&s->failures, 1, __ATOMIC_RELAXED);
    if (__atomic_exchange_n(&s->up, 0, __ATOMIC_RELAXED))
        kvs_warn("router: %s server %s is out of rotation: %s", side_name(s->side), s->url, why);
}

/* Drives legs until one more of them is done (or, with all, every one), or the job is
 * abandoned. */
static void run_legs(CURLM *multi, leg_t **legs, size_t n, job_t *j, int all)
{
    for (;;) {
        int running = 0, newly = 0;
        curl_multi_perform(multi, &running);
        CURLMsg *msg;
        int left;
        while ((msg = curl_multi_info_read(multi, &left)) != NULL) {
            if (msg->msg != CURLMSG_DONE) continue;
            for (size_t i = 0; i < n; i++) {
                if (legs[i] && !legs[i]->done && legs[i]->easy == msg->easy_handle) {
                    legs[i]->done = 1;
                    legs[i]->result = msg->data.result;
                    curl_easy_getinfo(legs[i]->easy, CURLINFO_RESPONSE_CODE, &legs[i]->status);
                    newly++;
                }
            }
        }
        size_t pending = 0;
        for (size_t i = 0; i < n; i++) {
            leg_t *l = legs[i];
            if (l == NULL || l->done) continue;
            if (__atomic_load_n(&l->server->lost, __ATOMIC_RELAXED) != l->lost_at_start) {
                /* Its server stopped answering health checks: waiting on it would hang. */
                curl_multi_remove_handle(multi, l->easy);
                l->done = l->lost = 1;
                l->result = CURLE_RECV_ERROR;
                newly++;
                continue;
            }
            pending++;
        }
        if (pending == 0 || (newly && !all) || (j && job_abandoned(j))) return;
        curl_multi_poll(multi, NULL, 0, 50, NULL);
    }
}

/* ---- choosing servers ---- */

/* A decode server bound to a prefill instance (it declares that instance's bootstrap) can only
 * take that instance's rooms; one that declares none, or a prefill server that declares none,
 * pairs with anything. */
static int paired(kvs_router_t *rt, const rserver_t *pre, const rserver_t *dec)
{
    pthread_mutex_lock(&rt->mu);
    int ok = pre->bootstrap == NULL || dec->bootstrap == NULL ||
             strcmp(pre->bootstrap, dec->bootstrap) == 0;
    pthread_mutex_unlock(&rt->mu);
    return ok;
}

static size_t nservers(const kvs_router_t *rt, int side)
{
    return __atomic_load_n(&rt->n[side], __ATOMIC_ACQUIRE);
}

static int in_rotation(const rserver_t *s)
{
    return __atomic_load_n(&s->up, __ATOMIC_RELAXED) &&
           !__atomic_load_n(&s->removed, __ATOMIC_RELAXED);
}

/* Whether s can be chosen: in rotation and, for a prefill server, with a live decode partner;
 * for a decode server, a partner of the chosen prefill server (pre). */
static int eligible(kvs_router_t *rt, rserver_t *s, const rserver_t *pre)
{
    if (!in_rotation(s)) return 0;
    if (s->side == KVS_ROUTER_DECODE) return pre == NULL || paired(rt, pre, s);
    for (size_t i = 0, n = nservers(rt, KVS_ROUTER_DECODE); i < n; i++) {
        const rserver_t *d = &rt->servers[KVS_ROUTER_DECODE][i];
        if (in_rotation(d) && paired(rt, s, d)) return 1;
    }
    return 0;
}

/* The requests on s now, as far as the router knows: those its last /internal/info counted that
 * were not this router's, and this router's own now (exact, and fresher than any poll). */
static uint64_t load_of(const rserver_t *s)
{
    uint64_t info = __atomic_load_n(&s->info_live, __ATOMIC_RELAXED);
    uint32_t live = (uint32_t) (info >> 32), mine_then = (uint32_t) info;
    uint64_t others = live > mine_then ? live - mine_then : 0;
    return others + __atomic_load_n(&s->inflight, __ATOMIC_RELAXED);
}

/* Whether a is less loaded than b (NULL: anything is): fewer requests, then more free pages. */
static int less_loaded(const rserver_t *a, const rserver_t *b)
{
    if (b == NULL) return 1;
    uint64_t la = load_of(a), lb = load_of(b);
    if (la != lb) return la < lb;
    return __atomic_load_n(&a->pages_free, __ATOMIC_RELAXED) >
           __atomic_load_n(&b->pages_free, __ATOMIC_RELAXED);
}

/* The least loaded eligible server; ties in round-robin order. */
static rserver_t *pick_least_loaded(kvs_router_t *rt, kvs_router_side_t side, const rserver_t *pre)
{
    size_t n = nservers(rt, side);
    uint64_t start = __atomic_fetch_add(&rt->rr[side], 1, __ATOMIC_RELAXED);
    rserver_t *best = NULL;
    for (size_t i = 0; i < n; i++) {
        rserver_t *s = &rt->servers[side][(start + i) % n];
        if (eligible(rt, s, pre) && less_loaded(s, best)) best = s;
    }
    return best;
}

static rserver_t *pick_round_robin(kvs_router_t *rt, kvs_router_side_t side, const rserver_t *pre)
{
    size_t n = nservers(rt, side);
    uint64_t start = __atomic_fetch_add(&rt->rr[side], 1, __ATOMIC_RELAXED);
    for (size_t i = 0; i < n; i++) {
        rserver_t *s = &rt->servers[side][(start + i) % n];
        if (eligible(rt, s, pre)) return s;
    }
    return NULL;
}

static rserver_t *pick_prefix(kvs_router_t *rt, kvs_router_side_t side, job_t *j,
                              const rserver_t *pre)
{
    size_t n = nservers(rt, side);
    uint64_t start = __atomic_fetch_add(&rt->rr[side], 1, __ATOMIC_RELAXED);
    leg_t *legs = kvs_calloc(n, sizeof(leg_t));
    leg_t **ptrs = kvs_calloc(n, sizeof(leg_t *));
    CURLM *multi = curl_multi_init();
    rserver_t *best = NULL;
    long best_cached = -1;
    if (legs == NULL || ptrs == NULL || multi == NULL) goto out;
    for (size_t i = 0; i < n; i++) {
        rserver_t *s = &rt->servers[side][(start + i) % n];
        if (!eligible(rt, s, pre)) continue;
        char *payload = kvs_malloc(j->body.len + 1);
        if (payload == NULL) continue;
        memcpy(payload, j->body.data, j->body.len);
        payload[j->body.len] = '\0';
        if (leg_init(&legs[i], rt, j, s, "/internal/match", payload, rt->match_timeout_ms, 0) !=
            KVS_OK) {
            leg_fini(&legs[i]);
            continue;
        }
        curl_multi_add_handle(multi, legs[i].easy);
        ptrs[i] = &legs[i];
    }
    run_legs(multi, ptrs, n, j, 1);
    /* In round-robin order from start: equal prefixes go to the less loaded server, then to the
     * next in turn. */
    for (size_t i = 0; i < n; i++) {
        rserver_t *s = &rt->servers[side][(start + i) % n];
        if (!eligible(rt, s, pre)) continue;
        long cached = 0;
        leg_t *leg = ptrs[i];
        if (leg && leg->done && leg->result == CURLE_OK && leg->status == 200) {
            json_t *ans = json_loadb(leg->resp.ptr ? leg->resp.ptr : "", leg->resp.len, 0, NULL);
            json_t *c = json_object_get(ans, "cached_tokens");
            if (json_is_integer(c)) cached = (long) json_integer_value(c);
            json_decref(ans);
        } else if (leg && leg->done && connection_failure(leg->result) &&
                   leg->result != CURLE_OPERATION_TIMEDOUT) {
            /* A slow answer (a server in a long forward pass) only counts as no cache hit. */
            mark_down(s, curl_easy_strerror(leg->result));
            continue;
        }
        if (cached > best_cached || (cached == best_cached && less_loaded(s, best))) {
            best_cached = cached;
            best = s;
        }
    }
    if (best && best_cached > 0) __atomic_add_fetch(&best->prefix_hits, 1, __ATOMIC_RELAXED);
out:
    for (size_t i = 0; legs && i < n; i++) {
        if (legs[i].easy && multi) curl_multi_remove_handle(multi, legs[i].easy);
        leg_fini(&legs[i]);
    }
    if (multi) curl_multi_cleanup(multi);
    kvs_free(ptrs);
    kvs_free(legs);
    return best ? best : pick_least_loaded(rt, side, pre);
}

/* pre: for the decode side, the prefill server already chosen. */
static rserver_t *pick(kvs_router_t *rt, kvs_router_side_t side, job_t *j, const rserver_t *pre)
{
    if (rt->policy[side] == KVS_ROUTER_PREFIX && j->body.len > 0)
        return pick_prefix(rt, side, j, pre);
    if (rt->policy[side] == KVS_ROUTER_LEAST_LOADED) return pick_least_loaded(rt, side, pre);
    return pick_round_robin(rt, side, pre);
}

/* The client's body with "kvstage" added (and, for the prefill leg, streaming off). seed: the
 * one both legs get when the client gave none (the prefill side draws the first token, the
 * decode side the rest: one stream only if they agree). */
static char *forward_body(job_t *j, uint64_t room, kvs_router_side_t side, rserver_t *prefill,
                          uint64_t seed)
{
    kvs_router_t *rt = j->rt;
    json_t *copy = json_deep_copy(j->root);
    json_t *k = json_pack("{s:I, s:s}", "room", (json_int_t) room, "role", side_name(side));
    json_t *s = json_object_get(j->root, "seed");
    if (copy == NULL || k == NULL ||
        ((s == NULL || json_is_null(s)) &&
         json_object_set_new(copy, "seed", json_integer((json_int_t) seed)) != 0)) {
        json_decref(copy);
        json_decref(k);
        return NULL;
    }
    if (side == KVS_ROUTER_PREFILL) {
        json_object_set_new(copy, "stream", json_false());
        json_object_del(copy, "stream_options");
    } else {
        json_object_set_new(k, "prefill", json_string(prefill->url));
        pthread_mutex_lock(&rt->mu);
        if (prefill->bootstrap)
            json_object_set_new(k, "bootstrap", json_string(prefill->bootstrap));
        pthread_mutex_unlock(&rt->mu);
    }
    json_object_set_new(copy, "kvstage", k);
    return kvs__json_dump_steal(copy);
}

/* A leg that failed in transit: 503 when its server is unreachable or went away (refused,
 * reset, closed, or found unreachable by a health check meanwhile), 504 when it timed out, 502
 * otherwise. */
static void fail_from_curl(job_t *j, leg_t *leg)
{
    rserver_t *s = leg->server;
    int timeout = !leg->lost && leg->result == CURLE_OPERATION_TIMEDOUT;
    int gone = leg->lost || (!timeout && connection_failure(leg->result));
    if (!leg->lost && connection_failure(leg->result))
        mark_down(s, curl_easy_strerror(leg->result));
    if (leg->lost)
        job_fail(j, 503, "server_unavailable",
                 "%s server %s stopped answering (out of rotation); the request was on it",
                 side_name(s->side), s->url);
    else
        job_fail(j,
                 timeout ? 504
                 : gone  ? 503
                         : 502,
                 timeout ? "gateway_timeout"
                 : gone  ? "server_unavailable"
                         : "bad_gateway",
                 "%s server %s: %s", side_name(s->side), s->url, curl_easy_strerror(leg->result));
}

/* A server's own error answer, passed to the client when nothing else was sent yet. */
static void fail_passthrough(job_t *j, leg_t *leg)
{
    pthread_mutex_lock(&j->mu);
    int fresh = !j->finished && !j->headers_ready;
    if (fresh && leg->resp.len > 0 && leg->resp.ptr) {
        j->fail_body = kvs_malloc(leg->resp.len + 1);
        if (j->fail_body) memcpy(j->fail_body, leg->resp.ptr, leg->resp.len + 1);
    }
    pthread_mutex_unlock(&j->mu);
    /* Its error's message goes with the status, for a client the answer no longer reaches. */
    json_t *ans = leg->resp.len ? json_loadb(leg->resp.ptr, leg->resp.len, 0, NULL) : NULL;
    const char *why = json_string_value(json_object_get(json_object_get(ans, "error"), "message"));
    job_fail(j, (unsigned) leg->status, "upstream_error", "%s server %s answered %ld%s%s",
             side_name(leg->server->side), leg->server->url, leg->status, why ? ": " : "",
             why ? why : "");
    json_decref(ans);
}

/* Tells server s to give up room (POST /internal/cancel): the other side refused or failed
 * it, or the client left, and a prefill server would otherwise hold its slot and pages until
 * its transfer timed out. Best effort: a server that does not answer is failing anyway. */
static void cancel_room(kvs_router_t *rt, rserver_t *s, uint64_t room)
{
    /* A leg like any other, so that it carries the servers' API key too. */
    char *body = kvs_malloc(64);
    leg_t leg;
    memset(&leg, 0, sizeof(leg));
    if (body != NULL) snprintf(body, 64, "{\"room\":%llu}", (unsigned long long) room);
    /* leg_init owns body from its first line: leg_fini frees it either way. */
    if (body == NULL || leg_init(&leg, rt, NULL, s, "/internal/cancel", body,
                                 rt->connect_timeout_ms * 2, 0) != KVS_OK) {
        leg_fini(&leg);
        kvs_warn("router: room %llu: no memory to cancel it on %s", (unsigned long long) room,
                 s->url);
        return;
    }
    curl_easy_setopt(leg.easy, CURLOPT_CONNECTTIMEOUT_MS, (long) rt->connect_timeout_ms);
    CURLcode c = curl_easy_perform(leg.easy);
    __atomic_add_fetch(&rt->cancels_sent, 1, __ATOMIC_RELAXED);
    kvs_debug("router: room %llu cancelled on %s %s: %s", (unsigned long long) room,
              side_name(s->side), s->url, curl_easy_strerror(c));
    leg_fini(&leg);
}

/* Both sides' reports in one "kvstage" object: the decode server's fields, "transfer_ns" the
 * prefill server's handoff time (from its last prompt chunk to the room concluded; the decode
 * side does not know when the prompt was done), and each server's whole report under
 * "prefill" and "decode". Counts the room's bytes for /metrics. */
static void merge_report(kvs_router_t *rt, const job_t *j, json_t *obj, json_t *pre)
{
    json_t *dec = json_object_get(obj, "kvstage");
    if (!json_is_object(dec)) return;
    json_t *both = json_deep_copy(dec);
    if (both == NULL) return;
    json_object_set_new(both, "servers",
                        json_pack("{s:s, s:s}", "prefill", j->served[KVS_ROUTER_PREFILL], "decode",
                                  j->served[KVS_ROUTER_DECODE]));
    json_t *t = json_object_get(pre, "transfer_ns");
    if (json_is_integer(t)) json_object_set(both, "transfer_ns", t);
    json_object_set(both, "decode", dec);
    if (json_is_object(pre)) json_object_set(both, "prefill", pre);
    json_int_t bytes = json_integer_value(json_object_get(dec, "kv_bytes"));
    if (bytes > 0) __atomic_add_fetch(&rt->kv_bytes, (uint64_t) bytes, __ATOMIC_RELAXED);
    json_object_set_new(obj, "kvstage", both);
}

/* Echo with logprobs: the decode server has no logits of the prompt, so its prompt entries
 * (the first ones of each choice's answer, or of each choice's first stream event) have null
 * logprobs; the prefill server's answer (one choice: the prompt is computed once) has the same
 * entries (same tokens and offsets) with the logprobs computed in its prefill pass. Each null
 * entry i of every choice takes the prefill answer's entry i. Generated entries are never null,
 * so later events are left as they are. */
static void merge_prompt_logprobs(json_t *obj, json_t *pre_root)
{
    json_t *pl =
        json_object_get(json_array_get(json_object_get(pre_root, "choices"), 0), "logprobs");
    json_t *pv = json_object_get(pl, "token_logprobs"), *pt = json_object_get(pl, "top_logprobs");
    if (!json_is_array(pv) || !json_is_array(pt)) return;
    json_t *choices = json_object_get(obj, "choices");
    for (size_t c = 0; c < json_array_size(choices); c++) {
        json_t *dl = json_object_get(json_array_get(choices, c), "logprobs");
        json_t *dv = json_object_get(dl, "token_logprobs");
        json_t *dt = json_object_get(dl, "top_logprobs");
        if (!json_is_array(dv) || !json_is_array(dt)) continue;
        for (size_t i = 0; i < json_array_size(dv) && i < json_array_size(pv); i++) {
            if (!json_is_null(json_array_get(dv, i))) continue;
            json_array_set(dv, i, json_array_get(pv, i));
            if (i < json_array_size(dt) && i < json_array_size(pt))
                json_array_set(dt, i, json_array_get(pt, i));
        }
    }
}

/* One held JSON text with the merged report, appended to out; unchanged when it is not JSON. */
static void merge_text(kvs_router_t *rt, const job_t *j, kvs__sb_t *out, const char *text,
                       size_t len, json_t *pre_root)
{
    json_t *pre = json_object_get(pre_root, "kvstage");
    json_t *obj = json_loadb(text, len, 0, NULL);
    char *merged = NULL;
    if (json_is_object(obj)) {
        merge_report(rt, j, obj, pre);
        merge_prompt_logprobs(obj, pre_root);
        merged = kvs__json_dump_steal(obj);
        obj = NULL;
    }
    json_decref(obj);
    if (merged) {
        kvs__sb_puts(out, merged);
        kvs_free(merged);
    } else {
        kvs__sb_append(out, text, len);
    }
}

/* Hands the held decode bytes to the client, the "kvstage" report merged with the prefill
 * leg's (pre_resp: its answer, or NULL when it failed). */
static void flush_held(job_t *j, const kvs__sb_t *pre_resp)
{
    kvs_router_t *rt = j->rt;
    json_t *pre_root =
        pre_resp && pre_resp->len ? json_loadb(pre_resp->ptr, pre_resp->len, 0, NULL) : NULL;
    json_t *pre = json_object_get(pre_root, "kvstage");
    json_int_t t = json_integer_value(json_object_get(pre, "transfer_ns"));
    if (t > 0) kvs__hist_observe(&rt->transfer, (uint64_t) t);
    pthread_mutex_lock(&j->mu);
    kvs__sb_t held = j->held;
    kvs__sb_init(&j->held);
    hold_t hold = j->hold;
    pthread_mutex_unlock(&j->mu);
    kvs__sb_t out;
    kvs__sb_init(&out);
    if (hold == HOLD_ALL && held.len > 0) {
        merge_text(rt, j, &out, held.ptr, held.len, pre_root);
    } else if (held.len > 0) { /* events: "data: X\n\n" */
        size_t at = 0;
        while (at < held.len) {
            const char *ev = held.ptr + at;
            const char *end = strstr(ev, "\n\n");
            size_t n = end ? (size_t) (end - ev) + 2 : held.len - at;
            if (end && strncmp(ev, "data: {", 7) == 0) {
                kvs__sb_puts(&out, "data: ");
                merge_text(rt, j, &out, ev + 6, n - 8, pre_root);
                kvs__sb_puts(&out, "\n\n");
            } else {
                kvs__sb_append(&out, ev, n);
            }
            at += n;
        }
    }
    json_decref(pre_root);
    kvs__sb_fini(&held);
    pthread_mutex_lock(&j->mu);
    if (out.len) kvs__sb_append(&j->buf, out.ptr, out.len);
    if (j->part.len) kvs__sb_append(&j->buf, j->part.ptr, j->part.len);
    kvs__sb_consume(&j->part, j->part.len);
    int oom = out.oom || j->buf.oom;
    pthread_mutex_unlock(&j->mu);
    kvs__sb_fini(&out);
    if (oom) job_fail(j, 500, NULL, "out of memory forwarding the answer");
}

/* Ends a leg still running (its server is told to give the room up once the job is over). */
static void drop_leg(CURLM *multi, leg_t *leg)
{
    if (leg->done) return;
    curl_multi_remove_handle(multi, leg->easy);
    leg->done = 1;
    leg->dropped = 1;
}

static int leg_ok(const leg_t *leg)
{
    return leg->done && !leg->dropped && leg->result == CURLE_OK && leg->status >= 200 &&
           leg->status < 300;
}

static void run_generate(job_t *j)
{
    kvs_router_t *rt = j->rt;
    rserver_t *pre = pick(rt, KVS_ROUTER_PREFILL, j, NULL);
    if (pre == NULL) {
        job_fail(j, 503, "no_server", "no prefill server with a live decode partner is available");
        return;
    }
    rserver_t *dec = pick(rt, KVS_ROUTER_DECODE, j, pre);
    if (dec == NULL) {
        job_fail(j, 503, "no_server", "no decode server is available for prefill server %s",
                 pre->url);
        return;
    }
    uint64_t room = __atomic_fetch_add(&rt->next_room, 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&rt->requests, 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&pre->chosen, 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&dec->chosen, 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&pre->inflight, 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&dec->inflight, 1, __ATOMIC_RELAXED);
    kvs_debug("router: room %llu: prefill %s, decode %s", (unsigned long long) room, pre->url,
              dec->url);
    const char *path = j->ep == EP_CHAT ? "/v1/chat/completions" : "/v1/completions";
    j->served[KVS_ROUTER_PREFILL] = pre->url;
    j->served[KVS_ROUTER_DECODE] = dec->url;
    leg_t lp, ld;
    memset(&lp, 0, sizeof(lp));
    memset(&ld, 0, sizeof(ld));
    CURLM *multi = curl_multi_init();
    const uint64_t seed = kvs__random_seed();
    char *bp = forward_body(j, room, KVS_ROUTER_PREFILL, pre, seed);
    char *bd = forward_body(j, room, KVS_ROUTER_DECODE, pre, seed);
    if (multi == NULL || bp == NULL || bd == NULL ||
        leg_init(&lp, rt, j, pre, path, bp, rt->request_timeout_ms, 0) != KVS_OK ||
        leg_init(&ld, rt, j, dec, path, bd, rt->request_timeout_ms, 1) != KVS_OK) {
        if (lp.payload != bp) kvs_free(bp);
        if (ld.payload != bd) kvs_free(bd);
        job_fail(j, 500, NULL, "out of memory forwarding room %llu", (unsigned long long) room);
        goto out;
    }
    curl_easy_setopt(lp.easy, CURLOPT_CONNECTTIMEOUT_MS, (long) rt->connect_timeout_ms);
    curl_easy_setopt(ld.easy, CURLOPT_CONNECTTIMEOUT_MS, (long) rt->connect_timeout_ms);
    curl_multi_add_handle(multi, lp.easy);
    curl_multi_add_handle(multi, ld.easy);
    leg_t *legs[2] = {&lp, &ld};
    int dec_reported = 0;
    for (;;) {
        run_legs(multi, legs, 2, j, 0);
        if (job_abandoned(j)) {
            if (stopping(rt))
                job_fail(j, 503, "shutting_down", "room %llu abandoned: the router is stopping",
                         (unsigned long long) room);
            else
                kvs_debug("router: room %llu: the client left", (unsigned long long) room);
            drop_leg(multi, &lp);
            drop_leg(multi, &ld);
            break;
        }
        pthread_mutex_lock(&j->mu);
        int dec_refused = j->headers_ready && (j->status < 200 || j->status >= 300);
        pthread_mutex_unlock(&j->mu);
        if (dec_refused || (ld.done && ld.result != CURLE_OK)) {
            /* The decode side refused or failed the room: the prefill side gives it up now
             * rather than at its transfer timeout. The decode answer (its own error, usually
             * the same bad request) is passed on as it comes. */
            drop_leg(multi, &lp);
        }
        if (ld.done && !dec_reported) {
            dec_reported = 1;
            if (ld.result != CURLE_OK) fail_from_curl(j, &ld);
        }
        int pre_failed = lp.done && !lp.dropped && !leg_ok(&lp);
        if (pre_failed && !dec_reported && !dec_refused) {
            /* A failed prefill dooms the room: the decode side gives it up, and the client gets
             * the prefill failure. */
            drop_leg(multi, &ld);
            dec_reported = 1;
            if (lp.result != CURLE_OK)
                fail_from_curl(j, &lp);
            else
                fail_passthrough(j, &lp);
        } else if (pre_failed && lp.result != CURLE_OK && connection_failure(lp.result)) {
            mark_down(pre, curl_easy_strerror(lp.result));
        }
        if (lp.done && ld.done) break;
    }
    if (leg_ok(&ld)) flush_held(j, leg_ok(&lp) ? &lp.resp : NULL);
out:
    if (multi) {
        if (lp.easy && !lp.dropped) curl_multi_remove_handle(multi, lp.easy);
        if (ld.easy && !ld.dropped) curl_multi_remove_handle(multi, ld.easy);
    }
    int cancel_pre = lp.dropped, cancel_dec = ld.dropped;
    leg_fini(&lp);
    leg_fini(&ld);
    if (multi) curl_multi_cleanup(multi);
    __atomic_sub_fetch(&pre->inflight, 1, __ATOMIC_RELAXED);
    __atomic_sub_fetch(&dec->inflight, 1, __ATOMIC_RELAXED);
    job_finish(j); /* a no-op when already finished */
    if (cancel_pre) cancel_room(rt, pre, room);
    if (cancel_dec) cancel_room(rt, dec, room);
}

/* A request a decode server answers alone (models, tokenize): passed on as is. POST: the
 * client's body goes with it. */
static void run_proxy(job_t *j, const char *path, int post)
{
    kvs_router_t *rt = j->rt;
    rserver_t *dec = pick_round_robin(rt, KVS_ROUTER_DECODE, NULL);
    if (dec == NULL) {
        job_fail(j, 503, "no_server", "no decode server is available");
        return;
    }
    leg_t leg;
    CURLM *multi = curl_multi_init();
    char *payload = NULL;
    if (post && (payload = kvs_malloc(j->body.len + 1)) != NULL) {
        if (j->body.len) memcpy(payload, j->body.data, j->body.len);
        payload[j->body.len] = '\0';
    }
    if (multi == NULL || (post && payload == NULL) ||
        leg_init(&leg, rt, j, dec, path, payload, rt->request_timeout_ms, 1) != KVS_OK) {
        if (multi == NULL || (post && payload == NULL)) kvs_free(payload);
        if (multi) leg_fini(&leg);
        if (multi) curl_multi_cleanup(multi);
        job_fail(j, 500, NULL, "out of memory forwarding %s", path);
        return;
    }
    curl_easy_setopt(leg.easy, CURLOPT_CONNECTTIMEOUT_MS, (long) rt->connect_timeout_ms);
    curl_multi_add_handle(multi, leg.easy);
    leg_t *legs[1] = {&leg};
    run_legs(multi, legs, 1, j, 1);
    if (!leg.done)
        job_fail(j, 503, "shutting_down", "%s abandoned", path);
    else if (leg.result != CURLE_OK)
        fail_from_curl(j, &leg);
    else
        job_finish(j);
    curl_multi_remove_handle(multi, leg.easy);
    leg_fini(&leg);
    curl_multi_cleanup(multi);
}

static void *job_thread(void *arg)
{
    job_t *j = arg;
    kvs_router_t *rt = j->rt;
    if (j->ep == EP_MODELS)
        run_proxy(j, "/v1/models", 0);
    else if (j->ep == EP_MODEL)
        run_proxy(j, j->proxy_path, 0);
    else if (j->ep == EP_TOKENIZE || j->ep == EP_DETOKENIZE)
        run_proxy(j, j->ep == EP_TOKENIZE ? "/tokenize" : "/detokenize", 1);
    else
        run_generate(j);
    job_unref(j);
    pthread_mutex_lock(&rt->mu);
    rt->n_jobs--;
    pthread_cond_broadcast(&rt->cv);
    pthread_mutex_unlock(&rt->mu);
    return NULL;
}

/* ---- the client's side ---- */

/* The headers of every answer to j: the unknown fields its body carried. */
static const char *const *answer_headers(const job_t *j, const char *h[3])
{
    if (j->ignored.n == 0) return NULL;
    h[0] = KVS_SERVER_IGNORED_HEADER;
    h[1] = j->ignored.names;
    h[2] = NULL;
    return h;
}

static enum MHD_Result send_error(job_t *j, unsigned status, const char *message, const char *param,
                                  const char *code)
{
    __atomic_add_fetch(&j->rt->http_codes[status < 600 ? status : 599], 1, __ATOMIC_RELAXED);
    const char *type = status >= 500 ? "server_error" : "invalid_request_error";
    const char *h[3];
    const char *const *headers = answer_headers(j, h);
    if (status == 405) {
        h[0] = MHD_HTTP_HEADER_ALLOW;
        h[1] = j->ep == EP_MODELS || j->ep == EP_MODEL || j->ep == EP_HEALTH || j->ep == EP_METRICS
                   ? "GET"
                   : "POST";
        h[2] = NULL;
        headers = h;
    } else if (status == 401) {
        h[0] = MHD_HTTP_HEADER_WWW_AUTHENTICATE;
        h[1] = "Bearer";
        h[2] = NULL;
        headers = h;
    }
    return kvs__http_send_error(j->conn, status, message, type, param, code, headers);
}

static ssize_t job_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    (void) pos;
    job_t *j = cls;
    pthread_mutex_lock(&j->mu);
    ssize_t ret;
    /* An event stream's buf holds whole events only (take_decode_bytes keeps the rest in part),
     * so that a failure can follow any of them. */
    if (j->buf.len > 0) {
        size_t n = j->buf.len < max ? j->buf.len : max;
        memcpy(buf, j->buf.ptr, n);
        kvs__sb_consume(&j->buf, n);
        ret = (ssize_t) n;
    } else if (j->finished) {
        ret = j->broken ? MHD_CONTENT_READER_END_WITH_ERROR : MHD_CONTENT_READER_END_OF_STREAM;
    } else {
        j->suspended = 1;
        MHD_suspend_connection(j->conn);
        ret = 0;
    }
    pthread_mutex_unlock(&j->mu);
    return ret;
}

/* The job's outcome, once its headers are known or it failed; else suspends again. */
static enum MHD_Result answer(job_t *j)
{
    kvs_router_t *rt = j->rt;
    pthread_mutex_lock(&j->mu);
    if (!j->headers_ready && !j->finished) {
        j->suspended = 1;
        MHD_suspend_connection(j->conn);
        pthread_mutex_unlock(&j->mu);
        return MHD_YES;
    }
    int failed = j->failed || !j->headers_ready;
    unsigned status = j->failed ? j->fail_status : 502;
    char msg[256];
    snprintf(msg, sizeof(msg), "%s", j->failed ? j->fail_msg : "no answer from the server");
    const char *code = j->fail_code;
    char *pass = j->fail_body;
    j->fail_body = NULL;
    long hstatus = j->status;
    char ctype[128];
    snprintf(ctype, sizeof(ctype), "%s", j->ctype);
    pthread_mutex_unlock(&j->mu);
    if (failed) {
        enum MHD_Result r;
        if (pass) {
            __atomic_add_fetch(&rt->http_codes[status < 600 ? status : 599], 1, __ATOMIC_RELAXED);
            const char *h[3];
            r = kvs__http_send(j->conn, status, "application/json", pass, strlen(pass),
                               answer_headers(j, h));
        } else {
            r = send_error(j, status, msg, NULL, code);
        }
        kvs_free(pass);
        return r;
    }
    struct MHD_Response *resp =
        MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, job_read, j, NULL);
    if (resp == NULL) return MHD_NO;
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, ctype);
    if (strncmp(ctype, "text/event-stream", 17) == 0)
        MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    const char *h[3];
    kvs__http_add_headers(resp, answer_headers(j, h));
    unsigned st = hstatus >= 100 && hstatus < 600 ? (unsigned) hstatus : 502;
    __atomic_add_fetch(&rt->http_codes[st], 1, __ATOMIC_RELAXED);
    enum MHD_Result r = MHD_queue_response(j->conn, st, resp);
    MHD_destroy_response(resp);
    return r;
}

static enum MHD_Result start_job(job_t *j)
{
    kvs_router_t *rt = j->rt;
    if (j->ep == EP_COMPLETIONS || j->ep == EP_CHAT) {
        json_error_t jerr;
        kvs_alloc_stats_t before, after;
        kvs_alloc_stats(&before);
        j->root = json_loadb(j->body.data ? j->body.data : "", j->body.len, 0, &jerr);
        kvs_alloc_stats(&after);
        /* jansson reports some failed allocations as syntax errors. */
        if (j->root == NULL && after.failed_allocs != before.failed_allocs)
            return send_error(j, 500, "out of memory reading the request", NULL, NULL);
        if (j->root == NULL) {
            char msg[256];
            snprintf(msg, sizeof(msg), "the body is not valid JSON: %s (line %d, column %d)",
                     jerr.text, jerr.line, jerr.column);
            return send_error(j, 400, msg, NULL, "invalid_json");
        }
        if (!json_is_object(j->root))
            return send_error(j, 400, "the request body must be a JSON object", NULL, NULL);
        if (json_object_get(j->root, "kvstage") != NULL)
            return send_error(j, 400, "'kvstage' is reserved for the router", "kvstage",
                              "unknown_field");
        /* Unknown fields are refused here (strict) or removed before forwarding, so that the
         * servers see only what they know and the client gets one account of what was
         * ignored. */
        kvs__api_err_t err;
        if (kvs__api_check_fields(j->root, j->ep == EP_CHAT, rt->strict, 1, &j->ignored, &err) !=
            KVS_OK)
            return send_error(j, (unsigned) err.status, err.message, err.param, err.code);
        if (j->ignored.n > 0) {
            kvs_warn("router: %s %s: ignored %u unknown field%s: %s", j->method, j->path,
                     j->ignored.n, j->ignored.n == 1 ? "" : "s", j->ignored.names);
            /* The prefix-aware choice sends the body as is: the cleaned one. */
            char *text = json_dumps(j->root, JSON_COMPACT);
            if (text == NULL)
                return send_error(j, 500, "out of memory reading the request", NULL, NULL);
            kvs__body_fini(&j->body);
            j->body.data = text;
            j->body.len = strlen(text);
            j->body.cap = j->body.len + 1;
        }
        /* The servers' checks that need no tokenizer, once, before either server starts work:
         * a request they would refuse for a field's type or range never reaches them. (Its
         * length and token ids are theirs to judge; a side that refuses frees the other.) */
        const kvs__api_limits_t lim = {.max_context = UINT32_MAX, .strict = rt->strict};
        const kvs_server_tokenizer_t shape = kvs__shape_tokenizer();
        kvs__api_req_t api;
        if (kvs__api_parse(&lim, &shape, j->ep == EP_CHAT, j->body.data, j->body.len, &api, &err) !=
            KVS_OK)
            return send_error(j, (unsigned) err.status, err.message, err.param, err.code);
        kvs__api_req_fini(&api);
    }
    pthread_mutex_lock(&rt->mu);
    if (rt->stopping) {
        pthread_mutex_unlock(&rt->mu);
        return send_error(j, 503, "the router is shutting down", NULL, "shutting_down");
    }
    rt->n_jobs++;
    pthread_mutex_unlock(&rt->mu);
    pthread_mutex_lock(&j->mu);
    j->refs++;
    pthread_mutex_unlock(&j->mu);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_t th;
    int rc = pthread_create(&th, &attr, job_thread, j);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
        kvs_error("router: cannot start a request thread");
        pthread_mutex_lock(&j->mu);
        j->refs--;
        pthread_mutex_unlock(&j->mu);
        pthread_mutex_lock(&rt->mu);
        rt->n_jobs--;
        pthread_cond_broadcast(&rt->cv);
        pthread_mutex_unlock(&rt->mu);
        return send_error(j, 503, "the router is overloaded", NULL, NULL);
    }
    j->started = 1;
    return answer(j);
}

static int router_healthy(kvs_router_t *rt)
{
    if (stopping(rt)) return 0;
    for (int side = 0; side < 2; side++) {
        int any = 0;
        for (size_t i = 0, n = nservers(rt, side); i < n; i++)
            any |= in_rotation(&rt->servers[side][i]);
        if (!any) return 0;
    }
    return 1;
}

static void label_escaped(kvs__sb_t *sb, const char *s)
{
    for (; *s; s++) {
        if (*s == '\\' || *s == '"')
            kvs__sb_printf(sb, "\\%c", *s);
        else if (*s == '\n')
            kvs__sb_puts(sb, "\\n");
        else
            kvs__sb_append(sb, s, 1);
    }
}

static void per_server(kvs__sb_t *sb, kvs_router_t *rt, const char *name, const char *type,
                       const char *help, size_t field)
{
    kvs__metric_header(sb, name, type, help);
    for (int side = 0; side < 2; side++) {
        for (size_t i = 0, n = nservers(rt, side); i < n; i++) {
            rserver_t *s = &rt->servers[side][i];
            if (__atomic_load_n(&s->removed, __ATOMIC_RELAXED)) continue; /* gone from the fleet */
            uint64_t v = field == 0   ? (uint64_t) __atomic_load_n(&s->up, __ATOMIC_RELAXED)
                         : field == 1 ? __atomic_load_n(&s->chosen, __ATOMIC_RELAXED)
                         : field == 2 ? __atomic_load_n(&s->failures, __ATOMIC_RELAXED)
                                      : __atomic_load_n(&s->prefix_hits, __ATOMIC_RELAXED);
            kvs__sb_printf(sb, "%s{side=\"%s\",url=\"", name, side_name((kvs_router_side_t) side));
            label_escaped(sb, s->url);
            kvs__sb_printf(sb, "\"} %llu\n", (unsigned long long) v);
        }
    }
}

static enum MHD_Result send_metrics(job_t *j)
{
    kvs_router_t *rt = j->rt;
    kvs__sb_t sb;
    kvs__sb_init(&sb);
    kvs__metric_header(&sb, "kvstage_router_http_requests_total", "counter",
                       "HTTP requests answered by the router, by status code.");
    for (unsigned c = 100; c < 600; c++) {
        uint64_t v = __atomic_load_n(&rt->http_codes[c], __ATOMIC_RELAXED);
        if (v || c == 200)
            kvs__sb_printf(&sb, "kvstage_router_http_requests_total{code=\"%u\"} %llu\n", c,
                           (unsigned long long) v);
    }
    kvs__metric_header(&sb, "kvstage_router_requests_total", "counter",
                       "Requests forwarded to a prefill and a decode server.");
    kvs__sb_printf(&sb, "kvstage_router_requests_total %llu\n",
                   (unsigned long long) __atomic_load_n(&rt->requests, __ATOMIC_RELAXED));
    pthread_mutex_lock(&rt->mu);
    uint32_t jobs = rt->n_jobs;
    pthread_mutex_unlock(&rt->mu);
    kvs__metric_header(&sb, "kvstage_router_requests_in_flight", "gauge",
                       "Requests being forwarded now.");
    kvs__sb_printf(&sb, "kvstage_router_requests_in_flight %u\n", jobs);
    kvs__metric_header(&sb, "kvstage_router_cancels_total", "counter",
                       "Rooms the router told a server to give up (the other side refused or "
                       "failed them, or the client left).");
    kvs__sb_printf(&sb, "kvstage_router_cancels_total %llu\n",
                   (unsigned long long) __atomic_load_n(&rt->cancels_sent, __ATOMIC_RELAXED));
    kvs__metric_header(&sb, "kvstage_router_kv_bytes_total", "counter",
                       "KV bytes moved, as the decode servers report them (answers that carry "
                       "a \"kvstage\" object: non-streaming ones and usage chunks).");
    kvs__sb_printf(&sb, "kvstage_router_kv_bytes_total %llu\n",
                   (unsigned long long) __atomic_load_n(&rt->kv_bytes, __ATOMIC_RELAXED));
    kvs__hist_render(&sb, "kvstage_router_kv_transfer_seconds",
                     "KV handoff time per room, as the prefill servers report it.", &rt->transfer);
    per_server(&sb, rt, "kvstage_router_server_up", "gauge", "1 while the server is in rotation.",
               0);
    per_server(&sb, rt, "kvstage_router_server_chosen_total", "counter",
               "Requests sent to the server.", 1);
    per_server(&sb, rt, "kvstage_router_server_failures_total", "counter",
               "Connection failures and timeouts towards the server.", 2);
    per_server(&sb, rt, "kvstage_router_prefix_hits_total", "counter",
               "Prefix-aware choices won with a cached prefix.", 3);
    char *text = kvs__sb_take(&sb);
    if (text == NULL) return send_error(j, 500, "out of memory", NULL, NULL);
    __atomic_add_fetch(&rt->http_codes[200], 1, __ATOMIC_RELAXED);
    enum MHD_Result r =
        kvs__http_send(j->conn, 200, "text/plain; version=0.0.4", text, strlen(text), NULL);
    kvs_free(text);
    return r;
}

/* A JSON answer (obj stolen). */
static enum MHD_Result send_json(job_t *j, unsigned status, json_t *obj)
{
    char *text = kvs__json_dump_steal(obj);
    if (text == NULL) return send_error(j, 500, "out of memory", NULL, NULL);
    __atomic_add_fetch(&j->rt->http_codes[status], 1, __ATOMIC_RELAXED);
    enum MHD_Result r =
        kvs__http_send(j->conn, status, "application/json", text, strlen(text), NULL);
    kvs_free(text);
    return r;
}

/* POST /admin/servers {"action": "add"|"remove", "side": "prefill"|"decode", "url": URL}: the
 * fleet changed. Add checks the server at once (in rotation when it answers /health) and
 * answers {"side", "url", "index", "up"}; remove takes it out of rotation for good (404 for a
 * server the router does not have). */
static enum MHD_Result admin_servers(job_t *j)
{
    kvs_router_t *rt = j->rt;
    json_t *root = json_loadb(j->body.data ? j->body.data : "", j->body.len, 0, NULL);
    const char *action = json_string_value(json_object_get(root, "action"));
    const char *side_s = json_string_value(json_object_get(root, "side"));
    const char *url = json_string_value(json_object_get(root, "url"));
    int add = action && strcmp(action, "add") == 0,
        remove = action && strcmp(action, "remove") == 0;
    int side = side_s && strcmp(side_s, "prefill") == 0  ? KVS_ROUTER_PREFILL
               : side_s && strcmp(side_s, "decode") == 0 ? KVS_ROUTER_DECODE
                                                         : -1;
    enum MHD_Result r;
    if ((!add && !remove) || side < 0 || url == NULL || strncmp(url, "http://", 7) != 0) {
        r = send_error(j, 400,
                       "the body must be {\"action\": \"add\" or \"remove\", \"side\": "
                       "\"prefill\" or \"decode\", \"url\": \"http://HOST:PORT\"}",
                       !add && !remove ? "action"
                       : side < 0      ? "side"
                                       : "url",
                       NULL);
    } else if (remove) {
        kvs_status_t st = kvs_router_remove_server(rt, (kvs_router_side_t) side, url);
        r = st == KVS_OK
                ? send_json(j, 200,
                            json_pack("{s:s, s:s, s:b}", "side", side_s, "url", url, "removed", 1))
            : st == KVS_ERR_NOT_FOUND ? send_error(j, 404, "no such server", "url", "not_found")
                                      : send_error(j, 400, "not a server URL", "url", NULL);
    } else {
        size_t index = 0;
        kvs_status_t st = kvs_router_add_server(rt, (kvs_router_side_t) side, url, &index);
        if (st == KVS_OK)
            r = send_json(j, 200,
                          json_pack("{s:s, s:s, s:I, s:b}", "side", side_s, "url",
                                    rt->servers[side][index].url, "index", (json_int_t) index, "up",
                                    in_rotation(&rt->servers[side][index])));
        else if (st == KVS_ERR_NOSPACE)
            r = send_error(j, 409, "the router has as many servers of that side as it can take",
                           "url", "too_many_servers");
        else
            r = send_error(j, st == KVS_ERR_NOMEM ? 500 : 400, "cannot add that server", "url",
                           NULL);
    }
    json_decref(root);
    return r;
}

static enum MHD_Result handle(job_t *j)
{
    kvs_router_t *rt = j->rt;
    if (!j->authorized && j->ep != EP_HEALTH && j->ep != EP_METRICS)
        return send_error(j, 401,
                          kvs__http_has_credentials(j->conn)
                              ? "incorrect API key provided"
                              : "missing API key: send the header 'Authorization: Bearer KEY'",
                          NULL, "invalid_api_key");
    if (j->ep == EP_UNKNOWN) {
        char msg[128];
        snprintf(msg, sizeof(msg), "unknown path: %s %s", j->method, j->path);
        return send_error(j, 404, msg, NULL, "not_found");
    }
    if (!j->method_ok) {
        char msg[128];
        snprintf(msg, sizeof(msg), "method %s is not allowed on %s", j->method, j->path);
        return send_error(j, 405, msg, NULL, "method_not_allowed");
    }
    if (j->body.too_large) {
        char msg[128];
        snprintf(msg, sizeof(msg), "the request body is larger than %zu bytes", rt->max_body);
        return send_error(j, 413, msg, NULL, "body_too_large");
    }
    if (j->body_oom) return send_error(j, 500, "out of memory reading the request", NULL, NULL);
    if (j->ep == EP_HEALTH) {
        int ok = router_healthy(rt);
        __atomic_add_fetch(&rt->http_codes[ok ? 200 : 503], 1, __ATOMIC_RELAXED);
        const char *text = ok ? "{\"status\":\"ok\"}" : "{\"status\":\"unavailable\"}";
        return kvs__http_send(j->conn, ok ? 200 : 503, "application/json", text, strlen(text),
                              NULL);
    }
    if (j->ep == EP_METRICS) return send_metrics(j);
    if (j->ep == EP_ADMIN_SERVERS) return admin_servers(j);
    return start_job(j);
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
                                  const char *method, const char *version, const char *upload_data,
                                  size_t *upload_size, void **con_cls)
{
    (void) version;
    kvs_router_t *rt = cls;
    job_t *j = *con_cls;
    if (j == NULL) {
        j = kvs_calloc(1, sizeof(*j));
        if (j == NULL) return MHD_NO;
        pthread_mutex_init(&j->mu, NULL);
        j->refs = 1;
        j->rt = rt;
        j->conn = conn;
        j->body.max = rt->max_body;
        pthread_mutex_lock(&rt->mu);
        rt->n_conns++;
        pthread_mutex_unlock(&rt->mu);
        const char *want = "POST";
        if (strcmp(url, "/v1/completions") == 0)
            j->ep = EP_COMPLETIONS;
        else if (strcmp(url, "/v1/chat/completions") == 0)
            j->ep = EP_CHAT;
        else if (strcmp(url, "/v1/models") == 0)
            j->ep = EP_MODELS, want = "GET";
        else if (strncmp(url, MODEL_PREFIX, strlen(MODEL_PREFIX)) == 0 &&
                 url[strlen(MODEL_PREFIX)] != '\0')
            j->ep = EP_MODEL, want = "GET";
        else if (strcmp(url, "/health") == 0)
            j->ep = EP_HEALTH, want = "GET";
        else if (strcmp(url, "/metrics") == 0)
            j->ep = EP_METRICS, want = "GET";
        else if (strcmp(url, "/tokenize") == 0)
            j->ep = EP_TOKENIZE;
        else if (strcmp(url, "/detokenize") == 0)
            j->ep = EP_DETOKENIZE;
        else if (strcmp(url, "/admin/servers") == 0)
            j->ep = EP_ADMIN_SERVERS;
        j->method_ok = strcmp(method, want) == 0;
        j->authorized = kvs__http_authorized(conn, rt->api_key);
        snprintf(j->method, sizeof(j->method), "%s", method);
        snprintf(j->path, sizeof(j->path), "%s", url);
        *con_cls = j;
        if (j->ep == EP_MODEL) {
            /* libmicrohttpd decoded the path: escape the id again for the server. */
            char *id = curl_easy_escape(NULL, url + strlen(MODEL_PREFIX), 0);
            kvs__sb_t sb;
            kvs__sb_init(&sb);
            kvs__sb_puts(&sb, MODEL_PREFIX);
            if (id) kvs__sb_puts(&sb, id);
            curl_free(id);
            j->proxy_path = id ? kvs__sb_take(&sb) : NULL;
            if (j->proxy_path == NULL) {
                kvs__sb_fini(&sb);
                j->body_oom = 1;
            }
        }
        /* Declared too large: answered before the body is read (the connection closes after). */
        if (kvs__http_body_exceeds(conn, rt->max_body)) {
            j->body.too_large = 1;
            return handle(j);
        }
        return MHD_YES;
    }
    if (*upload_size != 0) {
        if (j->ep != EP_UNKNOWN && j->method_ok && j->authorized && !j->body_oom &&
            kvs__body_add(&j->body, upload_data, *upload_size) != KVS_OK)
            j->body_oom = 1;
        *upload_size = 0;
        return MHD_YES;
    }
    if (j->started) return answer(j);
    return handle(j);
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode toe)
{
    (void) cls;
    (void) conn;
    (void) toe;
    job_t *j = *con_cls;
    if (j == NULL) return;
    *con_cls = NULL;
    pthread_mutex_lock(&j->mu);
    j->conn = NULL;
    j->client_gone = 1;
    j->suspended = 0;
    pthread_mutex_unlock(&j->mu);
    job_unref(j);
}

/* ---- health ---- */

/* What the /internal/info answer of s says: its bootstrap and its load (mine: this router's
 * requests on it when it was asked). */
static void take_info(kvs_router_t *rt, rserver_t *s, const kvs__sb_t *resp, uint32_t mine)
{
    json_t *info = json_loadb(resp->ptr ? resp->ptr : "", resp->len, 0, NULL);
    if (!json_is_object(info)) {
        json_decref(info);
        return;
    }
    const char *b = json_string_value(json_object_get(info, "bootstrap"));
    char *copy = b ? kvs_strdup(b) : NULL;
    pthread_mutex_lock(&rt->mu);
    if (copy || b == NULL) {
        kvs_free(s->bootstrap);
        s->bootstrap = copy;
    }
    pthread_mutex_unlock(&rt->mu);
    json_t *load = json_object_get(info, "load");
    json_int_t live = json_integer_value(json_object_get(load, "requests_live"));
    json_int_t free_pages = json_integer_value(json_object_get(load, "kv_pages_free"));
    if (live < 0 || live > UINT32_MAX) live = 0;
    if (free_pages < 0 || free_pages > UINT32_MAX) free_pages = 0;
    __atomic_store_n(&s->info_live, (uint64_t) live << 32 | mine, __ATOMIC_RELAXED);
    __atomic_store_n(&s->pages_free, (uint32_t) free_pages, __ATOMIC_RELAXED);
    json_decref(info);
}

typedef struct {
    rserver_t *s;
    int checked, ok;
    CURLcode c;
    long code;
    uint32_t mine;
    uint64_t failures; /* the server's failure count when its check began */
} check_t;

/* Health checks in a row that must time out before a server counts as hung: one slow answer
 * is a busy server (a CPU instance under load), not a dead one. */
#define SILENT_STRIKES 3

/* One health pass over list[n], every server at once: GET /health (200: in rotation; refused or
 * dropped: out, and the requests on it fail; silent for 2 x connect_timeout_ms in SILENT_STRIKES
 * passes in a row: the same), then GET /internal/info of those in rotation (bootstrap, load). */
static void check_servers(kvs_router_t *rt, rserver_t **list, size_t n)
{
    const uint32_t timeout = rt->connect_timeout_ms * 2;
    leg_t *legs = kvs_calloc(n, sizeof(leg_t));
    leg_t **ptrs = kvs_calloc(n, sizeof(leg_t *));
    check_t *ck = kvs_calloc(n, sizeof(check_t));
    CURLM *multi = curl_multi_init();
    if (legs == NULL || ptrs == NULL || ck == NULL || multi == NULL) {
        kvs_warn("router: no memory for a health check of %zu servers", n);
        goto out;
    }
    for (int phase = 0; phase < 2; phase++) {
        for (size_t i = 0; i < n; i++) {
            ck[i].s = list[i];
            if (phase == 1 && !ck[i].ok) continue;
            ck[i].mine = __atomic_load_n(&list[i]->inflight, __ATOMIC_RELAXED);
            if (phase == 0) ck[i].failures = __atomic_load_n(&list[i]->failures, __ATOMIC_RELAXED);
            if (leg_init(&legs[i], rt, NULL, list[i], phase ? "/internal/info" : "/health", NULL,
                         timeout, 0) != KVS_OK) {
                leg_fini(&legs[i]);
                continue;
            }
            curl_easy_setopt(legs[i].easy, CURLOPT_CONNECTTIMEOUT_MS,
                             (long) rt->connect_timeout_ms);
            curl_multi_add_handle(multi, legs[i].easy);
            ptrs[i] = &legs[i];
        }
        run_legs(multi, ptrs, n, NULL, 1);
        for (size_t i = 0; i < n; i++) {
            leg_t *l = ptrs[i];
            if (l == NULL) continue;
            if (phase == 0) {
                ck[i].checked = 1;
                ck[i].c = l->result;
                ck[i].code = l->status;
                ck[i].ok = l->result == CURLE_OK && l->status == 200;
            } else if (l->result == CURLE_OK && l->status == 200) {
                take_info(rt, list[i], &l->resp, ck[i].mine);
            }
            curl_multi_remove_handle(multi, l->easy);
            leg_fini(l);
            ptrs[i] = NULL;
        }
    }
    for (size_t i = 0; i < n; i++) {
        if (!ck[i].checked) continue;
        rserver_t *s = ck[i].s;
        int ok = ck[i].ok;
        CURLcode c = ck[i].c;
        /* A request found it unreachable while this check ran: the check's answer may be older
         * than that, so it cannot bring the server back; the next pass decides. */
        if (ok && __atomic_load_n(&s->failures, __ATOMIC_RELAXED) != ck[i].failures) continue;
        const int timed_out = !ok && c == CURLE_OPERATION_TIMEDOUT;
        const int first = s->checks++ == 0;
        s->silent = timed_out ? s->silent + 1 : 0;
        if (timed_out && s->silent < SILENT_STRIKES) {
            kvs_warn("router: %s server %s did not answer its health check in %u ms (%u of %u "
                     "before it counts as hung)",
                     side_name(s->side), s->url, timeout, s->silent, SILENT_STRIKES);
            continue; /* busy, as far as anyone can tell: it stays as it was */
        }
        /* Unreachable (not merely unhealthy: a draining server finishes its requests). */
        if (!ok && c != CURLE_OK && connection_failure(c))
            __atomic_add_fetch(&s->lost, 1, __ATOMIC_RELAXED);
        int was = __atomic_exchange_n(&s->up, ok, __ATOMIC_RELAXED);
        char why[96] = "";
        if (!ok) {
            if (c != CURLE_OK)
                snprintf(why, sizeof(why), "%s", curl_easy_strerror(c));
            else
                snprintf(why, sizeof(why), "/health answered %ld", ck[i].code);
        }
        if (was && !ok) {
            __atomic_add_fetch(&s->failures, 1, __ATOMIC_RELAXED);
            kvs_warn("router: %s server %s is out of rotation: %s", side_name(s->side), s->url,
                     why);
        } else if (!was && ok) {
            kvs_info("router: %s server %s is in rotation", side_name(s->side), s->url);
        } else if (first && !ok) {
            /* Said once: a wrong URL, or a server still starting, is otherwise silent here. */
            kvs_warn("router: %s server %s is not in rotation yet: %s (it joins once its /health "
                     "answers 200)",
                     side_name(s->side), s->url, why);
        }
    }
out:
    for (size_t i = 0; ptrs && i < n; i++) {
        if (ptrs[i] == NULL) continue;
        curl_multi_remove_handle(multi, ptrs[i]->easy);
        leg_fini(ptrs[i]);
    }
    if (multi) curl_multi_cleanup(multi);
    kvs_free(ck);
    kvs_free(ptrs);
    kvs_free(legs);
}

void kvs_router_check_now(kvs_router_t *rt)
{
    rserver_t *list[2 * KVS_ROUTER_MAX_SERVERS];
    size_t n = 0;
    pthread_mutex_lock(&rt->check_mu);
    for (int side = 0; side < 2; side++)
        for (size_t i = 0, ns = nservers(rt, side); i < ns; i++)
            if (!__atomic_load_n(&rt->servers[side][i].removed, __ATOMIC_RELAXED))
                list[n++] = &rt->servers[side][i];
    check_servers(rt, list, n);
    pthread_mutex_unlock(&rt->check_mu);
}

static void *health_thread(void *arg)
{
    kvs_router_t *rt = arg;
    pthread_mutex_lock(&rt->mu);
    while (!rt->stopping) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        uint64_t ns = (uint64_t) ts.tv_nsec + (uint64_t) rt->health_interval_ms * 1000000u;
        ts.tv_sec += (time_t) (ns / 1000000000u);
        ts.tv_nsec = (long) (ns % 1000000000u);
        while (!rt->stopping && pthread_cond_timedwait(&rt->cv, &rt->mu, &ts) == 0) {
        }
        if (rt->stopping) break;
        pthread_mutex_unlock(&rt->mu);
        kvs_router_check_now(rt);
        pthread_mutex_lock(&rt->mu);
    }
    pthread_mutex_unlock(&rt->mu);
    return NULL;
}

/* ---- lifetime ---- */

/* The servers and the keys. */
static void free_config(kvs_router_t *rt)
{
    kvs_free(rt->api_key);
    kvs_free(rt->server_key);
    kvs_free(rt->servers_file);
    for (int side = 0; side < 2; side++) {
        for (size_t i = 0; rt->servers[side] && i < rt->n[side]; i++) {
            kvs_free(rt->servers[side][i].url);
            kvs_free(rt->servers[side][i].bootstrap);
        }
        kvs_free(rt->servers[side]);
    }
}

/* An http:// URL, without its trailing slashes, of at most 400 bytes. */
static kvs_status_t url_copy(kvs_router_side_t side, const char *url, char **copy_p)
{
    if (url == NULL || strncmp(url, "http://", 7) != 0 || strlen(url) > 400) {
        kvs_error("router: %s server '%s' is not an http:// URL", side_name(side),
                  url ? url : "(null)");
        return KVS_ERR_INVALID;
    }
    char *copy = kvs_strdup(url);
    if (copy == NULL) return KVS_ERR_NOMEM;
    size_t len = strlen(copy);
    while (len > 7 && copy[len - 1] == '/') copy[--len] = '\0';
    *copy_p = copy;
    return KVS_OK;
}

static kvs_status_t server_init(rserver_t *s, kvs_router_side_t side, const char *url)
{
    s->side = side;
    return url_copy(side, url, &s->url);
}

/* The servers of side given at creation (none is fine when a servers file may list some). */
static kvs_status_t add_servers(kvs_router_t *rt, kvs_router_side_t side, const char *const *urls,
                                size_t n)
{
    if (urls == NULL) n = 0;
    if (n > KVS_ROUTER_MAX_SERVERS) {
        kvs_error("router: %zu %s servers; at most %d", n, side_name(side), KVS_ROUTER_MAX_SERVERS);
        return KVS_ERR_INVALID;
    }
    rt->servers[side] = kvs_calloc(KVS_ROUTER_MAX_SERVERS, sizeof(rserver_t));
    if (rt->servers[side] == NULL) return KVS_ERR_NOMEM;
    rt->n[side] = n;
    for (size_t i = 0; i < n; i++) {
        kvs_status_t st = server_init(&rt->servers[side][i], side, urls[i]);
        if (st != KVS_OK) return st;
        rt->servers[side][i].from_config = 1;
    }
    return KVS_OK;
}

static kvs_status_t apply_servers_file(kvs_router_t *rt, int check);

/* The servers file's first reading, then at least one server of each side. */
static kvs_status_t first_servers(kvs_router_t *rt, const char *path)
{
    if (path != NULL) {
        rt->servers_file = kvs_strdup(path);
        if (rt->servers_file == NULL) return KVS_ERR_NOMEM;
        kvs_status_t st = apply_servers_file(rt, 0);
        if (st != KVS_OK) return st;
    }
    for (int side = 0; side < 2; side++) {
        if (rt->n[side] == 0) {
            kvs_error("router: no %s server given%s", side_name((kvs_router_side_t) side),
                      path ? " (nor in the servers file)" : "");
            return KVS_ERR_INVALID;
        }
    }
    return KVS_OK;
}

/* The clients' key, and the servers' one: server_api_key, else the clients' one. */
static kvs_status_t copy_keys(kvs_router_t *rt, const kvs_router_config_t *c)
{
    const char *server_key = c->server_api_key ? c->server_api_key : c->api_key;
    kvs_status_t st = kvs__http_key_check(c->api_key);
    if (st == KVS_OK) st = kvs__http_key_check(server_key);
    if (st != KVS_OK) return st;
    rt->api_key = c->api_key ? kvs_strdup(c->api_key) : NULL;
    rt->server_key = server_key ? kvs_strdup(server_key) : NULL;
    if ((c->api_key && rt->api_key == NULL) || (server_key && rt->server_key == NULL))
        return KVS_ERR_NOMEM;
    return KVS_OK;
}

kvs_status_t kvs_router_create(const kvs_router_config_t *config, kvs_router_t **router_p)
{
    if (config == NULL) {
        kvs_error("router: no configuration");
        return KVS_ERR_INVALID;
    }
    kvs__json_init();
    pthread_once(&g_curl_once, curl_setup);
    if (!g_curl_ok) {
        kvs_error("router: libcurl failed to initialise");
        return KVS_ERR_IO;
    }
    kvs_router_t *rt = kvs_calloc(1, sizeof(*rt));
    if (rt == NULL) return KVS_ERR_NOMEM;
    kvs_status_t st = add_servers(rt, KVS_ROUTER_PREFILL, config->prefill, config->n_prefill);
    if (st == KVS_OK) st = add_servers(rt, KVS_ROUTER_DECODE, config->decode, config->n_decode);
    if (st == KVS_OK) st = copy_keys(rt, config);
    pthread_mutex_init(&rt->mu, NULL);
    if (st == KVS_OK) st = first_servers(rt, config->servers_file);
    if (st != KVS_OK) {
        pthread_mutex_destroy(&rt->mu);
        free_config(rt);
        kvs_free(rt);
        return st;
    }
    rt->policy[KVS_ROUTER_PREFILL] = config->prefill_policy;
    rt->policy[KVS_ROUTER_DECODE] = config->decode_policy;
    rt->health_interval_ms = config->health_interval_ms ? config->health_interval_ms : 500;
    rt->connect_timeout_ms = config->connect_timeout_ms ? config->connect_timeout_ms : 1000;
    rt->request_timeout_ms = config->request_timeout_ms ? config->request_timeout_ms : 600000;
    rt->match_timeout_ms = config->match_timeout_ms ? config->match_timeout_ms : 200;
    rt->max_body = config->max_body ? config->max_body : (size_t) 1 << 20;
    rt->strict = config->strict;
    rt->next_room =
        config->first_room ? config->first_room : ((kvs_now_ns() >> 10) & 0x3fffffffu) << 32;
    kvs__hist_init(&rt->transfer, kvs__transfer_bounds, KVS__TRANSFER_BOUNDS);
    pthread_mutex_init(&rt->check_mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&rt->cv, &ca);
    pthread_condattr_destroy(&ca);
    kvs_router_check_now(rt);
    /* A client costs its connection and, while forwarded, one towards each of two servers. */
    kvs__http_opts_t ho = {.host = config->host,
                           .port = config->port,
                           .threads = config->threads,
                           .max_connections = config->max_connections,
                           .idle_timeout_s = config->idle_timeout_s,
                           .fds_per_connection = 3,
                           .handler = on_request,
                           .handler_cls = rt,
                           .completed = on_completed,
                           .completed_cls = rt};
    st = kvs__http_start(&ho, &rt->daemon, &rt->port);
    if (st != KVS_OK) goto free_sync;
    if (pthread_create(&rt->health_thread, NULL, health_thread, rt) != 0) {
        kvs_error("router: cannot start the health thread");
        st = KVS_ERR_IO;
        MHD_stop_daemon(rt->daemon);
        goto free_sync;
    }
    kvs_info("router: listening on port %u", (unsigned) rt->port);
    *router_p = rt;
    return KVS_OK;

free_sync:
    pthread_cond_destroy(&rt->cv);
    pthread_mutex_destroy(&rt->check_mu);
    pthread_mutex_destroy(&rt->mu);
    free_config(rt);
    kvs_free(rt);
    return st;
}

uint16_t kvs_router_port(const kvs_router_t *router)
{
    return router->port;
}

void kvs_router_destroy(kvs_router_t *rt)
{
    if (rt == NULL) return;
    pthread_mutex_lock(&rt->mu);
    __atomic_store_n(&rt->stopping, 1, __ATOMIC_RELAXED);
    pthread_cond_broadcast(&rt->cv);
    pthread_mutex_unlock(&rt->mu);
    pthread_join(rt->health_thread, NULL);
    /* Jobs see stopping within one poll interval, fail their clients and resume them. */
    pthread_mutex_lock(&rt->mu);
    while (rt->n_jobs > 0) pthread_cond_wait(&rt->cv, &rt->mu);
    /* Let the last answers reach their clients (one that does not read is cut off). */
    struct timespec deadline;
    clock_gettime(CLOCK_MONOTONIC, &deadline);
    deadline.tv_sec += 2;
    while (rt->n_conns > 0) {
        if (pthread_cond_timedwait(&rt->cv, &rt->mu, &deadline) != 0) break;
    }
    pthread_mutex_unlock(&rt->mu);
    MHD_stop_daemon(rt->daemon);
    pthread_cond_destroy(&rt->cv);
    pthread_mutex_destroy(&rt->check_mu);
    pthread_mutex_destroy(&rt->mu);
    free_config(rt);
    kvs_free(rt);
}

int kvs_router_server_up(kvs_router_t *rt, kvs_router_side_t side, size_t index)
{
    if ((side != KVS_ROUTER_PREFILL && side != KVS_ROUTER_DECODE) || index >= nservers(rt, side))
        return -1;
    return __atomic_load_n(&rt->servers[side][index].up, __ATOMIC_RELAXED);
}

kvs_status_t kvs_router_server_stats(kvs_router_t *rt, kvs_router_side_t side, size_t index,
                                     kvs_router_server_stats_t *stats_p)
{
    if ((side != KVS_ROUTER_PREFILL && side != KVS_ROUTER_DECODE) || index >= nservers(rt, side)) {
        kvs_error("router: no %s server %zu", side == KVS_ROUTER_PREFILL ? "prefill" : "decode",
                  index);
        return KVS_ERR_INVALID;
    }
    rserver_t *s = &rt->servers[side][index];
    kvs_router_server_stats_t st;
    st.requests = __atomic_load_n(&rt->requests, __ATOMIC_RELAXED);
    st.chosen = __atomic_load_n(&s->chosen, __ATOMIC_RELAXED);
    st.failures = __atomic_load_n(&s->failures, __ATOMIC_RELAXED);
    st.prefix_hits = __atomic_load_n(&s->prefix_hits, __ATOMIC_RELAXED);
    *stats_p = st;
    return KVS_OK;
}

/* Puts url in the table of side (back in, when the router had it), under rt->mu; not checked
 * yet. from_file: listed by the servers file. */
static kvs_status_t register_locked(kvs_router_t *rt, kvs_router_side_t side, char *copy,
                                    int from_file, size_t *index_p)
{
    size_t n = rt->n[side], i = 0;
    while (i < n && strcmp(rt->servers[side][i].url, copy) != 0) i++;
    rserver_t *s = &rt->servers[side][i];
    if (i < n) { /* known, maybe removed: back in */
        kvs_free(copy);
    } else if (n == KVS_ROUTER_MAX_SERVERS) {
        kvs_error("router: %d %s servers already; %s not added", KVS_ROUTER_MAX_SERVERS,
                  side_name(side), copy);
        kvs_free(copy);
        return KVS_ERR_NOSPACE;
    } else {
        memset(s, 0, sizeof(*s));
        s->side = side;
        s->url = copy;
        __atomic_store_n(&rt->n[side], n + 1, __ATOMIC_RELEASE);
    }
    if (from_file) s->from_file = 1;
    __atomic_store_n(&s->removed, 0, __ATOMIC_RELAXED);
    *index_p = i;
    return KVS_OK;
}

kvs_status_t kvs_router_add_server(kvs_router_t *rt, kvs_router_side_t side, const char *url,
                                   size_t *index_p)
{
    if (side != KVS_ROUTER_PREFILL && side != KVS_ROUTER_DECODE) return KVS_ERR_INVALID;
    char *copy = NULL;
    kvs_status_t st = url_copy(side, url, &copy);
    if (st != KVS_OK) return st;
    size_t i = 0;
    pthread_mutex_lock(&rt->mu);
    st = register_locked(rt, side, copy, 0, &i);
    pthread_mutex_unlock(&rt->mu);
    if (st != KVS_OK) return st;
    /* In rotation once it answers: checked now, then with the others. */
    rserver_t *s = &rt->servers[side][i];
    pthread_mutex_lock(&rt->check_mu);
    check_servers(rt, &s, 1);
    pthread_mutex_unlock(&rt->check_mu);
    kvs_info("router: %s server %s added (%s)", side_name(side), s->url,
             in_rotation(s) ? "in rotation" : "not answering yet");
    if (index_p) *index_p = i;
    return KVS_OK;
}

kvs_status_t kvs_router_remove_server(kvs_router_t *rt, kvs_router_side_t side, const char *url)
{
    if (side != KVS_ROUTER_PREFILL && side != KVS_ROUTER_DECODE) return KVS_ERR_INVALID;
    char *copy = NULL;
    kvs_status_t st = url_copy(side, url, &copy);
    if (st != KVS_OK) return st;
    st = KVS_ERR_NOT_FOUND;
    pthread_mutex_lock(&rt->mu);
    for (size_t i = 0; i < rt->n[side]; i++) {
        rserver_t *s = &rt->servers[side][i];
        if (strcmp(s->url, copy) == 0 && !__atomic_load_n(&s->removed, __ATOMIC_RELAXED)) {
            __atomic_store_n(&s->removed, 1, __ATOMIC_RELAXED);
            st = KVS_OK;
        }
    }
    pthread_mutex_unlock(&rt->mu);
    if (st == KVS_OK) kvs_info("router: %s server %s removed", side_name(side), copy);
    kvs_free(copy);
    return st;
}

/* ---- the servers file ---- */

typedef struct {
    kvs_router_side_t side;
    char *url;
} listed_t;

#define MAX_LISTED (2 * KVS_ROUTER_MAX_SERVERS)

/* The servers file's entries into list[MAX_LISTED] (urls owned by the caller on KVS_OK). Lines:
 * "prefill URL" or "decode URL"; blank ones and those starting with '#' are skipped. */
static kvs_status_t read_servers_file(const char *path, listed_t *list, size_t *n_p)
{
    FILE *f = fopen(path, "r");
    if (f == NULL) {
        kvs_error("router: cannot read the servers file %s: %s", path, strerror(errno));
        return KVS_ERR_IO;
    }
    size_t n = 0;
    unsigned line_no = 0;
    kvs_status_t st = KVS_OK;
    char line[1024];
    while (st == KVS_OK && fgets(line, sizeof(line), f) != NULL) {
        line_no++;
        size_t len = strlen(line);
        if (len == sizeof(line) - 1 && line[len - 1] != '\n') {
            kvs_error("router: servers file %s line %u: longer than %zu bytes", path, line_no,
                      sizeof(line) - 2);
            st = KVS_ERR_INVALID;
            break;
        }
        char side_s[16], url[1024], extra[2];
        int got = sscanf(line, " %15s %1023s %1s", side_s, url, extra);
        if (got <= 0 || side_s[0] == '#') continue;
        int side = strcmp(side_s, "prefill") == 0  ? KVS_ROUTER_PREFILL
                   : strcmp(side_s, "decode") == 0 ? KVS_ROUTER_DECODE
                                                   : -1;
        if (side < 0 || got != 2) {
            kvs_error("router: servers file %s line %u: expected \"prefill URL\" or \"decode "
                      "URL\"",
                      path, line_no);
            st = KVS_ERR_INVALID;
        } else if (n == MAX_LISTED) {
            kvs_error("router: servers file %s line %u: more than %d servers", path, line_no,
                      MAX_LISTED);
            st = KVS_ERR_INVALID;
        } else if (strncmp(url, "http://", 7) != 0 || strlen(url) > 400) {
            kvs_error("router: servers file %s line %u: '%s' is not an http:// URL", path, line_no,
                      url);
            st = KVS_ERR_INVALID;
        } else if ((st = url_copy((kvs_router_side_t) side, url, &list[n].url)) == KVS_OK) {
            list[n++].side = (kvs_router_side_t) side;
        }
    }
    if (st == KVS_OK && ferror(f)) {
        kvs_error("router: cannot read the servers file %s", path);
        st = KVS_ERR_IO;
    }
    fclose(f);
    if (st != KVS_OK) {
        for (size_t i = 0; i < n; i++) kvs_free(list[i].url);
        return st;
    }
    *n_p = n;
    return KVS_OK;
}

/* Makes the servers the file lists the ones it owns: each listed one in (added, or back in),
 * each it listed before and lists no more out (unless given at creation). check: check the
 * listed ones now (else the caller does). */
static kvs_status_t apply_servers_file(kvs_router_t *rt, int check)
{
    listed_t list[MAX_LISTED];
    size_t n = 0;
    kvs_status_t st = read_servers_file(rt->servers_file, list, &n);
    if (st != KVS_OK) return st;
    rserver_t *added[MAX_LISTED];
    unsigned char keep[2][KVS_ROUTER_MAX_SERVERS];
    memset(keep, 0, sizeof(keep));
    size_t n_added = 0;
    pthread_mutex_lock(&rt->mu);
    for (size_t k = 0; k < n; k++) {
        size_t i = 0;
        kvs_status_t r = register_locked(rt, list[k].side, list[k].url, 1, &i);
        list[k].url = NULL; /* register_locked's now */
        if (r != KVS_OK) {
            st = r;
            continue;
        }
        if (!keep[list[k].side][i]) added[n_added++] = &rt->servers[list[k].side][i];
        keep[list[k].side][i] = 1;
    }
    for (int side = 0; side < 2; side++) {
        for (size_t i = 0; i < rt->n[side]; i++) {
            rserver_t *s = &rt->servers[side][i];
            if (!s->from_file || keep[side][i]) continue;
            s->from_file = 0;
            if (s->from_config || __atomic_load_n(&s->removed, __ATOMIC_RELAXED)) continue;
            __atomic_store_n(&s->removed, 1, __ATOMIC_RELAXED);
            kvs_info("router: %s server %s removed (no longer in %s)", side_name(s->side), s->url,
                     rt->servers_file);
        }
    }
    pthread_mutex_unlock(&rt->mu);
    if (check) {
        pthread_mutex_lock(&rt->check_mu);
        check_servers(rt, added, n_added);
        pthread_mutex_unlock(&rt->check_mu);
    }
    kvs_info("router: %zu servers listed in %s", n_added, rt->servers_file);
    return st;
}

kvs_status_t kvs_router_reload(kvs_router_t *rt)
{
    if (rt->servers_file == NULL) {
        kvs_error("router: no servers file to reload");
        return KVS_ERR_INVALID;
    }
    return apply_servers_file(rt, 1);
}
