/* Tests for the GGUF reader and dequantisation (serve/model/gguf.c, serve/model/quant.c): half
 * conversions, hand-computed quantised blocks, builder round trips of every metadata and
 * tensor type, sub-range dequantisation, malformed files (every truncation, corrupted fields,
 * random flips, allocation failures), the default model path, and the real SmolLM2 file
 * against reference data from Python gguf. */
#include "kvs_test.h"

#include <math.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "kvstage/clock.h"
#include "model/gguf.h"
#include "kvstage/rng.h"
#include "model/data/gguf_smollm2_ref.h"
#include "model/gguf_writer.h"

static const kvs_ggml_type_t all_types[] = {KVS_GGML_F32,  KVS_GGML_F16,  KVS_GGML_BF16,
                                            KVS_GGML_Q8_0, KVS_GGML_Q4_0, KVS_GGML_Q4_1};
#define N_TYPES (sizeof(all_types) / sizeof(all_types[0]))

static uint32_t bits_of(float f)
{
    uint32_t b;
    memcpy(&b, &f, 4);
    return b;
}

static float float_of(uint32_t b)
{
    float f;
    memcpy(&f, &b, 4);
    return f;
}

static uint16_t le16(const uint8_t *p)
{
    return (uint16_t) (p[0] | (p[1] << 8));
}

/* Element i of an encoded row, straight from the format's definition (one element at a time,
 * unlike the library's block decoders). */
static float ref_elem(kvs_ggml_type_t type, const uint8_t *data, uint64_t i)
{
    const uint8_t *blk;
    int j = (int) (i % 32), nib;
    float d, m, p;
    switch (type) {
    case KVS_GGML_F32:
        return float_of((uint32_t) data[4 * i] | (uint32_t) data[4 * i + 1] << 8 |
                        (uint32_t) data[4 * i + 2] << 16 | (uint32_t) data[4 * i + 3] << 24);
    case KVS_GGML_F16:
        return kvs_f16_to_f32(le16(data + 2 * i));
    case KVS_GGML_BF16:
        return float_of((uint32_t) le16(data + 2 * i) << 16);
    case KVS_GGML_Q8_0:
        blk = data + i / 32 * 34;
        return (float) (int8_t) blk[2 + j] * kvs_f16_to_f32(le16(blk));
    case KVS_GGML_Q4_0:
        blk = data + i / 32 * 18;
        nib = j < 16 ? blk[2 + j] & 15 : blk[2 + j - 16] >> 4;
        return (float) (nib - 8) * kvs_f16_to_f32(le16(blk));
    case KVS_GGML_Q4_1:
        blk = data + i / 32 * 20;
        nib = j < 16 ? blk[4 + j] & 15 : blk[4 + j - 16] >> 4;
        d = kvs_f16_to_f32(le16(blk));
        m = kvs_f16_to_f32(le16(blk + 2));
        p = d * (float) nib;
        return p + m;
    }
    fail_msg("ref_elem: type %d", (int) type);
    return 0;
}

#define ANY_ERROR ((kvs_status_t) 99) /* for open_expect: any failure status */

/* Opens a copy of buf[0, len) in an exactly sized heap block (so ASan sees any over-read),
 * expects the status, and checks that a failure logged exactly one error and leaked nothing. */
static void open_expect(const uint8_t *buf, size_t len, kvs_status_t want, const char *what)
{
    kvs_alloc_stats_t before, after;
    kvs_alloc_stats(&before);
    uint8_t *copy = len ? kvs_malloc(len) : NULL; /* NULL, 0 is a valid empty buffer */
    assert_true(len == 0 || copy != NULL);
    if (len) memcpy(copy, buf, len);
    kvs_log_capture_t cap = {.errors_only = 1};
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    kvs_gguf_t *g = NULL;
    kvs_status_t st = kvs_gguf_open_buffer(copy, len, &g);
    kvs_log_set_sink(NULL, NULL);
    if (want == ANY_ERROR ? st == KVS_OK : st != want)
        fail_msg("%s (len %zu): status %s, want %s; last error: %s", what, len, kvs_status_str(st),
                 kvs_status_str(want), cap.msg);
    if (st == KVS_OK) {
        kvs_gguf_close(g);
    } else {
        assert_null(g);
        if (cap.calls != 1) fail_msg("%s: %d errors logged, want 1", what, cap.calls);
    }
    kvs_free(copy);
    kvs_alloc_stats(&after);
    assert_int_equal(after.live_blocks, before.live_blocks);
}

/* Half-precision conversions */

static void test_f16_known_values(void **state)
{
    (void) state;
    static const struct {
        uint16_t h;
        float f;
    } table[] = {
        {0x0000, 0.0f},     {0x3c00, 1.0f},
        {0xc000, -2.0f},    {0x3555, 0.333251953125f},
        {0x7bff, 65504.0f}, {0xfbff, -65504.0f},
        {0x0400, 0x1p-14f}, {0x03ff, 1023 * 0x1p-24f}, /* largest subnormal */
        {0x0001, 0x1p-24f}, {0x8001, -0x1p-24f},
        {0x0200, 0x1p-15f}, {0x3c01, 1.0f + 0x1p-10f},
        {0x7c00, INFINITY}, {0xfc00, -INFINITY},
    };
    for (size_t i = 0; i < sizeof(table) / sizeof(table[0]); i++) {
        assert_int_equal(bits_of(kvs_f16_to_f32(table[i].h)), bits_of(table[i].f));
        assert_int_equal(kvs_f32_to_f16(table[i].f), table[i].h);
    }
    assert_int_equal(bits_of(kvs_f16_to_f32(0x8000)), 0x80000000u); /* -0 keeps its sign */
    assert_int_equal(kvs_f32_to_f16(-0.0f), 0x8000);
    assert_true(isnan(kvs_f16_to_f32(0x7e00)));
    assert_true(isnan(kvs_f16_to_f32(0x7c01))); /* signalling NaN is still NaN */
    assert_true(isnan(kvs_f16_to_f32(0xfe00)));
    uint16_t hn = kvs_f32_to_f16(NAN);
    assert_int_equal(hn & 0x7c00, 0x7c00);
    assert_true((hn & 0x3ff) != 0);
    /* A NaN whose payload lives only in the low bits must not become infinity. */
    assert_true(isnan(kvs_f16_to_f32(kvs_f32_to_f16(float_of(0x7f800001u)))));

    /* Rounding to nearest, ties to even. */
    assert_int_equal(kvs_f32_to_f16(1.0f + 0x1p-11f), 0x3c00);     /* tie, down to even */
    assert_int_equal(kvs_f32_to_f16(1.0f + 3 * 0x1p-11f), 0x3c02); /* tie, up to even */
    assert_int_equal(kvs_f32_to_f16(1.0f + 0x1p-11f + 0x1p-20f), 0x3c01);
    assert_int_equal(kvs_f32_to_f16(65519.0f), 0x7bff);
    assert_int_equal(kvs_f32_to_f16(65520.0f), 0x7c00); /* tie past the largest: infinity */
    assert_int_equal(kvs_f32_to_f16(1e10f), 0x7c00);
    assert_int_equal(kvs_f32_to_f16(-1e10f), 0xfc00);
    assert_int_equal(kvs_f32_to_f16(0x1p-25f), 0x0000);           /* tie to even zero */
    assert_int_equal(kvs_f32_to_f16(0x1p-25f * 1.0001f), 0x0001); /* just above the tie */
    assert_int_equal(kvs_f32_to_f16(3 * 0x1p-25f), 0x0002);       /* tie between 1 and 2 */
    assert_int_equal(kvs_f32_to_f16(0x1p-26f), 0x0000);
    assert_int_equal(kvs_f32_to_f16(-0x1p-30f), 0x8000);
    assert_int_equal(kvs_f32_to_f16(0x1p-14f - 0x1p-26f), 0x0400); /* rounds up into normal */
    assert_int_equal(kvs_f32_to_f16(1e-40f), 0x0000);              /* f32 subnormal */
}

/* The f16 neighbour of h in the direction dir (+1 away from zero, -1 towards), as a double. */
static double f16_neighbour(uint16_t h, int dir)
{
    uint16_t mag = h & 0x7fff, sign = h & 0x8000;
    if (dir < 0 && mag == 0) return kvs_f16_to_f32((uint16_t) (0x0001 | (sign ^ 0x8000)));
    mag = (uint16_t) (mag + dir);
    return kvs_f16_to_f32((uint16_t) (sign | mag));
}

