/* Compile-time check of the interceptor's hand-written driver declarations
 * (interceptor/src/cuda_decls.h) against the real cuda.h and cudaTypedefs.h.
 * It compiles only if every constant, type, struct layout and function-pointer
 * type matches; main() then prints a summary. Built by interceptor_check.sh
 * with the generated cuda_decls_renamed.h (our types, every CUDA name prefixed
 * with ours_, so both sets coexist in one translation unit). The Python
 * declarations of the bench's sleep-only baseline are checked against
 * cuda_decls.h by vllmpatch/tests/test_sleep_memory.py. */
#include <cuda.h>
#include <cudaTypedefs.h>
#include <stddef.h>
#include <stdio.h>

/* 1. Our function-pointer types, spelled over the real cuda.h types. cuda.h
 * #defines cuGetProcAddress to cuGetProcAddress_v2, which would rename our
 * driver-table member; the macro is restored below. */
#undef cuGetProcAddress
#define FRMPS_DECLS_NO_TYPES
#include "internal.h"
#define cuGetProcAddress cuGetProcAddress_v2

/* 2. Our types and constants, renamed. */
#undef FRMPS_DECLS_NO_TYPES
#define FRMPS_DECLS_NO_PFN
#include "cuda_decls_renamed.h"

#define SAME(a, b) __builtin_types_compatible_p(a, b)

