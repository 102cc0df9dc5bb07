/* The byte-level BPE tokenizer: the vocabulary and its indexes (token text hash, merge ranks,
 * byte tokens, literal special tokens), encoding (special tokens split out, pre-tokenizer, BPE
 * by merge rank), decoding, and the recogniser and renderer of ChatML chat templates. */
#include "model/tokenizer.h"

#include <string.h>

#include "base/map.h"
#include "kvstage/alloc.h"
#include "kvstage/log.h"
#include "model/unicode.h"

#define NO_TOKEN UINT32_MAX
/* Code points GPT-2's byte-to-unicode table maps bytes to are all below this. */
#define BYTE_CHARS 324

struct kvs_tokenizer {
    uint32_t n_tokens;
    char *text;          /* token texts as stored, back to back */
    uint32_t *text_off;  /* [n_tokens + 1] */
    char *bytes;         /* what each token decodes to, back to back */
    uint32_t *bytes_off; /* [n_tokens + 1] */
    uint8_t *types;      /* [n_tokens] kvs_token_type_t */
    uint32_t *slots;     /* [slot_mask + 1] token id + 1 by text hash; 0 is empty */
    size_t slot_mask;
    uint32_t byte_token[256]; /* the token of each single byte, NO_TOKEN if it has none */
    kvs_map_t merges;         /* left << 32 | right -> rank + 1 */
    uint32_t *merge_result;   /* [n_merges] the token a merge makes */
    uint32_t *specials;       /* [n_specials] tokens matched literally in text */
    size_t n_specials;
    uint8_t special_first[256]; /* 1 if some special token starts with this byte */
    uint32_t bos, eos;
    kvs_tokenizer_pre_t pre;
    char *chat_template; /* NUL-terminated, or NULL */
};

/* GPT-2's reversible byte-to-unicode table: printable Latin-1 bytes stand for themselves, the
 * others for 256, 257... in byte order, so that no token text holds a space or control byte. */
static void byte_chars(uint32_t map[256])
{
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; b++) {
        int printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
        map[b] = printable ? b : next++;
    }
}

static uint64_t hash_bytes(const char *s, size_t len)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < len; i++) h = (h ^ (uint8_t) s[i]) * 1099511628211ull;
    return h ^ (h >> 29);
}

static const char *token_text(const kvs_tokenizer_t *tok, uint32_t id, size_t *len_p)
{
    *len_p = tok->text_off[id + 1] - tok->text_off[id];
    return tok->text + tok->text_off[id];
}

static uint32_t lookup(const kvs_tokenizer_t *tok, const char *s, size_t len)
{
    size_t i = (size_t) hash_bytes(s, len) & tok->slot_mask;
    for (;; i = (i + 1) & tok->slot_mask) {
        uint32_t v = tok->slots[i];
        if (v == 0) return NO_TOKEN;
        size_t tl;
        const char *t = token_text(tok, v - 1, &tl);
        if (tl == len && memcmp(t, s, len) == 0) return v - 1;
    }
}

static kvs_status_t index_texts(kvs_tokenizer_t *tok)
{
    size_t cap = 16;
    while (cap < (size_t) tok->n_tokens * 2) cap *= 2;
    tok->slots = kvs_calloc(cap, sizeof(*tok->slots));
    if (tok->slots == NULL) {
        kvs_error("tokenizer: out of memory for the token index (%zu slots)", cap);
        return KVS_ERR_NOMEM;
    }
    tok->slot_mask = cap - 1;
    for (uint32_t id = 0; id < tok->n_tokens; id++) {
        size_t len;
        const char *s = token_text(tok, id, &len);
        /* A duplicate text keeps its first id. */
        if (lookup(tok, s, len) != NO_TOKEN) continue;
        size_t i = (size_t) hash_bytes(s, len) & tok->slot_mask;
        while (tok->slots[i] != 0) i = (i + 1) & tok->slot_mask;
        tok->slots[i] = id + 1;
    }
    return KVS_OK;
}

/* Undoes the byte-level mapping of every normal token; other tokens decode to their text. */
static void decode_texts(kvs_tokenizer_t *tok)
{
    uint32_t map[256];
    int16_t inverse[BYTE_CHARS];
    byte_chars(map);
    for (size_t c = 0; c < BYTE_CHARS; c++) inverse[c] = -1;
    for (int b = 0; b < 256; b++) inverse[map[b]] = (int16_t) b;

    uint32_t out = 0;
    for (uint32_t id = 0; id < tok->n_tokens; id++) {
        size_t len;
        const uint8_t *s = (const uint8_t *) token_text(tok, id, &len);
        tok->bytes_off[id] = out;
        int mapped = tok->types[id] == KVS_TOKEN_NORMAL || tok->types[id] == KVS_TOKEN_UNKNOWN;
        for (size_t i = 0; i < len;) {
            uint32_t cp;
            size_t n = kvs_utf8_decode(s + i, len - i, &cp);
            if (mapped && cp < BYTE_CHARS && inverse[cp] >= 0) {
                tok->bytes[out++] = (char) inverse[cp];
            } else {
                /* Not a byte character: kept as written, so nothing is lost. */
                memcpy(tok->bytes + out, s + i, n);
                out += (uint32_t) n;
            }
            i += n;
        }
    }
    tok->bytes_off[tok->n_tokens] = out;
}

