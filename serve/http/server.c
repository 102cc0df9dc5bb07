/* The HTTP server of one instance: libmicrohttpd with an internal thread pool, routing,
 * the OpenAI endpoints over the backend interface, streaming through suspended connections,
 * and the metrics.
 *
 * One HTTP request is one req_t, shared by the connection (MHD threads) and, once submitted,
 * the backend's sink (any thread), with a reference each. The sink only queues tokens and wakes
 * the connection; text decoding, stop strings and JSON happen on the MHD thread that serves the
 * connection (pump()), so the backend's engine loop never waits on formatting or the network.
 * A connection waiting for tokens is suspended; whoever flips r->suspended from 1 to 0 (under
 * r->mu) resumes it, exactly once, and a suspended connection cannot complete, so the resume
 * never touches a closed connection. */
#include "http/server_internal.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include "kvstage/alloc.h"
#include "kvstage/clock.h"
#include "kvstage/log.h"

typedef enum {
    EP_UNKNOWN = 0,
    EP_COMPLETIONS,
    EP_CHAT,
    EP_MODELS,
    EP_MODEL, /* /v1/models/{id} */
    EP_HEALTH,
    EP_METRICS,
    EP_MATCH,
    EP_INFO,
    EP_CANCEL,
    EP_TOKENIZE,
    EP_DETOKENIZE,
} endpoint_t;

typedef struct {
    uint32_t choice;
    uint32_t token;
    size_t piece_off; /* into the pieces buffer */
    size_t piece_len; /* SIZE_MAX: decode with the tokenizer */
    int has_lp;
    kvs_logprobs_t lp;
} tok_rec_t;

/* One position of an answer's logprobs: a generated token, or (echo) a prompt token. */
typedef struct {
    uint32_t token;
    int is_prompt;
    uint32_t prompt_at; /* is_prompt: its position (its logprobs are the sink's prompt_lp) */
    int has_lp;         /* generated: the backend sent them */
    kvs_logprobs_t lp;
    size_t piece_off, piece_len; /* its text, in lp_pieces */
    size_t end;                  /* bytes of the answer's text up to its end */
    size_t offset;               /* characters (code points) of the text before it */
} lp_rec_t;

typedef struct {
    tok_rec_t *toks; /* [n] */
    size_t n, cap;
    kvs__sb_t pieces;
} tok_queue_t;

/* One choice of an answer (the connection's thread only). */
typedef struct {
    kvs__sb_t text; /* the decoded text so far; cut at a stop string */
    size_t emitted; /* bytes of text already streamed */
    uint32_t generated;
    int stop_matched, cancel_sent;
    kvs_server_finish_t finish; /* once the request finished */
    /* logprobs: a record per rendered token, in text order; lps_sent of them streamed */
    lp_rec_t *lps;
    size_t n_lps, cap_lps, lps_sent;
    kvs__sb_t lp_pieces;
    size_t text_chars; /* code points in text */
    int lp_oom;
} choice_t;

typedef struct req req_t;

/* Rooms cancelled (POST /internal/cancel) before their request arrived: a request for one of
 * them within TOMB_NS is refused, so that a side the router gave up on never starts. */
#define TOMBS   1024
#define TOMB_NS (UINT64_C(60) * 1000000000u)

typedef struct {
    uint64_t room, at_ns; /* at_ns 0: empty */
} tomb_t;

struct kvs_server {
    char *model, *bootstrap, *api_key;
    kvs_server_role_t role;
    int strict_role;
    size_t max_body;
    kvs__api_limits_t limits;
    kvs_server_backend_t backend;
    kvs_server_tokenizer_t tok;
    struct MHD_Daemon *daemon;
    uint16_t port;
    time_t started;
    uint64_t next_room; /* atomic */

    pthread_mutex_t mu; /* stopping, the live list */
    pthread_cond_t cv;  /* the live list shrank */
    int stopping;
    req_t *live; /* submitted requests whose on_done has not come */
    uint32_t n_live;
    uint32_t n_reqs; /* HTTP requests not yet freed */
    tomb_t tombs[TOMBS];
    uint32_t next_tomb;

    /* Metrics, updated with atomics. */
    uint64_t http_codes[600];
    uint64_t finishes[4];
    uint64_t cancels;
    uint64_t prompt_tokens, generation_tokens, cached_tokens, kv_bytes;
    kvs__hist_t ttft, itl, e2e, transfer;

    /* The poke thread: looks at the sockets of waiting non-streaming connections now and then
     * (POKE_NS), which libmicrohttpd does not watch while they are suspended, so that a client
     * that hung up has its room cancelled while it runs, not when it ends. */
    pthread_t poke_thread;
    int poke_started;
    int poke_stop; /* under mu */
};

#define POKE_NS (500ull * 1000000ull)

struct req {
    kvs_server_t *srv;
    struct MHD_Connection *conn;
    endpoint_t ep;
    int method_ok;
    int authorized; /* the API key, when one is required */
    int model_ok;   /* EP_MODEL: the id is the served model */
    char method[8];
    char path[64];
    kvs__body_t body;
    int body_oom;

    pthread_mutex_t mu;
    int refs; /* under mu: the connection's, and the backend's while live */

    /* Fixed once submitted. */
    int submitted;
    kvs__api_req_t api;
    uint64_t room;
    time_t created;
    char id[48];
    uint64_t submit_ns;

    /* Shared with the sink, under mu. */
    kvs_logprobs_t *prompt_lp; /* echo with logprobs: [prompt_len], position 0 unused */
    uint8_t *prompt_has;       /* [prompt_len] the sink reported that position */
    tok_queue_t pend;
    int sink_oom;
    int backend_done;
    kvs_server_done_t done;
    int suspended;
    uint64_t first_ns, last_ns;

    /* The live list, under srv->mu. */
    req_t *prev, *next;
    int shutdown;      /* atomic: cancelled because the server stops */
    int remote_cancel; /* under srv->mu: /internal/cancel named this room */

    /* The connection's thread only. */
    tok_queue_t work;
    choice_t *ch; /* [n_ch]: api.n, or 1 */
    uint32_t n_ch;
    int cancel_sent, done_taken; /* cancel_sent: of every choice */
    int finished;
    kvs_server_finish_t finish; /* the request's: ERROR when it failed, else choice 0's */
    kvs_status_t finish_status;
    kvs_server_done_t final_done;
    kvs__sb_t out; /* SSE bytes not yet handed to MHD */
    int stream_started, stream_ended;
    size_t echo_len; /* bytes of each choice's text that echo the prompt */
};

static const double k_ttft_bounds[] = {0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2,
                                       0.5,   1,     2,    5,    10,   30};
static const double k_itl_bounds[] = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                                      0.05,   0.1,   0.25,   0.5,   1,    2.5};
static const double k_e2e_bounds[] = {0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120};

#define COUNT(srv_field)      __atomic_add_fetch(&(srv_field), 1, __ATOMIC_RELAXED)
#define ADD(srv_field, delta) __atomic_add_fetch(&(srv_field), (delta), __ATOMIC_RELAXED)
#define LOAD(srv_field)       __atomic_load_n(&(srv_field), __ATOMIC_RELAXED)

/* ---- requests ---- */

static void queue_fini(tok_queue_t *q)
{
    kvs_free(q->toks);
    kvs__sb_fini(&q->pieces);
    memset(q, 0, sizeof(*q));
}

static void req_unref(req_t *r)
{
    pthread_mutex_lock(&r->mu);
    int last = --r->refs == 0;
    pthread_mutex_unlock(&r->mu);
    if (!last) return;
    kvs__body_fini(&r->body);
    kvs__api_req_fini(&r->api);
    queue_fini(&r->pend);
    queue_fini(&r->work);
    for (uint32_t i = 0; i < r->n_ch; i++) {
        kvs__sb_fini(&r->ch[i].text);
        kvs_free(r->ch[i].lps);
        kvs__sb_fini(&r->ch[i].lp_pieces);
    }
    kvs_free(r->ch);
    kvs__sb_fini(&r->out);
    kvs_free(r->prompt_lp);
    kvs_free(r->prompt_has);
    pthread_mutex_destroy(&r->mu);
    kvs_server_t *srv = r->srv;
    kvs_free(r);
    pthread_mutex_lock(&srv->mu);
    srv->n_reqs--;
    pthread_cond_broadcast(&srv->cv);
    pthread_mutex_unlock(&srv->mu);
}

#define MODEL_PREFIX "/v1/models/"

static endpoint_t route(const char *url, const char **allow_p)
{
    static const struct {
        const char *path;
        endpoint_t ep;
        const char *method;
    } table[] = {
        {"/v1/completions", EP_COMPLETIONS, "POST"},
        {"/v1/chat/completions", EP_CHAT, "POST"},
        {"/v1/models", EP_MODELS, "GET"},
        {"/health", EP_HEALTH, "GET"},
        {"/metrics", EP_METRICS, "GET"},
        {"/internal/match", EP_MATCH, "POST"},
        {"/internal/info", EP_INFO, "GET"},
        {"/internal/cancel", EP_CANCEL, "POST"},
        {"/tokenize", EP_TOKENIZE, "POST"},
        {"/detokenize", EP_DETOKENIZE, "POST"},
    };
    for (size_t i = 0; i < sizeof(table) / sizeof(table[0]); i++) {
        if (strcmp(url, table[i].path) == 0) {
            *allow_p = table[i].method;
            return table[i].ep;
        }
    }
    /* Model ids may hold slashes ("org/name"): everything after the prefix is the id. */
    if (strncmp(url, MODEL_PREFIX, strlen(MODEL_PREFIX)) == 0 && url[strlen(MODEL_PREFIX)]) {
        *allow_p = "GET";
        return EP_MODEL;
    }
    *allow_p = NULL;
    return EP_UNKNOWN;
}

