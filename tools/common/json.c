/* Minimal JSON writer: keys and strings are escaped; numbers printed exactly. */
#include "common/json.h"

#include <inttypes.h>
#include <math.h>

static void put_string(FILE *f, const char *s)
{
    fputc('"', f);
    for (; *s; s++) {
        unsigned char c = (unsigned char) *s;
        if (c == '"' || c == '\\')
            fprintf(f, "\\%c", c);
        else if (c < 0x20)
            fprintf(f, "\\u%04x", c);
        else
            fputc(c, f);
    }
    fputc('"', f);
}

static void prefix(kvs_json_t *j, const char *key)
{
    if (j->need_comma[j->depth]) fputc(',', j->f);
    j->need_comma[j->depth] = 1;
    if (key != NULL) {
        put_string(j->f, key);
        fputc(':', j->f);
    }
}

static void open_container(kvs_json_t *j, const char *key, char c)
{
    prefix(j, key);
    fputc(c, j->f);
    if (j->depth < 15) j->depth++;
    j->need_comma[j->depth] = 0;
}

static void close_container(kvs_json_t *j, char c)
{
    fputc(c, j->f);
    if (j->depth > 0) j->depth--;
}

void kvs_json_begin(kvs_json_t *j, FILE *f)
{
    j->f = f;
    j->depth = 0;
    j->need_comma[0] = 0;
    fputc('{', f);
    j->depth = 1;
    j->need_comma[1] = 0;
}

void kvs_json_end(kvs_json_t *j)
{
    fputs("}\n", j->f);
    j->depth = 0;
}

void kvs_json_u64(kvs_json_t *j, const char *key, uint64_t v)
{
    prefix(j, key);
    fprintf(j->f, "%" PRIu64, v);
}

void kvs_json_i64(kvs_json_t *j, const char *key, int64_t v)
{
    prefix(j, key);
    fprintf(j->f, "%" PRId64, v);
}

void kvs_json_double(kvs_json_t *j, const char *key, double v)
{
    prefix(j, key);
    if (isfinite(v))
        fprintf(j->f, "%.6g", v);
    else
        fputs("null", j->f);
}

void kvs_json_bool(kvs_json_t *j, const char *key, int v)
{
    prefix(j, key);
    fputs(v ? "true" : "false", j->f);
}

void kvs_json_str(kvs_json_t *j, const char *key, const char *v)
{
    prefix(j, key);
    put_string(j->f, v);
}

void kvs_json_object_begin(kvs_json_t *j, const char *key)
{
    open_container(j, key, '{');
}

void kvs_json_object_end(kvs_json_t *j)
{
    close_container(j, '}');
}

void kvs_json_array_begin(kvs_json_t *j, const char *key)
{
    open_container(j, key, '[');
}

void kvs_json_array_end(kvs_json_t *j)
{
    close_container(j, ']');
}
