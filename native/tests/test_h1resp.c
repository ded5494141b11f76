/* Unit tests of vx_h1resp: the upstream response-head subset parser and the body decoder.
 *
 * The differential fuzz against httptools lives in tests/native/test_h1resp_fuzz.py; these
 * check the core alone, also under the sanitizers: every input is copied into an exact-size
 * heap buffer (a read past its end is an ASan report), every proper prefix of an accepted head
 * says MORE, each rule of the subset says FALLBACK where it should, and a chunked body decodes
 * the same fed whole and fed a byte at a time.
 */
#include "vx_h1resp.h"

#include "tests/check.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_FIELDS 16
#define MAX_HEAD 4096

static vx_hr_field fields[MAX_FIELDS];

static int parse_n(const char *s, size_t n, int no_body, vx_h1resp *out)
{
    char *buf = malloc(n ? n : 1);
    CHECK(buf != NULL);
    if (buf == NULL)
        return -1;
    memcpy(buf, s, n);
    int rc = vx_h1resp_parse(buf, n, fields, MAX_FIELDS, MAX_HEAD, no_body, out);
    free(buf);
    return rc;
}

static int parse(const char *s, vx_h1resp *out)
{
    return parse_n(s, strlen(s), 0, out);
}

static int field_is(const char *s, size_t i, const char *name, const char *value)
{
    return fields[i].name_len == strlen(name) &&
           memcmp(s + fields[i].name_off, name, strlen(name)) == 0 &&
           fields[i].value_len == strlen(value) &&
           memcmp(s + fields[i].value_off, value, strlen(value)) == 0;
}

static void test_accepts(void)
{
    const char *s = "HTTP/1.1 200 OK\r\n"
                    "Content-Type: text/event-stream\r\n"
                    "X-Empty:\r\n"
                    "X-Trail:  v \t\r\n"
                    "X-Obs: \x80\xff\r\n"
                    "Transfer-Encoding: Chunked\r\n"
                    "\r\n5\r\nhello";
    vx_h1resp h;
    CHECK(parse(s, &h) == VX_HR_DONE);
    CHECK(h.status == 200 && h.nfields == 5 && h.keep_alive);
    CHECK(h.framing == VX_HR_BODY_CHUNKED);
    CHECK(h.head_len == strlen(s) - strlen("5\r\nhello"));
    CHECK(field_is(s, 0, "Content-Type", "text/event-stream"));
    CHECK(field_is(s, 1, "X-Empty", ""));
    CHECK(field_is(s, 2, "X-Trail", "v \t"));
    CHECK(field_is(s, 3, "X-Obs", "\x80\xff"));
    /* Every proper prefix is a valid beginning. */
    size_t head = h.head_len;
    for (size_t n = 0; n < head; n++)
        CHECK(parse_n(s, n, 0, &h) == VX_HR_MORE);

    CHECK(parse("HTTP/1.1 404\r\ncontent-length: 0012\r\nconnection: Close\r\n\r\n", &h) ==
          VX_HR_DONE);
    CHECK(h.status == 404 && h.framing == VX_HR_BODY_LENGTH && h.content_length == 12);
    CHECK(!h.keep_alive);
    CHECK(parse("HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n", &h) == VX_HR_DONE);
    CHECK(h.framing == VX_HR_BODY_NONE);
    CHECK(parse("HTTP/1.1 204 No Content\r\n\r\n", &h) == VX_HR_DONE);
    CHECK(h.framing == VX_HR_BODY_NONE);
    /* The answer to HEAD has no body whatever it announces. */
    const char *hd = "HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\n";
    CHECK(parse_n(hd, strlen(hd), 1, &h) == VX_HR_DONE && h.framing == VX_HR_BODY_NONE);
}

