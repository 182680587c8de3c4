/* libfrmps_vmm against the real driver, kernel-free (copies only):
 *   export  : a process creates a pool, fills it, sends the fd over a unix
 *             socket, and exits without cleaning up (like a dying engine);
 *   standby : a second process reserves the same size on ONE scratch chunk,
 *             checks the scratch aliases, swaps to the fd read-only at the same
 *             VA, reads the exporter's bytes, makes it writable, writes a marker;
 *   verify  : a third process imports the fd and finds bytes and marker.
 * The orchestrating parent holds the fd only (no CUDA). Prints timings.
 * Usage: pool_real [size_mib]   (default 1024) */
#include <cuda.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "frmps_vmm.h"

#define MiB ((size_t)1 << 20)
#define CHUNK (2 * MiB)
#define MARKER_OFF ((size_t)12345)

#define FAIL(...)                                                                                  \
    do {                                                                                           \
        fprintf(stderr, "pool_real %s: ", mode);                                                   \
        fprintf(stderr, __VA_ARGS__);                                                              \
        fprintf(stderr, " [%s]\n", frmps_last_error());                                            \
        exit(1);                                                                                   \
    } while (0)
#define OK_F(call)                                                                                 \
    do {                                                                                           \
        int st_ = (call);                                                                          \
        if (st_ != FRMPS_OK)                                                                       \
            FAIL("%s -> %d", #call, st_);                                                          \
    } while (0)
#define OK_CU(call)                                                                                \
    do {                                                                                           \
        CUresult r_ = (call);                                                                      \
        if (r_ != CUDA_SUCCESS) {                                                                  \
            const char *n_ = NULL;                                                                 \
            cuGetErrorName(r_, &n_);                                                               \
            FAIL("%s -> %s", #call, n_ ? n_ : "?");                                                \
        }                                                                                          \
    } while (0)

static const char *mode = "main";

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static unsigned char pat(size_t i) { return (unsigned char)((i * 131u + 17u) % 251u); }

static void fill_pattern(unsigned char *b, size_t n)
{
    for (size_t i = 0; i < n; i++)
        b[i] = pat(i);
}

static size_t check_pattern(const unsigned char *b, size_t n, size_t skip_lo, size_t skip_hi)
{
    size_t bad = 0;
    for (size_t i = 0; i < n; i++)
        if ((i < skip_lo || i >= skip_hi) && b[i] != pat(i))
            bad++;
    return bad;
}

static int send_fd(int sock, int fd)
{
    char byte = 'f';
    struct iovec iov = {&byte, 1};
    union {
        struct cmsghdr h;
        char buf[CMSG_SPACE(sizeof(int))];
    } u;
    memset(&u, 0, sizeof u);
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
                         .msg_controllen = sizeof u.buf};
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof fd);
    return sendmsg(sock, &msg, 0) == 1 ? 0 : -1;
}

static int recv_fd(int sock)
{
    char byte;
    struct iovec iov = {&byte, 1};
    union {
        struct cmsghdr h;
        char buf[CMSG_SPACE(sizeof(int))];
    } u;
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
                         .msg_controllen = sizeof u.buf};
    if (recvmsg(sock, &msg, 0) != 1)
        return -1;
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    if (!c || c->cmsg_type != SCM_RIGHTS)
        return -1;
    int fd;
    memcpy(&fd, CMSG_DATA(c), sizeof fd);
    return fd;
}

/* cuInit + the primary context (~0.2 s) happen here, outside the timed steps. */
static void init_driver(void)
{
    size_t gran;
    OK_F(frmps_granularity(0, &gran));
}

static int do_export(size_t size, int sock)
{
    frmps_pool *p;
    int fd;
    init_driver();
    double t0 = now_ms();
    OK_F(frmps_pool_create("kv_cache", 0, size, 0, &p));
    double t1 = now_ms();
    OK_F(frmps_pool_export_fd(p, &fd));
    double t2 = now_ms();
    if (!(fcntl(fd, F_GETFD) & FD_CLOEXEC))
        FAIL("exported fd lacks FD_CLOEXEC (ARCHITECTURE.md: the driver sets it)");
    unsigned char *host = malloc(size);
    if (!host)
        FAIL("malloc");
    fill_pattern(host, size);
    OK_CU(cuMemcpyHtoD(frmps_pool_ptr(p), host, size));
    OK_CU(cuCtxSynchronize());
    if (send_fd(sock, fd) != 0)
        FAIL("send fd: %s", strerror(errno));
    printf("export: create %zu MiB %.3f ms, export fd %.3f ms (FD_CLOEXEC set), exiting without cleanup\n",
           size / MiB, t1 - t0, t2 - t1);
    fflush(stdout);
    _exit(0);
}