static kvs_status_t index_merges(kvs_tokenizer_t *tok, const kvs_tokenizer_vocab_t *vocab)
{
    if (vocab->n_merges >= UINT32_MAX) {
        kvs_error("tokenizer: %zu merges is too many", vocab->n_merges);
        return KVS_ERR_INVALID;
    }
    if (vocab->n_merges == 0) return KVS_OK;
    tok->merge_result = kvs_malloc(vocab->n_merges * sizeof(*tok->merge_result));
    size_t longest = 0;
    for (size_t r = 0; r < vocab->n_merges; r++)
        if (vocab->merges[r].len > longest) longest = vocab->merges[r].len;
    char *joined = kvs_malloc(longest + 1); /* [longest] the merge without its space */
    if (tok->merge_result == NULL || joined == NULL) {
        kvs_free(joined);
        kvs_error("tokenizer: out of memory indexing %zu merges", vocab->n_merges);
        return KVS_ERR_NOMEM;
    }
    kvs_status_t st = KVS_OK;
    for (size_t r = 0; r < vocab->n_merges && st == KVS_OK; r++) {
        const char *m = vocab->merges[r].ptr;
        size_t len = vocab->merges[r].len;
        const char *space = len ? memchr(m, ' ', len) : NULL;
        if (space == NULL || space == m || space == m + len - 1) {
            kvs_error("tokenizer: merge %zu \"%.*s\" is not \"left right\"", r,
                      (int) (len > 64 ? 64 : len), len ? m : "");
            st = KVS_ERR_PROTOCOL;
            break;
        }
        size_t ll = (size_t) (space - m), rl = len - ll - 1;
        memcpy(joined, m, ll);
        memcpy(joined + ll, space + 1, rl);
        uint32_t left = lookup(tok, m, ll), right = lookup(tok, space + 1, rl);
        uint32_t result = lookup(tok, joined, ll + rl);
        if (left == NO_TOKEN || right == NO_TOKEN || result == NO_TOKEN) {
            kvs_error("tokenizer: merge %zu \"%.*s\" names a token not in the vocabulary", r,
                      (int) (len > 64 ? 64 : len), m);
            st = KVS_ERR_PROTOCOL;
            break;
        }
        uint64_t key = (uint64_t) left << 32 | right;
        tok->merge_result[r] = result;
        /* A repeated pair keeps its lowest rank. */
        if (kvs_map_get(&tok->merges, key) != NULL) continue;
        st = kvs_map_put(&tok->merges, key, (void *) (uintptr_t) (r + 1));
        if (st != KVS_OK) kvs_error("tokenizer: out of memory indexing merge %zu", r);
    }
    kvs_free(joined);
    return st;
}

static kvs_status_t index_specials(kvs_tokenizer_t *tok)
{
    size_t n = 0;
    for (uint32_t id = 0; id < tok->n_tokens; id++)
        if ((tok->types[id] == KVS_TOKEN_CONTROL || tok->types[id] == KVS_TOKEN_USER_DEFINED) &&
            tok->text_off[id + 1] > tok->text_off[id])
            n++;
    if (n == 0) return KVS_OK;
    tok->specials = kvs_malloc(n * sizeof(*tok->specials));
    if (tok->specials == NULL) {
        kvs_error("tokenizer: out of memory for %zu special tokens", n);
        return KVS_ERR_NOMEM;
    }
    for (uint32_t id = 0; id < tok->n_tokens; id++) {
        if ((tok->types[id] == KVS_TOKEN_CONTROL || tok->types[id] == KVS_TOKEN_USER_DEFINED) &&
            tok->text_off[id + 1] > tok->text_off[id]) {
            tok->specials[tok->n_specials++] = id;
            tok->special_first[(uint8_t) tok->text[tok->text_off[id]]] = 1;
        }
    }
    return KVS_OK;
}

kvs_status_t kvs_tokenizer_create(const kvs_tokenizer_vocab_t *vocab, kvs_tokenizer_t **tok_p)
{
    if (vocab == NULL || tok_p == NULL || vocab->tokens == NULL || vocab->n_tokens == 0 ||
        (vocab->n_merges > 0 && vocab->merges == NULL)) {
        kvs_error("tokenizer: no vocabulary given");
        return KVS_ERR_INVALID;
    }
    if (vocab->n_tokens >= UINT32_MAX) {
        kvs_error("tokenizer: %zu tokens is too many", vocab->n_tokens);
        return KVS_ERR_INVALID;
    }
    if (vocab->bos >= vocab->n_tokens || vocab->eos >= vocab->n_tokens) {
        kvs_error("tokenizer: bos %u or eos %u outside the vocabulary of %zu", vocab->bos,
                  vocab->eos, vocab->n_tokens);
        return KVS_ERR_INVALID;
    }
    if (vocab->pre != KVS_TOKENIZER_PRE_GPT2 && vocab->pre != KVS_TOKENIZER_PRE_SMOLLM) {
        kvs_error("tokenizer: unknown pre-tokenizer %d", (int) vocab->pre);
        return KVS_ERR_INVALID;
    }
    size_t total = 0;
    for (size_t i = 0; i < vocab->n_tokens; i++) {
        if (vocab->tokens[i].ptr == NULL && vocab->tokens[i].len > 0) {
            kvs_error("tokenizer: token %zu has no text", i);
            return KVS_ERR_INVALID;
        }
        total += vocab->tokens[i].len;
        if (total >= UINT32_MAX) {
            kvs_error("tokenizer: token texts exceed 4 GiB");
            return KVS_ERR_INVALID;
        }
    }

    kvs_tokenizer_t *tok = kvs_calloc(1, sizeof(*tok));
    if (tok == NULL) {
        kvs_error("tokenizer: out of memory");
        return KVS_ERR_NOMEM;
    }
    kvs_map_init(&tok->merges);
    tok->n_tokens = (uint32_t) vocab->n_tokens;
    tok->bos = vocab->bos;
    tok->eos = vocab->eos;
    tok->pre = vocab->pre;
    tok->text = kvs_malloc(total + 1);
    tok->bytes = kvs_malloc(total + 1); /* decoding never lengthens a token */
    tok->text_off = kvs_malloc((vocab->n_tokens + 1) * sizeof(*tok->text_off));
    tok->bytes_off = kvs_malloc((vocab->n_tokens + 1) * sizeof(*tok->bytes_off));
    tok->types = kvs_malloc(vocab->n_tokens);
    if (vocab->chat_template.ptr != NULL) {
        tok->chat_template = kvs_malloc(vocab->chat_template.len + 1);
        if (tok->chat_template != NULL) {
            memcpy(tok->chat_template, vocab->chat_template.ptr, vocab->chat_template.len);
            tok->chat_template[vocab->chat_template.len] = 0;
        }
    }
    kvs_status_t st;
    if (tok->text == NULL || tok->bytes == NULL || tok->text_off == NULL ||
        tok->bytes_off == NULL || tok->types == NULL ||
        (vocab->chat_template.ptr != NULL && tok->chat_template == NULL)) {
        kvs_error("tokenizer: out of memory for %zu tokens", vocab->n_tokens);
        st = KVS_ERR_NOMEM;
        goto err_destroy;
    }
    uint32_t off = 0;
    for (uint32_t id = 0; id < tok->n_tokens; id++) {
        tok->text_off[id] = off;
        if (vocab->tokens[id].len)
            memcpy(tok->text + off, vocab->tokens[id].ptr, vocab->tokens[id].len);
        off += (uint32_t) vocab->tokens[id].len;
        int32_t type = vocab->types ? vocab->types[id] : KVS_TOKEN_NORMAL;
        if (type < KVS_TOKEN_NORMAL || type > KVS_TOKEN_BYTE) {
            kvs_error("tokenizer: token %u has unknown type %d", id, (int) type);
            st = KVS_ERR_PROTOCOL;
            goto err_destroy;
        }
        tok->types[id] = (uint8_t) type;
    }
    tok->text_off[tok->n_tokens] = off;
    decode_texts(tok);
    if ((st = index_texts(tok)) != KVS_OK) goto err_destroy;

    uint32_t map[256];
    byte_chars(map);
    for (int b = 0; b < 256; b++) {
        uint8_t utf8[4];
        size_t n = kvs_utf8_encode(map[b], utf8);
        tok->byte_token[b] = lookup(tok, (const char *) utf8, n);
    }
    if ((st = index_merges(tok, vocab)) != KVS_OK) goto err_destroy;
    if ((st = index_specials(tok)) != KVS_OK) goto err_destroy;
    *tok_p = tok;
    return KVS_OK;

err_destroy:
    kvs_tokenizer_destroy(tok);
    return st;
}

