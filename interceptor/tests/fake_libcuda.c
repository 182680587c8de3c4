/* TEST DOUBLE: a fake libcuda.so for the interceptor's unit tests. Not a driver.
 *
 * "Device" memory is host memory: VA reservations are PROT_NONE anonymous
 * mappings, a cuMemCreate handle is a memfd, cuMemMap maps the memfd at the
 * reserved address, cuMemSetAccess is mprotect. So exported fds really share
 * bytes between processes, read-only access really faults, and a scratch chunk
 * mapped many times really aliases. One device (ordinal 0); a 2 MiB
 * granularity; failures can be injected per function (see fake_control.h). */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cuda_decls.h"
#include "fake_control.h"

#define FAKE_FUNCS(X)                                                                      \
    X(cuInit) X(cuDeviceGet) X(cuCtxGetCurrent) X(cuCtxSetCurrent) X(cuDevicePrimaryCtxRetain) \
    X(cuGetErrorName) X(cuMemAlloc_v2) X(cuMemFree_v2) X(cuMemAddressReserve)              \
    X(cuMemAddressFree) X(cuMemCreate) X(cuMemRelease) X(cuMemMap) X(cuMemUnmap)          \
    X(cuMemSetAccess) X(cuMemExportToShareableHandle) X(cuMemImportFromShareableHandle)   \
    X(cuMemGetAllocationGranularity) X(cuGetProcAddress) X(cuGetProcAddress_v2)            \
    X(cuModuleLoadData) X(cuModuleGetFunction) X(cuLaunchKernel) X(cuCtxSynchronize)     \
    X(cuDeviceGetAttribute) X(cuCtxPushCurrent_v2) X(cuCtxPopCurrent_v2)                   \
    X(cuDevicePrimaryCtxRelease_v2) X(cuCtxGetLimit) X(cuCtxSetLimit)

enum {
#define FAKE_ENUM(n) F_##n,
    FAKE_FUNCS(FAKE_ENUM)
#undef FAKE_ENUM
    F_COUNT
};

static const char *const fake_names[F_COUNT] = {
#define FAKE_NAME(n) #n,
    FAKE_FUNCS(FAKE_NAME)
#undef FAKE_NAME
};

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static long calls[F_COUNT];
static int fail_countdown[F_COUNT];
static CUresult fail_err[F_COUNT];
static bool inited;
static struct CUctx_st {
    int dev;
    size_t stack; /* CU_LIMIT_STACK_SIZE: per-thread bytes */
} primary_ctx = {0, FAKE_STACK_DEFAULT};
static int primary_refs;
static _Thread_local CUcontext current;
/* cuCtxPushCurrent's stack, per thread (a few levels are all a test needs). */
static _Thread_local CUcontext pushed[8];
static _Thread_local int npushed;

struct alloc {
    int fd;
    size_t size;
    int refs; /* handle + one per mapping */
    bool exportable;
};
struct range {
    uintptr_t va;
    size_t size;
    struct alloc *a; /* mappings only */
    size_t offset;
};
struct rangevec {
    struct range *v;
    size_t n, cap;
};
static struct rangevec reservations, mappings, plain_allocs;
static long live_allocs;

static void rv_add(struct rangevec *rv, struct range r)
{
    if (rv->n == rv->cap) {
        rv->cap = rv->cap ? rv->cap * 2 : 16;
        rv->v = realloc(rv->v, rv->cap * sizeof *rv->v);
        if (!rv->v)
            abort(); /* test double: running out of host memory is fatal */
    }
    rv->v[rv->n++] = r;
}

static void rv_del(struct rangevec *rv, size_t i) { rv->v[i] = rv->v[--rv->n]; }

/* Entry bookkeeping: count the call, apply an injected failure. */
static CUresult enter(int f)
{
    pthread_mutex_lock(&mu);
    calls[f]++;
    CUresult rc = CUDA_SUCCESS;
    if (fail_countdown[f] > 0 && --fail_countdown[f] == 0)
        rc = fail_err[f];
    pthread_mutex_unlock(&mu);
    return rc;
}

