/* Token sampling: greedy, or temperature with a nucleus (top-p) cut. The nucleus is found
 * without sorting or allocating: it is always {i : logits[i] >= cut} for some logit value cut,
 * and the mass above a cut only shrinks as the cut rises, so a binary search over the float
 * values (in their order-preserving integer encoding) finds the highest cut that still holds
 * top_p of the mass. */
#include <math.h>
#include <string.h>

#include "model/model.h"

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

/* Mass of the tokens with logit >= cut, summed in id order; stops early once it reaches
 * stop (pass INFINITY for the whole sum). NaN logits never count. */
static double mass_above(const float *logits, uint32_t vocab, float cut, float max, double inv_temp,
                         double stop)
{
    double sum = 0;
    for (uint32_t i = 0; i < vocab && sum < stop; i++)
        if (logits[i] >= cut) sum += weight(logits[i], max, inv_temp);
    return sum;
}

/* Uniform double in [0, 1). */
static double uniform01(kvs_rng_t *rng)
{
    return (double) (kvs_rng_next(rng) >> 11) * 0x1p-53;
}

uint32_t kvs_sample(const float *logits, uint32_t vocab, const kvs_sample_params_t *params,
                    kvs_rng_t *rng)
{
    if (logits == NULL || vocab == 0) return 0;
    const uint32_t best = argmax(logits, vocab);
    if (params == NULL || !(params->temperature > 0.0f) || rng == NULL) return best;
    const float max = logits[best];
    if (!isfinite(max)) return best; /* all NaN, or a +inf logit: nothing to weigh */
    const double inv_temp = 1.0 / params->temperature;

    float cut = -INFINITY;
    if (!(params->top_p >= 1.0f)) {
        const double total = mass_above(logits, vocab, -INFINITY, max, inv_temp, INFINITY);
        const double target = params->top_p > 0.0f ? params->top_p * total : 0.0;
        /* Invariant: the cut encoded by lo keeps at least target; the top logit alone is a
         * valid answer when target is tiny. */
        uint32_t lo = float_key(-INFINITY), hi = float_key(max);
        while (lo < hi) {
            const uint32_t mid = lo + (hi - lo + 1) / 2;
            if (mass_above(logits, vocab, key_float(mid), max, inv_temp, target) >= target)
                lo = mid;
            else
                hi = mid - 1;
        }
        cut = key_float(lo);
    }

    const double kept = mass_above(logits, vocab, cut, max, inv_temp, INFINITY);
    const double r = uniform01(rng) * kept;
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
