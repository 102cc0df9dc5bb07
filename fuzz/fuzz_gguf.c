/* libFuzzer target for the GGUF reader (serve/model/gguf.c, serve/model/quant.c): open must
 * survive any input, fail without leaking, and whatever it accepts must be readable through
 * the whole public API (every key with every getter, every array element, every tensor by
 * index and name, dequantised whole and cut) without reading outside the input.
 *
 * Built with -DKVS_FUZZ_WRITE_SEEDS and without -fsanitize=fuzzer, the file is instead a
 * program that writes a seed corpus (small valid files of both versions with metadata and
 * tensors of every type) into the directory given as its argument. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvstage/alloc.h"
#include "model/gguf.h"
#include "kvstage/log.h"
#include "model/gguf_writer.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void drop_log(void *arg, kvs_log_level_t level, const char *file, int line, const char *msg)
{
    (void) arg, (void) level, (void) file, (void) line, (void) msg;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    /* Rejections and wrong-type lookups log errors by design; keep the output readable. */
    kvs_log_set_sink(drop_log, NULL);
    kvs_alloc_stats_t before, after;
    kvs_alloc_stats(&before);
    kvs_gguf_t *g = NULL;
    kvs_status_t st = kvs_gguf_open_buffer(data, size, &g);
    if (st == KVS_OK) {
        gw_walk(g);
        kvs_gguf_close(g);
    } else if (g != NULL ||
               (st != KVS_ERR_PROTOCOL && st != KVS_ERR_UNSUPPORTED && st != KVS_ERR_NOMEM)) {
        abort();
    }
    kvs_alloc_stats(&after);
    if (after.live_blocks != before.live_blocks) abort();
    return 0;
}

#ifdef KVS_FUZZ_WRITE_SEEDS
static int write_seed(const char *dir, const char *name, gw_t *w)
{
    size_t len;
    uint8_t *buf = gw_finish(w, &len);
    kvs_gguf_t *g;
    if (buf == NULL || kvs_gguf_open_buffer(buf, len, &g) != KVS_OK) {
        fprintf(stderr, "seed %s does not open\n", name);
        kvs_free(buf);
        gw_free(w);
        return 1;
    }
    kvs_gguf_close(g);
    char path[4096];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    int bad = f == NULL || fwrite(buf, 1, len, f) != len;
    if (f != NULL && fclose(f) != 0) bad = 1;
    if (bad) perror(path);
    kvs_free(buf);
    gw_free(w);
    return bad;
}

/* Metadata of every value type, nested arrays included. */
static void seed_metadata(gw_t *w, uint32_t version)
{
    static const uint8_t u8s[] = {0, 255};
    static const int32_t i32s[] = {-1, 3, 1};
    static const double f64s[] = {0.5, -2};
    static const uint8_t bools[] = {1, 0};
    static const char *const strs[] = {"<s>", "", "\xc4\xa0t"};
    static const uint16_t u16s[] = {1, 2};
    gw_init(w, version);
    gw_kv_str(w, "general.architecture", "llama");
    gw_kv_u8(w, "a.u8", 1);
    gw_kv_i8(w, "a.i8", -1);
    gw_kv_u16(w, "a.u16", 2);
    gw_kv_i16(w, "a.i16", -2);
    gw_kv_u32(w, "llama.block_count", 2);
    gw_kv_i32(w, "a.i32", -3);
    gw_kv_f32(w, "llama.rope.freq_base", 10000.0f);
    gw_kv_bool(w, "tokenizer.ggml.add_bos_token", 1);
    gw_kv_u64(w, "a.u64", 4);
    gw_kv_i64(w, "a.i64", -4);
    gw_kv_f64(w, "a.f64", 0.25);
    gw_kv_array(w, "a.au8", KVS_GGUF_U8, 2, u8s);
    gw_kv_array(w, "tokenizer.ggml.token_type", KVS_GGUF_I32, 3, i32s);
    gw_kv_array(w, "a.af64", KVS_GGUF_F64, 2, f64s);
    gw_kv_array(w, "a.abool", KVS_GGUF_BOOL, 2, bools);
    gw_kv_array(w, "tokenizer.ggml.tokens", KVS_GGUF_STRING, 3, strs);
    gw_bytes_t v = {0};
    gw_put_u32(&v, KVS_GGUF_ARRAY);
    gw_put_u64(&v, 2);
    gw_put_array(&v, KVS_GGUF_U16, 2, u16s);
    gw_put_array(&v, KVS_GGUF_STRING, 3, strs);
    gw_kv_raw(w, "a.nested", KVS_GGUF_ARRAY, v.p, v.len);
    kvs_free(v.p);
}

/* One small tensor of each supported type. */
static void seed_tensors(gw_t *w)
{
    static const kvs_ggml_type_t types[] = {KVS_GGML_F32,  KVS_GGML_F16,  KVS_GGML_BF16,
                                            KVS_GGML_Q8_0, KVS_GGML_Q4_0, KVS_GGML_Q4_1};
    float x[64];
    for (int i = 0; i < 64; i++) x[i] = (float) (i % 13) / 4 - 1.5f;
    for (size_t t = 0; t < sizeof(types) / sizeof(types[0]); t++) {
        char name[16];
        snprintf(name, sizeof(name), "t%zu.weight", t);
        const uint64_t ne[] = {32, 2};
        gw_tensor_f32(w, name, types[t], 2, ne, x);
    }
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s DIR\n", argv[0]);
        return 2;
    }
    gw_t w;
    int bad = 0;
    seed_metadata(&w, 3);
    bad |= write_seed(argv[1], "01_metadata_v3", &w);
    seed_metadata(&w, 2);
    seed_tensors(&w);
    bad |= write_seed(argv[1], "02_metadata_tensors_v2", &w);
    gw_init(&w, 3);
    gw_alignment(&w, 64);
    seed_tensors(&w);
    bad |= write_seed(argv[1], "03_tensors_align64_v3", &w);
    gw_init(&w, 3);
    bad |= write_seed(argv[1], "04_empty_v3", &w);
    return bad;
}
#endif
