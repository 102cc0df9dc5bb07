/* `kvstage bench <name>`: dispatches to one benchmark per file. A new benchmark is one line in
 * the table below (plus its header). */
#include "commands.h"

#include <stdio.h>
#include <string.h>

#include "bench_kernels.h"
#include "bench_protocol.h"
#include "bench_radix.h"
#include "bench_transfer.h"

static const kvs_command_t benches[] = {
    {"radix", kvs_bench_radix, "radix prefix cache: throughput and hit rate vs the ideal"},
    {"protocol", kvs_bench_protocol,
     "control-plane cost per chunk and room, bulk vs per-page writes"},
    {"kernels", kvs_bench_kernels, "CUDA gather/scatter kernels vs a device-to-device memcpy"},
    {"transfer", kvs_bench_transfer,
     "one request's KV between GPUs: staged, direct, per-page copies vs one bulk copy"},
};

static void usage(FILE *f)
{
    fprintf(f, "usage: kvstage bench <name> [flags]   (kvstage bench <name> --help for flags)\n\n");
    for (size_t i = 0; i < sizeof(benches) / sizeof(benches[0]); i++)
        fprintf(f, "  %-10s %s\n", benches[i].name, benches[i].summary);
}

int kvs_cmd_bench(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0 ||
        strcmp(argv[1], "help") == 0) {
        usage(stdout);
        return 0;
    }
    for (size_t i = 0; i < sizeof(benches) / sizeof(benches[0]); i++) {
        if (strcmp(argv[1], benches[i].name) == 0) return benches[i].run(argc - 1, argv + 1);
    }
    fprintf(stderr, "error: unknown benchmark '%s'\n\n", argv[1]);
    usage(stderr);
    return 2;
}
