/* The radix prefix cache: a compressed trie over page-aligned token keys, one shared root with
 * every namespace's subtrees below it, a global child hash table and an intrusive LRU list of
 * unlocked nodes that makes eviction O(evicted nodes).
 *
 * Child lookup: every non-root node sits in one hash table keyed by (parent, namespace, tokens of
 * its first page), with full comparison, so finding the child that continues a key costs O(P)
 * expected and no node keeps a child array.
 *
 * LRU invariant: the list holds exactly the unlocked non-root nodes, and every node appears
 * after all of its (necessarily unlocked) descendants. It holds because:
 *   - a lock count is the number of locks on the node or below it, so an unlocked node's whole
 *     subtree is unlocked and in the list, and the locked nodes of a path form its top part;
 *   - an access moves the unlocked part of a root path to the tail deepest first: moved nodes
 *     keep their mutual order, and a node's descendants off the path were already before it;
 *   - an unlock appends the nodes whose count fell to 0 (a path segment) deepest first, and
 *     their descendants were already in the list;
 *   - a split puts the new parent right after its only child;
 *   - eviction removes the head, which by the invariant has no descendant left: a leaf.
 * So eviction never has to search: the head is always the least recently used leaf.
 *
 * Not thread-safe: the caller serialises calls. The free callback must not call the cache. */
#include "kvstage/radix.h"

#include <assert.h>
#include <stdint.h>
#include <string.h>

#include "kvstage/alloc.h"
#include "kvstage/log.h"
#include "kvstage/rng.h"

struct kvs_radix_node {
    kvs_radix_node_t *parent;   /* NULL for the root */
    kvs_radix_node_t *hnext;    /* hash chain */
    kvs_radix_node_t *lru_prev; /* LRU links, meaningful only while unlocked */
    kvs_radix_node_t *lru_next;
    uint64_t ns;
    uint64_t hash;    /* of (parent, ns, first page) */
    size_t lock_ref;  /* locks held on this node or any descendant */
    size_t own_locks; /* locks taken on this very node: what unlock may release */
    size_t nchildren; /* for the leaf assertion on eviction */
    size_t npages;    /* edge length in pages */
    uint32_t *pages;  /* [npages] page ids, in the same block as the node */
    int32_t *tokens;  /* [npages][P] edge tokens, in the same block as the node */
};

struct kvs_radix {
    uint32_t page_size;
    kvs_radix_free_fn free_fn;
    void *free_arg;
    kvs_radix_node_t *root;
    kvs_radix_node_t **buckets; /* [nbuckets] chains of non-root nodes */
    size_t nbuckets;            /* a power of two */
    kvs_radix_node_t *lru_head; /* least recently used unlocked node */
    kvs_radix_node_t *lru_tail;
    kvs_radix_stats_t stats;
};

enum { INITIAL_BUCKETS = 64 };

/* ---- hashing ---- */

static uint64_t page_hash(const int32_t *tokens, uint32_t page_size)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (uint32_t i = 0; i < page_size; i++) h = (h ^ (uint32_t) tokens[i]) * 0x100000001b3ull;
    return h;
}

static uint64_t child_hash(const kvs_radix_node_t *parent, uint64_t ns, const int32_t *first,
                           uint32_t page_size)
{
    uint64_t where = kvs_mix64((uint64_t) (uintptr_t) parent ^ kvs_mix64(ns));
    return kvs_mix64(page_hash(first, page_size) ^ where);
}

static int page_equal(const int32_t *a, const int32_t *b, uint32_t page_size)
{
    return memcmp(a, b, (size_t) page_size * sizeof(int32_t)) == 0;
}

/* ---- child table ---- */

static kvs_radix_node_t *table_find(const kvs_radix_t *r, const kvs_radix_node_t *parent,
                                    uint64_t ns, const int32_t *first, uint64_t hash)
{
    for (kvs_radix_node_t *n = r->buckets[hash & (r->nbuckets - 1)]; n; n = n->hnext) {
        if (n->hash == hash && n->parent == parent && n->ns == ns &&
            page_equal(n->tokens, first, r->page_size))
            return n;
    }
    return NULL;
}

/* Growing is an optimisation: if the allocation fails the chains just get longer. */
static void table_maybe_grow(kvs_radix_t *r)
{
    if (r->stats.nodes < r->nbuckets || r->nbuckets > SIZE_MAX / 2 / sizeof(*r->buckets)) return;
    size_t nb = r->nbuckets * 2;
    kvs_radix_node_t **nbk = kvs_calloc(nb, sizeof(*nbk));
    if (nbk == NULL) {
        kvs_debug("radix: child table stays at %zu buckets (allocation failed)", r->nbuckets);
        return;
    }
    for (size_t i = 0; i < r->nbuckets; i++) {
        kvs_radix_node_t *n = r->buckets[i];
        while (n) {
            kvs_radix_node_t *next = n->hnext;
            size_t b = n->hash & (nb - 1);
            n->hnext = nbk[b];
            nbk[b] = n;
            n = next;
        }
    }
    kvs_free(r->buckets);
    r->buckets = nbk;
    r->nbuckets = nb;
}