static int do_standby(size_t size, int fd)
{
    frmps_pool *p;
    init_driver();
    double t0 = now_ms();
    OK_F(frmps_pool_reserve_scratch("kv_cache", 0, size, 0, CHUNK, &p));
    double t1 = now_ms();
    CUdeviceptr va = frmps_pool_ptr(p);
    unsigned char probe[256], back[256];
    memset(probe, 0xAA, sizeof probe);
    OK_CU(cuMemcpyHtoD(va, probe, sizeof probe));
    OK_CU(cuMemcpyDtoH(back, va + 3 * CHUNK, sizeof back));
    if (memcmp(probe, back, sizeof probe) != 0)
        FAIL("scratch chunk is not aliased over the range");
    double t2 = now_ms();
    OK_F(frmps_pool_swap_to_import(p, fd, 1));
    double t3 = now_ms();
    if (frmps_pool_ptr(p) != va)
        FAIL("swap moved the pool from %llx to %llx", (unsigned long long)va, frmps_pool_ptr(p));
    unsigned char *host = malloc(size);
    if (!host)
        FAIL("malloc");
    OK_CU(cuMemcpyDtoH(host, va, size));
    size_t bad = check_pattern(host, size, 0, 0);
    if (bad)
        FAIL("%zu bytes differ from the exporter's after swap", bad);
    double t4 = now_ms();
    OK_F(frmps_pool_set_access(p, 0));
    double t5 = now_ms();
    unsigned char marker[16];
    memset(marker, 0x5C, sizeof marker);
    OK_CU(cuMemcpyHtoD(va + MARKER_OFF, marker, sizeof marker));
    OK_CU(cuCtxSynchronize());
    OK_F(frmps_pool_destroy(p));
    printf("standby: reserve+scratch %zu MiB (%zu mappings) %.3f ms, sleep swap (unmap scratch, import, map RO) "
           "%.3f ms, same VA, bytes intact, wake RO->RW %.3f ms, marker written\n",
           size / MiB, size / CHUNK, t1 - t0, t3 - t2, t5 - t4);
    return 0;
}

static int do_verify(size_t size, int fd)
{
    frmps_pool *p;
    init_driver();
    double t0 = now_ms();
    OK_F(frmps_pool_import("kv_cache", 0, fd, size, 0, 1, &p));
    double t1 = now_ms();
    unsigned char *host = malloc(size);
    if (!host)
        FAIL("malloc");
    OK_CU(cuMemcpyDtoH(host, frmps_pool_ptr(p), size));
    for (size_t i = 0; i < 16; i++)
        if (host[MARKER_OFF + i] != 0x5C)
            FAIL("the standby's write after wake is missing");
    size_t bad = check_pattern(host, size, MARKER_OFF, MARKER_OFF + 16);
    if (bad)
        FAIL("%zu bytes differ", bad);
    OK_F(frmps_pool_destroy(p));
    printf("verify: import+map RO %zu MiB %.3f ms; exporter's bytes and standby's marker present\n",
           size / MiB, t1 - t0);
    return 0;
}

static int run_child(const char *self, const char *child_mode, size_t size_mib, int fd)
{
    char sz[32], fds[32];
    snprintf(sz, sizeof sz, "%zu", size_mib);
    snprintf(fds, sizeof fds, "%d", fd);
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        execl(self, self, child_mode, sz, fds, (char *)NULL);
        _exit(127);
    }
    int status;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
        ;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

int main(int argc, char **argv)
{
    if (argc >= 4) { /* child */
        mode = argv[1];
        size_t size = (size_t)strtoull(argv[2], NULL, 10) * MiB;
        int fd = atoi(argv[3]);
        if (strcmp(mode, "export") == 0)
            return do_export(size, fd);
        if (strcmp(mode, "standby") == 0)
            return do_standby(size, fd);
        if (strcmp(mode, "verify") == 0)
            return do_verify(size, fd);
        FAIL("unknown mode");
    }
    size_t size_mib = argc > 1 ? (size_t)strtoull(argv[1], NULL, 10) : 1024;
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) /* inheritable on purpose */
        FAIL("socketpair");
    int rc = run_child(argv[0], "export", size_mib, sv[1]);
    close(sv[1]);
    if (rc != 0)
        FAIL("export child failed (%d)", rc);
    int fd = recv_fd(sv[0]); /* no MSG_CMSG_CLOEXEC: the children inherit it */
    close(sv[0]);
    if (fd < 0)
        FAIL("no fd from the exporter");
    printf("main: holding the fd of an exited exporter, no CUDA in this process\n");
    if ((rc = run_child(argv[0], "standby", size_mib, fd)) != 0)
        FAIL("standby child failed (%d)", rc);
    if ((rc = run_child(argv[0], "verify", size_mib, fd)) != 0)
        FAIL("verify child failed (%d)", rc);
    close(fd);
    printf("pool_real: PASS\n");
    return 0;
}
