/* vx_limits: n token buckets and n concurrency gauges in one shared mapping. Plain C11, no
 * Python.
 *
 * The per-key (and per-upstream, and gateway-wide) limits of the gateway: the supervisor
 * creates ONE vx_limits before fork() and gives every key, upstream, ... its own index; the
 * table's owner assigns the indexes. Entry i is a token bucket (requests per minute, tokens per
 * minute) and a gauge of requests in flight (max_parallel). Like vx_bucket, everything lives in
 * an anonymous MAP_SHARED mapping, so the parent and every forked worker share one state.
 *
 * Bucket. Integer tokens; internally units, 1 token = VX_UNITS_PER_TOKEN units = the
 * number of microseconds in a minute, so a rate of r tokens per minute is exactly r units per
 * microsecond (no division, no remainder lost). Every take refills first, from the time it is
 * given (CLOCK_MONOTONIC microseconds, vx_limits_now_us): the count it draws from is never
 * stale, and time during which the bucket sat full is never credited later. The level may be
 * negative: `charge` takes unconditionally (over-use settled after the fact), and a bucket in
 * debt refuses every take until refills (or gives) have repaid it.
 * A bucket configured with rate 0 is LEASED: it never refills from the clock, only `give`
 * adds tokens (a Redis lease, see the multi-host mode), capped at burst like any other.
 * An index never configured has burst 0: every take answers "never".
 *
 * Exactness (what the tests check): tokens enter a bucket only through a refill, which credits
 * the interval (last_us, now] that it moved last_us across with one CAS (disjoint intervals,
 * last_us never moves back), and through give. Takes and charges are CAS / fetch-sub on the
 * level, which never goes above cap. So over any run, for a bucket configured once,
 *     taken - charged_debt_unpaid <= burst + rate * elapsed / 60e6 + given
 * with no slack however many threads and processes race.
 *
 * Gauge. `active` counts places held across the gateway; `held[slot][i]` counts the places
 * the process in worker slot `slot` holds, in a row of its own per slot (no false sharing
 * between workers, and forget_slot walks one contiguous row). enter() takes a place with a
 * CAS that never lets active exceed the limit, then counts it in its slot's row; leave()
 * undoes both. When a worker dies, the supervisor calls forget_slot(slot): every place the
 * dead process held is given back. Known window: a process killed between the CAS on active
 * and the increment of its row (two adjacent instructions) leaks that one place.
 *
 * Demand. A leased bucket is filled by a refresher that must know what the takers want, not
 * only what they got: `refused` counts the tokens of takes refused for want of tokens, and
 * `largest` holds the largest take asked since the refresher last popped it (so it can keep
 * enough for the next request of that size). Both are updated by take(); the largest costs a
 * relaxed load per take and a store only when a take is larger than any since the last pop.
 *
 * Memory orders. The level, last_us, taken, the demand and the gauges are each self-contained atomics:
 * no plain data is published through them, so their operations are relaxed (atomicity and
 * one modification order per variable is all the algorithm needs). One exception: configure()
 * moves last_us forward (so time spent LEASED or unconfigured is not credited by the first
 * refill with a clock rate) and then publishes the new config with a release store; takers
 * load the config with acquire, so a taker that sees the new rate also sees the new last_us.
 * forget_slot's exchange is acq_rel: the dead process's relaxed row updates reached memory
 * before its death was observed (process exit and waitpid are full barriers in practice; the
 * acquire documents the intent).
 *
 * Concurrency with configure(): configure is rare (start, reload, a Redis mode switch); a take
 * racing with it uses the old or the new (rate, burst) pair, never a mix (they are one word).
 */
#ifndef VX_LIMITS_H
#define VX_LIMITS_H

#include <stdalign.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "vx_units.h"
#define VX_LIMITS_LINE 64
#define VX_LIMITS_MAX_N 1000000            /* entries */
#define VX_LIMITS_MAX_SLOTS 4096           /* worker slots */
#define VX_LIMITS_MAX_RATE INT64_C(1000000000)  /* tokens per minute (fits 30 bits) */
#define VX_LIMITS_MAX_BURST INT64_C(1000000000) /* tokens (fits 30 bits) */
/* One give/charge/take moves at most this many tokens, and debt stops growing at this many
 * tokens: 1e10 * 6e7 = 6e17 units, so cap + debt + a refill's product stay far inside int64. */
