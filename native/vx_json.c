/* vx_json: one-pass JSON validator with top-level "model"/"stream" extraction.
 *
 * Shape: an explicit state machine (labels value / key / value_done) over one byte cursor,
 * with the open containers kept in a fixed VX_JSON_MAX_DEPTH-byte stack, so hostile nesting
 * costs neither recursion nor allocation. Each helper below takes the cursor by pointer,
 * advances it past what it accepted, and on failure stores the offending offset and returns
 * an error code; every byte read is checked against len first.
 */
#include "vx_json.h"

#include <stdint.h>
#include <string.h>

/* Significant digits of 2^1024 - 2^970: halfway between DBL_MAX and 2^1024. A value at or
 * above it rounds to infinity (at exactly halfway, round-to-even picks 2^1024), and that is
 * where orjson starts saying "number is infinity when parsed as double". As a decimal it is
 * 0.<these 309 digits> x 10^309; the last digit is non-zero, which number_overflows relies on. */
static const char overflow_digits[] =
    "17976931348623158079372897140530341507993413271003782693617377898044496829276475"
    "09466490179775872070963302864166928879109465555478519404026306574886715058206819"
    "08902000708383676273854845817711531764475730270069855571366959622842914819860834"
    "936475292719074168444365510704342711559699508093042880177904174497792";
#define OVERFLOW_EXP10 309
_Static_assert(sizeof overflow_digits - 1 == OVERFLOW_EXP10, "2^1024 - 2^970 has 309 digits");

/* Exponents are saturated here while they are read. Any |exponent| this large decides the
 * range check on its own, since digit counts are below VX_JSON_MAX_LEN = 2^60: the adjusted
 * exponent stays beyond +-(2^61 - 2^60), far from 309, and never overflows int64. */
#define EXP_CAP ((int64_t)1 << 61)

/* Bytes that end the plain run of a string: the quote, the backslash, control bytes (which
 * orjson refuses raw) and every byte >= 0x80 (start of a UTF-8 sequence to validate). */
#define R16(v) v, v, v, v, v, v, v, v, v, v, v, v, v, v, v, v
static const unsigned char str_stop[256] = {
    R16(1), R16(1),                                 /* 0x00-0x1f */
    0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, /* 0x20-0x2f: '"' */
    R16(0), R16(0),                                 /* 0x30-0x4f */
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, /* 0x50-0x5f: '\\' */
    R16(0), R16(0),                                 /* 0x60-0x7f */
    R16(1), R16(1), R16(1), R16(1), R16(1), R16(1), R16(1), R16(1), /* 0x80-0xff */
};
#undef R16

#define ONES UINT64_C(0x0101010101010101)
#define HIGHS UINT64_C(0x8080808080808080)

/* Non-zero iff one of the 8 bytes of w is a str_stop byte. Byte order does not matter.
 * w - ONES * 0x20 sets the high bit of each byte below 0x20 (it wraps around); q = w ^ '"'
 * and s = w ^ '\\' are zero exactly at the quote and the backslash, so q - ONES and s - ONES
 * set those bytes' high bits the same way. A byte that wraps also borrows from the byte
 * above it, which can set that neighbour's high bit too, but every such chain starts at a
 * genuine stop byte. Any other high bit comes from a byte >= 0x80, a stop byte itself. So
 * "some high bit is set" is exact; which byte it is is not needed. */
static inline uint64_t stop_bytes(uint64_t w)
{
    uint64_t q = w ^ (ONES * '"');
    uint64_t s = w ^ (ONES * '\\');
    return ((w - ONES * 0x20) | (q - ONES) | (s - ONES) | w) & HIGHS;
}

static inline int is_digit(unsigned c)
{
    return c - '0' < 10u;
}

static inline int hex_value(unsigned c)
{
    if (c - '0' < 10u)
        return (int)(c - '0');
    c |= 0x20; /* ASCII letters to lower case; maps no non-letter onto a-f */
    if (c - 'a' < 6u)
        return (int)(c - 'a' + 10);
    return -1;
}

