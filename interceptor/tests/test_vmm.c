/* Unit tests of libfrmps_vmm against the fake libcuda (FRMPS_LIBCUDA must point
 * at build/libcuda_fake.so). The hook tests run build/test_hooks with the
 * library LD_PRELOADed, as an engine would. */
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cuda_decls.h"
#include "fake_control.h"
#include "frmps_vmm.h"
#include "testutil.h"

#define MiB ((size_t)1 << 20)

static const char *test_error_text(void) { return frmps_last_error(); }

static fake_cuda_fail_fn fake_fail;
static fake_cuda_calls_fn fake_calls;
static fake_cuda_live_fn fake_live;
static fake_cuda_reset_fn fake_reset;
static char self_dir[4096];

static void test_setup(void)
{
    fake_reset();
    frmps_alloc_end(); /* a failed test may have left its region open */
}

static void *ptr_of(const frmps_pool *p) { return (void *)(uintptr_t)frmps_pool_ptr(p); }

static void fill(unsigned char *b, size_t n, unsigned seed)
{
    for (size_t i = 0; i < n; i++)
        b[i] = (unsigned char)((i * 31u + seed) & 0xff);
}

static int same(const unsigned char *b, size_t n, unsigned seed)
{
    for (size_t i = 0; i < n; i++)
        if (b[i] != (unsigned char)((i * 31u + seed) & 0xff))
            return 0;
    return 1;
}

static int count_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    int n = 0;
    if (!d)
        return -1;
    while (readdir(d))
        n++;
    closedir(d);
    return n;
}

/* Runs fn in a child; returns its wait status. */
static int in_child(int (*fn)(void *), void *arg)
{
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0)
        _exit(fn(arg));
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
        ;
    return status;
}

static int exited_ok(int status) { return WIFEXITED(status) && WEXITSTATUS(status) == 0; }

/* ---------------------------------------------------------------- tests */

struct import_arg {
    int fd;
    size_t size;
    int readonly;
    unsigned seed;
    int write_back;
};

static int child_import(void *varg)
{
    struct import_arg *a = varg;
    frmps_pool *p;
    if (frmps_pool_import("weights", 0, a->fd, a->size, 0, a->readonly, &p) != FRMPS_OK)
        return 10;
    if (!same(ptr_of(p), a->size, a->seed))
        return 11;
    if (a->write_back)
        ((unsigned char *)ptr_of(p))[100] = 0xAB;
    return frmps_pool_destroy(p) == FRMPS_OK ? 0 : 12;
}

static int test_create_export_import_fork(void)
{
    int fds_before = count_fds();
    frmps_pool *p;
    CHECK(frmps_pool_create("weights", 0, 3 * MiB, 0, &p) == FRMPS_OK);
    CHECK(frmps_pool_size(p) == 4 * MiB); /* rounded up to the granularity */
    CHECK(frmps_pool_ptr(p) % FAKE_GRANULARITY == 0);
    fill(ptr_of(p), frmps_pool_size(p), 7);
    int fd = -1;
    CHECK(frmps_pool_export_fd(p, &fd) == FRMPS_OK);
    CHECK(fd >= 0);
    CHECK(fcntl(fd, F_GETFD) & FD_CLOEXEC); /* as the real driver does */

    struct import_arg a = {fd, frmps_pool_size(p), 0, 7, 1};
    CHECK(exited_ok(in_child(child_import, &a)));
    /* The child's write through its own mapping is visible here: shared bytes. */
    CHECK(((unsigned char *)ptr_of(p))[100] == 0xAB);

    close(fd);
    CHECK(frmps_pool_destroy(p) == FRMPS_OK);
    CHECK(fake_live("reservations") == 0);
    CHECK(fake_live("mappings") == 0);
    CHECK(fake_live("allocs") == 0);
    CHECK(count_fds() == fds_before);
    return 0;
}

static int send_fd(int sock, int fd)
{
    char byte = 'x';
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
    if (recvmsg(sock, &msg, MSG_CMSG_CLOEXEC) != 1)
        return -1;
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    if (!c || c->cmsg_type != SCM_RIGHTS)
        return -1;
    int fd;
    memcpy(&fd, CMSG_DATA(c), sizeof fd);
    return fd;
}

