/* A small seeded PRNG (xoshiro256** seeded by splitmix64) so property tests, simulations and
 * adversarial schedules are reproducible from one 64-bit seed. */
#ifndef KVSTAGE_RNG_H
#define KVSTAGE_RNG_H

#include <stdint.h>

typedef struct {
    uint64_t s[4];
} kvs_rng_t;

void kvs_rng_seed(kvs_rng_t *rng, uint64_t seed);
uint64_t kvs_rng_next(kvs_rng_t *rng);
/* Uniform in [0, bound); bound 0 returns 0. */
uint64_t kvs_rng_below(kvs_rng_t *rng, uint64_t bound);
/* Uniform in [lo, hi] inclusive. */
uint64_t kvs_rng_range(kvs_rng_t *rng, uint64_t lo, uint64_t hi);
/* 1 with probability num/den. */
int kvs_rng_chance(kvs_rng_t *rng, uint64_t num, uint64_t den);
/* The splitmix64 finaliser: a good 64-bit mixing function. */
uint64_t kvs_mix64(uint64_t x);

#endif