static void table_insert(kvs_radix_t *r, kvs_radix_node_t *n)
{
    size_t b = n->hash & (r->nbuckets - 1);
    n->hnext = r->buckets[b];
    r->buckets[b] = n;
}

static void table_remove(kvs_radix_t *r, kvs_radix_node_t *n)
{
    kvs_radix_node_t **pp = &r->buckets[n->hash & (r->nbuckets - 1)];
    while (*pp != n) {
        assert(*pp != NULL);
        pp = &(*pp)->hnext;
    }
    *pp = n->hnext;
    n->hnext = NULL;
}

/* ---- LRU list ---- */

static void lru_remove(kvs_radix_t *r, kvs_radix_node_t *n)
{
    if (n->lru_prev)
        n->lru_prev->lru_next = n->lru_next;
    else
        r->lru_head = n->lru_next;
    if (n->lru_next)
        n->lru_next->lru_prev = n->lru_prev;
    else
        r->lru_tail = n->lru_prev;
    n->lru_prev = n->lru_next = NULL;
}

static void lru_append(kvs_radix_t *r, kvs_radix_node_t *n)
{
    n->lru_next = NULL;
    n->lru_prev = r->lru_tail;
    if (r->lru_tail)
        r->lru_tail->lru_next = n;
    else
        r->lru_head = n;
    r->lru_tail = n;
}

static void lru_insert_after(kvs_radix_t *r, kvs_radix_node_t *pos, kvs_radix_node_t *n)
{
    n->lru_prev = pos;
    n->lru_next = pos->lru_next;
    if (pos->lru_next)
        pos->lru_next->lru_prev = n;
    else
        r->lru_tail = n;
    pos->lru_next = n;
}

/* Marks the path from n up to the root as used, deepest first. Locked nodes are not in the
 * list, and once one is met every ancestor is locked too. */
static void touch_path(kvs_radix_t *r, kvs_radix_node_t *n)
{
    for (; n != r->root && n->lock_ref == 0; n = n->parent) {
        if (n != r->lru_tail) {
            lru_remove(r, n);
            lru_append(r, n);
        }
    }
}

/* ---- nodes ---- */

static kvs_radix_node_t *node_alloc(const kvs_radix_t *r, size_t npages)
{
    size_t per_page = sizeof(uint32_t) + (size_t) r->page_size * sizeof(int32_t);
    if (npages > (SIZE_MAX - sizeof(kvs_radix_node_t)) / per_page) return NULL;
    kvs_radix_node_t *n = kvs_malloc(sizeof(*n) + npages * per_page);
    if (n == NULL) return NULL;
    memset(n, 0, sizeof(*n));
    n->pages = (uint32_t *) (n + 1);
    n->tokens = (int32_t *) (n->pages + npages);
    n->npages = npages;
    return n;
}

/* Splits child x after its first `at` pages into new parent np (preallocated for `at` pages)
 * and x (the rest). Handles to x keep naming the end of the same key. */
static void node_split(kvs_radix_t *r, kvs_radix_node_t *x, size_t at, kvs_radix_node_t *np)
{
    uint32_t P = r->page_size;
    assert(at > 0 && at < x->npages && np->npages == at);
    memcpy(np->pages, x->pages, at * sizeof(uint32_t));
    memcpy(np->tokens, x->tokens, at * P * sizeof(int32_t));
    np->parent = x->parent;
    np->ns = x->ns;
    np->hash = x->hash; /* same parent, namespace and first page */
    np->lock_ref = x->lock_ref;
    np->nchildren = 1;

    table_remove(r, x);
    table_insert(r, np);

    /* The child keeps its block; the freed head of its arrays is at most the size of the key
     * it was inserted with. */
    x->npages -= at;
    memmove(x->pages, x->pages + at, x->npages * sizeof(uint32_t));
    memmove(x->tokens, x->tokens + at * P, x->npages * P * sizeof(int32_t));
    x->parent = np;
    x->hash = child_hash(np, x->ns, x->tokens, P);
    table_insert(r, x);

    if (x->lock_ref == 0) lru_insert_after(r, x, np);
    r->stats.nodes++;
    table_maybe_grow(r);
}

/* Walks the longest cached prefix of the key. On return *node_p is the deepest node whose whole
 * edge matched, *pages_p the pages matched up to it, and *partial_p the child whose edge matched
 * only in its first *partial_len_p pages (NULL when none). Read-only. */
