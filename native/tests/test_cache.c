/* test_cache: vx_cache, the shared response cache store, with an injected clock.
 *
 * Argument bounds and geometry (the mapping stays within capacity + a small constant); round
 * trips at every block boundary; the SHORT protocol; exact LRU against a reference model
 * (random puts and gets of random sizes: the same hits, entries, bytes and evictions after
 * every step); eviction until a large value fits; TTL, max_age (stale entries are kept and not
 * promoted), replace, too-large values; markers (lead, wait, unwait, expiry, takeover, the
 * bounded table and its sweep; owners: a leader that lost its lease cannot renew or drop its
 * successor's marker, a leader process that is gone frees its key at once, a zombie does
 * not until reaped); clear; threads hammering one cache with self-verifying values
 * while a checker walks every invariant; forked processes sharing it; a process killed while
 * holding the lock does not wedge the others (EOWNERDEAD: wiped, counted, usable).
 * Exit status 0 when every check passes.
 */
#include "vx_cache.h"
#include "check.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define T0 INT64_C(1000000000) /* an arbitrary "boot + 11.6 days" in ms */
#define DAY INT64_C(86400000)
#define ME ((int32_t)getpid()) /* the marker owner of this process's claims */

static void make_key(uint8_t key[VX_CACHE_KEY], uint64_t id)
{
    /* Structured keys on purpose (not digests): the index must still spread them. */
    memset(key, 0, VX_CACHE_KEY);
    memcpy(key, &id, sizeof id);
}

static uint64_t blocks_for(uint64_t len)
{
    return len <= VX_CACHE_HEAD_DATA ? 1
                                     : 1 + (len - VX_CACHE_HEAD_DATA + VX_CACHE_BLOCK - 1) /
                                               VX_CACHE_BLOCK;
}

static vx_cache_stats stats(vx_cache *c)
{
    vx_cache_stats s;
    memset(&s, 0, sizeof s);
    CHECK(vx_cache_read_stats(c, &s) == 0);
    return s;
}


static uint64_t rnd(uint64_t *s)
{
    uint64_t x = *s;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *s = x;
}

/* A value that proves its own integrity: id, length and seed up front, then bytes derived
 * from the seed. */
static void fill_value(unsigned char *v, size_t len, uint64_t id, uint64_t seed)
{
    unsigned char hdr[24];
    uint64_t l = len;
    memcpy(hdr, &id, 8);
    memcpy(hdr + 8, &l, 8);
    memcpy(hdr + 16, &seed, 8);
    size_t n = len < sizeof hdr ? len : sizeof hdr;
    memcpy(v, hdr, n);
    uint64_t s = seed | 1;
    for (size_t i = n; i < len; i += 8) { /* 8 bytes per step: cheap under the sanitizers */
        uint64_t x = rnd(&s);
        memcpy(v + i, &x, len - i < 8 ? len - i : 8);
    }
}

static int value_ok(const unsigned char *v, size_t len, uint64_t id)
{
    if (len < 24)
        return 0;
    uint64_t got_id, got_len, seed;
    memcpy(&got_id, v, 8);
    memcpy(&got_len, v + 8, 8);
    memcpy(&seed, v + 16, 8);
    if (got_id != id || got_len != len)
        return 0;
    uint64_t s = seed | 1;
    for (size_t i = 24; i < len; i += 8) {
        uint64_t x = rnd(&s);
        if (memcmp(v + i, &x, len - i < 8 ? len - i : 8) != 0)
            return 0;
    }
    return 1;
}

static void test_bad_input(void)
{
    errno = 0;
    CHECK(vx_cache_create(VX_CACHE_MIN_CAPACITY - 1) == NULL && errno == EINVAL);
    errno = 0;
    CHECK(vx_cache_create(VX_CACHE_MAX_CAPACITY + 1) == NULL && errno == EINVAL);
    errno = 0;
    CHECK(vx_cache_create(-1) == NULL && errno == EINVAL);
    vx_cache_destroy(NULL);
}

