/* vx_h1resp: see vx_h1resp.h. */
#include "vx_h1resp.h"

#include <string.h>

/* tchar of RFC 9110 §5.6.2. */
static int hr_tchar(unsigned char c)
{
    if (c >= 'a' && c <= 'z')
        return 1;
    if (c >= 'A' && c <= 'Z')
        return 1;
    if (c >= '0' && c <= '9')
        return 1;
    return c != 0 && strchr("!#$%&'*+-.^_`|~", c) != NULL;
}

/* HTAB / SP / VCHAR / obs-text: a field value's or a reason phrase's bytes. */
static int hr_vbyte(unsigned char c)
{
    return c == '\t' || c >= 0x20 ? c != 0x7f : 0;
}

/* Case-insensitive equality of n bytes against a lower-case literal. */
static int hr_ieq(const char *s, size_t n, const char *lit)
{
    size_t m = strlen(lit);
    if (n != m)
        return 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 'A' && c <= 'Z')
            c = (unsigned char)(c + 32);
        if (c != (unsigned char)lit[i])
            return 0;
    }
    return 1;
}

/* A value without its trailing OWS (kept in the field, ignored when it is interpreted). */
static size_t hr_trim(const char *v, size_t n)
{
    while (n && (v[n - 1] == ' ' || v[n - 1] == '\t'))
        n--;
    return n;
}

/* The end of the line starting at p (the CR of its CRLF), or NULL: *rc says MORE (no CRLF
 * yet) or FALLBACK (a bare CR or LF, or a byte `ok` refuses). */
static const char *hr_line(const char *p, const char *end, int (*ok)(unsigned char), int *rc)
{
    for (const char *q = p; q < end; q++) {
        unsigned char c = (unsigned char)*q;
        if (c == '\r') {
            if (q + 1 == end) {
                *rc = VX_HR_MORE;
                return NULL;
            }
            if (q[1] != '\n') {
                *rc = VX_HR_FALLBACK;
                return NULL;
            }
            return q;
        }
        if (!ok(c)) {
            *rc = VX_HR_FALLBACK;
            return NULL;
        }
    }
    *rc = VX_HR_MORE;
    return NULL;
}

/* "HTTP/1.1 NNN[ reason]" up to its CR at eol. */
static int hr_status_line(const char *p, const char *eol, int *status)
{
    size_t n = (size_t)(eol - p);
    if (n < 12 || memcmp(p, "HTTP/1.1 ", 9) != 0)
        return VX_HR_FALLBACK;
    int s = 0;
    for (int i = 9; i < 12; i++) {
        if (p[i] < '0' || p[i] > '9')
            return VX_HR_FALLBACK;
        s = s * 10 + (p[i] - '0');
    }
    if (n > 12 && p[12] != ' ')
        return VX_HR_FALLBACK;
    if (s < 200) /* interim answers (and 0xx) go to httptools, which skips them */
        return VX_HR_FALLBACK;
    *status = s;
    return VX_HR_DONE;
}

/* What the special fields of a head said, while its fields are read. */
typedef struct {
    int lengths, chunked, connections;
    int64_t length;
    int close;
} hr_framing;

/* Interpret one field; FALLBACK for what the subset leaves to httptools. */
static int hr_special(const char *name, size_t nlen, const char *v, size_t vlen, hr_framing *f)
{
    vlen = hr_trim(v, vlen);
    if (hr_ieq(name, nlen, "content-length")) {
        if (f->lengths++ || vlen < 1 || vlen > 18)
            return VX_HR_FALLBACK;
        int64_t x = 0;
        for (size_t i = 0; i < vlen; i++) {
            if (v[i] < '0' || v[i] > '9')
                return VX_HR_FALLBACK;
            x = x * 10 + (v[i] - '0'); /* 18 digits: below INT64_MAX */
        }
        f->length = x;
    } else if (hr_ieq(name, nlen, "transfer-encoding")) {
        if (f->chunked++ || !hr_ieq(v, vlen, "chunked"))
            return VX_HR_FALLBACK;
    } else if (hr_ieq(name, nlen, "connection")) {
        if (f->connections++)
            return VX_HR_FALLBACK;
        if (hr_ieq(v, vlen, "close"))
            f->close = 1;
        else if (!hr_ieq(v, vlen, "keep-alive"))
            return VX_HR_FALLBACK;
    } else if (hr_ieq(name, nlen, "upgrade") || hr_ieq(name, nlen, "proxy-connection")) {
        return VX_HR_FALLBACK;
    }
    return VX_HR_DONE;
}

