/* stress_ring: unit checks of vx_ring, then an MPMC stress run.
 *
 * Usage: stress_ring [total_items] [capacity]   (defaults: 10,000,000 items, 1024 slots)
 *
 * P producers push (producer << 32 | seq) with seq = 0, 1, 2, ... in order; C consumers pop,
 * alternating single pops and batches of varying size. Each consumer checks that the seqs it
 * sees from any one producer strictly increase (FIFO per producer) and marks every item in
 * its own bitmap; after the join every item must be marked exactly once (no loss, no
 * duplicate). A small capacity keeps the ring wrapping and hitting full/empty constantly.
 * Exit status 0 when every check passes, 1 otherwise.
 */
#include "vx_ring.h"
#include "check.h"

#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define PRODUCERS 4
#define CONSUMERS 4
/* A broken ring tends to hang rather than crash (a consumer waits for items that were lost):
 * the watchdog turns "no progress for this long" into a failure. */
#define STALL_SECONDS 20

/* ---- unit checks (single thread) ---- */

static int count_visit(void *item, void *ctx)
{
    uintptr_t *expect = ctx;
    if ((uintptr_t)item != *expect)
        return 1;
    (*expect)++;
    return 0;
}

static void unit_checks(void)
{
    int st;
    CHECK(vx_ring_create(0, &st) == NULL && st == VX_EINVAL);
    CHECK(vx_ring_create(1, &st) == NULL && st == VX_EINVAL);
    CHECK(vx_ring_create(3, &st) == NULL && st == VX_EINVAL);
    CHECK(vx_ring_create(VX_RING_MAX_CAPACITY * 2, &st) == NULL && st == VX_EINVAL);
    CHECK(vx_ring_create(SIZE_MAX, &st) == NULL && st == VX_EINVAL);

    vx_ring *r = vx_ring_create(8, &st);
    CHECK(r != NULL && st == VX_OK);
    if (r == NULL)
        return;
    void *out = NULL, *batch[16];
    size_t n = 99;
    CHECK(vx_ring_pop(r, &out) == VX_EMPTY);
    CHECK(vx_ring_pop_batch(r, batch, 4, &n) == VX_EMPTY && n == 0);
    CHECK(vx_ring_pop_batch(r, batch, 0, &n) == VX_EINVAL);
    /* Three laps of fill / drain so every slot wraps. */
    for (uintptr_t lap = 0; lap < 3; lap++) {
        for (uintptr_t i = 0; i < 8; i++)
            CHECK(vx_ring_push(r, (void *)(lap * 8 + i)) == VX_OK);
        CHECK(vx_ring_push(r, (void *)1) == VX_FULL);
        CHECK(vx_ring_size(r) == 8);
        uintptr_t expect = lap * 8;
        CHECK(vx_ring_visit(r, count_visit, &expect) == 0 && expect == lap * 8 + 8);
        CHECK(vx_ring_pop(r, &out) == VX_OK && (uintptr_t)out == lap * 8);
        CHECK(vx_ring_pop_batch(r, batch, 3, &n) == VX_OK && n == 3);
        for (uintptr_t i = 0; i < 3; i++)
            CHECK((uintptr_t)batch[i] == lap * 8 + 1 + i);
        /* max_n above what is there (and above capacity): returns the 4 that remain. */
        CHECK(vx_ring_pop_batch(r, batch, 16, &n) == VX_OK && n == 4);
        for (uintptr_t i = 0; i < 4; i++)
            CHECK((uintptr_t)batch[i] == lap * 8 + 4 + i);
        CHECK(vx_ring_size(r) == 0);
    }
    CHECK(vx_ring_capacity(r) == 8);
    vx_ring_free(r);
    vx_ring_free(NULL);
}

/* ---- stress ---- */

static vx_ring *ring;
static uint64_t per_producer;
static uint64_t total_items;
static _Atomic uint64_t consumed; /* relaxed: only tells consumers when to stop */
static _Atomic int finished;       /* threads done; relaxed: the joins order their results */

typedef struct {
    int id;
    uint8_t *seen;  /* bitmap over all items, this consumer's only */
    uint64_t count; /* items this consumer took */
    int errors;
    uint64_t full_spins, empty_spins;
} worker;

static void *producer_main(void *arg)
{
    worker *w = arg;
    for (uint64_t seq = 0; seq < per_producer; seq++) {
        void *item = (void *)(uintptr_t)(((uint64_t)w->id << 32) | seq);
        while (vx_ring_push(ring, item) != VX_OK) {
            w->full_spins++;
            sched_yield(); /* 8 threads on few cores: let a consumer run */
        }
    }
    atomic_fetch_add_explicit(&finished, 1, memory_order_relaxed);
    return NULL;
}

static void take(worker *w, void *item, int64_t *last)
{
    uint64_t v = (uint64_t)(uintptr_t)item;
    uint64_t p = v >> 32, seq = v & 0xffffffffu;
    if (p >= PRODUCERS || seq >= per_producer) {
        if (w->errors++ < 5)
            fprintf(stderr, "consumer %d: garbage item %#" PRIx64 "\n", w->id, v);
        return;
    }
    if ((int64_t)seq <= last[p]) {
        if (w->errors++ < 5)
            fprintf(stderr, "consumer %d: producer %" PRIu64 " seq %" PRIu64 " after %" PRId64 "\n",
                    w->id, p, seq, last[p]);
    }
    last[p] = (int64_t)seq;
    uint64_t idx = p * per_producer + seq;
    w->seen[idx >> 3] |= (uint8_t)(1u << (idx & 7));
    w->count++;
}

