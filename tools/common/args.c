/* Flag parsing for the kvstage tool: the flag table, declared ranges and the one-line usage
 * errors. */
#include "common/args.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvstage/log.h"

/* ---- declared intervals ---- */

typedef struct {
    double lo, hi; /* doubles; the integer bounds below for U32 and U64 */
    uint64_t ulo, uhi;
    int lo_open, hi_open;
} interval_t;

static uint64_t type_max(kvs_arg_type_t type)
{
    return type == KVS_ARG_U32 ? UINT32_MAX : UINT64_MAX;
}

/* "[lo,hi]" / "(lo,hi]" / ... into *iv; 0, or -1 when malformed. */
static int interval_parse(const char *spec, kvs_arg_type_t type, interval_t *iv)
{
    memset(iv, 0, sizeof(*iv));
    if (spec[0] != '[' && spec[0] != '(') return -1;
    iv->lo_open = spec[0] == '(';
    const char *p = spec + 1;
    char *end;
    errno = 0;
    if (type == KVS_ARG_DOUBLE) {
        iv->lo = strtod(p, &end);
        if (end == p || *end != ',') return -1;
        p = end + 1;
        iv->hi = strtod(p, &end);
    } else {
        iv->ulo = strtoull(p, &end, 10);
        if (end == p || *end != ',' || *p == '-') return -1;
        p = end + 1;
        iv->uhi = strtoull(p, &end, 10);
        if (*p == '-' || iv->uhi > type_max(type) || iv->ulo > iv->uhi) return -1;
    }
    if (end == p || errno != 0 || (*end != ']' && *end != ')') || end[1] != '\0') return -1;
    iv->hi_open = *end == ')';
    return 0;
}

/* The interval of a numeric flag; aborts on a malformed declaration. */
static interval_t flag_interval(const kvs_arg_t *a)
{
    interval_t iv = {.lo = -HUGE_VAL, .hi = HUGE_VAL, .ulo = 0, .uhi = type_max(a->type)};
    if (a->accepted != NULL && interval_parse(a->accepted, a->type, &iv) != 0) {
        fprintf(stderr, "kvstage: flag --%s declares a malformed range '%s'\n", a->name,
                a->accepted);
        abort();
    }
    return iv;
}

/* What a flag accepts, for its error lines: its declaration or the type's range. */
static const char *accepted_text(const kvs_arg_t *a, char *buf, size_t cap)
{
    switch (a->type) {
    case KVS_ARG_U32:
    case KVS_ARG_U64:
        if (a->accepted) return a->accepted;
        snprintf(buf, cap, "[0,%llu]", (unsigned long long) type_max(a->type));
        return buf;
    case KVS_ARG_DOUBLE:
        return a->accepted ? a->accepted : "a finite number";
    case KVS_ARG_STR:
        return a->accepted;
    case KVS_ARG_ONOFF:
        return "on|off";
    case KVS_ARG_CHOICE:
        return a->accepted;
    case KVS_ARG_FLAG:
        return "no value";
    }
    return NULL;
}

int kvs_args_error(const char *flag, const char *accepted, const char *why_fmt, ...)
{
    char why[768];
    va_list ap;
    va_start(ap, why_fmt);
    vsnprintf(why, sizeof(why), why_fmt, ap);
    va_end(ap);
    /* One line whatever the parts hold. */
    for (char *p = why; *p; p++)
        if (*p == '\n') *p = ' ';
    fprintf(stderr, "error: %s%s%s%s%s\n", flag ? flag : "", flag ? ": " : "", why,
            accepted ? "; accepted: " : "", accepted ? accepted : "");
    return KVS_ARGS_USAGE;
}

/* ---- values ---- */