void kvs_tokenizer_destroy(kvs_tokenizer_t *tok)
{
    if (tok == NULL) return;
    kvs_map_fini(&tok->merges);
    kvs_free(tok->merge_result);
    kvs_free(tok->specials);
    kvs_free(tok->slots);
    kvs_free(tok->types);
    kvs_free(tok->bytes_off);
    kvs_free(tok->text_off);
    kvs_free(tok->bytes);
    kvs_free(tok->text);
    kvs_free(tok->chat_template);
    kvs_free(tok);
}

/* ---- GGUF ---- */

static int str_is(kvs_gguf_str_t s, const char *lit)
{
    return s.len == strlen(lit) && memcmp(s.ptr, lit, s.len) == 0;
}

static kvs_status_t gguf_str_array(const kvs_gguf_t *g, const char *key, size_t *n_p,
                                   kvs_tokenizer_str_t **arr_p)
{
    kvs_gguf_type_t type;
    uint64_t count;
    kvs_status_t st = kvs_gguf_array(g, key, &type, &count);
    if (st == KVS_ERR_NOT_FOUND) {
        kvs_error("tokenizer: GGUF has no %s", key);
        return st;
    }
    if (st != KVS_OK) return st;
    if (type != KVS_GGUF_STRING || count >= UINT32_MAX) {
        kvs_error("tokenizer: GGUF %s is not an array of strings (type %d, %llu entries)", key,
                  (int) type, (unsigned long long) count);
        return KVS_ERR_PROTOCOL;
    }
    kvs_tokenizer_str_t *arr = kvs_malloc((count ? count : 1) * sizeof(*arr));
    if (arr == NULL) {
        kvs_error("tokenizer: out of memory reading %s", key);
        return KVS_ERR_NOMEM;
    }
    for (uint64_t i = 0; i < count; i++) {
        kvs_gguf_str_t s;
        if ((st = kvs_gguf_array_str(g, key, i, &s)) != KVS_OK) {
            kvs_free(arr);
            return st;
        }
        arr[i].ptr = s.ptr;
        arr[i].len = (size_t) s.len;
    }
    *n_p = (size_t) count;
    *arr_p = arr;
    return KVS_OK;
}

kvs_status_t kvs_tokenizer_from_gguf(const kvs_gguf_t *gguf, kvs_tokenizer_t **tok_p)
{
    if (gguf == NULL || tok_p == NULL) {
        kvs_error("tokenizer: no GGUF given");
        return KVS_ERR_INVALID;
    }
    kvs_gguf_str_t model, pre;
    kvs_status_t st = kvs_gguf_str(gguf, "tokenizer.ggml.model", &model);
    if (st == KVS_ERR_NOT_FOUND) kvs_error("tokenizer: GGUF has no tokenizer.ggml.model");
    if (st != KVS_OK) return st;
    if (!str_is(model, "gpt2")) {
        kvs_error("tokenizer: tokenizer.ggml.model \"%.*s\" is not supported (only gpt2, "
                  "byte-level BPE)",
                  (int) (model.len > 64 ? 64 : model.len), model.ptr);
        return KVS_ERR_UNSUPPORTED;
    }
    kvs_tokenizer_vocab_t vocab = {0};
    st = kvs_gguf_str(gguf, "tokenizer.ggml.pre", &pre);
    if (st != KVS_OK && st != KVS_ERR_NOT_FOUND) return st;
    if (st == KVS_OK && str_is(pre, "smollm")) {
        vocab.pre = KVS_TOKENIZER_PRE_SMOLLM;
    } else if (st == KVS_OK && str_is(pre, "gpt2")) {
        vocab.pre = KVS_TOKENIZER_PRE_GPT2;
    } else {
        /* Guessing would give wrong ids without any sign of it. */
        kvs_error("tokenizer: pre-tokenizer \"%.*s\" is not supported (only smollm and gpt2)",
                  st == KVS_OK ? (int) (pre.len > 64 ? 64 : pre.len) : 7,
                  st == KVS_OK ? pre.ptr : "missing");
        return KVS_ERR_UNSUPPORTED;
    }
    if ((st = kvs_gguf_u32(gguf, "tokenizer.ggml.bos_token_id", &vocab.bos)) != KVS_OK) {
        if (st != KVS_ERR_NOT_FOUND) return st;
        vocab.bos = 0;
    }
    if ((st = kvs_gguf_u32(gguf, "tokenizer.ggml.eos_token_id", &vocab.eos)) != KVS_OK) {
        if (st != KVS_ERR_NOT_FOUND) return st;
        vocab.eos = 0;
    }
    kvs_gguf_str_t tmpl;
    st = kvs_gguf_str(gguf, "tokenizer.chat_template", &tmpl);
    if (st != KVS_OK && st != KVS_ERR_NOT_FOUND) return st;
    if (st == KVS_OK) {
        vocab.chat_template.ptr = tmpl.ptr;
        vocab.chat_template.len = (size_t) tmpl.len;
    }

    kvs_tokenizer_str_t *tokens = NULL, *merges = NULL;
    int32_t *types = NULL;
    if ((st = gguf_str_array(gguf, "tokenizer.ggml.tokens", &vocab.n_tokens, &tokens)) != KVS_OK)
        goto out;
    if ((st = gguf_str_array(gguf, "tokenizer.ggml.merges", &vocab.n_merges, &merges)) != KVS_OK)
        goto out;
    kvs_gguf_type_t type;
    uint64_t count;
    st = kvs_gguf_array(gguf, "tokenizer.ggml.token_type", &type, &count);
    if (st == KVS_OK) {
        if (count != vocab.n_tokens) {
            kvs_error("tokenizer: tokenizer.ggml.token_type has %llu entries for %zu tokens",
                      (unsigned long long) count, vocab.n_tokens);
            st = KVS_ERR_PROTOCOL;
            goto out;
        }
        types = kvs_malloc((count ? count : 1) * sizeof(*types));
        if (types == NULL) {
            kvs_error("tokenizer: out of memory reading token types");
            st = KVS_ERR_NOMEM;
            goto out;
        }
        for (uint64_t i = 0; i < count; i++) {
            int64_t v;
            if ((st = kvs_gguf_array_i64(gguf, "tokenizer.ggml.token_type", i, &v)) != KVS_OK)
                goto out;
            types[i] = (int32_t) (v < INT32_MIN || v > INT32_MAX ? INT32_MIN : v);
        }
    } else if (st != KVS_ERR_NOT_FOUND) {
        goto out;
    }
    vocab.tokens = tokens;
    vocab.merges = merges;
    vocab.types = types;
    st = kvs_tokenizer_create(&vocab, tok_p);
out:
    kvs_free(types);
    kvs_free(merges);
    kvs_free(tokens);
    return st;
}

