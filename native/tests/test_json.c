/* test_json: vx_json_scan.
 *
 * Tables of valid and invalid documents (with the expected error code and offset), field
 * extraction (duplicates, escaped keys, nested keys ignored, non-object top level), depth at
 * and over the limit, every one- and two-byte UTF-8 lead/continuation pair against an
 * independent decoder, number range boundaries, every proper prefix of valid documents,
 * the word-at-a-time string loop with each byte value at each alignment, a deterministic
 * mutation fuzz checking the result invariants, and threads scanning one buffer at once (for
 * the TSan build: the scanner must have no shared mutable state). Exit status 0 when every
 * check passes; the orjson agreement itself is tested from Python.
 */
#include "vx_json.h"
#include "check.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* String literal and its length, embedded NULs included. */
#define DOC(s) (s), sizeof(s) - 1

static int scan(const char *doc, size_t len, vx_json_fields *f)
{
    return vx_json_scan((const unsigned char *)doc, len, f);
}

static void show(const char *what, const char *doc, size_t len, int rc, size_t off)
{
    fprintf(stderr, "  %s: rc %d (%s) offset %zu for %zu bytes: ", what, rc, vx_json_strerror(rc),
            off, len);
    for (size_t i = 0; i < len && i < 120; i++) {
        unsigned char c = (unsigned char)doc[i];
        if (c >= 0x20 && c < 0x7f)
            fputc(c, stderr);
        else
            fprintf(stderr, "\\x%02x", c);
    }
    fputc('\n', stderr);
}

/* ---------------------------------------------------------------- tables */

typedef struct {
    const char *doc;
    size_t len;
} valid_case;

static const valid_case valid[] = {
    {DOC("{}")},
    {DOC("[]")},
    {DOC("0")},
    {DOC("-0")},
    {DOC("1")},
    {DOC("-1.5e+10")},
    {DOC("1E-5")},
    {DOC("0e0")},
    {DOC("0.0e-0")},
    {DOC("-0.0E+00")},
    {DOC("123456789012345678901234567890")},
    {DOC("1e308")},
    {DOC("1.7976931348623157e308")},
    {DOC("-1.7976931348623158e308")}, /* still rounds to -DBL_MAX */
    {DOC("1e-400")},                  /* underflows to 0: fine */
    {DOC("1e-99999999999999999999999999")},
    {DOC("0e99999999999999999999")}, /* zero, whatever the exponent */
    {DOC("0.000e400")},
    {DOC("0.0001e312")},
    {DOC("10e307")},
    {DOC("1e0000000000000000000000308")},
    {DOC("true")},
    {DOC("false")},
    {DOC("null")},
    {DOC("\"\"")},
    {DOC(" \t\r\n{ \"a\" : [ 1 , 2 ] , \"b\" : { } } \t\r\n")},
    {DOC("[true,false,null,{\"a\":[]},\"x\",-0.5]")},
    {DOC("\"\\\" \\\\ \\/ \\b \\f \\n \\r \\t\"")},
    {DOC("\"\\u0000 \\u00e9\\u00E9 \\uFFFF \\uffff\"")},
    {DOC("\"\\ud83d\\ude00\"")},
    {DOC("\"\\uD83D\\uDE00\"")},
    {DOC("\"\\udbff\\udfff\"")}, /* U+10FFFF */
    {DOC("\"\\ud800\\udc00\"")}, /* U+10000 */
    {DOC("\"\\ud7ff\\ue000\"")}, /* just outside the surrogate range */
    {DOC("\"\x7f\"")},          /* DEL is not a control byte for JSON */
    {DOC("\"\xc2\x80 \xdf\xbf \xe0\xa0\x80 \xed\x9f\xbf \xee\x80\x80 \xef\xbf\xbf\"")},
    {DOC("\"\xf0\x90\x80\x80 \xf4\x8f\xbf\xbf \xef\xbb\xbf\"")}, /* a BOM inside a string is fine */
    {DOC("\"caf\xc3\xa9 \xe4\xb8\xad\xe6\x96\x87 \xf0\x9f\x98\x80\"")},
    {DOC("{\"\":\"\"}")},
    {DOC("{\"a\":1,\"a\":2}")},
};

typedef struct {
    const char *doc;
    size_t len;
    int rc;
    size_t off;
} invalid_case;

