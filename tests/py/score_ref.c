/* The reference the openai test scores a text against: the default model's log-probability of
 * each token of a prompt given the tokens before it, straight from the model (one position per
 * forward pass, each position's logits as a last token, log-softmax written out here), so no part
 * of the serving path (prefill chunks, the all-positions lm-head, kvs_logprobs) is involved.
 *
 *   kvs_score_ref ID_0 ID_1 ... ID_N-1   prints N-1 lines: log p(ID_i | ID_0..ID_i-1), i >= 1 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "kvstage/alloc.h"
#include "model/gguf.h"
#include "model/model.h"

int main(int argc, char **argv)
{
    int n = argc - 1;
    if (n < 2) {
        fprintf(stderr, "usage: kvs_score_ref ID_0 ID_1 ... (at least two token ids)\n");
        return 2;
    }
    char path[4096];
    kvs_gguf_t *g = NULL;
    kvs_model_t *m = NULL;
    if (kvs_model_default_path(path, sizeof(path)) != KVS_OK || kvs_gguf_open(path, &g) != KVS_OK ||
        kvs_model_load(g, (kvs_tp_t){1, 0}, &m) != KVS_OK)
        return 1;
    kvs_gguf_close(g);
    const kvs_model_config_t *c = kvs_model_config(m);
    const uint32_t P = 16, pages_n = ((uint32_t) n + P - 1) / P;
    kvs_pool_config_t pc = {.shape = kvs_model_kv_shape(m),
                            .tp = kvs_model_tp(m),
                            .page_size = P,
                            .num_pages = pages_n,
                            .layout = KVS_POOL_HND,
                            .mem = KVS_MEM_HOST};
    kvs_pool_t *pool = NULL;
    uint32_t *ids = malloc((size_t) n * sizeof(uint32_t)), *pages = malloc(pages_n * 4);
    float *logits = malloc((size_t) c->vocab * sizeof(float));
    if (ids == NULL || pages == NULL || logits == NULL || kvs_pool_create(&pc, &pool) != KVS_OK ||
        kvs_pool_alloc(pool, pages_n, pages) != KVS_OK)
        return 1;
    for (int i = 0; i < n; i++) {
        long v = strtol(argv[i + 1], NULL, 10);
        if (v < 0 || (uint32_t) v >= c->vocab) {
            fprintf(stderr, "kvs_score_ref: %s is not a token id below %u\n", argv[i + 1],
                    c->vocab);
            return 2;
        }
        ids[i] = (uint32_t) v;
    }
    for (int at = 0; at + 1 < n; at++) {
        kvs_model_seq_t s = {
            .tokens = ids + at, .n = 1, .pos0 = (uint32_t) at, .pages = pages, .npages = pages_n};
        if (kvs_model_forward(m, pool, &s, 1, NULL, NULL, logits) != KVS_OK) return 1;
        double max = logits[0], sum = 0;
        for (uint32_t i = 1; i < c->vocab; i++)
            if (logits[i] > max) max = logits[i];
        for (uint32_t i = 0; i < c->vocab; i++) sum += exp((double) logits[i] - max);
        printf("%.9g\n", (double) logits[ids[at + 1]] - max - log(sum));
    }
    kvs_pool_destroy(pool);
    kvs_model_destroy(m);
    free(ids);
    free(pages);
    free(logits);
    return 0;
}