static const char *allowed_method(endpoint_t ep)
{
    return (ep == EP_COMPLETIONS || ep == EP_CHAT || ep == EP_MATCH || ep == EP_CANCEL ||
            ep == EP_TOKENIZE || ep == EP_DETOKENIZE)
               ? "POST"
               : "GET";
}

static req_t *req_new(kvs_server_t *srv, struct MHD_Connection *conn, const char *url,
                      const char *method)
{
    req_t *r = kvs_calloc(1, sizeof(*r));
    if (r == NULL) return NULL;
    pthread_mutex_init(&r->mu, NULL);
    r->refs = 1;
    r->srv = srv;
    r->conn = conn;
    const char *allow;
    r->ep = route(url, &allow);
    r->method_ok = allow != NULL && strcmp(method, allow) == 0;
    r->authorized = kvs__http_authorized(conn, srv->api_key);
    r->model_ok = r->ep == EP_MODEL && strcmp(url + strlen(MODEL_PREFIX), srv->model) == 0;
    snprintf(r->method, sizeof(r->method), "%s", method);
    snprintf(r->path, sizeof(r->path), "%s", url);
    r->body.max = srv->max_body;
    pthread_mutex_lock(&srv->mu);
    srv->n_reqs++;
    pthread_mutex_unlock(&srv->mu);
    return r;
}

/* ---- answers ---- */

/* The headers of every answer to r: the unknown fields its body carried. */
static const char *const *answer_headers(const req_t *r, const char *h[3])
{
    if (r->api.ignored.n == 0) return NULL;
    h[0] = KVS_SERVER_IGNORED_HEADER;
    h[1] = r->api.ignored.names;
    h[2] = NULL;
    return h;
}

static enum MHD_Result send_text(req_t *r, unsigned status, const char *type, const char *text)
{
    COUNT(r->srv->http_codes[status < 600 ? status : 599]);
    const char *h[3];
    return kvs__http_send(r->conn, status, type, text, strlen(text), answer_headers(r, h));
}

static enum MHD_Result send_json_steal(req_t *r, unsigned status, json_t *obj)
{
    char *text = kvs__json_dump_steal(obj);
    if (text == NULL) {
        COUNT(r->srv->http_codes[500]);
        return kvs__http_send_error(r->conn, 500, "out of memory", "server_error", NULL, NULL,
                                    NULL);
    }
    enum MHD_Result res = send_text(r, status, "application/json", text);
    kvs_free(text);
    return res;
}

static enum MHD_Result send_error(req_t *r, unsigned status, const char *message, const char *param,
                                  const char *code)
{
    COUNT(r->srv->http_codes[status < 600 ? status : 599]);
    const char *type = status >= 500 ? "server_error" : "invalid_request_error";
    const char *h[3];
    const char *const *headers = answer_headers(r, h);
    if (status == 405) {
        h[0] = MHD_HTTP_HEADER_ALLOW;
        h[1] = allowed_method(r->ep);
        h[2] = NULL;
        headers = h;
    } else if (status == 401) {
        h[0] = MHD_HTTP_HEADER_WWW_AUTHENTICATE;
        h[1] = "Bearer";
        h[2] = NULL;
        headers = h;
    }
    return kvs__http_send_error(r->conn, status, message, type, param, code, headers);
}

/* Tokens generated, every choice's. */
static uint32_t generated_of(const req_t *r)
{
    uint32_t n = 0;
    for (uint32_t i = 0; i < r->n_ch; i++) n += r->ch[i].generated;
    return n;
}

/* The prompt counts once, the completion tokens of every choice. */
static json_t *usage_json(const req_t *r)
{
    json_t *details = json_pack("{s:i}", "cached_tokens", (int) r->final_done.cached_tokens);
    uint32_t gen = generated_of(r);
    return json_pack("{s:i, s:i, s:i, s:o}", "prompt_tokens", (int) r->api.prompt_len,
                     "completion_tokens", (int) gen, "total_tokens",
                     (int) (r->api.prompt_len + gen), "prompt_tokens_details", details);
}

static json_t *kvstage_json(const req_t *r)
{
    return json_pack("{s:I, s:I, s:I, s:I, s:I}", "room", (json_int_t) r->room, "seed",
                     (json_int_t) r->api.seed, "ttft_ns", (json_int_t) r->final_done.ttft_ns,
                     "transfer_ns", (json_int_t) r->final_done.transfer_ns, "kv_bytes",
                     (json_int_t) r->final_done.kv_bytes);
}

/* {"id", "object", "created", "model"} */
static json_t *head_json(const req_t *r, const char *object)
{
    return json_pack("{s:s, s:s, s:I, s:s}", "id", r->id, "object", object, "created",
                     (json_int_t) r->created, "model", r->srv->model);
}

/* ---- logprobs (OpenAI's shapes) ---- */

static size_t utf8_chars(const char *s, size_t len)
{
    size_t n = 0;
    for (size_t i = 0; i < len; i++) n += ((unsigned char) s[i] & 0xc0) != 0x80;
    return n;
}

/* Records the token whose piece was just appended to c->text (logprobs asked). */
static void lp_push(choice_t *c, uint32_t token, const char *piece, size_t len, int is_prompt,
                    uint32_t prompt_at, const kvs_logprobs_t *lp)
{
    if (c->n_lps == c->cap_lps) {
        size_t cap = c->cap_lps ? 2 * c->cap_lps : 64;
        lp_rec_t *p = kvs_realloc(c->lps, cap * sizeof(*p));
        if (p == NULL) {
            c->lp_oom = 1;
            return;
        }
        c->lps = p;
        c->cap_lps = cap;
    }
    lp_rec_t *e = &c->lps[c->n_lps++];
    memset(e, 0, sizeof(*e));
    e->token = token;
    e->is_prompt = is_prompt;
    e->prompt_at = prompt_at;
    if (lp != NULL) {
        e->has_lp = 1;
        e->lp = *lp;
    }
    e->piece_off = c->lp_pieces.len;
    e->piece_len = len;
    kvs__sb_append(&c->lp_pieces, piece, len);
    if (c->lp_pieces.oom) c->lp_oom = 1;
    e->end = c->text.len;
    e->offset = c->text_chars;
    c->text_chars += utf8_chars(piece, len);
}

/* The logprobs of record e, or NULL (a prompt's first token, or none reported). */
static const kvs_logprobs_t *lp_of(const req_t *r, const lp_rec_t *e)
{
    if (!e->is_prompt) return e->has_lp ? &e->lp : NULL;
    if (e->prompt_at == 0 || r->prompt_has == NULL || !r->prompt_has[e->prompt_at]) return NULL;
    return &r->prompt_lp[e->prompt_at];
}

static json_t *text_json(const char *text, size_t len);

/* A token's text as OpenAI gives it: a string (invalid UTF-8 as U+FFFD) and, for chat, its
 * bytes. */
static void token_text(const req_t *r, uint32_t id, const char **s_p, size_t *len_p)
{
    if (r->srv->tok.piece(r->srv->tok.ctx, id, s_p, len_p) != KVS_OK) {
        *s_p = "";
        *len_p = 0;
    }
}

static json_t *bytes_json(const char *s, size_t len)
{
    json_t *a = json_array();
    for (size_t i = 0; a && i < len; i++)
        json_array_append_new(a, json_integer((unsigned char) s[i]));
    return a;
}

static json_t *chat_entry(const char *s, size_t len, float logprob)
{
    return json_pack("{s:o, s:f, s:o}", "token", text_json(s, len), "logprob", (double) logprob,
                     "bytes", bytes_json(s, len));
}

/* Records [from, to) of choice c as choices[i].logprobs: chat {"content": [...]}, completions
 * {"tokens", "token_logprobs", "top_logprobs" (each a dict of at most N + 1 texts: the top N and
 * the chosen token), "text_offset"}. NULL without logprobs. */
