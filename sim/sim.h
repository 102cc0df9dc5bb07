/* The deterministic whole-system simulation: synthetic but exact KV, seeded workloads, and a
 * driver that runs one prefill instance and one decode instance (each with its own engine, KV
 * pools and radix cache) over the in-process transport on a virtual clock, then checks every
 * protocol.md §7 invariant it can observe from outside the protocol. */
#ifndef KVSTAGE_SIM_H
#define KVSTAGE_SIM_H

#include <stddef.h>
#include <stdint.h>

#include "kvstage/layout.h"
#include "kvstage/pd.h"
#include "kvstage/pool.h"
#include "kvstage/status.h"

/* ---- synthetic KV ----
 *
 * The bytes at (position, layer, component, global head, byte) are a pure function of the token
 * ids [0, position] (through a rolling hash) and of the coordinates, so a misplaced, stale or
 * missing byte anywhere is caught, and two prompts sharing a prefix share its KV exactly (what
 * a radix cache relies on). */

/* Rolling hash of a prompt: hashes_p[i] identifies tokens [0, i]. hashes_p holds len entries. */
void kvs_synth_hashes(const int32_t *tokens, uint64_t len, uint64_t *hashes_p);

/* Byte `byte` (within the head's D * E bytes) of global head `head`, (layer, component), at
 * the position whose rolling hash is `hash`. */
uint8_t kvs_synth_byte(uint64_t hash, uint32_t layer, uint32_t component, uint32_t head,
                       uint32_t byte);

/* Writes positions [start, end) of the heads this pool's rank holds: position pos lives in page
 * page_table[pos / P] at token pos % P. Any strides (NHD, HND). */
void kvs_synth_write(kvs_pool_t *pool, const uint64_t *hashes, const uint32_t *page_table,
                     uint64_t start, uint64_t end);
/* The same for a pool of a pipeline stage: its layer l is the model's first_layer + l. */
void kvs_synth_write_layers(kvs_pool_t *pool, uint32_t first_layer, const uint64_t *hashes,
                            const uint32_t *page_table, uint64_t start, uint64_t end);

/* Compares positions [start, end) against the synthetic KV; returns the number of bytes that
 * differ (0 = exact). */
uint64_t kvs_synth_verify(const kvs_pool_t *pool, const uint64_t *hashes,
                          const uint32_t *page_table, uint64_t start, uint64_t end);
/* The same for a decode context parallel rank's pool: the positions of [start, end) that it
 * holds, each at its local position (kvs_dcp_local) of the page table. */
uint64_t kvs_synth_verify_dcp(const kvs_pool_t *pool, const kvs_dcp_t *dcp, const uint64_t *hashes,
                              const uint32_t *page_table, uint64_t start, uint64_t end);

/* The synthetic "first generated token" of a prompt whose last rolling hash is last_hash: what
 * prefill sends as final metadata (4 bytes, little-endian). */
int32_t kvs_synth_first_token(uint64_t last_hash);

/* ---- workloads ---- */

typedef enum {
    KVS_WORKLOAD_SHARED_PREFIX = 0, /* groups share a prefix_len prefix, then a unique tail */
    KVS_WORKLOAD_MULTI_TURN = 1,    /* a client's next prompt extends its last prompt + answer */
    KVS_WORKLOAD_RANDOM = 2,        /* random lengths and tokens, little sharing */
    KVS_WORKLOAD_NEEDLE = 3,        /* one document with a short unique needle at a random spot */
} kvs_workload_kind_t;

/* "shared-prefix", "multi-turn", "random", "needle". */
const char *kvs_workload_kind_str(kvs_workload_kind_t kind);
/* KVS_ERR_INVALID (logged) for an unknown name. */
kvs_status_t kvs_workload_kind_parse(const char *name, kvs_workload_kind_t *kind_p);

typedef struct {
    kvs_workload_kind_t kind;
    uint32_t requests;
    uint32_t prompt_len;      /* longest prompt, tokens */
    uint32_t prefix_len;      /* shared-prefix: tokens every request of a group shares */
    uint32_t groups;          /* prefix groups / documents / clients; 0 = chosen from requests */
    uint32_t repeat_permille; /* chance that a request repeats an earlier prompt exactly */
    uint64_t seed;
} kvs_workload_config_t;

typedef struct {
    uint64_t room;         /* the id the router gives the request (distinct per request) */
    uint32_t index;        /* position in the workload (arrival order) */
    uint32_t len;          /* prompt length, >= 1 */
    const int32_t *tokens; /* [len] */
    uint32_t group;        /* prefix group, document or client */
    int64_t parent;        /* multi-turn: index of the previous turn; repeats: the original;
                              -1 otherwise */
} kvs_request_t;