static void test_geometry(void)
{
    const int64_t caps[] = {VX_CACHE_MIN_CAPACITY, INT64_C(1) << 20, INT64_C(64) << 20,
                            INT64_C(1) << 30};
    for (size_t i = 0; i < sizeof caps / sizeof caps[0]; i++) {
        vx_cache *c = vx_cache_create(caps[i]);
        CHECK(c != NULL);
        if (c == NULL)
            continue;
        vx_cache_stats s = stats(c);
        CHECK(s.capacity == caps[i]);
        /* Everything (header, markers, both indexes, next[], blocks) within the bound plus
         * the header: the constant is sizeof(vx_cache) <= 512 B. */
        CHECK(s.mapped <= caps[i] + (int64_t)sizeof(vx_cache));
        CHECK(s.blocks * VX_CACHE_BLOCK >= caps[i] / 100 * 95); /* and the pool gets nearly all */
        CHECK(s.block_size == VX_CACHE_BLOCK);
        CHECK(s.blocks * VX_CACHE_BLOCK < caps[i]);
        CHECK((uint64_t)s.max_value == VX_CACHE_HEAD_DATA + (s.blocks / 8 - 1) * VX_CACHE_BLOCK);
        CHECK(s.marker_slots >= VX_CACHE_MIN_MARKERS && s.marker_slots <= VX_CACHE_MAX_MARKERS);
        CHECK(s.entries == 0 && s.bytes == 0 && s.markers == 0);
        CHECK((uintptr_t)c % 4096 == 0);
        CHECK(vx_cache_check(c) == 0);
        vx_cache_destroy(c);
    }
}

static void test_round_trip(void)
{
    vx_cache *c = vx_cache_create(INT64_C(1) << 20);
    CHECK(c != NULL);
    if (c == NULL)
        return;
    const size_t h = VX_CACHE_HEAD_DATA, b = VX_CACHE_BLOCK;
    const size_t sizes[] = {0, 1, 24, h - 1, h, h + 1, h + b - 1, h + b, h + b + 1,
                            h + 5 * b, 1024, 16384, 100000};
    static unsigned char in[100000], out[100000];
    uint8_t key[VX_CACHE_KEY];
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        size_t len = sizes[i];
        make_key(key, i);
        for (size_t j = 0; j < len; j++)
            in[j] = (unsigned char)(j * 7 + i);
        CHECK(vx_cache_put(c, key, in, len, T0, DAY) == 1);
        size_t got = 12345;
        int64_t age = -1;
        memset(out, 0xAA, len);
        CHECK(vx_cache_get(c, key, T0 + 5, -1, out, sizeof out, &got, &age) == VX_CACHE_HIT);
        CHECK(got == len && age == 5);
        CHECK(memcmp(in, out, len) == 0);
        /* SHORT: length reported, nothing copied, nothing counted. */
        if (len > 0) {
            vx_cache_stats before = stats(c);
            got = 0;
            out[0] = 0x55;
            CHECK(vx_cache_get(c, key, T0 + 5, -1, out, len - 1, &got, &age) == VX_CACHE_SHORT);
            CHECK(got == len && out[0] == 0x55);
            vx_cache_stats after = stats(c);
            CHECK(after.hits == before.hits && after.misses == before.misses);
        }
    }
    vx_cache_stats s = stats(c);
    CHECK(s.entries == (int64_t)(sizeof sizes / sizeof sizes[0]));
    int64_t blocks = 0, bytes = 0;
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        blocks += (int64_t)blocks_for(sizes[i]);
        bytes += (int64_t)sizes[i];
    }
    CHECK(s.bytes == blocks * VX_CACHE_BLOCK);
    CHECK(s.value_bytes == bytes);
    CHECK(s.evictions == 0);
    make_key(key, 999);
    size_t got;
    int64_t age;
    CHECK(vx_cache_get(c, key, T0, -1, out, sizeof out, &got, &age) == VX_CACHE_MISS);
    CHECK(vx_cache_check(c) == 0);
    vx_cache_destroy(c);
}