static json_t *logprobs_json(const req_t *r, const choice_t *c, size_t from, size_t to)
{
    if (!r->api.logprobs) return NULL;
    const char *pieces = c->lp_pieces.ptr ? c->lp_pieces.ptr : "";
    if (r->api.chat) {
        json_t *content = json_array();
        for (size_t i = from; content && i < to; i++) {
            const lp_rec_t *e = &c->lps[i];
            const kvs_logprobs_t *lp = lp_of(r, e);
            json_t *ent = chat_entry(pieces + e->piece_off, e->piece_len,
                                     lp ? lp->logprob : KVS_LOGPROB_FLOOR);
            json_t *tops = json_array();
            for (uint32_t k = 0; lp && tops && k < lp->n_top && k < r->api.top_logprobs; k++) {
                const char *s;
                size_t n;
                token_text(r, lp->top[k].token, &s, &n);
                json_array_append_new(tops, chat_entry(s, n, lp->top[k].logprob));
            }
            if (ent && tops) json_object_set_new(ent, "top_logprobs", tops);
            json_array_append_new(content, ent);
        }
        return json_pack("{s:o, s:n}", "content", content, "refusal");
    }
    json_t *tokens = json_array(), *lps = json_array(), *tops = json_array(), *offs = json_array();
    for (size_t i = from; i < to && tokens && lps && tops && offs; i++) {
        const lp_rec_t *e = &c->lps[i];
        const kvs_logprobs_t *lp = lp_of(r, e);
        json_array_append_new(tokens, text_json(pieces + e->piece_off, e->piece_len));
        json_array_append_new(lps, lp ? json_real(lp->logprob) : json_null());
        json_array_append_new(offs, json_integer((json_int_t) e->offset));
        if (lp == NULL) {
            json_array_append_new(tops, json_null());
            continue;
        }
        json_t *d = json_object();
        for (uint32_t k = 0; d && k < lp->n_top && k < r->api.top_logprobs; k++) {
            const char *s;
            size_t n;
            token_text(r, lp->top[k].token, &s, &n);
            kvs__sb_t key;
            kvs__sb_init(&key);
            kvs__utf8_sanitize(&key, s, n);
            /* Texts that collide keep the likelier. */
            const char *ks = key.ptr ? key.ptr : ""; /* a control token's text is empty */
            if (!key.oom && json_object_get(d, ks) == NULL)
                json_object_set_new(d, ks, json_real(lp->top[k].logprob));
            kvs__sb_fini(&key);
        }
        kvs__sb_t key;
        kvs__sb_init(&key);
        kvs__utf8_sanitize(&key, pieces + e->piece_off, e->piece_len);
        const char *ks = key.ptr ? key.ptr : "";
        if (d && !key.oom && json_object_get(d, ks) == NULL)
            json_object_set_new(d, ks, json_real(lp->logprob));
        kvs__sb_fini(&key);
        json_array_append_new(tops, d);
    }
    return json_pack("{s:o, s:o, s:o, s:o}", "tokens", tokens, "token_logprobs", lps,
                     "top_logprobs", tops, "text_offset", offs);
}

/* Choice number index; lp: its logprobs (stolen), NULL for null. */
static json_t *choice_json(const req_t *r, uint32_t index, json_t *content, const char *finish,
                           json_t *lp)
{
    json_t *fin = finish ? json_string(finish) : json_null();
    if (lp == NULL) lp = json_null();
    if (r->api.chat && r->api.stream)
        return json_pack("{s:i, s:o, s:o, s:o}", "index", (int) index, "delta", content, "logprobs",
                         lp, "finish_reason", fin);
    if (r->api.chat)
        return json_pack("{s:i, s:{s:s, s:o}, s:o, s:o}", "index", (int) index, "message", "role",
                         "assistant", "content", content, "logprobs", lp, "finish_reason", fin);
    return json_pack("{s:i, s:o, s:o, s:o}", "index", (int) index, "text", content, "logprobs", lp,
                     "finish_reason", fin);
}

/* text[0, len) as a JSON string of valid UTF-8. */
static json_t *text_json(const char *text, size_t len)
{
    kvs__sb_t sb;
    kvs__sb_init(&sb);
    kvs__utf8_sanitize(&sb, text, len);
    json_t *s = sb.oom ? NULL : json_stringn(sb.ptr ? sb.ptr : "", sb.len);
    kvs__sb_fini(&sb);
    return s;
}

static void sse_event_steal(req_t *r, json_t *obj)
{
    char *text = kvs__json_dump_steal(obj);
    if (text == NULL) {
        r->out.oom = 1;
        return;
    }
    kvs__sb_puts(&r->out, "data: ");
    kvs__sb_puts(&r->out, text);
    kvs__sb_puts(&r->out, "\n\n");
    kvs_free(text);
}

/* A chunk of choice index (one choice per chunk, as OpenAI streams n > 1). */
static void sse_chunk(req_t *r, uint32_t index, json_t *content, const char *finish, json_t *lp)
{
    json_t *obj = head_json(r, r->api.chat ? "chat.completion.chunk" : "text_completion");
    json_t *choices = json_array();
    json_t *choice = content ? choice_json(r, index, content, finish, lp) : NULL;
    if (choice == NULL) json_decref(lp);
    if (obj == NULL || choices == NULL || choice == NULL) {
        json_decref(obj);
        json_decref(choices);
        json_decref(choice);
        r->out.oom = 1;
        return;
    }
    json_array_append_new(choices, choice);
    json_object_set_new(obj, "choices", choices);
    sse_event_steal(r, obj);
}

static const char *failure_message(const req_t *r, char *buf, size_t cap)
{
    if (LOAD(r->shutdown)) return "the server is shutting down";
    /* An I/O error is the backend's end (its ranks died): its health says what became of it. */
    char why[200] = "";
    if (r->finish_status == KVS_ERR_IO && r->srv->backend.health_detail != NULL)
        r->srv->backend.health_detail(r->srv->backend.ctx, why, sizeof(why));
    snprintf(buf, cap, "generation failed: %s%s%s%s", kvs_status_str(r->finish_status),
             why[0] ? " (" : "", why, why[0] ? ")" : "");
    return buf;
}

/* The end of a stream. Finished: each choice's last chunk (its finish_reason one OpenAI defines),
 * the usage chunk, [DONE]. Failed (any choice): an error event and nothing after it (no
 * finish_reason chunk, no [DONE]: clients read [DONE] as success). */
static void sse_finish(req_t *r)
{
    r->stream_ended = 1;
    if (r->finish == KVS_SERVER_FINISH_ERROR) {
        char buf[256];
        char *err =
            kvs__json_error(failure_message(r, buf, sizeof(buf)), "server_error", NULL, NULL);
        if (err == NULL) {
            r->out.oom = 1; /* the stream is cut off: not a success either */
        } else {
            kvs__sb_printf(&r->out, "data: %s\n\n", err);
            kvs_free(err);
        }
        return;
    }
    for (uint32_t i = 0; i < r->n_ch; i++) {
        choice_t *c = &r->ch[i];
        json_t *content = r->api.chat ? json_object() : json_string("");
        json_t *lp = c->lps_sent < c->n_lps ? logprobs_json(r, c, c->lps_sent, c->n_lps) : NULL;
        c->lps_sent = c->n_lps;
        sse_chunk(r, i, content, kvs__finish_name(c->finish), lp);
    }
    if (r->api.include_usage) {
        json_t *obj = head_json(r, r->api.chat ? "chat.completion.chunk" : "text_completion");
        if (obj == NULL) {
            r->out.oom = 1;
        } else {
            json_object_set_new(obj, "choices", json_array());
            json_object_set_new(obj, "usage", usage_json(r));
            json_object_set_new(obj, "kvstage", kvstage_json(r));
            sse_event_steal(r, obj);
        }
    }
    kvs__sb_puts(&r->out, "data: [DONE]\n\n");
}

static enum MHD_Result send_final(req_t *r)
{
    /* The engine's "could never fit": its prompt (and the pages of its further choices, or the
     * sequence it grew to) needs more KV pages than this server's whole pool holds. */
    if (r->finish == KVS_SERVER_FINISH_ERROR && r->finish_status == KVS_ERR_NOSPACE &&
        !LOAD(r->shutdown))
        return send_error(r, 400,
                          "the request needs more KV cache than this server's whole pool holds: "
                          "lower n, max_tokens or the prompt (or start the server with a larger "
                          "--kv-tokens)",
                          NULL, NULL);
    if (r->finish == KVS_SERVER_FINISH_ERROR) {
        char buf[256];
        return send_error(r, LOAD(r->shutdown) ? 503 : 500, failure_message(r, buf, sizeof(buf)),
                          NULL, NULL);
    }
    json_t *obj = head_json(r, r->api.chat ? "chat.completion" : "text_completion");
    json_t *choices = json_array();
    int oom = obj == NULL || choices == NULL;
    for (uint32_t i = 0; i < r->n_ch && !oom; i++) {
        const choice_t *c = &r->ch[i];
        json_t *content = text_json(c->text.ptr ? c->text.ptr : "", c->text.len);
        json_t *lp = logprobs_json(r, c, 0, c->n_lps);
        json_t *choice =
            content ? choice_json(r, i, content, kvs__finish_name(c->finish), lp) : NULL;
        if (content == NULL) json_decref(lp);
        oom = choice == NULL || json_array_append_new(choices, choice) != 0;
    }
    if (oom) {
        json_decref(obj);
        json_decref(choices);
        return send_error(r, 500, "out of memory", NULL, NULL);
    }
    json_object_set_new(obj, "choices", choices);
    json_object_set_new(obj, "usage", usage_json(r));
    json_object_set_new(obj, "kvstage", kvstage_json(r));
    return send_json_steal(r, 200, obj);
}

/* ---- the sink (backend threads) ---- */

static void queue_push(tok_queue_t *q, uint32_t choice, uint32_t token, const char *piece,
                       size_t len, const kvs_logprobs_t *lp, int *oom)
{
    if (q->n == q->cap) {
        size_t cap = q->cap ? 2 * q->cap : 64;
        tok_rec_t *t = kvs_realloc(q->toks, cap * sizeof(*t));
        if (t == NULL) {
            *oom = 1;
            return;
        }
        q->toks = t;
        q->cap = cap;
    }
    tok_rec_t *rec = &q->toks[q->n++];
    rec->choice = choice;
    rec->token = token;
    rec->piece_off = q->pieces.len;
    rec->piece_len = SIZE_MAX;
    rec->has_lp = lp != NULL;
    if (lp != NULL) rec->lp = *lp;
    if (piece != NULL) {
        kvs__sb_append(&q->pieces, piece, len);
        if (q->pieces.oom) {
            *oom = 1;
            return;
        }
        rec->piece_len = len;
    }
}

