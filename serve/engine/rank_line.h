/* The line protocol between rank 0 of a real-model instance (engine/llm_rank.h) and whoever
 * drives it (`kvstage generate`, the server's rank backend): one struct per request and per
 * event, and the one encoder and one decoder of each direction. Both sides use these, so the
 * text below is the only definition of the format.
 *
 * Rank 0 reads requests from in_fd, one line each (fields separated by single spaces):
 *   submit ROOM CHOICES MAX_NEW TEMPERATURE TOP_P TOP_K MIN_P PRESENCE FREQUENCY REPETITION
 *          SEED EOS LOGPROBS PROMPT_LOGPROBS B ID_1 BIAS_1 ... ID_B BIAS_B N ID_1 ... ID_N
 *          [peer PEER]
 *                         CHOICES 1..16: the sequences sampled from the prompt (choice i with
 *                         SEED + i; kvs_llm_request_t's n_choices; a prefill rank takes 1);
 *                         the sampling parameters (kvs_sample_params_t: TOP_K an integer, the
 *                         other five floats; PRESENCE, FREQUENCY and REPETITION the penalties);
 *                         EOS: a token id, or -1 for none (ignore_eos sends -1); LOGPROBS -1
 *                         (none) or 0..20 alternatives per token, PROMPT_LOGPROBS 0 or 1
 *                         (kvs_llm_request_t's logprobs, top_logprobs, prompt_logprobs);
 *                         B <= 300 logit biases, each a token id and a float; N >= 1 prompt
 *                         token ids. The ranges are the engine's (kvs_sample_params_invalid):
 *                         a submit outside them is answered "rejected". PEER (decode with
 *                         per-room bootstrap): the room's prefill instance, the description
 *                         the server got from kvs_plumbing_peer_lookup (1..KVS_LLM_PEER_MAX
 *                         printable characters, no space)
 *   stop ROOM [CHOICE]    ends choice CHOICE (0..15) of a live request at the next step;
 *                         without CHOICE, every choice
 *   match N ID_1 ... ID_N how many of these prompt tokens admission would find in the radix
 *                         cache now (kvs_llm_cached: read-only, so the ranks' caches stay equal)
 *   stats                 the stats line below (with "final":false), after the next step: its
 *                         transfer counters (bytes_moved, chunks, retries, ring...) are then
 *                         summed over every rank of the instance (kvs_llm_collect_metrics);
 *                         answers asked after it wait behind it
 *   quit                  ends the instance once no request is live (or after quit_grace_ns);
 *                         end of file means the same
 * Lines are taken between steps, so an answer can wait for one forward pass. Every match and
 * stats line is answered by exactly one line, in the order asked, so a client pairs answers
 * with questions in order. It writes to out_fd one JSON object per line:
 *   {"event":"ready","role":R,"tp":T,"load_s":X}          engine up, peers bootstrapped
 *   {"event":"token","room":N,"token":ID,"index":I}         with logprobs asked, also
 *        "logprob":X,"top":"ID_1 X_1 ... ID_K X_K"         the token's and its K alternatives'
 *                                                          (most likely first; %.9g floats)
 *   {"event":"prompt","room":N,"token":ID,"index":I,"logprob":X,"top":"..."}
 *                                                          prompt logprobs: prompt token I
 *                                                          (>= 1), before the first token
 *   {"event":"done","room":N,"status":S,"finish":F,"prompt_len":..,"cached":..,
 *    "generated":..,"submitted_ns":..,"admitted_ns":..,"prefilled_ns":..,"kv_ready_ns":..,
 *    "first_token_ns":..,"done_ns":..}                     status "ok" or an error string;
 *                                                          one per choice of the request
 *   Token and done lines of choice C > 0 also carry "choice":C (absent: choice 0).
 *   {"event":"rejected","room":N,"status":S}               the submit was refused
 *   {"event":"error","message":S}                          a line it could not parse
 *   {"event":"match","cached":C,"prompt_len":N}            the answer to match ("cached":0 and
 *                                                          "error":S for a malformed one)
 *   {"event":"peers","down":D,"of":T,"first":R}            rank 0's link: D of the other side's
 *                                                          T ranks unreachable (past the
 *                                                          liveness timeout), R the first of
 *                                                          them; written when D changes
 * Every rank, rank 0 included, writes one last line on out_fd (when out_fd >= 0) as it exits:
 *   {"event":"stats","role":R,"rank":r,...,"final":true}   kvs_llm_stats (steps, forward
 *                                                          passes, prompt, cached and decode
 *                                                          tokens, requests ok and failed,
 *                                                          radix pages, pool pages total and
 *                                                          free, queued, running), this
 *                                                          rank's sender/receiver metrics
 *                                                          (rooms, chunks, bulk and direct
 *                                                          writes, bytes_moved, control
 *                                                          messages, retries, rejected,
 *                                                          ring_used, ring_capacity, live,
 *                                                          quarantined and stashed rooms), load_s
 *                                                          and wall_s; rank 0 writes the same
 *                                                          line with "final":false for stats,
 *                                                          its metrics those of the instance
 *
 * Decoding events: "event" is required and fields may come in any order; unknown fields are
 * skipped (a newer rank may add some), a missing number reads as 0, a missing or unknown status
 * as KVS_ERR_IO, a missing or unknown finish as KVS_LLM_FINISH_ERROR, a missing "final" as true
 * (only a line that says "final":false answers a stats question). A field of the wrong JSON type
 * makes the line malformed. */
