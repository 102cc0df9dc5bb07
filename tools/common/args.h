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

/* Prints "usage + one line per flag" to f. */
/* "a" or "a,b" of GPU ordinals: prefill on a, decode on b (or a). 0 on success. */
int kvs_args_parse_gpus(const char *s, int *prefill_p, int *decode_p);

void kvs_args_usage(void *file, const char *usage, const kvs_arg_t *args, size_t count);

#endif