static const invalid_case invalid[] = {
    {DOC(""), VX_JSON_E_EMPTY, 0},
    {DOC(" \t\r\n"), VX_JSON_E_EMPTY, 4},
    {DOC("\xef\xbb\xbf{}"), VX_JSON_E_SYNTAX, 0}, /* BOM: orjson refuses it */
    {DOC("\x0c" "1"), VX_JSON_E_SYNTAX, 0},        /* form feed is not JSON whitespace */
    {DOC("\x0b" "1"), VX_JSON_E_SYNTAX, 0},
    {DOC("\xa0" "1"), VX_JSON_E_SYNTAX, 0},
    {DOC("\x00"), VX_JSON_E_SYNTAX, 0},
    {DOC("1\x00"), VX_JSON_E_TRAILING, 1},
    {DOC("{}\x00"), VX_JSON_E_TRAILING, 2},
    {DOC("1 2"), VX_JSON_E_TRAILING, 2},
    {DOC("[1]]"), VX_JSON_E_TRAILING, 3},
    {DOC("truex"), VX_JSON_E_TRAILING, 4},
    {DOC("0x10"), VX_JSON_E_TRAILING, 1},
    {DOC("[1,]"), VX_JSON_E_SYNTAX, 3},
    {DOC("{\"a\":1,}"), VX_JSON_E_SYNTAX, 7},
    {DOC("[,]"), VX_JSON_E_SYNTAX, 1},
    {DOC("{,}"), VX_JSON_E_SYNTAX, 1},
    {DOC("[1 2]"), VX_JSON_E_SYNTAX, 3},
    {DOC("{\"a\" 1}"), VX_JSON_E_SYNTAX, 5},
    {DOC("{\"a\"}"), VX_JSON_E_SYNTAX, 4},
    {DOC("{\"a\":}"), VX_JSON_E_SYNTAX, 5},
    {DOC("{1:2}"), VX_JSON_E_SYNTAX, 1},
    {DOC("{'a':1}"), VX_JSON_E_SYNTAX, 1},
    {DOC("[1}"), VX_JSON_E_SYNTAX, 2},
    {DOC("{\"a\":1]"), VX_JSON_E_SYNTAX, 6},
    {DOC("NaN"), VX_JSON_E_SYNTAX, 0},
    {DOC("Infinity"), VX_JSON_E_SYNTAX, 0},
    {DOC("-Infinity"), VX_JSON_E_NUMBER, 1},
    {DOC("nan"), VX_JSON_E_SYNTAX, 1},
    {DOC("True"), VX_JSON_E_SYNTAX, 0},
    {DOC("nul"), VX_JSON_E_TRUNCATED, 3},
    {DOC("nulll"), VX_JSON_E_TRAILING, 4},
    {DOC("/*c*/1"), VX_JSON_E_SYNTAX, 0},
    {DOC("1//c"), VX_JSON_E_TRAILING, 1},
    /* numbers */
    {DOC("01"), VX_JSON_E_NUMBER, 1},
    {DOC("-01"), VX_JSON_E_NUMBER, 2},
    {DOC("00"), VX_JSON_E_NUMBER, 1},
    {DOC("+1"), VX_JSON_E_SYNTAX, 0},
    {DOC(".1"), VX_JSON_E_SYNTAX, 0},
    {DOC("-"), VX_JSON_E_TRUNCATED, 1},
    {DOC("-a"), VX_JSON_E_NUMBER, 1},
    {DOC("[-]"), VX_JSON_E_NUMBER, 2},
    {DOC("1."), VX_JSON_E_TRUNCATED, 2},
    {DOC("1.e5"), VX_JSON_E_NUMBER, 2},
    {DOC("0.e1"), VX_JSON_E_NUMBER, 2},
    {DOC("1e"), VX_JSON_E_TRUNCATED, 2},
    {DOC("1e+"), VX_JSON_E_TRUNCATED, 3},
    {DOC("1e+x"), VX_JSON_E_NUMBER, 3},
    {DOC("1ex"), VX_JSON_E_NUMBER, 2},
    {DOC("1e400"), VX_JSON_E_RANGE, 0},
    {DOC("-1e400"), VX_JSON_E_RANGE, 0},
    {DOC("[2e308]"), VX_JSON_E_RANGE, 1},
    {DOC("1.8e308"), VX_JSON_E_RANGE, 0},
    {DOC("1.7976931348623159e308"), VX_JSON_E_RANGE, 0},
    {DOC("100e307"), VX_JSON_E_RANGE, 0},
    {DOC("0.0001e313"), VX_JSON_E_RANGE, 0},
    {DOC("1e18446744073709551616"), VX_JSON_E_RANGE, 0},
    {DOC("1e9223372036854775808"), VX_JSON_E_RANGE, 0},
    {DOC("1e0000000000000000000000309"), VX_JSON_E_RANGE, 0},
    /* strings */
    {DOC("\"a"), VX_JSON_E_TRUNCATED, 2},
    {DOC("\"\\"), VX_JSON_E_TRUNCATED, 2},
    {DOC("\"\\u"), VX_JSON_E_TRUNCATED, 3},
    {DOC("\"\\u00"), VX_JSON_E_TRUNCATED, 5},
    {DOC("\"\\x\""), VX_JSON_E_ESCAPE, 1},
    {DOC("\"\\'\""), VX_JSON_E_ESCAPE, 1},
    {DOC("\"\\U0041\""), VX_JSON_E_ESCAPE, 1},
    {DOC("\"\\u00G0\""), VX_JSON_E_ESCAPE, 1},
    {DOC("\"\\u00\""), VX_JSON_E_ESCAPE, 1},
    {DOC("\"\t\""), VX_JSON_E_CONTROL, 1},
    {DOC("\"\n\""), VX_JSON_E_CONTROL, 1},
    {DOC("\"\x00\""), VX_JSON_E_CONTROL, 1},
    {DOC("\"abc\x1f\""), VX_JSON_E_CONTROL, 4},
    {DOC("\"\\ud800\""), VX_JSON_E_SURROGATE, 1},
    {DOC("\"\\udc00\""), VX_JSON_E_SURROGATE, 1},
    {DOC("\"\\udfff\""), VX_JSON_E_SURROGATE, 1},
    {DOC("\"\\ud800\\u0041\""), VX_JSON_E_SURROGATE, 1},
    {DOC("\"\\ud800\\ud800\""), VX_JSON_E_SURROGATE, 1},
    {DOC("\"\\ud83d\\n\""), VX_JSON_E_SURROGATE, 1},
    {DOC("\"\\ud83dx\""), VX_JSON_E_SURROGATE, 1},
    {DOC("\"\\ud83d\\\""), VX_JSON_E_SURROGATE, 1},
    {DOC("\"\\ud83d\\uZZZZ\""), VX_JSON_E_ESCAPE, 7},
    {DOC("\"\\ud83d\\ude00\\ud83d\""), VX_JSON_E_SURROGATE, 13},
    {DOC("\"\\ud83d"), VX_JSON_E_TRUNCATED, 7},
    {DOC("\"\\ud83d\\"), VX_JSON_E_TRUNCATED, 8},
    {DOC("\"\\ud83d\\ude0"), VX_JSON_E_TRUNCATED, 12},
    /* UTF-8 */
    {DOC("\"\x80\""), VX_JSON_E_UTF8, 1},
    {DOC("\"\xbf\""), VX_JSON_E_UTF8, 1},
    {DOC("\"\xc0\x80\""), VX_JSON_E_UTF8, 1},         /* overlong NUL */
    {DOC("\"\xc1\xbf\""), VX_JSON_E_UTF8, 1},         /* overlong */
    {DOC("\"\xe0\x9f\xbf\""), VX_JSON_E_UTF8, 1},     /* overlong U+07FF */
    {DOC("\"\xed\xa0\x80\""), VX_JSON_E_UTF8, 1},     /* U+D800 encoded */
    {DOC("\"\xed\xbf\xbf\""), VX_JSON_E_UTF8, 1},     /* U+DFFF encoded */
    {DOC("\"\xf0\x8f\xbf\xbf\""), VX_JSON_E_UTF8, 1}, /* overlong U+FFFF */
    {DOC("\"\xf4\x90\x80\x80\""), VX_JSON_E_UTF8, 1}, /* U+110000 */
    {DOC("\"\xf5\x80\x80\x80\""), VX_JSON_E_UTF8, 1},
    {DOC("\"\xf8\""), VX_JSON_E_UTF8, 1},
    {DOC("\"\xff\""), VX_JSON_E_UTF8, 1},
    {DOC("\"\xc2\""), VX_JSON_E_UTF8, 1},
    {DOC("\"\xe2\x82\""), VX_JSON_E_UTF8, 1},
    {DOC("\"\xc2"), VX_JSON_E_TRUNCATED, 2},
    {DOC("\"\xf0\x9f\x98"), VX_JSON_E_TRUNCATED, 4},
    {DOC("\xc3\xa9"), VX_JSON_E_SYNTAX, 0}, /* non-ASCII outside strings */
    {DOC("{\"a\":1}\xff"), VX_JSON_E_TRAILING, 7},
};

