// SM fault: shared / local out-of-range address. A state-space-specific store
// (st.shared / st.local) to an offset far beyond the block's shared window /
// the thread's local window. Variants: shared (default), local.
// Observed on the H100 (driver 580.159.04, CUDA 13.0): both give
// cudaErrorIllegalAddress with Xid 13 "Out Of Range Address" (a local store at
// 16 MiB was still inside the window and did NOT fault; 0xFFFFFFF0 does).
#include "fault_common.h"

__global__ void shared_oob(unsigned offset)
{
    __shared__ int small[32];
    small[threadIdx.x & 31] = 1;
    asm volatile("st.shared.u32 [%0], %1;" ::"r"(offset), "r"(7) : "memory");
    __syncthreads();
}

__global__ void local_oob(unsigned offset)
{
    asm volatile("st.local.u32 [%0], %1;" ::"r"(offset), "r"(7) : "memory");
}

int main(int argc, char **argv)
{
    const char *variant = fault_variant(argc, argv, "shared");
    int local = strcmp(variant, "local") == 0;
    if (!local && strcmp(variant, "shared") != 0) {
        fprintf(stderr, "variants: shared, local\n");
        return 64;
    }
    fault_prepare("shared_oob", variant, argc, argv);
    if (local)
        local_oob<<<1, 32>>>(0xFFFFFFF0u); // the top of the 32-bit local window
    else
        shared_oob<<<1, 32>>>(0x00FFFFF0u); // 16 MiB: beyond any shared window (<= 228 KiB)
    const cudaError_t expected[] = {cudaErrorIllegalAddress, cudaErrorLaunchFailure, cudaSuccess};
    return fault_report("shared_oob", variant, expected);
}
