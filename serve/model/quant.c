/* Tensor element types: block sizes, half-precision conversions and dequantisation of
 * F32/F16/BF16/Q8_0/Q4_0/Q4_1 to f32, including sub-ranges that cut through blocks. Results
 * match ggml's reference dequantisers (and gguf.quants in Python) bit for bit. */
#include "model/quant.h"

#include <string.h>

#include "base/bytes.h"
#include "kvstage/log.h"

uint32_t kvs_ggml_block_elems(kvs_ggml_type_t type)
{
    switch (type) {
    case KVS_GGML_F32:
    case KVS_GGML_F16:
    case KVS_GGML_BF16:
        return 1;
    case KVS_GGML_Q4_0:
    case KVS_GGML_Q4_1:
    case KVS_GGML_Q8_0:
        return KVS_QK;
    }
    return 0;
}

uint32_t kvs_ggml_block_bytes(kvs_ggml_type_t type)
{
    switch (type) {
    case KVS_GGML_F32:
        return 4;
    case KVS_GGML_F16:
    case KVS_GGML_BF16:
        return 2;
    case KVS_GGML_Q4_0:
        return KVS_Q4_0_BYTES;
    case KVS_GGML_Q4_1:
        return KVS_Q4_1_BYTES;
    case KVS_GGML_Q8_0:
        return KVS_Q8_0_BYTES;
    }
    return 0;
}

static float f32_from_bits(uint32_t bits)
{
    float f;
    memcpy(&f, &bits, sizeof(f));
    return f;
}

static uint32_t bits_from_f32(float f)
{
    uint32_t bits;
    memcpy(&bits, &f, sizeof(bits));
    return bits;
}

float kvs_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t) (h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    if (exp == 0x1f) return f32_from_bits(sign | 0x7f800000u | (man << 13)); /* inf, NaN */
    if (exp != 0) return f32_from_bits(sign | ((exp + 127 - 15) << 23) | (man << 13));
    if (man == 0) return f32_from_bits(sign);
    /* Subnormal (man * 2^-24): shift the leading one up to the implicit bit. */
    uint32_t e = 127 - 14;
    while ((man & 0x400u) == 0) {
        man <<= 1;
        e--;
    }
    return f32_from_bits(sign | (e << 23) | ((man & 0x3ffu) << 13));
}

/* Keeps the low `shift` bits' worth of rounding: round to nearest, ties to even. */
static uint32_t round_shift(uint32_t v, uint32_t shift)
{
    uint32_t q = v >> shift;
    uint32_t rem = v & ((1u << shift) - 1);
    uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1))) q++;
    return q;
}

uint16_t kvs_f32_to_f16(float f)
{
    uint32_t x = bits_from_f32(f);
    uint16_t sign = (uint16_t) ((x >> 16) & 0x8000u);
    uint32_t exp = (x >> 23) & 0xffu;
    uint32_t man = x & 0x7fffffu;
    if (exp == 0xff) /* a NaN stays a (quiet) NaN, keeping the top of its payload */
        return (uint16_t) (sign | 0x7c00u | (man ? 0x200u | (man >> 13) : 0));
    int e = (int) exp - 127 + 15; /* biased f16 exponent */
    if (e >= 0x1f) return (uint16_t) (sign | 0x7c00u);
    if (e <= 0) {
        /* Subnormal result in units of 2^-24; below 2^-25 everything rounds to zero. */
        if (e < -10) return sign;
        return (uint16_t) (sign | round_shift(man | 0x800000u, (uint32_t) (14 - e)));
    }
    /* A carry out of the mantissa correctly bumps the exponent (up to inf). */
    return (uint16_t) (sign | round_shift(((uint32_t) e << 23) | man, 13));
}

float kvs_bf16_to_f32(uint16_t h)
{
    return f32_from_bits((uint32_t) h << 16);
}

