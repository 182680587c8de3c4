/* Loading the real driver, configuration, and per-thread error messages. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static _Thread_local char last_error[512];

static pthread_once_t config_once = PTHREAD_ONCE_INIT;
static bool disabled;

static pthread_once_t driver_once = PTHREAD_ONCE_INIT;
static struct frmps_driver driver;
static const struct frmps_driver *driver_ok;
static char driver_load_error[400];

typedef void *(*dlsym_fn)(void *, const char *);
static pthread_once_t dlsym_once = PTHREAD_ONCE_INIT;
static dlsym_fn real_dlsym_fn;

static void resolve_real_dlsym(void)
{
    /* dlsym is in libc since glibc 2.34 (version GLIBC_2.34), in libdl before
     * (GLIBC_2.2.5 on x86-64, GLIBC_2.17 on aarch64). dlvsym is not hooked. */
    static const char *const versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17"};
    for (size_t i = 0; i < sizeof versions / sizeof versions[0] && !real_dlsym_fn; i++) {
        void *p = dlvsym(RTLD_NEXT, "dlsym", versions[i]);
        memcpy(&real_dlsym_fn, &p, sizeof p);
    }
}

void *frmps_real_dlsym(void *handle, const char *name)
{
    pthread_once(&dlsym_once, resolve_real_dlsym);
    return real_dlsym_fn ? real_dlsym_fn(handle, name) : NULL;
}

static void read_config(void)
{
    const char *v = getenv("FRMPS_VMM_DISABLE");
    disabled = v && strcmp(v, "1") == 0;
}

bool frmps_config_disabled(void)
{
    pthread_once(&config_once, read_config);
    return disabled;
}

FRMPS_API int frmps_disabled(void) { return frmps_config_disabled() ? 1 : 0; }

static void load_driver(void)
{
    const char *path = getenv("FRMPS_LIBCUDA");
    if (!path || !*path)
        path = "libcuda.so.1";
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *e = dlerror();
        snprintf(driver_load_error, sizeof driver_load_error, "load CUDA driver %s: %s", path,
                 e ? e : "unknown error");
        return;
    }
#define FRMPS_RESOLVE(name)                                                                   \
    do {                                                                                      \
        void *p = frmps_real_dlsym(h, #name);                                                 \
        if (!p) {                                                                             \
            snprintf(driver_load_error, sizeof driver_load_error,                             \
                     "load CUDA driver %s: symbol %s missing (driver too old?)", path, #name); \
            return; /* the handle stays open: harmless, and other code may share it */        \
        }                                                                                     \
        memcpy(&driver.name, &p, sizeof p);                                                   \
    } while (0);
    FRMPS_DRIVER_FUNCS(FRMPS_RESOLVE)
#undef FRMPS_RESOLVE
    driver_ok = &driver;
}

const struct frmps_driver *frmps_driver_get(void)
{
    pthread_once(&driver_once, load_driver);
    if (!driver_ok)
        frmps_set_error(FRMPS_E_NOLIB, "%s", driver_load_error);
    return driver_ok;
}

int frmps_set_error(int status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return status;
}

int frmps_driver_error(const char *call, CUresult rc)
{
    const char *name = NULL;
    if (driver_ok && driver_ok->cuGetErrorName(rc, &name) != CUDA_SUCCESS)
        name = NULL;
    return frmps_set_error(FRMPS_E_DRIVER, "%s failed: %s (%d)", call, name ? name : "CUDA error",
                           (int)rc);
}

void frmps_clear_error(void) { last_error[0] = '\0'; }

FRMPS_API const char *frmps_last_error(void) { return last_error; }