#define ENTER(f)                                                                               \
    do {                                                                                       \
        CUresult injected_ = enter(F_##f);                                                     \
        if (injected_ != CUDA_SUCCESS)                                                         \
            return injected_;                                                                  \
    } while (0)
#define NEED_INIT()                                                                            \
    do {                                                                                       \
        if (!inited)                                                                           \
            return CUDA_ERROR_NOT_INITIALIZED;                                                 \
    } while (0)

void fake_cuda_fail(const char *name, int err, int nth)
{
    pthread_mutex_lock(&mu);
    for (int i = 0; i < F_COUNT; i++)
        if (strcmp(fake_names[i], name) == 0) {
            fail_countdown[i] = nth;
            fail_err[i] = (CUresult)err;
        }
    pthread_mutex_unlock(&mu);
}

long fake_cuda_calls(const char *name)
{
    long n = -1;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < F_COUNT; i++)
        if (strcmp(fake_names[i], name) == 0)
            n = calls[i];
    pthread_mutex_unlock(&mu);
    return n;
}

long fake_cuda_live(const char *what)
{
    long n = -1;
    pthread_mutex_lock(&mu);
    if (strcmp(what, "reservations") == 0)
        n = (long)reservations.n;
    else if (strcmp(what, "mappings") == 0)
        n = (long)mappings.n;
    else if (strcmp(what, "allocs") == 0)
        n = live_allocs;
    pthread_mutex_unlock(&mu);
    return n;
}

void fake_cuda_reset(void)
{
    pthread_mutex_lock(&mu);
    memset(calls, 0, sizeof calls);
    memset(fail_countdown, 0, sizeof fail_countdown);
    pthread_mutex_unlock(&mu);
}

