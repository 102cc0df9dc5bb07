/* Launching one real-model instance's rank processes (instance.h). */
#include "common/instance.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/args.h"
#include "kvstage/clock.h"
#include "common/spawn.h"
#include "engine/llm_rank.h"
#include "model/tpgroup.h"

int kvs_parse_seeded(const char *s, kvs_model_config_t *cfg_p)
{
    unsigned long v[7];
    int n = 0;
    for (const char *p = s;;) {
        if (n == 7 || *p < '0' || *p > '9') return -1;
        char *end;
        errno = 0;
        v[n++] = strtoul(p, &end, 10);
        if (errno != 0 || v[n - 1] == 0 || v[n - 1] > (1ul << 22)) return -1;
        if (*end == '\0') break;
        if (*end != ',') return -1;
        p = end + 1;
    }
    if (n != 7) return -1;
    *cfg_p = (kvs_model_config_t){.layers = (uint32_t) v[0],
                                  .dim = (uint32_t) v[1],
                                  .ffn_dim = (uint32_t) v[2],
                                  .heads = (uint32_t) v[3],
                                  .kv_heads = (uint32_t) v[4],
                                  .head_dim = (uint32_t) v[5],
                                  .vocab = (uint32_t) v[6],
                                  .max_ctx = 4096,
                                  .rope_theta = 10000.0f,
                                  .norm_eps = 1e-5f};
    return 0;
}

/* kvs_model_config_validate for TP tp; its reason into cap. */
static kvs_status_t tp_validate(const kvs_model_config_t *mc, uint32_t tp, kvs_args_capture_t *cap)
{
    kvs_args_capture_begin(cap);
    kvs_status_t st = kvs_model_config_validate(mc, (kvs_tp_t){tp, 0});
    kvs_args_capture_end(cap, 1);
    return st;
}

int kvs_model_tp_check(const kvs_model_config_t *mc, const char *flag, uint32_t tp)
{
    kvs_args_capture_t cap;
    if (tp_validate(mc, tp, &cap) == KVS_OK) return 0;
    char why[sizeof(cap.msg)];
    snprintf(why, sizeof(why), "%s", cap.msg);
    char sizes[512];
    size_t n = 0;
    sizes[0] = '\0';
    for (uint32_t t = 1; t <= KVS_MAX_TP && n < sizeof(sizes); t++)
        if (tp_validate(mc, t, &cap) == KVS_OK)
            n += (size_t) snprintf(sizes + n, sizeof(sizes) - n, "%s%u", n ? ", " : "", t);
    if (n < sizeof(sizes))
        snprintf(sizes + n, sizeof(sizes) - n,
                 " (a TP size must divide the %u query heads and the ffn width %u, and divide "
                 "the %u KV heads or be a multiple of them)",
                 mc->heads, mc->ffn_dim, mc->kv_heads);
    return kvs_args_error(flag, sizes, "%u does not split this model: %s", tp, why);
}

int kvs_check_context_flags(uint32_t *max_model_len_p, uint64_t kv_tokens, uint32_t page_size,
                            uint32_t model_ctx)
{
    uint32_t len = *max_model_len_p ? *max_model_len_p : model_ctx;
    if (len < 2 || len > model_ctx) {
        char acc[32];
        snprintf(acc, sizeof(acc), "[2,%u]", model_ctx);
        return kvs_args_error("--max-model-len", acc, "%u is outside the model's context length",
                              len);
    }
    if (kv_tokens != 0 && page_size != 0 &&
        (kv_tokens < len || kvs_llm_rank_pool_pages(kv_tokens, len, page_size) > UINT32_MAX)) {
        char acc[64];
        snprintf(acc, sizeof(acc), "[%u,%llu]", len, (unsigned long long) UINT32_MAX * page_size);
        return kvs_args_error("--kv-tokens", acc,
                              "%llu cannot hold one request of the whole context (--max-model-len "
                              "%u) in pages of %u tokens",
                              (unsigned long long) kv_tokens, len, page_size);
    }
    *max_model_len_p = len;
    return 0;
}

static const char *role_name(kvs_llm_role_t r)
{
    return r == KVS_LLM_PREFILL ? "prefill" : r == KVS_LLM_DECODE ? "decode" : "colocated";
}

