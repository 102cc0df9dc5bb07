/* Tests for serve/model/sample.c: greedy ties and NaN, reproducibility, the drawn distribution
 * of temperature and top-p, and each knob on a logit vector where it changes the pick (or the
 * kept set) in a way that ignoring it, or applying it out of the documented order, would not:
 * logit bias, repetition, frequency and presence penalties (greedy too), top-k, min-p, and
 * the order bias < penalties < temperature < top-k/min-p < top-p. Also the parameter checks. */
#include "kvs_test.h"

#include <math.h>
#include <string.h>

#include "model/model.h"
#include "kvstage/rng.h"

#define V_MAX 64

static uint32_t g_counts[V_MAX]; /* the penalty scratch, all zero between calls */

/* One pick from a copy of l (kvs_sample rewrites its logits). */
static uint32_t pick(const float *l, uint32_t v, const kvs_sample_params_t *p,
                     const kvs_sample_history_t *h, kvs_rng_t *rng)
{
    float buf[V_MAX];
    assert_true(v <= V_MAX);
    memcpy(buf, l, v * sizeof(float));
    uint32_t t = kvs_sample(buf, v, p, h, rng);
    for (uint32_t i = 0; i < V_MAX; i++) assert_int_equal(g_counts[i], 0); /* left all zero */
    return t;
}

/* A history of prompt ids then generated ids. */
static kvs_sample_history_t history(const uint32_t *tokens, uint32_t len, uint32_t prompt_len)
{
    return (kvs_sample_history_t){
        .tokens = tokens, .len = len, .prompt_len = prompt_len, .counts = g_counts};
}

/* Draws many samples and checks each token's frequency against want (within 0.012). */
static void check_freq(const float *l, uint32_t v, kvs_sample_params_t p,
                       const kvs_sample_history_t *h, const double *want, uint64_t seed,
                       const char *what)
{
    kvs_rng_t rng;
    kvs_rng_seed(&rng, seed);
    const uint32_t draws = 40000;
    uint32_t count[V_MAX] = {0};
    for (uint32_t i = 0; i < draws; i++) {
        uint32_t t = pick(l, v, &p, h, &rng);
        assert_true(t < v);
        count[t]++;
    }
    for (uint32_t i = 0; i < v; i++) {
        const double f = (double) count[i] / draws;
        if (fabs(f - want[i]) > 0.012)
            fail_msg("%s: token %u drawn with frequency %.4f, want %.4f (seed %llu)", what, i, f,
                     want[i], (unsigned long long) seed);
    }
}

static void test_greedy(void **state)
{
    (void) state;
    const float ties[] = {1, 3, 3, 2, 3};
    assert_int_equal(pick(ties, 5, NULL, NULL, NULL), 1);
    kvs_sample_params_t greedy = {.temperature = 0, .top_p = 1};
    assert_int_equal(pick(ties, 5, &greedy, NULL, NULL), 1);
    const float with_nan[] = {NAN, 1, 2, NAN};
    assert_int_equal(pick(with_nan, 4, &greedy, NULL, NULL), 2);
    const float neg[] = {-5, -1, -INFINITY, -1.5f};
    assert_int_equal(pick(neg, 4, &greedy, NULL, NULL), 1);

    /* a tiny nucleus keeps only the most likely token */
    kvs_rng_t rng;
    kvs_rng_seed(&rng, kvs_test_seed(17));
    const float l[] = {0.5f, 2.0f, 1.9f, -1.0f, 1.99f};
    kvs_sample_params_t tiny = {.temperature = 1.0f, .top_p = 1e-6f};
    for (int i = 0; i < 200; i++) assert_int_equal(pick(l, 5, &tiny, NULL, &rng), 1);
    kvs_sample_params_t zero = {.temperature = 0.7f, .top_p = 0.0f};
    for (int i = 0; i < 50; i++) assert_int_equal(pick(l, 5, &zero, NULL, &rng), 1);
    /* greedy draws nothing */
    kvs_rng_t a, b;
    kvs_rng_seed(&a, 5);
    kvs_rng_seed(&b, 5);
    (void) pick(l, 5, &greedy, NULL, &a);
    assert_true(kvs_rng_next(&a) == kvs_rng_next(&b));
}

