/* SIGINT and SIGTERM as a flag a long-running command polls (serve, router, serve-demo), and
 * SIGPIPE ignored (a peer that went away shows up as a write error). */
#ifndef KVSTAGE_TOOLS_SERVE_SIGNAL_H
#define KVSTAGE_TOOLS_SERVE_SIGNAL_H

/* Installs the handlers (once). */
void kvs_serve_signal_install(void);
/* Waits up to timeout_ms for SIGINT or SIGTERM; 1 once one arrived (and from then on). */
int kvs_serve_signal_wait(int timeout_ms);

#endif
