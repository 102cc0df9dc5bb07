/* kvs_spawn_self(): fork, wire the child's stdin and stdout, exec /proc/self/exe. */
#include "common/spawn.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static void close_pipe(int fds[2])
{
    int e = errno;
    for (int i = 0; i < 2; i++)
        if (fds[i] >= 0) close(fds[i]);
    fds[0] = fds[1] = -1;
    errno = e;
}

/* Both ends close-on-exec: only what the child dup2()s onto 0 or 1 reaches the program. */
static int open_pipe(kvs_spawn_io_t io, int fds[2])
{
    fds[0] = fds[1] = -1;
    if (io != KVS_SPAWN_PIPE) return 0;
    if (pipe(fds) != 0) {
        fds[0] = fds[1] = -1;
        return -1;
    }
    if (fcntl(fds[0], F_SETFD, FD_CLOEXEC) != 0 || fcntl(fds[1], F_SETFD, FD_CLOEXEC) != 0) {
        close_pipe(fds);
        return -1;
    }
    return 0;
}

/* In the child: makes `target` the pipe end or /dev/null. A source that is itself 0, 1 or 2
 * (the parent had closed its own) is moved above 2 first: dup2 onto itself would keep it
 * close-on-exec. */
static int wire(kvs_spawn_io_t io, int pipe_end, int target, int null_flags)
{
    if (io == KVS_SPAWN_INHERIT) return 0;
    int fd = io == KVS_SPAWN_PIPE ? pipe_end : open("/dev/null", null_flags | O_CLOEXEC);
    if (fd >= 0 && fd <= 2) fd = fcntl(fd, F_DUPFD_CLOEXEC, 3);
    return fd < 0 || dup2(fd, target) < 0 ? -1 : 0;
}

static int spawn(const char *who, char *const argv[], kvs_spawn_io_t in, kvs_spawn_io_t out,
                 int group, kvs_spawned_t *child_p)
{
    int ip[2], op[2]; /* [read end, write end] */
    if (open_pipe(in, ip) != 0) return -1;
    if (open_pipe(out, op) != 0) {
        close_pipe(ip);
        return -1;
    }
    /* What the caller printed comes out before anything a child writes to an inherited
     * stdout. */
    fflush(stdout);
    pid_t pid = fork();
    /* Both sides set the group, so it is set before either goes on. */
    if (pid > 0 && group) (void) setpgid(pid, pid);
    if (pid == 0) {
        if (group) (void) setpgid(0, 0);
        /* Both pipe ends above 2 before any dup2: wiring stdin must not close stdout's source. */
        if (ip[0] >= 0 && ip[0] <= 2) ip[0] = fcntl(ip[0], F_DUPFD_CLOEXEC, 3);
        if (op[1] >= 0 && op[1] <= 2) op[1] = fcntl(op[1], F_DUPFD_CLOEXEC, 3);
        if (wire(in, ip[0], STDIN_FILENO, O_RDONLY) == 0 &&
            wire(out, op[1], STDOUT_FILENO, O_WRONLY) == 0)
            execv("/proc/self/exe", argv);
        fprintf(stderr, "%s: cannot run kvstage: %s\n", who, strerror(errno));
        _exit(127);
    }
    int e = errno;
    if (ip[0] >= 0) close(ip[0]);
    if (op[1] >= 0) close(op[1]);
    ip[0] = op[1] = -1;
    if (pid < 0) {
        close_pipe(ip);
        close_pipe(op);
        errno = e;
        return -1;
    }
    *child_p = (kvs_spawned_t){.pid = pid, .in_fd = ip[1], .out_fd = op[0]};
    return 0;
}

int kvs_spawn_self(const char *who, char *const argv[], kvs_spawn_io_t in, kvs_spawn_io_t out,
                   kvs_spawned_t *child_p)
{
    return spawn(who, argv, in, out, 0, child_p);
}

int kvs_spawn_self_group(const char *who, char *const argv[], kvs_spawn_io_t in, kvs_spawn_io_t out,
                         kvs_spawned_t *child_p)
{
    return spawn(who, argv, in, out, 1, child_p);
}

int kvs_read_lines(int fd, char *buf, size_t cap, size_t *len,
                   void (*on_line)(void *arg, char *line), void *arg)
{
    ssize_t n = read(fd, buf + *len, cap - 1 - *len);
    if (n < 0 && errno == EINTR) return 1;
    if (n <= 0) return 0;
    *len += (size_t) n;
    buf[*len] = '\0';
    char *nl;
    while ((nl = strchr(buf, '\n')) != NULL) {
        *nl = '\0';
        on_line(arg, buf);
        size_t used = (size_t) (nl - buf) + 1;
        memmove(buf, nl + 1, *len - used + 1);
        *len -= used;
    }
    if (*len == cap - 1) *len = 0; /* an overlong line: drop it */
    return 1;
}
