/* Starting this very `kvstage` binary again as a child process, with its stdin and stdout on
 * pipes to the caller or not: how the demo, `generate` and the engine benchmark launch ranks
 * and deployments. */
#ifndef KVSTAGE_TOOLS_SPAWN_H
#define KVSTAGE_TOOLS_SPAWN_H

#include <stddef.h>
#include <sys/types.h>

/* What the child's stdin or stdout is. */
typedef enum {
    KVS_SPAWN_INHERIT = 0, /* the caller's own */
    KVS_SPAWN_PIPE = 1,    /* a pipe whose other end the caller gets */
    KVS_SPAWN_DEVNULL = 2, /* /dev/null */
} kvs_spawn_io_t;

typedef struct {
    pid_t pid;
    int in_fd;  /* write end of the child's stdin with KVS_SPAWN_PIPE, else -1 */
    int out_fd; /* read end of the child's stdout with KVS_SPAWN_PIPE, else -1 */
} kvs_spawned_t;

/* Runs /proc/self/exe with argv (argv[0] first, NULL-terminated). The caller's ends of the
 * pipes are close-on-exec, so a later child never holds an earlier child's pipe open (a child
 * reading its stdin sees EOF once the caller closes in_fd). stdout is flushed first. When exec
 * fails the child writes "<who>: cannot run kvstage: <why>" on stderr and exits with 127.
 * Returns 0, or -1 with errno set and nothing left open when no child could be started. */
int kvs_spawn_self(const char *who, char *const argv[], kvs_spawn_io_t in, kvs_spawn_io_t out,
                   kvs_spawned_t *child_p);
/* As kvs_spawn_self, the child leading a process group of its own (its pgid is its pid), so
 * that kill(-pid, sig) reaches it and every process it starts, and a terminal's signals to the
 * caller's group do not. */
int kvs_spawn_self_group(const char *who, char *const argv[], kvs_spawn_io_t in, kvs_spawn_io_t out,
                         kvs_spawned_t *child_p);

/* Reads what a child's pipe has into buf (cap bytes, *len of them holding the start of a line,
 * NUL-terminated) and calls on_line for every whole line, without its newline; a line longer
 * than the buffer is dropped. 0: the pipe is at its end or failed (close it); 1: go on (an
 * interrupted read included). */
int kvs_read_lines(int fd, char *buf, size_t cap, size_t *len,
                   void (*on_line)(void *arg, char *line), void *arg);

#endif