static int child_export_and_exit(void *varg)
{
    int sock = *(int *)varg;
    frmps_pool *p;
    int fd;
    if (frmps_pool_create("kv_cache", 0, 2 * MiB, 0, &p) != FRMPS_OK)
        return 20;
    fill(ptr_of(p), 2 * MiB, 99);
    if (frmps_pool_export_fd(p, &fd) != FRMPS_OK || send_fd(sock, fd) != 0)
        return 21;
    return 0; /* exits with the pool still mapped: only the fd keeps it alive */
}

static int test_import_after_exporter_exits(void)
{
    int sv[2];
    CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0);
    CHECK(exited_ok(in_child(child_export_and_exit, &sv[1])));
    int fd = recv_fd(sv[0]);
    close(sv[0]);
    close(sv[1]);
    CHECK(fd >= 0);
    frmps_pool *p;
    CHECK(frmps_pool_import("kv_cache", 0, fd, 2 * MiB, 0, 1, &p) == FRMPS_OK);
    CHECK(same(ptr_of(p), 2 * MiB, 99));
    close(fd); /* the import holds its own reference */
    CHECK(same(ptr_of(p), 2 * MiB, 99));
    CHECK(frmps_pool_destroy(p) == FRMPS_OK);
    return 0;
}

static int child_write(void *varg)
{
    ((volatile unsigned char *)varg)[0] = 1;
    return 0;
}

static int test_readonly_enforced(void)
{
    frmps_pool *owner, *ro;
    int fd;
    CHECK(frmps_pool_create("weights", 0, 2 * MiB, 0, &owner) == FRMPS_OK);
    fill(ptr_of(owner), 2 * MiB, 3);
    CHECK(frmps_pool_export_fd(owner, &fd) == FRMPS_OK);
    CHECK(frmps_pool_import("weights", 1, fd, 2 * MiB, 0, 1, &ro) == FRMPS_OK);
    CHECK(same(ptr_of(ro), 2 * MiB, 3));
    int st = in_child(child_write, ptr_of(ro));
    CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGSEGV);
    CHECK(frmps_pool_set_access(ro, 0) == FRMPS_OK);
    CHECK(exited_ok(in_child(child_write, ptr_of(ro))));
    ((unsigned char *)ptr_of(ro))[5] = 0x5A;
    CHECK(((unsigned char *)ptr_of(owner))[5] == 0x5A);
    CHECK(frmps_pool_set_access(ro, 1) == FRMPS_OK);
    st = in_child(child_write, ptr_of(ro));
    CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGSEGV);
    close(fd);
    CHECK(frmps_pool_destroy(ro) == FRMPS_OK);
    CHECK(frmps_pool_destroy(owner) == FRMPS_OK);
    CHECK(fake_live("allocs") == 0);
    return 0;
}

