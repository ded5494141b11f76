/* test_limits: vx_limits with an injected clock.
 *
 * Bad input; exact refill arithmetic and wait hints; debt (charge) refusing until repaid;
 * leased buckets (rate 0) filled only by give; reconfiguration (keeps the level, caps it, does
 * not credit leased time); gauges with per-slot rows and forget_slot; and exactness under
 * contention: threads and forked processes on a frozen clock admit exactly `burst` tokens,
 * threads on a shared fake clock satisfy
 *     taken + level (pending refill included) == burst + rate * elapsed   (to the unit),
 * and threads entering/leaving a gauge never hold more than its limit at once.
 * Exit status 0 when every check passes.
 */
#include "vx_limits.h"
#include "check.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#define U VX_UNITS_PER_TOKEN
#define T0 INT64_C(1000000000000) /* an arbitrary "boot + 11.6 days" in microseconds */

static int64_t units_of(vx_limits *l, int64_t i)
{
    return atomic_load_explicit(&l->e[i].level, memory_order_relaxed);
}

static void test_bad_input(void)
{
    errno = 0;
    CHECK(vx_limits_create(0, 1) == NULL && errno == EINVAL);
    errno = 0;
    CHECK(vx_limits_create(1, 0) == NULL && errno == EINVAL);
    errno = 0;
    CHECK(vx_limits_create(VX_LIMITS_MAX_N + 1, 1) == NULL && errno == EINVAL);
    errno = 0;
    CHECK(vx_limits_create(1, VX_LIMITS_MAX_SLOTS + 1) == NULL && errno == EINVAL);
    vx_limits *l = vx_limits_create(3, 2);
    CHECK(l != NULL);
    if (l == NULL)
        return;
    CHECK(l->row == 8); /* 3 cells padded to a whole line */
    int64_t rate = 7, burst = 7;
    vx_limits_config(l, 0, &rate, &burst);
    CHECK(rate == 0 && burst == 0);
    /* Unconfigured: every take is "never"; give adds nothing (burst 0). */
    CHECK(vx_limits_take(l, 0, 1, T0) == VX_LIMITS_NEVER);
    CHECK(vx_limits_give(l, 0, 5) == 0);
    CHECK(vx_limits_level(l, 0, T0) == 0);
    CHECK(!vx_limits_configure(l, 3, 60, 10, T0));  /* index */
    CHECK(!vx_limits_configure(l, -1, 60, 10, T0));
    CHECK(!vx_limits_configure(l, 0, -1, 10, T0)); /* rate */
    CHECK(!vx_limits_configure(l, 0, VX_LIMITS_MAX_RATE + 1, 10, T0));
    CHECK(!vx_limits_configure(l, 0, 60, 0, T0)); /* burst */
    CHECK(!vx_limits_configure(l, 0, 60, VX_LIMITS_MAX_BURST + 1, T0));
    vx_limits_config(l, 0, &rate, &burst);
    CHECK(rate == 0 && burst == 0);
    CHECK(vx_limits_configure(l, 0, 60, 10, T0));
    CHECK(vx_limits_take(l, 0, 11, T0) == VX_LIMITS_NEVER);
    CHECK(vx_limits_take(l, 0, 0, T0) == 0 && vx_limits_take(l, 0, -4, T0) == 0);
    CHECK(vx_limits_level(l, 0, T0) == 10 && vx_limits_taken(l, 0) == 0);
    vx_limits_charge(l, 0, 0);
    vx_limits_charge(l, 0, -3);
    CHECK(vx_limits_give(l, 0, 0) == 0 && vx_limits_refund(l, 0, -1) == 0);
    CHECK(vx_limits_level(l, 0, T0) == 10 && vx_limits_taken(l, 0) == 0);
    vx_limits_destroy(l);
    vx_limits_destroy(NULL);
}

