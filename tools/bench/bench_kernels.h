/* `kvstage bench kernels`: the CUDA gather/scatter kernels against a device-to-device copy. */
#ifndef KVSTAGE_TOOLS_BENCH_KERNELS_H
#define KVSTAGE_TOOLS_BENCH_KERNELS_H

/* argv[0] is "kernels". Returns the exit code: 0 ok, 1 no GPU, failed run or failed check,
 * 2 usage. */
int kvs_bench_kernels(int argc, char **argv);

#endif