/* ---- encoding ---- */

/* Where ids go: a caller's array (counting past its end) or one that grows. */
typedef struct {
    uint32_t *ids;
    size_t cap, n;
    int grow;
} id_sink_t;

static kvs_status_t sink_push(id_sink_t *sink, uint32_t id)
{
    if (sink->n == sink->cap && sink->grow) {
        size_t cap = sink->cap ? sink->cap * 2 : 64;
        uint32_t *ids = kvs_realloc(sink->ids, cap * sizeof(*ids));
        if (ids == NULL) {
            kvs_error("tokenizer: out of memory for %zu ids", cap);
            return KVS_ERR_NOMEM;
        }
        sink->ids = ids;
        sink->cap = cap;
    }
    if (sink->n < sink->cap) sink->ids[sink->n] = id;
    sink->n++;
    return KVS_OK;
}

/* A symbol of the piece being merged: a token in a list that merges shorten. */
typedef struct {
    uint32_t id; /* NO_TOKEN once merged into its left neighbour */
    int32_t prev, next;
} bpe_sym_t;

/* A possible merge of symbol pos with its right neighbour; valid while both still hold the
 * ids it was made from. Lowest rank first, then leftmost, as the reference applies them. */
typedef struct {
    uint64_t order; /* rank << 32 | pos */
    uint32_t left, right;
} bpe_cand_t;

typedef struct {
    bpe_sym_t *syms; /* [sym_cap] */
    size_t sym_cap;
    bpe_cand_t *heap; /* [heap_cap] a binary min-heap on order */
    size_t heap_cap, heap_n;
} bpe_scratch_t;

static void heap_push(bpe_scratch_t *b, bpe_cand_t c)
{
    size_t i = b->heap_n++;
    while (i > 0) {
        size_t parent = (i - 1) / 2;
        if (b->heap[parent].order <= c.order) break;
        b->heap[i] = b->heap[parent];
        i = parent;
    }
    b->heap[i] = c;
}

static bpe_cand_t heap_pop(bpe_scratch_t *b)
{
    bpe_cand_t top = b->heap[0], last = b->heap[--b->heap_n];
    size_t i = 0;
    for (;;) {
        size_t child = 2 * i + 1;
        if (child >= b->heap_n) break;
        if (child + 1 < b->heap_n && b->heap[child + 1].order < b->heap[child].order) child++;
        if (b->heap[child].order >= last.order) break;
        b->heap[i] = b->heap[child];
        i = child;
    }
    if (b->heap_n > 0) b->heap[i] = last;
    return top;
}

static void try_merge(const kvs_tokenizer_t *tok, bpe_scratch_t *b, int32_t pos)
{
    int32_t next = b->syms[pos].next;
    if (next < 0) return;
    uint64_t key = (uint64_t) b->syms[pos].id << 32 | b->syms[next].id;
    void *v = kvs_map_get(&tok->merges, key);
    if (v == NULL) return;
    uint64_t rank = (uint64_t) (uintptr_t) v - 1;
    bpe_cand_t c = {rank << 32 | (uint32_t) pos, b->syms[pos].id, b->syms[next].id};
    heap_push(b, c);
}

static kvs_status_t bpe_reserve(bpe_scratch_t *b, size_t len)
{
    /* Each merge adds at most two candidates to the len - 1 it starts with. */
    if (len > b->sym_cap) {
        bpe_sym_t *syms = kvs_realloc(b->syms, len * sizeof(*syms));
        if (syms == NULL) goto nomem;
        b->syms = syms;
        b->sym_cap = len;
    }
    if (3 * len > b->heap_cap) {
        bpe_cand_t *heap = kvs_realloc(b->heap, 3 * len * sizeof(*heap));
        if (heap == NULL) goto nomem;
        b->heap = heap;
        b->heap_cap = 3 * len;
    }
    return KVS_OK;
nomem:
    kvs_error("tokenizer: out of memory for a piece of %zu bytes", len);
    return KVS_ERR_NOMEM;
}

/* BPE over one pre-tokenized piece: its bytes become byte tokens (a byte without one is
 * dropped), then merges apply by rank until none is left. */
