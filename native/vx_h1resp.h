/* vx_h1resp: an HTTP/1.1 upstream's response, read natively: the head in one call, then the
 * body's framing (Content-Length or chunked) decoded incrementally, read by read.
 *
 * Why: with httptools, egress pays uvloop's get_buffer/buffer_updated in Python plus one
 * Python callback per header field, per body piece and per message end; for a streamed answer
 * that is several Python frames per upstream read, i.e. per token event. With this core the
 * connection's reads are handled in C and Python is called once per read at most.
 *
 * Like vx_reqhead it is a strict SUBSET parser: a head it does not validate completely, or
 * whose meaning is not one of the plain cases, says FALLBACK and the connection hands every
 * byte from that head on to httptools (llhttp), which keeps every odd case and its exact error.
 * Accepted (RFC 9112):
 *
 *   status-line = "HTTP/1.1" SP 3DIGIT [ SP reason ] CRLF, status 200-999 (a 1xx interim
 *                 answer falls back), reason of HTAB / SP / VCHAR / obs-text
 *   field-line  = token ":" OWS value CRLF, value of HTAB / SP / VCHAR / obs-text; leading
 *                 OWS dropped, trailing OWS kept (as llhttp reports it)
 *   end         = CRLF
 *   framing     = exactly one Content-Length of 1 to 18 digits, or exactly one
 *                 Transfer-Encoding "chunked" (any case), not both; none is accepted only
 *                 where there is no body (204, 304, the answer to HEAD)
 *   Connection  = at most one field, "close" or "keep-alive" (any case)
 *
 * and FALLBACK on HTTP/1.0 and other versions, obs-fold, bare CR or LF, Upgrade,
 * Proxy-Connection, a close-delimited body, more than `max_fields` fields and a head longer
 * than `max_head` bytes.
 *
 * Chunked bodies: chunk-size of 1 to 15 hex digits, chunk extensions checked and skipped
 * (";" name ["=" token or quoted-string], no whitespace, as llhttp reads them), data, CRLF;
 * after the last chunk trailer fields are skipped up to the blank line. Anything else inside a body is an ERROR (the connection cannot be resynced:
 * the caller fails the request and drops the connection).
 *
 * No allocation, no global state: safe from any thread. Offsets are from the buffer given.
 */
#ifndef VX_H1RESP_H
#define VX_H1RESP_H

#include <stddef.h>
#include <stdint.h>

#define VX_HR_DONE 0     /* a complete head was parsed */
#define VX_HR_MORE 1     /* a valid beginning: wait for more bytes */
#define VX_HR_FALLBACK 2 /* not in the subset: let httptools parse it */
#define VX_HR_ERROR 3    /* a body's framing is broken */

/* Bytes looked at, at most (offsets are uint32_t). */
#define VX_HR_MAX_LEN ((size_t)1 << 30)

typedef struct {
    uint32_t name_off, name_len, value_off, value_len;
} vx_hr_field;

/* Body framing of a parsed head. */
#define VX_HR_BODY_NONE 0    /* no body: the message ends with its head */
#define VX_HR_BODY_LENGTH 1  /* content_length bytes */
#define VX_HR_BODY_CHUNKED 2 /* chunked coding */

typedef struct {
    size_t head_len; /* bytes of the head, blank line included */
    int status;
    size_t nfields;
    int framing;            /* VX_HR_BODY_* */
    int64_t content_length; /* with VX_HR_BODY_LENGTH */
    int keep_alive;         /* no Connection: close */
} vx_h1resp;

/* Parse the head at buf[0 .. len); fields go to fields[0 .. max_fields). no_body: the request
 * was HEAD (the answer has no body whatever its framing fields say). Returns VX_HR_DONE, MORE
 * or FALLBACK. */
int vx_h1resp_parse(const char *buf, size_t len, vx_hr_field *fields, size_t max_fields,
                    size_t max_head, int no_body, vx_h1resp *out);

/* The incremental body decoder. */
typedef struct {
    int state;     /* internal */
    uint64_t left; /* bytes of body (length) or of the current chunk still due */
    int digits;    /* hex digits of the chunk size read so far */
} vx_hr_body;

/* Start decoding the body of a head parsed into *head. Returns 1 when the message is already
 * complete (no body, or Content-Length: 0), else 0. */
int vx_hr_body_start(vx_hr_body *b, const vx_h1resp *head);

/* One piece of body data: offset and length into the input. */
typedef struct {
    size_t off, len;
} vx_hr_span;

/* Decode in[0 .. len): body data as spans into spans[0 .. max_spans) (*nspans set), the bytes
 * consumed in *used (everything, unless the message ended or max_spans were filled first).
 * Returns 1 when the message ended (at in + *used), 0 when more is due, VX_HR_ERROR (3) on a
 * broken framing. */
int vx_hr_body_feed(vx_hr_body *b, const char *in, size_t len, vx_hr_span *spans,
                    size_t max_spans, size_t *nspans, size_t *used);

#endif
