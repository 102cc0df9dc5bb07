/* Tests for src/layout/grid.c: the protocol.md §1 test vectors, the worked request, and seeded
 * property tests of segments, floor and chunk numbering, of slot tokens and page spans with a
 * page size per side, and of the decode context parallel token map and its per-rank grid. */
#include "kvs_test.h"

#include <inttypes.h>

#include "kvstage/grid.h"
#include "kvstage/rng.h"

#define MAX_SEGS 4096

static void expect_segments(uint64_t start, uint64_t end, uint64_t base, uint64_t grid,
                            const kvs_segment_t *want, size_t n)
{
    kvs_segment_t got[16];
    size_t count = kvs_grid_segments(start, end, base, grid, got, 16);
    assert_int_equal(count, n);
    assert_int_equal(kvs_grid_segment_count(start, end, base, grid), n);
    for (size_t i = 0; i < n; i++) {
        assert_int_equal(got[i].start, want[i].start);
        assert_int_equal(got[i].end, want[i].end);
    }
}

static void test_grid_tokens_vectors(void **state)
{
    (void) state;
    assert_int_equal(kvs_grid_tokens(8192, 64), 8192);
    assert_int_equal(kvs_grid_tokens(8200, 64), 8192);
    assert_int_equal(kvs_grid_tokens(16, 64), 64);
    assert_int_equal(kvs_grid_tokens(256, 16), 256);
    assert_int_equal(kvs_grid_tokens(0, 16), 16);
    assert_int_equal(kvs_grid_tokens(100, 0), 0);
}

static void test_segments_vectors(void **state)
{
    (void) state;
    expect_segments(0, 8192, 0, 8192, (kvs_segment_t[]){{0, 8192}}, 1);
    expect_segments(8192, 16384, 0, 8192, (kvs_segment_t[]){{8192, 16384}}, 1);
    /* prefill hit 6144 + chunk 8192 */
    expect_segments(0, 14336, 0, 8192, (kvs_segment_t[]){{0, 8192}, {8192, 14336}}, 2);
    expect_segments(0, 28672, 0, 8192,
                    (kvs_segment_t[]){{0, 8192}, {8192, 16384}, {16384, 24576}, {24576, 28672}}, 4);
    /* split at base + G, not at multiples of G */
    expect_segments(6144, 22528, 6144, 8192, (kvs_segment_t[]){{6144, 14336}, {14336, 22528}}, 2);
    expect_segments(14336, 22528, 6144, 8192, (kvs_segment_t[]){{14336, 22528}}, 1);
    /* the metadata-only final send */
    expect_segments(4096, 4096, 0, 8192, (kvs_segment_t[]){{4096, 4096}}, 1);
    /* a reversed range is treated as empty */
    expect_segments(5000, 4000, 0, 8192, (kvs_segment_t[]){{5000, 5000}}, 1);
}

static void test_segments_truncated_output(void **state)
{
    (void) state;
    kvs_segment_t segs[2] = {{7, 7}, {7, 7}};
    /* asks for 4 segments but only has room for 1: the count is still the full split */
    assert_int_equal(kvs_grid_segments(0, 28672, 0, 8192, segs, 1), 4);
    assert_int_equal(segs[0].start, 0);
    assert_int_equal(segs[0].end, 8192);
    assert_int_equal(segs[1].start, 7); /* untouched */
    assert_int_equal(kvs_grid_segments(0, 28672, 0, 8192, NULL, 0), 4);
    assert_int_equal(kvs_grid_segments(10, 10, 0, 8192, NULL, 0), 1);
}

