/* A rank's connection to the other side: control messages (to peer ranks of the other side)
 * and the data plane (prefill writes into decode rings). Concrete links are made by a
 * transport (inproc now; ZeroMQ + UCX and CUDA IPC later); the protocol only sees this
 * handle. */
#ifndef KVSTAGE_LINK_H
#define KVSTAGE_LINK_H

#include "kvstage/layout.h" /* kvs_side_t */

typedef struct kvs_link kvs_link_t;

/* Destroys the link; no call may be in flight. NULL is ignored. */
void kvs_link_destroy(kvs_link_t *link);

#endif
