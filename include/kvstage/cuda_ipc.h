/* The CUDA IPC data plane: prefill and decode ranks in different processes of one host, their
 * pools on GPUs. The decode rank exports its staging ring (cudaIpcGetMemHandle); the handle
 * travels to the prefill ranks as bytes (by any channel: a pipe, the bootstrap registry); each
 * prefill rank imports it (cudaIpcOpenMemHandle) and writes with asynchronous peer copies on
 * its own stream, complete when their event fires, or maps the ring so its gather kernel
 * stores straight into a granted slot (direct write).
 *
 * A cuda_ipc link is data-plane only: it carries no control messages (send and recv return
 * KVS_ERR_UNSUPPORTED). Until a net link embeds it, the protocol cannot run on it alone; it
 * is the piece that lets the data path stay on NVLink between processes. Builds without CUDA
 * refuse to create one (KVS_ERR_UNSUPPORTED). */
#ifndef KVSTAGE_CUDA_IPC_H
#define KVSTAGE_CUDA_IPC_H

#include <stdint.h>

#include "kvstage/link.h"
#include "kvstage/net.h"
#include "kvstage/status.h"

#define KVS_CUDA_IPC_MAX_PEERS (KVS_NET_MAX_INSTANCES * KVS_MAX_TP)

typedef struct {
    kvs_side_t side;
    uint32_t rank;    /* this rank on its side */
    uint32_t peer_tp; /* peers: ranks on the other side, [1, KVS_CUDA_IPC_MAX_PEERS] (a
                         prefill net link's decode instances x their ranks) */
    int device;       /* this rank's CUDA device: where its pool, ring or buffers live */
} kvs_cuda_ipc_config_t;

/* An exported ring as bytes (explicit little-endian fields and the CUDA handle): magic,
 * version, ring size, the exporter's process id and device, cudaIpcMemHandle_t. */
#define KVS_CUDA_IPC_HANDLE_BYTES 96
typedef struct {
    uint8_t bytes[KVS_CUDA_IPC_HANDLE_BYTES];
} kvs_cuda_ipc_handle_t;

kvs_status_t kvs_cuda_ipc_link_create(const kvs_cuda_ipc_config_t *config, kvs_link_t **link_p);

/* The GPU (the exporter's device number) a handle's ring is on. */
uint32_t kvs_cuda_ipc_handle_device(const kvs_cuda_ipc_handle_t *handle);

/* Decode: the handle of the ring this link exposed (the receiver exposes it when it is
 * created). The ring must be the start of a device allocation on the link's device, as
 * kvs_receiver_create makes it. KVS_ERR_STATE before expose. */
kvs_status_t kvs_cuda_ipc_export(kvs_link_t *link, kvs_cuda_ipc_handle_t *handle_p);

/* Prefill: opens decode rank `peer`'s ring from its exported handle; writes and maps to that
 * peer work from now on. Importing again replaces the mapping (no write to the peer may be in
 * flight). KVS_ERR_INVALID for a malformed handle or one exported by this very process (use
 * the inproc link there); KVS_ERR_IO when CUDA cannot open it. */
kvs_status_t kvs_cuda_ipc_import(kvs_link_t *link, uint32_t peer,
                                 const kvs_cuda_ipc_handle_t *handle);

#endif
