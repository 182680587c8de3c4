// SM fault: illegal instruction (cudaErrorIllegalInstruction, 715; Xid 13
// "Illegal Instruction Encoding").
//
// What each variant produced on the H100 (driver 580.159.04, CUDA 13.0), probed
// with equivalent kernels:
//   jump-far (default): an indirect call to a device function's address + 1 MiB,
//       into the code segment's unused (zeroed) space: cudaErrorIllegalInstruction,
//       Xid 13 "Illegal Instruction Encoding".  <- the illegal-instruction fault
//   jump-mid: the same function's address + 8 (the middle of a 16-byte SASS
//       instruction): cudaErrorInvalidPc ("invalid program counter").
//   brkpt: PTX `brkpt;` with no debugger: cudaErrorLaunchFailure.
//   trap:  PTX `trap;` / __trap(): cudaErrorLaunchFailure ("unspecified launch
//       failure"), NOT an illegal instruction.
//   (A call through a pointer to __device__ DATA is an illegal address instead.)
#include "fault_common.h"

typedef void (*fn_t)(void);

__device__ __noinline__ void landing(void) { asm volatile("nanosleep.u32 1;"); }

__global__ void illegal(int variant)
{
    char *code = (char *)(fn_t)landing;
    if (variant == 0)
        ((fn_t)(code + (1 << 20)))();
    else if (variant == 1)
        ((fn_t)(code + 8))();
    else if (variant == 2)
        asm volatile("brkpt;");
    else
        asm volatile("trap;");
}

int main(int argc, char **argv)
{
    const char *variant = fault_variant(argc, argv, "jump-far");
    static const char *const names[] = {"jump-far", "jump-mid", "brkpt", "trap"};
    int v = -1;
    for (int i = 0; i < 4; i++)
        if (strcmp(variant, names[i]) == 0)
            v = i;
    if (v < 0) {
        fprintf(stderr, "variants: jump-far, jump-mid, brkpt, trap\n");
        return 64;
    }
    fault_prepare("illegal_instruction", variant, argc, argv);
    illegal<<<1, 1>>>(v);
    const cudaError_t expected[4][2] = {{cudaErrorIllegalInstruction, cudaSuccess},
                                        {cudaErrorInvalidPc, cudaSuccess},
                                        {cudaErrorLaunchFailure, cudaSuccess},
                                        {cudaErrorLaunchFailure, cudaSuccess}};
    return fault_report("illegal_instruction", variant, expected[v]);
}
