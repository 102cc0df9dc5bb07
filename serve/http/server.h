/* The serving layer of one instance: an OpenAI-compatible HTTP server (libmicrohttpd) over a
 * backend interface, so the HTTP side is testable without a model. The backend is an ops table
 * (submit, cancel, health, prefix match, stats) that reports each request's tokens and end to
 * a sink, from any thread; the tokenizer is an ops table too (encode, piece, chat formatting).
 * A byte tokenizer comes with it for tests and smoke runs (the tests' fake backend is in
 * tests/http/fake_backend.h); kvs_server_tokenizer_from() adapts model/tokenizer.h.
 *
 * HTTP endpoints:
 *   POST /v1/completions, POST /v1/chat/completions   OpenAI request and response shapes;
 *        "stream": true answers with server-sent events ("data: {...}\n\n" chunks, then
 *        "data: [DONE]\n\n"); "stream_options": {"include_usage": true} adds a usage chunk.
 *        Sampling: temperature [0, 2] (0: greedy), top_p (0, 1], presence_penalty and
 *        frequency_penalty [-2, 2] (OpenAI: over the generated tokens), logit_bias (an object
 *        of at most 300 token-id strings to biases in [-100, 100]), seed (an integer; absent: a
 *        fresh random one per request, in [0, 2^53)), and as vLLM: top_k (-1 or 0: off, else
 *        >= 1), min_p [0, 1], repetition_penalty (0, 2] (over prompt and generated tokens),
 *        ignore_eos (the EOS does not end generation), stop_token_ids [ids]; greedy honours
 *        the bias and the penalties too (model/sample.c: the order they act in).
 *        "n" [1, 16] choices (completions "best_of" only equal to n): choices[i] with "index" i,
 *        its own text, finish_reason and logprobs, sampled with seed + i from the one prompt
 *        (computed, or handed over, once); streamed, each chunk carries one choice's "index"
 *        (a role chunk and a last chunk per choice); stop strings end only the choice they match
 *        in; usage.completion_tokens sums the choices, prompt_tokens counts the prompt once; a
 *        failing choice fails the request (500, or the stream's error event). A prefill side
 *        computes one choice whatever n says.
 *        Logprobs, in OpenAI's shapes: chat "logprobs": true with "top_logprobs" [0, 20] gives
 *        choices[0].logprobs {"content": [{"token", "logprob", "bytes", "top_logprobs":
 *        [{"token", "logprob", "bytes"}]}]}; completions "logprobs" [0, 5] gives {"tokens",
 *        "token_logprobs", "top_logprobs" (per token a dict of the top N texts and the chosen
 *        one's), "text_offset" (characters)}; streamed, each chunk carries its tokens' entries.
 *        A logprob is the log-softmax of the model's raw logits at that position, before
 *        logit_bias, penalties and temperature (vLLM's default); stop token ids get no entry.
 *        Completions "echo": true starts the text with the prompt's (streamed: a chunk of its
 *        own); with logprobs, the prompt's tokens come first, the first one's logprob null, so
 *        that echo + logprobs + max_tokens 1 scores a text. Prompt logprobs come from the
 *        prefill pass (an lm-head over every prompt position of such a request); it computes
 *        its whole prompt, past any radix hit (a cached prefix has no logits). A decode side
 *        answers null for them: the router fills them in from the prefill side's answer.
 *        Extensions: "kvstage": {...} (below).
 *        Responses carry usage.prompt_tokens_details.cached_tokens and "kvstage": {"room",
 *        "seed", "ttft_ns", "transfer_ns", "kv_bytes"} (non-streaming responses and the usage
 *        chunk); "seed" replays the request's draws.
 *        A generation that fails answers 500 (non-streaming; 400 when the backend found it
 *        needs more KV pages than its whole pool, KVS_ERR_NOSPACE: n, max_tokens or the
 *        prompt too large for this server), or, streaming, ends the stream
 *        with "data: {"error": {...}}" and no [DONE] (clients read [DONE] as success);
 *        finish_reason only ever holds OpenAI's values ("stop", "length"; "handoff" on the
 *        prefill side of a room, which only the router sees).
 *   GET  /v1/models        the served model, as a list.
 *   GET  /v1/models/{id}   the model object ({"id", "object": "model", "created", "owned_by"})
 *                          when id is the served model (it may contain '/'), else 404
 *                          (code "model_not_found").
 *   POST /tokenize         as vLLM: {"prompt": text or ids} or {"messages": [...]} (rendered
 *                          with the chat template) -> {"tokens", "count", "max_model_len"}; a
 *                          prompt beyond the context is counted, not refused.
 *   POST /detokenize       {"tokens": [ids]} -> {"prompt": their text (invalid UTF-8 as
 *                          U+FFFD)}.
 *   GET  /health           200 {"status":"ok"}; 503 {"status":"unavailable", "reason": S} when
 *                          the backend's health() fails (a decode server whose prefill ranks are
 *                          unreachable says which; a server whose instance is restarting says
 *                          why) or the server is stopping.
 *   GET  /metrics          Prometheus text format: counters kvstage_http_requests_total{code},
 *                          kvstage_requests_finished_total{reason}, kvstage_requests_cancelled_
 *                          total, kvstage_{prompt,generation,cached_prompt}_tokens_total;
 *                          histograms kvstage_time_to_first_token_seconds, kvstage_inter_token_
 *                          latency_seconds, kvstage_request_duration_seconds, kvstage_kv_
 *                          transfer_seconds; from the backend's stats: kvstage_kv_bytes_total,
 *                          kvstage_kv_chunks_total, kvstage_control_{retries,rejected}_total and
 *                          gauges kvstage_ring_{used,capacity}_bytes, kvstage_rooms_{live,
 *                          quarantined,stashed} and kvstage_peer_instances (summed over the
 *                          instance's ranks),
 *                          kvstage_requests_{queued,running}, kvstage_kv_pages_{total,free,used}
 *                          (rank 0's pool); gauge kvstage_requests_live (submitted, not ended);
 *                          counters kvstage_instance_restarts_total (`serve --restart-ranks`)
 *                          and kvstage_preemptions_total (rank 0's).
 *   POST /internal/match   body: a completions or chat request; answers {"cached_tokens": N,
 *                          "prompt_tokens": M} from the backend's match() (the router's
 *                          prefix-aware choice).
 *   GET  /internal/info    {"model", "role", "bootstrap", "load": {"requests_live",
 *                          "requests_running", "requests_queued", "kv_pages_total",
 *                          "kv_pages_free"}} (the gauges of /metrics, now): the router pairs by
 *                          bootstrap and weighs load, fetched with its health checks.
 *   POST /internal/cancel  body {"room": N}: the router gave up on room N (the other side
 *                          refused or failed it, or the client left). Its live request here ends
 *                          now through the backend's cancel (a prefill room is aborted through
 *                          kvstage); when none is live yet, a request for room N arriving in the
 *                          next 60 s is refused 409 {"code": "cancelled"}. Answers {"room": N,
 *                          "cancelled": K}, K the live requests it ended.
 * Errors are {"error": {"message", "type", "param", "code"}}: type "invalid_request_error" for
 * 4xx (400 bad input, 401 API key missing or wrong (code "invalid_api_key", with
 * "WWW-Authenticate: Bearer"), 404 unknown path or model, 405 wrong method, 413 body too large),
 * "server_error" for 5xx (500 generation failed, 503 unavailable, overloaded or not ready: the
 * backend's instance is starting or restarting). A prompt +
 * max_tokens beyond max_context is a 400 with code "context_length_exceeded", param the
 * client's field ("max_tokens", "max_completion_tokens", or "prompt"/"messages" when the prompt
 * alone leaves no room) and both numbers in vLLM's words ("This model's maximum context length
 * is C tokens. However, you requested T tokens (P in the messages, M in the completion)...").
 *
 * Unknown fields: by default, unknown top-level fields and unknown fields inside "messages"[i],
 * "stream_options" and "kvstage" are ignored; the server logs one warning per request naming
 * them, and every answer to the request carries the header
 *   X-Kvstage-Ignored-Fields: a, b, messages[0].c
 * (bytes outside printable ASCII, ',' and '%' written %XX, the empty name as ""; ", ..." ends a
 * list cut at about 500 bytes). With config.strict (`--strict`) they are refused: 400, "param"
 * naming the field, code "unknown_field". Fields OpenAI or vLLM define that kvstage does not
 * support are not unknown: a value other than their neutral one is a 400 naming them in either
 * mode; so is the other endpoint's input ("prompt" in a chat request, "messages" in a completions
 * one, code "wrong_endpoint").
 *
 * API key: with config.api_key, every endpoint but /health and /metrics requires the header
 * "Authorization: Bearer KEY" (compared in constant time); the body of a request without it is
 * not kept.
 *
 * Connections: at most config.max_connections at once (the next wait in the listen backlog);
 * a connection silent for config.idle_timeout_s is closed (a connection waiting for tokens is
 * not silent). A body declared (Content-Length) larger than max_body is answered 413 at once,
 * without reading it, and the connection closes. A body that stops arriving cannot be answered
 * 408: libmicrohttpd lets an application answer only before the body is read or once all of it
 * is in, so such a connection is closed, unanswered, after idle_timeout_s. Bodies without a
 * length (chunked) that grow past max_body are read to their end and dropped, then answered
 * 413.
 *
 * Disaggregation (the router, kvstage/router.h, adds this to the client's JSON body):
 *   "kvstage": {"room": N, "role": "prefill"}
 *        prefill only: the backend computes the prompt and hands its KV over for room N; the
 *        answer is non-streaming (whatever "stream" says) with finish_reason "handoff". Stop
 *        strings are left to the decode side (a match in the first token must not abort the
 *        room under it).
 *   "kvstage": {"room": N, "role": "decode", "bootstrap": "EP", "prefill": "URL"}
 *        the decode side of room N: the KV comes from the prefill instance whose bootstrap
 *        (registry) endpoint is EP ("bootstrap" is omitted when the prefill server did not
 *        declare one; "prefill" is that server's base URL, informational). Answered as usual.
 *        A DECODE server with no bootstrap of its own (per-room bootstrap) needs EP, and asks
 *        the backend's peer op before anything else: 400 {"param": "kvstage.bootstrap", "code":
 *        "missing_bootstrap" or "incompatible_prefill"} (the message names the mismatch), 503
 *        {"code": "prefill_unreachable"}.
 *   N is an integer in [0, 2^62): the router's rooms. Requests without "kvstage" are served
 *   whole by this instance under a room the server picks in [2^62, 2^63).
 *
 * A client that hangs up cancels its room: a streaming one at the next token written, a
 * non-streaming one within half a second (a connection waiting for its answer is suspended, and
 * libmicrohttpd does not watch suspended sockets, so a thread of the server looks at them; the
 * router's request threads do the same for theirs, and cancel both sides). Creating a server or a
 * router routes jansson's allocations, process-wide, through the kvstage allocator. */