static void test_f16_exhaustive(void **state)
{
    (void) state;
    /* Every half survives the round trip through f32. */
    for (uint32_t h = 0; h < 65536; h++) {
        float f = kvs_f16_to_f32((uint16_t) h);
        if (isnan(f)) {
            assert_true((h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0);
            assert_true(isnan(kvs_f16_to_f32(kvs_f32_to_f16(f))));
            continue;
        }
        assert_int_equal(kvs_f32_to_f16(f), h);
    }
    /* Random floats in the finite half range round to the nearest half, ties to even. */
    uint64_t seed = kvs_test_seed(0x16f16), iters = kvs_test_iters(1000000);
    kvs_rng_t rng;
    kvs_rng_seed(&rng, seed);
    for (uint64_t it = 0; it < iters; it++) {
        /* Exponents around the half range, including far subnormal and overflow. */
        uint32_t exp = (uint32_t) kvs_rng_range(&rng, 127 - 27, 127 + 15);
        uint32_t b = (uint32_t) (kvs_rng_next(&rng) & 0x807fffffu) | exp << 23;
        float f = float_of(b);
        uint16_t h = kvs_f32_to_f16(f);
        double v = kvs_f16_to_f32(h), x = f;
        if (fabs(x) >= 65520.0) {
            if ((h & 0x7fff) != 0x7c00)
                fail_msg("seed %llu: %a -> %04x, want inf", (unsigned long long) seed, f, h);
            continue;
        }
        double err = fabs(v - x);
        double up = fabs(f16_neighbour(h, +1) - x), down = fabs(f16_neighbour(h, -1) - x);
        int ok = err <= up && err <= down;
        if (ok && (err == up || err == down) && err != 0) ok = (h & 1) == 0; /* tie: even */
        if (!ok)
            fail_msg("seed %llu: %a -> %04x (%a); neighbours off by %g and %g",
                     (unsigned long long) seed, f, h, v, up, down);
    }
}

static void test_bf16(void **state)
{
    (void) state;
    assert_int_equal(kvs_f32_to_bf16(1.0f), 0x3f80);
    assert_int_equal(kvs_f32_to_bf16(-2.0f), 0xc000);
    assert_int_equal(bits_of(kvs_bf16_to_f32(0x3f80)), 0x3f800000u);
    assert_int_equal(bits_of(kvs_bf16_to_f32(0x0001)), 0x00010000u); /* f32 subnormal */
    assert_int_equal(kvs_f32_to_bf16(float_of(0x00010000u)), 0x0001);
    assert_int_equal(kvs_f32_to_bf16(float_of(0x00008000u)), 0x0000); /* tie to even zero */
    assert_int_equal(kvs_f32_to_bf16(float_of(0x00018000u)), 0x0002); /* tie up to even */
    assert_int_equal(kvs_f32_to_bf16(float_of(0x3f808000u)), 0x3f80);
    assert_int_equal(kvs_f32_to_bf16(float_of(0x3f818000u)), 0x3f82);
    assert_int_equal(kvs_f32_to_bf16(float_of(0x3f808001u)), 0x3f81);
    assert_int_equal(kvs_f32_to_bf16(float_of(0x3f807fffu)), 0x3f80);
    assert_int_equal(kvs_f32_to_bf16(INFINITY), 0x7f80);
    assert_int_equal(kvs_f32_to_bf16(-INFINITY), 0xff80);
    assert_int_equal(kvs_f32_to_bf16(float_of(0x7f7fffffu)), 0x7f80); /* FLT_MAX overflows */
    assert_int_equal(kvs_f32_to_bf16(-0.0f), 0x8000);
    assert_true(isnan(kvs_bf16_to_f32(kvs_f32_to_bf16(NAN))));
    assert_true(isnan(kvs_bf16_to_f32(kvs_f32_to_bf16(float_of(0x7f800001u)))));
    assert_true(isnan(kvs_bf16_to_f32(kvs_f32_to_bf16(float_of(0xffffffffu)))));
    for (uint32_t h = 0; h < 65536; h++) {
        float f = kvs_bf16_to_f32((uint16_t) h);
        if (isnan(f)) continue;
        assert_int_equal(kvs_f32_to_bf16(f), h);
    }
}

static void test_block_sizes(void **state)
{
    (void) state;
    static const struct {
        kvs_ggml_type_t type;
        uint32_t elems, bytes;
    } table[] = {{KVS_GGML_F32, 1, 4},    {KVS_GGML_F16, 1, 2},    {KVS_GGML_BF16, 1, 2},
                 {KVS_GGML_Q8_0, 32, 34}, {KVS_GGML_Q4_0, 32, 18}, {KVS_GGML_Q4_1, 32, 20}};
    for (size_t i = 0; i < sizeof(table) / sizeof(table[0]); i++) {
        assert_int_equal(kvs_ggml_block_elems(table[i].type), table[i].elems);
        assert_int_equal(kvs_ggml_block_bytes(table[i].type), table[i].bytes);
    }
    assert_int_equal(kvs_ggml_block_elems((kvs_ggml_type_t) 12), 0); /* Q4_K */
    assert_int_equal(kvs_ggml_block_bytes((kvs_ggml_type_t) 12), 0);
    assert_int_equal(kvs_ggml_block_elems((kvs_ggml_type_t) 9999), 0);
}

/* Hand-computed blocks */

static kvs_gguf_tensor_t one_block(kvs_ggml_type_t type, const uint8_t *blk)
{
    kvs_gguf_tensor_t t = {.name = {"blk", 3}, .type = type, .n_dims = 1, .ne = {32, 1, 1, 1}};
    t.data = blk;
    t.bytes = kvs_ggml_block_bytes(type);
    return t;
}

static void test_hand_blocks(void **state)
{
    (void) state;
    float x[32];
    uint8_t blk[34];

    /* Q8_0: d = 0.25 (f16 0x3400), q[j] = j - 16 except q[0] = 127, q[1] = -128. */
    blk[0] = 0x00, blk[1] = 0x34;
    for (int j = 0; j < 32; j++) blk[2 + j] = (uint8_t) (j - 16);
    blk[2] = 127;
    blk[3] = 0x80;
    kvs_gguf_tensor_t t = one_block(KVS_GGML_Q8_0, blk);
    assert_int_equal(kvs_gguf_dequant(&t, 0, 1, 0, 32, x), KVS_OK);
    assert_true(x[0] == 31.75f && x[1] == -32.0f && x[2] == -3.5f && x[16] == 0.0f &&
                x[17] == 0.25f && x[31] == 3.75f);
    for (int j = 2; j < 32; j++) assert_true(x[j] == (float) (j - 16) * 0.25f);

    /* Q4_0: d = -2 (0xc000); byte j = j | (15 - j) << 4, so element j = (j - 8) * -2 and
     * element 16 + j = (7 - j) * -2. */
    blk[0] = 0x00, blk[1] = 0xc0;
    for (int j = 0; j < 16; j++) blk[2 + j] = (uint8_t) (j | (15 - j) << 4);
    t = one_block(KVS_GGML_Q4_0, blk);
    assert_int_equal(kvs_gguf_dequant(&t, 0, 1, 0, 32, x), KVS_OK);
    assert_true(x[0] == 16.0f && x[1] == 14.0f && x[8] == 0.0f && x[15] == -14.0f &&
                x[16] == -14.0f && x[23] == 0.0f && x[31] == 16.0f);
    for (int j = 0; j < 16; j++) {
        assert_true(x[j] == (float) (16 - 2 * j));
        assert_true(x[16 + j] == (float) (2 * j - 14));
    }

    /* Q4_1: d = 0.5 (0x3800), m = -1 (0xbc00), same nibbles: element j = 0.5 j - 1 and
     * element 16 + j = 0.5 (15 - j) - 1. */
    blk[0] = 0x00, blk[1] = 0x38, blk[2] = 0x00, blk[3] = 0xbc;
    for (int j = 0; j < 16; j++) blk[4 + j] = (uint8_t) (j | (15 - j) << 4);
    t = one_block(KVS_GGML_Q4_1, blk);
    assert_int_equal(kvs_gguf_dequant(&t, 0, 1, 0, 32, x), KVS_OK);
    assert_true(x[0] == -1.0f && x[1] == -0.5f && x[2] == 0.0f && x[15] == 6.5f && x[16] == 6.5f &&
                x[29] == 0.0f && x[31] == -1.0f);
    for (int j = 0; j < 16; j++) {
        assert_true(x[j] == 0.5f * (float) j - 1.0f);
        assert_true(x[16 + j] == 0.5f * (float) (15 - j) - 1.0f);
    }
    /* A cut inside the block: columns [13, 20). */
    float cut[7];
    assert_int_equal(kvs_gguf_dequant(&t, 0, 1, 13, 7, cut), KVS_OK);
    assert_memory_equal(cut, x + 13, sizeof(cut));

    /* Q4_1 where the product must be rounded before the add: d = 0x3555 (0.33325195...),
     * m = 0x2e66 (0.0999755859375), nibble 7. */
    blk[0] = 0x55, blk[1] = 0x35, blk[2] = 0x66, blk[3] = 0x2e;
    memset(blk + 4, 0x77, 16);
    t = one_block(KVS_GGML_Q4_1, blk);
    assert_int_equal(kvs_gguf_dequant(&t, 0, 1, 0, 32, x), KVS_OK);
    volatile float prod = 0.333251953125f * 7.0f;
    float want = prod + 0.0999755859375f;
    for (int j = 0; j < 32; j++) assert_int_equal(bits_of(x[j]), bits_of(want));

    /* F16 / BF16 / F32 elements. */
    const uint8_t h[4] = {0x00, 0x3c, 0x01, 0x80}; /* 1.0, -2^-24 */
    kvs_gguf_tensor_t th = {
        .type = KVS_GGML_F16, .n_dims = 1, .ne = {2, 1, 1, 1}, .data = h, .bytes = 4};
    assert_int_equal(kvs_gguf_dequant(&th, 0, 1, 0, 2, x), KVS_OK);
    assert_true(x[0] == 1.0f && x[1] == -0x1p-24f);
    th.type = KVS_GGML_BF16; /* 0x3c00 -> 2^-7, 0x8001 -> -2^-133 */
    assert_int_equal(kvs_gguf_dequant(&th, 0, 1, 0, 2, x), KVS_OK);
    assert_true(x[0] == 0x1p-7f && x[1] == -0x1p-133f);
    const uint8_t f[4] = {0x00, 0x00, 0xc0, 0x3f}; /* 1.5 */
    kvs_gguf_tensor_t tf = {
        .type = KVS_GGML_F32, .n_dims = 1, .ne = {1, 1, 1, 1}, .data = f, .bytes = 4};
    assert_int_equal(kvs_gguf_dequant(&tf, 0, 1, 0, 1, x), KVS_OK);
    assert_true(x[0] == 1.5f);
}

/* Metadata round trips */

static const char *const strings[] = {"", "a", "<|im_start|>", "\xc4\xa0t", "longer string"};

static void build_all_metadata(gw_t *w, uint32_t version)
{
    gw_init(w, version);
    gw_kv_u8(w, "t.u8", 200);
    gw_kv_i8(w, "t.i8", -5);
    gw_kv_i8(w, "t.i8pos", 100);
    gw_kv_u16(w, "t.u16", 65000);
    gw_kv_i16(w, "t.i16", -30000);
    gw_kv_u32(w, "t.u32", 4000000000u);
    gw_kv_i32(w, "t.i32", -2000000000);
    gw_kv_i32(w, "t.i32pos", 2000000000);
    gw_kv_f32(w, "t.f32", 1e-5f);
    gw_kv_bool(w, "t.true", 1);
    gw_kv_bool(w, "t.false", 0);
    gw_kv_str(w, "t.str", "llama");
    gw_kv_str(w, "t.empty", "");
    gw_kv_u64(w, "t.u64", 4294967295ull);
    gw_kv_u64(w, "t.u64big", 4294967296ull);
    gw_kv_i64(w, "t.i64", -1);
    gw_kv_i64(w, "t.i64pos", 7);
    gw_kv_f64(w, "t.f64", 100000.0);
    gw_kv_f64(w, "t.f64big", 1e300);
    gw_kv_str(w, "a", "prefix of ab");
    gw_kv_str(w, "ab", "not a prefix");

    static const uint8_t u8s[] = {0, 255, 7};
    static const int8_t i8s[] = {-128, 127, 0};
    static const uint16_t u16s[] = {0, 65535};
    static const int16_t i16s[] = {-32768, 32767};
    static const uint32_t u32s[] = {1, 4294967295u, 3};
    static const int32_t i32s[] = {-2147483647 - 1, 2147483647, 3, 1};
    static const uint64_t u64s[] = {18446744073709551615ull, 9223372036854775807ull, 0};
    static const int64_t i64s[] = {-9223372036854775807ll - 1, 9223372036854775807ll};
    static const float f32s[] = {1.5f, -0.0f, INFINITY};
    static const double f64s[] = {0.25, -1e300, 1e-300};
    static const uint8_t bools[] = {1, 0, 1};
    gw_kv_array(w, "a.u8", KVS_GGUF_U8, 3, u8s);
    gw_kv_array(w, "a.i8", KVS_GGUF_I8, 3, i8s);
    gw_kv_array(w, "a.u16", KVS_GGUF_U16, 2, u16s);
    gw_kv_array(w, "a.i16", KVS_GGUF_I16, 2, i16s);
    gw_kv_array(w, "a.u32", KVS_GGUF_U32, 3, u32s);
    gw_kv_array(w, "a.i32", KVS_GGUF_I32, 4, i32s);
    gw_kv_array(w, "a.u64", KVS_GGUF_U64, 3, u64s);
    gw_kv_array(w, "a.i64", KVS_GGUF_I64, 2, i64s);
    gw_kv_array(w, "a.f32", KVS_GGUF_F32, 3, f32s);
    gw_kv_array(w, "a.f64", KVS_GGUF_F64, 3, f64s);
    gw_kv_array(w, "a.bool", KVS_GGUF_BOOL, 3, bools);
    gw_kv_array(w, "a.str", KVS_GGUF_STRING, 5, strings);
    gw_kv_array(w, "a.empty", KVS_GGUF_U32, 0, NULL);
    gw_kv_array(w, "a.emptystr", KVS_GGUF_STRING, 0, NULL);

    /* [[1, 2], [], [["x", "yz"]]]: arrays of arrays, one holding an array of strings. */
    gw_bytes_t v = {0};
    static const uint32_t one_two[] = {1, 2};
    static const char *const xyz[] = {"x", "yz"};
    gw_put_u32(&v, KVS_GGUF_ARRAY);
    gw_put_u64(&v, 3);
    gw_put_array(&v, KVS_GGUF_U32, 2, one_two);
    gw_put_array(&v, KVS_GGUF_F32, 0, NULL);
    gw_put_u32(&v, KVS_GGUF_ARRAY);
    gw_put_u64(&v, 1);
    gw_put_array(&v, KVS_GGUF_STRING, 2, xyz);
    assert_false(v.oom);
    gw_kv_raw(w, "a.nested", KVS_GGUF_ARRAY, v.p, v.len);
    kvs_free(v.p);
    gw_kv_str(w, "after.nested", "still found");
}

static void assert_str(kvs_gguf_str_t s, const char *want)
{
    if (s.len != strlen(want) || memcmp(s.ptr, want, s.len) != 0)
        fail_msg("string '%.*s', want '%s'", (int) s.len, s.ptr, want);
}

static void check_all_metadata(const kvs_gguf_t *g)
{
    uint32_t u;
    float f;
    int b;
    int64_t i64;
    kvs_gguf_str_t s;
    kvs_gguf_type_t type;
    uint64_t count;
    kvs_log_capture_t cap = {.errors_only = 1};
    kvs_log_set_sink(kvs_log_capture_sink, &cap);

    /* u32 accepts any integer type with a value in range. */
    static const struct {
        const char *key;
        kvs_status_t st;
        uint32_t v;
    } u32s[] = {{"t.u8", KVS_OK, 200},
                {"t.i8", KVS_ERR_INVALID, 0},
                {"t.i8pos", KVS_OK, 100},
                {"t.u16", KVS_OK, 65000},
                {"t.i16", KVS_ERR_INVALID, 0},
                {"t.u32", KVS_OK, 4000000000u},
                {"t.i32", KVS_ERR_INVALID, 0},
                {"t.i32pos", KVS_OK, 2000000000},
                {"t.u64", KVS_OK, 4294967295u},
                {"t.u64big", KVS_ERR_INVALID, 0},
                {"t.i64", KVS_ERR_INVALID, 0},
                {"t.i64pos", KVS_OK, 7},
                {"t.f32", KVS_ERR_INVALID, 0},
                {"t.true", KVS_ERR_INVALID, 0},
                {"t.str", KVS_ERR_INVALID, 0},
                {"a.u32", KVS_ERR_INVALID, 0},
                {"missing", KVS_ERR_NOT_FOUND, 0},
                {"t.u", KVS_ERR_NOT_FOUND, 0},
                {"t.u80", KVS_ERR_NOT_FOUND, 0}};
    for (size_t i = 0; i < sizeof(u32s) / sizeof(u32s[0]); i++) {
        u = 12345;
        cap.calls = 0;
        kvs_status_t st = kvs_gguf_u32(g, u32s[i].key, &u);
        if (st != u32s[i].st)
            fail_msg("u32 %s: %s, want %s", u32s[i].key, kvs_status_str(st),
                     kvs_status_str(u32s[i].st));
        assert_int_equal(u, st == KVS_OK ? u32s[i].v : 12345u); /* written only on success */
        assert_int_equal(cap.calls, st == KVS_ERR_INVALID);     /* NOT_FOUND is not logged */
    }

    assert_int_equal(kvs_gguf_f32(g, "t.f32", &f), KVS_OK);
    assert_true(f == 1e-5f);
    assert_int_equal(kvs_gguf_f32(g, "t.f64", &f), KVS_OK);
    assert_true(f == 100000.0f);
    assert_int_equal(kvs_gguf_f32(g, "t.f64big", &f), KVS_ERR_INVALID);
    assert_int_equal(kvs_gguf_f32(g, "t.u32", &f), KVS_ERR_INVALID);
    assert_int_equal(kvs_gguf_f32(g, "nope", &f), KVS_ERR_NOT_FOUND);

    b = 7;
    assert_int_equal(kvs_gguf_bool(g, "t.true", &b), KVS_OK);
    assert_int_equal(b, 1);
    assert_int_equal(kvs_gguf_bool(g, "t.false", &b), KVS_OK);
    assert_int_equal(b, 0);
    assert_int_equal(kvs_gguf_bool(g, "t.u8", &b), KVS_ERR_INVALID);
    assert_int_equal(kvs_gguf_bool(g, "nope", &b), KVS_ERR_NOT_FOUND);

    assert_int_equal(kvs_gguf_str(g, "t.str", &s), KVS_OK);
    assert_str(s, "llama");
    assert_int_equal(kvs_gguf_str(g, "t.empty", &s), KVS_OK);
    assert_int_equal(s.len, 0);
    assert_int_equal(kvs_gguf_str(g, "a", &s), KVS_OK);
    assert_str(s, "prefix of ab");
    assert_int_equal(kvs_gguf_str(g, "ab", &s), KVS_OK);
    assert_str(s, "not a prefix");
    assert_int_equal(kvs_gguf_str(g, "after.nested", &s), KVS_OK);
    assert_str(s, "still found");
    assert_int_equal(kvs_gguf_str(g, "t.u8", &s), KVS_ERR_INVALID);
    assert_int_equal(kvs_gguf_str(g, "a.str", &s), KVS_ERR_INVALID);
    assert_int_equal(kvs_gguf_str(g, "", &s), KVS_ERR_NOT_FOUND);

    /* Arrays: type, count, elements. */
    static const struct {
        const char *key;
        kvs_gguf_type_t type;
        uint64_t count;
    } arrays[] = {{"a.u8", KVS_GGUF_U8, 3},       {"a.i8", KVS_GGUF_I8, 3},
                  {"a.u16", KVS_GGUF_U16, 2},     {"a.i16", KVS_GGUF_I16, 2},
                  {"a.u32", KVS_GGUF_U32, 3},     {"a.i32", KVS_GGUF_I32, 4},
                  {"a.u64", KVS_GGUF_U64, 3},     {"a.i64", KVS_GGUF_I64, 2},
                  {"a.f32", KVS_GGUF_F32, 3},     {"a.f64", KVS_GGUF_F64, 3},
                  {"a.bool", KVS_GGUF_BOOL, 3},   {"a.str", KVS_GGUF_STRING, 5},
                  {"a.empty", KVS_GGUF_U32, 0},   {"a.emptystr", KVS_GGUF_STRING, 0},
                  {"a.nested", KVS_GGUF_ARRAY, 3}};
    for (size_t i = 0; i < sizeof(arrays) / sizeof(arrays[0]); i++) {
        assert_int_equal(kvs_gguf_array(g, arrays[i].key, &type, &count), KVS_OK);
        assert_int_equal(type, arrays[i].type);
        assert_int_equal(count, arrays[i].count);
        assert_int_equal(kvs_gguf_array_i64(g, arrays[i].key, count, &i64), KVS_ERR_INVALID);
    }
    assert_int_equal(kvs_gguf_array(g, "t.u8", &type, &count), KVS_ERR_INVALID);
    assert_int_equal(kvs_gguf_array(g, "a.none", &type, &count), KVS_ERR_NOT_FOUND);

    static const struct {
        const char *key;
        uint64_t i;
        kvs_status_t st;
        int64_t v;
    } ints[] = {{"a.u8", 1, KVS_OK, 255},
                {"a.i8", 0, KVS_OK, -128},
                {"a.i8", 1, KVS_OK, 127},
                {"a.u16", 1, KVS_OK, 65535},
                {"a.i16", 0, KVS_OK, -32768},
                {"a.u32", 1, KVS_OK, 4294967295ll},
                {"a.i32", 0, KVS_OK, -2147483647ll - 1},
                {"a.i32", 3, KVS_OK, 1},
                {"a.u64", 0, KVS_ERR_INVALID, 0},
                {"a.u64", 1, KVS_OK, 9223372036854775807ll},
                {"a.i64", 0, KVS_OK, -9223372036854775807ll - 1},
                {"a.f32", 0, KVS_ERR_INVALID, 0},
                {"a.bool", 0, KVS_ERR_INVALID, 0},
                {"a.str", 0, KVS_ERR_INVALID, 0},
                {"a.nested", 0, KVS_ERR_INVALID, 0},
                {"t.i32", 0, KVS_ERR_INVALID, 0},
                {"a.missing", 0, KVS_ERR_NOT_FOUND, 0}};
    for (size_t i = 0; i < sizeof(ints) / sizeof(ints[0]); i++) {
        i64 = 42;
        kvs_status_t st = kvs_gguf_array_i64(g, ints[i].key, ints[i].i, &i64);
        if (st != ints[i].st)
            fail_msg("i64 %s[%llu]: %s", ints[i].key, (unsigned long long) ints[i].i,
                     kvs_status_str(st));
        assert_true(i64 == (st == KVS_OK ? ints[i].v : 42));
    }

    assert_int_equal(kvs_gguf_array_f32(g, "a.f32", 0, &f), KVS_OK);
    assert_true(f == 1.5f);
    assert_int_equal(kvs_gguf_array_f32(g, "a.f32", 1, &f), KVS_OK);
    assert_int_equal(bits_of(f), 0x80000000u);
    assert_int_equal(kvs_gguf_array_f32(g, "a.f32", 2, &f), KVS_OK);
    assert_true(isinf(f));
    assert_int_equal(kvs_gguf_array_f32(g, "a.f32", 3, &f), KVS_ERR_INVALID);
    assert_int_equal(kvs_gguf_array_f32(g, "a.f64", 0, &f), KVS_OK);
    assert_true(f == 0.25f);
    assert_int_equal(kvs_gguf_array_f32(g, "a.f64", 1, &f), KVS_ERR_INVALID); /* -1e300 */
    assert_int_equal(kvs_gguf_array_f32(g, "a.f64", 2, &f), KVS_OK);
    assert_true(f == 0.0f);
    assert_int_equal(kvs_gguf_array_f32(g, "a.i32", 0, &f), KVS_ERR_INVALID);

    for (uint64_t i = 0; i < 5; i++) {
        assert_int_equal(kvs_gguf_array_str(g, "a.str", i, &s), KVS_OK);
        assert_str(s, strings[i]);
    }
    assert_int_equal(kvs_gguf_array_str(g, "a.str", 5, &s), KVS_ERR_INVALID);
    assert_int_equal(kvs_gguf_array_str(g, "a.emptystr", 0, &s), KVS_ERR_INVALID);
    assert_int_equal(kvs_gguf_array_str(g, "a.u8", 0, &s), KVS_ERR_INVALID);
    assert_int_equal(kvs_gguf_array_str(g, "t.str", 0, &s), KVS_ERR_INVALID);
    assert_int_equal(kvs_gguf_array_str(g, "a.nope", 0, &s), KVS_ERR_NOT_FOUND);
    kvs_log_set_sink(NULL, NULL);
}

static void test_metadata_roundtrip(void **state)
{
    (void) state;
    for (uint32_t version = 2; version <= 3; version++) {
        gw_t w;
        build_all_metadata(&w, version);
        size_t len;
        uint8_t *buf = gw_finish(&w, &len);
        assert_non_null(buf);
        kvs_gguf_t *g;
        assert_int_equal(kvs_gguf_open_buffer(buf, len, &g), KVS_OK);
        check_all_metadata(g);

        /* File order, with types, through kv_at. */
        assert_int_equal(kvs_gguf_kv_count(g), w.n_kv);
        kvs_gguf_str_t k;
        kvs_gguf_type_t type;
        assert_int_equal(kvs_gguf_kv_at(g, 0, &k, &type), KVS_OK);
        assert_str(k, "t.u8");
        assert_int_equal(type, KVS_GGUF_U8);
        assert_int_equal(kvs_gguf_kv_at(g, 11, &k, &type), KVS_OK);
        assert_str(k, "t.str");
        assert_int_equal(type, KVS_GGUF_STRING);
        assert_int_equal(kvs_gguf_kv_at(g, w.n_kv - 1, &k, &type), KVS_OK);
        assert_str(k, "after.nested");
        kvs_log_capture_t cap = {.errors_only = 1};
        kvs_log_set_sink(kvs_log_capture_sink, &cap);
        assert_int_equal(kvs_gguf_kv_at(g, w.n_kv, &k, &type), KVS_ERR_INVALID);
        kvs_log_set_sink(NULL, NULL);
        assert_int_equal(cap.calls, 1);
        assert_int_equal(kvs_gguf_tensor_count(g), 0);
        kvs_gguf_tensor_t t;
        assert_int_equal(kvs_gguf_tensor(g, "x", &t), KVS_ERR_NOT_FOUND);
        kvs_gguf_close(g);
        kvs_free(buf);
        gw_free(&w);
    }
    kvs_assert_no_leaks();
}

/* Tensor round trips */

/* The data offset of tensor i as written. */
static uint64_t written_offset(const uint8_t *buf, const gw_t *w, uint64_t i)
{
    uint64_t v = 0;
    for (int k = 7; k >= 0; k--) v = v << 8 | buf[w->tensor_pos[i].offset + (size_t) k];
    return v;
}

/* Deterministic test values with a spread of magnitudes and signs. */
static void fill_values(float *x, uint64_t n, kvs_rng_t *rng)
{
    for (uint64_t i = 0; i < n; i++) {
        double u = (double) kvs_rng_below(rng, 1u << 24) / (1u << 24) - 0.5;
        x[i] = (float) (u * (1.0 + (double) (i % 7)) + 0.01 * sin((double) i));
    }
}

static void check_tensor_values(kvs_ggml_type_t type, const kvs_gguf_tensor_t *t, const float *x)
{
    uint64_t ne0 = t->ne[0], rows = t->ne[1] * t->ne[2] * t->ne[3], n = ne0 * rows;
    float *y = kvs_malloc(n * sizeof(float));
    assert_non_null(y);
    assert_int_equal(kvs_gguf_dequant(t, 0, rows, 0, ne0, y), KVS_OK);
    for (uint64_t i = 0; i < n; i++) {
        float want = ref_elem(type, t->data, i);
        if (bits_of(y[i]) != bits_of(want))
            fail_msg("type %d element %llu: %a, formula %a", (int) type, (unsigned long long) i,
                     y[i], want);
        /* And the encoding represents the input: exact, half rounding or within a step. */
        float err = fabsf(y[i] - x[i]);
        switch (type) {
        case KVS_GGML_F32:
            assert_true(err == 0);
            break;
        case KVS_GGML_F16:
            assert_int_equal(bits_of(y[i]), bits_of(kvs_f16_to_f32(kvs_f32_to_f16(x[i]))));
            break;
        case KVS_GGML_BF16:
            assert_int_equal(bits_of(y[i]), bits_of(kvs_bf16_to_f32(kvs_f32_to_bf16(x[i]))));
            break;
        default: {
            uint64_t b0 = i / 32 * 32;
            float amax = 0, min = x[b0], max = x[b0];
            for (uint64_t j = b0; j < b0 + 32; j++) {
                amax = fmaxf(amax, fabsf(x[j]));
                min = fminf(min, x[j]);
                max = fmaxf(max, x[j]);
            }
            float bound = type == KVS_GGML_Q8_0   ? 0.6f * amax / 127
                          : type == KVS_GGML_Q4_0 ? 1.1f * amax / 8
                                                  : 0.6f * (max - min) / 15 + fabsf(min) / 1024;
            if (err > bound + 1e-7f)
                fail_msg("type %d element %llu: %g decodes to %g (bound %g)", (int) type,
                         (unsigned long long) i, x[i], y[i], bound);
        }
        }
    }
    kvs_free(y);
}

static void test_tensor_roundtrip(void **state)
{
    (void) state;
    static const struct {
        uint32_t n_dims;
        uint64_t ne[4];
    } shapes[] = {{1, {64, 1, 1, 1}}, {2, {96, 3, 1, 1}}, {3, {32, 2, 3, 1}}, {4, {32, 1, 2, 2}}};
    kvs_rng_t rng;
    kvs_rng_seed(&rng, kvs_test_seed(7));
    float *x[N_TYPES][4];
    gw_t w;
    gw_init(&w, 3);
    gw_alignment(&w, 64);
    gw_kv_str(&w, "general.architecture", "test");
    for (size_t ti = 0; ti < N_TYPES; ti++) {
        for (size_t si = 0; si < 4; si++) {
            uint64_t n = shapes[si].ne[0] * shapes[si].ne[1] * shapes[si].ne[2] * shapes[si].ne[3];
            x[ti][si] = kvs_malloc(n * sizeof(float));
            assert_non_null(x[ti][si]);
            fill_values(x[ti][si], n, &rng);
            char name[32];
            snprintf(name, sizeof(name), "t%zu.s%zu", ti, si);
            gw_tensor_f32(&w, name, all_types[ti], shapes[si].n_dims, shapes[si].ne, x[ti][si]);
        }
    }
    size_t len;
    uint8_t *buf = gw_finish(&w, &len);
    assert_non_null(buf);
    assert_int_equal(w.data_start % 64, 0);
    kvs_gguf_t *g;
    assert_int_equal(kvs_gguf_open_buffer(buf, len, &g), KVS_OK);
    assert_int_equal(kvs_gguf_tensor_count(g), N_TYPES * 4);
    uint32_t align;
    assert_int_equal(kvs_gguf_u32(g, "general.alignment", &align), KVS_OK);
    assert_int_equal(align, 64);
    for (size_t ti = 0; ti < N_TYPES; ti++) {
        for (size_t si = 0; si < 4; si++) {
            uint64_t idx = ti * 4 + si;
            kvs_gguf_tensor_t t, byname;
            assert_int_equal(kvs_gguf_tensor_at(g, idx, &t), KVS_OK);
            char name[32];
            snprintf(name, sizeof(name), "t%zu.s%zu", ti, si);
            assert_str(t.name, name);
            assert_int_equal(kvs_gguf_tensor(g, name, &byname), KVS_OK);
            assert_memory_equal(&t, &byname, sizeof(t));
            assert_int_equal(t.type, all_types[ti]);
            assert_int_equal(t.n_dims, shapes[si].n_dims);
            uint64_t n = 1;
            for (int d = 0; d < 4; d++) {
                assert_int_equal(t.ne[d], shapes[si].ne[d]);
                n *= t.ne[d];
            }
            assert_int_equal(t.bytes,
                             n / kvs_ggml_block_elems(t.type) * kvs_ggml_block_bytes(t.type));
            uint64_t off = written_offset(buf, &w, idx);
            assert_ptr_equal(t.data, buf + w.data_start + off);
            assert_int_equal((size_t) (t.data - buf) % 64, 0);
            check_tensor_values(all_types[ti], &t, x[ti][si]);
            kvs_free(x[ti][si]);
        }
    }
    kvs_gguf_tensor_t t;
    assert_int_equal(kvs_gguf_tensor(g, "t0.s", &t), KVS_ERR_NOT_FOUND);
    assert_int_equal(kvs_gguf_tensor(g, "t0.s00", &t), KVS_ERR_NOT_FOUND);
    assert_int_equal(kvs_gguf_tensor(g, "", &t), KVS_ERR_NOT_FOUND);
    kvs_log_capture_t cap = {.errors_only = 1};
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    assert_int_equal(kvs_gguf_tensor_at(g, N_TYPES * 4, &t), KVS_ERR_INVALID);
    kvs_log_set_sink(NULL, NULL);
    kvs_gguf_close(g);
    kvs_free(buf);
    gw_free(&w);
    kvs_assert_no_leaks();
}

/* Sub-range dequantisation */

static void test_subrange_random(void **state)
{
    (void) state;
    uint64_t seed = kvs_test_seed(0x5ab5);
    uint64_t iters = kvs_test_iters(300);
    kvs_rng_t rng;
    kvs_rng_seed(&rng, seed);
    enum { NE0 = 160, ROWS = 7 };
    float x[NE0 * ROWS], full[NE0 * ROWS], cut[NE0 * ROWS + 1];
    uint8_t data[NE0 * ROWS * 4];
    for (size_t ti = 0; ti < N_TYPES; ti++) {
        kvs_ggml_type_t type = all_types[ti];
        fill_values(x, NE0 * ROWS, &rng);
        gw_quantize(type, x, NE0 * ROWS, data);
        kvs_gguf_tensor_t t = {
            .name = {"r", 1}, .type = type, .n_dims = 2, .ne = {NE0, ROWS, 1, 1}, .data = data};
        t.bytes = (uint64_t) NE0 * ROWS / kvs_ggml_block_elems(type) * kvs_ggml_block_bytes(type);
        assert_int_equal(kvs_gguf_dequant(&t, 0, ROWS, 0, NE0, full), KVS_OK);
        for (uint64_t it = 0; it < iters; it++) {
            uint64_t row0 = kvs_rng_below(&rng, ROWS), col0 = kvs_rng_below(&rng, NE0);
            uint64_t nrows = kvs_rng_range(&rng, 1, ROWS - row0);
            uint64_t ncols = kvs_rng_range(&rng, 1, NE0 - col0);
            memset(cut, 0xff, sizeof(cut));
            assert_int_equal(kvs_gguf_dequant(&t, row0, nrows, col0, ncols, cut), KVS_OK);
            for (uint64_t r = 0; r < nrows; r++) {
                if (memcmp(cut + r * ncols, full + (row0 + r) * NE0 + col0, ncols * 4) != 0)
                    fail_msg("seed %llu type %d: rows [%llu,+%llu) cols [%llu,+%llu) differ",
                             (unsigned long long) seed, (int) type, (unsigned long long) row0,
                             (unsigned long long) nrows, (unsigned long long) col0,
                             (unsigned long long) ncols);
            }
            /* Nothing past the output was written. */
            assert_int_equal(bits_of(cut[nrows * ncols]), 0xffffffffu);
        }
    }
}

static void test_dequant_errors(void **state)
{
    (void) state;
    uint8_t data[2 * 3 * 34] = {0};
    kvs_gguf_tensor_t t = {.name = {"q", 1},
                           .type = KVS_GGML_Q8_0,
                           .n_dims = 2,
                           .ne = {64, 3, 1, 1},
                           .data = data,
                           .bytes = sizeof(data)};
    float out[64 * 3];
    out[0] = 42.0f;
    kvs_log_capture_t cap = {.errors_only = 1};
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    assert_int_equal(kvs_gguf_dequant(&t, 0, 0, 0, 64, out), KVS_OK); /* empty: no write */
    assert_int_equal(kvs_gguf_dequant(&t, 3, 0, 0, 64, out), KVS_OK);
    assert_int_equal(kvs_gguf_dequant(&t, 0, 3, 64, 0, out), KVS_OK);
    assert_true(out[0] == 42.0f);
    assert_int_equal(cap.calls, 0);
    static const uint64_t bad[][4] = {
        {0, 4, 0, 64},         {3, 1, 0, 64},        {4, 0, 0, 1},          {0, 1, 0, 65},
        {0, 1, 1, 64},         {0, 1, 65, 0},        {UINT64_MAX, 2, 0, 1}, {1, UINT64_MAX, 0, 1},
        {0, 1, UINT64_MAX, 2}, {0, 1, 1, UINT64_MAX}};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        cap.calls = 0;
        assert_int_equal(kvs_gguf_dequant(&t, bad[i][0], bad[i][1], bad[i][2], bad[i][3], out),
                         KVS_ERR_INVALID);
        assert_int_equal(cap.calls, 1);
    }
    /* A descriptor whose size, shape or type disagree is refused. */
    kvs_gguf_tensor_t u = t;
    u.bytes--;
    assert_int_equal(kvs_gguf_dequant(&u, 0, 1, 0, 1, out), KVS_ERR_INVALID);
    u = t;
    u.ne[0] = 48;
    assert_int_equal(kvs_gguf_dequant(&u, 0, 1, 0, 1, out), KVS_ERR_INVALID);
    u = t;
    u.type = (kvs_ggml_type_t) 12;
    assert_int_equal(kvs_gguf_dequant(&u, 0, 1, 0, 1, out), KVS_ERR_INVALID);
    u = t;
    u.ne[2] = UINT64_MAX;
    assert_int_equal(kvs_gguf_dequant(&u, 0, 1, 0, 1, out), KVS_ERR_INVALID);
    u = t;
    u.data = NULL;
    assert_int_equal(kvs_gguf_dequant(&u, 0, 1, 0, 1, out), KVS_ERR_INVALID);
    assert_int_equal(kvs_gguf_dequant(NULL, 0, 1, 0, 1, out), KVS_ERR_INVALID);
    assert_int_equal(kvs_gguf_dequant(&t, 0, 1, 0, 1, NULL), KVS_ERR_INVALID);
    kvs_log_set_sink(NULL, NULL);
}

