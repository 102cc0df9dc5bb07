/* The rank 0 line protocol's codecs (engine/rank_line.h): the request lines as space-separated
 * fields, the event lines as flat JSON objects, each read and written here only. */
#include "engine/rank_line.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *kvs_rank_line_role_str(kvs_llm_role_t role)
{
    return role == KVS_LLM_PREFILL ? "prefill" : role == KVS_LLM_DECODE ? "decode" : "colocated";
}

static const char *const finish_names[] = {"length", "eos", "stop", "handoff", "error"};
#define N_FINISH (sizeof(finish_names) / sizeof(finish_names[0]))

const char *kvs_rank_line_finish_str(kvs_llm_finish_t f)
{
    return (unsigned) f < N_FINISH ? finish_names[f] : "unknown";
}

/* ---- writing ---- */

typedef struct {
    char *buf;
    size_t cap, len;
    int over; /* something did not fit */
} out_t;

static void put(out_t *o, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(out_t *o, const char *fmt, ...)
{
    if (o->over) return;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(o->buf + o->len, o->cap - o->len, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t) n >= o->cap - o->len) {
        o->over = 1;
        return;
    }
    o->len += (size_t) n;
}

/* A JSON string's contents: the lines are JSON, whatever a message holds. */
static void put_escaped(out_t *o, const char *s)
{
    for (; *s != '\0' && !o->over; s++) {
        unsigned char c = (unsigned char) *s;
        if (c == '"' || c == '\\')
            put(o, "\\%c", c);
        else if (c < 0x20)
            put(o, "\\u%04x", c);
        else
            put(o, "%c", c);
    }
}

static kvs_status_t finish_out(out_t *o, size_t *len_p)
{
    put(o, "\n");
    if (o->over) return KVS_ERR_NOSPACE;
    *len_p = o->len;
    return KVS_OK;
}

static void put_ids(out_t *o, const uint32_t *ids, uint32_t n)
{
    for (uint32_t i = 0; i < n && !o->over; i++) put(o, " %u", ids[i]);
}

size_t kvs_rank_line_request_size(const kvs_rank_line_request_t *req)
{
    /* Each id: a space and at most 10 digits; the fixed fields fit the constant. */
    /* Each bias: a space, 10 digits, a space and a %.9g float (at most 15 characters). */
    if (req->kind == KVS_RANK_LINE_SUBMIT)
        return 256 + (size_t) req->submit.prompt_len * 11 +
               (size_t) req->submit.sampling.n_bias * 27 + req->submit.peer_len;
    if (req->kind == KVS_RANK_LINE_MATCH) return 32 + (size_t) req->match_len * 11;
    return 32;
}

kvs_status_t kvs_rank_line_request_encode(const kvs_rank_line_request_t *req, char *buf, size_t cap,
                                          size_t *len_p)
{
    out_t o = {buf, cap, 0, cap == 0};
    const kvs_rank_line_submit_t *s = &req->submit;
    const kvs_sample_params_t *sp = &s->sampling;
    switch (req->kind) {
    case KVS_RANK_LINE_SUBMIT:
        if ((s->prompt == NULL && s->prompt_len > 0) || s->eos < -1 || s->eos > UINT32_MAX ||
            (sp->bias == NULL && sp->n_bias > 0) || s->top_logprobs > KVS_LOGPROBS_TOP_MAX ||
            (s->prompt_logprobs && !s->logprobs) || s->choices > KVS_LLM_CHOICES_MAX)
            return KVS_ERR_INVALID;
        put(&o, "submit %llu %u %u %.9g %.9g %u %.9g %.9g %.9g %.9g %llu %lld %d %d %u",
            (unsigned long long) s->room, s->choices ? s->choices : 1, s->max_new,
            (double) sp->temperature, (double) sp->top_p, sp->top_k, (double) sp->min_p,
            (double) sp->presence_penalty, (double) sp->frequency_penalty,
            (double) sp->repetition_penalty, (unsigned long long) s->seed, (long long) s->eos,
            s->logprobs ? (int) s->top_logprobs : -1, s->prompt_logprobs ? 1 : 0, sp->n_bias);
        for (uint32_t i = 0; i < sp->n_bias && !o.over; i++)
            put(&o, " %u %.9g", sp->bias[i].token, (double) sp->bias[i].bias);
        put(&o, " %u", s->prompt_len);
        put_ids(&o, s->prompt, s->prompt_len);
        if (s->peer_len > 0) {
            if (s->peer == NULL || s->peer_len > KVS_LLM_PEER_MAX) return KVS_ERR_INVALID;
            for (size_t i = 0; i < s->peer_len; i++)
                if (s->peer[i] <= ' ' || s->peer[i] > '~') return KVS_ERR_INVALID;
            put(&o, " peer %.*s", (int) s->peer_len, s->peer);
        }
        break;
    case KVS_RANK_LINE_STOP:
        put(&o, "stop %llu", (unsigned long long) req->room);
        if (req->choice != KVS_LLM_CHOICE_ALL) put(&o, " %u", req->choice);
        break;
    case KVS_RANK_LINE_MATCH:
        if (req->match == NULL && req->match_len > 0) return KVS_ERR_INVALID;
        put(&o, "match %u", req->match_len);
        put_ids(&o, req->match, req->match_len);
        break;
    case KVS_RANK_LINE_STATS:
        put(&o, "stats");
        break;
    case KVS_RANK_LINE_QUIT:
        put(&o, "quit");
        break;
    default:
        return KVS_ERR_INVALID;
    }
    return finish_out(&o, len_p);
}

