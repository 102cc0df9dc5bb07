/* The flags of one rank of a multi-process deployment, shared by `kvstage prefill`,
 * `kvstage decode` and the multi-process `kvstage demo`, which passes them through to every
 * rank it launches. */
#ifndef KVSTAGE_TOOLS_RANK_FLAGS_H
#define KVSTAGE_TOOLS_RANK_FLAGS_H

#include "sim/rank.h"

typedef struct {
    kvs_rank_config_t cfg;
    int json;
    int progress; /* print "progress CONCLUDED REQUESTS" lines on stdout (for the demo) */
} kvs_rank_flags_t;

/* The demo deployment: prefill TP4 -> decode TP2, 8 KV heads x 4 layers x 32 dims, page 16,
 * chunk 256, 64 random-length requests of up to 2000 tokens, 16 in flight, no radix. */
void kvs_rank_flags_default(kvs_rank_flags_t *flags_p);

/* Parses argv[1..] into flags (argv[0] is the command name); returns a KVS_ARGS_* code. */
int kvs_rank_flags_parse(kvs_rank_flags_t *flags, const char *usage, int argc, char **argv);

/* The checks across flags, before anything starts: TP sizes the KV heads allow, the workload,
 * and kvs_rank_check. cmd is "prefill", "decode" or "demo". 0, or 2 after the one error line. */
int kvs_rank_flags_check(const kvs_rank_flags_t *flags, const char *cmd);

/* 1 when every room succeeded exactly on the rank and nothing leaked. */
int kvs_rank_result_ok(const kvs_rank_result_t *result);

#endif