/* Malformed files */

/* A small valid file: metadata of several kinds (a string array and nested arrays among
 * them) and three tensors, the last ending exactly at the end of the file. */
static uint8_t *build_small(gw_t *w, uint32_t version, size_t *len_p)
{
    gw_init(w, version);
    gw_kv_str(w, "general.architecture", "llama");
    gw_kv_u32(w, "llama.block_count", 2);
    gw_alignment(w, 32);
    gw_kv_f32(w, "llama.rope.freq_base", 10000.0f);
    gw_kv_bool(w, "tokenizer.ggml.add_bos_token", 1);
    static const char *const toks[] = {"<s>", "a", "bc"};
    gw_kv_array(w, "tokenizer.ggml.tokens", KVS_GGUF_STRING, 3, toks);
    static const int32_t types[] = {3, 1, 1};
    gw_kv_array(w, "tokenizer.ggml.token_type", KVS_GGUF_I32, 3, types);
    gw_bytes_t v = {0};
    static const uint16_t u16s[] = {1, 2, 3};
    gw_put_u32(&v, KVS_GGUF_ARRAY);
    gw_put_u64(&v, 2);
    gw_put_array(&v, KVS_GGUF_U16, 3, u16s);
    gw_put_array(&v, KVS_GGUF_STRING, 2, toks);
    gw_kv_raw(w, "test.nested", KVS_GGUF_ARRAY, v.p, v.len);
    kvs_free(v.p);
    float x[64 * 2];
    for (int i = 0; i < 64 * 2; i++) x[i] = (float) i / 16 - 3;
    const uint64_t ne_q[] = {64, 2}, ne_h[] = {32}, ne_f[] = {8};
    gw_tensor_f32(w, "q", KVS_GGML_Q8_0, 2, ne_q, x);
    gw_tensor_f32(w, "h", KVS_GGML_F16, 1, ne_h, x);
    gw_tensor_f32(w, "f", KVS_GGML_F32, 1, ne_f, x); /* 32 bytes: ends the file unpadded */
    uint8_t *buf = gw_finish(w, len_p);
    assert_non_null(buf);
    return buf;
}