kvs_status_t kvs_rank_line_event_encode(const kvs_rank_line_event_t *ev, char *buf, size_t cap,
                                        size_t *len_p)
{
    out_t o = {buf, cap, 0, cap == 0};
    const kvs_llm_event_t *e = &ev->llm;
    const kvs_llm_stats_t *s = &ev->stats;
    const kvs_pd_metrics_t *m = &ev->metrics;
    switch (ev->kind) {
    case KVS_RANK_LINE_EV_READY:
        put(&o, "{\"event\":\"ready\",\"role\":\"%s\",\"tp\":%u,\"load_s\":%.3f}",
            kvs_rank_line_role_str(ev->role), ev->tp, ev->load_s);
        break;
    case KVS_RANK_LINE_EV_TOKEN:
    case KVS_RANK_LINE_EV_PROMPT:
        put(&o, "{\"event\":\"%s\",\"room\":%llu,\"token\":%u,\"index\":%u",
            ev->kind == KVS_RANK_LINE_EV_TOKEN ? "token" : "prompt", (unsigned long long) e->room,
            e->token, e->index);
        if (e->choice != 0) put(&o, ",\"choice\":%u", e->choice);
        if (e->has_logprobs) {
            put(&o, ",\"logprob\":%.9g,\"top\":\"", (double) e->lp.logprob);
            for (uint32_t i = 0; i < e->lp.n_top && i < KVS_LOGPROBS_TOP_MAX; i++)
                put(&o, "%s%u %.9g", i ? " " : "", e->lp.top[i].token,
                    (double) e->lp.top[i].logprob);
            put(&o, "\"");
        }
        put(&o, "}");
        break;
    case KVS_RANK_LINE_EV_DONE:
        put(&o,
            "{\"event\":\"done\",\"room\":%llu,\"status\":\"%s\",\"finish\":\"%s\","
            "\"prompt_len\":%u,\"cached\":%u,\"generated\":%u,\"submitted_ns\":%llu,"
            "\"admitted_ns\":%llu,\"prefilled_ns\":%llu,\"kv_ready_ns\":%llu,"
            "\"first_token_ns\":%llu,\"done_ns\":%llu",
            (unsigned long long) e->room, kvs_status_str(e->status),
            kvs_rank_line_finish_str(e->finish), e->prompt_len, e->cached_tokens, e->generated,
            (unsigned long long) e->submitted_ns, (unsigned long long) e->admitted_ns,
            (unsigned long long) e->prefilled_ns, (unsigned long long) e->kv_ready_ns,
            (unsigned long long) e->first_token_ns, (unsigned long long) e->done_ns);
        if (e->choice != 0) put(&o, ",\"choice\":%u", e->choice);
        put(&o, "}");
        break;
    case KVS_RANK_LINE_EV_REJECTED:
        put(&o, "{\"event\":\"rejected\",\"room\":%llu,\"status\":\"%s\"}",
            (unsigned long long) e->room, kvs_status_str(e->status));
        break;
    case KVS_RANK_LINE_EV_ERROR:
        put(&o, "{\"event\":\"error\",\"message\":\"");
        put_escaped(&o, ev->text);
        put(&o, "\"}");
        break;
    case KVS_RANK_LINE_EV_MATCH:
        if (ev->text[0] != '\0') {
            put(&o, "{\"event\":\"match\",\"cached\":%u,\"error\":\"", ev->cached);
            put_escaped(&o, ev->text);
            put(&o, "\"}");
        } else {
            put(&o, "{\"event\":\"match\",\"cached\":%u,\"prompt_len\":%llu}", ev->cached,
                (unsigned long long) ev->match_len);
        }
        break;
    case KVS_RANK_LINE_EV_PEERS:
        put(&o, "{\"event\":\"peers\",\"down\":%u,\"of\":%u,\"first\":%u}", ev->peers_down,
            ev->peers_of, ev->first_down);
        break;
    case KVS_RANK_LINE_EV_STATS: {
        put(&o,
            "{\"event\":\"stats\",\"role\":\"%s\",\"rank\":%u,\"steps\":%llu,"
            "\"forward_passes\":%llu,\"forward_ns\":%llu,\"prompt_tokens\":%llu,"
            "\"cached_tokens\":%llu,\"decode_tokens\":%llu,\"requests_ok\":%llu,"
            "\"requests_failed\":%llu,\"radix_pages\":%llu,\"preemptions\":%llu,"
            "\"pages_total\":%u,\"pages_free\":%u",
            kvs_rank_line_role_str(ev->role), ev->rank, (unsigned long long) s->steps,
            (unsigned long long) s->forward_passes, (unsigned long long) s->forward_ns,
            (unsigned long long) s->prompt_tokens, (unsigned long long) s->cached_tokens,
            (unsigned long long) s->decode_tokens, (unsigned long long) s->requests_ok,
            (unsigned long long) s->requests_failed, (unsigned long long) s->radix_pages,
            (unsigned long long) s->preemptions, s->pages_total, s->pages_free);
        uint32_t nf;
        const kvs_pd_metric_field_t *f = kvs_pd_metrics_fields(&nf);
        for (uint32_t i = 0; i < nf; i++)
            if (f[i].line != NULL)
                put(&o, ",\"%s\":%llu", f[i].line,
                    (unsigned long long) kvs_pd_metrics_get(m, &f[i]));
        put(&o, ",\"queued\":%u,\"running\":%u,\"load_s\":%.3f,\"wall_s\":%.3f,\"final\":%s}",
            s->queued, s->running, ev->load_s, ev->wall_s, ev->final ? "true" : "false");
        break;
    }
    default:
        return KVS_ERR_INVALID;
    }
    return finish_out(&o, len_p);
}

