// SM fault: lane user stack overflow. Deep, non-tail recursion with a large
// per-frame local array and a small per-thread stack limit runs the stack off
// the thread's local window. Variants: "recursion" (default).
//
// Observed on the H100 (driver 580.159.04, CUDA 13.0): this program (built with
// -Xptxas -O0) reports cudaErrorLaunchFailure with only Xid 43 (channel reset)
// in the kernel log, no SM warp exception; the same recursion built at -O3
// reported cudaErrorIllegalAddress with Xid 13 "Out Of Range Address" (the
// stack pointer leaves the local window). cudaErrorHardwareStackError / a
// logged "Lane User Stack Overflow" was not reproduced. Exit 0 = one of the
// expected errors below, 2 = another error.
#include "fault_common.h"

__device__ int deep(volatile int *sink, int depth)
{
    volatile int frame[64]; // 256 bytes per frame
    for (int i = 0; i < 64; i++)
        frame[i] = depth + i;
    if (depth <= 0)
        return frame[depth & 63];
    int r = deep(sink, depth - 1) + frame[(depth * 7) & 63]; // not a tail call
    *sink = r;
    return r;
}

__global__ void overflow(int *out, int depth) { out[threadIdx.x] = deep(out, depth); }

int main(int argc, char **argv)
{
    const char *variant = fault_variant(argc, argv, "recursion");
    int *out;
    CHECK_SETUP(cudaMalloc(&out, 1024 * sizeof(int)));
    CHECK_SETUP(cudaDeviceSetLimit(cudaLimitStackSize, 1024));
    fault_prepare("stack_overflow", variant, argc, argv);
    overflow<<<1, 32>>>(out, 1 << 20);
    const cudaError_t expected[] = {cudaErrorHardwareStackError, cudaErrorLaunchFailure,
                                   cudaErrorIllegalAddress, cudaSuccess};
    return fault_report("stack_overflow", variant, expected);
}
