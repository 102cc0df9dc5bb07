/* Checking a listening address before a server takes it (port.h). */
#include "common/port.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/args.h"

/* 0 when bindable; else the errno of the failure (EINVAL: host is not an IPv4 address). */
static int try_bind(const char *host, uint32_t port)
{
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof(sa));
    sa.sin_family = AF_INET;
    sa.sin_port = htons((uint16_t) port);
    if (inet_pton(AF_INET, host, &sa.sin_addr) != 1) return EINVAL;
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return errno;
    /* As the servers bind: a port whose old connections linger in TIME_WAIT is free. */
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    int err = bind(fd, (struct sockaddr *) &sa, sizeof(sa)) == 0 ? 0 : errno;
    close(fd);
    return err;
}

static int report(const char *host, uint32_t port, int err)
{
    if (err == EINVAL)
        return kvs_args_error("--host", "an IPv4 address such as 127.0.0.1 or 0.0.0.0",
                              "'%s' is not an IPv4 address", host);
    if (err == EADDRINUSE) {
        kvs_args_error(NULL, NULL, "port %u on %s is in use (--port 0 takes a free one)", port,
                       host);
        return 2;
    }
    if (err == EADDRNOTAVAIL)
        return kvs_args_error("--host", "an address of this machine, or 0.0.0.0",
                              "%s is not an address of this machine", host);
    if (err == EACCES)
        return kvs_args_error("--port", "a port above 1023, or 0 for a free one",
                              "binding port %u on %s is not permitted", port, host);
    return kvs_args_error("--port", NULL, "cannot bind port %u on %s: %s", port, host,
                          strerror(err));
}

int kvs_port_check(const char *host, uint32_t port)
{
    int err = try_bind(host, port);
    return err == 0 ? 0 : report(host, port, err);
}

int kvs_port_explain(const char *host, uint32_t port)
{
    int err = try_bind(host, port);
    if (err == 0 || (port == 0 && err != EINVAL && err != EADDRNOTAVAIL)) return 0;
    report(host, port, err);
    return 1;
}
