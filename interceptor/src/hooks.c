/* Driver-API hooks, active when the library is LD_PRELOADed.
 *
 * cudart (bundled in torch and vLLM wheels) does not call cuMemAlloc by symbol:
 * it dlopens libcuda.so.1, looks up cuGetProcAddress(_v2) with dlsym on that
 * handle (which LD_PRELOAD does not interpose), then fetches every driver entry
 * point through it. So we hook dlsym (for the two cuGetProcAddress names and the
 * allocation entry points) and cuGetProcAddress (to hand out our allocation
 * entry points), keyed by symbol name and requested API version.
 *
 * Limitation: a dlsym(RTLD_NEXT, ...) call made by the application is resolved
 * relative to this library, which comes first in the preload order; the result
 * is then the first definition after the interceptor rather than after the
 * caller. */
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

/* The one list of hooked symbols: exported name, the base name cuGetProcAddress
 * is asked for, and the cudaVersion range [min, max) for which the driver
 * returns exactly this ABI (max 0 = open-ended). cuMemAlloc/cuMemFree before
 * 3.2 are the 32-bit-pointer ABIs: never hooked. */
#define FRMPS_HOOKS(X)                                       \
    X(cuMemAlloc_v2, "cuMemAlloc", 3020, 0)                  \
    X(cuMemFree_v2, "cuMemFree", 3020, 0)                    \
    X(cuGetProcAddress, "cuGetProcAddress", 11030, 12000)    \
    X(cuGetProcAddress_v2, "cuGetProcAddress", 12000, 0)

/* Prototypes of the hooks, with the driver's exact signatures (the pfn_ types
 * are checked against cuda.h on the GPU machine). */
#define FRMPS_HOOK_PROTO(name, base, vmin, vmax) FRMPS_API extern __typeof__(*(pfn_##name)0) name;
FRMPS_HOOKS(FRMPS_HOOK_PROTO)
#undef FRMPS_HOOK_PROTO

struct hook {
    const char *name;
    const char *base;
    int vmin, vmax;
    void *fn;
};

static const struct hook hooks[] = {
#define FRMPS_HOOK_ENTRY(name, base, vmin, vmax) {#name, base, vmin, vmax, (void *)&name},
    FRMPS_HOOKS(FRMPS_HOOK_ENTRY)
#undef FRMPS_HOOK_ENTRY
};

#define NHOOKS (sizeof hooks / sizeof hooks[0])

/* Hooks take effect only when enabled and the driver loaded; otherwise the
 * caller gets exactly what it would have got without us. */
static bool hooks_live(void) { return !frmps_config_disabled() && frmps_driver_get() != NULL; }

static void *proc_substitute(const char *symbol, int version, void *found)
{
    if (!found || !symbol || symbol[0] != 'c' || symbol[1] != 'u')
        return found;
    for (size_t i = 0; i < NHOOKS; i++) {
        const struct hook *h = &hooks[i];
        if (strcmp(h->base, symbol) == 0 && version >= h->vmin && (h->vmax == 0 || version < h->vmax))
            return hooks_live() ? h->fn : found;
    }
    return found;
}

FRMPS_API CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags)
{
    const struct frmps_driver *d = frmps_driver_get();
    if (!d)
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult rc = d->cuGetProcAddress(symbol, pfn, cudaVersion, flags);
    if (rc == CUDA_SUCCESS && pfn)
        *pfn = proc_substitute(symbol, cudaVersion, *pfn);
    return rc;
}

FRMPS_API CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                       cuuint64_t flags, CUdriverProcAddressQueryResult *symbolStatus)
{
    const struct frmps_driver *d = frmps_driver_get();
    if (!d)
        return CUDA_ERROR_NOT_INITIALIZED;
    CUresult rc = d->cuGetProcAddress_v2(symbol, pfn, cudaVersion, flags, symbolStatus);
    if (rc == CUDA_SUCCESS && pfn)
        *pfn = proc_substitute(symbol, cudaVersion, *pfn);
    return rc;
}

FRMPS_API CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    const struct frmps_driver *d = frmps_driver_get();
    if (!d)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (dptr && bytesize && !frmps_config_disabled()) {
        int st = frmps_carve(bytesize, dptr);
        if (st == FRMPS_OK)
            return CUDA_SUCCESS;
        if (st != FRMPS_E_STATE) {
            /* Inside a sharing region: failing is right (unshared memory would
             * silently break failover); cudart cannot show our message. */
            fprintf(stderr, "frmps_vmm: cuMemAlloc of %zu bytes in a shared region failed: %s\n",
                    bytesize, frmps_last_error());
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
    }
    return d->cuMemAlloc_v2(dptr, bytesize);
}

FRMPS_API CUresult cuMemFree_v2(CUdeviceptr dptr)
{
    const struct frmps_driver *d = frmps_driver_get();
    if (!d)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (dptr && frmps_uncarve(dptr))
        return CUDA_SUCCESS;
    return d->cuMemFree_v2(dptr);
}

/* Set while this thread is inside our dlsym: anything the loader or the driver
 * load calls back into dlsym gets the raw answer. */
static _Thread_local int in_dlsym;

FRMPS_API void *dlsym(void *handle, const char *name)
{
    void *found = frmps_real_dlsym(handle, name);
    if (in_dlsym || !found || name[0] != 'c' || name[1] != 'u')
        return found;
    in_dlsym = 1;
    void *ret = found;
    for (size_t i = 0; i < NHOOKS; i++) {
        if (strcmp(hooks[i].name, name) == 0) {
            if (hooks_live())
                ret = hooks[i].fn;
            break;
        }
    }
    in_dlsym = 0;
    return ret;
}
