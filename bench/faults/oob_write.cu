// MMU fault that propagates under MPS: out-of-bounds write (to an unmapped
// device virtual address far past a small allocation). Reported as
// cudaErrorIllegalAddress (700); an MMU fault (Xid 31), not an SM warp error.
// Variants: write (default), read.
#include "fault_common.h"

__global__ void oob(int *p, unsigned long long off, int write, int *out)
{
    volatile int *q = p + off;
    if (write)
        *q = 42;
    else
        *out = *q;
}

int main(int argc, char **argv)
{
    const char *variant = fault_variant(argc, argv, "write");
    int *p, *out;
    CHECK_SETUP(cudaMalloc(&p, 1 << 20));
    CHECK_SETUP(cudaMalloc(&out, sizeof *out));
    fault_prepare("oob_write", variant, argc, argv);
    oob<<<1, 1>>>(p, 1ull << 36, strcmp(variant, "read") != 0, out); // +256 GiB
    const cudaError_t expected[] = {cudaErrorIllegalAddress, cudaSuccess};
    return fault_report("oob_write", variant, expected);
}
