/* Internals shared by the server, the router and their tests: a string builder, UTF-8 and
 * stop-string helpers for streamed text, OpenAI request parsing and response building,
 * Prometheus histograms, and the libmicrohttpd plumbing both HTTP fronts use. */
#ifndef KVSTAGE_SERVER_INTERNAL_H
#define KVSTAGE_SERVER_INTERNAL_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <jansson.h>
#include <microhttpd.h>

#include "http/server.h"

/* ---- string builder ---- */

typedef struct {
    char *ptr; /* NUL-terminated when len > 0 or after any append */
    size_t len, cap;
    int oom; /* an append failed: the content is truncated */
} kvs__sb_t;

void kvs__sb_init(kvs__sb_t *sb);
void kvs__sb_fini(kvs__sb_t *sb);
void kvs__sb_append(kvs__sb_t *sb, const char *data, size_t len);
void kvs__sb_puts(kvs__sb_t *sb, const char *s);
void kvs__sb_printf(kvs__sb_t *sb, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Drops the first n bytes. */
void kvs__sb_consume(kvs__sb_t *sb, size_t n);
/* Hands the buffer over (NUL-terminated, "" when empty; NULL after an allocation failure). */
char *kvs__sb_take(kvs__sb_t *sb);

/* ---- streamed text ---- */

/* Bytes at the end of text[0, len) that start a UTF-8 character not yet complete (0..3). */
size_t kvs__utf8_incomplete_tail(const char *text, size_t len);
/* Appends text[0, len) to sb as valid UTF-8: each invalid or truncated sequence becomes U+FFFD. */
void kvs__utf8_sanitize(kvs__sb_t *sb, const char *text, size_t len);
/* The first occurrence of any stop string in text[from, len): its offset, or SIZE_MAX. */
size_t kvs__stop_find(const char *text, size_t len, size_t from, char *const *stops,
                      const size_t *stop_lens, uint32_t n_stops);
/* The longest suffix of text[from, len) that is a proper prefix of some stop string: text that
 * must be held back because a stop string may be completing. */
size_t kvs__stop_hold(const char *text, size_t len, size_t from, char *const *stops,
                      const size_t *stop_lens, uint32_t n_stops);

/* A fresh seed for a request that gave none, in [0, 2^53) (exact as a JSON number in any
 * client): from getrandom, or the clock and a counter mixed when that fails. */
uint64_t kvs__random_seed(void);

/* ---- JSON ---- */

/* Routes jansson's allocations through the accounted allocator (once per process). */
void kvs__json_init(void);
/* Compact JSON text from kvs_malloc, or NULL (allocation failure). Steals obj. */
char *kvs__json_dump_steal(json_t *obj);
/* {"error": {"message", "type", "param", "code"}} as text; param and code may be NULL. */
char *kvs__json_error(const char *message, const char *type, const char *param, const char *code);

/* ---- OpenAI requests ---- */

#define KVS__MAX_STOPS               16
#define KVS__CHAT_TOP_LOGPROBS_MAX   20 /* OpenAI's ranges */
#define KVS__COMPLETION_LOGPROBS_MAX 5
#define KVS__MAX_STOP_LEN            256

typedef struct {
    uint32_t max_context;
    uint32_t default_max_tokens;
    const char *model; /* NULL: any */
    int strict;        /* refuse unknown fields (400) instead of ignoring them */
} kvs__api_limits_t;

#define KVS__IGNORED_CAP 512

/* Unknown fields a request carried, as the X-Kvstage-Ignored-Fields header lists them. */
typedef struct {
    /* "a, kvstage.b, messages[0].c": bytes outside printable ASCII, '%' and ',' as %XX; ends
     * with "..." when more did not fit. */
    char names[KVS__IGNORED_CAP];
    uint32_t n; /* fields ignored, listed or not */
    int truncated;
} kvs__api_ignored_t;

typedef struct {
    int chat;
    uint32_t *prompt; /* [prompt_len] */
    uint32_t prompt_len;
    uint32_t max_tokens;
    uint32_t n;                   /* choices ("n"), 1..KVS_SERVER_CHOICES_MAX */
    kvs_sample_params_t sampling; /* sampling.bias: owned (kvs_malloc) */
    uint64_t seed;                /* the client's, or kvs__random_seed() */
    int stream, include_usage;
    int logprobs;                /* chat "logprobs": true; completions "logprobs": N */
    uint32_t top_logprobs;       /* chat "top_logprobs"; completions "logprobs" */
    int echo;                    /* completions: the prompt's text (and logprobs) come first */
    char *stops[KVS__MAX_STOPS]; /* decoded-text stop strings */
    size_t stop_lens[KVS__MAX_STOPS];
    uint32_t n_stops;
    uint32_t *stop_ids; /* [n_stop_ids]: the tokenizer's EOS (not with ignore_eos), then
                           "stop_token_ids" */
    uint32_t n_stop_ids;
    int has_room; /* "kvstage" given */
    uint64_t room;
    kvs_server_role_t role;
    char *bootstrap; /* or NULL */
    kvs__api_ignored_t ignored;
} kvs__api_req_t;

typedef struct {
    int status;       /* HTTP status */
    const char *type; /* "invalid_request_error", "server_error" */
    const char *code; /* or NULL */
    char param[64];   /* "" for null */
    char message[256];
} kvs__api_err_t;

/* For checking a request's shape where no tokenizer is (the router): every text encodes to one
 * token, every id below 2^32 - 1 is valid, no EOS. With max_context UINT32_MAX, kvs__api_parse
 * then refuses what the servers would refuse for its fields, types and ranges, not its length
 * or its token ids. */
kvs_server_tokenizer_t kvs__shape_tokenizer(void);

/* Parses and validates one request body (unknown fields as kvs__api_check_fields says, with
 * limits->strict, listed in req_p->ignored). KVS_ERR_INVALID with *err_p filled for a request to
 * refuse (status 400 or 404); KVS_ERR_NOMEM (err_p filled with 500). Client errors are logged
 * at debug level only. On success *req_p is owned by the caller (kvs__api_req_fini). */
kvs_status_t kvs__api_parse(const kvs__api_limits_t *limits, const kvs_server_tokenizer_t *tok,
                            int chat, const char *body, size_t len, kvs__api_req_t *req_p,
                            kvs__api_err_t *err_p);
void kvs__api_req_fini(kvs__api_req_t *req);
/* The fields of a body (root) outside what the endpoint (chat or completions) knows, at the top
 * level and in "messages"[i], "stream_options" and "kvstage". strict: the first one is refused
 * (KVS_ERR_INVALID, err: 400 naming it, code "unknown_field"); else each is listed in *ign and,
 * with remove, deleted from root. Either way the other endpoint's input ("prompt" in a chat
 * request, "messages" in a completions one) is refused (code "wrong_endpoint"), and a root that
 * is not an object. One definition of the known fields for the server and the router. */
kvs_status_t kvs__api_check_fields(json_t *root, int chat, int strict, int remove,
                                   kvs__api_ignored_t *ign, kvs__api_err_t *err);

/* POST /tokenize: {"prompt": text or ids} or {"messages": [...]} (rendered with the chat
 * template, as a chat request) -> ids (kvs_malloc), as vLLM's. Errors as kvs__api_parse. */
kvs_status_t kvs__api_tokenize(const kvs__api_limits_t *limits, const kvs_server_tokenizer_t *tok,
                               const char *body, size_t len, uint32_t **ids_p, uint32_t *n_p,
                               kvs__api_err_t *err_p);
/* POST /detokenize: {"tokens": [ids]} -> their text, valid UTF-8 (kvs_malloc). */
kvs_status_t kvs__api_detokenize(const kvs__api_limits_t *limits, const kvs_server_tokenizer_t *tok,
                                 const char *body, size_t len, char **text_p,
                                 kvs__api_err_t *err_p);

/* The OpenAI name of a finish reason. */
const char *kvs__finish_name(kvs_server_finish_t finish);

/* ---- metrics ---- */

#define KVS__HIST_MAX 16

typedef struct {
    const double *bounds; /* [n] upper bounds in seconds, ascending (+Inf implied) */
    uint32_t n;
    uint64_t counts[KVS__HIST_MAX + 1]; /* per bucket, not cumulative; last: above all bounds */
    uint64_t sum_ns, count;
} kvs__hist_t;

/* The buckets of KV transfer times (the server's and the router's histograms). */
#define KVS__TRANSFER_BOUNDS 10
extern const double kvs__transfer_bounds[KVS__TRANSFER_BOUNDS];

void kvs__hist_init(kvs__hist_t *h, const double *bounds, uint32_t n);
/* Thread-safe (atomics). */
void kvs__hist_observe(kvs__hist_t *h, uint64_t ns);
/* # HELP, # TYPE, cumulative _bucket{le=...}, _sum (seconds) and _count. */
void kvs__hist_render(kvs__sb_t *sb, const char *name, const char *help, const kvs__hist_t *h);
void kvs__metric_header(kvs__sb_t *sb, const char *name, const char *type, const char *help);

/* ---- HTTP plumbing ---- */

typedef struct {
    char *data; /* [len] */
    size_t len, cap, max;
    int too_large; /* more than max bytes came; the excess was dropped */
} kvs__body_t;

/* Takes the next piece of an upload; drops bytes past max (too_large set). KVS_ERR_NOMEM. */
kvs_status_t kvs__body_add(kvs__body_t *body, const char *data, size_t len);
void kvs__body_fini(kvs__body_t *body);

/* Defaults of both fronts' connection handling. */
#define KVS__HTTP_MAX_CONNECTIONS 4096
#define KVS__HTTP_IDLE_TIMEOUT_S  60

typedef struct {
    const char *host; /* IPv4; NULL: 127.0.0.1 */
    uint16_t port;
    uint32_t threads;            /* 0: 4 */
    uint32_t max_connections;    /* 0: KVS__HTTP_MAX_CONNECTIONS */
    uint32_t idle_timeout_s;     /* 0: KVS__HTTP_IDLE_TIMEOUT_S */
    uint32_t fds_per_connection; /* descriptors one client costs the process; 0: 1 */
    MHD_AccessHandlerCallback handler;
    void *handler_cls;
    MHD_RequestCompletedCallback completed;
    void *completed_cls;
    /* The caller stops accepting with MHD_quiesce_daemon before it stops the daemon. Such a
     * daemon waits with poll(), not epoll: libmicrohttpd 0.9.75 can abort the process when an
     * epoll daemon with internal threads is quiesced (its own thread and the quiesce both take
     * the listen socket out of the epoll set, and the loser panics on ENOENT). */
    int quiesce;
} kvs__http_opts_t;

/* Starts a daemon with an internal thread pool and suspend/resume, bound to host:port, waiting
 * with epoll (poll() with opts->quiesce).
 * At most max_connections clients at once (the next ones wait in the listen backlog); one
 * silent for idle_timeout_s is closed, whatever phase it is in (libmicrohttpd answers nothing
 * then: it lets the application answer only once the whole request is in), except while
 * suspended (waiting for tokens). Raises the process's open-file soft limit when the
 * connections need it (max_connections * fds_per_connection), or lowers the limit to what the
 * hard limit allows, with a warning. */
kvs_status_t kvs__http_start(const kvs__http_opts_t *opts, struct MHD_Daemon **daemon_p,
                             uint16_t *port_p);
/* 1 when the request declares (Content-Length) a body larger than max: answered at once, before
 * the body is read, so a client cannot hold the connection by sending it slowly. */
int kvs__http_body_exceeds(struct MHD_Connection *conn, size_t max);
/* KVS_OK for NULL (no key) or a key of 1 to 1024 printable ASCII characters without spaces;
 * else KVS_ERR_INVALID, logged. */
kvs_status_t kvs__http_key_check(const char *key);
/* 1 when key is NULL or the request carries "Authorization: Bearer KEY" (compared in constant
 * time). */
int kvs__http_authorized(struct MHD_Connection *conn, const char *key);
/* 1 when the request has an Authorization header at all. */
int kvs__http_has_credentials(struct MHD_Connection *conn);
/* headers: NULL, or name, value, ..., NULL. */
void kvs__http_add_headers(struct MHD_Response *resp, const char *const *headers);
/* 1 when the client of a suspended connection has closed its end: libmicrohttpd does not watch
 * suspended sockets, so a waiting request looks itself (an orderly shutdown reads as 0 bytes; a
 * request pipelined behind this one, or nothing yet, is not a hang-up). Only while conn stays
 * suspended (its socket is still its own). */
int kvs__http_client_left(struct MHD_Connection *conn);
/* Queues text (copied) with a content type and headers; MHD_NO when it cannot. */
enum MHD_Result kvs__http_send(struct MHD_Connection *conn, unsigned status, const char *type,
                               const char *text, size_t len, const char *const *headers);
/* Queues {"error": ...} with headers (e.g. "Allow" for 405). */
enum MHD_Result kvs__http_send_error(struct MHD_Connection *conn, unsigned status,
                                     const char *message, const char *type, const char *param,
                                     const char *code, const char *const *headers);

#endif
