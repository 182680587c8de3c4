// MMU fault that propagates under MPS: access mismatch: a write to device
// memory mapped read-only (a VMM allocation with CU_MEM_ACCESS_FLAGS_PROT_READ,
// exactly how a frmps standby maps the shared pools before wake).
// Reported as cudaErrorIllegalAddress (700).
#include <cuda.h>

#include "fault_common.h"

#define CHECK_CU(call)                                                                      \
    do {                                                                                    \
        CUresult r_ = (call);                                                               \
        if (r_ != CUDA_SUCCESS) {                                                           \
            const char *s_ = NULL;                                                          \
            cuGetErrorName(r_, &s_);                                                        \
            fprintf(stderr, "setup failed: %s: %s\n", #call, s_ ? s_ : "?");                \
            exit(3);                                                                        \
        }                                                                                   \
    } while (0)

__global__ void write_ro(int *p) { *(volatile int *)p = 1; }

int main(int argc, char **argv)
{
    const char *variant = fault_variant(argc, argv, "vmm-read-only");
    CHECK_SETUP(cudaFree(0));
    int dev = 0;
    CHECK_SETUP(cudaGetDevice(&dev));
    CUmemAllocationProp prop = {};
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = dev;
    size_t gran = 0;
    CHECK_CU(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    CUmemGenericAllocationHandle h;
    CUdeviceptr va;
    CHECK_CU(cuMemCreate(&h, gran, &prop, 0));
    CHECK_CU(cuMemAddressReserve(&va, gran, gran, 0, 0));
    CHECK_CU(cuMemMap(va, gran, 0, h, 0));
    CUmemAccessDesc acc = {};
    acc.location = prop.location;
    acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READ;
    CHECK_CU(cuMemSetAccess(va, gran, &acc, 1));
    fault_prepare("readonly_write", variant, argc, argv);
    write_ro<<<1, 1>>>((int *)va);
    const cudaError_t expected[] = {cudaErrorIllegalAddress, cudaSuccess};
    return fault_report("readonly_write", variant, expected);
}
