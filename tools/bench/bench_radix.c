/* `kvstage bench radix`: drives the radix prefix cache the way a prefill engine does (match and
 * lock, compute the rest into fresh pool pages, insert the prompt, free the duplicates, unlock)
 * on built-in serving workloads or a replayed trace, and reports throughput and the hit rate
 * next to the workload's ideal (infinite cache) hit rate. Workloads are operation lists, so the
 * built-in run, the dumped trace and its replay execute exactly the same operations. The trace
 * format and the replay rules are in docs/radix-trace.md. */
#include "bench/bench_radix.h"
#include "bench/bench_util.h"

#include <errno.h>
#include <stdarg.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/args.h"
#include "common/json.h"
#include "kvstage/alloc.h"
#include "kvstage/clock.h"
#include "kvstage/radix.h"
#include "kvstage/rng.h"

enum { EXIT_RUN_FAILED = 1, EXIT_USAGE = 2 };

/* ---- workloads: operation lists over a token arena ---- */

typedef enum { OP_MATCH, OP_INSERT, OP_LOCK, OP_UNLOCK, OP_EVICT } op_kind_t;

typedef struct {
    op_kind_t kind;
    uint64_t line; /* trace line; 0 for built-in workloads */
    uint64_t ns;   /* match, insert */
    uint64_t arg;  /* lock, unlock: handle; evict: pages */
    size_t tok;    /* match, insert: offset of the key in the token arena */
    size_t len;    /* match, insert: key tokens */
} op_t;

typedef struct {
    char name[64];
    op_t *ops; /* [nops] */
    size_t nops, ops_cap;
    int32_t *toks; /* [ntoks] token arena; match and insert of one request share a key */
    size_t ntoks, toks_cap;
    size_t nhandles; /* match and insert operations so far: the next handle */
    size_t nmatches;
} workload_t;

static int grow(void **buf, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap) return 0;
    size_t ncap = *cap ? *cap : 1024;
    while (ncap < need) {
        if (ncap > SIZE_MAX / 2 / elem) return -1;
        ncap *= 2;
    }
    void *p = kvs_realloc(*buf, ncap * elem);
    if (p == NULL) return -1;
    *buf = p;
    *cap = ncap;
    return 0;
}

static int push_op(workload_t *w, op_t op)
{
    if (grow((void **) &w->ops, &w->ops_cap, w->nops + 1, sizeof(op_t)) != 0) return -1;
    if (op.kind == OP_MATCH || op.kind == OP_INSERT) w->nhandles++;
    if (op.kind == OP_MATCH) w->nmatches++;
    w->ops[w->nops++] = op;
    return 0;
}

/* Reserves n tokens at the end of the arena; returns their offset or SIZE_MAX. */
static size_t reserve_toks(workload_t *w, size_t n)
{
    if (grow((void **) &w->toks, &w->toks_cap, w->ntoks + n, sizeof(int32_t)) != 0) return SIZE_MAX;
    size_t off = w->ntoks;
    w->ntoks += n;
    return off;
}

static void workload_free(workload_t *w)
{
    kvs_free(w->ops);
    kvs_free(w->toks);
    memset(w, 0, sizeof(*w));
}

/* What an engine does per request: match and lock, insert the prompt, unlock. */
static int push_request(workload_t *w, uint64_t ns, size_t tok, size_t len)
{
    uint64_t h = w->nhandles;
    op_t key = {.kind = OP_MATCH, .ns = ns, .tok = tok, .len = len};
    if (push_op(w, key) != 0) return -1;
    if (push_op(w, (op_t){.kind = OP_LOCK, .arg = h}) != 0) return -1;
    key.kind = OP_INSERT;
    if (push_op(w, key) != 0) return -1;
    return push_op(w, (op_t){.kind = OP_UNLOCK, .arg = h});
}

/* ---- built-in workloads ---- */

enum { VOCAB = 32000 };

static void random_tokens(kvs_rng_t *rng, int32_t *dst, size_t n)
{
    for (size_t i = 0; i < n; i++) dst[i] = (int32_t) kvs_rng_below(rng, VOCAB);
}

static size_t scaled(size_t n, double scale)
{
    double v = (double) n * scale + 0.5;
    return v < 1.0 ? 1 : (size_t) v;
}

static void shuffle(kvs_rng_t *rng, size_t *a, size_t n)
{
    for (size_t i = n; i > 1; i--) {
        size_t j = kvs_rng_below(rng, i);
        size_t t = a[i - 1];
        a[i - 1] = a[j];
        a[j] = t;
    }
}

/* 64 groups x 16 requests x 2048 tokens; a group shares an 1800-token prefix (e.g. a system
 * prompt with documents), the rest is unique. Requests of all groups arrive interleaved. */
static int build_shared_prefix(workload_t *w, kvs_rng_t *rng, double scale)
{
    const size_t per = 16, len = 2048, shared = 1800;
    size_t groups = scaled(64, scale), n = groups * per;
    size_t *off = kvs_malloc(n * sizeof(size_t));
    if (off == NULL) return -1;
    int rc = -1;
    for (size_t g = 0; g < groups; g++) {
        for (size_t q = 0; q < per; q++) {
            size_t o = reserve_toks(w, len);
            if (o == SIZE_MAX) goto out;
            off[g * per + q] = o;
            if (q == 0)
                random_tokens(rng, w->toks + o, shared);
            else
                memcpy(w->toks + o, w->toks + off[g * per], shared * sizeof(int32_t));
            random_tokens(rng, w->toks + o + shared, len - shared);
        }
    }
    size_t *order = kvs_malloc(n * sizeof(size_t));
    if (order == NULL) goto out;
    for (size_t i = 0; i < n; i++) order[i] = off[i];
    shuffle(rng, order, n);
    rc = 0;
    for (size_t i = 0; i < n && rc == 0; i++) rc = push_request(w, 0, order[i], len);
    kvs_free(order);
out:
    kvs_free(off);
    return rc;
}