static void test_tables(void)
{
    for (size_t i = 0; i < sizeof valid / sizeof valid[0]; i++) {
        vx_json_fields f;
        int rc = scan(valid[i].doc, valid[i].len, &f);
        if (rc != VX_JSON_OK)
            show("valid doc rejected", valid[i].doc, valid[i].len, rc, f.error_offset);
        CHECK(rc == VX_JSON_OK);
    }
    for (size_t i = 0; i < sizeof invalid / sizeof invalid[0]; i++) {
        vx_json_fields f;
        memset(&f, 0x5a, sizeof f); /* junk: a failed scan must reset every field */
        int rc = scan(invalid[i].doc, invalid[i].len, &f);
        if (rc != invalid[i].rc || f.error_offset != invalid[i].off) {
            show("invalid doc", invalid[i].doc, invalid[i].len, rc, f.error_offset);
            fprintf(stderr, "    expected rc %d offset %zu\n", invalid[i].rc, invalid[i].off);
        }
        CHECK(rc == invalid[i].rc);
        CHECK(f.error_offset == invalid[i].off);
        CHECK(f.top_kind == VX_JSON_ABSENT && f.model_kind == VX_JSON_ABSENT &&
              f.stream_kind == VX_JSON_ABSENT && f.model_start == 0 && f.model_end == 0);
    }
    CHECK(vx_json_scan(NULL, 0, &(vx_json_fields){0}) == VX_JSON_E_EMPTY);
    CHECK(strcmp(vx_json_strerror(VX_JSON_E_RANGE), "number is infinity as a double") == 0);
    CHECK(strcmp(vx_json_strerror(99), "unknown error") == 0);
}

/* ---------------------------------------------------------------- fields */

typedef struct {
    const char *doc;
    size_t len;
    int top, model;
    const char *model_text; /* expected bytes of the model span, NULL when absent */
    int stream;
} fields_case;

