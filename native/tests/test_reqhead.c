/* Unit tests of vx_reqhead: the request-head subset parser.
 *
 * The differential fuzz against httptools lives in tests/native/test_reqhead_fuzz.py; these
 * check the core alone, also under the sanitizers: every head is copied into an exact-size
 * heap buffer so that reading one byte past the end is an ASan report, every proper prefix of
 * an accepted head says MORE, and each rule of the subset says FALLBACK where it should.
 */
#include "vx_reqhead.h"

#include "tests/check.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_FIELDS 16
#define MAX_HEADER 4096
#define MAX_PARTIAL 4096

static vx_rh_field fields[MAX_FIELDS];

/* Parse the first n bytes of s from an exact-size heap copy. */
static int parse_n(const char *s, size_t n, vx_reqhead *out)
{
    char *buf = malloc(n ? n : 1);
    CHECK(buf != NULL);
    if (buf == NULL)
        return -1;
    memcpy(buf, s, n);
    int rc = vx_reqhead_parse(buf, n, fields, MAX_FIELDS, MAX_HEADER, MAX_PARTIAL, out);
    free(buf);
    return rc;
}

static int parse(const char *s, vx_reqhead *out)
{
    return parse_n(s, strlen(s), out);
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
    const char *s = "POST /v1/chat/completions?a=1 HTTP/1.1\r\n"
                    "Host: 127.0.0.1:8080\r\n"
                    "Content-Type:application/json\r\n"
                    "Authorization: Bearer a\r\n"
                    "X-Empty:\r\n"
                    "X-Trail: v \t\r\n"
                    "X-Obs: \x80\xff\r\n"
                    "x-authorization:  Bearer b\r\n"
                    "Content-Length: 0012\r\n"
                    "Expect: 100-Continue\r\n"
                    "\r\nbody after the head";
    vx_reqhead h;
    CHECK(parse(s, &h) == VX_RH_DONE);
    CHECK(h.head_len == (size_t)(strstr(s, "\r\n\r\n") - s) + 4);
    CHECK(h.method == VX_RH_POST);
    CHECK(h.target_len == 24 && memcmp(s + h.target_off, "/v1/chat/completions?a=1", 24) == 0);
    CHECK(h.http10 == 0 && h.keep_alive == 1);
    CHECK(h.nfields == 9);
    CHECK(field_is(s, 0, "Host", "127.0.0.1:8080"));
    CHECK(field_is(s, 1, "Content-Type", "application/json"));
    CHECK(field_is(s, 3, "X-Empty", ""));
    CHECK(field_is(s, 4, "X-Trail", "v \t")); /* trailing OWS kept, as llhttp reports it */
    CHECK(field_is(s, 5, "X-Obs", "\x80\xff"));
    CHECK(field_is(s, 2, "Authorization", "Bearer a"));
    CHECK(field_is(s, 6, "x-authorization", "Bearer b"));
    CHECK(h.authorization == 2);
    CHECK(h.content_length == 12);
    CHECK(h.expect_continue == 1);
    size_t count = 24;
    for (size_t i = 0; i < h.nfields; i++)
        count += fields[i].name_len + fields[i].value_len + 4;
    CHECK(h.header_bytes == count);

    /* Every proper prefix is a valid beginning. */
    for (size_t n = 0; n < h.head_len; n++)
        CHECK(parse_n(s, n, &h) == VX_RH_MORE);
    /* Two Authorization fields (any case) are left to httptools' path, which refuses them. */
    CHECK(parse("GET / HTTP/1.1\r\nAuthorization: a\r\nauthorization: a\r\n\r\n", &h) ==
          VX_RH_FALLBACK);

    CHECK(parse("GET / HTTP/1.0\r\n\r\n", &h) == VX_RH_DONE); /* HTTP/1.0 may omit Host */
    CHECK(h.method == VX_RH_GET && h.http10 && !h.keep_alive && h.nfields == 0);
    CHECK(h.content_length == -1 && h.authorization == -1 && !h.expect_continue);
    CHECK(h.traceparent == -1);
    CHECK(parse("HEAD /a HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n", &h) == VX_RH_DONE);
    CHECK(h.method == VX_RH_HEAD && h.keep_alive);
    CHECK(parse("DELETE /a HTTP/1.1\r\nHost: a\r\nconnection: CLOSE\r\n\r\n", &h) ==
          VX_RH_DONE);
    CHECK(h.method == VX_RH_DELETE && !h.keep_alive);
    CHECK(parse("OPTIONS /a HTTP/1.1\r\nHost: a\r\nExpect: 100-continue \r\n\r\n", &h) ==
          VX_RH_DONE);
    CHECK(h.method == VX_RH_OPTIONS && !h.expect_continue); /* trailing SP: not the token */
    CHECK(parse("PATCH /\"<>\\^`{|}#~ HTTP/1.1\r\nHost: a\r\n\r\n", &h) == VX_RH_DONE);
    CHECK(parse("PUT /a HTTP/1.1\r\nHost: a\r\nContent-Length: 999999999999999999\r\n\r\n",
                &h) == VX_RH_DONE);
    CHECK(h.method == VX_RH_PUT && h.content_length == 999999999999999999LL);
    size_t len;
    CHECK(strcmp(vx_reqhead_method_name(VX_RH_PATCH, &len), "PATCH") == 0 && len == 5);

    /* Host values (RFC 9112 §3.2): uri-host [":" port], trailing OWS set aside, empty valid;
     * with HTTP/1.0, one Host is checked as with HTTP/1.1. */
    static const char *const hosts[] = {
        "GET / HTTP/1.1\r\nHost: 127.0.0.1:8080\r\n\r\n",
        "GET / HTTP/1.1\r\nhost: [::1]:8080\r\n\r\n",
        "GET / HTTP/1.1\r\nHOST: api.example.com\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: a-b.c_d~e!$&'()*+,;=%41\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: a \t\r\n\r\n",
        "GET / HTTP/1.1\r\nHost:\r\n\r\n",
        "GET / HTTP/1.0\r\nHost: a\r\n\r\n",
    };
    for (size_t i = 0; i < sizeof hosts / sizeof hosts[0]; i++)
        CHECK(parse(hosts[i], &h) == VX_RH_DONE);
}

