/* Tests for the tokenizer: Unicode classes and UTF-8 decoding, pre-tokenizer pieces, BPE on a
 * hand-made vocabulary, loading from GGUF, SmolLM2's ids against the reference data
 * (data/tokenizer_smollm2.txt, from HF tokenizers), round trips of random text, allocation
 * failures, and ChatML rendering against jinja2 (data/tokenizer_chat.txt). */
#include "kvs_test.h"

#include <string.h>

#include "model/gguf.h"
#include "kvstage/rng.h"
#include "model/tokenizer.h"
#include "model/gguf_writer.h"
#include "model/unicode.h"

/* ---- helpers ---- */

/* The data files sit beside this source file. */
static void data_path(const char *name, char *buf, size_t cap)
{
    const char *file = __FILE__;
    const char *slash = strrchr(file, '/');
    size_t dir = slash ? (size_t) (slash - file + 1) : 0;
    snprintf(buf, cap, "%.*sdata/%s", (int) dir, file, name);
}

/* The whole file, NUL-terminated; free with kvs_free. */
static char *read_data(const char *name)
{
    char path[4096];
    data_path(name, path, sizeof(path));
    FILE *f = fopen(path, "rb");
    if (f == NULL) fail_msg("cannot open %s", path);
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = kvs_malloc((size_t) size + 1);
    assert_non_null(buf);
    assert_int_equal(fread(buf, 1, (size_t) size, f), (size_t) size);
    buf[size] = 0;
    fclose(f);
    return buf;
}

/* Undoes the data files' escapes (\\ \n \t \r \xHH) into out; returns the length. */
static size_t unescape(const char *s, size_t len, char *out)
{
    size_t n = 0;
    for (size_t i = 0; i < len; i++) {
        if (s[i] != '\\') {
            out[n++] = s[i];
            continue;
        }
        assert_true(i + 1 < len);
        char c = s[++i];
        if (c == 'n') {
            out[n++] = '\n';
        } else if (c == 't') {
            out[n++] = '\t';
        } else if (c == 'r') {
            out[n++] = '\r';
        } else if (c == '\\') {
            out[n++] = '\\';
        } else if (c == 'x') {
            assert_true(i + 2 < len);
            char hex[3] = {s[i + 1], s[i + 2], 0};
            out[n++] = (char) strtol(hex, NULL, 16);
            i += 2;
        } else {
            fail_msg("bad escape \\%c in test data", c);
        }
    }
    return n;
}

/* Splits line at tabs into at most max fields (pointers into line, which is modified). */
static int split_tabs(char *line, char **fields, int max)
{
    int n = 0;
    fields[n++] = line;
    for (char *p = line; *p && n < max; p++) {
        if (*p == '\t') {
            *p = 0;
            fields[n++] = p + 1;
        }
    }
    return n;
}

/* GPT-2's byte-to-unicode table, spelled out independently of the library. */
static void byte_char(int b, char out[3])
{
    int printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
    int cp = b;
    if (!printable) {
        cp = 256;
        for (int i = 0; i < b; i++)
            if (!((i >= 33 && i <= 126) || (i >= 161 && i <= 172) || i >= 174)) cp++;
    }
    if (cp < 0x80) {
        out[0] = (char) cp;
        out[1] = 0;
    } else {
        out[0] = (char) (0xC0 | cp >> 6);
        out[1] = (char) (0x80 | (cp & 0x3F));
        out[2] = 0;
    }
}

static uint32_t id_of(const kvs_tokenizer_t *tok, const char *text)
{
    uint32_t id;
    if (kvs_tokenizer_token_id(tok, text, strlen(text), &id) != KVS_OK)
        fail_msg("no token \"%s\"", text);
    return id;
}

/* Encodes text and checks the tokens against their stored texts (NULL-terminated list). */
static void expect_tokens(const kvs_tokenizer_t *tok, const char *text, size_t len,
                          int parse_special, const char *const *want)
{
    uint32_t ids[64];
    size_t n;
    assert_int_equal(kvs_tokenizer_encode(tok, text, len, parse_special, ids, 64, &n), KVS_OK);
    size_t w = 0;
    while (want[w] != NULL) w++;
    if (n != w) fail_msg("\"%.*s\": %zu tokens, expected %zu", (int) len, text, n, w);
    for (size_t i = 0; i < n; i++) {
        uint32_t id = id_of(tok, want[i]);
        if (ids[i] != id)
            fail_msg("\"%.*s\": token %zu is %u, expected %u (\"%s\")", (int) len, text, i, ids[i],
                     id, want[i]);
    }
}

/* The concatenated bytes of ids; returns the length (out has room for cap). */
static size_t decode_all(const kvs_tokenizer_t *tok, const uint32_t *ids, size_t n, char *out,
                         size_t cap)
{
    size_t len = 0;
    for (size_t i = 0; i < n; i++) {
        size_t k;
        assert_int_equal(kvs_tokenizer_decode(tok, ids[i], out + len, cap - len, &k), KVS_OK);
        len += k;
    }
    return len;
}

/* ---- a hand-made vocabulary ----
 * ids: the specials, then the single bytes 0x00..0x7F (no token for 0x80..0xFF, so 'é'
 * and other multi-byte characters are dropped), then merged tokens. */

static const char *const tiny_specials[] = {"<s>", "</s>", "<s>x", "<u>"};
static const int32_t tiny_special_types[] = {KVS_TOKEN_CONTROL, KVS_TOKEN_CONTROL,
                                             KVS_TOKEN_CONTROL, KVS_TOKEN_USER_DEFINED};
#define TINY_SPECIALS 4
#define TINY_BYTES    0x80

static const char *const tiny_merged[] = {"ab", "bc", "abc", "aa", "aaaa", "Ġa", "Ġab", "!!"};

static kvs_status_t tiny_create(const char *const *merges, size_t n_merges, kvs_tokenizer_t **tok_p)
{
    enum { N = TINY_SPECIALS + TINY_BYTES + sizeof(tiny_merged) / sizeof(tiny_merged[0]) };
    static char bytes[TINY_BYTES][3];
    kvs_tokenizer_str_t tokens[N];
    kvs_tokenizer_str_t merge_strs[16];
    int32_t types[N];
    size_t n = 0;
    for (int i = 0; i < TINY_SPECIALS; i++) {
        tokens[n] = (kvs_tokenizer_str_t){tiny_specials[i], strlen(tiny_specials[i])};
        types[n++] = tiny_special_types[i];
    }
    for (int b = 0; b < TINY_BYTES; b++) {
        byte_char(b, bytes[b]);
        tokens[n] = (kvs_tokenizer_str_t){bytes[b], strlen(bytes[b])};
        types[n++] = KVS_TOKEN_NORMAL;
    }
    for (size_t i = 0; i < sizeof(tiny_merged) / sizeof(tiny_merged[0]); i++) {
        tokens[n] = (kvs_tokenizer_str_t){tiny_merged[i], strlen(tiny_merged[i])};
        types[n++] = KVS_TOKEN_NORMAL;
    }
    assert_true(n_merges <= 16);
    for (size_t i = 0; i < n_merges; i++)
        merge_strs[i] = (kvs_tokenizer_str_t){merges[i], strlen(merges[i])};
    kvs_tokenizer_vocab_t vocab = {
        .n_tokens = n,
        .tokens = tokens,
        .types = types,
        .n_merges = n_merges,
        .merges = merge_strs,
        .bos = 0,
        .eos = 1,
        .pre = KVS_TOKENIZER_PRE_SMOLLM,
        .chat_template = {"{{ x }}", 7},
    };
    return kvs_tokenizer_create(&vocab, tok_p);
}

