/* `kvstage router`: the prefill/decode router (http/router.h) over running `kvstage serve`
 * instances, serving until SIGINT or SIGTERM; SIGHUP re-reads --servers-file. */
#include "cmd/commands.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/args.h"
#include "common/port.h"
#include "common/http_flags.h"
#include "kvstage/alloc.h"
#include "http/router.h"
#include "common/serve_signal.h"

#define MAX_SERVERS 64

static const char usage[] =
    "kvstage router --prefill URL [--prefill URL ...] --decode URL [--decode URL ...] [--port P]\n"
    "  [--servers-file PATH] [--prefill-policy P] [--decode-policy P]\n"
    "  an OpenAI-compatible front that sends each request to a prefill and a decode server\n"
    "  (`kvstage serve`); --prefill and --decode repeat or take comma-separated lists.\n"
    "  Policies: prefix (the longest cached prefix, asked of every server, then the least\n"
    "  loaded; the default on both sides), least-loaded (fewest requests, then most free KV\n"
    "  pages, from each server's /internal/info at every health check), round-robin.\n"
    "  --servers-file: lines \"prefill URL\" or \"decode URL\" ('#' comments), servers beyond\n"
    "  the command line's; re-read on SIGHUP (new ones join, those gone from it leave once\n"
    "  their requests finish)";

#define POLICIES        "round-robin|prefix|least-loaded"
#define SERVERS_FILE_OK "a readable file of lines \"prefill URL\" or \"decode URL\""

/* Adds the comma-separated URLs of v (given to flag) to list. 0, or -1 after the error line
 * (too many, or not http://). */
static int add_urls(const char *flag, char *v, char **list, size_t *n)
{
    for (char *save = NULL, *u = strtok_r(v, ",", &save); u; u = strtok_r(NULL, ",", &save)) {
        if (*n == MAX_SERVERS) {
            kvs_args_error(flag, "at most " KVS_ARGS_STR(MAX_SERVERS) " servers of a role",
                           "too many servers");
            return -1;
        }
        if (strncmp(u, "http://", 7) != 0 || u[7] == '\0') {
            kvs_args_error(flag, "http://HOST:PORT URLs", "'%s' is not an http:// URL", u);
            return -1;
        }
        list[(*n)++] = u;
    }
    return 0;
}

/* Takes --prefill and --decode (repeatable) out of argv; the rest goes to the table parser. */
static int split_servers(int argc, char **argv, char **pre, size_t *np, char **dec, size_t *nd,
                         char **rest, int *nrest_p)
{
    int nrest = 0;
    rest[nrest++] = argv[0];
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int is_p = strcmp(a, "--prefill") == 0, is_d = strcmp(a, "--decode") == 0;
        char *v = NULL;
        if (strncmp(a, "--prefill=", 10) == 0) {
            is_p = 1;
            v = argv[i] + 10;
        } else if (strncmp(a, "--decode=", 9) == 0) {
            is_d = 1;
            v = argv[i] + 9;
        } else if (is_p || is_d) {
            if (i + 1 >= argc) {
                kvs_args_error(a, "http://HOST:PORT URLs, repeated or comma-separated",
                               "needs a value");
                return -1;
            }
            v = argv[++i];
        }
        if (!is_p && !is_d) {
            rest[nrest++] = argv[i];
            continue;
        }
        if (add_urls(is_p ? "--prefill" : "--decode", v, is_p ? pre : dec, is_p ? np : nd) != 0)
            return -1;
    }
    rest[nrest] = NULL;
    *nrest_p = nrest;
    return 0;
}