static void test_falls_back(void)
{
    static const char *const heads[] = {
        "HTTP/1.0 200 OK\r\ncontent-length: 1\r\n\r\n",     /* version */
        "HTTP/1.1 100 Continue\r\n\r\n",                    /* interim */
        "HTTP/1.1 200 OK\r\n\r\n",                          /* close-delimited */
        "HTTP/1.1 200 OK\ncontent-length: 1\r\n\r\n",       /* bare LF */
        "HTTP/1.1 200 OK\r\ncontent-length: 1\n\r\n",       /* bare LF */
        "HTTP/1.1 200 OK\r\nx: a\rb\r\ncontent-length: 1\r\n\r\n", /* bare CR */
        "HTTP/1.1 200 OK\r\n folded\r\ncontent-length: 1\r\n\r\n",  /* obs-fold */
        "HTTP/1.1 200 OK\r\nbad name: v\r\ncontent-length: 1\r\n\r\n",
        "HTTP/1.1 200 OK\r\n: v\r\ncontent-length: 1\r\n\r\n",
        "HTTP/1.1 200 OK\r\ncontent-length: 1\r\ncontent-length: 1\r\n\r\n",
        "HTTP/1.1 200 OK\r\ncontent-length: 1x\r\n\r\n",
        "HTTP/1.1 200 OK\r\ncontent-length: 1234567890123456789\r\n\r\n",
        "HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n",
        "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 1\r\n\r\n",
        "HTTP/1.1 200 OK\r\nconnection: upgrade\r\ncontent-length: 1\r\n\r\n",
        "HTTP/1.1 200 OK\r\nupgrade: h2c\r\ncontent-length: 1\r\n\r\n",
        "HTTP/1.1 200 OK\r\nx: \x7f\r\ncontent-length: 1\r\n\r\n", /* DEL */
        "HTTP/1.1 2000 OK\r\ncontent-length: 1\r\n\r\n",
        "HTTP/1.1 20 OK\r\ncontent-length: 1\r\n\r\n",
        "HTTP/1.1 200OK\r\ncontent-length: 1\r\n\r\n",
        "HTTP/2.0 200 OK\r\ncontent-length: 1\r\n\r\n",
    };
    vx_h1resp h;
    for (size_t i = 0; i < sizeof heads / sizeof heads[0]; i++) {
        int rc = parse(heads[i], &h);
        if (rc != VX_HR_FALLBACK)
            fprintf(stderr, "head %zu: %d\n", i, rc);
        CHECK(rc == VX_HR_FALLBACK);
    }
    /* More fields than room, and a head over max_head. */
    char big[8192];
    size_t n = (size_t)snprintf(big, sizeof big, "HTTP/1.1 200 OK\r\n");
    for (int i = 0; i <= MAX_FIELDS; i++)
        n += (size_t)snprintf(big + n, sizeof big - n, "x%d: v\r\n", i);
    n += (size_t)snprintf(big + n, sizeof big - n, "content-length: 1\r\n\r\n");
    CHECK(parse_n(big, n, 0, &h) == VX_HR_FALLBACK);
    memset(big, 'a', sizeof big);
    memcpy(big, "HTTP/1.1 200 OK\r\nx: ", 20);
    CHECK(parse_n(big, sizeof big, 0, &h) == VX_HR_FALLBACK);
}

/* Decode body (exact-size heap copy) fed in pieces of `step` bytes; the data into out. */
static int decode(const char *body, size_t len, size_t step, const vx_h1resp *h, char *out,
                  size_t *out_len, size_t *consumed)
{
    char *buf = malloc(len ? len : 1);
    CHECK(buf != NULL);
    if (buf == NULL)
        return -1;
    memcpy(buf, body, len);
    vx_hr_body b;
    int rc = vx_hr_body_start(&b, h);
    size_t at = 0;
    *out_len = 0;
    while (rc == 0 && at < len) {
        size_t n = len - at < step ? len - at : step;
        vx_hr_span spans[2];
        size_t ns, used;
        rc = vx_hr_body_feed(&b, buf + at, n, spans, 2, &ns, &used);
        for (size_t i = 0; i < ns; i++) {
            memcpy(out + *out_len, buf + at + spans[i].off, spans[i].len);
            *out_len += spans[i].len;
        }
        CHECK(used <= n);
        at += used;
        if (rc == 0 && used == 0 && ns == 0) {
            CHECK(0); /* no progress */
            break;
        }
    }
    *consumed = at;
    free(buf);
    return rc;
}

static void test_body(void)
{
    vx_h1resp chunked = {0, 200, 0, VX_HR_BODY_CHUNKED, 0, 1};
    const char *body = "5;ext=1\r\nhello\r\n1\r\n \r\n0A\r\n0123456789\r\n0\r\nx-t: 1\r\n\r\nNEXT";
    char out[64];
    for (size_t step = 1; step <= strlen(body); step++) {
        size_t n, used;
        CHECK(decode(body, strlen(body), step, &chunked, out, &n, &used) == 1);
        CHECK(n == 16 && memcmp(out, "hello 0123456789", 16) == 0);
        CHECK(used == strlen(body) - 4); /* stops at the message's end */
    }
    static const char *const broken[] = {
        "x\r\n", "5\r\nhelloX\r\n", "5\nhello\r\n", "1\r\na\r\n0\r\n\r\r",
        "1234567890abcdef\r\n", "\r\n", "5 ;x\r\nhello\r\n", "5\r\nhello\r\n0\r\n:bad\r\n\r\n",
    };
    for (size_t i = 0; i < sizeof broken / sizeof broken[0]; i++) {
        size_t n, used;
        CHECK(decode(broken[i], strlen(broken[i]), 3, &chunked, out, &n, &used) == VX_HR_ERROR);
    }
    vx_h1resp length = {0, 200, 0, VX_HR_BODY_LENGTH, 7, 1};
    size_t n, used;
    CHECK(decode("abcdefgREST", 11, 2, &length, out, &n, &used) == 1);
    CHECK(n == 7 && memcmp(out, "abcdefg", 7) == 0 && used == 7);
    CHECK(decode("abc", 3, 2, &length, out, &n, &used) == 0 && n == 3);
}

int main(void)
{
    test_accepts();
    test_falls_back();
    test_body();
    if (failures)
        fprintf(stderr, "test_h1resp: %d failure(s)\n", failures);
    else
        printf("test_h1resp: ok\n");
    return failures != 0;
}