/* Constants. */
#define VAL(name) _Static_assert((long long)ours_##name == (long long)name, #name " differs from cuda.h");
VAL(CUDA_SUCCESS) VAL(CUDA_ERROR_INVALID_VALUE) VAL(CUDA_ERROR_OUT_OF_MEMORY)
VAL(CUDA_ERROR_NOT_INITIALIZED) VAL(CUDA_ERROR_DEINITIALIZED) VAL(CUDA_ERROR_NO_DEVICE)
VAL(CUDA_ERROR_INVALID_DEVICE) VAL(CUDA_ERROR_INVALID_CONTEXT) VAL(CUDA_ERROR_INVALID_HANDLE)
VAL(CUDA_ERROR_NOT_FOUND) VAL(CUDA_ERROR_ILLEGAL_ADDRESS) VAL(CUDA_ERROR_NOT_PERMITTED)
VAL(CUDA_ERROR_NOT_SUPPORTED) VAL(CUDA_ERROR_UNKNOWN)
VAL(CU_MEM_HANDLE_TYPE_NONE) VAL(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
VAL(CU_MEM_HANDLE_TYPE_WIN32) VAL(CU_MEM_HANDLE_TYPE_WIN32_KMT) VAL(CU_MEM_HANDLE_TYPE_FABRIC)
VAL(CU_MEM_HANDLE_TYPE_MAX)
VAL(CU_MEM_ACCESS_FLAGS_PROT_NONE) VAL(CU_MEM_ACCESS_FLAGS_PROT_READ)
VAL(CU_MEM_ACCESS_FLAGS_PROT_READWRITE) VAL(CU_MEM_ACCESS_FLAGS_PROT_MAX)
VAL(CU_MEM_LOCATION_TYPE_INVALID) VAL(CU_MEM_LOCATION_TYPE_DEVICE) VAL(CU_MEM_LOCATION_TYPE_MAX)
VAL(CU_MEM_ALLOCATION_TYPE_INVALID) VAL(CU_MEM_ALLOCATION_TYPE_PINNED) VAL(CU_MEM_ALLOCATION_TYPE_MAX)
VAL(CU_MEM_ALLOC_GRANULARITY_MINIMUM) VAL(CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
VAL(CU_GET_PROC_ADDRESS_SUCCESS) VAL(CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND)
VAL(CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT)
#undef VAL

/* Scalar types. */
_Static_assert(SAME(ours_CUdeviceptr, CUdeviceptr), "CUdeviceptr");
_Static_assert(SAME(ours_CUdevice, CUdevice), "CUdevice");
_Static_assert(SAME(ours_CUmemGenericAllocationHandle, CUmemGenericAllocationHandle), "handle");
_Static_assert(SAME(ours_cuuint64_t, cuuint64_t), "cuuint64_t");
_Static_assert(sizeof(ours_CUresult) == sizeof(CUresult), "CUresult size");
_Static_assert(sizeof(ours_CUmemAllocationHandleType) == sizeof(CUmemAllocationHandleType), "enum size");
_Static_assert(sizeof(ours_CUdriverProcAddressQueryResult) == sizeof(CUdriverProcAddressQueryResult), "enum size");

/* Struct layouts, field by field. */
#define FIELD(S, f)                                                                             \
    _Static_assert(offsetof(ours_##S, f) == offsetof(S, f), #S "." #f " offset");              \
    _Static_assert(sizeof(((ours_##S *)0)->f) == sizeof(((S *)0)->f), #S "." #f " size");
_Static_assert(sizeof(ours_CUmemLocation) == sizeof(CUmemLocation), "CUmemLocation size");
FIELD(CUmemLocation, type) FIELD(CUmemLocation, id)
_Static_assert(sizeof(ours_CUmemAllocationProp) == sizeof(CUmemAllocationProp), "prop size");
FIELD(CUmemAllocationProp, type) FIELD(CUmemAllocationProp, requestedHandleTypes)
FIELD(CUmemAllocationProp, location) FIELD(CUmemAllocationProp, win32HandleMetaData)
FIELD(CUmemAllocationProp, allocFlags) FIELD(CUmemAllocationProp, allocFlags.compressionType)
FIELD(CUmemAllocationProp, allocFlags.gpuDirectRDMACapable) FIELD(CUmemAllocationProp, allocFlags.usage)
_Static_assert(sizeof(ours_CUmemAccessDesc) == sizeof(CUmemAccessDesc), "access desc size");
FIELD(CUmemAccessDesc, location) FIELD(CUmemAccessDesc, flags)
#undef FIELD

/* Function-pointer types (the hooks are declared with these very types), against
 * both the prototype in cuda.h and the versioned PFN typedef. */
#define FN(name, pfn) _Static_assert(SAME(pfn_##name, pfn), #name " vs " #pfn);
#define PROTO(name) _Static_assert(SAME(pfn_##name, __typeof__(&name)), #name " vs cuda.h prototype");
FN(cuInit, PFN_cuInit_v2000) PROTO(cuInit)
FN(cuDeviceGet, PFN_cuDeviceGet_v2000) PROTO(cuDeviceGet)
FN(cuCtxGetCurrent, PFN_cuCtxGetCurrent_v4000) PROTO(cuCtxGetCurrent)
FN(cuCtxSetCurrent, PFN_cuCtxSetCurrent_v4000) PROTO(cuCtxSetCurrent)
FN(cuDevicePrimaryCtxRetain, PFN_cuDevicePrimaryCtxRetain_v7000) PROTO(cuDevicePrimaryCtxRetain)
FN(cuGetErrorName, PFN_cuGetErrorName_v6000) PROTO(cuGetErrorName)
FN(cuMemAlloc_v2, PFN_cuMemAlloc_v3020) PROTO(cuMemAlloc_v2)
FN(cuMemFree_v2, PFN_cuMemFree_v3020) PROTO(cuMemFree_v2)
FN(cuMemAddressReserve, PFN_cuMemAddressReserve_v10020) PROTO(cuMemAddressReserve)
FN(cuMemAddressFree, PFN_cuMemAddressFree_v10020) PROTO(cuMemAddressFree)
FN(cuMemCreate, PFN_cuMemCreate_v10020) PROTO(cuMemCreate)
FN(cuMemRelease, PFN_cuMemRelease_v10020) PROTO(cuMemRelease)
FN(cuMemMap, PFN_cuMemMap_v10020) PROTO(cuMemMap)
FN(cuMemUnmap, PFN_cuMemUnmap_v10020) PROTO(cuMemUnmap)
FN(cuMemSetAccess, PFN_cuMemSetAccess_v10020) PROTO(cuMemSetAccess)
FN(cuMemExportToShareableHandle, PFN_cuMemExportToShareableHandle_v10020) PROTO(cuMemExportToShareableHandle)
FN(cuMemImportFromShareableHandle, PFN_cuMemImportFromShareableHandle_v10020) PROTO(cuMemImportFromShareableHandle)
FN(cuMemGetAllocationGranularity, PFN_cuMemGetAllocationGranularity_v10020) PROTO(cuMemGetAllocationGranularity)
/* The two cuGetProcAddress ABIs: the exported plain name is the 4-argument 11.3
 * ABI; cuda.h's cuGetProcAddress macro names the 5-argument _v2. */
FN(cuGetProcAddress, PFN_cuGetProcAddress_v11030)
FN(cuGetProcAddress_v2, PFN_cuGetProcAddress_v12000) PROTO(cuGetProcAddress_v2)
_Static_assert(!SAME(pfn_cuGetProcAddress, pfn_cuGetProcAddress_v2), "the two ABIs must differ");
_Static_assert(SAME(__typeof__(&cuGetProcAddress), PFN_cuGetProcAddress_v12000),
               "cuda.h maps cuGetProcAddress to the 5-argument _v2");
#undef FN
#undef PROTO

/* Every driver function the interceptor resolves is checked above. */
#define COUNT(name) +1
_Static_assert((0 FRMPS_DRIVER_FUNCS(COUNT)) == 20, "a driver function was added: check it here");
#undef COUNT

int main(void)
{
    printf("check_decls: interceptor declarations match cuda.h (CUDA_VERSION %d): "
           "every constant, scalar type, struct layout and the 20 driver function types, "
           "both cuGetProcAddress ABIs included\n",
           CUDA_VERSION);
    return 0;
}
