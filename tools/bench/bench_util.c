/* Helpers shared by the benchmarks: describing the machine they ran on. */
#include "bench/bench_util.h"

#include <stdio.h>
#include <string.h>
#include <unistd.h>

void kvs_bench_cpu_info(char *model, size_t size, long *cores_p)
{
    snprintf(model, size, "unknown CPU");
    long cores = 0;
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (f != NULL) {
        char line[512];
        int have_model = 0;
        while (fgets(line, sizeof(line), f)) {
            if (strncmp(line, "processor", 9) == 0) cores++;
            if (!have_model && strncmp(line, "model name", 10) == 0) {
                char *v = strchr(line, ':');
                if (v) {
                    v++;
                    while (*v == ' ' || *v == '\t') v++;
                    v[strcspn(v, "\n")] = '\0';
                    snprintf(model, size, "%s", v);
                    have_model = 1;
                }
            }
        }
        fclose(f);
    }
    if (cores == 0) cores = sysconf(_SC_NPROCESSORS_ONLN);
    *cores_p = cores;
}
