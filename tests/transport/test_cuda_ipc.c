/* Tests for the CUDA IPC data plane (src/transport/cuda_ipc.c). Cross-process: the parent is
 * the decode rank (its ring in device memory, GPU 1 when there are two), the forked child the
 * prefill rank (GPU 0); the exported handle travels through a pipe. The child imports it,
 * writes many pieces of a pattern with more copies in flight than the link's copy queue has
 * events, rewrites each source piece only after its write completed, runs the CUDA gather
 * kernel of a small device pool straight into the mapped ring (the direct-write path), and
 * checks the refusals of its side; the parent then checks every byte of its ring: patterns
 * where they were written, zeros elsewhere. The child forks before this process touches CUDA (a
 * CUDA context does not survive fork), so this test runs first. Without a GPU (or without CUDA) the
 * tests report skipped after checking that the link is refused cleanly. */
#include "kvs_test.h"

#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "base/mem.h"
#include "kvstage/cuda_ipc.h"
#if KVS_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif
#include "kvstage/log.h"
#include "kvstage/pool.h"
#include "kvstage/rng.h"
#include "staging/copy.h"
#include "transport/link.h"

#define RING_BYTES (16u << 20)
#define PIECES     150 /* per round; round r lands in [r * AREA, (r + 1) * AREA) */
#define AREA       (4u << 20)
#define MAP_OFFSET (12u << 20) /* the gather kernel stores here */

/* The direct write: a one-layer MLA pool (latent 64 x bf16, pages of 4 tokens, NHD), so a
 * gathered page is its 512 bytes as they lie in the pool, pages in list order. */
#define POOL_PAGES 16
#define PAGE_BYTES (4 * 64 * 2)

#if KVS_HAVE_CUDA
static const uint32_t gather_pages[] = {5, 2, 9, 14, 0, 7};
#define GATHER_N (sizeof(gather_pages) / sizeof(gather_pages[0]))

/* Piece i: where it lands in the ring and how long it is; the same in both processes. */
static void piece(uint32_t i, uint64_t *offset_p, uint64_t *len_p)
{
    kvs_rng_t rng;
    kvs_rng_seed(&rng, 0x1c0ffee + i);
    *len_p = 1 + kvs_rng_below(&rng, 20000);
    *offset_p = (uint64_t) i * 25000 + kvs_rng_below(&rng, 16);
}

/* The byte at position k of piece i in round `round` (each source is written twice). */
static uint8_t pattern(uint32_t i, uint32_t round, uint64_t k)
{
    return (uint8_t) (kvs_mix64(((uint64_t) i << 40) ^ ((uint64_t) round << 32) ^ k) >> 17);
}

/* Child exit codes name the first thing that went wrong. */
enum {
    CHILD_OK = 0,
    CHILD_READ = 10,
    CHILD_LINK,
    CHILD_IMPORT,
    CHILD_ALLOC,
    CHILD_WRITE,
    CHILD_POLL,
    CHILD_MAP,
    CHILD_REACH,
    CHILD_GATHER,
    CHILD_REFUSALS,
};

/* Byte k of pool page p. */
static uint8_t pool_byte(uint32_t p, uint64_t k)
{
    return pattern(1000 + p, 7, k);
}

