/* Small pieces the server and the router share: the string builder, UTF-8 handling of streamed
 * text, stop-string search, request seeds, JSON setup and error bodies, histograms, request
 * bodies and the libmicrohttpd daemon setup. */
#include "http/server_internal.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "kvstage/alloc.h"
#include "kvstage/clock.h"
#include "kvstage/log.h"
#include "kvstage/rng.h"

/* ---- string builder ---- */

void kvs__sb_init(kvs__sb_t *sb)
{
    memset(sb, 0, sizeof(*sb));
}

void kvs__sb_fini(kvs__sb_t *sb)
{
    kvs_free(sb->ptr);
    memset(sb, 0, sizeof(*sb));
}

static int sb_reserve(kvs__sb_t *sb, size_t extra)
{
    if (sb->oom) return 0;
    if (sb->len + extra + 1 <= sb->cap) return 1;
    size_t cap = sb->cap ? sb->cap : 256;
    while (cap < sb->len + extra + 1) cap *= 2;
    char *p = kvs_realloc(sb->ptr, cap);
    if (p == NULL) {
        sb->oom = 1;
        return 0;
    }
    sb->ptr = p;
    sb->cap = cap;
    return 1;
}

void kvs__sb_append(kvs__sb_t *sb, const char *data, size_t len)
{
    if (!sb_reserve(sb, len)) return;
    if (len) memcpy(sb->ptr + sb->len, data, len);
    sb->len += len;
    sb->ptr[sb->len] = '\0';
}

void kvs__sb_puts(kvs__sb_t *sb, const char *s)
{
    kvs__sb_append(sb, s, strlen(s));
}

