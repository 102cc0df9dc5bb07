/* The flags `kvstage serve` and `kvstage router` share for their HTTP front: unknown-field
 * strictness, the API key (or KVS_API_KEY), the connection limit and the idle timeout. */
#ifndef KVSTAGE_TOOLS_HTTP_FLAGS_H
#define KVSTAGE_TOOLS_HTTP_FLAGS_H

#include <stdint.h>

#include "common/args.h"

typedef struct {
    int strict;
    const char *api_key; /* NULL: none */
    uint32_t max_connections, idle_timeout_s;
} kvs_http_flags_t;

/* The defaults, then --strict, --api-key, --max-connections and --idle-timeout-s into t. */
void kvs_http_flags_add(kvs_arg_table_t *t, kvs_http_flags_t *f);
/* After parsing: the API key from KVS_API_KEY when --api-key was not given, and every value
 * checked. 0, or 2 after a one-line usage error. */
int kvs_http_flags_check(kvs_http_flags_t *f);
/* 0, or 2 after a usage error naming flag when key is not a valid API key. */
int kvs_http_flags_check_key(const char *flag, const char *key);

#endif