/* Exact LRU against a reference model with the same block accounting. */
#define MODEL_KEYS 400
static void test_lru_model(void)
{
    vx_cache *c = vx_cache_create(INT64_C(256) << 10);
    CHECK(c != NULL);
    if (c == NULL)
        return;
    vx_cache_stats s0 = stats(c);
    const int64_t nblocks = s0.blocks;
    struct {
        int present;
        uint64_t len, last_use;
    } m[MODEL_KEYS];
    memset(m, 0, sizeof m);
    int64_t used = 0, entries = 0, evictions = 0, hits = 0;
    uint64_t tick = 0, seed = 12345;
    static unsigned char buf[1 << 16], out[1 << 16];
    uint8_t key[VX_CACHE_KEY];
    int mismatches = 0;
    for (int step = 0; step < 200000 && mismatches < 5; step++) {
        uint64_t r = rnd(&seed);
        uint64_t k = r % MODEL_KEYS;
        make_key(key, k);
        if ((r >> 20) % 3 == 0) { /* put */
            /* Mostly small, some multi-block, a few over max_value. */
            uint64_t len = (r >> 24) % 8 == 0 ? (r >> 32) % ((uint64_t)s0.max_value + 600)
                                               : (r >> 32) % 1500;
            int stored = vx_cache_put(c, key, buf, len, T0, DAY);
            int expect = len <= (uint64_t)s0.max_value;
            CHECK(stored == expect);
            if (expect) {
                if (m[k].present) {
                    m[k].present = 0;
                    used -= (int64_t)blocks_for(m[k].len);
                    entries--;
                }
                int64_t need = (int64_t)blocks_for(len);
                while (nblocks - used < need) {
                    uint64_t victim = MODEL_KEYS;
                    for (uint64_t j = 0; j < MODEL_KEYS; j++)
                        if (m[j].present && (victim == MODEL_KEYS || m[j].last_use < m[victim].last_use))
                            victim = j;
                    m[victim].present = 0;
                    used -= (int64_t)blocks_for(m[victim].len);
                    entries--;
                    evictions++;
                }
                m[k].present = 1;
                m[k].len = len;
                m[k].last_use = ++tick;
                used += need;
                entries++;
            }
        } else { /* get */
            size_t got = 0;
            int64_t age;
            int rc = vx_cache_get(c, key, T0, -1, out, sizeof out, &got, &age);
            int expect = m[k].present ? VX_CACHE_HIT : VX_CACHE_MISS;
            if (rc != expect || (rc == VX_CACHE_HIT && got != m[k].len)) {
                fprintf(stderr, "step %d key %" PRIu64 ": got %d want %d\n", step, k, rc, expect);
                mismatches++;
            }
            if (m[k].present) {
                m[k].last_use = ++tick;
                hits++;
            }
        }
        if (step % 997 == 0 || step < 2000) {
            vx_cache_stats s = stats(c);
            if (s.entries != entries || s.bytes != used * VX_CACHE_BLOCK ||
                s.evictions != evictions || s.hits != hits) {
                fprintf(stderr, "step %d: entries %" PRId64 "/%" PRId64 " blocks %" PRId64
                        "/%" PRId64 " evictions %" PRId64 "/%" PRId64 "\n",
                        step, s.entries, entries, s.bytes / VX_CACHE_BLOCK, used, s.evictions,
                        evictions);
                mismatches++;
            }
        }
        if (step % 20000 == 0)
            CHECK(vx_cache_check(c) == 0);
    }
    CHECK(mismatches == 0);
    CHECK(evictions > 1000); /* the workload did exercise eviction */
    CHECK(vx_cache_check(c) == 0);
    vx_cache_destroy(c);
}

static void test_lru_order_explicit(void)
{
    vx_cache *c = vx_cache_create(VX_CACHE_MIN_CAPACITY);
    CHECK(c != NULL);
    if (c == NULL)
        return;
    const int64_t n = stats(c).blocks;
    uint8_t key[VX_CACHE_KEY];
    unsigned char v[8] = {0}, out[8];
    size_t got;
    int64_t age;
    for (int64_t i = 0; i < n; i++) { /* exactly fills the pool with 1-block entries */
        make_key(key, (uint64_t)i);
        CHECK(vx_cache_put(c, key, v, sizeof v, T0, DAY) == 1);
    }
    CHECK(stats(c).entries == n && stats(c).evictions == 0);
    make_key(key, 0);
    CHECK(vx_cache_get(c, key, T0, -1, out, sizeof out, &got, &age) == VX_CACHE_HIT);
    make_key(key, (uint64_t)n); /* evicts 1 (0 was used more recently) */
    CHECK(vx_cache_put(c, key, v, sizeof v, T0, DAY) == 1);
    make_key(key, 1);
    CHECK(vx_cache_get(c, key, T0, -1, out, sizeof out, &got, &age) == VX_CACHE_MISS);
    make_key(key, 0);
    CHECK(vx_cache_get(c, key, T0, -1, out, sizeof out, &got, &age) == VX_CACHE_HIT);
    make_key(key, 2);
    CHECK(vx_cache_get(c, key, T0, -1, out, sizeof out, &got, &age) == VX_CACHE_HIT);
    /* A value of 5 blocks evicts the 5 least recent: 3, 4, 5, 6, 7. */
    static unsigned char big[VX_CACHE_HEAD_DATA + 4 * VX_CACHE_BLOCK];
    make_key(key, 100000);
    CHECK(vx_cache_put(c, key, big, sizeof big, T0, DAY) == 1);
    CHECK(stats(c).evictions == 1 + 5);
    for (uint64_t i = 0; i < 10; i++) {
        make_key(key, i);
        int want = (i >= 3 && i <= 7) || i == 1 ? VX_CACHE_MISS : VX_CACHE_HIT;
        CHECK(vx_cache_get(c, key, T0, -1, out, sizeof out, &got, &age) == want);
    }
    CHECK(vx_cache_check(c) == 0);
    vx_cache_destroy(c);
}

