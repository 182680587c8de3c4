/* Pools: VMM allocations with POSIX-fd handles at reserved VA ranges, the
 * standby's scratch backing, and first-fit carve-outs for the allocator/hooks. */
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* cudaMalloc returns 256-byte aligned pointers; torch's allocator assumes at
 * least that. 512 keeps every carve-out friendly to vectorised kernels. */
#define CARVE_ALIGN ((size_t)512)

enum pool_kind {
    POOL_OWNED,    /* our cuMemCreate handle, mapped */
    POOL_IMPORTED, /* an imported handle, mapped */
    POOL_SCRATCH,  /* one scratch handle mapped repeatedly over the range */
    POOL_EMPTY     /* reserved VA, nothing mapped (a swap failed half-way) */
};

struct extent {
    size_t off, len;
};

struct extvec {
    struct extent *v;
    size_t n, cap;
};

struct frmps_pool {
    char tag[64];
    unsigned index;
    int device;
    size_t size;
    CUdeviceptr va;
    enum pool_kind kind;
    CUmemGenericAllocationHandle handle; /* OWNED / IMPORTED */
    CUmemGenericAllocationHandle scratch; /* SCRATCH */
    CUmemGenericAllocationHandle scratch_tail; /* SCRATCH, when size is not a multiple of chunk */
    size_t chunk, tail;
    int readonly;
    struct extvec free_list; /* sorted by offset, coalesced */
    struct extvec live;      /* carve-outs in use */
    size_t used;
};

/* Pool table and allocation region. One mutex: pool operations are rare, and
 * carve-outs are a short scan. */
static pthread_mutex_t table_mu = PTHREAD_MUTEX_INITIALIZER;
static frmps_pool **table;
static size_t table_len, table_cap;
static bool region_on;
static char region_tag[64];

static int extvec_insert(struct extvec *ev, size_t at, struct extent e)
{
    if (ev->n == ev->cap) {
        size_t ncap = ev->cap ? ev->cap * 2 : 16;
        struct extent *nv = realloc(ev->v, ncap * sizeof *nv);
        if (!nv)
            return frmps_set_error(FRMPS_E_NOMEM, "carve-out table: out of host memory");
        ev->v = nv;
        ev->cap = ncap;
    }
    memmove(&ev->v[at + 1], &ev->v[at], (ev->n - at) * sizeof *ev->v);
    ev->v[at] = e;
    ev->n++;
    return FRMPS_OK;
}

static void extvec_remove(struct extvec *ev, size_t at)
{
    memmove(&ev->v[at], &ev->v[at + 1], (ev->n - at - 1) * sizeof *ev->v);
    ev->n--;
}

static int table_add(frmps_pool *p)
{
    if (table_len == table_cap) {
        size_t ncap = table_cap ? table_cap * 2 : 8;
        frmps_pool **nt = realloc(table, ncap * sizeof *nt);
        if (!nt)
            return frmps_set_error(FRMPS_E_NOMEM, "pool table: out of host memory");
        table = nt;
        table_cap = ncap;
    }
    table[table_len++] = p;
    return FRMPS_OK;
}

static void table_remove(frmps_pool *p)
{
    for (size_t i = 0; i < table_len; i++) {
        if (table[i] == p) {
            memmove(&table[i], &table[i + 1], (table_len - i - 1) * sizeof *table);
            table_len--;
            return;
        }
    }
}

/* Pool state is read by carve-outs under table_mu: change it under table_mu too. */
static void set_kind(frmps_pool *p, enum pool_kind kind)
{
    pthread_mutex_lock(&table_mu);
    p->kind = kind;
    pthread_mutex_unlock(&table_mu);
}

static bool copy_tag(char dst[64], const char *tag)
{
    if (!tag || !*tag || strlen(tag) >= 64)
        return false;
    strcpy(dst, tag);
    return true;
}

