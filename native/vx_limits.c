/* vx_limits: shared token buckets and concurrency gauges. See vx_limits.h for the contract.
 *
 * Unlike vx_bucket (whose fast path is one fetch_sub and a give-back when short), takes here
 * are a CAS loop on the level: a refused take never dips the level, so no concurrent refill
 * sees the bucket emptier than it is (no overfill), no concurrent take is refused because of
 * a transient dip, and debt (level < 0) is read as debt. Each take refills first, so the
 * level is current; the refill is one load of last_us and, when time advanced, one CAS on it
 * and one CAS-add on the level.
 */
#ifndef _GNU_SOURCE
/* clock_gettime and MAP_ANONYMOUS are POSIX/BSD extensions that -std=c11 hides. */
#define _GNU_SOURCE
#endif

#include "vx_limits.h"
#include "vx_shm.h"

#include <errno.h>
#include <sys/mman.h>
#include <time.h>

#define U VX_UNITS_PER_TOKEN
#define DEBT_FLOOR (-VX_LIMITS_MAX_DEBT * U)

int64_t vx_limits_now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

static size_t held_offset(int64_t n)
{
    return offsetof(vx_limits, e) + (size_t)n * sizeof(vx_limit);
}

static size_t limits_bytes(int64_t n, int64_t slots, int64_t *row)
{
    const int64_t per_line = VX_LIMITS_LINE / (int64_t)sizeof(int64_t);
    *row = (n + per_line - 1) / per_line * per_line;
    /* At most 1e6 * 64 + 4096 * 1e6 * 8 bytes: well inside size_t on 64-bit. */
    return held_offset(n) + (size_t)slots * (size_t)*row * sizeof(int64_t);
}

vx_limits *vx_limits_create(int64_t n, int64_t slots)
{
    return vx_limits_create_fd(n, slots, NULL);
}

vx_limits *vx_limits_create_fd(int64_t n, int64_t slots, int *fd)
{
    if (n < 1 || n > VX_LIMITS_MAX_N || slots < 1 || slots > VX_LIMITS_MAX_SLOTS) {
        errno = EINVAL;
        return NULL;
    }
    int64_t row;
    size_t bytes = limits_bytes(n, slots, &row);
    /* Shared, anonymous or on a memfd: fork() shares the pages instead of copying them, and
     * fresh pages are zero: every entry unconfigured, every gauge 0. */
    vx_limits *l = vx_shm_map(bytes, "velox-limits", fd);
    if (l == NULL)
        return NULL;
    l->n = n;
    l->slots = slots;
    l->row = row;
    l->map_bytes = bytes;
    return l;
}

vx_limits *vx_limits_attach(int fd)
{
    size_t len;
    vx_limits *l = vx_shm_attach(fd, &len);
    if (l == NULL)
        return NULL;
    /* The header was written by vx_limits_create_fd before the descriptor was handed out;
     * a file of another shape (not ours, or truncated) is refused, not trusted. */
    int64_t row;
    if (len < sizeof *l || l->n < 1 || l->n > VX_LIMITS_MAX_N || l->slots < 1 ||
        l->slots > VX_LIMITS_MAX_SLOTS || limits_bytes(l->n, l->slots, &row) != len ||
        row != l->row || l->map_bytes != len) {
        munmap(l, len);
        errno = EINVAL;
        return NULL;
    }
    return l;
}

void vx_limits_destroy(vx_limits *l)
{
    if (l != NULL)
        munmap(l, l->map_bytes);
}

_Atomic int64_t *vx_limits_held(vx_limits *l, int64_t slot)
{
    _Atomic int64_t *base = (_Atomic int64_t *)((char *)l + held_offset(l->n));
    return base + slot * l->row;
}

static inline void unpack(uint64_t cfg, int64_t *rate, int64_t *burst)
{
    *rate = (int64_t)(cfg & 0xffffffffu);
    *burst = (int64_t)(cfg >> 32);
}

static inline uint64_t pack(int64_t rate, int64_t burst)
{
    return (uint64_t)rate | ((uint64_t)burst << 32);
}

/* Add up to `add` units without taking the level above cap: the CAS retries with the fresh
 * level, so two racing adders cannot both fill the same room. Returns the units added. */
static int64_t add_capped(vx_limit *e, int64_t add, int64_t cap)
{
    int64_t cur = atomic_load_explicit(&e->level, memory_order_relaxed);
    for (;;) {
        int64_t room = cap - cur;
        if (room <= 0 || add <= 0)
            return 0; /* full: the credit is discarded */
        int64_t a = add < room ? add : room;
        /* Relaxed: only the level itself is at stake (see vx_limits.h). */
        if (atomic_compare_exchange_weak_explicit(&e->level, &cur, cur + a, memory_order_relaxed,
                                                  memory_order_relaxed))
            return a;
    }
}

