/* `kvstage`: the command-line entry point; dispatches to one subcommand per file. */
#include "commands.h"

#include <stdio.h>
#include <string.h>

static const kvs_command_t commands[] = {
    {"plan", kvs_cmd_plan, "print the transfer plan between two TP layouts"},
    {"bench", kvs_cmd_bench, "run a benchmark (radix)"},
    {"demo", kvs_cmd_demo, "run the default deployment (what `make demo` runs)"},
    {"prefill", kvs_cmd_prefill, "run one prefill rank of a multi-process deployment"},
    {"decode", kvs_cmd_decode, "run one decode rank of a multi-process deployment"},
    {"sim", kvs_cmd_sim, "simulate prefill -> decode transfers on a virtual clock and verify them"},
};

static void usage(FILE *f)
{
    fprintf(f, "usage: kvstage <command> [flags]   (kvstage <command> --help for flags)\n\n");
    for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++)
        fprintf(f, "  %-8s %s\n", commands[i].name, commands[i].summary);
}

int main(int argc, char **argv)
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
    for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++) {
        if (strcmp(argv[1], commands[i].name) == 0) return commands[i].run(argc - 1, argv + 1);
    }
    fprintf(stderr, "error: unknown command '%s'\n\n", argv[1]);
    usage(stderr);
    return 2;
}
