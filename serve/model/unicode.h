/* Unicode for the tokenizer: UTF-8 decoding that never fails on bad input, the three character
 * classes the GPT-2 pre-tokenizer distinguishes (letters, numbers, whitespace), and that
 * pre-tokenizer itself, which cuts text into the pieces BPE works on. */
#ifndef KVSTAGE_MODEL_UNICODE_H
#define KVSTAGE_MODEL_UNICODE_H

#include <stddef.h>
#include <stdint.h>

typedef enum {
    KVS_UCLASS_OTHER = 0,
    KVS_UCLASS_LETTER = 1, /* \p{L}: Lu Ll Lt Lm Lo */
    KVS_UCLASS_NUMBER = 2, /* \p{N}: Nd Nl No */
    KVS_UCLASS_SPACE = 3,  /* \s as Oniguruma defines it: U+0009..U+000D, U+0085, Zs Zl Zp */
} kvs_uclass_t;

/* What kvs_utf8_decode yields for a byte that does not start a well-formed sequence. */
#define KVS_UNICODE_INVALID 0xFFFFFFFFu

/* The class of a code point; KVS_UCLASS_OTHER for KVS_UNICODE_INVALID and unassigned ones. */
kvs_uclass_t kvs_unicode_class(uint32_t cp);

/* Decodes the sequence at s[0..len), len >= 1, and returns the bytes it takes (1..4).
 * A malformed or truncated sequence, an overlong form, a surrogate or a value above U+10FFFF
 * takes exactly one byte and yields KVS_UNICODE_INVALID, so any byte string decodes. */
size_t kvs_utf8_decode(const uint8_t *s, size_t len, uint32_t *cp_p);

/* Encodes cp (at most U+10FFFF, not KVS_UNICODE_INVALID) into out; returns the length. */
size_t kvs_utf8_encode(uint32_t cp, uint8_t out[4]);

/* The length of the first piece of s[0..len), len >= 1, as the GPT-2 pre-tokenizer regex
 *   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 * cuts it. With split_digits every \p{N} character is a piece of its own and the regex never
 * looks across one (SmolLM2's Digits(individual_digits) pre-tokenizer runs before the regex).
 * A byte that is not UTF-8 counts as one character of no class. */
size_t kvs_pretok_next(const uint8_t *s, size_t len, int split_digits);

#endif
