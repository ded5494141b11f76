/* vx_reqhead: one complete HTTP/1.1 request head in one call (see vx_reqhead.h for what is
 * accepted and why everything else is left to httptools).
 *
 * One forward pass, no backtracking: every byte is classified once. Running out of bytes at
 * any point means "valid so far, need more" (the caller calls again from the start with more
 * bytes; heads are a few hundred bytes, and an incomplete one longer than max_partial falls
 * back, which bounds the rescanning a client trickling its head byte by byte can cause).
 */
#include "vx_reqhead.h"

#include <string.h>

static const struct {
    const char *name;
    size_t len;
} METHODS[VX_RH_METHODS] = {
    [VX_RH_GET] = {"GET", 3},         [VX_RH_HEAD] = {"HEAD", 4},
    [VX_RH_POST] = {"POST", 4},       [VX_RH_PUT] = {"PUT", 3},
    [VX_RH_DELETE] = {"DELETE", 6},   [VX_RH_OPTIONS] = {"OPTIONS", 7},
    [VX_RH_PATCH] = {"PATCH", 5},
};

const char *vx_reqhead_method_name(int method, size_t *len)
{
    *len = METHODS[method].len;
    return METHODS[method].name;
}

void vx_reqhead_lower(char *dst, const char *src, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)src[i];
        dst[i] = (char)(c >= 'A' && c <= 'Z' ? c + 32 : c);
    }
}

/* Byte classes: 1 tchar (RFC 9110 §5.6.2), 2 field-value byte (HTAB, SP, VCHAR, obs-text),
 * 4 target byte (visible ASCII 0x21-0x7E), 8 Host byte (uri-host [":" port] of RFC 3986:
 * ALPHA DIGIT "-._~" sub-delims "%" "[]:"; the set Go's net/http checks a Host against).
 * Generated from those definitions; one load per byte instead of a chain of comparisons: the
 * SDK's 483-byte head took 998 ns of CPU with the comparisons and 741 ns with the table (-O2,
 * this 2-core host under load). */
#define C_TCHAR 1u
#define C_VALUE 2u
#define C_TARGET 4u
#define C_HOST 8u
static const unsigned char CLASS[256] = {
    0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0,
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    2, 15, 6, 7, 15, 15, 15, 15, 14, 14, 15, 15, 14, 15, 15, 6,
    15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 14, 14, 6, 14, 6, 6,
    6, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15,
    15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 14, 6, 14, 7, 15,
    7, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15,
    15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 6, 7, 6, 15, 0,
    2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2,
    2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2,
    2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2,
    2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2,
    2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2,
    2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2,
    2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2,
    2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2,
};

/* a equals the lower-case literal b (length n) ignoring ASCII case. */
static int ieq(const char *a, size_t alen, const char *b, size_t n)
{
    if (alen != n)
        return 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)a[i];
        if ((c >= 'A' && c <= 'Z' ? c + 32 : c) != (unsigned char)b[i])
            return 0;
    }
    return 1;
}

#define IEQ(a, alen, lit) ieq((a), (alen), (lit), sizeof(lit) - 1)

/* A Host value of Host bytes only (RFC 9112 §3.2), once the trailing whitespace that field
 * values keep here (see vx_reqhead.h) is set aside; empty is valid (a target URI without an
 * authority). */
static int valid_host(const char *v, size_t n)
{
    size_t i = 0;
    while (i < n && (CLASS[(unsigned char)v[i]] & C_HOST))
        i++;
    while (i < n && (v[i] == ' ' || v[i] == '\t'))
        i++;
    return i == n;
}