static void test_ttl_max_age_replace(void)
{
    vx_cache *c = vx_cache_create(VX_CACHE_MIN_CAPACITY);
    CHECK(c != NULL);
    if (c == NULL)
        return;
    uint8_t key[VX_CACHE_KEY], key2[VX_CACHE_KEY];
    make_key(key, 1);
    make_key(key2, 2);
    unsigned char out[2048];
    size_t got;
    int64_t age = -1;
    CHECK(vx_cache_put(c, key, "hello", 5, T0, 1000) == 1);
    CHECK(vx_cache_get(c, key, T0 + 999, -1, out, sizeof out, &got, &age) == VX_CACHE_HIT);
    CHECK(age == 999 && got == 5 && memcmp(out, "hello", 5) == 0);
    /* A caller whose clock lags the storer's sees age 0, never negative. */
    CHECK(vx_cache_get(c, key, T0 - 10, -1, out, sizeof out, &got, &age) == VX_CACHE_HIT);
    CHECK(age == 0);
    /* max_age: older than the limit is a miss, the entry stays. */
    CHECK(vx_cache_get(c, key, T0 + 500, 499, out, sizeof out, &got, &age) == VX_CACHE_MISS);
    CHECK(vx_cache_get(c, key, T0 + 500, 500, out, sizeof out, &got, &age) == VX_CACHE_HIT);
    CHECK(vx_cache_get(c, key, T0 + 500, 0, out, sizeof out, &got, &age) == VX_CACHE_MISS);
    CHECK(vx_cache_get(c, key, T0, 0, out, sizeof out, &got, &age) == VX_CACHE_HIT && age == 0);
    vx_cache_stats s = stats(c);
    CHECK(s.stale == 2 && s.entries == 1 && s.expired == 0);
    /* TTL: gone at created + ttl, removed and counted. */
    CHECK(vx_cache_get(c, key, T0 + 1000, -1, out, sizeof out, &got, &age) == VX_CACHE_MISS);
    s = stats(c);
    CHECK(s.expired == 1 && s.entries == 0 && s.bytes == 0);
    CHECK(vx_cache_get(c, key, T0 + 1, -1, out, sizeof out, &got, &age) == VX_CACHE_MISS);

    /* Replace: the new value and its new time and TTL, one entry, bytes re-accounted. */
    CHECK(vx_cache_put(c, key, "a", 1, T0, 100) == 1);
    static unsigned char big[2000];
    memset(big, 'b', sizeof big);
    CHECK(vx_cache_put(c, key, big, sizeof big, T0 + 50, 1000) == 1);
    s = stats(c);
    CHECK(s.entries == 1 && s.replaced == 1 && s.value_bytes == 2000);
    CHECK(s.bytes == (int64_t)blocks_for(2000) * VX_CACHE_BLOCK);
    CHECK(vx_cache_get(c, key, T0 + 500, -1, out, sizeof out, &got, &age) == VX_CACHE_HIT);
    CHECK(got == 2000 && age == 450 && memcmp(out, big, 2000) == 0);
    CHECK(vx_cache_put(c, key, "c", 1, T0 + 600, 1000) == 1);
    CHECK(vx_cache_get(c, key, T0 + 601, -1, out, sizeof out, &got, &age) == VX_CACHE_HIT);
    CHECK(got == 1 && out[0] == 'c');

    /* Too large: refused, counted, the old entry stays. */
    int64_t max = s.max_value;
    static unsigned char huge[1 << 16];
    CHECK(max < (int64_t)sizeof huge);
    CHECK(vx_cache_put(c, key, huge, (size_t)max + 1, T0, 1000) == 0);
    CHECK(stats(c).rejected == 1);
    CHECK(vx_cache_get(c, key, T0 + 601, -1, out, sizeof out, &got, &age) == VX_CACHE_HIT);
    CHECK(vx_cache_put(c, key2, huge, (size_t)max, T0, 1000) == 1);

    /* delete and clear */
    CHECK(vx_cache_delete(c, key2) == 1);
    CHECK(vx_cache_delete(c, key2) == 0);
    CHECK(vx_cache_claim(c, key2, T0, 1000, ME) == VX_CLAIM_LEAD);
    CHECK(vx_cache_clear(c) == 0);
    s = stats(c);
    CHECK(s.entries == 0 && s.bytes == 0 && s.markers == 0 && s.value_bytes == 0);
    CHECK(s.stores == 5); /* counters survive a clear */
    CHECK(vx_cache_get(c, key, T0 + 601, -1, out, sizeof out, &got, &age) == VX_CACHE_MISS);
    CHECK(vx_cache_pending(c, key2, T0) == 0);
    CHECK(vx_cache_check(c) == 0);
    vx_cache_destroy(c);
}