/* ---- reading requests ---- */

typedef struct {
    const char *s;
    size_t len, at;
} cur_t;

/* One optional space, then a decimal u64 ending at a space or the end of the line. */
static int next_u64(cur_t *c, uint64_t *v)
{
    if (c->at < c->len && c->s[c->at] == ' ') c->at++;
    if (c->at >= c->len || c->s[c->at] < '0' || c->s[c->at] > '9') return -1;
    uint64_t x = 0;
    for (; c->at < c->len && c->s[c->at] >= '0' && c->s[c->at] <= '9'; c->at++) {
        uint64_t d = (uint64_t) (c->s[c->at] - '0');
        if (x > (UINT64_MAX - d) / 10) return -1;
        x = x * 10 + d;
    }
    if (c->at < c->len && c->s[c->at] != ' ') return -1;
    *v = x;
    return 0;
}

/* One optional space, then a float (strtof's syntax) ending at a space or the end. */
static int next_f32(cur_t *c, float *v)
{
    if (c->at < c->len && c->s[c->at] == ' ') c->at++;
    size_t start = c->at, end = start;
    while (end < c->len && c->s[end] != ' ') end++;
    char tok[128];
    if (end == start || end - start >= sizeof(tok)) return -1;
    memcpy(tok, c->s + start, end - start);
    tok[end - start] = '\0';
    errno = 0;
    char *stop;
    float x = strtof(tok, &stop);
    if (errno != 0 || stop != tok + (end - start)) return -1;
    *v = x;
    c->at = end;
    return 0;
}

static int at_end(const cur_t *c)
{
    return c->at >= c->len;
}

static kvs_status_t bad(const char **why_p, const char *why)
{
    *why_p = why;
    return KVS_ERR_INVALID;
}

