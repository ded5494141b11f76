/* vx_health: per-upstream circuit breakers, in-flight gauges and counters, a gateway-wide
 * retry budget, and the hashes the balancer uses. Plain C11, no Python.
 *
 * Like vx_bucket, every piece lives in an anonymous MAP_SHARED mapping: created by the
 * supervisor before fork(), it is ONE state for every worker, so the failures one worker sees
 * protect the requests of all the others. Time is passed in as `now_ms` (CLOCK_MONOTONIC
 * milliseconds, vx_now_ms) so tests drive the clock.
 *
 * Breaker. One 64-bit atomic word per upstream holds the whole state machine, so every
 * transition is one CAS and two processes can never both perform the same transition:
 *
 *     bits  0..1   state: CLOSED, OPEN, HALF_OPEN
 *     bits  2..9   count: consecutive failures (CLOSED) or probe successes (HALF_OPEN), <= 255
 *     bits 10..15  probes in flight (HALF_OPEN), <= 63
 *     bits 16..23  streak: consecutive openings without a close (for the doubling), <= 255
 *     bits 24..63  stamp, ms: when it opened (OPEN) or became half-open (HALF_OPEN); 2^40 ms
 *                  is 34 years of uptime
 *
 *   CLOSED --`failures` consecutive failures--> OPEN (streak+1; the CAS winner alone counts
 *   the opening) --after open_ms * 2^(streak-1), at most max_open_ms--> HALF_OPEN, entered
 *   lazily by the first vx_breaker_enter that finds the time up; it becomes the first probe.
 *   HALF_OPEN admits up to `probes` requests at once; `successes` probe successes --> CLOSED
 *   (streak 0); one probe failure --> OPEN again with the next, doubled, time. A probe that
 *   is never reported (its process died) is presumed lost after probe_lease_ms since the
 *   half-open stamp: the next caller takes over as a fresh probe.
 *
 *   vx_breaker_enter returns a ticket: 0 for a request admitted while CLOSED, stamp + 1 for a
 *   probe. vx_breaker_report takes it back with the outcome; a probe ticket whose half-open
 *   period is over (stamp changed) and any report while OPEN are ignored, so late answers
 *   never move the state of a later period. A NEUTRAL outcome (client left, gateway refused)
 *   only gives the probe slot back.
 *
 * Memory orders. The breaker word is self-contained: all of the state is in it, no plain data
 * is published through it, so its loads and CASes are relaxed (atomic RMWs have one
 * modification order whatever the order argument). opened_at_ms and open_count are reports
 * written by the opener after its CAS, relaxed: a reader may see them a moment late. The
 * in-flight gauge and the counters are relaxed fetch_adds. The retry budget alone needs
 * seq_cst (see vx_budget_try_retry in vx_health.c: a store-then-load handshake).
 */
#ifndef VX_HEALTH_H
#define VX_HEALTH_H

#include <stdalign.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define VX_HEALTH_LINE 64
#define VX_HEALTH_MAX_UPSTREAMS 4096
#define VX_HEALTH_MAX_COUNT 255    /* failures / successes thresholds */
#define VX_HEALTH_MAX_PROBES 63
#define VX_HEALTH_MAX_OPEN_MS (INT64_C(1) << 31) /* 24.8 days */
#define VX_HEALTH_MAX_NOW_MS ((INT64_C(1) << 40) - 1)

enum { VX_BREAKER_CLOSED = 0, VX_BREAKER_OPEN = 1, VX_BREAKER_HALF_OPEN = 2 };

/* vx_breaker_peek: what a request arriving now would get, without taking anything. */
enum {
    VX_PEEK_CLOSED = 0,  /* admitted */
    VX_PEEK_PROBE = 1,   /* admitted as a probe (half-open with a free slot, or open and due) */
    VX_PEEK_OPEN = 2,    /* refused: open, not yet due */
    VX_PEEK_PROBING = 3, /* refused: half-open, every probe slot taken */
};

#define VX_TICKET_DENIED INT64_C(-1)
#define VX_TICKET_CLOSED INT64_C(0)

enum { VX_OUTCOME_SUCCESS = 0, VX_OUTCOME_FAILURE = 1, VX_OUTCOME_NEUTRAL = 2 };

/* What vx_breaker_report (and vx_breaker_enter, through its `tr`) did. Each transition is
 * made by one CAS, so exactly one caller, in any process, is told of it. */
