/* vx_http1: the bytes of an HTTP/1.1 response as ingress writes them to a client: the head
 * (status line, header fields, content-length or chunked, connection: close), the body, and
 * the chunked framing of a streamed body.
 *
 * Why: building the head in Python costs a list of parts, one formatting call per header and a
 * join per response (about a quarter of a worker's Python time went into the client write);
 * here it is one size pass and one copy into a buffer the caller allocated, e.g. the bytes
 * object the binding hands to the transport. Nothing is validated: the caller (ingress) passes
 * fields it already trusts, and the output is byte for byte what velox/ingress.py's Python
 * writer produces (the tests compare the two).
 *
 * The status line is passed in whole ("HTTP/1.1 200 OK\r\n"): its reason phrases come from the
 * Python runtime's http.HTTPStatus, which differ between Python versions, so they stay there.
 *
 * Layout of a head, in this order (the Python writer's order):
 *   status line
 *   "content-length: N\r\n"               if VX_H1_LENGTH
 *   "name: value\r\n" for every field      in the order given
 *   "transfer-encoding: chunked\r\n"       if VX_H1_CHUNKED
 *   "connection: close\r\n"                if VX_H1_CLOSE
 *   "\r\n"
 * then the body (vx_h1_write_body) unless the request was HEAD.
 *
 * No allocation, no global state: safe from any thread.
 */
#ifndef VX_HTTP1_H
#define VX_HTTP1_H

#include <stddef.h>
#include <stdint.h>

#define VX_H1_LENGTH 1u  /* write content-length: the given length */
#define VX_H1_CHUNKED 2u /* write transfer-encoding: chunked */
#define VX_H1_CLOSE 4u   /* write connection: close */

/* The last chunk of a chunked body, and its length. */
#define VX_H1_LAST_CHUNK "0\r\n\r\n"
#define VX_H1_LAST_CHUNK_LEN 5u

/* Sizes that cannot overflow size_t when summed (a few of them): the binding refuses larger
 * inputs, which no Python object can reach anyway (PY_SSIZE_T_MAX is half of SIZE_MAX). */
#define VX_H1_MAX_LEN ((size_t)1 << 60)

typedef struct {
    const char *name;
    size_t name_len;
    const char *value;
    size_t value_len;
} vx_h1_field;

/* Bytes of the head described above. Every length must be below VX_H1_MAX_LEN and nfields
 * below VX_H1_MAX_LEN / 4, which keeps the sum below SIZE_MAX. */
size_t vx_h1_head_size(size_t status_len, const vx_h1_field *fields, size_t nfields,
                       uint64_t content_length, unsigned flags);

/* Write the head into out (at least vx_h1_head_size bytes); returns the end of what was
 * written. */
char *vx_h1_write_head(char *out, const char *status, size_t status_len,
                       const vx_h1_field *fields, size_t nfields, uint64_t content_length,
                       unsigned flags);

/* Decimal digits of n (1 for 0). */
size_t vx_h1_dec_len(uint64_t n);

/* Bytes of one chunk carrying n > 0 bytes: hex size, CRLF, data, CRLF. 0 for n == 0 (an empty
 * chunk would end the body, so none is written). */
size_t vx_h1_chunk_size(size_t n);

/* Frame n bytes of data as one chunk into out (vx_h1_chunk_size(n) bytes); returns the end.
 * Writes nothing for n == 0. Lower-case hex without leading zeros, as Python's %x. */
char *vx_h1_write_chunk(char *out, const char *data, size_t n);

/* The server-timing value of a relayed answer: four durations in microseconds, shown as
 * milliseconds with three decimals, exactly as velox/relay.py's Python formatting:
 *   "ring;dur=R.RRR, parse;dur=P.PPP, ratelimit;dur=L.LLL, upstream;dur=U.UUU"
 * out must hold VX_H1_TIMING_MAX bytes; returns the length written. */
#define VX_H1_TIMING_MAX 160
size_t vx_h1_server_timing(char *out, uint64_t ring_us, uint64_t parse_us, uint64_t limit_us,
                           uint64_t upstream_us);

#endif
