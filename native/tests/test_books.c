/* vx_books: JSON strings as orjson writes them, the timestamp, and the usage scan. */
#include "vx_books.h"

#include "tests/check.h"

#include <string.h>

static int str_is(const char *got, const char *end, const char *want)
{
    return (size_t)(end - got) == strlen(want) && memcmp(got, want, strlen(want)) == 0;
}

static void test_strings(void)
{
    char buf[256];
    const unsigned char ctl[] = {0x00, 0x01, 0x08, 0x09, 0x0a, 0x0c, 0x0d, 0x1f, 0x7f, '"', '\\',
                                 '/'};
    char *end = vx_books_latin1(buf, ctl, sizeof ctl);
    CHECK(str_is(buf, end, "\"\\u0000\\u0001\\b\\t\\n\\f\\r\\u001f\x7f\\\"\\\\/\""));
    CHECK((size_t)(end - buf) <= VX_BOOKS_STR_MAX(sizeof ctl));
    const unsigned char latin[] = {'a', 0xe9, 0xff, 0x80};
    end = vx_books_latin1(buf, latin, sizeof latin);
    CHECK(str_is(buf, end, "\"a\xc3\xa9\xc3\xbf\xc2\x80\""));
    const unsigned char utf8[] = "x\xe4\xb8\xad\xf0\x9f\x98\x80\xe2\x80\xa8\n";
    end = vx_books_utf8(buf, utf8, sizeof utf8 - 1);
    CHECK(str_is(buf, end, "\"x\xe4\xb8\xad\xf0\x9f\x98\x80\xe2\x80\xa8\\n\""));
    end = vx_books_latin1(buf, (const unsigned char *)"", 0);
    CHECK(str_is(buf, end, "\"\""));
    /* The worst case fits its bound: every byte a \u00XX. */
    unsigned char zeros[40] = {0};
    char big[VX_BOOKS_STR_MAX(40)];
    end = vx_books_latin1(big, zeros, sizeof zeros);
    CHECK((size_t)(end - big) == VX_BOOKS_STR_MAX(40));
    CHECK(vx_books_utf8_prefix(utf8, sizeof utf8 - 1, 2) == 4);
    CHECK(vx_books_utf8_prefix(utf8, sizeof utf8 - 1, 3) == 8);
    CHECK(vx_books_utf8_prefix(utf8, sizeof utf8 - 1, 100) == sizeof utf8 - 1);
    CHECK(vx_books_utf8_prefix(utf8, sizeof utf8 - 1, 0) == 0);
}

static void test_numbers_and_time(void)
{
    char buf[64];
    char *end = vx_books_i64(buf, 0);
    CHECK(str_is(buf, end, "0"));
    end = vx_books_i64(buf, -42);
    CHECK(str_is(buf, end, "-42"));
    end = vx_books_i64(buf, INT64_MIN);
    CHECK(str_is(buf, end, "-9223372036854775808"));
    end = vx_books_i64(buf, INT64_MAX);
    CHECK(str_is(buf, end, "9223372036854775807"));
    /* Every digit count, at and beside each power of ten (the two-digit steps' edges). */
    for (int64_t p = 1;; p *= 10) {
        for (int64_t d = -1; d <= 1; d++) {
            for (int sign = -1; sign <= 1; sign += 2) {
                char want[32];
                int64_t v = sign * (p + d);
                snprintf(want, sizeof want, "%lld", (long long)v);
                end = vx_books_i64(buf, v);
                CHECK(str_is(buf, end, want));
            }
        }
        if (p == INT64_C(1000000000000000000)) /* the last power of ten an int64 holds */
            break;
    }
    end = vx_books_usd(buf, 0);
    CHECK(str_is(buf, end, "0"));
    end = vx_books_usd(buf, INT64_C(3000000000));
    CHECK(str_is(buf, end, "3"));
    end = vx_books_usd(buf, INT64_C(1500));
    CHECK(str_is(buf, end, "0.0000015"));
    end = vx_books_usd(buf, INT64_C(12000000001));
    CHECK(str_is(buf, end, "12.000000001"));
    end = vx_books_usd(buf, -1); /* Python's divmod: -1 and 999999999 */
    CHECK(str_is(buf, end, "-1.999999999"));
    end = vx_books_usd(buf, INT64_MIN);
    CHECK(str_is(buf, end, "-9223372037.145224192"));
    CHECK((size_t)(end - buf) <= VX_BOOKS_USD_MAX);
    end = vx_books_usd(buf, INT64_MAX);
    CHECK(str_is(buf, end, "9223372036.854775807"));
    CHECK(vx_books_time(buf, INT64_C(1764000000123)) == 0);
    CHECK(memcmp(buf, "2025-11-24T16:00:00.123Z", VX_BOOKS_TIME_LEN) == 0);
    CHECK(vx_books_time(buf, 0) == 0);
    CHECK(memcmp(buf, "1970-01-01T00:00:00.000Z", VX_BOOKS_TIME_LEN) == 0);
    CHECK(vx_books_time(buf, -1) == -1);
    CHECK(vx_books_time(buf, INT64_C(253402300800000)) == -1); /* year 10000 */
}