static kvs_status_t bpe_piece(const kvs_tokenizer_t *tok, const uint8_t *p, size_t len,
                              bpe_scratch_t *b, id_sink_t *sink)
{
    if (len == 1)
        return tok->byte_token[p[0]] == NO_TOKEN ? KVS_OK : sink_push(sink, tok->byte_token[p[0]]);
    kvs_status_t st = bpe_reserve(b, len);
    if (st != KVS_OK) return st;
    int32_t n = 0;
    for (size_t i = 0; i < len; i++) {
        uint32_t id = tok->byte_token[p[i]];
        if (id == NO_TOKEN) continue;
        b->syms[n] = (bpe_sym_t){id, n - 1, n + 1};
        n++;
    }
    if (n == 0) return KVS_OK;
    b->syms[n - 1].next = -1;
    b->heap_n = 0;
    for (int32_t i = 0; i + 1 < n; i++) try_merge(tok, b, i);
    while (b->heap_n > 0) {
        bpe_cand_t c = heap_pop(b);
        int32_t pos = (int32_t) (uint32_t) c.order;
        bpe_sym_t *s = &b->syms[pos];
        if (s->id != c.left || s->next < 0 || b->syms[s->next].id != c.right) continue;
        bpe_sym_t *right = &b->syms[s->next];
        s->id = tok->merge_result[c.order >> 32];
        s->next = right->next;
        right->id = NO_TOKEN;
        if (s->next >= 0) b->syms[s->next].prev = pos;
        if (s->prev >= 0) try_merge(tok, b, s->prev);
        try_merge(tok, b, pos);
    }
    /* Merges remove right neighbours, so symbol 0 always heads the list. */
    for (int32_t i = 0; i >= 0; i = b->syms[i].next)
        if ((st = sink_push(sink, b->syms[i].id)) != KVS_OK) return st;
    return KVS_OK;
}

static kvs_status_t encode_plain(const kvs_tokenizer_t *tok, const uint8_t *s, size_t len,
                                 bpe_scratch_t *b, id_sink_t *sink)
{
    int split_digits = tok->pre == KVS_TOKENIZER_PRE_SMOLLM;
    for (size_t pos = 0; pos < len;) {
        size_t n = kvs_pretok_next(s + pos, len - pos, split_digits);
        kvs_status_t st = bpe_piece(tok, s + pos, n, b, sink);
        if (st != KVS_OK) return st;
        pos += n;
    }
    return KVS_OK;
}

/* The longest special token written at s, or 0. */
static size_t match_special(const kvs_tokenizer_t *tok, const uint8_t *s, size_t len,
                            int parse_special, uint32_t *id_p)
{
    size_t best = 0;
    for (size_t k = 0; k < tok->n_specials; k++) {
        uint32_t id = tok->specials[k];
        if (tok->types[id] == KVS_TOKEN_CONTROL && !parse_special) continue;
        size_t tl;
        const char *t = token_text(tok, id, &tl);
        if (tl > best && tl <= len && memcmp(t, s, tl) == 0) {
            best = tl;
            *id_p = id;
        }
    }
    return best;
}

static kvs_status_t encode(const kvs_tokenizer_t *tok, const char *text, size_t len,
                           int parse_special, id_sink_t *sink)
{
    if (tok == NULL || (text == NULL && len > 0)) {
        kvs_error("tokenizer: encode without a tokenizer or text");
        return KVS_ERR_INVALID;
    }
    if (len > (size_t) INT32_MAX) {
        kvs_error("tokenizer: text of %zu bytes is too long to encode at once", len);
        return KVS_ERR_INVALID;
    }
    const uint8_t *s = (const uint8_t *) text;
    bpe_scratch_t b = {0};
    kvs_status_t st = KVS_OK;
    size_t start = 0;
    for (size_t i = 0; i < len && st == KVS_OK;) {
        uint32_t id;
        size_t m =
            tok->special_first[s[i]] ? match_special(tok, s + i, len - i, parse_special, &id) : 0;
        if (m == 0) {
            i++;
            continue;
        }
        if ((st = encode_plain(tok, s + start, i - start, &b, sink)) != KVS_OK) break;
        st = sink_push(sink, id);
        i += m;
        start = i;
    }
    if (st == KVS_OK) st = encode_plain(tok, s + start, len - start, &b, sink);
    kvs_free(b.syms);
    kvs_free(b.heap);
    return st;
}

kvs_status_t kvs_tokenizer_encode(const kvs_tokenizer_t *tok, const char *text, size_t len,
                                  int parse_special, uint32_t *ids, size_t cap, size_t *n_p)
{
    if (n_p == NULL || (ids == NULL && cap > 0)) {
        kvs_error("tokenizer: encode needs a count and, with a capacity, an id array");
        return KVS_ERR_INVALID;
    }
    id_sink_t sink = {ids, cap, 0, 0};
    kvs_status_t st = encode(tok, text, len, parse_special, &sink);
    if (st != KVS_OK) return st;
    if (ids != NULL && sink.n > cap) {
        kvs_error("tokenizer: %zu ids do not fit in %zu", sink.n, cap);
        return KVS_ERR_NOSPACE;
    }
    *n_p = sink.n;
    return KVS_OK;
}

kvs_status_t kvs_tokenizer_encode_alloc(const kvs_tokenizer_t *tok, const char *text, size_t len,
                                        int parse_special, uint32_t **ids_p, size_t *n_p)
{
    if (ids_p == NULL || n_p == NULL) {
        kvs_error("tokenizer: encode_alloc needs ids_p and n_p");
        return KVS_ERR_INVALID;
    }
    id_sink_t sink = {NULL, 0, 0, 1};
    kvs_status_t st = encode(tok, text, len, parse_special, &sink);
    if (st != KVS_OK) {
        kvs_free(sink.ids);
        return st;
    }
    *ids_p = sink.ids;
    *n_p = sink.n;
    return KVS_OK;
}

/* ---- decoding and queries ---- */