#ifndef KVSTAGE_SERVER_H
#define KVSTAGE_SERVER_H

#include <stddef.h>
#include <stdint.h>

#include "kvstage/pd.h"
#include "kvstage/status.h"
#include "model/model.h"
#include "model/tokenizer.h"

/* The response header that names a request's ignored unknown fields. */
#define KVS_SERVER_IGNORED_HEADER "X-Kvstage-Ignored-Fields"

#define KVS_SERVER_CHOICES_MAX 16         /* "n" at most */
#define KVS_SERVER_CHOICE_ALL  UINT32_MAX /* cancel(): every choice of the room */

/* ---------------------------------------------------------------------------------------- */
/* Backend interface                                                                         */

typedef enum {
    KVS_SERVER_ROLE_NONE = 0,    /* the whole request on this instance (colocated) */
    KVS_SERVER_ROLE_PREFILL = 1, /* prefill only: compute the prompt, hand the KV over */
    KVS_SERVER_ROLE_DECODE = 2,  /* receive the KV of room from a prefill instance, generate */
} kvs_server_role_t;

/* What a backend receives; every pointer is borrowed for the duration of submit only. */
typedef struct {
    uint64_t room;
    kvs_server_role_t role;
    const char *bootstrap;  /* DECODE: the prefill instance's bootstrap endpoint; may be NULL */
    const uint32_t *prompt; /* [prompt_len] token ids, each < the tokenizer's vocab_size */
    uint32_t prompt_len;    /* >= 1 */
    uint32_t max_tokens;    /* >= 1; prompt_len + max_tokens <= the server's max_context */
    /* temperature [0, 2] (0: greedy), top_p (0, 1], the rest as the HTTP API's ranges; its
     * logit biases are ids < the tokenizer's vocab_size */
    kvs_sample_params_t sampling;
    uint64_t seed; /* the client's, or one the server drew (reported back) */
    /* [n_stop_ids] tokens that end generation: the EOS first (unless ignore_eos), then
     * "stop_token_ids" */
    const uint32_t *stop_ids;
    uint32_t n_stop_ids;
    int stream; /* informational: the server streams either way from the sink */
    /* 1: each on_token carries the token's logprobs with top_logprobs (0..KVS_LOGPROBS_TOP_MAX)
     * alternatives: log-softmax of the model's raw logits at that position, before logit bias,
     * penalties and temperature (vLLM's default) */
    int logprobs;
    uint32_t top_logprobs;
    /* With logprobs, not DECODE: on_prompt for prompt tokens 1..prompt_len-1 (computed in the
     * prefill pass; such a request computes its whole prompt, past any cached prefix) */
    int prompt_logprobs;
    /* Choices ("n"), 1..KVS_SERVER_CHOICES_MAX (PREFILL: 1): sequences sampled from the one
     * prompt, choice i with seed + i, each reported through on_token with its index */
    uint32_t n;
} kvs_server_request_t;