/* 256 clients x 5 rounds. Round 1: a shared 128-token system prompt and a user turn; round r+1:
 * the previous prompt, the answer to it and a new user turn (100-300 tokens each, ~200 mean).
 * Answers are generated on the decode side, so they reach this (prefill) cache only as part of
 * the next prompt. Rounds are in order; clients are interleaved within a round. */
static int build_multi_turn(workload_t *w, kvs_rng_t *rng, double scale)
{
    const size_t rounds = 5, sys = 128;
    size_t clients = scaled(256, scale);
    size_t *prev = kvs_calloc(clients * 3, sizeof(size_t)); /* [clients][offset, len, order] */
    if (prev == NULL) return -1;
    size_t *order = prev + clients * 2;
    int rc = -1;
    size_t sys_off = reserve_toks(w, sys);
    if (sys_off == SIZE_MAX) goto out;
    random_tokens(rng, w->toks + sys_off, sys);
    for (size_t r = 0; r < rounds; r++) {
        for (size_t c = 0; c < clients; c++) order[c] = c;
        shuffle(rng, order, clients);
        for (size_t i = 0; i < clients; i++) {
            size_t c = order[i];
            size_t user = kvs_rng_range(rng, 100, 300);
            size_t answer = r == 0 ? 0 : kvs_rng_range(rng, 100, 300);
            size_t base_off = r == 0 ? sys_off : prev[2 * c];
            size_t base_len = r == 0 ? sys : prev[2 * c + 1];
            size_t len = base_len + answer + user;
            size_t o = reserve_toks(w, len);
            if (o == SIZE_MAX) goto out;
            memcpy(w->toks + o, w->toks + base_off, base_len * sizeof(int32_t));
            random_tokens(rng, w->toks + o + base_len, answer + user);
            if (push_request(w, 0, o, len) != 0) goto out;
            prev[2 * c] = o;
            prev[2 * c + 1] = len;
        }
    }
    rc = 0;
out:
    kvs_free(prev);
    return rc;
}

/* An 8-shot prompt (~1000 tokens: 8 examples of 110-140) shared by 1000 questions of 30-70. */
static int build_few_shot(workload_t *w, kvs_rng_t *rng, double scale)
{
    size_t shots = 0;
    size_t shot_len[8];
    for (int s = 0; s < 8; s++) shots += shot_len[s] = kvs_rng_range(rng, 110, 140);
    size_t prefix = reserve_toks(w, shots);
    if (prefix == SIZE_MAX) return -1;
    random_tokens(rng, w->toks + prefix, shots);
    size_t questions = scaled(1000, scale);
    for (size_t q = 0; q < questions; q++) {
        size_t qlen = kvs_rng_range(rng, 30, 70);
        size_t o = reserve_toks(w, shots + qlen);
        if (o == SIZE_MAX) return -1;
        memcpy(w->toks + o, w->toks + prefix, shots * sizeof(int32_t));
        random_tokens(rng, w->toks + o + shots, qlen);
        if (push_request(w, 0, o, shots + qlen) != 0) return -1;
    }
    return 0;
}

typedef struct {
    const char *name;
    int (*build)(workload_t *w, kvs_rng_t *rng, double scale);
} builtin_t;

static const builtin_t builtins[] = {
    {"shared-prefix", build_shared_prefix},
    {"multi-turn", build_multi_turn},
    {"few-shot", build_few_shot},
};
enum { NBUILTINS = sizeof(builtins) / sizeof(builtins[0]) };

/* ---- trace files ---- */

static int is_space(char c)
{
    return c == ' ' || c == '\t' || c == '\r' || c == '\n';
}

typedef struct {
    const char *path;
    uint64_t line;
    char *p; /* cursor in the current line */
} cursor_t;

static int parse_error(const cursor_t *c, const char *what)
{
    fprintf(stderr, "error: %s:%" PRIu64 ": %s\n", c->path, c->line, what);
    return -1;
}

/* Next whitespace-separated field, NUL-terminated in place; NULL at the end of the line. */
static char *next_field(cursor_t *c)
{
    while (is_space(*c->p)) c->p++;
    if (*c->p == '\0') return NULL;
    char *start = c->p;
    while (*c->p && !is_space(*c->p)) c->p++;
    if (*c->p) *c->p++ = '\0';
    return start;
}

static int field_u64(cursor_t *c, const char *what, uint64_t max, uint64_t *out)
{
    char msg[160];
    char *f = next_field(c);
    if (f == NULL) {
        snprintf(msg, sizeof(msg), "missing %s", what);
        return parse_error(c, msg);
    }
    char *end;
    errno = 0;
    unsigned long long v = strtoull(f, &end, 10);
    if (*f == '-' || *f == '+' || errno != 0 || *end != '\0' || v > max) {
        snprintf(msg, sizeof(msg), "bad %s '%.40s' (expected 0..%" PRIu64 ")", what, f, max);
        return parse_error(c, msg);
    }
    *out = v;
    return 0;
}