static void pool_prop(CUmemAllocationProp *prop, int device)
{
    memset(prop, 0, sizeof *prop);
    prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop->requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop->location.id = device;
}

/* The driver needs cuInit and, for the VMM calls, a current context. Torch has
 * made the device's primary context current by the time it allocates; a bare
 * caller (the standby before torch initialises, the tests) gets it here. */
static int driver_ready(int device, const struct frmps_driver **out)
{
    if (frmps_config_disabled())
        return frmps_set_error(FRMPS_E_DISABLED, "frmps_vmm is disabled (FRMPS_VMM_DISABLE=1)");
    const struct frmps_driver *d = frmps_driver_get();
    if (!d)
        return FRMPS_E_NOLIB;
    if (device < 0)
        return frmps_set_error(FRMPS_E_INVAL, "device %d: must be >= 0", device);
    CUresult rc = d->cuInit(0);
    if (rc != CUDA_SUCCESS)
        return frmps_driver_error("cuInit", rc);
    CUcontext ctx = NULL;
    rc = d->cuCtxGetCurrent(&ctx);
    if (rc != CUDA_SUCCESS)
        return frmps_driver_error("cuCtxGetCurrent", rc);
    if (!ctx) {
        CUdevice dev;
        if ((rc = d->cuDeviceGet(&dev, device)) != CUDA_SUCCESS)
            return frmps_driver_error("cuDeviceGet", rc);
        if ((rc = d->cuDevicePrimaryCtxRetain(&ctx, dev)) != CUDA_SUCCESS)
            return frmps_driver_error("cuDevicePrimaryCtxRetain", rc);
        if ((rc = d->cuCtxSetCurrent(ctx)) != CUDA_SUCCESS)
            return frmps_driver_error("cuCtxSetCurrent", rc);
    }
    *out = d;
    return FRMPS_OK;
}

static int granularity(const struct frmps_driver *d, int device, size_t *out)
{
    CUmemAllocationProp prop;
    pool_prop(&prop, device);
    size_t g = 0;
    CUresult rc = d->cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    if (rc != CUDA_SUCCESS)
        return frmps_driver_error("cuMemGetAllocationGranularity", rc);
    if (g == 0 || (g & (g - 1)) != 0)
        return frmps_set_error(FRMPS_E_DRIVER, "driver reported granularity %zu: not a power of two", g);
    *out = g;
    return FRMPS_OK;
}

static int round_up(size_t size, size_t g, size_t *out)
{
    if (size == 0)
        return frmps_set_error(FRMPS_E_INVAL, "pool size must be > 0");
    if (size > SIZE_MAX - (g - 1))
        return frmps_set_error(FRMPS_E_INVAL, "pool size %zu too large", size);
    *out = (size + g - 1) & ~(g - 1);
    return FRMPS_OK;
}

FRMPS_API int frmps_granularity(int device, size_t *out)
{
    const struct frmps_driver *d;
    if (!out)
        return frmps_set_error(FRMPS_E_INVAL, "frmps_granularity: out is NULL");
    int st = driver_ready(device, &d);
    return st ? st : granularity(d, device, out);
}

static int set_access(const struct frmps_driver *d, CUdeviceptr va, size_t size, int device,
                      int readonly)
{
    CUmemAccessDesc desc;
    memset(&desc, 0, sizeof desc);
    desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    desc.location.id = device;
    desc.flags = readonly ? CU_MEM_ACCESS_FLAGS_PROT_READ : CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CUresult rc = d->cuMemSetAccess(va, size, &desc, 1);
    return rc == CUDA_SUCCESS ? FRMPS_OK : frmps_driver_error("cuMemSetAccess", rc);
}