static void sink_prompt(void *arg, uint32_t index, uint32_t token, const kvs_logprobs_t *lp)
{
    (void) token;
    req_t *r = arg;
    pthread_mutex_lock(&r->mu);
    if (r->prompt_lp != NULL && !r->backend_done && index > 0 && index < r->api.prompt_len) {
        r->prompt_lp[index] = *lp;
        r->prompt_has[index] = 1;
    }
    pthread_mutex_unlock(&r->mu);
}

static void sink_token(void *arg, uint32_t choice, uint32_t token, const char *piece,
                       size_t piece_len, const kvs_logprobs_t *lp)
{
    req_t *r = arg;
    kvs_server_t *srv = r->srv;
    uint64_t now = kvs_now_ns();
    pthread_mutex_lock(&r->mu);
    if (r->backend_done) { /* a backend bug; the request is over */
        pthread_mutex_unlock(&r->mu);
        return;
    }
    if (choice >= r->n_ch) { /* a backend bug */
        pthread_mutex_unlock(&r->mu);
        kvs_error("server: room %llu: a token of choice %u of %u", (unsigned long long) r->room,
                  choice, r->n_ch);
        return;
    }
    queue_push(&r->pend, choice, token, piece, piece_len, lp, &r->sink_oom);
    if (r->first_ns == 0) {
        r->first_ns = now;
        kvs__hist_observe(&srv->ttft, now - r->submit_ns);
    } else {
        kvs__hist_observe(&srv->itl, now - r->last_ns);
    }
    r->last_ns = now;
    /* A non-streaming request without stop strings only needs waking at the end. */
    int wake = r->suspended && (r->api.stream || r->api.n_stops > 0);
    if (wake) r->suspended = 0;
    struct MHD_Connection *conn = r->conn;
    pthread_mutex_unlock(&r->mu);
    if (wake) MHD_resume_connection(conn);
}

static void live_add(kvs_server_t *srv, req_t *r)
{
    r->next = srv->live;
    if (srv->live) srv->live->prev = r;
    srv->live = r;
    srv->n_live++;
}

static void live_remove(kvs_server_t *srv, req_t *r)
{
    pthread_mutex_lock(&srv->mu);
    if (r->prev) r->prev->next = r->next;
    if (r->next) r->next->prev = r->prev;
    if (srv->live == r) srv->live = r->next;
    r->prev = r->next = NULL;
    srv->n_live--;
    pthread_cond_broadcast(&srv->cv);
    pthread_mutex_unlock(&srv->mu);
}

static void sink_done(void *arg, const kvs_server_done_t *done)
{
    req_t *r = arg;
    pthread_mutex_lock(&r->mu);
    if (r->backend_done) {
        pthread_mutex_unlock(&r->mu);
        kvs_error("server: room %llu: the backend ended it twice", (unsigned long long) r->room);
        return;
    }
    r->backend_done = 1;
    r->done = *done;
    int wake = r->suspended;
    r->suspended = 0;
    struct MHD_Connection *conn = r->conn;
    pthread_mutex_unlock(&r->mu);
    /* Resume before leaving the live list: once the list is empty the server may stop its
     * daemon, and no connection may still be suspended then. */
    if (wake) MHD_resume_connection(conn);
    live_remove(r->srv, r);
    req_unref(r);
}

/* ---- the connection's side ---- */

static int is_stop_id(const req_t *r, uint32_t token)
{
    for (uint32_t i = 0; i < r->api.n_stop_ids; i++)
        if (r->api.stop_ids[i] == token) return 1;
    return 0;
}

/* Ends every choice at the backend. */
static void send_cancel(req_t *r)
{
    if (r->cancel_sent) return;
    r->cancel_sent = 1;
    COUNT(r->srv->cancels);
    kvs_server_backend_t *b = &r->srv->backend;
    b->cancel(b->ctx, r->room, KVS_SERVER_CHOICE_ALL);
}

/* Ends choice i at the backend (a stop string matched in it); with one choice, the request. */
static void send_cancel_choice(req_t *r, uint32_t i)
{
    if (r->n_ch == 1) {
        send_cancel(r);
        return;
    }
    choice_t *c = &r->ch[i];
    if (c->cancel_sent || r->cancel_sent) return;
    c->cancel_sent = 1;
    kvs_server_backend_t *b = &r->srv->backend;
    b->cancel(b->ctx, r->room, i);
}

static void account_finish(req_t *r)
{
    kvs_server_t *srv = r->srv;
    COUNT(srv->finishes[r->finish]);
    ADD(srv->prompt_tokens, r->api.prompt_len);
    ADD(srv->generation_tokens, generated_of(r));
    ADD(srv->cached_tokens, r->final_done.cached_tokens);
    ADD(srv->kv_bytes, r->final_done.kv_bytes);
    kvs__hist_observe(&srv->e2e, kvs_now_ns() - r->submit_ns);
    if (r->final_done.transfer_ns) kvs__hist_observe(&srv->transfer, r->final_done.transfer_ns);
}

/* Appends token t to choice c (decoded, its logprobs recorded) and cuts c at a stop string. */
static void take_token(req_t *r, choice_t *c, const tok_rec_t *t, size_t max_stop)
{
    kvs_server_t *srv = r->srv;
    c->generated++;
    if (is_stop_id(r, t->token)) return;
    const char *piece;
    size_t len;
    if (t->piece_len != SIZE_MAX) {
        piece = r->work.pieces.ptr + t->piece_off;
        len = t->piece_len;
    } else if (srv->tok.piece(srv->tok.ctx, t->token, &piece, &len) != KVS_OK) {
        piece = ""; /* logged by the tokenizer; the token renders as nothing */
        len = 0;
    }
    size_t old = c->text.len;
    kvs__sb_append(&c->text, piece, len);
    if (r->api.logprobs) lp_push(c, t->token, piece, len, 0, 0, t->has_lp ? &t->lp : NULL);
    if (r->api.n_stops == 0) return;
    size_t from = old + 1 > max_stop ? old + 1 - max_stop : 0;
    if (from < c->emitted) from = c->emitted;
    if (from < r->echo_len) from = r->echo_len; /* stops apply to the completion only */
    size_t at = kvs__stop_find(c->text.ptr, c->text.len, from, r->api.stops, r->api.stop_lens,
                               r->api.n_stops);
    if (at != SIZE_MAX) {
        c->text.len = at;
        c->text.ptr[at] = '\0';
        c->stop_matched = 1;
    }
}

/* Streaming: choice i's new text as chunks, up to what may still be cut by a stop string or
 * completes a character. */
static void stream_choice(req_t *r, uint32_t i)
{
    choice_t *c = &r->ch[i];
    size_t end = c->text.len;
    /* The echoed prompt goes out with its logprobs, which come before the first token. */
    if (r->api.echo && r->api.logprobs && c->generated == 0 && !r->finished) end = c->emitted;
    if (!r->finished && !c->stop_matched && end > c->emitted) {
        end -= kvs__stop_hold(c->text.ptr, end, c->emitted, r->api.stops, r->api.stop_lens,
                              r->api.n_stops);
        end -= kvs__utf8_incomplete_tail(c->text.ptr + c->emitted, end - c->emitted);
    }
    while (end > c->emitted) {
        /* The echoed prompt is a chunk of its own. */
        size_t upto = c->emitted < r->echo_len && end > r->echo_len ? r->echo_len : end;
        json_t *s = text_json(c->text.ptr + c->emitted, upto - c->emitted);
        json_t *content = s && r->api.chat ? json_pack("{s:o}", "content", s) : s;
        if (content == NULL) r->out.oom = 1;
        size_t k = c->lps_sent;
        while (k < c->n_lps && c->lps[k].end <= upto) k++;
        json_t *lp = k > c->lps_sent ? logprobs_json(r, c, c->lps_sent, k) : NULL;
        c->lps_sent = k;
        if (content) sse_chunk(r, i, content, NULL, lp);
        if (content == NULL) json_decref(lp);
        c->emitted = upto;
    }
}

/* Takes what the sink queued: decodes tokens, cuts each choice at stop strings, concludes the
 * request when the backend is done, and (streaming) turns the new text into SSE chunks. */
