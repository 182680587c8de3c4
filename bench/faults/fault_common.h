// Shared by the fault triggers: each program launches one faulting kernel,
// synchronises, prints the CUDA error it observed on stdout as
//   observed <fault> <variant>: <cudaErrorName> (<code>) <message>
// and exits 0 if that error is one of the expected ones, 2 if it is another
// error, 1 if the kernel ran without error. Run it as an MPS client (with the
// daemon's CUDA_MPS_PIPE_DIRECTORY) to kill every client of the MPS server.
//
// Arguments: [variant] [delay_ms]. delay_ms (default 0) sleeps after CUDA is
// initialised and before the fault, so a harness can start it early and
// fault while requests stream; a negative delay_ms prints "pid N ready" on
// stderr and faults when a byte (or EOF) arrives on stdin. Right before the
// faulting launch it prints "pid N triggering <fault> (<variant>) at <unix time>"
// on stderr, the time from its own clock (CLOCK_REALTIME, as the supervisor's
// records): a harness that reads the line later still knows when the fault came.
#pragma once
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define CHECK_SETUP(call)                                                                   \
    do {                                                                                    \
        cudaError_t e_ = (call);                                                            \
        if (e_ != cudaSuccess) {                                                            \
            fprintf(stderr, "setup failed: %s: %s\n", #call, cudaGetErrorString(e_));       \
            exit(3);                                                                        \
        }                                                                                   \
    } while (0)

static inline const char *fault_variant(int argc, char **argv, const char *dflt)
{
    return argc > 1 && argv[1][0] ? argv[1] : dflt;
}

static inline void fault_prepare(const char *fault, const char *variant, int argc, char **argv)
{
    CHECK_SETUP(cudaFree(0)); // create the context (joins MPS if a daemon is reachable)
    int delay_ms = argc > 2 ? atoi(argv[2]) : 0;
    if (delay_ms > 0)
        usleep((useconds_t)delay_ms * 1000);
    if (delay_ms < 0) {
        // Gate: joined (MPS) and ready; fault when the harness writes a byte to
        // stdin, so the fault lands at a chosen moment without the context setup.
        char b;
        fprintf(stderr, "pid %d ready\n", (int)getpid());
        fflush(stderr);
        if (read(0, &b, 1) < 0)
            perror("read gate");
    }
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    fprintf(stderr, "pid %d triggering %s (%s) at %lld.%09ld\n", (int)getpid(), fault, variant, (long long)ts.tv_sec,
            (long)ts.tv_nsec);
    fflush(stderr);
}

// expected: list of acceptable errors, terminated by cudaSuccess.
static inline int fault_report(const char *fault, const char *variant, const cudaError_t *expected)
{
    cudaError_t launch = cudaGetLastError();
    cudaError_t sync = cudaDeviceSynchronize();
    cudaError_t e = launch != cudaSuccess ? launch : sync;
    printf("observed %s %s: %s (%d) %s\n", fault, variant, cudaGetErrorName(e), (int)e,
           cudaGetErrorString(e));
    fflush(stdout);
    if (e == cudaSuccess)
        return 1;
    for (const cudaError_t *x = expected; *x != cudaSuccess; x++)
        if (*x == e)
            return 0;
    return 2;
}
