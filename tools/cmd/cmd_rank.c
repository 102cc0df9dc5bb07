/* `kvstage prefill` and `kvstage decode`: run one rank of a deployment as this process (see
 * sim/rank.h). Every rank of both instances must be given the same deployment and
 * workload flags; the prefill instance's registry endpoint ties them together. */
#include "cmd/commands.h"

#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "common/args.h"
#include "common/json.h"
#include "kvstage/log.h"
#include "sim/rank.h"
#include "common/rank_flags.h"

static void print_json(const kvs_rank_config_t *c, const kvs_rank_result_t *r, int ok)
{
    kvs_json_t j;
    kvs_json_begin(&j, stdout);
    kvs_json_bool(&j, "ok", ok);
    kvs_json_str(&j, "side", c->side == KVS_SIDE_PREFILL ? "prefill" : "decode");
    kvs_json_u64(&j, "rank", c->rank);
    kvs_json_u64(&j, "requests", r->requests);
    kvs_json_u64(&j, "succeeded", r->succeeded);
    kvs_json_u64(&j, "failed", r->failed);
    kvs_json_bool(&j, "exact", r->mismatched_bytes == 0 && r->meta_mismatches == 0);
    kvs_json_u64(&j, "mismatched_bytes", r->mismatched_bytes);
    kvs_json_u64(&j, "meta_mismatches", r->meta_mismatches);
    kvs_json_u64(&j, "leaked_slots", r->leaked_slots);
    kvs_json_u64(&j, "leaked_pages", r->leaked_pages);
    kvs_json_u64(&j, "leaked_rooms", r->leaked_rooms);
    /* The messages rejected are the protocol's and the link's together. */
    kvs_pd_metrics_t m = r->metrics;
    m.rejected += r->net.rejected;
    uint32_t nf;
    const kvs_pd_metric_field_t *f = kvs_pd_metrics_fields(&nf);
    for (uint32_t i = 0; i < nf; i++)
        if (f[i].json != NULL) kvs_json_u64(&j, f[i].json, kvs_pd_metrics_get(&m, &f[i]));
    kvs_json_u64(&j, "dead_peers", r->net.dead_peers);
    kvs_json_u64(&j, "corrupt_injected", r->net.corrupted);
    kvs_json_bool(&j, "timed_out", r->timed_out);
    kvs_json_double(&j, "wall_s", r->wall_s);
    kvs_json_end(&j);
}

static void print_progress(void *arg, uint32_t concluded, uint32_t requests)
{
    (void) arg;
    printf("progress %u %u\n", concluded, requests);
    fflush(stdout);
}

static volatile int metrics_wanted;

static void on_sigusr1(int sig)
{
    (void) sig;
    metrics_wanted = 1;
}

/* `kill -USR1 <pid>` prints the rank's counters on stderr. */
static void print_metrics(void *arg, const kvs_pd_metrics_t *m, const kvs_net_stats_t *n)
{
    (void) arg;
    char line[1024];
    size_t len = (size_t) snprintf(line, sizeof(line), "metrics: ");
    uint32_t nf;
    const kvs_pd_metric_field_t *f = kvs_pd_metrics_fields(&nf);
    for (uint32_t i = 0; i < nf && len < sizeof(line); i++) {
        if (f[i].text == NULL) continue;
        len += (size_t) snprintf(line + len, sizeof(line) - len, "%s%llu", f[i].text,
                                 (unsigned long long) kvs_pd_metrics_get(m, &f[i]));
        /* The link's rejections go with the protocol's. */
        if (len < sizeof(line) && f[i].offset == offsetof(kvs_pd_metrics_t, rejected))
            len += (size_t) snprintf(line + len, sizeof(line) - len, " (link %llu)",
                                     (unsigned long long) n->rejected);
    }
    if (len < sizeof(line))
        snprintf(line + len, sizeof(line) - len, "; dead peers %llu\n",
                 (unsigned long long) n->dead_peers);
    fputs(line, stderr);
}

static const char *side_name(kvs_side_t side)
{
    return side == KVS_SIDE_PREFILL ? "prefill" : "decode";
}

static void print_text(const kvs_rank_config_t *c, const kvs_rank_result_t *r)
{
    printf("%s rank %u: %u/%u rooms succeeded, %u failed, %s, leaks: pages %llu slots %llu "
           "rooms %llu, %.2f s\n",
           side_name(c->side), c->rank, r->succeeded, r->requests, r->failed,
           r->mismatched_bytes || r->meta_mismatches ? "NOT exact" : "exact",
           (unsigned long long) r->leaked_pages, (unsigned long long) r->leaked_slots,
           (unsigned long long) r->leaked_rooms, r->wall_s);
}

/* Runs the rank and prints its result; the exit code: 0 when kvs_rank_result_ok. */
static int rank_run(const kvs_rank_config_t *c, int json)
{
    kvs_rank_result_t r;
    kvs_status_t st = kvs_rank_run(c, &r);
    if (st != KVS_OK) {
        fprintf(stderr, "error: %s rank %u could not run: %s\n", side_name(c->side), c->rank,
                kvs_status_str(st));
        /* A configuration that can never run is a usage error, as in `kvstage sim`. */
        return st == KVS_ERR_INVALID ? 2 : 1;
    }
    int ok = kvs_rank_result_ok(&r);
    if (json)
        print_json(c, &r, ok);
    else
        print_text(c, &r);
    return ok ? 0 : 1;
}

static int run_side(kvs_side_t side, int argc, char **argv)
{
    kvs_rank_flags_t f;
    kvs_rank_flags_default(&f);
    f.cfg.side = side;
    const char *usage = side == KVS_SIDE_PREFILL ? "kvstage prefill --rank N --registry EP [flags]"
                                                 : "kvstage decode --rank N --registry EP [flags]";
    int rc = kvs_rank_flags_parse(&f, usage, argc, argv);
    if (rc != KVS_ARGS_OK) return rc == KVS_ARGS_HELP ? 0 : 2;
    if (kvs_rank_flags_check(&f, side == KVS_SIDE_PREFILL ? "prefill" : "decode") != 0) return 2;
    if (f.progress) f.cfg.progress = print_progress;
    signal(SIGUSR1, on_sigusr1);
    f.cfg.metrics_request = &metrics_wanted;
    f.cfg.metrics = print_metrics;
    return rank_run(&f.cfg, f.json);
}

int kvs_cmd_prefill(int argc, char **argv)
{
    return run_side(KVS_SIDE_PREFILL, argc, argv);
}

int kvs_cmd_decode(int argc, char **argv)
{
    return run_side(KVS_SIDE_DECODE, argc, argv);
}
