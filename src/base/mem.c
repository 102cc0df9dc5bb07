/* Host and device memory (see base/mem.h). Every CUDA call restores the caller's current
 * device, so objects of several GPUs can be driven from one thread without the thread's device
 * changing under it. */
#include "base/mem.h"

#include <pthread.h>
#include <string.h>

#include "kvstage/alloc.h"
#include "kvstage/log.h"

#if KVS_HAVE_CUDA
#include "base/cuda_util.h"
#endif

static const char *kind_name(kvs_mem_kind_t kind)
{
    return kind == KVS_MEM_DEVICE ? "device" : "host";
}

#if KVS_HAVE_CUDA

static pthread_once_t count_once = PTHREAD_ONCE_INIT;
static int device_count;

static void count_devices(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void) cudaGetLastError();
        n = 0;
    }
    device_count = n;
}

int kvs_mem_device_count(void)
{
    pthread_once(&count_once, count_devices);
    return device_count;
}

/* Makes `device` current; the previous device goes to *prev_p for device_leave. */
static kvs_status_t device_enter(int device, const char *what, int *prev_p)
{
    int prev = 0;
    kvs_status_t st = KVS_CUDA_CHECK(cudaGetDevice(&prev), "mem: %s: current device", what);
    if (st != KVS_OK) return st;
    if (prev != device) {
        st = KVS_CUDA_CHECK(cudaSetDevice(device), "mem: %s on device %d", what, device);
        if (st != KVS_OK) return st;
    }
    *prev_p = prev;
    return KVS_OK;
}

static void device_leave(int device, int prev)
{
    if (prev != device) (void) cudaSetDevice(prev);
}

static kvs_status_t device_check(int device, size_t bytes)
{
    int count = kvs_mem_device_count();
    if (count == 0) {
        kvs_error("mem: %zu bytes of device memory on device %d: no usable CUDA device here", bytes,
                  device);
        return KVS_ERR_UNSUPPORTED;
    }
    if (device < 0 || device >= count) {
        kvs_error("mem: device memory on device %d, but this machine has %d CUDA device(s)", device,
                  count);
        return KVS_ERR_INVALID;
    }
    return KVS_OK;
}

static kvs_status_t device_alloc(int device, size_t bytes, void **ptr_p)
{
    kvs_status_t st = device_check(device, bytes);
    if (st != KVS_OK) return st;
    int prev = 0;
    st = device_enter(device, "allocation", &prev);
    if (st != KVS_OK) return st;
    void *mem = NULL;
    st = KVS_CUDA_CHECK(cudaMalloc(&mem, bytes), "mem: %zu bytes on device %d", bytes, device);
    if (st == KVS_OK) {
        /* cudaMemset runs on the legacy default stream, which the copy backends' non-blocking
         * streams do not wait for: finish it here so no copy can see unzeroed memory. */
        st = KVS_CUDA_CHECK(cudaMemset(mem, 0, bytes), "mem: zeroing %zu bytes on device %d", bytes,
                            device);
        if (st == KVS_OK)
            st = KVS_CUDA_CHECK(cudaStreamSynchronize(0), "mem: zeroing %zu bytes on device %d",
                                bytes, device);
        if (st != KVS_OK) (void) cudaFree(mem);
    }
    device_leave(device, prev);
    if (st != KVS_OK) return st;
    *ptr_p = mem;
    return KVS_OK;
}

static void device_free(int device, void *ptr)
{
    int prev = device;
    const int entered = device_enter(device, "freeing", &prev) == KVS_OK;
    (void) KVS_CUDA_CHECK(cudaFree(ptr), "mem: freeing device memory on device %d", device);
    if (entered) device_leave(device, prev);
}

int kvs_mem_device_of(const void *ptr)
{
    if (ptr == NULL || kvs_mem_device_count() == 0) return -1;
    struct cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, ptr) != cudaSuccess) {
        (void) cudaGetLastError();
        return -1;
    }
    return a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged ? a.device : -1;
}