static void test_floor_and_pages_vectors(void **state)
{
    (void) state;
    assert_int_equal(kvs_grid_floor(12288, 6144, 8192, 64), 6144);
    assert_int_equal(kvs_grid_floor(20480, 6144, 8192, 64), 14336);
    assert_int_equal(kvs_grid_floor(28672, 6144, 8192, 64), 22528);
    assert_int_equal(kvs_grid_floor(14336, 6144, 8192, 64), 14336);
    assert_int_equal(kvs_grid_floor(14335, 6144, 8192, 64), 6144);
    assert_int_equal(kvs_grid_floor(100, 6144, 8192, 64), 6144); /* never below base */
    assert_int_equal(kvs_grid_floor(6144, 6144, 8192, 64), 6144);
    /* page flooring is absolute, then the grid is relative to base */
    assert_int_equal(kvs_grid_floor(16 + 64 + 63, 16, 64, 16), 80);
    assert_int_equal(kvs_grid_total_pages(30000, 6144, 64), 373);
    assert_int_equal(kvs_grid_total_pages(6144 + 64, 6144, 64), 1);
    assert_int_equal(kvs_grid_total_pages(6145, 6144, 64), 1);
    assert_int_equal(kvs_grid_total_pages(6144, 6144, 64), 0);
    assert_int_equal(kvs_grid_total_pages(100, 6144, 64), 0);
    assert_int_equal(kvs_grid_chunk_count(373, 8192, 64), 3);
    assert_int_equal(kvs_grid_chunk_count(256, 8192, 64), 2);
    assert_int_equal(kvs_grid_chunk_count(0, 8192, 64), 0);
    assert_int_equal(kvs_grid_chunk_pages(0, 373, 8192, 64), 128);
    assert_int_equal(kvs_grid_chunk_pages(1, 373, 8192, 64), 128);
    assert_int_equal(kvs_grid_chunk_pages(2, 373, 8192, 64), 117);
    assert_int_equal(kvs_grid_chunk_pages(3, 373, 8192, 64), 0);
    assert_int_equal(kvs_grid_chunk_pages(UINT64_MAX, 373, 8192, 64), 0);
    assert_int_equal(kvs_grid_chunk_of(0, 8192, 64), 0);
    assert_int_equal(kvs_grid_chunk_of(127, 8192, 64), 0);
    assert_int_equal(kvs_grid_chunk_of(128, 8192, 64), 1);
    assert_int_equal(kvs_grid_chunk_of(256, 8192, 64), 2);
}

/* protocol.md §1 worked request: C=8192, P=64, prompt 30000, decode hit 6144, prefill hit
 * 12288, prefill forwards in chunks of C from its hit. */
static void test_worked_request(void **state)
{
    (void) state;
    const uint64_t chunk = 8192, page = 64, prompt = 30000, base = 6144, hit = 12288;
    uint64_t g = kvs_grid_tokens(chunk, page);
    assert_int_equal(g, 8192);
    uint64_t total = kvs_grid_total_pages(prompt, base, page);
    assert_int_equal(total, 373);
    assert_int_equal(kvs_grid_chunk_count(total, g, page), 3);

    /* the cached-prefix early send floors to nothing */
    uint64_t sent = base;
    uint64_t end = kvs_grid_floor(hit, base, g, page);
    assert_int_equal(end, 6144);
    assert_int_equal(end, sent);

    /* then one send per forward pass; the last is not floored */
    static const uint64_t want_start[] = {6144, 14336, 22528};
    static const uint64_t want_end[] = {14336, 22528, 30000};
    static const uint64_t want_pages[] = {128, 128, 117};
    size_t k = 0;
    for (uint64_t computed = hit + chunk;; computed += chunk) {
        int last = computed >= prompt;
        uint64_t upto = last ? prompt : kvs_grid_floor(computed, base, g, page);
        kvs_segment_t segs[8];
        size_t n = kvs_grid_segments(sent, upto, base, g, segs, 8);
        for (size_t i = 0; i < n; i++) {
            if (segs[i].end == segs[i].start) continue;
            assert_true(k < 3);
            assert_int_equal(segs[i].start, want_start[k]);
            assert_int_equal(segs[i].end, want_end[k]);
            uint64_t sps = (segs[i].start - base) / page;
            uint64_t c = kvs_grid_chunk_of(sps, g, page);
            assert_int_equal(c, k);
            assert_int_equal(kvs_grid_chunk_pages(c, total, g, page), want_pages[k]);
            k++;
        }
        sent = upto;
        if (last) break;
    }
    assert_int_equal(k, 3);
    /* decode scatters chunk 2 at base + suffix_page_start * P */
    assert_int_equal(base + 2 * (g / page) * page, 22528);
}

/* Whether x is a grid boundary base + k*G (k any integer). */
static int on_grid(uint64_t x, uint64_t base, uint64_t grid)
{
    return x % grid == base % grid;
}

static uint64_t random_page(kvs_rng_t *rng)
{
    static const uint64_t pages[] = {1, 4, 16, 32, 64, 128};
    return kvs_rng_chance(rng, 1, 4) ? kvs_rng_range(rng, 1, 100)
                                     : pages[kvs_rng_below(rng, sizeof(pages) / sizeof(pages[0]))];
}