typedef struct {
    kvs_workload_config_t config;
    uint32_t count;
    kvs_request_t *requests; /* [count] */
    int32_t *tokens;         /* every prompt, back to back */
} kvs_workload_t;

/* Token ids below this are "vocabulary" tokens drawn at random; ids at or above it are unique
 * markers (group starts, unique tails, needles) that never collide. */
#define KVS_WORKLOAD_VOCAB 32000

/* Deterministic per config (seed included). KVS_ERR_INVALID for a config that cannot be built
 * (no requests, prompt_len 0, shared-prefix with prefix_len >= prompt_len). */
kvs_status_t kvs_workload_create(const kvs_workload_config_t *config, kvs_workload_t **workload_p);
void kvs_workload_destroy(kvs_workload_t *workload);

/* ---- the simulation ---- */

/* Fault kinds, a bit mask. reorder/dup/drop act on the network; abort and timeout pick a few
 * rooms ("fault rooms") that are aborted mid-transfer or whose prefill stalls forever. */
enum {
    KVS_SIM_FAULT_REORDER = 1u << 0,
    KVS_SIM_FAULT_DUP = 1u << 1,
    KVS_SIM_FAULT_DROP = 1u << 2,
    KVS_SIM_FAULT_ABORT = 1u << 3,
    KVS_SIM_FAULT_TIMEOUT = 1u << 4,
    KVS_SIM_FAULT_CORRUPT = 1u << 5,   /* a bit flipped in some data writes after they land */
    KVS_SIM_FAULT_WRITEFAIL = 1u << 6, /* some data writes fail (half landed, KVS_ERR_IO) */
};

/* The fault names, for help texts. */
#define KVS_SIM_FAULT_LIST "none|reorder|dup|drop|abort|timeout|corrupt|writefail"
/* Parses a comma list of KVS_SIM_FAULT_LIST; KVS_ERR_INVALID (logged, naming the bad item)
 * otherwise. */
kvs_status_t kvs_sim_faults_parse(const char *list, uint32_t *faults_p);
/* Writes the comma list for a mask ("none" for 0). */
void kvs_sim_faults_str(uint32_t faults, char *buf, size_t cap);

typedef struct {
    uint32_t concluded; /* requests concluded on both sides */
    uint32_t requests;
    uint32_t succeeded, failed;
    uint64_t virtual_ns;
} kvs_sim_progress_t;

typedef void (*kvs_sim_progress_fn)(void *arg, const kvs_sim_progress_t *progress);

typedef struct {
    kvs_kv_shape_t shape;
    uint32_t prefill_tp, decode_tp;
    uint32_t prefill_pp;        /* pipeline stages on prefill (0 or 1: none) */
    uint32_t decode_dcp;        /* decode context parallel group size (0 or 1: none) */
    uint32_t dcp_interleave;    /* its interleave (0: 1) */
    uint32_t page_size;         /* decode pages (the grid's); prefill too unless set below */
    uint32_t prefill_page_size; /* 0 = page_size */
    uint32_t chunk_tokens;
    kvs_pool_layout_t prefill_layout, decode_layout;
    uint32_t prefill_pool_pages, decode_pool_pages; /* per rank; 0 = sized from the workload */
    uint64_t ring_bytes; /* per decode rank; 0 = ring_slots slots of the full slot size */
    uint32_t ring_slots;
    uint32_t window_chunks, staging_buffers; /* sender knobs */
    kvs_write_mode_t write_mode;             /* sender knob (auto) */
    /* Where pools, staging buffers and rings live: host (the CPU reference) or device memory,
     * prefill ranks on prefill_device and decode ranks on decode_device (several ranks share a
     * GPU). On devices the CUDA copy kernels gather and scatter and writes are CUDA copies. */
    kvs_mem_kind_t mem;
    int prefill_device, decode_device;
    uint32_t prefill_batch; /* rooms in one prefill forward pass */
    int prefill_radix, decode_radix;
    kvs_workload_config_t workload; /* its seed is derived from `seed` */
    uint32_t concurrency;           /* requests in flight at once (the router's limit) */
    uint32_t faults;                /* KVS_SIM_FAULT_* */
    uint32_t fault_rooms;           /* rooms per abort/timeout fault; 0 = about 1 in 16 */
    int no_checksum;                /* chunk checksums off (protocol.md §5.5); on by default */
    int64_t misaligned_request;     /* test hook: this request index gets base + 1; -1 = none */
    uint64_t write_delay_ns;        /* data writes land up to this late; 0 = 20 ticks under
                                       the reorder fault, immediately otherwise */
    kvs_pd_timeouts_t timeouts;     /* zero fields are scaled from the virtual tick */
    uint64_t tick_ns;               /* virtual time per busy loop iteration */
    uint64_t step_ns;               /* virtual duration of one prefill forward pass */
    uint64_t max_iterations;        /* give up (result.stalled) after this many iterations */
    uint64_t max_virtual_ns;        /* ... or this much virtual time */
    uint64_t seed;
    kvs_sim_progress_fn progress; /* optional; called whenever a request concludes */
    void *progress_arg;
} kvs_sim_config_t;

