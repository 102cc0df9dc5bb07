/* The prefill/decode router: an OpenAI-compatible HTTP front (libmicrohttpd) that sends each
 * request to one prefill server and one decode server (http/server.h) and streams the decode
 * server's answer back (libcurl towards the servers).
 *
 * Per request: pick a prefill server, then a decode server, each side by its own policy, assign
 * a room id, and forward the client's body, with a "kvstage" object added, to both at once.
 * Policies (kvs_router_policy_t; `kvstage router` defaults to prefix on both sides):
 *   round robin   the next server in turn;
 *   least loaded  the fewest requests on it, then the most free KV pages, then in turn;
 *   prefix        POST /internal/match with the client's body to every candidate server: the
 *                 longest cached prefix wins, equal ones (no hit anywhere included) go to the
 *                 less loaded, then in turn. On the decode side this sends a multi-turn chat
 *                 back to the server that holds its earlier turns.
 * A server's load is what its last GET /internal/info said ("load": "requests_live",
 * "kv_pages_free"; fetched with every health check, never per request), less the requests this
 * router had on it then, plus those it has on it now (exact): other routers' requests count
 * too, and a burst between two checks spreads at once.
 * Pairing: a decode server whose GET /internal/info declares a bootstrap is bound to the
 * prefill server declaring the same one, and only those two are chosen together; a prefill
 * server without a live partner is passed over (a server declaring none pairs with any, so the
 * two sides are chosen independently).
 * A match that times out counts as no cache hit (it does not take the server out). Bodies:
 *   prefill: "kvstage": {"room": N, "role": "prefill"}, "stream": false
 *   decode:  "kvstage": {"room": N, "role": "decode", "prefill": "URL", "bootstrap": "EP"}
 * (bootstrap as the prefill server's GET /internal/info declares it, omitted when it declares
 * none), and, when the client gave no "seed", one random "seed" for both (so that the prefill
 * side's first token and the decode side's later ones are one sampled stream; the decode
 * server reports it in its "kvstage" object). The client gets the decode server's status,
 * content type and body as they arrive, except the part that carries the decode server's
 * "kvstage" report (a JSON answer whole; a stream from its usage chunk on), which waits for
 * the prefill answer so that the report covers both sides: "transfer_ns" is the prefill
 * server's handoff time (its last prompt chunk computed -> the room concluded), "kv_bytes",
 * "ttft_ns", "seed" and "room" the decode server's, "prefill" and "decode" hold each
 * server's own report, and "servers" {"prefill": URL, "decode": URL} says which served it.
 * Completions with "echo" and "logprobs": the decode server has no logits of the prompt, so
 * its prompt entries' logprobs are null; the prefill server's answer holds the same entries
 * with the logprobs of its prefill pass, and each null one is filled from there (a stream is
 * held whole until the prefill answer is in: its first chunk needs them).
 * A client body that already has "kvstage" is refused (400).
 *
 * Failures: every health_interval_ms (500 by default) one pass checks every server at once
 * (GET /health, then GET /internal/info): a server that refuses the connection, drops it,
 * answers other than 200, or does not answer within 2 x connect_timeout_ms in three passes in a
 * row (one slow answer is a busy server, which keeps its place and its requests) is out of
 * rotation until a pass finds it well; so is one that refuses, drops or times out a forwarded
 * request. A server killed outright is thus out within health_interval_ms (its refused port), and
 * the requests on it fail at once (their connections close with it). When a pass finds a server
 * unreachable (not merely unhealthy: a draining server's /health 503 leaves its requests be),
 * every request still waiting on it fails too, so a hung server or host costs at most
 * 3 x (health_interval_ms + 2 x connect_timeout_ms), not the request timeout. A request whose
 * chosen server failed that way answers 503 {"error": {"message" naming the server, "type":
 * "server_error", "code": "server_unavailable"}} (504 "gateway_timeout" when the request itself
 * timed out, 502 "bad_gateway" for another transfer error), or, when the
 * decode stream had already started, ends the stream after its last whole event with
 * "data: {"error": {...}}" and no [DONE] (a stream the decode server ends that way itself is
 * passed through as it is). No live server of a role: 503 (code "no_server"). A server's own
 * error answer (4xx, 5xx) is passed through. A side that fails or refuses the room frees the
 * other at once: when the decode server refuses it (e.g. max_tokens beyond its context) or
 * fails, the prefill leg is dropped and the prefill server told POST /internal/cancel
 * {"room": N}; when the prefill leg fails before the decode answer started, the decode leg is
 * dropped and cancelled likewise and the prefill failure answered; the client leaving (or the
 * router stopping) cancels both.
 *
 * Fleet changes at run time: POST /admin/servers {"action": "add"|"remove", "side":
 * "prefill"|"decode", "url": URL} (kvs_router_add_server / kvs_router_remove_server below),
 * guarded by the API key like every endpoint but /health and /metrics; and the servers file
 * (config.servers_file), read at creation and again by kvs_router_reload (`kvstage router`: on
 * SIGHUP). Its lines are "prefill URL" or "decode URL"; blank lines and lines starting with '#'
 * are skipped. A reload adds the servers it lists (or takes them back in) and removes those it
 * listed before and lists no more, except servers given at creation; removed ones finish the
 * requests they have.
 *
 * Front endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET
 * /v1/models/{id}, POST /tokenize and POST /detokenize (these proxied to a live decode server,
 * as they are), GET /health (200 when at least one
 * prefill and one decode server are live, else 503), GET /metrics (kvstage_router_* series:
 * HTTP codes, requests, in flight, cancels sent, KV bytes and a handoff-time histogram from the
 * servers' reports, and per server up, chosen, failures, prefix hits).
 *
 * Before choosing servers the router checks the request with the servers' own parser
 * (http/server_internal.h's kvs__api_parse over a shape-only tokenizer): a field of the wrong
 * type or out of range is answered 400 here, and neither server starts work on it. The
 * prompt's length and token ids need the model's tokenizer and stay the servers' to judge.
 *
 * As the servers (http/server.h): unknown fields are ignored and named in a warning and in the
 * X-Kvstage-Ignored-Fields header, and removed from what is forwarded, so the servers never see
 * them; with strict the router refuses them (400) itself. With api_key, every endpoint but
 * /health and /metrics requires "Authorization: Bearer KEY" (401 otherwise). Towards the
 * servers (every request, health checks included) the router sends "Authorization: Bearer" with
 * server_api_key, or with api_key when that is not given, or nothing when neither is: one key
 * for a whole deployment needs only api_key. Connection limits, idle timeouts and bodies as
 * the servers'. */
