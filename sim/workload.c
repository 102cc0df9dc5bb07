/* Seeded request workloads with a known sharing structure, so simulations exercise radix hits of
 * every shape: long shared prefixes, growing conversations, no sharing, and hits that end at
 * random (non page-aligned) places. */
#include <string.h>

#include "kvstage/alloc.h"
#include "kvstage/log.h"
#include "kvstage/rng.h"
#include "sim/sim.h"

static const char *const kind_names[] = {"shared-prefix", "multi-turn", "random", "needle"};

const char *kvs_workload_kind_str(kvs_workload_kind_t kind)
{
    if ((unsigned) kind >= sizeof(kind_names) / sizeof(kind_names[0])) return "unknown";
    return kind_names[kind];
}

kvs_status_t kvs_workload_kind_parse(const char *name, kvs_workload_kind_t *kind_p)
{
    for (unsigned i = 0; i < sizeof(kind_names) / sizeof(kind_names[0]); i++) {
        if (strcmp(name, kind_names[i]) == 0) {
            *kind_p = (kvs_workload_kind_t) i;
            return KVS_OK;
        }
    }
    kvs_error("workload: unknown kind '%s' (expected shared-prefix, multi-turn, random or "
              "needle)",
              name);
    return KVS_ERR_INVALID;
}

/* Generation state: prompts are appended to a growing token buffer. */
typedef struct {
    kvs_rng_t rng;
    int32_t *tokens; /* [cap] */
    uint64_t used, cap;
    int32_t next_marker; /* next unique marker id (>= KVS_WORKLOAD_VOCAB) */
} gen_t;

static int32_t gen_vocab(gen_t *g)
{
    return (int32_t) kvs_rng_below(&g->rng, KVS_WORKLOAD_VOCAB);
}

static int32_t gen_marker(gen_t *g)
{
    return g->next_marker++;
}

static void gen_random(gen_t *g, int32_t *out, uint64_t n)
{
    for (uint64_t i = 0; i < n; i++) out[i] = gen_vocab(g);
}

static uint32_t default_groups(const kvs_workload_config_t *c)
{
    if (c->groups != 0) return c->groups;
    switch (c->kind) {
    case KVS_WORKLOAD_SHARED_PREFIX:
        return c->requests / 64 + 1;
    case KVS_WORKLOAD_MULTI_TURN:
        return c->requests / 8 + 1;
    case KVS_WORKLOAD_NEEDLE:
        return 1;
    case KVS_WORKLOAD_RANDOM:
        return 1;
    }
    return 1;
}

static kvs_status_t validate(const kvs_workload_config_t *c)
{
    if (c->requests == 0 || c->prompt_len == 0) {
        kvs_error("workload: requests (%u) and prompt_len (%u) must be > 0", c->requests,
                  c->prompt_len);
        return KVS_ERR_INVALID;
    }
    if ((unsigned) c->kind >= sizeof(kind_names) / sizeof(kind_names[0])) {
        kvs_error("workload: unknown kind %d", (int) c->kind);
        return KVS_ERR_INVALID;
    }
    if (c->kind == KVS_WORKLOAD_SHARED_PREFIX && c->prefix_len >= c->prompt_len) {
        kvs_error("workload: shared-prefix needs prefix_len (%u) < prompt_len (%u)", c->prefix_len,
                  c->prompt_len);
        return KVS_ERR_INVALID;
    }
    if (c->repeat_permille > 1000) {
        kvs_error("workload: repeat_permille %u is above 1000", c->repeat_permille);
        return KVS_ERR_INVALID;
    }
    return KVS_OK;
}

/* Fills one request's tokens (at most prompt_len of them, into out) and returns its length.
 * `state` holds the per-group material: shared prefixes, documents or conversations. */
typedef struct {
    int32_t *group_tokens; /* [groups][prompt_len]: prefix, document or conversation so far */
    uint32_t *group_len;   /* [groups]: multi-turn conversation length (0 = none yet) */
    int64_t *group_last;   /* [groups]: multi-turn: index of the conversation's last turn */
} groups_t;

static uint32_t make_shared_prefix(const kvs_workload_config_t *c, gen_t *g, groups_t *gs,
                                   uint32_t group, int32_t *out)
{
    /* Tails take the upper three quarters of the room left after the prefix, so prompts
     * span about prefix + (prompt - prefix) / 4 .. prompt. */
    uint32_t room = c->prompt_len - c->prefix_len;
    uint32_t len = (uint32_t) kvs_rng_range(&g->rng, c->prefix_len + 1 + room / 4, c->prompt_len);
    memcpy(out, gs->group_tokens + (size_t) group * c->prompt_len,
           (size_t) c->prefix_len * sizeof(int32_t));
    out[c->prefix_len] = gen_marker(g); /* the tail is unique from its first token */
    gen_random(g, out + c->prefix_len + 1, len - c->prefix_len - 1);
    return len;
}

static uint32_t make_needle(const kvs_workload_config_t *c, gen_t *g, groups_t *gs, uint32_t group,
                            int32_t *out)
{
    uint32_t len = c->prompt_len;
    uint32_t needle = (uint32_t) kvs_rng_range(&g->rng, 1, len < 8 ? len : 8);
    uint32_t at = (uint32_t) kvs_rng_range(&g->rng, 0, len - needle);
    const int32_t *doc = gs->group_tokens + (size_t) group * c->prompt_len;
    memcpy(out, doc, (size_t) at * sizeof(int32_t));
    for (uint32_t i = 0; i < needle; i++) out[at + i] = gen_marker(g);
    memcpy(out + at + needle, doc + at, (size_t) (len - at - needle) * sizeof(int32_t));
    return len;
}

