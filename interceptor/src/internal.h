/* Internal declarations shared by the interceptor's translation units. */
#ifndef FRMPS_INTERNAL_H
#define FRMPS_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>

#include "cuda_decls.h"
#include "frmps_vmm.h"

/* Every driver entry point the interceptor calls, resolved by exported ABI name
 * (the versioned names, so no cuGetProcAddress version games are needed). */
#define FRMPS_DRIVER_FUNCS(X)            \
    X(cuInit)                            \
    X(cuDeviceGet)                       \
    X(cuCtxGetCurrent)                   \
    X(cuCtxSetCurrent)                   \
    X(cuDevicePrimaryCtxRetain)          \
    X(cuGetErrorName)                    \
    X(cuMemAlloc_v2)                     \
    X(cuMemFree_v2)                      \
    X(cuMemAddressReserve)               \
    X(cuMemAddressFree)                  \
    X(cuMemCreate)                       \
    X(cuMemRelease)                      \
    X(cuMemMap)                          \
    X(cuMemUnmap)                        \
    X(cuMemSetAccess)                    \
    X(cuMemExportToShareableHandle)      \
    X(cuMemImportFromShareableHandle)    \
    X(cuMemGetAllocationGranularity)     \
    X(cuGetProcAddress)                  \
    X(cuGetProcAddress_v2)

struct frmps_driver {
#define FRMPS_DRIVER_FIELD(name) pfn_##name name;
    FRMPS_DRIVER_FUNCS(FRMPS_DRIVER_FIELD)
#undef FRMPS_DRIVER_FIELD
};

/* Loads the driver once (pthread_once). Returns NULL, with the thread's error
 * set, if it cannot be loaded; callers then pass through or fail. */
const struct frmps_driver *frmps_driver_get(void);
/* The raw dlsym, never our hook (for driver symbols and the dlsym hook). */
void *frmps_real_dlsym(void *handle, const char *name);
bool frmps_config_disabled(void);

int frmps_set_error(int status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
int frmps_driver_error(const char *call, CUresult rc);
void frmps_clear_error(void);

/* Carve-out interface used by the allocator and the hooks. */
int frmps_carve(size_t size, CUdeviceptr *out); /* FRMPS_E_STATE (no message): no region open */
bool frmps_uncarve(CUdeviceptr ptr);                    /* true if ptr was a carve-out (now freed) */
bool frmps_region_active(void);

#endif