static void pump(req_t *r)
{
    tok_queue_t tmp;
    pthread_mutex_lock(&r->mu);
    tmp = r->pend;
    r->pend = r->work;
    r->work = tmp;
    int took_done = r->backend_done && !r->done_taken;
    if (took_done) {
        r->done_taken = 1;
        r->final_done = r->done;
    }
    int oom = r->sink_oom;
    pthread_mutex_unlock(&r->mu);

    size_t max_stop = 0;
    for (uint32_t k = 0; k < r->api.n_stops; k++)
        if (r->api.stop_lens[k] > max_stop) max_stop = r->api.stop_lens[k];
    for (size_t i = 0; i < r->work.n && !r->finished; i++) {
        const tok_rec_t *t = &r->work.toks[i];
        choice_t *c = &r->ch[t->choice];
        if (c->stop_matched) continue;
        take_token(r, c, t, max_stop);
        if (c->stop_matched && !r->done_taken) send_cancel_choice(r, t->choice);
    }
    r->work.n = 0;
    r->work.pieces.len = 0;
    for (uint32_t i = 0; i < r->n_ch; i++)
        if (r->ch[i].text.oom || r->ch[i].lp_oom) oom = 1;

    if (took_done && !r->finished) {
        r->finished = 1;
        const kvs_server_done_t *d = &r->final_done;
        /* A choice cut at a stop string stopped, whatever ended it at the backend; one that
         * failed fails the request. */
        int failed = 0;
        for (uint32_t i = 0; i < r->n_ch; i++) {
            choice_t *c = &r->ch[i];
            c->finish = c->stop_matched ? KVS_SERVER_FINISH_STOP : d->choice_finish[i];
            failed |= c->finish == KVS_SERVER_FINISH_ERROR;
        }
        r->finish = failed ? KVS_SERVER_FINISH_ERROR : r->ch[0].finish;
        r->finish_status = d->status;
        if (oom) {
            r->finish = KVS_SERVER_FINISH_ERROR;
            r->finish_status = KVS_ERR_NOMEM;
        } else if (LOAD(r->shutdown) && r->finish != KVS_SERVER_FINISH_ERROR) {
            /* Ended by the server's own cancel: any choice it stopped was cut short. */
            for (uint32_t i = 0; i < r->n_ch; i++) {
                if (r->ch[i].finish == KVS_SERVER_FINISH_STOP && !r->ch[i].stop_matched) {
                    r->finish = KVS_SERVER_FINISH_ERROR;
                    r->finish_status = KVS_ERR_ABORTED;
                }
            }
        }
        if (r->finish == KVS_SERVER_FINISH_ERROR && r->finish_status == KVS_OK)
            r->finish_status = KVS_ERR_IO;
        account_finish(r);
    }
    if (!r->api.stream) return;

    if (!r->stream_started) {
        r->stream_started = 1;
        for (uint32_t i = 0; r->api.chat && i < r->n_ch; i++) {
            json_t *delta = json_pack("{s:s, s:s}", "role", "assistant", "content", "");
            if (delta) sse_chunk(r, i, delta, NULL, NULL);
        }
    }
    for (uint32_t i = 0; i < r->n_ch; i++) stream_choice(r, i);
    if (r->finished && !r->stream_ended) sse_finish(r);
}

/* Something for pump() to do, or suspend: under r->mu, so a sink call cannot slip between the
 * check and the suspension. Returns 1 when suspended. */
static int suspend_if_idle(req_t *r)
{
    pthread_mutex_lock(&r->mu);
    int idle = r->pend.n == 0 && !(r->backend_done && !r->done_taken);
    if (idle) {
        r->suspended = 1;
        MHD_suspend_connection(r->conn);
    }
    pthread_mutex_unlock(&r->mu);
    return idle;
}

static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    (void) pos;
    req_t *r = cls;
    for (;;) {
        if (r->out.oom) return MHD_CONTENT_READER_END_WITH_ERROR;
        if (r->out.len > 0) {
            size_t n = r->out.len < max ? r->out.len : max;
            memcpy(buf, r->out.ptr, n);
            kvs__sb_consume(&r->out, n);
            return (ssize_t) n;
        }
        if (r->stream_ended) return MHD_CONTENT_READER_END_OF_STREAM;
        pump(r);
        if (r->out.len > 0 || r->stream_ended || r->out.oom) continue;
        if (suspend_if_idle(r)) return 0;
    }
}

static enum MHD_Result wait_final(req_t *r)
{
    for (;;) {
        pump(r);
        if (r->finished) return send_final(r);
        if (suspend_if_idle(r)) return MHD_YES;
    }
}

static enum MHD_Result answer_submit_error(req_t *r, kvs_status_t st)
{
    char msg[160];
    snprintf(msg, sizeof(msg), "the backend refused the request: %s", kvs_status_str(st));
    if (st == KVS_ERR_INVALID || st == KVS_ERR_UNSUPPORTED)
        return send_error(r, 400, msg, NULL, NULL);
    if (st == KVS_ERR_NOSPACE) return send_error(r, 503, "the server is overloaded", NULL, NULL);
    if (st == KVS_ERR_STATE) {
        char why[160] = "";
        if (r->srv->backend.health_detail != NULL)
            r->srv->backend.health_detail(r->srv->backend.ctx, why, sizeof(why));
        snprintf(msg, sizeof(msg), "the server is not ready%s%s", why[0] ? ": " : "", why);
        return send_error(r, 503, msg, NULL, NULL);
    }
    return send_error(r, 500, msg, NULL, NULL);
}

/* Under srv->mu. */
static int tomb_find(const kvs_server_t *srv, uint64_t room, uint64_t now)
{
    for (uint32_t i = 0; i < TOMBS; i++)
        if (srv->tombs[i].at_ns != 0 && srv->tombs[i].room == room &&
            now - srv->tombs[i].at_ns < TOMB_NS)
            return 1;
    return 0;
}

static const char *role_name(kvs_server_role_t role);

/* strict_role: why this server does not serve the request (written to msg), or NULL. */
static const char *role_refusal(const kvs_server_t *srv, const kvs__api_req_t *api, char *msg,
                                size_t cap)
{
    const char *mine = role_name(srv->role);
    if (srv->role == KVS_SERVER_ROLE_NONE && api->has_room) {
        snprintf(msg, cap,
                 "this is a colocated server: it serves whole requests, without \"kvstage\"");
        return "wrong_role";
    }
    if (srv->role != KVS_SERVER_ROLE_NONE && !api->has_room) {
        snprintf(msg, cap,
                 "this is a %s server: it serves the %s side of requests a router sends (with "
                 "\"kvstage\"); send this request to the router or to a colocated server",
                 mine, mine);
        return "wrong_role";
    }
    if (srv->role != KVS_SERVER_ROLE_NONE && api->role != srv->role) {
        snprintf(msg, cap, "this is a %s server; the request is for a %s server", mine,
                 role_name(api->role));
        return "wrong_role";
    }
    if (srv->role == KVS_SERVER_ROLE_DECODE && srv->bootstrap != NULL && api->bootstrap != NULL &&
        strcmp(srv->bootstrap, api->bootstrap) != 0) {
        snprintf(msg, cap,
                 "this decode server is bound to the prefill instance at %s; the request's KV "
                 "would come from %s",
                 srv->bootstrap, api->bootstrap);
        return "wrong_bootstrap";
    }
    return NULL;
}

/* echo: the prompt's text starts every choice's answer; with logprobs its tokens are the first
 * records (their logprobs, one set for all choices, come from the sink). */
static kvs_status_t echo_prompt(req_t *r)
{
    if (r->api.logprobs) {
        r->prompt_lp = kvs_malloc((size_t) r->api.prompt_len * sizeof(kvs_logprobs_t));
        r->prompt_has = kvs_calloc(r->api.prompt_len, 1);
        if (r->prompt_lp == NULL || r->prompt_has == NULL) return KVS_ERR_NOMEM;
    }
    for (uint32_t c = 0; c < r->n_ch; c++) {
        choice_t *ch = &r->ch[c];
        for (uint32_t i = 0; i < r->api.prompt_len; i++) {
            const char *piece;
            size_t len;
            token_text(r, r->api.prompt[i], &piece, &len);
            kvs__sb_append(&ch->text, piece, len);
            if (r->api.logprobs) lp_push(ch, r->api.prompt[i], piece, len, 1, i, NULL);
        }
        r->echo_len = ch->text.len;
        if (ch->text.oom || ch->lp_oom) return KVS_ERR_NOMEM;
    }
    return KVS_OK;
}

static enum MHD_Result handle_generate(req_t *r)
{
    kvs_server_t *srv = r->srv;
    kvs__api_err_t err;
    kvs_status_t st = kvs__api_parse(&srv->limits, &srv->tok, r->ep == EP_CHAT, r->body.data,
                                     r->body.len, &r->api, &err);
    if (st != KVS_OK) return send_error(r, (unsigned) err.status, err.message, err.param, err.code);
    if (r->api.ignored.n > 0)
        kvs_warn("server: %s %s: ignored %u unknown field%s: %s", r->method, r->path,
                 r->api.ignored.n, r->api.ignored.n == 1 ? "" : "s", r->api.ignored.names);
    if (srv->strict_role) {
        char msg[384];
        const char *code = role_refusal(srv, &r->api, msg, sizeof(msg));
        if (code != NULL) return send_error(r, 400, msg, "kvstage", code);
    }
    if (srv->role == KVS_SERVER_ROLE_DECODE && srv->bootstrap == NULL && srv->backend.peer &&
        r->api.role == KVS_SERVER_ROLE_DECODE) {
        /* Per-room bootstrap: the room's prefill instance is checked (and wired on first use)
         * before anything is answered, so that a refusal is a status, not a cut stream. */
        char why[320], msg[400];
        if (r->api.bootstrap == NULL)
            return send_error(r, 400,
                              "this decode server takes rooms from any prefill instance: "
                              "'kvstage.bootstrap' must name the room's (its registry endpoint)",
                              "kvstage.bootstrap", "missing_bootstrap");
        st = srv->backend.peer(srv->backend.ctx, r->api.bootstrap, why, sizeof(why));
        if (st == KVS_ERR_INCOMPATIBLE || st == KVS_ERR_INVALID) {
            snprintf(msg, sizeof(msg),
                     "the prefill instance at %s cannot feed this decode "
                     "server: %s",
                     r->api.bootstrap, why);
            return send_error(r, 400, msg, "kvstage.bootstrap", "incompatible_prefill");
        }
        if (st != KVS_OK) {
            snprintf(msg, sizeof(msg), "the prefill instance at %s is unreachable: %s",
                     r->api.bootstrap, why);
            return send_error(r, 503, msg, "kvstage.bootstrap", "prefill_unreachable");
        }
    }
    if (r->api.role == KVS_SERVER_ROLE_PREFILL) {
        /* The prefill side only hands the KV and the first token over: stop strings are the
         * decode side's to apply (cutting here would abort the room under the decode side). */
        r->api.stream = 0;
        r->api.include_usage = 0;
        for (uint32_t i = 0; i < r->api.n_stops; i++) kvs_free(r->api.stops[i]);
        r->api.n_stops = 0;
        r->api.n = 1; /* the decode side samples the choices from the one prompt */
    }
    r->n_ch = r->api.n;
    r->ch = kvs_calloc(r->n_ch, sizeof(*r->ch));
    if (r->ch == NULL) {
        r->n_ch = 0;
        return send_error(r, 500, "out of memory", NULL, NULL);
    }
    r->room =
        r->api.has_room ? r->api.room : __atomic_fetch_add(&srv->next_room, 1, __ATOMIC_RELAXED);
    r->created = time(NULL);
    snprintf(r->id, sizeof(r->id), "%s-%016llx", r->api.chat ? "chatcmpl" : "cmpl",
             (unsigned long long) r->room);