static int test_scratch_then_swap_keeps_va(void)
{
    frmps_pool *active, *standby;
    int fd;
    CHECK(frmps_pool_create("kv_cache", 0, 8 * MiB, 0, &active) == FRMPS_OK);
    fill(ptr_of(active), 8 * MiB, 42);
    CHECK(frmps_pool_export_fd(active, &fd) == FRMPS_OK);

    long creates = fake_calls("cuMemCreate");
    long maps_before = fake_live("mappings");
    CHECK(frmps_pool_reserve_scratch("kv_cache", 0, 8 * MiB, 0, 2 * MiB, &standby) == FRMPS_OK);
    CHECK(fake_calls("cuMemCreate") == creates + 1); /* ONE scratch allocation ... */
    CHECK(fake_live("mappings") == maps_before + 4); /* ... mapped 4 times */
    unsigned char *va = ptr_of(standby);
    /* The standby initialises on scratch: writable, aliased, and not the active's memory. */
    /* volatile: the aliasing is invisible to the compiler. */
    volatile unsigned char *vva = va;
    vva[0] = 0x11;
    CHECK(vva[2 * MiB] == 0x11 && vva[6 * MiB] == 0x11);
    CHECK(same(ptr_of(active), 8 * MiB, 42));

    long unmaps = fake_calls("cuMemUnmap");
    CHECK(frmps_pool_swap_to_import(standby, fd, 1) == FRMPS_OK);
    CHECK(fake_calls("cuMemUnmap") == unmaps + 1); /* every scratch mapping in one call */
    CHECK(ptr_of(standby) == (void *)va);           /* same VA: captured graphs stay valid */
    CHECK(fake_live("mappings") == maps_before + 1);
    CHECK(same(va, 8 * MiB, 42));
    int st = in_child(child_write, va);
    CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGSEGV);

    /* Wake: read-write, and writes land in the shared memory. */
    CHECK(frmps_pool_set_access(standby, 0) == FRMPS_OK);
    va[8 * MiB - 1] = 0x77;
    CHECK(((unsigned char *)ptr_of(active))[8 * MiB - 1] == 0x77);

    CHECK(frmps_pool_swap_to_import(standby, fd, 1) == FRMPS_E_STATE);
    close(fd);
    CHECK(frmps_pool_destroy(standby) == FRMPS_OK);
    CHECK(frmps_pool_destroy(active) == FRMPS_OK);
    CHECK(fake_live("allocs") == 0 && fake_live("reservations") == 0);
    return 0;
}

/* A chunk that does not divide the pool: the driver maps a handle only whole,
 * so the tail gets its own smaller scratch handle (10 MiB = 2 x 4 MiB + 2 MiB). */
static int test_scratch_tail_has_its_own_handle(void)
{
    frmps_pool *active, *standby;
    int fd;
    CHECK(frmps_pool_create("weights", 0, 10 * MiB, 0, &active) == FRMPS_OK);
    fill(ptr_of(active), 10 * MiB, 7);
    CHECK(frmps_pool_export_fd(active, &fd) == FRMPS_OK);
    long creates = fake_calls("cuMemCreate"), maps_before = fake_live("mappings");
    CHECK(frmps_pool_reserve_scratch("weights", 0, 10 * MiB, 0, 4 * MiB, &standby) == FRMPS_OK);
    CHECK(fake_calls("cuMemCreate") == creates + 2);
    CHECK(fake_live("mappings") == maps_before + 3);
    volatile unsigned char *va = ptr_of(standby);
    va[10 * MiB - 1] = 0x22; /* the tail is writable scratch too */
    CHECK(va[10 * MiB - 1] == 0x22 && same(ptr_of(active), 10 * MiB, 7));
    CHECK(frmps_pool_swap_to_import(standby, fd, 1) == FRMPS_OK);
    CHECK(fake_live("mappings") == maps_before + 1);
    CHECK(same((void *)va, 10 * MiB, 7));
    close(fd);
    CHECK(frmps_pool_destroy(standby) == FRMPS_OK);
    /* Released on destroy without a swap too. */
    CHECK(frmps_pool_reserve_scratch("weights", 0, 10 * MiB, 0, 4 * MiB, &standby) == FRMPS_OK);
    CHECK(frmps_pool_destroy(standby) == FRMPS_OK);
    CHECK(frmps_pool_destroy(active) == FRMPS_OK);
    CHECK(fake_live("allocs") == 0 && fake_live("reservations") == 0);
    return 0;
}

static int test_swap_size_mismatch_is_clear(void)
{
    frmps_pool *small, *big, *standby;
    int small_fd, big_fd;
    CHECK(frmps_pool_create("kv_cache", 0, 2 * MiB, 0, &small) == FRMPS_OK);
    CHECK(frmps_pool_create("kv_cache", 1, 4 * MiB, 0, &big) == FRMPS_OK);
    CHECK(frmps_pool_export_fd(small, &small_fd) == FRMPS_OK);
    CHECK(frmps_pool_export_fd(big, &big_fd) == FRMPS_OK);
    CHECK(frmps_pool_reserve_scratch("kv_cache", 0, 4 * MiB, 0, 0, &standby) == FRMPS_OK);
    void *va = ptr_of(standby);
    CHECK(frmps_pool_swap_to_import(standby, small_fd, 1) == FRMPS_E_DRIVER);
    CHECK_CONTAINS(frmps_last_error(), "smaller");
    /* Left reserved and empty: access changes are refused, a correct fd still maps. */
    CHECK(frmps_pool_set_access(standby, 0) == FRMPS_E_STATE);
    CHECK(frmps_pool_swap_to_import(standby, big_fd, 0) == FRMPS_OK);
    CHECK(ptr_of(standby) == va);
    close(small_fd);
    close(big_fd);
    CHECK(frmps_pool_destroy(standby) == FRMPS_OK);
    CHECK(frmps_pool_destroy(small) == FRMPS_OK);
    CHECK(frmps_pool_destroy(big) == FRMPS_OK);
    CHECK(fake_live("allocs") == 0 && fake_live("reservations") == 0);
    return 0;
}