static void test_segments_and_floor_property(void **state)
{
    (void) state;
    uint64_t seed = kvs_test_seed(0x6d1e5eedULL);
    uint64_t iters = kvs_test_iters(20000);
    kvs_rng_t rng;
    kvs_rng_seed(&rng, seed);
    static kvs_segment_t segs[MAX_SEGS];
    for (uint64_t it = 0; it < iters; it++) {
        uint64_t page = random_page(&rng);
        uint64_t grid =
            kvs_grid_tokens(kvs_rng_range(&rng, 0, 40) * page + kvs_rng_below(&rng, page), page);
        uint64_t base = kvs_rng_range(&rng, 0, 200) * page;
        uint64_t start = kvs_rng_chance(&rng, 1, 8) ? kvs_rng_range(&rng, 0, base + grid)
                                                    : base + kvs_rng_range(&rng, 0, 30 * grid);
        uint64_t end =
            start + (kvs_rng_chance(&rng, 1, 10) ? 0 : kvs_rng_range(&rng, 1, 40 * grid));
        if (kvs_rng_chance(&rng, 1, 16)) end = start - (start > 0); /* empty or reversed */

        size_t n = kvs_grid_segments(start, end, base, grid, segs, MAX_SEGS);
        if (n > MAX_SEGS || n == 0 || n != kvs_grid_segment_count(start, end, base, grid))
            fail_msg("seed %" PRIu64 " iter %" PRIu64 ": bad count %zu", seed, it, n);
        if (end <= start) {
            if (n != 1 || segs[0].start != start || segs[0].end != start)
                fail_msg("seed %" PRIu64 " iter %" PRIu64 ": empty range", seed, it);
        } else {
            uint64_t cur = start;
            for (size_t i = 0; i < n; i++) {
                uint64_t s = segs[i].start, e = segs[i].end;
                int ok = s == cur && e > s && e <= end;
                /* internal boundaries are grid points, and no grid point lies inside */
                if (i + 1 < n) ok = ok && on_grid(e, base, grid);
                uint64_t into = (s % grid + grid - base % grid) % grid;
                ok = ok && into + (e - s) <= grid;
                if (!ok)
                    fail_msg("seed %" PRIu64 " iter %" PRIu64 ": segment %zu [%" PRIu64 ",%" PRIu64
                             ") of [%" PRIu64 ",%" PRIu64 ") base %" PRIu64 " G %" PRIu64,
                             seed, it, i, s, e, start, end, base, grid);
                cur = e;
            }
            if (cur != end) fail_msg("seed %" PRIu64 " iter %" PRIu64 ": not tiled", seed, it);
        }

        uint64_t fend = kvs_rng_range(&rng, 0, base + 30 * grid);
        uint64_t f = kvs_grid_floor(fend, base, grid, page);
        uint64_t fp = fend / page * page;
        uint64_t hi = fend > base ? fend : base;
        int ok = f >= base && f <= hi && (f - base) % grid == 0;
        if (fp <= base)
            ok = ok && f == base;
        else
            ok = ok && f <= fp && f + grid > fp;
        if (!ok)
            fail_msg("seed %" PRIu64 " iter %" PRIu64 ": floor(%" PRIu64 ", base %" PRIu64
                     ", G %" PRIu64 ", P %" PRIu64 ") = %" PRIu64,
                     seed, it, fend, base, grid, page, f);

        uint64_t prompt = kvs_rng_range(&rng, 0, base + 30 * grid);
        uint64_t total = kvs_grid_total_pages(prompt, base, page);
        uint64_t want_total = prompt > base ? (prompt - base + page - 1) / page : 0;
        uint64_t chunks = kvs_grid_chunk_count(total, grid, page);
        uint64_t sum = 0, f_pages = grid / page;
        for (uint64_t c = 0; c < chunks; c++) {
            uint64_t cp = kvs_grid_chunk_pages(c, total, grid, page);
            if (cp == 0 || cp > f_pages || (c + 1 < chunks && cp != f_pages) ||
                kvs_grid_chunk_of(c * f_pages, grid, page) != c)
                fail_msg("seed %" PRIu64 " iter %" PRIu64 ": chunk %" PRIu64, seed, it, c);
            sum += cp;
        }
        if (total != want_total || sum != total ||
            kvs_grid_chunk_pages(chunks, total, grid, page) != 0)
            fail_msg("seed %" PRIu64 " iter %" PRIu64 ": total %" PRIu64 " sum %" PRIu64, seed, it,
                     total, sum);
    }
}

