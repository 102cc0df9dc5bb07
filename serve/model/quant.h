/* Internal: block layouts of the supported quantised tensor types and whole-block decoding,
 * shared by kvs_gguf_dequant and by model code that decodes rows itself. */
#ifndef KVSTAGE_MODEL_QUANT_H
#define KVSTAGE_MODEL_QUANT_H

#include <stdint.h>

#include "model/gguf.h"

/* Elements per block of the quantised types. */
#define KVS_QK 32

/* Bytes per block: f16 scale (+ f16 min for Q4_1) then the packed values. In Q4_x byte j holds
 * element j in its low nibble and element j + 16 in its high nibble. */
#define KVS_Q8_0_BYTES (2 + KVS_QK)
#define KVS_Q4_0_BYTES (2 + KVS_QK / 2)
#define KVS_Q4_1_BYTES (4 + KVS_QK / 2)

/* Decodes nblocks whole blocks of a supported type from src (no alignment needed) into
 * dst[nblocks * kvs_ggml_block_elems(type)]. */
void kvs_dequant_blocks(kvs_ggml_type_t type, const uint8_t *src, uint64_t nblocks, float *dst);

/* Checks a tensor descriptor (type supported; shape, type and size agree) and that rows
 * [row0, row0 + nrows) and columns [col0, col0 + ncols) lie inside it, viewed as rows of ne[0]
 * (kvs_gguf_dequant's view); *row_bytes_p: the bytes of one such row. KVS_ERR_INVALID (logged,
 * naming the tensor) otherwise. */
kvs_status_t kvs_gguf_check_slice(const kvs_gguf_tensor_t *tensor, uint64_t row0, uint64_t nrows,
                                  uint64_t col0, uint64_t ncols, uint64_t *row_bytes_p);

#endif