typedef enum {
    KVS_SERVER_FINISH_STOP = 0,    /* a stop token, or cancel() */
    KVS_SERVER_FINISH_LENGTH = 1,  /* max_tokens generated */
    KVS_SERVER_FINISH_ERROR = 2,   /* see status */
    KVS_SERVER_FINISH_HANDOFF = 3, /* PREFILL: the KV (and first token) reached decode */
} kvs_server_finish_t;

typedef struct {
    kvs_server_finish_t finish; /* the request's: ERROR when any choice failed, else choice 0's */
    kvs_server_finish_t choice_finish[KVS_SERVER_CHOICES_MAX]; /* [n]: each choice's */
    kvs_status_t status;                                       /* FINISH_ERROR: why */
    uint32_t prompt_tokens; /* prompt length as the backend saw it */
    uint32_t cached_tokens; /* of which found in this instance's prefix cache */
    uint32_t generated;     /* tokens reported through on_token, all choices */
    uint64_t ttft_ns;       /* submit -> first token known on this side; 0: unknown */
    uint64_t transfer_ns;   /* KV transfer time of the room; 0: none or unknown */
    uint64_t kv_bytes;      /* KV bytes moved for the room */
} kvs_server_done_t;

/* Where a backend reports one request. The backend may call these from any thread (an engine
 * loop thread), also before submit() returns; calls for one request never overlap; on_token
 * comes once per generated token of each choice, in order within the choice (a stop token
 * included: the server does not render the stop ids as text); on_done comes exactly once, last,
 * once every choice ended, for every request submit() accepted, cancelled ones included. The server
 * never calls the backend from inside a sink call, and the sink never blocks on the network (it
 * only queues and wakes). */
