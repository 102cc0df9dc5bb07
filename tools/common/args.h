/* Table-driven flag parsing shared by every `kvstage` subcommand: `--name value`,
 * `--name=value` and boolean `--name`. Errors print a clear message and the usage. */
#ifndef KVSTAGE_TOOLS_ARGS_H
#define KVSTAGE_TOOLS_ARGS_H

#include <stddef.h>
#include <stdint.h>

typedef enum {
    KVS_ARG_U32,    /* uint32_t *dst */
    KVS_ARG_U64,    /* uint64_t *dst */
    KVS_ARG_DOUBLE, /* double *dst */
    KVS_ARG_STR,    /* const char **dst (points into argv) */
    KVS_ARG_FLAG,   /* int *dst set to 1; takes no value */
    KVS_ARG_ONOFF,  /* int *dst: on -> 1, off -> 0 */
    KVS_ARG_CHOICE, /* int *dst: index of the value in choices ("a|b|c") */
} kvs_arg_type_t;

typedef struct {
    const char *name; /* without the leading dashes */
    kvs_arg_type_t type;
    void *dst;
    const char *help;
    const char *choices; /* KVS_ARG_CHOICE only */
    int *seen;           /* optional: set to 1 when the flag was given */
} kvs_arg_t;

enum { KVS_ARGS_OK = 0, KVS_ARGS_HELP = 1, KVS_ARGS_USAGE = 2 };

/* Parses argv[first..argc). Returns KVS_ARGS_OK, KVS_ARGS_HELP (usage printed to stdout for
 * --help) or KVS_ARGS_USAGE (error and usage printed to stderr). Callers exit 0 on HELP and 2
 * on USAGE. */
int kvs_args_parse(const char *usage, const kvs_arg_t *args, size_t count, int argc, char **argv,
                   int first);

/* A flag table assembled from groups (layout flags, workload flags, ...), so that no one
 * function has to hold a command's whole table. Groups keep their order: it is the --help
 * order. */
enum { KVS_ARG_TABLE_MAX = 64 };
typedef struct {
    kvs_arg_t items[KVS_ARG_TABLE_MAX];
    size_t count;
} kvs_arg_table_t;

/* Appends count flags; more than KVS_ARG_TABLE_MAX in all is a programming error and aborts. */
void kvs_arg_table_add(kvs_arg_table_t *table, const kvs_arg_t *group, size_t count);
#define KVS_ARG_TABLE_ADD(table, group)                                                            \
    kvs_arg_table_add((table), (group), sizeof(group) / sizeof((group)[0]))

/* kvs_args_parse over a table. */
int kvs_arg_table_parse(const kvs_arg_table_t *table, const char *usage, int argc, char **argv,
                        int first);

/* "a" or "a,b" of GPU ordinals: prefill on a, decode on b (or a). 0 on success. */
int kvs_args_parse_gpus(const char *s, int *prefill_p, int *decode_p);

/* Prints "usage + one line per flag" to f. */
void kvs_args_usage(void *file, const char *usage, const kvs_arg_t *args, size_t count);

#endif
