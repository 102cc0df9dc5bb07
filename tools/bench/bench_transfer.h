/* `kvstage bench transfer`: one request's KV from prefill pools to decode pools, through the
 * protocol (staged and direct writes), a per-page copy path and one bulk copy (the limit). */
#ifndef KVSTAGE_TOOLS_BENCH_TRANSFER_H
#define KVSTAGE_TOOLS_BENCH_TRANSFER_H

/* argv[0] is "transfer". Returns the exit code: 0 ok, 1 failed run or failed check, 2 usage
 * (including --device cuda without CUDA or a GPU). */
int kvs_bench_transfer(int argc, char **argv);

#endif