static void test_small_file_valid(void **state)
{
    (void) state;
    for (uint32_t version = 2; version <= 3; version++) {
        gw_t w;
        size_t len;
        uint8_t *buf = build_small(&w, version, &len);
        open_expect(buf, len, KVS_OK, "valid");
        kvs_gguf_t *g;
        assert_int_equal(kvs_gguf_open_buffer(buf, len, &g), KVS_OK);
        kvs_gguf_tensor_t t;
        assert_int_equal(kvs_gguf_tensor(g, "f", &t), KVS_OK);
        assert_ptr_equal(t.data + t.bytes, buf + len);
        kvs_log_capture_t cap = {.errors_only = 1};
        kvs_log_set_sink(kvs_log_capture_sink, &cap);
        assert_true(gw_walk(g) > 100);
        kvs_log_set_sink(NULL, NULL);
        kvs_gguf_close(g);
        kvs_free(buf);
        gw_free(&w);
    }
    kvs_assert_no_leaks();
}

static void test_every_truncation(void **state)
{
    (void) state;
    gw_t w;
    size_t len;
    uint8_t *buf = build_small(&w, 3, &len);
    for (size_t n = 0; n < len; n++) open_expect(buf, n, KVS_ERR_PROTOCOL, "truncated");
    open_expect(NULL, 0, KVS_ERR_PROTOCOL, "NULL buffer");
    kvs_free(buf);
    gw_free(&w);
    kvs_assert_no_leaks();
}