#define VX_LIMITS_MAX_TOKENS INT64_C(10000000000)
#define VX_LIMITS_MAX_DEBT VX_LIMITS_MAX_TOKENS
/* What take() answers for a LEASED bucket short of tokens: no clock will fill it, the next
 * lease will (leases are sized to about a second's share). */
#define VX_LIMITS_LEASE_WAIT_US INT64_C(1000000)

/* take(): 0 taken; > 0 microseconds until n could be available (nothing taken); this: never. */
#define VX_LIMITS_NEVER INT64_C(-1)

typedef struct vx_limit {
    /* One line per entry: a request of a key touches its bucket and its gauge together. */
    alignas(VX_LIMITS_LINE) _Atomic int64_t level; /* units; < 0: debt */
    _Atomic int64_t last_us;                      /* refill credited up to this time */
    _Atomic uint64_t config;                      /* rate | burst << 32; 0: never configured */
    _Atomic int64_t taken;                        /* tokens taken or charged, minus refunds */
    _Atomic int64_t active;                       /* places held across the gateway */
    _Atomic int64_t entered;                      /* places ever taken (a counter) */
    /* Demand, for a LEASED bucket's refresher (which sees `taken` only for admitted takes): */
    _Atomic int64_t refused; /* tokens of takes refused for want of tokens (a counter) */
    _Atomic int64_t largest; /* the largest take asked since vx_limits_pop_largest (a gauge) */
} vx_limit;

typedef struct vx_limits {
    int64_t n;          /* entries */
    int64_t slots;      /* worker slots (rows of held) */
    int64_t row;        /* int64 cells per held row: n rounded up to a whole line */
    size_t map_bytes;   /* the whole mapping, for munmap */
    alignas(VX_LIMITS_LINE) vx_limit e[];
    /* followed by _Atomic int64_t held[slots][row], at vx_limits_held() */
} vx_limits;

_Static_assert(ATOMIC_LLONG_LOCK_FREE == 2 && ATOMIC_LONG_LOCK_FREE == 2,
               "shared-memory atomics must be lock-free to work across processes");
_Static_assert(sizeof(_Atomic int64_t) == sizeof(int64_t), "atomics stored inline");
_Static_assert(sizeof(_Atomic uint64_t) == sizeof(uint64_t), "atomics stored inline");
_Static_assert(sizeof(vx_limit) == VX_LIMITS_LINE, "one cache line per entry");
_Static_assert(offsetof(vx_limits, e) == VX_LIMITS_LINE, "entries start on their own line");
_Static_assert(VX_LIMITS_MAX_RATE < (INT64_C(1) << 32) && VX_LIMITS_MAX_BURST < (INT64_C(1) << 31),
               "rate and burst pack into one 64-bit config word");

/* CLOCK_MONOTONIC in microseconds (the same clock as vx_now_us). */
int64_t vx_limits_now_us(void);

/* Map n entries (all unconfigured, gauges 0) and slots rows of held places. NULL with errno
 * EINVAL for n or slots outside [1, MAX], or mmap's errno. The view is this process's;
 * forked children inherit the same shared state and release their own view the same way. */
vx_limits *vx_limits_create(int64_t n, int64_t slots);
/* The same on a memfd: its descriptor is stored in *fd (the caller closes it), for another
 * process to map with vx_limits_attach (fd NULL: anonymous, as vx_limits_create). */
vx_limits *vx_limits_create_fd(int64_t n, int64_t slots, int *fd);
/* Map the limits another process made with vx_limits_create_fd, from its descriptor (kept
 * the caller's). NULL with errno EINVAL when the file is not a whole vx_limits. */
vx_limits *vx_limits_attach(int fd);
void vx_limits_destroy(vx_limits *l); /* NULL accepted */

/* The row of held places of a slot (n cells, then padding). */
_Atomic int64_t *vx_limits_held(vx_limits *l, int64_t slot);

/* Set entry i's rate (tokens per minute, 0 = leased: no clock refill) and burst (>= 1).
 * The first configure of an entry starts it full (rate > 0) or empty (leased); a later one
 * first credits the time up to now_us at the old rate, then keeps the level, capped at the
 * new burst (debt is kept). false (and nothing changed) for arguments out of range. */
bool vx_limits_configure(vx_limits *l, int64_t i, int64_t rate_per_minute, int64_t burst,
                         int64_t now_us);

/* rate and burst of entry i (0, 0 when never configured). */
void vx_limits_config(const vx_limits *l, int64_t i, int64_t *rate_per_minute, int64_t *burst);

