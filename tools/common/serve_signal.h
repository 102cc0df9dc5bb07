/* SIGINT and SIGTERM as a flag a long-running command polls (serve, router, serve-demo), and
 * SIGPIPE ignored (a peer that went away shows up as a write error); SIGHUP as a second flag
 * for a command that re-reads its configuration on it (router). */
#ifndef KVSTAGE_TOOLS_SERVE_SIGNAL_H
#define KVSTAGE_TOOLS_SERVE_SIGNAL_H

/* Installs the handlers (once). */
void kvs_serve_signal_install(void);
/* Waits up to timeout_ms for SIGINT or SIGTERM; 1 once one arrived (and from then on). A
 * SIGHUP (when installed) ends the wait early too, returning 0. */
int kvs_serve_signal_wait(int timeout_ms);
/* After kvs_serve_signal_install: SIGHUP no longer ends the process but sets a flag. */
void kvs_serve_signal_install_hup(void);
/* 1 when a SIGHUP came since the last call (and clears it). */
int kvs_serve_signal_hup_take(void);

#endif