#ifndef KVSTAGE_ROUTER_H
#define KVSTAGE_ROUTER_H

#include <stddef.h>
#include <stdint.h>

#include "kvstage/status.h"

typedef enum {
    KVS_ROUTER_ROUND_ROBIN = 0,
    KVS_ROUTER_PREFIX = 1,       /* longest cached prefix (POST /internal/match), then load */
    KVS_ROUTER_LEAST_LOADED = 2, /* fewest requests, then most free pages */
} kvs_router_policy_t;

typedef enum {
    KVS_ROUTER_PREFILL = 0,
    KVS_ROUTER_DECODE = 1,
} kvs_router_side_t;

typedef struct {
    const char *host;                   /* IPv4 address to bind; NULL: "127.0.0.1" */
    uint16_t port;                      /* 0: chosen by the system */
    uint32_t threads;                   /* HTTP worker threads; 0: 4 */
    const char *const *prefill;         /* [n_prefill] base URLs, "http://host:port" */
    size_t n_prefill;                   /* >= 1 with servers_file's */
    const char *const *decode;          /* [n_decode] base URLs */
    size_t n_decode;                    /* >= 1 with servers_file's */
    const char *servers_file;           /* more servers (see above); NULL: none */
    kvs_router_policy_t prefill_policy; /* default round robin */
    kvs_router_policy_t decode_policy;
    uint32_t health_interval_ms; /* 0: 500 */
    uint32_t connect_timeout_ms; /* 0: 1000 */
    uint32_t request_timeout_ms; /* whole request; 0: 600000 */
    uint32_t match_timeout_ms;   /* each /internal/match; 0: 200 */
    size_t max_body;             /* client body bytes at most; 0: 1 MiB */
    uint64_t first_room;         /* 0: from the clock, in [0, 2^62) */
    int strict;                  /* 1: refuse unknown fields (400) itself; 0: drop them */
    const char *api_key;         /* required of clients; NULL: none */
    const char *server_api_key;  /* sent to the servers; NULL: api_key */
    uint32_t max_connections;    /* clients at once; 0: 4096 */
    uint32_t idle_timeout_s;     /* 0: 60 */
} kvs_router_config_t;

