/* The driver-API hooks, seen from an application that has libfrmps_vmm.so
 * LD_PRELOADed and reaches the driver the way bundled cudart does: dlopen the
 * driver, dlsym cuGetProcAddress(_v2) on that handle, fetch entry points with it.
 * Run by test_vmm with argv[1] = enabled | disabled | nodriver. */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_decls.h"
#include "fake_control.h"
#include "frmps_vmm.h"
#include "testutil.h"

#define MiB ((size_t)1 << 20)

/* The interceptor's API, looked up like any preloaded library's. */
static const char *(*api_last_error)(void);
static int (*api_pool_create)(const char *, unsigned, size_t, int, frmps_pool **);
static unsigned long long (*api_pool_ptr)(const frmps_pool *);
static size_t (*api_pool_used)(const frmps_pool *);
static int (*api_pool_destroy)(frmps_pool *);
static int (*api_alloc_begin)(const char *);
static void (*api_alloc_end)(void);
static void *(*api_malloc)(ssize_t, int, void *);

static fake_cuda_calls_fn fake_calls;
static void *fake;

static const char *test_error_text(void) { return api_last_error ? api_last_error() : ""; }
static void test_setup(void) {}

/* Which library and symbol a function pointer belongs to. */
static int is_fn(void *fn, const char *lib_part, const char *sym)
{
    Dl_info info;
    if (!fn || !dladdr(fn, &info) || !info.dli_fname || !info.dli_sname)
        return 0;
    return strstr(info.dli_fname, lib_part) != NULL && strcmp(info.dli_sname, sym) == 0;
}

static int resolve_api(void)
{
#define API(var, name) *(void **)&var = dlsym(RTLD_DEFAULT, name); CHECK(var != NULL)
    API(api_last_error, "frmps_last_error");
    API(api_pool_create, "frmps_pool_create");
    API(api_pool_ptr, "frmps_pool_ptr");
    API(api_pool_used, "frmps_pool_used");
    API(api_pool_destroy, "frmps_pool_destroy");
    API(api_alloc_begin, "frmps_alloc_begin");
    API(api_alloc_end, "frmps_alloc_end");
    API(api_malloc, "frmps_malloc");
#undef API
    return 0;
}

static int test_dlsym_hands_out_matching_abis(void)
{
    /* The plain name is the 4-argument ABI: it must get the 4-argument hook,
     * never the 5-argument one (the seed shim's bug). */
    void *v1 = dlsym(fake, "cuGetProcAddress");
    void *v2 = dlsym(fake, "cuGetProcAddress_v2");
    CHECK(is_fn(v1, "libfrmps_vmm", "cuGetProcAddress"));
    CHECK(is_fn(v2, "libfrmps_vmm", "cuGetProcAddress_v2"));
    CHECK(is_fn(dlsym(fake, "cuMemAlloc_v2"), "libfrmps_vmm", "cuMemAlloc_v2"));
    CHECK(is_fn(dlsym(fake, "cuMemFree_v2"), "libfrmps_vmm", "cuMemFree_v2"));
    /* Everything else is the driver's own. */
    CHECK(is_fn(dlsym(fake, "cuMemCreate"), "libcuda_fake", "cuMemCreate"));
    return 0;
}

