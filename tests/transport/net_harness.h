/* Helpers for tests that run ranks as processes over net links: children forked with a pipe
 * each way, pipe I/O that never waits past a deadline, a teardown that kills whatever a failed
 * test left running, and removal of the shared-memory files that killed UCX processes leave in
 * /dev/shm. Children are plain C (no cmocka): they report through their pipe and exit code. */
#ifndef KVSTAGE_TESTS_TRANSPORT_NET_HARNESS_H
#define KVSTAGE_TESTS_TRANSPORT_NET_HARNESS_H

#include "kvs_test.h"

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvstage/clock.h"

#define NH_MS           1000000ull
#define NH_MAX_CHILDREN 16

typedef struct {
    pid_t pid;
    int up, down; /* parent's ends: read from the child, write to the child */
} nh_child_t;

typedef int (*nh_child_fn)(int up, int down, void *arg);

/* Children of the running test (so the teardown can kill them), and the test process. */
static nh_child_t nh_children[NH_MAX_CHILDREN];
static pid_t nh_parent;

static inline void nh_sleep_us(long us)
{
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    nanosleep(&ts, NULL);
}

/* Children give up when the test process is gone. */
static inline int nh_parent_alive(void)
{
    return getppid() == nh_parent;
}

/* Reads exactly n bytes, giving up after timeout_ms (a stuck peer must not hang a test). */
static inline int nh_read_full(int fd, void *buf, size_t n, uint64_t timeout_ms)
{
    size_t got = 0;
    uint64_t end = kvs_now_ns() + timeout_ms * NH_MS;
    while (got < n) {
        uint64_t now = kvs_now_ns();
        if (now > end) return -1;
        struct pollfd p = {.fd = fd, .events = POLLIN};
        uint64_t left_ms = (end - now) / NH_MS + 1;
        int r = poll(&p, 1, left_ms > 100 ? 100 : (int) left_ms);
        if (r < 0 && errno != EINTR) return -1;
        if (r <= 0) continue;
        ssize_t k = read(fd, (char *) buf + got, n - got);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return -1;
        got += (size_t) k;
    }
    return 0;
}

static inline int nh_write_full(int fd, const void *buf, size_t n)
{
    size_t put = 0;
    while (put < n) {
        ssize_t k = write(fd, (const char *) buf + put, n - put);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return -1;
        put += (size_t) k;
    }
    return 0;
}