static inline size_t skip_ws(const unsigned char *buf, size_t len, size_t p)
{
    while (p < len && (buf[p] == ' ' || buf[p] == '\n' || buf[p] == '\r' || buf[p] == '\t'))
        p++;
    return p;
}

/* Kind of the value whose first byte is c; only called on values already validated. */
static int kind_of(unsigned char c)
{
    switch (c) {
    case '{': return VX_JSON_OBJECT;
    case '[': return VX_JSON_ARRAY;
    case '"': return VX_JSON_STRING;
    case 't': return VX_JSON_TRUE;
    case 'f': return VX_JSON_FALSE;
    case 'n': return VX_JSON_NULL;
    default: return VX_JSON_NUMBER;
    }
}

/* Four hex digits at buf[q, q + 4) as a code unit, or -1 with *rc and *err set: TRUNCATED if the
 * input ends while the digits so far are valid, else ESCAPE at esc (the backslash). */
static long read_hex4(const unsigned char *buf, size_t len, size_t q, size_t esc, int *rc,
                      size_t *err)
{
    long v = 0;
    for (size_t i = 0; i < 4; i++) {
        if (q + i >= len) {
            *rc = VX_JSON_E_TRUNCATED;
            *err = len;
            return -1;
        }
        int h = hex_value(buf[q + i]);
        if (h < 0) {
            *rc = VX_JSON_E_ESCAPE;
            *err = esc;
            return -1;
        }
        v = v * 16 + h;
    }
    return v;
}

/* buf[*pp] is a backslash inside a string. Accepts one escape (a \u surrogate pair counts as
 * one) and moves *pp past it. Lone surrogates are refused because orjson refuses them (it
 * builds a Python str, which could hold one, but yyjson checks pairing). */
static int scan_escape(const unsigned char *buf, size_t len, size_t *pp, size_t *err)
{
    size_t p = *pp;
    int rc = VX_JSON_OK;
    if (len - p < 2) {
        *err = len;
        return VX_JSON_E_TRUNCATED;
    }
    switch (buf[p + 1]) {
    case '"': case '\\': case '/': case 'b': case 'f': case 'n': case 'r': case 't':
        *pp = p + 2;
        return VX_JSON_OK;
    case 'u':
        break;
    default:
        *err = p;
        return VX_JSON_E_ESCAPE;
    }
    long cu = read_hex4(buf, len, p + 2, p, &rc, err);
    if (cu < 0)
        return rc;
    if (cu >= 0xDC00 && cu <= 0xDFFF) { /* low surrogate with no high one before it */
        *err = p;
        return VX_JSON_E_SURROGATE;
    }
    if (cu < 0xD800 || cu > 0xDBFF) {
        *pp = p + 6;
        return VX_JSON_OK;
    }
    /* High surrogate: the very next thing must be a \u low surrogate. */
    size_t q = p + 6;
    for (size_t i = 0; i < 2; i++) {
        if (q + i >= len) {
            *err = len;
            return VX_JSON_E_TRUNCATED;
        }
        if (buf[q + i] != (i == 0 ? '\\' : 'u')) {
            *err = p;
            return VX_JSON_E_SURROGATE;
        }
    }
    long lo = read_hex4(buf, len, q + 2, q, &rc, err);
    if (lo < 0)
        return rc;
    if (lo < 0xDC00 || lo > 0xDFFF) {
        *err = p;
        return VX_JSON_E_SURROGATE;
    }
    *pp = q + 6;
    return VX_JSON_OK;
}

/* buf[*pp] >= 0x80. Accepts one well-formed UTF-8 sequence (RFC 3629 table 3-7: no overlong
 * forms, no U+D800-DFFF, nothing above U+10FFFF) and moves *pp past it. */
