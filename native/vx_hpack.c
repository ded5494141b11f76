/* vx_hpack.c: HPACK decoder and stateless encoder (see vx_hpack.h for the contract). */
#include "vx_hpack.h"

#include "vx_hpack_tables.h"

#include <stdlib.h>
#include <string.h>

struct vx_hentry {
    uint32_t name_len;
    uint32_t value_len;
    uint8_t data[]; /* name then value */
};

/* RFC 7541 section 4.1: every entry costs its name and value plus 32 octets of overhead. */
#define ENTRY_OVERHEAD 32
/* python-hyper hpack's VARINT_MAX_LENGTH: at most five continuation octets, the fifth final.
 * That covers any 32-bit value (with room for redundant zero octets) and bounds the loop. */
#define MAX_CONTINUATION_OCTETS 5

/* ------------------------------------------------------------------------------ Huffman */

int vx_huffman_decode(const uint8_t *in, size_t n, vx_buf *out)
{
    /* The shortest code is 5 bits, so n octets decode to at most n * 8 / 5 symbols. */
    if (!vx_buf_reserve(out, n / 5 * 8 + 8))
        return VX_HPACK_NOMEM;
    uint8_t *o = out->p + out->len;
    uint64_t acc = 0; /* undecoded bits, most significant first */
    unsigned bits = 0;
    size_t i = 0;
    for (;;) {
        while (bits <= 56 && i < n) {
            acc |= (uint64_t)in[i++] << (56 - bits);
            bits += 8;
        }
        if (bits == 0)
            break;
        /* Look at the next 30 bits as if the input went on with ones: a string that ends in
         * valid padding (a prefix of EOS) then decodes to a code longer than what is left. */
        uint64_t padded = bits < 64 ? acc | (~UINT64_C(0) >> bits) : acc;
        unsigned len = 0, sym = 0;
        uint16_t fast = vx_huff_fast[padded >> 56];
        if (fast) {
            len = fast >> 9;
            sym = fast & 0x1FF;
        } else {
            uint32_t top = (uint32_t)(padded >> 34);
            for (unsigned l = 9; l <= 30; l++) {
                uint32_t code = top >> (30 - l);
                if (code - vx_huff_first[l] < vx_huff_count[l]) {
                    len = l;
                    sym = vx_huff_sorted[vx_huff_offset[l] + code - vx_huff_first[l]];
                    break;
                }
            }
            if (len == 0)
                return VX_HPACK_ERROR; /* unreachable: the code is complete */
        }
        if (len > bits) {
            /* What is left is padding: at most 7 bits, all ones (RFC 7541 section 5.2). */
            uint64_t mask = ~UINT64_C(0) << (64 - bits);
            if (bits > 7 || (acc & mask) != mask)
                return VX_HPACK_ERROR;
            break;
        }
        if (sym == 256)
            return VX_HPACK_ERROR; /* EOS inside a string */
        *o++ = (uint8_t)sym;
        acc <<= len;
        bits -= len;
    }
    out->len = (size_t)(o - out->p);
    return VX_HPACK_OK;
}

bool vx_huffman_encode(const uint8_t *in, size_t n, vx_buf *out)
{
    if (!vx_buf_reserve(out, n * 4 + 1))
        return false;
    uint64_t acc = 0;
    unsigned bits = 0;
    for (size_t i = 0; i < n; i++) {
        acc = acc << vx_huff_len[in[i]] | vx_huff_code[in[i]];
        bits += vx_huff_len[in[i]];
        while (bits >= 8) {
            bits -= 8;
            out->p[out->len++] = (uint8_t)(acc >> bits);
        }
    }
    if (bits)
        out->p[out->len++] = (uint8_t)(acc << (8 - bits) | (0xFFu >> bits));
    return true;
}

/* ------------------------------------------------------------------------------ decoder */

bool vx_hpack_decoder_init(vx_hpack_decoder *d, size_t allowed, size_t max_list)
{
    memset(d, 0, sizeof *d);
    d->ring_cap = (uint32_t)(allowed / ENTRY_OVERHEAD + 1);
    d->ring = calloc(d->ring_cap, sizeof *d->ring);
    d->max_size = d->allowed = allowed;
    d->max_list = max_list;
    return d->ring != NULL;
}

static void evict_oldest(vx_hpack_decoder *d)
{
    vx_hentry *e = d->ring[d->tail];
    d->size -= (size_t)e->name_len + e->value_len + ENTRY_OVERHEAD;
    free(e);
    d->ring[d->tail] = NULL;
    d->tail = (d->tail + 1) % d->ring_cap;
    d->count--;
}

void vx_hpack_decoder_free(vx_hpack_decoder *d)
{
    if (d->ring == NULL)
        return;
    while (d->count)
        evict_oldest(d);
    free(d->ring);
    d->ring = NULL;
}

static void shrink_to(vx_hpack_decoder *d, size_t limit)
{
    while (d->count && d->size > limit)
        evict_oldest(d);
}

/* RFC 7541 section 4.4: make room by evicting the oldest entries; an entry larger than the
 * whole table empties it and is not added. */