/* Builds the small file, patches one field, expects a status. */
static void corrupt_expect(size_t (*pos)(const gw_t *), uint64_t value, int bytes,
                           kvs_status_t want, const char *what)
{
    gw_t w;
    size_t len;
    uint8_t *buf = build_small(&w, 3, &len);
    gw_patch(buf, pos(&w), value, bytes);
    open_expect(buf, len, want, what);
    kvs_free(buf);
    gw_free(&w);
}

static size_t pos_magic(const gw_t *w)
{
    (void) w;
    return 0;
}
static size_t pos_version(const gw_t *w)
{
    (void) w;
    return GW_POS_VERSION;
}
static size_t pos_n_tensors(const gw_t *w)
{
    (void) w;
    return GW_POS_N_TENSORS;
}
static size_t pos_n_kv(const gw_t *w)
{
    (void) w;
    return GW_POS_N_KV;
}
static size_t pos_key_len(const gw_t *w) /* kv 0 */
{
    return w->kv_pos[0].key_len;
}
static size_t pos_kv_type(const gw_t *w) /* kv 1, a u32 */
{
    return w->kv_pos[1].type;
}
static size_t pos_alignment(const gw_t *w) /* kv 2's value */
{
    return w->kv_pos[2].value;
}
static size_t pos_alignment_type(const gw_t *w)
{
    return w->kv_pos[2].type;
}
static size_t pos_bool(const gw_t *w) /* kv 4's value */
{
    return w->kv_pos[4].value;
}
static size_t pos_str_array_elem_type(const gw_t *w) /* kv 5 */
{
    return w->kv_pos[5].value;
}
static size_t pos_str_array_count(const gw_t *w)
{
    return w->kv_pos[5].value + 4;
}
static size_t pos_str_array_elem1_len(const gw_t *w) /* after "<s>" */
{
    return w->kv_pos[5].value + 12 + 8 + 3;
}
static size_t pos_i32_array_count(const gw_t *w) /* kv 6 */
{
    return w->kv_pos[6].value + 4;
}
static size_t pos_nested_elem_type(const gw_t *w) /* kv 7: the inner arrays' first type */
{
    return w->kv_pos[7].value + 12;
}
static size_t pos_nested_count(const gw_t *w)
{
    return w->kv_pos[7].value + 4;
}
static size_t pos_t0_name_len(const gw_t *w)
{
    return w->tensor_pos[0].name_len;
}
static size_t pos_t0_n_dims(const gw_t *w)
{
    return w->tensor_pos[0].n_dims;
}
static size_t pos_t0_ne0(const gw_t *w)
{
    return w->tensor_pos[0].ne0;
}
static size_t pos_t0_ne1(const gw_t *w)
{
    return w->tensor_pos[0].ne0 + 8;
}
static size_t pos_t0_type(const gw_t *w)
{
    return w->tensor_pos[0].type;
}
static size_t pos_t1_type(const gw_t *w)
{
    return w->tensor_pos[1].type;
}
static size_t pos_t2_offset(const gw_t *w)
{
    return w->tensor_pos[2].offset;
}
static size_t pos_t1_name(const gw_t *w) /* "h" -> "q": a duplicate name */
{
    return w->tensor_pos[1].name_len + 8;
}

