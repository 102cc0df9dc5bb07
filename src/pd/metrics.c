/* The transfer counters' field table (KVS_PD_METRICS in kvstage/pd.h) as data, and sums. */
#include "kvstage/pd.h"

static const kvs_pd_metric_field_t fields[] = {
#define ROW_(f, k, j, l, t, p, at, h)                                                              \
    {.field = #f,                                                                                  \
     .offset = offsetof(kvs_pd_metrics_t, f),                                                      \
     .kind = KVS_PD_##k,                                                                           \
     .json = j,                                                                                    \
     .line = l,                                                                                    \
     .text = t,                                                                                    \
     .prom = p,                                                                                    \
     .prom_at = at,                                                                                \
     .help = h},
    KVS_PD_METRICS(ROW_)
#undef ROW_
};

#define N_FIELDS (sizeof(fields) / sizeof(fields[0]))
/* Every member is a row's uint64_t: the struct is the table and nothing else. */
typedef char kvs_pd_metrics_is_the_table_[sizeof(kvs_pd_metrics_t) == N_FIELDS * 8 ? 1 : -1];

const kvs_pd_metric_field_t *kvs_pd_metrics_fields(uint32_t *count_p)
{
    *count_p = (uint32_t) N_FIELDS;
    return fields;
}

uint64_t kvs_pd_metrics_get(const kvs_pd_metrics_t *m, const kvs_pd_metric_field_t *f)
{
    return *(const uint64_t *) ((const char *) m + f->offset);
}

void kvs_pd_metrics_set(kvs_pd_metrics_t *m, const kvs_pd_metric_field_t *f, uint64_t v)
{
    *(uint64_t *) ((char *) m + f->offset) = v;
}

void kvs_pd_metrics_add(kvs_pd_metrics_t *dst, const kvs_pd_metrics_t *src)
{
    for (size_t i = 0; i < N_FIELDS; i++)
        kvs_pd_metrics_set(dst, &fields[i],
                           kvs_pd_metrics_get(dst, &fields[i]) +
                               kvs_pd_metrics_get(src, &fields[i]));
}
