/* vx_bucket: shared-memory token bucket. See vx_bucket.h for the contract.
 *
 * Accounting invariant (what the exactness tests check): tokens only enter the bucket through
 * a refill, and a refill credits the interval (last_us, now_us] that it moved last_us across
 * with one CAS. last_us never moves backwards, so the credited intervals are disjoint and lie
 * inside [creation, latest now_us]; every other operation either takes units out or gives
 * back exactly what it took. Hence, at any moment,
 *     admitted <= burst + rate_per_minute * (latest now_us - creation) / 60e6
 * with no slack, however many threads and processes race.
 *
 * Known imprecisions (both allowed by the invariant above; neither mints tokens):
 *  1. Give-back overfill. A failing acquire subtracts n, then adds it back. A refill that
 *     runs in between sees the bucket emptier than it is, so its cap check lets in up to n
 *     units of credit too many; after the give-back the bucket holds up to cap + n (summed
 *     over the racers). The surplus is credit that the cap would otherwise have discarded;
 *     it is consumed by the next takes and the next refills add nothing until it is gone.
 *  2. Lazy credit. acquire's fast path does not read the clock, so time is credited only when
 *     a refill runs (when a take comes up short), for the whole interval since the previous
 *     refill. Time during which the bucket sat full must not count, or a burst after a quiet
 *     period could be followed at once by a second one. Two measures keep that out:
 *       - a take that finds the bucket full stamps last_us forward to now (stamp_full): the
 *         bucket was full until this moment, so nothing before it may be credited. The clock
 *         is read only then, which happens under light load, when it costs nothing that
 *         matters. This covers the common case (idle, hence full, then a burst).
 *       - acquire_up_to, the once-per-batch call of the gateway, refills before it takes, so
 *         the count it draws from is never stale: over any window, what it admits is bounded
 *         by burst + rate * window.
 *     What remains: acquire() on a bucket that was left partly full for a long while can
 *     still, at its next shortage, credit time during which the bucket would have been full;
 *     over a window not starting at creation the bound for acquire() alone is then
 *     2 * burst + rate * window.
 */
#ifndef _GNU_SOURCE
/* clock_gettime and MAP_ANONYMOUS are POSIX/BSD extensions that -std=c11 hides. */
#define _GNU_SOURCE
#endif

#include "vx_bucket.h"

#include <errno.h>
#include <sys/mman.h>
#include <time.h>

/* How many take/refill rounds acquire tries before answering "no". Each round either
 * returns or saw another caller move last_us forward, so this only bites under extreme
 * contention, where a false "no" is the right answer anyway: tokens are scarce. */
#define VX_BUCKET_MAX_ROUNDS 8

int64_t vx_now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

int vx_bucket_check(int64_t rate_per_minute, int64_t burst)
{
    if (rate_per_minute < 1 || rate_per_minute > VX_BUCKET_MAX_RATE)
        return VX_BUCKET_BAD_RATE;
    if (burst < 1 || burst > VX_BUCKET_MAX_BURST)
        return VX_BUCKET_BAD_BURST;
    return VX_BUCKET_OK;
}

vx_bucket *vx_bucket_create(int64_t rate_per_minute, int64_t burst, int64_t now_us)
{
    if (vx_bucket_check(rate_per_minute, burst) != VX_BUCKET_OK) {
        errno = EINVAL;
        return NULL;
    }
    /* Anonymous + shared: no file, and fork() shares the pages instead of copying them. */
    void *mem = mmap(NULL, sizeof(vx_bucket), PROT_READ | PROT_WRITE,
                     MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED)
        return NULL;
    vx_bucket *b = mem;
    b->rate = rate_per_minute;
    b->burst = burst;
    b->cap = burst * VX_UNITS_PER_TOKEN;
    b->fill_us = (b->cap + rate_per_minute - 1) / rate_per_minute;
    /* The mapping reaches other threads/processes only through thread creation, fork or a
     * pointer handover that orders these initialising stores before any use. */
    atomic_init(&b->tokens, b->cap); /* starts full */
    atomic_init(&b->last_us, now_us);
    return b;
}

void vx_bucket_destroy(vx_bucket *bucket)
{
    if (bucket != NULL)
        munmap(bucket, sizeof(vx_bucket));
}

/* Add up to `add` units without ever taking the count above cap: the CAS retries with the
 * fresh count, so two racing adders cannot both fill the same room. */
static void add_capped(vx_bucket *b, int64_t add)
{
    int64_t cur = atomic_load_explicit(&b->tokens, memory_order_relaxed);
    for (;;) {
        int64_t room = b->cap - cur;
        if (room <= 0 || add <= 0)
            return; /* full (or overfilled, see imprecision 1): the credit is discarded */
        int64_t a = add < room ? add : room;
        /* Relaxed: only the count itself is at stake (see vx_bucket.h). */
        if (atomic_compare_exchange_weak_explicit(&b->tokens, &cur, cur + a,
                                                  memory_order_relaxed, memory_order_relaxed))
            return;
    }
}

int vx_bucket_refill(vx_bucket *b, int64_t now_us)
{
    int64_t last = atomic_load_explicit(&b->last_us, memory_order_relaxed);
    if (now_us <= last)
        return VX_REFILL_NONE; /* clock went back or time already credited: never mint */
    /* Exactly one caller moves last_us across (last, now_us]; the interval it credits is
     * therefore credited once. Strong CAS: a spurious failure would only cost a retry, but
     * "lost" should mean somebody else really did refill. Relaxed: see vx_bucket.h. */
    if (!atomic_compare_exchange_strong_explicit(&b->last_us, &last, now_us,
                                                 memory_order_relaxed, memory_order_relaxed))
        return VX_REFILL_LOST;
    int64_t elapsed = now_us - last;
    /* Beyond fill_us the cap discards the credit anyway; clamping keeps the product small. */
    if (elapsed > b->fill_us)
        elapsed = b->fill_us;
    add_capped(b, elapsed * b->rate);
    return VX_REFILL_WON;
}