static int in_pool(const frmps_pool *p, const void *ptr)
{
    uintptr_t a = (uintptr_t)ptr, base = (uintptr_t)frmps_pool_ptr(p);
    return a >= base && a < base + frmps_pool_size(p);
}

static int test_allocator_carve_and_free(void)
{
    frmps_pool *kv;
    CHECK(frmps_pool_create("kv_cache", 0, 4 * MiB, 0, &kv) == FRMPS_OK);

    /* Outside a region: the driver's allocator. */
    long allocs = fake_calls("cuMemAlloc_v2"), frees = fake_calls("cuMemFree_v2");
    void *plain = frmps_malloc(4096, 0, NULL);
    CHECK(plain && !in_pool(kv, plain));
    CHECK(fake_calls("cuMemAlloc_v2") == allocs + 1);
    frmps_free(plain, 4096, 0, NULL);
    CHECK(fake_calls("cuMemFree_v2") == frees + 1);

    CHECK(frmps_alloc_begin("kv_cache") == FRMPS_OK);
    void *a = frmps_malloc(1000, 0, NULL);
    void *b = frmps_malloc((ssize_t)MiB, 0, NULL);
    CHECK(a && b && in_pool(kv, a) && in_pool(kv, b));
    CHECK((uintptr_t)a % 512 == 0 && (uintptr_t)b % 512 == 0);
    CHECK(frmps_pool_used(kv) == 1024 + MiB);
    CHECK(frmps_malloc((ssize_t)(4 * MiB), 0, NULL) == NULL); /* full: fails, no fallback */
    CHECK_CONTAINS(frmps_last_error(), "no room");
    CHECK(fake_calls("cuMemAlloc_v2") == allocs + 1);
    frmps_free(a, 1000, 0, NULL);
    frmps_free(b, (ssize_t)MiB, 0, NULL);
    CHECK(frmps_pool_used(kv) == 0);
    CHECK(fake_calls("cuMemFree_v2") == frees + 1);
    /* Freed ranges coalesce: the whole pool is one extent again. */
    void *all = frmps_malloc((ssize_t)(4 * MiB), 0, NULL);
    CHECK(all == ptr_of(kv));
    frmps_free(all, (ssize_t)(4 * MiB), 0, NULL);

    /* Many small carve-outs (the bookkeeping grows, never overflows). */
    void *many[300];
    for (int i = 0; i < 300; i++) {
        many[i] = frmps_malloc(512, 0, NULL);
        CHECK(many[i] && in_pool(kv, many[i]));
    }
    for (int i = 0; i < 300; i += 2)
        frmps_free(many[i], 512, 0, NULL);
    for (int i = 1; i < 300; i += 2)
        frmps_free(many[i], 512, 0, NULL);
    CHECK(frmps_pool_used(kv) == 0);
    CHECK(frmps_malloc((ssize_t)(4 * MiB), 0, NULL) == ptr_of(kv));
    frmps_free(ptr_of(kv), 0, 0, NULL);
    frmps_alloc_end();

    /* A region for a tag with no pool: an explicit sharing request, so it fails. */
    CHECK(frmps_alloc_begin("weights") == FRMPS_OK);
    CHECK(frmps_malloc(4096, 0, NULL) == NULL);
    CHECK_CONTAINS(frmps_last_error(), "no pool tagged weights");
    frmps_alloc_end();
    CHECK(frmps_pool_destroy(kv) == FRMPS_OK);
    return 0;
}

