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
        if (c >= 0x20 && c < 0x80 && c != '"' && c != '\\') { /* most bytes: copied, no call */
            *out++ = (char)c;
        } else if (c < 0x80) {
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
        if (c >= 0x20 && c != '"' && c != '\\') /* most bytes, UTF-8's >= 0x80 included */
            *out++ = (char)c;
        else
            out = put_ascii(out, c);
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

/* "00".."99": two digits per division (an access line writes ~11 numbers). */
static const char DIGIT_PAIRS[201] =
    "00010203040506070809101112131415161718192021222324252627282930313233343536373839"
    "40414243444546474849505152535455565758596061626364656667686970717273747576777879"
    "8081828384858687888990919293949596979899";

char *vx_books_i64(char *out, int64_t v)
{
    char tmp[VX_BOOKS_I64_MAX];
    size_t at = sizeof(tmp); /* written from the end */
    /* Magnitude in unsigned arithmetic: INT64_MIN has no positive int64. */
    uint64_t m = v < 0 ? (uint64_t)0 - (uint64_t)v : (uint64_t)v;
    while (m >= 100) {
        unsigned pair = (unsigned)(m % 100) * 2;
        m /= 100;
        tmp[--at] = DIGIT_PAIRS[pair + 1];
        tmp[--at] = DIGIT_PAIRS[pair];
    }
    if (m >= 10) {
        tmp[--at] = DIGIT_PAIRS[m * 2 + 1];
        tmp[--at] = DIGIT_PAIRS[m * 2];
    } else {
        tmp[--at] = (char)('0' + m);
    }
    if (v < 0)
        *out++ = '-';
    memcpy(out, tmp + at, sizeof(tmp) - at);
    return out + (sizeof(tmp) - at);
}

char *vx_books_usd(char *out, int64_t nanos)
{
    int64_t whole = nanos / VX_BOOKS_NANOS_PER_USD, frac = nanos % VX_BOOKS_NANOS_PER_USD;
    if (frac < 0) { /* floor, as Python's divmod: the fraction is never negative */
        whole -= 1;
        frac += VX_BOOKS_NANOS_PER_USD;
    }
    out = vx_books_i64(out, whole);
    if (frac == 0)
        return out;
    *out++ = '.';
    char digits[9];
    for (int i = 8; i >= 0; i--, frac /= 10)
        digits[i] = (char)('0' + frac % 10);
    int n = 9;
    while (digits[n - 1] == '0') /* frac != 0: a digit other than 0 stops this */
        n--;
    memcpy(out, digits, (size_t)n);
    return out + n;
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

/* The usage object's first member: at the last `"usage"` of s, past `:{` and the space after
 * it. 1 with *at set; 0 when s has no "usage" key; -1 when its value does not open an object. */
static int usage_object(const unsigned char *s, size_t n, size_t *at)
{
    static const char KEY[] = "\"usage\"";
    const size_t klen = sizeof KEY - 1;
    if (n < klen)
        return 0;
    /* The last occurrence: scan backwards for its closing quote's first byte. */
    size_t found = (size_t)-1;
    for (size_t i = n - klen + 1; i-- > 0;) {
        if (s[i] == '"' && memcmp(s + i, KEY, klen) == 0) {
            found = i;
            break;
        }
    }
    if (found == (size_t)-1)
        return 0;
    size_t i = skip_space(s, n, found + klen);
    if (!(i = expect(s, n, i, LIT(":"))))
        return -1;
    i = skip_space(s, n, i);
    if (!(i = expect(s, n, i, LIT("{"))))
        return -1;
    *at = skip_space(s, n, i);
    return 1;
}

/* OpenAI's first two members, from the usage object's start: 1 with *a, *b and *at past the
 * second number; 0 when s has no "usage" key; -1 when not in that form. */
static int openai_two(const unsigned char *s, size_t n, size_t *at, int64_t *a, int64_t *b)
{
    size_t i = 0;
    int rc = usage_object(s, n, &i);
    if (rc <= 0)
        return rc;
    if (!(i = expect(s, n, i, LIT("\"prompt_tokens\""))))
        return -1;
    i = skip_space(s, n, i);
    if (!(i = expect(s, n, i, LIT(":"))))
        return -1;
    i = skip_space(s, n, i);
    if ((*a = digits(s, n, &i)) < 0)
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
    if ((*b = digits(s, n, &i)) < 0)
        return -1;
    *at = i;
    return 1;
}

int vx_books_usage(const unsigned char *s, size_t n, int64_t *in, int64_t *out)
{
    size_t i;
    int64_t a, b;
    int rc = openai_two(s, n, &i, &a, &b);
    if (rc <= 0)
        return rc;
    *in = a;
    *out = b;
    return 1;
}

/* ---- usage in the Messages API's order (non-streamed answers) ----
 *
 * Its own function beside vx_books_usage, so the OpenAI scan stays as it is. The members read,
 * in Anthropic's order: "input_tokens" (required), "cache_creation_input_tokens" and
 * "cache_read_input_tokens" (each optional), "cache_creation" (optional: an object of
 * "name":digits members, the cache writes by lifetime, already counted in the total above),
 * "output_tokens" (required); what follows output_tokens is not read. */

/* ,"<key>": at s[*i] (whitespace allowed between tokens): 1 with *i past the colon and the
 * space after it; 0 when the next member is another one (nothing moved). */
static int member(const unsigned char *s, size_t n, size_t *i, const char *key, size_t len)
{
    size_t j = skip_space(s, n, *i);
    if (!(j = expect(s, n, j, LIT(","))))
        return 0;
    j = skip_space(s, n, j);
    if (!(j = expect(s, n, j, key, len)))
        return 0;
    j = skip_space(s, n, j);
    if (!(j = expect(s, n, j, LIT(":"))))
        return 0;
    *i = skip_space(s, n, j);
    return 1;
}

/* A member name without escapes at s[*i] (its opening quote): 1 with [*a, *b) its bytes and *i
 * past its closing quote and the colon after it (and the space after that); 0 otherwise. */
static int member_name(const unsigned char *s, size_t n, size_t *i, size_t *a, size_t *b)
{
    size_t j = *i;
    if (!(j = expect(s, n, j, LIT("\""))))
        return 0;
    *a = j;
    while (j < n && s[j] != '"' && s[j] != '\\')
        j++;
    *b = j;
    if (!(j = expect(s, n, j, LIT("\""))))
        return 0;
    j = skip_space(s, n, j);
    if (!(j = expect(s, n, j, LIT(":"))))
        return 0;
    *i = skip_space(s, n, j);
    return 1;
}

static int name_is(const unsigned char *s, size_t a, size_t b, const char *lit, size_t len)
{
    return b - a == len && memcmp(s + a, lit, len) == 0;
}

/* Which parts a details object holds, by its member names (slots of v; -1: none read). */
struct parts_of {
    const char *name[2];
    size_t len[2];
    int slot[2];
};

static const struct parts_of PROMPT_PARTS = {
    {"cached_tokens", "cache_write_tokens"}, {13, 18}, {2, 3}};
static const struct parts_of COMPLETION_PARTS = {{"reasoning_tokens", ""}, {16, 0}, {4, -1}};
static const struct parts_of NO_PARTS = {{"", ""}, {0, 0}, {-1, -1}};

/* An object of "name":digits members at s[*i] (its '{'), the named parts stored in v: 1 with
 * *i past its closing brace, 0 when it is anything else. */
static int details_object(const unsigned char *s, size_t n, size_t *i, const struct parts_of *p,
                          int64_t *v)
{
    size_t j = *i + 1; /* past '{' (the caller saw it) */
    j = skip_space(s, n, j);
    if (j < n && s[j] == '}') {
        *i = j + 1;
        return 1;
    }
    for (;;) {
        size_t a, b;
        if (!member_name(s, n, &j, &a, &b))
            return 0;
        int64_t d = digits(s, n, &j);
        if (d < 0)
            return 0;
        for (int k = 0; k < 2; k++)
            if (p->slot[k] >= 0 && name_is(s, a, b, p->name[k], p->len[k]))
                v[p->slot[k]] = d;
        j = skip_space(s, n, j);
        if (j < n && s[j] == '}') {
            *i = j + 1;
            return 1;
        }
        if (!(j = expect(s, n, j, LIT(","))))
            return 0;
        j = skip_space(s, n, j);
    }
}

/* An object of "name":digits members at s[i] (names without escapes): the index past its
 * closing brace, 0 when it is anything else. */
static size_t number_object(const unsigned char *s, size_t n, size_t i)
{
    int64_t unread[VX_BOOKS_PARTS];
    if (i >= n || s[i] != '{' || !details_object(s, n, &i, &NO_PARTS, unread))
        return 0;
    return i;
}

int vx_books_usage_messages(const unsigned char *s, size_t n, int64_t *in, int64_t *out)
{
    size_t i = 0;
    int rc = usage_object(s, n, &i);
    if (rc <= 0)
        return rc;
    if (!(i = expect(s, n, i, LIT("\"input_tokens\""))))
        return -1;
    i = skip_space(s, n, i);
    if (!(i = expect(s, n, i, LIT(":"))))
        return -1;
    i = skip_space(s, n, i);
    int64_t total = digits(s, n, &i);
    if (total < 0)
        return -1;
    /* Cache writes and reads are parts of the input, as OpenAI's prompt_tokens count them. */
    if (member(s, n, &i, LIT("\"cache_creation_input_tokens\""))) {
        int64_t v = digits(s, n, &i);
        if (v < 0)
            return -1;
        total += v;
    }
    if (member(s, n, &i, LIT("\"cache_read_input_tokens\""))) {
        int64_t v = digits(s, n, &i);
        if (v < 0)
            return -1;
        total += v;
    }
    if (member(s, n, &i, LIT("\"cache_creation\"")) && !(i = number_object(s, n, i)))
        return -1;
    if (!member(s, n, &i, LIT("\"output_tokens\"")))
        return -1;
    int64_t o = digits(s, n, &i);
    if (o < 0)
        return -1;
    *in = total;
    *out = o;
    return 1;
}

/* ---- usage with its parts (OpenAI's order, to the object's end) ---- */

/* The members after completion_tokens, to the usage object's closing brace. */
static int usage_rest(const unsigned char *s, size_t n, size_t i, int64_t *v)
{
    for (;;) {
        i = skip_space(s, n, i);
        if (i < n && s[i] == '}')
            return 1;
        if (!(i = expect(s, n, i, LIT(","))))
            return -1;
        i = skip_space(s, n, i);
        size_t a, b;
        if (!member_name(s, n, &i, &a, &b))
            return -1;
        int prompt = name_is(s, a, b, LIT("prompt_tokens_details"));
        int completion = name_is(s, a, b, LIT("completion_tokens_details"));
        if (i < n && s[i] == '{') {
            const struct parts_of *p = prompt ? &PROMPT_PARTS : completion ? &COMPLETION_PARTS
                                                                          : &NO_PARTS;
            /* A repeated details object replaces the earlier one whole. */
            if (prompt)
                v[2] = v[3] = 0;
            if (completion)
                v[4] = 0;
            if (!details_object(s, n, &i, p, v))
                return -1;
            continue;
        }
        if (prompt || completion || name_is(s, a, b, LIT("prompt_tokens")) ||
            name_is(s, a, b, LIT("completion_tokens")) || digits(s, n, &i) < 0)
            return -1;
    }
}

int vx_books_usage_parts(const unsigned char *s, size_t n, int64_t v[VX_BOOKS_PARTS])
{
    for (int k = 0; k < VX_BOOKS_PARTS; k++)
        v[k] = 0;
    size_t i;
    int rc = openai_two(s, n, &i, &v[0], &v[1]);
    return rc <= 0 ? rc : usage_rest(s, n, i, v);
}

/* ---- estimate ----
 *
 * One forward pass over the JSON text that knows only what the estimate needs: which container
 * it is in (up to ROLE_DEPTH levels, by the role the schema gives it) and, in an object, the
 * key of the value being read. Strings are skipped with memchr for their closing quote; any
 * byte that fits nowhere is stepped over, so every input ends, and every read is checked. */

enum {
    R_NONE,   /* nothing the estimate reads is inside */
    R_TOP,    /* the top-level object */
    R_LIST,   /* top.messages / top.input (an array) */
    R_ITEM,   /* an object of R_LIST */
    R_PARTS,  /* R_ITEM.content (an array) */
    R_PART,   /* an object of R_PARTS */
    R_IMAGE,  /* R_PART.image_url (an object) */
    R_SOURCE, /* R_PART.source (an object) */
};

/* What the value after a key (or an array element) is to the estimate. */
enum {
    V_NONE,
    V_LIST,     /* R_TOP.messages / input: R_LIST when an array */
    V_ITEM,     /* an element of R_LIST: R_ITEM when an object */
    V_CONTENT,  /* R_ITEM.content: R_PARTS when an array */
    V_PART,     /* an element of R_PARTS: R_PART when an object */
    V_IMAGE,    /* R_PART.image_url: R_IMAGE when an object, a data URL when a string */
    V_SOURCE,   /* R_PART.source: R_SOURCE when an object */
    V_URL,      /* R_IMAGE.url: a data URL when a string */
    V_DATA,     /* R_SOURCE.data: a payload when a string */
    V_MAX,      /* R_TOP.max_tokens (V_MAX + 0), max_completion_tokens, max_output_tokens */
};

#define ROLE_DEPTH 8 /* R_SOURCE sits at depth 6; deeper containers are all R_NONE */
#define OUTPUT_CAP INT64_C(1000000000000000) /* 10^15: larger values count as this */

static const char B64[] = ";base64,";
#define B64_LEN (sizeof B64 - 1)

static const char *const MAX_KEYS[3] = {"max_tokens", "max_completion_tokens",
                                        "max_output_tokens"};

/* Index of the closing quote of the string whose content starts at s[i], n if unclosed. */
static size_t string_end(const unsigned char *s, size_t n, size_t i)
{
    while (i < n) {
        const unsigned char *q = memchr(s + i, '"', n - i);
        if (q == NULL)
            return n;
        size_t at = (size_t)(q - s), k = at;
        while (k > i && s[k - 1] == '\\')
            k--;
        if ((at - k) % 2 == 0) /* an even run of backslashes escapes nothing */
            return at;
        i = at + 1;
    }
    return n;
}

static int hex4(const unsigned char *s, size_t n, size_t i, unsigned *v)
{
    if (n - i < 4)
        return 0;
    unsigned x = 0;
    for (size_t k = i; k < i + 4; k++) {
        unsigned c = s[k], d;
        if (c >= '0' && c <= '9')
            d = c - '0';
        else if ((c | 0x20) >= 'a' && (c | 0x20) <= 'f')
            d = (c | 0x20) - 'a' + 10;
        else
            return 0;
        x = x * 16 + d;
    }
    *v = x;
    return 1;
}

/* One decoded unit of the string content s[*i .. end): its UTF-8 byte count, and the byte
 * itself when it is ASCII (else -1). A lone surrogate counts 3 bytes (Python's
 * "surrogatepass"); a broken escape counts as its backslash alone. */
static int next_unit(const unsigned char *s, size_t end, size_t *i, int *ascii)
{
    unsigned char c = s[*i];
    if (c != '\\') {
        (*i)++;
        *ascii = c < 0x80 ? c : -1;
        return 1;
    }
    if (end - *i < 2) {
        (*i)++;
        *ascii = '\\';
        return 1;
    }
    unsigned char e = s[*i + 1];
    static const char SIMPLE[] = "\"\\/bfnrt", VALUE[] = "\"\\/\b\f\n\r\t";
    const char *at = e ? strchr(SIMPLE, e) : NULL;
    if (at != NULL) {
        *i += 2;
        *ascii = (unsigned char)VALUE[at - SIMPLE];
        return 1;
    }
    unsigned u, lo;
    if (e != 'u' || !hex4(s, end, *i + 2, &u)) {
        (*i)++;
        *ascii = '\\';
        return 1;
    }
    *i += 6;
    *ascii = u < 0x80 ? (int)u : -1;
    if (u < 0x80)
        return 1;
    if (u < 0x800)
        return 2;
    if (u >= 0xD800 && u <= 0xDBFF && end - *i >= 6 && s[*i] == '\\' && s[*i + 1] == 'u' &&
        hex4(s, end, *i + 2, &lo) && lo >= 0xDC00 && lo <= 0xDFFF) {
        *i += 6; /* a pair: one code point above U+FFFF */
        return 4;
    }
    return 3;
}

/* The decoded string content s[a .. b) equals the ASCII literal lit. */
static int key_is(const unsigned char *s, size_t a, size_t b, const char *lit)
{
    size_t i = a, k = 0, len = strlen(lit);
    /* An escape only lengthens a spelling: as long as lit, it is lit or not; shorter, or
     * longer without a backslash, it is not. */
    if (b - a == len)
        return memcmp(s + a, lit, len) == 0;
    if (b - a < len || memchr(s + a, '\\', b - a) == NULL)
        return 0;
    while (i < b) {
        int ascii;
        next_unit(s, b, &i, &ascii);
        if (k == len || ascii != (unsigned char)lit[k])
            return 0;
        k++;
    }
    return k == len;
}

/* Payload bytes of the string content s[a .. b): with `whole`, its decoded length; else the
 * decoded bytes after its first ";base64," (-1 when it has none: then it is text). */
static int64_t payload(const unsigned char *s, size_t a, size_t b, int whole)
{
    if (memchr(s + a, '\\', b - a) == NULL) { /* the usual case: no escapes, bytes as they are */
        if (whole)
            return (int64_t)(b - a);
        const unsigned char *hit = memmem(s + a, b - a, B64, B64_LEN);
        return hit == NULL ? -1 : (int64_t)(b - (size_t)(hit - s) - B64_LEN);
    }
    size_t i = a, matched = whole ? B64_LEN : 0;
    int64_t after = 0;
    while (i < b) {
        int ascii;
        int bytes = next_unit(s, b, &i, &ascii);
        if (matched == B64_LEN)
            after += bytes;
        else if (ascii == (unsigned char)B64[matched])
            matched++;
        else
            matched = ascii == ';'; /* ';' occurs only first in the pattern */
    }
    return matched == B64_LEN ? after : -1;
}

/* The value role of key s[a .. b) in a container of role `role`. */
static int key_role(const unsigned char *s, size_t a, size_t b, int role)
{
    switch (role) {
    case R_TOP:
        if (key_is(s, a, b, "messages") || key_is(s, a, b, "input"))
            return V_LIST;
        for (int k = 0; k < 3; k++)
            if (key_is(s, a, b, MAX_KEYS[k]))
                return V_MAX + k;
        return V_NONE;
    case R_ITEM:
        return key_is(s, a, b, "content") ? V_CONTENT : V_NONE;
    case R_PART:
        if (key_is(s, a, b, "image_url"))
            return V_IMAGE;
        return key_is(s, a, b, "source") ? V_SOURCE : V_NONE;
    case R_IMAGE:
        return key_is(s, a, b, "url") ? V_URL : V_NONE;
    case R_SOURCE:
        return key_is(s, a, b, "data") ? V_DATA : V_NONE;
    default:
        return V_NONE;
    }
}

/* The role of a container opened by `open` ('{' or '[') where a value of role v was due. */
static int container_role(int v, unsigned char open, size_t depth)
{
    if (open == '{') {
        if (depth == 0)
            return R_TOP;
        return v == V_ITEM ? R_ITEM : v == V_PART ? R_PART : v == V_IMAGE ? R_IMAGE
               : v == V_SOURCE ? R_SOURCE : R_NONE;
    }
    return v == V_LIST ? R_LIST : v == V_CONTENT ? R_PARTS : R_NONE;
}

/* A number value at s[*i]: a non-negative JSON integer (capped at OUTPUT_CAP; "-0" is 0),
 * else -1; *i moves past the whole token. */
static int64_t integer(const unsigned char *s, size_t n, size_t *i)
{
    size_t j = *i;
    int negative = j < n && s[j] == '-';
    if (negative)
        j++;
    int64_t v = 0;
    size_t digits = j;
    while (j < n && s[j] >= '0' && s[j] <= '9') {
        v = v * 10 + (s[j] - '0');
        if (v > OUTPUT_CAP)
            v = OUTPUT_CAP;
        j++;
    }
    int ok = j > digits && !(negative && v != 0);
    while (j < n && (s[j] == '.' || s[j] == 'e' || s[j] == 'E' || s[j] == '+' || s[j] == '-' ||
                     (s[j] >= '0' && s[j] <= '9'))) {
        ok = 0; /* a fraction or an exponent: not an integer */
        j++;
    }
    *i = j > *i ? j : *i + 1;
    return ok ? v : -1;
}

/* The value role due for the elements of an array of role r. */
static int element_role(int r)
{
    return r == R_LIST ? V_ITEM : r == R_PARTS ? V_PART : V_NONE;
}

void vx_books_estimate(const unsigned char *s, size_t n, int64_t *input, int64_t *output)
{
    unsigned char role[ROLE_DEPTH], is_object[ROLE_DEPTH];
    size_t depth = 0, inline_bytes = 0, payloads = 0, i = 0;
    int due = V_NONE;  /* what the next value is (set by a key, an array, a comma) */
    int want_key = 0;  /* in an object, before a key */
    int64_t last[3] = {-2, -2, -2}; /* each max key's last value: -2 absent, -1 not an integer */
    while (i < n) {
        unsigned char c = s[i];
        int tracked = depth > 0 && depth <= ROLE_DEPTH;
        int here = tracked ? role[depth - 1] : R_NONE;
        int in_object = tracked && is_object[depth - 1];
        if (due >= V_MAX && (c == '{' || c == '[' || c == '"' || c == 't' || c == 'f' ||
                             c == 'n'))
            last[due - V_MAX] = -1; /* a max key whose value is no integer */
        switch (c) {
        case '{':
        case '[': {
            int r = container_role(due, c, depth);
            if (depth < ROLE_DEPTH) {
                role[depth] = (unsigned char)r;
                is_object[depth] = c == '{';
            }
            depth++;
            want_key = c == '{';
            due = c == '[' ? element_role(r) : V_NONE;
            i++;
            break;
        }
        case '}':
        case ']':
            if (depth > 0)
                depth--;
            due = V_NONE;
            want_key = 0;
            i++;
            break;
        case ',':
            want_key = in_object;
            due = in_object ? V_NONE : element_role(here);
            i++;
            break;
        case '"': {
            size_t end = string_end(s, n, i + 1); /* the closing quote, n if none */
            if (want_key) {
                due = key_role(s, i + 1, end, here);
                want_key = 0;
            } else {
                if (end < n && (due == V_IMAGE || due == V_URL || due == V_DATA)) {
                    int64_t bytes = payload(s, i + 1, end, due == V_DATA);
                    if (bytes >= 0) {
                        inline_bytes += (size_t)bytes;
                        payloads++;
                    }
                }
                due = V_NONE;
            }
            i = end < n ? end + 1 : n;
            break;
        }
        case '-':
        case '0': case '1': case '2': case '3': case '4':
        case '5': case '6': case '7': case '8': case '9': {
            int64_t v = integer(s, n, &i);
            if (due >= V_MAX)
                last[due - V_MAX] = v;
            due = V_NONE;
            break;
        }
        case 't':
        case 'f':
        case 'n':
            due = V_NONE;
            while (i < n && s[i] >= 'a' && s[i] <= 'z')
                i++;
            break;
        default: /* whitespace, ':', and anything that is no JSON at all */
            i++;
        }
    }
    size_t text = n - (inline_bytes <= n ? inline_bytes : n);
    *input = (int64_t)((text + VX_BOOKS_BYTES_PER_TOKEN - 1) / VX_BOOKS_BYTES_PER_TOKEN) +
             (int64_t)payloads * VX_BOOKS_IMAGE_TOKENS;
    *output = -1;
    for (int k = 0; k < 3; k++)
        if (last[k] > *output)
            *output = last[k];
}
