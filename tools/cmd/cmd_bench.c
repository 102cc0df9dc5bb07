/* `kvstage bench <name>`: dispatches to one benchmark per file. A new benchmark is one line in
 * the table below (plus its header). */
#include "cmd/commands.h"

#include <stdio.h>
#include <string.h>

#include "bench/bench_engine.h"
#include "bench/bench_kernels.h"
#include "bench/bench_protocol.h"
#include "bench/bench_radix.h"
#include "bench/bench_serve.h"
#include "bench/bench_transfer.h"

static const kvs_command_t benches[] = {
    {"radix", kvs_bench_radix, "radix prefix cache: throughput and hit rate vs the ideal"},
    {"protocol", kvs_bench_protocol,
     "control-plane cost per chunk and room, bulk vs per-page writes"},
    {"kernels", kvs_bench_kernels, "CUDA gather/scatter kernels vs a device-to-device memcpy"},
    {"engine", kvs_bench_engine,
     "the reference engine on CPU (or --device cuda): prefill and decode, colocated vs "
     "disaggregated"},
    {"serve", kvs_bench_serve,
     "HTTP serving under concurrent clients: TTFT and tok/s, colocated vs disaggregated"},
    {"transfer", kvs_bench_transfer,
     "one request's KV between GPUs: staged, direct, per-page copies vs one bulk copy"},
};

int kvs_cmd_bench(int argc, char **argv)
{
    return kvs_dispatch("kvstage bench <name>", benches, sizeof(benches) / sizeof(benches[0]), argc,
                        argv);
}
