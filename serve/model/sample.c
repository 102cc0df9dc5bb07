/* Token sampling as OpenAI and vLLM clients expect, in one fixed order:
 *   1. logit bias   logits[id] += bias, for each entry.
 *   2. penalties    repetition (vLLM) over every token of the history, prompt included: a
 *                   positive logit is divided by it, a negative one multiplied; then frequency
 *                   and presence (OpenAI) over the generated tokens only: logit -= count *
 *                   frequency + presence.
 *   3. temperature  0: greedy, the argmax of the biased, penalised logits (4-7 cannot move the
 *                   argmax and are skipped); otherwise weights exp((logit - max) / temperature).
 *   4. top-k        keeps the k largest logits.
 *   5. min-p        keeps the weights >= min_p (the top token weighs 1).
 *   6. top-p        keeps the smallest set of the most likely survivors holding top_p of the
 *                   survivors' mass.
 *   7. draw         one uniform double from rng (or given: kvs_sample_at), walked over the kept
 *                   weights in id order.
 * Each of 4-6 keeps {i : logits[i] >= cut} for some logit value cut (the weights rise with the
 * logit), so they compose by raising one cut in turn, and tokens tied at a cut are all kept.
 * A cut is found without sorting or allocating: the count (top-k) or mass (top-p) above a cut
 * only shrinks as the cut rises, so a binary search over the float values (in their
 * order-preserving integer encoding) finds the highest cut that still holds enough. */
#include <math.h>
#include <string.h>

#include "model/model.h"

const char *kvs_sample_params_invalid(const kvs_sample_params_t *p, uint32_t vocab)
{
    const float pen = KVS_SAMPLE_PENALTY_MAX;
    if (!(p->temperature >= 0) || isinf(p->temperature))
        return "temperature must be finite and >= 0";
    if (!(p->top_p >= 0 && p->top_p <= 1)) return "top_p must be in [0, 1]";
    if (!(p->min_p >= 0 && p->min_p <= 1)) return "min_p must be in [0, 1]";
    if (!(fabsf(p->presence_penalty) <= pen)) return "presence_penalty must be in [-2, 2]";
    if (!(fabsf(p->frequency_penalty) <= pen)) return "frequency_penalty must be in [-2, 2]";
    if (!(p->repetition_penalty >= 0 && p->repetition_penalty <= pen))
        return "repetition_penalty must be in (0, 2] (0: off)";
    if (p->n_bias > KVS_SAMPLE_BIAS_LIMIT) return "logit_bias has more than 300 entries";
    if (p->n_bias > 0 && p->bias == NULL) return "logit_bias entries missing";
    for (uint32_t i = 0; i < p->n_bias; i++) {
        if (p->bias[i].token >= vocab) return "a logit_bias token is outside the vocabulary";
        if (!(fabsf(p->bias[i].bias) <= KVS_SAMPLE_BIAS_MAX))
            return "a logit_bias value must be in [-100, 100]";
    }
    return NULL;
}

/* Lowest id among the largest non-NaN logits; 0 when every logit is NaN. */
static uint32_t argmax(const float *logits, uint32_t vocab)
{
    uint32_t best = UINT32_MAX;
    for (uint32_t i = 0; i < vocab; i++) {
        if (isnan(logits[i])) continue;
        if (best == UINT32_MAX || logits[i] > logits[best]) best = i;
    }
    return best == UINT32_MAX ? 0 : best;
}

/* Steps 1 and 2. The counts scratch holds, per token of the history, a seen bit and the
 * number of generated occurrences; the second walk applies each token's penalties once and
 * clears its count. */