enum {
    VX_TR_NONE = 0,       /* no transition (counted, or ignored) */
    VX_TR_OPENED = 1,     /* CLOSED -> OPEN: this caller is the one opener */
    VX_TR_REOPENED = 2,   /* HALF_OPEN -> OPEN */
    VX_TR_CLOSED = 3,     /* HALF_OPEN -> CLOSED */
    VX_TR_HALF_OPENED = 4 /* OPEN -> HALF_OPEN (vx_breaker_enter: this caller is its probe) */
};

/* Per-upstream counters (only grow). */
enum {
    VX_UP_REQUESTS = 0,  /* attempts sent */
    VX_UP_SUCCESSES = 1,
    VX_UP_FAILURES = 2,  /* upstream-caused */
    VX_UP_RETRIES = 3,   /* attempts that were retries */
    VX_UP_PANICS = 4,    /* attempts sent in panic mode (every breaker open) */
    VX_UP_FULL = 5,      /* refused: max_in_flight reached */
    VX_UP_COUNTERS = 6,
};

typedef struct vx_health_policy {
    int64_t failures;       /* [1, 255] consecutive failures that open */
    int64_t successes;      /* [1, 255] probe successes that close */
    int64_t open_ms;        /* [1, 2^31] first opening */
    int64_t max_open_ms;    /* [open_ms, 2^31] cap on the doubling */
    int64_t probes;         /* [1, 63] probes at once while half-open */
    int64_t probe_lease_ms; /* [1, 2^31] a probe unreported this long is presumed lost */
} vx_health_policy;

typedef struct vx_upstream {
    /* Read by every pick, written only on transitions and by failure counts. */
    alignas(VX_HEALTH_LINE) _Atomic uint64_t word;
    _Atomic int64_t opened_at_ms; /* report: the last opening (-1: never) */
    _Atomic int64_t open_count;   /* report: openings so far */
    /* Written twice per request. */
    alignas(VX_HEALTH_LINE) _Atomic int64_t in_flight;
    int64_t max_in_flight; /* read-only after creation; 0: no cap */
    alignas(VX_HEALTH_LINE) _Atomic int64_t counters[VX_UP_COUNTERS];
} vx_upstream;

typedef struct vx_health {
    vx_health_policy policy; /* read-only after creation */
    int64_t n;
    size_t map_bytes;
    alignas(VX_HEALTH_LINE) vx_upstream up[];
} vx_health;

_Static_assert(ATOMIC_LLONG_LOCK_FREE == 2 && ATOMIC_LONG_LOCK_FREE == 2,
               "shared-memory atomics must be lock-free to work across processes");
_Static_assert(sizeof(_Atomic uint64_t) == 8, "atomics stored inline");
_Static_assert(sizeof(vx_upstream) == 3 * VX_HEALTH_LINE, "three lines per upstream");
_Static_assert(offsetof(vx_upstream, in_flight) == VX_HEALTH_LINE, "gauge on its own line");
_Static_assert(offsetof(vx_upstream, counters) == 2 * VX_HEALTH_LINE, "counters on their own");
_Static_assert(offsetof(vx_health, up) == VX_HEALTH_LINE, "upstreams start on a line");

/* A consistent snapshot of one breaker (decoded from one load of its word). */
typedef struct vx_breaker_view {
    int state;
    int64_t count;     /* consecutive failures (CLOSED) or probe successes (HALF_OPEN) */
    int64_t probes;    /* probes in flight (HALF_OPEN) */
    int64_t streak;    /* consecutive openings */
    int64_t stamp_ms;  /* opened (OPEN) / half-open since (HALF_OPEN); 0 when CLOSED */
    int64_t opened_at_ms;
    int64_t open_count;
    int64_t until_half_open_ms; /* OPEN: ms left (0 when due); otherwise 0 */
} vx_breaker_view;

/* CLOCK_MONOTONIC in milliseconds. */
int64_t vx_now_ms(void);

/* 0, or the 1-based position of the first out-of-range field of the policy (in the order of
 * the struct). */
int vx_health_check_policy(const vx_health_policy *p);

/* Map n upstream records (all CLOSED, gauges 0); max_in_flight[i] >= 0 (0: no cap), NULL for
 * no caps. NULL with errno EINVAL for bad arguments, or mmap's errno. */
vx_health *vx_health_create(int64_t n, const int64_t *max_in_flight, const vx_health_policy *p);
void vx_health_destroy(vx_health *h); /* NULL accepted; this process's view only */

/* Open time for the streak-th consecutive opening (streak >= 1). */
int64_t vx_breaker_open_ms(const vx_health *h, int64_t streak);

