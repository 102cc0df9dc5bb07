/* `kvstage`: the command-line entry point; dispatches to one subcommand per file. */
#include "cmd/commands.h"

#include <stdio.h>
#include <string.h>

#include "common/args.h"
#include "kvstage/msg.h"

#ifndef KVS_VERSION /* CMake defines both for this file */
#define KVS_VERSION    "unknown"
#define KVS_GIT_COMMIT "unknown"
#endif

static const kvs_command_t commands[] = {
    {"plan", kvs_cmd_plan, "print the transfer plan between two TP layouts"},
    {"bench", kvs_cmd_bench, "run a benchmark (radix, protocol, kernels, engine, serve, transfer)"},
    {"demo", kvs_cmd_demo, "run the default deployment (what `make demo` runs)"},
    {"prefill", kvs_cmd_prefill, "run one prefill rank of a multi-process deployment"},
    {"decode", kvs_cmd_decode, "run one decode rank of a multi-process deployment"},
    {"generate", kvs_cmd_generate,
     "run a real model disaggregated through kvstage, every rank a process"},
    {"serve", kvs_cmd_serve,
     "serve one instance of a real model over HTTP (OpenAI API), every rank a process"},
    {"router", kvs_cmd_router, "route requests to prefill and decode servers"},
    {"serve-demo", kvs_cmd_serve_demo,
     "what `make demo` runs: router, prefill and decode servers of a real model, two chats"},
    {"sim", kvs_cmd_sim, "simulate prefill -> decode transfers on a virtual clock and verify them"},
    {"version", kvs_cmd_version, "print the version, the git commit and the protocol version"},
};

int kvs_cmd_version(int argc, char **argv)
{
    if (argc > 1) return kvs_args_error(NULL, "no arguments", "unexpected argument '%s'", argv[1]);
    printf("kvstage %s (git %s, protocol %d)\n", KVS_VERSION, KVS_GIT_COMMIT, KVS_MSG_VERSION);
    return 0;
}

static void usage(FILE *f, const char *what, const kvs_command_t *table, size_t count)
{
    fprintf(f, "usage: %s [flags]   (%s --help for its flags)\n\n", what, what);
    for (size_t i = 0; i < count; i++) fprintf(f, "  %-12s %s\n", table[i].name, table[i].summary);
}

int kvs_dispatch(const char *what, const kvs_command_t *table, size_t count, int argc, char **argv)
{
    char names[256];
    size_t len = 0;
    names[0] = '\0';
    for (size_t i = 0; i < count && len < sizeof(names); i++)
        len += (size_t) snprintf(names + len, sizeof(names) - len, "%s%s", i ? "|" : "",
                                 table[i].name);
    if (argc < 2) return kvs_args_error(NULL, names, "%s: give a name", what);
    if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0 ||
        strcmp(argv[1], "help") == 0) {
        usage(stdout, what, table, count);
        return 0;
    }
    for (size_t i = 0; i < count; i++)
        if (strcmp(argv[1], table[i].name) == 0) return table[i].run(argc - 1, argv + 1);
    return kvs_args_error(NULL, names, "%s: unknown name '%s'", what, argv[1]);
}

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "llm-rank") == 0) return kvs_cmd_llm_rank(argc - 1, argv + 1);
    if (argc > 1 && strcmp(argv[1], "--version") == 0) return kvs_cmd_version(argc - 1, argv + 1);
    return kvs_dispatch("kvstage <command>", commands, sizeof(commands) / sizeof(commands[0]), argc,
                        argv);
}
