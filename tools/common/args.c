/* Flag parsing for the kvstage tool. */
#include "common/args.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void kvs_args_usage(void *file, const char *usage, const kvs_arg_t *args, size_t count)
{
    FILE *f = file;
    fprintf(f, "usage: %s\n", usage);
    for (size_t i = 0; i < count; i++) {
        const char *val = "";
        switch (args[i].type) {
        case KVS_ARG_U32:
        case KVS_ARG_U64:
            val = " N";
            break;
        case KVS_ARG_DOUBLE:
            val = " X";
            break;
        case KVS_ARG_STR:
            val = " S";
            break;
        case KVS_ARG_ONOFF:
            val = " on|off";
            break;
        case KVS_ARG_CHOICE:
            val = " ";
            break;
        case KVS_ARG_FLAG:
            break;
        }
        char left[96];
        snprintf(left, sizeof(left), "--%s%s%s", args[i].name, val,
                 args[i].type == KVS_ARG_CHOICE ? args[i].choices : "");
        fprintf(f, "  %-36s %s\n", left, args[i].help);
    }
    fprintf(f, "  %-36s %s\n", "--help", "show this help");
}

static int parse_u64(const char *s, uint64_t max, uint64_t *out)
{
    if (*s == '\0' || *s == '-') return -1;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 0);
    if (errno != 0 || *end != '\0' || v > max) return -1;
    *out = v;
    return 0;
}

static int choice_index(const char *choices, const char *value)
{
    size_t vlen = strlen(value);
    int idx = 0;
    const char *p = choices;
    while (*p) {
        const char *bar = strchr(p, '|');
        size_t len = bar ? (size_t) (bar - p) : strlen(p);
        if (len == vlen && strncmp(p, value, len) == 0) return idx;
        idx++;
        if (!bar) break;
        p = bar + 1;
    }
    return -1;
}

static int set_value(const kvs_arg_t *a, const char *value)
{
    uint64_t u;
    switch (a->type) {
    case KVS_ARG_U32:
        if (parse_u64(value, UINT32_MAX, &u) != 0) return -1;
        *(uint32_t *) a->dst = (uint32_t) u;
        return 0;
    case KVS_ARG_U64:
        if (parse_u64(value, UINT64_MAX, &u) != 0) return -1;
        *(uint64_t *) a->dst = u;
        return 0;
    case KVS_ARG_DOUBLE: {
        char *end;
        errno = 0;
        double d = strtod(value, &end);
        if (errno != 0 || *value == '\0' || *end != '\0') return -1;
        *(double *) a->dst = d;
        return 0;
    }
    case KVS_ARG_STR:
        *(const char **) a->dst = value;
        return 0;
    case KVS_ARG_ONOFF:
        if (strcmp(value, "on") == 0)
            *(int *) a->dst = 1;
        else if (strcmp(value, "off") == 0)
            *(int *) a->dst = 0;
        else
            return -1;
        return 0;
    case KVS_ARG_CHOICE: {
        int idx = choice_index(a->choices, value);
        if (idx < 0) return -1;
        *(int *) a->dst = idx;
        return 0;
    }
    case KVS_ARG_FLAG:
        return -1;
    }
    return -1;
}

int kvs_args_parse(const char *usage, const kvs_arg_t *args, size_t count, int argc, char **argv,
                   int first)
{
    for (int i = first; i < argc; i++) {
        const char *arg = argv[i];
        if (strcmp(arg, "--help") == 0 || strcmp(arg, "-h") == 0) {
            kvs_args_usage(stdout, usage, args, count);
            return KVS_ARGS_HELP;
        }
        if (strncmp(arg, "--", 2) != 0) {
            fprintf(stderr, "error: unexpected argument '%s'\n", arg);
            kvs_args_usage(stderr, usage, args, count);
            return KVS_ARGS_USAGE;
        }
        const char *name = arg + 2;
        const char *eq = strchr(name, '=');
        size_t nlen = eq ? (size_t) (eq - name) : strlen(name);
        const kvs_arg_t *a = NULL;
        for (size_t j = 0; j < count; j++) {
            if (strlen(args[j].name) == nlen && strncmp(args[j].name, name, nlen) == 0) {
                a = &args[j];
                break;
            }
        }
        if (a == NULL) {
            fprintf(stderr, "error: unknown flag '--%.*s'\n", (int) nlen, name);
            kvs_args_usage(stderr, usage, args, count);
            return KVS_ARGS_USAGE;
        }
        if (a->type == KVS_ARG_FLAG) {
            if (eq) {
                fprintf(stderr, "error: flag '--%s' takes no value\n", a->name);
                return KVS_ARGS_USAGE;
            }
            *(int *) a->dst = 1;
        } else {
            const char *value = eq ? eq + 1 : NULL;
            if (value == NULL) {
                if (i + 1 >= argc) {
                    fprintf(stderr, "error: flag '--%s' needs a value\n", a->name);
                    kvs_args_usage(stderr, usage, args, count);
                    return KVS_ARGS_USAGE;
                }
                value = argv[++i];
            }
            if (set_value(a, value) != 0) {
                if (a->type == KVS_ARG_CHOICE)
                    fprintf(stderr, "error: bad value '%s' for '--%s' (expected %s)\n", value,
                            a->name, a->choices);
                else
                    fprintf(stderr, "error: bad value '%s' for '--%s'\n", value, a->name);
                return KVS_ARGS_USAGE;
            }
        }
        if (a->seen) *a->seen = 1;
    }
    return KVS_ARGS_OK;
}

/* "a" or "a,b" of GPU ordinals: prefill on a, decode on b (or a). 0 on success. */
int kvs_args_parse_gpus(const char *s, int *prefill_p, int *decode_p)
{
    long v[2];
    int n = 0;
    for (const char *p = s;;) {
        char *end;
        if (n == 2 || *p < '0' || *p > '9') return -1;
        v[n++] = strtol(p, &end, 10);
        if (v[n - 1] > 1024) return -1;
        if (*end == '\0') break;
        if (*end != ',') return -1;
        p = end + 1;
    }
    *prefill_p = (int) v[0];
    *decode_p = (int) v[n - 1];
    return 0;
}

void kvs_arg_table_add(kvs_arg_table_t *t, const kvs_arg_t *group, size_t count)
{
    if (count > KVS_ARG_TABLE_MAX - t->count) {
        fprintf(stderr, "kvstage: flag table full (%zu + %zu flags)\n", t->count, count);
        abort();
    }
    memcpy(&t->items[t->count], group, count * sizeof(*group));
    t->count += count;
}

int kvs_arg_table_parse(const kvs_arg_table_t *t, const char *usage, int argc, char **argv,
                        int first)
{
    return kvs_args_parse(usage, t->items, t->count, argc, argv, first);
}
