/* A read-only GGUF (version 2 and 3) file: metadata lookup, tensor directory and
 * dequantisation of tensor rows to f32. The file is mapped, never copied whole; every offset
 * and count read from it is bounds-checked so a truncated or hostile file is an error, never
 * a crash. */
#ifndef KVSTAGE_GGUF_H
#define KVSTAGE_GGUF_H

#include <stddef.h>
#include <stdint.h>

#include "kvstage/status.h"

/* Metadata value types, numbered as in the GGUF format. */
typedef enum {
    KVS_GGUF_U8 = 0,
    KVS_GGUF_I8 = 1,
    KVS_GGUF_U16 = 2,
    KVS_GGUF_I16 = 3,
    KVS_GGUF_U32 = 4,
    KVS_GGUF_I32 = 5,
    KVS_GGUF_F32 = 6,
    KVS_GGUF_BOOL = 7,
    KVS_GGUF_STRING = 8,
    KVS_GGUF_ARRAY = 9,
    KVS_GGUF_U64 = 10,
    KVS_GGUF_I64 = 11,
    KVS_GGUF_F64 = 12,
} kvs_gguf_type_t;

/* Tensor element types, numbered as in the GGUF format; only these are supported. */
typedef enum {
    KVS_GGML_F32 = 0,
    KVS_GGML_F16 = 1,
    KVS_GGML_Q4_0 = 2,
    KVS_GGML_Q4_1 = 3,
    KVS_GGML_Q8_0 = 8,
    KVS_GGML_BF16 = 30,
} kvs_ggml_type_t;

#define KVS_GGUF_MAX_DIMS 4

/* A string inside the mapped file: not NUL-terminated. */
typedef struct {
    const char *ptr;
    uint64_t len;
} kvs_gguf_str_t;

typedef struct {
    kvs_gguf_str_t name;
    kvs_ggml_type_t type;
    uint32_t n_dims;
    uint64_t ne[KVS_GGUF_MAX_DIMS]; /* ne[0] is the contiguous dimension; unused dims are 1 */
    const uint8_t *data;            /* inside the mapping */
    uint64_t bytes;
} kvs_gguf_tensor_t;

typedef struct kvs_gguf kvs_gguf_t;

/* Maps and parses the file: header, metadata, tensor directory (offsets aligned to
 * general.alignment, data inside the file, sizes consistent with type and shape).
 * KVS_ERR_IO if it cannot be opened or mapped, KVS_ERR_PROTOCOL (message naming the field)
 * if malformed, KVS_ERR_UNSUPPORTED for a version other than 2 or 3 or a tensor type outside
 * kvs_ggml_type_t. */
kvs_status_t kvs_gguf_open(const char *path, kvs_gguf_t **gguf_p);
/* The same over a caller-owned buffer that must outlive the handle (tests, fuzzing). */
kvs_status_t kvs_gguf_open_buffer(const void *data, size_t size, kvs_gguf_t **gguf_p);
void kvs_gguf_close(kvs_gguf_t *gguf);

/* Scalar metadata. KVS_ERR_NOT_FOUND if the key is absent (not logged: callers often have a
 * default), KVS_ERR_INVALID (logged) if present with a type that cannot be converted exactly
 * (u32 accepts any integer type in range; f32 accepts f32 and f64). */
kvs_status_t kvs_gguf_u32(const kvs_gguf_t *gguf, const char *key, uint32_t *value_p);
kvs_status_t kvs_gguf_f32(const kvs_gguf_t *gguf, const char *key, float *value_p);
kvs_status_t kvs_gguf_bool(const kvs_gguf_t *gguf, const char *key, int *value_p);
kvs_status_t kvs_gguf_str(const kvs_gguf_t *gguf, const char *key, kvs_gguf_str_t *value_p);

/* Array metadata: element type and count. */
kvs_status_t kvs_gguf_array(const kvs_gguf_t *gguf, const char *key, kvs_gguf_type_t *type_p,
                            uint64_t *count_p);
/* Element i of a string array (O(1): offsets are indexed at open). */
kvs_status_t kvs_gguf_array_str(const kvs_gguf_t *gguf, const char *key, uint64_t i,
                                kvs_gguf_str_t *value_p);
/* Element i of a numeric array converted to i64 / f32 (any integer type; f32/f64). */
kvs_status_t kvs_gguf_array_i64(const kvs_gguf_t *gguf, const char *key, uint64_t i,
                                int64_t *value_p);
kvs_status_t kvs_gguf_array_f32(const kvs_gguf_t *gguf, const char *key, uint64_t i,
                                float *value_p);

/* Metadata in file order, for dumps and fuzzing: the key and value type of entry i
 * (0..count-1); KVS_ERR_INVALID (logged) for i out of range. */
uint64_t kvs_gguf_kv_count(const kvs_gguf_t *gguf);
kvs_status_t kvs_gguf_kv_at(const kvs_gguf_t *gguf, uint64_t i, kvs_gguf_str_t *key_p,
                            kvs_gguf_type_t *type_p);

uint64_t kvs_gguf_tensor_count(const kvs_gguf_t *gguf);
/* By index (0..count-1) or by name; KVS_ERR_NOT_FOUND (not logged) for an absent name. */
kvs_status_t kvs_gguf_tensor_at(const kvs_gguf_t *gguf, uint64_t i, kvs_gguf_tensor_t *tensor_p);
kvs_status_t kvs_gguf_tensor(const kvs_gguf_t *gguf, const char *name, kvs_gguf_tensor_t *tensor_p);

/* Dequantises a sub-matrix of a tensor viewed as rows of ne[0] elements (a 1-D tensor is one
 * row; dims above 2 are flattened into rows):
 * rows [row0, row0+nrows) and, within each row, columns [col0, col0+ncols). Output is
 * dst[nrows][ncols] row-major. Any col0/ncols works for every type (a quantised block that
 * straddles the range is decoded and cut). KVS_ERR_INVALID for a range outside the tensor. */
kvs_status_t kvs_gguf_dequant(const kvs_gguf_tensor_t *tensor, uint64_t row0, uint64_t nrows,
                              uint64_t col0, uint64_t ncols, float *dst);

/* Elements per block and bytes per block of a type (1 and 4 for F32, 32 and 20 for Q4_1...);
 * 0 for an unknown type. */
uint32_t kvs_ggml_block_elems(kvs_ggml_type_t type);
uint32_t kvs_ggml_block_bytes(kvs_ggml_type_t type);

/* Half-precision conversions (round to nearest even on the way down). */
float kvs_f16_to_f32(uint16_t h);
uint16_t kvs_f32_to_f16(float f);
float kvs_bf16_to_f32(uint16_t h);
uint16_t kvs_f32_to_bf16(float f);

/* The embedded default model: $KVS_MODEL if set, else
 * ${KVS_CACHE_DIR:-$HOME/.cache/kvstage}/models/SmolLM2-135M-Instruct.Q4_1.gguf.
 * KVS_ERR_NOT_FOUND (logged, saying to run scripts/setup.sh) if that file does not exist,
 * KVS_ERR_NOSPACE if the path does not fit in cap bytes. */
kvs_status_t kvs_model_default_path(char *buf, size_t cap);

#endif