kvs_status_t kvs_mem_copy(void *dst, const void *src, size_t bytes)
{
    if (bytes == 0) return KVS_OK;
    if (kvs_mem_device_of(dst) < 0 && kvs_mem_device_of(src) < 0) {
        memcpy(dst, src, bytes);
        return KVS_OK;
    }
    /* The per-thread stream, then a wait: a plain cudaMemcpy between two device buffers may
     * return before the copy is done, and the copy backends' streams would not wait for it. */
    kvs_status_t st =
        KVS_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, cudaStreamPerThread),
                       "mem: copying %zu bytes from %p to %p", bytes, src, dst);
    if (st != KVS_OK) return st;
    return KVS_CUDA_CHECK(cudaStreamSynchronize(cudaStreamPerThread),
                          "mem: copying %zu bytes from %p to %p", bytes, src, dst);
}

/* Pairs this process enabled (bit p of [d]: device d reaches peer p), so enabling stays
 * idempotent without asking CUDA again: a repeated cudaDeviceEnablePeerAccess returns an error
 * that memory checkers report. Ordinals from 64 up are not remembered. */
#define PEER_BITS 64
static pthread_mutex_t peer_lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t peer_enabled[PEER_BITS];

/* Enables access from device to peer (different devices); cudaSuccess or the error, which
 * the caller reports (or not). */
static cudaError_t enable_peer(int device, int peer)
{
    const int known = device < PEER_BITS && peer < PEER_BITS;
    pthread_mutex_lock(&peer_lock);
    cudaError_t err = cudaSuccess;
    if (!known || !(peer_enabled[device] >> peer & 1)) {
        int can = 0, prev = 0;
        err = cudaDeviceCanAccessPeer(&can, device, peer);
        if (err == cudaSuccess && !can) err = cudaErrorPeerAccessUnsupported;
        if (err == cudaSuccess) err = cudaGetDevice(&prev);
        if (err == cudaSuccess) err = cudaSetDevice(device);
        if (err == cudaSuccess) {
            err = cudaDeviceEnablePeerAccess(peer, 0);
            if (err == cudaErrorPeerAccessAlreadyEnabled) err = cudaSuccess; /* done elsewhere */
            (void) cudaSetDevice(prev);
        }
        if (err != cudaSuccess) {
            (void) cudaGetLastError();
            kvs_debug("mem: no peer access from device %d to %d: %s", device, peer,
                      cudaGetErrorString(err));
        }
        if (err == cudaSuccess && known) peer_enabled[device] |= 1ull << peer;
    }
    pthread_mutex_unlock(&peer_lock);
    return err;
}

kvs_status_t kvs_mem_peer_enable(int device, int peer)
{
    if (device == peer) return KVS_OK;
    cudaError_t err = enable_peer(device, peer);
    if (err == cudaErrorPeerAccessUnsupported) {
        kvs_error("mem: device %d cannot access device %d's memory (no peer path)", device, peer);
        return KVS_ERR_UNSUPPORTED;
    }
    return KVS_CUDA_CHECK(err, "mem: enabling peer access from device %d to %d", device, peer);
}

int kvs_mem_device_can_access(int device, const void *ptr)
{
    int where = kvs_mem_device_of(ptr);
    if (where < 0) return 0;
    return where == device || enable_peer(device, where) == cudaSuccess;
}

kvs_status_t kvs_mem_device_sync(int device)
{
    int prev = 0;
    kvs_status_t st = device_enter(device, "synchronize", &prev);
    if (st != KVS_OK) return st;
    st = KVS_CUDA_CHECK(cudaDeviceSynchronize(), "mem: waiting for device %d", device);
    device_leave(device, prev);
    return st;
}

#else /* built without CUDA */

int kvs_mem_device_count(void)
{
    return 0;
}

int kvs_mem_device_of(const void *ptr)
{
    (void) ptr;
    return -1;
}

kvs_status_t kvs_mem_copy(void *dst, const void *src, size_t bytes)
{
    if (bytes) memcpy(dst, src, bytes);
    return KVS_OK;
}

kvs_status_t kvs_mem_peer_enable(int device, int peer)
{
    if (device == peer) return KVS_OK;
    kvs_error("mem: peer access from device %d to %d needs a CUDA build", device, peer);
    return KVS_ERR_UNSUPPORTED;
}