static kvs_status_t decode_submit(cur_t *c, uint32_t *ids, uint32_t ids_cap, kvs_logit_bias_t *bias,
                                  kvs_rank_line_submit_t *s, const char **why_p)
{
    uint64_t choices, max_new, top_k, nb, n;
    kvs_sample_params_t *sp = &s->sampling;
    if (next_u64(c, &s->room) || next_u64(c, &choices) || next_u64(c, &max_new) ||
        next_f32(c, &sp->temperature) || next_f32(c, &sp->top_p) || next_u64(c, &top_k) ||
        next_f32(c, &sp->min_p) || next_f32(c, &sp->presence_penalty) ||
        next_f32(c, &sp->frequency_penalty) || next_f32(c, &sp->repetition_penalty) ||
        next_u64(c, &s->seed) || max_new > UINT32_MAX || top_k > UINT32_MAX)
        return bad(why_p, "submit needs ROOM CHOICES MAX_NEW TEMPERATURE TOP_P TOP_K MIN_P "
                          "PRESENCE FREQUENCY REPETITION SEED EOS LOGPROBS PROMPT_LOGPROBS B "
                          "BIASES N IDS");
    if (choices == 0 || choices > KVS_LLM_CHOICES_MAX) return bad(why_p, "CHOICES must be 1..16");
    s->choices = (uint32_t) choices;
    s->max_new = (uint32_t) max_new;
    sp->top_k = (uint32_t) top_k;
    if (c->len - c->at >= 3 && memcmp(c->s + c->at, " -1", 3) == 0 &&
        (c->at + 3 == c->len || c->s[c->at + 3] == ' ')) {
        c->at += 3;
        s->eos = -1;
    } else {
        uint64_t e;
        if (next_u64(c, &e) || e >= UINT32_MAX) return bad(why_p, "EOS must be a token id or -1");
        s->eos = (int64_t) e;
    }
    uint64_t lp;
    if (c->len - c->at >= 3 && memcmp(c->s + c->at, " -1", 3) == 0 &&
        (c->at + 3 == c->len || c->s[c->at + 3] == ' ')) {
        c->at += 3;
    } else if (next_u64(c, &lp) || lp > KVS_LOGPROBS_TOP_MAX) {
        return bad(why_p, "LOGPROBS must be -1 (none) or 0..20");
    } else {
        s->logprobs = 1;
        s->top_logprobs = (uint32_t) lp;
    }
    if (next_u64(c, &lp) || lp > (uint64_t) s->logprobs)
        return bad(why_p, "PROMPT_LOGPROBS must be 0, or 1 with LOGPROBS");
    s->prompt_logprobs = (int) lp;
    if (next_u64(c, &nb) || nb > KVS_SAMPLE_BIAS_LIMIT)
        return bad(why_p, "B must be a count of logit biases, at most 300");
    for (uint64_t i = 0; i < nb; i++) {
        uint64_t id;
        if (next_u64(c, &id) || id > UINT32_MAX || next_f32(c, &bias[i].bias))
            return bad(why_p, "logit biases must be pairs of a token id and a float");
        bias[i].token = (uint32_t) id;
    }
    sp->n_bias = (uint32_t) nb;
    sp->bias = bias;
    if (next_u64(c, &n) || n == 0 || n > ids_cap) {
        *why_p = "prompt length out of range";
        return KVS_ERR_NOSPACE;
    }
    for (uint64_t i = 0; i < n; i++) {
        uint64_t id;
        if (next_u64(c, &id) || id > UINT32_MAX) return bad(why_p, "prompt token ids");
        ids[i] = (uint32_t) id;
    }
    static const char peer[] = " peer ";
    if (c->len - c->at >= sizeof(peer) - 1 && memcmp(c->s + c->at, peer, sizeof(peer) - 1) == 0) {
        c->at += sizeof(peer) - 1;
        s->peer = c->s + c->at;
        while (c->at < c->len && c->s[c->at] > ' ' && c->s[c->at] <= '~') c->at++;
        s->peer_len = (size_t) (c->s + c->at - s->peer);
        if (s->peer_len == 0 || s->peer_len > KVS_LLM_PEER_MAX || !at_end(c))
            return bad(why_p, "PEER must be 1..16384 printable characters without spaces");
    }
    if (!at_end(c)) return bad(why_p, "more token ids than N");
    s->prompt_len = (uint32_t) n;
    s->prompt = ids;
    return KVS_OK;
}

static kvs_status_t decode_match(cur_t *c, uint32_t *ids, uint32_t ids_cap,
                                 kvs_rank_line_request_t *q, const char **why_p)
{
    uint64_t n;
    if (next_u64(c, &n) || n == 0) return bad(why_p, "match needs N >= 1 and N token ids");
    for (uint64_t i = 0; i < n; i++) {
        uint64_t id;
        if (next_u64(c, &id) || id > UINT32_MAX) return bad(why_p, "match: prompt token ids");
        if (i < ids_cap) ids[i] = (uint32_t) id;
    }
    if (!at_end(c)) return bad(why_p, "match: more token ids than N");
    /* Every id took two bytes at least, so N fits the 32 bits of a line's length bound. */
    q->match_len = (uint32_t) n;
    q->match = ids;
    if (n > ids_cap) {
        *why_p = "match: more token ids than the rank takes";
        return KVS_ERR_NOSPACE;
    }
    return KVS_OK;
}

static int verb(const char *s, size_t len, const char *word)
{
    size_t n = strlen(word);
    return len > n && memcmp(s, word, n) == 0 && s[n] == ' ';
}