uint16_t kvs_f32_to_bf16(float f)
{
    uint32_t x = bits_from_f32(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t) ((x >> 16) | 0x40u); /* quiet NaN */
    return (uint16_t) ((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

/* [nblocks][34]: f16 d, 32 x int8 q; x = d * q */
static void dequant_q8_0(const uint8_t *src, uint64_t nblocks, float *dst)
{
    for (uint64_t b = 0; b < nblocks; b++, src += KVS_Q8_0_BYTES, dst += KVS_QK) {
        float d = kvs_f16_to_f32(kvs_get_u16(src));
        for (int j = 0; j < KVS_QK; j++) {
            int q = src[2 + j] < 128 ? src[2 + j] : src[2 + j] - 256;
            dst[j] = (float) q * d;
        }
    }
}

/* [nblocks][18]: f16 d, 16 bytes of nibbles; x = d * (q - 8) */
static void dequant_q4_0(const uint8_t *src, uint64_t nblocks, float *dst)
{
    for (uint64_t b = 0; b < nblocks; b++, src += KVS_Q4_0_BYTES, dst += KVS_QK) {
        float d = kvs_f16_to_f32(kvs_get_u16(src));
        const uint8_t *qs = src + 2;
        for (int j = 0; j < KVS_QK / 2; j++) {
            dst[j] = (float) ((qs[j] & 0x0f) - 8) * d;
            dst[j + KVS_QK / 2] = (float) ((qs[j] >> 4) - 8) * d;
        }
    }
}

/* [nblocks][20]: f16 d, f16 m, 16 bytes of nibbles; x = d * q + m */
static void dequant_q4_1(const uint8_t *src, uint64_t nblocks, float *dst)
{
    for (uint64_t b = 0; b < nblocks; b++, src += KVS_Q4_1_BYTES, dst += KVS_QK) {
        float d = kvs_f16_to_f32(kvs_get_u16(src));
        float m = kvs_f16_to_f32(kvs_get_u16(src + 2));
        const uint8_t *qs = src + 4;
        for (int j = 0; j < KVS_QK / 2; j++) {
            /* Separate statements: the product is rounded before the add (no FMA), as in ggml. */
            float lo = d * (float) (qs[j] & 0x0f);
            float hi = d * (float) (qs[j] >> 4);
            dst[j] = lo + m;
            dst[j + KVS_QK / 2] = hi + m;
        }
    }
}

void kvs_dequant_blocks(kvs_ggml_type_t type, const uint8_t *src, uint64_t nblocks, float *dst)
{
    switch (type) {
    case KVS_GGML_F32:
        for (uint64_t i = 0; i < nblocks; i++) dst[i] = f32_from_bits(kvs_get_u32(src + 4 * i));
        return;
    case KVS_GGML_F16:
        for (uint64_t i = 0; i < nblocks; i++) dst[i] = kvs_f16_to_f32(kvs_get_u16(src + 2 * i));
        return;
    case KVS_GGML_BF16:
        for (uint64_t i = 0; i < nblocks; i++) dst[i] = kvs_bf16_to_f32(kvs_get_u16(src + 2 * i));
        return;
    case KVS_GGML_Q8_0:
        dequant_q8_0(src, nblocks, dst);
        return;
    case KVS_GGML_Q4_0:
        dequant_q4_0(src, nblocks, dst);
        return;
    case KVS_GGML_Q4_1:
        dequant_q4_1(src, nblocks, dst);
        return;
    }
}

/* a * b into *r unless it overflows. */
static int mul_u64(uint64_t a, uint64_t b, uint64_t *r)
{
    if (a != 0 && b > UINT64_MAX / a) return -1;
    *r = a * b;
    return 0;
}

kvs_status_t kvs_gguf_check_slice(const kvs_gguf_tensor_t *tensor, uint64_t row0, uint64_t nrows,
                                  uint64_t col0, uint64_t ncols, uint64_t *row_bytes_p)
{
    const int nlen = tensor->name.len > 64 ? 64 : (int) tensor->name.len;
    const char *name = tensor->name.ptr ? tensor->name.ptr : "";
    uint32_t be = kvs_ggml_block_elems(tensor->type);
    uint32_t bb = kvs_ggml_block_bytes(tensor->type);
    if (be == 0) {
        kvs_error("gguf dequant %.*s: tensor type %d not supported", nlen, name,
                  (int) tensor->type);
        return KVS_ERR_INVALID;
    }
    /* The descriptor comes from the caller: re-check that shape, type and size agree. */
    uint64_t ne0 = tensor->ne[0], rows = 1, row_bytes = 0, total = 0;
    int bad = tensor->n_dims > KVS_GGUF_MAX_DIMS || ne0 % be != 0 || tensor->data == NULL;
    for (int d = 1; d < KVS_GGUF_MAX_DIMS && !bad; d++) bad = mul_u64(rows, tensor->ne[d], &rows);
    if (!bad) bad = mul_u64(ne0 / be, bb, &row_bytes) || mul_u64(row_bytes, rows, &total);
    if (bad || total != tensor->bytes) {
        kvs_error("gguf dequant %.*s: descriptor inconsistent (ne[0] %llu, %llu rows, %llu bytes)",
                  nlen, name, (unsigned long long) ne0, (unsigned long long) rows,
                  (unsigned long long) tensor->bytes);
        return KVS_ERR_INVALID;
    }
    if (row0 > rows || nrows > rows - row0 || col0 > ne0 || ncols > ne0 - col0) {
        kvs_error("gguf dequant %.*s: rows [%llu, +%llu) cols [%llu, +%llu) outside %llu x %llu",
                  nlen, name, (unsigned long long) row0, (unsigned long long) nrows,
                  (unsigned long long) col0, (unsigned long long) ncols, (unsigned long long) rows,
                  (unsigned long long) ne0);
        return KVS_ERR_INVALID;
    }
    *row_bytes_p = row_bytes;
    return KVS_OK;
}

kvs_status_t kvs_gguf_dequant(const kvs_gguf_tensor_t *tensor, uint64_t row0, uint64_t nrows,
                              uint64_t col0, uint64_t ncols, float *dst)
{
    if (tensor == NULL || (dst == NULL && nrows != 0 && ncols != 0)) {
        kvs_error("gguf dequant: NULL tensor or destination");
        return KVS_ERR_INVALID;
    }
    uint64_t row_bytes;
    kvs_status_t st = kvs_gguf_check_slice(tensor, row0, nrows, col0, ncols, &row_bytes);
    if (st != KVS_OK) return st;
    const uint32_t be = kvs_ggml_block_elems(tensor->type);
    const uint32_t bb = kvs_ggml_block_bytes(tensor->type);
    if (nrows == 0 || ncols == 0) return KVS_OK;

    uint64_t end = col0 + ncols;
    float tmp[KVS_QK]; /* one block that straddles an edge of the range */
    for (uint64_t r = 0; r < nrows; r++) {
        const uint8_t *row = tensor->data + (row0 + r) * row_bytes;
        float *out = dst + r * ncols; /* [nrows][ncols] */
        uint64_t b = col0 / be, c = col0;
        if (c % be != 0) { /* leading partial block */
            uint64_t n = be - c % be < end - c ? be - c % be : end - c;
            kvs_dequant_blocks(tensor->type, row + b * bb, 1, tmp);
            memcpy(out, tmp + c % be, n * sizeof(float));
            out += n;
            c += n;
            b++;
        }
        uint64_t full = end / be > b ? end / be - b : 0; /* whole blocks inside the range */
        if (c < end && full > 0) {
            kvs_dequant_blocks(tensor->type, row + b * bb, full, out);
            out += full * be;
            c += full * be;
            b += full;
        }
        if (c < end) { /* trailing partial block */
            kvs_dequant_blocks(tensor->type, row + b * bb, 1, tmp);
            memcpy(out, tmp, (end - c) * sizeof(float));
        }
    }
    return KVS_OK;
}