/* The traceparent field: found in any position and case, its index kept; a repeated one is
 * VX_RH_MANY; a malformed value is still the client's field (the tracer judges the value). */
static void test_traceparent(void)
{
    vx_reqhead h;
    const char *first = "POST /v1/x HTTP/1.1\r\ntraceparent: 00-ab-cd-01\r\nHost: a\r\n\r\n";
    CHECK(parse(first, &h) == VX_RH_DONE && h.traceparent == 0);
    CHECK(field_is(first, 0, "traceparent", "00-ab-cd-01"));
    const char *last = "POST /v1/x HTTP/1.1\r\nHost: a\r\nX-A: 1\r\nTraceParent:  v \r\n\r\n";
    CHECK(parse(last, &h) == VX_RH_DONE && h.traceparent == 2);
    CHECK(field_is(last, 2, "TraceParent", "v "));
    CHECK(parse("GET / HTTP/1.1\r\nTRACEPARENT:\r\nHost: a\r\n\r\n", &h) == VX_RH_DONE);
    CHECK(h.traceparent == 0);
    CHECK(parse("GET / HTTP/1.1\r\ntraceparent: a\r\nHost: a\r\nTraceparent: a\r\n\r\n",
                &h) == VX_RH_DONE);
    CHECK(h.traceparent == VX_RH_MANY);
    /* Names that only look alike are other fields. */
    CHECK(parse("GET / HTTP/1.1\r\ntraceparents: a\r\ntracepar: a\r\ntracestate: a\r\n"
                "xraceparent: a\r\nHost: a\r\n\r\n", &h) == VX_RH_DONE);
    CHECK(h.traceparent == -1);
}