int vx_reqhead_parse(const char *buf, size_t len, vx_rh_field *fields, size_t max_fields,
                     size_t max_header_bytes, size_t max_partial, vx_reqhead *out)
{
    if (len > VX_RH_MAX_LEN)
        len = VX_RH_MAX_LEN; /* offsets are 32-bit; max_partial is far below this */
    const int more = len >= max_partial ? VX_RH_FALLBACK : VX_RH_MORE;
    size_t p = 0;

    /* method SP */
    while (p < len && buf[p] >= 'A' && buf[p] <= 'Z')
        p++;
    if (p == len)
        return p <= 7 ? more : VX_RH_FALLBACK; /* OPTIONS is the longest: 7 */
    if (buf[p] != ' ')
        return VX_RH_FALLBACK;
    /* The length and the first byte first: one memcmp call, not two for POST (HEAD's too). */
    out->method = -1;
    for (int m = 0; m < VX_RH_METHODS; m++)
        if (METHODS[m].len == p && METHODS[m].name[0] == buf[0] &&
            memcmp(buf, METHODS[m].name, p) == 0) {
            out->method = m;
            break;
        }
    if (out->method < 0)
        return VX_RH_FALLBACK;
    p++;

    /* origin-form target SP */
    size_t target = p;
    if (p == len)
        return more;
    if (buf[p] != '/')
        return VX_RH_FALLBACK;
    while (p < len && (CLASS[(unsigned char)buf[p]] & C_TARGET))
        p++;
    if (p == len)
        return more;
    if (buf[p] != ' ')
        return VX_RH_FALLBACK;
    out->target_off = (uint32_t)target;
    out->target_len = (uint32_t)(p - target);
    p++;

    /* "HTTP/1.1" or "HTTP/1.0", CRLF */
    static const char VERSION[] = "HTTP/1.";
    for (size_t i = 0; i < 7; i++, p++) {
        if (p == len)
            return more;
        if (buf[p] != VERSION[i])
            return VX_RH_FALLBACK;
    }
    if (p == len)
        return more;
    if (buf[p] != '1' && buf[p] != '0')
        return VX_RH_FALLBACK;
    out->http10 = buf[p] == '0';
    p++;
    for (int i = 0; i < 2; i++, p++) {
        if (p == len)
            return more;
        if (buf[p] != "\r\n"[i])
            return VX_RH_FALLBACK;
    }

    size_t header_bytes = out->target_len;
    size_t n = 0;
    int64_t content_length = -1;
    int authorization = -1, traceparent = -1, expect = 0, connection = 0, close = 0, keep_alive = 0, host = 0;
    for (;;) {
        if (p == len)
            return more;
        if (buf[p] == '\r') { /* the blank line ends the head */
            if (p + 1 == len)
                return more;
            if (buf[p + 1] != '\n')
                return VX_RH_FALLBACK;
            p += 2;
            break;
        }
        size_t name = p;
        while (p < len && (CLASS[(unsigned char)buf[p]] & C_TCHAR))
            p++;
        if (p == len)
            return more;
        if (buf[p] != ':' || p == name) /* also obs-fold, bare LF, SP before the colon */
            return VX_RH_FALLBACK;
        size_t name_len = p - name;
        p++;
        while (p < len && (buf[p] == ' ' || buf[p] == '\t'))
            p++;
        size_t value = p;
        while (p < len && (CLASS[(unsigned char)buf[p]] & C_VALUE))
            p++;
        if (p == len)
            return more;
        if (buf[p] != '\r')
            return VX_RH_FALLBACK;
        if (p + 1 == len)
            return more;
        if (buf[p + 1] != '\n')
            return VX_RH_FALLBACK;
        size_t value_len = p - value;
        p += 2;

        if (n == max_fields)
            return VX_RH_FALLBACK;
        header_bytes += name_len + value_len + 4;
        if (header_bytes > max_header_bytes)
            return VX_RH_FALLBACK; /* httptools answers the 431 */
        const char *nm = buf + name, *v = buf + value;
        switch (name_len) {
        case 4: /* one valid Host, or httptools' path answers the 400 (RFC 9112 §3.2) */
            if (IEQ(nm, name_len, "host")) {
                if (host || !valid_host(v, value_len))
                    return VX_RH_FALLBACK;
                host = 1;
            }
            break;
        case 14:
            if (IEQ(nm, name_len, "content-length")) {
                if (content_length >= 0 || value_len == 0 || value_len > 18)
                    return VX_RH_FALLBACK; /* 18 digits < 2^63: no overflow */
                int64_t cl = 0;
                for (size_t i = 0; i < value_len; i++) {
                    if (v[i] < '0' || v[i] > '9')
                        return VX_RH_FALLBACK;
                    cl = cl * 10 + (v[i] - '0');
                }
                content_length = cl;
            }
            break;
        case 17:
            if (IEQ(nm, name_len, "transfer-encoding"))
                return VX_RH_FALLBACK;
            break;
        case 7:
            if (IEQ(nm, name_len, "upgrade"))
                return VX_RH_FALLBACK;
            break;
        case 16:
            if (IEQ(nm, name_len, "proxy-connection"))
                return VX_RH_FALLBACK;
            break;
        case 10:
            if (IEQ(nm, name_len, "connection")) {
                if (connection)
                    return VX_RH_FALLBACK;
                connection = 1;
                if (IEQ(v, value_len, "close"))
                    close = 1;
                else if (IEQ(v, value_len, "keep-alive"))
                    keep_alive = 1;
                else
                    return VX_RH_FALLBACK;
            }
            break;
        case 13:
            if (IEQ(nm, name_len, "authorization")) {
                if (authorization >= 0)
                    return VX_RH_FALLBACK; /* ingress refuses two credentials (400) */
                authorization = (int)n;
            }
            break;
        case 11:
            if (IEQ(nm, name_len, "traceparent"))
                traceparent = traceparent == -1 ? (int)n : VX_RH_MANY;
            break;
        case 6:
            if (IEQ(nm, name_len, "expect") && IEQ(v, value_len, "100-continue"))
                expect = 1;
            break;
        default:
            break;
        }
        fields[n].name_off = (uint32_t)name;
        fields[n].name_len = (uint32_t)name_len;
        fields[n].value_off = (uint32_t)value;
        fields[n].value_len = (uint32_t)value_len;
        n++;
    }
    if (!host && !out->http10)
        return VX_RH_FALLBACK; /* HTTP/1.1 requires Host; HTTP/1.0 may omit it */
    out->head_len = p;
    out->nfields = n;
    out->content_length = content_length;
    out->authorization = authorization;
    out->traceparent = traceparent;
    out->expect_continue = expect;
    out->keep_alive = out->http10 ? keep_alive : !close;
    out->header_bytes = header_bytes;
    return VX_RH_DONE;
}

/* A Connection value naming no other field: "keep-alive" or "close", any case. */
int vx_reqhead_plain_connection(const char *v, size_t n)
{
    static const char *const plain[] = {"keep-alive", "close"};
    for (int p = 0; p < 2; p++) {
        size_t len = strlen(plain[p]), j = 0;
        if (len != n)
            continue;
        while (j < n && (v[j] | (v[j] >= 'A' && v[j] <= 'Z' ? 0x20 : 0)) == plain[p][j])
            j++;
        if (j == n)
            return 1;
    }
    return 0;
}