/* Rank order: "a b" first, so " ab" cannot become "Ġab". */
static const char *const tiny_merges_ab_first[] = {"a b",   "b c", "ab c", "a a",
                                                   "aa aa", "Ġ a", "Ġa b", "! !"};
/* The same merges with "Ġ a" first. */
static const char *const tiny_merges_space_first[] = {"Ġ a", "a b", "Ġa b", "b c", "ab c"};

/* ---- Unicode ---- */

static void test_unicode_classes(void **state)
{
    (void) state;
    static const struct {
        uint32_t cp;
        kvs_uclass_t cls;
    } cases[] = {
        {'a', KVS_UCLASS_LETTER},
        {'Z', KVS_UCLASS_LETTER},
        {'5', KVS_UCLASS_NUMBER},
        {' ', KVS_UCLASS_SPACE},
        {'\t', KVS_UCLASS_SPACE},
        {'\n', KVS_UCLASS_SPACE},
        {0x0B, KVS_UCLASS_SPACE},
        {'\r', KVS_UCLASS_SPACE},
        {'!', KVS_UCLASS_OTHER},
        {'\'', KVS_UCLASS_OTHER},
        {0x00, KVS_UCLASS_OTHER},
        {0x1C, KVS_UCLASS_OTHER},
        {0x1F, KVS_UCLASS_OTHER},
        {0x7F, KVS_UCLASS_OTHER},
        {0x85, KVS_UCLASS_SPACE},
        {0xA0, KVS_UCLASS_SPACE},
        {0xAA, KVS_UCLASS_LETTER},
        {0xB2, KVS_UCLASS_NUMBER},
        {0xBD, KVS_UCLASS_NUMBER},
        {0xD7, KVS_UCLASS_OTHER},
        {0xE9, KVS_UCLASS_LETTER},
        {0x0663, KVS_UCLASS_NUMBER},
        {0x1680, KVS_UCLASS_SPACE},
        {0x2000, KVS_UCLASS_SPACE},
        {0x200A, KVS_UCLASS_SPACE},
        {0x200B, KVS_UCLASS_OTHER},
        {0x2028, KVS_UCLASS_SPACE},
        {0x2029, KVS_UCLASS_SPACE},
        {0x202F, KVS_UCLASS_SPACE},
        {0x205F, KVS_UCLASS_SPACE},
        {0x2167, KVS_UCLASS_NUMBER},
        {0x3000, KVS_UCLASS_SPACE},
        {0x3042, KVS_UCLASS_LETTER},
        {0x4E2D, KVS_UCLASS_LETTER},
        {0xAC00, KVS_UCLASS_LETTER},
        {0xD7A3, KVS_UCLASS_LETTER},
        {0xFEFF, KVS_UCLASS_OTHER},
        {0xFF12, KVS_UCLASS_NUMBER},
        {0x1F600, KVS_UCLASS_OTHER},
        {0x20000, KVS_UCLASS_LETTER},
        {0x10FFFF, KVS_UCLASS_OTHER},
        {0x110000, KVS_UCLASS_OTHER},
        {KVS_UNICODE_INVALID, KVS_UCLASS_OTHER},
        /* Assigned in Unicode 15 and 16, which the reference's regex engine knows. */
        {0x11F04, KVS_UCLASS_LETTER},
        {0xA7DA, KVS_UCLASS_LETTER},
        {0x13460, KVS_UCLASS_LETTER},
        {0x1CCF0, KVS_UCLASS_NUMBER},
        {0x1E4F0, KVS_UCLASS_NUMBER},
        {0x2EBF0, KVS_UCLASS_LETTER},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        if (kvs_unicode_class(cases[i].cp) != cases[i].cls)
            fail_msg("U+%04X: class %d, expected %d", cases[i].cp,
                     (int) kvs_unicode_class(cases[i].cp), (int) cases[i].cls);
}

static void test_utf8_decode(void **state)
{
    (void) state;
    /* Every scalar value survives encode then decode. */
    for (uint32_t cp = 0; cp <= 0x10FFFF; cp++) {
        if (cp >= 0xD800 && cp <= 0xDFFF) continue;
        uint8_t buf[4];
        size_t n = kvs_utf8_encode(cp, buf);
        uint32_t back;
        if (kvs_utf8_decode(buf, n, &back) != n || back != cp) fail_msg("U+%04X", cp);
    }
    /* Malformed input takes one byte and decodes as invalid. */
    static const struct {
        const char *s;
        size_t len;
    } bad[] = {
        {"\x80", 1},             /* lone continuation */
        {"\xC0\x80", 2},         /* overlong NUL */
        {"\xC1\xBF", 2},         /* overlong */
        {"\xE0\x80\xAF", 3},     /* overlong */
        {"\xED\xA0\x80", 3},     /* surrogate */
        {"\xF4\x90\x80\x80", 4}, /* above U+10FFFF */
        {"\xF5\x80\x80\x80", 4}, /* bad lead */
        {"\xFF", 1},
        {"\xE2\x82", 2},     /* truncated */
        {"\xE2\x28\xA1", 3}, /* bad continuation */
        {"\xF0\x9F\x98", 3}, /* truncated emoji */
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        uint32_t cp = 0;
        assert_int_equal(kvs_utf8_decode((const uint8_t *) bad[i].s, bad[i].len, &cp), 1);
        assert_int_equal(cp, KVS_UNICODE_INVALID);
    }
    uint32_t cp;
    assert_int_equal(kvs_utf8_decode((const uint8_t *) "\xF0\x9F\x98\x80", 4, &cp), 4);
    assert_int_equal(cp, 0x1F600);
}

/* ---- pre-tokenizer ---- */

typedef struct {
    const char *text;
    int split_digits;
    const char *pieces[12];
} pretok_case_t;

static void test_pretok_pieces(void **state)
{
    (void) state;
    static const pretok_case_t cases[] = {
        {"Hello world", 1, {"Hello", " world"}},
        {"a  b", 1, {"a", " ", " b"}},
        {"a   \n\nb", 1, {"a", "   \n", "\n", "b"}},
        {"a\n b", 1, {"a", "\n", " b"}},
        {"a \tb", 1, {"a", " ", "\t", "b"}},
        {"trailing  ", 1, {"trailing", "  "}},
        {"  lead", 1, {" ", " lead"}},
        {"don't we'll've", 1, {"don", "'t", " we", "'ll", "'ve"}},
        {"DON'T", 1, {"DON", "'", "T"}},
        {"x''s", 1, {"x", "''", "s"}},
        {"'re'", 1, {"'re", "'"}},
        {"abc123 45", 1, {"abc", "1", "2", "3", " ", "4", "5"}},
        {"abc123 45", 0, {"abc", "123", " 45"}},
        {"a 1", 1, {"a", " ", "1"}},
        {"a  1", 1, {"a", "  ", "1"}},
        {"a  1", 0, {"a", " ", " 1"}},
        {"!!? ...", 1, {"!!?", " ..."}},
        {"f(x)=y;", 1, {"f", "(", "x", ")=", "y", ";"}},
        {"\xff\xfe"
         "ab",
         1,
         {"\xff\xfe", "ab"}},
        {"a\xc3", 1, {"a", "\xc3"}},
        {"caf\xc3\xa9 \xf0\x9f\x98\x80!", 1, {"caf\xc3\xa9", " \xf0\x9f\x98\x80!"}},
        {"\xc2\xa0x", 1, {"\xc2\xa0", "x"}},
        {" \xc2\xa0x", 1, {" ", "\xc2\xa0", "x"}},
        {"\xd9\xa3"
         "4x",
         1,
         {"\xd9\xa3", "4", "x"}},
        {"\xd9\xa3"
         "4x",
         0,
         {"\xd9\xa3"
          "4",
          "x"}},
        {"   ", 1, {"   "}},
        {"\n", 1, {"\n"}},
    };
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        const char *text = cases[c].text;
        size_t len = strlen(text), pos = 0, k = 0;
        while (pos < len) {
            size_t n =
                kvs_pretok_next((const uint8_t *) text + pos, len - pos, cases[c].split_digits);
            const char *want = cases[c].pieces[k];
            if (want == NULL || n != strlen(want) || memcmp(text + pos, want, n) != 0)
                fail_msg("case %zu \"%s\": piece %zu is \"%.*s\", expected \"%s\"", c, text, k,
                         (int) n, text + pos, want ? want : "(none)");
            pos += n;
            k++;
        }
        if (cases[c].pieces[k] != NULL) fail_msg("case %zu: fewer pieces than expected", c);
    }
}