static int test_region_and_argument_errors(void)
{
    frmps_pool *p = (frmps_pool *)1;
    CHECK(frmps_alloc_begin("kv_cache") == FRMPS_OK);
    CHECK(frmps_alloc_begin("weights") == FRMPS_E_STATE);
    CHECK_CONTAINS(frmps_last_error(), "already open");
    frmps_alloc_end();
    CHECK(frmps_alloc_begin("") == FRMPS_E_INVAL);
    CHECK(frmps_pool_create(NULL, 0, MiB, 0, &p) == FRMPS_E_INVAL);
    CHECK(p == NULL);
    char longtag[80];
    memset(longtag, 'x', sizeof longtag - 1);
    longtag[sizeof longtag - 1] = '\0';
    CHECK(frmps_pool_create(longtag, 0, MiB, 0, &p) == FRMPS_E_INVAL);
    CHECK(frmps_pool_create("weights", 0, 0, 0, &p) == FRMPS_E_INVAL);
    CHECK(frmps_pool_create("weights", 0, MiB, -1, &p) == FRMPS_E_INVAL);
    CHECK(frmps_pool_create("weights", 0, SIZE_MAX - 10, 0, &p) == FRMPS_E_INVAL);
    CHECK(frmps_pool_create("weights", 0, MiB, 0, NULL) == FRMPS_E_INVAL);
    CHECK(frmps_pool_import("weights", 0, -1, MiB, 0, 1, &p) == FRMPS_E_INVAL);
    CHECK(frmps_pool_export_fd(NULL, NULL) == FRMPS_E_INVAL);
    CHECK(frmps_pool_set_access(NULL, 0) == FRMPS_E_INVAL);
    CHECK(frmps_pool_swap_to_import(NULL, 0, 0) == FRMPS_E_INVAL);
    CHECK(frmps_pool_destroy(NULL) == FRMPS_OK);
    CHECK(frmps_malloc(-5, 0, NULL) == NULL);
    frmps_free(NULL, 0, 0, NULL);
    /* An fd that is no exported handle: the driver refuses, we say which call. */
    int devnull = open("/dev/null", O_RDONLY | O_CLOEXEC);
    CHECK(frmps_pool_import("weights", 0, devnull, MiB, 0, 1, &p) == FRMPS_E_DRIVER);
    CHECK_CONTAINS(frmps_last_error(), "cuMemImportFromShareableHandle");
    close(devnull);
    /* Swap on a pool that is not scratch-backed. */
    frmps_pool *owned;
    CHECK(frmps_pool_create("weights", 0, MiB, 0, &owned) == FRMPS_OK);
    CHECK(frmps_pool_swap_to_import(owned, 0, 1) == FRMPS_E_STATE);
    CHECK(frmps_pool_destroy(owned) == FRMPS_OK);
    CHECK(fake_live("reservations") == 0 && fake_live("allocs") == 0);
    return 0;
}