    kvs_server_request_t q;
    memset(&q, 0, sizeof(q));
    q.room = r->room;
    q.role = r->api.role;
    q.bootstrap = r->api.bootstrap;
    q.prompt = r->api.prompt;
    q.prompt_len = r->api.prompt_len;
    q.max_tokens = r->api.max_tokens;
    q.sampling = r->api.sampling;
    q.seed = r->api.seed;
    q.stop_ids = r->api.stop_ids;
    q.n_stop_ids = r->api.n_stop_ids;
    q.stream = r->api.stream;
    q.logprobs = r->api.logprobs;
    q.top_logprobs = r->api.top_logprobs;
    q.n = r->n_ch;
    /* A decode side has no logits of the prompt: the router takes them from the prefill side. */
    q.prompt_logprobs = r->api.echo && r->api.logprobs && r->api.role != KVS_SERVER_ROLE_DECODE;
    if (r->api.echo && echo_prompt(r) != KVS_OK)
        return send_error(r, 500, "out of memory echoing the prompt", NULL, NULL);
    kvs_server_sink_t sink = {sink_token, sink_done, r, sink_prompt};

    /* Live (and the backend's reference taken) before submit: on_done may come before submit
     * returns. */
    pthread_mutex_lock(&srv->mu);
    if (srv->stopping) {
        pthread_mutex_unlock(&srv->mu);
        return send_error(r, 503, "the server is shutting down", NULL, NULL);
    }
    if (r->api.has_room && tomb_find(srv, r->room, kvs_now_ns())) {
        pthread_mutex_unlock(&srv->mu);
        char msg[96];
        snprintf(msg, sizeof(msg), "room %llu was cancelled before it arrived",
                 (unsigned long long) r->room);
        return send_error(r, 409, msg, "kvstage.room", "cancelled");
    }
    live_add(srv, r);
    pthread_mutex_unlock(&srv->mu);
    pthread_mutex_lock(&r->mu);
    r->refs++;
    pthread_mutex_unlock(&r->mu);
    r->submit_ns = kvs_now_ns();

    st = srv->backend.submit(srv->backend.ctx, &q, &sink);
    if (st != KVS_OK) {
        live_remove(srv, r);
        pthread_mutex_lock(&r->mu);
        r->refs--;
        pthread_mutex_unlock(&r->mu);
        return answer_submit_error(r, st);
    }
    r->submitted = 1;
    /* A cancel that found the request live before the backend knew its room. */
    pthread_mutex_lock(&srv->mu);
    int cancelled = r->remote_cancel;
    pthread_mutex_unlock(&srv->mu);
    if (cancelled) srv->backend.cancel(srv->backend.ctx, r->room, KVS_SERVER_CHOICE_ALL);
    if (!r->api.stream) return wait_final(r);

    struct MHD_Response *resp =
        MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, stream_read, r, NULL);
    if (resp == NULL) return MHD_NO; /* closing the connection cancels the request */
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    const char *h[3];
    kvs__http_add_headers(resp, answer_headers(r, h));
    COUNT(srv->http_codes[200]);
    enum MHD_Result res = MHD_queue_response(r->conn, 200, resp);
    MHD_destroy_response(resp);
    return res;
}

static enum MHD_Result handle_match(req_t *r)
{
    kvs_server_t *srv = r->srv;
    /* The router sends the client's body as is: a chat request names its messages. */
    json_t *peek = json_loadb(r->body.data ? r->body.data : "", r->body.len, 0, NULL);
    int chat = json_is_object(peek) && json_object_get(peek, "messages") != NULL;
    json_decref(peek);
    kvs__api_req_t api;
    kvs__api_err_t err;
    kvs_status_t st =
        kvs__api_parse(&srv->limits, &srv->tok, chat, r->body.data, r->body.len, &api, &err);
    if (st != KVS_OK) return send_error(r, (unsigned) err.status, err.message, err.param, err.code);
    uint32_t cached = 0;
    if (srv->backend.match) {
        st = srv->backend.match(srv->backend.ctx, api.prompt, api.prompt_len, &cached);
        if (st != KVS_OK) cached = 0;
    }
    if (cached > api.prompt_len) cached = api.prompt_len;
    json_t *obj = json_pack("{s:i, s:i}", "cached_tokens", (int) cached, "prompt_tokens",
                            (int) api.prompt_len);
    kvs__api_req_fini(&api);
    return send_json_steal(r, 200, obj);
}

/* POST /internal/cancel {"room": N}: the router gave up on room N (the other side refused or
 * failed it, or the client left). Its live request here ends now, through the backend (a
 * prefill room is aborted through kvstage, its pages and slot released as the protocol
 * says); a request for it that has not arrived yet is refused when it does. */
static enum MHD_Result handle_cancel(req_t *r)
{
    kvs_server_t *srv = r->srv;
    json_t *root = json_loadb(r->body.data ? r->body.data : "", r->body.len, 0, NULL);
    json_t *v = json_object_get(root, "room");
    json_int_t room = json_is_integer(v) ? json_integer_value(v) : -1;
    json_decref(root);
    if (room < 0 || (uint64_t) room >= (UINT64_C(1) << 62))
        return send_error(r, 400, "the body must be {\"room\": N} with N in [0, 2^62)", "room",
                          NULL);
    uint64_t rooms[8];
    uint32_t n = 0, found = 0;
    pthread_mutex_lock(&srv->mu);
    for (req_t *q = srv->live; q; q = q->next) {
        if (!q->api.has_room || q->room != (uint64_t) room) continue;
        q->remote_cancel = 1;
        if (n < 8) rooms[n++] = q->room;
        found++;
    }
    if (found == 0) {
        srv->tombs[srv->next_tomb] = (tomb_t){(uint64_t) room, kvs_now_ns()};
        srv->next_tomb = (srv->next_tomb + 1) % TOMBS;
    }
    pthread_mutex_unlock(&srv->mu);
    for (uint32_t i = 0; i < n; i++) {
        COUNT(srv->cancels);
        srv->backend.cancel(srv->backend.ctx, rooms[i], KVS_SERVER_CHOICE_ALL);
    }
    kvs_debug("server: room %lld cancelled by the router (%u live)", (long long) room, found);
    return send_json_steal(r, 200, json_pack("{s:I, s:i}", "room", room, "cancelled", (int) found));
}

/* POST /tokenize and /detokenize, as vLLM answers them. */
static enum MHD_Result handle_tokenize(req_t *r)
{
    kvs_server_t *srv = r->srv;
    kvs__api_err_t err;
    const char *body = r->body.data ? r->body.data : "";
    if (r->ep == EP_DETOKENIZE) {
        char *text = NULL;
        if (kvs__api_detokenize(&srv->limits, &srv->tok, body, r->body.len, &text, &err) != KVS_OK)
            return send_error(r, (unsigned) err.status, err.message, err.param, err.code);
        json_t *obj = json_pack("{s:s}", "prompt", text);
        kvs_free(text);
        return send_json_steal(r, 200, obj);
    }
    uint32_t *ids = NULL, n = 0;
    if (kvs__api_tokenize(&srv->limits, &srv->tok, body, r->body.len, &ids, &n, &err) != KVS_OK)
        return send_error(r, (unsigned) err.status, err.message, err.param, err.code);
    json_t *arr = json_array();
    for (uint32_t i = 0; arr && i < n; i++) json_array_append_new(arr, json_integer(ids[i]));
    kvs_free(ids);
    return send_json_steal(r, 200,
                           json_pack("{s:o, s:i, s:i}", "tokens", arr, "count", (int) n,
                                     "max_model_len", (int) srv->limits.max_context));
}

static int server_healthy(kvs_server_t *srv)
{
    pthread_mutex_lock(&srv->mu);
    int stopping = srv->stopping;
    pthread_mutex_unlock(&srv->mu);
    if (stopping) return 0;
    return srv->backend.health == NULL || srv->backend.health(srv->backend.ctx) == KVS_OK;
}

static const char *role_name(kvs_server_role_t role)
{
    switch (role) {
    case KVS_SERVER_ROLE_PREFILL:
        return "prefill";
    case KVS_SERVER_ROLE_DECODE:
        return "decode";
    case KVS_SERVER_ROLE_NONE:
        break;
    }
    return "colocated";
}

/* GET /internal/info: what the router pairs by (bootstrap) and chooses by (load: the gauges of
 * /metrics it weighs, read now). */
