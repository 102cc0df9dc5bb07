/* The listening address of `kvstage serve` and `kvstage router`, checked before anything starts:
 * an IPv4 --host and a --port that is free on it. */
#ifndef KVSTAGE_TOOLS_PORT_H
#define KVSTAGE_TOOLS_PORT_H

#include <stdint.h>

/* 0 when port (0: any free one) can be bound on host now; else the one error line ("error: port
 * P on HOST is in use", or why host or port cannot be used) and 2. The address is released at
 * once, so a later bind can still lose a race: kvs_port_explain() then says why. */
int kvs_port_check(const char *host, uint32_t port);

/* After a failed bind: kvs_port_check's line when the port is taken or the host unusable, else
 * nothing. 1 when it said something. */
int kvs_port_explain(const char *host, uint32_t port);

#endif
