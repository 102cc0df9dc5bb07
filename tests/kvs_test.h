/* Shared test helpers: cmocka includes, leak checks against the accounted allocator, and a
 * seed taken from KVS_SEED so property tests are reproducible. */
#ifndef KVSTAGE_TESTS_KVS_TEST_H
#define KVSTAGE_TESTS_KVS_TEST_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvstage/alloc.h"
#include "kvstage/log.h"
#include "kvstage/rng.h"

/* Asserts that no accounted allocation is live. */
#define kvs_assert_no_leaks()                                                                      \
    do {                                                                                           \
        kvs_alloc_stats_t st_;                                                                     \
        kvs_alloc_stats(&st_);                                                                     \
        if (st_.live_blocks != 0)                                                                  \
            fail_msg("leak: %llu blocks, %llu bytes still allocated",                              \
                     (unsigned long long) st_.live_blocks, (unsigned long long) st_.live_bytes);   \
    } while (0)

/* The seed for property tests: KVS_SEED from the environment, else the given default. */
static inline uint64_t kvs_test_seed(uint64_t dflt)
{
    const char *s = getenv("KVS_SEED");
    return s ? strtoull(s, NULL, 0) : dflt;
}

/* Captures log messages (install with kvs_log_set_sink(kvs_log_capture_sink, &capture)) so
 * tests can check what was reported, and keeps expected errors off stderr. */
typedef struct {
    int errors_only; /* count only KVS_LOG_ERROR messages */
    int calls;
    char msg[512]; /* the last message counted */
} kvs_log_capture_t;

static inline void kvs_log_capture_sink(void *arg, kvs_log_level_t level, const char *file,
                                        int line, const char *msg)
{
    (void) file;
    (void) line;
    kvs_log_capture_t *c = arg;
    if (c->errors_only && level != KVS_LOG_ERROR) return;
    c->calls++;
    snprintf(c->msg, sizeof(c->msg), "%s", msg);
}

/* A loopback TCP port bound but never listened on, for a test that needs an endpoint nobody
 * answers: connects to it are refused, and while *fd_p stays open no other process can bind it
 * (a port merely free when the test looked can be taken meanwhile by another test running at
 * the same time, whose listener then answers). Close *fd_p at the end. */
static inline uint16_t kvs_test_dead_port(int *fd_p)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof(a));
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    assert_int_equal(bind(fd, (struct sockaddr *) &a, sizeof(a)), 0);
    assert_int_equal(getsockname(fd, (struct sockaddr *) &a, &len), 0);
    *fd_p = fd;
    return ntohs(a.sin_port);
}

/* A loopback TCP port free at the time of the call (the kernel's pick for port 0), for a test
 * that must name a port another process binds. Ports a test derives itself (from its pid, say)
 * can fall in the ephemeral range and collide with another test's connection. */
static inline uint16_t kvs_test_free_port(void)
{
    int fd;
    uint16_t port = kvs_test_dead_port(&fd);
    close(fd);
    return port;
}

/* order[0..n) = a random permutation of 0..n-1, drawn from rng (Fisher-Yates). */
static inline void kvs_test_shuffle(kvs_rng_t *rng, int *order, int n)
{
    for (int i = 0; i < n; i++) order[i] = i;
    for (int i = n - 1; i > 0; i--) {
        int j = (int) kvs_rng_below(rng, (uint64_t) i + 1), t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
}

/* Iteration count: KVS_ITERS from the environment (for soaks), else the given default. */
static inline uint64_t kvs_test_iters(uint64_t dflt)
{
    const char *s = getenv("KVS_ITERS");
    return s ? strtoull(s, NULL, 0) : dflt;
}

#endif