static void test_refill_exact(void)
{
    vx_limits *l = vx_limits_create(2, 1);
    if (l == NULL) {
        failures++;
        return;
    }
    CHECK(vx_limits_configure(l, 1, 60, 10, T0)); /* 1 token per second, starts full */
    CHECK(vx_limits_take(l, 1, 10, T0) == 0);
    CHECK(vx_limits_taken(l, 1) == 10);
    CHECK(vx_limits_take(l, 1, 1, T0) == 1000000);
    CHECK(vx_limits_take(l, 1, 2, T0) == 2000000);
    CHECK(vx_limits_take(l, 1, 1, T0 + 999999) == 1); /* 60 units short of a token */
    CHECK(units_of(l, 1) == U - 60);
    CHECK(vx_limits_take(l, 1, 1, T0 + 1000000) == 0); /* the remainder was kept */
    CHECK(units_of(l, 1) == 0);
    CHECK(vx_limits_level(l, 1, T0 + 4500000) == 3); /* 3.5 s: three whole tokens */
    CHECK(vx_limits_take(l, 1, 3, T0 + 4500000) == 0);
    CHECK(vx_limits_take(l, 1, 1, T0 + 4500000) == 500000);
    /* A long idle period refills to the cap and not beyond. */
    CHECK(vx_limits_level(l, 1, T0 + INT64_C(3600000000)) == 10);
    CHECK(vx_limits_take(l, 1, 10, T0 + INT64_C(3600000000)) == 0);
    CHECK(vx_limits_take(l, 1, 1, T0 + INT64_C(3600000000)) > 0);
    /* The clock going back mints nothing. */
    CHECK(vx_limits_take(l, 1, 1, T0) == 1000000);
    CHECK(vx_limits_take(l, 1, 1, INT64_MIN) > 0);
    CHECK(units_of(l, 1) == 0);
    /* Entry 0 was untouched by all of it. */
    CHECK(vx_limits_take(l, 0, 1, T0) == VX_LIMITS_NEVER);
    vx_limits_destroy(l);
}

static void test_debt(void)
{
    vx_limits *l = vx_limits_create(1, 1);
    if (l == NULL) {
        failures++;
        return;
    }
    CHECK(vx_limits_configure(l, 0, 600, 100, T0)); /* 10 tokens per second */
    CHECK(vx_limits_take(l, 0, 40, T0) == 0);
    vx_limits_charge(l, 0, 100); /* the answer used 100 more than reserved */
    CHECK(vx_limits_level(l, 0, T0) == -40);
    CHECK(vx_limits_taken(l, 0) == 140);
    /* In debt: even one token waits until 41 tokens have refilled (4.1 s). */
    CHECK(vx_limits_take(l, 0, 1, T0) == 4100000);
    CHECK(vx_limits_take(l, 0, 1, T0 + 4099999) == 1);
    CHECK(vx_limits_take(l, 0, 1, T0 + 4100000) == 0);
    CHECK(vx_limits_level(l, 0, T0 + 4100000) == 0);
    /* A refund of an unused reservation: level back, taken down. */
    CHECK(vx_limits_take(l, 0, 1, T0 + 4200000) == 0);
    CHECK(vx_limits_refund(l, 0, 1) == 1);
    CHECK(vx_limits_taken(l, 0) == 141);
    /* Refunds and gives are capped at burst. */
    CHECK(vx_limits_give(l, 0, 1000) == 99);
    CHECK(vx_limits_level(l, 0, T0 + 4200000) == 100);
    /* Debt stops at the floor: no wrap however much is charged. */
    for (int k = 0; k < 5; k++)
        vx_limits_charge(l, 0, VX_LIMITS_MAX_TOKENS);
    CHECK(units_of(l, 0) == -VX_LIMITS_MAX_DEBT * U);
    CHECK(vx_limits_level(l, 0, T0 + 4200000) == -VX_LIMITS_MAX_DEBT);
    CHECK(vx_limits_take(l, 0, 1, T0 + 4200000) > 0);
    /* The refill of a deep debt does not overflow: 2000 years later (debt paid after ~32) the
     * bucket is full. */
    CHECK(vx_limits_take(l, 0, 100, T0 + INT64_C(365) * 86400 * 1000000 * 2000) == 0);
    vx_limits_destroy(l);
}

