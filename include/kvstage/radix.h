/* The radix prefix cache: maps token-id prefixes (page-aligned) to the pool pages that hold
 * their KV, as serving engines do. Keys live in namespaces (e.g. a LoRA id or cache salt; 0 is
 * the default); a prefix only matches within its namespace.
 *
 * Ownership: pages passed to insert beyond the already-present prefix belong to the cache until
 * it hands them back through the evict callback (on eviction and on destroy). Locked nodes
 * (and their ancestors) are protected from eviction. */
#ifndef KVSTAGE_RADIX_H
#define KVSTAGE_RADIX_H

#include <stddef.h>
#include <stdint.h>

#include "kvstage/status.h"

typedef struct kvs_radix kvs_radix_t;
typedef struct kvs_radix_node kvs_radix_node_t;

/* Receives pages the cache gives up (eviction, destroy). */
typedef void (*kvs_radix_free_fn)(void *arg, const uint32_t *pages, size_t count);

kvs_status_t kvs_radix_create(uint32_t page_size, kvs_radix_free_fn free_fn, void *free_arg,
                              kvs_radix_t **radix_p);
/* Hands every cached page to the free callback, then frees the cache. Locks are ignored. */
void kvs_radix_destroy(kvs_radix_t *radix);

typedef struct {
    size_t tokens;          /* matched length, a multiple of the page size */
    kvs_radix_node_t *node; /* deepest matched node (the root when nothing matched) */
} kvs_radix_match_t;

/* Longest cached prefix of tokens[0, len) in namespace ns. Writes its tokens/P page ids to
 * pages_p, which must hold len/P entries (NULL when only the length is wanted). Splits a node
 * when the match ends inside it. Marks the matched path as recently used. */
kvs_status_t kvs_radix_match(kvs_radix_t *radix, uint64_t ns, const int32_t *tokens, size_t len,
                             uint32_t *pages_p, kvs_radix_match_t *match_p);

/* Read-only: the length of the longest cached prefix of tokens[0, len) in namespace ns (a
 * multiple of the page size), as kvs_radix_match would find it, without splitting a node or
 * touching the LRU order: a query that leaves the cache exactly as it was, e.g. one that only
 * one of several lockstep replicas of a cache answers. */
kvs_status_t kvs_radix_lookup(const kvs_radix_t *radix, uint64_t ns, const int32_t *tokens,
                              size_t len, size_t *tokens_p);

/* Inserts the first floor(len/P)*P tokens with their pages (pages[i] holds tokens
 * [i*P, (i+1)*P)). *present_p receives how many tokens were already cached: the caller keeps
 * (and should free) its pages for [0, present); the cache owns the rest. node_p (optional)
 * receives the node ending the inserted key. */
kvs_status_t kvs_radix_insert(kvs_radix_t *radix, uint64_t ns, const int32_t *tokens, size_t len,
                              const uint32_t *pages, size_t *present_p, kvs_radix_node_t **node_p);

/* Lock protects node and every ancestor from eviction; calls nest. */
void kvs_radix_lock(kvs_radix_t *radix, kvs_radix_node_t *node);
/* KVS_ERR_STATE if the node is not locked. */
kvs_status_t kvs_radix_unlock(kvs_radix_t *radix, kvs_radix_node_t *node);

/* Evicts at least `pages` pages (whole nodes, least recently used leaves first) unless fewer
 * are evictable; returns how many were evicted and handed to the free callback. */
size_t kvs_radix_evict(kvs_radix_t *radix, size_t pages);

typedef struct {
    size_t total_pages;     /* pages held by the cache */
    size_t evictable_pages; /* pages in unlocked nodes */
    size_t protected_pages; /* pages in locked nodes */
    size_t nodes;           /* excluding roots */
} kvs_radix_stats_t;

void kvs_radix_stats(const kvs_radix_t *radix, kvs_radix_stats_t *stats_p);

#endif