static int scan_utf8(const unsigned char *buf, size_t len, size_t *pp, size_t *err)
{
    size_t p = *pp;
    unsigned c = buf[p], lo = 0x80, hi = 0xBF; /* allowed range of the second byte */
    size_t n;
    if (c >= 0xC2 && c <= 0xDF) {
        n = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
        n = 3;
        if (c == 0xE0)
            lo = 0xA0; /* below: overlong */
        else if (c == 0xED)
            hi = 0x9F; /* above: surrogates */
    } else if (c >= 0xF0 && c <= 0xF4) {
        n = 4;
        if (c == 0xF0)
            lo = 0x90; /* below: overlong */
        else if (c == 0xF4)
            hi = 0x8F; /* above: beyond U+10FFFF */
    } else { /* continuation byte, C0/C1 (always overlong) or F5-FF */
        *err = p;
        return VX_JSON_E_UTF8;
    }
    for (size_t i = 1; i < n; i++) {
        if (p + i >= len) {
            *err = len;
            return VX_JSON_E_TRUNCATED;
        }
        unsigned b = buf[p + i];
        if (b < lo || b > hi) {
            *err = p;
            return VX_JSON_E_UTF8;
        }
        lo = 0x80;
        hi = 0xBF;
    }
    *pp = p + n;
    return VX_JSON_OK;
}

/* Offset of the first stop byte in an 8-byte word whose stop_bytes() mask m is non-zero.
 * Where words load little-endian, that byte is the lowest flagged one: a false flag only
 * comes from a borrow, which moves towards higher addresses, so it always lies above a
 * genuine stop byte. Elsewhere (or without the GCC/Clang builtin) answer 0 and let the
 * byte loop that follows find it. */
#if defined(__GNUC__) && defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define FIRST_STOP(m) ((size_t)__builtin_ctzll(m) / 8)
#else
#define FIRST_STOP(m) ((size_t)0)
#endif

/* buf[*pp] is the opening quote. Moves *pp past the closing quote; *escaped tells whether the
 * string held a backslash (then its bytes are not its value). */
static int scan_string(const unsigned char *buf, size_t len, size_t *pp, int *escaped,
                       size_t *err)
{
    size_t p = *pp + 1;
    int esc = 0, rc;
    for (;;) {
        /* Look for the next stop byte 16 bytes at a time, with one branch per round: big
         * bodies are mostly one long base64 or text string, and this is where their time
         * goes. memcpy is an unaligned load. */
        while (len - p >= 16) {
            uint64_t a, b, ma, mb;
            memcpy(&a, buf + p, 8);
            memcpy(&b, buf + p + 8, 8);
            ma = stop_bytes(a);
            mb = stop_bytes(b);
            if (ma | mb) {
                p += ma ? FIRST_STOP(ma) : 8 + FIRST_STOP(mb);
                break;
            }
            p += 16;
        }
        /* The stop byte itself (already at p where FIRST_STOP is exact), or the last bytes. */
        while (p < len && !str_stop[buf[p]])
            p++;
        if (p >= len) {
            *err = len;
            return VX_JSON_E_TRUNCATED;
        }
        unsigned c = buf[p];
        if (c == '"') {
            *pp = p + 1;
            *escaped = esc;
            return VX_JSON_OK;
        }
        if (c == '\\') {
            esc = 1;
            rc = scan_escape(buf, len, &p, err);
        } else if (c < 0x20) {
            *err = p;
            return VX_JSON_E_CONTROL;
        } else {
            /* Text in non-Latin scripts is runs of multi-byte characters: validate them back
             * to back rather than searching again after each one. */
            do
                rc = scan_utf8(buf, len, &p, err);
            while (rc == VX_JSON_OK && p < len && buf[p] >= 0x80);
        }
        if (rc != VX_JSON_OK)
            return rc;
    }
}

/* Whether the number with integer digits buf[i0, i1), fraction digits buf[f0, f1) (empty
 * range if none) and decimal exponent exp (saturated at +-EXP_CAP) has a magnitude of at
 * least 2^1024 - 2^970. Normalise to 0.d1d2... x 10^e10 with d1 the first non-zero digit;
 * e10 alone decides unless it is 309, and then at most 309 digits are compared, so the cost
 * beyond the digits' first reading is bounded (except for the skip over a fraction's leading
 * zeros, read once more: still linear). */
