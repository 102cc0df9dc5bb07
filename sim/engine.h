/* The minimal serving engines of the simulation (internal to the simulation library): one prefill
 * instance and one decode instance, each a scheduler over all of its TP ranks with one radix cache
 * over page ids that are identical on every rank. They call the protocol API exactly as a real
 * engine would; read prefill_engine.c and decode_engine.c to learn that API's calling pattern. */
#ifndef KVSTAGE_ENGINE_ENGINE_H
#define KVSTAGE_ENGINE_ENGINE_H

#include <stdint.h>

#include "kvstage/pd.h"
#include "kvstage/pool.h"
#include "kvstage/radix.h"
#include "sim/sim.h"

/* A fault the simulation plants in one room. */
typedef enum {
    KVS_ENGINE_FAULT_NONE = 0,
    KVS_ENGINE_FAULT_ABORT = 1,    /* abort the room: prefill after `at` chunks; decode `at` polls
                                      after a rank reported Transferring */
    KVS_ENGINE_FAULT_STALL = 2,    /* prefill: never launch another forward after `at` chunks */
    KVS_ENGINE_FAULT_MISALIGN = 3, /* decode: pass a base that is not a page multiple */
} kvs_engine_fault_kind_t;

typedef struct {
    kvs_engine_fault_kind_t kind;
    uint32_t at;
} kvs_engine_fault_t;

/* How a room ended on one side. */
typedef struct {
    kvs_room_status_t status;  /* SUCCESS or FAILED (the MIN over the side's ranks) */
    kvs_status_t reason;       /* the first failing rank's reason, a root cause over ABORTED */
    uint64_t hit_tokens;       /* radix hit: prefill snapshot or decode base */
    uint64_t total_pages;      /* decode: suffix pages transferred */
    uint64_t mismatched_bytes; /* decode, on Success: bytes that differ from the prefill KV */
    int meta_ok;               /* decode, on Success: the final metadata was the expected one */
} kvs_engine_outcome_t;

typedef void (*kvs_engine_done_fn)(void *arg, const kvs_request_t *request,
                                   const kvs_engine_outcome_t *outcome);

/* ---- pages in lockstep ----
 * Every rank of an instance runs the same schedule, so each rank's pool hands out the same ids;
 * these helpers do every allocation and free on all ranks and check that the ids agree. */

typedef struct {
    kvs_pool_t *const *pools; /* [tp] */
    uint32_t tp;
    kvs_radix_t *radix; /* NULL when the instance has no radix cache */
    uint32_t *scratch;  /* [pages of the largest allocation]: other ranks' ids */
    uint32_t scratch_cap;
} kvs_lockstep_t;

/* Copies the pool array (tp entries), sizes the scratch for allocations of up to max_pages, and
 * creates the instance's radix cache when radix is set (its evictions free on every rank).
 * ls must not move afterwards: the radix cache keeps a pointer to it. */
kvs_status_t kvs_lockstep_init(kvs_lockstep_t *ls, kvs_pool_t *const *pools, uint32_t tp,
                               uint32_t page_size, uint32_t max_pages, int radix);
/* Destroys the radix cache (its pages go back to the pools) and frees what init took. */
void kvs_lockstep_fini(kvs_lockstep_t *ls);

/* Takes n pages on every rank, evicting from the radix cache first when too few are free.
 * KVS_ERR_NOSPACE (not logged: the engine simply waits) when they cannot be had. */
kvs_status_t kvs_lockstep_alloc(kvs_lockstep_t *ls, uint32_t n, uint32_t *pages_p);
void kvs_lockstep_free(kvs_lockstep_t *ls, const uint32_t *pages, uint32_t n);
/* The radix cache's eviction callback (arg: the kvs_lockstep_t). */
void kvs_lockstep_radix_free(void *arg, const uint32_t *pages, size_t count);

/* ---- what one request needs ----
 * A pool or staging ring smaller than one request can never serve it: these let the simulation
 * and the rank processes refuse such a configuration up front. */

/* Pages a prompt of len tokens occupies on one rank: prefill holds all of them; decode, with no
 * radix hit (the worst case), as many delta pages. */
uint32_t kvs_engine_prompt_pages(uint32_t len, uint32_t page_size);
/* Bytes of the largest staging slot decode rank `decode_rank` grants for prompts of up to
 * max_prompt_len tokens: one grid chunk, or the whole prompt when that is shorter. 0 for an
 * invalid geometry. */
uint64_t kvs_engine_slot_bytes(const kvs_pd_geometry_t *geo, uint32_t decode_rank,
                               uint32_t max_prompt_len);
/* KVS_ERR_INVALID (logged as "who: ...", with the pages needed and given, and `flag` to fix it
 * when not NULL) when a pool of pool_pages cannot hold one prompt of max_prompt_len tokens.
 * side: "prefill" or "decode". */
kvs_status_t kvs_engine_check_pool(const char *who, const char *side, const char *flag,
                                   uint32_t pool_pages, uint32_t page_size,
                                   uint32_t max_prompt_len);
/* kvs_engine_check_pool over an engine's tp pools (no flag: its caller sized them). */
kvs_status_t kvs_engine_check_pools(const char *who, const char *side, kvs_pool_t *const *pools,
                                    uint32_t tp, uint32_t page_size, uint32_t max_prompt_len);
