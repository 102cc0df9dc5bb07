/* An open-addressing hash map from 64-bit keys to pointers (internal container). */
#ifndef KVSTAGE_BASE_MAP_H
#define KVSTAGE_BASE_MAP_H

#include <stddef.h>
#include <stdint.h>

#include "kvstage/status.h"

typedef struct {
    uint64_t *keys;
    void **vals; /* NULL marks an empty slot; a tombstone is the map's own marker */
    size_t cap;  /* power of two, or 0 */
    size_t count;
    size_t used; /* count + tombstones */
} kvs_map_t;

void kvs_map_init(kvs_map_t *map);
void kvs_map_fini(kvs_map_t *map);
void *kvs_map_get(const kvs_map_t *map, uint64_t key);
/* Inserts or replaces; val must not be NULL. */
kvs_status_t kvs_map_put(kvs_map_t *map, uint64_t key, void *val);
/* Returns the removed value, or NULL if absent. */
void *kvs_map_remove(kvs_map_t *map, uint64_t key);

/* Iteration: for (size_t i = 0; kvs_map_next(map, &i, &k, &v);) ... Removing the current entry
 * during iteration is allowed. */
int kvs_map_next(const kvs_map_t *map, size_t *iter, uint64_t *key_p, void **val_p);

#endif
