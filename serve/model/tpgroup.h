/* The tensor-parallel group of the reference engine: the TP ranks of one model replica, as
 * processes on one host (or threads of one process, for tests), meet in one POSIX
 * shared-memory segment for all-reduce, broadcast and barrier. Every wait has a deadline, so a
 * dead or stuck peer is an error on the survivors, never a hang.
 *
 * Collectives are matched by order: every rank must make the same sequence of calls (the same
 * operation with the same n), as with MPI or NCCL. A mismatch that is seen is an error.
 *
 * Errors of a collective call:
 *   KVS_ERR_TIMEOUT       some rank did not arrive by the deadline (the log names them);
 *   KVS_ERR_IO            a peer process is gone: found with kill(pid, 0) once it has been
 *                         reaped, long before the deadline; an unreaped (zombie) or foreign-
 *                         namespace peer is found by the deadline instead;
 *   KVS_ERR_ABORTED       another rank failed first and marked the segment aborted;
 *   KVS_ERR_INCOMPATIBLE  the ranks made different calls (operation or n) in one generation;
 *   KVS_ERR_STATE         this handle failed earlier.
 * Any of the first four poisons the group: the failing rank marks the segment aborted so its
 * peers fail fast instead of waiting out their deadlines, and every later call on the handle
 * fails at once with KVS_ERR_STATE; the only thing left to do is kvs_tpgroup_leave(). An
 * invalid argument (KVS_ERR_INVALID) touches nothing and does not poison the group.
 *
 * One group handle belongs to one thread at a time.
 *
 * Names and reclaim: a segment outlives its processes only when rank 0 dies without leaving
 * (SIGKILL of the whole instance). Names of the form "/kvs-PID-TAG" (PID in decimal, the
 * process that owns the name: the launcher of the ranks) let kvs_tpgroup_reclaim() find the
 * segments whose owner is gone and remove them; kvstage calls it whenever it launches an
 * instance. */
#ifndef KVSTAGE_TPGROUP_H
#define KVSTAGE_TPGROUP_H

#include <stddef.h>
#include <stdint.h>

#include "kvstage/status.h"

/* Largest group size accepted. */
#define KVS_TPGROUP_MAX_RANKS 256

typedef struct kvs_tpgroup kvs_tpgroup_t;

typedef struct {
    /* POSIX shm name, unique per group and the same on every rank: '/' then 1..254 characters
     * without '/', e.g. "/kvs-<pid of rank 0's parent>-<instance>" (reclaimable, above). Unused
     * when size is 1. */
    const char *name;
    uint32_t size; /* ranks in the group, 1..KVS_TPGROUP_MAX_RANKS */
    uint32_t rank; /* this rank, < size */
    /* Capacities, identical on every rank (a rank whose values differ cannot join). */
    size_t max_doubles; /* largest all-reduce, in doubles (the engine: tokens per step x dim) */
    size_t max_bytes;   /* largest broadcast, in bytes */
    /* Deadline of every call, join included, counted from the start of the call; > 0. */
    uint64_t timeout_ms;
} kvs_tpgroup_config_t;

/* Joins the group and returns once all `size` ranks have joined (a join barrier). Rank 0
 * creates the segment, first removing a stale one of the same name left by a crashed run;
 * the other ranks open it, retrying until the deadline, and move to the new segment when the
 * one they opened turns out to be stale. Size 1 needs no shared memory at all.
 * KVS_ERR_TIMEOUT: some rank did not arrive in time (the message names them);
 * KVS_ERR_INCOMPATIBLE: the segment found has other capacities or size (at the deadline);
 * KVS_ERR_INVALID, KVS_ERR_NOMEM, KVS_ERR_IO. On failure nothing is left behind (rank 0
 * removes the segment it created). */
kvs_status_t kvs_tpgroup_join(const kvs_tpgroup_config_t *config, kvs_tpgroup_t **group_p);

/* Unmaps the segment and frees the handle; rank 0 also removes the name. No barrier: a rank
 * may leave while the others still finish their last call. NULL is a no-op. */
void kvs_tpgroup_leave(kvs_tpgroup_t *group);

/* Removes every segment named "/kvs-PID-..." (/dev/shm) whose owner PID no longer exists
 * (kill(PID, 0) fails with ESRCH); logs each. Returns how many it removed. A live owner is never
 * touched, nor a name of another form. Limit: PIDs are this PID namespace's, so hosts that share
 * /dev/shm between PID namespaces (containers) must not share it with kvstage instances. */
uint32_t kvs_tpgroup_reclaim(void);

uint32_t kvs_tpgroup_size(const kvs_tpgroup_t *group);
uint32_t kvs_tpgroup_rank(const kvs_tpgroup_t *group);
/* The deadline of the group's calls (its config's timeout_ms), in nanoseconds. */
uint64_t kvs_tpgroup_timeout_ns(const kvs_tpgroup_t *group);

/* In place: buf[i] = sum over ranks of each rank's buf[i], added in rank order
 * ((b0 + b1) + b2) + ..., so every rank gets the bitwise-identical result whatever the
 * timing. n <= max_doubles (KVS_ERR_INVALID otherwise, nothing touched); n may be 0. */
kvs_status_t kvs_tpgroup_allreduce(kvs_tpgroup_t *group, double *buf, size_t n);

/* kvs_tpgroup_allreduce for the engine's all-reduce callback (group is a kvs_tpgroup_t). */
kvs_status_t kvs_tpgroup_allreduce_cb(void *group, double *buf, size_t n);

/* Copies rank 0's buf[0..n) into every other rank's buf. n <= max_bytes; every rank passes
 * the same n. Also a barrier. */
kvs_status_t kvs_tpgroup_broadcast(kvs_tpgroup_t *group, void *buf, size_t n);

/* Returns once every rank has entered the same barrier. */
kvs_status_t kvs_tpgroup_barrier(kvs_tpgroup_t *group);

#endif