/* The demo configuration: prefill TP4 -> decode TP2, 8 KV heads, page 16, chunk 256, the
 * shared-prefix workload, radix caches on both sides, no faults. */
void kvs_sim_config_default(kvs_sim_config_t *config_p);

/* Bytes of the largest full slot (G tokens) on any decode rank: the unit of ring_slots. 0 for
 * an invalid layout. */
/* What both sides of the simulated deployment agree on. */
kvs_pd_geometry_t kvs_sim_geometry(const kvs_sim_config_t *config);

uint64_t kvs_sim_full_slot_bytes(const kvs_sim_config_t *config);

/* Writes the `kvstage sim` command line that reproduces config. */
void kvs_sim_config_cmdline(const kvs_sim_config_t *config, char *buf, size_t cap);

typedef struct {
    uint32_t requests, succeeded, failed;
    uint32_t expected_failures;   /* failed rooms that a fault (abort, timeout, misaligned
                                     base) targeted */
    uint32_t unexpected_failures; /* failed rooms no fault targeted */
    uint32_t side_mismatches;     /* rooms where prefill and decode disagree on the outcome
                                     (counted among unexpected failures) */
    uint32_t fail_reasons[16];    /* failed rooms by -reason (KVS_ERR_*), decode side */
    int exact;                    /* every succeeded room verified byte-exact */
    uint64_t mismatched_bytes;
    uint32_t meta_mismatches; /* succeeded rooms whose final metadata was wrong */
    uint64_t leaked_slots;    /* live staging slots or used ring bytes left (count of rings) */
    uint64_t leaked_pages;    /* pool pages neither free nor owned by a radix cache */
    uint64_t leaked_rooms;    /* room state left on any sender or receiver */
    uint64_t leaked_allocs;   /* accounted heap blocks left after teardown */
    uint64_t chunks;          /* chunks scattered (all decode ranks) */
    uint64_t expected_chunks; /* what succeeded rooms alone need */
    uint64_t bulk_writes;
    uint64_t direct_writes;   /* of bulk_writes: gathered straight into the remote slot */
    uint64_t per_page_writes; /* what a per-page path would issue for the succeeded rooms */
    uint64_t control_messages;
    uint64_t retries, rejected_messages, ignored_messages;
    uint64_t bytes_moved;
    uint64_t protocol_ns; /* real time inside sender/receiver progress, all ranks */
    uint64_t data_ns;     /* of which gather, scatter and transport writes */
    uint64_t ring_capacity, ring_high_water;        /* bytes, max over decode ranks */
    uint64_t decode_hit_tokens, prefill_hit_tokens; /* radix hits, summed over rooms */
    uint64_t max_prefill_hit_tokens;
    uint32_t full_decode_hits; /* rooms with nothing to transfer (metadata-only send) */
    uint64_t net_dropped, net_duplicated;
    /* The corruption fault: data writes with a flipped bit, and writer regions whose checksum
     * failed at the scatter. Detected <= injected: a corrupted write into a chunk of a room
     * that already failed is never scattered, so never checked (and never used). */
    uint64_t corrupt_injected, corrupt_detected;
    /* The broken-write fault: data writes that failed; each fails its room (if it was live). */
    uint64_t write_failures;
    int stalled;          /* gave up at the iteration / virtual time limit */
    uint32_t unconcluded; /* requests not concluded when it gave up */
    uint64_t iterations;
    uint64_t drain_ns; /* virtual time from the last conclusion until the protocol was quiet */
    uint64_t virtual_ns;
    double wall_s;
} kvs_sim_result_t;

/* Runs the simulation. KVS_OK when it ran (the verdict is in the result, see kvs_sim_result_ok);
 * KVS_ERR_INVALID for a bad configuration, KVS_ERR_NOMEM on allocation failure,
 * KVS_ERR_UNSUPPORTED for device memory without CUDA or a GPU. */
kvs_status_t kvs_sim_run(const kvs_sim_config_t *config, kvs_sim_result_t *result_p);

/* 1 when every room that should succeed succeeded exactly, nothing leaked and it finished. */
int kvs_sim_result_ok(const kvs_sim_result_t *result);

#endif