int kvs_mem_device_can_access(int device, const void *ptr)
{
    (void) device;
    (void) ptr;
    return 0;
}

kvs_status_t kvs_mem_device_sync(int device)
{
    kvs_error("mem: waiting for device %d needs a CUDA build", device);
    return KVS_ERR_UNSUPPORTED;
}

#endif

kvs_status_t kvs_mem_alloc(kvs_mem_kind_t kind, int device, size_t bytes, void **ptr_p)
{
    if (ptr_p == NULL || (kind != KVS_MEM_HOST && kind != KVS_MEM_DEVICE)) {
        kvs_error("mem: allocation of kind %d with output %p: invalid", (int) kind, (void *) ptr_p);
        return KVS_ERR_INVALID;
    }
    if (bytes == 0) bytes = 1; /* a unique pointer, as malloc(0) may not give one */
    if (kind == KVS_MEM_DEVICE) {
#if KVS_HAVE_CUDA
        return device_alloc(device, bytes, ptr_p);
#else
        kvs_error("mem: %zu bytes of device memory on device %d: this kvstage was built without "
                  "CUDA",
                  bytes, device);
        return KVS_ERR_UNSUPPORTED;
#endif
    }
    void *mem = kvs_aligned_alloc(KVS_MEM_ALIGN, bytes);
    if (mem == NULL) {
        kvs_error("mem: out of memory allocating %zu bytes of %s memory", bytes, kind_name(kind));
        return KVS_ERR_NOMEM;
    }
    /* Zeroed so that a byte read before it is written is deterministic (and quiet under memory
     * checkers); it also touches every page up front instead of on the hot path. */
    memset(mem, 0, bytes);
    *ptr_p = mem;
    return KVS_OK;
}

void kvs_mem_free(kvs_mem_kind_t kind, int device, void *ptr)
{
    if (ptr == NULL) return;
#if KVS_HAVE_CUDA
    if (kind == KVS_MEM_DEVICE) {
        device_free(device, ptr);
        return;
    }
#else
    (void) kind;
#endif
    (void) device;
    kvs_free(ptr);
}

/* ---- the copy queue ---- */

#define QUEUE_EVENTS 64u /* copies in flight before a copy waits for the oldest */

struct kvs_mem_queue {
    int device; /* -1: host queue (memcpy) */
    uint64_t issued, done;
#if KVS_HAVE_CUDA
    cudaStream_t stream;
    cudaEvent_t events[QUEUE_EVENTS]; /* ticket t completes with events[t % QUEUE_EVENTS] */
    uint64_t event_ticket[QUEUE_EVENTS];
#endif
};

int kvs_mem_queue_device(const kvs_mem_queue_t *q)
{
    return q->device;
}

#if KVS_HAVE_CUDA
/* Frees what create made; safe on a partly built queue. */
static void queue_release(kvs_mem_queue_t *q)
{
    int prev = q->device;
    const int entered = device_enter(q->device, "copy queue", &prev) == KVS_OK;
    if (q->stream != NULL) {
        (void) KVS_CUDA_CHECK(cudaStreamSynchronize(q->stream), "mem: draining a copy queue");
        (void) KVS_CUDA_CHECK(cudaStreamDestroy(q->stream), "mem: copy queue stream");
    }
    for (uint32_t i = 0; i < QUEUE_EVENTS; i++)
        if (q->events[i] != NULL)
            (void) KVS_CUDA_CHECK(cudaEventDestroy(q->events[i]), "mem: copy queue event");
    if (entered) device_leave(q->device, prev);
}
#endif