/* Allocates the struct and reserves VA; on success the caller owns both. */
static int pool_begin(const char *tag, unsigned index, size_t size, int device, frmps_pool **out,
                      const struct frmps_driver **dout, size_t *gran)
{
    frmps_pool *p = calloc(1, sizeof *p);
    if (!p)
        return frmps_set_error(FRMPS_E_NOMEM, "pool: out of host memory");
    if (!copy_tag(p->tag, tag)) {
        free(p);
        return frmps_set_error(FRMPS_E_INVAL, "pool tag must be 1..63 bytes");
    }
    const struct frmps_driver *d;
    int st = driver_ready(device, &d);
    if (!st)
        st = granularity(d, device, gran);
    if (!st)
        st = round_up(size, *gran, &p->size);
    if (st) {
        free(p);
        return st;
    }
    CUresult rc = d->cuMemAddressReserve(&p->va, p->size, *gran, 0, 0);
    if (rc != CUDA_SUCCESS) {
        free(p);
        return frmps_driver_error("cuMemAddressReserve", rc);
    }
    p->index = index;
    p->device = device;
    p->kind = POOL_EMPTY;
    *out = p;
    *dout = d;
    return FRMPS_OK;
}

/* Releases a scratch-backed pool's one or two private handles (unmapped first). */
static CUresult scratch_release(const struct frmps_driver *d, frmps_pool *p)
{
    CUresult rc = d->cuMemRelease(p->scratch), rc2 = CUDA_SUCCESS;
    if (p->tail)
        rc2 = d->cuMemRelease(p->scratch_tail);
    p->tail = 0;
    return rc != CUDA_SUCCESS ? rc : rc2;
}

/* Frees whatever the pool holds; the driver errors of cleanup are not the
 * caller's first error, so they only surface when nothing else failed. */
static int pool_release(const struct frmps_driver *d, frmps_pool *p)
{
    int st = FRMPS_OK;
    CUresult rc;
    if (p->kind != POOL_EMPTY && (rc = d->cuMemUnmap(p->va, p->size)) != CUDA_SUCCESS)
        st = frmps_driver_error("cuMemUnmap", rc);
    if ((p->kind == POOL_OWNED || p->kind == POOL_IMPORTED) &&
        (rc = d->cuMemRelease(p->handle)) != CUDA_SUCCESS && !st)
        st = frmps_driver_error("cuMemRelease", rc);
    if (p->kind == POOL_SCRATCH && (rc = scratch_release(d, p)) != CUDA_SUCCESS && !st)
        st = frmps_driver_error("cuMemRelease(scratch)", rc);
    if (p->va && (rc = d->cuMemAddressFree(p->va, p->size)) != CUDA_SUCCESS && !st)
        st = frmps_driver_error("cuMemAddressFree", rc);
    free(p->free_list.v);
    free(p->live.v);
    free(p);
    return st;
}

/* Registers the pool (whole range free for carve-outs). */
static int pool_finish(const struct frmps_driver *d, frmps_pool *p, frmps_pool **out)
{
    int st = extvec_insert(&p->free_list, 0, (struct extent){0, p->size});
    if (!st) {
        pthread_mutex_lock(&table_mu);
        st = table_add(p);
        pthread_mutex_unlock(&table_mu);
    }
    if (st) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", frmps_last_error());
        pool_release(d, p);
        return frmps_set_error(st, "%s", msg);
    }
    *out = p;
    return FRMPS_OK;
}

FRMPS_API int frmps_pool_create(const char *tag, unsigned index, size_t size, int device,
                                frmps_pool **out)
{
    if (!out)
        return frmps_set_error(FRMPS_E_INVAL, "out pointer is NULL");
    *out = NULL;
    const struct frmps_driver *d;
    size_t gran;
    frmps_pool *p;
    int st = pool_begin(tag, index, size, device, &p, &d, &gran);
    if (st)
        return st;
    CUmemAllocationProp prop;
    pool_prop(&prop, device);
    CUresult rc = d->cuMemCreate(&p->handle, p->size, &prop, 0);
    if (rc != CUDA_SUCCESS) {
        st = frmps_driver_error("cuMemCreate", rc);
        pool_release(d, p);
        return st;
    }
    if ((rc = d->cuMemMap(p->va, p->size, 0, p->handle, 0)) != CUDA_SUCCESS) {
        st = frmps_driver_error("cuMemMap", rc);
        d->cuMemRelease(p->handle);
        pool_release(d, p);
        return st;
    }
    p->kind = POOL_OWNED;
    if ((st = set_access(d, p->va, p->size, device, 0)) != FRMPS_OK) {
        pool_release(d, p);
        return st;
    }
    return pool_finish(d, p, out);
}

