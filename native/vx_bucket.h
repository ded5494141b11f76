/* vx_bucket: token bucket in shared memory, integer-only, lock-free.
 *
 * Plain C11, no Python. The state lives in an anonymous MAP_SHARED mapping, so a bucket
 * created before fork() is one bucket for the parent and every child: they all enforce one
 * limit. Functions that need the time take it as `now_us` (CLOCK_MONOTONIC microseconds,
 * see vx_now_us) so tests can drive the clock; the variants without `_at` read the clock
 * themselves, and only on the slow path.
 *
 * Units: 1 token = VX_UNITS_PER_TOKEN units = the number of microseconds in a minute.
 * A rate of r tokens per minute is then exactly r units per microsecond, so a refill of
 * `elapsed_us` adds `elapsed_us * r` units with no division and no remainder to lose.
 *
 * Memory orders: the token count and the refill timestamp are each a self-contained atomic;
 * no plain data is published through either, so every operation on them is relaxed. What
 * the algorithm needs is atomicity and a single modification order per variable, which all
 * atomic read-modify-writes have regardless of the order argument.
 */
#ifndef VX_BUCKET_H
#define VX_BUCKET_H

#include <stdalign.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "vx_units.h"
/* Upper bounds keep every product inside int64: the cap is at most 6e16 units, so the
 * counter has room for ~150 concurrent burst-sized withdrawals below zero (each is given
 * back at once) before it could wrap, and a refill adds at most cap + rate units. */
#define VX_BUCKET_MAX_RATE INT64_C(1000000000)
#define VX_BUCKET_MAX_BURST INT64_C(1000000000)

/* Results of vx_bucket_check. */
enum { VX_BUCKET_OK = 0, VX_BUCKET_BAD_RATE = 1, VX_BUCKET_BAD_BURST = 2 };

/* Results of vx_bucket_refill. */
enum {
    VX_REFILL_NONE = 0, /* now_us <= last refill: nothing to credit (or the clock went back) */
    VX_REFILL_WON = 1,  /* this caller credited (last, now_us] */
    VX_REFILL_LOST = 2, /* another caller moved the timestamp first: just retry the take */
};

#define VX_BUCKET_LINE 64

typedef struct vx_bucket {
    /* Hot: every acquire does a fetch_sub here. Own cache line. */
    alignas(VX_BUCKET_LINE) _Atomic int64_t tokens; /* units; may dip below 0 transiently */
    /* Warm: moved only by refills. Own line so refills do not disturb the hot one more than
     * their token add has to. */
    alignas(VX_BUCKET_LINE) _Atomic int64_t last_us; /* refill credited up to this time */
    /* Read-only after creation. */
    alignas(VX_BUCKET_LINE) int64_t rate; /* tokens per minute == units per microsecond */
    int64_t burst;                        /* tokens */
    int64_t cap;                          /* burst in units */
    int64_t fill_us;                      /* time to fill from empty: ceil(cap / rate) */
} vx_bucket;

_Static_assert(ATOMIC_LLONG_LOCK_FREE == 2 && ATOMIC_LONG_LOCK_FREE == 2,
               "shared-memory atomics must be lock-free to work across processes");
_Static_assert(sizeof(_Atomic int64_t) == sizeof(int64_t), "atomics stored inline");
_Static_assert(offsetof(vx_bucket, last_us) == VX_BUCKET_LINE, "last_us on its own line");
_Static_assert(offsetof(vx_bucket, rate) == 2 * VX_BUCKET_LINE, "config on its own line");

/* CLOCK_MONOTONIC in microseconds. */
int64_t vx_now_us(void);

/* VX_BUCKET_OK, or which argument is out of [1, VX_BUCKET_MAX_*]. */
int vx_bucket_check(int64_t rate_per_minute, int64_t burst);

/* Map a new full bucket whose refill clock starts at now_us. Returns NULL with errno set
 * (EINVAL for arguments vx_bucket_check rejects, or mmap's errno). The caller owns the
 * mapping in this process and releases it with vx_bucket_destroy; forked children inherit
 * the same shared state and release their own view the same way. */
vx_bucket *vx_bucket_create(int64_t rate_per_minute, int64_t burst, int64_t now_us);
void vx_bucket_destroy(vx_bucket *bucket); /* NULL accepted */

/* Take n tokens at once, or none. true when taken. false at once when n < 1 or n > burst.
 * The `_at` form uses now_us for a refill; the other reads the clock only if it must. */
bool vx_bucket_acquire(vx_bucket *bucket, int64_t n);
bool vx_bucket_acquire_at(vx_bucket *bucket, int64_t n, int64_t now_us);

/* Take min(n, whole tokens available) and return how many (0 when none or n < 1). */
int64_t vx_bucket_acquire_up_to(vx_bucket *bucket, int64_t n);
int64_t vx_bucket_acquire_up_to_at(vx_bucket *bucket, int64_t n, int64_t now_us);

/* Microseconds until n tokens can be available, counting the refill pending since the last
 * one: 0 when they are there now, -1 when n > burst (never), 0 for n < 1. Read-only. */
int64_t vx_bucket_wait_hint_us(const vx_bucket *bucket, int64_t n, int64_t now_us);

/* Whole tokens available at now_us, pending refill included, capped at burst. Read-only and
 * approximate under concurrency (a metric). */
int64_t vx_bucket_available(const vx_bucket *bucket, int64_t now_us);

/* Credit the time since the last refill, if this caller wins the race for it (see the enum).
 * Exposed for tests; acquire calls it on its slow path. */
int vx_bucket_refill(vx_bucket *bucket, int64_t now_us);

#endif /* VX_BUCKET_H */