static void bias_and_penalise(float *logits, uint32_t vocab, const kvs_sample_params_t *p,
                              const kvs_sample_history_t *h)
{
    for (uint32_t i = 0; i < p->n_bias; i++)
        if (p->bias[i].token < vocab) logits[p->bias[i].token] += p->bias[i].bias;
    const float rep = p->repetition_penalty;
    const int repeat = rep > 0 && rep != 1;
    if (h == NULL || h->counts == NULL ||
        !(repeat || p->presence_penalty != 0 || p->frequency_penalty != 0))
        return;
    const uint32_t seen = 0x80000000u;
    uint32_t *c = h->counts;
    for (uint32_t i = 0; i < h->len; i++) {
        const uint32_t t = h->tokens[i];
        if (t < vocab) c[t] = (c[t] | seen) + (i >= h->prompt_len);
    }
    for (uint32_t i = 0; i < h->len; i++) {
        const uint32_t t = h->tokens[i];
        if (t >= vocab || c[t] == 0) continue;
        float l = logits[t];
        if (repeat) l = l > 0 ? l / rep : l * rep;
        const uint32_t n = c[t] & ~seen;
        if (n > 0) l -= (float) n * p->frequency_penalty + p->presence_penalty;
        logits[t] = l;
        c[t] = 0;
    }
}

/* An encoding of floats as unsigned integers that keeps their order (-0 just below +0). */
static uint32_t float_key(float f)
{
    uint32_t b;
    memcpy(&b, &f, sizeof(b));
    return (b & 0x80000000u) ? ~b : b | 0x80000000u;
}

static float key_float(uint32_t k)
{
    uint32_t b = (k & 0x80000000u) ? k & 0x7fffffffu : ~k;
    float f;
    memcpy(&f, &b, sizeof(f));
    return f;
}

/* Unnormalised probability of a logit: exp((logit - max) / temperature), in (0, 1]. */
static inline double weight(float logit, float max, double inv_temp)
{
    return exp(((double) logit - (double) max) * inv_temp);
}

/* The tokens with logit >= cut, summed in id order: their count (by_count) or their mass;
 * stops early once the sum reaches stop (pass INFINITY for the whole sum). NaN logits never
 * count. */
static double sum_above(const float *logits, uint32_t vocab, float cut, float max, double inv_temp,
                        int by_count, double stop)
{
    double sum = 0;
    for (uint32_t i = 0; i < vocab && sum < stop; i++)
        if (logits[i] >= cut) sum += by_count ? 1.0 : weight(logits[i], max, inv_temp);
    return sum;
}

/* The highest cut in [low, max] whose sum above still reaches target; the sum above low
 * must reach it. */
static float highest_cut(const float *logits, uint32_t vocab, float low, float max, double inv_temp,
                         int by_count, double target)
{
    uint32_t lo = float_key(low), hi = float_key(max);
    while (lo < hi) {
        const uint32_t mid = lo + (hi - lo + 1) / 2;
        if (sum_above(logits, vocab, key_float(mid), max, inv_temp, by_count, target) >= target)
            lo = mid;
        else
            hi = mid - 1;
    }
    return key_float(lo);
}

/* Uniform double in [0, 1). */
static double uniform01(kvs_rng_t *rng)
{
    return (double) (kvs_rng_next(rng) >> 11) * 0x1p-53;
}

int kvs_sample_on_device_ok(const kvs_sample_params_t *p)
{
    return p != NULL && p->n_bias == 0 && p->presence_penalty == 0 && p->frequency_penalty == 0 &&
           (p->repetition_penalty == 0 || p->repetition_penalty == 1);
}

double kvs_sample_draw(kvs_rng_t *rng)
{
    return uniform01(rng);
}

