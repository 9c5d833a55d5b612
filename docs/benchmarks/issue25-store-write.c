// Issue 25 item 4 (2026-11-28): the kernel's cost of a store commit's write(2) on this
// machine's file system, apart from hubcast: 38,500-byte writes (a POST /ingest batch of 500
// compact records) into a log, fdatasync every 64 MiB, 256 MiB per run. Kernel time per
// write from getrusage.
//   gcc -O2 -o /tmp/w docs/benchmarks/issue25-store-write.c && /tmp/w DIR [WRITE_BYTES]
// WRITE_BYTES (default 38,500): larger writes, as a commit of several batches would make;
// the times are still given per 38,500 bytes.
// modes: append (a new file, ext4's delayed allocation: what hubcast did), reserve (a new
// file, blocks reserved 8 MiB ahead with fallocate(FALLOC_FL_KEEP_SIZE): what it does now),
// overwrite (the same file written again from its start: its blocks allocated and its pages
// in the page cache, what re-using a log file would give).
#define _GNU_SOURCE
#include <fcntl.h>
#include <linux/falloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

static double sys_s(void) {
    struct rusage r;
    getrusage(RUSAGE_SELF, &r);
    return r.ru_stime.tv_sec + r.ru_stime.tv_usec / 1e6;
}

static void run(const char *path, const char *mode, size_t chunk, size_t total) {
    int append = strcmp(mode, "overwrite") != 0, reserve = strcmp(mode, "reserve") == 0;
    if (append) unlink(path);
    int fd = open(path, O_CREAT | O_WRONLY | (append ? O_APPEND : 0), 0644);
    char *buf = malloc(chunk);
    memset(buf, 'x', chunk);
    double w = 0, s = 0, a;
    size_t n = 0, since = 0, reserved = 0;
    while (n < total) {
        a = sys_s();
        if (reserve && n + chunk > reserved) {
            fallocate(fd, FALLOC_FL_KEEP_SIZE, n, (8 << 20) + chunk);
            reserved = n + (8 << 20) + chunk;
        }
        if (write(fd, buf, chunk) != (ssize_t)chunk) { perror("write"); exit(1); }
        w += sys_s() - a;
        n += chunk;
        since += chunk;
        if (since >= (64 << 20)) { a = sys_s(); fdatasync(fd); s += sys_s() - a; since = 0; }
    }
    a = sys_s();
    fdatasync(fd);
    s += sys_s() - a;
    close(fd);
    free(buf);
    printf("%-9s %zu-byte writes, per 38,500 bytes: write %5.2f us, fdatasync %5.2f us\n", mode, chunk, w / total * 38500 * 1e6, s / total * 38500 * 1e6);
}

int main(int argc, char **argv) {
    char path[4096];
    snprintf(path, sizeof path, "%s/issue25-store-write.bin", argc > 1 ? argv[1] : ".");
    size_t chunk = argc > 2 ? (size_t)atol(argv[2]) : 38500;
    for (int round = 0; round < 3; round++) {
        run(path, "append", chunk, 256 << 20);
        run(path, "reserve", chunk, 256 << 20);
        run(path, "overwrite", chunk, 256 << 20);
    }
    unlink(path);
    return 0;
}
