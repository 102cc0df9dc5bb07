/* Leveled logging with an environment-selected level and a replaceable sink. */
#include "kvstage/log.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

static int g_level = -1; /* -1: not yet read from the environment */
static kvs_log_sink_t g_sink;
static void *g_sink_arg;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static const char *const level_names[] = {"error", "warn", "info", "debug", "trace"};

static void read_env_level(void)
{
    const char *env = getenv("KVS_LOG");
    int level = KVS_LOG_WARN;
    if (env != NULL) {
        for (int i = 0; i <= KVS_LOG_TRACE; i++) {
            if (strcasecmp(env, level_names[i]) == 0) level = i;
        }
    }
    if (__atomic_load_n(&g_level, __ATOMIC_RELAXED) < 0)
        __atomic_store_n(&g_level, level, __ATOMIC_RELAXED);
}

void kvs_log_set_level(kvs_log_level_t level)
{
    pthread_once(&g_once, read_env_level);
    __atomic_store_n(&g_level, (int) level, __ATOMIC_RELAXED);
}

kvs_log_level_t kvs_log_get_level(void)
{
    pthread_once(&g_once, read_env_level);
    return (kvs_log_level_t) __atomic_load_n(&g_level, __ATOMIC_RELAXED);
}

void kvs_log_set_sink(kvs_log_sink_t sink, void *arg)
{
    g_sink_arg = arg;
    g_sink = sink;
}

int kvs_log_enabled(kvs_log_level_t level)
{
    return (int) level <= (int) kvs_log_get_level();
}

void kvs_log_write(kvs_log_level_t level, const char *file, int line, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    if (g_sink != NULL) {
        g_sink(g_sink_arg, level, file, line, msg);
        return;
    }
    const char *base = strrchr(file, '/');
    fprintf(stderr, "kvstage %s %s:%d: %s\n", level_names[level], base ? base + 1 : file, line,
            msg);
}