static const fields_case fields[] = {
    {DOC("{\"model\":\"gpt-4o\",\"stream\":true}"), VX_JSON_OBJECT, VX_JSON_STRING, "\"gpt-4o\"",
     VX_JSON_TRUE},
    {DOC(" { \"stream\" : false , \"model\" : \"m\\u00e9\" } "), VX_JSON_OBJECT, VX_JSON_STRING,
     "\"m\\u00e9\"", VX_JSON_FALSE},
    {DOC("{}"), VX_JSON_OBJECT, VX_JSON_ABSENT, NULL, VX_JSON_ABSENT},
    {DOC("{\"model\":42,\"stream\":null}"), VX_JSON_OBJECT, VX_JSON_NUMBER, "42", VX_JSON_NULL},
    {DOC("{\"model\":-1.5e3}"), VX_JSON_OBJECT, VX_JSON_NUMBER, "-1.5e3", VX_JSON_ABSENT},
    {DOC("{\"model\":null,\"stream\":1}"), VX_JSON_OBJECT, VX_JSON_NULL, "null", VX_JSON_NUMBER},
    {DOC("{\"model\":true,\"stream\":\"true\"}"), VX_JSON_OBJECT, VX_JSON_TRUE, "true",
     VX_JSON_STRING},
    {DOC("{\"model\":false,\"stream\":[]}"), VX_JSON_OBJECT, VX_JSON_FALSE, "false", VX_JSON_ARRAY},
    {DOC("{\"model\":[1,{\"model\":2}],\"stream\":{}}"), VX_JSON_OBJECT, VX_JSON_ARRAY,
     "[1,{\"model\":2}]", VX_JSON_OBJECT},
    {DOC("{\"model\":{\"model\":\"inner\",\"stream\":true}}"), VX_JSON_OBJECT, VX_JSON_OBJECT,
     "{\"model\":\"inner\",\"stream\":true}", VX_JSON_ABSENT},
    {DOC("{\"model\" :\n [ ] \n}"), VX_JSON_OBJECT, VX_JSON_ARRAY, "[ ]", VX_JSON_ABSENT},
    {DOC("{\"model\":{}}"), VX_JSON_OBJECT, VX_JSON_OBJECT, "{}", VX_JSON_ABSENT},
    /* nested keys are not the request's */
    {DOC("{\"messages\":[{\"model\":\"x\",\"stream\":true}],\"meta\":{\"model\":\"y\"}}"),
     VX_JSON_OBJECT, VX_JSON_ABSENT, NULL, VX_JSON_ABSENT},
    {DOC("{\"a\":{\"model\":1},\"model\":\"m\",\"b\":{\"stream\":false}}"), VX_JSON_OBJECT,
     VX_JSON_STRING, "\"m\"", VX_JSON_ABSENT},
    /* duplicates: the last one counts */
    {DOC("{\"model\":\"a\",\"model\":\"b\"}"), VX_JSON_OBJECT, VX_JSON_STRING, "\"b\"",
     VX_JSON_ABSENT},
    {DOC("{\"model\":\"a\",\"x\":1,\"model\":{\"k\":[1,2]}}"), VX_JSON_OBJECT, VX_JSON_OBJECT,
     "{\"k\":[1,2]}", VX_JSON_ABSENT},
    {DOC("{\"stream\":true,\"stream\":false}"), VX_JSON_OBJECT, VX_JSON_ABSENT, NULL, VX_JSON_FALSE},
    {DOC("{\"stream\":false,\"stream\":true}"), VX_JSON_OBJECT, VX_JSON_ABSENT, NULL, VX_JSON_TRUE},
    /* keys compared after unescaping */
    {DOC("{\"mod\\u0065l\":\"m\"}"), VX_JSON_OBJECT, VX_JSON_STRING, "\"m\"", VX_JSON_ABSENT},
    {DOC("{\"\\u006d\\u006f\\u0064\\u0065\\u006c\":1}"), VX_JSON_OBJECT, VX_JSON_NUMBER, "1",
     VX_JSON_ABSENT},
    {DOC("{\"\\u006D\\u006F\\u0064\\u0065\\u006C\":1}"), VX_JSON_OBJECT, VX_JSON_NUMBER, "1",
     VX_JSON_ABSENT}, /* upper-case hex digits, same letters */
    {DOC("{\"str\\u0065am\":true,\"stre\\u0061m\":false}"), VX_JSON_OBJECT, VX_JSON_ABSENT, NULL,
     VX_JSON_FALSE},
    {DOC("{\"m\\u006fdel\":\"x\",\"model\":\"y\"}"), VX_JSON_OBJECT, VX_JSON_STRING, "\"y\"",
     VX_JSON_ABSENT},
    {DOC("{\"model\":\"y\",\"m\\u006fdel\":\"x\"}"), VX_JSON_OBJECT, VX_JSON_STRING, "\"x\"",
     VX_JSON_ABSENT},
    /* near misses */
    {DOC("{\"\\u004dodel\":1}"), VX_JSON_OBJECT, VX_JSON_ABSENT, NULL, VX_JSON_ABSENT}, /* Model */
    /* U+016D and U+056D end in the byte of 'm': only a whole ASCII code point may match */
    {DOC("{\"\\u016dodel\":1,\"\\u056dodel\":2}"), VX_JSON_OBJECT, VX_JSON_ABSENT, NULL,
     VX_JSON_ABSENT},
    {DOC("{\"Model\":1,\"STREAM\":true}"), VX_JSON_OBJECT, VX_JSON_ABSENT, NULL, VX_JSON_ABSENT},
    {DOC("{\"model \":1,\" stream\":true}"), VX_JSON_OBJECT, VX_JSON_ABSENT, NULL, VX_JSON_ABSENT},
    {DOC("{\"modelx\":1,\"strea\":true}"), VX_JSON_OBJECT, VX_JSON_ABSENT, NULL, VX_JSON_ABSENT},
    {DOC("{\"mode\\u006c\\u0000\":1}"), VX_JSON_OBJECT, VX_JSON_ABSENT, NULL, VX_JSON_ABSENT},
    {DOC("{\"model\\n\":1}"), VX_JSON_OBJECT, VX_JSON_ABSENT, NULL, VX_JSON_ABSENT},
    {DOC("{\"mod\\/el\":1}"), VX_JSON_OBJECT, VX_JSON_ABSENT, NULL, VX_JSON_ABSENT},
    {DOC("{\"\\ud83d\\ude00model\":1}"), VX_JSON_OBJECT, VX_JSON_ABSENT, NULL, VX_JSON_ABSENT},
    {DOC("{\"mod\\u0065l\\u0065\":1}"), VX_JSON_OBJECT, VX_JSON_ABSENT, NULL, VX_JSON_ABSENT},
    {DOC("{\"\\u006d\\u006f\\u0064\\u0065\\u006c\\u006c\\u006c\\u006c\":1}"), VX_JSON_OBJECT,
     VX_JSON_ABSENT, NULL, VX_JSON_ABSENT},
    {DOC("{\"mod\xc3\xa9l\":1}"), VX_JSON_OBJECT, VX_JSON_ABSENT, NULL, VX_JSON_ABSENT},
    {DOC("{\"model\":\"stream\",\"x\":\"model\"}"), VX_JSON_OBJECT, VX_JSON_STRING, "\"stream\"",
     VX_JSON_ABSENT},
    /* top level that is not an object */
    {DOC("[\"model\",{\"model\":1}]"), VX_JSON_ARRAY, VX_JSON_ABSENT, NULL, VX_JSON_ABSENT},
    {DOC("\"model\""), VX_JSON_STRING, VX_JSON_ABSENT, NULL, VX_JSON_ABSENT},
    {DOC(" 7 "), VX_JSON_NUMBER, VX_JSON_ABSENT, NULL, VX_JSON_ABSENT},
    {DOC("-7"), VX_JSON_NUMBER, VX_JSON_ABSENT, NULL, VX_JSON_ABSENT},
    {DOC("null"), VX_JSON_NULL, VX_JSON_ABSENT, NULL, VX_JSON_ABSENT},
    {DOC("true"), VX_JSON_TRUE, VX_JSON_ABSENT, NULL, VX_JSON_ABSENT},
    {DOC("false"), VX_JSON_FALSE, VX_JSON_ABSENT, NULL, VX_JSON_ABSENT},
};

