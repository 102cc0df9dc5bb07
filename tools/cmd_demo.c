/* `kvstage demo`: what `make demo` runs. For now it explains the handoff and prints the plan of
 * the default deployment; the in-process protocol simulation replaces the body later. */
#include "commands.h"

#include <stdio.h>

#include "args.h"

int kvs_cmd_demo(int argc, char **argv)
{
    int rc = kvs_args_parse("kvstage demo", NULL, 0, argc, argv, 1);
    if (rc == KVS_ARGS_HELP) return 0;
    if (rc != KVS_ARGS_OK) return 2;

    printf("kvstage moves a request's KV cache from the prefill workers that compute it to the\n"
           "decode workers that continue it. When the two sides shard attention heads over\n"
           "different tensor-parallel sizes, a token's row on a prefill rank holds a different\n"
           "head subset than on a decode rank, so a naive transfer posts one small write per\n"
           "page, layer, K/V and destination. kvstage instead gathers each prefill rank's head\n"
           "slice for a whole chunk into one region of a staging slot on the decode rank, writes\n"
           "it in one bulk transfer, and scatters the slot into the decode KV pool. Below is the\n"
           "plan for the default deployment: prefill TP4 -> decode TP2, 8 KV heads, 32 layers,\n"
           "head dim 128, bf16, page 16, chunk 256.\n\n");
    fflush(stdout);

    char *plan_argv[] = {
        "plan", "--prefill-tp", "4",  "--decode-tp", "2",   "--kv-heads",
        "8",    "--layers",     "32", "--head-dim",  "128", "--dtype-bytes",
        "2",    "--page-size",  "16", "--chunk",     "256",
    };
    return kvs_cmd_plan((int) (sizeof(plan_argv) / sizeof(plan_argv[0])), plan_argv);
}