/* Credit (last_us, now_us] at `rate`, once: whoever moves last_us across an interval credits
 * it. A lost CAS retries against the fresh last_us, so when this returns every microsecond up
 * to now_us has been claimed by someone (whose add may still be on its way: a take in that
 * window of a few instructions can be refused; it never admits more than was credited). */
static void refill(vx_limit *e, int64_t rate, int64_t cap, int64_t now_us)
{
    if (rate <= 0)
        return; /* leased: only give adds */
    int64_t last = atomic_load_explicit(&e->last_us, memory_order_relaxed);
    while (now_us > last) {
        /* Strong: a spurious failure would only cost a turn of the loop, but it is clearer
         * that a failure means someone else moved the clock. Relaxed: see vx_limits.h. */
        if (atomic_compare_exchange_strong_explicit(&e->last_us, &last, now_us,
                                                    memory_order_relaxed, memory_order_relaxed)) {
            int64_t elapsed = now_us - last;
            /* Beyond the time to fill from the deepest debt the cap discards the credit
             * anyway; clamping keeps the product inside int64 (<= cap + debt + rate). */
            int64_t fill_us = (cap - DEBT_FLOOR) / rate + 1;
            if (elapsed > fill_us)
                elapsed = fill_us;
            add_capped(e, elapsed * rate, cap);
            return;
        }
    }
}

static inline vx_limit *entry(vx_limits *l, int64_t i)
{
    return &l->e[i];
}

void vx_limits_refill(vx_limits *l, int64_t i, int64_t now_us)
{
    vx_limit *e = entry(l, i);
    int64_t rate, burst;
    unpack(atomic_load_explicit(&e->config, memory_order_acquire), &rate, &burst);
    refill(e, rate, burst * U, now_us);
}

/* Move last_us forward to now_us (never back). Relaxed: see vx_limits.h. */
static void stamp(vx_limit *e, int64_t now_us)
{
    int64_t last = atomic_load_explicit(&e->last_us, memory_order_relaxed);
    while (last < now_us &&
           !atomic_compare_exchange_weak_explicit(&e->last_us, &last, now_us,
                                                  memory_order_relaxed, memory_order_relaxed)) {
    }
}

bool vx_limits_configure(vx_limits *l, int64_t i, int64_t rate_per_minute, int64_t burst,
                         int64_t now_us)
{
    if (i < 0 || i >= l->n || rate_per_minute < 0 || rate_per_minute > VX_LIMITS_MAX_RATE ||
        burst < 1 || burst > VX_LIMITS_MAX_BURST)
        return false;
    vx_limit *e = entry(l, i);
    uint64_t old = atomic_load_explicit(&e->config, memory_order_acquire);
    const int64_t cap = burst * U;
    if (old == 0) {
        /* First configuration: nobody takes from an unconfigured entry (burst 0 refuses
         * everything), so plain initialising stores are enough before the release below. */
        atomic_store_explicit(&e->level, rate_per_minute > 0 ? cap : 0, memory_order_relaxed);
        atomic_store_explicit(&e->last_us, now_us, memory_order_relaxed);
    } else {
        int64_t old_rate, old_burst;
        unpack(old, &old_rate, &old_burst);
        refill(e, old_rate, old_burst * U, now_us); /* the old rate up to now */
        stamp(e, now_us); /* leased time (old rate 0) is not credited at the new rate */
        /* Keep the level, capped at the new burst; debt is kept as it is. */
        int64_t cur = atomic_load_explicit(&e->level, memory_order_relaxed);
        while (cur > cap &&
               !atomic_compare_exchange_weak_explicit(&e->level, &cur, cap, memory_order_relaxed,
                                                      memory_order_relaxed)) {
        }
    }
    /* Release: publishes last_us (and, the first time, the level) to takers that load the
     * config with acquire (see vx_limits.h). */
    atomic_store_explicit(&e->config, pack(rate_per_minute, burst), memory_order_release);
    return true;
}

void vx_limits_config(const vx_limits *l, int64_t i, int64_t *rate_per_minute, int64_t *burst)
{
    unpack(atomic_load_explicit(&l->e[i].config, memory_order_relaxed), rate_per_minute, burst);
}

/* Raise `largest` to n. Usually one relaxed load: a store only for the first take after the
 * refresher's pop (about 20 a second) or a larger one. Relaxed: a self-contained gauge. */
static void note_largest(vx_limit *e, int64_t n)
{
    int64_t cur = atomic_load_explicit(&e->largest, memory_order_relaxed);
    while (n > cur && !atomic_compare_exchange_weak_explicit(&e->largest, &cur, n,
                                                             memory_order_relaxed,
                                                             memory_order_relaxed)) {
    }
}