static void test_reproducible(void **state)
{
    (void) state;
    const uint64_t seed = kvs_test_seed(18);
    float l[50];
    kvs_rng_t g;
    kvs_rng_seed(&g, seed);
    for (int i = 0; i < 50; i++) l[i] = (float) ((double) (kvs_rng_next(&g) >> 40) * 0x1p-23 - 1);
    kvs_sample_params_t p = {.temperature = 1.5f, .top_p = 0.9f, .top_k = 30, .min_p = 0.05f};
    uint32_t a[64], b[64], c[64];
    kvs_rng_t r1, r2, r3;
    kvs_rng_seed(&r1, seed);
    kvs_rng_seed(&r2, seed);
    kvs_rng_seed(&r3, seed + 1);
    int differ = 0;
    for (int i = 0; i < 64; i++) {
        a[i] = pick(l, 50, &p, NULL, &r1);
        b[i] = pick(l, 50, &p, NULL, &r2);
        c[i] = pick(l, 50, &p, NULL, &r3);
        assert_true(a[i] < 50);
        differ |= a[i] != c[i];
    }
    assert_memory_equal(a, b, sizeof(a));
    assert_true(differ); /* another seed draws another sequence */
}

static void test_distribution(void **state)
{
    (void) state;
    const uint64_t seed = kvs_test_seed(19);
    const float l[4] = {logf(0.1f), logf(0.2f), logf(0.3f), logf(0.4f)};
    const double plain[4] = {0.1, 0.2, 0.3, 0.4};
    check_freq(l, 4, (kvs_sample_params_t){.temperature = 1, .top_p = 1}, NULL, plain, seed,
               "plain");
    /* top_p 0.5: {0.4} is not enough, {0.4, 0.3} is; renormalised */
    const double nucleus[4] = {0, 0, 3.0 / 7, 4.0 / 7};
    check_freq(l, 4, (kvs_sample_params_t){.temperature = 1, .top_p = 0.5f}, NULL, nucleus, seed,
               "top_p");
    /* temperature 2: p^(1/2) renormalised */
    double hot[4], z = 0;
    for (int i = 0; i < 4; i++) z += (hot[i] = sqrt(plain[i]));
    for (int i = 0; i < 4; i++) hot[i] /= z;
    check_freq(l, 4, (kvs_sample_params_t){.temperature = 2, .top_p = 1}, NULL, hot, seed,
               "temperature");
    /* tokens tied at the cut are all kept */
    const float flat[4] = {0, 0, 0, 0};
    const double quarter[4] = {0.25, 0.25, 0.25, 0.25};
    check_freq(flat, 4, (kvs_sample_params_t){.temperature = 1, .top_p = 0.3f}, NULL, quarter, seed,
               "ties");
    /* NaN is never drawn */
    const float nan_l[3] = {0, NAN, 0};
    const double halves[3] = {0.5, 0, 0.5};
    check_freq(nan_l, 3, (kvs_sample_params_t){.temperature = 1, .top_p = 1}, NULL, halves, seed,
               "NaN");
}