static void test_falls_back(void)
{
    static const char *const cases[] = {
        "\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n",           /* leading empty line */
        "get / HTTP/1.1\r\nHost: a\r\n\r\n",               /* method case */
        "CONNECT a:443 HTTP/1.1\r\nHost: a\r\n\r\n",       /* not in the subset */
        "TRACE / HTTP/1.1\r\nHost: a\r\n\r\n",
        "GETS / HTTP/1.1\r\nHost: a\r\n\r\n",
        "OPTIONSX / HTTP/1.1\r\nHost: a\r\n\r\n",
        "GET  / HTTP/1.1\r\nHost: a\r\n\r\n",              /* two spaces */
        "GET * HTTP/1.1\r\nHost: a\r\n\r\n",              /* asterisk-form */
        "GET http://a/ HTTP/1.1\r\nHost: a\r\n\r\n",      /* absolute-form */
        "GET /\r\nHost: a\r\n\r\n",                       /* HTTP/0.9: no version */
        "GET /\r\n\r\n",
        "GET / HTTP/0.9\r\nHost: a\r\n\r\n",
        "GET / HTTP/1.1\r\n\r\n",                          /* HTTP/1.1 without Host */
        "GET / HTTP/1.1\r\nX-Host: a\r\nHosts: a\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: a\r\nHost: a\r\n\r\n",    /* two Host fields */
        "GET / HTTP/1.0\r\nhost: a\r\nHOST: b\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: a/b\r\n\r\n",            /* not uri-host [":" port] */
        "GET / HTTP/1.1\r\nHost: u@a\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: a b\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: a\"\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: \xc3\xa9\r\n\r\n",
        "POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n",
        "GET /a\x80 HTTP/1.1\r\nHost: a\r\n\r\n",
        "GET /a\t HTTP/1.1\r\nHost: a\r\n\r\n",
        "GET /a  HTTP/1.1\r\nHost: a\r\n\r\n",
        "GET / HTTP/2.0\r\nHost: a\r\n\r\n",
        "GET / HTTP/1.2\r\nHost: a\r\n\r\n",
        "GET / HTTP/1.1 \r\nHost: a\r\n\r\n",
        "GET / HTTP/1.1\nHost: a\r\n\r\n",                 /* bare LF */
        "GET / HTTP/1.1\r\nHost: a\r\nA: b\n\r\n",
        "GET / HTTP/1.1\r\nHost: a\r\nA: b\r\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: a\r\nA: b\r\n c\r\n\r\n", /* obs-fold */
        "GET / HTTP/1.1\r\nHost: a\r\nA : b\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: a\r\n: b\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: a\r\nA(: b\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: a\r\nA: b\x7f\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: a\r\nA: b\x01\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: a\r\n\r\r\n",
        "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: a\r\nUpgrade: h2c\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: a\r\nProxy-Connection: close\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: a\r\nConnection: upgrade\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: a\r\nConnection: close \r\n\r\n",
        "GET / HTTP/1.1\r\nHost: a\r\nConnection: keep-alive, close\r\n\r\n",
        "GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\nConnection: close\r\n\r\n",
        "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\n",
        "POST / HTTP/1.1\r\nHost: a\r\nContent-Length:\r\n\r\n",
        "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: +1\r\n\r\n",
        "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 1 \r\n\r\n",
        "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 1,1\r\n\r\n",
        "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 1234567890123456789\r\n\r\n", /* 19 digits */
    };
    vx_reqhead h;
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int rc = parse(cases[i], &h);
        if (rc != VX_RH_FALLBACK)
            fprintf(stderr, "case %zu: %d\n", i, rc);
        CHECK(rc == VX_RH_FALLBACK);
    }
}

static void test_limits(void)
{
    vx_reqhead h;
    char buf[MAX_PARTIAL + 64];
    /* As many fields as the caller has room for (Host included) are parsed; one more falls
     * back (ingress's 431). */
    size_t n = (size_t)snprintf(buf, sizeof buf, "GET / HTTP/1.1\r\nHost: a\r\n");
    for (int i = 1; i < MAX_FIELDS; i++)
        n += (size_t)snprintf(buf + n, sizeof buf - n, "x-%d: v\r\n", i);
    memcpy(buf + n, "\r\n", 2);
    CHECK(parse_n(buf, n + 2, &h) == VX_RH_DONE);
    CHECK(h.nfields == MAX_FIELDS);
    n += (size_t)snprintf(buf + n, sizeof buf - n, "x: v\r\n\r\n");
    CHECK(parse_n(buf, n, &h) == VX_RH_FALLBACK);

    /* ingress's byte count: exactly at the limit is fine, one over falls back. */
    size_t value = MAX_HEADER - 1 - 9 - 5 - 4; /* target "/", Host "a", "x-big", ": " CRLF */
    n = (size_t)snprintf(buf, sizeof buf, "GET / HTTP/1.1\r\nHost: a\r\nx-big: ");
    memset(buf + n, 'v', value);
    n += value;
    memcpy(buf + n, "\r\n\r\n", 4);
    CHECK(parse_n(buf, n + 4, &h) == VX_RH_DONE);
    CHECK(h.header_bytes == MAX_HEADER);
    memmove(buf + n + 1, buf + n, 4);
    buf[n] = 'v';
    CHECK(parse_n(buf, n + 5, &h) == VX_RH_FALLBACK);

    /* An incomplete head of max_partial bytes falls back; one byte less waits. */
    n = (size_t)snprintf(buf, sizeof buf, "GET / HTTP/1.1\r\nx: ");
    memset(buf + n, 'v', MAX_PARTIAL - n);
    CHECK(parse_n(buf, MAX_PARTIAL - 1, &h) == VX_RH_MORE);
    CHECK(parse_n(buf, MAX_PARTIAL, &h) == VX_RH_FALLBACK);
}

int main(void)
{
    test_accepts();
    test_traceparent();
    test_falls_back();
    test_limits();
    if (failures) {
        fprintf(stderr, "test_reqhead: %d check(s) failed\n", failures);
        return 1;
    }
    printf("test_reqhead: ok\n");
    return 0;
}
