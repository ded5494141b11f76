/* vx_buf.h: the growable byte buffer shared by the HTTP/2 codec and its HPACK coder.
 *
 * Appends report failure (false) instead of aborting, so an allocation failure becomes a
 * connection error rather than a crash. All inline: the codec appends a few bytes at a time on
 * its hot path. */
#ifndef VX_BUF_H
#define VX_BUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    uint8_t *p;
    size_t len;
    size_t cap;
} vx_buf;

/* Make room for `extra` more bytes. Capacity doubles (from 256) so appends are amortised O(1). */
static inline bool vx_buf_reserve(vx_buf *b, size_t extra)
{
    if (b->cap - b->len >= extra)
        return true;
    if (extra > SIZE_MAX / 2 - b->len)
        return false;
    size_t cap = b->cap ? b->cap : 256;
    while (cap - b->len < extra)
        cap *= 2;
    uint8_t *p = realloc(b->p, cap);
    if (p == NULL)
        return false;
    b->p = p;
    b->cap = cap;
    return true;
}

static inline bool vx_buf_append(vx_buf *b, const void *src, size_t n)
{
    if (!vx_buf_reserve(b, n))
        return false;
    if (n)
        memcpy(b->p + b->len, src, n);
    b->len += n;
    return true;
}

static inline bool vx_buf_byte(vx_buf *b, uint8_t c)
{
    if (!vx_buf_reserve(b, 1))
        return false;
    b->p[b->len++] = c;
    return true;
}

/* Empty the buffer; give the memory back if one burst made it larger than `keep` bytes, so a
 * long-lived connection does not hold on to the high-water mark of its largest read. */
static inline void vx_buf_reset(vx_buf *b, size_t keep)
{
    b->len = 0;
    if (b->cap > keep) {
        free(b->p);
        b->p = NULL;
        b->cap = 0;
    }
}

static inline void vx_buf_free(vx_buf *b)
{
    free(b->p);
    b->p = NULL;
    b->len = b->cap = 0;
}

#endif
