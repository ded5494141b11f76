/* vx_hpack.h: HPACK (RFC 7541) for the native HTTP/2 client codec.
 *
 * Decoder: static and dynamic table, Huffman strings, dynamic table size updates (accepted only
 * at the start of a block and only up to the size we allow), a bound on the decoded header list
 * (RFC 9113 section 6.5.2 accounting: name + value + 32 per field), integers of at most five
 * continuation octets (as python-hyper hpack, the reference it is fuzzed against). Every
 * malformed input is a return code, never a read out of bounds.
 *
 * Encoder: stateless, like the Python framer's (velox/egress/hpack_static.py): indexed static
 * entries when name and value match exactly, otherwise literals without indexing (never-indexed
 * for credentials) with a static name index where one exists, no Huffman coding. Stateless means
 * the peer's table never holds anything of ours and the bytes on the wire are exactly the
 * framer's, which the tests compare.
 *
 * No Python.h: plain C11.
 */
#ifndef VX_HPACK_H
#define VX_HPACK_H

#include "vx_buf.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum {
    VX_HPACK_OK = 0,
    VX_HPACK_ERROR = -1,     /* malformed block: COMPRESSION_ERROR */
    VX_HPACK_TOO_LARGE = -2, /* decoded header list over the limit: ENHANCE_YOUR_CALM */
    VX_HPACK_NOMEM = -3,     /* allocation failed: INTERNAL_ERROR */
};

/* One decoded field: offsets into the arena the caller passed to vx_hpack_decode. */
typedef struct {
    uint32_t name_off;
    uint32_t name_len;
    uint32_t value_off;
    uint32_t value_len;
} vx_hfield;

typedef struct {
    vx_hfield *p;
    size_t len;
    size_t cap;
} vx_hfields;

typedef struct vx_hentry vx_hentry;

typedef struct {
    vx_hentry **ring; /* dynamic table, oldest at `tail`, `count` entries */
    uint32_t ring_cap;
    uint32_t tail;
    uint32_t count;
    size_t size;      /* RFC 7541 section 4.1 size of the entries held */
    size_t max_size;  /* the current limit, as last set by a size update */
    size_t allowed;   /* our SETTINGS_HEADER_TABLE_SIZE: the most a size update may ask for */
    size_t max_list;  /* decoded header list limit */
} vx_hpack_decoder;

/* Returns false if the table cannot be allocated. */
bool vx_hpack_decoder_init(vx_hpack_decoder *d, size_t allowed, size_t max_list);
void vx_hpack_decoder_free(vx_hpack_decoder *d);

/* Decode one complete header block. Names and values are appended to `arena` and described by
 * entries appended to `out` (neither is cleared first). On any error the dynamic table may have
 * changed, which does not matter: every error is a connection error. */
int vx_hpack_decode(vx_hpack_decoder *d, const uint8_t *in, size_t n, vx_buf *arena,
                    vx_hfields *out);

/* Huffman-decode `n` bytes onto `out`. Returns VX_HPACK_OK or VX_HPACK_ERROR (EOS in the
 * string, padding longer than 7 bits or not all ones) or VX_HPACK_NOMEM. */
int vx_huffman_decode(const uint8_t *in, size_t n, vx_buf *out);

/* Huffman-encode (used by the tests to build blocks; the codec never Huffman-codes). */
bool vx_huffman_encode(const uint8_t *in, size_t n, vx_buf *out);

/* RFC 7541 section 5.1 integer with an N-bit prefix; `pattern` holds the high bits. */
bool vx_hpack_int(vx_buf *out, uint64_t value, unsigned prefix_bits, uint8_t pattern);

/* Append one field as the stateless encoder does. */
bool vx_hpack_encode_field(vx_buf *out, const uint8_t *name, size_t nlen, const uint8_t *value,
                           size_t vlen, bool never_indexed);

/* True for the header names whose values are credentials (encoded never-indexed). */
bool vx_hpack_sensitive(const uint8_t *name, size_t nlen);

#endif