static void *consumer_main(void *arg)
{
    worker *w = arg;
    int64_t last[PRODUCERS];
    void *batch[64];
    for (int p = 0; p < PRODUCERS; p++)
        last[p] = -1;
    unsigned rng = 0x9e3779b9u * (unsigned)(w->id + 1);
    while (atomic_load_explicit(&consumed, memory_order_relaxed) < total_items) {
        rng = rng * 1103515245u + 12345u;
        size_t got = 0;
        if ((rng >> 16) % 3 == 0) {
            void *item;
            if (vx_ring_pop(ring, &item) == VX_OK) {
                take(w, item, last);
                got = 1;
            }
        } else {
            size_t max_n = 1 + (rng >> 20) % 64;
            if (vx_ring_pop_batch(ring, batch, max_n, &got) == VX_OK) {
                if (got == 0 || got > max_n)
                    w->errors++;
                for (size_t i = 0; i < got; i++)
                    take(w, batch[i], last);
            }
        }
        if (got == 0) {
            w->empty_spins++;
            sched_yield();
        } else {
            atomic_fetch_add_explicit(&consumed, got, memory_order_relaxed);
        }
    }
    atomic_fetch_add_explicit(&finished, 1, memory_order_relaxed);
    return NULL;
}

int main(int argc, char **argv)
{
    total_items = argc > 1 ? strtoull(argv[1], NULL, 10) : 10000000ull;
    size_t capacity = argc > 2 ? (size_t)strtoull(argv[2], NULL, 10) : 1024;
    per_producer = total_items / PRODUCERS;
    total_items = per_producer * PRODUCERS;
    if (per_producer == 0 || per_producer > 0xffffffffu) {
        fprintf(stderr, "stress_ring: item count out of range\n");
        return 2;
    }

    unit_checks();

    int st;
    ring = vx_ring_create(capacity, &st);
    if (ring == NULL) {
        fprintf(stderr, "stress_ring: bad capacity %zu\n", capacity);
        return 2;
    }
    size_t bitmap_bytes = (size_t)(total_items + 7) / 8;
    worker prod[PRODUCERS], cons[CONSUMERS];
    pthread_t threads[PRODUCERS + CONSUMERS];
    memset(prod, 0, sizeof prod);
    memset(cons, 0, sizeof cons);
    for (int i = 0; i < CONSUMERS; i++) {
        cons[i].id = i;
        cons[i].seen = calloc(bitmap_bytes, 1);
        if (cons[i].seen == NULL) {
            fprintf(stderr, "stress_ring: out of memory\n");
            return 2;
        }
    }
    /* Consumers first so they are already spinning on an empty ring. */
    for (int i = 0; i < CONSUMERS; i++)
        pthread_create(&threads[PRODUCERS + i], NULL, consumer_main, &cons[i]);
    for (int i = 0; i < PRODUCERS; i++) {
        prod[i].id = i;
        pthread_create(&threads[i], NULL, producer_main, &prod[i]);
    }
    /* Progress = items consumed plus threads finished; both only grow. */
    uint64_t seen_progress = 0;
    int idle_ticks = 0;
    while (atomic_load_explicit(&finished, memory_order_relaxed) < PRODUCERS + CONSUMERS) {
        nanosleep(&(struct timespec){.tv_nsec = 100 * 1000 * 1000}, NULL);
        uint64_t now = atomic_load_explicit(&consumed, memory_order_relaxed) +
                       (uint64_t)atomic_load_explicit(&finished, memory_order_relaxed);
        idle_ticks = now == seen_progress ? idle_ticks + 1 : 0;
        seen_progress = now;
        if (idle_ticks >= STALL_SECONDS * 10) {
            fprintf(stderr, "stress_ring: no progress for %d s (%" PRIu64 " of %" PRIu64
                            " items consumed) -> FAIL\n", STALL_SECONDS,
                    atomic_load_explicit(&consumed, memory_order_relaxed), total_items);
            _exit(1); /* the workers are stuck; do not join them */
        }
    }
    for (int i = 0; i < PRODUCERS + CONSUMERS; i++)
        pthread_join(threads[i], NULL);

    uint64_t taken = 0, full_spins = 0, empty_spins = 0;
    for (int i = 0; i < CONSUMERS; i++) {
        taken += cons[i].count;
        empty_spins += cons[i].empty_spins;
        if (cons[i].errors) {
            fprintf(stderr, "consumer %d: %d order/garbage errors\n", i, cons[i].errors);
            failures++;
        }
    }
    for (int i = 0; i < PRODUCERS; i++)
        full_spins += prod[i].full_spins;
    CHECK(taken == total_items);
    uint64_t lost = 0, dup = 0;
    for (size_t byte = 0; byte < bitmap_bytes; byte++) {
        for (int bit = 0; bit < 8; bit++) {
            if (byte * 8 + (size_t)bit >= total_items)
                break;
            int marks = 0;
            for (int i = 0; i < CONSUMERS; i++)
                marks += (cons[i].seen[byte] >> bit) & 1;
            lost += marks == 0;
            dup += marks > 1;
        }
    }
    CHECK(lost == 0);
    CHECK(dup == 0);
    void *extra;
    CHECK(vx_ring_pop(ring, &extra) == VX_EMPTY);
    printf("stress_ring: %d producers, %d consumers, %" PRIu64 " items, capacity %zu: "
           "lost %" PRIu64 ", duplicated %" PRIu64 ", full-waits %" PRIu64 ", empty-waits %" PRIu64
           " -> %s\n",
           PRODUCERS, CONSUMERS, total_items, capacity, lost, dup, full_spins, empty_spins,
           failures ? "FAIL" : "ok");
    for (int i = 0; i < CONSUMERS; i++)
        free(cons[i].seen);
    vx_ring_free(ring);
    return failures ? 1 : 0;
}
