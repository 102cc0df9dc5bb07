/* Leveled logging. The level comes from KVS_LOG (error|warn|info|debug|trace, default warn);
 * an embedding engine can take over the output with kvs_log_set_sink(). */
#ifndef KVSTAGE_LOG_H
#define KVSTAGE_LOG_H

typedef enum {
    KVS_LOG_ERROR = 0,
    KVS_LOG_WARN = 1,
    KVS_LOG_INFO = 2,
    KVS_LOG_DEBUG = 3,
    KVS_LOG_TRACE = 4,
} kvs_log_level_t;

/* Receives every message at or below the current level; msg has no trailing newline. */
typedef void (*kvs_log_sink_t)(void *arg, kvs_log_level_t level, const char *file, int line,
                               const char *msg);

void kvs_log_set_level(kvs_log_level_t level);
kvs_log_level_t kvs_log_get_level(void);
/* NULL restores the default sink (stderr). */
void kvs_log_set_sink(kvs_log_sink_t sink, void *arg);
int kvs_log_enabled(kvs_log_level_t level);
void kvs_log_write(kvs_log_level_t level, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

#define kvs_log(level, ...)                                                                        \
    do {                                                                                           \
        if (kvs_log_enabled(level)) kvs_log_write(level, __FILE__, __LINE__, __VA_ARGS__);         \
    } while (0)
#define kvs_error(...) kvs_log(KVS_LOG_ERROR, __VA_ARGS__)
#define kvs_warn(...)  kvs_log(KVS_LOG_WARN, __VA_ARGS__)
#define kvs_info(...)  kvs_log(KVS_LOG_INFO, __VA_ARGS__)
#define kvs_debug(...) kvs_log(KVS_LOG_DEBUG, __VA_ARGS__)
#define kvs_trace(...) kvs_log(KVS_LOG_TRACE, __VA_ARGS__)

#endif