static int number_overflows(const unsigned char *buf, size_t i0, size_t i1, size_t f0, size_t f1,
                            int64_t exp)
{
    int64_t e10;
    size_t sig;
    if (buf[i0] != '0') { /* no leading zeros allowed, so the integer part is all significant */
        e10 = (int64_t)(i1 - i0) + exp;
        sig = i0;
    } else { /* integer part is exactly "0" */
        size_t z = f0;
        while (z < f1 && buf[z] == '0')
            z++;
        if (z == f1)
            return 0; /* the value is zero, whatever the exponent */
        e10 = exp - (int64_t)(z - f0);
        sig = z;
        i1 = sig; /* no integer digits take part in the comparison */
        f0 = sig;
    }
    if (e10 != OVERFLOW_EXP10)
        return e10 > OVERFLOW_EXP10;
    size_t k = 0;
    for (size_t i = sig; i < i1 && k < OVERFLOW_EXP10; i++, k++)
        if (buf[i] != (unsigned char)overflow_digits[k])
            return buf[i] > (unsigned char)overflow_digits[k];
    for (size_t i = f0; i < f1 && k < OVERFLOW_EXP10; i++, k++)
        if (buf[i] != (unsigned char)overflow_digits[k])
            return buf[i] > (unsigned char)overflow_digits[k];
    /* All 309 digits equal: at least the threshold. Fewer digits, all equal: below it, since
     * the threshold's remaining digits end in a non-zero one. */
    return k == OVERFLOW_EXP10;
}

/* buf[*pp] is '-' or a digit. Accepts -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)? and
 * moves *pp past it; out-of-range values are refused (VX_JSON_E_RANGE at the number's start).
 * What follows the number is the caller's business ("0x" fails there, as trailing content). */
static int scan_number(const unsigned char *buf, size_t len, size_t *pp, size_t *err)
{
    size_t start = *pp, p = start;
    if (buf[p] == '-')
        p++;
    if (p >= len)
        goto truncated;
    size_t i0 = p;
    if (buf[p] == '0') {
        p++;
        if (p < len && is_digit(buf[p]))
            goto bad; /* leading zero */
    } else if (is_digit(buf[p])) {
        while (p < len && is_digit(buf[p]))
            p++;
    } else {
        goto bad;
    }
    size_t i1 = p, f0 = p, f1 = p;
    if (p < len && buf[p] == '.') {
        p++;
        if (p >= len)
            goto truncated;
        if (!is_digit(buf[p]))
            goto bad;
        f0 = p;
        while (p < len && is_digit(buf[p]))
            p++;
        f1 = p;
    }
    int64_t exp = 0;
    if (p < len && (buf[p] | 0x20) == 'e') {
        p++;
        if (p >= len)
            goto truncated;
        int neg = buf[p] == '-';
        if (buf[p] == '+' || buf[p] == '-') {
            p++;
            if (p >= len)
                goto truncated;
        }
        if (!is_digit(buf[p]))
            goto bad;
        while (p < len && is_digit(buf[p])) {
            exp = exp <= (EXP_CAP - 9) / 10 ? exp * 10 + (buf[p] - '0') : EXP_CAP;
            p++;
        }
        if (neg)
            exp = -exp;
    }
    if (number_overflows(buf, i0, i1, f0, f1, exp)) {
        *err = start;
        return VX_JSON_E_RANGE;
    }
    *pp = p;
    return VX_JSON_OK;
truncated:
    *err = len;
    return VX_JSON_E_TRUNCATED;
bad:
    *err = p;
    return VX_JSON_E_NUMBER;
}