CUresult cuInit(unsigned int flags)
{
    ENTER(cuInit);
    if (flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    inited = true;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice *device, int ordinal)
{
    ENTER(cuDeviceGet);
    NEED_INIT();
    if (ordinal != 0)
        return CUDA_ERROR_INVALID_DEVICE;
    *device = 0;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetCurrent(CUcontext *pctx)
{
    ENTER(cuCtxGetCurrent);
    NEED_INIT();
    *pctx = current;
    return CUDA_SUCCESS;
}

CUresult cuCtxSetCurrent(CUcontext ctx)
{
    ENTER(cuCtxSetCurrent);
    NEED_INIT();
    current = ctx;
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    ENTER(cuDevicePrimaryCtxRetain);
    NEED_INIT();
    if (dev != 0)
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&mu);
    primary_refs++;
    pthread_mutex_unlock(&mu);
    *pctx = &primary_ctx;
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev)
{
    ENTER(cuDevicePrimaryCtxRelease_v2);
    NEED_INIT();
    if (dev != 0)
        return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&mu);
    primary_refs--;
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

/* An H100 SXM's figures: 132 SMs of 2048 threads. */
CUresult cuDeviceGetAttribute(int *pi, int attrib, CUdevice dev)
{
    ENTER(cuDeviceGetAttribute);
    NEED_INIT();
    if (dev != 0)
        return CUDA_ERROR_INVALID_DEVICE;
    if (!pi)
        return CUDA_ERROR_INVALID_VALUE;
    switch (attrib) {
    case 16: /* CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT */
        *pi = 132;
        return CUDA_SUCCESS;
    case 39: /* CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR */
        *pi = 2048;
        return CUDA_SUCCESS;
    }
    return CUDA_ERROR_INVALID_VALUE;
}

CUresult cuCtxPushCurrent_v2(CUcontext ctx)
{
    ENTER(cuCtxPushCurrent_v2);
    NEED_INIT();
    if (!ctx)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (npushed == (int)(sizeof pushed / sizeof pushed[0]))
        return CUDA_ERROR_INVALID_VALUE;
    pushed[npushed++] = current;
    current = ctx;
    return CUDA_SUCCESS;
}

CUresult cuCtxPopCurrent_v2(CUcontext *pctx)
{
    ENTER(cuCtxPopCurrent_v2);
    NEED_INIT();
    if (!current)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (pctx)
        *pctx = current;
    current = npushed ? pushed[--npushed] : NULL;
    return CUDA_SUCCESS;
}

/* CU_LIMIT_STACK_SIZE (0) only. Setting rounds up to 16 bytes, as the driver may. */
CUresult cuCtxGetLimit(size_t *pvalue, int limit)
{
    ENTER(cuCtxGetLimit);
    NEED_INIT();
    if (!current)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (!pvalue || limit != 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    *pvalue = current->stack;
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

CUresult cuCtxSetLimit(int limit, size_t value)
{
    ENTER(cuCtxSetLimit);
    NEED_INIT();
    if (!current)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (limit != 0)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    current->stack = (value + 15) / 16 * 16;
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

long fake_cuda_primary_refs(void)
{
    pthread_mutex_lock(&mu);
    long n = primary_refs;
    pthread_mutex_unlock(&mu);
    return n;
}

CUresult cuGetErrorName(CUresult error, const char **pstr)
{
    ENTER(cuGetErrorName);
    switch (error) {
#define NAME(e)                                                                                \
    case e:                                                                                    \
        *pstr = #e;                                                                            \
        return CUDA_SUCCESS;
        NAME(CUDA_SUCCESS)
        NAME(CUDA_ERROR_INVALID_VALUE)
        NAME(CUDA_ERROR_OUT_OF_MEMORY)
        NAME(CUDA_ERROR_NOT_INITIALIZED)
        NAME(CUDA_ERROR_INVALID_DEVICE)
        NAME(CUDA_ERROR_INVALID_CONTEXT)
        NAME(CUDA_ERROR_INVALID_HANDLE)
        NAME(CUDA_ERROR_NOT_FOUND)
        NAME(CUDA_ERROR_NOT_PERMITTED)
        NAME(CUDA_ERROR_NOT_SUPPORTED)
        NAME(CUDA_ERROR_UNKNOWN)
        NAME(CUDA_ERROR_ILLEGAL_ADDRESS)
        NAME(CUDA_ERROR_MISALIGNED_ADDRESS)
#undef NAME
    default:
        *pstr = NULL;
        return CUDA_ERROR_INVALID_VALUE;
    }
}

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    ENTER(cuMemAlloc_v2);
    NEED_INIT();
    if (!current)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (!dptr || bytesize == 0)
        return CUDA_ERROR_INVALID_VALUE;
    void *p = mmap(NULL, bytesize, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return CUDA_ERROR_OUT_OF_MEMORY;
    pthread_mutex_lock(&mu);
    rv_add(&plain_allocs, (struct range){(uintptr_t)p, bytesize, NULL, 0});
    pthread_mutex_unlock(&mu);
    *dptr = (CUdeviceptr)(uintptr_t)p;
    return CUDA_SUCCESS;
}

CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    ENTER(cuMemFree_v2);
    NEED_INIT();
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    for (size_t i = 0; i < plain_allocs.n; i++)
        if (plain_allocs.v[i].va == (uintptr_t)dptr) {
            munmap((void *)plain_allocs.v[i].va, plain_allocs.v[i].size);
            rv_del(&plain_allocs, i);
            rc = CUDA_SUCCESS;
            break;
        }
    pthread_mutex_unlock(&mu);
    return rc;
}

static bool granular(size_t x) { return x % FAKE_GRANULARITY == 0; }

static bool prop_ok(const CUmemAllocationProp *prop)
{
    return prop && prop->type == CU_MEM_ALLOCATION_TYPE_PINNED &&
           prop->location.type == CU_MEM_LOCATION_TYPE_DEVICE && prop->location.id == 0;
}

CUresult cuMemGetAllocationGranularity(size_t *granularity, const CUmemAllocationProp *prop,
                                       CUmemAllocationGranularity_flags option)
{
    ENTER(cuMemGetAllocationGranularity);
    NEED_INIT();
    if (!granularity || !prop_ok(prop) || (option != CU_MEM_ALLOC_GRANULARITY_MINIMUM &&
                                           option != CU_MEM_ALLOC_GRANULARITY_RECOMMENDED))
        return CUDA_ERROR_INVALID_VALUE;
    *granularity = FAKE_GRANULARITY;
    return CUDA_SUCCESS;
}

CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags)
{
    ENTER(cuMemAddressReserve);
    NEED_INIT();
    if (!ptr || size == 0 || !granular(size) || addr != 0 || flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (alignment == 0)
        alignment = FAKE_GRANULARITY;
    void *p = mmap(NULL, size + alignment, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (p == MAP_FAILED)
        return CUDA_ERROR_OUT_OF_MEMORY;
    uintptr_t base = ((uintptr_t)p + alignment - 1) & ~(uintptr_t)(alignment - 1);
    if (base > (uintptr_t)p)
        munmap(p, base - (uintptr_t)p);
    size_t tail = (uintptr_t)p + size + alignment - (base + size);
    if (tail)
        munmap((void *)(base + size), tail);
    pthread_mutex_lock(&mu);
    rv_add(&reservations, (struct range){base, size, NULL, 0});
    pthread_mutex_unlock(&mu);
    *ptr = base;
    return CUDA_SUCCESS;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size)
{
    ENTER(cuMemAddressFree);
    NEED_INIT();
    CUresult rc = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    for (size_t i = 0; i < mappings.n; i++)
        if (mappings.v[i].va >= ptr && mappings.v[i].va < ptr + size) {
            pthread_mutex_unlock(&mu);
            return CUDA_ERROR_INVALID_VALUE; /* still mapped: the caller leaks a mapping */
        }
    for (size_t i = 0; i < reservations.n; i++)
        if (reservations.v[i].va == ptr && reservations.v[i].size == size) {
            munmap((void *)ptr, size);
            rv_del(&reservations, i);
            rc = CUDA_SUCCESS;
            break;
        }
    pthread_mutex_unlock(&mu);
    return rc;
}

static CUmemGenericAllocationHandle new_alloc(int fd, size_t size, bool exportable)
{
    struct alloc *a = calloc(1, sizeof *a);
    if (!a)
        return 0;
    a->fd = fd;
    a->size = size;
    a->refs = 1;
    a->exportable = exportable;
    pthread_mutex_lock(&mu);
    live_allocs++;
    pthread_mutex_unlock(&mu);
    return (CUmemGenericAllocationHandle)(uintptr_t)a;
}

static void alloc_unref_locked(struct alloc *a)
{
    if (--a->refs == 0) {
        close(a->fd);
        free(a);
        live_allocs--;
    }
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                     const CUmemAllocationProp *prop, unsigned long long flags)
{
    ENTER(cuMemCreate);
    NEED_INIT();
    if (!handle || !prop_ok(prop) || size == 0 || !granular(size) || flags != 0)
        return CUDA_ERROR_INVALID_VALUE;
    int fd = memfd_create("fake-cuda-vmm", MFD_CLOEXEC);
    if (fd < 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    if (ftruncate(fd, (off_t)size) != 0) {
        close(fd);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *handle = new_alloc(fd, size,
                        prop->requestedHandleTypes == CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (!*handle) {
        close(fd);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return CUDA_SUCCESS;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle)
{
    ENTER(cuMemRelease);
    NEED_INIT();
    if (!handle)
        return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    alloc_unref_locked((struct alloc *)(uintptr_t)handle);
    pthread_mutex_unlock(&mu);
    return CUDA_SUCCESS;
}

static bool inside_reservation_locked(uintptr_t va, size_t size)
{
    for (size_t i = 0; i < reservations.n; i++)
        if (va >= reservations.v[i].va && va + size <= reservations.v[i].va + reservations.v[i].size)
            return true;
    return false;
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags)
{
    ENTER(cuMemMap);
    NEED_INIT();
    struct alloc *a = (struct alloc *)(uintptr_t)handle;
    if (!a || flags != 0 || size == 0 || !granular(size) || !granular(offset) ||
        offset + size > a->size)
        return CUDA_ERROR_INVALID_VALUE;
    /* The real driver (580, H100/H200) maps a handle only whole: offset 0 and
     * the handle's full size; anything shorter is CUDA_ERROR_NOT_SUPPORTED. */
    if (offset != 0 || size != a->size)
        return CUDA_ERROR_NOT_SUPPORTED;
    pthread_mutex_lock(&mu);
    CUresult rc = CUDA_SUCCESS;
    if (!inside_reservation_locked(ptr, size))
        rc = CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < mappings.n && rc == CUDA_SUCCESS; i++)
        if (ptr < mappings.v[i].va + mappings.v[i].size && mappings.v[i].va < ptr + size)
            rc = CUDA_ERROR_INVALID_VALUE; /* already mapped */
    if (rc == CUDA_SUCCESS) {
        /* No access until cuMemSetAccess, as with the real driver. */
        void *p = mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, a->fd,
                       (off_t)offset);
        if (p == MAP_FAILED) {
            rc = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            a->refs++;
            rv_add(&mappings, (struct range){ptr, size, a, offset});
        }
    }
    pthread_mutex_unlock(&mu);
    return rc;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size)
{
    ENTER(cuMemUnmap);
    NEED_INIT();
    pthread_mutex_lock(&mu);
    size_t covered = 0;
    for (size_t i = 0; i < mappings.n; i++) {
        struct range *m = &mappings.v[i];
        bool overlap = ptr < m->va + m->size && m->va < ptr + size;
        bool inside = m->va >= ptr && m->va + m->size <= ptr + size;
        if (overlap && !inside) {
            pthread_mutex_unlock(&mu);
            return CUDA_ERROR_INVALID_VALUE; /* would split a mapping */
        }
        if (inside)
            covered += m->size;
    }
    if (covered != size) {
        pthread_mutex_unlock(&mu);
        return CUDA_ERROR_INVALID_VALUE;
    }
    for (size_t i = 0; i < mappings.n;) {
        struct range *m = &mappings.v[i];
        if (m->va >= ptr && m->va + m->size <= ptr + size) {
            alloc_unref_locked(m->a);
            rv_del(&mappings, i);
        } else {
            i++;
        }
    }
    /* Back to a plain reservation. */
    void *p = mmap((void *)(uintptr_t)ptr, size, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    pthread_mutex_unlock(&mu);
    return p == MAP_FAILED ? CUDA_ERROR_UNKNOWN : CUDA_SUCCESS;
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count)
{
    ENTER(cuMemSetAccess);
    NEED_INIT();
    if (!desc || count != 1 || desc->location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
        desc->location.id != 0)
        return CUDA_ERROR_INVALID_VALUE;
    int prot;
    switch (desc->flags) {
    case CU_MEM_ACCESS_FLAGS_PROT_NONE: prot = PROT_NONE; break;
    case CU_MEM_ACCESS_FLAGS_PROT_READ: prot = PROT_READ; break;
    case CU_MEM_ACCESS_FLAGS_PROT_READWRITE: prot = PROT_READ | PROT_WRITE; break;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
    pthread_mutex_lock(&mu);
    size_t covered = 0;
    for (size_t i = 0; i < mappings.n; i++) {
        struct range *m = &mappings.v[i];
        if (m->va >= ptr && m->va + m->size <= ptr + size)
            covered += m->size;
    }
    pthread_mutex_unlock(&mu);
    if (covered != size)
        return CUDA_ERROR_INVALID_VALUE; /* the whole range must be mapped */
    return mprotect((void *)(uintptr_t)ptr, size, prot) == 0 ? CUDA_SUCCESS : CUDA_ERROR_UNKNOWN;
}

CUresult cuMemExportToShareableHandle(void *shareableHandle, CUmemGenericAllocationHandle handle,
                                      CUmemAllocationHandleType handleType,
                                      unsigned long long flags)
{
    ENTER(cuMemExportToShareableHandle);
    NEED_INIT();
    struct alloc *a = (struct alloc *)(uintptr_t)handle;
    if (!a || !shareableHandle || flags != 0 ||
        handleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || !a->exportable)
        return CUDA_ERROR_INVALID_VALUE;
    /* The real driver's exported fd has FD_CLOEXEC set too. */
    int fd = fcntl(a->fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *(int *)shareableHandle = fd;
    return CUDA_SUCCESS;
}

CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *osHandle,
                                        CUmemAllocationHandleType shHandleType)
{
    ENTER(cuMemImportFromShareableHandle);
    NEED_INIT();
    int src = (int)(intptr_t)osHandle;
    struct stat st;
    if (!handle || shHandleType != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || src < 0 ||
        fstat(src, &st) != 0 || st.st_size <= 0)
        return CUDA_ERROR_INVALID_VALUE;
    int fd = fcntl(src, F_DUPFD_CLOEXEC, 0);
    if (fd < 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *handle = new_alloc(fd, (size_t)st.st_size, true);
    if (!*handle) {
        close(fd);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    return CUDA_SUCCESS;
}

/* Modules and launches, for sdk/primefault.py's tests. A module is its image's
 * text; a function is found by its ".entry <name>(" line. One kernel "runs":
 * frmps_prime_fault, whose 8-byte access at its pointer argument + 4 makes the
 * context's sticky error CUDA_ERROR_MISALIGNED_ADDRESS when that address is not
 * 8-aligned (and the pointer is one of cuMemAlloc's); cuCtxSynchronize returns
 * the sticky error. FAKE_DEEP_STACK_KERNEL grows the context's per-thread stack to
 * FAKE_DEEP_STACK. Any other kernel does nothing. */
typedef struct fake_module {
    char *image;
} *CUmodule;
typedef struct fake_function {
    char name[64];
} *CUfunction;
typedef void *CUstream;
static CUresult sticky;

CUresult cuModuleLoadData(CUmodule *module, const void *image)
{
    ENTER(cuModuleLoadData);
    NEED_INIT();
    if (!current)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (!module || !image)
        return CUDA_ERROR_INVALID_VALUE;
    CUmodule m = calloc(1, sizeof *m);
    if (!m || !(m->image = strdup(image)))
        abort(); /* test double */
    *module = m;
    return CUDA_SUCCESS;
}

CUresult cuModuleGetFunction(CUfunction *fn, CUmodule mod, const char *name)
{
    ENTER(cuModuleGetFunction);
    NEED_INIT();
    if (!fn || !mod || !name || strlen(name) >= sizeof((*fn)->name))
        return CUDA_ERROR_INVALID_VALUE;
    char entry[96];
    snprintf(entry, sizeof entry, ".entry %s(", name);
    if (!strstr(mod->image, entry))
        return CUDA_ERROR_NOT_FOUND;
    CUfunction f = calloc(1, sizeof *f);
    if (!f)
        abort();
    strcpy(f->name, name);
    *fn = f;
    return CUDA_SUCCESS;
}

CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned shared, CUstream stream, void **params, void **extra)
{
    ENTER(cuLaunchKernel);
    NEED_INIT();
    (void)gx, (void)gy, (void)gz, (void)bx, (void)by, (void)bz, (void)shared, (void)stream, (void)extra;
    if (!current)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (!f)
        return CUDA_ERROR_INVALID_HANDLE;
    if (strcmp(f->name, FAKE_DEEP_STACK_KERNEL) == 0) {
        /* The driver grows the context's stack for a launch that needs more, and keeps it. */
        pthread_mutex_lock(&mu);
        if (current->stack < FAKE_DEEP_STACK)
            current->stack = FAKE_DEEP_STACK;
        pthread_mutex_unlock(&mu);
        return CUDA_SUCCESS;
    }
    if (strcmp(f->name, "frmps_prime_fault") != 0)
        return CUDA_SUCCESS;
    if (!params || !params[0])
        return CUDA_ERROR_INVALID_VALUE;
    uintptr_t p = (uintptr_t) * (uint64_t *)params[0];
    bool known = false;
    pthread_mutex_lock(&mu);
    for (size_t i = 0; i < plain_allocs.n; i++)
        known |= p >= plain_allocs.v[i].va && p + 12 <= plain_allocs.v[i].va + plain_allocs.v[i].size;
    pthread_mutex_unlock(&mu);
    if (!known)
        sticky = CUDA_ERROR_ILLEGAL_ADDRESS;
    else if ((p + 4) % 8 != 0)
        sticky = CUDA_ERROR_MISALIGNED_ADDRESS;
    return CUDA_SUCCESS;
}

CUresult cuCtxSynchronize(void)
{
    ENTER(cuCtxSynchronize);
    NEED_INIT();
    return current ? sticky : CUDA_ERROR_INVALID_CONTEXT;
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags);
CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                             CUdriverProcAddressQueryResult *symbolStatus);

struct proc {
    const char *base;
    int vmin;
    void *fn;
};

static CUresult lookup(const char *symbol, void **pfn, int version)
{
    /* Newest ABI first: the first entry whose vmin <= version wins. */
    const struct proc table[] = {
        {"cuGetProcAddress", 12000, (void *)&cuGetProcAddress_v2},
        {"cuGetProcAddress", 11030, (void *)&cuGetProcAddress},
        {"cuMemAlloc", 3020, (void *)&cuMemAlloc_v2},
        {"cuMemFree", 3020, (void *)&cuMemFree_v2},
        {"cuInit", 2000, (void *)&cuInit},
        {"cuDeviceGet", 2000, (void *)&cuDeviceGet},
        {"cuCtxGetCurrent", 4000, (void *)&cuCtxGetCurrent},
        {"cuCtxSetCurrent", 4000, (void *)&cuCtxSetCurrent},
        {"cuMemCreate", 10020, (void *)&cuMemCreate},
        {"cuMemMap", 10020, (void *)&cuMemMap},
    };
    if (!symbol || !pfn)
        return CUDA_ERROR_INVALID_VALUE;
    bool known = false;
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++) {
        if (strcmp(table[i].base, symbol) != 0)
            continue;
        known = true;
        if (version >= table[i].vmin) {
            *pfn = table[i].fn;
            return CUDA_SUCCESS;
        }
    }
    *pfn = NULL;
    return known ? CUDA_ERROR_NOT_SUPPORTED : CUDA_ERROR_NOT_FOUND;
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    ENTER(cuGetProcAddress);
    (void)flags;
    return lookup(symbol, pfn, cudaVersion);
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
                             CUdriverProcAddressQueryResult *symbolStatus)
{
    ENTER(cuGetProcAddress_v2);
    (void)flags;
    CUresult rc = lookup(symbol, pfn, cudaVersion);
    if (symbolStatus)
        *symbolStatus = rc == CUDA_SUCCESS             ? CU_GET_PROC_ADDRESS_SUCCESS
                        : rc == CUDA_ERROR_NOT_FOUND ? CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND
                                                     : CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
    return rc;
}