static void test_fields(void)
{
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++) {
        const fields_case *c = &fields[i];
        vx_json_fields f;
        memset(&f, 0x5a, sizeof f);
        int rc = scan(c->doc, c->len, &f);
        int ok = rc == VX_JSON_OK && f.top_kind == c->top && f.model_kind == c->model &&
                 f.stream_kind == c->stream && f.error_offset == 0;
        if (ok && c->model_text == NULL)
            ok = f.model_start == 0 && f.model_end == 0;
        else if (ok)
            ok = f.model_start <= f.model_end && f.model_end <= c->len &&
                 f.model_end - f.model_start == strlen(c->model_text) &&
                 memcmp(c->doc + f.model_start, c->model_text, strlen(c->model_text)) == 0;
        if (!ok) {
            show("fields", c->doc, c->len, rc, f.error_offset);
            fprintf(stderr, "    got top %d model %d [%zu, %zu) stream %d\n", f.top_kind,
                    f.model_kind, f.model_start, f.model_end, f.stream_kind);
        }
        CHECK(ok);
    }
}

/* ---------------------------------------------------------------- depth */

/* depth levels of `open`, then `inner`, then the matching closers. */
static size_t nest(char *buf, size_t depth, const char *open, const char *inner, char close)
{
    size_t n = 0, lo = strlen(open), li = strlen(inner);
    for (size_t i = 0; i < depth; i++, n += lo)
        memcpy(buf + n, open, lo);
    memcpy(buf + n, inner, li);
    n += li;
    for (size_t i = 0; i < depth; i++)
        buf[n++] = close;
    return n;
}

static void test_depth(void)
{
    static char buf[16 * (VX_JSON_MAX_DEPTH + 2) + 5000];
    vx_json_fields f;
    size_t n;
    CHECK(VX_JSON_MAX_DEPTH == 1024);

    n = nest(buf, 1024, "[", "", ']');
    CHECK(scan(buf, n, &f) == VX_JSON_OK && f.top_kind == VX_JSON_ARRAY);
    n = nest(buf, 1025, "[", "", ']');
    CHECK(scan(buf, n, &f) == VX_JSON_E_DEPTH && f.error_offset == 1024);
    n = nest(buf, 1023, "[", "{}", ']'); /* 1024 containers with the innermost object */
    CHECK(scan(buf, n, &f) == VX_JSON_OK);
    n = nest(buf, 1024, "[", "{}", ']');
    CHECK(scan(buf, n, &f) == VX_JSON_E_DEPTH && f.error_offset == 1024);
    n = nest(buf, 1024, "[", "1", ']'); /* scalars do not count */
    CHECK(scan(buf, n, &f) == VX_JSON_OK);

    n = nest(buf, 1024, "{\"a\":", "1", '}');
    CHECK(scan(buf, n, &f) == VX_JSON_OK && f.top_kind == VX_JSON_OBJECT);
    n = nest(buf, 1025, "{\"a\":", "1", '}');
    CHECK(scan(buf, n, &f) == VX_JSON_E_DEPTH && f.error_offset == 1024 * 5);
    n = nest(buf, 1024, "{\"model\":", "1", '}'); /* only the outermost "model" counts */
    CHECK(scan(buf, n, &f) == VX_JSON_OK && f.model_kind == VX_JSON_OBJECT &&
          f.model_start == 9 && f.model_end == n - 1);

    /* Mixed, and deep but closed again before going deep a second time. */
    n = 0;
    for (int rep = 0; rep < 2; rep++) {
        buf[n++] = rep == 0 ? '[' : ',';
        for (int i = 0; i < 1023; i++)
            buf[n++] = '[';
        for (int i = 0; i < 1023; i++)
            buf[n++] = ']';
    }
    buf[n++] = ']';
    CHECK(scan(buf, n, &f) == VX_JSON_OK);

    /* Unclosed at the limit: truncated, not a depth error. */
    memset(buf, '[', 1024);
    CHECK(scan(buf, 1024, &f) == VX_JSON_E_TRUNCATED && f.error_offset == 1024);
    memset(buf, '[', 5000);
    CHECK(scan(buf, 5000, &f) == VX_JSON_E_DEPTH && f.error_offset == 1024);
}

/* ---------------------------------------------------------------- UTF-8 */

/* Independent reference: decode from the bit patterns, then refuse what Unicode refuses. */
static int utf8_ok(const unsigned char *s, size_t n)
{
    uint32_t cp;
    size_t need;
    if (s[0] < 0x80)
        return n == 1;
    if ((s[0] & 0xE0) == 0xC0) {
        need = 2;
        cp = s[0] & 0x1F;
    } else if ((s[0] & 0xF0) == 0xE0) {
        need = 3;
        cp = s[0] & 0x0F;
    } else if ((s[0] & 0xF8) == 0xF0) {
        need = 4;
        cp = s[0] & 0x07;
    } else {
        return 0;
    }
    if (n != need)
        return 0;
    for (size_t i = 1; i < n; i++) {
        if ((s[i] & 0xC0) != 0x80)
            return 0;
        cp = cp << 6 | (s[i] & 0x3F);
    }
    static const uint32_t min_cp[5] = {0, 0, 0x80, 0x800, 0x10000};
    return cp >= min_cp[need] && cp <= 0x10FFFF && !(cp >= 0xD800 && cp <= 0xDFFF);
}

static size_t utf8_len_for_lead(unsigned b)
{
    return b >= 0xF0 ? 4 : b >= 0xE0 ? 3 : 2;
}