/* protocol.md §4 sending discipline over random prompts: every non-last send floored to the
 * grid, each split into sub-sends. Every non-empty sub-send is then exactly one whole chunk,
 * which is what makes chunk_of(suffix_page_start) exact. */
static void test_sends_are_whole_chunks_property(void **state)
{
    (void) state;
    uint64_t seed = kvs_test_seed(0xc4a7c5ULL);
    uint64_t iters = kvs_test_iters(5000);
    kvs_rng_t rng;
    kvs_rng_seed(&rng, seed);
    kvs_segment_t segs[MAX_SEGS];
    for (uint64_t it = 0; it < iters; it++) {
        uint64_t page = random_page(&rng);
        uint64_t chunk = kvs_rng_range(&rng, 1, 40) * page;
        uint64_t grid = kvs_grid_tokens(chunk, page);
        uint64_t base = kvs_rng_range(&rng, 0, 100) * page;
        uint64_t prompt = base + kvs_rng_range(&rng, 0, 20 * grid);
        uint64_t total = kvs_grid_total_pages(prompt, base, page);
        uint64_t chunks = kvs_grid_chunk_count(total, grid, page);
        uint64_t sent = base, next_chunk = 0, computed = kvs_rng_range(&rng, 0, prompt);
        int lasts = 0;
        for (;;) {
            int last = computed >= prompt;
            uint64_t upto = last ? prompt : kvs_grid_floor(computed, base, grid, page);
            if (upto < sent) upto = sent;
            size_t n = kvs_grid_segments(sent, upto, base, grid, segs, MAX_SEGS);
            assert_true(n <= MAX_SEGS);
            for (size_t i = 0; i < n; i++) {
                uint64_t s = segs[i].start, e = segs[i].end;
                if (e == s) {
                    if (last && i + 1 == n) lasts++;
                    continue;
                }
                uint64_t sps = (s - base) / page;
                uint64_t c = kvs_grid_chunk_of(sps, grid, page);
                uint64_t pages = (e - s + page - 1) / page;
                if ((s - base) % page != 0 || c != next_chunk || sps != c * (grid / page) ||
                    pages != kvs_grid_chunk_pages(c, total, grid, page))
                    fail_msg("seed %" PRIu64 " iter %" PRIu64 ": sub-send [%" PRIu64 ",%" PRIu64
                             ") is not chunk %" PRIu64,
                             seed, it, s, e, next_chunk);
                next_chunk++;
                if (last && i + 1 == n) lasts++;
            }
            sent = upto;
            if (last) break;
            computed += kvs_rng_range(&rng, 1, 3 * chunk);
        }
        if (next_chunk != chunks || lasts != 1)
            fail_msg("seed %" PRIu64 " iter %" PRIu64 ": %" PRIu64 " of %" PRIu64
                     " chunks sent, %d last",
                     seed, it, next_chunk, chunks, lasts);
    }
}

/* A page size per side (protocol.md §1): a slot's tokens run to the next boundary or to the
 * end both sides' pages cover. */