static void test_corrupt_fields(void **state)
{
    (void) state;
    const kvs_status_t P = KVS_ERR_PROTOCOL, U = KVS_ERR_UNSUPPORTED;
    corrupt_expect(pos_magic, 'G' | 'G' << 8 | 'U' << 16 | 'G' << 24, 4, P, "magic");
    corrupt_expect(pos_version, 1, 4, U, "version 1");
    corrupt_expect(pos_version, 4, 4, U, "version 4");
    corrupt_expect(pos_version, 0x03000000, 4, U, "big-endian version");
    corrupt_expect(pos_n_tensors, UINT64_MAX, 8, P, "tensor count max");
    corrupt_expect(pos_n_tensors, 1ull << 40, 8, P, "tensor count 2^40");
    corrupt_expect(pos_n_tensors, 4, 8, ANY_ERROR, "tensor count + 1");
    corrupt_expect(pos_n_kv, UINT64_MAX, 8, P, "kv count max");
    corrupt_expect(pos_n_kv, 1ull << 20, 8, P, "kv count 2^20");
    corrupt_expect(pos_n_kv, 9, 8, ANY_ERROR, "kv count + 1");
    corrupt_expect(pos_key_len, UINT64_MAX, 8, P, "key length max");
    corrupt_expect(pos_key_len, 70000, 8, P, "key length over 65535");
    corrupt_expect(pos_key_len, 1000, 8, ANY_ERROR, "key length into the directory");
    corrupt_expect(pos_kv_type, 13, 4, P, "value type 13");
    corrupt_expect(pos_kv_type, UINT32_MAX, 4, P, "value type max");
    corrupt_expect(pos_alignment, 0, 4, P, "alignment 0");
    corrupt_expect(pos_alignment, 48, 4, P, "alignment 48");
    corrupt_expect(pos_alignment, 1u << 31, 4, P, "alignment 2^31");
    corrupt_expect(pos_alignment_type, KVS_GGUF_F32, 4, P, "alignment as f32");
    corrupt_expect(pos_bool, 2, 1, P, "bool 2");
    corrupt_expect(pos_str_array_elem_type, 13, 4, P, "array element type 13");
    corrupt_expect(pos_str_array_count, UINT64_MAX, 8, P, "string array count max");
    corrupt_expect(pos_str_array_count, 1ull << 62, 8, P, "string array count 2^62");
    corrupt_expect(pos_str_array_elem1_len, UINT64_MAX - 3, 8, P, "string element length");
    corrupt_expect(pos_i32_array_count, UINT64_MAX / 2, 8, P, "i32 array count overflow");
    corrupt_expect(pos_i32_array_count, 1ull << 40, 8, P, "i32 array count 2^40");
    corrupt_expect(pos_nested_count, UINT64_MAX, 8, P, "nested array count max");
    corrupt_expect(pos_nested_elem_type, 99, 4, P, "nested element type 99");
    corrupt_expect(pos_t0_name_len, UINT64_MAX, 8, P, "tensor name length max");
    corrupt_expect(pos_t0_name_len, 5000, 8, P, "tensor name length 5000");
    corrupt_expect(pos_t0_n_dims, 5, 4, P, "n_dims 5");
    corrupt_expect(pos_t0_n_dims, UINT32_MAX, 4, P, "n_dims max");
    corrupt_expect(pos_t0_ne0, 48, 8, P, "ne[0] not a multiple of 32");
    corrupt_expect(pos_t0_ne0, 1ull << 62, 8, P, "element count overflow");
    corrupt_expect(pos_t0_ne0, UINT64_MAX - 31, 8, P, "ne[0] above INT64_MAX");
    corrupt_expect(pos_t0_ne1, 1000, 8, P, "tensor data past the end");
    corrupt_expect(pos_t0_type, 12, 4, U, "type Q4_K");
    corrupt_expect(pos_t0_type, 0xffff, 4, U, "type 0xffff");
    corrupt_expect(pos_t1_type, KVS_GGML_F32, 4, P, "F16 relabelled F32 runs past the end");
    corrupt_expect(pos_t2_offset, 1, 8, P, "offset misaligned");
    corrupt_expect(pos_t2_offset, 1ull << 20, 8, P, "offset past EOF");
    corrupt_expect(pos_t2_offset, UINT64_MAX - 31, 8, P, "offset overflow");
    corrupt_expect(pos_t1_name, 'q', 1, P, "duplicate tensor name");
    kvs_assert_no_leaks();
}