FRMPS_API int frmps_pool_export_fd(frmps_pool *p, int *fd_out)
{
    const struct frmps_driver *d;
    if (!p || !fd_out)
        return frmps_set_error(FRMPS_E_INVAL, "frmps_pool_export_fd: NULL argument");
    int st = driver_ready(p->device, &d);
    if (st)
        return st;
    if (p->kind != POOL_OWNED && p->kind != POOL_IMPORTED)
        return frmps_set_error(FRMPS_E_STATE, "pool %s/%u has no shareable handle to export", p->tag,
                               p->index);
    int fd = -1;
    CUresult rc = d->cuMemExportToShareableHandle(&fd, p->handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    if (rc != CUDA_SUCCESS)
        return frmps_driver_error("cuMemExportToShareableHandle", rc);
    *fd_out = fd;
    return FRMPS_OK;
}

/* Import `fd` and map it over the whole (reserved, unmapped) range of p. */
static int map_import(const struct frmps_driver *d, frmps_pool *p, int fd, int readonly)
{
    if (fd < 0)
        return frmps_set_error(FRMPS_E_INVAL, "fd %d is not a valid descriptor", fd);
    CUmemGenericAllocationHandle h;
    CUresult rc = d->cuMemImportFromShareableHandle(&h, (void *)(intptr_t)fd,
                                                    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (rc != CUDA_SUCCESS)
        return frmps_driver_error("cuMemImportFromShareableHandle", rc);
    if ((rc = d->cuMemMap(p->va, p->size, 0, h, 0)) != CUDA_SUCCESS) {
        int st = frmps_set_error(FRMPS_E_DRIVER,
                                 "cuMemMap of the imported handle over %zu bytes failed (%d): is the "
                                 "exported pool smaller than the %s/%u layout says?",
                                 p->size, (int)rc, p->tag, p->index);
        d->cuMemRelease(h);
        return st;
    }
    int st = set_access(d, p->va, p->size, p->device, readonly);
    if (st) {
        d->cuMemUnmap(p->va, p->size);
        d->cuMemRelease(h);
        return st;
    }
    p->handle = h;
    p->readonly = readonly;
    set_kind(p, POOL_IMPORTED);
    return FRMPS_OK;
}

FRMPS_API int frmps_pool_import(const char *tag, unsigned index, int fd, size_t size, int device,
                                int readonly, frmps_pool **out)
{
    if (!out)
        return frmps_set_error(FRMPS_E_INVAL, "out pointer is NULL");
    *out = NULL;
    const struct frmps_driver *d;
    size_t gran;
    frmps_pool *p;
    int st = pool_begin(tag, index, size, device, &p, &d, &gran);
    if (st)
        return st;
    if ((st = map_import(d, p, fd, readonly)) != FRMPS_OK) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", frmps_last_error());
        pool_release(d, p);
        return frmps_set_error(st, "%s", msg);
    }
    return pool_finish(d, p, out);
}

FRMPS_API int frmps_pool_reserve_scratch(const char *tag, unsigned index, size_t size, int device,
                                         size_t scratch_chunk, frmps_pool **out)
{
    if (!out)
        return frmps_set_error(FRMPS_E_INVAL, "out pointer is NULL");
    *out = NULL;
    const struct frmps_driver *d;
    size_t gran, chunk = 0;
    frmps_pool *p;
    int st = pool_begin(tag, index, size, device, &p, &d, &gran);
    if (st)
        return st;
    if ((st = round_up(scratch_chunk ? scratch_chunk : gran, gran, &chunk)) != FRMPS_OK) {
        pool_release(d, p);
        return st;
    }
    if (chunk > p->size)
        chunk = p->size;
    /* The driver maps a handle only whole (offset 0, its full size: a shorter
     * mapping is CUDA_ERROR_NOT_SUPPORTED on the H100/H200), so a pool that is not
     * a multiple of the chunk gets a second, smaller handle for its tail. */
    size_t tail = p->size % chunk, whole = p->size - tail;
    CUmemAllocationProp prop;
    pool_prop(&prop, device);
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE; /* private to this process */
    CUresult rc = d->cuMemCreate(&p->scratch, chunk, &prop, 0);
    if (rc != CUDA_SUCCESS) {
        st = frmps_driver_error("cuMemCreate(scratch)", rc);
        pool_release(d, p);
        return st;
    }
    if (tail && (rc = d->cuMemCreate(&p->scratch_tail, tail, &prop, 0)) != CUDA_SUCCESS) {
        st = frmps_driver_error("cuMemCreate(scratch tail)", rc);
        d->cuMemRelease(p->scratch);
        pool_release(d, p);
        return st;
    }
    p->tail = tail;
    size_t off = 0;
    for (; off < whole; off += chunk)
        if ((rc = d->cuMemMap(p->va + off, chunk, 0, p->scratch, 0)) != CUDA_SUCCESS)
            break;
    if (rc == CUDA_SUCCESS && tail) {
        if ((rc = d->cuMemMap(p->va + whole, tail, 0, p->scratch_tail, 0)) == CUDA_SUCCESS)
            off += tail;
    }
    if (rc != CUDA_SUCCESS) {
        st = frmps_driver_error("cuMemMap(scratch)", rc);
        if (off)
            d->cuMemUnmap(p->va, off);
        scratch_release(d, p);
        pool_release(d, p);
        return st;
    }
    p->kind = POOL_SCRATCH;
    p->chunk = chunk;
    if ((st = set_access(d, p->va, p->size, device, 0)) != FRMPS_OK) {
        pool_release(d, p);
        return st;
    }
    return pool_finish(d, p, out);
}

FRMPS_API int frmps_pool_swap_to_import(frmps_pool *p, int fd, int readonly)
{
    const struct frmps_driver *d;
    if (!p)
        return frmps_set_error(FRMPS_E_INVAL, "frmps_pool_swap_to_import: pool is NULL");
    int st = driver_ready(p->device, &d);
    if (st)
        return st;
    if (p->kind != POOL_SCRATCH && p->kind != POOL_EMPTY)
        return frmps_set_error(FRMPS_E_STATE, "pool %s/%u is not scratch-backed", p->tag, p->index);
    if (p->kind == POOL_SCRATCH) {
        /* One call over every scratch mapping: the expensive step, done at sleep. */
        CUresult rc = d->cuMemUnmap(p->va, p->size);
        if (rc != CUDA_SUCCESS)
            return frmps_driver_error("cuMemUnmap(scratch)", rc);
        scratch_release(d, p);
        set_kind(p, POOL_EMPTY);
    }
    return map_import(d, p, fd, readonly);
}

FRMPS_API int frmps_pool_set_access(frmps_pool *p, int readonly)
{
    const struct frmps_driver *d;
    if (!p)
        return frmps_set_error(FRMPS_E_INVAL, "frmps_pool_set_access: pool is NULL");
    int st = driver_ready(p->device, &d);
    if (st)
        return st;
    if (p->kind == POOL_EMPTY)
        return frmps_set_error(FRMPS_E_STATE, "pool %s/%u has nothing mapped", p->tag, p->index);
    if ((st = set_access(d, p->va, p->size, p->device, readonly)) == FRMPS_OK)
        p->readonly = readonly;
    return st;
}

FRMPS_API unsigned long long frmps_pool_ptr(const frmps_pool *p) { return p ? p->va : 0; }

FRMPS_API size_t frmps_pool_size(const frmps_pool *p) { return p ? p->size : 0; }

FRMPS_API size_t frmps_pool_used(const frmps_pool *p)
{
    if (!p)
        return 0;
    pthread_mutex_lock(&table_mu);
    size_t used = p->used;
    pthread_mutex_unlock(&table_mu);
    return used;
}

FRMPS_API int frmps_pool_destroy(frmps_pool *p)
{
    if (!p)
        return FRMPS_OK;
    const struct frmps_driver *d = frmps_driver_get();
    pthread_mutex_lock(&table_mu);
    table_remove(p);
    pthread_mutex_unlock(&table_mu);
    if (!d) { /* cannot happen for a pool that exists; keep the memory rather than crash */
        return FRMPS_E_NOLIB;
    }
    return pool_release(d, p);
}

/* ---------------------------------------------------------------- carve-outs */

FRMPS_API int frmps_alloc_begin(const char *tag)
{
    char t[64];
    if (!copy_tag(t, tag))
        return frmps_set_error(FRMPS_E_INVAL, "allocation tag must be 1..63 bytes");
    pthread_mutex_lock(&table_mu);
    int st = FRMPS_OK;
    if (region_on)
        st = frmps_set_error(FRMPS_E_STATE, "allocation region %s is already open", region_tag);
    else {
        memcpy(region_tag, t, sizeof t);
        region_on = true;
    }
    pthread_mutex_unlock(&table_mu);
    return st;
}

FRMPS_API void frmps_alloc_end(void)
{
    pthread_mutex_lock(&table_mu);
    region_on = false;
    region_tag[0] = '\0';
    pthread_mutex_unlock(&table_mu);
}

bool frmps_region_active(void)
{
    pthread_mutex_lock(&table_mu);
    bool on = region_on;
    pthread_mutex_unlock(&table_mu);
    return on;
}

/* First fit over the tag's mapped pools, in creation order: the same sequence
 * of requests gives the same offsets in the active and in the standby. */
static bool carve_from(frmps_pool *p, size_t len, CUdeviceptr *out)
{
    for (size_t i = 0; i < p->free_list.n; i++) {
        struct extent *e = &p->free_list.v[i];
        if (e->len < len)
            continue;
        struct extent got = {e->off, len};
        size_t at = p->live.n;
        if (extvec_insert(&p->live, at, got) != FRMPS_OK)
            return false;
        e->off += len;
        e->len -= len;
        if (e->len == 0)
            extvec_remove(&p->free_list, i);
        p->used += len;
        *out = p->va + got.off;
        return true;
    }
    return false;
}

int frmps_carve(size_t size, CUdeviceptr *out)
{
    if (!frmps_region_active())
        return FRMPS_E_STATE; /* fast path, before validating the size */
    if (size == 0 || size > SIZE_MAX - CARVE_ALIGN)
        return frmps_set_error(FRMPS_E_INVAL, "carve-out size %zu is invalid", size);
    size_t len = (size + CARVE_ALIGN - 1) & ~(CARVE_ALIGN - 1);
    pthread_mutex_lock(&table_mu);
    int st;
    if (!region_on) {
        st = FRMPS_E_STATE; /* closed meanwhile: the caller passes through */
    } else {
        st = frmps_set_error(FRMPS_E_NOMEM, "no room for %zu bytes in the pools tagged %s", size,
                             region_tag);
        bool found_pool = false;
        for (size_t i = 0; i < table_len; i++) {
            frmps_pool *p = table[i];
            if (p->kind == POOL_EMPTY || strcmp(p->tag, region_tag) != 0)
                continue;
            found_pool = true;
            if (carve_from(p, len, out)) {
                st = FRMPS_OK;
                break;
            }
        }
        if (!found_pool)
            st = frmps_set_error(FRMPS_E_NOMEM, "no pool tagged %s exists (create it before "
                                                "opening its allocation region)", region_tag);
    }
    pthread_mutex_unlock(&table_mu);
    return st;
}

static void free_extent(frmps_pool *p, struct extent e)
{
    struct extvec *fl = &p->free_list;
    size_t at = 0;
    while (at < fl->n && fl->v[at].off < e.off)
        at++;
    bool merge_prev = at > 0 && fl->v[at - 1].off + fl->v[at - 1].len == e.off;
    bool merge_next = at < fl->n && e.off + e.len == fl->v[at].off;
    if (merge_prev && merge_next) {
        fl->v[at - 1].len += e.len + fl->v[at].len;
        extvec_remove(fl, at);
    } else if (merge_prev) {
        fl->v[at - 1].len += e.len;
    } else if (merge_next) {
        fl->v[at].off = e.off;
        fl->v[at].len += e.len;
    } else if (extvec_insert(fl, at, e) != FRMPS_OK) {
        /* Out of host memory for the free list: the range leaks inside the pool
         * (the pool stays usable); nothing outside the pool is affected. */
        return;
    }
}

bool frmps_uncarve(CUdeviceptr ptr)
{
    bool found = false;
    pthread_mutex_lock(&table_mu);
    for (size_t i = 0; i < table_len && !found; i++) {
        frmps_pool *p = table[i];
        if (ptr < p->va || ptr >= p->va + p->size)
            continue;
        size_t off = (size_t)(ptr - p->va);
        for (size_t j = 0; j < p->live.n; j++) {
            if (p->live.v[j].off == off) {
                struct extent e = p->live.v[j];
                extvec_remove(&p->live, j);
                p->used -= e.len;
                free_extent(p, e);
                found = true;
                break;
            }
        }
    }
    pthread_mutex_unlock(&table_mu);
    return found;
}

FRMPS_API void *frmps_malloc(ssize_t size, int device, void *stream)
{
    (void)stream; /* VMM memory is not stream-ordered */
    if (size <= 0) {
        frmps_set_error(FRMPS_E_INVAL, "frmps_malloc: size %zd", size);
        return NULL;
    }
    const struct frmps_driver *d = frmps_driver_get();
    if (!d)
        return NULL;
    if (!frmps_config_disabled()) {
        CUdeviceptr p;
        int st = frmps_carve((size_t)size, &p);
        if (st == FRMPS_OK)
            return (void *)(uintptr_t)p;
        if (st != FRMPS_E_STATE) {
            /* torch turns NULL into an OOM error without our message: say it here. */
            fprintf(stderr, "frmps_vmm: shared allocation of %zd bytes on device %d failed: %s\n",
                    size, device, frmps_last_error());
            return NULL;
        }
    }
    CUdeviceptr p = 0;
    CUresult rc = d->cuMemAlloc_v2(&p, (size_t)size);
    if (rc != CUDA_SUCCESS) {
        frmps_driver_error("cuMemAlloc_v2", rc);
        return NULL;
    }
    return (void *)(uintptr_t)p;
}

FRMPS_API void frmps_free(void *ptr, ssize_t size, int device, void *stream)
{
    (void)size;
    (void)device;
    (void)stream;
    if (!ptr)
        return;
    if (frmps_uncarve((CUdeviceptr)(uintptr_t)ptr))
        return;
    const struct frmps_driver *d = frmps_driver_get();
    if (!d)
        return;
    CUresult rc = d->cuMemFree_v2((CUdeviceptr)(uintptr_t)ptr);
    if (rc != CUDA_SUCCESS)
        frmps_driver_error("cuMemFree_v2", rc);
}
