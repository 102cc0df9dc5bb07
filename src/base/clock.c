/* Monotonic clock. */
#include "kvstage/clock.h"

#include <time.h>

uint64_t kvs_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t) ts.tv_sec * 1000000000ull + (uint64_t) ts.tv_nsec;
}

static uint64_t monotonic_now(void *arg)
{
    (void) arg;
    return kvs_now_ns();
}

kvs_clock_t kvs_clock_monotonic(void)
{
    kvs_clock_t c = {monotonic_now, NULL};
    return c;
}
