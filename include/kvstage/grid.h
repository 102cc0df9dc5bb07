/* Grid arithmetic of protocol.md §1: slot size, segments split at grid boundaries, flooring a
 * send to the grid, chunk numbering, and the decode context parallel token map (which tokens a
 * decode rank holds, and where). Positions are absolute token positions unless named local. */
#ifndef KVSTAGE_GRID_H
#define KVSTAGE_GRID_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    uint64_t start, end; /* [start, end) in tokens */
} kvs_segment_t;

/* G = max(1, chunk / page) * page: tokens per staging slot. */
uint64_t kvs_grid_tokens(uint64_t chunk, uint64_t page);

/* Number of segments that segments(start, end, base, G) produces (>= 1). */
size_t kvs_grid_segment_count(uint64_t start, uint64_t end, uint64_t base, uint64_t grid);

/* Splits [start, end) at base + k*G boundaries; an empty range gives the one segment
 * (start, start). Writes at most max segments; returns how many the full split has. */
size_t kvs_grid_segments(uint64_t start, uint64_t end, uint64_t base, uint64_t grid,
                         kvs_segment_t *segs, size_t max);

/* A non-last send's end: floored to a page, then to base + k*G; never below base. */
uint64_t kvs_grid_floor(uint64_t end, uint64_t base, uint64_t grid, uint64_t page);

/* ceil((prompt_len - base) / page); 0 when base >= prompt_len. */
uint64_t kvs_grid_total_pages(uint64_t prompt_len, uint64_t base, uint64_t page);

/* Number of chunks for total_pages suffix pages with F = G / page pages per slot. */
uint64_t kvs_grid_chunk_count(uint64_t total_pages, uint64_t grid, uint64_t page);

/* Pages in chunk k: min((k+1)F, total) - kF, or 0 past the end. */
uint64_t kvs_grid_chunk_pages(uint64_t chunk, uint64_t total_pages, uint64_t grid, uint64_t page);

/* Chunk index of a sub-send that starts at suffix page `suffix_page_start`. */
uint64_t kvs_grid_chunk_of(uint64_t suffix_page_start, uint64_t grid, uint64_t page);

/* Tokens in chunk k's slot: from base + k*G to the next boundary or to the transfer's end
 * E = min(prompt_len rounded up to the decode page, rounded up to the prefill page), the last
 * position both sides' pages cover; 0 past the end. With equal page sizes this is
 * chunk_pages * P. */
uint64_t kvs_grid_slot_tokens(uint64_t chunk, uint64_t prompt_len, uint64_t base, uint64_t grid,
                              uint64_t decode_page, uint64_t prefill_page);

/* Where tokens [start, start + tokens) lie in one side's pages of `page` tokens: page index
 * `first` (of the prompt's page table), at token `offset` in it, over `count` pages. */
typedef struct {
    uint64_t first;
    uint64_t offset;
    uint64_t count;
} kvs_page_span_t;

kvs_page_span_t kvs_grid_page_span(uint64_t start, uint64_t tokens, uint64_t page);

/* ---- decode context parallelism (protocol.md §1 "Context parallelism") ----
 * A DCP group of N decode ranks holds the same heads and different tokens: token t lives on
 * rank (t / T) mod N of the group, at local position (t / (N*T)) * T + t mod T of that rank's
 * pages, so each rank holds its tokens densely and in order. N = 1 is plain TP (local = t). */

typedef struct {
    uint32_t size;       /* N: ranks in the group (0 or 1: no DCP) */
    uint32_t interleave; /* T: consecutive tokens per rank (0 or 1: one) */
    uint32_t rank;       /* this rank's place in its group, below N */
} kvs_dcp_t;

/* The group rank that holds token t: (t / T) mod N. */
uint32_t kvs_dcp_owner(const kvs_dcp_t *dcp, uint64_t t);
/* Token t's local position on the rank that holds it. */
uint64_t kvs_dcp_local(const kvs_dcp_t *dcp, uint64_t t);
/* The converse for dcp->rank: the absolute position of its local position `local`. */
uint64_t kvs_dcp_global(const kvs_dcp_t *dcp, uint64_t local);
/* How many of the tokens [0, end) dcp->rank holds: the local position of its first token at or
 * after `end`. */
uint64_t kvs_dcp_count(const kvs_dcp_t *dcp, uint64_t end);

/* A decode rank's delta pages for a room: its tokens in [base, E) (E as for
 * kvs_grid_slot_tokens), in pages of decode_page from its local position of base, rounded up.
 * Without DCP this is kvs_grid_total_pages(prompt_len, base, decode_page) for any base that is
 * a multiple of the decode page. */
uint64_t kvs_grid_rank_total_pages(uint64_t prompt_len, uint64_t base, uint64_t decode_page,
                                   uint64_t prefill_page, const kvs_dcp_t *dcp);
/* Tokens in a decode rank's slot of chunk k: its tokens among the chunk's kvs_grid_slot_tokens
 * tokens from base + k*G (grid = G). With base and G multiples of N*T each full chunk gives
 * every rank G / N tokens, at local positions from base / N + k*G/N. */
uint64_t kvs_grid_rank_slot_tokens(uint64_t chunk, uint64_t prompt_len, uint64_t base,
                                   uint64_t grid, uint64_t decode_page, uint64_t prefill_page,
                                   const kvs_dcp_t *dcp);

#endif