kvs_status_t kvs_rank_line_request_decode(const char *line, size_t len, uint32_t *ids,
                                          uint32_t ids_cap, kvs_logit_bias_t *bias,
                                          kvs_rank_line_request_t *req_p, const char **why_p)
{
    const char *unused;
    if (why_p == NULL) why_p = &unused;
    memset(req_p, 0, sizeof(*req_p));
    *why_p = NULL;
    if (len > KVS_RANK_LINE_MAX) return bad(why_p, "line too long");
    const char *nul = memchr(line, '\0', len);
    if (nul != NULL) len = (size_t) (nul - line);
    /* The cursor starts on the space after the verb: every field reads one space first. */
    if (verb(line, len, "submit")) {
        req_p->kind = KVS_RANK_LINE_SUBMIT;
        cur_t c = {line, len, 6};
        return decode_submit(&c, ids, ids_cap, bias, &req_p->submit, why_p);
    }
    if (verb(line, len, "stop")) {
        req_p->kind = KVS_RANK_LINE_STOP;
        cur_t c = {line, len, 4};
        uint64_t choice = KVS_LLM_CHOICE_ALL; /* no CHOICE: every one */
        if (next_u64(&c, &req_p->room)) return bad(why_p, "stop needs ROOM [CHOICE]");
        if (!at_end(&c) && (next_u64(&c, &choice) || choice >= KVS_LLM_CHOICES_MAX))
            return bad(why_p, "stop needs ROOM [CHOICE], CHOICE 0..15");
        if (!at_end(&c)) return bad(why_p, "stop needs ROOM [CHOICE]");
        req_p->choice = (uint32_t) choice;
        return KVS_OK;
    }
    if (verb(line, len, "match")) {
        req_p->kind = KVS_RANK_LINE_MATCH;
        cur_t c = {line, len, 5};
        return decode_match(&c, ids, ids_cap, req_p, why_p);
    }
    if (len == 5 && memcmp(line, "stats", 5) == 0) {
        req_p->kind = KVS_RANK_LINE_STATS;
        return KVS_OK;
    }
    if (len == 4 && memcmp(line, "quit", 4) == 0) {
        req_p->kind = KVS_RANK_LINE_QUIT;
        return KVS_OK;
    }
    return bad(why_p, "expected submit, stop, match, stats or quit");
}

/* ---- reading events: a flat JSON object ---- */

typedef enum { V_STR, V_NUM, V_TRUE, V_FALSE, V_NULL } vtype_t;

typedef struct {
    const char *key; /* raw, between the quotes (the keys that matter have no escapes) */
    size_t key_len;
    vtype_t type;
    const char *val; /* V_STR: raw contents between the quotes; V_NUM: the number's text */
    size_t val_len;
} pair_t;

#define MAX_PAIRS 128

typedef struct {
    pair_t p[MAX_PAIRS];
    uint32_t n;
} obj_t;

static int is_ws(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r';
}

static void skip_ws(cur_t *c)
{
    while (c->at < c->len && is_ws(c->s[c->at])) c->at++;
}

static int hex4(const char *s, unsigned *v)
{
    unsigned x = 0;
    for (int i = 0; i < 4; i++) {
        char h = s[i];
        unsigned d = h >= '0' && h <= '9'   ? (unsigned) (h - '0')
                     : h >= 'a' && h <= 'f' ? (unsigned) (h - 'a' + 10)
                     : h >= 'A' && h <= 'F' ? (unsigned) (h - 'A' + 10)
                                            : 16u;
        if (d == 16) return -1;
        x = x * 16 + d;
    }
    *v = x;
    return 0;
}

/* A string starting at its opening quote; *raw_p, *raw_len_p: what is between the quotes. */
static int scan_string(cur_t *c, const char **raw_p, size_t *raw_len_p)
{
    if (c->at >= c->len || c->s[c->at] != '"') return -1;
    size_t start = ++c->at;
    while (c->at < c->len) {
        unsigned char ch = (unsigned char) c->s[c->at];
        if (ch == '"') {
            *raw_p = c->s + start;
            *raw_len_p = c->at - start;
            c->at++;
            return 0;
        }
        if (ch < 0x20) return -1;
        if (ch != '\\') {
            c->at++;
            continue;
        }
        if (c->at + 1 >= c->len) return -1;
        char e = c->s[c->at + 1];
        unsigned u;
        if (e == 'u') {
            if (c->at + 6 > c->len || hex4(c->s + c->at + 2, &u)) return -1;
            c->at += 6;
        } else if (strchr("\"\\/bfnrt", e) != NULL && e != '\0') {
            c->at += 2;
        } else {
            return -1;
        }
    }
    return -1;
}

/* JSON's number grammar. */
static int scan_number(cur_t *c)
{
    size_t at = c->at;
    const char *s = c->s;
#define DIGIT(i) ((i) < c->len && s[i] >= '0' && s[i] <= '9')
    if (at < c->len && s[at] == '-') at++;
    if (!DIGIT(at)) return -1;
    if (s[at] == '0')
        at++;
    else
        while (DIGIT(at)) at++;
    if (at < c->len && s[at] == '.') {
        at++;
        if (!DIGIT(at)) return -1;
        while (DIGIT(at)) at++;
    }
    if (at < c->len && (s[at] == 'e' || s[at] == 'E')) {
        at++;
        if (at < c->len && (s[at] == '+' || s[at] == '-')) at++;
        if (!DIGIT(at)) return -1;
        while (DIGIT(at)) at++;
    }
#undef DIGIT
    c->at = at;
    return 0;
}

static int scan_word(cur_t *c, const char *w)
{
    size_t n = strlen(w);
    if (c->len - c->at < n || memcmp(c->s + c->at, w, n) != 0) return -1;
    c->at += n;
    return 0;
}

