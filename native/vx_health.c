/* vx_health: shared breakers, gauges, retry budget, hashes. See vx_health.h for the contract. */
#ifndef _GNU_SOURCE
/* clock_gettime and MAP_ANONYMOUS are POSIX/BSD extensions that -std=c11 hides. */
#define _GNU_SOURCE
#endif

#include "vx_health.h"

#include <errno.h>
#include <math.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

/* ------------------------------------------------------------------ breaker word */

#define ST_SHIFT 0
#define CNT_SHIFT 2
#define PRB_SHIFT 10
#define STK_SHIFT 16
#define TS_SHIFT 24

static inline int w_state(uint64_t w) { return (int)(w & 3u); }
static inline int64_t w_count(uint64_t w) { return (int64_t)((w >> CNT_SHIFT) & 0xffu); }
static inline int64_t w_probes(uint64_t w) { return (int64_t)((w >> PRB_SHIFT) & 0x3fu); }
static inline int64_t w_streak(uint64_t w) { return (int64_t)((w >> STK_SHIFT) & 0xffu); }
static inline int64_t w_stamp(uint64_t w) { return (int64_t)(w >> TS_SHIFT); }

static inline uint64_t w_make(int state, int64_t count, int64_t probes, int64_t streak,
                              int64_t stamp)
{
    if (count > 255)
        count = 255;
    if (streak > 255)
        streak = 255;
    return (uint64_t)state | (uint64_t)count << CNT_SHIFT | (uint64_t)probes << PRB_SHIFT |
           (uint64_t)streak << STK_SHIFT | (uint64_t)(stamp & VX_HEALTH_MAX_NOW_MS) << TS_SHIFT;
}

/* now_ms outside [0, 2^40) would not fit the stamp; clamp rather than wrap. */
static inline int64_t clamp_now(int64_t now_ms)
{
    return now_ms < 0 ? 0 : (now_ms > VX_HEALTH_MAX_NOW_MS ? VX_HEALTH_MAX_NOW_MS : now_ms);
}

int64_t vx_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

int vx_health_check_policy(const vx_health_policy *p)
{
    if (p->failures < 1 || p->failures > VX_HEALTH_MAX_COUNT)
        return 1;
    if (p->successes < 1 || p->successes > VX_HEALTH_MAX_COUNT)
        return 2;
    if (p->open_ms < 1 || p->open_ms > VX_HEALTH_MAX_OPEN_MS)
        return 3;
    if (p->max_open_ms < p->open_ms || p->max_open_ms > VX_HEALTH_MAX_OPEN_MS)
        return 4;
    if (p->probes < 1 || p->probes > VX_HEALTH_MAX_PROBES)
        return 5;
    if (p->probe_lease_ms < 1 || p->probe_lease_ms > VX_HEALTH_MAX_OPEN_MS)
        return 6;
    return 0;
}

vx_health *vx_health_create(int64_t n, const int64_t *max_in_flight, const vx_health_policy *p)
{
    if (n < 1 || n > VX_HEALTH_MAX_UPSTREAMS || p == NULL || vx_health_check_policy(p) != 0) {
        errno = EINVAL;
        return NULL;
    }
    for (int64_t i = 0; max_in_flight != NULL && i < n; i++) {
        if (max_in_flight[i] < 0) {
            errno = EINVAL;
            return NULL;
        }
    }
    size_t bytes = sizeof(vx_health) + (size_t)n * sizeof(vx_upstream);
    /* Anonymous + shared: fork() shares these pages instead of copying them. Fresh anonymous
     * pages are zero: CLOSED, no counts, no gauges. */
    void *mem = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED)
        return NULL;
    vx_health *h = mem;
    h->policy = *p;
    h->n = n;
    h->map_bytes = bytes;
    for (int64_t i = 0; i < n; i++) {
        vx_upstream *u = &h->up[i];
        /* Published to other threads/processes by thread creation or fork only. */
        atomic_init(&u->word, w_make(VX_BREAKER_CLOSED, 0, 0, 0, 0));
        atomic_init(&u->opened_at_ms, -1);
        atomic_init(&u->open_count, 0);
        atomic_init(&u->in_flight, 0);
        u->max_in_flight = max_in_flight != NULL ? max_in_flight[i] : 0;
        for (int f = 0; f < VX_UP_COUNTERS; f++)
            atomic_init(&u->counters[f], 0);
    }
    return h;
}

void vx_health_destroy(vx_health *h)
{
    if (h != NULL)
        munmap(h, h->map_bytes);
}

