/* frmps_vmm: shareable CUDA VMM memory pools for an engine's weights and KV cache.
 *
 * A pool is one VMM allocation (cuMemCreate with a POSIX-fd handle) mapped at a
 * reserved virtual address range. The active engine creates its pools and exports
 * one fd per pool to the supervisor; a standby imports those fds (read-only until
 * it takes over). Layout choice: ONE pool per (tag, index), not one handle per
 * allocation: the engine lays out a "weights" pool and a "kv_cache" pool whose
 * sizes both processes derive from the model config, so a standby can reserve the
 * same sizes before it sees any fd, and the supervisor brokers a handful of fds.
 *
 * Three ways in:
 *  - explicit pools (frmps_pool_*), used by the engine SDK through ctypes;
 *  - a PyTorch pluggable allocator (frmps_malloc/frmps_free) that carves
 *    allocations out of the pools of the tag set by frmps_alloc_begin();
 *  - driver-API hooks (cuGetProcAddress, cuGetProcAddress_v2, dlsym,
 *    cuMemAlloc_v2, cuMemFree_v2) when the library is LD_PRELOADed, for engines
 *    that allocate with cudaMalloc: inside frmps_alloc_begin()/frmps_alloc_end()
 *    their allocations are carved out of the tag's pools; outside, and whenever
 *    FRMPS_VMM_DISABLE=1, every call passes straight to the driver.
 *
 * Errors: every function returns an frmps_status; on failure a message for the
 * calling thread is available from frmps_last_error() until its next failure.
 * All functions are thread-safe.
 *
 * Environment: FRMPS_LIBCUDA (driver library to dlopen, default libcuda.so.1),
 * FRMPS_VMM_DISABLE=1 (kill switch: hooks and the allocator pass through, and the
 * explicit pool functions fail with FRMPS_E_DISABLED). Read once, at first use. */
#ifndef FRMPS_VMM_H
#define FRMPS_VMM_H

#include <stddef.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FRMPS_API __attribute__((visibility("default")))

typedef enum frmps_status {
    FRMPS_OK = 0,
    FRMPS_E_INVAL = 1,     /* bad argument */
    FRMPS_E_DRIVER = 2,    /* the CUDA driver failed; the message names the call and error */
    FRMPS_E_NOMEM = 3,     /* host memory, or no room left in the tag's pools */
    FRMPS_E_DISABLED = 4,  /* FRMPS_VMM_DISABLE=1 */
    FRMPS_E_NOLIB = 5,     /* the driver library could not be loaded or lacks a symbol */
    FRMPS_E_STATE = 6      /* the call does not fit the pool's state (e.g. swap on a non-scratch pool) */
} frmps_status;

typedef struct frmps_pool frmps_pool;

/* Message for the calling thread's last failure ("" if none). Never NULL. */
FRMPS_API const char *frmps_last_error(void);
/* 1 if FRMPS_VMM_DISABLE=1 was set at first use. */
FRMPS_API int frmps_disabled(void);

/* Owned pool: reserve VA, cuMemCreate (POSIX-fd handle) on `device`, map, set
 * read-write access. `size` is rounded up to the allocation granularity
 * (frmps_pool_size returns the rounded size). `tag` is at most 63 bytes. */
FRMPS_API int frmps_pool_create(const char *tag, unsigned index, size_t size, int device,
                                frmps_pool **out);
/* Export the pool's handle as a new fd, owned by the caller. The driver sets
 * FD_CLOEXEC on it: pass it with SCM_RIGHTS, or clear the flag before exec. */
FRMPS_API int frmps_pool_export_fd(frmps_pool *pool, int *fd_out);
/* Import a handle exported by another process: reserve VA, map, set access
 * (read-only if `readonly`). `fd` stays owned by the caller. */
FRMPS_API int frmps_pool_import(const char *tag, unsigned index, int fd, size_t size, int device,
                                int readonly, frmps_pool **out);
/* Standby: reserve `size` of VA and back all of it with ONE scratch allocation
 * of `scratch_chunk` bytes (rounded to granularity) mapped repeatedly, read-write,
 * so the engine can initialise and capture graphs without touching shared memory. */
FRMPS_API int frmps_pool_reserve_scratch(const char *tag, unsigned index, size_t size, int device,
                                         size_t scratch_chunk, frmps_pool **out);
/* Standby going to sleep: unmap the scratch (one call, tens of ms for GiBs: do it
 * here, never at wake), import `fd` and map it at the SAME address, read-only if
 * `readonly`. On failure the pool is left reserved and unmapped (FRMPS_E_*). */
FRMPS_API int frmps_pool_swap_to_import(frmps_pool *pool, int fd, int readonly);
/* Change access of the whole pool (wake: read-only -> read-write). */
FRMPS_API int frmps_pool_set_access(frmps_pool *pool, int readonly);
FRMPS_API unsigned long long frmps_pool_ptr(const frmps_pool *pool);
FRMPS_API size_t frmps_pool_size(const frmps_pool *pool);
/* Unmap, release, free the VA range. Carve-outs still live become invalid. NULL is a no-op. */
FRMPS_API int frmps_pool_destroy(frmps_pool *pool);
/* The allocation granularity for `device` (what sizes are rounded to). */
FRMPS_API int frmps_granularity(int device, size_t *out);

/* Allocation region: until frmps_alloc_end(), frmps_malloc and (when preloaded)
 * cuMemAlloc_v2 carve allocations out of pools tagged `tag`. Process-wide, not
 * per thread: torch and cudart may allocate on any thread. Not nestable. */
FRMPS_API int frmps_alloc_begin(const char *tag);
FRMPS_API void frmps_alloc_end(void);

/* torch.cuda.memory.CUDAPluggableAllocator entry points. Inside a region: carve
 * from the tag's pools, NULL when they are full (an explicit sharing request fails
 * loudly rather than silently falling back to unshared memory). Outside: the
 * driver's cuMemAlloc_v2/cuMemFree_v2. */
FRMPS_API void *frmps_malloc(ssize_t size, int device, void *stream);
FRMPS_API void frmps_free(void *ptr, ssize_t size, int device, void *stream);

/* Bytes currently carved out of `pool` (tests, diagnostics). */
FRMPS_API size_t frmps_pool_used(const frmps_pool *pool);

#ifdef __cplusplus
}
#endif
#endif