static int field_token(cursor_t *c, uint64_t index, uint64_t count, int32_t *out)
{
    char msg[160];
    char *f = next_field(c);
    if (f == NULL) {
        snprintf(msg, sizeof(msg), "expected %" PRIu64 " tokens, found %" PRIu64, count, index);
        return parse_error(c, msg);
    }
    char *end;
    errno = 0;
    long long v = strtoll(f, &end, 10);
    if (errno != 0 || *end != '\0' || end == f || v < INT32_MIN || v > INT32_MAX) {
        snprintf(msg, sizeof(msg), "bad token '%.40s' (expected an int32)", f);
        return parse_error(c, msg);
    }
    *out = (int32_t) v;
    return 0;
}

static int expect_end(cursor_t *c)
{
    char *f = next_field(c);
    if (f == NULL) return 0;
    char msg[160];
    snprintf(msg, sizeof(msg), "unexpected extra field '%.40s'", f);
    return parse_error(c, msg);
}

enum { MAX_WORKLOADS = 64, MAX_KEY_TOKENS = 1 << 26 };

static int section_check(const cursor_t *c, const workload_t *w)
{
    if (w->nmatches > 0) return 0;
    char msg[160];
    snprintf(msg, sizeof(msg), "workload '%s' has no match line", w->name);
    return parse_error(c, msg);
}

/* Parses one operation line (not a comment, not a workload line) into w. */
static int parse_op(cursor_t *c, const char *word, workload_t *w)
{
    op_t op = {.line = c->line};
    char msg[200];
    if (strcmp(word, "match") == 0 || strcmp(word, "insert") == 0) {
        op.kind = word[0] == 'm' ? OP_MATCH : OP_INSERT;
        uint64_t n;
        if (field_u64(c, "namespace", UINT64_MAX, &op.ns) != 0 ||
            field_u64(c, "token count", MAX_KEY_TOKENS, &n) != 0)
            return -1;
        size_t o = reserve_toks(w, n);
        if (o == SIZE_MAX) return parse_error(c, "out of memory");
        for (uint64_t i = 0; i < n; i++)
            if (field_token(c, i, n, w->toks + o + i) != 0) return -1;
        if (next_field(c) != NULL) {
            snprintf(msg, sizeof(msg), "more tokens than the %" PRIu64 " announced", n);
            return parse_error(c, msg);
        }
        op.tok = o;
        op.len = n;
    } else if (strcmp(word, "lock") == 0 || strcmp(word, "unlock") == 0) {
        op.kind = word[0] == 'l' ? OP_LOCK : OP_UNLOCK;
        if (field_u64(c, "handle", UINT64_MAX, &op.arg) != 0 || expect_end(c) != 0) return -1;
        if (op.arg >= w->nhandles) {
            snprintf(msg, sizeof(msg),
                     "handle %" PRIu64 " does not name an earlier match or insert line of "
                     "workload '%s' (%zu so far)",
                     op.arg, w->name, w->nhandles);
            return parse_error(c, msg);
        }
    } else if (strcmp(word, "evict") == 0) {
        op.kind = OP_EVICT;
        if (field_u64(c, "page count", UINT64_MAX, &op.arg) != 0 || expect_end(c) != 0) return -1;
    } else {
        snprintf(msg, sizeof(msg), "unknown operation '%.40s'", word);
        return parse_error(c, msg);
    }
    if (push_op(w, op) != 0) return parse_error(c, "out of memory");
    return 0;
}

/* Reads a trace into workloads; 0, or -1 after printing the error with its line. */
static int trace_read(const char *path, workload_t *ws, size_t *nw_p)
{
    FILE *f = fopen(path, "r");
    if (f == NULL) {
        fprintf(stderr, "error: cannot open trace '%s': %s\n", path, strerror(errno));
        return -1;
    }
    cursor_t c = {.path = path};
    char *buf = NULL; /* getline's buffer comes from libc's malloc */
    size_t bufcap = 0;
    size_t nw = 0;
    int rc = -1;
    while (getline(&buf, &bufcap, f) >= 0) {
        c.line++;
        c.p = buf;
        char *word = next_field(&c);
        if (word == NULL || word[0] == '#') continue;
        if (strcmp(word, "workload") == 0) {
            char *name = next_field(&c);
            if (name == NULL) {
                parse_error(&c, "missing workload name");
                goto out;
            }
            if (expect_end(&c) != 0) goto out;
            if (nw > 0 && section_check(&c, &ws[nw - 1]) != 0) goto out;
            if (nw == MAX_WORKLOADS) {
                parse_error(&c, "too many workloads");
                goto out;
            }
            snprintf(ws[nw++].name, sizeof(ws[0].name), "%s", name);
            continue;
        }
        if (nw == 0) snprintf(ws[nw++].name, sizeof(ws[0].name), "trace");
        if (parse_op(&c, word, &ws[nw - 1]) != 0) goto out;
    }
    if (ferror(f)) {
        fprintf(stderr, "error: reading trace '%s': %s\n", path, strerror(errno));
        goto out;
    }
    c.line++;
    if (nw == 0) {
        parse_error(&c, "the trace has no operations");
        goto out;
    }
    if (section_check(&c, &ws[nw - 1]) != 0) goto out;
    rc = 0;
out:
    free(buf);
    fclose(f);
    *nw_p = nw;
    return rc;
}

