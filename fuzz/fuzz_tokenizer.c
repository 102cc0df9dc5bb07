/* libFuzzer target for the tokenizer (serve/model/tokenizer.c) and the server's adapters over it
 * (serve/http/tokenize.c): the real SmolLM2 tokenizer, read once from the default model's GGUF
 * (model_path.c: KVS_MODEL or the cache scripts/setup.sh fills), or, when that file is absent
 * or KVS_FUZZ_TOKENIZER=tiny, a small byte-level vocabulary built here (every byte, a few
 * merges, control and user-defined tokens). The first input byte's bit 0 turns parse_special
 * on; the rest is the text. For every input: encoding succeeds with ids below the vocabulary;
 * decoding them gives the text back, less the bytes that have no token; counting alone and a
 * buffer one id short agree with it; the server adapter and the byte tokenizer encode and
 * render it; arbitrary ids taken from the input decode or are refused without reading outside
 * the vocabulary; the text as a chat message renders with the model's template and contains
 * it; nothing leaks. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvstage/alloc.h"
#include "kvstage/log.h"
#include "model/gguf.h"
#include "model/tokenizer.h"
#include "http/server.h"

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static kvs_gguf_t *g_gguf;
static kvs_tokenizer_t *g_tok;
static int g_has_token[256]; /* the byte is encoded, not dropped */

static void drop_log(void *arg, kvs_log_level_t level, const char *file, int line, const char *msg)
{
    (void) arg, (void) level, (void) file, (void) line, (void) msg;
}

/* GPT-2's byte-to-character table: printable Latin-1 bytes stand for themselves, the others for
 * U+0100 onwards in byte order; as UTF-8 into out (NUL-terminated). */
static void gpt2_byte(unsigned b, char out[3])
{
    unsigned cp = b;
    if (!((b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE)) {
        cp = 0x100;
        for (unsigned i = 0; i < b; i++)
            cp += !((i >= 0x21 && i <= 0x7E) || (i >= 0xA1 && i <= 0xAC) || i >= 0xAE);
    }
    if (cp < 0x80) {
        out[0] = (char) cp;
        out[1] = '\0';
    } else {
        out[0] = (char) (0xC0 | (cp >> 6));
        out[1] = (char) (0x80 | (cp & 0x3F));
        out[2] = '\0';
    }
}

static kvs_status_t tiny_tokenizer(kvs_tokenizer_t **tok_p)
{
    static char bytes[256][3];
    static const char *const extra[] = {"<|im_start|>", "<|im_end|>",  "<u>", "he",
                                        "\xC4\xA0t",    "\xC4\xA0the", "aa",  "aaaa"};
    static const int32_t extra_types[] = {
        KVS_TOKEN_CONTROL, KVS_TOKEN_CONTROL, KVS_TOKEN_USER_DEFINED, KVS_TOKEN_NORMAL,
        KVS_TOKEN_NORMAL,  KVS_TOKEN_NORMAL,  KVS_TOKEN_NORMAL,       KVS_TOKEN_NORMAL};
    static const char *const merges[] = {"h e", "\xC4\xA0 t", "\xC4\xA0t he", "a a", "aa aa"};
    enum { N_EXTRA = sizeof(extra) / sizeof(extra[0]), N_MERGES = 5 };
    kvs_tokenizer_str_t tokens[256 + N_EXTRA], ms[N_MERGES];
    int32_t types[256 + N_EXTRA];
    for (unsigned b = 0; b < 256; b++) {
        gpt2_byte(b, bytes[b]);
        tokens[b] = (kvs_tokenizer_str_t){bytes[b], strlen(bytes[b])};
        types[b] = KVS_TOKEN_NORMAL;
    }
    for (size_t i = 0; i < N_EXTRA; i++) {
        tokens[256 + i] = (kvs_tokenizer_str_t){extra[i], strlen(extra[i])};
        types[256 + i] = extra_types[i];
    }
    for (size_t i = 0; i < N_MERGES; i++)
        ms[i] = (kvs_tokenizer_str_t){merges[i], strlen(merges[i])};
    kvs_tokenizer_vocab_t v = {.n_tokens = 256 + N_EXTRA,
                               .tokens = tokens,
                               .types = types,
                               .n_merges = N_MERGES,
                               .merges = ms,
                               .bos = 256,
                               .eos = 257,
                               .pre = KVS_TOKENIZER_PRE_SMOLLM};
    return kvs_tokenizer_create(&v, tok_p);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void) argc, (void) argv;
    const char *which = getenv("KVS_FUZZ_TOKENIZER");
    char path[4096];
    int tiny = which != NULL && strcmp(which, "tiny") == 0;
    kvs_log_set_sink(drop_log, NULL); /* a missing model is not an error here */
    if (!tiny && kvs_model_default_path(path, sizeof(path)) == KVS_OK &&
        kvs_gguf_open(path, &g_gguf) == KVS_OK &&
        kvs_tokenizer_from_gguf(g_gguf, &g_tok) == KVS_OK) {
        fprintf(stderr, "fuzz_tokenizer: the tokenizer of %s\n", path);
    } else {
        if (tiny_tokenizer(&g_tok) != KVS_OK) abort();
        fprintf(stderr, "fuzz_tokenizer: a small test vocabulary (%s)\n",
                tiny ? "KVS_FUZZ_TOKENIZER=tiny" : "the default model is not there");
    }
    kvs_log_set_sink(NULL, NULL);
    for (unsigned b = 0; b < 256; b++) {
        char c = (char) b;
        size_t n = 0;
        if (kvs_tokenizer_encode(g_tok, &c, 1, 0, NULL, 0, &n) != KVS_OK) abort();
        g_has_token[b] = n > 0;
    }
    return 0;
}