static int insert(vx_hpack_decoder *d, const uint8_t *name, size_t nlen, const uint8_t *value,
                  size_t vlen)
{
    size_t esize = nlen + vlen + ENTRY_OVERHEAD;
    if (esize > d->max_size) {
        shrink_to(d, 0);
        return VX_HPACK_OK;
    }
    shrink_to(d, d->max_size - esize);
    vx_hentry *e = malloc(sizeof *e + nlen + vlen);
    if (e == NULL)
        return VX_HPACK_NOMEM;
    e->name_len = (uint32_t)nlen;
    e->value_len = (uint32_t)vlen;
    memcpy(e->data, name, nlen);
    memcpy(e->data + nlen, value, vlen);
    d->ring[(d->tail + d->count) % d->ring_cap] = e; /* count < ring_cap: max_size/32 bound */
    d->count++;
    d->size += esize;
    return VX_HPACK_OK;
}

static int get_int(const uint8_t *in, size_t n, size_t *pos, unsigned prefix_bits, uint64_t *out)
{
    size_t p = *pos;
    if (p >= n)
        return VX_HPACK_ERROR;
    uint64_t limit = (UINT64_C(1) << prefix_bits) - 1;
    uint64_t v = in[p++] & limit;
    if (v == limit) {
        unsigned shift = 0;
        for (int octets = 1;; octets++) {
            if (p >= n)
                return VX_HPACK_ERROR;
            uint8_t b = in[p++];
            v += (uint64_t)(b & 0x7F) << shift;
            if (!(b & 0x80))
                break;
            if (octets >= MAX_CONTINUATION_OCTETS)
                return VX_HPACK_ERROR;
            shift += 7;
        }
    }
    *pos = p;
    *out = v;
    return VX_HPACK_OK;
}

/* Decode a string literal onto the arena; its offset and length go to *off / *len. */
static int get_string(const uint8_t *in, size_t n, size_t *pos, vx_buf *arena, uint32_t *off,
                      uint32_t *len)
{
    if (*pos >= n)
        return VX_HPACK_ERROR;
    bool huffman = in[*pos] & 0x80;
    uint64_t slen;
    if (get_int(in, n, pos, 7, &slen) != VX_HPACK_OK || slen > n - *pos)
        return VX_HPACK_ERROR;
    size_t start = arena->len;
    if (huffman) {
        int rc = vx_huffman_decode(in + *pos, (size_t)slen, arena);
        if (rc != VX_HPACK_OK)
            return rc;
    } else if (!vx_buf_append(arena, in + *pos, (size_t)slen)) {
        return VX_HPACK_NOMEM;
    }
    *pos += (size_t)slen;
    *off = (uint32_t)start;
    *len = (uint32_t)(arena->len - start);
    return VX_HPACK_OK;
}

/* Copy the name (and, if `with_value`, the value) of table entry `index` onto the arena. */
static int copy_indexed(vx_hpack_decoder *d, uint64_t index, bool with_value, vx_buf *arena,
                        vx_hfield *f)
{
    const uint8_t *name, *value;
    size_t nlen, vlen;
    if (index == 0)
        return VX_HPACK_ERROR;
    if (index <= VX_HPACK_STATIC_COUNT) {
        const vx_hpack_static_entry *s = &vx_hpack_static[index - 1];
        name = (const uint8_t *)s->name;
        nlen = s->name_len;
        value = (const uint8_t *)s->value;
        vlen = s->value_len;
    } else {
        uint64_t j = index - VX_HPACK_STATIC_COUNT - 1; /* 0 = newest */
        if (j >= d->count)
            return VX_HPACK_ERROR;
        const vx_hentry *e = d->ring[(d->tail + d->count - 1 - (uint32_t)j) % d->ring_cap];
        name = e->data;
        nlen = e->name_len;
        value = e->data + nlen;
        vlen = e->value_len;
    }
    if (!vx_buf_reserve(arena, nlen + vlen))
        return VX_HPACK_NOMEM;
    f->name_off = (uint32_t)arena->len;
    f->name_len = (uint32_t)nlen;
    vx_buf_append(arena, name, nlen);
    if (with_value) {
        f->value_off = (uint32_t)arena->len;
        f->value_len = (uint32_t)vlen;
        vx_buf_append(arena, value, vlen);
    }
    return VX_HPACK_OK;
}

