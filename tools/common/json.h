/* A minimal streaming JSON object writer for the tool's --json output. */
#ifndef KVSTAGE_TOOLS_JSON_H
#define KVSTAGE_TOOLS_JSON_H

#include <stdint.h>
#include <stdio.h>

typedef struct {
    FILE *f;
    int depth;
    int need_comma[16];
} kvs_json_t;

void kvs_json_begin(kvs_json_t *j, FILE *f); /* opens the top-level object */
void kvs_json_end(kvs_json_t *j);            /* closes it and prints a newline */
void kvs_json_u64(kvs_json_t *j, const char *key, uint64_t v);
void kvs_json_i64(kvs_json_t *j, const char *key, int64_t v);
void kvs_json_double(kvs_json_t *j, const char *key, double v);
void kvs_json_bool(kvs_json_t *j, const char *key, int v);
void kvs_json_str(kvs_json_t *j, const char *key, const char *v);
/* Nested containers; key is NULL inside arrays. */
void kvs_json_object_begin(kvs_json_t *j, const char *key);
void kvs_json_object_end(kvs_json_t *j);
void kvs_json_array_begin(kvs_json_t *j, const char *key);
void kvs_json_array_end(kvs_json_t *j);

#endif