static void test_utf8(void)
{
    unsigned char doc[8];
    vx_json_fields f;
    /* Every lead byte >= 0x80 with every second byte, the rest a valid continuation (0x80 or
     * 0xBF) or, separately, a bad one; the scanner must agree with the reference. */
    for (unsigned b0 = 0x80; b0 <= 0xFF; b0++) {
        size_t n = utf8_len_for_lead(b0);
        for (unsigned b1 = 0; b1 <= 0xFF; b1++) {
            for (unsigned tail = 0; tail < 3; tail++) {
                unsigned char seq[4] = {(unsigned char)b0, (unsigned char)b1, 0x80, 0x80};
                if (tail == 1)
                    seq[2] = seq[3] = 0xBF;
                if (tail == 2)
                    seq[n - 1] = n > 2 ? 0x41 : seq[n - 1]; /* 'A' where a continuation goes */
                doc[0] = '"';
                memcpy(doc + 1, seq, n);
                doc[1 + n] = '"';
                int rc = vx_json_scan(doc, n + 2, &f);
                int expect = utf8_ok(seq, n);
                if ((rc == VX_JSON_OK) != expect) {
                    show("utf8", (const char *)doc, n + 2, rc, f.error_offset);
                    failures++;
                    return;
                }
                if (!expect && !(rc == VX_JSON_E_UTF8 && f.error_offset == 1)) {
                    /* A byte that cannot continue the sequence may be the closing quote or a
                     * control byte; then the sequence is still the first error. */
                    show("utf8 error", (const char *)doc, n + 2, rc, f.error_offset);
                    failures++;
                    return;
                }
            }
        }
    }
    /* All of U+0080..U+10FFFF (surrogates excluded) encode and scan; spot-check in strides. */
    for (uint32_t cp = 0x80; cp <= 0x10FFFF; cp += (cp < 0x10000 ? 1 : 61)) {
        if (cp >= 0xD800 && cp <= 0xDFFF)
            continue;
        size_t n = 0;
        doc[n++] = '"';
        if (cp < 0x800) {
            doc[n++] = (unsigned char)(0xC0 | cp >> 6);
        } else if (cp < 0x10000) {
            doc[n++] = (unsigned char)(0xE0 | cp >> 12);
            doc[n++] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
        } else {
            doc[n++] = (unsigned char)(0xF0 | cp >> 18);
            doc[n++] = (unsigned char)(0x80 | ((cp >> 12) & 0x3F));
            doc[n++] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
        }
        doc[n++] = (unsigned char)(0x80 | (cp & 0x3F));
        doc[n++] = '"';
        if (vx_json_scan(doc, n, &f) != VX_JSON_OK) {
            fprintf(stderr, "  utf8: U+%04X rejected\n", (unsigned)cp);
            failures++;
            return;
        }
    }
}

/* ---------------------------------------------------------------- numbers */

#define T_DIGITS                                                                                   \
    "17976931348623158079372897140530341507993413271003782693617377898044496829276475"             \
    "09466490179775872070963302864166928879109465555478519404026306574886715058206819"             \
    "08902000708383676273854845817711531764475730270069855571366959622842914819860834"             \
    "936475292719074168444365510704342711559699508093042880177904174497792"
/* T_DIGITS - 1 */
#define T_MINUS_1                                                                                  \
    "17976931348623158079372897140530341507993413271003782693617377898044496829276475"             \
    "09466490179775872070963302864166928879109465555478519404026306574886715058206819"             \
    "08902000708383676273854845817711531764475730270069855571366959622842914819860834"             \
    "936475292719074168444365510704342711559699508093042880177904174497791"

static int scan_str(const char *s)
{
    vx_json_fields f;
    return scan(s, strlen(s), &f);
}

static void test_number_range(void)
{
    static char buf[4096];
    /* 2^1024 - 2^970 is the first magnitude orjson calls infinity; one less is DBL_MAX. */
    CHECK(scan_str(T_DIGITS) == VX_JSON_E_RANGE);
    CHECK(scan_str("-" T_DIGITS) == VX_JSON_E_RANGE);
    CHECK(scan_str(T_MINUS_1) == VX_JSON_OK);
    CHECK(scan_str("-" T_MINUS_1) == VX_JSON_OK);
    CHECK(scan_str("[" T_MINUS_1 ",-" T_MINUS_1 "]") == VX_JSON_OK);
    CHECK(scan_str(T_DIGITS "e0") == VX_JSON_E_RANGE);
    CHECK(scan_str(T_DIGITS "0e-1") == VX_JSON_E_RANGE); /* same value, one more digit */
    CHECK(scan_str(T_MINUS_1 "9e-1") == VX_JSON_OK);     /* T - 0.1 */
    CHECK(scan_str(T_DIGITS "e-1") == VX_JSON_OK);
    CHECK(scan_str("0." T_DIGITS "e309") == VX_JSON_E_RANGE);
    CHECK(scan_str("0." T_MINUS_1 "e309") == VX_JSON_OK);
    CHECK(scan_str("0.000" T_DIGITS "e312") == VX_JSON_E_RANGE);
    CHECK(scan_str("0.000" T_MINUS_1 "e312") == VX_JSON_OK);
    CHECK(scan_str("0." T_DIGITS "000e309") == VX_JSON_E_RANGE);
    CHECK(scan_str("1.797693134862315807937289714053e308") == VX_JSON_OK);
    CHECK(scan_str("1.797693134862315807937289714054e308") == VX_JSON_E_RANGE);
    CHECK(scan_str("1.7976931348623158079372897140530341e+308") == VX_JSON_OK);
    CHECK(scan_str("-1e309") == VX_JSON_E_RANGE);
    CHECK(scan_str("0.1e310") == VX_JSON_E_RANGE);
    CHECK(scan_str("0.1e309") == VX_JSON_OK);
    /* The integer digits split across the decimal point at every position. */
    const char *t = T_DIGITS, *m = T_MINUS_1;
    for (int cut = 1; cut < 309; cut++) {
        for (int which = 0; which < 2; which++) {
            const char *d = which ? m : t;
            int n = snprintf(buf, sizeof buf, "%.*s.%se%d", cut, d, d + cut, 309 - cut);
            int rc = scan(buf, (size_t)n, &(vx_json_fields){0});
            if (rc != (which ? VX_JSON_OK : VX_JSON_E_RANGE)) {
                show("range split", buf, (size_t)n, rc, 0);
                failures++;
            }
        }
    }
    /* T followed by a long tail of zeros then a 1 (above T) and T-1 followed by nines
     * (below T). */
    int n = snprintf(buf, sizeof buf, "%s.", T_DIGITS);
    memset(buf + n, '0', 2000);
    buf[n + 2000] = '1';
    CHECK(scan(buf, (size_t)n + 2001, &(vx_json_fields){0}) == VX_JSON_E_RANGE);
    n = snprintf(buf, sizeof buf, "%s.", T_MINUS_1);
    memset(buf + n, '9', 2000);
    CHECK(scan(buf, (size_t)n + 2000, &(vx_json_fields){0}) == VX_JSON_OK);
    /* 1 and 308 zeros is 1e308; 309 zeros is 1e309. */
    buf[0] = '1';
    memset(buf + 1, '0', 309);
    CHECK(scan(buf, 309, &(vx_json_fields){0}) == VX_JSON_OK);
    CHECK(scan(buf, 310, &(vx_json_fields){0}) == VX_JSON_E_RANGE);
    /* 0.<1000 zeros>1e1309 = 1e308. */
    memcpy(buf, "0.", 2);
    memset(buf + 2, '0', 1000);
    memcpy(buf + 1002, "1e1309", 6);
    CHECK(scan(buf, 1008, &(vx_json_fields){0}) == VX_JSON_OK);
    memcpy(buf + 1002, "1e1310", 6);
    CHECK(scan(buf, 1008, &(vx_json_fields){0}) == VX_JSON_E_RANGE);
    /* An absurd negative exponent does not wrap around into overflow, nor a positive one
     * into range. */
    CHECK(scan_str("9e-9999999999999999999999999999999999999999") == VX_JSON_OK);
    CHECK(scan_str("0.0000001e99999999999999999999999999999999999") == VX_JSON_E_RANGE);
    CHECK(scan_str("0.0e99999999999999999999999999999999999") == VX_JSON_OK);
}