typedef struct {
    /* piece: the token's text when the backend has it (copied before return); NULL: the
     * server decodes the id with its tokenizer. lp: the token's logprobs when the request
     * asked (copied), else NULL. */
    void (*on_token)(void *arg, uint32_t choice, uint32_t token, const char *piece,
                     size_t piece_len, const kvs_logprobs_t *lp);
    void (*on_done)(void *arg, const kvs_server_done_t *done);
    void *arg;
    /* prompt_logprobs: prompt token number index (1..prompt_len-1, in order, before the first
     * on_token) and its logprobs given the tokens before it (copied). NULL: not wanted. */
    void (*on_prompt)(void *arg, uint32_t index, uint32_t token, const kvs_logprobs_t *lp);
} kvs_server_sink_t;

/* Counters (since start) and gauges (now) for /metrics. */
typedef struct {
    /* The instance's transfer counters; /metrics exports the fields KVS_PD_METRICS gives a
     * Prometheus name (bytes: KV payload bytes moved, sent or scattered; chunks; retries and
     * rejected control messages; ring_used and ring_capacity). */
    kvs_pd_metrics_t metrics;
    uint32_t queued;      /* gauge: requests waiting for admission */
    uint32_t running;     /* gauge: requests admitted */
    uint32_t pages_total; /* gauge: KV pool pages (of one rank: the ranks' pools are alike) */
    uint32_t pages_free;  /* gauge: of which free now */
    uint32_t restarts;    /* counter: the instance's ranks restarted (serve --restart-ranks) */
    uint64_t preemptions; /* counter: running requests sent back to the queue for want of KV
                             pages (recomputed when pages free up) */
} kvs_server_backend_stats_t;