/* Take n tokens at once, or none. 0: taken. > 0: microseconds until n could be there (for a
 * leased bucket VX_LIMITS_LEASE_WAIT_US). VX_LIMITS_NEVER: n > burst. n < 1: 0, nothing taken. */
int64_t vx_limits_take(vx_limits *l, int64_t i, int64_t n, int64_t now_us);

/* Add n tokens (a deposit: a lease), the level capped at burst. Returns the tokens actually
 * added (less than n when the cap was reached). `taken` is not changed. */
int64_t vx_limits_give(vx_limits *l, int64_t i, int64_t n);

/* give() of tokens taken earlier and not used: also subtracts n from `taken`. */
int64_t vx_limits_refund(vx_limits *l, int64_t i, int64_t n);

/* Take n tokens unconditionally: the level may go negative (debt), down to -MAX_DEBT. */
void vx_limits_charge(vx_limits *l, int64_t i, int64_t n);

/* Whole tokens at now_us (pending refill included, capped at burst; floor, so debt reads
 * negative). Read-only; approximate under concurrency (a header, a metric). */
int64_t vx_limits_level(const vx_limits *l, int64_t i, int64_t now_us);

/* Cumulative tokens taken or charged, minus refunds. */
int64_t vx_limits_taken(const vx_limits *l, int64_t i);

/* Cumulative tokens of the takes refused because the bucket was short (not those larger than
 * its burst): demand that `taken` does not show. */
int64_t vx_limits_refused(const vx_limits *l, int64_t i);

/* The largest take asked of bucket i (admitted or refused) since the last call, and reset
 * it to 0. One reader (the host's lease refresher). */
int64_t vx_limits_pop_largest(vx_limits *l, int64_t i);

/* Credit the time since the last refill to entry i (exposed for tests; take calls it). */
void vx_limits_refill(vx_limits *l, int64_t i, int64_t now_us);

/* What vx_limits_admit refused on. */
enum { VX_ADMIT_OK = 0, VX_ADMIT_REQUESTS = 1, VX_ADMIT_TOKENS = 2, VX_ADMIT_PARALLEL = 3 };
/* vx_limits_admit's wait for a full gauge: places come back as requests end, at no known
 * time; a second is what Retry-After says. */
#define VX_LIMITS_PARALLEL_WAIT_US INT64_C(1000000)

/* One admission in one call (the keys stage's per-request path): take 1 from bucket req_i
 * (skipped when req_i < 0), then `tokens` from bucket tok_i (skipped when tok_i < 0 or
 * tokens < 1), then a place of gauge gauge_i with `limit` for `slot` (skipped when
 * gauge_i < 0). All or nothing: a refusal gives back what the earlier steps took (refund).
 * Returns 0 and *reason VX_ADMIT_OK when admitted; else the refusing step's wait (as take(),
 * VX_LIMITS_PARALLEL_WAIT_US for the gauge) and *reason says which step refused. When
 * admitted, *left_req and *left_tok are the whole tokens left in buckets req_i and tok_i
 * (0 for a skipped step; never negative): the x-ratelimit-remaining-* headers. */
int64_t vx_limits_admit(vx_limits *l, int64_t req_i, int64_t tok_i, int64_t tokens,
                        int64_t gauge_i, int64_t limit, int64_t slot, int64_t now_us,
                        int *reason, int64_t *left_req, int64_t *left_tok);

/* Take one place of gauge i for the process in `slot`: false (nothing taken) when `limit`
 * places are held already. limit <= 0: no limit (the gauge only counts). */
bool vx_limits_enter(vx_limits *l, int64_t i, int64_t limit, int64_t slot);

/* Give back a place this slot took. false (nothing changed) when the slot holds none of
 * gauge i: a second leave for one enter is harmless. */
bool vx_limits_leave(vx_limits *l, int64_t i, int64_t slot);

/* Places held across the gateway, and by one slot; places ever taken. */
int64_t vx_limits_active(const vx_limits *l, int64_t i);
int64_t vx_limits_entered(const vx_limits *l, int64_t i);
int64_t vx_limits_held_by(vx_limits *l, int64_t i, int64_t slot);

/* Give back every place the (dead) process in `slot` held; returns how many. Call it only
 * when no process runs in that slot (after waitpid, before a new worker starts there). */
int64_t vx_limits_forget_slot(vx_limits *l, int64_t slot);

#endif /* VX_LIMITS_H */
