/* `kvstage prefill` and `kvstage decode`: run one rank of a deployment as this process (see
 * sim/rank.h). Every rank of both instances must be given the same deployment and
 * workload flags; the prefill instance's registry endpoint ties them together. */
#include "cmd/commands.h"

#include <signal.h>
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
    kvs_json_u64(&j, "chunks", r->metrics.chunks);
    kvs_json_u64(&j, "bulk_writes", r->metrics.bulk_writes);
    kvs_json_u64(&j, "direct_writes", r->metrics.direct_writes);
    kvs_json_u64(&j, "bytes_moved", r->metrics.bytes);
    kvs_json_u64(&j, "control_messages", r->metrics.msgs_sent);
    kvs_json_u64(&j, "retries", r->metrics.retries);
    kvs_json_u64(&j, "rejected_messages", r->metrics.rejected + r->net.rejected);
    kvs_json_u64(&j, "ignored_messages", r->metrics.ignored);
    kvs_json_u64(&j, "ring_high_water", r->metrics.ring_high_water);
    kvs_json_u64(&j, "dead_peers", r->net.dead_peers);
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
    fprintf(stderr,
            "metrics: rooms added %llu succeeded %llu failed %llu live %llu; chunks %llu; bulk "
            "writes %llu; bytes %llu; messages sent %llu received %llu; retries %llu; rejected "
            "%llu (link %llu); ignored %llu; ring used %llu of %llu (high water %llu), live "
            "slots %llu; dead peers %llu\n",
            (unsigned long long) m->rooms_added, (unsigned long long) m->rooms_succeeded,
            (unsigned long long) m->rooms_failed, (unsigned long long) m->live_rooms,
            (unsigned long long) m->chunks, (unsigned long long) m->bulk_writes,
            (unsigned long long) m->bytes, (unsigned long long) m->msgs_sent,
            (unsigned long long) m->msgs_received, (unsigned long long) m->retries,
            (unsigned long long) m->rejected, (unsigned long long) n->rejected,
            (unsigned long long) m->ignored, (unsigned long long) m->ring_used,
            (unsigned long long) m->ring_capacity, (unsigned long long) m->ring_high_water,
            (unsigned long long) m->live_slots, (unsigned long long) n->dead_peers);
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
    if (f.progress) f.cfg.progress = print_progress;
    signal(SIGUSR1, on_sigusr1);
    f.cfg.metrics_request = &metrics_wanted;
    f.cfg.metrics = print_metrics;
    kvs_rank_result_t r;
    kvs_status_t st = kvs_rank_run(&f.cfg, &r);
    if (st != KVS_OK) {
        fprintf(stderr, "error: %s rank %u could not run: %s\n",
                side == KVS_SIDE_PREFILL ? "prefill" : "decode", f.cfg.rank, kvs_status_str(st));
        return 1;
    }
    int ok = kvs_rank_result_ok(&r);
    if (f.json) {
        print_json(&f.cfg, &r, ok);
    } else {
        printf("%s rank %u: %u/%u rooms succeeded, %u failed, %s, leaks: pages %llu slots %llu "
               "rooms %llu, %.2f s\n",
               side == KVS_SIDE_PREFILL ? "prefill" : "decode", f.cfg.rank, r.succeeded, r.requests,
               r.failed, r.mismatched_bytes || r.meta_mismatches ? "NOT exact" : "exact",
               (unsigned long long) r.leaked_pages, (unsigned long long) r.leaked_slots,
               (unsigned long long) r.leaked_rooms, r.wall_s);
    }
    return ok ? 0 : 1;
}

int kvs_cmd_prefill(int argc, char **argv)
{
    return run_side(KVS_SIDE_PREFILL, argc, argv);
}

int kvs_cmd_decode(int argc, char **argv)
{
    return run_side(KVS_SIDE_DECODE, argc, argv);
}