/* ---------------------------------------------------------------- prefixes */

static const char *const complete_docs[] = {
    "{\"model\":\"gpt-4o\",\"messages\":[{\"role\":\"user\",\"content\":\"caf\xc3\xa9 "
    "\xf0\x9f\x98\x80 \\u00e9\\ud83d\\ude00\\n\"}],\"stream\":true,\"temperature\":-0.5e-3,"
    "\"n\":10,\"stop\":null,\"logprobs\":false}",
    "[1,-2.5E+10,true,false,null,\"\",{},[],{\"a\":[{\"b\":\"\\\"\"}]}]",
    "\"\\u0041\\t\xe4\xb8\xad\"",
    "true",
    "false",
    "null",
    "{ \"a\" : [ 1 , { } ] }",
};

static void test_prefixes(void)
{
    for (size_t d = 0; d < sizeof complete_docs / sizeof complete_docs[0]; d++) {
        const char *doc = complete_docs[d];
        size_t n = strlen(doc);
        vx_json_fields f;
        CHECK(scan(doc, n, &f) == VX_JSON_OK);
        CHECK(scan(doc, 0, &f) == VX_JSON_E_EMPTY);
        for (size_t k = 1; k < n; k++) {
            int rc = scan(doc, k, &f);
            if (rc != VX_JSON_E_TRUNCATED || f.error_offset != k) {
                show("prefix", doc, k, rc, f.error_offset);
                failures++;
            }
        }
    }
}

/* ---------------------------------------------------------------- strings, word at a time */

static void test_string_bytes(void)
{
    /* Each byte value at each position of a 40-byte string body, so the special byte lands in
     * every lane of both 8-byte words of the 16-byte loop and in the byte-wise tail. */
    unsigned char doc[64];
    for (unsigned v = 0; v < 256; v++) {
        for (size_t k = 0; k < 40; k++) {
            doc[0] = '"';
            memset(doc + 1, 'a', 40);
            doc[1 + k] = (unsigned char)v;
            doc[41] = '"';
            vx_json_fields f;
            int rc = vx_json_scan(doc, 42, &f);
            int want;
            size_t at = 1 + k;
            if (v < 0x20)
                want = VX_JSON_E_CONTROL;
            else if (v == '"')
                want = VX_JSON_E_TRAILING, at = 2 + k;
            else if (v == '\\' && k == 39) /* escapes the closing quote */
                want = VX_JSON_E_TRUNCATED, at = 42;
            else if (v == '\\')
                want = VX_JSON_E_ESCAPE;
            else if (v >= 0x80)
                want = VX_JSON_E_UTF8;
            else
                want = VX_JSON_OK, at = 0;
            if (rc != want || f.error_offset != at) {
                show("string byte", (const char *)doc, 42, rc, f.error_offset);
                failures++;
                return;
            }
        }
    }
    /* Long string with a stop byte near the end, at each alignment of the string's start. */
    static unsigned char big[4096];
    for (size_t shift = 0; shift < 16; shift++) {
        size_t n = 0;
        memset(big, ' ', shift);
        n = shift;
        big[n++] = '"';
        memset(big + n, 'Q', 3000);
        n += 3000;
        big[n++] = '"';
        vx_json_fields f;
        CHECK(vx_json_scan(big, n, &f) == VX_JSON_OK && f.top_kind == VX_JSON_STRING);
        big[n - 7] = 0x01;
        CHECK(vx_json_scan(big, n, &f) == VX_JSON_E_CONTROL && f.error_offset == n - 7);
        big[n - 7] = 0xE2; /* needs two continuation bytes; gets 'Q' */
        CHECK(vx_json_scan(big, n, &f) == VX_JSON_E_UTF8 && f.error_offset == n - 7);
        CHECK(vx_json_scan(big, n - 1, &f) == VX_JSON_E_UTF8);
        big[n - 7] = 'Q';
        CHECK(vx_json_scan(big, n - 1, &f) == VX_JSON_E_TRUNCATED && f.error_offset == n - 1);
    }
}

/* ---------------------------------------------------------------- fuzz */