/* Any bytes: pieces are non-empty, tile the text, and with split digits a \p{N} character is
 * a piece on its own. */
static void test_pretok_property(void **state)
{
    (void) state;
    uint64_t seed = kvs_test_seed(0x70c3);
    kvs_rng_t rng;
    kvs_rng_seed(&rng, seed);
    static const char *const atoms[] = {"a",
                                        "Z",
                                        " ",
                                        "  ",
                                        "\n",
                                        "\t",
                                        "7",
                                        "'",
                                        "'s",
                                        "!",
                                        "\xc3\xa9",
                                        "\xd9\xa3",
                                        "\xe4\xb8\xad",
                                        "\xc2\xa0",
                                        "\xf0\x9f\x98\x80",
                                        "\xff",
                                        "\x80",
                                        "\xe2\x82"};
    uint64_t iters = kvs_test_iters(2000);
    for (uint64_t it = 0; it < iters; it++) {
        char text[256];
        size_t len = 0, parts = 1 + kvs_rng_below(&rng, 30);
        for (size_t p = 0; p < parts; p++) {
            const char *a = atoms[kvs_rng_below(&rng, sizeof(atoms) / sizeof(atoms[0]))];
            memcpy(text + len, a, strlen(a));
            len += strlen(a);
        }
        int split = (int) (it & 1);
        for (size_t pos = 0; pos < len;) {
            size_t n = kvs_pretok_next((const uint8_t *) text + pos, len - pos, split);
            if (n == 0 || n > len - pos)
                fail_msg("seed %llu: bad piece length", (unsigned long long) seed);
            for (size_t i = pos; i < pos + n;) {
                uint32_t cp;
                size_t k = kvs_utf8_decode((const uint8_t *) text + i, pos + n - i, &cp);
                if (split && kvs_unicode_class(cp) == KVS_UCLASS_NUMBER && n != k)
                    fail_msg("seed %llu: a digit shares a piece", (unsigned long long) seed);
                i += k;
            }
            pos += n;
        }
    }
}

/* ---- BPE on the hand-made vocabulary ---- */

static void test_bpe_tiny(void **state)
{
    (void) state;
    kvs_tokenizer_t *tok;
    assert_int_equal(tiny_create(tiny_merges_ab_first, 8, &tok), KVS_OK);
    expect_tokens(tok, "abc", 3, 1, (const char *[]){"abc", NULL});
    expect_tokens(tok, "bc", 2, 1, (const char *[]){"bc", NULL});
    expect_tokens(tok, "cab", 3, 1, (const char *[]){"c", "ab", NULL});
    /* Equal ranks: leftmost first, so aaaaa is aaaa + a, not a + aaaa. */
    expect_tokens(tok, "aaaaa", 5, 1, (const char *[]){"aaaa", "a", NULL});
    expect_tokens(tok, "aaa", 3, 1, (const char *[]){"aa", "a", NULL});
    /* "a b" outranks "Ġ a": the space stays alone. */
    expect_tokens(tok, " ab", 3, 1, (const char *[]){"Ġ", "ab", NULL});
    expect_tokens(tok, "ab ab", 5, 1, (const char *[]){"ab", "Ġ", "ab", NULL});
    /* Merges never cross pieces. */
    expect_tokens(tok, "a1b", 3, 1, (const char *[]){"a", "1", "b", NULL});
    expect_tokens(tok, "!!", 2, 1, (const char *[]){"!!", NULL});
    /* A byte without a token is dropped and its neighbours in the piece can merge, as HF's
     * BPE does: 'ÿ' is a letter whose bytes C3 BF have no token here. */
    expect_tokens(tok,
                  "a\xc3\xbf"
                  "b",
                  4, 1, (const char *[]){"ab", NULL});
    expect_tokens(tok, "!\xc3\xbf!", 4, 1, (const char *[]){"!", "!", NULL});
    expect_tokens(tok, "\xff", 1, 1, (const char *[]){NULL});
    expect_tokens(tok, "", 0, 1, (const char *[]){NULL});
    kvs_tokenizer_destroy(tok);

    assert_int_equal(tiny_create(tiny_merges_space_first, 5, &tok), KVS_OK);
    expect_tokens(tok, " ab", 3, 1, (const char *[]){"Ġab", NULL});
    expect_tokens(tok, " abc", 4, 1, (const char *[]){"Ġab", "c", NULL});
    expect_tokens(tok, "abc", 3, 1, (const char *[]){"abc", NULL});
    kvs_tokenizer_destroy(tok);
    kvs_assert_no_leaks();
}

static void test_specials_tiny(void **state)
{
    (void) state;
    kvs_tokenizer_t *tok;
    assert_int_equal(tiny_create(tiny_merges_ab_first, 8, &tok), KVS_OK);
    expect_tokens(tok, "ab<s>ab</s>", 11, 1, (const char *[]){"ab", "<s>", "ab", "</s>", NULL});
    expect_tokens(tok, "<s></s>", 7, 1, (const char *[]){"<s>", "</s>", NULL});
    /* Longest match wins. */
    expect_tokens(tok, "<s>xy", 5, 1, (const char *[]){"<s>x", "y", NULL});
    /* Without parse_special, CONTROL text is ordinary text; USER_DEFINED is always parsed. */
    expect_tokens(tok, "a<s>", 4, 0, (const char *[]){"a", "<", "s", ">", NULL});
    expect_tokens(tok, "a<u>b", 5, 0, (const char *[]){"a", "<u>", "b", NULL});
    expect_tokens(tok, "a<u>b", 5, 1, (const char *[]){"a", "<u>", "b", NULL});
    /* Text on either side of a special is pre-tokenized on its own. */
    expect_tokens(tok, " a<s> ab", 8, 1, (const char *[]){"Ġa", "<s>", "Ġ", "ab", NULL});
    expect_tokens(tok, "<s", 2, 1, (const char *[]){"<", "s", NULL});

    /* Queries and decoding. */
    assert_int_equal(kvs_tokenizer_vocab_size(tok), TINY_SPECIALS + TINY_BYTES + 8);
    assert_int_equal(kvs_tokenizer_bos(tok), 0);
    assert_int_equal(kvs_tokenizer_eos(tok), 1);
    assert_true(kvs_tokenizer_is_control(tok, 0));
    assert_false(kvs_tokenizer_is_control(tok, 3));
    assert_int_equal(kvs_tokenizer_token_type(tok, 3), KVS_TOKEN_USER_DEFINED);
    assert_int_equal(kvs_tokenizer_token_type(tok, id_of(tok, "ab")), KVS_TOKEN_NORMAL);
    assert_int_equal(kvs_tokenizer_token_type(tok, 100000), 0);
    assert_false(kvs_tokenizer_is_control(tok, 100000));
    assert_string_equal(kvs_tokenizer_chat_template(tok), "{{ x }}");
    uint32_t id;
    assert_int_equal(kvs_tokenizer_token_id(tok, "zz", 2, &id), KVS_ERR_NOT_FOUND);
    char buf[16];
    size_t n;
    assert_int_equal(kvs_tokenizer_decode(tok, id_of(tok, "Ġab"), buf, sizeof(buf), &n), KVS_OK);
    assert_int_equal(n, 3);
    assert_memory_equal(buf, " ab", 3);
    assert_int_equal(kvs_tokenizer_decode(tok, 0, buf, sizeof(buf), &n), KVS_OK);
    assert_int_equal(n, 3);
    assert_memory_equal(buf, "<s>", 3);
    char nl[3];
    byte_char('\n', nl);
    assert_int_equal(kvs_tokenizer_decode(tok, id_of(tok, nl), buf, sizeof(buf), &n), KVS_OK);
    assert_int_equal(n, 1);
    assert_int_equal(buf[0], '\n');
    for (int b = 0; b < TINY_BYTES; b++) {
        assert_int_equal(kvs_tokenizer_decode(tok, TINY_SPECIALS + (uint32_t) b, buf, 1, &n),
                         KVS_OK);
        assert_int_equal(n, 1);
        assert_int_equal((uint8_t) buf[0], b);
    }

    kvs_log_capture_t cap = {.errors_only = 1};
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    assert_int_equal(kvs_tokenizer_decode(tok, id_of(tok, "Ġab"), buf, 2, &n), KVS_ERR_NOSPACE);
    assert_int_equal(kvs_tokenizer_decode(tok, 5000, buf, sizeof(buf), &n), KVS_ERR_INVALID);
    const char *piece;
    assert_int_equal(kvs_tokenizer_piece(tok, 5000, &piece, &n), KVS_ERR_INVALID);
    assert_int_equal(cap.calls, 3);
    kvs_log_set_sink(NULL, NULL);
    kvs_tokenizer_destroy(tok);
    kvs_assert_no_leaks();
}

