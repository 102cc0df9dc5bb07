/* The HTTP front's flags (http_flags.h). */
#include "common/http_flags.h"

#include <stdlib.h>

#include "http/server.h"

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
        {"max-connections", KVS_ARG_U32, &f->max_connections, "client connections at once (4096)",
         "[1,1000000]", NULL},
        {"idle-timeout-s", KVS_ARG_U32, &f->idle_timeout_s,
         "close a client connection silent this long (60)", "[1,86400]", NULL},
    };
    KVS_ARG_TABLE_ADD(t, g);
}

int kvs_http_flags_check_key(const char *flag, const char *key)
{
    if (key == NULL || kvs_server_api_key_valid(key)) return 0;
    return kvs_args_error(flag, "1 to 1024 printable ASCII characters without spaces",
                          "not a usable key");
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
    /* The ranges are the flag table's. */
    return kvs_http_flags_check_key(flag, f->api_key);
}