int vx_hpack_decode(vx_hpack_decoder *d, const uint8_t *in, size_t n, vx_buf *arena,
                    vx_hfields *out)
{
    size_t pos = 0;
    size_t inflated = 0;
    bool any = false;
    int rc;
    while (pos < n) {
        uint8_t b = in[pos];
        uint64_t index;
        vx_hfield f;
        if (b & 0x80) { /* indexed field */
            if ((rc = get_int(in, n, &pos, 7, &index)) != VX_HPACK_OK)
                return rc;
            if ((rc = copy_indexed(d, index, true, arena, &f)) != VX_HPACK_OK)
                return rc;
        } else if ((b & 0xE0) == 0x20) { /* dynamic table size update */
            if (any) /* only before the first field (RFC 7541 section 4.2) */
                return VX_HPACK_ERROR;
            if ((rc = get_int(in, n, &pos, 5, &index)) != VX_HPACK_OK)
                return rc;
            if (index > d->allowed)
                return VX_HPACK_ERROR;
            d->max_size = (size_t)index;
            shrink_to(d, d->max_size);
            continue;
        } else { /* literal: with incremental indexing (01), without (0000) or never (0001) */
            bool indexing = b & 0x40;
            if ((rc = get_int(in, n, &pos, indexing ? 6 : 4, &index)) != VX_HPACK_OK)
                return rc;
            if (index) {
                if ((rc = copy_indexed(d, index, false, arena, &f)) != VX_HPACK_OK)
                    return rc;
            } else if ((rc = get_string(in, n, &pos, arena, &f.name_off, &f.name_len)) !=
                       VX_HPACK_OK) {
                return rc;
            }
            if ((rc = get_string(in, n, &pos, arena, &f.value_off, &f.value_len)) != VX_HPACK_OK)
                return rc;
            if (indexing) {
                rc = insert(d, arena->p + f.name_off, f.name_len, arena->p + f.value_off,
                            f.value_len);
                if (rc != VX_HPACK_OK)
                    return rc;
            }
        }
        if (out->len == out->cap) {
            size_t cap = out->cap ? out->cap * 2 : 32;
            vx_hfield *p = realloc(out->p, cap * sizeof *p);
            if (p == NULL)
                return VX_HPACK_NOMEM;
            out->p = p;
            out->cap = cap;
        }
        out->p[out->len++] = f;
        any = true;
        inflated += (size_t)f.name_len + f.value_len + ENTRY_OVERHEAD;
        if (inflated > d->max_list)
            return VX_HPACK_TOO_LARGE;
    }
    return VX_HPACK_OK;
}

/* ------------------------------------------------------------------------------ encoder */

bool vx_hpack_int(vx_buf *out, uint64_t value, unsigned prefix_bits, uint8_t pattern)
{
    uint64_t limit = (UINT64_C(1) << prefix_bits) - 1;
    if (!vx_buf_reserve(out, 11))
        return false;
    if (value < limit) {
        out->p[out->len++] = (uint8_t)(pattern | value);
        return true;
    }
    out->p[out->len++] = (uint8_t)(pattern | limit);
    value -= limit;
    while (value >= 0x80) {
        out->p[out->len++] = (uint8_t)(value & 0x7F) | 0x80;
        value >>= 7;
    }
    out->p[out->len++] = (uint8_t)value;
    return true;
}

static unsigned static_name_index(const uint8_t *name, size_t nlen)
{
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < nlen; i++)
        h = (h ^ name[i]) * 16777619u;
    for (unsigned slot = h & (VX_HPACK_NAME_SLOTS - 1);; slot = (slot + 1) & (VX_HPACK_NAME_SLOTS - 1)) {
        unsigned index = vx_hpack_name_slot[slot];
        if (index == 0)
            return 0;
        const vx_hpack_static_entry *s = &vx_hpack_static[index - 1];
        if (s->name_len == nlen && memcmp(s->name, name, nlen) == 0)
            return index;
    }
}

static bool equals(const uint8_t *a, size_t alen, const char *b)
{
    return alen == strlen(b) && memcmp(a, b, alen) == 0;
}

bool vx_hpack_sensitive(const uint8_t *name, size_t nlen)
{
    /* codec.SENSITIVE_HEADERS */
    switch (nlen) {
    case 6:
        return equals(name, nlen, "cookie");
    case 7:
        return equals(name, nlen, "api-key");
    case 9:
        return equals(name, nlen, "x-api-key");
    case 13:
        return equals(name, nlen, "authorization");
    case 19:
        return equals(name, nlen, "proxy-authorization");
    default:
        return false;
    }
}

bool vx_hpack_encode_field(vx_buf *out, const uint8_t *name, size_t nlen, const uint8_t *value,
                           size_t vlen, bool never_indexed)
{
    unsigned index = static_name_index(name, nlen);
    if (index && !never_indexed) {
        /* Entries sharing a name are adjacent; look for an exact match among them. */
        for (unsigned i = index; i <= VX_HPACK_STATIC_COUNT; i++) {
            const vx_hpack_static_entry *s = &vx_hpack_static[i - 1];
            if (s->name_len != nlen || memcmp(s->name, name, nlen) != 0)
                break;
            if (s->value_len && s->value_len == vlen && memcmp(s->value, value, vlen) == 0)
                return vx_hpack_int(out, i, 7, 0x80);
        }
    }
    if (!vx_hpack_int(out, index, 4, never_indexed ? 0x10 : 0x00))
        return false;
    if (!index && !(vx_hpack_int(out, nlen, 7, 0) && vx_buf_append(out, name, nlen)))
        return false;
    return vx_hpack_int(out, vlen, 7, 0) && vx_buf_append(out, value, vlen);
}
