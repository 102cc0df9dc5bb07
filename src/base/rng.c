/* xoshiro256** with splitmix64 seeding. */
#include "kvstage/rng.h"

uint64_t kvs_mix64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

void kvs_rng_seed(kvs_rng_t *rng, uint64_t seed)
{
    for (int i = 0; i < 4; i++) {
        seed = kvs_mix64(seed);
        rng->s[i] = seed;
    }
}

static uint64_t rotl(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

uint64_t kvs_rng_next(kvs_rng_t *rng)
{
    uint64_t *s = rng->s;
    uint64_t result = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

uint64_t kvs_rng_below(kvs_rng_t *rng, uint64_t bound)
{
    if (bound == 0) return 0;
    /* Rejection keeps the distribution exactly uniform. */
    uint64_t limit = UINT64_MAX - UINT64_MAX % bound;
    uint64_t x;
    do {
        x = kvs_rng_next(rng);
    } while (x >= limit);
    return x % bound;
}

uint64_t kvs_rng_range(kvs_rng_t *rng, uint64_t lo, uint64_t hi)
{
    if (hi <= lo) return lo;
    if (hi - lo == UINT64_MAX) return kvs_rng_next(rng);
    return lo + kvs_rng_below(rng, hi - lo + 1);
}

int kvs_rng_chance(kvs_rng_t *rng, uint64_t num, uint64_t den)
{
    return den != 0 && kvs_rng_below(rng, den) < num;
}
