/* `kvstage bench radix`: the radix prefix cache on serving workloads or a replayed trace. */
#ifndef KVSTAGE_TOOLS_BENCH_RADIX_H
#define KVSTAGE_TOOLS_BENCH_RADIX_H

/* argv[0] is "radix". Returns the exit code: 0 ok, 1 failed run, 2 usage or malformed trace. */
int kvs_bench_radix(int argc, char **argv);

#endif