/* Gathers gather_pages of a fresh device pool into dst with the CUDA copy backend. */
static int gather_into(int device, uint8_t *dst)
{
    kvs_pool_config_t pc;
    memset(&pc, 0, sizeof(pc));
    pc.shape = (kvs_kv_shape_t){
        .layers = 1, .kv_heads = 1, .head_dim_k = 64, .elem_bytes = 2, .attn = KVS_ATTN_MLA};
    pc.tp.tp_size = 1;
    pc.page_size = 4;
    pc.num_pages = POOL_PAGES;
    pc.layout = KVS_POOL_NHD;
    pc.mem = KVS_MEM_DEVICE;
    pc.device = device;
    kvs_pool_t *pool = NULL;
    kvs_copy_backend_t gpu = {NULL, NULL};
    uint8_t host[POOL_PAGES * PAGE_BYTES];
    kvs_status_t s1 = kvs_pool_create(&pc, &pool);
    kvs_status_t s2 = s1 == KVS_OK ? kvs_copy_cuda_create(device, &gpu) : KVS_ERR_STATE;
    int ok = s1 == KVS_OK && s2 == KVS_OK;
    if (!ok)
        fprintf(stderr, "prefill process: pool %s, copy backend %s\n", kvs_status_str(s1),
                kvs_status_str(s2));
    const kvs_region_t *r = ok ? kvs_pool_region(pool, 0, 0) : NULL;
    ok = ok && r->page_stride == PAGE_BYTES;
    for (uint32_t p = 0; ok && p < POOL_PAGES; p++)
        for (uint64_t k = 0; k < PAGE_BYTES; k++) host[p * PAGE_BYTES + k] = pool_byte(p, k);
    ok = ok && kvs_mem_copy(r->base, host, sizeof(host)) == KVS_OK;
    kvs_copy_desc_t d = {.regions = r,
                         .layers = 1,
                         .components = 1,
                         .shape = &kvs_pool_config(pool)->shape,
                         .pages = gather_pages,
                         .npages = GATHER_N,
                         .pool_pages = POOL_PAGES,
                         .page_size = 4,
                         .pool_head = 0,
                         .heads = 1,
                         .region = dst,
                         .region_bytes = GATHER_N * PAGE_BYTES};
    uint64_t ticket = 0;
    kvs_status_t st = ok ? kvs_copy_submit(&gpu, KVS_COPY_GATHER, &d, &ticket) : KVS_ERR_INVALID;
    if (st == KVS_OK) {
        while ((st = kvs_copy_poll(&gpu, ticket)) == KVS_INPROGRESS) {
        }
    }
    if (!ok || st != KVS_OK)
        fprintf(stderr, "prefill process: gather into the mapped ring: setup %s, copy %s\n",
                ok ? "ok" : "failed", kvs_status_str(st));
    kvs_copy_backend_destroy(&gpu);
    kvs_pool_destroy(pool);
    return ok && st == KVS_OK;
}