static void test_encode_buffers(void **state)
{
    (void) state;
    kvs_tokenizer_t *tok;
    assert_int_equal(tiny_create(tiny_merges_ab_first, 8, &tok), KVS_OK);
    const char *text = "abc abc<s>!!";
    size_t len = strlen(text), n = 0;
    /* Counting: ids NULL. */
    assert_int_equal(kvs_tokenizer_encode(tok, text, len, 1, NULL, 0, &n), KVS_OK);
    assert_int_equal(n, 5); /* abc Ġ abc <s> !! */
    uint32_t ids[5], big[8];
    assert_int_equal(kvs_tokenizer_encode(tok, text, len, 1, ids, 5, &n), KVS_OK);
    assert_int_equal(n, 5);
    assert_int_equal(kvs_tokenizer_encode(tok, text, len, 1, big, 8, &n), KVS_OK);
    assert_memory_equal(ids, big, sizeof(ids));
    uint32_t *alloc_ids;
    assert_int_equal(kvs_tokenizer_encode_alloc(tok, text, len, 1, &alloc_ids, &n), KVS_OK);
    assert_int_equal(n, 5);
    assert_memory_equal(alloc_ids, ids, sizeof(ids));
    kvs_free(alloc_ids);
    assert_int_equal(kvs_tokenizer_encode_alloc(tok, "", 0, 1, &alloc_ids, &n), KVS_OK);
    assert_int_equal(n, 0);
    assert_null(alloc_ids);
    assert_int_equal(kvs_tokenizer_encode(tok, NULL, 0, 1, ids, 5, &n), KVS_OK);
    assert_int_equal(n, 0);

    kvs_log_capture_t cap = {.errors_only = 1};
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    n = 77;
    assert_int_equal(kvs_tokenizer_encode(tok, text, len, 1, ids, 4, &n), KVS_ERR_NOSPACE);
    assert_int_equal(n, 77); /* written only on success */
    assert_int_equal(kvs_tokenizer_encode(tok, NULL, 3, 1, ids, 4, &n), KVS_ERR_INVALID);
    assert_int_equal(kvs_tokenizer_encode(tok, text, len, 1, NULL, 4, &n), KVS_ERR_INVALID);
    assert_int_equal(cap.calls, 3);
    kvs_log_set_sink(NULL, NULL);
    kvs_tokenizer_destroy(tok);
    kvs_assert_no_leaks();
}

static void test_vocab_errors(void **state)
{
    (void) state;
    kvs_log_capture_t cap = {.errors_only = 1};
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    kvs_tokenizer_t *tok = (kvs_tokenizer_t *) (uintptr_t) 1;
    static const struct {
        const char *merge;
        kvs_status_t st;
        const char *msg;
    } bad_merges[] = {
        {"ab", KVS_ERR_PROTOCOL, "is not \"left right\""},
        {" ab", KVS_ERR_PROTOCOL, "is not \"left right\""},
        {"ab ", KVS_ERR_PROTOCOL, "is not \"left right\""},
        {"", KVS_ERR_PROTOCOL, "is not \"left right\""},
        {"a zz", KVS_ERR_PROTOCOL, "not in the vocabulary"},
        {"c a", KVS_ERR_PROTOCOL, "not in the vocabulary"}, /* "ca" is no token */
    };
    for (size_t i = 0; i < sizeof(bad_merges) / sizeof(bad_merges[0]); i++) {
        const char *merges[2] = {"a b", bad_merges[i].merge};
        cap.calls = 0;
        assert_int_equal(tiny_create(merges, 2, &tok), bad_merges[i].st);
        assert_int_equal(cap.calls, 1);
        assert_non_null(strstr(cap.msg, bad_merges[i].msg));
        assert_non_null(strstr(cap.msg, "merge 1"));
    }
    assert_ptr_equal(tok, (kvs_tokenizer_t *) (uintptr_t) 1);

    kvs_tokenizer_str_t tokens[2] = {{"a", 1}, {"b", 1}};
    int32_t types[2] = {KVS_TOKEN_NORMAL, 9};
    kvs_tokenizer_vocab_t v = {.n_tokens = 2, .tokens = tokens, .bos = 0, .eos = 1};
    kvs_tokenizer_vocab_t bad = v;
    bad.n_tokens = 0;
    assert_int_equal(kvs_tokenizer_create(&bad, &tok), KVS_ERR_INVALID);
    bad = v;
    bad.eos = 2;
    assert_int_equal(kvs_tokenizer_create(&bad, &tok), KVS_ERR_INVALID);
    assert_non_null(strstr(cap.msg, "outside the vocabulary"));
    bad = v;
    bad.types = types;
    assert_int_equal(kvs_tokenizer_create(&bad, &tok), KVS_ERR_PROTOCOL);
    assert_non_null(strstr(cap.msg, "unknown type 9"));
    bad = v;
    bad.pre = (kvs_tokenizer_pre_t) 7;
    assert_int_equal(kvs_tokenizer_create(&bad, &tok), KVS_ERR_INVALID);
    bad = v;
    bad.n_merges = 1;
    assert_int_equal(kvs_tokenizer_create(&bad, &tok), KVS_ERR_INVALID);
    assert_int_equal(kvs_tokenizer_create(NULL, &tok), KVS_ERR_INVALID);
    assert_ptr_equal(tok, (kvs_tokenizer_t *) (uintptr_t) 1);
    kvs_log_set_sink(NULL, NULL);

    /* A duplicate text keeps its first id; a repeated merge its first rank. */
    kvs_tokenizer_str_t dup_tokens[4] = {{"a", 1}, {"b", 1}, {"ab", 2}, {"a", 1}};
    kvs_tokenizer_str_t dup_merges[2] = {{"a b", 3}, {"a b", 3}};
    v = (kvs_tokenizer_vocab_t){
        .n_tokens = 4, .tokens = dup_tokens, .n_merges = 2, .merges = dup_merges};
    assert_int_equal(kvs_tokenizer_create(&v, &tok), KVS_OK);
    assert_int_equal(id_of(tok, "a"), 0);
    expect_tokens(tok, "ab", 2, 1, (const char *[]){"ab", NULL});
    kvs_tokenizer_destroy(tok);
    kvs_assert_no_leaks();
}

