/* bench: single-thread costs of the native core, in nanoseconds per operation.
 *
 * Each figure is the median of TRIALS runs. Targets: ring push+pop <= 25 ns,
 * uncontended acquire <= 10 ns. The last row puts two threads on one ring (each pushes then
 * pops) to show what sharing the counters' cache lines costs.
 */
#include "vx_bucket.h"
#include "vx_cache.h"
#include "vx_health.h"
#include "vx_ring.h"
#include "vx_stats.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define TRIALS 7
#define CAPACITY 16384

static double now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v)
{
    qsort(v, TRIALS, sizeof v[0], cmp_double);
    return v[TRIALS / 2];
}

static void *volatile sink;

static double ring_push_pop(vx_ring *r)
{
    const long n = 10000000;
    void *out;
    double t = now_ns();
    for (long i = 0; i < n; i++) {
        vx_ring_push(r, (void *)i);
        vx_ring_pop(r, &out);
    }
    t = now_ns() - t;
    sink = out;
    return t / n;
}

/* Drain a full ring, one item or `batch` items per call; only the draining is timed. */
static double ring_drain(vx_ring *r, size_t batch)
{
    static void *buf[64];
    double total = 0;
    long items = 0;
    for (int round = 0; round < 200; round++) {
        for (long i = 0; i < CAPACITY; i++)
            vx_ring_push(r, (void *)i);
        double t = now_ns();
        size_t got;
        if (batch == 1) {
            while (vx_ring_pop(r, buf) == VX_OK)
                items++;
        } else {
            while (vx_ring_pop_batch(r, buf, batch, &got) == VX_OK)
                items += (long)got;
        }
        total += now_ns() - t;
    }
    sink = buf[0];
    return total / items;
}

static double bucket_acquire(vx_bucket *b, int64_t n)
{
    const long iters = 10000000;
    long ok = 0;
    double t = now_ns();
    for (long i = 0; i < iters; i++)
        ok += vx_bucket_acquire(b, n);
    t = now_ns() - t;
    sink = (void *)ok;
    return t / iters;
}

static double counters_add(vx_counters *c)
{
    const long iters = 10000000;
    double t = now_ns();
    for (long i = 0; i < iters; i++)
        vx_counters_add(c, 0, 1, 1);
    return (now_ns() - t) / iters;
}

static double hist_record(vx_hist *h)
{
    const long iters = 10000000;
    double t = now_ns();
    for (long i = 0; i < iters; i++)
        vx_hist_record(h, 0, (i & 0xffff) + 100);
    return (now_ns() - t) / iters;
}

/* A closed breaker: peek + enter + in-flight acquire/release + success report, i.e. what one
 * request costs the shared health state. */
static double health_request(vx_health *h)
{
    const long iters = 10000000;
    long ok = 0;
    double t = now_ns();
    for (long i = 0; i < iters; i++) {
        ok += vx_breaker_peek(h, 0, i) == VX_PEEK_CLOSED;
        int64_t ticket = vx_breaker_enter(h, 0, i, NULL);
        if (vx_inflight_acquire(h, 0)) {
            vx_inflight_release(h, 0);
            vx_breaker_report(h, 0, ticket, VX_OUTCOME_SUCCESS, i);
        }
    }
    t = now_ns() - t;
    sink = (void *)ok;
    return t / iters;
}

/* record_request + try_retry on a budget with room (the clock moves 1 ms per call). */
static double budget_pair(vx_budget *b)
{
    const long iters = 10000000;
    long ok = 0;
    double t = now_ns();
    for (long i = 0; i < iters; i++) {
        vx_budget_record_request(b, i);
        ok += vx_budget_try_retry(b, i) >= 0;
    }
    t = now_ns() - t;
    sink = (void *)ok;
    return t / iters;
}

static double hrw_rank(size_t n)
{
    const long iters = 2000000;
    uint64_t seeds[10];
    double weights[10];
    uint32_t order[10];
    for (size_t i = 0; i < n; i++) {
        seeds[i] = vx_hash64(&i, sizeof i, 7);
        weights[i] = 1.0;
    }
    long acc = 0;
    double t = now_ns();
    for (long i = 0; i < iters; i++) {
        vx_hrw_rank(vx_hash64(&i, sizeof i, 0), seeds, weights, n, order);
        acc += order[0];
    }
    t = now_ns() - t;
    sink = (void *)acc;
    return t / iters;
}

static vx_ring *shared_ring;

static void *pair_thread(void *arg)
{
    long n = (long)(intptr_t)arg;
    void *out;
    for (long i = 0; i < n; i++) {
        while (vx_ring_push(shared_ring, (void *)i) != VX_OK)
            ;
        while (vx_ring_pop(shared_ring, &out) != VX_OK)
            ;
    }
    sink = out;
    return NULL;
}

static double ring_two_threads(void)
{
    const long n = 2000000;
    pthread_t a, b;
    double t = now_ns();
    pthread_create(&a, NULL, pair_thread, (void *)(intptr_t)n);
    pthread_create(&b, NULL, pair_thread, (void *)(intptr_t)n);
    pthread_join(a, NULL);
    pthread_join(b, NULL);
    return (now_ns() - t) / (2.0 * n); /* wall time per push+pop pair, both threads */
}

/* Response cache store: hits (lock, index walk, copy out of the block chain, LRU bump,
 * unlock) on a working set of 256 entries, and puts replacing them. Own trials and rows, so
 * the table above stays as it was. */
