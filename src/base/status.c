/* Names for kvs_status_t values. */
#include "kvstage/status.h"

const char *kvs_status_str(kvs_status_t status)
{
    switch (status) {
    case KVS_OK:
        return "ok";
    case KVS_INPROGRESS:
        return "in progress";
    case KVS_ERR_INVALID:
        return "invalid argument";
    case KVS_ERR_NOMEM:
        return "out of memory";
    case KVS_ERR_NOSPACE:
        return "no space";
    case KVS_ERR_NOT_FOUND:
        return "not found";
    case KVS_ERR_TIMEOUT:
        return "timed out";
    case KVS_ERR_PROTOCOL:
        return "protocol error";
    case KVS_ERR_UNSUPPORTED:
        return "unsupported";
    case KVS_ERR_IO:
        return "i/o error";
    case KVS_ERR_ABORTED:
        return "aborted";
    case KVS_ERR_INCOMPATIBLE:
        return "incompatible peer";
    case KVS_ERR_STATE:
        return "invalid state";
    case KVS_ERR_CORRUPT:
        return "checksum mismatch";
    }
    return "unknown status";
}
