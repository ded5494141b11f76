/* vx_books: JSON strings for the access log and usage scanning. See vx_books.h. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* gmtime_r, memrchr under -std=c11 */
#endif

#include "vx_books.h"

#include <string.h>
#include <time.h>

static const char HEX[] = "0123456789abcdef";

/* One byte below 0x80 as JSON string content. */
static char *put_ascii(char *out, unsigned char c)
{
    if (c >= 0x20 && c != '"' && c != '\\') {
        *out++ = (char)c;
        return out;
    }
    *out++ = '\\';
    switch (c) {
    case '"': *out++ = '"'; break;
    case '\\': *out++ = '\\'; break;
    case '\b': *out++ = 'b'; break;
    case '\f': *out++ = 'f'; break;
    case '\n': *out++ = 'n'; break;
    case '\r': *out++ = 'r'; break;
    case '\t': *out++ = 't'; break;
    default:
        *out++ = 'u';
        *out++ = '0';
        *out++ = '0';
        *out++ = HEX[c >> 4];
        *out++ = HEX[c & 15];
    }
    return out;
}

char *vx_books_latin1(char *out, const unsigned char *s, size_t n)
{
    *out++ = '"';
    for (size_t i = 0; i < n; i++) {
        unsigned char c = s[i];
        if (c < 0x80) {
            out = put_ascii(out, c);
        } else { /* U+0080..U+00FF: two bytes of UTF-8 */
            *out++ = (char)(0xC0 | (c >> 6));
            *out++ = (char)(0x80 | (c & 0x3F));
        }
    }
    *out++ = '"';
    return out;
}

char *vx_books_utf8(char *out, const unsigned char *s, size_t n)
{
    *out++ = '"';
    for (size_t i = 0; i < n; i++) {
        unsigned char c = s[i];
        if (c < 0x80)
            out = put_ascii(out, c);
        else
            *out++ = (char)c;
    }
    *out++ = '"';
    return out;
}

size_t vx_books_utf8_prefix(const unsigned char *s, size_t n, size_t chars)
{
    size_t count = 0;
    for (size_t i = 0; i < n; i++) {
        if ((s[i] & 0xC0) != 0x80) { /* a lead byte starts a code point */
            if (count == chars)
                return i;
            count++;
        }
    }
    return n;
}

char *vx_books_i64(char *out, int64_t v)
{
    char tmp[VX_BOOKS_I64_MAX];
    size_t len = 0;
    /* Magnitude in unsigned arithmetic: INT64_MIN has no positive int64. */
    uint64_t m = v < 0 ? (uint64_t)0 - (uint64_t)v : (uint64_t)v;
    do {
        tmp[len++] = (char)('0' + m % 10);
        m /= 10;
    } while (m);
    if (v < 0)
        *out++ = '-';
    while (len)
        *out++ = tmp[--len];
    return out;
}

static char *put2(char *out, int v)
{
    *out++ = (char)('0' + v / 10);
    *out++ = (char)('0' + v % 10);
    return out;
}

int vx_books_time(char *out, int64_t ms)
{
    if (ms < 0 || ms > INT64_C(253402300799999)) /* 9999-12-31T23:59:59.999Z */
        return -1;
    time_t seconds = (time_t)(ms / 1000);
    struct tm tm;
    if (gmtime_r(&seconds, &tm) == NULL)
        return -1;
    int year = tm.tm_year + 1900, milli = (int)(ms % 1000);
    out = put2(out, year / 100);
    out = put2(out, year % 100);
    *out++ = '-';
    out = put2(out, tm.tm_mon + 1);
    *out++ = '-';
    out = put2(out, tm.tm_mday);
    *out++ = 'T';
    out = put2(out, tm.tm_hour);
    *out++ = ':';
    out = put2(out, tm.tm_min);
    *out++ = ':';
    out = put2(out, tm.tm_sec);
    *out++ = '.';
    *out++ = (char)('0' + milli / 100);
    out = put2(out, milli % 100);
    *out = 'Z';
    return 0;
}

/* ---- usage ---- */

