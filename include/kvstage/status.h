/* kvstage status codes: one kvs_status_t for every fallible call. */
#ifndef KVSTAGE_STATUS_H
#define KVSTAGE_STATUS_H

typedef enum {
    KVS_OK = 0,
    KVS_INPROGRESS = 1,         /* not an error: work continues, call again later */
    KVS_ERR_INVALID = -1,       /* bad argument or configuration */
    KVS_ERR_NOMEM = -2,         /* allocation failed */
    KVS_ERR_NOSPACE = -3,       /* out of pages, ring space or slots */
    KVS_ERR_NOT_FOUND = -4,     /* unknown room, key or peer */
    KVS_ERR_TIMEOUT = -5,       /* a deadline passed */
    KVS_ERR_PROTOCOL = -6,      /* a message failed validation */
    KVS_ERR_UNSUPPORTED = -7,   /* valid request the build or layout cannot serve */
    KVS_ERR_IO = -8,            /* transport or system call failure */
    KVS_ERR_ABORTED = -9,       /* the room was aborted */
    KVS_ERR_INCOMPATIBLE = -10, /* peers disagree on shape, page size or layout */
    KVS_ERR_STATE = -11,        /* call not valid in the object's current state */
    KVS_ERR_CORRUPT = -12,      /* data failed its end-to-end checksum */
} kvs_status_t;

/* A short, static, human-readable description; never NULL. */
const char *kvs_status_str(kvs_status_t status);

#endif