kvs_status_t kvs_tokenizer_piece(const kvs_tokenizer_t *tok, uint32_t id, const char **bytes_p,
                                 size_t *len_p)
{
    if (tok == NULL || id >= tok->n_tokens) {
        kvs_error("tokenizer: token %u outside the vocabulary of %u", id, tok ? tok->n_tokens : 0);
        return KVS_ERR_INVALID;
    }
    *bytes_p = tok->bytes + tok->bytes_off[id];
    *len_p = tok->bytes_off[id + 1] - tok->bytes_off[id];
    return KVS_OK;
}

kvs_status_t kvs_tokenizer_decode(const kvs_tokenizer_t *tok, uint32_t id, char *buf, size_t cap,
                                  size_t *n_p)
{
    const char *bytes;
    size_t len;
    kvs_status_t st = kvs_tokenizer_piece(tok, id, &bytes, &len);
    if (st != KVS_OK) return st;
    if (len > cap) {
        kvs_error("tokenizer: token %u is %zu bytes, buffer %zu", id, len, cap);
        return KVS_ERR_NOSPACE;
    }
    if (len) memcpy(buf, bytes, len);
    *n_p = len;
    return KVS_OK;
}

kvs_status_t kvs_tokenizer_token_id(const kvs_tokenizer_t *tok, const char *text, size_t len,
                                    uint32_t *id_p)
{
    uint32_t id = lookup(tok, text, len);
    if (id == NO_TOKEN) return KVS_ERR_NOT_FOUND;
    *id_p = id;
    return KVS_OK;
}

uint32_t kvs_tokenizer_vocab_size(const kvs_tokenizer_t *tok)
{
    return tok->n_tokens;
}

uint32_t kvs_tokenizer_bos(const kvs_tokenizer_t *tok)
{
    return tok->bos;
}

uint32_t kvs_tokenizer_eos(const kvs_tokenizer_t *tok)
{
    return tok->eos;
}

kvs_token_type_t kvs_tokenizer_token_type(const kvs_tokenizer_t *tok, uint32_t id)
{
    return id < tok->n_tokens ? (kvs_token_type_t) tok->types[id] : (kvs_token_type_t) 0;
}

int kvs_tokenizer_is_control(const kvs_tokenizer_t *tok, uint32_t id)
{
    return kvs_tokenizer_token_type(tok, id) == KVS_TOKEN_CONTROL;
}

const char *kvs_tokenizer_chat_template(const kvs_tokenizer_t *tok)
{
    return tok->chat_template;
}

/* ---- chat templates ----
 * A template is lexed the way Jinja (as transformers configures it: trim_blocks,
 * lstrip_blocks) would see it, normalised (attribute access as subscripts, adjacent string
 * literals joined), and compared token by token with the ChatML templates below; a match is
 * rendered directly. */

typedef enum {
    TT_TEXT, /* output outside tags, after whitespace control */
    TT_STMT_OPEN,
    TT_STMT_CLOSE,
    TT_EXPR_OPEN,
    TT_EXPR_CLOSE,
    TT_NAME,
    TT_STRING, /* the literal's value, escapes undone */
    TT_NUMBER,
    TT_OP,
} tmpl_kind_t;

typedef struct {
    tmpl_kind_t kind;
    const char *p;
    size_t n;
} tmpl_tok_t;

typedef struct {
    tmpl_tok_t *toks; /* [cap] */
    size_t n, cap;
    char *strs; /* string values, in token order: adjacent literals are adjacent here */
    size_t strs_n;
} tmpl_lex_t;

/* The placeholder for the default system message in the templates below. */
#define TMPL_CAPTURE "\x01"

#define TMPL_LOOP_START "{% for message in messages %}"
#define TMPL_SYSTEM                                                                                \
    "{% if loop.first and messages[0]['role'] != 'system' %}{{ '" TMPL_CAPTURE "' }}{% endif %}"
#define TMPL_MESSAGE                                                                               \
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"        \
    "{% endfor %}"
#define TMPL_PROMPT "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"

/* The ChatML forms recognised: with or without a default system message, and with or without
 * the generation prompt (without it, add_generation_prompt changes nothing, as in Jinja). */
static const struct {
    const char *text;
    int system, prompt;
} tmpl_forms[] = {
    {TMPL_LOOP_START TMPL_MESSAGE TMPL_PROMPT, 0, 1},
    {TMPL_LOOP_START TMPL_SYSTEM TMPL_MESSAGE TMPL_PROMPT, 1, 1},
    {TMPL_LOOP_START TMPL_MESSAGE, 0, 0},
    {TMPL_LOOP_START TMPL_SYSTEM TMPL_MESSAGE, 1, 0},
};

static int is_space(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

static int is_name_char(char c, int first)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
           (!first && c >= '0' && c <= '9');
}

