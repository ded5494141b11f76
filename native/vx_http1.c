/* vx_http1: HTTP/1.1 response heads and chunk framing (see vx_http1.h for the layout).
 *
 * Two passes over the same description, one to size and one to write, so the caller can
 * allocate the exact buffer once (the binding writes straight into a new bytes object).
 */
#include "vx_http1.h"

#include <string.h>

static const char CONTENT_LENGTH[] = "content-length: ";
static const char CHUNKED[] = "transfer-encoding: chunked\r\n";
static const char CLOSE[] = "connection: close\r\n";
#define LIT_LEN(s) (sizeof(s) - 1)

size_t vx_h1_dec_len(uint64_t n)
{
    size_t len = 1;
    while (n >= 10) {
        n /= 10;
        len++;
    }
    return len;
}

static size_t hex_len(size_t n)
{
    size_t len = 1;
    while (n >= 16) {
        n >>= 4;
        len++;
    }
    return len;
}

size_t vx_h1_head_size(size_t status_len, const vx_h1_field *fields, size_t nfields,
                       uint64_t content_length, unsigned flags)
{
    size_t size = status_len + 2; /* + the blank line */
    if (flags & VX_H1_LENGTH)
        size += LIT_LEN(CONTENT_LENGTH) + vx_h1_dec_len(content_length) + 2;
    for (size_t i = 0; i < nfields; i++)
        size += fields[i].name_len + 2 + fields[i].value_len + 2; /* ": " and CRLF */
    if (flags & VX_H1_CHUNKED)
        size += LIT_LEN(CHUNKED);
    if (flags & VX_H1_CLOSE)
        size += LIT_LEN(CLOSE);
    return size;
}

static char *put(char *out, const char *s, size_t n)
{
    if (n) /* memcpy with a NULL source is undefined even for 0 bytes (an empty bytes value) */
        memcpy(out, s, n);
    return out + n;
}

static char *put_dec(char *out, uint64_t n)
{
    size_t len = vx_h1_dec_len(n);
    for (size_t i = len; i > 0; i--) {
        out[i - 1] = (char)('0' + n % 10);
        n /= 10;
    }
    return out + len;
}

char *vx_h1_write_head(char *out, const char *status, size_t status_len,
                       const vx_h1_field *fields, size_t nfields, uint64_t content_length,
                       unsigned flags)
{
    out = put(out, status, status_len);
    if (flags & VX_H1_LENGTH) {
        out = put(out, CONTENT_LENGTH, LIT_LEN(CONTENT_LENGTH));
        out = put_dec(out, content_length);
        out = put(out, "\r\n", 2);
    }
    for (size_t i = 0; i < nfields; i++) {
        out = put(out, fields[i].name, fields[i].name_len);
        out = put(out, ": ", 2);
        out = put(out, fields[i].value, fields[i].value_len);
        out = put(out, "\r\n", 2);
    }
    if (flags & VX_H1_CHUNKED)
        out = put(out, CHUNKED, LIT_LEN(CHUNKED));
    if (flags & VX_H1_CLOSE)
        out = put(out, CLOSE, LIT_LEN(CLOSE));
    return put(out, "\r\n", 2);
}

size_t vx_h1_chunk_size(size_t n)
{
    return n ? hex_len(n) + 2 + n + 2 : 0;
}

char *vx_h1_write_chunk(char *out, const char *data, size_t n)
{
    static const char digits[] = "0123456789abcdef";
    if (n == 0)
        return out;
    size_t len = hex_len(n);
    size_t v = n;
    for (size_t i = len; i > 0; i--) {
        out[i - 1] = digits[v & 15];
        v >>= 4;
    }
    out += len;
    out = put(out, "\r\n", 2);
    out = put(out, data, n);
    return put(out, "\r\n", 2);
}

/* "name;dur=<us / 1000>.<us % 1000, three digits>" */
static char *put_dur(char *out, const char *name, size_t name_len, uint64_t us)
{
    out = put(out, name, name_len);
    out = put_dec(out, us / 1000);
    uint64_t frac = us % 1000;
    out[0] = '.';
    out[1] = (char)('0' + frac / 100);
    out[2] = (char)('0' + frac / 10 % 10);
    out[3] = (char)('0' + frac % 10);
    return out + 4;
}

size_t vx_h1_server_timing(char *out, uint64_t ring_us, uint64_t parse_us, uint64_t limit_us,
                           uint64_t upstream_us)
{
    /* At most 4 * (20 + 4) bytes of figures and 52 of names: 148 < VX_H1_TIMING_MAX. */
    char *p = out;
    p = put_dur(p, "ring;dur=", 9, ring_us);
    p = put_dur(p, ", parse;dur=", 12, parse_us);
    p = put_dur(p, ", ratelimit;dur=", 16, limit_us);
    p = put_dur(p, ", upstream;dur=", 15, upstream_us);
    return (size_t)(p - out);
}