/* The prefill process: everything here runs after fork, in a process with no CUDA state. */
static int child_main(int in_fd, int out_fd, int device)
{
    kvs_cuda_ipc_handle_t h;
    size_t got = 0;
    while (got < sizeof(h)) {
        ssize_t n = read(in_fd, h.bytes + got, sizeof(h) - got);
        if (n <= 0) return CHILD_READ;
        got += (size_t) n;
    }
    kvs_link_t *link = NULL;
    kvs_cuda_ipc_config_t cfg = {
        .side = KVS_SIDE_PREFILL, .rank = 0, .peer_tp = 1, .device = device};
    if (kvs_cuda_ipc_link_create(&cfg, &link) != KVS_OK) return CHILD_LINK;
    int rc = CHILD_OK;
    uint8_t *host = NULL;
    void *src = NULL;
    uint64_t tickets[PIECES];
    /* a malformed handle is refused; the real one opens */
    kvs_cuda_ipc_handle_t bad = h;
    bad.bytes[0] ^= 0xff;
    kvs_log_capture_t cap = {0};
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    if (kvs_cuda_ipc_import(link, 0, &bad) != KVS_ERR_INVALID ||
        kvs_cuda_ipc_import(link, 1, &h) != KVS_ERR_INVALID) {
        rc = CHILD_REFUSALS;
        goto out;
    }
    kvs_log_set_sink(NULL, NULL);
    if (kvs_cuda_ipc_import(link, 0, &h) != KVS_OK) {
        rc = CHILD_IMPORT;
        goto out;
    }
    /* sources: one device buffer, piece i at i * 20000 (lengths are at most 20000) */
    const size_t src_bytes = (size_t) PIECES * 20000;
    host = malloc(src_bytes);
    if (host == NULL || kvs_mem_alloc(KVS_MEM_DEVICE, device, src_bytes, &src) != KVS_OK) {
        rc = CHILD_ALLOC;
        goto out;
    }
    for (uint32_t round = 0; round < 2 && rc == CHILD_OK; round++) {
        /* the same sources twice, rewritten in between: each round's area must hold exactly
         * what the sources held when that round's writes were issued */
        for (uint32_t i = 0; i < PIECES; i++) {
            uint64_t off, len;
            piece(i, &off, &len);
            for (uint64_t k = 0; k < len; k++) host[(size_t) i * 20000 + k] = pattern(i, round, k);
        }
        if (kvs_mem_copy(src, host, src_bytes) != KVS_OK) {
            rc = CHILD_WRITE;
            break;
        }
        for (uint32_t i = 0; i < PIECES; i++) {
            uint64_t off, len;
            piece(i, &off, &len);
            off += (uint64_t) round * AREA;
            if (link->ops->write(link->ctx, 0, off, (uint8_t *) src + (size_t) i * 20000, len,
                                 &tickets[i]) != KVS_OK) {
                rc = CHILD_WRITE;
                break;
            }
        }
        if (rc != CHILD_OK) break;
        /* complete in order; a source may be rewritten only after its write completed */
        for (uint32_t i = 0; i < PIECES; i++) {
            kvs_status_t st;
            while ((st = link->ops->write_poll(link->ctx, tickets[i])) == KVS_INPROGRESS) {
            }
            if (st != KVS_OK) {
                rc = CHILD_POLL;
                break;
            }
        }
    }
    if (rc != CHILD_OK) goto out;
    /* the direct path: the gather kernel stores through the mapped ring */
    int is_host = 1;
    uint8_t *mapped = NULL;
    if (link->ops->map(link->ctx, 0, MAP_OFFSET, GATHER_N * PAGE_BYTES, &mapped, &is_host) !=
            KVS_OK ||
        mapped == NULL || is_host) {
        rc = CHILD_MAP;
        goto out;
    }
    if (!kvs_mem_device_can_access(device, mapped)) {
        int where = kvs_mem_device_of(mapped), can = -1;
        cudaError_t e = where >= 0 ? cudaDeviceCanAccessPeer(&can, device, where) : cudaSuccess;
        fprintf(stderr,
                "prefill process: GPU %d cannot reach the mapped ring (on GPU %d): "
                "can access peer %d (%s)\n",
                device, where, can, cudaGetErrorString(e));
        rc = CHILD_REACH;
        goto out;
    }
    if (!gather_into(device, mapped)) {
        rc = CHILD_GATHER;
        goto out;
    }
    /* refusals: outside the ring, unknown peer, control messages */
    cap.calls = 0;
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    uint64_t t = 0;
    uint8_t msg[8] = {0};
    size_t len = 0;
    if (link->ops->map(link->ctx, 0, RING_BYTES - 10, 11, &mapped, &is_host) != KVS_ERR_INVALID ||
        link->ops->map(link->ctx, 1, 0, 1, &mapped, &is_host) != KVS_ERR_NOT_FOUND ||
        link->ops->write(link->ctx, 0, RING_BYTES - 10, src, 11, &t) != KVS_ERR_INVALID ||
        link->ops->write(link->ctx, 1, 0, src, 1, &t) != KVS_ERR_NOT_FOUND ||
        link->ops->send(link->ctx, 0, msg, sizeof(msg)) != KVS_ERR_UNSUPPORTED ||
        link->ops->recv(link->ctx, msg, sizeof(msg), &len, NULL) != KVS_ERR_UNSUPPORTED ||
        cap.calls != 3)
        rc = CHILD_REFUSALS;
out:
    kvs_log_set_sink(NULL, NULL);
    kvs_link_destroy(link);
    kvs_mem_free(KVS_MEM_DEVICE, device, src);
    free(host);
    uint8_t done = (uint8_t) rc;
    if (write(out_fd, &done, 1) != 1) rc = CHILD_READ;
    return rc;
}

