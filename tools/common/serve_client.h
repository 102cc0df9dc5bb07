/* What `serve-demo` and `bench serve` share: starting `kvstage serve` and `kvstage router` as
 * child processes (each leading a process group of its own) and waiting for their "serving on"
 * / "routing on" line; stopping them; a streamed OpenAI request with its client-side timing;
 * one value from a server's /metrics. */
#ifndef KVSTAGE_TOOLS_SERVE_CLIENT_H
#define KVSTAGE_TOOLS_SERVE_CLIENT_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

typedef struct {
    const char *name;    /* for messages: "prefill server" */
    pid_t pid;           /* also its process group */
    int out_fd;          /* its stdout */
    char line[512];      /* its "serving on" / "routing on" line */
    char url[128];       /* http://HOST:PORT from that line */
    char bootstrap[128]; /* "bootstrap EP" from that line, or "" */
    int exited, status;
} kvs_child_t;

/* Starts `kvstage argv[1..]` (argv NULL-terminated, argv[0] any name), stdin /dev/null, stdout
 * on a pipe, in a new process group. 0, or -1 (reported). name and out_fd must be set. */
int kvs_child_start(kvs_child_t *c, char **argv);
/* Reads the child's stdout until a line starting with prefix (then fills url and bootstrap);
 * gives up after timeout_s, when the child exits, or on SIGINT/SIGTERM (serve_signal.h).
 * 0 once found; -1 (reported). */
int kvs_child_wait_line(kvs_child_t *c, const char *prefix, uint32_t timeout_s);
/* SIGTERM, up to timeout_s for it to exit, then SIGKILL to its whole group; reaps it. 1 when it
 * exited by itself with status 0. No-op (1) for a child never started. */
int kvs_child_stop(kvs_child_t *c, uint32_t timeout_s);

typedef struct {
    /* in */
    int print; /* write the text to stdout as it comes */
    /* out */
    long status;     /* HTTP status; 0: no answer */
    char text[8192]; /* the streamed text (cut at the end of the buffer) */
    size_t text_len;
    uint64_t t0, first_ns, end_ns; /* CLOCK_MONOTONIC: sent, first text, the end */
    long prompt_tokens, completion_tokens, cached;
    unsigned long long ttft_ns, kv_bytes; /* the answering server's "kvstage" fields */
    char finish[32];
    char error[512]; /* an error event's or answer's message, or "" */
    /* private */
    char *buf;
    size_t len, cap;
} kvs_stream_t;

/* POSTs body (a JSON request with "stream": true and usage included) to url + path and reads the
 * event stream. 0 when an answer came back (status 200, text, no error); -1 otherwise, with
 * status and error telling why. A SIGINT or SIGTERM ends the transfer. */
int kvs_stream_request(const char *url, const char *path, const char *body, kvs_stream_t *s);

/* A sample's value from url's /metrics (the exact "name{labels}" text); -1 when absent. */
double kvs_metric_get(const char *url, const char *name);

#endif