static void test_leased(void)
{
    vx_limits *l = vx_limits_create(1, 1);
    if (l == NULL) {
        failures++;
        return;
    }
    CHECK(vx_limits_configure(l, 0, 0, 50, T0)); /* leased: starts empty, no clock refill */
    CHECK(vx_limits_level(l, 0, T0 + 3600000000) == 0);
    CHECK(vx_limits_take(l, 0, 1, T0 + 3600000000) == VX_LIMITS_LEASE_WAIT_US);
    CHECK(vx_limits_take(l, 0, 51, T0) == VX_LIMITS_NEVER);
    CHECK(vx_limits_give(l, 0, 30) == 30);
    CHECK(vx_limits_take(l, 0, 20, T0 + 7200000000) == 0);
    CHECK(vx_limits_take(l, 0, 20, T0 + 7200000000) == VX_LIMITS_LEASE_WAIT_US);
    CHECK(vx_limits_level(l, 0, T0 + 7200000000) == 10);
    CHECK(vx_limits_give(l, 0, 100) == 40); /* capped at burst */
    CHECK(vx_limits_taken(l, 0) == 20);
    /* Leased -> clock rate: the hour spent leased is not credited; the level is kept. */
    CHECK(vx_limits_take(l, 0, 45, T0 + 7200000000) == 0); /* level 5 */
    CHECK(vx_limits_configure(l, 0, 60, 50, T0 + 10800000000));
    CHECK(vx_limits_level(l, 0, T0 + 10800000000) == 5);
    CHECK(vx_limits_level(l, 0, T0 + 10802000000) == 7); /* then 1 per second */
    /* Clock rate -> smaller burst: the time up to now is credited at the old rate, then the
     * level is capped at the new burst. */
    CHECK(vx_limits_configure(l, 0, 60, 3, T0 + 10810000000));
    CHECK(vx_limits_level(l, 0, T0 + 10810000000) == 3);
    int64_t rate, burst;
    vx_limits_config(l, 0, &rate, &burst);
    CHECK(rate == 60 && burst == 3);
    /* -> leased again: the level is kept, and no longer grows. */
    CHECK(vx_limits_configure(l, 0, 0, 3, T0 + 10811000000));
    CHECK(vx_limits_level(l, 0, T0 + 20000000000) == 3);
    vx_limits_destroy(l);
}

/* What a leased bucket's refresher reads besides `taken`: the tokens of refused takes (a
 * counter) and the largest take asked since its last look (a gauge it pops). */
static void test_demand(void)
{
    vx_limits *l = vx_limits_create(2, 1);
    if (l == NULL) {
        failures++;
        return;
    }
    CHECK(vx_limits_configure(l, 0, 0, 2000, T0)); /* leased, empty */
    CHECK(vx_limits_refused(l, 0) == 0 && vx_limits_pop_largest(l, 0) == 0);
    CHECK(vx_limits_take(l, 0, 1043, T0) == VX_LIMITS_LEASE_WAIT_US);
    CHECK(vx_limits_take(l, 0, 7, T0) == VX_LIMITS_LEASE_WAIT_US);
    CHECK(vx_limits_take(l, 0, 2001, T0) == VX_LIMITS_NEVER); /* never: no demand it can meet */
    CHECK(vx_limits_refused(l, 0) == 1050 && vx_limits_taken(l, 0) == 0);
    CHECK(vx_limits_pop_largest(l, 0) == 1043 && vx_limits_pop_largest(l, 0) == 0);
    CHECK(vx_limits_give(l, 0, 1035) == 1035);
    CHECK(vx_limits_take(l, 0, 8, T0) == 0); /* admitted: largest, not refused */
    CHECK(vx_limits_take(l, 0, 1043, T0) == VX_LIMITS_LEASE_WAIT_US);
    CHECK(vx_limits_refused(l, 0) == 2093 && vx_limits_taken(l, 0) == 8);
    CHECK(vx_limits_pop_largest(l, 0) == 1043);
    /* admit: the refusing bucket counts the demand; the refunded one does not. */
    CHECK(vx_limits_configure(l, 1, 60, 5, T0));
    int reason;
    int64_t left_req, left_tok;
    CHECK(vx_limits_admit(l, 1, 0, 2000, -1, 0, 0, T0, &reason, &left_req, &left_tok) > 0);
    CHECK(reason == VX_ADMIT_TOKENS && vx_limits_refused(l, 0) == 4093);
    CHECK(vx_limits_refused(l, 1) == 0 && vx_limits_taken(l, 1) == 0);
    CHECK(vx_limits_pop_largest(l, 1) == 1 && vx_limits_pop_largest(l, 0) == 2000);
    vx_limits_destroy(l);
}