/* Greedy picks that move only when the knob acts as documented. */
static void test_bias_and_penalties(void **state)
{
    (void) state;
    const kvs_sample_params_t greedy = {.top_p = 1};
    kvs_sample_params_t p;

    /* logit bias: +1.5 lifts token 0 over token 1; -100 sinks the top token */
    const float l[3] = {1, 2, 0};
    const kvs_logit_bias_t up[1] = {{0, 1.5f}}, down[1] = {{1, -100}};
    p = greedy;
    p.bias = up;
    p.n_bias = 1;
    assert_int_equal(pick(l, 3, &p, NULL, NULL), 0);
    p.bias = down;
    assert_int_equal(pick(l, 3, &p, NULL, NULL), 0);
    assert_int_equal(pick(l, 3, &greedy, NULL, NULL), 1);

    /* frequency: per generated occurrence; the prompt does not count */
    const float f[3] = {3.0f, 2.5f, 0};
    const uint32_t twice[2] = {0, 0};
    kvs_sample_history_t gen2 = history(twice, 2, 0), prompt2 = history(twice, 2, 2);
    p = greedy;
    p.frequency_penalty = 0.3f; /* 3 - 2 * 0.3 = 2.4 < 2.5; once would leave 2.7 */
    assert_int_equal(pick(f, 3, &p, &gen2, NULL), 1);
    assert_int_equal(pick(f, 3, &p, &prompt2, NULL), 0);
    assert_int_equal(pick(f, 3, &p, NULL, NULL), 0); /* no history: nothing to penalise */
    p.frequency_penalty = -0.3f;                     /* negative: encourages */
    const float g[3] = {2.5f, 3.0f, 0};
    assert_int_equal(pick(g, 3, &p, &gen2, NULL), 0);

    /* presence: once per generated token, however often */
    const uint32_t thrice[4] = {2, 0, 0, 0};
    kvs_sample_history_t gen3 = history(thrice, 4, 1);
    p = greedy;
    p.presence_penalty = 0.3f; /* 2.7 > 2.5: still 0 (three times would be 2.1) */
    assert_int_equal(pick(f, 3, &p, &gen3, NULL), 0);
    p.presence_penalty = 0.6f; /* 2.4 < 2.5 */
    assert_int_equal(pick(f, 3, &p, &gen3, NULL), 1);
    assert_int_equal(pick(f, 3, &p, &prompt2, NULL), 0); /* the prompt does not count */

    /* repetition: prompt tokens too; positive logits divided, negative multiplied */
    const uint32_t zero[1] = {0};
    kvs_sample_history_t in_prompt = history(zero, 1, 1);
    p = greedy;
    p.repetition_penalty = 2;
    const float pos[2] = {3, 2}; /* 1.5 < 2 (multiplied: 6) */
    assert_int_equal(pick(pos, 2, &p, &in_prompt, NULL), 1);
    const float negl[2] = {-1, -1.5f}; /* -2 < -1.5 (divided: -0.5) */
    assert_int_equal(pick(negl, 2, &p, &in_prompt, NULL), 1);
    p.repetition_penalty = 1; /* off */
    assert_int_equal(pick(pos, 2, &p, &in_prompt, NULL), 0);

    /* order: the bias before the penalties. -1 + 2 = 1, then / 2 = 0.5 > 0.25 (penalty first:
     * -1 * 2 + 2 = 0 < 0.25) */
    const float o1[2] = {-1, 0.25f};
    const kvs_logit_bias_t plus2[1] = {{0, 2}};
    p = greedy;
    p.bias = plus2;
    p.n_bias = 1;
    p.repetition_penalty = 2;
    assert_int_equal(pick(o1, 2, &p, &in_prompt, NULL), 0);

    /* order: repetition before frequency. 3 / 2 - 1 = 0.5 < 0.75 (frequency first: 1) */
    const float o2[2] = {3, 0.75f};
    kvs_sample_history_t gen1 = history(zero, 1, 0);
    p = greedy;
    p.repetition_penalty = 2;
    p.frequency_penalty = 1;
    assert_int_equal(pick(o2, 2, &p, &gen1, NULL), 1);

    /* history tokens outside the vocabulary are skipped */
    const uint32_t wild[2] = {7, 0};
    kvs_sample_history_t w = history(wild, 2, 0);
    p = greedy;
    p.presence_penalty = 2;
    assert_int_equal(pick(pos, 2, &p, &w, NULL), 1);
}

