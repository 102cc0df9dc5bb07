/* A byte-level BPE tokenizer (the GPT-2 family, as SmolLM2 uses it) built from GGUF metadata
 * or from an in-memory vocabulary, and the rendering of a conversation in ChatML as the model's
 * chat template does (without a Jinja interpreter: templates are recognised, not run). */
#ifndef KVSTAGE_TOKENIZER_H
#define KVSTAGE_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "model/gguf.h"
#include "kvstage/status.h"

/* Token types, numbered as GGUF's tokenizer.ggml.token_type. */
typedef enum {
    KVS_TOKEN_NORMAL = 1,
    KVS_TOKEN_UNKNOWN = 2,
    KVS_TOKEN_CONTROL = 3,      /* <|im_start|>...: matched in text only when parse_special */
    KVS_TOKEN_USER_DEFINED = 4, /* matched in text always */
    KVS_TOKEN_UNUSED = 5,
    KVS_TOKEN_BYTE = 6,
} kvs_token_type_t;

/* How text is cut into pieces before BPE (GGUF tokenizer.ggml.pre). */
typedef enum {
    KVS_TOKENIZER_PRE_GPT2 = 0,   /* "gpt2": the GPT-2 regex alone */
    KVS_TOKENIZER_PRE_SMOLLM = 1, /* "smollm": every \p{N} character alone, then the GPT-2 regex */
} kvs_tokenizer_pre_t;

/* Bytes that need not be NUL-terminated. */
typedef struct {
    const char *ptr;
    size_t len;
} kvs_tokenizer_str_t;

/* Everything a tokenizer is made from; kvs_tokenizer_create copies what it keeps. */
typedef struct {
    size_t n_tokens;
    const kvs_tokenizer_str_t *tokens; /* [n_tokens] text as stored: bytes through GPT-2's
                                          byte-to-unicode table ("Ġthe" for " the") */
    const int32_t *types;              /* [n_tokens] kvs_token_type_t; NULL: all NORMAL */
    size_t n_merges;
    const kvs_tokenizer_str_t *merges; /* [n_merges] "left right"; the index is the rank */
    uint32_t bos, eos;
    kvs_tokenizer_pre_t pre;
    kvs_tokenizer_str_t chat_template; /* {NULL, 0} when there is none */
} kvs_tokenizer_vocab_t;

typedef struct kvs_tokenizer kvs_tokenizer_t;

/* Validates and indexes the vocabulary. KVS_ERR_INVALID for an empty vocabulary or bos/eos
 * out of range; KVS_ERR_PROTOCOL (message naming the entry) for a merge that is not
 * "left right" over known tokens with a known result. */
kvs_status_t kvs_tokenizer_create(const kvs_tokenizer_vocab_t *vocab, kvs_tokenizer_t **tok_p);

/* From tokenizer.ggml.* and tokenizer.chat_template (bos/eos default to 0 when absent).
 * KVS_ERR_UNSUPPORTED for a model other than "gpt2" or a pre-tokenizer other than "smollm" and
 * "gpt2"; KVS_ERR_NOT_FOUND if the vocabulary arrays are absent; otherwise as
 * kvs_tokenizer_create. The tokenizer does not refer to the GGUF afterwards. */
kvs_status_t kvs_tokenizer_from_gguf(const kvs_gguf_t *gguf, kvs_tokenizer_t **tok_p);

void kvs_tokenizer_destroy(kvs_tokenizer_t *tok);

/* Encodes len bytes of text (any bytes: invalid UTF-8 goes through the byte-level mapping;
 * a byte with no token, such as 0xFF in SmolLM2, is dropped as the reference tokenizer drops
 * it). With parse_special, CONTROL tokens written literally in the text become their ids;
 * USER_DEFINED ones always do. No BOS is added. Writes the ids and their count to *n_p.
 * With ids == NULL (and cap 0) it only counts. KVS_ERR_NOSPACE if they do not fit in cap.
 * Safe to call from several threads on one tokenizer. */
kvs_status_t kvs_tokenizer_encode(const kvs_tokenizer_t *tok, const char *text, size_t len,
                                  int parse_special, uint32_t *ids, size_t cap, size_t *n_p);
/* The same into an array it allocates (free with kvs_free; NULL when the count is 0). */
kvs_status_t kvs_tokenizer_encode_alloc(const kvs_tokenizer_t *tok, const char *text, size_t len,
                                        int parse_special, uint32_t **ids_p, size_t *n_p);

/* The bytes one token stands for (byte-level mapping undone; CONTROL and USER_DEFINED tokens
 * give their text). A token may be part of a UTF-8 character: concatenate before printing.
 * Not NUL-terminated. KVS_ERR_INVALID for an id out of range, KVS_ERR_NOSPACE if cap is short. */
kvs_status_t kvs_tokenizer_decode(const kvs_tokenizer_t *tok, uint32_t id, char *buf, size_t cap,
                                  size_t *n_p);
/* The same bytes without a copy; they live as long as the tokenizer. */
kvs_status_t kvs_tokenizer_piece(const kvs_tokenizer_t *tok, uint32_t id, const char **bytes_p,
                                 size_t *len_p);

/* The id of a token by its stored text ("<|im_end|>", "Ġthe"). KVS_ERR_NOT_FOUND, not logged. */
kvs_status_t kvs_tokenizer_token_id(const kvs_tokenizer_t *tok, const char *text, size_t len,
                                    uint32_t *id_p);

uint32_t kvs_tokenizer_vocab_size(const kvs_tokenizer_t *tok);
uint32_t kvs_tokenizer_bos(const kvs_tokenizer_t *tok);
uint32_t kvs_tokenizer_eos(const kvs_tokenizer_t *tok);
/* 0 for an id out of range. */
kvs_token_type_t kvs_tokenizer_token_type(const kvs_tokenizer_t *tok, uint32_t id);
int kvs_tokenizer_is_control(const kvs_tokenizer_t *tok, uint32_t id);
/* The chat template from the vocabulary (NUL-terminated), or NULL when there is none. */
const char *kvs_tokenizer_chat_template(const kvs_tokenizer_t *tok);

typedef struct {
    const char *role; /* "system", "user", "assistant"... */
    const char *content;
} kvs_chat_msg_t;

/* Renders n messages as the chat template tmpl does, with "<|im_start|>assistant\n" appended
 * when add_generation_prompt. Only ChatML templates are recognised: each message as
 * "<|im_start|>ROLE\nCONTENT<|im_end|>\n", optionally preceded by the template's default
 * system message when the first message is not a system one (SmolLM2's and Qwen's templates).
 * Whitespace control ({%- -%}, and trim_blocks/lstrip_blocks as transformers renders),
 * quoting, message.role for message['role'] and split string literals do not matter.
 * tmpl NULL means plain ChatML without a default system message. KVS_ERR_UNSUPPORTED (logged)
 * for any other template. *text_p is NUL-terminated; free it with kvs_free. */
kvs_status_t kvs_chat_format(const char *tmpl, const kvs_chat_msg_t *msgs, size_t n,
                             int add_generation_prompt, char **text_p);

#endif