static void test_gauges(void)
{
    vx_limits *l = vx_limits_create(10, 3);
    if (l == NULL) {
        failures++;
        return;
    }
    CHECK(vx_limits_enter(l, 4, 2, 0));
    CHECK(vx_limits_enter(l, 4, 2, 1));
    CHECK(!vx_limits_enter(l, 4, 2, 2)); /* the limit holds across slots */
    CHECK(vx_limits_active(l, 4) == 2);
    CHECK(vx_limits_held_by(l, 4, 0) == 1 && vx_limits_held_by(l, 4, 2) == 0);
    CHECK(vx_limits_leave(l, 4, 0));
    CHECK(!vx_limits_leave(l, 4, 0)); /* a second leave changes nothing */
    CHECK(!vx_limits_leave(l, 4, 2)); /* a slot that holds nothing */
    CHECK(vx_limits_active(l, 4) == 1);
    CHECK(vx_limits_enter(l, 4, 2, 2));
    /* limit <= 0: counts only. */
    for (int k = 0; k < 5; k++)
        CHECK(vx_limits_enter(l, 9, 0, 1));
    CHECK(vx_limits_enter(l, 9, -1, 2));
    CHECK(vx_limits_active(l, 9) == 6);
    /* Slot 1 dies holding one place of 4 and five of 9. */
    CHECK(vx_limits_forget_slot(l, 1) == 6);
    CHECK(vx_limits_active(l, 4) == 1 && vx_limits_active(l, 9) == 1);
    CHECK(vx_limits_held_by(l, 4, 1) == 0 && vx_limits_held_by(l, 9, 1) == 0);
    CHECK(vx_limits_forget_slot(l, 1) == 0);
    /* The gauges are independent of the buckets: an unconfigured entry counts places. */
    CHECK(vx_limits_leave(l, 4, 2) && vx_limits_leave(l, 9, 2));
    CHECK(vx_limits_active(l, 4) == 0 && vx_limits_active(l, 9) == 0);
    vx_limits_destroy(l);
}

