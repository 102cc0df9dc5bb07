/* The writer-region checksum (protocol.md §5.5), internal to libkvstage: every writer sums
 * the region it writes as it gathers it, CHUNK_READY carries the sum, and the receiver sums
 * the bytes in its ring as it scatters them and compares.
 *
 * Definition: the region is a run of little-endian 64-bit words w_q (q = byte offset / 8; a
 * last partial word is zero-padded). Two lanes, a = sum of w_q * K1(q) and b = sum of
 * bswap(w_q) * K2(q) modulo 2^64, with odd keys K1(q) = A1 + q * D1 and K2(q) = A2 + q * D2;
 * the checksum is mix(a, b, region bytes). Both lanes are linear in any split of a word into
 * disjoint byte sets, so any copy loop (and any GPU thread) can add the bytes it moves, at
 * any offset and in any order, and the sums agree: the bytes are read once, by the copy. A
 * changed word always changes lane a (its key is odd); the byte-swapped lane b catches the
 * high-bit changes that could cancel out in a.
 *
 * Usable from C and from CUDA device code (the functions are host and device there). */
#ifndef KVSTAGE_STAGING_CHECKSUM_H
#define KVSTAGE_STAGING_CHECKSUM_H

#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define KVS_CSUM_FN __host__ __device__ __forceinline__
#else
#define KVS_CSUM_FN static inline
#endif

#define KVS_CSUM_A1 0x9e3779b97f4a7c15ull /* odd */
#define KVS_CSUM_D1 0xd6e8feb86659fd92ull /* even: keys stay odd */
#define KVS_CSUM_A2 0xc2b2ae3d27d4eb4full
#define KVS_CSUM_D2 0x165667b19e3779f8ull

typedef struct {
    uint64_t a, b;
} kvs_csum_t;

KVS_CSUM_FN uint64_t kvs_csum_bswap(uint64_t x)
{
#ifdef __CUDA_ARCH__
    return ((uint64_t) __byte_perm((unsigned) x, 0, 0x0123) << 32) |
           __byte_perm((unsigned) (x >> 32), 0, 0x0123);
#else
    return __builtin_bswap64(x);
#endif
}

/* Adds word q's part `v` (its bytes in place, the others zero). */
KVS_CSUM_FN void kvs_csum_word(kvs_csum_t *c, uint64_t q, uint64_t v)
{
    c->a += v * (KVS_CSUM_A1 + q * KVS_CSUM_D1);
    c->b += kvs_csum_bswap(v) * (KVS_CSUM_A2 + q * KVS_CSUM_D2);
}

/* Adds n <= 8 bytes, given as the low bytes of v, that sit at region offset `offset`: they
 * may straddle two words. */
KVS_CSUM_FN void kvs_csum_small(kvs_csum_t *c, uint64_t offset, uint64_t v, uint32_t n)
{
    const uint32_t s = (uint32_t) (offset & 7);
    if (n < 8) v &= (1ull << (8 * n)) - 1;
    kvs_csum_word(c, offset >> 3, v << (8 * s));
    if (s + n > 8) kvs_csum_word(c, (offset >> 3) + 1, v >> (8 * (8 - s)));
}

/* Adds the n bytes at data, which sit at region offset `offset`. */
KVS_CSUM_FN void kvs_csum_add(kvs_csum_t *c, uint64_t offset, const void *data, uint64_t n)
{
    const uint8_t *p = (const uint8_t *) data;
    uint64_t a = c->a, b = c->b;
    if ((offset & 7) == 0) {
        /* Whole words: keys advance by a constant, so the loop needs no multiply for them. */
        uint64_t k1 = KVS_CSUM_A1 + (offset >> 3) * KVS_CSUM_D1;
        uint64_t k2 = KVS_CSUM_A2 + (offset >> 3) * KVS_CSUM_D2;
        uint64_t i = 0;
        /* Four words a step on independent sums, so the multiplies overlap. */
        uint64_t a1 = 0, a2 = 0, a3 = 0, b1 = 0, b2 = 0, b3 = 0;
        for (; i + 32 <= n; i += 32) {
            uint64_t w[4];
            memcpy(w, p + i, 32);
            a += w[0] * k1;
            a1 += w[1] * (k1 + KVS_CSUM_D1);
            a2 += w[2] * (k1 + 2 * KVS_CSUM_D1);
            a3 += w[3] * (k1 + 3 * KVS_CSUM_D1);
            b += kvs_csum_bswap(w[0]) * k2;
            b1 += kvs_csum_bswap(w[1]) * (k2 + KVS_CSUM_D2);
            b2 += kvs_csum_bswap(w[2]) * (k2 + 2 * KVS_CSUM_D2);
            b3 += kvs_csum_bswap(w[3]) * (k2 + 3 * KVS_CSUM_D2);
            k1 += 4 * KVS_CSUM_D1;
            k2 += 4 * KVS_CSUM_D2;
        }
        a += a1 + a2 + a3;
        b += b1 + b2 + b3;
        for (; i + 8 <= n; i += 8) {
            uint64_t w;
            memcpy(&w, p + i, 8);
            a += w * k1;
            b += kvs_csum_bswap(w) * k2;
            k1 += KVS_CSUM_D1;
            k2 += KVS_CSUM_D2;
        }
        c->a = a;
        c->b = b;
        p += i;
        offset += i;
        n -= i;
    }
    while (n > 0) {
        const uint32_t take = (uint32_t) (n < 8 - (offset & 7) ? n : 8 - (offset & 7));
        uint64_t v = 0;
        memcpy(&v, p, take);
        kvs_csum_small(c, offset, v, take);
        p += take;
        offset += take;
        n -= take;
    }
}

KVS_CSUM_FN void kvs_csum_merge(kvs_csum_t *c, const kvs_csum_t *other)
{
    c->a += other->a;
    c->b += other->b;
}

/* The checksum of a region of `bytes` bytes whose sums are c. Never 0, so 0 can mean "none". */
KVS_CSUM_FN uint64_t kvs_csum_final(const kvs_csum_t *c, uint64_t bytes)
{
    uint64_t x = c->a ^ (c->b * 0xbf58476d1ce4e5b9ull) ^ (bytes * 0x94d049bb133111ebull);
    x ^= x >> 31;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 29;
    return x == 0 ? 1 : x;
}

/* The checksum of n contiguous bytes: the reference the tests hold every backend to. */
KVS_CSUM_FN uint64_t kvs_csum_of(const void *region, uint64_t n)
{
    kvs_csum_t c = {0, 0};
    kvs_csum_add(&c, 0, region, n);
    return kvs_csum_final(&c, n);
}

#endif
