/* vx_h2.h: a sans-IO HTTP/2 client connection codec (RFC 9113), the C core of the `native`
 * egress codec (velox/egress/nativecodec.py; the contract is velox/egress/codec.py's Codec).
 *
 * It is a port of the Python framer (velox/egress/framer.py) with the same settings, the same
 * flow-control policy, the same errors and the same bytes on the wire, so the two can be
 * compared frame for frame. One `vx_h2_receive` call parses every complete frame of one
 * upstream read and leaves a compact event list (`ev`, `fields`, `arena`) that the binding
 * turns into Python tuples in one pass: one crossing of the boundary per read.
 *
 * Hostile input is bounded: a frame over 16 KiB is refused from its header, a header block
 * over 128 KiB or of more than VX_H2_MAX_CONTINUATIONS frames and a decoded header list over
 * 64 KiB are ENHANCE_YOUR_CALM, every window is checked against 2^31 - 1, and held input never
 * exceeds one frame. Allocation failure is INTERNAL_ERROR, never a crash.
 *
 * Not thread-safe: one connection belongs to one event loop. No Python.h: plain C11.
 */
#ifndef VX_H2_H
#define VX_H2_H

#include "vx_buf.h"
#include "vx_hpack.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Event kinds: the values of velox.egress.codec's RESPONSE .. PING_ACK. */
enum {
    VX_EV_RESPONSE = 1,
    VX_EV_DATA = 2,
    VX_EV_TRAILERS = 3,
    VX_EV_RESET = 4,
    VX_EV_GOAWAY = 5,
    VX_EV_SETTINGS = 6,
    VX_EV_PING_ACK = 7,
};

/* HTTP/2 error codes (RFC 9113 section 7) the codec uses. */
enum {
    VX_H2_NO_ERROR = 0x0,
    VX_H2_PROTOCOL_ERROR = 0x1,
    VX_H2_INTERNAL_ERROR = 0x2,
    VX_H2_FLOW_CONTROL_ERROR = 0x3,
    VX_H2_STREAM_CLOSED = 0x5,
    VX_H2_FRAME_SIZE_ERROR = 0x6,
    VX_H2_REFUSED_STREAM = 0x7,
    VX_H2_CANCEL = 0x8,
    VX_H2_COMPRESSION_ERROR = 0x9,
    VX_H2_ENHANCE_YOUR_CALM = 0xB,
};

/* Settings and policy: the values of velox.egress.codec (the binding checks they agree). */
#define VX_H2_LOCAL_INITIAL_WINDOW_SIZE (8 * 1024 * 1024)
#define VX_H2_LOCAL_CONNECTION_WINDOW (64 * 1024 * 1024)
#define VX_H2_LOCAL_MAX_HEADER_LIST_SIZE (64 * 1024)
#define VX_H2_LOCAL_HEADER_TABLE_SIZE 4096
#define VX_H2_LOCAL_MAX_FRAME_SIZE 16384
#define VX_H2_DATA_PER_CALL (1024 * 1024)
#define VX_H2_DEFAULT_MAX_CONCURRENT_STREAMS 100
#define VX_H2_MAX_CONCURRENT_STREAMS_CAP 512
#define VX_H2_MAX_WINDOW 2147483647
#define VX_H2_MAX_STREAM_ID 2147483647
/* Compressed header blocks larger than this are refused (the framer's _MAX_HEADER_BLOCK). */
#define VX_H2_MAX_HEADER_BLOCK (2 * VX_H2_LOCAL_MAX_HEADER_LIST_SIZE)
/* A header block may span at most this many CONTINUATION frames. 128 KiB in 16 KiB frames is
 * 8; 64 leaves room for servers using small frames while stopping a flood of empty ones, which
 * would otherwise cost CPU for nothing (the "CONTINUATION flood" of 2024). */
#define VX_H2_MAX_CONTINUATIONS 64

/* One event of the last vx_h2_receive call. `data`/`len` point into the input (DATA payload,
 * GOAWAY debug data, PING_ACK opaque), valid until the next call; header fields are
 * `fields.p[first .. first + count)`, their bytes in `arena`. */