static int spawn_rank(const kvs_instance_config_t *c, kvs_instance_t *inst, uint32_t rank)
{
    char num[13][24];
    char *args[64];
    int n = 0;
    const int pd = c->role != KVS_LLM_COLOCATED;
    const uint32_t ptp = c->role == KVS_LLM_DECODE ? c->peer_tp : c->tp;
    const uint32_t dtp = c->role == KVS_LLM_PREFILL ? c->peer_tp : c->tp;
    args[n++] = "kvstage";
    args[n++] = "llm-rank";
    args[n++] = "--role";
    args[n++] = (char *) role_name(c->role);
    args[n++] = "--rank";
    snprintf(num[0], sizeof(num[0]), "%u", rank);
    args[n++] = num[0];
    args[n++] = "--prefill-tp";
    snprintf(num[1], sizeof(num[1]), "%u", ptp);
    args[n++] = num[1];
    args[n++] = "--decode-tp";
    snprintf(num[2], sizeof(num[2]), "%u", dtp);
    args[n++] = num[2];
    if (c->seeded != NULL) {
        args[n++] = "--seeded";
        args[n++] = (char *) c->seeded;
        args[n++] = "--model-seed";
        snprintf(num[3], sizeof(num[3]), "%llu", (unsigned long long) c->model_seed);
        args[n++] = num[3];
    } else {
        args[n++] = "--model";
        args[n++] = (char *) c->model_path;
    }
    const struct {
        const char *flag;
        uint64_t v;
    } u[] = {{"--page-size", c->page_size},
             {"--chunk", c->chunk},
             {"--max-running", c->max_running},
             {"--max-model-len", c->max_context},
             {"--kv-tokens", c->kv_tokens}};
    for (int i = 0; i < 5; i++) {
        if (u[i].v == 0) continue; /* the rank's default */
        args[n++] = (char *) u[i].flag;
        snprintf(num[4 + i], sizeof(num[4 + i]), "%llu", (unsigned long long) u[i].v);
        args[n++] = num[4 + i];
    }
    args[n++] = "--radix";
    args[n++] = c->radix ? "on" : "off";
    args[n++] = "--checksum";
    args[n++] = c->no_checksum ? "off" : "on";
    args[n++] = "--group";
    args[n++] = inst->group;
    if (pd && c->registry != NULL) {
        args[n++] = "--registry";
        args[n++] = (char *) c->registry;
    }
    if (c->role == KVS_LLM_DECODE && c->registry == NULL) {
        const struct {
            const char *flag;
            uint32_t v;
        } per_room[] = {{"--max-peer-instances", c->max_peer_instances},
                        {"--peer-idle-s", c->peer_idle_s}};
        for (int i = 0; i < 2; i++) {
            if (per_room[i].v == 0) continue;
            args[n++] = (char *) per_room[i].flag;
            snprintf(num[10 + i], sizeof(num[10 + i]), "%u", per_room[i].v);
            args[n++] = num[10 + i];
        }
    }
    args[n++] = "--data";
    args[n++] = c->data == 1 ? "shm" : c->data == 2 ? "tcp" : "auto";
    if (c->kv_bf16 && c->gpu < 0) {
        args[n++] = "--kv-dtype";
        args[n++] = "bf16";
    }
    if (c->gpu >= 0) {
        args[n++] = "--device";
        args[n++] = "cuda";
        args[n++] = "--gpu";
        snprintf(num[12], sizeof(num[12]), "%d", c->gpu);
        args[n++] = num[12];
    }
    args[n] = NULL;

    kvs_spawned_t k;
    if (kvs_spawn_self("serve", args, rank == 0 ? KVS_SPAWN_PIPE : KVS_SPAWN_DEVNULL,
                       rank == 0 ? KVS_SPAWN_PIPE : KVS_SPAWN_DEVNULL, &k) != 0)
        return -1;
    inst->pids[rank] = k.pid;
    if (rank == 0) {
        inst->in_fd = k.in_fd;
        inst->out_fd = k.out_fd;
    }
    return 0;
}