static int usage(const char *s, int64_t *in, int64_t *out)
{
    return vx_books_usage((const unsigned char *)s, strlen(s), in, out);
}

static void test_usage(void)
{
    int64_t in = -1, out = -1;
    CHECK(usage("{\"usage\":{\"prompt_tokens\":31,\"completion_tokens\":4,\"total_tokens\":35}}",
                &in, &out) == 1);
    CHECK(in == 31 && out == 4);
    CHECK(usage("{\"usage\" : { \"prompt_tokens\" : 1 ,\n\"completion_tokens\":\t2}}", &in,
                &out) == 1);
    CHECK(in == 1 && out == 2);
    CHECK(usage("{\"a\":{\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2}},"
                "\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":8}}", &in, &out) == 1);
    CHECK(in == 7 && out == 8);
    CHECK(usage("{}", &in, &out) == 0);
    CHECK(usage("", &in, &out) == 0);
    CHECK(usage("\"usag", &in, &out) == 0);
    CHECK(usage("\"usage\"", &in, &out) == -1);
    CHECK(usage("{\"usage\":null}", &in, &out) == -1);
    CHECK(usage("{\"usage\":{\"completion_tokens\":4,\"prompt_tokens\":31}}", &in, &out) == -1);
    CHECK(usage("{\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":}}", &in, &out) == -1);
    CHECK(usage("{\"usage\":{\"prompt_tokens\":1234567890123456,\"completion_tokens\":1}}", &in,
                &out) == -1);
    CHECK(usage("{\"usage\":{\"prompt_tokens\":1,\"completion_tokens", &in, &out) == -1);
    /* Every prefix of a good body is read safely (the sanitizers watch the reads). */
    const char *good = "{\"usage\":{\"prompt_tokens\":31,\"completion_tokens\":4}}";
    for (size_t n = 0; n <= strlen(good); n++)
        CHECK(vx_books_usage((const unsigned char *)good, n, &in, &out) >= -1);
}

static int usage_messages(const char *s, int64_t *in, int64_t *out)
{
    return vx_books_usage_messages((const unsigned char *)s, strlen(s), in, out);
}