static int test_get_proc_address_by_version(void)
{
    pfn_cuGetProcAddress gpa1;
    pfn_cuGetProcAddress_v2 gpa2;
    *(void **)&gpa1 = dlsym(fake, "cuGetProcAddress");
    *(void **)&gpa2 = dlsym(fake, "cuGetProcAddress_v2");
    void *p = NULL;
    CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    CHECK(gpa2("cuGetProcAddress", &p, 12000, 0, &status) == CUDA_SUCCESS);
    CHECK(status == CU_GET_PROC_ADDRESS_SUCCESS);
    CHECK(is_fn(p, "libfrmps_vmm", "cuGetProcAddress_v2"));
    CHECK(gpa2("cuGetProcAddress", &p, 11030, 0, &status) == CUDA_SUCCESS);
    CHECK(is_fn(p, "libfrmps_vmm", "cuGetProcAddress"));
    CHECK(gpa1("cuGetProcAddress", &p, 11040, 0) == CUDA_SUCCESS);
    CHECK(is_fn(p, "libfrmps_vmm", "cuGetProcAddress"));
    CHECK(gpa1("cuMemAlloc", &p, 12000, 0) == CUDA_SUCCESS);
    CHECK(is_fn(p, "libfrmps_vmm", "cuMemAlloc_v2"));
    CHECK(gpa2("cuMemFree", &p, 13000, 0, &status) == CUDA_SUCCESS);
    CHECK(is_fn(p, "libfrmps_vmm", "cuMemFree_v2"));
    CHECK(gpa2("cuMemCreate", &p, 12000, 0, &status) == CUDA_SUCCESS);
    CHECK(is_fn(p, "libcuda_fake", "cuMemCreate"));
    /* Driver errors come back unchanged. */
    CHECK(gpa2("cuNoSuchThing", &p, 12000, 0, &status) == CUDA_ERROR_NOT_FOUND);
    CHECK(status == CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND && p == NULL);
    return 0;
}

static int in_pool(frmps_pool *pool, CUdeviceptr p)
{
    CUdeviceptr base = api_pool_ptr(pool);
    return p >= base && p < base + 4 * MiB;
}

static int test_tagged_cuMemAlloc_goes_to_pool(void)
{
    pfn_cuGetProcAddress_v2 gpa2;
    pfn_cuMemAlloc_v2 alloc;
    pfn_cuMemFree_v2 mfree;
    pfn_cuInit init;
    *(void **)&gpa2 = dlsym(fake, "cuGetProcAddress_v2");
    CHECK(gpa2("cuMemAlloc", (void **)&alloc, 12000, 0, NULL) == CUDA_SUCCESS);
    CHECK(gpa2("cuMemFree", (void **)&mfree, 12000, 0, NULL) == CUDA_SUCCESS);
    CHECK(gpa2("cuInit", (void **)&init, 12000, 0, NULL) == CUDA_SUCCESS);
    CHECK(init(0) == CUDA_SUCCESS);
    frmps_pool *pool;
    CHECK(api_pool_create("weights", 0, 4 * MiB, 0, &pool) == FRMPS_OK);

    long real_allocs = fake_calls("cuMemAlloc_v2"), real_frees = fake_calls("cuMemFree_v2");
    CUdeviceptr outside = 0, a = 0, b = 0;
    CHECK(alloc(&outside, 8192) == CUDA_SUCCESS);
    CHECK(!in_pool(pool, outside));
    CHECK(fake_calls("cuMemAlloc_v2") == real_allocs + 1);

    CHECK(api_alloc_begin("weights") == FRMPS_OK);
    CHECK(alloc(&a, 3 * MiB) == CUDA_SUCCESS);
    CHECK(alloc(&b, 4096) == CUDA_SUCCESS);
    CHECK(in_pool(pool, a) && in_pool(pool, b));
    CHECK(fake_calls("cuMemAlloc_v2") == real_allocs + 1);
    /* Full: a loud failure, not unshared memory. */
    CUdeviceptr c = 0;
    CHECK(alloc(&c, 2 * MiB) == CUDA_ERROR_OUT_OF_MEMORY);
    CHECK(fake_calls("cuMemAlloc_v2") == real_allocs + 1);
    api_alloc_end();

    CHECK(mfree(a) == CUDA_SUCCESS && mfree(b) == CUDA_SUCCESS);
    CHECK(api_pool_used(pool) == 0);
    CHECK(fake_calls("cuMemFree_v2") == real_frees);
    CHECK(mfree(outside) == CUDA_SUCCESS);
    CHECK(fake_calls("cuMemFree_v2") == real_frees + 1);
    CHECK(api_pool_destroy(pool) == FRMPS_OK);
    return 0;
}

