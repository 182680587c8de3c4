/* Control surface of the fake libcuda (a TEST DOUBLE, tests/fake_libcuda.c).
 * Tests reach these with dlsym on the fake's handle. */
#ifndef FRMPS_FAKE_CONTROL_H
#define FRMPS_FAKE_CONTROL_H

/* The fake's granularity (the real driver reports 2 MiB on current GPUs). */
#define FAKE_GRANULARITY ((size_t)2 << 20)

/* The per-thread stack a context starts with, and what a launch of the kernel named
 * FAKE_DEEP_STACK_KERNEL grows it to (the driver grows it at launch, never back). */
#define FAKE_STACK_DEFAULT ((size_t)1024)
#define FAKE_DEEP_STACK ((size_t)4096)
#define FAKE_DEEP_STACK_KERNEL "frmps_deep_stack"
/* References cuDevicePrimaryCtxRetain holds that cuDevicePrimaryCtxRelease has not dropped. */
typedef long (*fake_cuda_primary_refs_fn)(void);

/* Make the nth next call (1 = the very next) of driver function `name` fail with `err`. */
typedef void (*fake_cuda_fail_fn)(const char *name, int err, int nth);
/* How many times `name` was called in this process. */
typedef long (*fake_cuda_calls_fn)(const char *name);
/* Live objects: "reservations", "mappings", "allocs" (handles with references). */
typedef long (*fake_cuda_live_fn)(const char *what);
/* Clear injected failures and call counters. */
typedef void (*fake_cuda_reset_fn)(void);

#endif