/* KVS_ERR_INVALID (logged, with the bytes needed and given) when a ring of ring_bytes on every
 * decode rank cannot hold the largest slot of some decode rank. */
kvs_status_t kvs_engine_check_ring(const char *who, const kvs_pd_geometry_t *geo,
                                   uint32_t max_prompt_len, uint64_t ring_bytes);
/* kvs_pd_geometry_check_device for both sides: a deployment with every pool on a GPU. */
kvs_status_t kvs_engine_check_devices(const kvs_pd_geometry_t *geo);

/* ---- prefill ---- */

typedef struct kvs_prefill_engine kvs_prefill_engine_t;

typedef struct {
    kvs_pd_geometry_t geo;
    uint32_t batch; /* rooms per forward pass */
    int radix;      /* prefill radix cache on/off */
    uint32_t max_prompt_len;
    /* Ranks this engine drives: pools and senders hold this many (0 = all PP x TP ranks of the
     * instance; 1 = one rank per process, each process running the same schedule), from
     * instance rank first_rank on (rank = stage * TP + TP rank). */
    uint32_t local_ranks;
    uint32_t first_rank;
} kvs_prefill_engine_config_t;

/* pools and senders: [local_ranks or all prefill ranks], owned by the caller, outliving the
 * engine; a rank's pool holds its stage's layers (kvs_pp_stage_shape). With pipeline stages a
 * forward pass moves each chunk one stage on: stage s computes a chunk's layers one step after
 * stage s - 1, and its ranks report it computed (and send it) then.
 * KVS_ERR_INVALID (logged) when a pool cannot hold one prompt of max_prompt_len tokens. A
 * submitted request longer than max_prompt_len fails alone at admission (KVS_ERR_NOSPACE). */
kvs_status_t kvs_prefill_engine_create(const kvs_prefill_engine_config_t *config,
                                       kvs_pool_t *const *pools, kvs_sender_t *const *senders,
                                       kvs_engine_done_fn done, void *done_arg,
                                       kvs_prefill_engine_t **engine_p);
/* Frees the engine's rooms (without telling the senders) and its radix cache. */
void kvs_prefill_engine_destroy(kvs_prefill_engine_t *engine);
/* The router hands the engine a request: the room is added on every rank now (so decode's
 * metadata finds it), and queued for admission. request must outlive the room. */
kvs_status_t kvs_prefill_engine_submit(kvs_prefill_engine_t *engine, const kvs_request_t *request,
                                       const kvs_engine_fault_t *fault);
/* One scheduler iteration: the running forward pass completes, concluded rooms are released,
 * queued rooms are admitted and the next forward pass is launched. Returns how many rooms
 * changed state (0 = idle). */
uint32_t kvs_prefill_engine_step(kvs_prefill_engine_t *engine);
/* Only polls and concludes rooms (between forward passes). */
uint32_t kvs_prefill_engine_poll(kvs_prefill_engine_t *engine);
/* 1 while a forward pass is running (the engine wants its next step). */
int kvs_prefill_engine_busy(const kvs_prefill_engine_t *engine);
uint32_t kvs_prefill_engine_live_rooms(const kvs_prefill_engine_t *engine);
/* Pages its radix cache holds (0 without one). */
size_t kvs_prefill_engine_cached_pages(const kvs_prefill_engine_t *engine);

/* ---- decode ---- */

typedef struct kvs_decode_engine kvs_decode_engine_t;

typedef struct {
    kvs_pd_geometry_t geo;
    int radix; /* decode radix cache on/off */
    uint32_t max_prompt_len;
    uint32_t local_ranks; /* as for prefill: 0 = all decode_tp ranks */
} kvs_decode_engine_config_t;

/* As for prefill: KVS_ERR_INVALID (logged) when a pool cannot hold one prompt's delta pages. */
kvs_status_t kvs_decode_engine_create(const kvs_decode_engine_config_t *config,
                                      kvs_pool_t *const *pools, kvs_receiver_t *const *receivers,
                                      kvs_engine_done_fn done, void *done_arg,
                                      kvs_decode_engine_t **engine_p);
void kvs_decode_engine_destroy(kvs_decode_engine_t *engine);
/* Queues a request; it is admitted (FIFO) when its delta pages can be allocated. One longer than
 * max_prompt_len can never be: it fails alone at admission (KVS_ERR_NOSPACE). */
kvs_status_t kvs_decode_engine_submit(kvs_decode_engine_t *engine, const kvs_request_t *request,
                                      const kvs_engine_fault_t *fault);
/* Admits queued rooms, polls live ones, verifies and concludes finished ones. Returns how many
 * rooms changed state. */
uint32_t kvs_decode_engine_step(kvs_decode_engine_t *engine);
uint32_t kvs_decode_engine_live_rooms(const kvs_decode_engine_t *engine);
size_t kvs_decode_engine_cached_pages(const kvs_decode_engine_t *engine);

/* A room's reason over its ranks, one failed rank's reason at a time: the root cause wins over
 * KVS_ERR_ABORTED, which on one rank is usually another rank's failure echoed back (an engine
 * aborts a room's other ranks when one fails it, and prefill passes that on to decode). */
static inline kvs_status_t kvs_engine_root_cause(kvs_status_t reason, kvs_status_t rank_reason)
{
    if (reason == KVS_OK || (reason == KVS_ERR_ABORTED && rank_reason != KVS_OK))
        return rank_reason;
    return reason;
}

#endif
