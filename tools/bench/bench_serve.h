/* `kvstage bench serve`: the HTTP serving path under load. Concurrent streaming clients against
 * a colocated server and against a router in front of a prefill and a decode server (every
 * process started here), swept over the number of users: time to first token (p50, p99) and
 * output tokens/s per user and in total. */
#ifndef KVSTAGE_TOOLS_BENCH_SERVE_H
#define KVSTAGE_TOOLS_BENCH_SERVE_H

/* argv[0] is "serve". Returns the exit code: 0 ok, 1 failed run, 2 usage. */
int kvs_bench_serve(int argc, char **argv);

#endif