static void test_admit(void)
{
    vx_limits *l = vx_limits_create(4, 2);
    if (l == NULL) {
        failures++;
        return;
    }
    int reason = -1;
    int64_t lr = -1, lt = -1;
    CHECK(vx_limits_configure(l, 0, 60, 2, T0));   /* requests: 2, one per second */
    CHECK(vx_limits_configure(l, 1, 600, 100, T0)); /* tokens: 100, ten per second */
    CHECK(vx_limits_admit(l, 0, 1, 60, 0, 1, 1, T0, &reason, &lr, &lt) == 0);
    CHECK(reason == VX_ADMIT_OK && lr == 1 && lt == 40);
    CHECK(vx_limits_active(l, 0) == 1 && vx_limits_held_by(l, 0, 1) == 1);
    CHECK(vx_limits_entered(l, 0) == 1);
    /* Tokens short (40 left, 60 asked): refused, the request token given back. */
    CHECK(vx_limits_admit(l, 0, 1, 60, 2, 0, 1, T0, &reason, &lr, &lt) == 2000000);
    CHECK(reason == VX_ADMIT_TOKENS);
    CHECK(vx_limits_level(l, 0, T0) == 1 && vx_limits_level(l, 1, T0) == 40);
    CHECK(vx_limits_taken(l, 0) == 1 && vx_limits_taken(l, 1) == 60);
    /* Gauge full (limit 1 held): refused, request and tokens given back. */
    CHECK(vx_limits_admit(l, 0, 1, 30, 0, 1, 0, T0, &reason, &lr, &lt) == VX_LIMITS_PARALLEL_WAIT_US);
    CHECK(reason == VX_ADMIT_PARALLEL);
    CHECK(vx_limits_level(l, 0, T0) == 1 && vx_limits_level(l, 1, T0) == 40);
    CHECK(vx_limits_active(l, 0) == 1);
    /* Requests short. */
    CHECK(vx_limits_admit(l, 0, -1, 0, -1, 0, 0, T0, &reason, &lr, &lt) == 0);
    CHECK(vx_limits_admit(l, 0, 1, 1, 2, 0, 0, T0, &reason, &lr, &lt) == 1000000);
    CHECK(reason == VX_ADMIT_REQUESTS && vx_limits_level(l, 1, T0) == 40);
    /* Every step skipped: admitted, nothing touched. */
    CHECK(vx_limits_admit(l, -1, -1, 5, -1, 0, 0, T0, &reason, &lr, &lt) == 0);
    CHECK(reason == VX_ADMIT_OK && lr == 0 && lt == 0);
    CHECK(vx_limits_entered(l, 0) == 1); /* refused admissions entered nothing */
    /* Never: more tokens than the burst. */
    CHECK(vx_limits_admit(l, -1, 1, 101, -1, 0, 0, T0, &reason, &lr, &lt) == VX_LIMITS_NEVER);
    CHECK(reason == VX_ADMIT_TOKENS);
    vx_limits_destroy(l);
}

/* ---- contention ---- */

#define THREADS 4

typedef struct {
    vx_limits *l;
    int id;
    long iters;
    _Atomic int64_t *clock; /* NULL: frozen at T0 */
    int64_t admitted;
} worker;

static void *bucket_main(void *arg)
{
    worker *w = arg;
    for (long k = 0; k < w->iters; k++) {
        /* Relaxed: the fake clock only has to be a shared, monotonic source of readings. */
        int64_t now = w->clock == NULL
                          ? T0
                          : atomic_fetch_add_explicit(w->clock, 1, memory_order_relaxed) + 1;
        int64_t n = 1 + (w->id + k) % 3;
        if (vx_limits_take(w->l, 0, n, now) == 0)
            w->admitted += n;
    }
    return NULL;
}

static int64_t run_threads(void *(*body)(void *), vx_limits *l, long iters,
                           _Atomic int64_t *clock)
{
    pthread_t t[THREADS];
    worker w[THREADS];
    for (int k = 0; k < THREADS; k++) {
        w[k] = (worker){.l = l, .id = k, .iters = iters, .clock = clock};
        pthread_create(&t[k], NULL, body, &w[k]);
    }
    int64_t admitted = 0;
    for (int k = 0; k < THREADS; k++) {
        pthread_join(t[k], NULL);
        admitted += w[k].admitted;
    }
    return admitted;
}

static void test_threads_frozen_clock(void)
{
    const int64_t burst = 100000;
    vx_limits *l = vx_limits_create(1, 1);
    if (l == NULL || !vx_limits_configure(l, 0, 1, burst, T0)) {
        failures++;
        return;
    }
    int64_t admitted = run_threads(bucket_main, l, 40000, NULL);
    CHECK(admitted + units_of(l, 0) / U == burst); /* nothing minted, nothing lost */
    CHECK(units_of(l, 0) % U == 0 && units_of(l, 0) >= 0 && units_of(l, 0) < 3 * U);
    CHECK(vx_limits_taken(l, 0) == admitted);
    printf("test_limits: frozen clock, %d threads: admitted %" PRId64 " of burst %" PRId64 "\n",
           THREADS, admitted, burst);
    vx_limits_destroy(l);
}