static void test_slot_tokens_vectors(void **state)
{
    (void) state;
    static const struct {
        uint64_t chunk, prompt_len, base, grid, decode_page, prefill_page, want;
    } v[] = {
        /* equal pages: chunk_pages * P (the worked request) */
        {0, 30000, 6144, 8192, 64, 64, 8192},
        {1, 30000, 6144, 8192, 64, 64, 8192},
        {2, 30000, 6144, 8192, 64, 64, 117 * 64},
        {3, 30000, 6144, 8192, 64, 64, 0},
        /* prefill pages larger: E = min(112, 128); chunks start inside prefill pages */
        {0, 100, 16, 32, 16, 64, 32},
        {2, 100, 16, 32, 16, 64, 32},
        {3, 100, 16, 32, 16, 64, 0},
        /* decode pages larger: E = min(128, 112) = 112, the last slot ends inside a decode page */
        {0, 100, 0, 64, 64, 16, 64},
        {1, 100, 0, 64, 64, 16, 48},
        /* not powers of two: E = min(21, 20) */
        {0, 20, 3, 12, 3, 5, 12},
        {1, 20, 3, 12, 3, 5, 5},
        /* nothing to send */
        {0, 64, 64, 64, 16, 16, 0},
    };
    for (size_t i = 0; i < sizeof(v) / sizeof(v[0]); i++) {
        uint64_t got = kvs_grid_slot_tokens(v[i].chunk, v[i].prompt_len, v[i].base, v[i].grid,
                                            v[i].decode_page, v[i].prefill_page);
        if (got != v[i].want)
            fail_msg("case %zu: %" PRIu64 " tokens, want %" PRIu64, i, got, v[i].want);
    }
    static const struct {
        uint64_t start, tokens, page, first, offset, count;
    } s[] = {
        {16, 32, 64, 0, 16, 1}, {80, 32, 64, 1, 16, 1}, {48, 32, 64, 0, 48, 2},
        {15, 5, 5, 3, 0, 1},    {0, 0, 16, 0, 0, 0},    {7, 1, 1, 7, 0, 1},
    };
    for (size_t i = 0; i < sizeof(s) / sizeof(s[0]); i++) {
        kvs_page_span_t got = kvs_grid_page_span(s[i].start, s[i].tokens, s[i].page);
        if (got.first != s[i].first || got.offset != s[i].offset || got.count != s[i].count)
            fail_msg("span %zu: (%" PRIu64 ", %" PRIu64 ", %" PRIu64 ")", i, got.first, got.offset,
                     got.count);
    }
}

/* For any pair of page sizes: the slots tile [base, E) with E >= prompt_len, each within its
 * chunk's decode pages, and each slot's prefill span lies in the prompt's prefill pages. */
static void test_dcp_token_map_vectors(void **state)
{
    (void) state;
    /* N = 4, T = 1: round robin */
    static const uint32_t owner4[] = {0, 1, 2, 3, 0, 1, 2, 3, 0, 1};
    static const uint64_t local4[] = {0, 0, 0, 0, 1, 1, 1, 1, 2, 2};
    kvs_dcp_t d = {.size = 4, .interleave = 1};
    for (uint64_t t = 0; t < 10; t++) {
        assert_int_equal(kvs_dcp_owner(&d, t), owner4[t]);
        assert_int_equal(kvs_dcp_local(&d, t), local4[t]);
    }
    /* N = 2, T = 4: runs of 4, so 0-3 and 8-11 on rank 0, 4-7 and 12-15 on rank 1 */
    static const uint32_t owner2[] = {0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1};
    static const uint64_t local2[] = {0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7};
    d = (kvs_dcp_t){.size = 2, .interleave = 4, .rank = 1};
    for (uint64_t t = 0; t < 16; t++) {
        assert_int_equal(kvs_dcp_owner(&d, t), owner2[t]);
        assert_int_equal(kvs_dcp_local(&d, t), local2[t]);
    }
    assert_int_equal(kvs_dcp_global(&d, 5), 13);
    assert_int_equal(kvs_dcp_global(&d, 0), 4);
    static const uint64_t below[][2] = {{0, 0}, {4, 0}, {5, 1}, {8, 4}, {12, 4}, {13, 5}, {16, 8}};
    for (size_t i = 0; i < sizeof(below) / sizeof(below[0]); i++)
        assert_int_equal(kvs_dcp_count(&d, below[i][0]), below[i][1]);
    /* no DCP (size 0 or 1): every token on rank 0 at its own position */
    d = (kvs_dcp_t){0};
    assert_int_equal(kvs_dcp_owner(&d, 77), 0);
    assert_int_equal(kvs_dcp_local(&d, 77), 77);
    assert_int_equal(kvs_dcp_global(&d, 77), 77);
    assert_int_equal(kvs_dcp_count(&d, 77), 77);
}