static void test_markers(void)
{
    vx_cache *c = vx_cache_create(VX_CACHE_MIN_CAPACITY);
    CHECK(c != NULL);
    if (c == NULL)
        return;
    uint8_t k[VX_CACHE_KEY], other[VX_CACHE_KEY];
    make_key(k, 7);
    make_key(other, 8);
    CHECK(vx_cache_pending(c, k, T0) == 0);
    CHECK(vx_cache_waiting(c, k) == 0);
    CHECK(vx_cache_claim(c, k, T0, 1000, ME) == VX_CLAIM_LEAD);
    CHECK(vx_cache_pending(c, k, T0) == 1);
    CHECK(vx_cache_pending(c, other, T0) == 0);
    CHECK(vx_cache_claim(c, k, T0 + 10, 1000, ME) == VX_CLAIM_WAIT);
    CHECK(vx_cache_claim(c, k, T0 + 20, 1000, ME) == VX_CLAIM_WAIT);
    CHECK(vx_cache_claim(c, k, T0 + 30, 1000, ME) == VX_CLAIM_WAIT);
    CHECK(vx_cache_waiting(c, k) == 3);
    CHECK(vx_cache_unwait(c, k) == 2);
    CHECK(vx_cache_waiting(c, k) == 2);
    CHECK(vx_cache_pending(c, k, T0 + 999) == 1);
    /* The leader died: its marker expires after hold_ms, then the next claim takes over,
     * keeping the count of those still waiting. */
    CHECK(vx_cache_pending(c, k, T0 + 1000) == 0);
    CHECK(vx_cache_claim(c, k, T0 + 1000, 500, ME) == VX_CLAIM_TAKEOVER);
    CHECK(vx_cache_waiting(c, k) == 2);
    CHECK(vx_cache_pending(c, k, T0 + 1499) == 1);
    CHECK(vx_cache_claim(c, k, T0 + 1001, 500, ME) == VX_CLAIM_WAIT);
    CHECK(vx_cache_waiting(c, k) == 3);
    CHECK(vx_cache_release(c, k, ME) == 1);
    CHECK(vx_cache_pending(c, k, T0 + 1002) == 0);
    CHECK(vx_cache_waiting(c, k) == 0);
    CHECK(vx_cache_unwait(c, k) == 0); /* late waiters of a released marker: no-ops */
    CHECK(vx_cache_release(c, k, ME) == 0);
    for (int i = 0; i < 3; i++)
        CHECK(vx_cache_unwait(c, other) == 0);
    vx_cache_stats s = stats(c);
    CHECK(s.claims == 6 && s.takeovers == 1 && s.markers == 0);
    /* Never below zero. */
    CHECK(vx_cache_claim(c, k, T0, 1000, ME) == VX_CLAIM_LEAD);
    CHECK(vx_cache_unwait(c, k) == 0);
    CHECK(vx_cache_waiting(c, k) == 0);
    CHECK(vx_cache_release(c, k, ME) == 1);

    /* The table is bounded: with every marker live, claim leads without one; once they
     * have expired, the sweep reclaims them. */
    int64_t slots = s.marker_slots;
    uint8_t key[VX_CACHE_KEY];
    for (int64_t i = 0; i < slots; i++) {
        make_key(key, 1000 + (uint64_t)i);
        CHECK(vx_cache_claim(c, key, T0, 1000 + i, ME) == VX_CLAIM_LEAD);
    }
    CHECK(stats(c).markers == slots);
    make_key(key, 5000);
    CHECK(vx_cache_claim(c, key, T0, 1000, ME) == VX_CLAIM_FULL);
    CHECK(vx_cache_pending(c, key, T0) == 0);
    CHECK(stats(c).markers_full == 1);
    /* At T0 + 1003, the markers with hold 1000..1003 (4 of them) have expired. */
    CHECK(vx_cache_claim(c, key, T0 + 1003, 1000, ME) == VX_CLAIM_LEAD);
    CHECK(stats(c).markers == slots - 3);
    CHECK(vx_cache_check(c) == 0);
    for (int64_t i = 0; i < slots; i++) {
        make_key(key, 1000 + (uint64_t)i);
        CHECK(vx_cache_pending(c, key, T0 + 1003) == (i >= 4));
        vx_cache_release(c, key, ME);
    }
    CHECK(stats(c).markers == 1);
    CHECK(vx_cache_check(c) == 0);
    vx_cache_destroy(c);
}