/* Remembers a child the test forked itself, so that the teardown kills it. */
static inline void nh_track(pid_t pid, int up, int down)
{
    for (int i = 0; i < NH_MAX_CHILDREN; i++) {
        if (nh_children[i].pid == 0) {
            nh_children[i] = (nh_child_t){.pid = pid, .up = up, .down = down};
            return;
        }
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    fail_msg("more than %d child processes", NH_MAX_CHILDREN);
}

/* Closes the parent's pipe ends of a child that is gone. */
static inline void nh_forget(pid_t pid)
{
    for (int i = 0; i < NH_MAX_CHILDREN; i++) {
        if (nh_children[i].pid != pid) continue;
        if (nh_children[i].up >= 0) close(nh_children[i].up);
        if (nh_children[i].down >= 0) close(nh_children[i].down);
        nh_children[i].pid = 0;
    }
}

/* Forks fn(up, down, arg) with a pipe each way; the child's exit code is fn's, or 90 if the
 * child's accounted allocations did not return to what it inherited. Fork before creating any
 * ZeroMQ or UCX object in the test process. */
static inline nh_child_t nh_spawn(nh_child_fn fn, void *arg)
{
    int up[2], down[2];
    assert_int_equal(pipe(up), 0);
    assert_int_equal(pipe(down), 0);
    nh_parent = getpid();
    nh_child_t c = {.pid = fork()};
    assert_true(c.pid >= 0);
    if (c.pid == 0) {
        close(up[0]);
        close(down[1]);
        kvs_alloc_stats_t before, after; /* the parent's blocks came along with fork() */
        kvs_alloc_stats(&before);
        int code = fn(up[1], down[0], arg);
        kvs_alloc_stats(&after);
        if (code == 0 && after.live_blocks != before.live_blocks) code = 90;
        _exit(code);
    }
    close(up[1]);
    close(down[0]);
    c.up = up[0];
    c.down = down[1];
    nh_track(c.pid, c.up, c.down);
    return c;
}

/* Waits (bounded) for a child's exit; returns its exit code, or 128 + signal. */
static inline int nh_reap(pid_t pid, uint64_t timeout_ms)
{
    int status = 0;
    pid_t got;
    uint64_t end = kvs_now_ns() + timeout_ms * NH_MS;
    while ((got = waitpid(pid, &status, WNOHANG)) == 0 && kvs_now_ns() < end) nh_sleep_us(1000);
    if (got == 0) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        nh_forget(pid);
        fail_msg("child %d did not exit within %llu ms", (int) pid,
                 (unsigned long long) timeout_ms);
    }
    nh_forget(pid);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

/* Teardown: kills what a failed test left running (stopped children too). A pid that is no
 * longer an unreaped child of ours is left alone (it may belong to someone else by now). */
static inline int nh_kill_children(void **state)
{
    (void) state;
    for (int i = 0; i < NH_MAX_CHILDREN; i++) {
        pid_t pid = nh_children[i].pid;
        if (pid == 0) continue;
        if (waitpid(pid, NULL, WNOHANG) == 0) {
            kill(pid, SIGKILL);
            waitpid(pid, NULL, 0);
        }
        nh_forget(pid);
    }
    return 0;
}

/* Shared-memory files UCX may leave behind when a process is killed. */
typedef struct {
    char names[64][NAME_MAX + 1];
    int n;
} nh_shm_list_t;

static inline void nh_shm_snapshot(nh_shm_list_t *s)
{
    s->n = 0;
    DIR *d = opendir("/dev/shm");
    if (d == NULL) return;
    struct dirent *e;
    while ((e = readdir(d)) != NULL && s->n < 64)
        if (strncmp(e->d_name, "ucx_shm_posix_", 14) == 0)
            snprintf(s->names[s->n++], NAME_MAX + 1, "%s", e->d_name);
    closedir(d);
}

static inline int nh_shm_open_anywhere(const char *name)
{
    DIR *proc = opendir("/proc");
    if (proc == NULL) return 1; /* cannot tell: keep it */
    struct dirent *p;
    int found = 0;
    char want[NAME_MAX + 16];
    snprintf(want, sizeof(want), "/dev/shm/%s", name);
    while (!found && (p = readdir(proc)) != NULL) {
        if (p->d_name[0] < '0' || p->d_name[0] > '9') continue;
        char fdpath[NAME_MAX + 16];
        snprintf(fdpath, sizeof(fdpath), "/proc/%s/fd", p->d_name);
        DIR *fds = opendir(fdpath);
        if (fds == NULL) continue;
        struct dirent *f;
        while (!found && (f = readdir(fds)) != NULL) {
            char link[2 * NAME_MAX + 32], target[NAME_MAX + 80];
            snprintf(link, sizeof(link), "%s/%s", fdpath, f->d_name);
            ssize_t n = readlink(link, target, sizeof(target) - 1);
            if (n <= 0) continue;
            target[n] = '\0';
            found = strncmp(target, want, strlen(want)) == 0;
        }
        closedir(fds);
    }
    closedir(proc);
    return found;
}

/* Removes UCX shared-memory files that appeared since `before` and that no process holds open:
 * what a killed process left. Files of tests running in parallel are open, so they stay. */
static inline void nh_shm_clean(const nh_shm_list_t *before)
{
    nh_shm_list_t now;
    nh_shm_snapshot(&now);
    for (int i = 0; i < now.n; i++) {
        int old = 0;
        for (int j = 0; j < before->n && !old; j++)
            old = strcmp(now.names[i], before->names[j]) == 0;
        if (old || nh_shm_open_anywhere(now.names[i])) continue;
        char path[NAME_MAX + 16];
        snprintf(path, sizeof(path), "/dev/shm/%s", now.names[i]);
        unlink(path);
    }
}

#endif