/* One field line p .. eol into *field (offsets from base). */
static int hr_field(const char *base, const char *p, const char *eol, vx_hr_field *field,
                    hr_framing *f)
{
    const char *q = p;
    while (q < eol && hr_tchar((unsigned char)*q))
        q++;
    if (q == p || q == eol || *q != ':')
        return VX_HR_FALLBACK; /* an empty name, obs-fold (leading SP), no colon */
    const char *v = q + 1;
    while (v < eol && (*v == ' ' || *v == '\t'))
        v++;
    field->name_off = (uint32_t)(p - base);
    field->name_len = (uint32_t)(q - p);
    field->value_off = (uint32_t)(v - base);
    field->value_len = (uint32_t)(eol - v);
    return hr_special(p, (size_t)(q - p), v, (size_t)(eol - v), f);
}

static int hr_value_byte(unsigned char c)
{
    return hr_vbyte(c);
}

int vx_h1resp_parse(const char *buf, size_t len, vx_hr_field *fields, size_t max_fields,
                    size_t max_head, int no_body, vx_h1resp *out)
{
    if (len > VX_HR_MAX_LEN)
        len = VX_HR_MAX_LEN;
    size_t limit = len < max_head ? len : max_head;
    const char *end = buf + limit;
    /* A start that cannot become our status line falls back at once (httptools then says
     * what is wrong now, not once a CRLF came). */
    if (memcmp(buf, "HTTP/1.1 ", limit < 9 ? limit : 9) != 0)
        return VX_HR_FALLBACK;
    int rc;
    const char *eol = hr_line(buf, end, hr_value_byte, &rc);
    if (eol == NULL)
        return rc == VX_HR_MORE && limit == max_head ? VX_HR_FALLBACK : rc;
    int status = 0;
    rc = hr_status_line(buf, eol, &status);
    if (rc != VX_HR_DONE)
        return rc;
    hr_framing f = {0, 0, 0, 0, 0};
    size_t n = 0;
    const char *p = eol + 2;
    for (;;) {
        if (p + 2 <= end && p[0] == '\r' && p[1] == '\n')
            break; /* the blank line */
        if (p < end && (*p == '\r' || *p == '\n') && !(p + 1 == end && *p == '\r'))
            return VX_HR_FALLBACK; /* a bare CR or LF where a field or the end should be */
        eol = hr_line(p, end, hr_value_byte, &rc);
        if (eol == NULL)
            return rc == VX_HR_MORE && limit == max_head ? VX_HR_FALLBACK : rc;
        if (n == max_fields)
            return VX_HR_FALLBACK;
        rc = hr_field(buf, p, eol, &fields[n], &f);
        if (rc != VX_HR_DONE)
            return rc;
        n++;
        p = eol + 2;
    }
    if (f.lengths && f.chunked)
        return VX_HR_FALLBACK;
    out->head_len = (size_t)(p + 2 - buf);
    out->status = status;
    out->nfields = n;
    out->keep_alive = !f.close;
    out->content_length = f.length;
    if (no_body || status == 204 || status == 304)
        out->framing = VX_HR_BODY_NONE;
    else if (f.chunked)
        out->framing = VX_HR_BODY_CHUNKED;
    else if (f.lengths)
        out->framing = f.length ? VX_HR_BODY_LENGTH : VX_HR_BODY_NONE;
    else
        return VX_HR_FALLBACK; /* close-delimited: httptools' path keeps its behaviour */
    return VX_HR_DONE;
}

/* ---------------------------------------------------------------- body */

enum {
    HB_LENGTH,     /* Content-Length bytes due */
    HB_SIZE,       /* reading the chunk-size's hex digits */
    HB_EXT_NAME,   /* a chunk extension's name (after ";") */
    HB_EXT_VAL0,   /* the start of its value (after "=") */
    HB_EXT_VAL,    /* a token value */
    HB_EXT_QUOTED, /* a quoted-string value */
    HB_EXT_ESCAPE, /* the byte after a backslash in it */
    HB_EXT_AFTER,  /* after the closing quote: ";" or CR */
    HB_SIZE_LF,    /* the LF after the size line's CR */
    HB_DATA,       /* chunk data due */
    HB_DATA_CR,    /* the CR after chunk data */
    HB_DATA_LF,    /* its LF */
    HB_TRAILER,    /* at the start of a trailer line (or of the final blank line) */
    HB_TRAILER_NAME, /* a trailer field's name, up to its ":" */
    HB_TRAILER_IN, /* inside a trailer field's value, up to CR */
    HB_TRAILER_LF, /* the LF of a trailer line */
    HB_END_LF,     /* the LF of the final blank line */
    HB_DONE
};

int vx_hr_body_start(vx_hr_body *b, const vx_h1resp *head)
{
    b->digits = 0;
    b->left = 0;
    if (head->framing == VX_HR_BODY_LENGTH) {
        b->state = HB_LENGTH;
        b->left = (uint64_t)head->content_length;
        return 0;
    }
    if (head->framing == VX_HR_BODY_CHUNKED) {
        b->state = HB_SIZE;
        return 0;
    }
    b->state = HB_DONE;
    return 1;
}