/* A child process that claims key (as its own pid) and exits; returns its pid, not reaped. */
static pid_t child_claims(vx_cache *c, const uint8_t *key)
{
    pid_t pid = fork();
    if (pid == 0)
        _exit(vx_cache_claim(c, key, T0, DAY, (int32_t)getpid()) == VX_CLAIM_LEAD ? 0 : 1);
    return pid;
}

static void test_marker_owners(void)
{
    vx_cache *c = vx_cache_create(VX_CACHE_MIN_CAPACITY);
    CHECK(c != NULL);
    if (c == NULL)
        return;
    const int32_t parent = (int32_t)getppid(); /* a process that exists and is not us */
    uint8_t k[VX_CACHE_KEY];
    make_key(k, 70);

    /* Only the owner renews or releases. A renewed lease outlives the old expiry. */
    CHECK(vx_cache_claim(c, k, T0, 100, ME) == VX_CLAIM_LEAD);
    CHECK(vx_cache_renew(c, k, T0 + 50, 100, parent) == 0);
    CHECK(vx_cache_release(c, k, parent) == 0);
    CHECK(vx_cache_renew(c, k, T0 + 50, 100, ME) == 1);
    CHECK(vx_cache_pending(c, k, T0 + 149) == 1);
    CHECK(vx_cache_pending(c, k, T0 + 150) == 0);
    /* The lease lapsed (the leader was stalled): another takes over, and the old leader can
     * neither extend nor drop the new one's marker. */
    CHECK(vx_cache_claim(c, k, T0 + 150, 100, parent) == VX_CLAIM_TAKEOVER);
    CHECK(vx_cache_renew(c, k, T0 + 160, 1000, ME) == 0);
    CHECK(vx_cache_release(c, k, ME) == 0);
    CHECK(vx_cache_pending(c, k, T0 + 249) == 1);
    CHECK(vx_cache_claim(c, k, T0 + 200, 100, ME) == VX_CLAIM_WAIT);
    CHECK(vx_cache_release(c, k, parent) == 1);
    CHECK(vx_cache_renew(c, k, T0 + 200, 100, parent) == 0); /* nothing left to renew */

    /* A leader process that is gone: its marker is dead at once, whatever its lease (a day),
     * once the process is reaped; a zombie still counts (its lease bounds that). */
    uint8_t d[VX_CACHE_KEY];
    make_key(d, 71);
    pid_t pid = child_claims(c, d);
    CHECK(pid > 0);
    siginfo_t info;
    memset(&info, 0, sizeof info);
    CHECK(waitid(P_PID, (id_t)pid, &info, WEXITED | WNOWAIT) == 0); /* exited, not reaped */
    CHECK(info.si_code == CLD_EXITED && info.si_status == 0);
    CHECK(vx_cache_pending(c, d, T0 + 1) == 1);
    CHECK(vx_cache_claim(c, d, T0 + 1, 1000, ME) == VX_CLAIM_WAIT);
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid); /* reaped: the pid no longer exists */
    CHECK(vx_cache_pending(c, d, T0 + 2) == 0);
    vx_cache_stats before = stats(c);
    CHECK(vx_cache_claim(c, d, T0 + 2, 1000, ME) == VX_CLAIM_TAKEOVER);
    CHECK(vx_cache_waiting(c, d) == 1); /* those waiting stay counted */
    CHECK(stats(c).takeovers == before.takeovers + 1);
    CHECK(vx_cache_renew(c, d, T0 + 3, 1000, (int32_t)pid) == 0);
    CHECK(vx_cache_release(c, d, (int32_t)pid) == 0);
    CHECK(vx_cache_pending(c, d, T0 + 3) == 1);
    CHECK(vx_cache_release(c, d, ME) == 1);

    /* Owner 0 (no process): only the lease ends it. */
    CHECK(vx_cache_claim(c, d, T0, 100, 0) == VX_CLAIM_LEAD);
    CHECK(vx_cache_pending(c, d, T0 + 99) == 1);
    CHECK(vx_cache_claim(c, d, T0 + 99, 100, ME) == VX_CLAIM_WAIT);
    CHECK(vx_cache_claim(c, d, T0 + 100, 100, ME) == VX_CLAIM_TAKEOVER);
    CHECK(vx_cache_release(c, d, ME) == 1);
    CHECK(stats(c).markers == 0);
    CHECK(vx_cache_check(c) == 0);
    vx_cache_destroy(c);
}

/* ---------------------------------------------------------------- threads */