static void test_dcp_rank_grid_vectors(void **state)
{
    (void) state;
    static const struct {
        uint64_t prompt_len, base, grid, pd, pp;
        uint32_t n, t, rank;
        uint64_t pages, slot0, slot1;
    } v[] = {
        /* N 4, T 2, page 16, prefix 128 (two units of 64): E = 304, every rank 44 tokens from
         * its local 32 (the prefix offset is 128 / 4), 3 pages, all in chunk 0 */
        {300, 128, 256, 16, 16, 4, 2, 0, 3, 44, 0},
        {300, 128, 256, 16, 16, 4, 2, 3, 3, 44, 0},
        /* N 4, T 2, page 4, G 32, prompt 33: E = 36, chunk 1 holds tokens 32-35, on ranks 0, 1 */
        {33, 0, 32, 4, 4, 4, 2, 0, 3, 8, 2},
        {33, 0, 32, 4, 4, 4, 2, 1, 3, 8, 2},
        {33, 0, 32, 4, 4, 4, 2, 2, 2, 8, 0},
        {33, 0, 32, 4, 4, 4, 2, 3, 2, 8, 0},
        /* N 2, T 1, decode page 2, prefill page 4, prompt 5: E = 6, token 5 on rank 1 */
        {5, 0, 4, 2, 4, 2, 1, 0, 2, 2, 1},
        {5, 0, 4, 2, 4, 2, 1, 1, 2, 2, 1},
        /* no DCP: the plain grid (the worked request's chunks 0 and 1) */
        {30000, 6144, 8192, 64, 64, 1, 1, 0, 373, 8192, 8192},
        /* a full decode hit */
        {64, 64, 64, 16, 16, 2, 1, 1, 0, 0, 0},
    };
    for (size_t i = 0; i < sizeof(v) / sizeof(v[0]); i++) {
        const kvs_dcp_t d = {.size = v[i].n, .interleave = v[i].t, .rank = v[i].rank};
        uint64_t pages =
            kvs_grid_rank_total_pages(v[i].prompt_len, v[i].base, v[i].pd, v[i].pp, &d);
        uint64_t s0 = kvs_grid_rank_slot_tokens(0, v[i].prompt_len, v[i].base, v[i].grid, v[i].pd,
                                                v[i].pp, &d);
        uint64_t s1 = kvs_grid_rank_slot_tokens(1, v[i].prompt_len, v[i].base, v[i].grid, v[i].pd,
                                                v[i].pp, &d);
        if (pages != v[i].pages || s0 != v[i].slot0 || s1 != v[i].slot1)
            fail_msg("case %zu: %" PRIu64 " pages, slots %" PRIu64 ", %" PRIu64 "; want %" PRIu64
                     ", %" PRIu64 ", %" PRIu64,
                     i, pages, s0, s1, v[i].pages, v[i].slot0, v[i].slot1);
    }
}

/* Random DCP groups: the map is a bijection onto dense local positions, counts agree with a
 * brute-force count, and for a geometry the rules allow (T dividing Pd, prefix and G multiples
 * of N*Pd) the ranks' slots partition each slot, start on their own pages at base/N + k*G/N,
 * fit the engine's ceil((prompt - base) / (N*Pd)) pages, and N = 1 is the plain grid. */
static void test_dcp_property(void **state)
{
    (void) state;
    uint64_t seed = kvs_test_seed(0xdc9ull);
    kvs_rng_t rng;
    kvs_rng_seed(&rng, seed);
    for (int iter = 0; iter < 2000; iter++) {
        const uint32_t n = (uint32_t) kvs_rng_range(&rng, 1, 8);
        const uint32_t pd = 1u << kvs_rng_below(&rng, 5);
        const uint32_t t = 1u << kvs_rng_below(&rng, (uint64_t) __builtin_ctz(pd) + 1);
        uint64_t seen[8] = {0};
        for (uint64_t x = 0; x < 200; x++) {
            uint32_t j = kvs_dcp_owner(&(kvs_dcp_t){n, t, 0}, x);
            const kvs_dcp_t d = {n, t, j};
            assert_true(j < n);
            if (kvs_dcp_local(&d, x) != seen[j] || kvs_dcp_global(&d, seen[j]) != x ||
                kvs_dcp_count(&d, x) != seen[j])
                fail_msg("seed %" PRIu64 ": N %u T %u token %" PRIu64, seed, n, t, x);
            seen[j]++;
            for (uint32_t r = 0; r < n; r++)
                assert_int_equal(kvs_dcp_count(&(kvs_dcp_t){n, t, r}, x + 1), seen[r]);
        }
        const uint64_t unit = (uint64_t) n * pd, pp = kvs_rng_range(&rng, 1, 40);
        const uint64_t grid = unit * kvs_rng_range(&rng, 1, 4);
        const uint64_t prompt = kvs_rng_range(&rng, 1, 600);
        const uint64_t base = unit * kvs_rng_below(&rng, prompt / unit + 1);
        const uint64_t engine_pages = (prompt + unit - 1) / unit - base / unit;
        for (uint64_t k = 0; k * grid + base < prompt + grid; k++) {
            uint64_t sum = 0;
            for (uint32_t r = 0; r < n; r++) {
                const kvs_dcp_t d = {n, t, r};
                sum += kvs_grid_rank_slot_tokens(k, prompt, base, grid, pd, pp, &d);
                assert_int_equal(kvs_dcp_count(&d, base + k * grid), base / n + k * grid / n);
                assert_true(kvs_grid_rank_total_pages(prompt, base, pd, pp, &d) <= engine_pages);
            }
            if (sum != kvs_grid_slot_tokens(k, prompt, base, grid, pd, pp))
                fail_msg("seed %" PRIu64 ": N %u T %u Pd %u Pp %" PRIu64 " prompt %" PRIu64
                         " base %" PRIu64 " chunk %" PRIu64 ": ranks hold %" PRIu64,
                         seed, n, t, pd, pp, prompt, base, k, sum);
        }
        const kvs_dcp_t one = {1, 1, 0};
        assert_int_equal(kvs_grid_rank_total_pages(prompt, base, pd, pp, &one),
                         kvs_grid_total_pages(prompt, base, pd));
    }
}