static double cache_op(vx_cache *c, size_t size, int put)
{
    static unsigned char buf[16384];
    const long n = 200000;
    uint8_t key[VX_CACHE_KEY] = {0};
    size_t len;
    int64_t age;
    double t = now_ns();
    for (long i = 0; i < n; i++) {
        key[0] = (uint8_t)((i * 97) & 255);
        if (put)
            vx_cache_put(c, key, buf, size, 1000, INT64_C(1) << 40);
        else
            vx_cache_get(c, key, 1001, -1, buf, sizeof buf, &len, &age);
    }
    return (now_ns() - t) / n;
}

static void cache_rows(void)
{
    static const size_t sizes[] = {1024, 16384};
    double v[4][TRIALS];
    vx_cache *c = vx_cache_create(INT64_C(64) << 20);
    if (c == NULL) {
        fprintf(stderr, "bench: cache setup failed\n");
        return;
    }
    for (int s = 0; s < 2; s++) {
        uint8_t key[VX_CACHE_KEY] = {0};
        static unsigned char val[16384];
        key[1] = (uint8_t)s;
        for (int i = 0; i < 256; i++) {
            key[0] = (uint8_t)i;
            vx_cache_put(c, key, val, sizes[s], 1000, INT64_C(1) << 40);
        }
        for (int t = 0; t < TRIALS; t++) {
            v[2 * s][t] = cache_op(c, sizes[s], 0);
            v[2 * s + 1][t] = cache_op(c, sizes[s], 1);
        }
    }
    printf("| cache get, hit, 1 KiB value (256 entries)         | %6.2f |         |\n", median(v[0]));
    printf("| cache put, replacing, 1 KiB value                 | %6.2f |         |\n", median(v[1]));
    printf("| cache get, hit, 16 KiB value (256 entries)        | %6.2f |         |\n", median(v[2]));
    printf("| cache put, replacing, 16 KiB value                | %6.2f |         |\n", median(v[3]));
    vx_cache_destroy(c);
}

int main(void)
{
    double v[12][TRIALS];
    vx_ring *r = vx_ring_create(CAPACITY, NULL);
    shared_ring = vx_ring_create(CAPACITY, NULL);
    /* Burst and rate so large that the bucket never runs dry: the fast path is measured. */
    vx_bucket *b = vx_bucket_create(VX_BUCKET_MAX_RATE, VX_BUCKET_MAX_BURST, vx_now_us());
    vx_counters c = {0};
    vx_hist h = {0};
    vx_health_policy policy = {.failures = 5, .successes = 2, .open_ms = 30000,
                               .max_open_ms = 300000, .probes = 1, .probe_lease_ms = 60000};
    vx_health *health = vx_health_create(1, NULL, &policy);
    vx_budget *budget = vx_budget_create(100, 10, 1000);
    if (health == NULL || budget == NULL || r == NULL || shared_ring == NULL || b == NULL || vx_counters_init(&c, 4, 4) != 0 ||
        vx_hist_init(&h, 4) != 0) {
        fprintf(stderr, "bench: setup failed\n");
        return 1;
    }
    for (int t = 0; t < TRIALS; t++) {
        v[0][t] = ring_push_pop(r);
        v[1][t] = ring_drain(r, 1);
        v[2][t] = ring_drain(r, 64);
        v[3][t] = bucket_acquire(b, 1);
        v[4][t] = bucket_acquire(b, 64) / 64;
        v[5][t] = counters_add(&c);
        v[6][t] = hist_record(&h);
        v[7][t] = ring_two_threads();
        v[8][t] = health_request(health);
        v[9][t] = budget_pair(budget);
        v[10][t] = hrw_rank(3);
        v[11][t] = hrw_rank(10);
        /* Refill the bucket between trials (the 64-token rows take 6.4e8 per trial). */
        atomic_store_explicit(&b->tokens, b->cap, memory_order_relaxed);
    }
    printf("| operation (median of %d runs)                      | ns/op  | target  |\n", TRIALS);
    printf("|---------------------------------------------------|-------:|--------:|\n");
    printf("| ring push + pop (one item, single thread)         | %6.2f | <= 25   |\n", median(v[0]));
    printf("| ring pop, draining a full ring, per item          | %6.2f |         |\n", median(v[1]));
    printf("| ring pop_batch(64) claim, draining, per item      | %6.2f |         |\n", median(v[2]));
    printf("| bucket acquire(1), uncontended                    | %6.2f | <= 10   |\n", median(v[3]));
    printf("| bucket acquire(64), uncontended, per token        | %6.2f |         |\n", median(v[4]));
    printf("| counters add (relaxed fetch_add)                  | %6.2f |         |\n", median(v[5]));
    printf("| histogram record (3 relaxed fetch_adds)           | %6.2f |         |\n", median(v[6]));
    printf("| ring push + pop, 2 threads sharing one ring, wall | %6.2f |         |\n", median(v[7]));
    printf("| health: peek+enter+acquire+release+report, closed | %6.2f |         |\n", median(v[8]));
    printf("| retry budget: record_request + try_retry          | %6.2f |         |\n", median(v[9]));
    printf("| hash64 (8 B) + rendezvous rank, 3 targets         | %6.2f |         |\n", median(v[10]));
    printf("| hash64 (8 B) + rendezvous rank, 10 targets        | %6.2f |         |\n", median(v[11]));
    cache_rows();
    vx_health_destroy(health);
    vx_budget_destroy(budget);
    vx_ring_free(r);
    vx_ring_free(shared_ring);
    vx_bucket_destroy(b);
    vx_counters_destroy(&c);
    vx_hist_destroy(&h);
    return 0;
}