int64_t vx_breaker_open_ms(const vx_health *h, int64_t streak)
{
    int64_t ms = h->policy.open_ms, cap = h->policy.max_open_ms;
    for (int64_t k = 1; k < streak && ms < cap; k++)
        ms *= 2; /* at most 31 doublings before passing cap (both <= 2^31): no overflow */
    return ms < cap ? ms : cap;
}

static inline bool due(const vx_health *h, uint64_t w, int64_t now)
{
    return now - w_stamp(w) >= vx_breaker_open_ms(h, w_streak(w));
}

int vx_breaker_peek(const vx_health *h, int64_t i, int64_t now_ms)
{
    int64_t now = clamp_now(now_ms);
    uint64_t w = atomic_load_explicit(&h->up[i].word, memory_order_relaxed);
    switch (w_state(w)) {
    case VX_BREAKER_CLOSED:
        return VX_PEEK_CLOSED;
    case VX_BREAKER_OPEN:
        return due(h, w, now) ? VX_PEEK_PROBE : VX_PEEK_OPEN;
    default:
        if (w_probes(w) < h->policy.probes || now - w_stamp(w) >= h->policy.probe_lease_ms)
            return VX_PEEK_PROBE;
        return VX_PEEK_PROBING;
    }
}

int64_t vx_breaker_enter(vx_health *h, int64_t i, int64_t now_ms, int *tr)
{
    vx_upstream *u = &h->up[i];
    int64_t now = clamp_now(now_ms);
    if (tr != NULL)
        *tr = VX_TR_NONE;
    /* Relaxed throughout: the word is the whole state (see vx_health.h). */
    uint64_t w = atomic_load_explicit(&u->word, memory_order_relaxed);
    for (;;) {
        uint64_t next;
        int64_t ticket;
        switch (w_state(w)) {
        case VX_BREAKER_CLOSED:
            return VX_TICKET_CLOSED;
        case VX_BREAKER_OPEN:
            if (!due(h, w, now))
                return VX_TICKET_DENIED;
            /* Due: this caller turns it half-open and is its first probe. */
            next = w_make(VX_BREAKER_HALF_OPEN, 0, 1, w_streak(w), now);
            ticket = now + 1;
            break;
        default:
            if (w_probes(w) < h->policy.probes) {
                next = w + ((uint64_t)1 << PRB_SHIFT);
                ticket = w_stamp(w) + 1;
            } else if (now - w_stamp(w) >= h->policy.probe_lease_ms) {
                /* Every slot held past the lease: presume them lost and start over with a
                 * new stamp, so their late reports are ignored. */
                next = w_make(VX_BREAKER_HALF_OPEN, w_count(w), 1, w_streak(w), now);
                ticket = now + 1;
            } else {
                return VX_TICKET_DENIED;
            }
        }
        if (atomic_compare_exchange_weak_explicit(&u->word, &w, next, memory_order_relaxed,
                                                  memory_order_relaxed)) {
            if (tr != NULL && w_state(w) == VX_BREAKER_OPEN)
                *tr = VX_TR_HALF_OPENED; /* only the CAS winner gets here */
            return ticket;
        }
    }
}

static void note_opening(vx_upstream *u, int64_t now)
{
    atomic_store_explicit(&u->opened_at_ms, now, memory_order_relaxed);
    atomic_fetch_add_explicit(&u->open_count, 1, memory_order_relaxed);
}

