/* Pieces shared by the transfer benchmarks: list flags, medians, checksum costs, slot sizes. */
#include "bench/bench_transfer_common.h"

#include <stdio.h>
#include <stdlib.h>

#include "kvstage/grid.h"

int kvs_bt_parse_list(const char *s, uint32_t *out)
{
    int n = 0;
    while (*s) {
        char *end;
        unsigned long v = strtoul(s, &end, 10);
        if (end == s || v == 0 || v > (1ul << 24) || n == KVS_BT_MAX_LIST) return -1;
        out[n++] = (uint32_t) v;
        if (*end == ',')
            end++;
        else if (*end != '\0')
            return -1;
        s = end;
    }
    return n;
}

int kvs_bt_parse_tp(const char *s, uint32_t *ptp, uint32_t *dtp)
{
    int n = 0;
    while (*s) {
        char *end;
        unsigned long a = strtoul(s, &end, 10);
        if (end == s || *end != ':' || n == KVS_BT_MAX_LIST) return -1;
        s = end + 1;
        unsigned long b = strtoul(s, &end, 10);
        if (end == s || a == 0 || b == 0 || a > KVS_MAX_TP || b > KVS_MAX_TP) return -1;
        ptp[n] = (uint32_t) a;
        dtp[n++] = (uint32_t) b;
        if (*end == ',')
            end++;
        else if (*end != '\0')
            return -1;
        s = end;
    }
    return n;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *) a, y = *(const double *) b;
    return (x > y) - (x < y);
}

double kvs_bt_median(double *v, uint32_t n)
{
    qsort(v, n, sizeof(double), cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2.0;
}

int kvs_bt_csum_cost(double gbs_on, double gbs_off, double *pct_p)
{
    if (gbs_on <= 0 || gbs_off <= 0) return 0;
    *pct_p = 100.0 * (gbs_off / gbs_on - 1.0); /* time = bytes / rate */
    return 1;
}

void kvs_bt_csum_cell(char *buf, size_t cap, int width, double gbs_on, double gbs_off,
                      const char *absent)
{
    double pct = 0;
    if (kvs_bt_csum_cost(gbs_on, gbs_off, &pct))
        snprintf(buf, cap, "%*.1f%%", width - 1, pct);
    else
        snprintf(buf, cap, "%*s", width, absent);
}

uint64_t kvs_bt_full_slot_bytes(const kvs_pd_geometry_t *g)
{
    kvs_writer_t writers[KVS_MAX_WRITERS];
    uint64_t tokens = kvs_grid_tokens(g->chunk_tokens, g->page_size), most = 0;
    for (uint32_t d = 0; d < g->decode_tp; d++) {
        uint32_t n = 0;
        if (kvs_plan_writers(&g->shape, g->prefill_tp, g->decode_tp, d, 1, writers, &n) != KVS_OK)
            return 0;
        uint64_t b = kvs_slot_layout(writers, n, tokens, NULL);
        if (b > most) most = b;
    }
    return most;
}
