// SM fault: invalid address space (cudaErrorInvalidAddressSpace, 717): an
// instruction that only works on some state spaces gets a generic address in
// another one. Variants (observed on the H100, driver 580.159.04, CUDA 13.0):
//   ld-global-shared (default): `ld.global` on the generic address of a
//       __shared__ variable: cudaErrorInvalidAddressSpace, Xid 13 "Invalid
//       Address Space".
//   atomic-local: a generic atomic on a thread-local variable: ran WITHOUT error
//       on the H100 (kept to show it is not a trigger there).
#include "fault_common.h"

__global__ void atomic_local(int *out, int salt)
{
    int local[4];
    local[salt & 3] = salt;
    int *generic = &local[(salt + 1) & 3];
    asm volatile("" : "+l"(generic)); // keep the compiler from resolving the space
    atomicAdd(generic, 1);
    out[0] = local[0] + local[1] + local[2] + local[3];
}

__global__ void ld_global_shared(int *out)
{
    __shared__ int s[32];
    s[threadIdx.x & 31] = (int)threadIdx.x;
    __syncthreads();
    unsigned long long generic = (unsigned long long)&s[0];
    int v;
    asm volatile("ld.global.u32 %0, [%1];" : "=r"(v) : "l"(generic) : "memory");
    out[0] = v;
}

int main(int argc, char **argv)
{
    const char *variant = fault_variant(argc, argv, "ld-global-shared");
    int v = strcmp(variant, "atomic-local") == 0 ? 0 : strcmp(variant, "ld-global-shared") == 0 ? 1 : -1;
    if (v < 0) {
        fprintf(stderr, "variants: atomic-local, ld-global-shared\n");
        return 64;
    }
    int *out;
    CHECK_SETUP(cudaMalloc(&out, sizeof *out));
    fault_prepare("invalid_address_space", variant, argc, argv);
    if (v == 0)
        atomic_local<<<1, 1>>>(out, 5);
    else
        ld_global_shared<<<1, 32>>>(out);
    const cudaError_t expected[] = {cudaErrorInvalidAddressSpace, cudaSuccess};
    return fault_report("invalid_address_space", variant, expected);
}