/* The sampled filters and the order in which they act, seen in the kept distribution. */
static void test_filters_and_order(void **state)
{
    (void) state;
    const uint64_t seed = kvs_test_seed(20);
    const float l[4] = {logf(0.4f), logf(0.3f), logf(0.2f), logf(0.1f)};
    kvs_sample_params_t p = {.temperature = 1, .top_p = 1};

    /* top-k 2: the two most likely, renormalised; ties at the k-th are all kept */
    p.top_k = 2;
    const double k2[4] = {4.0 / 7, 3.0 / 7, 0, 0};
    check_freq(l, 4, p, NULL, k2, seed, "top_k 2");
    const float tied[4] = {0, 0, 0, -1};
    const double thirds[4] = {1.0 / 3, 1.0 / 3, 1.0 / 3, 0};
    check_freq(tied, 4, p, NULL, thirds, seed, "top_k ties");
    p.top_k = 9; /* more than the vocabulary: everything */
    const double plain[4] = {0.4, 0.3, 0.2, 0.1};
    check_freq(l, 4, p, NULL, plain, seed, "top_k 9");

    /* min-p 0.45: p >= 0.18 kept ({0.4, 0.3, 0.2}) */
    p = (kvs_sample_params_t){.temperature = 1, .top_p = 1, .min_p = 0.45f};
    const double m[4] = {0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9, 0};
    check_freq(l, 4, p, NULL, m, seed, "min_p");
    /* after the temperature: at T 2 the weights are sqrt(p), so min-p 0.6 keeps sqrt(p) >=
     * 0.6 sqrt(0.4), three tokens (before it, p >= 0.24: two) */
    p.temperature = 2;
    p.min_p = 0.6f;
    const double zt = sqrt(0.4) + sqrt(0.3) + sqrt(0.2);
    const double mt[4] = {sqrt(0.4) / zt, sqrt(0.3) / zt, sqrt(0.2) / zt, 0};
    check_freq(l, 4, p, NULL, mt, seed, "temperature, then min_p");

    /* top-k before top-p: after top-k 2, token 0 holds 4/7 >= 0.5 alone (top-p first would
     * keep {0, 1}) */
    p = (kvs_sample_params_t){.temperature = 1, .top_p = 0.5f, .top_k = 2};
    const double only0[4] = {1, 0, 0, 0};
    check_freq(l, 4, p, NULL, only0, seed, "top_k, then top_p");
    /* min-p before top-p: min-p 0.6 keeps {0.4, 0.3}; then 4/7 >= 0.55 alone */
    p = (kvs_sample_params_t){.temperature = 1, .top_p = 0.55f, .min_p = 0.6f};
    check_freq(l, 4, p, NULL, only0, seed, "min_p, then top_p");

    /* penalties before the temperature: 1 - 1 = 0 ties token 1, then / T changes nothing
     * (temperature first: 2 - 1 = 1 against 0, p0 = 0.73) */
    const float two[2] = {1, 0};
    const uint32_t zero[1] = {0};
    kvs_sample_history_t gen1 = history(zero, 1, 0);
    p = (kvs_sample_params_t){.temperature = 0.5f, .top_p = 1, .frequency_penalty = 1};
    const double half[2] = {0.5, 0.5};
    check_freq(two, 2, p, &gen1, half, seed, "penalty, then temperature");
    /* the bias before the temperature likewise: -1 + 1 = 0 ties token 1 */
    const kvs_logit_bias_t minus1[1] = {{0, -1}};
    p = (kvs_sample_params_t){.temperature = 0.5f, .top_p = 1, .bias = minus1, .n_bias = 1};
    check_freq(two, 2, p, NULL, half, seed, "bias, then temperature");
    /* the penalties before min-p: the penalised token falls below the cut */
    const float near[2] = {1, 0.9f};
    p = (kvs_sample_params_t){.temperature = 1, .top_p = 1, .min_p = 0.5f, .presence_penalty = 2};
    const double one1[2] = {0, 1};
    check_freq(near, 2, p, &gen1, one1, seed, "penalty, then min_p");
}

