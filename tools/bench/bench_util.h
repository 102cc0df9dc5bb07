/* Helpers shared by the benchmarks. */
#ifndef KVSTAGE_TOOLS_BENCH_UTIL_H
#define KVSTAGE_TOOLS_BENCH_UTIL_H

#include <stddef.h>

/* The CPU model name (from /proc/cpuinfo) and the number of online cores. */
void kvs_bench_cpu_info(char *model, size_t size, long *cores_p);

#endif
