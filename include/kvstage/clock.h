/* Time: a monotonic wall clock, and a clock object so that protocol state machines can run on
 * virtual time in deterministic tests and simulations. */
#ifndef KVSTAGE_CLOCK_H
#define KVSTAGE_CLOCK_H

#include <stdint.h>

/* Monotonic nanoseconds since an arbitrary origin. */
uint64_t kvs_now_ns(void);

typedef struct {
    uint64_t (*now_ns)(void *arg);
    void *arg;
} kvs_clock_t;

/* The clock backed by kvs_now_ns(). */
kvs_clock_t kvs_clock_monotonic(void);

static inline uint64_t kvs_clock_now(const kvs_clock_t *clock)
{
    return clock->now_ns(clock->arg);
}

#endif