static void test_slot_tokens_property(void **state)
{
    (void) state;
    kvs_rng_t rng;
    uint64_t seed = kvs_test_seed(0x9a6e5);
    kvs_rng_seed(&rng, seed);
    for (int it = 0; it < 20000; it++) {
        uint64_t pd = kvs_rng_range(&rng, 1, 70), pp = kvs_rng_range(&rng, 1, 70);
        if (kvs_rng_chance(&rng, 1, 2)) {
            pd = 1ull << kvs_rng_below(&rng, 9);
            pp = 1ull << kvs_rng_below(&rng, 9);
        }
        uint64_t grid = pd * kvs_rng_range(&rng, 1, 5);
        uint64_t prompt = kvs_rng_range(&rng, 1, 3000);
        uint64_t base = pd * kvs_rng_below(&rng, prompt / pd + 1);
        uint64_t total = kvs_grid_total_pages(prompt, base, pd);
        uint64_t n = kvs_grid_chunk_count(total, grid, pd);
        uint64_t at = base;
        for (uint64_t k = 0; k < n; k++) {
            uint64_t t = kvs_grid_slot_tokens(k, prompt, base, grid, pd, pp);
            uint64_t pages = kvs_grid_chunk_pages(k, total, grid, pd);
            if (t == 0 || t > pages * pd || at != base + k * grid)
                fail_msg("seed 0x%" PRIx64 ": chunk %" PRIu64 " of P %" PRIu64 "/%" PRIu64
                         " has %" PRIu64 " tokens",
                         seed, k, pd, pp, t);
            kvs_page_span_t sp = kvs_grid_page_span(at, t, pp);
            assert_true(sp.offset < pp);
            assert_true(sp.first + sp.count <= (prompt + pp - 1) / pp);
            assert_true(sp.offset + t <= sp.count * pp && sp.offset + t > (sp.count - 1) * pp);
            at += t;
        }
        assert_int_equal(kvs_grid_slot_tokens(n, prompt, base, grid, pd, pp), 0);
        if (n > 0) {
            assert_true(at >= prompt);
            assert_true(at - prompt < pd && at - prompt < pp);
        }
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_grid_tokens_vectors),
        cmocka_unit_test(test_segments_vectors),
        cmocka_unit_test(test_segments_truncated_output),
        cmocka_unit_test(test_floor_and_pages_vectors),
        cmocka_unit_test(test_worked_request),
        cmocka_unit_test(test_segments_and_floor_property),
        cmocka_unit_test(test_sends_are_whole_chunks_property),
        cmocka_unit_test(test_slot_tokens_vectors),
        cmocka_unit_test(test_slot_tokens_property),
        cmocka_unit_test(test_dcp_token_map_vectors),
        cmocka_unit_test(test_dcp_rank_grid_vectors),
        cmocka_unit_test(test_dcp_property),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