int vx_breaker_report(vx_health *h, int64_t i, int64_t ticket, int outcome, int64_t now_ms)
{
    vx_upstream *u = &h->up[i];
    int64_t now = clamp_now(now_ms);
    uint64_t w = atomic_load_explicit(&u->word, memory_order_relaxed);
    for (;;) {
        uint64_t next;
        int tr = VX_TR_NONE;
        int st = w_state(w);
        if (st == VX_BREAKER_CLOSED) {
            /* Every report counts here, late probe reports included: they are evidence. */
            if (outcome == VX_OUTCOME_SUCCESS) {
                if (w_count(w) == 0)
                    return VX_TR_NONE; /* the common case: no write, the line stays shared */
                next = w_make(VX_BREAKER_CLOSED, 0, 0, w_streak(w), 0);
            } else if (outcome == VX_OUTCOME_FAILURE) {
                int64_t c = w_count(w) + 1;
                if (c >= h->policy.failures) {
                    next = w_make(VX_BREAKER_OPEN, 0, 0, w_streak(w) + 1, now);
                    tr = VX_TR_OPENED;
                } else {
                    next = w_make(VX_BREAKER_CLOSED, c, 0, w_streak(w), 0);
                }
            } else {
                return VX_TR_NONE;
            }
        } else if (st == VX_BREAKER_OPEN) {
            return VX_TR_NONE; /* answers of requests admitted before it opened */
        } else {
            if (ticket != w_stamp(w) + 1)
                return VX_TR_NONE; /* not a probe of this half-open period */
            int64_t probes = w_probes(w) > 0 ? w_probes(w) - 1 : 0;
            if (outcome == VX_OUTCOME_SUCCESS) {
                int64_t c = w_count(w) + 1;
                if (c >= h->policy.successes) {
                    next = w_make(VX_BREAKER_CLOSED, 0, 0, 0, 0);
                    tr = VX_TR_CLOSED;
                } else {
                    next = w_make(VX_BREAKER_HALF_OPEN, c, probes, w_streak(w), w_stamp(w));
                }
            } else if (outcome == VX_OUTCOME_FAILURE) {
                next = w_make(VX_BREAKER_OPEN, 0, 0, w_streak(w) + 1, now);
                tr = VX_TR_REOPENED;
            } else {
                next = w_make(VX_BREAKER_HALF_OPEN, w_count(w), probes, w_streak(w), w_stamp(w));
            }
        }
        if (atomic_compare_exchange_weak_explicit(&u->word, &w, next, memory_order_relaxed,
                                                  memory_order_relaxed)) {
            if (tr == VX_TR_OPENED || tr == VX_TR_REOPENED)
                note_opening(u, now); /* only the CAS winner gets here: one count per opening */
            return tr;
        }
    }
}

void vx_breaker_read(const vx_health *h, int64_t i, int64_t now_ms, vx_breaker_view *out)
{
    const vx_upstream *u = &h->up[i];
    int64_t now = clamp_now(now_ms);
    uint64_t w = atomic_load_explicit(&u->word, memory_order_relaxed);
    out->state = w_state(w);
    out->count = w_count(w);
    out->probes = w_probes(w);
    out->streak = w_streak(w);
    out->stamp_ms = w_stamp(w);
    out->opened_at_ms = atomic_load_explicit(&u->opened_at_ms, memory_order_relaxed);
    out->open_count = atomic_load_explicit(&u->open_count, memory_order_relaxed);
    out->until_half_open_ms = 0;
    if (out->state == VX_BREAKER_OPEN) {
        int64_t left = w_stamp(w) + vx_breaker_open_ms(h, w_streak(w)) - now;
        out->until_half_open_ms = left > 0 ? left : 0;
    }
}

/* ------------------------------------------------------------------ gauges and counters */

bool vx_inflight_acquire(vx_health *h, int64_t i)
{
    vx_upstream *u = &h->up[i];
    /* One fetch_add; over the cap, one fetch_sub gives it back. Readers may see the gauge one
     * above the cap for that moment per racer; admissions never pass it. Relaxed: a count. */
    int64_t old = atomic_fetch_add_explicit(&u->in_flight, 1, memory_order_relaxed);
    if (u->max_in_flight > 0 && old >= u->max_in_flight) {
        atomic_fetch_sub_explicit(&u->in_flight, 1, memory_order_relaxed);
        atomic_fetch_add_explicit(&u->counters[VX_UP_FULL], 1, memory_order_relaxed);
        return false;
    }
    return true;
}

void vx_inflight_release(vx_health *h, int64_t i)
{
    atomic_fetch_sub_explicit(&h->up[i].in_flight, 1, memory_order_relaxed);
}

int64_t vx_inflight(const vx_health *h, int64_t i)
{
    int64_t v = atomic_load_explicit(&h->up[i].in_flight, memory_order_relaxed);
    return v > 0 ? v : 0;
}

void vx_health_count(vx_health *h, int64_t i, int field, int64_t n)
{
    atomic_fetch_add_explicit(&h->up[i].counters[field], n, memory_order_relaxed);
}

int64_t vx_health_counter(const vx_health *h, int64_t i, int field)
{
    return atomic_load_explicit(&h->up[i].counters[field], memory_order_relaxed);
}

/* ------------------------------------------------------------------ retry budget */

#define CNT_MASK UINT64_C(0xffffffff)

static inline uint64_t tag_of(int64_t sec) { return (uint64_t)(sec + 1) << 32; }