static void test_corrupt_structure(void **state)
{
    (void) state;
    gw_t w;
    size_t len;
    uint8_t *buf;

    /* Duplicate key. */
    gw_init(&w, 3);
    gw_kv_u32(&w, "k", 1);
    gw_kv_str(&w, "other", "x");
    gw_kv_u32(&w, "k", 2);
    buf = gw_finish(&w, &len);
    open_expect(buf, len, KVS_ERR_PROTOCOL, "duplicate key");
    kvs_free(buf);
    gw_free(&w);

    /* Arrays nested 8 deep are fine, 9 deep are refused. */
    for (int depth = 8; depth <= 9; depth++) {
        gw_init(&w, 3);
        gw_bytes_t v = {0};
        for (int i = 1; i < depth; i++) {
            gw_put_u32(&v, KVS_GGUF_ARRAY);
            gw_put_u64(&v, 1);
        }
        gw_put_array(&v, KVS_GGUF_U8, 0, NULL);
        gw_kv_raw(&w, "deep", KVS_GGUF_ARRAY, v.p, v.len);
        kvs_free(v.p);
        buf = gw_finish(&w, &len);
        open_expect(buf, len, depth <= 8 ? KVS_OK : KVS_ERR_PROTOCOL, "nesting");
        kvs_free(buf);
        gw_free(&w);
    }

    /* A bool array element that is not 0 or 1. */
    gw_init(&w, 3);
    static const uint8_t bools[] = {1, 0, 3};
    gw_kv_array(&w, "b", KVS_GGUF_BOOL, 3, bools);
    buf = gw_finish(&w, &len);
    open_expect(buf, len, KVS_ERR_PROTOCOL, "bool array");
    kvs_free(buf);
    gw_free(&w);

    /* No tensors: no data section needed, and metadata-only files may end unpadded. */
    gw_init(&w, 2);
    gw_kv_str(&w, "general.name", "x");
    buf = gw_finish(&w, &len);
    open_expect(buf, len, KVS_OK, "metadata only");
    for (size_t n = 0; n < GW_HEADER_BYTES + 8 + 12 + 4 + 8 + 1; n++)
        open_expect(buf, n, KVS_ERR_PROTOCOL, "metadata only truncated");
    kvs_free(buf);
    gw_free(&w);

    /* A tensor with a zero dimension has no data and is valid. */
    gw_init(&w, 3);
    const uint64_t ne[] = {32, 0};
    gw_tensor(&w, "empty", KVS_GGML_Q4_1, 2, ne, NULL, 0);
    buf = gw_finish(&w, &len);
    kvs_gguf_t *g;
    assert_int_equal(kvs_gguf_open_buffer(buf, len, &g), KVS_OK);
    kvs_gguf_tensor_t t;
    assert_int_equal(kvs_gguf_tensor(g, "empty", &t), KVS_OK);
    assert_int_equal(t.bytes, 0);
    float out[1] = {5};
    assert_int_equal(kvs_gguf_dequant(&t, 0, 0, 0, 32, out), KVS_OK);
    assert_true(out[0] == 5);
    kvs_gguf_close(g);
    kvs_free(buf);
    gw_free(&w);
    kvs_assert_no_leaks();
}

/* Random byte corruption: anything open accepts must be fully readable. */
static void test_random_flips(void **state)
{
    (void) state;
    uint64_t seed = kvs_test_seed(0xf11b5), iters = kvs_test_iters(20000);
    kvs_rng_t rng;
    kvs_rng_seed(&rng, seed);
    gw_t w;
    size_t len;
    uint8_t *buf = build_small(&w, 3, &len);
    uint8_t *copy = kvs_malloc(len);
    assert_non_null(copy);
    kvs_log_capture_t cap = {.errors_only = 1};
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    uint64_t accepted = 0;
    for (uint64_t it = 0; it < iters; it++) {
        memcpy(copy, buf, len);
        /* Mostly the header and directory, where the structure lives. */
        size_t region = kvs_rng_chance(&rng, 3, 4) ? w.data_start : len;
        int flips = (int) kvs_rng_range(&rng, 1, 4);
        for (int f = 0; f < flips; f++) {
            size_t p = (size_t) kvs_rng_below(&rng, region);
            copy[p] = kvs_rng_chance(&rng, 1, 2)
                          ? (uint8_t) kvs_rng_next(&rng)
                          : (uint8_t) (copy[p] ^ (1u << kvs_rng_below(&rng, 8)));
        }
        kvs_gguf_t *g = NULL;
        cap.calls = 0;
        kvs_status_t st = kvs_gguf_open_buffer(copy, len, &g);
        if (st == KVS_OK) {
            accepted++;
            gw_walk(g);
            kvs_gguf_close(g);
        } else if (cap.calls != 1 || (st != KVS_ERR_PROTOCOL && st != KVS_ERR_UNSUPPORTED)) {
            kvs_log_set_sink(NULL, NULL);
            fail_msg("seed %llu iteration %llu: %s with %d errors logged",
                     (unsigned long long) seed, (unsigned long long) it, kvs_status_str(st),
                     cap.calls);
        }
    }
    kvs_log_set_sink(NULL, NULL);
    assert_true(accepted > 0); /* flips in values and data are harmless */
    kvs_free(copy);
    kvs_free(buf);
    gw_free(&w);
    kvs_assert_no_leaks();
}

static void test_alloc_failures(void **state)
{
    (void) state;
    gw_t w;
    size_t len;
    uint8_t *buf = build_small(&w, 3, &len);
    kvs_alloc_stats_t before, after;
    kvs_alloc_stats(&before);
    kvs_log_capture_t cap = {.errors_only = 1};
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    uint64_t nth;
    for (nth = 1; nth < 100; nth++) {
        kvs_gguf_t *g = NULL;
        cap.calls = 0;
        kvs_alloc_fail_at(nth);
        kvs_status_t st = kvs_gguf_open_buffer(buf, len, &g);
        kvs_alloc_fail_at(0);
        if (st == KVS_OK) {
            kvs_gguf_close(g);
            break;
        }
        assert_int_equal(st, KVS_ERR_NOMEM);
        assert_int_equal(cap.calls, 1);
        kvs_alloc_stats(&after);
        assert_int_equal(after.live_blocks, before.live_blocks);
    }
    kvs_log_set_sink(NULL, NULL);
    assert_true(nth >= 5 && nth < 100); /* handle, kv, index, strings, tensors... */
    kvs_free(buf);
    gw_free(&w);
    kvs_assert_no_leaks();
}

/* Files and paths */

static void write_file(const char *path, const void *data, size_t len)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(data, 1, len, f), len);
    assert_int_equal(fclose(f), 0);
}

static void test_open_file(void **state)
{
    (void) state;
    char dir[] = "/tmp/kvs_gguf_XXXXXX";
    assert_non_null(mkdtemp(dir));
    char path[256], empty[256];
    snprintf(path, sizeof(path), "%s/small.gguf", dir);
    snprintf(empty, sizeof(empty), "%s/empty.gguf", dir);
    gw_t w;
    size_t len;
    uint8_t *buf = build_small(&w, 3, &len);
    write_file(path, buf, len);
    write_file(empty, "", 0);

    kvs_gguf_t *g;
    assert_int_equal(kvs_gguf_open(path, &g), KVS_OK);
    kvs_gguf_str_t s;
    assert_int_equal(kvs_gguf_array_str(g, "tokenizer.ggml.tokens", 2, &s), KVS_OK);
    assert_str(s, "bc");
    kvs_gguf_tensor_t t;
    assert_int_equal(kvs_gguf_tensor(g, "q", &t), KVS_OK);
    float row[64];
    assert_int_equal(kvs_gguf_dequant(&t, 1, 1, 0, 64, row), KVS_OK);
    for (int i = 0; i < 64; i++) assert_true(fabsf(row[i] - ((float) (64 + i) / 16 - 3)) < 0.03f);
    kvs_gguf_close(g);

    kvs_log_capture_t cap = {.errors_only = 1};
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    char missing[300];
    snprintf(missing, sizeof(missing), "%s/missing.gguf", dir);
    assert_int_equal(kvs_gguf_open(missing, &g), KVS_ERR_IO);
    assert_int_equal(kvs_gguf_open(dir, &g), KVS_ERR_IO);
    assert_int_equal(kvs_gguf_open(empty, &g), KVS_ERR_PROTOCOL);
    kvs_log_set_sink(NULL, NULL);
    assert_int_equal(cap.calls, 3);

    unlink(path);
    unlink(empty);
    rmdir(dir);
    kvs_free(buf);
    gw_free(&w);
    kvs_assert_no_leaks();
}

/* Sets or unsets an environment variable, returning a copy of the old value to restore. */
static char *env_swap(const char *name, const char *value)
{
    const char *old = getenv(name);
    char *saved = old ? kvs_strdup(old) : NULL;
    if (value)
        setenv(name, value, 1);
    else
        unsetenv(name);
    return saved;
}

static void env_restore(const char *name, char *saved)
{
    if (saved)
        setenv(name, saved, 1);
    else
        unsetenv(name);
    kvs_free(saved);
}

static void test_model_default_path(void **state)
{
    (void) state;
    char dir[] = "/tmp/kvs_model_XXXXXX";
    assert_non_null(mkdtemp(dir));
    char models[256], file[300], other[300];
    snprintf(models, sizeof(models), "%s/models", dir);
    assert_int_equal(mkdir(models, 0700), 0);
    snprintf(file, sizeof(file), "%s/SmolLM2-135M-Instruct.Q4_1.gguf", models);
    snprintf(other, sizeof(other), "%s/other.gguf", dir);
    write_file(other, "x", 1);

    char *old_model = env_swap("KVS_MODEL", NULL), *old_cache = env_swap("KVS_CACHE_DIR", dir);
    char out[512] = "untouched";
    kvs_log_capture_t cap = {.errors_only = 1};
    kvs_log_set_sink(kvs_log_capture_sink, &cap);

    /* The cache directory, before and after the file exists. */
    assert_int_equal(kvs_model_default_path(out, sizeof(out)), KVS_ERR_NOT_FOUND);
    assert_string_equal(out, "untouched");
    assert_non_null(strstr(cap.msg, "run scripts/setup.sh"));
    write_file(file, "GGUF", 4);
    assert_int_equal(kvs_model_default_path(out, sizeof(out)), KVS_OK);
    assert_string_equal(out, file);
    assert_int_equal(kvs_model_default_path(out, strlen(file)), KVS_ERR_NOSPACE);
    assert_int_equal(kvs_model_default_path(out, strlen(file) + 1), KVS_OK);

    /* KVS_MODEL wins, and must exist. */
    setenv("KVS_MODEL", other, 1);
    assert_int_equal(kvs_model_default_path(out, sizeof(out)), KVS_OK);
    assert_string_equal(out, other);
    setenv("KVS_MODEL", models, 1); /* a directory is not a model */
    cap.calls = 0;
    assert_int_equal(kvs_model_default_path(out, sizeof(out)), KVS_ERR_NOT_FOUND);
    assert_int_equal(cap.calls, 1);
    assert_non_null(strstr(cap.msg, "scripts/setup.sh"));

    /* Without KVS_CACHE_DIR: $HOME/.cache/kvstage. */
    unsetenv("KVS_MODEL");
    unsetenv("KVS_CACHE_DIR");
    char *old_home = env_swap("HOME", dir);
    assert_int_equal(kvs_model_default_path(out, sizeof(out)), KVS_ERR_NOT_FOUND);
    char want[400];
    snprintf(want, sizeof(want), "%s/.cache/kvstage/models/SmolLM2-135M-Instruct.Q4_1.gguf", dir);
    assert_non_null(strstr(cap.msg, want));
    env_restore("HOME", old_home);
    kvs_log_set_sink(NULL, NULL);

    env_restore("KVS_MODEL", old_model);
    env_restore("KVS_CACHE_DIR", old_cache);
    unlink(file);
    unlink(other);
    rmdir(models);
    rmdir(dir);
    kvs_assert_no_leaks();
}

