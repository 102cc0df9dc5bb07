/* OpenAI request parsing and validation: /v1/completions and /v1/chat/completions bodies to a
 * tokenized request, or the 4xx answer that names the offending field. */
#include "http/server_internal.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "kvstage/alloc.h"
#include "kvstage/log.h"

static const char *const k_common_fields[] = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stream",
    "stream_options",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "user",
    "seed",
    "stop_token_ids",
    "top_k",
    "min_p",
    "repetition_penalty",
    "ignore_eos",
    "kvstage",
    NULL,
};
static const char *const k_completion_fields[] = {"prompt", "echo", "best_of", "suffix", NULL};
static const char *const k_chat_fields[] = {
    "messages",    "max_completion_tokens", "top_logprobs", "response_format", "tools",
    "tool_choice", "parallel_tool_calls",   "store",        "metadata",        NULL,
};
static const char *const k_message_fields[] = {"role", "content", "name", NULL};
static const char *const k_stream_options_fields[] = {"include_usage", NULL};
static const char *const k_kvstage_fields[] = {"room", "role", "bootstrap", "prefill", NULL};

#define BAD_REQUEST "invalid_request_error"

static kvs_status_t fail(kvs__api_err_t *err, int status, const char *param, const char *code,
                         const char *fmt, ...) __attribute__((format(printf, 5, 6)));