typedef struct kvs_router kvs_router_t;

/* Checks every server once (GET /health and /internal/info) before serving, so the first
 * requests see the true liveness. KVS_ERR_INVALID for a bad configuration (no server of a
 * role, a URL that is not http://, a key that is not 1 to 1024 printable ASCII characters
 * without spaces, a servers file line that is not "prefill URL" or "decode URL": its number
 * logged), KVS_ERR_IO when the address cannot be bound or the servers file read. */
kvs_status_t kvs_router_create(const kvs_router_config_t *config, kvs_router_t **router_p);
uint16_t kvs_router_port(const kvs_router_t *router);
/* Stops the health checks, abandons in-flight requests (their clients see an error), frees. */
void kvs_router_destroy(kvs_router_t *router);

/* One health pass over every server now (blocking). */
void kvs_router_check_now(kvs_router_t *router);
/* 1 when server index of side is in rotation, 0 when out, -1 for a bad index. */
int kvs_router_server_up(kvs_router_t *router, kvs_router_side_t side, size_t index);

/* Servers of a side at most (given at creation and added since). */
#define KVS_ROUTER_MAX_SERVERS 64
/* Adds a server at run time (also POST /admin/servers {"action": "add", "side", "url"}): checked
 * at once (GET /health, /internal/info), in rotation when it answers; a URL the router had
 * removed comes back under its old index. *index_p (may be NULL): its index. KVS_ERR_INVALID
 * for a URL that is not http://, KVS_ERR_NOSPACE beyond KVS_ROUTER_MAX_SERVERS. */
kvs_status_t kvs_router_add_server(kvs_router_t *router, kvs_router_side_t side, const char *url,
                                   size_t *index_p);
/* Takes a server out for good (also POST /admin/servers {"action": "remove", ...}): it is never
 * chosen or checked again; requests already on it finish. KVS_ERR_NOT_FOUND for a URL the
 * router does not have in use. */
kvs_status_t kvs_router_remove_server(kvs_router_t *router, kvs_router_side_t side,
                                      const char *url);
/* Reads config.servers_file again and applies it (see above); the servers it added are checked
 * before it returns. A file that cannot be read or has a bad line (KVS_ERR_IO, KVS_ERR_INVALID,
 * logged with the line's number) changes nothing; KVS_ERR_NOSPACE when it lists more than
 * KVS_ROUTER_MAX_SERVERS of a side (the others applied). KVS_ERR_INVALID without a file. */
kvs_status_t kvs_router_reload(kvs_router_t *router);

typedef struct {
    uint64_t requests;    /* requests forwarded (a server pair was chosen) */
    uint64_t chosen;      /* of which this server took part */
    uint64_t failures;    /* connection failures and timeouts towards it */
    uint64_t prefix_hits; /* prefix-aware choices where it had the longest prefix (> 0) */
} kvs_router_server_stats_t;
/* KVS_ERR_INVALID for a bad index. */
kvs_status_t kvs_router_server_stats(kvs_router_t *router, kvs_router_side_t side, size_t index,
                                     kvs_router_server_stats_t *stats_p);

#endif