/* kvs_sample with its draw given (u < 0: greedy whatever the temperature). */
static uint32_t sample_with(float *logits, uint32_t vocab, const kvs_sample_params_t *params,
                            const kvs_sample_history_t *history, kvs_rng_t *rng, double u)
{
    if (logits == NULL || vocab == 0) return 0;
    if (params != NULL) bias_and_penalise(logits, vocab, params, history);
    const uint32_t best = argmax(logits, vocab);
    if (params == NULL || !(params->temperature > 0.0f) || (rng == NULL && u < 0)) return best;
    const float max = logits[best];
    if (!isfinite(max)) return best; /* all NaN, or a +inf logit: nothing to weigh */
    const double inv_temp = 1.0 / params->temperature;

    float cut = -INFINITY;
    if (params->top_k > 0 &&
        sum_above(logits, vocab, cut, max, inv_temp, 1, INFINITY) > params->top_k)
        cut = highest_cut(logits, vocab, cut, max, inv_temp, 1, params->top_k);
    if (params->min_p > 0) {
        float low = max; /* the lowest logit whose weight reaches min_p: the top's does */
        for (uint32_t i = 0; i < vocab; i++)
            if (logits[i] >= cut && logits[i] < low &&
                weight(logits[i], max, inv_temp) >= params->min_p)
                low = logits[i];
        cut = low;
    }
    if (!(params->top_p >= 1.0f)) {
        const double total = sum_above(logits, vocab, cut, max, inv_temp, 0, INFINITY);
        /* A tiny target keeps the top logit alone. */
        const double target = params->top_p > 0.0f ? params->top_p * total : 0.0;
        cut = highest_cut(logits, vocab, cut, max, inv_temp, 0, target);
    }

    const double kept = sum_above(logits, vocab, cut, max, inv_temp, 0, INFINITY);
    const double r = (rng != NULL ? uniform01(rng) : u) * kept;
    double acc = 0;
    uint32_t last = best;
    for (uint32_t i = 0; i < vocab; i++) {
        if (!(logits[i] >= cut)) continue;
        acc += weight(logits[i], max, inv_temp);
        last = i;
        if (r < acc) return i;
    }
    return last; /* r landed on the rounding error at the very top */
}

uint32_t kvs_sample(float *logits, uint32_t vocab, const kvs_sample_params_t *params,
                    const kvs_sample_history_t *history, kvs_rng_t *rng)
{
    return sample_with(logits, vocab, params, history, rng, -1.0);
}

uint32_t kvs_sample_at(float *logits, uint32_t vocab, const kvs_sample_params_t *params,
                       const kvs_sample_history_t *history, double u)
{
    return sample_with(logits, vocab, params, history, NULL, u);
}

/* A before b in a top list: larger, or equal with the lower id. */
static int ranks_before(float la, uint32_t a, float lb, uint32_t b)
{
    return la > lb || (la == lb && a < b);
}

/* logit - lse, or KVS_LOGPROB_FLOOR when that is not a finite number. */
static float floored(float logit, double lse)
{
    double v = (double) logit - lse;
    return isfinite(v) && v > KVS_LOGPROB_FLOOR ? (float) v : KVS_LOGPROB_FLOOR;
}

void kvs_logprobs(const float *logits, uint32_t vocab, uint32_t token, uint32_t n_top,
                  kvs_logprobs_t *out_p)
{
    kvs_logprobs_t out;
    memset(&out, 0, sizeof(out));
    if (n_top > KVS_LOGPROBS_TOP_MAX) n_top = KVS_LOGPROBS_TOP_MAX;
    if (n_top > vocab) n_top = vocab;
    /* log-sum-exp around the maximum; NaN is -inf */
    double max = -INFINITY;
    for (uint32_t i = 0; i < vocab; i++)
        if (logits[i] > max) max = logits[i];
    double sum = 0;
    if (isfinite(max))
        for (uint32_t i = 0; i < vocab; i++)
            if (logits[i] > -INFINITY) sum += exp((double) logits[i] - max);
    const double lse = isfinite(max) ? max + log(sum) : max;
    /* The n_top largest, by insertion into a short sorted list. */
    uint32_t n = 0;
    for (uint32_t i = 0; i < vocab && n_top > 0; i++) {
        float l = isnan(logits[i]) ? -INFINITY : logits[i];
        if (n == n_top && !ranks_before(l, i, out.top[n - 1].logprob, out.top[n - 1].token))
            continue;
        uint32_t at = n < n_top ? n++ : n - 1;
        while (at > 0 && ranks_before(l, i, out.top[at - 1].logprob, out.top[at - 1].token)) {
            out.top[at] = out.top[at - 1];
            at--;
        }
        out.top[at] = (kvs_token_logprob_t){.token = i, .logprob = l};
    }
    for (uint32_t k = 0; k < n; k++) out.top[k].logprob = floored(out.top[k].logprob, lse);
    out.n_top = n;
    out.logprob = floored(token < vocab ? logits[token] : NAN, lse);
    *out_p = out;
}
