/* test_stats: vx_stats counters and histograms.
 *
 * Bucket geometry (every value lands in a bucket that contains it; midpoints within 1/128),
 * percentiles against the exact nearest-rank percentiles of a fixed lognormal sample,
 * counters and histograms hammered by threads (totals exact), shared-memory layout, and a
 * forked child whose records the parent reads. Exit status 0 when every check passes.
 */
#include "vx_stats.h"
#include "check.h"

#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

/* |approx - exact| <= exact / 128, in integers. */
static int within_bound(int64_t approx, int64_t exact)
{
    int64_t diff = approx > exact ? approx - exact : exact - approx;
    return diff * 128 <= exact;
}

static void check_value(int64_t v)
{
    size_t i = vx_hist_index(v);
    int64_t clamped = v < 0 ? 0 : (v > VX_HIST_MAX_US ? VX_HIST_MAX_US : v);
    CHECK(i < VX_HIST_BUCKETS);
    CHECK(vx_hist_lower(i) <= clamped && clamped <= vx_hist_upper(i));
    CHECK(within_bound(vx_hist_mid(i), clamped));
    if (clamped < VX_HIST_EXACT)
        CHECK(vx_hist_mid(i) == clamped);
}

static void test_geometry(void)
{
    CHECK(VX_HIST_BUCKETS == 1544);
    for (int64_t v = -3; v < (1 << 16); v++)
        check_value(v);
    for (int64_t v = 1 << 16; v <= VX_HIST_MAX_US; v += v / 97 + 1)
        check_value(v);
    check_value(VX_HIST_MAX_US);
    check_value(VX_HIST_MAX_US + 1);
    check_value(INT64_MAX);
    CHECK(vx_hist_index(INT64_MAX) == VX_HIST_BUCKETS - 1);
    CHECK(vx_hist_index(VX_HIST_MAX_US) == VX_HIST_BUCKETS - 1);
    /* Buckets tile the range: each starts right after the previous one ends. */
    for (size_t i = 1; i < VX_HIST_BUCKETS; i++) {
        CHECK(vx_hist_lower(i) == vx_hist_upper(i - 1) + 1);
        /* Width at most 1/64 of the lower bound above the exact range. */
        if (i >= VX_HIST_EXACT)
            CHECK((vx_hist_upper(i) - vx_hist_lower(i) + 1) * 64 <= vx_hist_lower(i));
    }
}

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* splitmix64: fixed seed, same sample on every run and machine. */
static uint64_t rng_state = 42;
static double uniform01(void)
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return ((double)(z >> 11) + 0.5) / 9007199254740992.0; /* (0, 1) */
}

static void test_percentiles_lognormal(void)
{
    enum { N = 100000 };
    static int64_t sample[N];
    vx_hist h = {0};
    CHECK(vx_hist_init(&h, 3) == 0);
    /* Lognormal around e^9 us (~8 ms) with sigma 1.5: spans the exact range up to seconds. */
    for (int i = 0; i < N; i += 2) {
        double u1 = uniform01(), u2 = uniform01();
        double r = sqrt(-2.0 * log(u1));
        double z[2] = {r * cos(6.283185307179586 * u2), r * sin(6.283185307179586 * u2)};
        for (int j = 0; j < 2; j++) {
            sample[i + j] = (int64_t)exp(9.0 + 1.5 * z[j]);
            vx_hist_record(&h, (size_t)(i + j) % 3, sample[i + j]);
        }
    }
    qsort(sample, N, sizeof sample[0], cmp_i64);
    static int64_t counts[VX_HIST_BUCKETS];
    int64_t total = vx_hist_merge(&h, -1, counts);
    CHECK(total == N);
    CHECK(vx_hist_count(&h, -1) == N);
    int64_t sum = 0;
    for (int i = 0; i < N; i++)
        sum += sample[i];
    CHECK(vx_hist_sum(&h, -1) == sum);
    const double qs[] = {0.001, 0.01, 0.1, 0.5, 0.9, 0.99, 0.999, 1.0};
    for (size_t k = 0; k < sizeof qs / sizeof qs[0]; k++) {
        int64_t rank = (int64_t)ceil(qs[k] * N);
        int64_t exact = sample[rank - 1], approx = vx_hist_percentile(counts, total, qs[k]);
        if (!within_bound(approx, exact)) {
            fprintf(stderr, "q=%g: histogram %" PRId64 ", exact %" PRId64 "\n", qs[k], approx, exact);
            failures++;
        }
    }
    printf("test_stats: p50 %" PRId64 " (exact %" PRId64 "), p99.9 %" PRId64 " (exact %" PRId64 ")\n",
           vx_hist_percentile(counts, total, 0.5), sample[N / 2 - 1],
           vx_hist_percentile(counts, total, 0.999), sample[99900 - 1]);
    /* Empty histogram: 0. */
    vx_hist e = {0};
    CHECK(vx_hist_init(&e, 1) == 0);
    total = vx_hist_merge(&e, -1, counts);
    CHECK(total == 0 && vx_hist_percentile(counts, total, 0.5) == 0);
    vx_hist_destroy(&e);
    vx_hist_destroy(&h);
    vx_hist_destroy(&h); /* idempotent */
}