#ifndef KVSTAGE_RANK_LINE_H
#define KVSTAGE_RANK_LINE_H

#include <stddef.h>
#include <stdint.h>

#include "engine/llm.h"
#include "kvstage/pd.h"
#include "kvstage/status.h"

#define KVS_RANK_LINE_MAX  (16u << 20) /* longest line either decoder takes */
#define KVS_RANK_LINE_TEXT 256         /* decoded strings (messages) keep this much, NUL included */

/* ---- requests: client -> rank 0 ---- */

typedef enum {
    KVS_RANK_LINE_NONE = 0, /* decode: the line named no request */
    KVS_RANK_LINE_SUBMIT,
    KVS_RANK_LINE_STOP,
    KVS_RANK_LINE_MATCH,
    KVS_RANK_LINE_STATS,
    KVS_RANK_LINE_QUIT,
} kvs_rank_line_kind_t;

typedef struct {
    uint64_t room;
    uint32_t choices; /* CHOICES; encode: 0 writes 1 */
    uint32_t max_new;
    /* Floats written with %.9g (a float prints exactly) and read back as floats. Decode:
     * sampling.bias points into the caller's bias buffer. */
    kvs_sample_params_t sampling;
    uint64_t seed;
    int64_t eos; /* a token id (< UINT32_MAX), or -1: none */
    /* kvs_llm_request_t's: LOGPROBS is -1 without logprobs, else top_logprobs */
    int logprobs;
    uint32_t top_logprobs;
    int prompt_logprobs;
    uint32_t prompt_len;    /* N */
    const uint32_t *prompt; /* encode: [prompt_len] read; decode: into the caller's ids */
    const char *peer;       /* [peer_len] PEER, or peer_len 0; decode: into the line */
    size_t peer_len;
} kvs_rank_line_submit_t;

typedef struct {
    kvs_rank_line_kind_t kind;
    uint64_t room;                 /* STOP */
    uint32_t choice;               /* STOP: the choice, or KVS_LLM_CHOICE_ALL (no CHOICE) */
    kvs_rank_line_submit_t submit; /* SUBMIT */
    uint32_t match_len;            /* MATCH: N */
    const uint32_t *match;         /* MATCH: as submit.prompt */
} kvs_rank_line_request_t;

/* Bytes an encoding of req can take at most (its newline and a NUL included). */
size_t kvs_rank_line_request_size(const kvs_rank_line_request_t *req);

/* Writes req as one line, its newline included, NUL-terminated, into buf[cap]; *len_p: the
 * bytes before the NUL. KVS_ERR_NOSPACE when cap is short (buf then holds nothing useful),
 * KVS_ERR_INVALID for an unknown kind or ids missing. */