int kvs_instance_start(const kvs_instance_config_t *c, kvs_instance_t *inst)
{
    memset(inst, 0, sizeof(*inst));
    inst->in_fd = inst->out_fd = -1;
    if (c->tp == 0 || c->tp > KVS_MAX_TP || (c->role == KVS_LLM_PREFILL && c->registry == NULL)) {
        fprintf(stderr, "error: an instance needs 1..%d ranks (and a registry when prefill)\n",
                KVS_MAX_TP);
        return -1;
    }
    /* Named for this process (tpgroup.h): the next instance on the host removes it should a
     * SIGKILL of the whole instance leave it; this one removes those of instances before. */
    if (c->generation == 0)
        snprintf(inst->group, sizeof(inst->group), "/kvs-%ld-%c", (long) getpid(),
                 role_name(c->role)[0]);
    else
        snprintf(inst->group, sizeof(inst->group), "/kvs-%ld-%c%u", (long) getpid(),
                 role_name(c->role)[0], c->generation);
    kvs_tpgroup_reclaim();
    /* Ignored signals stay ignored across exec; handled ones do not. */
    struct sigaction ign, old;
    memset(&ign, 0, sizeof(ign));
    ign.sa_handler = SIG_IGN;
    sigemptyset(&ign.sa_mask);
    sigaction(SIGINT, &ign, &old);
    int rc = 0;
    for (uint32_t r = 0; r < c->tp; r++) {
        if (spawn_rank(c, inst, r) != 0) {
            fprintf(stderr, "error: cannot start %s rank %u: %s\n", role_name(c->role), r,
                    strerror(errno));
            rc = -1;
            break;
        }
        inst->n++;
    }
    sigaction(SIGINT, &old, NULL);
    if (rc != 0) {
        kvs_instance_wait(inst, 0);
        if (inst->in_fd >= 0) close(inst->in_fd);
        if (inst->out_fd >= 0) close(inst->out_fd);
        inst->in_fd = inst->out_fd = -1;
    }
    return rc;
}

uint32_t kvs_instance_poll(kvs_instance_t *inst)
{
    uint32_t running = 0;
    for (uint32_t r = 0; r < inst->n; r++) {
        if (inst->exited[r]) continue;
        pid_t p = waitpid(inst->pids[r], &inst->status[r], WNOHANG);
        if (p == inst->pids[r] || (p < 0 && errno == ECHILD))
            inst->exited[r] = 1;
        else
            running++;
    }
    return running;
}

int kvs_instance_wait(kvs_instance_t *inst, uint32_t timeout_ms)
{
    const uint64_t end = kvs_now_ns() + (uint64_t) timeout_ms * 1000000ull;
    int killed = 0;
    while (kvs_instance_poll(inst) > 0) {
        if (!killed && kvs_now_ns() >= end) {
            for (uint32_t r = 0; r < inst->n; r++)
                if (!inst->exited[r]) kill(inst->pids[r], SIGKILL);
            killed = 1;
        }
        struct timespec ts = {0, 10 * 1000000L};
        nanosleep(&ts, NULL);
    }
    /* Left behind only by a rank 0 that did not get to leave its group. */
    if (inst->group[0] != '\0') shm_unlink(inst->group);
    int ok = !killed;
    for (uint32_t r = 0; r < inst->n; r++)
        ok &= WIFEXITED(inst->status[r]) && WEXITSTATUS(inst->status[r]) == 0;
    return ok ? 0 : -1;
}

void kvs_instance_describe_exit(const kvs_instance_t *inst, char *buf, size_t cap)
{
    snprintf(buf, cap, "every rank is running");
    /* The first rank that failed; else the first that exited. */
    uint32_t pick = inst->n;
    for (uint32_t r = 0; r < inst->n; r++) {
        if (!inst->exited[r]) continue;
        int st = inst->status[r];
        int bad = !WIFEXITED(st) || WEXITSTATUS(st) != 0;
        if (pick == inst->n ||
            (bad && !(!WIFEXITED(inst->status[pick]) || WEXITSTATUS(inst->status[pick]) != 0)))
            pick = r;
    }
    for (uint32_t r = pick; r < inst->n; r++) {
        int st = inst->status[r];
        if (WIFEXITED(st))
            snprintf(buf, cap, "rank %u exited with status %d", r, WEXITSTATUS(st));
        else if (WIFSIGNALED(st))
            snprintf(buf, cap, "rank %u was killed by signal %d", r, WTERMSIG(st));
        else
            snprintf(buf, cap, "rank %u ended", r);
        return;
    }
}
