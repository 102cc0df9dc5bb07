/* `kvstage bench engine`: the reference engine's prefill and decode rates on CPU, colocated vs
 * disaggregated through kvstage, and the transfer's share of time to first token. */
#ifndef KVSTAGE_TOOLS_BENCH_ENGINE_H
#define KVSTAGE_TOOLS_BENCH_ENGINE_H

/* argv[0] is "engine". Returns the exit code: 0 ok, 1 failed run, 2 usage. */
int kvs_bench_engine(int argc, char **argv);

#endif