static uint64_t rng = 0x243F6A8885A308D3ull;
static uint64_t next_rand(void)
{
    uint64_t z = (rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Invariants of any result; also, the error offset's contract: the bytes before it are a
 * prefix of a valid document, so scanning just them can only end in "truncated", "empty" or
 * success (when they happen to be complete already), never in an earlier error. */
static void check_result(const unsigned char *doc, size_t n, int rc, const vx_json_fields *f)
{
    if (rc == VX_JSON_OK) {
        CHECK(f->error_offset == 0);
        CHECK(f->top_kind >= VX_JSON_NULL && f->top_kind <= VX_JSON_OBJECT);
        if (f->top_kind != VX_JSON_OBJECT)
            CHECK(f->model_kind == VX_JSON_ABSENT && f->stream_kind == VX_JSON_ABSENT);
        if (f->model_kind == VX_JSON_ABSENT) {
            CHECK(f->model_start == 0 && f->model_end == 0);
        } else {
            vx_json_fields g;
            CHECK(f->model_start < f->model_end && f->model_end <= n);
            /* The span is a JSON text of the reported kind. */
            CHECK(vx_json_scan(doc + f->model_start, f->model_end - f->model_start, &g) ==
                      VX_JSON_OK &&
                  g.top_kind == f->model_kind);
        }
        return;
    }
    CHECK(rc > 0 && rc <= VX_JSON_E_TOO_LARGE);
    CHECK(f->error_offset <= n);
    vx_json_fields g;
    int prc = vx_json_scan(doc, f->error_offset, &g);
    if (!(prc == VX_JSON_OK || prc == VX_JSON_E_TRUNCATED || prc == VX_JSON_E_EMPTY)) {
        show("error offset not a viable prefix", (const char *)doc, n, rc, f->error_offset);
        failures++;
    }
}

static void test_fuzz(void)
{
    static const char alphabet[] = "{}[]:,\"\\ \n-+.eE0123456789tfnulrsaumodel\x01\x7f\xc3\xa9"
                                   "\xed\xa0\xf0\x9f\x98\x80";
    static unsigned char doc[512];
    size_t seeds = sizeof complete_docs / sizeof complete_docs[0];
    for (int iter = 0; iter < 200000; iter++) {
        const char *seed = complete_docs[next_rand() % seeds];
        size_t n = strlen(seed);
        memcpy(doc, seed, n);
        int edits = 1 + (int)(next_rand() % 4);
        for (int e = 0; e < edits; e++) {
            size_t at = n ? next_rand() % (n + 1) : 0;
            unsigned char c = (next_rand() & 3) == 0
                                  ? (unsigned char)next_rand()
                                  : (unsigned char)alphabet[next_rand() % (sizeof alphabet - 1)];
            switch (next_rand() % 3) {
            case 0: /* insert */
                if (n < sizeof doc) {
                    memmove(doc + at + 1, doc + at, n - at);
                    doc[at] = c;
                    n++;
                }
                break;
            case 1: /* delete */
                if (at < n) {
                    memmove(doc + at, doc + at + 1, n - at - 1);
                    n--;
                }
                break;
            default: /* replace */
                if (at < n)
                    doc[at] = c;
                break;
            }
        }
        vx_json_fields f;
        int rc = vx_json_scan(doc, n, &f);
        check_result(doc, n, rc, &f);
        if (failures > 20)
            return;
    }
}

/* ---------------------------------------------------------------- threads */

typedef struct {
    const unsigned char *doc;
    size_t len;
    vx_json_fields want;
    int bad;
} thread_job;

static void *scan_thread(void *arg)
{
    thread_job *job = arg;
    for (int i = 0; i < 8; i++) {
        vx_json_fields f;
        if (vx_json_scan(job->doc, job->len, &f) != VX_JSON_OK ||
            f.model_start != job->want.model_start || f.model_end != job->want.model_end ||
            f.model_kind != job->want.model_kind || f.stream_kind != job->want.stream_kind ||
            f.top_kind != job->want.top_kind)
            job->bad++;
    }
    return NULL;
}

static void test_threads(void)
{
    /* An OpenAI-style request with a 1 MiB base64 image, scanned by 4 threads at once: what
     * the GIL-free binding allows. */
    static const char head[] =
        "{\"model\":\"gpt-4o\",\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\","
        "\"text\":\"d\xc3\xa9" "cris l'image\"},{\"type\":\"image_url\",\"image_url\":{\"url\":"
        "\"data:image/png;base64,";
    static const char tail[] = "\"}}]}],\"stream\":true}";
    size_t body = 1 << 20, n = sizeof head - 1 + body + sizeof tail - 1;
    unsigned char *doc = malloc(n);
    CHECK(doc != NULL);
    if (doc == NULL)
        return;
    static const char b64[] =
        "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    memcpy(doc, head, sizeof head - 1);
    for (size_t i = 0; i < body; i++)
        doc[sizeof head - 1 + i] = (unsigned char)b64[next_rand() % 64];
    memcpy(doc + sizeof head - 1 + body, tail, sizeof tail - 1);

    thread_job jobs[4];
    pthread_t tids[4];
    vx_json_fields want;
    CHECK(vx_json_scan(doc, n, &want) == VX_JSON_OK);
    CHECK(want.model_kind == VX_JSON_STRING && want.stream_kind == VX_JSON_TRUE);
    CHECK(want.model_start == 9 && want.model_end == 17);
    for (int t = 0; t < 4; t++) {
        jobs[t] = (thread_job){doc, n, want, 0};
        CHECK(pthread_create(&tids[t], NULL, scan_thread, &jobs[t]) == 0);
    }
    for (int t = 0; t < 4; t++) {
        pthread_join(tids[t], NULL);
        CHECK(jobs[t].bad == 0);
    }
    free(doc);
}

int main(void)
{
    test_tables();
    test_fields();
    test_depth();
    test_utf8();
    test_number_range();
    test_prefixes();
    test_string_bytes();
    test_fuzz();
    test_threads();
    if (failures) {
        fprintf(stderr, "test_json: %d check(s) failed\n", failures);
        return 1;
    }
    printf("test_json: ok\n");
    return 0;
}