static int parse_object(const char *line, size_t len, obj_t *o, const char **why_p)
{
    cur_t c = {line, len, 0};
    o->n = 0;
    skip_ws(&c);
    if (c.at >= c.len || line[c.at] != '{') return *why_p = "not a JSON object", -1;
    c.at++;
    skip_ws(&c);
    if (c.at < c.len && line[c.at] == '}') {
        c.at++;
    } else {
        for (;;) {
            if (o->n == MAX_PAIRS) return *why_p = "too many fields", -1;
            pair_t *p = &o->p[o->n++];
            skip_ws(&c);
            if (scan_string(&c, &p->key, &p->key_len)) return *why_p = "bad field name", -1;
            skip_ws(&c);
            if (c.at >= c.len || line[c.at] != ':') return *why_p = "expected ':'", -1;
            c.at++;
            skip_ws(&c);
            size_t vstart = c.at;
            int rc;
            char ch = c.at < c.len ? line[c.at] : '\0';
            if (ch == '"') {
                p->type = V_STR;
                rc = scan_string(&c, &p->val, &p->val_len);
            } else if (ch == 't') {
                p->type = V_TRUE;
                rc = scan_word(&c, "true");
            } else if (ch == 'f') {
                p->type = V_FALSE;
                rc = scan_word(&c, "false");
            } else if (ch == 'n') {
                p->type = V_NULL;
                rc = scan_word(&c, "null");
            } else {
                p->type = V_NUM;
                rc = scan_number(&c);
                p->val = line + vstart;
                p->val_len = c.at - vstart;
            }
            /* Nested objects and arrays are no part of the protocol. */
            if (rc) return *why_p = "bad value", -1;
            skip_ws(&c);
            if (c.at < c.len && line[c.at] == ',') {
                c.at++;
                continue;
            }
            if (c.at < c.len && line[c.at] == '}') {
                c.at++;
                break;
            }
            return *why_p = "expected ',' or '}'", -1;
        }
    }
    skip_ws(&c);
    if (c.at != c.len) return *why_p = "text after the object", -1;
    return 0;
}

static const pair_t *find(const obj_t *o, const char *key)
{
    size_t n = strlen(key);
    for (uint32_t i = 0; i < o->n; i++)
        if (o->p[i].key_len == n && memcmp(o->p[i].key, key, n) == 0) return &o->p[i];
    return NULL;
}

/* Unescapes a string value into out[cap] (cut to fit, always NUL-terminated). */
static void unescape(const pair_t *p, char *out, size_t cap)
{
    size_t w = 0;
    for (size_t i = 0; i < p->val_len;) {
        char ch = p->val[i];
        char enc[4];
        size_t n = 1;
        enc[0] = ch;
        if (ch == '\\') {
            char e = p->val[i + 1];
            i += 2;
            unsigned u = 0;
            if (e == 'u') {
                hex4(p->val + i, &u); /* checked when scanned */
                i += 4;
                /* A surrogate pair is one code point; a lone surrogate becomes U+FFFD. */
                if (u >= 0xd800 && u < 0xdc00 && i + 6 <= p->val_len && p->val[i] == '\\' &&
                    p->val[i + 1] == 'u') {
                    unsigned lo;
                    if (hex4(p->val + i + 2, &lo) == 0 && lo >= 0xdc00 && lo < 0xe000) {
                        u = 0x10000 + ((u - 0xd800) << 10) + (lo - 0xdc00);
                        i += 6;
                    }
                }
                if (u >= 0xd800 && u < 0xe000) u = 0xfffd;
                if (u < 0x80) {
                    enc[0] = (char) u;
                } else if (u < 0x800) {
                    enc[0] = (char) (0xc0 | (u >> 6));
                    enc[1] = (char) (0x80 | (u & 0x3f));
                    n = 2;
                } else if (u < 0x10000) {
                    enc[0] = (char) (0xe0 | (u >> 12));
                    enc[1] = (char) (0x80 | ((u >> 6) & 0x3f));
                    enc[2] = (char) (0x80 | (u & 0x3f));
                    n = 3;
                } else {
                    enc[0] = (char) (0xf0 | (u >> 18));
                    enc[1] = (char) (0x80 | ((u >> 12) & 0x3f));
                    enc[2] = (char) (0x80 | ((u >> 6) & 0x3f));
                    enc[3] = (char) (0x80 | (u & 0x3f));
                    n = 4;
                }
            } else {
                enc[0] = e == 'b'   ? '\b'
                         : e == 'f' ? '\f'
                         : e == 'n' ? '\n'
                         : e == 'r' ? '\r'
                         : e == 't' ? '\t'
                                    : e;
            }
        } else {
            i++;
        }
        if (w + n >= cap) break;
        memcpy(out + w, enc, n);
        w += n;
    }
    out[w] = '\0';
}

/* The reads below leave *v alone when the field is absent; -1: present with the wrong type. */
static int get_str(const obj_t *o, const char *key, char *out, size_t cap)
{
    const pair_t *p = find(o, key);
    if (p == NULL) return 0;
    if (p->type != V_STR) return -1;
    unescape(p, out, cap);
    return 1;
}

