/* Page allocation in lockstep over an instance's TP ranks: one schedule, identical page ids on
 * every rank, so one radix cache and one page table serve them all. */
#include <assert.h>
#include <stdlib.h>
#include <string.h>

#include "sim/engine.h"
#include "kvstage/alloc.h"
#include "kvstage/log.h"

kvs_status_t kvs_lockstep_alloc(kvs_lockstep_t *ls, uint32_t n, uint32_t *pages_p)
{
    if (n == 0) return KVS_OK;
    assert(n <= ls->scratch_cap);
    uint32_t free_pages = kvs_pool_free_pages(ls->pools[0]);
    if (free_pages < n && ls->radix != NULL) {
        kvs_radix_evict(ls->radix, n - free_pages);
        free_pages = kvs_pool_free_pages(ls->pools[0]);
    }
    if (free_pages < n) return KVS_ERR_NOSPACE;
    kvs_status_t st = kvs_pool_alloc(ls->pools[0], n, pages_p);
    if (st != KVS_OK) return st;
    for (uint32_t r = 1; r < ls->tp; r++) {
        st = kvs_pool_alloc(ls->pools[r], n, ls->scratch);
        /* Every rank saw the same allocations and frees, so the same ids must come back; if
         * not, the engine's bookkeeping is broken and nothing after this can be trusted
         * (checked even in release builds: the simulation exists to catch such bugs). */
        if (st != KVS_OK || memcmp(ls->scratch, pages_p, (size_t) n * sizeof(uint32_t)) != 0) {
            kvs_error("lockstep: rank %u handed out different pages than rank 0", r);
            abort();
        }
    }
    return KVS_OK;
}

void kvs_lockstep_free(kvs_lockstep_t *ls, const uint32_t *pages, uint32_t n)
{
    if (n == 0) return;
    for (uint32_t r = 0; r < ls->tp; r++) {
        if (kvs_pool_free(ls->pools[r], pages, n) != KVS_OK) {
            kvs_error("lockstep: freeing %u pages on rank %u failed (engine bookkeeping)", n, r);
            abort();
        }
    }
}

void kvs_lockstep_radix_free(void *arg, const uint32_t *pages, size_t count)
{
    kvs_lockstep_free(arg, pages, (uint32_t) count);
}

kvs_status_t kvs_lockstep_init(kvs_lockstep_t *ls, kvs_pool_t *const *pools, uint32_t tp,
                               uint32_t page_size, uint32_t max_pages, int radix)
{
    memset(ls, 0, sizeof(*ls));
    kvs_pool_t **copy = kvs_calloc(tp, sizeof(*copy));
    ls->scratch = kvs_calloc(max_pages + 1, sizeof(uint32_t));
    if (copy == NULL || ls->scratch == NULL) {
        kvs_free(copy);
        kvs_free(ls->scratch);
        ls->scratch = NULL;
        return KVS_ERR_NOMEM;
    }
    memcpy(copy, pools, tp * sizeof(*copy));
    ls->pools = copy;
    ls->tp = tp;
    ls->scratch_cap = max_pages + 1;
    if (radix) {
        kvs_status_t st = kvs_radix_create(page_size, kvs_lockstep_radix_free, ls, &ls->radix);
        if (st != KVS_OK) {
            kvs_lockstep_fini(ls);
            return st;
        }
    }
    return KVS_OK;
}

void kvs_lockstep_fini(kvs_lockstep_t *ls)
{
    kvs_radix_destroy(ls->radix);
    kvs_free(ls->scratch);
    kvs_free((void *) ls->pools);
    memset(ls, 0, sizeof(*ls));
}