/* buf[*pp] starts the literal word[0, n). Moves *pp past it. */
static int scan_literal(const unsigned char *buf, size_t len, size_t *pp, const char *word,
                        size_t n, size_t *err)
{
    size_t p = *pp;
    for (size_t i = 0; i < n; i++) {
        if (p + i >= len) {
            *err = len;
            return VX_JSON_E_TRUNCATED;
        }
        if (buf[p + i] != (unsigned char)word[i]) {
            *err = p + i;
            return VX_JSON_E_SYNTAX;
        }
    }
    *pp = p + n;
    return VX_JSON_OK;
}

enum { FIELD_NONE, FIELD_MODEL, FIELD_STREAM };

/* Which field a top-level key names. s[0, n) are the bytes between the key's quotes, already
 * validated (but re-read defensively: every access is checked against n, in case the caller
 * broke its promise not to modify the buffer). Without a backslash the bytes are the name.
 * Otherwise decode at most 7 characters, one more than the longest name: each escape or raw
 * byte yields one, so this costs O(1) however long the key. Only \u escapes can spell the
 * names' letters (the short escapes all stand for punctuation or control characters, and a
 * \u escape for a non-ASCII character cannot match an ASCII name), so the others rule a
 * match out at once. */
static int field_of_key(const unsigned char *s, size_t n, int escaped)
{
    if (!escaped) {
        if (n == 5 && memcmp(s, "model", 5) == 0)
            return FIELD_MODEL;
        if (n == 6 && memcmp(s, "stream", 6) == 0)
            return FIELD_STREAM;
        return FIELD_NONE;
    }
    unsigned char name[7];
    size_t k = 0, i = 0;
    while (i < n) {
        if (k == sizeof name)
            return FIELD_NONE;
        if (s[i] != '\\') {
            name[k++] = s[i++];
            continue;
        }
        if (n - i < 6 || s[i + 1] != 'u')
            return FIELD_NONE;
        long cu = 0;
        for (size_t j = 2; j < 6; j++) {
            int h = hex_value(s[i + j]);
            if (h < 0)
                return FIELD_NONE;
            cu = cu * 16 + h;
        }
        if (cu >= 0x80)
            return FIELD_NONE;
        name[k++] = (unsigned char)cu;
        i += 6;
    }
    if (k == 5 && memcmp(name, "model", 5) == 0)
        return FIELD_MODEL;
    if (k == 6 && memcmp(name, "stream", 6) == 0)
        return FIELD_STREAM;
    return FIELD_NONE;
}