static void test_usage_messages(void)
{
    int64_t in = -1, out = -1;
    /* Anthropic's answer as the API writes it: cache writes and reads are part of the input. */
    CHECK(usage_messages("{\"content\":[{\"type\":\"text\",\"text\":\"\\\"usage\\\"\"}],"
                         "\"usage\":{\"input_tokens\":12,\"cache_creation_input_tokens\":100,"
                         "\"cache_read_input_tokens\":1000,\"cache_creation\":{"
                         "\"ephemeral_5m_input_tokens\":100,\"ephemeral_1h_input_tokens\":0},"
                         "\"output_tokens\":6,\"service_tier\":\"standard\"}}",
                         &in, &out) == 1);
    CHECK(in == 1112 && out == 6);
    CHECK(usage_messages("{\"usage\":{\"input_tokens\":3,\"output_tokens\":4}}", &in, &out) == 1);
    CHECK(in == 3 && out == 4);
    CHECK(usage_messages("{\"usage\" : {\n\"input_tokens\" : 3 , \"cache_read_input_tokens\":2 ,"
                         " \"cache_creation\" : { } , \"output_tokens\":4}}", &in, &out) == 1);
    CHECK(in == 5 && out == 4);
    CHECK(usage_messages("{}", &in, &out) == 0);
    CHECK(usage_messages("", &in, &out) == 0);
    /* Other orders, nulls, strings and cut bodies are left to Python. */
    CHECK(usage_messages("{\"usage\":{\"output_tokens\":4,\"input_tokens\":3}}", &in, &out) == -1);
    CHECK(usage_messages("{\"usage\":{\"input_tokens\":3,\"cache_creation_input_tokens\":null,"
                         "\"output_tokens\":4}}", &in, &out) == -1);
    CHECK(usage_messages("{\"usage\":{\"input_tokens\":3,\"cache_creation\":{\"a\\\"b\":1},"
                         "\"output_tokens\":4}}", &in, &out) == -1);
    CHECK(usage_messages("{\"usage\":{\"input_tokens\":3,\"cache_creation\":{\"a\":\"x\"},"
                         "\"output_tokens\":4}}", &in, &out) == -1);
    CHECK(usage_messages("{\"usage\":{\"input_tokens\":3,\"service_tier\":\"x\","
                         "\"output_tokens\":4}}", &in, &out) == -1);
    CHECK(usage_messages("{\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2}}", &in,
                         &out) == -1);
    const char *good = "{\"usage\":{\"input_tokens\":12,\"cache_creation_input_tokens\":1,"
                       "\"cache_read_input_tokens\":2,\"cache_creation\":{\"a\":1,\"b\":2},"
                       "\"output_tokens\":6}}";
    for (size_t n = 0; n <= strlen(good); n++)
        CHECK(vx_books_usage_messages((const unsigned char *)good, n, &in, &out) >= -1);
}

static int usage_parts(const char *s, int64_t *v)
{
    return vx_books_usage_parts((const unsigned char *)s, strlen(s), v);
}

static void test_usage_parts(void)
{
    int64_t v[VX_BOOKS_PARTS];
    /* OpenAI's answer as the API writes it: both details, their parts read. */
    const char *openai = "{\"id\":\"x\",\"usage\":{\"prompt_tokens\":31,\"completion_tokens\":4,"
                         "\"total_tokens\":35,\"prompt_tokens_details\":{\"cached_tokens\":16,"
                         "\"audio_tokens\":0},\"completion_tokens_details\":{"
                         "\"reasoning_tokens\":2,\"audio_tokens\":0,"
                         "\"accepted_prediction_tokens\":0,\"rejected_prediction_tokens\":0}},"
                         "\"system_fingerprint\":null}";
    CHECK(usage_parts(openai, v) == 1);
    CHECK(v[0] == 31 && v[1] == 4 && v[2] == 16 && v[3] == 0 && v[4] == 2);
    CHECK(usage_parts("{\"usage\" : { \"prompt_tokens\" : 1 , \"completion_tokens\":2 } }", v) == 1);
    CHECK(v[0] == 1 && v[1] == 2 && v[2] == 0 && v[3] == 0 && v[4] == 0);
    /* A translated answer's cache writes; a repeated details object replaces the first. */
    CHECK(usage_parts("{\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":2,"
                      "\"prompt_tokens_details\":{\"cached_tokens\":3,\"cache_write_tokens\":4},"
                      "\"prompt_tokens_details\":{\"cache_write_tokens\":5}}}", v) == 1);
    CHECK(v[2] == 0 && v[3] == 5);
    CHECK(usage_parts("{}", v) == 0);
    CHECK(usage_parts("", v) == 0);
    /* Anything else is left to Python: nulls, strings, deeper objects, repeated totals, a
     * details name holding a number, escaped names, another order, a cut object. */
    const char *other[] = {
        "{\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2,\"x\":null}}",
        "{\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2,\"x\":\"y\"}}",
        "{\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2,\"x\":{\"y\":{}}}}",
        "{\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2,\"prompt_tokens\":3}}",
        "{\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2,\"prompt_tokens_details\":3}}",
        "{\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2,\"a\\\"b\":3}}",
        "{\"usage\":{\"completion_tokens\":2,\"prompt_tokens\":1}}",
        "{\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2,",
        "{\"usage\":{\"input_tokens\":1,\"output_tokens\":2}}",
    };
    for (size_t k = 0; k < sizeof other / sizeof other[0]; k++)
        CHECK(usage_parts(other[k], v) == -1);
    /* Every prefix of a good body is read safely (the sanitizers watch the reads). */
    for (size_t n = 0; n <= strlen(openai); n++)
        CHECK(vx_books_usage_parts((const unsigned char *)openai, n, v) >= -1);
}