static void put_key(FILE *f, const char *word, const op_t *op, const int32_t *toks)
{
    fprintf(f, "%s %" PRIu64 " %zu", word, op->ns, op->len);
    char buf[16];
    for (size_t i = 0; i < op->len; i++) {
        /* Hand-rolled formatting: traces run to tens of millions of tokens. */
        int64_t v = toks[op->tok + i];
        char *e = buf + sizeof(buf), *p = e;
        uint64_t u = v < 0 ? (uint64_t) (-v) : (uint64_t) v;
        do *--p = (char) ('0' + u % 10);
        while ((u /= 10) != 0);
        if (v < 0) *--p = '-';
        *--p = ' ';
        fwrite(p, 1, (size_t) (e - p), f);
    }
    fputc('\n', f);
}

static int trace_write(const char *path, const workload_t *ws, size_t nw, const char *origin)
{
    FILE *f = fopen(path, "w");
    if (f == NULL) {
        fprintf(stderr, "error: cannot create trace '%s': %s\n", path, strerror(errno));
        return -1;
    }
    fprintf(f, "# kvstage radix trace v1: one operation per line, see docs/radix-trace.md\n");
    fprintf(f, "# %s\n", origin);
    for (size_t i = 0; i < nw; i++) {
        const workload_t *w = &ws[i];
        fprintf(f, "workload %s\n", w->name);
        for (size_t k = 0; k < w->nops; k++) {
            const op_t *op = &w->ops[k];
            switch (op->kind) {
            case OP_MATCH:
                put_key(f, "match", op, w->toks);
                break;
            case OP_INSERT:
                put_key(f, "insert", op, w->toks);
                break;
            case OP_LOCK:
                fprintf(f, "lock %" PRIu64 "\n", op->arg);
                break;
            case OP_UNLOCK:
                fprintf(f, "unlock %" PRIu64 "\n", op->arg);
                break;
            case OP_EVICT:
                fprintf(f, "evict %" PRIu64 "\n", op->arg);
                break;
            }
        }
    }
    int bad = ferror(f);
    if (fclose(f) != 0 || bad) {
        fprintf(stderr, "error: writing trace '%s' failed\n", path);
        return -1;
    }
    return 0;
}

/* ---- the ideal hit rate: an infinite cache, from the workload alone ---- */

/* A set of 64-bit prefix hashes (open addressing; 0 marks an empty slot). A key's prefix of k
 * pages is identified by a chained hash of its namespace and pages: an independent computation
 * that shares nothing with the cache, so it also checks it (hit == ideal when nothing was
 * evicted). */
typedef struct {
    uint64_t *slot; /* [cap] */
    size_t cap;
} hset_t;

static uint64_t prefix_step(uint64_t h, const int32_t *page, uint32_t P)
{
    for (uint32_t i = 0; i < P; i++) h = kvs_mix64(h ^ (uint32_t) page[i]);
    return h ? h : 1;
}

static int hset_has_or_add(hset_t *s, uint64_t h, int add)
{
    size_t i = h & (s->cap - 1);
    while (s->slot[i] != 0) {
        if (s->slot[i] == h) return 1;
        i = (i + 1) & (s->cap - 1);
    }
    if (add) s->slot[i] = h;
    return 0;
}

static int ideal_matched(const workload_t *w, uint32_t P, uint64_t *matched_p)
{
    size_t pages = 0;
    for (size_t k = 0; k < w->nops; k++)
        if (w->ops[k].kind == OP_INSERT) pages += w->ops[k].len / P;
    hset_t s = {.cap = 16};
    while (s.cap < 2 * pages + 16) s.cap *= 2;
    s.slot = kvs_calloc(s.cap, sizeof(uint64_t));
    if (s.slot == NULL) return -1;
    uint64_t matched = 0;
    for (size_t k = 0; k < w->nops; k++) {
        const op_t *op = &w->ops[k];
        if (op->kind != OP_MATCH && op->kind != OP_INSERT) continue;
        uint64_t h = kvs_mix64(op->ns);
        size_t n = op->len / P;
        for (size_t p = 0; p < n; p++) {
            h = prefix_step(h, w->toks + op->tok + p * P, P);
            int had = hset_has_or_add(&s, h, op->kind == OP_INSERT);
            if (op->kind == OP_MATCH) {
                if (!had) break;
                matched += P;
            }
        }
    }
    kvs_free(s.slot);
    *matched_p = matched;
    return 0;
}

/* ---- the pool: page ids from a counter and a free list, capacity-bounded ---- */

typedef struct {
    uint64_t capacity;
    uint32_t *free_ids; /* [slots] released ids, reused first */
    size_t nfree;
    uint64_t next;  /* ids below next were handed out at least once */
    uint8_t *held;  /* [slots] 1 while allocated: catches double frees */
    uint64_t slots; /* min(capacity, the most the workload can hold at once) */
    uint64_t in_use;
    uint64_t bad; /* releases of ids not allocated */
} pool_t;

static int pool_init(pool_t *p, uint64_t capacity, uint64_t bound)
{
    memset(p, 0, sizeof(*p));
    p->capacity = capacity;
    p->slots = capacity < bound ? capacity : bound;
    if (p->slots > UINT32_MAX) return -1;
    p->free_ids = kvs_malloc((p->slots + 1) * sizeof(uint32_t));
    p->held = kvs_calloc(p->slots + 1, 1);
    return p->free_ids && p->held ? 0 : -1;
}

static void pool_fini(pool_t *p)
{
    kvs_free(p->free_ids);
    kvs_free(p->held);
}

static uint64_t pool_available(const pool_t *p)
{
    return p->slots - p->in_use;
}