static void walk(const kvs_radix_t *r, uint64_t ns, const int32_t *tokens, size_t npages,
                 kvs_radix_node_t **node_p, size_t *pages_p, kvs_radix_node_t **partial_p,
                 size_t *partial_len_p)
{
    uint32_t P = r->page_size;
    kvs_radix_node_t *node = r->root;
    size_t i = 0;
    *partial_p = NULL;
    *partial_len_p = 0;
    while (i < npages) {
        const int32_t *key = tokens + i * P;
        kvs_radix_node_t *child = table_find(r, node, ns, key, child_hash(node, ns, key, P));
        if (child == NULL) break;
        size_t j = 1;
        while (j < child->npages && i + j < npages &&
               page_equal(child->tokens + j * P, key + j * P, P))
            j++;
        if (j < child->npages) {
            *partial_p = child;
            *partial_len_p = j;
            break;
        }
        node = child;
        i += j;
    }
    *node_p = node;
    *pages_p = i;
}

/* ---- public API ---- */

kvs_status_t kvs_radix_create(uint32_t page_size, kvs_radix_free_fn free_fn, void *free_arg,
                              kvs_radix_t **radix_p)
{
    if (page_size == 0 || radix_p == NULL) {
        kvs_error("radix: invalid arguments (page size %u)", page_size);
        return KVS_ERR_INVALID;
    }
    kvs_radix_t *r = kvs_calloc(1, sizeof(*r));
    if (r == NULL) goto err;
    r->page_size = page_size;
    r->free_fn = free_fn;
    r->free_arg = free_arg;
    r->nbuckets = INITIAL_BUCKETS;
    r->buckets = kvs_calloc(r->nbuckets, sizeof(*r->buckets));
    if (r->buckets == NULL) goto err_free_radix;
    r->root = node_alloc(r, 0);
    if (r->root == NULL) goto err_free_buckets;
    *radix_p = r;
    return KVS_OK;

err_free_buckets:
    kvs_free(r->buckets);
err_free_radix:
    kvs_free(r);
err:
    kvs_error("radix: out of memory creating the cache");
    return KVS_ERR_NOMEM;
}

void kvs_radix_destroy(kvs_radix_t *radix)
{
    if (radix == NULL) return;
    for (size_t b = 0; b < radix->nbuckets; b++) {
        kvs_radix_node_t *n = radix->buckets[b];
        while (n) {
            kvs_radix_node_t *next = n->hnext;
            if (radix->free_fn && n->npages > 0)
                radix->free_fn(radix->free_arg, n->pages, n->npages);
            kvs_free(n);
            n = next;
        }
    }
    kvs_free(radix->root);
    kvs_free(radix->buckets);
    kvs_free(radix);
}

kvs_status_t kvs_radix_match(kvs_radix_t *radix, uint64_t ns, const int32_t *tokens, size_t len,
                             uint32_t *pages_p, kvs_radix_match_t *match_p)
{
    if (radix == NULL || match_p == NULL || (tokens == NULL && len >= radix->page_size)) {
        kvs_error("radix: match with invalid arguments (len %zu)", len);
        return KVS_ERR_INVALID;
    }
    size_t npages = len / radix->page_size;
    kvs_radix_node_t *node, *partial;
    size_t matched, partial_len;
    walk(radix, ns, tokens, npages, &node, &matched, &partial, &partial_len);
    if (partial != NULL) {
        kvs_radix_node_t *np = node_alloc(radix, partial_len);
        if (np == NULL) {
            kvs_error("radix: out of memory splitting a node (%zu pages)", partial_len);
            return KVS_ERR_NOMEM;
        }
        node_split(radix, partial, partial_len, np);
        node = np;
        matched += partial_len;
    }
    touch_path(radix, node);
    if (pages_p != NULL) {
        size_t end = matched;
        for (kvs_radix_node_t *n = node; n != radix->root; n = n->parent) {
            end -= n->npages;
            memcpy(pages_p + end, n->pages, n->npages * sizeof(uint32_t));
        }
        assert(end == 0);
    }
    match_p->tokens = matched * radix->page_size;
    match_p->node = node;
    return KVS_OK;
}

kvs_status_t kvs_radix_lookup(const kvs_radix_t *radix, uint64_t ns, const int32_t *tokens,
                              size_t len, size_t *tokens_p)
{
    if (radix == NULL || tokens_p == NULL || (tokens == NULL && len >= radix->page_size)) {
        kvs_error("radix: lookup with invalid arguments (len %zu)", len);
        return KVS_ERR_INVALID;
    }
    kvs_radix_node_t *node, *partial;
    size_t matched, partial_len;
    walk(radix, ns, tokens, len / radix->page_size, &node, &matched, &partial, &partial_len);
    *tokens_p = (matched + partial_len) * radix->page_size;
    return KVS_OK;
}