/* Why value is not a number of a's type in its range, or NULL (and the value stored). */
static const char *set_number(const kvs_arg_t *a, const char *value)
{
    const interval_t iv = flag_interval(a);
    if (*value == '\0') return "is empty";
    char *end;
    errno = 0;
    if (a->type == KVS_ARG_DOUBLE) {
        double d = strtod(value, &end);
        if (end == value) return "is not a number";
        if (*end != '\0') return "has trailing characters";
        if (!isfinite(d)) return "is not a finite number";
        if (errno == ERANGE) return "is out of range";
        if (d < iv.lo || (iv.lo_open && d == iv.lo) || d > iv.hi || (iv.hi_open && d == iv.hi))
            return "is out of range";
        *(double *) a->dst = d;
        return NULL;
    }
    const char *digits = value;
    if (*digits == '+') digits++;
    if (*digits == '-') return "is negative";
    int base = 10;
    if (digits[0] == '0' && (digits[1] == 'x' || digits[1] == 'X')) {
        base = 16;
        digits += 2;
    }
    if (!(base == 16 ? isxdigit((unsigned char) *digits) : isdigit((unsigned char) *digits)))
        return "is not a whole number";
    unsigned long long v = strtoull(digits, &end, base);
    if (end == digits) return "is not a whole number";
    if (*end != '\0')
        return *end == '.' || *end == 'e' ? "is not a whole number" : "has trailing characters";
    if (errno == ERANGE || v > type_max(a->type)) return "overflows";
    if (v < iv.ulo || (iv.lo_open && v == iv.ulo) || v > iv.uhi || (iv.hi_open && v == iv.uhi))
        return "is out of range";
    if (a->type == KVS_ARG_U32)
        *(uint32_t *) a->dst = (uint32_t) v;
    else
        *(uint64_t *) a->dst = v;
    return NULL;
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

/* Stores value; NULL, or why it is not accepted. */
static const char *set_value(const kvs_arg_t *a, const char *value)
{
    switch (a->type) {
    case KVS_ARG_U32:
    case KVS_ARG_U64:
    case KVS_ARG_DOUBLE:
        return set_number(a, value);
    case KVS_ARG_STR:
        if (*value == '\0') return "is empty";
        *(const char **) a->dst = value;
        return NULL;
    case KVS_ARG_ONOFF:
        if (strcmp(value, "on") == 0)
            *(int *) a->dst = 1;
        else if (strcmp(value, "off") == 0)
            *(int *) a->dst = 0;
        else
            return "is neither on nor off";
        return NULL;
    case KVS_ARG_CHOICE: {
        int idx = choice_index(a->accepted, value);
        if (idx < 0) return "is not one of the choices";
        *(int *) a->dst = idx;
        return NULL;
    }
    case KVS_ARG_FLAG:
        break;
    }
    return "takes no value";
}

/* ---- the table ---- */

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
                 args[i].type == KVS_ARG_CHOICE ? args[i].accepted : "");
        const int ranged = (args[i].type == KVS_ARG_U32 || args[i].type == KVS_ARG_U64 ||
                            args[i].type == KVS_ARG_DOUBLE) &&
                           args[i].accepted != NULL;
        fprintf(f, "  %-36s %s%s%s\n", left, args[i].help, ranged ? "; in " : "",
                ranged ? args[i].accepted : "");
    }
    fprintf(f, "  %-36s %s\n", "--help", "show this help");
}

/* The command of a usage text, its words up to the first that is not a name ("kvstage bench
 * radix [flags]" -> "kvstage bench radix"), for the hint of an unknown flag. */
static void command_of(const char *usage, char *buf, size_t cap)
{
    size_t n = 0;
    for (const char *p = usage; *p && *p != '\n';) {
        if (*p == '-' || *p == '[' || *p == '<' || *p == '(') break;
        const char *sp = strchr(p, ' ');
        size_t len = sp ? (size_t) (sp - p) : strcspn(p, "\n");
        if (n + len + 2 > cap) break;
        if (n) buf[n++] = ' ';
        memcpy(buf + n, p, len);
        n += len;
        if (!sp) break;
        p = sp + 1;
    }
    buf[n] = '\0';
}

