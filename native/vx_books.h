/* vx_books: the per-request bookkeeping's byte work: JSON strings for the access log's line
 * and the usage of an answer body, without Python.
 *
 * Why: a worker writes one access-log line per request and reads the token usage of every
 * model call's answer. Done in Python they cost about 5 us and 2 us of a request's ~80 us of
 * CPU (benches/bench_books.py); the binding (native/_velox_native.c) walks the request's
 * attributes and calls these.
 *
 * JSON strings are written exactly as orjson writes them: '"' and '\' escaped with a
 * backslash, \b \f \n \r \t in their short forms, every other byte below 0x20 as \u00XX
 * (lowercase hex), everything else (0x7F, U+2028/2029 included) as it is, in UTF-8.
 * Every read is checked against its length, so any byte sequence is safe to pass.
 */
#ifndef VX_BOOKS_H
#define VX_BOOKS_H

#include <stddef.h>
#include <stdint.h>

/* Room a JSON string of n input bytes may need: each byte at most 6 (\u00XX; a latin-1
 * byte becomes at most 2), plus the quotes. */
#define VX_BOOKS_STR_MAX(n) (6 * (size_t)(n) + 2)
/* Room of vx_books_i64's output. */
#define VX_BOOKS_I64_MAX 20
/* "YYYY-MM-DDTHH:MM:SS.mmmZ" for years 0..9999. */
#define VX_BOOKS_TIME_LEN 24

/* s read as latin-1 (each byte one code point), as a quoted JSON string at out; returns the
 * end of what was written. */
char *vx_books_latin1(char *out, const unsigned char *s, size_t n);
/* s, valid UTF-8, as a quoted JSON string at out (bytes >= 0x80 copied). */
char *vx_books_utf8(char *out, const unsigned char *s, size_t n);
/* Bytes of the first `chars` code points of UTF-8 text s (n when it has fewer). */
size_t vx_books_utf8_prefix(const unsigned char *s, size_t n, size_t chars);
/* v in decimal. */
char *vx_books_i64(char *out, int64_t v);
/* nanos nano-USD as a decimal of USD: the whole part, then (when there is one) '.' and the
 * nine-digit fraction with its trailing zeros cut; Python's divmod by 10^9 for negative nanos
 * (velox.spend.gate.usd_text, which the tests compare it with). */
#define VX_BOOKS_USD_MAX (VX_BOOKS_I64_MAX + 10)
#define VX_BOOKS_NANOS_PER_USD INT64_C(1000000000)
char *vx_books_usd(char *out, int64_t nanos);
/* The UTC time of ms milliseconds after the epoch (0 <= ms, year <= 9999) as
 * "YYYY-MM-DDTHH:MM:SS.mmmZ": VX_BOOKS_TIME_LEN bytes at out, no terminator. 0, or -1 when
 * out of range (nothing written). */
int vx_books_time(char *out, int64_t ms);

/* The usage of an answer in OpenAI's own order: at the last `"usage"` of s, `"usage":{
 * "prompt_tokens":N,"completion_tokens":M` (JSON whitespace allowed between tokens, N and M
 * of 1 to 15 digits). 1 with *in, *out set; 0 when s has no "usage" key at all; -1 when its
 * last one is not in that form (the caller reads it another way). */
int vx_books_usage(const unsigned char *s, size_t n, int64_t *in, int64_t *out);

/* The usage of an answer in OpenAI's own order with its parts, so that pricing needs no parse
 * of the answer: at the last `"usage"` of s, `"usage":{"prompt_tokens":N,"completion_tokens":M`
 * as vx_books_usage reads it, then every member to the object's closing brace, each either
 * `"name":digits` or `"name":{"name":digits, ...}` (names without escapes, JSON whitespace
 * between tokens). v[0] = N, v[1] = M, v[2] = prompt_tokens_details.cached_tokens, v[3] =
 * prompt_tokens_details.cache_write_tokens (a translated answer's), v[4] =
 * completion_tokens_details.reasoning_tokens (0 when absent; a repeated name's last
 * occurrence, a repeated details object's last, as JSON parsers keep them). 1 when read; 0
 * when s has no "usage" key; -1 when its last one is in any other form (a string or null
 * member, a deeper object, prompt_tokens or completion_tokens named twice, a details name
 * holding a number): the caller parses it (velox.spend.wire.usage_parts is the meaning). */
#define VX_BOOKS_PARTS 5
int vx_books_usage_parts(const unsigned char *s, size_t n, int64_t v[VX_BOOKS_PARTS]);

/* The usage of a Messages API answer in Anthropic's own order: at the last `"usage"` of s,
 * `"usage":{"input_tokens":N` then optionally `"cache_creation_input_tokens":C`,
 * `"cache_read_input_tokens":R`, `"cache_creation":{"name":digits, ...}`, then
 * `"output_tokens":M` (JSON whitespace allowed between tokens, each number 1 to 15 digits).
 * 1 with *in = N + C + R (the whole input, as OpenAI's prompt_tokens counts it) and *out = M;
 * 0 when s has no "usage" key; -1 when its last one is not in that form. */
int vx_books_usage_messages(const unsigned char *s, size_t n, int64_t *in, int64_t *out);

/* A request body's token estimate (velox.usage), read from where the schema puts things:
 *   *input = ceil((n - payload bytes) / 4) + 765 per inline payload. A payload is a string at
 *     top.messages[i].content[j].image_url.url or .image_url (chat's and the Responses API's
 *     image parts; top.input[i] alike): its decoded bytes after its first ";base64," (one
 *     without that marker is text), or at top.messages[i].content[j].source.data (a base64
 *     image source: the whole decoded string). Keys are compared unescaped and every
 *     occurrence counts (duplicate keys included); ";base64," anywhere else is text.
 *   *output = the largest of max_tokens, max_completion_tokens and max_output_tokens of the
 *     top-level object, each by its last occurrence and only when that is a non-negative
 *     integer (capped at 10^15), -1 when none is; the same keys deeper (a tool's JSON schema)
 *     count for nothing.
 * "Decoded bytes" are the UTF-8 bytes of the string's value (a lone surrogate escape counts 3).
 * Defined for JSON texts (the parse stage has validated the body); any other bytes are read
 * safely and give some estimate. velox/usage.py's input_tokens and output_limit are the
 * reference, kept equal by a differential test. */
#define VX_BOOKS_BYTES_PER_TOKEN 4
#define VX_BOOKS_IMAGE_TOKENS 765
void vx_books_estimate(const unsigned char *s, size_t n, int64_t *input, int64_t *output);

#endif /* VX_BOOKS_H */
