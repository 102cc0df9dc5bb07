/* CUDA error checking for kvstage's CUDA builds (C and CUDA sources alike): every runtime call
 * goes through KVS_CUDA_CHECK, which turns a failure into one logged line (the caller's context,
 * the call, the CUDA error name and text) and a kvs_status_t. Include only when KVS_HAVE_CUDA. */
#ifndef KVSTAGE_BASE_CUDA_UTIL_H
#define KVSTAGE_BASE_CUDA_UTIL_H

#include <stdarg.h>
#include <stdio.h>

#include <cuda_runtime_api.h>

#include "kvstage/log.h"
#include "kvstage/status.h"

/* The kvs_status_t a CUDA error becomes: a missing device or driver is an unsupported request
 * on this machine, an allocation failure is out of memory, a bad argument is invalid, and
 * everything else (launch failures, faults) is an I/O-like device failure. */
static inline kvs_status_t kvs_cuda_status(cudaError_t err)
{
    switch (err) {
    case cudaSuccess:
        return KVS_OK;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorCompatNotSupportedOnDevice:
    case cudaErrorSystemDriverMismatch:
        return KVS_ERR_UNSUPPORTED;
    case cudaErrorMemoryAllocation:
        return KVS_ERR_NOMEM;
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevice:
    case cudaErrorInvalidDevicePointer:
        return KVS_ERR_INVALID;
    default:
        return KVS_ERR_IO;
    }
}

/* Logs a failed call once (err != cudaSuccess) and maps it. A non-sticky error is also taken
 * off the runtime's last-error slot so that a later cudaGetLastError() after a kernel launch
 * reports that launch, not this old failure. */
static inline kvs_status_t kvs__cuda_check(cudaError_t err, const char *file, int line,
                                           const char *call, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static inline kvs_status_t kvs__cuda_check(cudaError_t err, const char *file, int line,
                                           const char *call, const char *fmt, ...)
{
    if (err == cudaSuccess) return KVS_OK;
    (void) cudaGetLastError();
    if (kvs_log_enabled(KVS_LOG_ERROR)) {
        char what[256];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(what, sizeof(what), fmt, ap);
        va_end(ap);
        kvs_log_write(KVS_LOG_ERROR, file, line, "%s: %s failed: %s (%s)", what, call,
                      cudaGetErrorName(err), cudaGetErrorString(err));
    }
    return kvs_cuda_status(err);
}

/* st = KVS_CUDA_CHECK(cudaMalloc(&p, n), "pool: %zu bytes on device %d", n, dev); */
#define KVS_CUDA_CHECK(call, ...) kvs__cuda_check((call), __FILE__, __LINE__, #call, __VA_ARGS__)

#endif