static uint32_t pool_alloc(pool_t *p)
{
    uint32_t id = p->nfree > 0 ? p->free_ids[--p->nfree] : (uint32_t) p->next++;
    p->held[id] = 1;
    p->in_use++;
    return id;
}

static void pool_release(void *arg, const uint32_t *pages, size_t count)
{
    pool_t *p = arg;
    for (size_t i = 0; i < count; i++) {
        uint32_t id = pages[i];
        if (id >= p->next || !p->held[id]) {
            p->bad++;
            continue;
        }
        p->held[id] = 0;
        p->free_ids[p->nfree++] = id;
        p->in_use--;
    }
}

/* ---- running a workload ---- */

typedef struct {
    uint64_t requests, lookup_tokens, matched_tokens, ideal_tokens;
    uint64_t ops, evicted_pages, inserted_pages, skipped_inserts;
    uint64_t capacity;
    double seconds; /* best of the repeats */
} result_t;

typedef struct {
    kvs_radix_node_t *node; /* NULL: produced by a skipped insert */
    uint64_t locks;         /* locks this handle holds */
    uint64_t epoch;         /* eviction epoch when the node was last known alive */
    int root;               /* names the root (nothing matched or inserted): never evicted */
} handle_t;

typedef struct {
    const char *src; /* trace path, or NULL for built-in */
    const workload_t *w;
    uint32_t P;
    kvs_radix_t *radix;
    pool_t pool;
    handle_t *handles; /* [w->nhandles] */
    uint32_t *pages;   /* [longest key / P] scratch for insert */
    uint32_t *matched; /* [longest key / P] pages of the last match */
    uint64_t epoch;    /* bumps whenever something was evicted */
    size_t last_match; /* handle of the most recent match, SIZE_MAX before one */
    const op_t *last_match_op;
    size_t last_matched_pages;
    result_t res;
} runner_t;