/* ---- GGUF loading, on small files built here ---- */

typedef struct {
    const char *model, *pre;
    int tokens_as_ints;
    int types_count; /* -1: the right count */
} tiny_gguf_opts_t;

static uint8_t *tiny_gguf(const tiny_gguf_opts_t *o, size_t *len_p)
{
    static const char *const tokens[] = {"<|im_end|>", "a", "b", "ab", "Ġ", "Ġab", "1", "2", "Ġ1"};
    static const int32_t types[] = {3, 1, 1, 1, 1, 1, 1, 1, 1};
    static const char *const merges[] = {"a b", "Ġ ab", "Ġ 1"};
    gw_t w;
    gw_init(&w, 3);
    gw_kv_str(&w, "general.architecture", "llama");
    if (o->model) gw_kv_str(&w, "tokenizer.ggml.model", o->model);
    if (o->pre) gw_kv_str(&w, "tokenizer.ggml.pre", o->pre);
    if (o->tokens_as_ints)
        gw_kv_array(&w, "tokenizer.ggml.tokens", KVS_GGUF_I32, 9, types);
    else
        gw_kv_array(&w, "tokenizer.ggml.tokens", KVS_GGUF_STRING, 9, tokens);
    gw_kv_array(&w, "tokenizer.ggml.token_type", KVS_GGUF_I32,
                o->types_count < 0 ? 9 : (uint64_t) o->types_count, types);
    gw_kv_array(&w, "tokenizer.ggml.merges", KVS_GGUF_STRING, 3, merges);
    gw_kv_u32(&w, "tokenizer.ggml.bos_token_id", 0);
    gw_kv_u32(&w, "tokenizer.ggml.eos_token_id", 0);
    gw_kv_str(&w, "tokenizer.chat_template", "chatml?");
    uint8_t *buf = gw_finish(&w, len_p);
    gw_free(&w);
    assert_non_null(buf);
    return buf;
}

static kvs_status_t tiny_gguf_tokenizer(const tiny_gguf_opts_t *o, kvs_tokenizer_t **tok_p)
{
    size_t len;
    uint8_t *buf = tiny_gguf(o, &len);
    kvs_gguf_t *g;
    assert_int_equal(kvs_gguf_open_buffer(buf, len, &g), KVS_OK);
    kvs_status_t st = kvs_tokenizer_from_gguf(g, tok_p);
    kvs_gguf_close(g);
    kvs_free(buf);
    return st;
}

static void test_from_gguf_tiny(void **state)
{
    (void) state;
    kvs_tokenizer_t *tok;
    tiny_gguf_opts_t ok = {"gpt2", "smollm", 0, -1};
    assert_int_equal(tiny_gguf_tokenizer(&ok, &tok), KVS_OK);
    /* The GGUF is closed: everything below comes from the tokenizer's own copies. */
    expect_tokens(tok, "ab ab<|im_end|>12", 17, 1,
                  (const char *[]){"ab", "Ġab", "<|im_end|>", "1", "2", NULL});
    assert_true(kvs_tokenizer_is_control(tok, 0));
    assert_string_equal(kvs_tokenizer_chat_template(tok), "chatml?");
    /* smollm cuts a space off the digit after it; gpt2 keeps " 1" one piece. */
    expect_tokens(tok, "a 1", 3, 1, (const char *[]){"a", "Ġ", "1", NULL});
    kvs_tokenizer_destroy(tok);
    tiny_gguf_opts_t gpt2 = {"gpt2", "gpt2", 0, -1};
    assert_int_equal(tiny_gguf_tokenizer(&gpt2, &tok), KVS_OK);
    expect_tokens(tok, "a 1", 3, 1, (const char *[]){"a", "Ġ1", NULL});
    kvs_tokenizer_destroy(tok);

    kvs_log_capture_t cap = {.errors_only = 1};
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    static const struct {
        tiny_gguf_opts_t o;
        kvs_status_t st;
        const char *msg;
    } bad[] = {
        {{"llama", "smollm", 0, -1}, KVS_ERR_UNSUPPORTED, "\"llama\" is not supported"},
        {{NULL, "smollm", 0, -1}, KVS_ERR_NOT_FOUND, "no tokenizer.ggml.model"},
        {{"gpt2", "llama-bpe", 0, -1}, KVS_ERR_UNSUPPORTED, "\"llama-bpe\" is not supported"},
        {{"gpt2", NULL, 0, -1}, KVS_ERR_UNSUPPORTED, "\"missing\" is not supported"},
        {{"gpt2", "smollm", 1, -1}, KVS_ERR_PROTOCOL, "not an array of strings"},
        {{"gpt2", "smollm", 0, 5}, KVS_ERR_PROTOCOL, "5 entries for 9 tokens"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        tok = NULL;
        cap.calls = 0;
        assert_int_equal(tiny_gguf_tokenizer(&bad[i].o, &tok), bad[i].st);
        assert_null(tok);
        assert_int_equal(cap.calls, 1);
        if (strstr(cap.msg, bad[i].msg) == NULL)
            fail_msg("case %zu: message \"%s\" lacks \"%s\"", i, cap.msg, bad[i].msg);
    }
    kvs_log_set_sink(NULL, NULL);
    kvs_assert_no_leaks();
}

/* Every allocation of create, from_gguf, encode and chat formatting can fail cleanly. */
static void test_alloc_failures(void **state)
{
    (void) state;
    kvs_log_set_sink(kvs_log_capture_sink, &(kvs_log_capture_t){0});
    int created = 0;
    for (uint64_t k = 1; !created; k++) {
        kvs_tokenizer_t *tok = NULL;
        kvs_alloc_fail_at(k);
        kvs_status_t st = tiny_create(tiny_merges_ab_first, 8, &tok);
        kvs_alloc_fail_at(0);
        if (st == KVS_OK) {
            created = 1;
            kvs_tokenizer_destroy(tok);
        } else {
            assert_int_equal(st, KVS_ERR_NOMEM);
        }
        kvs_assert_no_leaks();
    }
    size_t len;
    uint8_t *buf = tiny_gguf(&(tiny_gguf_opts_t){"gpt2", "smollm", 0, -1}, &len);
    kvs_gguf_t *g;
    assert_int_equal(kvs_gguf_open_buffer(buf, len, &g), KVS_OK);
    for (uint64_t k = 1;; k++) {
        kvs_tokenizer_t *tok = NULL;
        kvs_alloc_fail_at(k);
        kvs_status_t st = kvs_tokenizer_from_gguf(g, &tok);
        kvs_alloc_fail_at(0);
        if (st == KVS_OK) {
            kvs_tokenizer_destroy(tok);
            break;
        }
        assert_int_equal(st, KVS_ERR_NOMEM);
    }
    kvs_gguf_close(g);
    kvs_free(buf);
    kvs_assert_no_leaks();

    kvs_tokenizer_t *tok;
    assert_int_equal(tiny_create(tiny_merges_ab_first, 8, &tok), KVS_OK);
    /* Long enough for the growing id array to reallocate. */
    char text[600];
    for (size_t i = 0; i < sizeof(text); i++) text[i] = "ab c!"[i % 5];
    size_t want;
    assert_int_equal(kvs_tokenizer_encode(tok, text, sizeof(text), 1, NULL, 0, &want), KVS_OK);
    for (uint64_t k = 1;; k++) {
        uint32_t *ids = NULL;
        size_t n = 0;
        kvs_alloc_fail_at(k);
        kvs_status_t st = kvs_tokenizer_encode_alloc(tok, text, sizeof(text), 1, &ids, &n);
        kvs_alloc_fail_at(0);
        if (st == KVS_OK) {
            assert_int_equal(n, want);
            kvs_free(ids);
            break;
        }
        assert_int_equal(st, KVS_ERR_NOMEM);
        assert_null(ids);
    }
    kvs_tokenizer_destroy(tok);

    kvs_chat_msg_t msgs[2] = {{"user", "hi"}, {"assistant", "hello"}};
    const char *tmpl = "{% for message in messages %}{% if loop.first and messages[0]['role'] != "
                       "'system' %}{{ '<|im_start|>system\\nX<|im_end|>\\n' }}{% endif %}"
                       "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                       "'<|im_end|>' + '\\n'}}{% endfor %}";
    for (uint64_t k = 1;; k++) {
        char *text_out = NULL;
        kvs_alloc_fail_at(k);
        kvs_status_t st = kvs_chat_format(tmpl, msgs, 2, 1, &text_out);
        kvs_alloc_fail_at(0);
        if (st == KVS_OK) {
            assert_non_null(strstr(text_out, "system\nX<|im_end|>"));
            kvs_free(text_out);
            break;
        }
        assert_int_equal(st, KVS_ERR_NOMEM);
        assert_null(text_out);
    }
    kvs_log_set_sink(NULL, NULL);
    kvs_assert_no_leaks();
}