static void test_threads_fake_clock(void)
{
    /* 0.1 token per fake microsecond; every call advances the clock by one, so demand (1..3
     * tokens per call) exceeds the rate by far and the bucket never reaches its cap. */
    const int64_t rate = 6000000, burst = 1000;
    _Atomic int64_t clock = T0;
    vx_limits *l = vx_limits_create(1, 1);
    if (l == NULL || !vx_limits_configure(l, 0, rate, burst, T0)) {
        failures++;
        return;
    }
    /* Take one token at T0 so the bucket is below its cap from the start: a refill of a full
     * bucket discards its credit, which would make the identity depend on thread start-up. */
    CHECK(vx_limits_take(l, 0, 1, T0) == 0);
    int64_t admitted = 1 + run_threads(bucket_main, l, 250000, &clock);
    int64_t end = atomic_load_explicit(&clock, memory_order_relaxed);
    int64_t credit = rate * (end - T0);
    int64_t pending = rate * (end - atomic_load_explicit(&l->e[0].last_us, memory_order_relaxed));
    CHECK(admitted * U <= burst * U + credit); /* upper bound, no slack */
    CHECK(admitted * U + units_of(l, 0) + pending == burst * U + credit); /* identity */
    CHECK(vx_limits_taken(l, 0) == admitted);
    printf("test_limits: fake clock, %d threads, %" PRId64 " us: admitted %" PRId64
           ", bound %" PRId64 "\n", THREADS, end - T0, admitted, burst + credit / U);
    vx_limits_destroy(l);
}

/* Gauge: each thread enters (limit 3) in its own slot and, while inside, counts itself in a
 * shared "inside" counter; the maximum ever seen must not exceed the limit. */
static _Atomic int64_t inside, max_inside;

static void *gauge_main(void *arg)
{
    worker *w = arg;
    for (long k = 0; k < w->iters; k++) {
        if (!vx_limits_enter(w->l, 0, 3, w->id))
            continue;
        w->admitted++;
        /* seq_cst is not needed for the count; relaxed RMWs keep it exact. */
        int64_t now = atomic_fetch_add_explicit(&inside, 1, memory_order_relaxed) + 1;
        int64_t seen = atomic_load_explicit(&max_inside, memory_order_relaxed);
        while (now > seen && !atomic_compare_exchange_weak_explicit(
                                 &max_inside, &seen, now, memory_order_relaxed,
                                 memory_order_relaxed)) {
        }
        atomic_fetch_sub_explicit(&inside, 1, memory_order_relaxed);
        CHECK(vx_limits_leave(w->l, 0, w->id));
    }
    return NULL;
}

static void test_threads_gauge(void)
{
    vx_limits *l = vx_limits_create(1, THREADS);
    if (l == NULL) {
        failures++;
        return;
    }
    int64_t admitted = run_threads(gauge_main, l, 200000, NULL);
    CHECK(admitted > 0);
    CHECK(atomic_load(&max_inside) <= 3 && atomic_load(&max_inside) >= 1);
    CHECK(vx_limits_active(l, 0) == 0);
    for (int k = 0; k < THREADS; k++)
        CHECK(vx_limits_held_by(l, 0, k) == 0);
    printf("test_limits: gauge, %d threads: %" PRId64 " entries, at most %" PRId64
           " inside (limit 3)\n", THREADS, admitted, atomic_load(&max_inside));
    vx_limits_destroy(l);
}

/* Processes: two children take from one bucket on a frozen clock (exactly burst in all), and
 * each takes places of a gauge and exits without leaving them; forget_slot gives them back. */