int kvs_cmd_router(int argc, char **argv)
{
    char *pre[MAX_SERVERS], *dec[MAX_SERVERS];
    size_t np = 0, nd = 0;
    int nrest = 0;
    char **rest = kvs_calloc((size_t) argc + 1, sizeof(char *));
    if (rest == NULL) return 1;
    if (split_servers(argc, argv, pre, &np, dec, &nd, rest, &nrest) != 0) {
        kvs_free(rest);
        return 2;
    }
    const char *host = "127.0.0.1", *server_key = NULL, *servers_file = NULL;
    uint32_t port = 0, threads = 8, match_ms = 2000, health_ms = 500, timeout_s = 600;
    int policy = 1, policies[2] = {1, 1}, seen_side[2] = {0, 0};
    kvs_http_flags_t hf;
    const kvs_arg_t args[] = {
        {"port", KVS_ARG_U32, &port, "HTTP port (0: a free one, printed)", "[0,65535]", NULL},
        {"host", KVS_ARG_STR, &host, "IPv4 address to bind (127.0.0.1)", "an IPv4 address", NULL},
        {"servers-file", KVS_ARG_STR, &servers_file,
         "more servers, one \"prefill URL\" or \"decode URL\" a line; re-read on SIGHUP",
         SERVERS_FILE_OK, NULL},
        {"policy", KVS_ARG_CHOICE, &policy,
         "server choice of both sides (prefix), unless --prefill-policy / --decode-policy",
         POLICIES, NULL},
        {"prefill-policy", KVS_ARG_CHOICE, &policies[KVS_ROUTER_PREFILL],
         "prefill server choice (prefix: longest cached prefix, then least loaded)", POLICIES,
         &seen_side[KVS_ROUTER_PREFILL]},
        {"decode-policy", KVS_ARG_CHOICE, &policies[KVS_ROUTER_DECODE],
         "decode server choice (prefix: a chat's later turns go back to its server)", POLICIES,
         &seen_side[KVS_ROUTER_DECODE]},
        {"threads", KVS_ARG_U32, &threads, "HTTP worker threads (8)", "[1,1024]", NULL},
        {"match-timeout-ms", KVS_ARG_U32, &match_ms,
         "prefix policy: how long a server's cache answer may take (2000)", "[1,3600000]", NULL},
        {"health-interval-ms", KVS_ARG_U32, &health_ms,
         "health checks of every server (500): a dead one is out within this", "[1,3600000]", NULL},
        {"request-timeout-s", KVS_ARG_U32, &timeout_s, "one request at most (600)", "[1,4000000]",
         NULL},
        {"server-api-key", KVS_ARG_STR, &server_key,
         "the key sent to the servers (default: the --api-key clients must send)", NULL, NULL},
    };
    kvs_arg_table_t t = {.count = 0};
    KVS_ARG_TABLE_ADD(&t, args);
    kvs_http_flags_add(&t, &hf);
    int rc = kvs_arg_table_parse(&t, usage, nrest, rest, 1);
    kvs_free(rest);
    if (rc != KVS_ARGS_OK) return rc == KVS_ARGS_HELP ? 0 : 2;
    if ((rc = kvs_http_flags_check(&hf)) != 0) return rc;
    if ((rc = kvs_http_flags_check_key("--server-api-key", server_key)) != 0) return rc;
    for (int side = 0; side < 2; side++)
        if (!seen_side[side]) policies[side] = policy;
    if (servers_file != NULL && access(servers_file, R_OK) != 0)
        return kvs_args_error("--servers-file", SERVERS_FILE_OK, "cannot read '%s': %s",
                              servers_file, strerror(errno));
    if (servers_file == NULL && (np == 0 || nd == 0))
        return kvs_args_error(np == 0 ? "--prefill" : "--decode", "http://HOST:PORT URLs",
                              "give at least one server (or a --servers-file)");
    if ((rc = kvs_port_check(host, port)) != 0) return rc;
    kvs_serve_signal_install();
    kvs_serve_signal_install_hup();
    kvs_router_config_t c = {.host = host,
                             .port = (uint16_t) port,
                             .threads = threads,
                             .prefill = (const char *const *) pre,
                             .n_prefill = np,
                             .decode = (const char *const *) dec,
                             .n_decode = nd,
                             .servers_file = servers_file,
                             .prefill_policy = (kvs_router_policy_t) policies[KVS_ROUTER_PREFILL],
                             .decode_policy = (kvs_router_policy_t) policies[KVS_ROUTER_DECODE],
                             .health_interval_ms = health_ms,
                             .match_timeout_ms = match_ms,
                             .request_timeout_ms = timeout_s * 1000u,
                             .strict = hf.strict,
                             .api_key = hf.api_key,
                             .server_api_key = server_key,
                             .max_connections = hf.max_connections,
                             .idle_timeout_s = hf.idle_timeout_s};
    kvs_router_t *rt = NULL;
    kvs_args_capture_t cap;
    kvs_args_capture_begin(&cap);
    kvs_status_t st = kvs_router_create(&c, &rt);
    if (st == KVS_ERR_INVALID && servers_file != NULL && cap.msg[0] != '\0') {
        /* The servers file's bad line, or a side it leaves without a server. */
        kvs_args_capture_end(&cap, 1);
        return kvs_args_error("--servers-file", SERVERS_FILE_OK, "%s", cap.msg);
    }
    kvs_args_capture_end(&cap, 0);
    if (st != KVS_OK) {
        /* Free when checked above: something took it since. */
        if (!kvs_port_explain(host, port))
            fprintf(stderr, "error: cannot start the router on %s:%u\n", host, port);
        return 1;
    }
    static const char *const names[] = {"round-robin", "prefix", "least-loaded"};
    printf("routing on http://%s:%u (%zu prefill, %zu decode%s, policy %s/%s)\n", host,
           (unsigned) kvs_router_port(rt), np, nd, servers_file ? " and the servers file" : "",
           names[policies[KVS_ROUTER_PREFILL]], names[policies[KVS_ROUTER_DECODE]]);
    fflush(stdout);
    while (!kvs_serve_signal_wait(1000)) {
        if (servers_file != NULL && kvs_serve_signal_hup_take() && kvs_router_reload(rt) != KVS_OK)
            fprintf(stderr, "kvstage router: %s not applied (the servers stay as they were)\n",
                    servers_file);
    }
    fprintf(stderr, "kvstage router: shutting down\n");
    kvs_router_destroy(rt);
    return 0;
}