typedef struct {
    uint8_t kind;
    uint8_t end_stream;
    uint32_t sid;   /* stream id; last_stream_id for GOAWAY; the limit for SETTINGS */
    uint32_t value; /* status, error code, or DATA's flow-controlled length */
    const uint8_t *data;
    size_t len;
    uint32_t first;
    uint32_t count;
    uint32_t tag; /* DATA: the stream's tag (vx_h2_set_tag), 0 when none */
} vx_h2_event;

/* One request header field, as the caller passes it. */
typedef struct {
    const uint8_t *name;
    size_t name_len;
    const uint8_t *value;
    size_t value_len;
} vx_h2_header;

typedef struct vx_h2 vx_h2;

/* Results of the calls that can fail. */
enum {
    VX_H2_OK = 0,
    VX_H2_ERROR = -1,   /* connection error: vx_h2_error_code / vx_h2_error_message */
    VX_H2_REFUSED = -2, /* no new stream may be opened: vx_h2_refusal says why */
    VX_H2_NOMEM = -3,
};

vx_h2 *vx_h2_new(const uint8_t *authority, size_t authority_len, const uint8_t *scheme,
                 size_t scheme_len);
void vx_h2_free(vx_h2 *c);

/* Queue the client preface, our SETTINGS and the connection WINDOW_UPDATE. */
int vx_h2_initiate(vx_h2 *c);

/* Open a stream carrying one request; *sid receives its id. The body is copied as far as it
 * cannot be framed at once. */
int vx_h2_send_request(vx_h2 *c, const uint8_t *method, size_t method_len, const uint8_t *path,
                       size_t path_len, const vx_h2_header *headers, size_t n_headers,
                       const uint8_t *body, size_t body_len, uint32_t *sid);

/* Feed bytes read from the transport. VX_H2_OK or VX_H2_ERROR (GOAWAY queued); in both cases
 * the events decoded before any error are in vx_h2_events. */
int vx_h2_receive(vx_h2 *c, const uint8_t *data, size_t n);
const vx_h2_event *vx_h2_events(const vx_h2 *c, size_t *n);
const vx_hfield *vx_h2_fields(const vx_h2 *c);
const uint8_t *vx_h2_arena(const vx_h2 *c);

/* The queued output (after framing deferred body data, as data_to_send does); the caller copies
 * it and then calls vx_h2_output_done. */
const uint8_t *vx_h2_output(vx_h2 *c, size_t *n);
void vx_h2_output_done(vx_h2 *c);
bool vx_h2_data_pending(const vx_h2 *c);
/* Anything for vx_h2_output to return: queued frames, or deferred body data. */
bool vx_h2_has_output(const vx_h2 *c);

/* VX_H2_OK, or VX_H2_ERROR when `sid` was never opened on this connection. */
int vx_h2_acknowledge(vx_h2 *c, uint32_t sid, int64_t n);
void vx_h2_reset_stream(vx_h2 *c, uint32_t sid, uint32_t error_code);
/* Give an open stream a tag its DATA events carry (0: none): the binding's index of where the
 * stream's body goes. VX_H2_OK, or VX_H2_ERROR when the codec holds no state for `sid`. */
int vx_h2_set_tag(vx_h2 *c, uint32_t sid, uint32_t tag);
/* The tag of `sid`, or 0 (none, or no state held for it any more). */
uint32_t vx_h2_tag(const vx_h2 *c, uint32_t sid);
void vx_h2_send_ping(vx_h2 *c, const uint8_t opaque[8]);
void vx_h2_close(vx_h2 *c, uint32_t error_code);

uint32_t vx_h2_max_concurrent_streams(const vx_h2 *c);
uint64_t vx_h2_next_stream_id(const vx_h2 *c);
size_t vx_h2_stream_count(const vx_h2 *c);
bool vx_h2_failed(const vx_h2 *c);
uint32_t vx_h2_error_code(const vx_h2 *c);
const char *vx_h2_error_message(const vx_h2 *c);
const char *vx_h2_refusal(const vx_h2 *c);
/* Allocation failed at some point: the connection must be dropped (the binding raises
 * MemoryError). */
bool vx_h2_nomem(const vx_h2 *c);

#endif
