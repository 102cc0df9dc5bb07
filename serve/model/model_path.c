/* Where the embedded default model lives: the path scripts/setup.sh downloads it to, or the
 * file named by KVS_MODEL. */
#include "model/gguf.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "kvstage/log.h"

#define MODEL_FILE "SmolLM2-135M-Instruct.Q4_1.gguf"

kvs_status_t kvs_model_default_path(char *buf, size_t cap)
{
    char path[4096];
    const char *env = getenv("KVS_MODEL");
    const char *cache = getenv("KVS_CACHE_DIR");
    const char *home = getenv("HOME");
    int n;
    if (env != NULL && env[0] != 0)
        n = snprintf(path, sizeof(path), "%s", env);
    else if (cache != NULL && cache[0] != 0)
        n = snprintf(path, sizeof(path), "%s/models/%s", cache, MODEL_FILE);
    else if (home != NULL && home[0] != 0)
        n = snprintf(path, sizeof(path), "%s/.cache/kvstage/models/%s", home, MODEL_FILE);
    else {
        kvs_error("model: neither KVS_MODEL, KVS_CACHE_DIR nor HOME is set; run "
                  "scripts/setup.sh or set KVS_MODEL");
        return KVS_ERR_NOT_FOUND;
    }
    if (n < 0 || (size_t) n >= sizeof(path) || (size_t) n >= cap) {
        kvs_error("model: path of the default model does not fit in %zu bytes", cap);
        return KVS_ERR_NOSPACE;
    }
    struct stat sb;
    if (stat(path, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        kvs_error("model: %s not found: run scripts/setup.sh (or set KVS_MODEL)", path);
        return KVS_ERR_NOT_FOUND;
    }
    memcpy(buf, path, (size_t) n + 1);
    return KVS_OK;
}