/* ---- SmolLM2 ---- */

typedef struct {
    kvs_gguf_t *gguf;
    kvs_tokenizer_t *tok;
} smollm2_t;

static void smollm2_open(smollm2_t *m)
{
    char path[4096];
    if (kvs_model_default_path(path, sizeof(path)) != KVS_OK)
        fail_msg("SmolLM2-135M-Instruct.Q4_1.gguf is missing: run scripts/setup.sh (or set "
                 "KVS_MODEL)");
    assert_int_equal(kvs_gguf_open(path, &m->gguf), KVS_OK);
    assert_int_equal(kvs_tokenizer_from_gguf(m->gguf, &m->tok), KVS_OK);
}

static void smollm2_close(smollm2_t *m)
{
    kvs_tokenizer_destroy(m->tok);
    kvs_gguf_close(m->gguf);
}

static void test_smollm2_facts(void **state)
{
    (void) state;
    smollm2_t m;
    smollm2_open(&m);
    assert_int_equal(kvs_tokenizer_vocab_size(m.tok), 49152);
    assert_int_equal(kvs_tokenizer_bos(m.tok), 1);
    assert_int_equal(kvs_tokenizer_eos(m.tok), 2);
    assert_int_equal(id_of(m.tok, "<|endoftext|>"), 0);
    assert_int_equal(id_of(m.tok, "<|im_start|>"), 1);
    assert_int_equal(id_of(m.tok, "<|im_end|>"), 2);
    int controls = 0;
    for (uint32_t id = 0; id < 49152; id++) controls += kvs_tokenizer_is_control(m.tok, id);
    assert_int_equal(controls, 17);
    char buf[256];
    size_t n;
    assert_int_equal(kvs_tokenizer_decode(m.tok, 2, buf, sizeof(buf), &n), KVS_OK);
    assert_int_equal(n, 10);
    assert_memory_equal(buf, "<|im_end|>", 10);
    assert_int_equal(kvs_tokenizer_decode(m.tok, id_of(m.tok, "Ġthe"), buf, sizeof(buf), &n),
                     KVS_OK);
    assert_int_equal(n, 4);
    assert_memory_equal(buf, " the", 4);
    /* Every token decodes to something. */
    for (uint32_t id = 0; id < 49152; id++) {
        const char *bytes;
        assert_int_equal(kvs_tokenizer_piece(m.tok, id, &bytes, &n), KVS_OK);
        assert_true(n > 0);
    }

    /* The GGUF's template is the one the chat reference was rendered from. */
    char *data = read_data("tokenizer_chat.txt");
    const char *tmpl = kvs_tokenizer_chat_template(m.tok);
    assert_non_null(tmpl);
    int found = 0;
    for (char *line = strtok(data, "\n"); line != NULL; line = strtok(NULL, "\n")) {
        char *f[3];
        if (split_tabs(line, f, 3) == 3 && strcmp(f[0], "template") == 0 &&
            strcmp(f[1], "smollm2") == 0) {
            char *want = kvs_malloc(strlen(f[2]) + 1);
            size_t wl = unescape(f[2], strlen(f[2]), want);
            assert_int_equal(strlen(tmpl), wl);
            assert_memory_equal(tmpl, want, wl);
            kvs_free(want);
            found = 1;
        }
    }
    assert_true(found);
    kvs_free(data);
    smollm2_close(&m);
    kvs_assert_no_leaks();
}

/* The ids HF tokenizers gives for each case, and decode(encode(text)) == text. */
static void test_smollm2_reference(void **state)
{
    (void) state;
    smollm2_t m;
    smollm2_open(&m);
    char *data = read_data("tokenizer_smollm2.txt");
    size_t cases = 0;
    char *save = NULL;
    for (char *line = strtok_r(data, "\n", &save); line != NULL;
         line = strtok_r(NULL, "\n", &save)) {
        if (line[0] == '#') continue;
        char *f[3];
        assert_int_equal(split_tabs(line, f, 3), 3);
        int parse_special = strchr(f[0], 's') != NULL, roundtrip = strchr(f[0], 'r') != NULL;
        char text[1024];
        size_t len = unescape(f[1], strlen(f[1]), text);
        uint32_t want[512];
        size_t n_want = 0;
        for (char *p = f[2]; *p;) {
            char *end;
            want[n_want++] = (uint32_t) strtoul(p, &end, 10);
            assert_true(end > p);
            p = end;
            while (*p == ' ') p++;
        }
        uint32_t *ids;
        size_t n;
        assert_int_equal(kvs_tokenizer_encode_alloc(m.tok, text, len, parse_special, &ids, &n),
                         KVS_OK);
        size_t i = 0;
        while (i < n && i < n_want && ids[i] == want[i]) i++;
        if (i < n || i < n_want)
            fail_msg("case %zu \"%s\": %zu ids, expected %zu; first difference at %zu: %d vs %d",
                     cases, f[1], n, n_want, i, i < n ? (int) ids[i] : -1,
                     i < n_want ? (int) want[i] : -1);
        char back[1024];
        size_t back_len = decode_all(m.tok, ids, n, back, sizeof(back));
        if (roundtrip && (back_len != len || memcmp(back, text, len) != 0))
            fail_msg("case %zu \"%s\": decodes to \"%.*s\"", cases, f[1], (int) back_len, back);
        if (!roundtrip) assert_true(back_len < len); /* bytes without a token were dropped */
        kvs_free(ids);
        cases++;
    }
    assert_true(cases >= 40);
    kvs_free(data);
    smollm2_close(&m);
    kvs_assert_no_leaks();
}