/* A forked child asks the CUDA runtime how many GPUs there are: this process must not touch
 * CUDA before its prefill child is forked. */
static int gpus_seen_by_child(void)
{
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) _exit(kvs_mem_device_count() > 100 ? 100 : kvs_mem_device_count());
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 0;
}

#endif

static void test_cross_process_writes(void **state)
{
    (void) state;
#if !KVS_HAVE_CUDA
    kvs_link_t *link = NULL;
    kvs_cuda_ipc_config_t cfg = {.side = KVS_SIDE_DECODE, .peer_tp = 1};
    kvs_log_capture_t cap = {0};
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    assert_int_equal(kvs_cuda_ipc_link_create(&cfg, &link), KVS_ERR_UNSUPPORTED);
    kvs_log_set_sink(NULL, NULL);
    assert_int_equal(cap.calls, 1);
    assert_null(link);
    print_message("built without CUDA: CUDA IPC tests skipped\n");
    skip();
#else
    const int gpus = gpus_seen_by_child();
    if (gpus == 0) {
        print_message("no CUDA device here: CUDA IPC tests skipped\n");
        skip();
    }
    const int prefill_gpu = 0, decode_gpu = gpus > 1 ? 1 : 0;
    int to_child[2], to_parent[2];
    assert_int_equal(pipe(to_child), 0);
    assert_int_equal(pipe(to_parent), 0);
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        close(to_child[1]);
        close(to_parent[0]);
        _exit(child_main(to_child[0], to_parent[1], prefill_gpu));
    }
    close(to_child[0]);
    close(to_parent[1]);

    /* the decode rank: its ring, exported */
    void *ring = NULL;
    assert_int_equal(kvs_mem_alloc(KVS_MEM_DEVICE, decode_gpu, RING_BYTES, &ring), KVS_OK);
    kvs_link_t *link = NULL;
    kvs_cuda_ipc_config_t cfg = {
        .side = KVS_SIDE_DECODE, .rank = 0, .peer_tp = 1, .device = decode_gpu};
    assert_int_equal(kvs_cuda_ipc_link_create(&cfg, &link), KVS_OK);
    kvs_cuda_ipc_handle_t h;
    kvs_log_capture_t cap = {0};
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    assert_int_equal(kvs_cuda_ipc_export(link, &h), KVS_ERR_STATE); /* nothing exposed yet */
    uint8_t host_ring[64];
    assert_int_equal(link->ops->expose(link->ctx, host_ring, sizeof(host_ring)), KVS_ERR_INVALID);
    kvs_log_set_sink(NULL, NULL);
    assert_int_equal(cap.calls, 2);
    assert_int_equal(link->ops->expose(link->ctx, ring, RING_BYTES), KVS_OK);
    assert_int_equal(kvs_cuda_ipc_export(link, &h), KVS_OK);
    /* importing our own export is refused: CUDA IPC is between processes */
    kvs_link_t *self = NULL;
    kvs_cuda_ipc_config_t pcfg = {
        .side = KVS_SIDE_PREFILL, .rank = 0, .peer_tp = 1, .device = prefill_gpu};
    assert_int_equal(kvs_cuda_ipc_link_create(&pcfg, &self), KVS_OK);
    cap.calls = 0;
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    assert_int_equal(kvs_cuda_ipc_import(self, 0, &h), KVS_ERR_INVALID);
    kvs_log_set_sink(NULL, NULL);
    assert_int_equal(cap.calls, 1);
    kvs_link_destroy(self);

    assert_int_equal(write(to_child[1], h.bytes, sizeof(h)), (ssize_t) sizeof(h));
    struct pollfd pfd = {.fd = to_parent[0], .events = POLLIN};
    int ready = poll(&pfd, 1, 120000);
    uint8_t done = 0xff;
    if (ready == 1) assert_int_equal(read(to_parent[0], &done, 1), 1);
    int status = 0;
    if (ready != 1) kill(pid, SIGKILL);
    assert_int_equal(waitpid(pid, &status, 0), pid);
    if (ready != 1) fail_msg("the prefill process did not answer within 120 s");
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || done != 0)
        fail_msg("the prefill process failed: exit %d, code %u (see enum in the test)",
                 WIFEXITED(status) ? WEXITSTATUS(status) : -1, done);

    /* every byte of the ring: both rounds' pieces, the mapped piece, zeros elsewhere */
    uint8_t *got = malloc(RING_BYTES), *want = calloc(1, RING_BYTES);
    assert_non_null(got);
    assert_non_null(want);
    for (uint32_t round = 0; round < 2; round++) {
        for (uint32_t i = 0; i < PIECES; i++) {
            uint64_t off, len;
            piece(i, &off, &len);
            off += (uint64_t) round * AREA;
            for (uint64_t k = 0; k < len; k++) want[off + k] = pattern(i, round, k);
        }
    }
    for (uint32_t i = 0; i < GATHER_N; i++)
        for (uint64_t k = 0; k < PAGE_BYTES; k++)
            want[MAP_OFFSET + i * PAGE_BYTES + k] = pool_byte(gather_pages[i], k);
    assert_int_equal(kvs_mem_copy(got, ring, RING_BYTES), KVS_OK);
    for (uint64_t k = 0; k < RING_BYTES; k++)
        if (got[k] != want[k])
            fail_msg("ring byte %llu is %u, want %u", (unsigned long long) k, got[k], want[k]);
    free(got);
    free(want);
    close(to_child[1]);
    close(to_parent[0]);
    /* the ring withdrawn (as a receiver does before freeing it): nothing left to export */
    assert_int_equal(link->ops->expose(link->ctx, NULL, 0), KVS_OK);
    cap.calls = 0;
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    assert_int_equal(kvs_cuda_ipc_export(link, &h), KVS_ERR_STATE);
    kvs_log_set_sink(NULL, NULL);
    assert_int_equal(cap.calls, 1);
    kvs_link_destroy(link);
    kvs_mem_free(KVS_MEM_DEVICE, decode_gpu, ring);
    kvs_assert_no_leaks();
