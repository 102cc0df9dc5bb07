/* Grid arithmetic of protocol.md §1: slot size, segments split at grid boundaries, flooring a
 * send to the grid, and chunk numbering. All positions are absolute token positions. */
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

#endif