kvs_status_t kvs_mem_queue_create(int device, kvs_mem_queue_t **queue_p)
{
    kvs_mem_queue_t *q = kvs_calloc(1, sizeof(*q));
    if (q == NULL) {
        kvs_error("mem: out of memory creating a copy queue");
        return KVS_ERR_NOMEM;
    }
    q->device = device < 0 ? -1 : device;
    if (q->device < 0) {
        *queue_p = q;
        return KVS_OK;
    }
#if KVS_HAVE_CUDA
    kvs_status_t st = device_check(device, 0);
    int prev = 0;
    if (st == KVS_OK) st = device_enter(device, "copy queue", &prev);
    if (st != KVS_OK) {
        kvs_free(q);
        return st;
    }
    st = KVS_CUDA_CHECK(cudaStreamCreateWithFlags(&q->stream, cudaStreamNonBlocking),
                        "mem: copy queue stream on device %d", device);
    for (uint32_t i = 0; i < QUEUE_EVENTS && st == KVS_OK; i++)
        st = KVS_CUDA_CHECK(cudaEventCreateWithFlags(&q->events[i], cudaEventDisableTiming),
                            "mem: copy queue event on device %d", device);
    device_leave(device, prev);
    if (st != KVS_OK) {
        queue_release(q);
        kvs_free(q);
        return st;
    }
    *queue_p = q;
    return KVS_OK;
#else
    kvs_error("mem: a copy queue on device %d needs a CUDA build", device);
    kvs_free(q);
    return KVS_ERR_UNSUPPORTED;
#endif
}

void kvs_mem_queue_destroy(kvs_mem_queue_t *q)
{
    if (q == NULL) return;
#if KVS_HAVE_CUDA
    if (q->device >= 0) queue_release(q);
#endif
    kvs_free(q);
}

kvs_status_t kvs_mem_queue_copy(kvs_mem_queue_t *q, void *dst, const void *src, size_t bytes,
                                uint64_t *ticket_p)
{
    if (q->device < 0) {
        if (bytes) memcpy(dst, src, bytes);
        q->done = ++q->issued;
        *ticket_p = q->issued;
        return KVS_OK;
    }
#if KVS_HAVE_CUDA
    const uint64_t ticket = q->issued + 1;
    const uint32_t slot = (uint32_t) (ticket % QUEUE_EVENTS);
    kvs_status_t st;
    if (q->event_ticket[slot] > q->done) {
        /* More than QUEUE_EVENTS copies in flight: the oldest must finish to free its event. */
        st = KVS_CUDA_CHECK(cudaEventSynchronize(q->events[slot]),
                            "mem: waiting for copy %llu on device %d",
                            (unsigned long long) q->event_ticket[slot], q->device);
        if (st != KVS_OK) return st;
        q->done = q->event_ticket[slot];
    }
    int prev = 0;
    st = device_enter(q->device, "queued copy", &prev);
    if (st != KVS_OK) return st;
    st = KVS_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, q->stream),
                        "mem: queued copy of %zu bytes from %p to %p on device %d", bytes, src, dst,
                        q->device);
    if (st == KVS_OK)
        st = KVS_CUDA_CHECK(cudaEventRecord(q->events[slot], q->stream),
                            "mem: queued copy completion on device %d", q->device);
    device_leave(q->device, prev);
    if (st != KVS_OK) return st;
    q->event_ticket[slot] = ticket;
    q->issued = ticket;
    *ticket_p = ticket;
    return KVS_OK;
#else
    (void) dst;
    (void) src;
    (void) bytes;
    (void) ticket_p;
    return KVS_ERR_UNSUPPORTED; /* create refuses device queues without CUDA */
#endif
}

kvs_status_t kvs_mem_queue_poll(kvs_mem_queue_t *q, uint64_t ticket)
{
    if (ticket == 0 || ticket > q->issued) {
        kvs_error("mem: poll of copy %llu, never issued (last %llu)", (unsigned long long) ticket,
                  (unsigned long long) q->issued);
        return KVS_ERR_INVALID;
    }
    if (ticket <= q->done) return KVS_OK;
#if KVS_HAVE_CUDA
    /* An event is reused only once its copy is known done, so a ticket above done still owns
     * its event. */
    const cudaError_t err = cudaEventQuery(q->events[ticket % QUEUE_EVENTS]);
    if (err == cudaErrorNotReady) return KVS_INPROGRESS;
    if (err == cudaSuccess) {
        q->done = ticket;
        return KVS_OK;
    }
    return KVS_CUDA_CHECK(err, "mem: queued copy %llu on device %d failed",
                          (unsigned long long) ticket, q->device);
#else
    return KVS_ERR_INVALID;
#endif
}
