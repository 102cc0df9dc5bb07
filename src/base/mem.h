/* Host and device memory for kvstage's own buffers (internal): allocation of pools, staging
 * rings and staging buffers of either kind, copies between any two pointers, the few device
 * queries the layers above need (which device a pointer lives on, peer access), and a copy
 * queue for asynchronous transport writes. Builds without CUDA keep the same functions: host
 * memory works, device memory is refused with KVS_ERR_UNSUPPORTED. */
#ifndef KVSTAGE_BASE_MEM_H
#define KVSTAGE_BASE_MEM_H

#include <stddef.h>
#include <stdint.h>

#include "kvstage/mem.h"
#include "kvstage/status.h"

/* Host allocations are aligned to this (a page: enough for vector loads, DMA engines and
 * registration with a transport); cudaMalloc aligns device memory at least as much. */
#define KVS_MEM_ALIGN 4096u

/* Allocates `bytes` of zeroed memory of `kind` (device memory on `device`) and logs its own
 * failures: KVS_ERR_NOMEM, KVS_ERR_INVALID for a device the machine does not have,
 * KVS_ERR_UNSUPPORTED for device memory without CUDA or a GPU. Device memory is zeroed before
 * the call returns, so no stream can see it unzeroed. The caller's current device is kept. */
kvs_status_t kvs_mem_alloc(kvs_mem_kind_t kind, int device, size_t bytes, void **ptr_p);
/* Frees what kvs_mem_alloc returned (same kind and device); NULL is ignored. */
void kvs_mem_free(kvs_mem_kind_t kind, int device, void *ptr);

/* Copies bytes between any two pointers (host or device, same or different devices) and
 * returns once the copy is complete; the areas must not overlap. KVS_ERR_IO (logged) when the
 * device copy fails. */
kvs_status_t kvs_mem_copy(void *dst, const void *src, size_t bytes);

/* CUDA devices the runtime sees; 0 without CUDA or without a GPU. Never logs. */
int kvs_mem_device_count(void);
/* The device that ptr's memory lives on, or -1 for host memory (always -1 without CUDA). */
int kvs_mem_device_of(const void *ptr);
/* Lets kernels on `device` access memory of `peer` (idempotent; nothing to do when they are
 * the same device). KVS_ERR_UNSUPPORTED (logged) when the two GPUs cannot reach each other. */
kvs_status_t kvs_mem_peer_enable(int device, int peer);
/* 1 when kernels on `device` can store to ptr: it is device memory of `device`, or of a peer
 * that `device` can reach (peer access is enabled on the way). 0 for host memory. Never logs. */
int kvs_mem_device_can_access(int device, const void *ptr);
/* Waits for all work queued on `device` (any stream). */
kvs_status_t kvs_mem_device_sync(int device);

/* An ordered queue of asynchronous copies: a CUDA stream on one device with completion
 * events, or plain memcpy (complete at once) for a host queue (device < 0) and in builds
 * without CUDA. Tickets are > 0 and increasing; copies finish in ticket order. One thread
 * uses a queue at a time. */
typedef struct kvs_mem_queue kvs_mem_queue_t;

kvs_status_t kvs_mem_queue_create(int device, kvs_mem_queue_t **queue_p);
/* Waits for the copies in flight, then frees the queue. NULL is ignored. */
void kvs_mem_queue_destroy(kvs_mem_queue_t *queue);
/* Starts copying bytes from src to dst; src and dst must stay valid (and src unchanged) until
 * the ticket completes. */
kvs_status_t kvs_mem_queue_copy(kvs_mem_queue_t *queue, void *dst, const void *src, size_t bytes,
                                uint64_t *ticket_p);
/* KVS_OK when the copy with this ticket (and every earlier one) is complete, KVS_INPROGRESS,
 * KVS_ERR_IO when the device reported a failure, KVS_ERR_INVALID for a ticket never issued. */
kvs_status_t kvs_mem_queue_poll(kvs_mem_queue_t *queue, uint64_t ticket);
/* The queue's device, -1 for a host queue. */
int kvs_mem_queue_device(const kvs_mem_queue_t *queue);

#endif
