// SM fault: misaligned address (cudaErrorMisalignedAddress, 716). An 8-byte
// load from an address that is 4 mod 8. Variants: load (default), store.
// Observed on the H100 (store): cudaErrorMisalignedAddress, Xid 13 "Misaligned Address".
#include "fault_common.h"

__global__ void misaligned(char *base, int store, unsigned long long *out)
{
    unsigned long long *p = (unsigned long long *)(base + 4);
    if (store)
        *(volatile unsigned long long *)p = 1;
    else
        *out = *(volatile unsigned long long *)p;
}

int main(int argc, char **argv)
{
    const char *variant = fault_variant(argc, argv, "load");
    int store = strcmp(variant, "store") == 0;
    char *base;
    unsigned long long *out;
    CHECK_SETUP(cudaMalloc(&base, 4096));
    CHECK_SETUP(cudaMalloc(&out, sizeof *out));
    fault_prepare("misaligned", variant, argc, argv);
    misaligned<<<1, 1>>>(base, store, out);
    const cudaError_t expected[] = {cudaErrorMisalignedAddress, cudaSuccess};
    return fault_report("misaligned", variant, expected);
}
