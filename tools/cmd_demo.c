/* `kvstage demo`: what `make demo` runs. It explains the handoff in a paragraph, then runs the
 * default simulation (`kvstage sim` with its defaults: prefill TP4 -> decode TP2, 200
 * shared-prefix requests, radix caches on both sides) with progress and a summary, and exits
 * with the simulation's verdict. Every `kvstage sim` flag is accepted. */
#include "commands.h"

#include <stdio.h>
#include <string.h>

int kvs_cmd_demo(int argc, char **argv)
{
    int quiet = 0;
    for (int i = 1; i < argc; i++)
        quiet |= strcmp(argv[i], "--json") == 0 || strcmp(argv[i], "--help") == 0 ||
                 strcmp(argv[i], "-h") == 0;
    if (!quiet) {
        printf("kvstage moves a request's KV cache from the prefill workers that compute it to\n"
               "the decode workers that continue it. When the two sides shard attention heads\n"
               "over different tensor-parallel sizes, a naive transfer posts one small write per\n"
               "page, layer, K/V and destination. kvstage gathers each prefill rank's head slice\n"
               "of a whole chunk into one region of a staging slot on the decode rank, writes it\n"
               "in one bulk transfer and scatters the slot into the decode KV pool.\n\n"
               "This demo simulates one prefill instance (TP4) and one decode instance (TP2)\n"
               "in this process on a virtual clock: 200 requests sharing long prefixes, radix\n"
               "prefix caches on both sides, and every transferred byte checked.\n\n");
        fflush(stdout);
    }
    return kvs_cmd_sim(argc, argv);
}