/* The serving engine behind the server. Every function may be called from several server
 * threads at once. */
typedef struct {
    void *ctx;
    /* Takes a request (copying what it keeps). KVS_OK: the sink will get on_done.
     * Errors (no sink call follows): KVS_ERR_INVALID or KVS_ERR_UNSUPPORTED (answered 400),
     * KVS_ERR_NOSPACE (503, overloaded), KVS_ERR_STATE (503, not ready: starting,
     * restarting or its ranks ended; health_detail says which), anything else (500). */
    kvs_status_t (*submit)(void *ctx, const kvs_server_request_t *request,
                           const kvs_server_sink_t *sink);
    /* Ends choice `choice` of a live request soon (a stop string matched in it), or every choice
     * (KVS_SERVER_CHOICE_ALL: client gone, server stopping); on_done still follows. Called from
     * server threads, concurrently with the backend's own sink calls for the same room.
     * KVS_ERR_NOT_FOUND for a room that already ended (expected, ignored). */
    kvs_status_t (*cancel)(void *ctx, uint64_t room, uint32_t choice);
    /* KVS_OK while the backend can serve. NULL: always healthy. */
    kvs_status_t (*health)(void *ctx);
    /* Why health() fails, into buf[cap] ("" when it does not); shown by /health, a submit's
     * 503 and the error of a request that ended with KVS_ERR_IO. NULL: none. */
    void (*health_detail)(void *ctx, char *buf, size_t cap);
    /* The longest prefix of prompt in this instance's prefix cache. NULL: 0. */
    kvs_status_t (*match)(void *ctx, const uint32_t *prompt, uint32_t prompt_len,
                          uint32_t *cached_p);
    /* NULL: all zero. */
    void (*stats)(void *ctx, kvs_server_backend_stats_t *stats_p);
    /* DECODE with per-room bootstrap (no bootstrap configured): whether the prefill instance
     * whose registry endpoint `bootstrap` is can feed this instance, before its room is
     * submitted (the server then answers a refusal before any byte of the answer). KVS_OK;
     * KVS_ERR_INCOMPATIBLE or KVS_ERR_INVALID (400, why names the mismatch); anything else
     * (503, why: unreachable). NULL: rooms from any instance are submitted. */
    kvs_status_t (*peer)(void *ctx, const char *bootstrap, char *why, size_t cap);
} kvs_server_backend_t;

/* ---------------------------------------------------------------------------------------- */
/* Tokenizer interface                                                                       */

typedef struct {
    void *ctx;
    /* text (special tokens written literally are parsed) -> ids in an array from kvs_malloc
     * (NULL when *n_p is 0). */
    kvs_status_t (*encode)(void *ctx, const char *text, size_t len, uint32_t **ids_p, size_t *n_p);
    /* The bytes of one generated token, living as long as the tokenizer; empty for control
     * tokens. May be part of a UTF-8 character. */
    kvs_status_t (*piece)(void *ctx, uint32_t id, const char **bytes_p, size_t *len_p);
    /* The conversation rendered as the model expects, with the assistant turn opened;
     * NUL-terminated, from kvs_malloc. */
    kvs_status_t (*chat)(void *ctx, const kvs_chat_msg_t *msgs, size_t n, char **text_p);
    uint32_t vocab_size;
    uint32_t eos; /* added to every request's stop ids; UINT32_MAX: none */
} kvs_server_tokenizer_t;