static json_t *info_json(kvs_server_t *srv)
{
    kvs_server_backend_stats_t bs;
    memset(&bs, 0, sizeof(bs));
    if (srv->backend.stats) srv->backend.stats(srv->backend.ctx, &bs);
    pthread_mutex_lock(&srv->mu);
    uint32_t live = srv->n_live;
    pthread_mutex_unlock(&srv->mu);
    return json_pack("{s:s, s:s, s:s?, s:{s:I, s:I, s:I, s:I, s:I}}", "model", srv->model, "role",
                     role_name(srv->role), "bootstrap", srv->bootstrap, "load", "requests_live",
                     (json_int_t) live, "requests_running", (json_int_t) bs.running,
                     "requests_queued", (json_int_t) bs.queued, "kv_pages_total",
                     (json_int_t) bs.pages_total, "kv_pages_free", (json_int_t) bs.pages_free);
}

static json_t *model_json(const kvs_server_t *srv)
{
    return json_pack("{s:s, s:s, s:I, s:s}", "id", srv->model, "object", "model", "created",
                     (json_int_t) srv->started, "owned_by", "kvstage");
}

static enum MHD_Result handle(req_t *r)
{
    kvs_server_t *srv = r->srv;
    if (!r->authorized && r->ep != EP_HEALTH && r->ep != EP_METRICS)
        return send_error(r, 401,
                          kvs__http_has_credentials(r->conn)
                              ? "incorrect API key provided"
                              : "missing API key: send the header 'Authorization: Bearer KEY'",
                          NULL, "invalid_api_key");
    if (r->ep == EP_UNKNOWN) {
        char msg[128];
        snprintf(msg, sizeof(msg), "unknown path: %s %s", r->method, r->path);
        return send_error(r, 404, msg, NULL, "not_found");
    }
    if (!r->method_ok) {
        char msg[128];
        snprintf(msg, sizeof(msg), "method %s is not allowed on %s (use %s)", r->method, r->path,
                 allowed_method(r->ep));
        return send_error(r, 405, msg, NULL, "method_not_allowed");
    }
    if (r->body.too_large) {
        char msg[128];
        snprintf(msg, sizeof(msg), "the request body is larger than %zu bytes", srv->max_body);
        return send_error(r, 413, msg, NULL, "body_too_large");
    }
    if (r->body_oom) return send_error(r, 500, "out of memory reading the request", NULL, NULL);
    switch (r->ep) {
    case EP_COMPLETIONS:
    case EP_CHAT:
        return handle_generate(r);
    case EP_MATCH:
        return handle_match(r);
    case EP_CANCEL:
        return handle_cancel(r);
    case EP_TOKENIZE:
    case EP_DETOKENIZE:
        return handle_tokenize(r);
    case EP_HEALTH: {
        if (server_healthy(srv))
            return send_text(r, 200, "application/json", "{\"status\":\"ok\"}");
        char why[256] = "";
        if (srv->backend.health_detail)
            srv->backend.health_detail(srv->backend.ctx, why, sizeof(why));
        return send_json_steal(r, 503,
                               json_pack("{s:s, s:s}", "status", "unavailable", "reason",
                                         why[0] ? why : "the server is stopping or not ready"));
    }
    case EP_METRICS: {
        char *text = NULL;
        if (kvs_server_metrics(srv, &text) != KVS_OK)
            return send_error(r, 500, "out of memory", NULL, NULL);
        enum MHD_Result res = send_text(r, 200, "text/plain; version=0.0.4", text);
        kvs_free(text);
        return res;
    }
    case EP_MODELS:
        return send_json_steal(
            r, 200, json_pack("{s:s, s:[o]}", "object", "list", "data", model_json(srv)));
    case EP_MODEL: {
        if (r->model_ok) return send_json_steal(r, 200, model_json(srv));
        char msg[160];
        snprintf(msg, sizeof(msg), "the model '%s' does not exist", r->path + strlen(MODEL_PREFIX));
        return send_error(r, 404, msg, "model", "model_not_found");
    }
    case EP_INFO:
        return send_json_steal(r, 200, info_json(srv));
    case EP_UNKNOWN:
        break;
    }
    return send_error(r, 404, "unknown path", NULL, "not_found");
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
                                  const char *method, const char *version, const char *upload_data,
                                  size_t *upload_size, void **con_cls)
{
    (void) version;
    kvs_server_t *srv = cls;
    req_t *r = *con_cls;
    if (r == NULL) {
        r = req_new(srv, conn, url, method);
        if (r == NULL) return MHD_NO;
        *con_cls = r;
        /* Declared too large: answered before the body is read (the connection closes after). */
        if (kvs__http_body_exceeds(conn, srv->max_body)) {
            r->body.too_large = 1;
            return handle(r);
        }
        return MHD_YES;
    }
    if (*upload_size != 0) {
        /* Bodies of requests that will be refused are read and dropped, so the answer is not
         * lost to a reset connection. */
        if (r->ep != EP_UNKNOWN && r->method_ok && r->authorized && !r->body_oom &&
            kvs__body_add(&r->body, upload_data, *upload_size) != KVS_OK)
            r->body_oom = 1;
        *upload_size = 0;
        return MHD_YES;
    }
    if (r->submitted) return wait_final(r); /* resumed */
    return handle(r);
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode toe)
{
    (void) cls;
    (void) conn;
    req_t *r = *con_cls;
    if (r == NULL) return;
    *con_cls = NULL;
    if (r->submitted) {
        pthread_mutex_lock(&r->mu);
        r->conn = NULL;
        r->suspended = 0;
        int live = !r->backend_done;
        pthread_mutex_unlock(&r->mu);
        if (live) {
            kvs_debug("server: room %llu: connection ended (%d) before the request; cancelling",
                      (unsigned long long) r->room, (int) toe);
            send_cancel(r);
        }
    }
    req_unref(r);
}

/* ---- the poke thread ---- */

static void *poke_main(void *arg)
{
    kvs_server_t *srv = arg;
    uint64_t rooms[64];
    pthread_mutex_lock(&srv->mu);
    while (!srv->poke_stop) {
        struct timespec t;
        clock_gettime(CLOCK_MONOTONIC, &t);
        t.tv_nsec += (long) POKE_NS;
        t.tv_sec += t.tv_nsec / 1000000000L;
        t.tv_nsec %= 1000000000L;
        while (!srv->poke_stop && pthread_cond_timedwait(&srv->cv, &srv->mu, &t) == 0) {
        }
        if (srv->poke_stop) break;
        /* A suspended connection cannot complete, so its socket is still this request's. */
        uint32_t n = 0;
        for (req_t *r = srv->live; r && n < 64; r = r->next) {
            if (r->remote_cancel) continue;
            pthread_mutex_lock(&r->mu);
            int gone =
                r->suspended && !r->api.stream && r->conn != NULL && kvs__http_client_left(r->conn);
            pthread_mutex_unlock(&r->mu);
            if (gone) {
                r->remote_cancel = 1;
                rooms[n++] = r->room;
            }
        }
        pthread_mutex_unlock(&srv->mu);
        for (uint32_t i = 0; i < n; i++) {
            kvs_debug("server: room %llu: its client hung up while waiting; cancelling",
                      (unsigned long long) rooms[i]);
            COUNT(srv->cancels);
            srv->backend.cancel(srv->backend.ctx, rooms[i], KVS_SERVER_CHOICE_ALL);
        }
        pthread_mutex_lock(&srv->mu);
    }
    pthread_mutex_unlock(&srv->mu);
    return NULL;
}

static void poke_stop(kvs_server_t *srv)
{
    if (!srv->poke_started) return;
    pthread_mutex_lock(&srv->mu);
    srv->poke_stop = 1;
    pthread_cond_broadcast(&srv->cv);
    pthread_mutex_unlock(&srv->mu);
    pthread_join(srv->poke_thread, NULL);
    srv->poke_started = 0;
}

/* ---- metrics ---- */

static void counter(kvs__sb_t *sb, const char *name, const char *help, uint64_t v)
{
    kvs__metric_header(sb, name, "counter", help);
    kvs__sb_printf(sb, "%s %llu\n", name, (unsigned long long) v);
}

static void gauge(kvs__sb_t *sb, const char *name, const char *help, uint64_t v)
{
    kvs__metric_header(sb, name, "gauge", help);
    kvs__sb_printf(sb, "%s %llu\n", name, (unsigned long long) v);
}

