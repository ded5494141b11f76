/* vx_json: validate a JSON text and pick out the top-level "model" and "stream" fields,
 * without allocating and without Python, so the binding can run it with the GIL released.
 *
 * Why: the gateway must reject malformed bodies with a 400 and route on "model"/"stream".
 * Parsing a multi-megabyte body with orjson holds the GIL for milliseconds and stalls the
 * worker's event loop; this scanner does the same accept/reject decision in a thread.
 *
 * What is accepted is exactly what orjson 3.x (yyjson underneath) accepts, checked by
 * differential tests: RFC 8259 with nothing extra (no comments, no trailing commas, no NaN or
 * Infinity, no BOM), whitespace limited to space, tab, LF and CR, and:
 *   - strings: well-formed UTF-8 (no overlong forms, no encoded surrogates, nothing above
 *     U+10FFFF), no raw byte below 0x20, escapes \" \\ \/ \b \f \n \r \t \uXXXX where a \u
 *     high surrogate must be followed at once by a \u low surrogate and a lone low surrogate
 *     is an error;
 *   - numbers: the RFC grammar, and (like orjson) no number whose magnitude rounds to
 *     infinity as an IEEE binary64, i.e. |value| >= 2^1024 - 2^970; underflow to 0 is fine;
 *   - at most VX_JSON_MAX_DEPTH arrays/objects open at once.
 *
 * Cost: one pass, linear in len, constant memory (a VX_JSON_MAX_DEPTH-byte stack on the C
 * stack). Every read is checked against len, so any byte sequence is safe to pass.
 */
#ifndef VX_JSON_H
#define VX_JSON_H

#include <stddef.h>

/* orjson rejects a document with more than 1024 arrays/objects open at once. */
#define VX_JSON_MAX_DEPTH 1024

/* Return codes of vx_json_scan. Only "zero or not" is part of the orjson agreement; which
 * non-zero code a broken document gets is a best effort for error messages. */
enum vx_json_error {
    VX_JSON_OK = 0,
    VX_JSON_E_EMPTY = 1,     /* no value: empty or whitespace-only input */
    VX_JSON_E_TRUNCATED = 2, /* input ends inside a value */
    VX_JSON_E_SYNTAX = 3,    /* a byte that cannot appear at that point */
    VX_JSON_E_TRAILING = 4,  /* something other than whitespace after the top-level value */
    VX_JSON_E_DEPTH = 5,     /* more than VX_JSON_MAX_DEPTH nested arrays/objects */
    VX_JSON_E_NUMBER = 6,    /* malformed number: leading zero, missing digits */
    VX_JSON_E_RANGE = 7,     /* number that would be +-infinity as a double */
    VX_JSON_E_CONTROL = 8,   /* raw byte below 0x20 inside a string */
    VX_JSON_E_ESCAPE = 9,    /* unknown escape, or \u without four hex digits */
    VX_JSON_E_SURROGATE = 10, /* \u escape: lone or out-of-order UTF-16 surrogate */
    VX_JSON_E_UTF8 = 11,     /* ill-formed UTF-8 inside a string */
    VX_JSON_E_TOO_LARGE = 12, /* len >= VX_JSON_MAX_LEN */
};

/* Inputs this long are refused up front, so that digit and exponent arithmetic in int64
 * never overflows. 2^60 bytes is far beyond any real buffer. */
#define VX_JSON_MAX_LEN ((size_t)1 << 60)

/* JSON type of a value. ABSENT: the field is not in the top-level object (or the top-level
 * value is not an object). The numbering is part of the Python API (velox._native.JSON_*). */
enum vx_json_kind {
    VX_JSON_ABSENT = 0,
    VX_JSON_NULL = 1,
    VX_JSON_FALSE = 2,
    VX_JSON_TRUE = 3,
    VX_JSON_NUMBER = 4,
    VX_JSON_STRING = 5,
    VX_JSON_ARRAY = 6,
    VX_JSON_OBJECT = 7,
};

typedef struct vx_json_fields {
    /* On error: where validation failed. The bytes before it are a prefix of some valid
     * document, so it points at the first offending byte (the backslash of a bad escape, the
     * first byte of an ill-formed UTF-8 sequence or of an out-of-range number, the bracket
     * that opens one level too many), or is len when the input ends too early. 0 on success. */
    size_t error_offset;
    /* Byte span [model_start, model_end) of the value of the top-level "model" key: for a
     * string, quotes included, so the span is itself a JSON text. 0, 0 when absent. */
    size_t model_start, model_end;
    int top_kind;    /* enum vx_json_kind of the top-level value */
    int model_kind;  /* enum vx_json_kind of "model"'s value, VX_JSON_ABSENT if none */
    int stream_kind; /* enum vx_json_kind of "stream"'s value (TRUE/FALSE for the literals) */
} vx_json_fields;

/* Validate buf[0, len) as one JSON text and fill *out.
 *
 * Returns VX_JSON_OK (0), or a positive enum vx_json_error with out->error_offset set and
 * every other field of *out reset (kinds ABSENT, spans 0).
 *
 * Fields are looked up among the keys of the top-level object only (keys of nested objects
 * are ignored), after unescaping ("mod\u0065l" is "model"). When a key occurs more than
 * once the last occurrence is reported, as orjson and Python dicts keep the last one.
 *
 * buf may be NULL when len is 0. Thread-safe and reentrant: it touches only buf (read-only),
 * *out and its own stack. The caller must keep buf alive and unchanged for the call; if it
 * changes anyway, the result is meaningless, but reads still stay inside [buf, buf + len). */
int vx_json_scan(const unsigned char *buf, size_t len, vx_json_fields *out);

/* Static English description of a return code of vx_json_scan ("unknown error" otherwise). */
const char *vx_json_strerror(int code);

#endif /* VX_JSON_H */