int vx_breaker_peek(const vx_health *h, int64_t i, int64_t now_ms);
/* VX_TICKET_DENIED, VX_TICKET_CLOSED, or a probe ticket (> 0). *tr (unless tr is NULL) is
 * set to VX_TR_HALF_OPENED when this call turned the breaker half-open, else VX_TR_NONE. */
int64_t vx_breaker_enter(vx_health *h, int64_t i, int64_t now_ms, int *tr);
/* One of VX_TR_*. `outcome` is VX_OUTCOME_*; anything else is treated as NEUTRAL. */
int vx_breaker_report(vx_health *h, int64_t i, int64_t ticket, int outcome, int64_t now_ms);
void vx_breaker_read(const vx_health *h, int64_t i, int64_t now_ms, vx_breaker_view *out);

/* in_flight += 1 unless that passes max_in_flight; true when taken. */
bool vx_inflight_acquire(vx_health *h, int64_t i);
void vx_inflight_release(vx_health *h, int64_t i);
int64_t vx_inflight(const vx_health *h, int64_t i);

void vx_health_count(vx_health *h, int64_t i, int field, int64_t n);
int64_t vx_health_counter(const vx_health *h, int64_t i, int field);

/* ------------------------------------------------------------------ retry budget
 *
 * Seconds are now_ms / 1000. The budget keeps, for each of the last W = window_s seconds, the
 * requests and the retries charged to it (one slot per second, reused every W seconds; each
 * count shares its word with the second it belongs to, so reuse is one CAS).
 *
 * Guarantee: a retry is granted at second s only if, counting it,
 *     100 * retries(s-W+1 .. s) <= percent * requests(s-W+1 .. s) + 100 * min_per_s * W
 * where the sums run over the W seconds ending at s (the current one included). Every retry
 * granted to an earlier second of that window is visible to the check (see the .c), so the
 * inequality holds for the final counts of every window that ends in a second with a grant,
 * however many threads and processes race. A caller whose clock lags the newest second seen
 * is charged to that newest second.
 */
#define VX_BUDGET_MAX_WINDOW_S 3600
#define VX_BUDGET_MAX_PERCENT 1000
#define VX_BUDGET_MAX_MIN_PER_S 1000000

typedef struct vx_budget_slot {
    _Atomic uint64_t requests; /* (second + 1) << 32 | count */
    _Atomic uint64_t retries;
} vx_budget_slot;

typedef struct vx_budget {
    alignas(VX_HEALTH_LINE) _Atomic int64_t head_s; /* newest second seen */
    alignas(VX_HEALTH_LINE) int64_t percent;        /* read-only after creation */
    int64_t window_s;
    int64_t min_per_s;
    size_t map_bytes;
    alignas(VX_HEALTH_LINE) vx_budget_slot slot[];
} vx_budget;

_Static_assert(offsetof(vx_budget, percent) == VX_HEALTH_LINE, "head on its own line");
_Static_assert(offsetof(vx_budget, slot) == 2 * VX_HEALTH_LINE, "slots start on a line");

/* NULL with errno EINVAL when an argument is outside [0|1, VX_BUDGET_MAX_*]. */
vx_budget *vx_budget_create(int64_t percent, int64_t window_s, int64_t min_per_s);
void vx_budget_destroy(vx_budget *b);
/* Count one request; returns the second it was charged to, or -1 in the rare case it was not
 * counted (the newest second moved a whole window ahead during the call). */
int64_t vx_budget_record_request(vx_budget *b, int64_t now_ms);
/* The second the retry was charged to, or -1 when the budget refuses it. */
int64_t vx_budget_try_retry(vx_budget *b, int64_t now_ms);
/* Requests and retries over the window ending at now_ms's second (a metric). */
void vx_budget_window(const vx_budget *b, int64_t now_ms, int64_t *requests, int64_t *retries);

/* ------------------------------------------------------------------ hashing */

/* A fast, stable (across processes, runs and machines) 64-bit hash of bytes. */
uint64_t vx_hash64(const void *data, size_t len, uint64_t seed);
/* Weighted rendezvous hashing: order[0..n) gets 0..n-1 sorted by score, highest first, where
 * score_i = weight_i / -ln(u_i) and u_i in (0, 1) comes from mixing key_hash with seeds[i].
 * Target i wins with probability weight_i / sum(weights); removing a target moves only the
 * keys it held. n <= 64, weights > 0. */
void vx_hrw_rank(uint64_t key_hash, const uint64_t *seeds, const double *weights, size_t n,
                 uint32_t *order);

#endif /* VX_HEALTH_H */