/* The bucket was full up to now_us: move last_us forward so that interval is never credited.
 * Never moves it backwards (a refill may have passed now_us already); a lost CAS retries
 * against the fresh value. Relaxed: see vx_bucket.h. */
static void stamp_full(vx_bucket *b, int64_t now_us)
{
    int64_t last = atomic_load_explicit(&b->last_us, memory_order_relaxed);
    while (last < now_us &&
           !atomic_compare_exchange_weak_explicit(&b->last_us, &last, now_us,
                                                  memory_order_relaxed, memory_order_relaxed)) {
    }
}

/* Fast path: one fetch_sub. If it came up short, the give-back restores the count. A take
 * that found the bucket full stamps the time (see imprecision 2). */
static bool take(vx_bucket *b, int64_t need, int64_t now_us, bool have_now)
{
    int64_t old = atomic_fetch_sub_explicit(&b->tokens, need, memory_order_relaxed);
    if (old >= need) {
        if (old >= b->cap)
            stamp_full(b, have_now ? now_us : vx_now_us());
        return true;
    }
    atomic_fetch_add_explicit(&b->tokens, need, memory_order_relaxed);
    return false;
}

static bool acquire_impl(vx_bucket *b, int64_t n, int64_t now_us, bool have_now)
{
    if (n < 1 || n > b->burst)
        return false;
    const int64_t need = n * VX_UNITS_PER_TOKEN;
    for (int round = 0; round < VX_BUCKET_MAX_ROUNDS; round++) {
        if (take(b, need, now_us, have_now))
            return true;
        if (!have_now) {
            now_us = vx_now_us();
            have_now = true;
        }
        if (vx_bucket_refill(b, now_us) == VX_REFILL_NONE)
            /* Everything up to now_us is credited already; a refill that another caller
             * won a moment ago may still be adding its tokens, so look once more. */
            return take(b, need, now_us, have_now);
        /* WON: retry with the fresh tokens. LOST: the winner is adding them; retry. */
    }
    return false;
}

bool vx_bucket_acquire(vx_bucket *bucket, int64_t n)
{
    return acquire_impl(bucket, n, 0, false);
}

bool vx_bucket_acquire_at(vx_bucket *bucket, int64_t n, int64_t now_us)
{
    return acquire_impl(bucket, n, now_us, true);
}

static int64_t acquire_up_to_impl(vx_bucket *b, int64_t n, int64_t now_us, bool have_now)
{
    if (n < 1)
        return 0;
    if (n > b->burst)
        n = b->burst; /* the bucket never holds more than burst whole tokens */
    const int64_t need = n * VX_UNITS_PER_TOKEN;
    /* Called once per batch: refill first (one clock read and one CAS per batch), so the
     * count is current and no time the bucket spent full is credited later. */
    if (!have_now) {
        now_us = vx_now_us();
        have_now = true;
    }
    vx_bucket_refill(b, now_us);
    for (int round = 0;; round++) {
        /* One fetch_sub takes all n; the units we were not entitled to go back in one
         * fetch_add. `old` is never more than what is really there (other callers' in-flight
         * withdrawals only make it smaller), so the sum of grants never exceeds the bucket. */
        int64_t old = atomic_fetch_sub_explicit(&b->tokens, need, memory_order_relaxed);
        int64_t got = old >= need ? n : (old > 0 ? old / VX_UNITS_PER_TOKEN : 0);
        int64_t excess = need - got * VX_UNITS_PER_TOKEN;
        if (excess != 0)
            atomic_fetch_add_explicit(&b->tokens, excess, memory_order_relaxed);
        if (got > 0 || round == 1)
            return got;
        vx_bucket_refill(b, now_us); /* a racing refill may be adding its tokens: retry once */
    }
}

int64_t vx_bucket_acquire_up_to(vx_bucket *bucket, int64_t n)
{
    return acquire_up_to_impl(bucket, n, 0, false);
}

int64_t vx_bucket_acquire_up_to_at(vx_bucket *bucket, int64_t n, int64_t now_us)
{
    return acquire_up_to_impl(bucket, n, now_us, true);
}

/* Units the bucket would hold after a refill at now_us, without performing it. */
static int64_t projected_units(const vx_bucket *b, int64_t now_us)
{
    int64_t cur = atomic_load_explicit(&b->tokens, memory_order_relaxed);
    int64_t last = atomic_load_explicit(&b->last_us, memory_order_relaxed);
    int64_t pending = now_us > last ? now_us - last : 0;
    if (pending > b->fill_us)
        pending = b->fill_us;
    int64_t room = b->cap - cur;
    int64_t add = pending * b->rate;
    if (room <= 0)
        return b->cap; /* overfilled: report the cap, the surplus is transient */
    return cur + (add < room ? add : room);
}

int64_t vx_bucket_wait_hint_us(const vx_bucket *b, int64_t n, int64_t now_us)
{
    if (n < 1)
        return 0;
    if (n > b->burst)
        return -1;
    const int64_t need = n * VX_UNITS_PER_TOKEN;
    int64_t have = projected_units(b, now_us);
    if (have >= need)
        return 0;
    return (need - have + b->rate - 1) / b->rate; /* ceil: the first whole microsecond */
}

int64_t vx_bucket_available(const vx_bucket *b, int64_t now_us)
{
    int64_t have = projected_units(b, now_us);
    return have > 0 ? have / VX_UNITS_PER_TOKEN : 0;
}
