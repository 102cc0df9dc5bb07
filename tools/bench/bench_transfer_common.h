/* Pieces shared by the transfer benchmarks (`kvstage bench transfer` on GPUs or in one process,
 * and its `--transport ucx` variant across two processes): list flags, medians, slot sizes.
 * `kvstage bench kernels` parses its list flags here too. */
#ifndef KVSTAGE_TOOLS_BENCH_TRANSFER_COMMON_H
#define KVSTAGE_TOOLS_BENCH_TRANSFER_COMMON_H

#include <stdint.h>

#include "kvstage/pd.h"

#define KVS_BT_MAX_LIST 16

/* Parses "a,b,c" of positive integers (at most KVS_BT_MAX_LIST); returns the count or -1. */
int kvs_bt_parse_list(const char *s, uint32_t *out);

/* Parses "1:1,2:1,1:2" into prefill and decode TP sizes; returns the count or -1. */
int kvs_bt_parse_tp(const char *s, uint32_t *ptp, uint32_t *dtp);

/* Median of v[0..n), n >= 1; sorts v. */
double kvs_bt_median(double *v, uint32_t n);

/* Bytes of the largest full slot on any decode rank of the geometry; 0 on a bad geometry. */
uint64_t kvs_bt_full_slot_bytes(const kvs_pd_geometry_t *g);

#endif