#define STRESS_KEYS 300
#define STRESS_THREADS 4

typedef struct {
    vx_cache *c;
    uint64_t seed;
    int ops;
    int64_t hits, bad, marker_bad;
    _Atomic int *stop;
} stress_arg;

static void *stress_main(void *p)
{
    stress_arg *a = p;
    static _Thread_local unsigned char buf[20000], out[20000];
    uint8_t key[VX_CACHE_KEY];
    uint64_t s = a->seed;
    for (int i = 0; i < a->ops; i++) {
        uint64_t r = rnd(&s);
        uint64_t k = r % STRESS_KEYS;
        make_key(key, k);
        int64_t now = T0 + i / 16;
        switch ((r >> 16) % 8) {
        case 0:
        case 1: {
            size_t len = 24 + (size_t)((r >> 24) % 6000);
            if ((r >> 40) % 64 == 0)
                len = 24 + (size_t)((r >> 24) % 19000);
            fill_value(buf, len, k, r);
            if (vx_cache_put(a->c, key, buf, len, now, 1 + (int64_t)((r >> 48) % 2000)) < 0)
                a->bad++;
            break;
        }
        case 7: {
            /* A marker round: lead, then (maybe) wait on someone else's, unwait, release. */
            int rc = vx_cache_claim(a->c, key, now, 50, ME);
            if (rc < 0)
                a->marker_bad++;
            else if (rc == VX_CLAIM_WAIT) {
                if (vx_cache_unwait(a->c, key) < 0)
                    a->marker_bad++;
            } else if (vx_cache_renew(a->c, key, now, 50, ME) < 0 ||
                       vx_cache_release(a->c, key, ME) < 0)
                a->marker_bad++;
            break;
        }
        default: {
            /* Small buffer first (the binding's protocol), then the exact length. */
            size_t got = 0;
            int64_t age = 0;
            int rc = vx_cache_get(a->c, key, now, (r >> 8) % 4 == 0 ? 100 : -1, out, 4096, &got,
                                  &age);
            if (rc == VX_CACHE_SHORT)
                rc = vx_cache_get(a->c, key, now, -1, out, sizeof out, &got, &age);
            if (rc == VX_CACHE_HIT) {
                a->hits++;
                if (!value_ok(out, got, k) || age < 0)
                    a->bad++;
            } else if (rc < 0)
                a->bad++;
        }
        }
    }
    return NULL;
}

typedef struct {
    vx_cache *c;
    _Atomic int *stop;
    int runs, first_error;
} checker_arg;

static void *checker_main(void *p)
{
    checker_arg *a = p;
    /* Acquire: pairs with the main thread's release store after the joins. */
    while (!atomic_load_explicit(a->stop, memory_order_acquire)) {
        int rc = vx_cache_check(a->c);
        if (rc != 0 && a->first_error == 0)
            a->first_error = rc;
        a->runs++;
        /* Every 10 ms: a walk holds the lock for the whole pool (~1,000 blocks here), so
         * walking back to back would mostly measure the walker (10x more under TSan). */
        struct timespec ts = {0, 10000000};
        nanosleep(&ts, NULL);
    }
    return NULL;
}

static void test_threads(int ops)
{
    vx_cache *c = vx_cache_create(INT64_C(512) << 10); /* small: constant eviction */
    CHECK(c != NULL);
    if (c == NULL)
        return;
    _Atomic int stop = 0;
    pthread_t t[STRESS_THREADS], ck;
    stress_arg a[STRESS_THREADS];
    checker_arg ca = {.c = c, .stop = &stop};
    pthread_create(&ck, NULL, checker_main, &ca);
    for (int i = 0; i < STRESS_THREADS; i++) {
        a[i] = (stress_arg){.c = c, .seed = 0x1234567ull * (uint64_t)(i + 1), .ops = ops,
                            .stop = &stop};
        pthread_create(&t[i], NULL, stress_main, &a[i]);
    }
    int64_t hits = 0, bad = 0, marker_bad = 0;
    for (int i = 0; i < STRESS_THREADS; i++) {
        pthread_join(t[i], NULL);
        hits += a[i].hits;
        bad += a[i].bad;
        marker_bad += a[i].marker_bad;
    }
    atomic_store_explicit(&stop, 1, memory_order_release);
    pthread_join(ck, NULL);
    vx_cache_stats s = stats(c);
    printf("test_cache: threads: %d x %d ops, %" PRId64 " hits, %" PRId64 " evictions, %" PRId64
           " expired, %d invariant walks\n",
           STRESS_THREADS, ops, hits, s.evictions, s.expired, ca.runs);
    CHECK(bad == 0 && marker_bad == 0);
    CHECK(ca.first_error == 0);
    CHECK(ca.runs > 0);
    CHECK(s.hits == hits);
    CHECK(hits > 0 && s.evictions > 0 && s.expired > 0);
    CHECK(s.bytes <= s.blocks * VX_CACHE_BLOCK);
    CHECK(vx_cache_check(c) == 0);
    vx_cache_destroy(c);
}