static void test_params_invalid(void **state)
{
    (void) state;
    const kvs_sample_params_t ok = {.temperature = 0.7f,
                                    .top_p = 0.9f,
                                    .top_k = 40,
                                    .min_p = 0.1f,
                                    .presence_penalty = -2,
                                    .frequency_penalty = 2,
                                    .repetition_penalty = 2};
    assert_null(kvs_sample_params_invalid(&ok, 10));
    const kvs_sample_params_t zero = {0};
    assert_null(kvs_sample_params_invalid(&zero, 10)); /* all off, greedy */
    struct {
        kvs_sample_params_t p;
        const char *names;
    } bad[] = {
        {{.temperature = -0.1f}, "temperature"},
        {{.temperature = INFINITY}, "temperature"},
        {{.temperature = NAN}, "temperature"},
        {{.top_p = 1.01f}, "top_p"},
        {{.top_p = -0.1f}, "top_p"},
        {{.min_p = 1.5f}, "min_p"},
        {{.min_p = NAN}, "min_p"},
        {{.presence_penalty = 2.01f}, "presence_penalty"},
        {{.frequency_penalty = -2.01f}, "frequency_penalty"},
        {{.repetition_penalty = 2.01f}, "repetition_penalty"},
        {{.repetition_penalty = -1}, "repetition_penalty"},
        {{.n_bias = 1}, "logit_bias"},
        {{.n_bias = KVS_SAMPLE_BIAS_LIMIT + 1}, "300"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        const char *why = kvs_sample_params_invalid(&bad[i].p, 10);
        if (why == NULL || strstr(why, bad[i].names) == NULL)
            fail_msg("case %zu: %s", i, why ? why : "accepted");
    }
    kvs_logit_bias_t b[1] = {{10, 1}};
    kvs_sample_params_t p = {.bias = b, .n_bias = 1};
    assert_non_null(strstr(kvs_sample_params_invalid(&p, 10), "vocabulary"));
    b[0] = (kvs_logit_bias_t){9, 100.5f};
    assert_non_null(strstr(kvs_sample_params_invalid(&p, 10), "[-100, 100]"));
    b[0] = (kvs_logit_bias_t){9, -100};
    assert_null(kvs_sample_params_invalid(&p, 10));
}

/* kvs_logprobs: log-softmax in double, the top N most likely first (lower id on ties), NaN as
 * -inf, -inf reported as the floor, N capped by the vocabulary and KVS_LOGPROBS_TOP_MAX. */
/* kvs_sample_at with the draw an rng would give picks what kvs_sample picks with that rng, for
 * every combination of filters; kvs_sample_on_device_ok refuses bias and penalties only. */
static void test_given_draw(void **state)
{
    (void) state;
    enum { V = 500 };
    float base[V], a[V], b[V];
    kvs_rng_t rng;
    kvs_rng_seed(&rng, 77);
    for (uint32_t i = 0; i < V; i++)
        base[i] = (float) ((double) kvs_rng_below(&rng, 10000) / 900.0);
    for (uint32_t k = 0; k < 300; k++) {
        kvs_sample_params_t p = {.temperature = (float) (k % 4) * 0.5f,
                                 .top_k = k % 3 == 0 ? 0 : k % 50,
                                 .top_p = k % 5 == 0 ? 1.0f : 0.3f + (float) (k % 7) * 0.1f,
                                 .min_p = k % 6 == 0 ? 0.1f : 0.0f};
        kvs_rng_t r1, r2;
        kvs_rng_seed(&r1, k);
        kvs_rng_seed(&r2, k);
        memcpy(a, base, sizeof(a));
        memcpy(b, base, sizeof(b));
        const uint32_t want = kvs_sample(a, V, &p, NULL, &r1);
        assert_int_equal(kvs_sample_at(b, V, &p, NULL, kvs_sample_draw(&r2)), want);
        assert_true(kvs_sample_on_device_ok(&p));
    }
    kvs_sample_params_t p = {.top_p = 1.0f, .repetition_penalty = 1.0f};
    assert_true(kvs_sample_on_device_ok(&p));
    p.repetition_penalty = 1.1f;
    assert_false(kvs_sample_on_device_ok(&p));
    p.repetition_penalty = 0;
    p.frequency_penalty = 0.1f;
    assert_false(kvs_sample_on_device_ok(&p));
    p.frequency_penalty = 0;
    kvs_logit_bias_t bias = {3, 1.0f};
    p.bias = &bias;
    p.n_bias = 1;
    assert_false(kvs_sample_on_device_ok(&p));
    assert_false(kvs_sample_on_device_ok(NULL));
}

static void test_logprobs(void **state)
{
    (void) state;
    const float l[6] = {1.0f, 3.0f, NAN, 3.0f, -INFINITY, 0.5f};
    kvs_logprobs_t lp;
    kvs_logprobs(l, 6, 0, 4, &lp);
    double lse = log(exp(1.0) + 2 * exp(3.0) + exp(0.5));
    assert_true(fabs(lp.logprob - (1.0 - lse)) < 1e-6);
    assert_int_equal(lp.n_top, 4);
    const uint32_t order[4] = {1, 3, 0, 5};
    for (int k = 0; k < 4; k++) {
        assert_int_equal(lp.top[k].token, order[k]);
        assert_true(fabs(lp.top[k].logprob - ((double) l[order[k]] - lse)) < 1e-6);
    }
    double total = 0;
    kvs_logprobs(l, 6, 2, 6, &lp);
    for (uint32_t k = 0; k < lp.n_top; k++)
        if (lp.top[k].logprob > KVS_LOGPROB_FLOOR) total += exp(lp.top[k].logprob);
    assert_true(fabs(total - 1.0) < 1e-6);
    assert_true(lp.logprob == KVS_LOGPROB_FLOOR); /* the NaN */
    assert_true(lp.top[5].logprob == KVS_LOGPROB_FLOOR);
    kvs_logprobs(l, 6, 4, 0, &lp);
    assert_true(lp.logprob == KVS_LOGPROB_FLOOR && lp.n_top == 0);
    static float flat[64];
    kvs_logprobs(flat, 64, 63, 99, &lp);
    assert_int_equal(lp.n_top, KVS_LOGPROBS_TOP_MAX);
    for (int k = 0; k < KVS_LOGPROBS_TOP_MAX; k++) assert_int_equal(lp.top[k].token, (uint32_t) k);
    assert_true(fabs(lp.logprob + log(64.0)) < 1e-6);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_greedy),
        cmocka_unit_test(test_reproducible),
        cmocka_unit_test(test_distribution),
        cmocka_unit_test(test_bias_and_penalties),
        cmocka_unit_test(test_filters_and_order),
        cmocka_unit_test(test_params_invalid),
        cmocka_unit_test(test_logprobs),
        cmocka_unit_test(test_given_draw),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