/* A conversation grows by an answer (what the model said) and the user's next message; when
 * that would not fit, the client starts a new conversation. */
static uint32_t make_turn(const kvs_workload_config_t *c, gen_t *g, groups_t *gs, uint32_t group,
                          int32_t *out, int64_t *parent_p)
{
    int32_t *conv = gs->group_tokens + (size_t) group * c->prompt_len;
    uint32_t cur = gs->group_len[group];
    uint32_t answer = (uint32_t) kvs_rng_range(&g->rng, 16, 64);
    uint32_t user = (uint32_t) kvs_rng_range(&g->rng, 16, 128);
    if (cur == 0 || (uint64_t) cur + answer + user > c->prompt_len) {
        uint32_t lo = c->prompt_len / 8 ? c->prompt_len / 8 : 1;
        uint32_t hi = c->prompt_len / 4 > lo ? c->prompt_len / 4 : lo;
        cur = (uint32_t) kvs_rng_range(&g->rng, lo, hi);
        conv[0] = gen_marker(g); /* a fresh conversation shares nothing */
        gen_random(g, conv + 1, cur - 1);
        *parent_p = -1;
    } else {
        gen_random(g, conv + cur, answer + user);
        cur += answer + user;
        *parent_p = gs->group_last[group];
    }
    gs->group_len[group] = cur;
    memcpy(out, conv, (size_t) cur * sizeof(int32_t));
    return cur;
}

kvs_status_t kvs_workload_create(const kvs_workload_config_t *config, kvs_workload_t **workload_p)
{
    kvs_status_t st = validate(config);
    if (st != KVS_OK) return st;
    const kvs_workload_config_t *c = config;
    uint32_t groups = default_groups(c);
    gen_t g = {.next_marker = KVS_WORKLOAD_VOCAB};
    kvs_rng_seed(&g.rng, c->seed);
    groups_t gs = {0};

    kvs_workload_t *w = kvs_calloc(1, sizeof(*w));
    if (w == NULL) goto err_nomem;
    w->config = *c;
    w->config.groups = groups;
    w->count = c->requests;
    w->requests = kvs_calloc(c->requests, sizeof(kvs_request_t));
    g.cap = (uint64_t) c->requests * c->prompt_len;
    g.tokens = kvs_malloc((size_t) g.cap * sizeof(int32_t));
    gs.group_tokens = kvs_malloc((size_t) groups * c->prompt_len * sizeof(int32_t));
    gs.group_len = kvs_calloc(groups, sizeof(uint32_t));
    gs.group_last = kvs_calloc(groups, sizeof(int64_t));
    if (w->requests == NULL || g.tokens == NULL || gs.group_tokens == NULL ||
        gs.group_len == NULL || gs.group_last == NULL)
        goto err_free;

    /* Shared prefixes and documents start with a marker so groups never share a token. */
    for (uint32_t i = 0; i < groups; i++) {
        int32_t *t = gs.group_tokens + (size_t) i * c->prompt_len;
        t[0] = gen_marker(&g);
        gen_random(&g, t + 1, c->prompt_len - 1);
    }

    for (uint32_t i = 0; i < c->requests; i++) {
        kvs_request_t *r = &w->requests[i];
        int32_t *out = g.tokens + g.used;
        r->index = i;
        /* kvs_mix64 is a bijection, so distinct indices give distinct (and arbitrary) ids. */
        r->room = kvs_mix64(c->seed * 0x9e3779b97f4a7c15ull + i);
        r->parent = -1;
        if (i > 0 && kvs_rng_chance(&g.rng, c->repeat_permille, 1000)) {
            const kvs_request_t *orig = &w->requests[kvs_rng_below(&g.rng, i)];
            memcpy(out, orig->tokens, (size_t) orig->len * sizeof(int32_t));
            r->len = orig->len;
            r->group = orig->group;
            r->parent = orig->index;
        } else {
            switch (c->kind) {
            case KVS_WORKLOAD_SHARED_PREFIX:
                r->group = (uint32_t) kvs_rng_below(&g.rng, groups);
                r->len = make_shared_prefix(c, &g, &gs, r->group, out);
                break;
            case KVS_WORKLOAD_MULTI_TURN:
                /* Clients take turns round-robin, as concurrent users do. */
                r->group = i % groups;
                r->len = make_turn(c, &g, &gs, r->group, out, &r->parent);
                gs.group_last[r->group] = i;
                break;
            case KVS_WORKLOAD_RANDOM:
                r->len = (uint32_t) kvs_rng_range(&g.rng, 1, c->prompt_len);
                gen_random(&g, out, r->len);
                break;
            case KVS_WORKLOAD_NEEDLE:
                r->group = (uint32_t) kvs_rng_below(&g.rng, groups);
                r->len = make_needle(c, &g, &gs, r->group, out);
                break;
            }
        }
        r->tokens = out;
        g.used += r->len;
    }
    w->tokens = g.tokens;
    kvs_free(gs.group_tokens);
    kvs_free(gs.group_len);
    kvs_free(gs.group_last);
    *workload_p = w;
    return KVS_OK;

err_free:
    kvs_free(gs.group_tokens);
    kvs_free(gs.group_len);
    kvs_free(gs.group_last);
    kvs_free(g.tokens);
    kvs_free(w->requests);
    kvs_free(w);
err_nomem:
    kvs_error("workload: out of memory for %u requests of up to %u tokens", c->requests,
              c->prompt_len);
    return KVS_ERR_NOMEM;
}

void kvs_workload_destroy(kvs_workload_t *workload)
{
    if (workload == NULL) return;
    kvs_free(workload->tokens);
    kvs_free(workload->requests);
    kvs_free(workload);
}
