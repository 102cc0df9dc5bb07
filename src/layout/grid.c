/* Grid arithmetic of protocol.md §1: slot size, splitting sends at slot boundaries, flooring a
 * non-last send, chunk numbering and the decode context parallel token map. Degenerate inputs (page
 * or grid 0) give the neutral answer documented per function instead of dividing by zero. */
#include "kvstage/grid.h"

uint64_t kvs_grid_tokens(uint64_t chunk, uint64_t page)
{
    if (page == 0) return 0;
    uint64_t pages = chunk / page;
    return (pages > 0 ? pages : 1) * page;
}

/* End of the segment that starts at cur: the next boundary base + k*G after cur, or end.
 * The grid is anchored at base for every integer k, so a start below base is still split
 * consistently; G == 0 means "no grid" and never splits. */
static uint64_t segment_end(uint64_t cur, uint64_t end, uint64_t base, uint64_t grid)
{
    if (grid == 0) return end;
    uint64_t into = (cur % grid + grid - base % grid) % grid; /* tokens since last boundary */
    uint64_t left = grid - into;
    return left >= end - cur ? end : cur + left;
}

size_t kvs_grid_segment_count(uint64_t start, uint64_t end, uint64_t base, uint64_t grid)
{
    return kvs_grid_segments(start, end, base, grid, NULL, 0);
}

size_t kvs_grid_segments(uint64_t start, uint64_t end, uint64_t base, uint64_t grid,
                         kvs_segment_t *segs, size_t max)
{
    if (end <= start) {
        if (max > 0) segs[0] = (kvs_segment_t){start, start};
        return 1;
    }
    size_t n = 0;
    for (uint64_t cur = start; cur < end; n++) {
        uint64_t next = segment_end(cur, end, base, grid);
        if (n < max) segs[n] = (kvs_segment_t){cur, next};
        cur = next;
    }
    return n;
}

uint64_t kvs_grid_floor(uint64_t end, uint64_t base, uint64_t grid, uint64_t page)
{
    if (end <= base || grid == 0) return base;
    uint64_t paged = page > 0 ? end - end % page : end;
    if (paged <= base) return base;
    return base + (paged - base) / grid * grid;
}

uint64_t kvs_grid_total_pages(uint64_t prompt_len, uint64_t base, uint64_t page)
{
    if (page == 0 || prompt_len <= base) return 0;
    uint64_t tokens = prompt_len - base;
    return tokens / page + (tokens % page != 0);
}

/* F = G / P pages per slot; 0 for a degenerate grid. */
static uint64_t pages_per_slot(uint64_t grid, uint64_t page)
{
    return page > 0 ? grid / page : 0;
}

uint64_t kvs_grid_chunk_count(uint64_t total_pages, uint64_t grid, uint64_t page)
{
    uint64_t f = pages_per_slot(grid, page);
    if (f == 0) return 0;
    return total_pages / f + (total_pages % f != 0);
}

uint64_t kvs_grid_chunk_pages(uint64_t chunk, uint64_t total_pages, uint64_t grid, uint64_t page)
{
    uint64_t f = pages_per_slot(grid, page);
    if (chunk >= kvs_grid_chunk_count(total_pages, grid, page)) return 0;
    uint64_t first = chunk * f; /* < total_pages, so no overflow */
    uint64_t left = total_pages - first;
    return left < f ? left : f;
}

uint64_t kvs_grid_chunk_of(uint64_t suffix_page_start, uint64_t grid, uint64_t page)
{
    uint64_t f = pages_per_slot(grid, page);
    return f > 0 ? suffix_page_start / f : 0;
}

static uint64_t round_up(uint64_t x, uint64_t a)
{
    return x % a == 0 ? x : x + (a - x % a);
}

/* E: the last position both sides' pages cover (pages > 0). */
static uint64_t transfer_end(uint64_t prompt_len, uint64_t decode_page, uint64_t prefill_page)
{
    uint64_t e_decode = round_up(prompt_len, decode_page);
    uint64_t e_prefill = round_up(prompt_len, prefill_page);
    return e_decode < e_prefill ? e_decode : e_prefill;
}

uint64_t kvs_grid_slot_tokens(uint64_t chunk, uint64_t prompt_len, uint64_t base, uint64_t grid,
                              uint64_t decode_page, uint64_t prefill_page)
{
    if (grid == 0 || decode_page == 0 || prefill_page == 0 || prompt_len <= base) return 0;
    uint64_t end = transfer_end(prompt_len, decode_page, prefill_page);
    if (chunk > (end - base) / grid) return 0;
    uint64_t start = base + chunk * grid;
    if (start >= end) return 0;
    return end - start < grid ? end - start : grid;
}

kvs_page_span_t kvs_grid_page_span(uint64_t start, uint64_t tokens, uint64_t page)
{
    if (page == 0) return (kvs_page_span_t){0, 0, 0};
    kvs_page_span_t s = {.first = start / page, .offset = start % page};
    s.count = tokens == 0 ? 0 : (s.offset + tokens + page - 1) / page;
    return s;
}

/* N and T with their "none" spellings (0) read as 1. */
static uint64_t dcp_n(const kvs_dcp_t *d)
{
    return d->size > 1 ? d->size : 1;
}

static uint64_t dcp_t(const kvs_dcp_t *d)
{
    return d->interleave > 1 ? d->interleave : 1;
}

uint32_t kvs_dcp_owner(const kvs_dcp_t *dcp, uint64_t t)
{
    return (uint32_t) (t / dcp_t(dcp) % dcp_n(dcp));
}

uint64_t kvs_dcp_local(const kvs_dcp_t *dcp, uint64_t t)
{
    const uint64_t T = dcp_t(dcp);
    return t / (dcp_n(dcp) * T) * T + t % T;
}

uint64_t kvs_dcp_global(const kvs_dcp_t *dcp, uint64_t local)
{
    const uint64_t T = dcp_t(dcp);
    return local / T * dcp_n(dcp) * T + (uint64_t) dcp->rank * T + local % T;
}

uint64_t kvs_dcp_count(const kvs_dcp_t *dcp, uint64_t end)
{
    const uint64_t T = dcp_t(dcp), cycle = dcp_n(dcp) * T;
    /* whole cycles give T tokens each; the last partial cycle reaches into this rank's run */
    const uint64_t into = end % cycle, mine = (uint64_t) dcp->rank * T;
    const uint64_t part = into <= mine ? 0 : (into - mine < T ? into - mine : T);
    return end / cycle * T + part;
}

uint64_t kvs_grid_rank_total_pages(uint64_t prompt_len, uint64_t base, uint64_t decode_page,
                                   uint64_t prefill_page, const kvs_dcp_t *dcp)
{
    if (decode_page == 0 || prefill_page == 0 || prompt_len <= base) return 0;
    const uint64_t end = kvs_dcp_count(dcp, transfer_end(prompt_len, decode_page, prefill_page));
    const uint64_t from = kvs_dcp_count(dcp, base);
    return end <= from ? 0 : (end - from + decode_page - 1) / decode_page;
}

uint64_t kvs_grid_rank_slot_tokens(uint64_t chunk, uint64_t prompt_len, uint64_t base,
                                   uint64_t grid, uint64_t decode_page, uint64_t prefill_page,
                                   const kvs_dcp_t *dcp)
{
    uint64_t n = kvs_grid_slot_tokens(chunk, prompt_len, base, grid, decode_page, prefill_page);
    if (n == 0) return 0;
    const uint64_t start = base + chunk * grid;
    return kvs_dcp_count(dcp, start + n) - kvs_dcp_count(dcp, start);
}