static int hex_value(char c)
{
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static int lex_push(tmpl_lex_t *lx, tmpl_kind_t kind, const char *p, size_t n)
{
    if (lx->n == lx->cap) return 0;
    lx->toks[lx->n++] = (tmpl_tok_t){kind, p, n};
    return 1;
}

/* A quoted literal at s[*pos] (on the quote) with Python's escapes; 0 if it cannot be read. */
static int lex_string(tmpl_lex_t *lx, const char *s, size_t len, size_t *pos)
{
    char quote = s[*pos];
    size_t i = *pos + 1;
    char *out = lx->strs + lx->strs_n;
    size_t n = 0;
    for (;;) {
        if (i >= len) return 0;
        char c = s[i++];
        if (c == quote) break;
        if (c != '\\') {
            out[n++] = c;
            continue;
        }
        if (i >= len) return 0;
        c = s[i++];
        int digits = 0;
        switch (c) {
        case 'n':
            out[n++] = '\n';
            break;
        case 't':
            out[n++] = '\t';
            break;
        case 'r':
            out[n++] = '\r';
            break;
        case '\\':
        case '\'':
        case '"':
            out[n++] = c;
            break;
        case 'x':
            digits = 2;
            break;
        case 'u':
            digits = 4;
            break;
        case 'U':
            digits = 8;
            break;
        default:
            return 0; /* rarer escapes: not a template we know */
        }
        if (digits) {
            uint32_t cp = 0;
            for (int d = 0; d < digits; d++) {
                int v = i < len ? hex_value(s[i++]) : -1;
                if (v < 0) return 0;
                cp = cp << 4 | (uint32_t) v;
            }
            if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
            n += kvs_utf8_encode(cp, (uint8_t *) out + n);
        }
    }
    lx->strs_n += n;
    *pos = i;
    return lex_push(lx, TT_STRING, out, n);
}

/* Lexes s (newlines already normalised). 0 when it is not something this lexer can read. */
static int tmpl_lex(tmpl_lex_t *lx, const char *s, size_t len)
{
    size_t pos = 0;
    while (pos < len) {
        /* Output text up to the next tag. */
        size_t tag = pos;
        while (tag + 1 < len &&
               !(s[tag] == '{' && (s[tag + 1] == '{' || s[tag + 1] == '%' || s[tag + 1] == '#')))
            tag++;
        if (tag + 1 >= len) tag = len;
        size_t text_end = tag;
        if (tag < len) {
            char kind = s[tag + 1];
            char sign = tag + 2 < len ? s[tag + 2] : 0;
            if (sign == '-') {
                while (text_end > pos && is_space(s[text_end - 1])) text_end--;
            } else if (sign != '+' && kind != '{') {
                /* lstrip_blocks: whitespace between a line start and a block tag goes. */
                size_t line = text_end;
                while (line > pos && s[line - 1] != '\n') line--;
                int at_line_start = line > pos || pos == 0 || s[pos - 1] == '\n';
                size_t i = line;
                while (i < text_end && is_space(s[i])) i++;
                if (at_line_start && i == text_end) text_end = line;
            }
        }
        if (text_end > pos && !lex_push(lx, TT_TEXT, s + pos, text_end - pos)) return 0;
        if (tag >= len) break;

        char kind = s[tag + 1];
        pos = tag + 2;
        if (pos < len && (s[pos] == '-' || (s[pos] == '+' && kind != '{'))) pos++;
        int trim_after = 0;
        if (kind == '#') {
            for (;; pos++) {
                if (pos + 1 >= len) return 0;
                if (s[pos] == '#' && s[pos + 1] == '}') break;
            }
            trim_after = s[pos - 1] == '-';
            pos += 2;
        } else {
            char close = kind == '%' ? '%' : '}';
            if (!lex_push(lx, kind == '%' ? TT_STMT_OPEN : TT_EXPR_OPEN, s + tag, 2)) return 0;
            for (;;) {
                while (pos < len && is_space(s[pos])) pos++;
                if (pos >= len) return 0;
                if (s[pos] == '-' && pos + 2 < len && s[pos + 1] == close && s[pos + 2] == '}') {
                    trim_after = 1;
                    pos++;
                }
                if (s[pos] == close && pos + 1 < len && s[pos + 1] == '}') {
                    if (!lex_push(lx, kind == '%' ? TT_STMT_CLOSE : TT_EXPR_CLOSE, s + pos, 2))
                        return 0;
                    pos += 2;
                    break;
                }
                char c = s[pos];
                if (c == '\'' || c == '"') {
                    if (!lex_string(lx, s, len, &pos)) return 0;
                } else if (is_name_char(c, 1)) {
                    size_t e = pos;
                    while (e < len && is_name_char(s[e], 0)) e++;
                    if (!lex_push(lx, TT_NAME, s + pos, e - pos)) return 0;
                    pos = e;
                } else if (c >= '0' && c <= '9') {
                    size_t e = pos;
                    while (e < len && s[e] >= '0' && s[e] <= '9') e++;
                    if (!lex_push(lx, TT_NUMBER, s + pos, e - pos)) return 0;
                    pos = e;
                } else {
                    size_t n = 1;
                    if (pos + 1 < len && s[pos + 1] == '=' &&
                        (c == '=' || c == '!' || c == '<' || c == '>'))
                        n = 2;
                    if (!lex_push(lx, TT_OP, s + pos, n)) return 0;
                    pos += n;
                }
            }
        }
        if (trim_after) {
            while (pos < len && is_space(s[pos])) pos++;
        } else if (kind != '{' && pos < len && s[pos] == '\n') {
            pos++; /* trim_blocks */
        }
    }
    return 1;
}

static int tok_is(const tmpl_tok_t *t, tmpl_kind_t kind, const char *text)
{
    return t->kind == kind && t->n == strlen(text) && memcmp(t->p, text, t->n) == 0;
}

/* in -> out (room for twice as many tokens): message.role becomes message['role'], and
 * 'a' + 'b' becomes 'ab' (the values of adjacent literals are adjacent in strs). */
static size_t tmpl_normalise(const tmpl_lex_t *lx, tmpl_tok_t *out)
{
    size_t n = 0;
    for (size_t i = 0; i < lx->n; i++) {
        tmpl_tok_t t = lx->toks[i];
        if (n >= 2 && t.kind == TT_NAME && tok_is(&out[n - 1], TT_OP, ".") &&
            (out[n - 2].kind == TT_NAME || tok_is(&out[n - 2], TT_OP, "]"))) {
            out[n - 1] = (tmpl_tok_t){TT_OP, "[", 1};
            out[n++] = (tmpl_tok_t){TT_STRING, t.p, t.n};
            out[n++] = (tmpl_tok_t){TT_OP, "]", 1};
            continue;
        }
        if (n >= 2 && t.kind == TT_STRING && tok_is(&out[n - 1], TT_OP, "+") &&
            out[n - 2].kind == TT_STRING && out[n - 2].p + out[n - 2].n == t.p) {
            out[n - 2].n += t.n;
            n--;
            continue;
        }
        out[n++] = t;
    }
    return n;
}

/* A lexed and normalised template; everything lives in mem. */
typedef struct {
    void *mem;
    tmpl_tok_t *toks;
    size_t n;
} tmpl_t;

/* KVS_ERR_UNSUPPORTED (not logged) for text the lexer cannot read. */
static kvs_status_t tmpl_read(const char *src, size_t len, tmpl_t *t)
{
    /* A token takes at least one byte of source and a literal's value is no longer than its
     * source; normalising turns 3 tokens (a.b) into 4 (a['b']). */
    size_t cap = len + 1;
    /* [cap] lexed tokens, [2 * cap] normalised tokens, [cap] source, [cap] string values */
    tmpl_tok_t *mem = kvs_malloc(3 * cap * sizeof(tmpl_tok_t) + 2 * cap);
    if (mem == NULL) {
        kvs_error("chat: out of memory reading a template of %zu bytes", len);
        return KVS_ERR_NOMEM;
    }
    tmpl_tok_t *lexed = mem, *norm = mem + cap;
    char *s = (char *) (norm + 2 * cap), *strs = s + cap;
    size_t n = 0;
    for (size_t i = 0; i < len; i++) {
        /* Jinja reads \r\n and \r as \n, and drops one newline at the very end. */
        if (src[i] == '\r') {
            s[n++] = '\n';
            if (i + 1 < len && src[i + 1] == '\n') i++;
        } else {
            s[n++] = src[i];
        }
    }
    if (n > 0 && s[n - 1] == '\n') n--;
    tmpl_lex_t lx = {lexed, 0, cap, strs, 0};
    if (!tmpl_lex(&lx, s, n)) {
        kvs_free(mem);
        return KVS_ERR_UNSUPPORTED;
    }
    t->mem = mem;
    t->toks = norm;
    t->n = tmpl_normalise(&lx, norm);
    return KVS_OK;
}

static int tmpl_match(const tmpl_t *in, const tmpl_t *canon, tmpl_tok_t *capture_p)
{
    if (in->n != canon->n) return 0;
    for (size_t i = 0; i < in->n; i++) {
        const tmpl_tok_t *c = &canon->toks[i], *t = &in->toks[i];
        if (c->kind != t->kind) return 0;
        if (c->kind == TT_STRING && tok_is(c, TT_STRING, TMPL_CAPTURE)) {
            *capture_p = *t;
            continue;
        }
        if (c->n != t->n || memcmp(c->p, t->p, c->n) != 0) return 0;
    }
    return 1;
}

/* What a recognised template renders. */
typedef struct {
    int prompt;   /* it has the generation prompt */
    char *system; /* its default system message (kvs_free it), or NULL */
    size_t system_len;
} tmpl_form_t;

/* KVS_ERR_UNSUPPORTED (logged) unless tmpl is one of tmpl_forms. */
static kvs_status_t tmpl_recognise(const char *tmpl, tmpl_form_t *form_p)
{
    tmpl_t in = {0};
    kvs_status_t st = tmpl_read(tmpl, strlen(tmpl), &in);
    int found = 0;
    for (size_t f = 0; f < sizeof(tmpl_forms) / sizeof(tmpl_forms[0]) && st == KVS_OK && !found;
         f++) {
        tmpl_t canon;
        st = tmpl_read(tmpl_forms[f].text, strlen(tmpl_forms[f].text), &canon);
        if (st != KVS_OK) break;
        tmpl_tok_t capture = {TT_STRING, NULL, 0};
        if (tmpl_match(&in, &canon, &capture)) {
            found = 1;
            tmpl_form_t form = {tmpl_forms[f].prompt, NULL, 0};
            if (tmpl_forms[f].system) {
                form.system = kvs_malloc(capture.n + 1);
                if (form.system == NULL) {
                    kvs_error("chat: out of memory");
                    st = KVS_ERR_NOMEM;
                } else {
                    memcpy(form.system, capture.p, capture.n);
                    form.system[capture.n] = 0;
                    form.system_len = capture.n;
                }
            }
            if (st == KVS_OK) *form_p = form;
        }
        kvs_free(canon.mem);
    }
    kvs_free(in.mem);
    if (st == KVS_ERR_UNSUPPORTED || (st == KVS_OK && !found)) {
        kvs_error("chat: the chat template is not one this renderer knows: only ChatML "
                  "(<|im_start|>role\\ncontent<|im_end|>\\n per message, optionally after a "
                  "default system message) is recognised; Jinja is not interpreted");
        return KVS_ERR_UNSUPPORTED;
    }
    return st;
}

static char *append(char *out, const char *s, size_t n)
{
    memcpy(out, s, n);
    return out + n;
}

kvs_status_t kvs_chat_format(const char *tmpl, const kvs_chat_msg_t *msgs, size_t n,
                             int add_generation_prompt, char **text_p)
{
    static const char start[] = "<|im_start|>", end[] = "<|im_end|>\n";
    static const char prompt[] = "<|im_start|>assistant\n";
    if (text_p == NULL || (msgs == NULL && n > 0)) {
        kvs_error("chat: no messages or output given");
        return KVS_ERR_INVALID;
    }
    for (size_t i = 0; i < n; i++) {
        if (msgs[i].role == NULL || msgs[i].content == NULL) {
            kvs_error("chat: message %zu has no role or content", i);
            return KVS_ERR_INVALID;
        }
    }
    tmpl_form_t form = {1, NULL, 0}; /* no template: plain ChatML */
    if (tmpl != NULL) {
        kvs_status_t st = tmpl_recognise(tmpl, &form);
        if (st != KVS_OK) return st;
    }
    /* Jinja emits the default inside the loop, on the first message only. */
    int emit_system = form.system != NULL && n > 0 && strcmp(msgs[0].role, "system") != 0;
    int emit_prompt = form.prompt && add_generation_prompt;
    size_t total = (emit_system ? form.system_len : 0) + (emit_prompt ? sizeof(prompt) - 1 : 0);
    for (size_t i = 0; i < n; i++)
        total += sizeof(start) - 1 + strlen(msgs[i].role) + 1 + strlen(msgs[i].content) +
                 sizeof(end) - 1;
    char *text = kvs_malloc(total + 1);
    if (text == NULL) {
        kvs_error("chat: out of memory for %zu bytes", total);
        kvs_free(form.system);
        return KVS_ERR_NOMEM;
    }
    char *o = text;
    if (emit_system) o = append(o, form.system, form.system_len);
    for (size_t i = 0; i < n; i++) {
        o = append(o, start, sizeof(start) - 1);
        o = append(o, msgs[i].role, strlen(msgs[i].role));
        *o++ = '\n';
        o = append(o, msgs[i].content, strlen(msgs[i].content));
        o = append(o, end, sizeof(end) - 1);
    }
    if (emit_prompt) o = append(o, prompt, sizeof(prompt) - 1);
    *o = 0;
    kvs_free(form.system);
    *text_p = text;
    return KVS_OK;
}