/* Random text, valid UTF-8 or not, decodes back to itself less the bytes that have no token. */
static void test_smollm2_roundtrip_random(void **state)
{
    (void) state;
    smollm2_t m;
    smollm2_open(&m);
    int has_token[256];
    for (int b = 0; b < 256; b++) {
        char c = (char) b;
        size_t n;
        assert_int_equal(kvs_tokenizer_encode(m.tok, &c, 1, 0, NULL, 0, &n), KVS_OK);
        has_token[b] = n == 1;
    }
    assert_false(has_token[0xFF]);
    assert_true(has_token['a'] && has_token[0x80] && has_token[0xF0]);

    uint64_t seed = kvs_test_seed(0x5eed);
    kvs_rng_t rng;
    kvs_rng_seed(&rng, seed);
    static const char *const atoms[] = {"the",
                                        " ",
                                        "  ",
                                        "\n",
                                        "\t",
                                        "Hello",
                                        "'s",
                                        "'",
                                        "0",
                                        "42",
                                        ".",
                                        "!?",
                                        "\xc3\xa9",
                                        "\xc3\xbc",
                                        "\xe4\xb8\xad",
                                        "\xe3\x81\x82",
                                        "\xf0\x9f\x98\x80",
                                        "\xc2\xa0",
                                        "<|im_end|>",
                                        "<|im_start|>",
                                        "\xff",
                                        "\x80",
                                        "\xe2\x82",
                                        "\x04"};
    uint64_t iters = kvs_test_iters(300);
    for (uint64_t it = 0; it < iters; it++) {
        char text[1024], want[1024], back[1024];
        size_t len = 0, parts = 1 + kvs_rng_below(&rng, 60);
        for (size_t p = 0; p < parts; p++) {
            if (kvs_rng_below(&rng, 8) == 0) {
                text[len++] = (char) kvs_rng_below(&rng, 256); /* any byte */
                continue;
            }
            const char *a = atoms[kvs_rng_below(&rng, sizeof(atoms) / sizeof(atoms[0]))];
            memcpy(text + len, a, strlen(a));
            len += strlen(a);
        }
        size_t want_len = 0;
        for (size_t i = 0; i < len; i++)
            if (has_token[(uint8_t) text[i]]) want[want_len++] = text[i];
        int parse_special = (int) (it & 1);
        uint32_t *ids;
        size_t n;
        assert_int_equal(kvs_tokenizer_encode_alloc(m.tok, text, len, parse_special, &ids, &n),
                         KVS_OK);
        size_t back_len = decode_all(m.tok, ids, n, back, sizeof(back));
        if (back_len != want_len || memcmp(back, want, want_len) != 0)
            fail_msg("seed %llu iteration %llu: round trip differs", (unsigned long long) seed,
                     (unsigned long long) it);
        /* Without parse_special no control token appears. */
        for (size_t i = 0; i < n && !parse_special; i++)
            if (kvs_tokenizer_is_control(m.tok, ids[i]))
                fail_msg("seed %llu: control token from plain text", (unsigned long long) seed);
        kvs_free(ids);
    }
    smollm2_close(&m);
    kvs_assert_no_leaks();
}

/* A rendered SmolLM2 conversation tokenizes to the ids the reference gives for that text. */
static void test_smollm2_chat_ids(void **state)
{
    (void) state;
    smollm2_t m;
    smollm2_open(&m);
    kvs_chat_msg_t msg = {"user", "What is 2+2?"};
    char *text;
    assert_int_equal(kvs_chat_format(kvs_tokenizer_chat_template(m.tok), &msg, 1, 1, &text),
                     KVS_OK);
    static const uint32_t want[] = {1,    9690, 198,   2683, 359,  253,  5356, 5646,  11173, 3365,
                                    3511, 308,  34519, 28,   7018, 411,  407,  19712, 8182,  2,
                                    198,  1,    4093,  198,  1780, 314,  216,  34,    27,    34,
                                    47,   2,    198,   1,    520,  9531, 198};
    uint32_t ids[64];
    size_t n;
    assert_int_equal(kvs_tokenizer_encode(m.tok, text, strlen(text), 1, ids, 64, &n), KVS_OK);
    assert_int_equal(n, sizeof(want) / sizeof(want[0]));
    assert_memory_equal(ids, want, sizeof(want));
    kvs_free(text);
    smollm2_close(&m);
    kvs_assert_no_leaks();
}

/* ---- chat templates ---- */

#define MAX_TEMPLATES 8

static void test_chat_reference(void **state)
{
    (void) state;
    char *data = read_data("tokenizer_chat.txt");
    char *names[MAX_TEMPLATES], *templates[MAX_TEMPLATES];
    int n_templates = 0, cases = 0, unsupported = 0;
    kvs_chat_msg_t msgs[8];
    char *bufs[8 * 2];
    int n_bufs = 0;
    char *tmpl = NULL;
    const char *tmpl_name = NULL;
    int add_gen = 0, n_msgs = 0, want_msgs = 0;
    kvs_log_capture_t cap = {.errors_only = 1};
    kvs_log_set_sink(kvs_log_capture_sink, &cap);
    char *save = NULL;
    for (char *line = strtok_r(data, "\n", &save); line != NULL;
         line = strtok_r(NULL, "\n", &save)) {
        if (line[0] == '#') continue;
        char *f[4] = {"", "", "", ""};
        int nf = split_tabs(line, f, 4);
        if (strcmp(f[0], "template") == 0) {
            assert_true(nf == 3 && n_templates < MAX_TEMPLATES);
            names[n_templates] = f[1];
            templates[n_templates] = kvs_malloc(strlen(f[2]) + 1);
            templates[n_templates][unescape(f[2], strlen(f[2]), templates[n_templates])] = 0;
            n_templates++;
        } else if (strcmp(f[0], "case") == 0) {
            tmpl = NULL;
            tmpl_name = f[1];
            for (int t = 0; t < n_templates; t++)
                if (strcmp(names[t], f[1]) == 0) tmpl = templates[t];
            assert_non_null(tmpl);
            add_gen = atoi(f[2]);
            want_msgs = atoi(f[3]);
            n_msgs = 0;
        } else if (strcmp(f[0], "msg") == 0) {
            assert_true(nf == 3 && n_msgs < 8);
            for (int k = 1; k <= 2; k++) {
                bufs[n_bufs] = kvs_malloc(strlen(f[k]) + 1);
                bufs[n_bufs][unescape(f[k], strlen(f[k]), bufs[n_bufs])] = 0;
                n_bufs++;
            }
            msgs[n_msgs].role = bufs[n_bufs - 2];
            msgs[n_msgs].content = bufs[n_bufs - 1];
            n_msgs++;
        } else if (strcmp(f[0], "expect") == 0) {
            assert_int_equal(n_msgs, want_msgs);
            char *want = kvs_malloc(strlen(f[1]) + 1);
            want[unescape(f[1], strlen(f[1]), want)] = 0;
            char *got = NULL;
            kvs_status_t st = kvs_chat_format(tmpl, msgs, (size_t) n_msgs, add_gen, &got);
            if (st != KVS_OK)
                fail_msg("template %s, %d messages: %s (%s)", tmpl_name, n_msgs, kvs_status_str(st),
                         cap.msg);
            if (strcmp(got, want) != 0)
                fail_msg("template %s, %d messages, add_generation_prompt %d:\n%s\nexpected:\n%s",
                         tmpl_name, n_msgs, add_gen, got, want);
            kvs_free(got);
            /* tmpl NULL is plain ChatML. */
            if (strcmp(tmpl_name, "chatml") == 0) {
                assert_int_equal(kvs_chat_format(NULL, msgs, (size_t) n_msgs, add_gen, &got),
                                 KVS_OK);
                assert_string_equal(got, want);
                kvs_free(got);
            }
            kvs_free(want);
            while (n_bufs > 0) kvs_free(bufs[--n_bufs]);
            cases++;
        } else if (strcmp(f[0], "unsupported") == 0) {
            char *t = kvs_malloc(strlen(f[1]) + 1);
            t[unescape(f[1], strlen(f[1]), t)] = 0;
            kvs_chat_msg_t msg = {"user", "hi"};
            char *got = (char *) (uintptr_t) 1;
            cap.calls = 0;
            assert_int_equal(kvs_chat_format(t, &msg, 1, 1, &got), KVS_ERR_UNSUPPORTED);
            assert_ptr_equal(got, (char *) (uintptr_t) 1);
            assert_int_equal(cap.calls, 1);
            assert_non_null(strstr(cap.msg, "only ChatML"));
            kvs_free(t);
            unsupported++;
        } else {
            fail_msg("unknown line kind \"%s\"", f[0]);
        }
    }
    assert_true(n_templates >= 4);
    assert_true(cases >= 40);
    assert_true(unsupported >= 5);
    for (int t = 0; t < n_templates; t++) kvs_free(templates[t]);
    kvs_free(data);

    kvs_chat_msg_t bad = {"user", NULL};
    char *got;
    assert_int_equal(kvs_chat_format(NULL, &bad, 1, 0, &got), KVS_ERR_INVALID);
    assert_int_equal(kvs_chat_format(NULL, NULL, 1, 0, &got), KVS_ERR_INVALID);
    assert_int_equal(kvs_chat_format(NULL, NULL, 0, 1, &got), KVS_OK);
    assert_string_equal(got, "<|im_start|>assistant\n");
    kvs_free(got);
    kvs_log_set_sink(NULL, NULL);
    kvs_assert_no_leaks();
}