static int get_u64(const obj_t *o, const char *key, uint64_t max, uint64_t *v)
{
    const pair_t *p = find(o, key);
    if (p == NULL) return 0;
    if (p->type != V_NUM || p->val[0] == '-') return -1;
    uint64_t x = 0;
    for (size_t i = 0; i < p->val_len; i++) {
        char ch = p->val[i];
        if (ch < '0' || ch > '9') return -1; /* a fraction or exponent: not a count */
        uint64_t d = (uint64_t) (ch - '0');
        if (x > (UINT64_MAX - d) / 10) return -1;
        x = x * 10 + d;
    }
    if (x > max) return -1;
    *v = x;
    return 1;
}

static int get_u32(const obj_t *o, const char *key, uint32_t *v)
{
    uint64_t x = *v;
    int rc = get_u64(o, key, UINT32_MAX, &x);
    *v = (uint32_t) x;
    return rc;
}

static int get_double(const obj_t *o, const char *key, double *v)
{
    const pair_t *p = find(o, key);
    if (p == NULL) return 0;
    char tok[128];
    if (p->type != V_NUM || p->val_len >= sizeof(tok)) return -1;
    memcpy(tok, p->val, p->val_len);
    tok[p->val_len] = '\0';
    *v = strtod(tok, NULL); /* the grammar was checked; out of range saturates */
    return 1;
}

static int get_bool(const obj_t *o, const char *key, int *v)
{
    const pair_t *p = find(o, key);
    if (p == NULL) return 0;
    if (p->type != V_TRUE && p->type != V_FALSE) return -1;
    *v = p->type == V_TRUE;
    return 1;
}

static int get_role(const obj_t *o, kvs_llm_role_t *role)
{
    char s[16];
    int rc = get_str(o, "role", s, sizeof(s));
    if (rc <= 0) return rc;
    for (int r = KVS_LLM_COLOCATED; r <= KVS_LLM_DECODE; r++) {
        if (strcmp(s, kvs_rank_line_role_str((kvs_llm_role_t) r)) == 0) {
            *role = (kvs_llm_role_t) r;
            return 1;
        }
    }
    return -1;
}

static int get_status(const obj_t *o, kvs_status_t *st)
{
    char s[64];
    *st = KVS_ERR_IO;
    int rc = get_str(o, "status", s, sizeof(s));
    if (rc <= 0) return rc;
    for (int v = KVS_INPROGRESS; v >= KVS_ERR_STATE; v--) {
        if (strcmp(s, kvs_status_str((kvs_status_t) v)) == 0) {
            *st = (kvs_status_t) v;
            break;
        }
    }
    return 1;
}

static int get_finish(const obj_t *o, kvs_llm_finish_t *f)
{
    char s[16];
    *f = KVS_LLM_FINISH_ERROR;
    int rc = get_str(o, "finish", s, sizeof(s));
    if (rc <= 0) return rc;
    for (unsigned i = 0; i < N_FINISH; i++) {
        if (strcmp(s, finish_names[i]) == 0) {
            *f = (kvs_llm_finish_t) i;
            break;
        }
    }
    return 1;
}

/* The stats line's transfer counters: the fields with a line key. -1: one of the wrong type. */
static int get_metrics(const obj_t *o, kvs_pd_metrics_t *m)
{
    uint32_t nf;
    const kvs_pd_metric_field_t *f = kvs_pd_metrics_fields(&nf);
    for (uint32_t i = 0; i < nf; i++) {
        uint64_t v = 0;
        if (f[i].line == NULL) continue;
        if (get_u64(o, f[i].line, UINT64_MAX, &v) < 0) return -1;
        kvs_pd_metrics_set(m, &f[i], v);
    }
    return 0;
}

/* "logprob" and "top" ("ID LOGPROB ..." pairs, at most KVS_LOGPROBS_TOP_MAX): both or neither;
 * -1: malformed. */
static int get_logprobs(const obj_t *o, kvs_llm_event_t *e)
{
    double lp = 0;
    char top[1024];
    int a = get_double(o, "logprob", &lp), b = get_str(o, "top", top, sizeof(top));
    if (a < 0 || b < 0 || a != b) return -1;
    if (a == 0) return 0;
    e->has_logprobs = 1;
    e->lp.logprob = (float) lp;
    cur_t c = {top, strlen(top), 0};
    for (uint32_t n = 0; c.at < c.len; n++) {
        uint64_t id;
        float v;
        if (n >= KVS_LOGPROBS_TOP_MAX) return -1;
        if (next_u64(&c, &id) || id > UINT32_MAX || next_f32(&c, &v)) return -1;
        e->lp.top[n] = (kvs_token_logprob_t){.token = (uint32_t) id, .logprob = v};
        e->lp.n_top = n + 1;
    }
    return 1;
}

