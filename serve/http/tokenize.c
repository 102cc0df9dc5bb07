/* The server's tokenizer adapters: the real byte-level BPE tokenizer (model/tokenizer.h)
 * behind the server's ops table, and the byte tokenizer that goes with the fake backend. */
#include "http/server_internal.h"

#include <string.h>

#include "kvstage/alloc.h"
#include "kvstage/log.h"

/* ---- the real tokenizer ---- */

static kvs_status_t bpe_encode(void *ctx, const char *text, size_t len, uint32_t **ids_p,
                               size_t *n_p)
{
    return kvs_tokenizer_encode_alloc(ctx, text, len, 1, ids_p, n_p);
}

static kvs_status_t bpe_piece(void *ctx, uint32_t id, const char **bytes_p, size_t *len_p)
{
    const kvs_tokenizer_t *tok = ctx;
    if (id < kvs_tokenizer_vocab_size(tok) && kvs_tokenizer_is_control(tok, id)) {
        *bytes_p = "";
        *len_p = 0;
        return KVS_OK;
    }
    return kvs_tokenizer_piece(tok, id, bytes_p, len_p);
}

static kvs_status_t bpe_chat_template(void *ctx, const kvs_chat_msg_t *msgs, size_t n,
                                      char **text_p)
{
    return kvs_chat_format(kvs_tokenizer_chat_template(ctx), msgs, n, 1, text_p);
}

static kvs_status_t bpe_chat_plain(void *ctx, const kvs_chat_msg_t *msgs, size_t n, char **text_p)
{
    (void) ctx;
    return kvs_chat_format(NULL, msgs, n, 1, text_p);
}

kvs_status_t kvs_server_tokenizer_from(const kvs_tokenizer_t *tok, kvs_server_tokenizer_t *out_p)
{
    if (tok == NULL) {
        kvs_error("server: no tokenizer given");
        return KVS_ERR_INVALID;
    }
    kvs_server_tokenizer_t t;
    memset(&t, 0, sizeof(t));
    t.ctx = (void *) tok;
    t.encode = bpe_encode;
    t.piece = bpe_piece;
    t.chat = bpe_chat_template;
    t.vocab_size = kvs_tokenizer_vocab_size(tok);
    t.eos = kvs_tokenizer_eos(tok);
    const char *tmpl = kvs_tokenizer_chat_template(tok);
    if (tmpl != NULL) {
        /* Probe the template once, so an unrecognised one is reported once, at setup, and not
         * on every request. */
        kvs_chat_msg_t probe = {"user", "x"};
        char *text = NULL;
        kvs_status_t st = kvs_chat_format(tmpl, &probe, 1, 1, &text);
        kvs_free(text);
        if (st == KVS_ERR_UNSUPPORTED) {
            kvs_warn("server: the model's chat template is not recognised; using plain ChatML");
            t.chat = bpe_chat_plain;
        } else if (st != KVS_OK) {
            return st;
        }
    } else {
        t.chat = bpe_chat_plain;
    }
    *out_p = t;
    return KVS_OK;
}

/* ---- bytes as tokens ---- */

#define BYTE_EOS 256u

static kvs_status_t byte_encode(void *ctx, const char *text, size_t len, uint32_t **ids_p,
                                size_t *n_p)
{
    (void) ctx;
    uint32_t *ids = NULL;
    if (len > 0) {
        ids = kvs_malloc(len * sizeof(uint32_t));
        if (ids == NULL) return KVS_ERR_NOMEM;
        for (size_t i = 0; i < len; i++) ids[i] = (unsigned char) text[i];
    }
    *ids_p = ids;
    *n_p = len;
    return KVS_OK;
}

static const char k_bytes[256] = {
#define B4(x)  (char) (x), (char) ((x) + 1), (char) ((x) + 2), (char) ((x) + 3)
#define B16(x) B4(x), B4((x) + 4), B4((x) + 8), B4((x) + 12)
#define B64(x) B16(x), B16((x) + 16), B16((x) + 32), B16((x) + 48)
    B64(0),
    B64(64),
    B64(128),
    B64(192),
#undef B64
#undef B16
#undef B4
};

static kvs_status_t byte_piece(void *ctx, uint32_t id, const char **bytes_p, size_t *len_p)
{
    (void) ctx;
    if (id > BYTE_EOS) {
        kvs_error("byte tokenizer: token %u outside the vocabulary of %u", id, BYTE_EOS + 1);
        return KVS_ERR_INVALID;
    }
    *bytes_p = id == BYTE_EOS ? "" : &k_bytes[id];
    *len_p = id == BYTE_EOS ? 0 : 1;
    return KVS_OK;
}

static kvs_status_t byte_chat(void *ctx, const kvs_chat_msg_t *msgs, size_t n, char **text_p)
{
    (void) ctx;
    kvs__sb_t sb;
    kvs__sb_init(&sb);
    for (size_t i = 0; i < n; i++) kvs__sb_printf(&sb, "%s: %s\n", msgs[i].role, msgs[i].content);
    kvs__sb_puts(&sb, "assistant: ");
    char *text = kvs__sb_take(&sb);
    if (text == NULL) return KVS_ERR_NOMEM;
    *text_p = text;
    return KVS_OK;
}

kvs_server_tokenizer_t kvs_server_byte_tokenizer(void)
{
    kvs_server_tokenizer_t t;
    memset(&t, 0, sizeof(t));
    t.encode = byte_encode;
    t.piece = byte_piece;
    t.chat = byte_chat;
    t.vocab_size = BYTE_EOS + 1;
    t.eos = BYTE_EOS;
    return t;
}

/* A prompt of one token whatever the text: the shape of a request, not its length. */
static kvs_status_t shape_encode(void *ctx, const char *text, size_t len, uint32_t **ids_p,
                                 size_t *n_p)
{
    (void) ctx;
    (void) text;
    (void) len;
    uint32_t *ids = kvs_malloc(sizeof(uint32_t));
    if (ids == NULL) return KVS_ERR_NOMEM;
    ids[0] = 0;
    *ids_p = ids;
    *n_p = 1;
    return KVS_OK;
}

kvs_server_tokenizer_t kvs__shape_tokenizer(void)
{
    kvs_server_tokenizer_t t = kvs_server_byte_tokenizer();
    t.encode = shape_encode;
    t.vocab_size = UINT32_MAX;
    t.eos = UINT32_MAX;
    return t;
}