kvs_status_t kvs_rank_line_request_encode(const kvs_rank_line_request_t *req, char *buf, size_t cap,
                                          size_t *len_p);

/* Reads one request line line[len] (no newline; a NUL ends it early). ids[ids_cap] receives the
 * prompt ids of a submit or match, which then point into it; bias[KVS_SAMPLE_BIAS_LIMIT] the
 * logit biases of a submit.
 *   KVS_OK              *req_p is the request.
 *   KVS_ERR_INVALID     malformed; req_p->kind says which request it was (NONE: no known verb)
 *                       and *why_p what is wrong (a static string).
 *   KVS_ERR_NOSPACE     submit: ROOM and the sampling fields read, but N is not a number, 0 or
 *                       more than ids_cap (the ids are not read: rank 0 refuses the request);
 *                       match: N > ids_cap, the ids are well formed but not stored
 *                       (req_p->match_len is N). *why_p says so. */
kvs_status_t kvs_rank_line_request_decode(const char *line, size_t len, uint32_t *ids,
                                          uint32_t ids_cap, kvs_logit_bias_t *bias,
                                          kvs_rank_line_request_t *req_p, const char **why_p);

/* ---- events: rank 0 (and every rank's exit line) -> client ---- */

typedef enum {
    KVS_RANK_LINE_EV_READY = 0,
    KVS_RANK_LINE_EV_TOKEN,
    KVS_RANK_LINE_EV_DONE,
    KVS_RANK_LINE_EV_REJECTED,
    KVS_RANK_LINE_EV_ERROR,
    KVS_RANK_LINE_EV_MATCH,
    KVS_RANK_LINE_EV_STATS,
    KVS_RANK_LINE_EV_PROMPT,
    KVS_RANK_LINE_EV_PEERS,
} kvs_rank_line_event_kind_t;

typedef struct {
    kvs_rank_line_event_kind_t kind;
    kvs_llm_role_t role; /* EV_READY, EV_STATS */
    uint32_t tp;         /* EV_READY */
    uint32_t rank;       /* EV_STATS */
    double load_s;       /* EV_READY, EV_STATS (%.3f) */
    double wall_s;       /* EV_STATS (%.3f) */
    /* EV_TOKEN, EV_PROMPT: room, token, index, has_logprobs and lp; EV_DONE: room, status, finish,
     * prompt_len, cached_tokens, generated and the times; EV_REJECTED: room, status. */
    kvs_llm_event_t llm;
    uint32_t cached;                           /* EV_MATCH */
    uint64_t match_len;                        /* EV_MATCH: "prompt_len" (absent with "error") */
    uint32_t peers_down, peers_of, first_down; /* EV_PEERS */
    int final;                /* EV_STATS: the exit-time line (false: a stats answer) */
    kvs_llm_stats_t stats;    /* EV_STATS */
    kvs_pd_metrics_t metrics; /* EV_STATS: the fields the line carries (rank_line.c) */
    /* EV_ERROR: the message; EV_MATCH: the error, "" when well formed. Encode: escaped as JSON
     * needs; decode: cut to KVS_RANK_LINE_TEXT - 1 bytes. */
    char text[KVS_RANK_LINE_TEXT];
} kvs_rank_line_event_t;

/* Writes ev as one JSON line, as kvs_rank_line_request_encode. */
kvs_status_t kvs_rank_line_event_encode(const kvs_rank_line_event_t *ev, char *buf, size_t cap,
                                        size_t *len_p);

/* Reads one event line line[len] (no newline needed). KVS_ERR_INVALID when it is not a JSON
 * object with an "event" name and fields of the right types, KVS_ERR_UNSUPPORTED for an event
 * this decoder does not know (a newer rank's: skip it); *why_p (may be NULL) says which. */
kvs_status_t kvs_rank_line_event_decode(const char *line, size_t len, kvs_rank_line_event_t *ev_p,
                                        const char **why_p);

/* The names the lines use. */
const char *kvs_rank_line_role_str(kvs_llm_role_t role);
const char *kvs_rank_line_finish_str(kvs_llm_finish_t finish);

#endif