int kvs_args_parse(const char *usage, const kvs_arg_t *args, size_t count, int argc, char **argv,
                   int first)
{
    for (size_t j = 0; j < count; j++)
        if (args[j].type == KVS_ARG_U32 || args[j].type == KVS_ARG_U64 ||
            args[j].type == KVS_ARG_DOUBLE)
            (void) flag_interval(&args[j]); /* aborts on a malformed declaration */
    char cmd[128], hint[192];
    command_of(usage, cmd, sizeof(cmd));
    snprintf(hint, sizeof(hint), "the flags `%s --help` lists", cmd);
    for (int i = first; i < argc; i++) {
        const char *arg = argv[i];
        if (strcmp(arg, "--help") == 0 || strcmp(arg, "-h") == 0) {
            kvs_args_usage(stdout, usage, args, count);
            return KVS_ARGS_HELP;
        }
        if (strncmp(arg, "--", 2) != 0 || arg[2] == '\0')
            return kvs_args_error(NULL, hint, "unexpected argument '%s'", arg);
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
        char flag[80], acc[64];
        snprintf(flag, sizeof(flag), "--%.*s", (int) (nlen < 64 ? nlen : 64), name);
        if (a == NULL) return kvs_args_error(flag, hint, "unknown flag");
        const char *accepted = accepted_text(a, acc, sizeof(acc));
        if (a->type == KVS_ARG_FLAG) {
            if (eq) return kvs_args_error(flag, NULL, "takes no value");
            *(int *) a->dst = 1;
        } else {
            const char *value = eq ? eq + 1 : NULL;
            if (value == NULL) {
                if (i + 1 >= argc) return kvs_args_error(flag, accepted, "needs a value");
                value = argv[++i];
            }
            const char *why = set_value(a, value);
            if (why != NULL) return kvs_args_error(flag, accepted, "'%s' %s", value, why);
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
        errno = 0;
        v[n++] = strtol(p, &end, 10);
        if (errno != 0 || v[n - 1] > 1024) return -1;
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

/* ---- library messages folded into the error line ---- */

static void capture_sink(void *arg, kvs_log_level_t level, const char *file, int line,
                         const char *msg)
{
    kvs_args_capture_t *c = arg;
    if (level == KVS_LOG_ERROR && c->msg[0] == '\0') {
        snprintf(c->msg, sizeof(c->msg), "%s", msg);
        return;
    }
    static const char *const names[] = {"error", "warn", "info", "debug", "trace"};
    const char *base = strrchr(file, '/');
    fprintf(stderr, "kvstage %s %s:%d: %s\n", names[level], base ? base + 1 : file, line, msg);
}

void kvs_args_capture_begin(kvs_args_capture_t *c)
{
    c->msg[0] = '\0';
    kvs_log_set_sink(capture_sink, c);
}

void kvs_args_capture_end(kvs_args_capture_t *c, int used)
{
    kvs_log_set_sink(NULL, NULL);
    if (!used && c->msg[0] != '\0') fprintf(stderr, "kvstage error: %s\n", c->msg);
}

static void quiet_sink(void *arg, kvs_log_level_t level, const char *file, int line,
                       const char *msg)
{
}

const char *kvs_args_tp_sizes(const kvs_kv_shape_t *shape, char *buf, size_t cap)
{
    size_t n = 0;
    buf[0] = '\0';
    kvs_log_set_sink(quiet_sink, NULL);
    for (uint32_t tp = 1; tp <= KVS_MAX_TP && n < cap; tp++)
        if (kvs_tp_validate(shape, &(kvs_tp_t){.tp_size = tp}) == KVS_OK)
            n += (size_t) snprintf(buf + n, cap - n, "%s%u", n ? ", " : "", tp);
    kvs_log_set_sink(NULL, NULL);
    if (n < cap && shape->attn == KVS_ATTN_MHA)
        snprintf(buf + n, cap - n,
                 " (a TP size must divide the %u KV heads or be a multiple of them)",
                 shape->kv_heads);
    else if (n < cap)
        snprintf(buf + n, cap - n, " (MLA: every rank holds the whole latent)");
    return buf;
}

uint32_t kvs_args_dtype_bytes(int index)
{
    return 1u << index;
}

void kvs_args_page_rows(kvs_args_pages_t *pages, kvs_arg_t *rows_p)
{
    rows_p[0] = (kvs_arg_t){"page-size",   KVS_ARG_U32,
                            &pages->both,  "tokens per KV page on both sides (16)",
                            "[1,1048576]", &pages->seen_both};
    rows_p[1] = (kvs_arg_t){"prefill-page-size",
                            KVS_ARG_U32,
                            &pages->prefill,
                            "tokens per prefill page (--page-size); prefill pages are gathered "
                            "at any offset",
                            "[1,1048576]",
                            &pages->seen_prefill};
    rows_p[2] = (kvs_arg_t){
        "decode-page-size", KVS_ARG_U32,
        &pages->decode,     "tokens per decode page (--page-size); the grid is aligned to it",
        "[1,1048576]",      &pages->seen_decode};
}

int kvs_args_page_sizes(const kvs_args_pages_t *pages, uint32_t *decode_p, uint32_t *prefill_p)
{
    if (pages->seen_both && (pages->seen_prefill || pages->seen_decode))
        return kvs_args_error("--page-size",
                              "--page-size, or --prefill-page-size and --decode-page-size",
                              "sets both sides: it excludes --prefill-page-size and "
                              "--decode-page-size");
    if (pages->seen_both) {
        *decode_p = pages->both;
        *prefill_p = 0;
    }
    if (pages->seen_decode) *decode_p = pages->decode;
    if (pages->seen_prefill) *prefill_p = pages->prefill;
    if (*prefill_p == *decode_p) *prefill_p = 0;
    return 0;
}

void kvs_args_dcp_rows(uint32_t *dcp, uint32_t *interleave, kvs_arg_t *rows_p)
{
    rows_p[0] = (kvs_arg_t){"decode-dcp",
                            KVS_ARG_U32,
                            dcp,
                            "decode context parallelism: groups of N decode ranks holding the "
                            "same heads, token t on rank (t / interleave) mod N of its group (1)",
                            "[1,64]",
                            NULL};
    rows_p[1] = (kvs_arg_t){
        "dcp-interleave", KVS_ARG_U32,
        interleave,       "consecutive tokens per DCP rank; divides the decode page (1)",
        "[1,1048576]",    NULL};
}

int kvs_args_check_layout(const kvs_pd_geometry_t *geo)
{
    /* The geometry checks stages, then the DCP size, then the interleave, then the chunk: each
     * step below switches on one more of them (a chunk of one unit always passes). */
    static const struct {
        const char *flag, *accepted;
    } steps[] = {
        {"--prefill-pp", "at most one stage per layer and at most 64 prefill ranks (PP x TP)"},
        {"--decode-dcp", "a divisor of the decode ranks that hold each KV head, max(1, decode "
                         "TP / KV heads)"},
        {"--dcp-interleave", "a divisor of the decode page size"},
        {"--chunk", "a positive multiple of the decode page size (times --decode-dcp)"},
    };
    for (size_t i = 0; i < sizeof(steps) / sizeof(steps[0]); i++) {
        kvs_pd_geometry_t g = *geo;
        if (i < 1) g.decode_dcp = 0;
        if (i < 2) g.dcp_interleave = 0;
        if (i < 3) g.chunk_tokens = kvs_pd_geometry_unit(&g);
        kvs_args_capture_t cap;
        kvs_args_capture_begin(&cap);
        kvs_status_t st = kvs_pd_geometry_validate(&g);
        kvs_args_capture_end(&cap, st != KVS_OK);
        if (st != KVS_OK) return kvs_args_error(steps[i].flag, steps[i].accepted, "%s", cap.msg);
    }
    return 0;
}