static int test_driver_failures_are_clear_and_clean(void)
{
    static const char *const calls[] = {"cuMemAddressReserve", "cuMemCreate", "cuMemMap",
                                        "cuMemSetAccess"};
    for (size_t i = 0; i < sizeof calls / sizeof calls[0]; i++) {
        frmps_pool *p = (frmps_pool *)1;
        fake_fail(calls[i], CUDA_ERROR_OUT_OF_MEMORY, 1);
        CHECK(frmps_pool_create("weights", 0, 2 * MiB, 0, &p) == FRMPS_E_DRIVER);
        CHECK(p == NULL);
        CHECK_CONTAINS(frmps_last_error(), calls[i]);
        CHECK_CONTAINS(frmps_last_error(), "CUDA_ERROR_OUT_OF_MEMORY");
        /* Nothing left behind. */
        CHECK(fake_live("reservations") == 0);
        CHECK(fake_live("mappings") == 0);
        CHECK(fake_live("allocs") == 0);
    }
    /* Scratch: the second of four chunk mappings fails. */
    frmps_pool *p;
    fake_fail("cuMemMap", CUDA_ERROR_OUT_OF_MEMORY, 2);
    CHECK(frmps_pool_reserve_scratch("kv_cache", 0, 8 * MiB, 0, 2 * MiB, &p) == FRMPS_E_DRIVER);
    CHECK_CONTAINS(frmps_last_error(), "cuMemMap(scratch)");
    CHECK(fake_live("reservations") == 0 && fake_live("mappings") == 0 &&
          fake_live("allocs") == 0);
    /* Export failure. */
    CHECK(frmps_pool_create("weights", 0, 2 * MiB, 0, &p) == FRMPS_OK);
    int fd;
    fake_fail("cuMemExportToShareableHandle", CUDA_ERROR_NOT_SUPPORTED, 1);
    CHECK(frmps_pool_export_fd(p, &fd) == FRMPS_E_DRIVER);
    CHECK_CONTAINS(frmps_last_error(), "CUDA_ERROR_NOT_SUPPORTED");
    CHECK(frmps_pool_destroy(p) == FRMPS_OK);
    /* The driver refuses cuInit: reported as such. */
    fake_fail("cuInit", CUDA_ERROR_NO_DEVICE, 1);
    CHECK(frmps_pool_create("weights", 0, 2 * MiB, 0, &p) == FRMPS_E_DRIVER);
    CHECK_CONTAINS(frmps_last_error(), "cuInit");
    return 0;
}

static void *thread_fail(void *arg)
{
    (void)arg;
    frmps_pool *p;
    frmps_pool_create("", 0, 0, 0, &p);
    return (void *)(uintptr_t)(strlen(frmps_last_error()) > 0);
}

static int test_errors_are_per_thread(void)
{
    frmps_pool *p;
    CHECK(frmps_pool_create("weights", 0, 0, 0, &p) == FRMPS_E_INVAL);
    char mine[512];
    snprintf(mine, sizeof mine, "%s", frmps_last_error());
    pthread_t t;
    void *had_error;
    CHECK(pthread_create(&t, NULL, thread_fail, NULL) == 0);
    CHECK(pthread_join(t, &had_error) == 0);
    CHECK(had_error == (void *)1);
    CHECK(strcmp(mine, frmps_last_error()) == 0); /* the other thread's failure is not ours */
    return 0;
}

static int test_many_pools(void)
{
    enum { N = 40 };
    frmps_pool *pools[N];
    char tag[16];
    for (int i = 0; i < N; i++) {
        snprintf(tag, sizeof tag, "t%d", i % 5);
        CHECK(frmps_pool_create(tag, (unsigned)(i / 5), 2 * MiB, 0, &pools[i]) == FRMPS_OK);
    }
    /* A tag's pools are used in creation order once the first is full. */
    CHECK(frmps_alloc_begin("t3") == FRMPS_OK);
    void *x = frmps_malloc((ssize_t)(2 * MiB), 0, NULL);
    void *y = frmps_malloc((ssize_t)(2 * MiB), 0, NULL);
    frmps_alloc_end();
    CHECK(x == ptr_of(pools[3]) && y == ptr_of(pools[8]));
    frmps_free(x, 0, 0, NULL);
    frmps_free(y, 0, 0, NULL);
    for (int i = 0; i < N; i++)
        CHECK(frmps_pool_destroy(pools[i]) == FRMPS_OK);
    CHECK(fake_live("reservations") == 0 && fake_live("allocs") == 0);
    return 0;
}

static int test_concurrent_carve(void);

struct carve_arg {
    int ok;
};

static void *carve_worker(void *varg)
{
    struct carve_arg *a = varg;
    a->ok = 1;
    for (int i = 0; i < 2000; i++) {
        void *p = frmps_malloc(4096, 0, NULL);
        if (!p) {
            a->ok = 0;
            break;
        }
        frmps_free(p, 4096, 0, NULL);
    }
    return NULL;
}

