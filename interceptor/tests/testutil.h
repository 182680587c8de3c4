/* A minimal test runner: each test returns 0 on success; CHECK stops it. The
 * last line printed is "N passed, N failed"; main exits non-zero on failure. */
#ifndef FRMPS_TESTUTIL_H
#define FRMPS_TESTUTIL_H

#include <stdio.h>
#include <string.h>

static int tests_passed, tests_failed;
/* Each test file provides the error text to show next to a failed check. */
static const char *test_error_text(void);

#define CHECK(cond)                                                                            \
    do {                                                                                       \
        if (!(cond)) {                                                                         \
            fprintf(stderr, "    %s:%d: CHECK(%s) failed; last error: \"%s\"\n", __FILE__,     \
                    __LINE__, #cond, test_error_text());                                       \
            return 1;                                                                          \
        }                                                                                      \
    } while (0)

#define CHECK_CONTAINS(haystack, needle) CHECK(strstr((haystack), (needle)) != NULL)

#define RUN(test)                                                                              \
    do {                                                                                       \
        test_setup();                                                                          \
        int failed_ = (test)();                                                                \
        printf("%s %s\n", failed_ ? "FAIL" : "ok  ", #test);                                   \
        fflush(stdout);                                                                        \
        if (failed_)                                                                           \
            tests_failed++;                                                                    \
        else                                                                                   \
            tests_passed++;                                                                    \
    } while (0)

#define FINISH()                                                                               \
    do {                                                                                       \
        printf("%d passed, %d failed\n", tests_passed, tests_failed);                          \
        return tests_failed ? 1 : 0;                                                           \
    } while (0)

#endif
