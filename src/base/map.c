/* Open-addressing hash map with linear probing and tombstones. */
#include "base/map.h"

#include "kvstage/alloc.h"
#include "kvstage/rng.h"

static char tombstone_marker;
#define TOMBSTONE ((void *) &tombstone_marker)

void kvs_map_init(kvs_map_t *map)
{
    map->keys = NULL;
    map->vals = NULL;
    map->cap = map->count = map->used = 0;
}

void kvs_map_fini(kvs_map_t *map)
{
    kvs_free(map->keys);
    kvs_free(map->vals);
    kvs_map_init(map);
}

static size_t find_slot(const kvs_map_t *map, uint64_t key, int *found_p)
{
    size_t mask = map->cap - 1;
    size_t i = (size_t) kvs_mix64(key) & mask;
    size_t first_tomb = SIZE_MAX;
    for (;;) {
        void *v = map->vals[i];
        if (v == NULL) {
            *found_p = 0;
            return first_tomb != SIZE_MAX ? first_tomb : i;
        }
        if (v == TOMBSTONE) {
            if (first_tomb == SIZE_MAX) first_tomb = i;
        } else if (map->keys[i] == key) {
            *found_p = 1;
            return i;
        }
        i = (i + 1) & mask;
    }
}

void *kvs_map_get(const kvs_map_t *map, uint64_t key)
{
    if (map->count == 0) return NULL;
    int found;
    size_t i = find_slot(map, key, &found);
    return found ? map->vals[i] : NULL;
}

static kvs_status_t grow(kvs_map_t *map)
{
    size_t cap = map->cap ? map->cap : 16;
    while ((map->count + 1) * 2 > cap) cap *= 2;
    uint64_t *keys = kvs_calloc(cap, sizeof(*keys));
    void **vals = kvs_calloc(cap, sizeof(*vals));
    if (keys == NULL || vals == NULL) {
        kvs_free(keys);
        kvs_free(vals);
        return KVS_ERR_NOMEM;
    }
    kvs_map_t fresh = {keys, vals, cap, 0, 0};
    for (size_t i = 0; i < map->cap; i++) {
        if (map->vals[i] != NULL && map->vals[i] != TOMBSTONE) {
            int found;
            size_t j = find_slot(&fresh, map->keys[i], &found);
            fresh.keys[j] = map->keys[i];
            fresh.vals[j] = map->vals[i];
            fresh.count++;
            fresh.used++;
        }
    }
    kvs_free(map->keys);
    kvs_free(map->vals);
    *map = fresh;
    return KVS_OK;
}

kvs_status_t kvs_map_put(kvs_map_t *map, uint64_t key, void *val)
{
    if ((map->used + 1) * 4 > map->cap * 3) {
        kvs_status_t st = grow(map);
        if (st != KVS_OK) return st;
    }
    int found;
    size_t i = find_slot(map, key, &found);
    if (!found) {
        if (map->vals[i] == NULL) map->used++;
        map->count++;
        map->keys[i] = key;
    }
    map->vals[i] = val;
    return KVS_OK;
}

void *kvs_map_remove(kvs_map_t *map, uint64_t key)
{
    if (map->count == 0) return NULL;
    int found;
    size_t i = find_slot(map, key, &found);
    if (!found) return NULL;
    void *v = map->vals[i];
    map->vals[i] = TOMBSTONE;
    map->count--;
    return v;
}

int kvs_map_next(const kvs_map_t *map, size_t *iter, uint64_t *key_p, void **val_p)
{
    for (size_t i = *iter; i < map->cap; i++) {
        void *v = map->vals[i];
        if (v != NULL && v != TOMBSTONE) {
            *iter = i + 1;
            if (key_p) *key_p = map->keys[i];
            if (val_p) *val_p = v;
            return 1;
        }
    }
    *iter = map->cap;
    return 0;
}