kvs_status_t kvs_radix_insert(kvs_radix_t *radix, uint64_t ns, const int32_t *tokens, size_t len,
                              const uint32_t *pages, size_t *present_p, kvs_radix_node_t **node_p)
{
    if (radix == NULL || present_p == NULL ||
        (len >= radix->page_size && (tokens == NULL || pages == NULL))) {
        kvs_error("radix: insert with invalid arguments (len %zu)", len);
        return KVS_ERR_INVALID;
    }
    uint32_t P = radix->page_size;
    size_t npages = len / P;
    kvs_radix_node_t *node, *partial;
    size_t present, partial_len;
    walk(radix, ns, tokens, npages, &node, &present, &partial, &partial_len);
    present += partial_len;
    size_t leaf_pages = npages - present;

    /* Allocate everything before changing anything, so a failure leaves the cache as it was. */
    kvs_radix_node_t *np = NULL, *leaf = NULL;
    if (partial != NULL && (np = node_alloc(radix, partial_len)) == NULL) goto err_nomem;
    if (leaf_pages > 0 && (leaf = node_alloc(radix, leaf_pages)) == NULL) goto err_free_split;

    if (np != NULL) {
        node_split(radix, partial, partial_len, np);
        node = np;
    }
    if (leaf != NULL) {
        memcpy(leaf->pages, pages + present, leaf_pages * sizeof(uint32_t));
        memcpy(leaf->tokens, tokens + present * P, leaf_pages * P * sizeof(int32_t));
        leaf->parent = node;
        leaf->ns = ns;
        leaf->hash = child_hash(node, ns, leaf->tokens, P);
        table_insert(radix, leaf);
        node->nchildren++;
        lru_append(radix, leaf); /* touch_path below keeps it where the order needs it */
        radix->stats.nodes++;
        radix->stats.total_pages += leaf_pages;
        radix->stats.evictable_pages += leaf_pages;
        table_maybe_grow(radix);
        node = leaf;
    }
    touch_path(radix, node);
    *present_p = present * P;
    if (node_p != NULL) *node_p = node;
    return KVS_OK;

err_free_split:
    kvs_free(np);
err_nomem:
    kvs_error("radix: out of memory inserting a key of %zu pages", npages);
    return KVS_ERR_NOMEM;
}

void kvs_radix_lock(kvs_radix_t *radix, kvs_radix_node_t *node)
{
    node->own_locks++;
    for (kvs_radix_node_t *n = node; n != NULL; n = n->parent) {
        if (n->lock_ref++ == 0 && n != radix->root) {
            lru_remove(radix, n);
            radix->stats.evictable_pages -= n->npages;
            radix->stats.protected_pages += n->npages;
        }
    }
}

kvs_status_t kvs_radix_unlock(kvs_radix_t *radix, kvs_radix_node_t *node)
{
    /* Checking the node's own locks (not its count, which includes descendants' locks) keeps
     * an unlock through the wrong handle from corrupting the counts of a locked path. */
    if (node->own_locks == 0) {
        kvs_error("radix: unlock of a node that is not locked (%zu locks below it)",
                  node->lock_ref);
        return KVS_ERR_STATE;
    }
    node->own_locks--;
    /* Counts only fall to 0 on a segment starting at node, so appending while walking up puts
     * the newly unlocked nodes at the tail deepest first. */
    for (kvs_radix_node_t *n = node; n != NULL; n = n->parent) {
        assert(n->lock_ref > 0);
        if (--n->lock_ref == 0 && n != radix->root) {
            lru_append(radix, n);
            radix->stats.evictable_pages += n->npages;
            radix->stats.protected_pages -= n->npages;
        }
    }
    return KVS_OK;
}

size_t kvs_radix_evict(kvs_radix_t *radix, size_t pages)
{
    size_t evicted = 0;
    while (evicted < pages && radix->lru_head != NULL) {
        kvs_radix_node_t *n = radix->lru_head;
        assert(n->lock_ref == 0 && n->nchildren == 0);
        lru_remove(radix, n);
        table_remove(radix, n);
        n->parent->nchildren--;
        radix->stats.nodes--;
        radix->stats.total_pages -= n->npages;
        radix->stats.evictable_pages -= n->npages;
        if (radix->free_fn) radix->free_fn(radix->free_arg, n->pages, n->npages);
        evicted += n->npages;
        kvs_free(n);
    }
    return evicted;
}

void kvs_radix_stats(const kvs_radix_t *radix, kvs_radix_stats_t *stats_p)
{
    *stats_p = radix->stats;
}