#define U64(key, field) (get_u64(&o, key, UINT64_MAX, &(field)) < 0)
#define U32(key, field) (get_u32(&o, key, &(field)) < 0)

kvs_status_t kvs_rank_line_event_decode(const char *line, size_t len, kvs_rank_line_event_t *ev_p,
                                        const char **why_p)
{
    const char *unused;
    if (why_p == NULL) why_p = &unused;
    *why_p = NULL;
    memset(ev_p, 0, sizeof(*ev_p));
    if (len > KVS_RANK_LINE_MAX) return bad(why_p, "line too long");
    obj_t o;
    if (parse_object(line, len, &o, why_p)) return KVS_ERR_INVALID;
    char kind[16];
    if (get_str(&o, "event", kind, sizeof(kind)) <= 0) return bad(why_p, "no \"event\" name");
    kvs_rank_line_event_t *ev = ev_p;
    kvs_llm_event_t *e = &ev->llm;
    int wrong = 0; /* a field of the wrong type */
    if (strcmp(kind, "ready") == 0) {
        ev->kind = KVS_RANK_LINE_EV_READY;
        wrong = get_role(&o, &ev->role) < 0 || U32("tp", ev->tp) ||
                get_double(&o, "load_s", &ev->load_s) < 0;
    } else if (strcmp(kind, "token") == 0 || strcmp(kind, "prompt") == 0) {
        ev->kind = kind[0] == 't' ? KVS_RANK_LINE_EV_TOKEN : KVS_RANK_LINE_EV_PROMPT;
        e->kind = kind[0] == 't' ? KVS_LLM_EV_TOKEN : KVS_LLM_EV_PROMPT;
        wrong = U64("room", e->room) || U32("token", e->token) || U32("index", e->index) ||
                U32("choice", e->choice) || get_logprobs(&o, e) < 0;
    } else if (strcmp(kind, "done") == 0 || strcmp(kind, "rejected") == 0) {
        ev->kind = kind[0] == 'd' ? KVS_RANK_LINE_EV_DONE : KVS_RANK_LINE_EV_REJECTED;
        e->kind = KVS_LLM_EV_DONE;
        wrong = U64("room", e->room) || get_status(&o, &e->status) < 0 ||
                get_finish(&o, &e->finish) < 0 || U32("prompt_len", e->prompt_len) ||
                U32("cached", e->cached_tokens) || U32("generated", e->generated) ||
                U64("submitted_ns", e->submitted_ns) || U64("admitted_ns", e->admitted_ns) ||
                U64("prefilled_ns", e->prefilled_ns) || U64("kv_ready_ns", e->kv_ready_ns) ||
                U64("first_token_ns", e->first_token_ns) || U64("done_ns", e->done_ns) ||
                U32("choice", e->choice);
    } else if (strcmp(kind, "error") == 0) {
        ev->kind = KVS_RANK_LINE_EV_ERROR;
        wrong = get_str(&o, "message", ev->text, sizeof(ev->text)) < 0;
    } else if (strcmp(kind, "match") == 0) {
        ev->kind = KVS_RANK_LINE_EV_MATCH;
        wrong = U32("cached", ev->cached) || U64("prompt_len", ev->match_len) ||
                get_str(&o, "error", ev->text, sizeof(ev->text)) < 0;
    } else if (strcmp(kind, "peers") == 0) {
        ev->kind = KVS_RANK_LINE_EV_PEERS;
        wrong =
            U32("down", ev->peers_down) || U32("of", ev->peers_of) || U32("first", ev->first_down);
    } else if (strcmp(kind, "stats") == 0) {
        kvs_llm_stats_t *s = &ev->stats;
        kvs_pd_metrics_t *m = &ev->metrics;
        ev->kind = KVS_RANK_LINE_EV_STATS;
        ev->final = 1;
        wrong = get_role(&o, &ev->role) < 0 || U32("rank", ev->rank) || U64("steps", s->steps) ||
                U64("forward_passes", s->forward_passes) || U64("forward_ns", s->forward_ns) ||
                U64("prompt_tokens", s->prompt_tokens) || U64("cached_tokens", s->cached_tokens) ||
                U64("decode_tokens", s->decode_tokens) || U64("requests_ok", s->requests_ok) ||
                U64("requests_failed", s->requests_failed) || U64("radix_pages", s->radix_pages) ||
                U64("preemptions", s->preemptions) || U32("pages_total", s->pages_total) ||
                U32("pages_free", s->pages_free) || get_metrics(&o, m) ||
                U32("queued", s->queued) || U32("running", s->running) ||
                get_double(&o, "load_s", &ev->load_s) < 0 ||
                get_double(&o, "wall_s", &ev->wall_s) < 0 || get_bool(&o, "final", &ev->final) < 0;
    } else {
        *why_p = "unknown event";
        return KVS_ERR_UNSUPPORTED;
    }
    if (wrong) return bad(why_p, "a field of the wrong type or out of range");
    return KVS_OK;
}

#undef U64
#undef U32