/* ---------------------------------------------------------------- processes */

static void test_fork_shares(void)
{
    vx_cache *c = vx_cache_create(INT64_C(1) << 20);
    CHECK(c != NULL);
    if (c == NULL)
        return;
    enum { CHILDREN = 3, PER_CHILD = 200 };
    pid_t pids[CHILDREN];
    for (int ch = 0; ch < CHILDREN; ch++) {
        pids[ch] = fork();
        if (pids[ch] == 0) {
            unsigned char v[1500];
            uint8_t key[VX_CACHE_KEY];
            for (int i = 0; i < PER_CHILD; i++) {
                uint64_t id = (uint64_t)(ch * PER_CHILD + i);
                make_key(key, id);
                fill_value(v, 24 + id % 1400, id, id * 31);
                if (vx_cache_put(c, key, v, 24 + id % 1400, T0, DAY) != 1)
                    _exit(1);
            }
            _exit(0);
        }
        CHECK(pids[ch] > 0);
    }
    for (int ch = 0; ch < CHILDREN; ch++) {
        int status = 0;
        waitpid(pids[ch], &status, 0);
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    }
    unsigned char out[2000];
    uint8_t key[VX_CACHE_KEY];
    int ok = 0;
    for (uint64_t id = 0; id < CHILDREN * PER_CHILD; id++) {
        make_key(key, id);
        size_t got;
        int64_t age;
        if (vx_cache_get(c, key, T0, -1, out, sizeof out, &got, &age) == VX_CACHE_HIT &&
            value_ok(out, got, id))
            ok++;
    }
    CHECK(ok == CHILDREN * PER_CHILD);
    CHECK(vx_cache_check(c) == 0);
    vx_cache_destroy(c);
}

static void test_dead_holder(void)
{
    vx_cache *c = vx_cache_create(INT64_C(1) << 20);
    CHECK(c != NULL);
    if (c == NULL)
        return;
    uint8_t key[VX_CACHE_KEY];
    make_key(key, 1);
    CHECK(vx_cache_put(c, key, "before", 6, T0, DAY) == 1);
    CHECK(vx_cache_claim(c, key, T0, DAY, ME) == VX_CLAIM_LEAD);
    pid_t pid = fork();
    if (pid == 0) {
        vx_cache_hold(c, 30000); /* killed long before it ends */
        _exit(0);
    }
    CHECK(pid > 0);
    /* Bounded wait (5 s) for the child to hold the lock. */
    for (int i = 0; i < 5000 && !vx_cache_holding(c); i++) {
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    CHECK(vx_cache_holding(c) == 1);
    kill(pid, SIGKILL);
    int status = 0;
    waitpid(pid, &status, 0);
    CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
    /* The next locker recovers: the cache is wiped (it is only a cache), markers too. */
    unsigned char out[16];
    size_t got;
    int64_t age;
    CHECK(vx_cache_get(c, key, T0, -1, out, sizeof out, &got, &age) == VX_CACHE_MISS);
    vx_cache_stats s = stats(c);
    CHECK(s.recoveries == 1 && s.entries == 0 && s.markers == 0);
    CHECK(vx_cache_holding(c) == 0);
    CHECK(vx_cache_pending(c, key, T0) == 0);
    CHECK(vx_cache_put(c, key, "after", 5, T0, DAY) == 1);
    CHECK(vx_cache_get(c, key, T0, -1, out, sizeof out, &got, &age) == VX_CACHE_HIT);
    CHECK(got == 5 && memcmp(out, "after", 5) == 0);
    CHECK(stats(c).recoveries == 1);
    CHECK(vx_cache_check(c) == 0);
    vx_cache_destroy(c);
}

int main(int argc, char **argv)
{
    int ops = argc > 1 ? atoi(argv[1]) : 200000;
    test_bad_input();
    test_geometry();
    test_round_trip();
    test_lru_order_explicit();
    test_lru_model();
    test_ttl_max_age_replace();
    test_markers();
    test_marker_owners();
    test_fork_shares();
    test_dead_holder();
    test_threads(ops);
    if (failures) {
        fprintf(stderr, "test_cache: %d check(s) failed\n", failures);
        return 1;
    }
    printf("test_cache: ok\n");
    return 0;
}