static void test_bad_sizes(void)
{
    vx_counters c = {0};
    vx_hist h = {0};
    CHECK(vx_counters_init(&c, 0, 1) != 0);
    CHECK(vx_counters_init(&c, 1, 0) != 0);
    CHECK(vx_counters_init(&c, VX_STATS_MAX_SLOTS + 1, 1) != 0);
    CHECK(vx_counters_init(&c, 1, VX_COUNTERS_MAX_FIELDS + 1) != 0);
    CHECK(vx_hist_init(&h, 0) != 0);
    CHECK(vx_hist_init(&h, VX_STATS_MAX_SLOTS + 1) != 0);
    CHECK(c.base == NULL && h.base == NULL);
}

/* ---- threads ---- */

#define THREADS 4
#define ADDS 200000

static vx_counters shared_c;
static vx_hist shared_h;

static void *stats_worker(void *arg)
{
    size_t id = (size_t)(uintptr_t)arg;
    for (int i = 0; i < ADDS; i++) {
        vx_counters_add(&shared_c, id, 0, 1);        /* own slot */
        vx_counters_add(&shared_c, 0, 2, 2);         /* everybody on one cell */
        vx_hist_record(&shared_h, 0, i % 1000);      /* everybody on one histogram */
        vx_hist_record(&shared_h, id, 1000000 + i);  /* own histogram */
    }
    return NULL;
}

static void test_threads_and_layout(void)
{
    CHECK(vx_counters_init(&shared_c, THREADS, 3) == 0);
    CHECK(vx_hist_init(&shared_h, THREADS) == 0);
    /* Each slot's row starts on its own cache line. */
    for (size_t s = 0; s < THREADS; s++) {
        CHECK((uintptr_t)&shared_c.base[s * shared_c.stride] % VX_STATS_LINE == 0);
        CHECK((uintptr_t)(shared_h.base + s * shared_h.stride) % VX_STATS_LINE == 0);
    }
    CHECK(shared_c.stride * sizeof(int64_t) >= VX_STATS_LINE);
    pthread_t t[THREADS];
    for (size_t i = 0; i < THREADS; i++)
        pthread_create(&t[i], NULL, stats_worker, (void *)(uintptr_t)i);
    /* Read while they write: totals are monotonic snapshots, never torn. */
    int64_t prev = 0;
    for (int k = 0; k < 1000; k++) {
        int64_t now = vx_counters_total(&shared_c, 2);
        CHECK(now >= prev && now % 2 == 0);
        prev = now;
    }
    for (int i = 0; i < THREADS; i++)
        pthread_join(t[i], NULL);
    CHECK(vx_counters_total(&shared_c, 0) == (int64_t)THREADS * ADDS);
    CHECK(vx_counters_get(&shared_c, 0, 2) == (int64_t)THREADS * ADDS * 2);
    CHECK(vx_counters_total(&shared_c, 1) == 0);
    for (size_t s = 0; s < THREADS; s++)
        CHECK(vx_counters_get(&shared_c, s, 0) == ADDS);
    vx_counters_set(&shared_c, 1, 1, -42);
    CHECK(vx_counters_get(&shared_c, 1, 1) == -42);
    CHECK(vx_hist_count(&shared_h, -1) == (int64_t)THREADS * ADDS * 2);
    CHECK(vx_hist_count(&shared_h, 0) == (int64_t)THREADS * ADDS + ADDS);
    static int64_t counts[VX_HIST_BUCKETS];
    CHECK(vx_hist_merge(&shared_h, 0, counts) == (int64_t)THREADS * ADDS + ADDS);
    CHECK(counts[5] == THREADS * (ADDS / 1000)); /* value 5 is exact */
    vx_counters_destroy(&shared_c);
    vx_hist_destroy(&shared_h);
}

static void test_fork(void)
{
    vx_counters c = {0};
    vx_hist h = {0};
    CHECK(vx_counters_init(&c, 2, 1) == 0);
    CHECK(vx_hist_init(&h, 2) == 0);
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        for (int i = 0; i < 1000; i++) {
            vx_counters_add(&c, 1, 0, 1);
            vx_hist_record(&h, 1, 250);
        }
        _exit(0);
    }
    vx_counters_add(&c, 0, 0, 5);
    int status = 0;
    waitpid(pid, &status, 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    CHECK(vx_counters_total(&c, 0) == 1005); /* the child's writes are visible here */
    CHECK(vx_hist_count(&h, 1) == 1000 && vx_hist_sum(&h, -1) == 250000);
    static int64_t counts[VX_HIST_BUCKETS];
    CHECK(vx_hist_percentile(counts, vx_hist_merge(&h, -1, counts), 0.5) == vx_hist_mid(vx_hist_index(250)));
    vx_counters_destroy(&c);
    vx_hist_destroy(&h);
}

int main(void)
{
    test_geometry();
    test_bad_sizes();
    test_percentiles_lognormal();
    test_threads_and_layout();
    test_fork();
    printf("test_stats: %s\n", failures ? "FAIL" : "ok");
    return failures ? 1 : 0;
}