static int hr_hex(unsigned char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* Take up to b->left bytes of data at in[i .. len) as one span. */
static size_t hr_take(vx_hr_body *b, size_t i, size_t len, vx_hr_span *span)
{
    uint64_t avail = (uint64_t)(len - i);
    size_t n = (size_t)(b->left < avail ? b->left : avail);
    span->off = i;
    span->len = n;
    b->left -= n;
    return n;
}

int vx_hr_body_feed(vx_hr_body *b, const char *in, size_t len, vx_hr_span *spans,
                    size_t max_spans, size_t *nspans, size_t *used)
{
    size_t i = 0, ns = 0;
    while (i < len && b->state != HB_DONE) {
        unsigned char c = (unsigned char)in[i];
        switch (b->state) {
        case HB_LENGTH:
        case HB_DATA:
            if (ns == max_spans)
                goto out;
            i += hr_take(b, i, len, &spans[ns]);
            ns++;
            if (b->left == 0)
                b->state = b->state == HB_LENGTH ? HB_DONE : HB_DATA_CR;
            continue;
        case HB_SIZE: {
            int h = hr_hex(c);
            if (h >= 0) {
                if (b->digits == 15)
                    goto broken; /* 2^60 bytes: no chunk is that large */
                b->left = b->left << 4 | (uint64_t)h;
                b->digits++;
            } else if (b->digits == 0) {
                goto broken;
            } else if (c == ';') { /* llhttp refuses whitespace before it */
                b->state = HB_EXT_NAME;
                b->digits = -1; /* no name byte yet */
            } else if (c == '\r') {
                b->state = HB_SIZE_LF;
            } else {
                goto broken;
            }
            break;
        }
        case HB_EXT_NAME: /* chunk-ext = *( ";" name [ "=" value ] ), no whitespace */
            if (hr_tchar(c))
                b->digits = 1;
            else if (b->digits < 0 || (c != '=' && c != ';' && c != '\r'))
                goto broken;
            else if (c == '=')
                b->state = HB_EXT_VAL0;
            else if (c == ';')
                b->digits = -1;
            else
                b->state = HB_SIZE_LF;
            break;
        case HB_EXT_VAL0:
            if (c == '"')
                b->state = HB_EXT_QUOTED;
            else if (hr_tchar(c))
                b->state = HB_EXT_VAL;
            else
                goto broken;
            break;
        case HB_EXT_VAL:
        case HB_EXT_AFTER:
            if (c == ';') {
                b->state = HB_EXT_NAME;
                b->digits = -1;
            } else if (c == '\r') {
                b->state = HB_SIZE_LF;
            } else if (b->state == HB_EXT_AFTER || !hr_tchar(c)) {
                goto broken;
            }
            break;
        case HB_EXT_QUOTED:
            if (c == '"')
                b->state = HB_EXT_AFTER;
            else if (c == '\\')
                b->state = HB_EXT_ESCAPE;
            else if (!hr_vbyte(c))
                goto broken;
            break;
        case HB_EXT_ESCAPE:
            if (!hr_vbyte(c))
                goto broken;
            b->state = HB_EXT_QUOTED;
            break;
        case HB_SIZE_LF:
            if (c != '\n')
                goto broken;
            b->digits = 0;
            b->state = b->left ? HB_DATA : HB_TRAILER;
            break;
        case HB_DATA_CR:
            if (c != '\r')
                goto broken;
            b->state = HB_DATA_LF;
            break;
        case HB_DATA_LF:
            if (c != '\n')
                goto broken;
            b->state = HB_SIZE;
            break;
        case HB_TRAILER:
            if (c == '\r')
                b->state = HB_END_LF;
            else if (hr_tchar(c))
                b->state = HB_TRAILER_NAME;
            else
                goto broken;
            break;
        case HB_TRAILER_NAME:
            if (c == ':')
                b->state = HB_TRAILER_IN;
            else if (!hr_tchar(c))
                goto broken;
            break;
        case HB_TRAILER_IN:
            if (c == '\r')
                b->state = HB_TRAILER_LF;
            else if (!hr_vbyte(c))
                goto broken;
            break;
        case HB_TRAILER_LF:
            if (c != '\n')
                goto broken;
            b->state = HB_TRAILER;
            break;
        case HB_END_LF:
            if (c != '\n')
                goto broken;
            b->state = HB_DONE;
            break;
        default:
            goto broken;
        }
        i++;
    }
out:
    *nspans = ns;
    *used = i;
    return b->state == HB_DONE;
broken:
    *nspans = ns;
    *used = i;
    return VX_HR_ERROR;
}