int vx_json_scan(const unsigned char *buf, size_t len, vx_json_fields *out)
{
    /* stack[i]: 1 if the (i+1)-th open container is an object, 0 if an array. */
    unsigned char stack[VX_JSON_MAX_DEPTH];
    size_t depth = 0;
    size_t p, err = 0;
    int rc, escaped = 0;
    /* The top-level key whose value is being read (set only at depth 1), and where that
     * value starts; both survive the nested containers the value may contain. */
    int field = FIELD_NONE;
    size_t field_start = 0;
    vx_json_fields f = {0, 0, 0, VX_JSON_ABSENT, VX_JSON_ABSENT, VX_JSON_ABSENT};

    if (len >= VX_JSON_MAX_LEN) {
        rc = VX_JSON_E_TOO_LARGE;
        goto fail;
    }
    p = skip_ws(buf, len, 0);
    if (p == len) {
        rc = VX_JSON_E_EMPTY;
        err = len;
        goto fail;
    }
    f.top_kind = kind_of(buf[p]);

value: /* a value must start at p (whitespace already skipped) */
    if (p >= len)
        goto truncated;
    switch (buf[p]) {
    case '{':
    case '[':
        if (depth == VX_JSON_MAX_DEPTH) {
            rc = VX_JSON_E_DEPTH;
            err = p;
            goto fail;
        }
        stack[depth++] = buf[p] == '{';
        {
            unsigned char close = buf[p] == '{' ? '}' : ']';
            p = skip_ws(buf, len, p + 1);
            if (p < len && buf[p] == close) { /* empty container */
                p++;
                depth--;
                goto value_done;
            }
        }
        if (stack[depth - 1])
            goto key;
        goto value;
    case '"':
        rc = scan_string(buf, len, &p, &escaped, &err);
        break;
    case 't':
        rc = scan_literal(buf, len, &p, "true", 4, &err);
        break;
    case 'f':
        rc = scan_literal(buf, len, &p, "false", 5, &err);
        break;
    case 'n':
        rc = scan_literal(buf, len, &p, "null", 4, &err);
        break;
    case '-': case '0': case '1': case '2': case '3': case '4':
    case '5': case '6': case '7': case '8': case '9':
        rc = scan_number(buf, len, &p, &err);
        break;
    default:
        rc = VX_JSON_E_SYNTAX;
        err = p;
        break;
    }
    if (rc != VX_JSON_OK)
        goto fail;
    goto value_done;

key: /* inside an object, a key must start at p (whitespace already skipped) */
    if (p >= len)
        goto truncated;
    if (buf[p] != '"') {
        rc = VX_JSON_E_SYNTAX;
        err = p;
        goto fail;
    }
    {
        size_t k0 = p + 1;
        rc = scan_string(buf, len, &p, &escaped, &err);
        if (rc != VX_JSON_OK)
            goto fail;
        if (depth == 1) /* p - 1 is the closing quote */
            field = field_of_key(buf + k0, p - 1 - k0, escaped);
    }
    p = skip_ws(buf, len, p);
    if (p >= len)
        goto truncated;
    if (buf[p] != ':') {
        rc = VX_JSON_E_SYNTAX;
        err = p;
        goto fail;
    }
    p = skip_ws(buf, len, p + 1);
    if (depth == 1)
        field_start = p;
    goto value;

value_done: /* a value ends just before p; depth containers are still open around it */
    if (depth == 1 && field != FIELD_NONE) {
        /* Overwrite on every occurrence: the last duplicate key wins, as in orjson. */
        if (field == FIELD_MODEL) {
            f.model_kind = kind_of(buf[field_start]);
            f.model_start = field_start;
            f.model_end = p;
        } else {
            f.stream_kind = kind_of(buf[field_start]);
        }
        field = FIELD_NONE;
    }
    p = skip_ws(buf, len, p);
    if (depth == 0) {
        if (p != len) {
            rc = VX_JSON_E_TRAILING;
            err = p;
            goto fail;
        }
        *out = f;
        return VX_JSON_OK;
    }
    if (p >= len)
        goto truncated;
    if (buf[p] == ',') {
        p = skip_ws(buf, len, p + 1);
        if (stack[depth - 1])
            goto key;
        goto value;
    }
    if (buf[p] == (stack[depth - 1] ? '}' : ']')) {
        p++;
        depth--;
        goto value_done;
    }
    rc = VX_JSON_E_SYNTAX;
    err = p;
    goto fail;

truncated:
    rc = VX_JSON_E_TRUNCATED;
    err = len;
fail:
    out->error_offset = err;
    out->model_start = out->model_end = 0;
    out->top_kind = out->model_kind = out->stream_kind = VX_JSON_ABSENT;
    return rc;
}

const char *vx_json_strerror(int code)
{
    switch (code) {
    case VX_JSON_OK: return "ok";
    case VX_JSON_E_EMPTY: return "empty document";
    case VX_JSON_E_TRUNCATED: return "unexpected end of data";
    case VX_JSON_E_SYNTAX: return "unexpected character";
    case VX_JSON_E_TRAILING: return "unexpected content after document";
    case VX_JSON_E_DEPTH: return "nesting deeper than 1024";
    case VX_JSON_E_NUMBER: return "malformed number";
    case VX_JSON_E_RANGE: return "number is infinity as a double";
    case VX_JSON_E_CONTROL: return "control character in string";
    case VX_JSON_E_ESCAPE: return "invalid escape in string";
    case VX_JSON_E_SURROGATE: return "unpaired surrogate in \\u escape";
    case VX_JSON_E_UTF8: return "invalid UTF-8 in string";
    case VX_JSON_E_TOO_LARGE: return "document too large";
    default: return "unknown error";
    }
}