vx_budget *vx_budget_create(int64_t percent, int64_t window_s, int64_t min_per_s)
{
    if (percent < 0 || percent > VX_BUDGET_MAX_PERCENT || window_s < 1 ||
        window_s > VX_BUDGET_MAX_WINDOW_S || min_per_s < 0 || min_per_s > VX_BUDGET_MAX_MIN_PER_S) {
        errno = EINVAL;
        return NULL;
    }
    size_t bytes = sizeof(vx_budget) + (size_t)window_s * sizeof(vx_budget_slot);
    void *mem = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED)
        return NULL;
    vx_budget *b = mem;
    atomic_init(&b->head_s, 0);
    b->percent = percent;
    b->window_s = window_s;
    b->min_per_s = min_per_s;
    b->map_bytes = bytes;
    for (int64_t k = 0; k < window_s; k++) {
        atomic_init(&b->slot[k].requests, 0); /* tag 0: belongs to no second */
        atomic_init(&b->slot[k].retries, 0);
    }
    return b;
}

void vx_budget_destroy(vx_budget *b)
{
    if (b != NULL)
        munmap(b, b->map_bytes);
}

/* The newest second seen, moved forward to sec if sec is newer; returns the second to charge.
 * seq_cst: this is the "store" half of the handshake in vx_budget_try_retry. */
static int64_t advance_head(vx_budget *b, int64_t sec)
{
    int64_t head = atomic_load_explicit(&b->head_s, memory_order_seq_cst);
    while (head < sec) {
        if (atomic_compare_exchange_weak_explicit(&b->head_s, &head, sec, memory_order_seq_cst,
                                                  memory_order_seq_cst))
            return sec;
    }
    return head;
}

/* Count of `word` if it belongs to sec, else 0. */
static inline int64_t count_for(uint64_t word, int64_t sec)
{
    return (word & ~CNT_MASK) == tag_of(sec) ? (int64_t)(word & CNT_MASK) : 0;
}

int64_t vx_budget_record_request(vx_budget *b, int64_t now_ms)
{
    int64_t sec = advance_head(b, now_ms < 0 ? 0 : now_ms / 1000);
    _Atomic uint64_t *cell = &b->slot[sec % b->window_s].requests;
    uint64_t w = atomic_load_explicit(cell, memory_order_relaxed);
    for (;;) {
        uint64_t tag = w & ~CNT_MASK, next;
        if (tag == tag_of(sec))
            next = (w & CNT_MASK) == CNT_MASK ? w : w + 1; /* saturate at 2^32-1 a second */
        else if (tag < tag_of(sec))
            next = tag_of(sec) | 1; /* the slot's previous second left the window: reuse */
        else
            return -1; /* a newer second owns the slot (the head moved a whole window during
                          this call): the request is not counted */
        /* Relaxed: request counts only ever raise what a retry may take (see try_retry). */
        if (atomic_compare_exchange_weak_explicit(cell, &w, next, memory_order_relaxed,
                                                  memory_order_relaxed))
            return sec;
    }
}

/* The handshake. A retry checks the past seconds of its window and then takes one unit from
 * the current second's slot with a CAS conditional on that slot's count, so grants to the
 * same second are serialised. What remains is a caller B that moved the head to second s and
 * read the slot of an earlier second s' while a caller A, still on s', was granting there:
 *     B: head := s   (seq_cst RMW)        A: slot[s'] += 1   (seq_cst CAS)
 *     B: read slot[s'] (seq_cst)          A: read head       (seq_cst)
 * In the single total order of seq_cst operations one of the two reads comes last and sees
 * the other's write: either B counts A's grant, or A sees head > s' and takes its grant back
 * and retries on the newer second. So every grant is counted by every later check of a
 * window containing it (a grant being undone may be counted too: conservative). */