static void test_processes(void)
{
    const int64_t burst = 50000;
    const int children = 2;
    vx_limits *l = vx_limits_create(2, children);
    int fds[2];
    if (l == NULL || !vx_limits_configure(l, 0, 1, burst, T0) || pipe(fds) != 0) {
        failures++;
        return;
    }
    pid_t pids[2];
    fflush(stdout); /* or the children would inherit, and repeat, buffered output */
    for (int c = 0; c < children; c++) {
        pids[c] = fork();
        if (pids[c] == 0) {
            int64_t admitted = 0;
            for (long k = 0; k < 40000; k++) /* 2 x 40000 > burst */
                admitted += vx_limits_take(l, 0, 1, T0) == 0 ? 1 : 0;
            for (int k = 0; k < 7; k++) /* 2 x 7 > 10: some refused */
                vx_limits_enter(l, 1, 10, c);
            _exit(write(fds[1], &admitted, sizeof admitted) == sizeof admitted ? 0 : 1);
        }
    }
    close(fds[1]);
    int64_t total = 0, one;
    for (int c = 0; c < children; c++) {
        int status = 0;
        waitpid(pids[c], &status, 0);
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
        if (read(fds[0], &one, sizeof one) == sizeof one)
            total += one;
    }
    close(fds[0]);
    CHECK(total == burst); /* one bucket across processes */
    CHECK(units_of(l, 0) == 0);
    CHECK(vx_limits_active(l, 1) == 10);
    int64_t h0 = vx_limits_held_by(l, 1, 0), h1 = vx_limits_held_by(l, 1, 1);
    CHECK(h0 + h1 == 10);
    CHECK(vx_limits_forget_slot(l, 0) == h0);
    CHECK(vx_limits_active(l, 1) == h1);
    CHECK(vx_limits_forget_slot(l, 1) == h1);
    CHECK(vx_limits_active(l, 1) == 0);
    printf("test_limits: %d processes: admitted %" PRId64 " of burst %" PRId64
           ", places %" PRId64 " + %" PRId64 " forgotten\n", children, total, burst, h0, h1);
    vx_limits_destroy(l);
}

static void test_real_clock(void)
{
    int64_t a = vx_limits_now_us(), c = vx_limits_now_us();
    CHECK(a > 0 && c >= a);
    vx_limits *l = vx_limits_create(1, 1);
    if (l == NULL || !vx_limits_configure(l, 0, 1, 2, vx_limits_now_us())) {
        failures++;
        return;
    }
    CHECK(vx_limits_take(l, 0, 2, vx_limits_now_us()) == 0);
    int64_t wait = vx_limits_take(l, 0, 1, vx_limits_now_us());
    CHECK(wait > 59000000 && wait <= 60000000); /* a token a minute */
    vx_limits_destroy(l);
}

/* On a memfd: a second mapping from the descriptor is the same state; a file of another
 * shape (a short one, an empty one) is refused with EINVAL. */
static void test_memfd_attach(void)
{
    int fd = -1;
    vx_limits *l = vx_limits_create_fd(8, 2, &fd);
    CHECK(l != NULL && fd >= 0);
    vx_limits_configure(l, 0, 60, 5, 1000);
    vx_limits *m = vx_limits_attach(fd);
    CHECK(m != NULL && m->n == 8 && m->slots == 2);
    CHECK(vx_limits_take(m, 0, 2, 1000) == 0);
    CHECK(vx_limits_level(l, 0, 1000) == 3);
    vx_limits_destroy(m); /* unmapped first: pages past a truncated file's end would fault */
    vx_limits_destroy(l);
    CHECK(ftruncate(fd, 100) == 0); /* now shorter than its header says */
    errno = 0;
    CHECK(vx_limits_attach(fd) == NULL && errno == EINVAL);
    CHECK(ftruncate(fd, 0) == 0);
    errno = 0;
    CHECK(vx_limits_attach(fd) == NULL && errno == EINVAL);
    close(fd);
}

int main(void)
{
    test_bad_input();
    test_refill_exact();
    test_debt();
    test_leased();
    test_demand();
    test_gauges();
    test_admit();
    test_threads_frozen_clock();
    test_threads_fake_clock();
    test_threads_gauge();
    test_processes();
    test_real_clock();
    test_memfd_attach();
    printf("test_limits: %s\n", failures ? "FAIL" : "ok");
    return failures ? 1 : 0;
}
