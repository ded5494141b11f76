/* vx_reqhead: one complete HTTP/1.1 request head, parsed and validated in one call.
 *
 * Why: with httptools, ingress pays a Python callback per header field (15 for the `openai`
 * SDK's request) plus one each for the URL, the start, the end of the head and the body; the
 * largest single Python cost of a proxied request. This parser reads the whole head
 * at once and the binding hands ingress everything it needs in one tuple.
 *
 * It is a strict SUBSET parser, not a second HTTP implementation: it accepts only heads it
 * validates completely and whose meaning is unambiguous, and says FALLBACK for anything else;
 * ingress then hands every buffered byte to httptools (llhttp) for the rest of the connection,
 * which keeps every odd case and its exact error. Accepted (RFC 9112):
 *
 *   request-line  = method SP target SP ("HTTP/1.1" / "HTTP/1.0") CRLF
 *                   method one of GET HEAD POST PUT DELETE OPTIONS PATCH (no CONNECT, no
 *                   TRACE), exactly one SP each side, target "/" then visible ASCII
 *                   (0x21-0x7E; llhttp accepts every one of them in a path or query)
 *   field-line    = token ":" OWS value CRLF, token of tchars, value of HTAB / SP / VCHAR /
 *                   obs-text; leading OWS dropped, trailing OWS KEPT (as llhttp reports it)
 *   end           = CRLF
 *
 *   Host          exactly one field of Host bytes (uri-host [":" port], trailing OWS set
 *                 aside) with HTTP/1.1; at most one with HTTP/1.0 (RFC 9112 §3.2)
 *
 * and FALLBACK on: a leading empty line, any other method or version (HTTP/0.9's version-less
 * line, HTTP/2.0), any other target form (absolute-form included), obs-fold, bare CR or LF,
 * Transfer-Encoding, Upgrade, Proxy-Connection (llhttp reads it as Connection), Connection
 * other than one field with exactly "close" or "keep-alive" (any case), Content-Length other
 * than 1 to 18 digits or given twice, Authorization given twice, a missing, repeated or
 * invalid Host, more than `max_fields` fields, a head whose ingress byte count (target + per
 * field name + value + 4, what velox/ingress.py's callbacks count) exceeds `max_header_bytes`,
 * and an incomplete head already `max_partial` bytes long. Ingress's httptools path then
 * answers what needs an answer (400 for Host and for two Authorization fields, 431 for the
 * limits, 505 for the versions, absolute-form served by its path), so the rules live in one
 * place for the odd cases.
 *
 * keep_alive follows llhttp's should_keep_alive for what is accepted: HTTP/1.1 unless
 * "Connection: close", HTTP/1.0 only with "Connection: keep-alive".
 *
 * No allocation, no global state: safe from any thread. Offsets are from `buf`.
 */
#ifndef VX_REQHEAD_H
#define VX_REQHEAD_H

#include <stddef.h>
#include <stdint.h>

#define VX_RH_DONE 0     /* a complete head was parsed into *out */
#define VX_RH_MORE 1     /* what is there is a valid beginning: wait for more bytes */
#define VX_RH_FALLBACK 2 /* not in the subset (or too large): let httptools parse it */

/* vx_reqhead.traceparent when the field is repeated: the W3C Trace Context test suite
 * expects a receiver to ignore both and start a new trace. */
#define VX_RH_MANY (-2)

/* Bytes looked at, at most (offsets are uint32_t). */
#define VX_RH_MAX_LEN ((size_t)1 << 30)

/* Methods, in the order of the binding's cached bytes objects. */
enum {
    VX_RH_GET,
    VX_RH_HEAD,
    VX_RH_POST,
    VX_RH_PUT,
    VX_RH_DELETE,
    VX_RH_OPTIONS,
    VX_RH_PATCH,
    VX_RH_METHODS
};

typedef struct {
    uint32_t name_off, name_len, value_off, value_len;
} vx_rh_field;

typedef struct {
    size_t head_len;       /* bytes of the head, blank line included: the body starts here */
    int method;            /* VX_RH_GET ... */
    uint32_t target_off, target_len;
    int http10;            /* 1 for HTTP/1.0 */
    size_t nfields;
    int64_t content_length; /* -1 when absent */
    int authorization;     /* index of the one Authorization field, -1 if none */
    int expect_continue;   /* some Expect field is exactly "100-continue" (any case) */
    int traceparent;       /* index of the one traceparent field (W3C Trace Context), -1 if
                            * none, VX_RH_MANY if more than one: a tracing gateway reads it
                            * from here instead of looking through the fields in Python */
    int keep_alive;
    size_t header_bytes;   /* ingress's count (see above) */
} vx_reqhead;

/* Parse the head at buf[0 .. len). Fields go to fields[0 .. max_fields). Returns VX_RH_*. */
int vx_reqhead_parse(const char *buf, size_t len, vx_rh_field *fields, size_t max_fields,
                     size_t max_header_bytes, size_t max_partial, vx_reqhead *out);

/* The method's name ("GET", ...) and its length. */
const char *vx_reqhead_method_name(int method, size_t *len);

/* Copy n bytes from src to dst with ASCII upper case letters lowered (header names). */
void vx_reqhead_lower(char *dst, const char *src, size_t n);

/* A Connection value naming no other field: "keep-alive" or "close", any case (1), else 0. */
int vx_reqhead_plain_connection(const char *v, size_t n);

#endif
