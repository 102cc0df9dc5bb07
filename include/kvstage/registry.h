/* The bootstrap registry (protocol.md §5). Each prefill instance runs one; every prefill rank
 * registers with it (rank, control endpoint, TP size, KV shape, page size, chunk size, layout
 * hash), and decode ranks query it to learn the prefill layout and endpoints, refusing an
 * incompatible peer with a message that names the mismatch. Messages are the codec's REGISTER,
 * QUERY and QUERY_REPLY over ZeroMQ; clients retry until a deadline. */
#ifndef KVSTAGE_REGISTRY_H
#define KVSTAGE_REGISTRY_H

#include <stddef.h>
#include <stdint.h>

#include "kvstage/msg.h"
#include "kvstage/layout.h"
#include "kvstage/status.h"

typedef struct kvs_registry kvs_registry_t;

/* Binds the registry's endpoint (e.g. "tcp://127.0.0.1:0" for a free port). */
kvs_status_t kvs_registry_create(const char *bind, kvs_registry_t **registry_p);
void kvs_registry_destroy(kvs_registry_t *registry);
/* The bound endpoint, with the real port. */
const char *kvs_registry_endpoint(const kvs_registry_t *registry);
/* Answers waiting requests, waiting at most timeout_ms for the first; returns how many it
 * answered. Malformed requests are counted (kvs_registry_rejected) and dropped. */
uint32_t kvs_registry_serve(kvs_registry_t *registry, int timeout_ms);
uint32_t kvs_registry_count(const kvs_registry_t *registry);
/* Registers a rank of the process that serves the registry, without a round trip. A TP size or
 * stage count that differs from earlier registrations is refused (KVS_ERR_INCOMPATIBLE). */
kvs_status_t kvs_registry_add(kvs_registry_t *registry, const kvs_msg_register_t *reg);
uint64_t kvs_registry_rejected(const kvs_registry_t *registry);

/* What a prefill rank registers: its place in the deployment (rank = stage * TP + TP rank)
 * and what decode must match. */
void kvs_registry_describe(const kvs_pd_geometry_t *geo, uint32_t rank, const char *endpoint,
                           kvs_msg_register_t *reg_p);

/* A hash of everything both sides must agree on beyond the fields the registration carries
 * (protocol version, slot and region layout rules). */
uint64_t kvs_registry_layout_hash(const kvs_pd_geometry_t *geo);

/* Client side: registers `reg`, retrying until acknowledged or timeout_ns passes. */
kvs_status_t kvs_registry_register(const char *registry, const kvs_msg_register_t *reg,
                                   uint64_t timeout_ns);
/* Client side: asks for prefill rank `rank`, retrying until it is registered or timeout_ns
 * passes (KVS_ERR_TIMEOUT). */
kvs_status_t kvs_registry_query(const char *registry, uint32_t rank, uint64_t timeout_ns,
                                kvs_msg_register_t *reg_p);

/* Checks a prefill registration against this decode rank's geometry: KVS_OK, or
 * KVS_ERR_INCOMPATIBLE with a message naming the mismatch (KV shape, element size, page size,
 * chunk size, layout hash) in why (also logged). */
kvs_status_t kvs_registry_check(const kvs_msg_register_t *prefill, const kvs_pd_geometry_t *mine,
                                char *why, size_t cap);

#endif
