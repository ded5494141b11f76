/* vx_ring: Vyukov bounded MPMC ring. See vx_ring.h for the contract.
 *
 * Protocol, for the slot of position pos (cell pos & mask) in lap L:
 *   seq == pos      the slot is free for the producer that claims position pos;
 *   seq == pos + 1  the producer of pos has written data, the consumer of pos may read it;
 *   seq == pos + capacity  (written by that consumer) the slot is free for the next lap.
 * A producer claims pos by CAS on enq only after seeing seq == pos; a consumer claims pos by
 * CAS on deq only after seeing seq == pos + 1. The CAS on the counters decides who owns a
 * position; the release/acquire pair on seq is what orders the plain accesses to data.
 */
#include "vx_ring.h"

#include <stdint.h>
#include <stdlib.h>

int vx_ring_capacity_ok(size_t capacity)
{
    return capacity >= 2 && capacity <= VX_RING_MAX_CAPACITY && (capacity & (capacity - 1)) == 0;
}

/* aligned_alloc wants the size to be a multiple of the alignment. */
static size_t round_up_line(size_t n)
{
    return (n + VX_CACHE_LINE - 1) & ~(size_t)(VX_CACHE_LINE - 1);
}

vx_ring *vx_ring_create(size_t capacity, int *status)
{
    int dummy;
    if (status == NULL)
        status = &dummy;
    if (!vx_ring_capacity_ok(capacity)) {
        *status = VX_EINVAL;
        return NULL;
    }
    vx_ring *ring = aligned_alloc(VX_CACHE_LINE, sizeof *ring);
    vx_ring_cell *cells = aligned_alloc(VX_CACHE_LINE, round_up_line(capacity * sizeof *cells));
    if (ring == NULL || cells == NULL) {
        free(ring);
        free(cells);
        *status = VX_ENOMEM;
        return NULL;
    }
    /* Writing every cell here is the first touch of its pages, so they land on the memory
     * node of the creating thread. Relaxed is enough: the ring is handed to other threads
     * through whatever publishes the pointer (thread creation, a lock, the GIL), which
     * orders these plain initialising stores before any use. */
    for (size_t i = 0; i < capacity; i++) {
        atomic_init(&cells[i].seq, i);
        cells[i].data = NULL;
    }
    atomic_init(&ring->enq, 0);
    atomic_init(&ring->deq, 0);
    ring->cells = cells;
    ring->mask = capacity - 1;
    *status = VX_OK;
    return ring;
}

void vx_ring_free(vx_ring *ring)
{
    if (ring == NULL)
        return;
    free(ring->cells);
    free(ring);
}

int vx_ring_push(vx_ring *ring, void *item)
{
    vx_ring_cell *cell;
    /* Relaxed: a stale pos is harmless, the seq check below detects it and reloads. */
    size_t pos = atomic_load_explicit(&ring->enq, memory_order_relaxed);
    for (;;) {
        cell = &ring->cells[pos & ring->mask];
        /* Acquire, pairs with the release store of seq in vx_ring_pop / vx_ring_pop_batch:
         * the previous lap's consumer has finished reading data before we overwrite it. */
        size_t seq = atomic_load_explicit(&cell->seq, memory_order_acquire);
        ptrdiff_t dif = (ptrdiff_t)(seq - pos);
        if (dif == 0) {
            /* Relaxed CAS: it only decides which producer owns pos; data is ordered by seq. */
            if (atomic_compare_exchange_weak_explicit(&ring->enq, &pos, pos + 1,
                                                      memory_order_relaxed, memory_order_relaxed))
                break;
            /* On failure pos holds the current enq: retry with it. */
        } else if (dif < 0) {
            /* The slot still holds the item from one lap ago: the ring is full. */
            return VX_FULL;
        } else {
            /* Another producer already took pos: catch up. */
            pos = atomic_load_explicit(&ring->enq, memory_order_relaxed);
        }
    }
    cell->data = item;
    /* Release, pairs with the acquire load of seq in vx_ring_pop / vx_ring_pop_batch: the
     * consumer that sees pos + 1 also sees data. */
    atomic_store_explicit(&cell->seq, pos + 1, memory_order_release);
    return VX_OK;
}