/* The text as the model's chat template renders it in a user message, which must contain it. */
static void check_chat(const char *text, size_t len)
{
    char *content = kvs_malloc(len + 1);
    if (content == NULL) abort();
    memcpy(content, text, len);
    content[len] = '\0';
    kvs_chat_msg_t msgs[2] = {{"system", "s"}, {"user", content}};
    char *out = NULL;
    if (kvs_chat_format(kvs_tokenizer_chat_template(g_tok), msgs, 2, 1, &out) != KVS_OK) abort();
    if (strstr(out, content) == NULL) abort();
    kvs_free(out);
    kvs_free(content);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kvs_log_set_sink(drop_log, NULL); /* refusals below are logged by design */
    if (size < 1) return 0;
    int special = data[0] & 1;
    const char *text = (const char *) data + 1;
    size_t len = size - 1;
    uint32_t vocab = kvs_tokenizer_vocab_size(g_tok);
    kvs_alloc_stats_t before, after;
    kvs_alloc_stats(&before);

    uint32_t *ids = NULL;
    size_t n = 0;
    if (kvs_tokenizer_encode_alloc(g_tok, text, len, special, &ids, &n) != KVS_OK) abort();
    if ((n == 0) != (ids == NULL) || n > len) abort();
    size_t counted = 0;
    if (kvs_tokenizer_encode(g_tok, text, len, special, NULL, 0, &counted) != KVS_OK ||
        counted != n)
        abort();
    if (n > 0) {
        size_t got = 0;
        if (kvs_tokenizer_encode(g_tok, text, len, special, ids, n - 1, &got) != KVS_ERR_NOSPACE)
            abort();
    }
    /* Decoding gives the text back, less the bytes without a token. */
    char *want = kvs_malloc(len + 1), *back = kvs_malloc(len + 1);
    if (want == NULL || back == NULL) abort();
    size_t want_len = 0, back_len = 0;
    for (size_t i = 0; i < len; i++)
        if (g_has_token[(uint8_t) text[i]]) want[want_len++] = text[i];
    for (size_t i = 0; i < n; i++) {
        if (ids[i] >= vocab) abort();
        if (!special && kvs_tokenizer_is_control(g_tok, ids[i])) abort();
        const char *p;
        size_t pl;
        if (kvs_tokenizer_piece(g_tok, ids[i], &p, &pl) != KVS_OK || back_len + pl > want_len)
            abort();
        memcpy(back + back_len, p, pl);
        back_len += pl;
    }
    if (back_len != want_len || memcmp(back, want, want_len) != 0) abort();
    kvs_free(want);
    kvs_free(back);
    kvs_free(ids);

    /* The server's adapter (special tokens parsed, control ones rendered as nothing) and the
     * byte tokenizer. */
    kvs_server_tokenizer_t st[2];
    if (kvs_server_tokenizer_from(g_tok, &st[0]) != KVS_OK) abort();
    st[1] = kvs_server_byte_tokenizer();
    for (int t = 0; t < 2; t++) {
        if (st[t].encode(st[t].ctx, text, len, &ids, &n) != KVS_OK) abort();
        for (size_t i = 0; i < n; i++) {
            const char *p;
            size_t pl;
            if (ids[i] >= st[t].vocab_size || st[t].piece(st[t].ctx, ids[i], &p, &pl) != KVS_OK)
                abort();
        }
        if (t == 1 && n != len) abort(); /* a byte is a token */
        kvs_free(ids);
    }
    /* Ids read from the input: in range they decode, out of range they are refused. */
    for (size_t i = 0; i + 4 <= len && i < 64; i += 4) {
        uint32_t id;
        memcpy(&id, text + i, 4);
        id %= vocab + 16;
        const char *p;
        size_t pl;
        char buf[8];
        kvs_status_t s1 = kvs_tokenizer_piece(g_tok, id, &p, &pl);
        kvs_status_t s2 = kvs_tokenizer_decode(g_tok, id, buf, sizeof(buf), &pl);
        kvs_status_t s3 = st[0].piece(st[0].ctx, id, &p, &pl);
        int in = id < vocab;
        if ((s1 == KVS_OK) != in || (s3 == KVS_OK) != in) abort();
        if (in ? (s2 != KVS_OK && s2 != KVS_ERR_NOSPACE) : s2 != KVS_ERR_INVALID) abort();
    }
    check_chat(text, strnlen(text, len));

    kvs_alloc_stats(&after);
    if (after.live_blocks != before.live_blocks) abort();
    return 0;
}
