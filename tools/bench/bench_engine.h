/* `kvstage bench engine`: the reference engine's prefill and decode rates on CPU, colocated vs
 * disaggregated through kvstage, and the transfer's share of time to first token. */
#ifndef KVSTAGE_TOOLS_BENCH_ENGINE_H
#define KVSTAGE_TOOLS_BENCH_ENGINE_H

#include "common/json.h"

/* argv[0] is "engine". Returns the exit code: 0 ok, 1 failed run, 2 usage. */
int kvs_bench_engine(int argc, char **argv);

/* --device cuda, the model part (bench_engine_cuda.c): the CUDA forward pass timed in this
 * process beside the GEMM and copy ceilings, a table (or rows into j when json). 0, 1 when a
 * row failed, -1 (said) when the GPU is not usable. */
int kvs_bench_engine_cuda_model(int gpu, int json, kvs_json_t *j);

#endif