int64_t vx_budget_try_retry(vx_budget *b, int64_t now_ms)
{
    const int64_t W = b->window_s;
    const int64_t reserve = 100 * b->min_per_s * W;
    int64_t own = now_ms < 0 ? 0 : now_ms / 1000;
    for (int round = 0; round < 8; round++) {
        int64_t sec = advance_head(b, own);
        int64_t requests = 0, past = 0;
        for (int64_t k = 0; k < W && k <= sec; k++) {
            vx_budget_slot *s = &b->slot[(sec - k) % W];
            requests += count_for(atomic_load_explicit(&s->requests, memory_order_seq_cst), sec - k);
            if (k > 0)
                past += count_for(atomic_load_explicit(&s->retries, memory_order_seq_cst), sec - k);
        }
        const int64_t allowance = b->percent * requests + reserve;
        _Atomic uint64_t *cell = &b->slot[sec % W].retries;
        uint64_t w = atomic_load_explicit(cell, memory_order_seq_cst);
        bool granted = false, stale = false;
        for (;;) {
            uint64_t tag = w & ~CNT_MASK;
            if (tag > tag_of(sec)) {
                stale = true; /* the head moved a whole window meanwhile: start over */
                break;
            }
            int64_t cur = tag == tag_of(sec) ? (int64_t)(w & CNT_MASK) : 0;
            if (100 * (past + cur + 1) > allowance)
                return -1;
            uint64_t next = tag_of(sec) | (uint64_t)(cur + 1);
            if (atomic_compare_exchange_weak_explicit(cell, &w, next, memory_order_seq_cst,
                                                      memory_order_seq_cst)) {
                granted = true;
                break;
            }
        }
        if (stale)
            continue;
        if (granted && atomic_load_explicit(&b->head_s, memory_order_seq_cst) == sec)
            return sec;
        /* A newer second began while we granted: give the unit back and decide again there.
         * The slot is still ours (the head moved less than W seconds, or it would have been
         * reused, which the tag check below notices). */
        w = atomic_load_explicit(cell, memory_order_seq_cst);
        while ((w & ~CNT_MASK) == tag_of(sec) && (w & CNT_MASK) > 0 &&
               !atomic_compare_exchange_weak_explicit(cell, &w, w - 1, memory_order_seq_cst,
                                                      memory_order_seq_cst)) {
        }
        own = atomic_load_explicit(&b->head_s, memory_order_seq_cst);
    }
    return -1; /* extreme contention around second boundaries: refusing is the safe answer */
}

void vx_budget_window(const vx_budget *b, int64_t now_ms, int64_t *requests, int64_t *retries)
{
    int64_t sec = now_ms < 0 ? 0 : now_ms / 1000;
    int64_t head = atomic_load_explicit(&b->head_s, memory_order_relaxed);
    if (head > sec)
        sec = head;
    *requests = 0;
    *retries = 0;
    for (int64_t k = 0; k < b->window_s && k <= sec; k++) {
        const vx_budget_slot *s = &b->slot[(sec - k) % b->window_s];
        *requests += count_for(atomic_load_explicit(&s->requests, memory_order_relaxed), sec - k);
        *retries += count_for(atomic_load_explicit(&s->retries, memory_order_relaxed), sec - k);
    }
}

/* ------------------------------------------------------------------ hashing */

/* Stafford's "mix13" variant of the murmur3 64-bit finaliser: full avalanche in 2 multiplies. */
static inline uint64_t mix64(uint64_t x)
{
    x ^= x >> 30;
    x *= UINT64_C(0xbf58476d1ce4e5b9);
    x ^= x >> 27;
    x *= UINT64_C(0x94d049bb133111eb);
    x ^= x >> 31;
    return x;
}

uint64_t vx_hash64(const void *data, size_t len, uint64_t seed)
{
    const unsigned char *p = data;
    uint64_t h = mix64(seed ^ (UINT64_C(0x9e3779b97f4a7c15) * (uint64_t)(len + 1)));
    while (len >= 8) {
        uint64_t v;
        memcpy(&v, p, 8); /* unaligned-safe; little-endian hosts give the same value */
        h = mix64(h ^ v) * UINT64_C(0x9e3779b97f4a7c15);
        p += 8;
        len -= 8;
    }
    uint64_t tail = 0;
    for (size_t k = 0; k < len; k++)
        tail |= (uint64_t)p[k] << (8 * k);
    return mix64(h ^ tail ^ ((uint64_t)len << 56));
}

void vx_hrw_rank(uint64_t key_hash, const uint64_t *seeds, const double *weights, size_t n,
                 uint32_t *order)
{
    double score[64];
    if (n > 64)
        n = 64;
    bool equal = true; /* equal weights: the order of the raw hashes is the same order */
    for (size_t i = 1; i < n; i++)
        equal = equal && weights[i] == weights[0];
    for (size_t i = 0; i < n; i++) {
        /* 53 random bits, +0.5 so u is in (0, 1): -ln(u) is finite and positive, and
         * w / -ln(u) grows with u, so with equal weights u alone ranks (no log needed). */
        double u = ((double)(mix64(key_hash ^ seeds[i]) >> 11) + 0.5) * 0x1p-53;
        score[i] = equal ? u : weights[i] / -log(u);
        /* Insertion sort, highest first: n is small (targets of one route). */
        size_t j = i;
        while (j > 0 && score[order[j - 1]] < score[i]) {
            order[j] = order[j - 1];
            j--;
        }
        order[j] = (uint32_t)i;
    }
}