static int test_concurrent_carve(void)
{
    frmps_pool *kv;
    CHECK(frmps_pool_create("kv_cache", 0, 2 * MiB, 0, &kv) == FRMPS_OK);
    CHECK(frmps_alloc_begin("kv_cache") == FRMPS_OK);
    pthread_t t[4];
    struct carve_arg args[4];
    for (int i = 0; i < 4; i++)
        CHECK(pthread_create(&t[i], NULL, carve_worker, &args[i]) == 0);
    for (int i = 0; i < 4; i++)
        CHECK(pthread_join(t[i], NULL) == 0);
    frmps_alloc_end();
    for (int i = 0; i < 4; i++)
        CHECK(args[i].ok);
    CHECK(frmps_pool_used(kv) == 0);
    CHECK(frmps_pool_destroy(kv) == FRMPS_OK);
    return 0;
}

/* ---------------------------------------------------------------- hooks (preloaded child) */

static int run_hooks_child(const char *mode, const char *libcuda, int disable)
{
    char exe[4200], lib[4200], fake[4200];
    snprintf(exe, sizeof exe, "%s/test_hooks", self_dir);
    snprintf(lib, sizeof lib, "%s/libfrmps_vmm.so", self_dir);
    snprintf(fake, sizeof fake, "%s/libcuda_fake.so", self_dir);
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        setenv("LD_PRELOAD", lib, 1);
        setenv("FRMPS_FAKE_LIBCUDA", fake, 1);
        setenv("FRMPS_LIBCUDA", libcuda ? libcuda : fake, 1);
        if (disable)
            setenv("FRMPS_VMM_DISABLE", "1", 1);
        else
            unsetenv("FRMPS_VMM_DISABLE");
        execl(exe, exe, mode, (char *)NULL);
        _exit(127);
    }
    int status;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
        ;
    return status;
}

static int test_hooks_route_tagged_allocations(void)
{
    CHECK(exited_ok(run_hooks_child("enabled", NULL, 0)));
    return 0;
}

static int test_hooks_kill_switch_passes_through(void)
{
    CHECK(exited_ok(run_hooks_child("disabled", NULL, 1)));
    return 0;
}

static int test_hooks_pass_through_without_driver(void)
{
    CHECK(exited_ok(run_hooks_child("nodriver", "/nonexistent/libcuda.so.1", 0)));
    return 0;
}

int main(void)
{
    const char *fake_path = getenv("FRMPS_LIBCUDA");
    if (!fake_path) {
        fprintf(stderr, "set FRMPS_LIBCUDA to the fake driver (build/libcuda_fake.so)\n");
        return 2;
    }
    void *fake = dlopen(fake_path, RTLD_NOW);
    if (!fake) {
        fprintf(stderr, "dlopen %s: %s\n", fake_path, dlerror());
        return 2;
    }
    *(void **)&fake_fail = dlsym(fake, "fake_cuda_fail");
    *(void **)&fake_calls = dlsym(fake, "fake_cuda_calls");
    *(void **)&fake_live = dlsym(fake, "fake_cuda_live");
    *(void **)&fake_reset = dlsym(fake, "fake_cuda_reset");
    if (!fake_fail || !fake_calls || !fake_live || !fake_reset) {
        fprintf(stderr, "%s is not the fake driver\n", fake_path);
        return 2;
    }
    ssize_t n = readlink("/proc/self/exe", self_dir, sizeof self_dir - 1);
    if (n <= 0)
        return 2;
    self_dir[n] = '\0';
    *strrchr(self_dir, '/') = '\0';

    RUN(test_create_export_import_fork);
    RUN(test_import_after_exporter_exits);
    RUN(test_readonly_enforced);
    RUN(test_scratch_then_swap_keeps_va);
    RUN(test_scratch_tail_has_its_own_handle);
    RUN(test_swap_size_mismatch_is_clear);
    RUN(test_allocator_carve_and_free);
    RUN(test_region_and_argument_errors);
    RUN(test_driver_failures_are_clear_and_clean);
    RUN(test_errors_are_per_thread);
    RUN(test_many_pools);
    RUN(test_concurrent_carve);
    RUN(test_hooks_route_tagged_allocations);
    RUN(test_hooks_kill_switch_passes_through);
    RUN(test_hooks_pass_through_without_driver);
    FINISH();
}
