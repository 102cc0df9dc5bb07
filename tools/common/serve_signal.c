/* The stop signals of long-running commands (serve_signal.h): a handler that only sets a flag
 * and writes to a self-pipe, so the waiting thread wakes at once. */
#include "common/serve_signal.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

static volatile sig_atomic_t g_stop, g_hup;
static int g_pipe[2] = {-1, -1};

static void on_signal(int sig)
{
    int e = errno;
    if (sig == SIGHUP)
        g_hup = 1;
    else
        g_stop = 1;
    if (g_pipe[1] >= 0) {
        char c = 1;
        (void) !write(g_pipe[1], &c, 1);
    }
    errno = e;
}

void kvs_serve_signal_install(void)
{
    if (g_pipe[0] < 0 && pipe(g_pipe) == 0) {
        for (int i = 0; i < 2; i++) {
            fcntl(g_pipe[i], F_SETFL, fcntl(g_pipe[i], F_GETFL) | O_NONBLOCK);
            fcntl(g_pipe[i], F_SETFD, FD_CLOEXEC);
        }
    }
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
}

void kvs_serve_signal_install_hup(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGHUP, &sa, NULL);
}

int kvs_serve_signal_hup_take(void)
{
    if (!g_hup) return 0;
    g_hup = 0;
    return 1;
}

int kvs_serve_signal_wait(int timeout_ms)
{
    if (g_stop) return 1;
    struct pollfd pfd = {g_pipe[0], POLLIN, 0};
    if (g_pipe[0] >= 0 && poll(&pfd, 1, timeout_ms) > 0) {
        char buf[16];
        while (read(g_pipe[0], buf, sizeof(buf)) > 0) {
        }
    } else if (g_pipe[0] < 0 && timeout_ms > 0) {
        poll(NULL, 0, timeout_ms);
    }
    return g_stop != 0;
}