static size_t skip_space(const unsigned char *s, size_t n, size_t i)
{
    while (i < n && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r'))
        i++;
    return i;
}

/* s[i..] starts with lit: the index past it, else 0 (never a valid index past a literal). */
static size_t expect(const unsigned char *s, size_t n, size_t i, const char *lit, size_t len)
{
    if (n - i < len || memcmp(s + i, lit, len) != 0)
        return 0;
    return i + len;
}

/* 1 to 15 digits at s[*i]: their value, *i moved past them; -1 when there are none or more. */
static int64_t digits(const unsigned char *s, size_t n, size_t *i)
{
    size_t j = *i;
    int64_t v = 0;
    while (j < n && s[j] >= '0' && s[j] <= '9') {
        if (j - *i == 15)
            return -1;
        v = v * 10 + (s[j] - '0');
        j++;
    }
    if (j == *i)
        return -1;
    *i = j;
    return v;
}

#define LIT(s) s, sizeof(s) - 1

int vx_books_usage(const unsigned char *s, size_t n, int64_t *in, int64_t *out)
{
    static const char KEY[] = "\"usage\"";
    const size_t klen = sizeof KEY - 1;
    if (n < klen)
        return 0;
    /* The last occurrence: scan backwards for its closing quote's first byte. */
    size_t at = (size_t)-1;
    for (size_t i = n - klen + 1; i-- > 0;) {
        if (s[i] == '"' && memcmp(s + i, KEY, klen) == 0) {
            at = i;
            break;
        }
    }
    if (at == (size_t)-1)
        return 0;
    size_t i = skip_space(s, n, at + klen);
    if (!(i = expect(s, n, i, LIT(":"))))
        return -1;
    i = skip_space(s, n, i);
    if (!(i = expect(s, n, i, LIT("{"))))
        return -1;
    i = skip_space(s, n, i);
    if (!(i = expect(s, n, i, LIT("\"prompt_tokens\""))))
        return -1;
    i = skip_space(s, n, i);
    if (!(i = expect(s, n, i, LIT(":"))))
        return -1;
    i = skip_space(s, n, i);
    int64_t a = digits(s, n, &i);
    if (a < 0)
        return -1;
    i = skip_space(s, n, i);
    if (!(i = expect(s, n, i, LIT(","))))
        return -1;
    i = skip_space(s, n, i);
    if (!(i = expect(s, n, i, LIT("\"completion_tokens\""))))
        return -1;
    i = skip_space(s, n, i);
    if (!(i = expect(s, n, i, LIT(":"))))
        return -1;
    i = skip_space(s, n, i);
    int64_t b = digits(s, n, &i);
    if (b < 0)
        return -1;
    *in = a;
    *out = b;
    return 1;
}

/* ---- estimate ---- */

static int py_space(unsigned char c)
{
    return c == ' ' || (c >= '\t' && c <= '\r'); /* \t \n \v \f \r */
}

static const unsigned char *find(const unsigned char *s, size_t n, const char *lit, size_t len)
{
    return memmem(s, n, lit, len);
}

/* At s[i] (just past `"max_`): the rest of one of the three keys, then \s* : \s* digits. */
static int64_t max_value(const unsigned char *s, size_t n, size_t i)
{
    static const char *const rests[] = {"completion_tokens\"", "output_tokens\"", "tokens\""};
    for (size_t r = 0; r < 3; r++) {
        size_t len = strlen(rests[r]);
        if (n - i < len || memcmp(s + i, rests[r], len) != 0)
            continue;
        size_t j = i + len;
        while (j < n && py_space(s[j]))
            j++;
        if (j >= n || s[j] != ':')
            return -1;
        j++;
        while (j < n && py_space(s[j]))
            j++;
        int64_t v = 0;
        size_t k = j;
        while (k < n && k - j < 12 && s[k] >= '0' && s[k] <= '9')
            v = v * 10 + (s[k++] - '0');
        return k > j ? v : -1;
    }
    return -1;
}

void vx_books_estimate(const unsigned char *s, size_t n, int64_t *input, int64_t *output)
{
    static const char B64[] = ";base64,";
    size_t inline_bytes = 0, payloads = 0, at = 0;
    const unsigned char *hit;
    while ((hit = find(s + at, n - at, B64, sizeof B64 - 1)) != NULL) {
        size_t start = (size_t)(hit - s) + sizeof B64 - 1;
        const unsigned char *quote = memchr(s + start, '"', n - start);
        if (quote == NULL)
            break;
        size_t end = (size_t)(quote - s);
        inline_bytes += end - start;
        payloads++;
        at = end;
    }
    size_t text = n - inline_bytes;
    *input = (int64_t)((text + VX_BOOKS_BYTES_PER_TOKEN - 1) / VX_BOOKS_BYTES_PER_TOKEN) +
             (int64_t)payloads * VX_BOOKS_IMAGE_TOKENS;
    *output = -1;
    at = 0;
    while ((hit = find(s + at, n - at, "\"max_", 5)) != NULL) {
        size_t i = (size_t)(hit - s) + 5;
        int64_t v = max_value(s, n, i);
        if (v >= 0) {
            *output = v;
            return;
        }
        at = (size_t)(hit - s) + 1;
    }
}