kvs_status_t kvs_server_metrics(kvs_server_t *srv, char **text_p)
{
    kvs_server_backend_stats_t bs;
    memset(&bs, 0, sizeof(bs));
    if (srv->backend.stats) srv->backend.stats(srv->backend.ctx, &bs);
    pthread_mutex_lock(&srv->mu);
    uint32_t live = srv->n_live;
    pthread_mutex_unlock(&srv->mu);

    kvs__sb_t sb;
    kvs__sb_init(&sb);
    kvs__metric_header(&sb, "kvstage_http_requests_total", "counter",
                       "HTTP requests answered, by status code.");
    for (unsigned c = 100; c < 600; c++) {
        uint64_t v = LOAD(srv->http_codes[c]);
        if (v || c == 200)
            kvs__sb_printf(&sb, "kvstage_http_requests_total{code=\"%u\"} %llu\n", c,
                           (unsigned long long) v);
    }
    kvs__metric_header(&sb, "kvstage_requests_finished_total", "counter",
                       "Generation requests finished, by finish reason.");
    for (int f = 0; f < 4; f++)
        kvs__sb_printf(&sb, "kvstage_requests_finished_total{reason=\"%s\"} %llu\n",
                       kvs__finish_name((kvs_server_finish_t) f),
                       (unsigned long long) LOAD(srv->finishes[f]));
    counter(&sb, "kvstage_requests_cancelled_total",
            "Requests cancelled at the backend (client gone, stop string, shutdown).",
            LOAD(srv->cancels));
    counter(&sb, "kvstage_prompt_tokens_total", "Prompt tokens of finished requests.",
            LOAD(srv->prompt_tokens));
    counter(&sb, "kvstage_generation_tokens_total", "Tokens generated.",
            LOAD(srv->generation_tokens));
    counter(&sb, "kvstage_cached_prompt_tokens_total", "Prompt tokens found in the prefix cache.",
            LOAD(srv->cached_tokens));
    kvs__hist_render(&sb, "kvstage_time_to_first_token_seconds", "Submission to the first token.",
                     &srv->ttft);
    kvs__hist_render(&sb, "kvstage_inter_token_latency_seconds", "Time between tokens.", &srv->itl);
    kvs__hist_render(&sb, "kvstage_request_duration_seconds", "Submission to the end.", &srv->e2e);
    kvs__hist_render(&sb, "kvstage_kv_transfer_seconds", "KV transfer time per room.",
                     &srv->transfer);
    /* The backend's transfer counters, in their Prometheus order. */
    uint32_t nf;
    const kvs_pd_metric_field_t *f = kvs_pd_metrics_fields(&nf);
    for (uint32_t at = 1; at <= nf; at++) {
        for (uint32_t i = 0; i < nf; i++) {
            if (f[i].prom == NULL || f[i].prom_at != at) continue;
            (f[i].kind == KVS_PD_COUNTER ? counter : gauge)(&sb, f[i].prom, f[i].help,
                                                            kvs_pd_metrics_get(&bs.metrics, &f[i]));
        }
    }
    gauge(&sb, "kvstage_requests_queued", "Requests waiting for admission (backend).", bs.queued);
    gauge(&sb, "kvstage_requests_running", "Requests admitted (backend).", bs.running);
    gauge(&sb, "kvstage_kv_pages_total", "KV pool pages (backend, one rank's pool).",
          bs.pages_total);
    gauge(&sb, "kvstage_kv_pages_free", "KV pool pages free now.", bs.pages_free);
    gauge(&sb, "kvstage_kv_pages_used", "KV pool pages held by requests or the prefix cache.",
          bs.pages_total - (bs.pages_free < bs.pages_total ? bs.pages_free : bs.pages_total));
    gauge(&sb, "kvstage_requests_live", "Requests submitted and not finished.", live);
    counter(&sb, "kvstage_instance_restarts_total",
            "The instance's ranks restarted after a rank died (serve --restart-ranks).",
            bs.restarts);
    counter(&sb, "kvstage_preemptions_total",
            "Running requests sent back to the queue for want of KV pages, recomputed later.",
            bs.preemptions);
    char *text = kvs__sb_take(&sb);
    if (text == NULL) {
        kvs_error("server: no memory for the metrics text");
        return KVS_ERR_NOMEM;
    }
    *text_p = text;
    return KVS_OK;
}

/* ---- lifetime ---- */

static kvs_status_t check_config(const kvs_server_config_t *c)
{
    if (c == NULL || c->backend.submit == NULL || c->backend.cancel == NULL) {
        kvs_error("server: the backend needs submit and cancel");
        return KVS_ERR_INVALID;
    }
    if (c->tokenizer.encode == NULL || c->tokenizer.piece == NULL || c->tokenizer.chat == NULL ||
        c->tokenizer.vocab_size == 0) {
        kvs_error("server: the tokenizer needs encode, piece, chat and a vocabulary size");
        return KVS_ERR_INVALID;
    }
    if (c->max_context == 1) {
        kvs_error("server: max_context 1 leaves no room for a prompt and a token");
        return KVS_ERR_INVALID;
    }
    return kvs__http_key_check(c->api_key);
}

kvs_status_t kvs_server_create(const kvs_server_config_t *config, kvs_server_t **server_p)
{
    kvs_status_t st = check_config(config);
    if (st != KVS_OK) return st;
    kvs__json_init();
    kvs_server_t *srv = kvs_calloc(1, sizeof(*srv));
    if (srv == NULL) return KVS_ERR_NOMEM;
    srv->model = kvs_strdup(config->model ? config->model : "kvstage");
    srv->bootstrap = config->bootstrap ? kvs_strdup(config->bootstrap) : NULL;
    srv->api_key = config->api_key ? kvs_strdup(config->api_key) : NULL;
    if (srv->model == NULL || (config->bootstrap && srv->bootstrap == NULL) ||
        (config->api_key && srv->api_key == NULL)) {
        st = KVS_ERR_NOMEM;
        goto free_strings;
    }
    srv->role = config->role;
    srv->strict_role = config->strict_role;
    srv->max_body = config->max_body ? config->max_body : (size_t) 1 << 20;
    srv->limits.max_context = config->max_context ? config->max_context : 4096;
    srv->limits.default_max_tokens = config->default_max_tokens;
    srv->limits.model = srv->model;
    srv->limits.strict = config->strict;
    srv->backend = config->backend;
    srv->tok = config->tokenizer;
    srv->started = time(NULL);
    srv->next_room = config->first_room
                         ? config->first_room
                         : (UINT64_C(1) << 62) | ((kvs_now_ns() & 0xffffffffu) << 24);
    kvs__hist_init(&srv->ttft, k_ttft_bounds, sizeof(k_ttft_bounds) / sizeof(double));
    kvs__hist_init(&srv->itl, k_itl_bounds, sizeof(k_itl_bounds) / sizeof(double));
    kvs__hist_init(&srv->e2e, k_e2e_bounds, sizeof(k_e2e_bounds) / sizeof(double));
    kvs__hist_init(&srv->transfer, kvs__transfer_bounds, KVS__TRANSFER_BOUNDS);
    pthread_mutex_init(&srv->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&srv->cv, &ca);
    pthread_condattr_destroy(&ca);
    kvs__http_opts_t ho = {.host = config->host,
                           .port = config->port,
                           .threads = config->threads,
                           .max_connections = config->max_connections,
                           .idle_timeout_s = config->idle_timeout_s,
                           .fds_per_connection = 1,
                           .handler = on_request,
                           .handler_cls = srv,
                           .completed = on_completed,
                           .completed_cls = srv,
                           .quiesce = 1}; /* kvs_server_destroy */
    st = kvs__http_start(&ho, &srv->daemon, &srv->port);
    if (st != KVS_OK) goto free_sync;
    if (pthread_create(&srv->poke_thread, NULL, poke_main, srv) != 0) {
        kvs_error("server: cannot start its poke thread");
        MHD_stop_daemon(srv->daemon);
        st = KVS_ERR_NOMEM;
        goto free_sync;
    }
    srv->poke_started = 1;
    kvs_info("server: serving %s on port %u", srv->model, (unsigned) srv->port);
    *server_p = srv;
    return KVS_OK;

free_sync:
    pthread_cond_destroy(&srv->cv);
    pthread_mutex_destroy(&srv->mu);
free_strings:
    kvs_free(srv->api_key);
    kvs_free(srv->bootstrap);
    kvs_free(srv->model);
    kvs_free(srv);
    return st;
}

uint16_t kvs_server_port(const kvs_server_t *server)
{
    return server->port;
}

void kvs_server_destroy(kvs_server_t *srv)
{
    if (srv == NULL) return;
    /* Stop accepting connections (the port closes, so routers see the server gone), stop
     * taking requests and collect the live rooms; cancel them outside the lock, since a backend
     * may end a request from inside cancel. */
    MHD_socket listen_fd = MHD_quiesce_daemon(srv->daemon);
    pthread_mutex_lock(&srv->mu);
    srv->stopping = 1;
    uint32_t n = srv->n_live;
    uint64_t *rooms = kvs_calloc(n ? n : 1, sizeof(uint64_t));
    uint32_t k = 0;
    for (req_t *r = srv->live; r && rooms; r = r->next) {
        __atomic_store_n(&r->shutdown, 1, __ATOMIC_RELAXED);
        rooms[k++] = r->room;
    }
    pthread_mutex_unlock(&srv->mu);
    for (uint32_t i = 0; i < k; i++)
        srv->backend.cancel(srv->backend.ctx, rooms[i], KVS_SERVER_CHOICE_ALL);
    kvs_free(rooms);

    struct timespec deadline;
    clock_gettime(CLOCK_MONOTONIC, &deadline);
    deadline.tv_sec += 10;
    pthread_mutex_lock(&srv->mu);
    while (srv->n_live > 0) {
        if (pthread_cond_timedwait(&srv->cv, &srv->mu, &deadline) != 0) break;
    }
    uint32_t left = srv->n_live;
    /* Let the answers of the requests just ended reach their clients (a client that does not
     * read is cut off at the deadline). */
    clock_gettime(CLOCK_MONOTONIC, &deadline);
    deadline.tv_sec += 2;
    while (left == 0 && srv->n_reqs > 0) {
        if (pthread_cond_timedwait(&srv->cv, &srv->mu, &deadline) != 0) break;
    }
    pthread_mutex_unlock(&srv->mu);
    if (left > 0) {
        /* The backend still holds these requests and will call their sinks, which refer to the
         * server: it cannot be freed, and their connections stay suspended, so the daemon
         * cannot be stopped either. */
        kvs_error("server: %u requests never ended at the backend; leaving the server running "
                  "without accepting requests",
                  left);
        return;
    }
    poke_stop(srv);
    MHD_stop_daemon(srv->daemon);
    if (listen_fd != MHD_INVALID_SOCKET) close(listen_fd);
    pthread_cond_destroy(&srv->cv);
    pthread_mutex_destroy(&srv->mu);
    kvs_free(srv->api_key);
    kvs_free(srv->bootstrap);
    kvs_free(srv->model);
    kvs_free(srv);
}
