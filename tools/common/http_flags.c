/* The HTTP front's flags (http_flags.h). */
#include "common/http_flags.h"

#include <stdio.h>
#include <stdlib.h>

#include "http/server.h"

#define MAX_CONNECTIONS_MAX 1000000u
#define IDLE_TIMEOUT_MAX_S  86400u

void kvs_http_flags_add(kvs_arg_table_t *t, kvs_http_flags_t *f)
{
    f->strict = 0;
    f->api_key = NULL;
    f->max_connections = 4096;
    f->idle_timeout_s = 60;
    const kvs_arg_t g[] = {
        {"strict", KVS_ARG_FLAG, &f->strict,
         "refuse unknown request fields (400); default: ignore them, named in a header", NULL,
         NULL},
        {"api-key", KVS_ARG_STR, &f->api_key,
         "require 'Authorization: Bearer KEY' but on /health, /metrics (default $KVS_API_KEY)",
         NULL, NULL},
        {"max-connections", KVS_ARG_U32, &f->max_connections,
         "client connections at once, 1..1000000 (4096)", NULL, NULL},
        {"idle-timeout-s", KVS_ARG_U32, &f->idle_timeout_s,
         "close a client connection silent this long, 1..86400 (60)", NULL, NULL},
    };
    KVS_ARG_TABLE_ADD(t, g);
}

int kvs_http_flags_check_key(const char *flag, const char *key)
{
    if (key == NULL || kvs_server_api_key_valid(key)) return 0;
    fprintf(stderr, "error: %s must be 1 to 1024 printable ASCII characters without spaces\n",
            flag);
    return 2;
}

int kvs_http_flags_check(kvs_http_flags_t *f)
{
    const char *flag = "--api-key";
    if (f->api_key == NULL) {
        const char *env = getenv("KVS_API_KEY");
        if (env != NULL && env[0] != '\0') {
            f->api_key = env;
            flag = "KVS_API_KEY";
        }
    }
    if (kvs_http_flags_check_key(flag, f->api_key) != 0) return 2;
    if (f->max_connections == 0 || f->max_connections > MAX_CONNECTIONS_MAX) {
        fprintf(stderr, "error: --max-connections must be 1..%u, not %u\n", MAX_CONNECTIONS_MAX,
                f->max_connections);
        return 2;
    }
    if (f->idle_timeout_s == 0 || f->idle_timeout_s > IDLE_TIMEOUT_MAX_S) {
        fprintf(stderr, "error: --idle-timeout-s must be 1..%u, not %u\n", IDLE_TIMEOUT_MAX_S,
                f->idle_timeout_s);
        return 2;
    }
    return 0;
}