int64_t vx_limits_refused(const vx_limits *l, int64_t i)
{
    return atomic_load_explicit(&l->e[i].refused, memory_order_relaxed);
}

int64_t vx_limits_pop_largest(vx_limits *l, int64_t i)
{
    return atomic_exchange_explicit(&entry(l, i)->largest, 0, memory_order_relaxed);
}

int64_t vx_limits_take(vx_limits *l, int64_t i, int64_t n, int64_t now_us)
{
    if (n < 1)
        return 0;
    vx_limit *e = entry(l, i);
    int64_t rate, burst;
    /* Acquire: pairs with configure's release (see vx_limits.h). */
    unpack(atomic_load_explicit(&e->config, memory_order_acquire), &rate, &burst);
    if (n > burst)
        return VX_LIMITS_NEVER;
    const int64_t need = n * U, cap = burst * U;
    note_largest(e, n);
    refill(e, rate, cap, now_us);
    int64_t cur = atomic_load_explicit(&e->level, memory_order_relaxed);
    while (cur >= need) {
        /* Weak: a spurious failure just loops with the fresh level. Relaxed: vx_limits.h. */
        if (atomic_compare_exchange_weak_explicit(&e->level, &cur, cur - need,
                                                  memory_order_relaxed, memory_order_relaxed)) {
            atomic_fetch_add_explicit(&e->taken, n, memory_order_relaxed);
            return 0;
        }
    }
    /* A counter: relaxed (see vx_limits.h). */
    atomic_fetch_add_explicit(&e->refused, n, memory_order_relaxed);
    if (rate == 0)
        return VX_LIMITS_LEASE_WAIT_US;
    return (need - cur + rate - 1) / rate; /* ceil: >= 1 since need > cur */
}

int64_t vx_limits_give(vx_limits *l, int64_t i, int64_t n)
{
    if (n < 1)
        return 0;
    if (n > VX_LIMITS_MAX_TOKENS)
        n = VX_LIMITS_MAX_TOKENS;
    vx_limit *e = entry(l, i);
    int64_t rate, burst;
    unpack(atomic_load_explicit(&e->config, memory_order_acquire), &rate, &burst);
    (void)rate;
    int64_t added = add_capped(e, n * U, burst * U);
    /* Whole tokens: the level's fraction (a partial refill) may round one token down. */
    return added / U;
}

int64_t vx_limits_refund(vx_limits *l, int64_t i, int64_t n)
{
    if (n < 1)
        return 0;
    if (n > VX_LIMITS_MAX_TOKENS)
        n = VX_LIMITS_MAX_TOKENS;
    int64_t added = vx_limits_give(l, i, n);
    atomic_fetch_sub_explicit(&entry(l, i)->taken, n, memory_order_relaxed);
    return added;
}

void vx_limits_charge(vx_limits *l, int64_t i, int64_t n)
{
    if (n < 1)
        return;
    if (n > VX_LIMITS_MAX_TOKENS)
        n = VX_LIMITS_MAX_TOKENS;
    vx_limit *e = entry(l, i);
    const int64_t sub = n * U;
    int64_t cur = atomic_load_explicit(&e->level, memory_order_relaxed);
    for (;;) {
        int64_t next = cur - sub < DEBT_FLOOR ? DEBT_FLOOR : cur - sub;
        if (next >= cur) /* at the floor already: the debt stops growing */
            break;
        if (atomic_compare_exchange_weak_explicit(&e->level, &cur, next, memory_order_relaxed,
                                                  memory_order_relaxed))
            break;
    }
    atomic_fetch_add_explicit(&e->taken, n, memory_order_relaxed);
}

static int64_t floor_div(int64_t a, int64_t b)
{
    int64_t q = a / b;
    return (a % b != 0 && a < 0) ? q - 1 : q;
}

int64_t vx_limits_level(const vx_limits *l, int64_t i, int64_t now_us)
{
    const vx_limit *e = &l->e[i];
    int64_t rate, burst;
    unpack(atomic_load_explicit(&e->config, memory_order_acquire), &rate, &burst);
    const int64_t cap = burst * U;
    int64_t cur = atomic_load_explicit(&e->level, memory_order_relaxed);
    if (rate > 0 && cur < cap) {
        int64_t last = atomic_load_explicit(&e->last_us, memory_order_relaxed);
        int64_t pending = now_us > last ? now_us - last : 0;
        int64_t fill_us = (cap - cur) / rate + 1;
        if (pending > fill_us)
            pending = fill_us;
        cur += pending * rate;
        if (cur > cap)
            cur = cap;
    }
    return floor_div(cur, U);
}