static void estimate(const char *s, int64_t *in, int64_t *out)
{
    vx_books_estimate((const unsigned char *)s, strlen(s), in, out);
}

static void test_estimate(void)
{
    int64_t in, out;
    estimate("", &in, &out);
    CHECK(in == 0 && out == -1);
    estimate("{\"max_tokens\": 32}", &in, &out); /* 17 bytes */
    CHECK(in == 5 && out == 32);
    /* The largest of the three keys, each by its last occurrence. */
    estimate("{\"max_completion_tokens\":7,\"max_tokens\":9}", &in, &out);
    CHECK(out == 9);
    estimate("{\"max_tokens\":null,\"max_output_tokens\":3}", &in, &out);
    CHECK(out == 3);
    estimate("{\"max_tokens\":5,\"max_tokens\":null}", &in, &out);
    CHECK(out == -1);
    estimate("{\"max_tokens\":1234567890123456789}", &in, &out);
    CHECK(out == INT64_C(1000000000000000));
    estimate("{\"max_tokens\":-0,\"max_output_tokens\":-3}", &in, &out);
    CHECK(out == 0);
    estimate("{\"max_tokens\":1e3,\"max_completion_tokens\":2.0}", &in, &out);
    CHECK(out == -1);
    estimate("{\"max_", &in, &out);
    CHECK(out == -1);
    /* A decoy inside a tool's schema is not the request's maximum; an escaped key is. */
    estimate("{\"tools\":[{\"parameters\":{\"max_tokens\":1}}],\"max_tokens\":500}", &in, &out);
    CHECK(out == 500);
    estimate("{\"tools\":[{\"parameters\":{\"max_tokens\":1}}]}", &in, &out);
    CHECK(out == -1);
    estimate("{\"max_\\u0074okens\":44}", &in, &out);
    CHECK(out == 44);
    /* ";base64," in text is text; at an image part's url it is a payload. */
    estimate("{\"messages\":[{\"content\":\";base64,AAAAAAAA\"}]}", &in, &out); /* 45 bytes */
    CHECK(in == 12 && out == -1);
    const char *chat = "{\"messages\":[{\"content\":[{\"image_url\":{\"url\":"
                       "\"data:image/png;base64,AAAAAAAA\"}}]}]}"; /* 83 bytes, 8 inline */
    estimate(chat, &in, &out);
    CHECK(in == 19 + 765);
    const char *responses = "{\"input\":[{\"content\":[{\"type\":\"input_image\",\"image_url\":"
                            "\"data:x;base64,AAAA\"}]}]}"; /* 81 bytes, 4 inline */
    estimate(responses, &in, &out);
    CHECK(in == 20 + 765);
    const char *source = "{\"messages\":[{\"content\":[{\"source\":{\"data\":\"AAAAAAAA\"}}]}]}";
    estimate(source, &in, &out); /* 59 bytes, 8 inline */
    CHECK(in == 13 + 765);
    /* Escapes are decoded: "\/" is one byte of payload, the marker may be spelt escaped. */
    estimate("{\"messages\":[{\"content\":[{\"image_url\":{\"url\":\"x\\u003bbase64,A\\/B\"}}]}]}",
             &in, &out); /* 71 bytes, 3 inline */
    CHECK(in == 17 + 765);
    /* The same url outside an image part, or deeper, is text. */
    estimate("{\"tools\":[{\"image_url\":{\"url\":\"x;base64,AAAAAAAA\"}}]}", &in, &out);
    CHECK(in == 14);
    /* Every prefix of a body, and hostile bytes, are read safely (the sanitizers watch). */
    for (size_t n = 0; n <= strlen(chat); n++)
        vx_books_estimate((const unsigned char *)chat, n, &in, &out);
    estimate("]]]}}}\"\\\"\\", &in, &out);
    CHECK(in == 3);
    estimate("{\"messages\":[{\"content\":[{\"image_url\":\"x;base64,\\", &in, &out);
    CHECK(out == -1);
}

int main(void)
{
    test_estimate();
    test_strings();
    test_numbers_and_time();
    test_usage();
    test_usage_parts();
    test_usage_messages();
    if (failures)
        fprintf(stderr, "test_books: %d failure(s)\n", failures);
    return failures != 0;
}
