/* The `kvstage` subcommands. Each returns the process exit code: 0 success, 1 failure
 * (e.g. a check failed), 2 usage error. argv[0] is the subcommand name. */
#ifndef KVSTAGE_TOOLS_COMMANDS_H
#define KVSTAGE_TOOLS_COMMANDS_H

#include <stddef.h>

typedef struct {
    const char *name;
    int (*run)(int argc, char **argv);
    const char *summary;
} kvs_command_t;

/* Runs the entry of `table` named by argv[1] with (argc - 1, argv + 1); prints the table as
 * usage for --help (exit 0); a missing or unknown name is one error line (exit 2). `what` names the
 * level, e.g. "kvstage <command>" or "kvstage bench <name>". */
int kvs_dispatch(const char *what, const kvs_command_t *table, size_t count, int argc, char **argv);

int kvs_cmd_plan(int argc, char **argv);
int kvs_cmd_bench(int argc, char **argv);
int kvs_cmd_demo(int argc, char **argv);
int kvs_cmd_prefill(int argc, char **argv);
int kvs_cmd_decode(int argc, char **argv);
int kvs_cmd_sim(int argc, char **argv);
/* `sim` with `intro` printed above its table (demo --transport inproc); never before an error. */
int kvs_cmd_sim_intro(int argc, char **argv, const char *intro);
int kvs_cmd_generate(int argc, char **argv);
int kvs_cmd_serve(int argc, char **argv);
int kvs_cmd_router(int argc, char **argv);
int kvs_cmd_serve_demo(int argc, char **argv);
int kvs_cmd_version(int argc, char **argv);
/* One rank of a `generate` deployment; launched by generate, not listed. */
int kvs_cmd_llm_rank(int argc, char **argv);

#endif