void kvs__sb_printf(kvs__sb_t *sb, const char *fmt, ...)
{
    char small[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(small, sizeof(small), fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if ((size_t) n < sizeof(small)) {
        kvs__sb_append(sb, small, (size_t) n);
        return;
    }
    if (!sb_reserve(sb, (size_t) n)) return;
    va_start(ap, fmt);
    vsnprintf(sb->ptr + sb->len, (size_t) n + 1, fmt, ap);
    va_end(ap);
    sb->len += (size_t) n;
}

void kvs__sb_consume(kvs__sb_t *sb, size_t n)
{
    if (n >= sb->len) {
        sb->len = 0;
        if (sb->ptr) sb->ptr[0] = '\0';
        return;
    }
    memmove(sb->ptr, sb->ptr + n, sb->len - n + 1);
    sb->len -= n;
}

char *kvs__sb_take(kvs__sb_t *sb)
{
    if (sb->oom) {
        kvs__sb_fini(sb);
        return NULL;
    }
    if (!sb_reserve(sb, 0)) return NULL;
    char *p = sb->ptr;
    p[sb->len] = '\0';
    memset(sb, 0, sizeof(*sb));
    return p;
}

/* ---- UTF-8 ---- */

/* The length a lead byte announces (0: not a lead byte), and the range its second byte must
 * fall in (overlong forms, surrogates and values past U+10FFFF excluded). */
static size_t utf8_lead(unsigned char c, unsigned char *lo_p, unsigned char *hi_p)
{
    *lo_p = 0x80;
    *hi_p = 0xBF;
    if (c < 0x80) return 1;
    if (c >= 0xC2 && c <= 0xDF) return 2;
    if (c >= 0xE0 && c <= 0xEF) {
        if (c == 0xE0) *lo_p = 0xA0;
        if (c == 0xED) *hi_p = 0x9F;
        return 3;
    }
    if (c >= 0xF0 && c <= 0xF4) {
        if (c == 0xF0) *lo_p = 0x90;
        if (c == 0xF4) *hi_p = 0x8F;
        return 4;
    }
    return 0;
}

/* How many bytes from s[0, avail) form a valid (possibly partial) sequence; *need_p receives the
 * full length. 0 for an invalid lead byte. */
static size_t utf8_valid_prefix(const unsigned char *s, size_t avail, size_t *need_p)
{
    unsigned char lo, hi;
    size_t need = utf8_lead(s[0], &lo, &hi);
    *need_p = need;
    if (need == 0) return 0;
    size_t i = 1;
    while (i < need && i < avail) {
        unsigned char c = s[i];
        if (i == 1 ? (c < lo || c > hi) : (c < 0x80 || c > 0xBF)) break;
        i++;
    }
    return i;
}

size_t kvs__utf8_incomplete_tail(const char *text, size_t len)
{
    const unsigned char *s = (const unsigned char *) text;
    for (size_t back = 1; back <= 3 && back <= len; back++) {
        size_t i = len - back;
        if ((s[i] & 0xC0) == 0x80) continue; /* a continuation byte: look further back */
        size_t need;
        size_t ok = utf8_valid_prefix(s + i, back, &need);
        return (need > back && ok == back) ? back : 0;
    }
    return 0;
}

void kvs__utf8_sanitize(kvs__sb_t *sb, const char *text, size_t len)
{
    const unsigned char *s = (const unsigned char *) text;
    size_t i = 0, run = 0; /* run: start of the valid bytes not yet appended */
    while (i < len) {
        size_t need;
        size_t ok = utf8_valid_prefix(s + i, len - i, &need);
        if (need != 0 && ok == need) {
            i += need;
            continue;
        }
        kvs__sb_append(sb, text + run, i - run);
        kvs__sb_append(sb, "\xEF\xBF\xBD", 3);
        i += ok ? ok : 1;
        run = i;
    }
    kvs__sb_append(sb, text + run, len - run);
}

size_t kvs__stop_find(const char *text, size_t len, size_t from, char *const *stops,
                      const size_t *stop_lens, uint32_t n_stops)
{
    size_t best = SIZE_MAX;
    for (uint32_t k = 0; k < n_stops; k++) {
        size_t sl = stop_lens[k];
        if (sl == 0 || sl > len) continue;
        for (size_t i = from; i + sl <= len && i < best; i++) {
            if (memcmp(text + i, stops[k], sl) == 0) {
                best = i;
                break;
            }
        }
    }
    return best;
}

size_t kvs__stop_hold(const char *text, size_t len, size_t from, char *const *stops,
                      const size_t *stop_lens, uint32_t n_stops)
{
    size_t hold = 0;
    for (uint32_t k = 0; k < n_stops; k++) {
        size_t sl = stop_lens[k];
        for (size_t h = sl > 0 ? sl - 1 : 0; h > hold; h--) {
            if (h > len - from) continue;
            if (memcmp(text + len - h, stops[k], h) == 0) {
                hold = h;
                break;
            }
        }
    }
    return hold;
}

/* ---- seeds ---- */

uint64_t kvs__random_seed(void)
{
    static uint64_t calls;
    uint64_t s;
    if (getrandom(&s, sizeof(s), GRND_NONBLOCK) != (ssize_t) sizeof(s)) {
        /* No entropy yet (or no getrandom): distinct per call and per process all the same. */
        uint64_t n = __atomic_add_fetch(&calls, 1, __ATOMIC_RELAXED);
        s = kvs_mix64(kvs_now_ns() ^ kvs_mix64(n ^ ((uint64_t) getpid() << 32)));
    }
    return s & ((UINT64_C(1) << 53) - 1);
}

/* ---- JSON ---- */

static pthread_once_t g_json_once = PTHREAD_ONCE_INIT;

static void json_setup(void)
{
    json_set_alloc_funcs(kvs_malloc, kvs_free);
}

void kvs__json_init(void)
{
    pthread_once(&g_json_once, json_setup);
}

char *kvs__json_dump_steal(json_t *obj)
{
    if (obj == NULL) return NULL;
    char *text = json_dumps(obj, JSON_COMPACT);
    json_decref(obj);
    return text;
}

char *kvs__json_error(const char *message, const char *type, const char *param, const char *code)
{
    json_t *err = json_object();
    json_t *root = json_object();
    if (err == NULL || root == NULL) {
        json_decref(err);
        json_decref(root);
        return NULL;
    }
    json_object_set_new(err, "message", json_string(message));
    json_object_set_new(err, "type", json_string(type));
    json_object_set_new(err, "param", param && *param ? json_string(param) : json_null());
    json_object_set_new(err, "code", code ? json_string(code) : json_null());
    json_object_set_new(root, "error", err);
    return kvs__json_dump_steal(root);
}

/* ---- metrics ---- */

const double kvs__transfer_bounds[KVS__TRANSFER_BOUNDS] = {0.0001, 0.0005, 0.001, 0.005, 0.01,
                                                           0.05,   0.1,    0.5,   1,     5};

void kvs__hist_init(kvs__hist_t *h, const double *bounds, uint32_t n)
{
    memset(h, 0, sizeof(*h));
    h->bounds = bounds;
    h->n = n < KVS__HIST_MAX ? n : KVS__HIST_MAX;
}

void kvs__hist_observe(kvs__hist_t *h, uint64_t ns)
{
    double s = (double) ns * 1e-9;
    uint32_t b = 0;
    while (b < h->n && s > h->bounds[b]) b++;
    __atomic_add_fetch(&h->counts[b], 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&h->sum_ns, ns, __ATOMIC_RELAXED);
    __atomic_add_fetch(&h->count, 1, __ATOMIC_RELAXED);
}

void kvs__metric_header(kvs__sb_t *sb, const char *name, const char *type, const char *help)
{
    kvs__sb_printf(sb, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

void kvs__hist_render(kvs__sb_t *sb, const char *name, const char *help, const kvs__hist_t *h)
{
    kvs__metric_header(sb, name, "histogram", help);
    /* Read the buckets first and derive _count from them, so the +Inf bucket always equals
     * _count even while other threads observe. */
    uint64_t cum = 0;
    for (uint32_t b = 0; b <= h->n; b++) {
        cum += __atomic_load_n(&h->counts[b], __ATOMIC_RELAXED);
        if (b < h->n)
            kvs__sb_printf(sb, "%s_bucket{le=\"%g\"} %llu\n", name, h->bounds[b],
                           (unsigned long long) cum);
        else
            kvs__sb_printf(sb, "%s_bucket{le=\"+Inf\"} %llu\n", name, (unsigned long long) cum);
    }
    uint64_t sum = __atomic_load_n(&h->sum_ns, __ATOMIC_RELAXED);
    kvs__sb_printf(sb, "%s_sum %.9g\n", name, (double) sum * 1e-9);
    kvs__sb_printf(sb, "%s_count %llu\n", name, (unsigned long long) cum);
}

/* ---- request bodies ---- */

kvs_status_t kvs__body_add(kvs__body_t *body, const char *data, size_t len)
{
    if (body->len + len > body->max) {
        body->too_large = 1;
        return KVS_OK;
    }
    if (body->len + len + 1 > body->cap) {
        size_t cap = body->cap ? body->cap : 1024;
        while (cap < body->len + len + 1) cap *= 2;
        char *p = kvs_realloc(body->data, cap);
        if (p == NULL) {
            kvs_error("http: no memory for a %zu-byte request body", body->len + len);
            return KVS_ERR_NOMEM;
        }
        body->data = p;
        body->cap = cap;
    }
    memcpy(body->data + body->len, data, len);
    body->len += len;
    body->data[body->len] = '\0';
    return KVS_OK;
}

void kvs__body_fini(kvs__body_t *body)
{
    kvs_free(body->data);
    body->data = NULL;
    body->len = body->cap = 0;
}

/* ---- libmicrohttpd ---- */

static void mhd_log(void *cls, const char *fmt, va_list ap)
{
    (void) cls;
    char msg[256];
    vsnprintf(msg, sizeof(msg), fmt, ap);
    size_t n = strlen(msg);
    while (n > 0 && (msg[n - 1] == '\n' || msg[n - 1] == '\r')) msg[--n] = '\0';
    kvs_debug("microhttpd: %s", msg);
}

/* The connections the process can afford: the soft open-file limit is raised towards the hard
 * one when the connection limit needs it, and the limit is lowered (said once) when even the
 * hard one is short. A full process would fail every accept and every outgoing connection,
 * where a full daemon only stops accepting until a connection ends. */
static uint32_t afford_connections(uint32_t want, uint32_t fds_per_conn)
{
    const rlim_t reserve = 256; /* listening sockets, logs, models, the rank pipes, ZeroMQ */
    rlim_t need = (rlim_t) want * fds_per_conn + reserve;
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0) return want;
    if (rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < need) {
        struct rlimit raised = rl;
        raised.rlim_cur = (rl.rlim_max == RLIM_INFINITY || rl.rlim_max > need) ? need : rl.rlim_max;
        if (setrlimit(RLIMIT_NOFILE, &raised) == 0) rl = raised;
    }
    if (rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur >= need) return want;
    uint32_t fit = rl.rlim_cur > reserve ? (uint32_t) ((rl.rlim_cur - reserve) / fds_per_conn) : 0;
    if (fit == 0) fit = 1;
    kvs_warn("http: the open-file limit (%llu, hard %llu) allows %u connections, not %u; raise "
             "it (ulimit -n) to serve more",
             (unsigned long long) rl.rlim_cur, (unsigned long long) rl.rlim_max, fit, want);
    return fit;
}

kvs_status_t kvs__http_start(const kvs__http_opts_t *o, struct MHD_Daemon **daemon_p,
                             uint16_t *port_p)
{
    struct sockaddr_in addr;
    memset(&addr, 0, sizeof(addr));
    addr.sin_family = AF_INET;
    addr.sin_port = htons(o->port);
    const char *h = o->host ? o->host : "127.0.0.1";
    if (strcmp(h, "localhost") == 0) h = "127.0.0.1";
    if (inet_pton(AF_INET, h, &addr.sin_addr) != 1) {
        kvs_error("http: bind address '%s' is not an IPv4 address", h);
        return KVS_ERR_INVALID;
    }
    /* epoll or poll: no FD_SETSIZE ceiling on the descriptors a connection may get. */
    unsigned flags = (o->quiesce ? MHD_USE_POLL_INTERNAL_THREAD : MHD_USE_EPOLL_INTERNAL_THREAD) |
                     MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ERROR_LOG;
    unsigned pool = o->threads ? o->threads : 4;
    unsigned limit =
        afford_connections(o->max_connections ? o->max_connections : KVS__HTTP_MAX_CONNECTIONS,
                           o->fds_per_connection ? o->fds_per_connection : 1);
    unsigned idle = o->idle_timeout_s ? o->idle_timeout_s : KVS__HTTP_IDLE_TIMEOUT_S;
    /* libmicrohttpd splits the limit among the pool's threads; each needs one at least. */
    if (pool > limit) pool = limit;
    /* The pool option is refused for a single thread. */
    struct MHD_OptionItem opts[] = {
        {MHD_OPTION_EXTERNAL_LOGGER, (intptr_t) mhd_log, NULL},
        {MHD_OPTION_SOCK_ADDR, 0, &addr},
        {MHD_OPTION_NOTIFY_COMPLETED, (intptr_t) o->completed, o->completed_cls},
        {MHD_OPTION_CONNECTION_TIMEOUT, idle, NULL},
        {MHD_OPTION_CONNECTION_LIMIT, limit, NULL},
        {pool > 1 ? MHD_OPTION_THREAD_POOL_SIZE : MHD_OPTION_END, pool, NULL},
        {MHD_OPTION_END, 0, NULL},
    };
    struct MHD_Daemon *d = MHD_start_daemon(flags, o->port, NULL, NULL, o->handler, o->handler_cls,
                                            MHD_OPTION_ARRAY, opts, MHD_OPTION_END);
    if (d == NULL) {
        kvs_error("http: cannot listen on %s:%u", h, (unsigned) o->port);
        return KVS_ERR_IO;
    }
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(d, MHD_DAEMON_INFO_BIND_PORT);
    if (info == NULL || info->port == 0) {
        kvs_error("http: cannot read back the port bound on %s", h);
        MHD_stop_daemon(d);
        return KVS_ERR_IO;
    }
    *port_p = info->port;
    *daemon_p = d;
    return KVS_OK;
}

int kvs__http_body_exceeds(struct MHD_Connection *conn, size_t max)
{
    const char *v = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Content-Length");
    if (v == NULL) return 0;
    char *end;
    errno = 0;
    unsigned long long n = strtoull(v, &end, 10);
    /* libmicrohttpd refuses a malformed length before the handler sees the request. */
    return end != v && (errno == ERANGE || n > max);
}

int kvs_server_api_key_valid(const char *key)
{
    size_t n = strlen(key);
    for (size_t i = 0; i < n; i++)
        if ((unsigned char) key[i] <= 0x20 || (unsigned char) key[i] >= 0x7F) return 0;
    return n >= 1 && n <= 1024;
}

kvs_status_t kvs__http_key_check(const char *key)
{
    if (key == NULL || kvs_server_api_key_valid(key)) return KVS_OK;
    kvs_error("http: an API key must be 1 to 1024 printable ASCII characters without spaces");
    return KVS_ERR_INVALID;
}

int kvs__http_has_credentials(struct MHD_Connection *conn)
{
    return MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION) !=
           NULL;
}

int kvs__http_authorized(struct MHD_Connection *conn, const char *key)
{
    if (key == NULL) return 1;
    const char *v =
        MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    if (v == NULL || strncasecmp(v, "Bearer ", 7) != 0) return 0;
    v += 7;
    while (*v == ' ') v++;
    /* Constant time in the key: every byte of it is compared whatever the client sent. */
    size_t given = strlen(v), want = strlen(key);
    unsigned char diff = given != want;
    for (size_t i = 0; i < want; i++)
        diff |= (unsigned char) ((i < given ? (unsigned char) v[i] : 0) ^ (unsigned char) key[i]);
    return diff == 0;
}

enum MHD_Result kvs__http_send(struct MHD_Connection *conn, unsigned status, const char *type,
                               const char *text, size_t len, const char *const *headers)
{
    struct MHD_Response *resp =
        MHD_create_response_from_buffer(len, (void *) text, MHD_RESPMEM_MUST_COPY);
    if (resp == NULL) return MHD_NO;
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    kvs__http_add_headers(resp, headers);
    enum MHD_Result r = MHD_queue_response(conn, status, resp);
    MHD_destroy_response(resp);
    return r;
}

void kvs__http_add_headers(struct MHD_Response *resp, const char *const *headers)
{
    for (size_t i = 0; headers && headers[i] && headers[i + 1]; i += 2)
        MHD_add_response_header(resp, headers[i], headers[i + 1]);
}

enum MHD_Result kvs__http_send_error(struct MHD_Connection *conn, unsigned status,
                                     const char *message, const char *type, const char *param,
                                     const char *code, const char *const *headers)
{
    char *text = kvs__json_error(message, type, param, code);
    static const char fallback[] = "{\"error\":{\"message\":\"out of memory\",\"type\":"
                                   "\"server_error\",\"param\":null,\"code\":null}}";
    enum MHD_Result r =
        kvs__http_send(conn, text ? status : 500, "application/json", text ? text : fallback,
                       strlen(text ? text : fallback), headers);
    kvs_free(text);
    return r;
}

int kvs__http_client_left(struct MHD_Connection *conn)
{
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (ci == NULL) return 0;
    char b;
    ssize_t n = recv(ci->connect_fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    /* Only an orderly close or a reset says so; any other error is no proof the client left. */
    return n == 0 || (n < 0 && errno == ECONNRESET);
}