static kvs_status_t fail(kvs__api_err_t *err, int status, const char *param, const char *code,
                         const char *fmt, ...)
{
    err->status = status;
    err->type = status >= 500 ? "server_error" : BAD_REQUEST;
    err->code = code;
    snprintf(err->param, sizeof(err->param), "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof(err->message), fmt, ap);
    va_end(ap);
    if (status >= 500) {
        kvs_error("server: %s", err->message);
        return KVS_ERR_NOMEM;
    }
    kvs_debug("server: refused a request: %s", err->message);
    return KVS_ERR_INVALID;
}

static kvs_status_t fail_nomem(kvs__api_err_t *err)
{
    return fail(err, 500, NULL, NULL, "out of memory while parsing the request");
}

static int in_list(const char *const *list, const char *key)
{
    for (size_t i = 0; list[i]; i++)
        if (strcmp(list[i], key) == 0) return 1;
    return 0;
}

/* A field present and not null. */
static json_t *field(json_t *root, const char *name)
{
    json_t *v = json_object_get(root, name);
    return (v == NULL || json_is_null(v)) ? NULL : v;
}

static kvs_status_t get_number(json_t *root, const char *name, double lo, double hi, int lo_open,
                               double *out, kvs__api_err_t *err)
{
    json_t *v = field(root, name);
    if (v == NULL) return KVS_OK;
    if (!json_is_number(v)) return fail(err, 400, name, NULL, "'%s' must be a number", name);
    double d = json_number_value(v);
    if (!(d <= hi) || !(lo_open ? d > lo : d >= lo))
        return fail(err, 400, name, NULL, "'%s' must be in %s%g, %g], not %g", name,
                    lo_open ? "(" : "[", lo, hi, d);
    *out = d;
    return KVS_OK;
}

static kvs_status_t get_bool(json_t *root, const char *name, int *out, kvs__api_err_t *err)
{
    json_t *v = field(root, name);
    if (v == NULL) return KVS_OK;
    if (!json_is_boolean(v)) return fail(err, 400, name, NULL, "'%s' must be a boolean", name);
    *out = json_is_true(v);
    return KVS_OK;
}

/* "n": the choices, 1..KVS_SERVER_CHOICES_MAX (absent: 1); completions "best_of" only as n
 * (every sample returned, none ranked). */
static kvs_status_t parse_choices(json_t *root, kvs__api_req_t *req, kvs__api_err_t *err)
{
    json_t *v;
    req->n = 1;
    if ((v = field(root, "n")) != NULL) {
        json_int_t n = json_is_integer(v) ? json_integer_value(v) : 0;
        if (n < 1 || n > KVS_SERVER_CHOICES_MAX)
            return fail(err, 400, "n", NULL, "'n' must be an integer in [1, %d]",
                        KVS_SERVER_CHOICES_MAX);
        req->n = (uint32_t) n;
    }
    if ((v = field(root, "best_of")) != NULL) {
        if (!json_is_integer(v))
            return fail(err, 400, "best_of", NULL, "'best_of' must be an integer");
        if (json_integer_value(v) != (json_int_t) req->n)
            return fail(err, 400, "best_of", NULL,
                        "only best_of equal to n (%u) is supported, not %lld", req->n,
                        (long long) json_integer_value(v));
    }
    return KVS_OK;
}

/* Fields accepted for compatibility whose only supported value is their neutral one. */
static kvs_status_t check_neutral(json_t *root, int chat, kvs__api_err_t *err)
{
    json_t *v;
    if ((v = field(root, "suffix")) != NULL) {
        if (!json_is_string(v)) return fail(err, 400, "suffix", NULL, "'suffix' must be a string");
        if (json_string_length(v) != 0)
            return fail(err, 400, "suffix", NULL, "suffix is not supported");
    }
    if ((v = field(root, "user")) != NULL && !json_is_string(v))
        return fail(err, 400, "user", NULL, "'user' must be a string");
    if ((v = field(root, "response_format")) != NULL) {
        json_t *t = json_is_object(v) ? json_object_get(v, "type") : NULL;
        if (!json_is_object(v) || !json_is_string(t))
            return fail(err, 400, "response_format", NULL,
                        "'response_format' must be an object with a 'type'");
        if (strcmp(json_string_value(t), "text") != 0)
            return fail(err, 400, "response_format", NULL,
                        "response_format '%s' is not supported (only 'text')",
                        json_string_value(t));
    }
    if ((v = field(root, "tools")) != NULL) {
        if (!json_is_array(v)) return fail(err, 400, "tools", NULL, "'tools' must be an array");
        if (json_array_size(v) != 0)
            return fail(err, 400, "tools", NULL, "tools are not supported");
    }
    if ((v = field(root, "tool_choice")) != NULL) {
        const char *s = json_string_value(v);
        if (s == NULL || (strcmp(s, "none") != 0 && strcmp(s, "auto") != 0))
            return fail(err, 400, "tool_choice", NULL,
                        "tool_choice other than 'none' or 'auto' "
                        "is not supported");
    }
    int b = 0;
    if (get_bool(root, "parallel_tool_calls", &b, err) != KVS_OK ||
        get_bool(root, "store", &b, err) != KVS_OK)
        return KVS_ERR_INVALID;
    if ((v = field(root, "metadata")) != NULL && !json_is_object(v))
        return fail(err, 400, "metadata", NULL, "'metadata' must be an object");
    return KVS_OK;
}

/* Chat: "logprobs" a boolean, "top_logprobs" 0..20 (only with logprobs true, as OpenAI);
 * completions: "logprobs" the alternatives, 0..5 (false: none), and "echo" (the prompt's text,
 * and with logprobs its tokens' logprobs, before the completion). */
static kvs_status_t parse_logprobs(json_t *root, int chat, kvs__api_req_t *req, kvs__api_err_t *err)
{
    json_t *v = field(root, "logprobs");
    if (chat) {
        if (get_bool(root, "logprobs", &req->logprobs, err) != KVS_OK) return KVS_ERR_INVALID;
        if ((v = field(root, "top_logprobs")) == NULL) return KVS_OK;
        json_int_t k = json_is_integer(v) ? json_integer_value(v) : -1;
        if (k < 0 || k > KVS__CHAT_TOP_LOGPROBS_MAX)
            return fail(err, 400, "top_logprobs", NULL,
                        "'top_logprobs' must be an integer in [0, %d]", KVS__CHAT_TOP_LOGPROBS_MAX);
        if (!req->logprobs && k > 0)
            return fail(err, 400, "top_logprobs", NULL,
                        "'top_logprobs' needs 'logprobs' set to true");
        req->top_logprobs = (uint32_t) k;
        return KVS_OK;
    }
    if (v != NULL && !json_is_false(v)) {
        json_int_t k = json_is_integer(v) ? json_integer_value(v) : -1;
        if (k < 0 || k > KVS__COMPLETION_LOGPROBS_MAX)
            return fail(err, 400, "logprobs", NULL, "'logprobs' must be an integer in [0, %d]",
                        KVS__COMPLETION_LOGPROBS_MAX);
        req->logprobs = 1;
        req->top_logprobs = (uint32_t) k;
    }
    return get_bool(root, "echo", &req->echo, err);
}

/* A logit_bias key: a token id in canonical decimal (one spelling per id). */
static int token_key(const char *key, uint32_t vocab, uint32_t *id_p)
{
    uint64_t id = 0;
    size_t n = strlen(key);
    if (n == 0 || n > 10 || (key[0] == '0' && n > 1)) return 0;
    for (size_t i = 0; i < n; i++) {
        if (key[i] < '0' || key[i] > '9') return 0;
        id = id * 10 + (uint64_t) (key[i] - '0');
    }
    if (id >= vocab) return 0;
    *id_p = (uint32_t) id;
    return 1;
}

static kvs_status_t parse_logit_bias(json_t *root, const kvs_server_tokenizer_t *tok,
                                     kvs__api_req_t *req, kvs__api_err_t *err)
{
    json_t *v = field(root, "logit_bias");
    if (v == NULL) return KVS_OK;
    if (!json_is_object(v))
        return fail(err, 400, "logit_bias", NULL,
                    "'logit_bias' must be an object of token ids to biases");
    size_t n = json_object_size(v);
    if (n > KVS_SAMPLE_BIAS_LIMIT)
        return fail(err, 400, "logit_bias", NULL, "'logit_bias' has %zu entries; at most %u", n,
                    KVS_SAMPLE_BIAS_LIMIT);
    if (n == 0) return KVS_OK;
    kvs_logit_bias_t *b = kvs_malloc(n * sizeof(*b));
    if (b == NULL) return fail_nomem(err);
    req->sampling.bias = b; /* owned from here: fini frees it */
    const char *key;
    json_t *val;
    uint32_t k = 0;
    json_object_foreach(v, key, val)
    {
        uint32_t id;
        if (!token_key(key, tok->vocab_size, &id))
            return fail(err, 400, "logit_bias", NULL,
                        "logit_bias key '%.32s' is not a token id below %u (in decimal)", key,
                        tok->vocab_size);
        double d = json_is_number(val) ? json_number_value(val) : NAN;
        if (!(fabs(d) <= KVS_SAMPLE_BIAS_MAX))
            return fail(err, 400, "logit_bias", NULL,
                        "logit_bias['%s'] must be a number in [-%g, %g]", key,
                        (double) KVS_SAMPLE_BIAS_MAX, (double) KVS_SAMPLE_BIAS_MAX);
        b[k++] = (kvs_logit_bias_t){.token = id, .bias = (float) d};
        req->sampling.n_bias = k;
    }
    return KVS_OK;
}

/* ---- unknown fields ---- */

/* Appends prefix + key to the list, as it will appear in a header. */
static void ignored_add(kvs__api_ignored_t *ign, const char *prefix, const char *key)
{
    ign->n++;
    if (ign->truncated) return;
    static const char more[] = ", ...";
    char name[KVS__IGNORED_CAP];
    size_t n = 0;
    for (int part = 0; part < 2; part++) {
        for (const unsigned char *c = (const unsigned char *) (part ? key : prefix);
             *c && n + 4 < sizeof(name); c++) {
            if (*c < 0x21 || *c > 0x7E || *c == '%' || *c == ',')
                n += (size_t) snprintf(name + n, sizeof(name) - n, "%%%02X", *c);
            else
                name[n++] = (char) *c;
        }
    }
    if (n == 0) n = (size_t) snprintf(name, sizeof(name), "\"\""); /* the empty key */
    name[n] = '\0';
    size_t len = strlen(ign->names);
    size_t sep = len ? 2 : 0;
    if (len + sep + n + sizeof(more) > sizeof(ign->names)) {
        snprintf(ign->names + len, sizeof(ign->names) - len, "%s", len ? more : more + 2);
        ign->truncated = 1;
        return;
    }
    snprintf(ign->names + len, sizeof(ign->names) - len, "%s%s", sep ? ", " : "", name);
}

/* The members of obj outside known (and known2): refused when strict, else listed (and, with
 * remove, deleted). */
static kvs_status_t check_object(json_t *obj, const char *prefix, const char *const *known,
                                 const char *const *known2, int strict, int remove,
                                 kvs__api_ignored_t *ign, kvs__api_err_t *err)
{
    const char *key;
    json_t *val;
    void *tmp;
    json_object_foreach_safe(obj, tmp, key, val)
    {
        if (in_list(known, key) || (known2 != NULL && in_list(known2, key))) continue;
        if (strict) {
            char param[sizeof(err->param)];
            snprintf(param, sizeof(param), "%s%s", prefix, key);
            return fail(err, 400, param, "unknown_field", "unknown field '%s%s'", prefix, key);
        }
        ignored_add(ign, prefix, key);
        if (remove) json_object_del(obj, key);
    }
    return KVS_OK;
}

/* The sampling knobs (model/model.h), each refused outside its range by name. */
static kvs_status_t parse_sampling(json_t *root, const kvs_server_tokenizer_t *tok,
                                   kvs__api_req_t *req, kvs__api_err_t *err)
{
    const double pen = KVS_SAMPLE_PENALTY_MAX;
    double t = 1.0, p = 1.0, minp = 0, presence = 0, frequency = 0, repetition = 1;
    kvs_status_t st;
    if ((st = get_number(root, "temperature", 0, 2, 0, &t, err)) != KVS_OK ||
        (st = get_number(root, "top_p", 0, 1, 1, &p, err)) != KVS_OK ||
        (st = get_number(root, "min_p", 0, 1, 0, &minp, err)) != KVS_OK ||
        (st = get_number(root, "presence_penalty", -pen, pen, 0, &presence, err)) != KVS_OK ||
        (st = get_number(root, "frequency_penalty", -pen, pen, 0, &frequency, err)) != KVS_OK ||
        (st = get_number(root, "repetition_penalty", 0, pen, 1, &repetition, err)) != KVS_OK)
        return st;
    kvs_sample_params_t *sp = &req->sampling;
    sp->temperature = (float) t;
    sp->top_p = (float) p;
    sp->min_p = (float) minp;
    sp->presence_penalty = (float) presence;
    sp->frequency_penalty = (float) frequency;
    sp->repetition_penalty = (float) repetition;
    json_t *v = field(root, "top_k");
    if (v != NULL) {
        json_int_t k = json_is_integer(v) ? json_integer_value(v) : -2;
        if (k < -1)
            return fail(err, 400, "top_k", NULL,
                        "'top_k' must be an integer: -1 or 0 (off), or at least 1");
        /* More than the vocabulary keeps it all. */
        sp->top_k = k <= 0 ? 0 : k > tok->vocab_size ? tok->vocab_size : (uint32_t) k;
    }
    if ((v = field(root, "seed")) != NULL) {
        if (!json_is_integer(v)) return fail(err, 400, "seed", NULL, "'seed' must be an integer");
        req->seed = (uint64_t) json_integer_value(v);
    } else {
        req->seed = kvs__random_seed();
    }
    return parse_logit_bias(root, tok, req, err);
}

kvs_status_t kvs__api_check_fields(json_t *root, int chat, int strict, int remove,
                                   kvs__api_ignored_t *ign, kvs__api_err_t *err)
{
    if (!json_is_object(root))
        return fail(err, 400, NULL, NULL, "the request body must be a JSON object");
    /* The other endpoint's input is a request sent to the wrong endpoint, not an extension. */
    const char *wrong = chat ? "prompt" : "messages";
    if (json_object_get(root, wrong) != NULL)
        return fail(err, 400, wrong, "wrong_endpoint",
                    "'%s' belongs to %s requests; this endpoint takes '%s'", wrong,
                    chat ? "/v1/completions" : "/v1/chat/completions",
                    chat ? "messages" : "prompt");
    kvs_status_t st =
        check_object(root, "", k_common_fields, chat ? k_chat_fields : k_completion_fields, strict,
                     remove, ign, err);
    json_t *v = json_object_get(root, "messages");
    for (size_t i = 0; chat && st == KVS_OK && i < json_array_size(v); i++) {
        json_t *m = json_array_get(v, i);
        char prefix[40];
        snprintf(prefix, sizeof(prefix), "messages[%zu].", i);
        if (json_is_object(m))
            st = check_object(m, prefix, k_message_fields, NULL, strict, remove, ign, err);
    }
    if (st == KVS_OK && json_is_object(v = json_object_get(root, "stream_options")))
        st = check_object(v, "stream_options.", k_stream_options_fields, NULL, strict, remove, ign,
                          err);
    if (st == KVS_OK && json_is_object(v = json_object_get(root, "kvstage")))
        st = check_object(v, "kvstage.", k_kvstage_fields, NULL, strict, remove, ign, err);
    return st;
}

static kvs_status_t parse_stops(json_t *root, kvs__api_req_t *req, kvs__api_err_t *err)
{
    json_t *v = field(root, "stop");
    if (v == NULL) return KVS_OK;
    json_t *one[1] = {v};
    json_t **items = one;
    size_t n = 1;
    if (json_is_array(v)) {
        n = json_array_size(v);
        if (n > KVS__MAX_STOPS)
            return fail(err, 400, "stop", NULL, "at most %d stop strings, not %zu", KVS__MAX_STOPS,
                        n);
        items = NULL;
    } else if (!json_is_string(v)) {
        return fail(err, 400, "stop", NULL, "'stop' must be a string or an array of strings");
    }
    for (size_t i = 0; i < n; i++) {
        json_t *s = items ? items[i] : json_array_get(v, i);
        char param[32] = "stop";
        if (items == NULL) snprintf(param, sizeof(param), "stop[%zu]", i);
        if (!json_is_string(s)) return fail(err, 400, param, NULL, "'%s' must be a string", param);
        size_t len = json_string_length(s);
        if (len == 0 || len > KVS__MAX_STOP_LEN)
            return fail(err, 400, param, NULL, "a stop string must have 1 to %d bytes, not %zu",
                        KVS__MAX_STOP_LEN, len);
        char *copy = kvs_malloc(len + 1);
        if (copy == NULL) return fail_nomem(err);
        memcpy(copy, json_string_value(s), len + 1);
        req->stops[req->n_stops] = copy;
        req->stop_lens[req->n_stops] = len;
        req->n_stops++;
    }
    return KVS_OK;
}

static kvs_status_t parse_stop_ids(json_t *root, const kvs_server_tokenizer_t *tok, int ignore_eos,
                                   kvs__api_req_t *req, kvs__api_err_t *err)
{
    json_t *v = field(root, "stop_token_ids");
    size_t n = 0;
    if (v != NULL) {
        if (!json_is_array(v))
            return fail(err, 400, "stop_token_ids", NULL,
                        "'stop_token_ids' must be an array of token ids");
        n = json_array_size(v);
        if (n > 64)
            return fail(err, 400, "stop_token_ids", NULL, "at most 64 stop token ids, not %zu", n);
    }
    req->stop_ids = kvs_calloc(n + 1, sizeof(uint32_t));
    if (req->stop_ids == NULL) return fail_nomem(err);
    if (tok->eos != UINT32_MAX && !ignore_eos) req->stop_ids[req->n_stop_ids++] = tok->eos;
    for (size_t i = 0; i < n; i++) {
        json_t *e = json_array_get(v, i);
        json_int_t id = json_is_integer(e) ? json_integer_value(e) : -1;
        if (id < 0 || (uint64_t) id >= tok->vocab_size)
            return fail(err, 400, "stop_token_ids", NULL,
                        "stop_token_ids[%zu] is not a token id below %u", i, tok->vocab_size);
        req->stop_ids[req->n_stop_ids++] = (uint32_t) id;
    }
    return KVS_OK;
}

static kvs_status_t parse_kvstage(json_t *root, kvs__api_req_t *req, kvs__api_err_t *err)
{
    json_t *v = field(root, "kvstage");
    if (v == NULL) return KVS_OK;
    if (!json_is_object(v)) return fail(err, 400, "kvstage", NULL, "'kvstage' must be an object");
    json_t *room = json_object_get(v, "room");
    if (!json_is_integer(room) || json_integer_value(room) < 0 ||
        (uint64_t) json_integer_value(room) >= (UINT64_C(1) << 62))
        return fail(err, 400, "kvstage.room", NULL,
                    "'kvstage.room' must be an integer in [0, 2^62)");
    const char *role = json_string_value(json_object_get(v, "role"));
    if (role != NULL && strcmp(role, "prefill") == 0)
        req->role = KVS_SERVER_ROLE_PREFILL;
    else if (role != NULL && strcmp(role, "decode") == 0)
        req->role = KVS_SERVER_ROLE_DECODE;
    else
        return fail(err, 400, "kvstage.role", NULL,
                    "'kvstage.role' must be \"prefill\" or \"decode\"");
    json_t *boot = json_object_get(v, "bootstrap");
    if (boot != NULL && !json_is_null(boot)) {
        if (!json_is_string(boot))
            return fail(err, 400, "kvstage.bootstrap", NULL,
                        "'kvstage.bootstrap' must be a string");
        req->bootstrap = kvs_strdup(json_string_value(boot));
        if (req->bootstrap == NULL) return fail_nomem(err);
    }
    json_t *pre = json_object_get(v, "prefill");
    if (pre != NULL && !json_is_null(pre) && !json_is_string(pre))
        return fail(err, 400, "kvstage.prefill", NULL, "'kvstage.prefill' must be a string");
    req->has_room = 1;
    req->room = (uint64_t) json_integer_value(room);
    return KVS_OK;
}

static kvs_status_t encode(const kvs_server_tokenizer_t *tok, const char *text, size_t len,
                           kvs__api_req_t *req, kvs__api_err_t *err)
{
    uint32_t *ids = NULL;
    size_t n = 0;
    kvs_status_t st = tok->encode(tok->ctx, text, len, &ids, &n);
    if (st == KVS_ERR_NOMEM) return fail_nomem(err);
    if (st != KVS_OK)
        return fail(err, 400, "prompt", NULL, "the prompt cannot be tokenized: %s",
                    kvs_status_str(st));
    if (n > UINT32_MAX) {
        kvs_free(ids);
        return fail(err, 400, "prompt", NULL, "the prompt is too long");
    }
    req->prompt = ids;
    req->prompt_len = (uint32_t) n;
    return KVS_OK;
}

/* A prompt given as an array of token ids. */
static kvs_status_t take_ids(json_t *arr, const kvs_server_tokenizer_t *tok, kvs__api_req_t *req,
                             kvs__api_err_t *err)
{
    size_t n = json_array_size(arr);
    if (n > UINT32_MAX) return fail(err, 400, "prompt", NULL, "the prompt is too long");
    uint32_t *ids = kvs_malloc((n ? n : 1) * sizeof(uint32_t));
    if (ids == NULL) return fail_nomem(err);
    for (size_t i = 0; i < n; i++) {
        json_t *e = json_array_get(arr, i);
        json_int_t id = json_is_integer(e) ? json_integer_value(e) : -1;
        if (id < 0 || (uint64_t) id >= tok->vocab_size) {
            kvs_free(ids);
            return fail(err, 400, "prompt", NULL, "prompt[%zu] is not a token id below %u", i,
                        tok->vocab_size);
        }
        ids[i] = (uint32_t) id;
    }
    req->prompt = ids;
    req->prompt_len = (uint32_t) n;
    return KVS_OK;
}

static int all_integers(json_t *arr)
{
    for (size_t i = 0; i < json_array_size(arr); i++)
        if (!json_is_integer(json_array_get(arr, i))) return 0;
    return 1;
}

static kvs_status_t parse_prompt(json_t *root, const kvs_server_tokenizer_t *tok,
                                 kvs__api_req_t *req, kvs__api_err_t *err)
{
    json_t *v = field(root, "prompt");
    if (v == NULL) return fail(err, 400, "prompt", NULL, "'prompt' is required");
    if (json_is_string(v))
        return encode(tok, json_string_value(v), json_string_length(v), req, err);
    if (!json_is_array(v))
        return fail(err, 400, "prompt", NULL,
                    "'prompt' must be a string, an array of token ids, or an array of one of "
                    "those");
    if (json_array_size(v) > 0 && all_integers(v)) return take_ids(v, tok, req, err);
    if (json_array_size(v) == 1) {
        json_t *e = json_array_get(v, 0);
        if (json_is_string(e))
            return encode(tok, json_string_value(e), json_string_length(e), req, err);
        if (json_is_array(e) && all_integers(e)) return take_ids(e, tok, req, err);
    }
    if (json_array_size(v) > 1)
        return fail(err, 400, "prompt", NULL,
                    "batched prompts are not supported: send one prompt per request");
    return fail(err, 400, "prompt", NULL, "'prompt' is empty or of the wrong type");
}

/* A message's content: a string, or an array of {"type": "text", "text": ...} parts joined. */
static kvs_status_t message_content(json_t *content, size_t i, char **text_p, kvs__api_err_t *err)
{
    char param[48];
    snprintf(param, sizeof(param), "messages[%zu].content", i);
    if (json_is_string(content)) {
        *text_p = kvs_strdup(json_string_value(content));
        return *text_p ? KVS_OK : fail_nomem(err);
    }
    if (!json_is_array(content))
        return fail(err, 400, param, NULL, "'%s' must be a string or an array of text parts",
                    param);
    kvs__sb_t sb;
    kvs__sb_init(&sb);
    for (size_t k = 0; k < json_array_size(content); k++) {
        json_t *part = json_array_get(content, k);
        const char *type = json_string_value(json_object_get(part, "type"));
        json_t *text = json_object_get(part, "text");
        if (type == NULL || strcmp(type, "text") != 0 || !json_is_string(text)) {
            kvs__sb_fini(&sb);
            return fail(err, 400, param, NULL,
                        "'%s[%zu]' must be {\"type\": \"text\", \"text\": ...} (only text parts "
                        "are supported)",
                        param, k);
        }
        kvs__sb_append(&sb, json_string_value(text), json_string_length(text));
    }
    char *text = kvs__sb_take(&sb);
    if (text == NULL) return fail_nomem(err);
    *text_p = text;
    return KVS_OK;
}

static kvs_status_t parse_messages(json_t *root, const kvs_server_tokenizer_t *tok,
                                   kvs__api_req_t *req, kvs__api_err_t *err)
{
    json_t *v = field(root, "messages");
    if (v == NULL) return fail(err, 400, "messages", NULL, "'messages' is required");
    if (!json_is_array(v) || json_array_size(v) == 0)
        return fail(err, 400, "messages", NULL, "'messages' must be a non-empty array");
    size_t n = json_array_size(v);
    kvs_chat_msg_t *msgs = kvs_calloc(n, sizeof(*msgs));
    char **contents = kvs_calloc(n, sizeof(char *));
    kvs_status_t st = KVS_OK;
    if (msgs == NULL || contents == NULL) {
        st = fail_nomem(err);
        goto out;
    }
    for (size_t i = 0; i < n && st == KVS_OK; i++) {
        json_t *m = json_array_get(v, i);
        char param[48];
        snprintf(param, sizeof(param), "messages[%zu]", i);
        if (!json_is_object(m)) {
            st = fail(err, 400, param, NULL, "'%s' must be an object", param);
            break;
        }
        const char *role = json_string_value(json_object_get(m, "role"));
        if (role == NULL || (strcmp(role, "system") != 0 && strcmp(role, "user") != 0 &&
                             strcmp(role, "assistant") != 0 && strcmp(role, "developer") != 0)) {
            char p2[64];
            snprintf(p2, sizeof(p2), "%s.role", param);
            st = fail(err, 400, p2, NULL,
                      "'%s' must be \"system\", \"user\", \"assistant\" or \"developer\"", p2);
            break;
        }
        json_t *name = json_object_get(m, "name");
        if (name != NULL && !json_is_null(name) && !json_is_string(name)) {
            char p2[64];
            snprintf(p2, sizeof(p2), "%s.name", param);
            st = fail(err, 400, p2, NULL, "'%s' must be a string", p2);
            break;
        }
        st = message_content(json_object_get(m, "content"), i, &contents[i], err);
        /* The templates know system, user and assistant; a developer message is the newer
         * name of a system one. */
        msgs[i].role = strcmp(role, "developer") == 0 ? "system" : role;
        msgs[i].content = contents[i];
    }
    if (st != KVS_OK) goto out;
    char *text = NULL;
    st = tok->chat(tok->ctx, msgs, n, &text);
    if (st == KVS_ERR_NOMEM) {
        st = fail_nomem(err);
        goto out;
    }
    if (st != KVS_OK) {
        st = fail(err, 400, "messages", NULL, "the conversation cannot be formatted: %s",
                  kvs_status_str(st));
        goto out;
    }
    st = encode(tok, text, strlen(text), req, err);
    if (st != KVS_OK && err->status == 400) snprintf(err->param, sizeof(err->param), "messages");
    kvs_free(text);
out:
    if (contents)
        for (size_t i = 0; i < n; i++) kvs_free(contents[i]);
    kvs_free(contents);
    kvs_free(msgs);
    return st;
}

/* prompt + max_tokens within the context, in vLLM's words: the client's own field is named and
 * both numbers given. */
static kvs_status_t parse_lengths(json_t *root, const kvs__api_limits_t *lim, int chat,
                                  kvs__api_req_t *req, kvs__api_err_t *err)
{
    const char *pname = chat ? "messages" : "prompt";
    if (req->prompt_len == 0) return fail(err, 400, pname, NULL, "the prompt is empty");
    if (req->prompt_len >= lim->max_context)
        return fail(err, 400, pname, "context_length_exceeded",
                    "This model's maximum context length is %u tokens. However, you requested %u "
                    "tokens in the %s, which leaves no room for the completion. Please reduce the "
                    "length of the %s.",
                    lim->max_context, req->prompt_len, pname, pname);
    uint32_t avail = lim->max_context - req->prompt_len;
    const char *mname = "max_tokens";
    json_t *v = field(root, "max_tokens");
    if (chat && field(root, "max_completion_tokens") != NULL) {
        mname = "max_completion_tokens";
        v = field(root, mname);
    }
    if (v == NULL) {
        req->max_tokens = lim->default_max_tokens && lim->default_max_tokens < avail
                              ? lim->default_max_tokens
                              : avail;
        return KVS_OK;
    }
    if (!json_is_integer(v)) return fail(err, 400, mname, NULL, "'%s' must be an integer", mname);
    json_int_t m = json_integer_value(v);
    if (m < 1) return fail(err, 400, mname, NULL, "'%s' must be at least 1", mname);
    if ((uint64_t) m > avail)
        return fail(err, 400, mname, "context_length_exceeded",
                    "This model's maximum context length is %u tokens. However, you requested "
                    "%llu tokens (%u in the %s, %lld in the completion). Please reduce the length "
                    "of the %s or completion ('%s' at most %u).",
                    lim->max_context, (unsigned long long) m + req->prompt_len, req->prompt_len,
                    pname, (long long) m, pname, mname, avail);
    req->max_tokens = (uint32_t) m;
    return KVS_OK;
}

static kvs_status_t parse_fields(json_t *root, const kvs__api_limits_t *lim,
                                 const kvs_server_tokenizer_t *tok, int chat, kvs__api_req_t *req,
                                 kvs__api_err_t *err)
{
    kvs_status_t st = kvs__api_check_fields(root, chat, lim->strict, 0, &req->ignored, err);
    if (st != KVS_OK) return st;
    json_t *v = field(root, "model");
    if (v != NULL) {
        if (!json_is_string(v)) return fail(err, 400, "model", NULL, "'model' must be a string");
        if (lim->model != NULL && strcmp(json_string_value(v), lim->model) != 0)
            return fail(err, 404, "model", "model_not_found", "the model '%s' does not exist",
                        json_string_value(v));
    }
    if ((st = check_neutral(root, chat, err)) != KVS_OK) return st;
    if ((st = parse_choices(root, req, err)) != KVS_OK) return st;
    if ((st = parse_logprobs(root, chat, req, err)) != KVS_OK) return st;
    if ((st = parse_sampling(root, tok, req, err)) != KVS_OK) return st;
    int ignore_eos = 0;
    if ((st = get_bool(root, "ignore_eos", &ignore_eos, err)) != KVS_OK) return st;
    if ((st = get_bool(root, "stream", &req->stream, err)) != KVS_OK) return st;
    if ((v = field(root, "stream_options")) != NULL) {
        if (!json_is_object(v))
            return fail(err, 400, "stream_options", NULL, "'stream_options' must be an object");
        if (!req->stream)
            return fail(err, 400, "stream_options", NULL,
                        "'stream_options' is only allowed when 'stream' is true");
        if ((st = get_bool(v, "include_usage", &req->include_usage, err)) != KVS_OK) {
            snprintf(err->param, sizeof(err->param), "stream_options.include_usage");
            return st;
        }
    }
    if ((st = parse_stops(root, req, err)) != KVS_OK) return st;
    if ((st = parse_stop_ids(root, tok, ignore_eos, req, err)) != KVS_OK) return st;
    if ((st = parse_kvstage(root, req, err)) != KVS_OK) return st;
    st = chat ? parse_messages(root, tok, req, err) : parse_prompt(root, tok, req, err);
    if (st != KVS_OK) return st;
    return parse_lengths(root, lim, chat, req, err);
}

kvs_status_t kvs__api_parse(const kvs__api_limits_t *limits, const kvs_server_tokenizer_t *tok,
                            int chat, const char *body, size_t len, kvs__api_req_t *req_p,
                            kvs__api_err_t *err_p)
{
    kvs__json_init();
    kvs__api_req_t req;
    memset(&req, 0, sizeof(req));
    req.chat = chat;
    json_error_t jerr;
    kvs_alloc_stats_t before, after;
    kvs_alloc_stats(&before);
    json_t *root = json_loadb(body ? body : "", len, 0, &jerr);
    kvs_alloc_stats(&after);
    /* jansson reports some failed allocations as syntax errors: an allocation that failed
     * meanwhile means the body was not judged. */
    if (root == NULL && after.failed_allocs != before.failed_allocs) return fail_nomem(err_p);
    if (root == NULL)
        return fail(err_p, 400, NULL, "invalid_json",
                    "the body is not valid JSON: %s (line %d, column %d)", jerr.text, jerr.line,
                    jerr.column);
    kvs_status_t st = parse_fields(root, limits, tok, chat, &req, err_p);
    json_decref(root);
    if (st != KVS_OK) {
        kvs__api_req_fini(&req);
        return st;
    }
    *req_p = req;
    return KVS_OK;
}

void kvs__api_req_fini(kvs__api_req_t *req)
{
    kvs_free(req->prompt);
    for (uint32_t i = 0; i < req->n_stops; i++) kvs_free(req->stops[i]);
    kvs_free(req->stop_ids);
    kvs_free((void *) req->sampling.bias);
    kvs_free(req->bootstrap);
    memset(req, 0, sizeof(*req));
}

const char *kvs__finish_name(kvs_server_finish_t finish)
{
    switch (finish) {
    case KVS_SERVER_FINISH_STOP:
        return "stop";
    case KVS_SERVER_FINISH_LENGTH:
        return "length";
    case KVS_SERVER_FINISH_HANDOFF:
        return "handoff";
    case KVS_SERVER_FINISH_ERROR:
        break;
    }
    return "error";
}

/* The body of /tokenize or /detokenize as an object; a field not in `known` is refused when
 * strict, else ignored with a warning (the first one named). */
static json_t *small_body(const char *body, size_t len, const char *const *known,
                          const kvs__api_limits_t *lim, kvs__api_err_t *err)
{
    kvs__json_init();
    json_error_t jerr;
    json_t *root = json_loadb(body ? body : "", len, 0, &jerr);
    if (root == NULL) {
        fail(err, 400, NULL, "invalid_json", "the body is not valid JSON: %s (line %d, column %d)",
             jerr.text, jerr.line, jerr.column);
        return NULL;
    }
    const char *key;
    json_t *val;
    const char *bad = NULL;
    if (!json_is_object(root)) {
        fail(err, 400, NULL, NULL, "the request body must be a JSON object");
        goto refuse;
    }
    json_object_foreach(root, key, val)
    {
        if (!in_list(known, key)) {
            bad = key;
            break;
        }
    }
    if (bad != NULL && lim->strict) {
        fail(err, 400, bad, "unknown_field", "unknown field '%s'", bad);
        goto refuse;
    }
    if (bad != NULL)
        kvs_warn("server: ignored an unknown field of a (de)tokenize request: %s", bad);
    json_t *m = field(root, "model");
    if (m != NULL && (!json_is_string(m) ||
                      (lim->model != NULL && strcmp(json_string_value(m), lim->model) != 0))) {
        fail(err, 404, "model", "model_not_found", "the model '%s' does not exist",
             json_is_string(m) ? json_string_value(m) : "(not a string)");
        goto refuse;
    }
    return root;
refuse:
    json_decref(root);
    return NULL;
}

kvs_status_t kvs__api_tokenize(const kvs__api_limits_t *lim, const kvs_server_tokenizer_t *tok,
                               const char *body, size_t len, uint32_t **ids_p, uint32_t *n_p,
                               kvs__api_err_t *err)
{
    static const char *const known[] = {
        "model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", NULL};
    json_t *root = small_body(body, len, known, lim, err);
    if (root == NULL) return err->status >= 500 ? KVS_ERR_NOMEM : KVS_ERR_INVALID;
    kvs__api_req_t req;
    memset(&req, 0, sizeof(req));
    kvs_status_t st;
    int bval = 0;
    if ((st = get_bool(root, "add_special_tokens", &bval, err)) != KVS_OK ||
        (st = get_bool(root, "add_generation_prompt", &bval, err)) != KVS_OK)
        goto out;
    int has_p = field(root, "prompt") != NULL, has_m = field(root, "messages") != NULL;
    if (has_p == has_m) {
        st = fail(err, 400, has_p ? "messages" : "prompt", NULL,
                  "give one of 'prompt' (text or token ids) and 'messages' (a conversation)");
        goto out;
    }
    st = has_m ? parse_messages(root, tok, &req, err) : parse_prompt(root, tok, &req, err);
    if (st == KVS_OK) {
        *ids_p = req.prompt;
        *n_p = req.prompt_len;
        req.prompt = NULL;
    }
out:
    kvs__api_req_fini(&req);
    json_decref(root);
    return st;
}

kvs_status_t kvs__api_detokenize(const kvs__api_limits_t *lim, const kvs_server_tokenizer_t *tok,
                                 const char *body, size_t len, char **text_p, kvs__api_err_t *err)
{
    static const char *const known[] = {"model", "tokens", NULL};
    json_t *root = small_body(body, len, known, lim, err);
    if (root == NULL) return err->status >= 500 ? KVS_ERR_NOMEM : KVS_ERR_INVALID;
    json_t *v = field(root, "tokens");
    kvs_status_t st = KVS_OK;
    kvs__sb_t raw, out;
    kvs__sb_init(&raw);
    kvs__sb_init(&out);
    if (!json_is_array(v)) {
        st = fail(err, 400, "tokens", NULL, "'tokens' must be an array of token ids");
        goto out;
    }
    for (size_t i = 0; i < json_array_size(v); i++) {
        json_t *e = json_array_get(v, i);
        json_int_t id = json_is_integer(e) ? json_integer_value(e) : -1;
        if (id < 0 || (uint64_t) id >= tok->vocab_size) {
            st = fail(err, 400, "tokens", NULL, "tokens[%zu] is not a token id below %u", i,
                      tok->vocab_size);
            goto out;
        }
        const char *piece;
        size_t n;
        if (tok->piece(tok->ctx, (uint32_t) id, &piece, &n) == KVS_OK)
            kvs__sb_append(&raw, piece, n);
    }
    kvs__utf8_sanitize(&out, raw.ptr ? raw.ptr : "", raw.len);
    char *text = kvs__sb_take(&out);
    if (raw.oom || text == NULL) {
        kvs_free(text);
        st = fail_nomem(err);
        goto out;
    }
    *text_p = text;
out:
    kvs__sb_fini(&raw);
    kvs__sb_fini(&out);
    json_decref(root);
    return st;
}
