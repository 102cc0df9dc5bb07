/* Table-driven flag parsing shared by every `kvstage` subcommand: `--name value`,
 * `--name=value` and boolean `--name`. Each flag declares what it accepts (a range, a choice
 * list); a bad value, an unknown flag or a missing value is one line on stderr,
 * "error: --flag: why; accepted: what", and the command exits 2 before it starts anything.
 * Checks that span flags or need the model print the same line through kvs_args_error(). */
#ifndef KVSTAGE_TOOLS_ARGS_H
#define KVSTAGE_TOOLS_ARGS_H

#include <stddef.h>
#include <stdint.h>

#include "kvstage/layout.h"

/* A macro's value as a string literal, for ranges built from limits: "[1," KVS_ARGS_STR(N) "]". */
#define KVS_ARGS_STR_(x) #x
#define KVS_ARGS_STR(x)  KVS_ARGS_STR_(x)
#define KVS_ARGS_TP      "[1," KVS_ARGS_STR(KVS_MAX_TP) "]"

typedef enum {
    KVS_ARG_U32,    /* uint32_t *dst */
    KVS_ARG_U64,    /* uint64_t *dst */
    KVS_ARG_DOUBLE, /* double *dst */
    KVS_ARG_STR,    /* const char **dst (points into argv) */
    KVS_ARG_FLAG,   /* int *dst set to 1; takes no value */
    KVS_ARG_ONOFF,  /* int *dst: on -> 1, off -> 0 */
    KVS_ARG_CHOICE, /* int *dst: index of the value in accepted ("a|b|c") */
} kvs_arg_type_t;

typedef struct {
    const char *name; /* without the leading dashes */
    kvs_arg_type_t type;
    void *dst;
    const char *help;
    /* KVS_ARG_CHOICE: the values, "a|b|c". KVS_ARG_U32, _U64, _DOUBLE: the accepted interval,
     * "[lo,hi]" with "(" or ")" for an open end (so "[1,64]", "(0,1]"); NULL accepts the
     * type's whole range (and any finite double). STR: a description of the form, shown in
     * errors only (NULL: any text). A malformed interval is a programming error: the parser
     * aborts on it whatever the command line, so every command's --help finds it. */
    const char *accepted;
    int *seen; /* optional: set to 1 when the flag was given */
} kvs_arg_t;

enum { KVS_ARGS_OK = 0, KVS_ARGS_HELP = 1, KVS_ARGS_USAGE = 2 };

/* Parses argv[first..argc). Returns KVS_ARGS_OK, KVS_ARGS_HELP (usage printed to stdout for
 * --help) or KVS_ARGS_USAGE (one error line printed to stderr). Callers exit 0 on HELP and 2
 * on USAGE. usage starts with the command ("kvstage plan [flags]"): errors point at its
 * --help. */
int kvs_args_parse(const char *usage, const kvs_arg_t *args, size_t count, int argc, char **argv,
                   int first);

/* The one usage-error line: "error: FLAG: WHY; accepted: ACCEPTED" (flag NULL: no "FLAG: ";
 * accepted NULL: no "; accepted"). flag is written as on the command line ("--tp"). Returns
 * KVS_ARGS_USAGE (2), the exit code. */
int kvs_args_error(const char *flag, const char *accepted, const char *why_fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Holds the first error the library logs while a check runs, so that the tool can fold it
 * into its one error line instead of a second line above it; every other message goes to
 * stderr as usual. */
typedef struct {
    char msg[512]; /* "" when nothing was logged */
} kvs_args_capture_t;
void kvs_args_capture_begin(kvs_args_capture_t *capture);
/* Restores the default log sink. Unless used, a held message is printed after all. */
void kvs_args_capture_end(kvs_args_capture_t *capture, int used);

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

/* "a" or "a,b" of GPU ordinals (0..1024): prefill on a, decode on b (or a). 0 on success. */
int kvs_args_parse_gpus(const char *s, int *prefill_p, int *decode_p);
#define KVS_ARGS_GPUS_ACCEPTED "one or two GPU ordinals in [0,1024], e.g. 0 or 0,1"

/* An element size as a KVS_ARG_CHOICE: the index into KVS_ARGS_DTYPES, and its bytes. */
#define KVS_ARGS_DTYPES "1|2|4"
uint32_t kvs_args_dtype_bytes(int index);

/* The TP sizes (1..KVS_MAX_TP) that shape's heads allow, "1, 2, 4, 8", with the rule, into buf
 * for the accepted part of an error; call it outside a capture (it silences the log). */
const char *kvs_args_tp_sizes(const kvs_kv_shape_t *shape, char *buf, size_t cap);

/* The page-size flags of every command that takes a deployment: --page-size sets both sides'
 * and excludes --prefill-page-size and --decode-page-size, which set one side each. */
typedef struct {
    uint32_t both, prefill, decode; /* the flags' values */
    int seen_both, seen_prefill, seen_decode;
} kvs_args_pages_t;
/* The three flag rows into rows_p[3], over *pages (which must outlive the parse). */
void kvs_args_page_rows(kvs_args_pages_t *pages, kvs_arg_t *rows_p);
/* After the parse: the decode page size (the grid's) and the prefill one (0: the same), from
 * the flags given over the defaults already in *decode_p and *prefill_p. 0, or 2 after the one
 * error line. */
int kvs_args_page_sizes(const kvs_args_pages_t *pages, uint32_t *decode_p, uint32_t *prefill_p);

/* The decode context parallel flags of every command that takes a deployment, --decode-dcp
 * over *dcp and --dcp-interleave over *interleave, into rows_p[2]. */
void kvs_args_dcp_rows(uint32_t *dcp, uint32_t *interleave, kvs_arg_t *rows_p);

/* The layout checks past the TP sizes (callers check those first), each naming its flag:
 * --prefill-pp against the layers and the prefill rank limit, --decode-dcp against the decode
 * ranks holding each head, --dcp-interleave against the decode page, then --chunk against
 * DCP x the decode page. 0, or 2 after the one error line. */
int kvs_args_check_layout(const kvs_pd_geometry_t *geo);

/* Prints "usage + one line per flag" to f. */
void kvs_args_usage(void *file, const char *usage, const kvs_arg_t *args, size_t count);

#endif
