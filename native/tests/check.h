/* check.h: the one assertion of the C tests. A failed check is reported with its place and
 * counted, and the test goes on, so one run shows every failure; main returns non-zero when
 * `failures` is. Checks made from several threads only ever write it on a failure. */
#ifndef VX_TESTS_CHECK_H
#define VX_TESTS_CHECK_H

#include <stdio.h>

static int failures;

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond);               \
            failures++;                                                                            \
        }                                                                                          \
    } while (0)

#endif