/* The real model */

static void expect_u32(const kvs_gguf_t *g, const char *key, uint32_t want)
{
    uint32_t v;
    kvs_status_t st = kvs_gguf_u32(g, key, &v);
    if (st != KVS_OK || v != want) fail_msg("%s: %s %u, want %u", key, kvs_status_str(st), v, want);
}

static void expect_str(const kvs_gguf_t *g, const char *key, const char *want)
{
    kvs_gguf_str_t s;
    assert_int_equal(kvs_gguf_str(g, key, &s), KVS_OK);
    assert_str(s, want);
}

static void test_smollm2(void **state)
{
    (void) state;
    char path[4096];
    if (kvs_model_default_path(path, sizeof(path)) != KVS_OK)
        fail_msg("SmolLM2-135M-Instruct GGUF not found: run scripts/setup.sh (or set KVS_MODEL)");
    kvs_gguf_t *g;
    uint64_t t0 = kvs_now_ns();
    assert_int_equal(kvs_gguf_open(path, &g), KVS_OK);
    uint64_t open_ns = kvs_now_ns() - t0;
    print_message("opened %s in %.2f ms\n", path, (double) open_ns / 1e6);

    expect_str(g, "general.architecture", "llama");
    expect_u32(g, "llama.block_count", 30);
    expect_u32(g, "llama.context_length", 8192);
    expect_u32(g, "llama.embedding_length", 576);
    expect_u32(g, "llama.feed_forward_length", 1536);
    expect_u32(g, "llama.attention.head_count", 9);
    expect_u32(g, "llama.attention.head_count_kv", 3);
    expect_u32(g, "llama.vocab_size", 49152);
    expect_u32(g, "llama.rope.dimension_count", 64);
    expect_u32(g, "tokenizer.ggml.bos_token_id", 1);
    expect_u32(g, "tokenizer.ggml.eos_token_id", 2);
    expect_u32(g, "general.file_type", 3);
    float f;
    assert_int_equal(kvs_gguf_f32(g, "llama.rope.freq_base", &f), KVS_OK);
    assert_true(f == 100000.0f);
    assert_int_equal(kvs_gguf_f32(g, "llama.attention.layer_norm_rms_epsilon", &f), KVS_OK);
    assert_true(f == 1e-5f);
    int b = 1;
    assert_int_equal(kvs_gguf_bool(g, "tokenizer.ggml.add_bos_token", &b), KVS_OK);
    assert_int_equal(b, 0);
    expect_str(g, "tokenizer.ggml.model", "gpt2");
    expect_str(g, "tokenizer.ggml.pre", "smollm");
    kvs_gguf_str_t s;
    assert_int_equal(kvs_gguf_str(g, "tokenizer.chat_template", &s), KVS_OK);
    assert_true(s.len > 100);
    uint32_t align;
    assert_int_equal(kvs_gguf_u32(g, "general.alignment", &align), KVS_ERR_NOT_FOUND);
    assert_int_equal(kvs_gguf_kv_count(g), 33);

    kvs_gguf_type_t type;
    uint64_t count;
    assert_int_equal(kvs_gguf_array(g, "tokenizer.ggml.tokens", &type, &count), KVS_OK);
    assert_int_equal(type, KVS_GGUF_STRING);
    assert_int_equal(count, 49152);
    static const char *const toks[][2] = {{"0", "<|endoftext|>"},
                                          {"1", "<|im_start|>"},
                                          {"2", "<|im_end|>"},
                                          {"100", "t"},
                                          {"49151", "ectable"}};
    for (size_t i = 0; i < sizeof(toks) / sizeof(toks[0]); i++) {
        assert_int_equal(
            kvs_gguf_array_str(g, "tokenizer.ggml.tokens", strtoull(toks[i][0], NULL, 10), &s),
            KVS_OK);
        assert_str(s, toks[i][1]);
    }
    assert_int_equal(kvs_gguf_array(g, "tokenizer.ggml.merges", &type, &count), KVS_OK);
    assert_int_equal(type, KVS_GGUF_STRING);
    assert_int_equal(count, 48900);
    assert_int_equal(kvs_gguf_array_str(g, "tokenizer.ggml.merges", 0, &s), KVS_OK);
    assert_str(s, "\xc4\xa0 t");
    assert_int_equal(kvs_gguf_array_str(g, "tokenizer.ggml.merges", 48899, &s), KVS_OK);
    assert_str(s, "ect able");
    assert_int_equal(kvs_gguf_array(g, "tokenizer.ggml.token_type", &type, &count), KVS_OK);
    assert_int_equal(type, KVS_GGUF_I32);
    assert_int_equal(count, 49152);
    int control = 0;
    for (uint64_t i = 0; i < count; i++) {
        int64_t v;
        assert_int_equal(kvs_gguf_array_i64(g, "tokenizer.ggml.token_type", i, &v), KVS_OK);
        assert_true(v == 1 || v == 3);
        control += v == 3;
        if (i < 17) assert_int_equal(v, 3);
    }
    assert_int_equal(control, 17);

    /* Every tensor as Python's reader sees it. */
    size_t n_ref = sizeof(gguf_ref_tensors) / sizeof(gguf_ref_tensors[0]);
    assert_int_equal(n_ref, 272);
    assert_int_equal(kvs_gguf_tensor_count(g), 272);
    kvs_gguf_tensor_t first;
    assert_int_equal(kvs_gguf_tensor_at(g, 0, &first), KVS_OK);
    for (size_t i = 0; i < n_ref; i++) {
        const gguf_ref_tensor_t *r = &gguf_ref_tensors[i];
        kvs_gguf_tensor_t t, byname;
        assert_int_equal(kvs_gguf_tensor_at(g, i, &t), KVS_OK);
        assert_str(t.name, r->name);
        assert_int_equal(kvs_gguf_tensor(g, r->name, &byname), KVS_OK);
        assert_ptr_equal(byname.data, t.data);
        assert_int_equal(t.type, r->type);
        assert_int_equal(t.n_dims, r->n_dims);
        for (int d = 0; d < 4; d++) assert_int_equal(t.ne[d], r->ne[d]);
        assert_int_equal(t.bytes, r->bytes);
        assert_int_equal((uint64_t) (t.data - first.data),
                         r->file_offset - gguf_ref_tensors[0].file_offset);
        /* The layout the model expects: Q8_0 embeddings, Q4_1 matrices, F32 norms. */
        int is_norm = strstr(r->name, "norm") != NULL;
        int is_embd = strcmp(r->name, "token_embd.weight") == 0;
        assert_int_equal(t.type, is_norm ? KVS_GGML_F32 : is_embd ? KVS_GGML_Q8_0 : KVS_GGML_Q4_1);
    }
    kvs_gguf_tensor_t t;
    assert_int_equal(kvs_gguf_tensor(g, "output.weight", &t), KVS_ERR_NOT_FOUND);
    assert_int_equal(kvs_gguf_tensor(g, "blk.29.ffn_down.weight", &t), KVS_OK);
    assert_true(t.ne[0] == 1536 && t.ne[1] == 576 && t.type == KVS_GGML_Q4_1);

    /* Dequantised values against gguf.quants.dequantize, bit for bit. */
    for (size_t i = 0; i < sizeof(gguf_ref_slices) / sizeof(gguf_ref_slices[0]); i++) {
        const gguf_ref_slice_t *r = &gguf_ref_slices[i];
        assert_int_equal(kvs_gguf_tensor(g, r->name, &t), KVS_OK);
        float *row = kvs_malloc(t.ne[0] * sizeof(float));
        float *cut = kvs_malloc(r->ncols * sizeof(float));
        assert_non_null(row);
        assert_non_null(cut);
        assert_int_equal(kvs_gguf_dequant(&t, r->row, 1, r->col0, r->ncols, cut), KVS_OK);
        assert_int_equal(kvs_gguf_dequant(&t, r->row, 1, 0, t.ne[0], row), KVS_OK);
        for (uint64_t c = 0; c < r->ncols; c++) {
            if (bits_of(cut[c]) != r->bits[c] || bits_of(row[r->col0 + c]) != r->bits[c])
                fail_msg("%s row %llu col %llu: %a (row %a), reference %a", r->name,
                         (unsigned long long) r->row, (unsigned long long) (r->col0 + c), cut[c],
                         row[r->col0 + c], float_of(r->bits[c]));
        }
        kvs_free(row);
        kvs_free(cut);
    }
    kvs_gguf_close(g);
    kvs_assert_no_leaks();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_f16_known_values),
        cmocka_unit_test(test_f16_exhaustive),
        cmocka_unit_test(test_bf16),
        cmocka_unit_test(test_block_sizes),
        cmocka_unit_test(test_hand_blocks),
        cmocka_unit_test(test_metadata_roundtrip),
        cmocka_unit_test(test_tensor_roundtrip),
        cmocka_unit_test(test_subrange_random),
        cmocka_unit_test(test_dequant_errors),
        cmocka_unit_test(test_small_file_valid),
        cmocka_unit_test(test_every_truncation),
        cmocka_unit_test(test_corrupt_fields),
        cmocka_unit_test(test_corrupt_structure),
        cmocka_unit_test(test_random_flips),
        cmocka_unit_test(test_alloc_failures),
        cmocka_unit_test(test_open_file),
        cmocka_unit_test(test_model_default_path),
        cmocka_unit_test(test_smollm2),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
