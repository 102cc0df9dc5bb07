/* `kvstage bench protocol`: control-plane cost per chunk and per room, bulk vs per-page writes. */
#ifndef KVSTAGE_TOOLS_BENCH_PROTOCOL_H
#define KVSTAGE_TOOLS_BENCH_PROTOCOL_H

int kvs_bench_protocol(int argc, char **argv);

#endif