/* Whitespace control and spelling variants of the same template are all recognised. */
static void test_chat_variants(void **state)
{
    (void) state;
    static const char *const same[] = {
        /* Escaped quotes and \u escapes in the default system message. */
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\\nIt\\'s \\u00e9\\x21<|im_end|>\\n' }}{% endif %}"
        "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
        /* \r\n line ends, a trailing newline, attribute access, split literals. */
        "{%- for message in messages -%}\r\n"
        "  {%- if loop.first and messages[0].role != \"system\" -%}\r\n"
        "    {{- \"<|im_start|>system\\nIt's \\u00e9!<|im_end|>\\n\" -}}\r\n"
        "  {%- endif -%}\r\n"
        "  {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}\r\n"
        "{%- endfor -%}\r\n"
        "{%- if add_generation_prompt -%}{{- '<|im_start|>' + 'assistant' + '\\n' -}}"
        "{%- endif -%}\n",
    };
    kvs_chat_msg_t msgs[2] = {{"user", "Hi"}, {"assistant", "Yo"}};
    const char *want = "<|im_start|>system\nIt's \xc3\xa9!<|im_end|>\n<|im_start|>user\nHi"
                       "<|im_end|>\n<|im_start|>assistant\nYo<|im_end|>\n<|im_start|>assistant\n";
    for (size_t i = 0; i < sizeof(same) / sizeof(same[0]); i++) {
        char *got;
        assert_int_equal(kvs_chat_format(same[i], msgs, 2, 1, &got), KVS_OK);
        if (strcmp(got, want) != 0) fail_msg("variant %zu renders\n%s", i, got);
        kvs_free(got);
    }
    kvs_assert_no_leaks();
}

/* Templates mangled at random never crash the recogniser or leak; they render or are
 * refused. */
static void test_chat_mutations(void **state)
{
    (void) state;
    static const char base[] =
        "{%- for message in messages -%}{% if loop.first and messages[0].role != 'system' %}"
        "{{ '<|im_start|>system\\nHi \\u00e9<|im_end|>\\n' }}{% endif %}{# c #}"
        "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
        "\"\\n\"}}{% endfor %}\n{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
        "{%+ endif -%}  ";
    static const char alphabet[] = "{}%#-+'\"\\ \n\tax[].|0";
    uint64_t seed = kvs_test_seed(0xc4a7);
    kvs_rng_t rng;
    kvs_rng_seed(&rng, seed);
    kvs_log_set_sink(kvs_log_capture_sink, &(kvs_log_capture_t){0});
    kvs_chat_msg_t msgs[2] = {{"user", "q"}, {"assistant", "a"}};
    char *text;
    assert_int_equal(kvs_chat_format(base, msgs, 2, 1, &text), KVS_OK);
    assert_string_equal(text, "<|im_start|>system\nHi \xc3\xa9<|im_end|>\n<|im_start|>user\nq"
                              "<|im_end|>\n<|im_start|>assistant\na<|im_end|>\n"
                              "<|im_start|>assistant\n");
    kvs_free(text);
    uint64_t iters = kvs_test_iters(3000), ok = 0;
    for (uint64_t it = 0; it < iters; it++) {
        char t[sizeof(base) + 16];
        size_t len = sizeof(base) - 1;
        memcpy(t, base, len);
        for (uint64_t e = 0, edits = 1 + kvs_rng_below(&rng, 3); e < edits; e++) {
            size_t at = (size_t) kvs_rng_below(&rng, len + 1);
            char c = alphabet[kvs_rng_below(&rng, sizeof(alphabet) - 1)];
            switch (kvs_rng_below(&rng, 3)) {
            case 0: /* delete */
                if (at < len) memmove(t + at, t + at + 1, len - at - 1), len--;
                break;
            case 1: /* insert */
                memmove(t + at + 1, t + at, len - at);
                t[at] = c;
                len++;
                break;
            default: /* replace */
                if (at < len) t[at] = c;
            }
        }
        if (kvs_rng_below(&rng, 8) == 0) len = (size_t) kvs_rng_below(&rng, len + 1);
        t[len] = 0;
        text = NULL;
        kvs_status_t st = kvs_chat_format(t, msgs, 2, (int) (it & 1), &text);
        if (st == KVS_OK) {
            /* Whatever was recognised still renders each message as ChatML. */
            if (strstr(text, "<|im_start|>user\nq<|im_end|>\n") == NULL)
                fail_msg("seed %llu: odd rendering \"%s\" of \"%s\"", (unsigned long long) seed,
                         text, t);
            kvs_free(text);
            ok++;
        } else if (st != KVS_ERR_UNSUPPORTED) {
            fail_msg("seed %llu: %s for \"%s\"", (unsigned long long) seed, kvs_status_str(st), t);
        }
    }
    assert_true(ok > 0); /* some edits (in the messages' text, spaces in tags) are harmless */
    kvs_log_set_sink(NULL, NULL);
    kvs_assert_no_leaks();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_unicode_classes),   cmocka_unit_test(test_utf8_decode),
        cmocka_unit_test(test_pretok_pieces),     cmocka_unit_test(test_pretok_property),
        cmocka_unit_test(test_bpe_tiny),          cmocka_unit_test(test_specials_tiny),
        cmocka_unit_test(test_encode_buffers),    cmocka_unit_test(test_vocab_errors),
        cmocka_unit_test(test_from_gguf_tiny),    cmocka_unit_test(test_alloc_failures),
        cmocka_unit_test(test_chat_reference),    cmocka_unit_test(test_chat_variants),
        cmocka_unit_test(test_chat_mutations),    cmocka_unit_test(test_smollm2_facts),
        cmocka_unit_test(test_smollm2_reference), cmocka_unit_test(test_smollm2_roundtrip_random),
        cmocka_unit_test(test_smollm2_chat_ids),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
