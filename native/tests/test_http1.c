/* Unit tests of vx_http1: response heads and chunk framing, byte for byte.
 *
 * The Python tests (tests/native/test_http1.py) compare the binding with ingress's Python
 * writer over generated inputs; these check the core alone, under the sanitizers too: exact
 * sizes (the size pass and the write pass agree, nothing written past the end: a guard byte
 * after every buffer), empty names and values given as NULL pointers, the hex and decimal
 * edges.
 */
#include "vx_http1.h"

#include "tests/check.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define GUARD 0x5a

/* Write a head into an exact-size heap buffer with one guard byte after it, compare. */
static void check_head(const char *status, const vx_h1_field *f, size_t n, uint64_t len,
                       unsigned flags, const char *expect)
{
    size_t size = vx_h1_head_size(strlen(status), f, n, len, flags);
    CHECK(size == strlen(expect));
    char *buf = malloc(size + 1);
    CHECK(buf != NULL);
    if (buf == NULL)
        return;
    buf[size] = (char)GUARD;
    char *end = vx_h1_write_head(buf, status, strlen(status), f, n, len, flags);
    CHECK(end == buf + size);
    CHECK(memcmp(buf, expect, size) == 0);
    CHECK(buf[size] == (char)GUARD);
    free(buf);
}

static void test_heads(void)
{
    const char *ok = "HTTP/1.1 200 OK\r\n";
    vx_h1_field two[] = {
        {"content-type", 12, "application/json", 16},
        {"server-timing", 13, "ring;dur=0.001", 14},
    };
    check_head(ok, NULL, 0, 0, 0, "HTTP/1.1 200 OK\r\n\r\n");
    check_head(ok, NULL, 0, 0, VX_H1_LENGTH, "HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n");
    check_head(ok, two, 2, 1234567, VX_H1_LENGTH | VX_H1_CLOSE,
               "HTTP/1.1 200 OK\r\ncontent-length: 1234567\r\ncontent-type: application/json\r\n"
               "server-timing: ring;dur=0.001\r\nconnection: close\r\n\r\n");
    check_head("HTTP/1.1 503 Service Unavailable\r\n", two, 1, 0, VX_H1_CHUNKED,
               "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
               "transfer-encoding: chunked\r\n\r\n");
    check_head(ok, two, 1, 0, VX_H1_CHUNKED | VX_H1_CLOSE,
               "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
               "transfer-encoding: chunked\r\nconnection: close\r\n\r\n");
    /* Empty names and values as NULL pointers (an empty bytes object may give one). */
    vx_h1_field empty[] = {{NULL, 0, NULL, 0}, {"x", 1, NULL, 0}};
    check_head(ok, empty, 2, 0, 0, "HTTP/1.1 200 OK\r\n: \r\nx: \r\n\r\n");
    /* The largest content-length: 2^64 - 1, twenty digits. */
    check_head(ok, NULL, 0, UINT64_MAX, VX_H1_LENGTH,
               "HTTP/1.1 200 OK\r\ncontent-length: 18446744073709551615\r\n\r\n");
}

static void test_dec_len(void)
{
    CHECK(vx_h1_dec_len(0) == 1);
    CHECK(vx_h1_dec_len(9) == 1);
    CHECK(vx_h1_dec_len(10) == 2);
    CHECK(vx_h1_dec_len(99999) == 5);
    CHECK(vx_h1_dec_len(100000) == 6);
    CHECK(vx_h1_dec_len(UINT64_MAX) == 20);
}

static void test_chunks(void)
{
    CHECK(vx_h1_chunk_size(0) == 0);
    char guard[2] = {(char)GUARD, 0};
    CHECK(vx_h1_write_chunk(guard, NULL, 0) == guard); /* nothing, not even with NULL data */
    CHECK(guard[0] == (char)GUARD);
    /* Sizes around every hex digit boundary up to 3 digits, and a large one. */
    static const size_t sizes[] = {1, 9, 10, 15, 16, 17, 255, 256, 4095, 4096, 65536 + 3};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        size_t n = sizes[i];
        char *data = malloc(n);
        CHECK(data != NULL);
        if (data == NULL)
            return;
        for (size_t k = 0; k < n; k++)
            data[k] = (char)('a' + k % 26);
        char expect_head[32];
        int hl = snprintf(expect_head, sizeof expect_head, "%zx\r\n", n);
        size_t size = vx_h1_chunk_size(n);
        CHECK(size == (size_t)hl + n + 2);
        char *buf = malloc(size + 1);
        CHECK(buf != NULL);
        if (buf == NULL) {
            free(data);
            return;
        }
        buf[size] = (char)GUARD;
        char *end = vx_h1_write_chunk(buf, data, n);
        CHECK(end == buf + size);
        CHECK(memcmp(buf, expect_head, (size_t)hl) == 0);
        CHECK(memcmp(buf + hl, data, n) == 0);
        CHECK(memcmp(buf + hl + n, "\r\n", 2) == 0);
        CHECK(buf[size] == (char)GUARD);
        free(buf);
        free(data);
    }
    CHECK(strlen(VX_H1_LAST_CHUNK) == VX_H1_LAST_CHUNK_LEN);
}

static void test_server_timing(void)
{
    char buf[VX_H1_TIMING_MAX + 1];
    buf[VX_H1_TIMING_MAX] = (char)GUARD;
    const char *small = "ring;dur=0.000, parse;dur=0.007, ratelimit;dur=1.000, upstream;dur=12.345";
    size_t n = vx_h1_server_timing(buf, 0, 7, 1000, 12345);
    CHECK(n == strlen(small) && memcmp(buf, small, n) == 0);
    /* The widest value: every duration 2^64 - 1 us fits the buffer. */
    n = vx_h1_server_timing(buf, UINT64_MAX, UINT64_MAX, UINT64_MAX, UINT64_MAX);
    CHECK(n <= VX_H1_TIMING_MAX);
    CHECK(memcmp(buf, "ring;dur=18446744073709551.615, ", 32) == 0);
    CHECK(buf[VX_H1_TIMING_MAX] == (char)GUARD);
}

int main(void)
{
    test_heads();
    test_server_timing();
    test_dec_len();
    test_chunks();
    if (failures) {
        fprintf(stderr, "test_http1: %d check(s) failed\n", failures);
        return 1;
    }
    printf("test_http1: ok\n");
    return 0;
}
