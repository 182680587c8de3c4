/* The few CUDA driver API types, constants and signatures the interceptor uses,
 * declared by hand so that it builds without the CUDA toolkit. Every value here
 * is copied from cuda.h (CUDA 12/13); bench/gpu/check_decls.c compares each one
 * against the real header on the GPU machine (values, struct layouts, and the
 * function-pointer types, including both cuGetProcAddress variants). */
#ifndef FRMPS_CUDA_DECLS_H
#define FRMPS_CUDA_DECLS_H

#include <stddef.h>
#include <stdint.h>

/* FRMPS_DECLS_NO_TYPES: take the types from the real cuda.h (the GPU-side check
 * does this to compare our function-pointer types with the real prototypes).
 * FRMPS_DECLS_NO_PFN: types and constants only. */
#ifndef FRMPS_DECLS_NO_TYPES

typedef enum frmps_cuda_result {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_DEINITIALIZED = 4,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_ILLEGAL_ADDRESS = 700,
    CUDA_ERROR_MISALIGNED_ADDRESS = 716,
    CUDA_ERROR_NOT_PERMITTED = 800,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_UNKNOWN = 999
} CUresult;

typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef uint64_t cuuint64_t;
typedef struct CUctx_st *CUcontext;
typedef unsigned long long CUmemGenericAllocationHandle;

typedef enum frmps_cu_mem_handle_type {
    CU_MEM_HANDLE_TYPE_NONE = 0x0,
    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1,
    CU_MEM_HANDLE_TYPE_WIN32 = 0x2,
    CU_MEM_HANDLE_TYPE_WIN32_KMT = 0x4,
    CU_MEM_HANDLE_TYPE_FABRIC = 0x8,
    CU_MEM_HANDLE_TYPE_MAX = 0x7FFFFFFF
} CUmemAllocationHandleType;

typedef enum frmps_cu_mem_access_flags {
    CU_MEM_ACCESS_FLAGS_PROT_NONE = 0x0,
    CU_MEM_ACCESS_FLAGS_PROT_READ = 0x1,
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3,
    CU_MEM_ACCESS_FLAGS_PROT_MAX = 0x7FFFFFFF
} CUmemAccess_flags;

typedef enum frmps_cu_mem_location_type {
    CU_MEM_LOCATION_TYPE_INVALID = 0x0,
    CU_MEM_LOCATION_TYPE_DEVICE = 0x1,
    CU_MEM_LOCATION_TYPE_MAX = 0x7FFFFFFF
} CUmemLocationType;

typedef enum frmps_cu_mem_allocation_type {
    CU_MEM_ALLOCATION_TYPE_INVALID = 0x0,
    CU_MEM_ALLOCATION_TYPE_PINNED = 0x1,
    CU_MEM_ALLOCATION_TYPE_MAX = 0x7FFFFFFF
} CUmemAllocationType;

typedef enum frmps_cu_mem_granularity_flags {
    CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0,
    CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 0x1
} CUmemAllocationGranularity_flags;

/* cuGetProcAddress_v2's 5th argument (CUDA 12.0+). */
typedef enum frmps_cu_proc_address_query_result {
    CU_GET_PROC_ADDRESS_SUCCESS = 0,
    CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND = 1,
    CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT = 2
} CUdriverProcAddressQueryResult;

typedef struct CUmemLocation_st {
    CUmemLocationType type;
    int id;
} CUmemLocation;

typedef struct CUmemAllocationProp_st {
    CUmemAllocationType type;
    CUmemAllocationHandleType requestedHandleTypes;
    CUmemLocation location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
} CUmemAllocationProp;

typedef struct CUmemAccessDesc_st {
    CUmemLocation location;
    CUmemAccess_flags flags;
} CUmemAccessDesc;

#endif /* FRMPS_DECLS_NO_TYPES */

#ifndef FRMPS_DECLS_NO_PFN
/* Function-pointer types, one per driver entry point used (exported ABI names). */
typedef CUresult (*pfn_cuInit)(unsigned int flags);
typedef CUresult (*pfn_cuDeviceGet)(CUdevice *device, int ordinal);
typedef CUresult (*pfn_cuCtxGetCurrent)(CUcontext *pctx);
typedef CUresult (*pfn_cuCtxSetCurrent)(CUcontext ctx);
typedef CUresult (*pfn_cuDevicePrimaryCtxRetain)(CUcontext *pctx, CUdevice dev);
typedef CUresult (*pfn_cuGetErrorName)(CUresult error, const char **pstr);
typedef CUresult (*pfn_cuMemAlloc_v2)(CUdeviceptr *dptr, size_t bytesize);
typedef CUresult (*pfn_cuMemFree_v2)(CUdeviceptr dptr);
typedef CUresult (*pfn_cuMemAddressReserve)(CUdeviceptr *ptr, size_t size, size_t alignment,
                                            CUdeviceptr addr, unsigned long long flags);
typedef CUresult (*pfn_cuMemAddressFree)(CUdeviceptr ptr, size_t size);
typedef CUresult (*pfn_cuMemCreate)(CUmemGenericAllocationHandle *handle, size_t size,
                                    const CUmemAllocationProp *prop, unsigned long long flags);
typedef CUresult (*pfn_cuMemRelease)(CUmemGenericAllocationHandle handle);
typedef CUresult (*pfn_cuMemMap)(CUdeviceptr ptr, size_t size, size_t offset,
                                 CUmemGenericAllocationHandle handle, unsigned long long flags);
typedef CUresult (*pfn_cuMemUnmap)(CUdeviceptr ptr, size_t size);
typedef CUresult (*pfn_cuMemSetAccess)(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc,
                                       size_t count);
typedef CUresult (*pfn_cuMemExportToShareableHandle)(void *shareableHandle,
                                                     CUmemGenericAllocationHandle handle,
                                                     CUmemAllocationHandleType handleType,
                                                     unsigned long long flags);
typedef CUresult (*pfn_cuMemImportFromShareableHandle)(CUmemGenericAllocationHandle *handle,
                                                       void *osHandle,
                                                       CUmemAllocationHandleType shHandleType);
typedef CUresult (*pfn_cuMemGetAllocationGranularity)(size_t *granularity,
                                                      const CUmemAllocationProp *prop,
                                                      CUmemAllocationGranularity_flags option);
/* The two cuGetProcAddress ABIs. libcuda exports both names:
 *   "cuGetProcAddress"    = CUDA 11.3 ABI, 4 arguments (PFN_cuGetProcAddress_v11030);
 *   "cuGetProcAddress_v2" = CUDA 12.0 ABI, 5 arguments (PFN_cuGetProcAddress_v12000),
 * and cuda.h >= 12 #defines cuGetProcAddress to cuGetProcAddress_v2, so source
 * code that "calls cuGetProcAddress" with 5 arguments binds to the _v2 symbol.
 * Handing the 5-argument function to a caller that looked up the plain name
 * (the seed shim's bug) makes the callee read a garbage 5th argument and write
 * through it. */
typedef CUresult (*pfn_cuGetProcAddress)(const char *symbol, void **pfn, int cudaVersion,
                                         cuuint64_t flags);
typedef CUresult (*pfn_cuGetProcAddress_v2)(const char *symbol, void **pfn, int cudaVersion,
                                            cuuint64_t flags,
                                            CUdriverProcAddressQueryResult *symbolStatus);
#endif /* FRMPS_DECLS_NO_PFN */

#endif
