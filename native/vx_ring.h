/* vx_ring: bounded multi-producer multi-consumer ring of `void *` (Vyukov's design).
 *
 * Plain C11, no Python. Every slot carries a sequence number that tells producers and
 * consumers whose turn the slot is, so the only shared read-modify-write operations are one
 * CAS on the enqueue counter per push and one CAS on the dequeue counter per pop (or per
 * batch). Nothing blocks, nothing grows: a full ring says VX_FULL, an empty one VX_EMPTY.
 *
 * Ownership: the ring stores pointers, never what they point to. Whoever pushes a pointer
 * hands it to the ring; whoever pops it gets it back. Freeing the ring does not touch the
 * items still in it: drain it first (vx_ring_pop until VX_EMPTY) if they own resources.
 */
#ifndef VX_RING_H
#define VX_RING_H

#include <stdalign.h>
#include <stdatomic.h>
#include <stddef.h>

/* Status codes of the vx_ring_ API. */
enum {
    VX_OK = 0,      /* done */
    VX_FULL = 1,    /* push: no free slot right now */
    VX_EMPTY = 2,   /* pop: no published item right now */
    VX_EINVAL = -1, /* bad argument (capacity not a power of two >= 2, or too large) */
    VX_ENOMEM = -2, /* allocation failed */
};

#define VX_CACHE_LINE 64
/* Largest accepted capacity: 2^30 slots is 16 GiB of cells, far beyond any sane gateway
 * queue, and keeps capacity * sizeof(cell) well inside size_t on 64-bit targets. */
#define VX_RING_MAX_CAPACITY ((size_t)1 << 30)

typedef struct vx_ring_cell {
    /* Whose turn: == pos means free for the producer of position pos; == pos + 1 means
     * holding the item of position pos, ready for its consumer. */
    _Atomic size_t seq;
    void *data; /* plain field: ordered by the release/acquire pair on seq */
} vx_ring_cell;

typedef struct vx_ring {
    /* Producers hammer `enq`, consumers hammer `deq`: each gets its own cache line so a
     * push never invalidates the line a pop is spinning on (and vice versa). */
    alignas(VX_CACHE_LINE) _Atomic size_t enq;
    alignas(VX_CACHE_LINE) _Atomic size_t deq;
    /* Read-only after vx_ring_create: shared by everyone without contention. */
    alignas(VX_CACHE_LINE) vx_ring_cell *cells;
    size_t mask; /* capacity - 1 */
} vx_ring;

_Static_assert(offsetof(vx_ring, enq) == 0, "enq starts the struct");
_Static_assert(offsetof(vx_ring, deq) == VX_CACHE_LINE, "deq on its own cache line");
_Static_assert(offsetof(vx_ring, cells) == 2 * VX_CACHE_LINE, "config on its own cache line");
_Static_assert(sizeof(vx_ring) == 3 * VX_CACHE_LINE, "no trailing sharing");

/* 1 when capacity is a power of two in [2, VX_RING_MAX_CAPACITY], else 0. */
int vx_ring_capacity_ok(size_t capacity);

/* Allocate a ring and its slot array and write every slot (first touch, so the pages are
 * local to the calling thread's NUMA node). Returns the ring, or NULL with *status set to
 * VX_EINVAL or VX_ENOMEM (status may be NULL). Free with vx_ring_free. */
vx_ring *vx_ring_create(size_t capacity, int *status);

/* Free the ring and its slots. Items still inside are not touched (see the header note).
 * Must not race with any other call on the ring. NULL is accepted. */
void vx_ring_free(vx_ring *ring);

/* Hand `item` to the ring. VX_OK, or VX_FULL (the ring keeps nothing, the caller still owns
 * item). Thread-safe against any mix of pushes and pops. */
int vx_ring_push(vx_ring *ring, void *item);

/* Take the oldest published item into *out. VX_OK (caller now owns *out) or VX_EMPTY
 * (*out untouched). Thread-safe. */
int vx_ring_pop(vx_ring *ring, void **out);

/* Take up to max_n oldest items into out[0..*n_out) with one CAS on the dequeue counter when
 * no other consumer interferes. Claims only the prefix of consecutively published slots, so
 * it never waits for a producer that has claimed a slot but not yet written it. max_n is
 * clamped to the capacity. VX_OK with *n_out >= 1 (caller owns those items), VX_EMPTY with
 * *n_out == 0, or VX_EINVAL if max_n == 0. Thread-safe. */
int vx_ring_pop_batch(vx_ring *ring, void **out, size_t max_n, size_t *n_out);

/* Items pushed but not yet popped. Exact when quiescent; under concurrency a snapshot that
 * may be stale by the time it returns (always within [0, capacity]). */
size_t vx_ring_size(const vx_ring *ring);

size_t vx_ring_capacity(const vx_ring *ring);

/* Call fn(item, ctx) for every item in the ring, oldest first, without removing any; stops
 * at and returns the first non-zero fn result, else 0. For quiescent rings only (no
 * concurrent push or pop): it exists so a garbage collector can see what the ring holds. */
int vx_ring_visit(const vx_ring *ring, int (*fn)(void *item, void *ctx), void *ctx);

#endif /* VX_RING_H */
