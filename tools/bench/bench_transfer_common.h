/* Pieces shared by the transfer benchmarks (`kvstage bench transfer` on GPUs or in one process,
 * and its `--transport ucx` variant across two processes): list flags, medians, slot sizes.
 * `kvstage bench kernels` parses its list flags here too. */
#ifndef KVSTAGE_TOOLS_BENCH_TRANSFER_COMMON_H
#define KVSTAGE_TOOLS_BENCH_TRANSFER_COMMON_H

#include <stddef.h>
#include <stdint.h>

#include "kvstage/pd.h"

#define KVS_BT_MAX_LIST 16

/* --checksum: time the protocol with chunk checksums on and off (both, the default; the cost
 * is the difference), or in one setting only. */
enum { KVS_BT_CSUM_BOTH = 0, KVS_BT_CSUM_ON = 1, KVS_BT_CSUM_OFF = 2 };
#define KVS_BT_CSUM_CHOICES "both|on|off"
#define KVS_BT_CSUM_HELP                                                                           \
    "chunk checksums: both times the protocol with them on (the default protocol) and off "        \
    "and prints their cost; on or off times that setting only (both)"

/* Parses "a,b,c" of positive integers (at most KVS_BT_MAX_LIST); returns the count or -1. */
int kvs_bt_parse_list(const char *s, uint32_t *out);

/* Parses "1:1,2:1,1:2" into prefill and decode TP sizes; returns the count or -1. */
int kvs_bt_parse_tp(const char *s, uint32_t *ptp, uint32_t *dtp);

/* Median of v[0..n), n >= 1; sorts v. */
double kvs_bt_median(double *v, uint32_t n);

/* The checksum's cost from the rates of the same transfer with checksums on and off: (time on -
 * time off) / time off, in percent, into *pct_p; 0 when either was not measured. */
int kvs_bt_csum_cost(double gbs_on, double gbs_off, double *pct_p);

/* That cost as a table cell `width` wide ("  3.2%"), or `absent` when it was not measured. */
void kvs_bt_csum_cell(char *buf, size_t cap, int width, double gbs_on, double gbs_off,
                      const char *absent);

/* Bytes of the largest full slot on any decode rank of the geometry; 0 on a bad geometry. */
uint64_t kvs_bt_full_slot_bytes(const kvs_pd_geometry_t *g);

#endif
