/* Generic link handle functions. */
#include "transport/link.h"

#include "kvstage/alloc.h"

void kvs_link_destroy(kvs_link_t *link)
{
    if (link == NULL) return;
    link->ops->destroy(link->ctx);
    kvs_free(link);
}