static int run_error(const runner_t *rn, const op_t *op, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* A failed run: the operation's trace line (or its index in a built-in workload) and why. */
static int run_error(const runner_t *rn, const op_t *op, const char *fmt, ...)
{
    if (rn->src)
        fprintf(stderr, "error: %s:%" PRIu64 ": ", rn->src, op->line);
    else
        fprintf(stderr, "error: workload %s, operation %zu: ", rn->w->name,
                (size_t) (op - rn->w->ops));
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    return -1;
}

static uint64_t evict(runner_t *rn, uint64_t pages)
{
    uint64_t got = kvs_radix_evict(rn->radix, pages);
    rn->res.ops++;
    rn->res.evicted_pages += got;
    if (got > 0) rn->epoch++;
    return got;
}

static int run_insert(runner_t *rn, const op_t *op, size_t h)
{
    const int32_t *key = rn->w->toks + op->tok;
    size_t n = op->len / rn->P;
    /* Reuse the pages of the most recent match when it still holds a lock (so its pages are
     * still cached) and covers the start of this key: the engine computed only the rest. */
    size_t m = 0;
    const op_t *mo = rn->last_match_op;
    if (mo != NULL && mo->ns == op->ns && rn->handles[rn->last_match].locks > 0) {
        size_t mt = rn->last_matched_pages * rn->P;
        if (mt <= op->len &&
            (mo->tok == op->tok || memcmp(rn->w->toks + mo->tok, key, mt * sizeof(int32_t)) == 0))
            m = rn->last_matched_pages;
    }
    size_t need = n - m;
    if (pool_available(&rn->pool) < need) evict(rn, need - pool_available(&rn->pool));
    if (pool_available(&rn->pool) < need) {
        rn->res.skipped_inserts++;
        rn->handles[h].node = NULL;
        return 0;
    }
    memcpy(rn->pages, rn->matched, m * sizeof(uint32_t));
    for (size_t i = m; i < n; i++) rn->pages[i] = pool_alloc(&rn->pool);
    size_t present;
    kvs_radix_node_t *node;
    kvs_status_t st = kvs_radix_insert(rn->radix, op->ns, key, op->len, rn->pages, &present, &node);
    rn->res.ops++;
    if (st != KVS_OK) {
        pool_release(&rn->pool, rn->pages + m, n - m);
        return run_error(rn, op, "insert failed: %s", kvs_status_str(st));
    }
    size_t pp = present / rn->P;
    if (pp < m) return run_error(rn, op, "insert found less than the locked match");
    pool_release(&rn->pool, rn->pages + m, pp - m); /* computed twice: the cache had them */
    rn->res.inserted_pages += n - pp;
    rn->handles[h] = (handle_t){.node = node, .epoch = rn->epoch, .root = n == 0};
    return 0;
}

static int run_op(runner_t *rn, const op_t *op, size_t *next_handle)
{
    switch (op->kind) {
    case OP_MATCH: {
        size_t h = (*next_handle)++;
        kvs_radix_match_t m;
        kvs_status_t st =
            kvs_radix_match(rn->radix, op->ns, rn->w->toks + op->tok, op->len, rn->matched, &m);
        rn->res.ops++;
        if (st != KVS_OK) return run_error(rn, op, "match failed: %s", kvs_status_str(st));
        rn->res.requests++;
        rn->res.lookup_tokens += op->len;
        rn->res.matched_tokens += m.tokens;
        rn->handles[h] = (handle_t){.node = m.node, .epoch = rn->epoch, .root = m.tokens == 0};
        rn->last_match = h;
        rn->last_match_op = op;
        rn->last_matched_pages = m.tokens / rn->P;
        return 0;
    }
    case OP_INSERT:
        return run_insert(rn, op, (*next_handle)++);
    case OP_LOCK: {
        handle_t *hd = &rn->handles[op->arg];
        if (hd->node == NULL)
            return run_error(rn, op, "lock of handle %" PRIu64 ", whose insert was skipped",
                             op->arg);
        if (hd->locks == 0 && hd->epoch != rn->epoch && !hd->root)
            return run_error(rn, op,
                             "lock of handle %" PRIu64
                             ", which holds no lock and may have been evicted since",
                             op->arg);
        kvs_radix_lock(rn->radix, hd->node);
        rn->res.ops++;
        hd->locks++;
        return 0;
    }
    case OP_UNLOCK: {
        handle_t *hd = &rn->handles[op->arg];
        if (hd->locks == 0)
            return run_error(rn, op, "unlock of handle %" PRIu64 ", which holds no lock", op->arg);
        kvs_status_t st = kvs_radix_unlock(rn->radix, hd->node);
        rn->res.ops++;
        if (st != KVS_OK) return run_error(rn, op, "unlock failed: %s", kvs_status_str(st));
        if (--hd->locks == 0) hd->epoch = rn->epoch;
        return 0;
    }
    case OP_EVICT:
        evict(rn, op->arg);
        return 0;
    }
    return 0;
}

/* One pass over the workload from an empty cache; checks the pool afterwards. */
static int run_once(runner_t *rn, double *seconds_p)
{
    const workload_t *w = rn->w;
    memset(&rn->res, 0, sizeof(rn->res));
    memset(rn->handles, 0, w->nhandles * sizeof(handle_t));
    rn->epoch = 0;
    rn->last_match_op = NULL;
    rn->last_match = SIZE_MAX;
    if (kvs_radix_create(rn->P, pool_release, &rn->pool, &rn->radix) != KVS_OK) return -1;
    size_t next_handle = 0;
    int rc = 0;
    uint64_t t0 = kvs_now_ns();
    for (size_t k = 0; k < w->nops && rc == 0; k++) rc = run_op(rn, &w->ops[k], &next_handle);
    uint64_t t1 = kvs_now_ns();
    kvs_radix_destroy(rn->radix);
    rn->radix = NULL;
    *seconds_p = (double) (t1 - t0) * 1e-9;
    if (rc == 0 && (rn->pool.in_use != 0 || rn->pool.bad != 0)) {
        fprintf(stderr,
                "error: workload %s: page accounting broken (%" PRIu64 " pages never returned, "
                "%" PRIu64 " bad releases)\n",
                w->name, rn->pool.in_use, rn->pool.bad);
        rc = -1;
    }
    return rc;
}

static int run_workload(const workload_t *w, const char *src, uint32_t P, uint64_t capacity,
                        uint32_t repeat, result_t *res_p)
{
    runner_t rn = {.src = src, .w = w, .P = P};
    uint64_t bound = 0;
    size_t longest = 1;
    for (size_t k = 0; k < w->nops; k++) {
        const op_t *op = &w->ops[k];
        if (op->kind == OP_INSERT) bound += op->len / P;
        if ((op->kind == OP_INSERT || op->kind == OP_MATCH) && op->len / P > longest)
            longest = op->len / P;
    }
    if (capacity == 0) capacity = bound > 0 ? bound : 1;
    int rc = -1;
    rn.handles = kvs_calloc(w->nhandles + 1, sizeof(handle_t));
    rn.pages = kvs_malloc(longest * sizeof(uint32_t));
    rn.matched = kvs_malloc(longest * sizeof(uint32_t));
    if (rn.handles == NULL || rn.pages == NULL || rn.matched == NULL) {
        fprintf(stderr, "error: workload %s: out of memory\n", w->name);
        goto out;
    }
    result_t best = {0};
    for (uint32_t r = 0; r < repeat; r++) {
        /* A fresh pool per pass keeps page ids, and so every pass, identical. */
        pool_fini(&rn.pool);
        if (pool_init(&rn.pool, capacity, bound) != 0) {
            fprintf(stderr, "error: workload %s: cannot allocate a pool of %" PRIu64 " pages\n",
                    w->name, rn.pool.slots);
            goto out;
        }
        double s;
        if (run_once(&rn, &s) != 0) goto out;
        if (r == 0 || s < best.seconds) {
            best = rn.res;
            best.seconds = s;
        }
    }
    best.capacity = capacity;
    if (ideal_matched(w, P, &best.ideal_tokens) != 0) {
        fprintf(stderr, "error: workload %s: out of memory\n", w->name);
        goto out;
    }
    if (best.evicted_pages == 0 && best.skipped_inserts == 0 &&
        best.matched_tokens != best.ideal_tokens) {
        fprintf(stderr,
                "error: workload %s: nothing was evicted but the cache matched %" PRIu64
                " tokens where the ideal is %" PRIu64 "\n",
                w->name, best.matched_tokens, best.ideal_tokens);
        goto out;
    }
    *res_p = best;
    rc = 0;
out:
    pool_fini(&rn.pool);
    kvs_free(rn.handles);
    kvs_free(rn.pages);
    kvs_free(rn.matched);
    return rc;
}

/* ---- output ---- */

static const char *si(double v, char *buf, size_t size)
{
    const char *unit = "";
    if (v >= 1e9)
        v /= 1e9, unit = " G";
    else if (v >= 1e6)
        v /= 1e6, unit = " M";
    else if (v >= 1e3)
        v /= 1e3, unit = " k";
    snprintf(buf, size, "%.2f%s", v, unit);
    return buf;
}

static double ratio(uint64_t a, uint64_t b)
{
    return b ? (double) a / (double) b : 0.0;
}

static double per_s(uint64_t n, double s)
{
    return s > 0 ? (double) n / s : 0.0;
}

typedef struct {
    uint32_t page_size;
    uint64_t capacity;
    uint64_t seed;
    double scale;
    uint32_t repeat;
    int json;
    int workload; /* 0: all, else builtins[workload - 1] */
    const char *trace;
    const char *dump;
} bench_cfg_t;

static void print_text(const bench_cfg_t *cfg, const workload_t *ws, const result_t *res, size_t nw)
{
    char model[256], a[32], b[32];
    long cores;
    kvs_bench_cpu_info(model, sizeof(model), &cores);
    printf("kvstage bench radix: page size %u tokens, ", cfg->page_size);
    if (cfg->trace)
        printf("trace %s", cfg->trace);
    else
        printf("built-in workloads (seed %" PRIu64 ", scale %g)", cfg->seed, cfg->scale);
    printf(", fastest of %u runs\n", cfg->repeat);
    printf("hardware: %s, %ld cores (the benchmark uses one)\n\n", model, cores);
    printf("%-16s %9s %13s %9s %9s %14s %12s %10s %9s\n", "workload", "requests", "prompt tokens",
           "hit rate", "ideal", "matched tok/s", "ops/s", "capacity", "evicted");
    for (size_t i = 0; i < nw; i++) {
        const result_t *r = &res[i];
        printf("%-16s %9" PRIu64 " %13" PRIu64 " %8.2f%% %8.2f%% %14s %12s %10" PRIu64 " %9" PRIu64
               "\n",
               ws[i].name, r->requests, r->lookup_tokens,
               100.0 * ratio(r->matched_tokens, r->lookup_tokens),
               100.0 * ratio(r->ideal_tokens, r->lookup_tokens),
               si(per_s(r->matched_tokens, r->seconds), a, sizeof(a)),
               si(per_s(r->ops, r->seconds), b, sizeof(b)), r->capacity, r->evicted_pages);
        if (r->skipped_inserts)
            printf("%-16s %" PRIu64
                   " inserts skipped: too few pages even after evicting all unlocked ones\n",
                   "", r->skipped_inserts);
    }
    printf("\nhit rate = matched / prompt tokens; ideal = an infinite cache at this page size "
           "(computed from the workload);\nops = cache calls (match, insert, lock, unlock, "
           "evict); capacity in pages (default: no eviction).\n");
}

static void print_json(const bench_cfg_t *cfg, const workload_t *ws, const result_t *res, size_t nw)
{
    char model[256];
    long cores;
    kvs_bench_cpu_info(model, sizeof(model), &cores);
    kvs_json_t j;
    kvs_json_begin(&j, stdout);
    kvs_json_str(&j, "bench", "radix");
    kvs_json_str(&j, "cpu", model);
    kvs_json_i64(&j, "cores", cores);
    kvs_json_u64(&j, "page_size", cfg->page_size);
    if (cfg->trace) {
        kvs_json_str(&j, "trace", cfg->trace);
    } else {
        kvs_json_u64(&j, "seed", cfg->seed);
        kvs_json_double(&j, "scale", cfg->scale);
    }
    kvs_json_u64(&j, "repeat", cfg->repeat);
    kvs_json_array_begin(&j, "workloads");
    for (size_t i = 0; i < nw; i++) {
        const result_t *r = &res[i];
        kvs_json_object_begin(&j, NULL);
        kvs_json_str(&j, "name", ws[i].name);
        kvs_json_u64(&j, "requests", r->requests);
        kvs_json_u64(&j, "lookup_tokens", r->lookup_tokens);
        kvs_json_u64(&j, "matched_tokens", r->matched_tokens);
        kvs_json_u64(&j, "ideal_matched_tokens", r->ideal_tokens);
        kvs_json_double(&j, "hit_rate", ratio(r->matched_tokens, r->lookup_tokens));
        kvs_json_double(&j, "ideal_hit_rate", ratio(r->ideal_tokens, r->lookup_tokens));
        kvs_json_double(&j, "seconds", r->seconds);
        kvs_json_double(&j, "matched_tokens_per_s", per_s(r->matched_tokens, r->seconds));
        kvs_json_u64(&j, "ops", r->ops);
        kvs_json_double(&j, "ops_per_s", per_s(r->ops, r->seconds));
        kvs_json_u64(&j, "capacity_pages", r->capacity);
        kvs_json_u64(&j, "inserted_pages", r->inserted_pages);
        kvs_json_u64(&j, "evicted_pages", r->evicted_pages);
        kvs_json_u64(&j, "skipped_inserts", r->skipped_inserts);
        kvs_json_object_end(&j);
    }
    kvs_json_array_end(&j);
    kvs_json_end(&j);
}

/* ---- the command ---- */

static const char USAGE[] = "kvstage bench radix [flags]";

/* bench_cfg_t and which flags were given, for the checks. */
typedef struct {
    bench_cfg_t cfg;
    int seen_workload, seen_seed, seen_scale;
} radix_opts_t;

static void radix_flags(kvs_arg_table_t *t, radix_opts_t *o)
{
    bench_cfg_t *cfg = &o->cfg;
    const kvs_arg_t g[] = {
        {"workload", KVS_ARG_CHOICE, &cfg->workload, "built-in workload(s) to run",
         "all|shared-prefix|multi-turn|few-shot", &o->seen_workload},
        {"page-size", KVS_ARG_U32, &cfg->page_size, "tokens per page (default 16)", "[1,1048576]",
         NULL},
        {"capacity-pages", KVS_ARG_U64, &cfg->capacity,
         "pool pages; evict when an allocation would exceed it (default 0: no eviction)", NULL,
         NULL},
        {"seed", KVS_ARG_U64, &cfg->seed, "workload generator seed (default 1)", NULL,
         &o->seen_seed},
        {"scale", KVS_ARG_DOUBLE, &cfg->scale,
         "scale the number of requests (groups, clients, questions); default 1", "(0,1000]",
         &o->seen_scale},
        {"repeat", KVS_ARG_U32, &cfg->repeat,
         "timed passes per workload, the fastest reported (default 5)", "[1,1000]", NULL},
        {"json", KVS_ARG_FLAG, &cfg->json, "print JSON instead of a table", NULL, NULL},
        {"trace", KVS_ARG_STR, &cfg->trace, "replay this trace file instead of the built-ins", NULL,
         NULL},
        {"dump-trace", KVS_ARG_STR, &cfg->dump,
         "write the workloads as a trace file (docs/radix-trace.md), then run", NULL, NULL},
    };
    KVS_ARG_TABLE_ADD(t, g);
}

/* 0, or EXIT_USAGE after the error and the usage. */
static int check_opts(const radix_opts_t *o, const kvs_arg_table_t *t)
{
    const bench_cfg_t *cfg = &o->cfg;
    const char *bad = NULL;
    (void) t; /* the ranges are the table's */
    if (cfg->trace && (o->seen_workload || o->seen_seed || o->seen_scale))
        bad = "replays a file: --workload, --seed and --scale do not apply";
    if (bad == NULL) return 0;
    kvs_args_error("--trace", "--trace alone, or the built-in workloads' flags", "%s", bad);
    return EXIT_USAGE;
}

/* The trace, or the selected built-ins, into ws; *nw_p counts every workload to free, also
 * after a failure. 0, EXIT_USAGE for a bad trace, EXIT_RUN_FAILED (said why). */
static int load_workloads(const bench_cfg_t *cfg, workload_t *ws, size_t *nw_p)
{
    if (cfg->trace) return trace_read(cfg->trace, ws, nw_p) != 0 ? EXIT_USAGE : 0;
    for (int b = 0; b < NBUILTINS; b++) {
        if (cfg->workload != 0 && cfg->workload != b + 1) continue;
        workload_t *w = &ws[(*nw_p)++];
        snprintf(w->name, sizeof(w->name), "%s", builtins[b].name);
        kvs_rng_t rng;
        kvs_rng_seed(&rng, kvs_mix64(cfg->seed) ^ (uint64_t) b);
        if (builtins[b].build(w, &rng, cfg->scale) != 0) {
            fprintf(stderr, "error: out of memory building workload %s\n", w->name);
            return EXIT_RUN_FAILED;
        }
    }
    return 0;
}

/* --dump-trace: the workloads as a trace file, with where they came from; 0 or -1. */
static int dump_workloads(const bench_cfg_t *cfg, const workload_t *ws, size_t nw)
{
    char origin[256];
    if (cfg->trace)
        snprintf(origin, sizeof(origin), "replayed from %s", cfg->trace);
    else
        snprintf(origin, sizeof(origin),
                 "kvstage bench radix built-in workloads, --seed %" PRIu64 " --scale %g", cfg->seed,
                 cfg->scale);
    return trace_write(cfg->dump, ws, nw, origin);
}

/* Loads (and dumps) the workloads, runs each and prints the results; the exit code. */
static int bench_radix_run(const bench_cfg_t *cfg, workload_t *ws, result_t *res, size_t *nw_p)
{
    int rc = load_workloads(cfg, ws, nw_p);
    if (rc != 0) return rc;
    const size_t nw = *nw_p;
    if (cfg->dump && dump_workloads(cfg, ws, nw) != 0) return EXIT_RUN_FAILED;
    for (size_t i = 0; i < nw; i++)
        if (run_workload(&ws[i], cfg->trace, cfg->page_size, cfg->capacity, cfg->repeat, &res[i]) !=
            0)
            return EXIT_RUN_FAILED;
    if (cfg->json)
        print_json(cfg, ws, res, nw);
    else
        print_text(cfg, ws, res, nw);
    return 0;
}

int kvs_bench_radix(int argc, char **argv)
{
    radix_opts_t o = {.cfg = {.page_size = 16, .seed = 1, .scale = 1.0, .repeat = 5}};
    kvs_arg_table_t t = {.count = 0};
    radix_flags(&t, &o);
    int rc = kvs_arg_table_parse(&t, USAGE, argc, argv, 1);
    if (rc == KVS_ARGS_HELP) return 0;
    if (rc != KVS_ARGS_OK) return EXIT_USAGE;
    if ((rc = check_opts(&o, &t)) != 0) return rc;

    workload_t *ws = kvs_calloc(MAX_WORKLOADS, sizeof(workload_t));
    result_t *res = kvs_calloc(MAX_WORKLOADS, sizeof(result_t));
    size_t nw = 0;
    if (ws == NULL || res == NULL) {
        fprintf(stderr, "error: out of memory\n");
        rc = EXIT_RUN_FAILED;
    } else {
        rc = bench_radix_run(&o.cfg, ws, res, &nw);
    }
    if (ws)
        for (size_t i = 0; i < nw; i++) workload_free(&ws[i]);
    kvs_free(ws);
    kvs_free(res);
    return rc;
}
