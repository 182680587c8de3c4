// SM fault: illegal instruction (cudaErrorIllegalInstruction, 715).
// Note: `trap;` / __trap() is NOT this fault: it reports cudaErrorLaunchFailure
// ("unspecified launch failure"); it is kept as variant "trap" for comparison.
// Variants:
//   brkpt (default): PTX `brkpt;` with no debugger attached: the SM raises an
//                    illegal-instruction warp error.
//   jump:            an indirect call through a function pointer that points at
//                    a __device__ data array (the bytes are not valid SASS).
//   trap:            `trap;` (expected to differ: unspecified launch failure).
#include "fault_common.h"

__device__ unsigned long long not_code[64];

typedef void (*fn_t)(void);

__global__ void illegal(int variant, fn_t target)
{
    if (variant == 0)
        asm volatile("brkpt;");
    else if (variant == 1)
        target(); // jump into data
    else
        asm volatile("trap;");
}

int main(int argc, char **argv)
{
    const char *variant = fault_variant(argc, argv, "brkpt");
    int v = strcmp(variant, "brkpt") == 0 ? 0 : strcmp(variant, "jump") == 0 ? 1
          : strcmp(variant, "trap") == 0  ? 2 : -1;
    if (v < 0) {
        fprintf(stderr, "variants: brkpt, jump, trap\n");
        return 64;
    }
    // Fill the data with 0xff bytes so a jump there decodes garbage, not NOPs.
    unsigned long long ones[64];
    memset(ones, 0xff, sizeof ones);
    CHECK_SETUP(cudaMemcpyToSymbol(not_code, ones, sizeof ones));
    void *data_addr;
    CHECK_SETUP(cudaGetSymbolAddress(&data_addr, not_code));
    fault_prepare("illegal_instruction", variant, argc, argv);
    illegal<<<1, 1>>>(v, (fn_t)data_addr);
    const cudaError_t expected_ii[] = {cudaErrorIllegalInstruction, cudaErrorInvalidPc, cudaSuccess};
    const cudaError_t expected_trap[] = {cudaErrorLaunchFailure, cudaSuccess};
    return fault_report("illegal_instruction", variant, v == 2 ? expected_trap : expected_ii);
}
