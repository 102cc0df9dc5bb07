/* Token sampling on the device (internal to the CUDA model backend): kvs_sample_at's rule
 * (serve/model/sample.c: greedy, temperature, top-k, min-p, top-p, one draw walked in id order)
 * over rows of f32 logits that stay on the device, one block per row.
 *
 * The cuts are found without sorting, as on the host: each keeps {logit >= cut}, and a radix
 * walk over the logits' order-preserving integer keys (four passes of 256 bins) finds the
 * highest cut whose count (top-k) or mass (top-p) above still reaches the target. Masses are
 * sums of exp((logit - max) / temperature) in fixed point (2^-40 units, integer atomics and a
 * block scan), so a row's result does not depend on the order threads add in, and every TP
 * rank picks the same token from the same logits; against the host's double sums a choice can
 * differ only when the draw lands within about vocab x 2^-40 of a boundary. */
#ifndef KVSTAGE_MODEL_CUDA_SAMPLE_CUH
#define KVSTAGE_MODEL_CUDA_SAMPLE_CUH

#include <cuda_runtime.h>
#include <stdint.h>

extern "C" {
#include "kvstage/status.h"
#include "model/model.h"
}

namespace kvs_cuda
{

struct sample_row_t {
    uint32_t row;   /* the row of logits */
    uint32_t top_k; /* 0: off */
    float temperature, top_p, min_p;
    double draw; /* uniform [0, 1) */
};

/* Row `row` sampled by params with the draw given. */
inline sample_row_t sample_row(uint32_t row, const kvs_sample_params_t &p, double draw)
{
    return sample_row_t{row, p.top_k, p.temperature, p.top_p, p.min_p, draw};
}

/* Bytes of device scratch the sampling of `rows` rows of `vocab` logits needs. */
size_t sample_scratch_bytes(uint32_t rows, uint32_t vocab);

/* tokens[i] = the token of rows[i] (all device memory; scratch of sample_scratch_bytes). */
kvs_status_t sample_launch(const float *logits, uint32_t vocab, const sample_row_t *rows,
                           uint32_t nrows, void *scratch, uint32_t *tokens, cudaStream_t stream);

} // namespace kvs_cuda

#endif