static int test_disabled_is_pure_passthrough(void)
{
    CHECK(is_fn(dlsym(fake, "cuGetProcAddress"), "libcuda_fake", "cuGetProcAddress"));
    CHECK(is_fn(dlsym(fake, "cuGetProcAddress_v2"), "libcuda_fake", "cuGetProcAddress_v2"));
    CHECK(is_fn(dlsym(fake, "cuMemAlloc_v2"), "libcuda_fake", "cuMemAlloc_v2"));
    pfn_cuGetProcAddress_v2 gpa2;
    *(void **)&gpa2 = dlsym(fake, "cuGetProcAddress_v2");
    void *p;
    CHECK(gpa2("cuMemAlloc", &p, 12000, 0, NULL) == CUDA_SUCCESS);
    CHECK(is_fn(p, "libcuda_fake", "cuMemAlloc_v2"));
    /* Even our own exported entry point (reached by direct linking) passes through. */
    pfn_cuMemAlloc_v2 ours;
    pfn_cuInit init;
    *(void **)&ours = dlsym(RTLD_DEFAULT, "cuMemAlloc_v2");
    *(void **)&init = dlsym(fake, "cuInit");
    CHECK(init(0) == CUDA_SUCCESS);
    frmps_pool *pool;
    CHECK(api_pool_create("weights", 0, 4 * MiB, 0, &pool) == FRMPS_E_DISABLED);
    CHECK_CONTAINS(api_last_error(), "FRMPS_VMM_DISABLE");
    CHECK(api_alloc_begin("weights") == FRMPS_OK);
    CUdeviceptr d = 0;
    long real_allocs = fake_calls("cuMemAlloc_v2");
    pfn_cuCtxSetCurrent setcur;
    pfn_cuDevicePrimaryCtxRetain retain;
    CUcontext ctx;
    *(void **)&setcur = dlsym(fake, "cuCtxSetCurrent");
    *(void **)&retain = dlsym(fake, "cuDevicePrimaryCtxRetain");
    CHECK(retain(&ctx, 0) == CUDA_SUCCESS && setcur(ctx) == CUDA_SUCCESS);
    CHECK(ours(&d, 4096) == CUDA_SUCCESS);
    CHECK(fake_calls("cuMemAlloc_v2") == real_allocs + 1);
    CHECK(api_malloc(4096, 0, NULL) != NULL);
    CHECK(fake_calls("cuMemAlloc_v2") == real_allocs + 2);
    api_alloc_end();
    return 0;
}

static int test_no_driver_passes_through(void)
{
    CHECK(is_fn(dlsym(fake, "cuGetProcAddress_v2"), "libcuda_fake", "cuGetProcAddress_v2"));
    CHECK(is_fn(dlsym(fake, "cuMemAlloc_v2"), "libcuda_fake", "cuMemAlloc_v2"));
    frmps_pool *pool;
    CHECK(api_pool_create("weights", 0, 4 * MiB, 0, &pool) == FRMPS_E_NOLIB);
    CHECK_CONTAINS(api_last_error(), "/nonexistent/libcuda.so.1");
    return 0;
}

int main(int argc, char **argv)
{
    const char *mode = argc > 1 ? argv[1] : "";
    const char *fake_path = getenv("FRMPS_FAKE_LIBCUDA");
    fake = fake_path ? dlopen(fake_path, RTLD_NOW | RTLD_LOCAL) : NULL;
    if (!fake) {
        fprintf(stderr, "test_hooks: FRMPS_FAKE_LIBCUDA must name the fake driver\n");
        return 2;
    }
    *(void **)&fake_calls = dlsym(fake, "fake_cuda_calls");
    if (resolve_api() != 0 || !fake_calls) {
        fprintf(stderr, "test_hooks: run me with libfrmps_vmm.so in LD_PRELOAD\n");
        return 2;
    }
    printf("  [test_hooks %s]\n", mode);
    if (strcmp(mode, "enabled") == 0) {
        RUN(test_dlsym_hands_out_matching_abis);
        RUN(test_get_proc_address_by_version);
        RUN(test_tagged_cuMemAlloc_goes_to_pool);
    } else if (strcmp(mode, "disabled") == 0) {
        RUN(test_disabled_is_pure_passthrough);
    } else if (strcmp(mode, "nodriver") == 0) {
        RUN(test_no_driver_passes_through);
    } else {
        fprintf(stderr, "test_hooks: unknown mode %s\n", mode);
        return 2;
    }
    FINISH();
}