#endif
}

/* Arguments are checked before any CUDA call; export and import take cuda_ipc links only. */
static void test_refusals(void **state)
{
    (void) state;
    kvs_log_capture_t cap = {0};
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    kvs_link_t *link = NULL;
    kvs_cuda_ipc_config_t cfg = {.side = KVS_SIDE_PREFILL, .peer_tp = 0, .device = 0};
#if KVS_HAVE_CUDA
    const kvs_status_t want = KVS_ERR_INVALID;
#else
    const kvs_status_t want = KVS_ERR_UNSUPPORTED;
#endif
    assert_int_equal(kvs_cuda_ipc_link_create(&cfg, &link), want);
    cfg.peer_tp = 1;
    cfg.device = -1;
    assert_int_equal(kvs_cuda_ipc_link_create(&cfg, &link), want);
    assert_int_equal(kvs_cuda_ipc_link_create(NULL, &link), want);
    assert_null(link);
    kvs_cuda_ipc_handle_t h;
    memset(&h, 0, sizeof(h));
    assert_int_equal(kvs_cuda_ipc_export(NULL, &h), want);
    assert_int_equal(kvs_cuda_ipc_import(NULL, 0, &h), want);
    kvs_log_set_sink(NULL, NULL);
    assert_int_equal(cap.calls, 5);
    kvs_assert_no_leaks();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cross_process_writes), /* first: it forks before any CUDA call */
        cmocka_unit_test(test_refusals),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
