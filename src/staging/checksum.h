/* The writer-region checksum (protocol.md §5.5), internal to libkvstage: every writer sums
 * the region it writes as it gathers it, CHUNK_READY carries the sum, and the receiver sums
 * the bytes in its ring as it scatters them and compares.
 *
 * Definition: the region is a run of little-endian 32-bit words x_j (j = byte offset / 4; a
 * last partial word is zero-padded). a = sum of x_j * K(j) modulo 2^64, each product the full
 * 64-bit product of two 32-bit numbers, with odd keys K(j) = A + j * D modulo 2^32; the
 * checksum is mix(a, region bytes). The sum is linear in any split of a word into disjoint
 * byte sets, so any copy loop (and any GPU thread) can add the bytes it moves, at any offset
 * and in any order, and the sums agree: the bytes are read once, by the copy. A changed word
 * always changes a (an odd key, a product that cannot wrap), and so do two changed words
 * unless their changes cancel exactly. The work per word is one widening 32-bit multiply and
 * one add, which a GPU does natively and a CPU does four or eight words at a time in SIMD.
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

#define KVS_CSUM_A 0x9e3779b9u /* odd */
#define KVS_CSUM_D 0x7f4a7c16u /* even: keys stay odd */

typedef struct {
    uint64_t a;
} kvs_csum_t;

KVS_CSUM_FN uint32_t kvs_csum_key(uint64_t j)
{
    return KVS_CSUM_A + (uint32_t) j * KVS_CSUM_D;
}

/* Adds word j's part `v` (its bytes in place, the others zero). */
KVS_CSUM_FN void kvs_csum_word(kvs_csum_t *c, uint64_t j, uint32_t v)
{
    c->a += (uint64_t) v * kvs_csum_key(j);
}

/* Adds n <= 8 bytes, given as the low bytes of v, that sit at region offset `offset`: they
 * may straddle up to three words. */
KVS_CSUM_FN void kvs_csum_small(kvs_csum_t *c, uint64_t offset, uint64_t v, uint32_t n)
{
    if (n < 8) v &= (1ull << (8 * n)) - 1;
    const uint32_t s = (uint32_t) (offset & 3);
    uint64_t j = offset >> 2;
    /* the bytes as they sit in words j, j+1, j+2: (v << 8s) spread over 96 bits */
    kvs_csum_word(c, j, (uint32_t) (v << (8 * s)));
    const uint64_t rest = s ? v >> (32 - 8 * s) : v >> 32; /* from word j+1 on */
    if (s + n > 4) kvs_csum_word(c, j + 1, (uint32_t) rest);
    if (s + n > 8) kvs_csum_word(c, j + 2, (uint32_t) (rest >> 32));
}

/* Adds the n bytes at data, which sit at region offset `offset`. */
KVS_CSUM_FN void kvs_csum_add(kvs_csum_t *c, uint64_t offset, const void *data, uint64_t n)
{
    const uint8_t *p = (const uint8_t *) data;
    while (n > 0 && (offset & 3) != 0) { /* to a word boundary */
        const uint32_t take = (uint32_t) (n < 4 - (offset & 3) ? n : 4 - (offset & 3));
        uint64_t v = 0;
        memcpy(&v, p, take);
        kvs_csum_small(c, offset, v, take);
        p += take;
        offset += take;
        n -= take;
    }
    /* Whole words: the keys advance by a constant, and the loop has no carried dependency
     * but the sum, so compilers turn it into SIMD widening multiplies. */
    const uint32_t k0 = kvs_csum_key(offset >> 2);
    const uint64_t nw = n / 4, i = nw * 4;
    uint64_t a = c->a;
    for (uint64_t w = 0; w < nw; w++) {
        uint32_t x;
        memcpy(&x, p + 4 * w, 4);
        a += (uint64_t) x * (uint32_t) (k0 + (uint32_t) w * KVS_CSUM_D);
    }
    c->a = a;
    if (i < n) {
        uint64_t v = 0;
        memcpy(&v, p + i, n - i);
        kvs_csum_small(c, offset + i, v, (uint32_t) (n - i));
    }
}

KVS_CSUM_FN void kvs_csum_merge(kvs_csum_t *c, const kvs_csum_t *other)
{
    c->a += other->a;
}

/* The checksum of a region of `bytes` bytes whose sums are c. Never 0, so 0 can mean "none". */
KVS_CSUM_FN uint64_t kvs_csum_final(const kvs_csum_t *c, uint64_t bytes)
{
    uint64_t x = c->a ^ (bytes * 0x94d049bb133111ebull);
    x ^= x >> 31;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 29;
    return x == 0 ? 1 : x;
}

/* The checksum of n contiguous bytes: the reference the tests hold every backend to. */
KVS_CSUM_FN uint64_t kvs_csum_of(const void *region, uint64_t n)
{
    kvs_csum_t c = {0};
    kvs_csum_add(&c, 0, region, n);
    return kvs_csum_final(&c, n);
}

#endif