int vx_ring_pop(vx_ring *ring, void **out)
{
    vx_ring_cell *cell;
    size_t pos = atomic_load_explicit(&ring->deq, memory_order_relaxed); /* stale is harmless */
    for (;;) {
        cell = &ring->cells[pos & ring->mask];
        /* Acquire, pairs with the release store of seq in vx_ring_push: data is written. */
        size_t seq = atomic_load_explicit(&cell->seq, memory_order_acquire);
        ptrdiff_t dif = (ptrdiff_t)(seq - (pos + 1));
        if (dif == 0) {
            /* Relaxed CAS: ownership only; data is ordered by seq. */
            if (atomic_compare_exchange_weak_explicit(&ring->deq, &pos, pos + 1,
                                                      memory_order_relaxed, memory_order_relaxed))
                break;
        } else if (dif < 0) {
            /* Nothing published at pos yet (free slot, or a producer mid-write). */
            return VX_EMPTY;
        } else {
            pos = atomic_load_explicit(&ring->deq, memory_order_relaxed);
        }
    }
    *out = cell->data;
    /* Release, pairs with the acquire load of seq in vx_ring_push: our read of data happens
     * before the next lap's producer overwrites it. */
    atomic_store_explicit(&cell->seq, pos + ring->mask + 1, memory_order_release);
    return VX_OK;
}

int vx_ring_pop_batch(vx_ring *ring, void **out, size_t max_n, size_t *n_out)
{
    *n_out = 0;
    if (max_n == 0)
        return VX_EINVAL;
    if (max_n > ring->mask + 1)
        max_n = ring->mask + 1; /* never claim the same cell twice in one batch */

    size_t pos = atomic_load_explicit(&ring->deq, memory_order_relaxed);
    size_t k;
    for (;;) {
        /* Count the published prefix starting at pos. Stopping at the first unpublished slot
         * is what keeps a batch from claiming a position whose producer is still writing. */
        ptrdiff_t dif = 0;
        for (k = 0; k < max_n; k++) {
            /* Acquire, pairs with the release store of seq in vx_ring_push: if we end up
             * owning this position, its data is visible to the reads below. */
            size_t seq = atomic_load_explicit(&ring->cells[(pos + k) & ring->mask].seq,
                                              memory_order_acquire);
            dif = (ptrdiff_t)(seq - (pos + k + 1));
            if (dif != 0)
                break;
        }
        if (k == 0) {
            if (dif < 0)
                return VX_EMPTY;
            pos = atomic_load_explicit(&ring->deq, memory_order_relaxed); /* stale pos */
            continue;
        }
        /* One CAS claims all k positions. It succeeds only if deq is still pos; deq never
         * goes backwards, so nobody claimed any of pos .. pos+k-1 while we scanned, and each
         * seq we saw (== position + 1) can only mean "published for this very position".
         * Relaxed: ownership only, the data is ordered by the acquire loads above. */
        if (atomic_compare_exchange_weak_explicit(&ring->deq, &pos, pos + k,
                                                  memory_order_relaxed, memory_order_relaxed))
            break;
        /* Lost to another consumer (pos now holds the fresh deq): rescan from there. */
    }
    for (size_t i = 0; i < k; i++) {
        vx_ring_cell *cell = &ring->cells[(pos + i) & ring->mask];
        out[i] = cell->data;
        /* Release, pairs with the acquire load of seq in vx_ring_push (as in vx_ring_pop). */
        atomic_store_explicit(&cell->seq, pos + i + ring->mask + 1, memory_order_release);
    }
    *n_out = k;
    return VX_OK;
}

size_t vx_ring_size(const vx_ring *ring)
{
    /* Relaxed: a metric. Reading deq first means the later enq is at least as new, so the
     * difference cannot go negative; it can overshoot while both move, hence the clamp. */
    size_t deq = atomic_load_explicit(&ring->deq, memory_order_relaxed);
    size_t enq = atomic_load_explicit(&ring->enq, memory_order_relaxed);
    size_t n = enq - deq;
    if ((ptrdiff_t)n < 0)
        return 0;
    return n > ring->mask + 1 ? ring->mask + 1 : n;
}

size_t vx_ring_capacity(const vx_ring *ring)
{
    return ring->mask + 1;
}

int vx_ring_visit(const vx_ring *ring, int (*fn)(void *item, void *ctx), void *ctx)
{
    /* Quiescent by contract, so the counters need no ordering (relaxed). The seq load is
     * still acquire, pairing with the release store of seq in vx_ring_push, so that reading
     * data is ordered after its publication even if the last push ran on another thread. */
    size_t deq = atomic_load_explicit(&ring->deq, memory_order_relaxed);
    size_t enq = atomic_load_explicit(&ring->enq, memory_order_relaxed);
    for (size_t pos = deq; pos != enq; pos++) {
        const vx_ring_cell *cell = &ring->cells[pos & ring->mask];
        if (atomic_load_explicit(&cell->seq, memory_order_acquire) != pos + 1)
            continue; /* claimed but not published: impossible when quiescent, skip anyway */
        int rc = fn(cell->data, ctx);
        if (rc != 0)
            return rc;
    }
    return 0;
}