int64_t vx_limits_taken(const vx_limits *l, int64_t i)
{
    return atomic_load_explicit(&l->e[i].taken, memory_order_relaxed);
}

bool vx_limits_enter(vx_limits *l, int64_t i, int64_t limit, int64_t slot)
{
    vx_limit *e = entry(l, i);
    if (limit <= 0) {
        atomic_fetch_add_explicit(&e->active, 1, memory_order_relaxed);
    } else {
        int64_t cur = atomic_load_explicit(&e->active, memory_order_relaxed);
        do {
            if (cur >= limit)
                return false;
            /* Relaxed: the gauge is self-contained (see vx_limits.h). */
        } while (!atomic_compare_exchange_weak_explicit(&e->active, &cur, cur + 1,
                                                        memory_order_relaxed,
                                                        memory_order_relaxed));
    }
    /* Only this slot's process writes its row while it lives: a plain fetch_add. */
    atomic_fetch_add_explicit(&vx_limits_held(l, slot)[i], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&e->entered, 1, memory_order_relaxed); /* a counter: relaxed */
    return true;
}

bool vx_limits_leave(vx_limits *l, int64_t i, int64_t slot)
{
    _Atomic int64_t *cell = &vx_limits_held(l, slot)[i];
    /* Single writer per row (the slot's own process), so load-then-subtract cannot race with
     * another leave of the same row. */
    if (atomic_load_explicit(cell, memory_order_relaxed) <= 0)
        return false;
    atomic_fetch_sub_explicit(cell, 1, memory_order_relaxed);
    atomic_fetch_sub_explicit(&entry(l, i)->active, 1, memory_order_relaxed);
    return true;
}

int64_t vx_limits_active(const vx_limits *l, int64_t i)
{
    return atomic_load_explicit(&l->e[i].active, memory_order_relaxed);
}

int64_t vx_limits_entered(const vx_limits *l, int64_t i)
{
    return atomic_load_explicit(&l->e[i].entered, memory_order_relaxed);
}

int64_t vx_limits_held_by(vx_limits *l, int64_t i, int64_t slot)
{
    return atomic_load_explicit(&vx_limits_held(l, slot)[i], memory_order_relaxed);
}

int64_t vx_limits_forget_slot(vx_limits *l, int64_t slot)
{
    _Atomic int64_t *row = vx_limits_held(l, slot);
    int64_t total = 0;
    for (int64_t i = 0; i < l->n; i++) {
        /* Cheap read first: most cells of a row are 0, and a write would dirty every line. */
        if (atomic_load_explicit(&row[i], memory_order_relaxed) == 0)
            continue;
        /* acq_rel: see vx_limits.h (the dead process's updates precede its reaping). */
        int64_t h = atomic_exchange_explicit(&row[i], 0, memory_order_acq_rel);
        if (h > 0) {
            atomic_fetch_sub_explicit(&l->e[i].active, h, memory_order_relaxed);
            total += h;
        }
    }
    return total;
}

int64_t vx_limits_admit(vx_limits *l, int64_t req_i, int64_t tok_i, int64_t tokens,
                        int64_t gauge_i, int64_t limit, int64_t slot, int64_t now_us,
                        int *reason, int64_t *left_req, int64_t *left_tok)
{
    int64_t wait;
    *left_req = *left_tok = 0;
    if (req_i >= 0 && (wait = vx_limits_take(l, req_i, 1, now_us)) != 0) {
        *reason = VX_ADMIT_REQUESTS;
        return wait;
    }
    if (tok_i >= 0 && tokens > 0 && (wait = vx_limits_take(l, tok_i, tokens, now_us)) != 0) {
        if (req_i >= 0)
            vx_limits_refund(l, req_i, 1);
        *reason = VX_ADMIT_TOKENS;
        return wait;
    }
    if (gauge_i >= 0 && !vx_limits_enter(l, gauge_i, limit, slot)) {
        if (req_i >= 0)
            vx_limits_refund(l, req_i, 1);
        if (tok_i >= 0 && tokens > 0)
            vx_limits_refund(l, tok_i, tokens);
        *reason = VX_ADMIT_PARALLEL;
        return VX_LIMITS_PARALLEL_WAIT_US;
    }
    *reason = VX_ADMIT_OK;
    /* What is left right after the takes (their refills are current: no projection needed).
     * Relaxed loads: a header value, approximate under concurrency by nature. */
    if (req_i >= 0) {
        int64_t units = atomic_load_explicit(&l->e[req_i].level, memory_order_relaxed);
        *left_req = units > 0 ? units / U : 0;
    }
    if (tok_i >= 0 && tokens > 0) {
        int64_t units = atomic_load_explicit(&l->e[tok_i].level, memory_order_relaxed);
        *left_tok = units > 0 ? units / U : 0;
    }
    return 0;
}
