/* The `kvstage` subcommands. Each returns the process exit code: 0 success, 1 failure
 * (e.g. a check failed), 2 usage error. argv[0] is the subcommand name. */
#ifndef KVSTAGE_TOOLS_COMMANDS_H
#define KVSTAGE_TOOLS_COMMANDS_H

typedef struct {
    const char *name;
    int (*run)(int argc, char **argv);
    const char *summary;
} kvs_command_t;

int kvs_cmd_plan(int argc, char **argv);
int kvs_cmd_bench(int argc, char **argv);
int kvs_cmd_demo(int argc, char **argv);
int kvs_cmd_prefill(int argc, char **argv);
int kvs_cmd_decode(int argc, char **argv);
int kvs_cmd_sim(int argc, char **argv);

#endif