/* The real tokenizer (borrowed; it must outlive every user of the result): encode with special
 * tokens parsed, control tokens render as nothing, chat through kvs_chat_format with the
 * model's template (plain ChatML when the template is not recognised; said once, as a
 * warning). */
kvs_status_t kvs_server_tokenizer_from(const kvs_tokenizer_t *tok, kvs_server_tokenizer_t *out_p);

/* Bytes as tokens: id b < 256 is byte b, 256 is the EOS (rendered as nothing); chat renders
 * "ROLE: CONTENT\n" per message, then "assistant: ". No state. */
kvs_server_tokenizer_t kvs_server_byte_tokenizer(void);

/* ---------------------------------------------------------------------------------------- */
/* The server                                                                                */

typedef struct {
    const char *host;            /* IPv4 address to bind; NULL: "127.0.0.1" */
    uint16_t port;               /* 0: chosen by the system (read it back with kvs_server_port) */
    uint32_t threads;            /* HTTP worker threads; 0: 4 */
    const char *model;           /* the model name served; a request naming another is 404 */
    uint32_t max_context;        /* prompt + max_tokens at most; 0: 4096 */
    uint32_t default_max_tokens; /* when a request gives none; 0: the rest of the context */
    size_t max_body;             /* request body bytes at most; 0: 1 MiB */
    kvs_server_role_t role;      /* /internal/info; with strict_role also what it serves */
    /* /internal/info. PREFILL: this instance's bootstrap endpoint for decode peers. DECODE: the
     * prefill instance's endpoint this one is bound to, so that a router pairs them; with
     * strict_role a request naming another one is refused. NULL: none. */
    const char *bootstrap;
    /* 1: serve only requests of this role: a PREFILL or DECODE server refuses requests without
     * "kvstage" or for the other role, a colocated (NONE) one refuses requests with "kvstage",
     * and a DECODE server with a bootstrap refuses a "kvstage.bootstrap" naming another
     * instance; each with 400 {"param": "kvstage", "code": "wrong_role" or "wrong_bootstrap"}
     * and a message naming this server's role. 0: every request goes to the backend. */
    int strict_role;
    uint64_t first_room;          /* rooms of requests without "kvstage"; 0: from the clock,
                                     in [2^62, 2^63) */
    int strict;                   /* 1: refuse unknown fields (400); 0: ignore them (above) */
    const char *api_key;          /* required of clients (above); NULL: none. 1 to 1024 printable
                                     ASCII characters without spaces */
    uint32_t max_connections;     /* clients at once; 0: 4096 (above) */
    uint32_t idle_timeout_s;      /* 0: 60 */
    kvs_server_backend_t backend; /* borrowed; must outlive the server */
    kvs_server_tokenizer_t tokenizer;
} kvs_server_config_t;

typedef struct kvs_server kvs_server_t;

/* Binds and starts serving on background threads. KVS_ERR_INVALID for a bad configuration
 * (missing backend submit/cancel or tokenizer functions, bad host, bad API key), KVS_ERR_IO when
 * the address cannot be bound. Raises the process's open-file soft limit (towards the hard one)
 * when max_connections needs it; when the hard limit is short, serves fewer connections and
 * says so. */
kvs_status_t kvs_server_create(const kvs_server_config_t *config, kvs_server_t **server_p);
/* The bound port. */
uint16_t kvs_server_port(const kvs_server_t *server);
/* Closes the port, stops taking requests (503), cancels the live ones (streams end with an
 * error event, waiting ones answer 503), waits for the backend's on_done of each (up to 10 s)
 * and for their answers to go out (up to 2 s more), closes every connection and frees the
 * server. Should a backend never end a request, it logs an error after the 10 s and leaves the
 * server allocated (the backend's sinks still refer to it). */
void kvs_server_destroy(kvs_server_t *server);

/* 1 when key can be an API key (config.api_key): 1 to 1024 printable ASCII characters without
 * spaces, so that it fits an Authorization header as it is. */
int kvs_server_api_key_valid(const char *key);

/* The /metrics text (NUL-terminated, from kvs_malloc). */
kvs_status_t kvs_server_metrics(kvs_server_t *server, char **text_p);

#endif
