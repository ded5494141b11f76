/* vx_cache: the shared response cache store. See vx_cache.h for the layout and the contract.
 *
 * Every public function is: lock (recovering from a dead holder), work on plain data, unlock.
 * The work under the lock is bounded: a lookup walks one index chain (load factor <= 1 with
 * a well-mixed hash of the digest), a put evicts at most the blocks it needs, a copy is one
 * memcpy per 512-byte block. Only the marker sweep (when all markers are taken) is O(markers),
 * at most 4096.
 */
#ifndef _GNU_SOURCE
/* MAP_ANONYMOUS, pthread_mutexattr_setrobust, nanosleep: hidden by strict -std=c11. */
#define _GNU_SOURCE
#endif

#include "vx_cache.h"

#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define NONE 0u

static inline uint64_t align_up(uint64_t v, uint64_t a)
{
    return (v + a - 1) & ~(a - 1);
}

static inline uint32_t *next_of(const vx_cache *c)
{
    return (uint32_t *)((unsigned char *)c + c->next_off);
}

static inline uint32_t *buckets_of(const vx_cache *c)
{
    return (uint32_t *)((unsigned char *)c + c->buckets_off);
}

static inline uint32_t *mbuckets_of(const vx_cache *c)
{
    return (uint32_t *)((unsigned char *)c + c->mbuckets_off);
}

/* Block b (1-based). */
static inline unsigned char *block(const vx_cache *c, uint32_t b)
{
    return (unsigned char *)c + c->blocks_off + (uint64_t)(b - 1) * VX_CACHE_BLOCK;
}

static inline vx_centry *entry(const vx_cache *c, uint32_t b)
{
    return (vx_centry *)block(c, b);
}

static inline vx_cmarker *marker(const vx_cache *c, uint32_t m)
{
    return (vx_cmarker *)((unsigned char *)c + c->markers_off) + (m - 1);
}

/* The digest is (normally) already uniform, but tests and callers may pass structured keys:
 * fold all 32 bytes and finish with the splitmix64 mixer. */
static inline uint64_t key_hash(const uint8_t *key)
{
    uint64_t w[4];
    memcpy(w, key, sizeof w);
    uint64_t h = w[0] ^ (w[1] * UINT64_C(0x9e3779b97f4a7c15)) ^ ((w[2] << 29) | (w[2] >> 35)) ^
                 (w[3] * UINT64_C(0xc2b2ae3d27d4eb4f));
    h ^= h >> 30;
    h *= UINT64_C(0xbf58476d1ce4e5b9);
    h ^= h >> 27;
    h *= UINT64_C(0x94d049bb133111eb);
    h ^= h >> 31;
    return h;
}

/* Blocks for a value of len bytes (the head block carries VX_CACHE_HEAD_DATA of them). */
static inline uint64_t blocks_for(uint64_t len)
{
    if (len <= VX_CACHE_HEAD_DATA)
        return 1;
    return 1 + (len - VX_CACHE_HEAD_DATA + VX_CACHE_BLOCK - 1) / VX_CACHE_BLOCK;
}

/* ---------------------------------------------------------------- creation */

vx_cache *vx_cache_create(int64_t capacity_bytes)
{
    if (capacity_bytes < VX_CACHE_MIN_CAPACITY || capacity_bytes > VX_CACHE_MAX_CAPACITY) {
        errno = EINVAL;
        return NULL;
    }
    uint64_t cap = (uint64_t)capacity_bytes;
    /* Markers: one per 4 KiB of capacity, 16 to 4096 (in-flight requests are bounded by the
     * workers' concurrency; 4096 x 56 B = 224 KiB at most, 1/64 of the capacity at least). */
    uint64_t nmarkers = cap >> 12;
    if (nmarkers < VX_CACHE_MIN_MARKERS)
        nmarkers = VX_CACHE_MIN_MARKERS;
    if (nmarkers > VX_CACHE_MAX_MARKERS)
        nmarkers = VX_CACHE_MAX_MARKERS;
    uint64_t nmbuckets = 1;
    while (nmbuckets < nmarkers)
        nmbuckets <<= 1;
    uint64_t hdr = align_up(sizeof(vx_cache), VX_CACHE_LINE);
    uint64_t markers_off = hdr;
    uint64_t mbuckets_off = align_up(markers_off + nmarkers * sizeof(vx_cmarker), VX_CACHE_LINE);
    uint64_t fixed = align_up(mbuckets_off + nmbuckets * sizeof(uint32_t), VX_CACHE_LINE);
    /* The rest of the capacity pays for the blocks: 512 B each, plus 4 B of next[] and at
     * most 4 B of index bucket (nbuckets <= nblocks), plus up to 3 x 63 B of alignment. */
    uint64_t per_block = VX_CACHE_BLOCK + 2 * sizeof(uint32_t);
    uint64_t room = cap - (fixed - hdr) - 3 * VX_CACHE_LINE; /* the header is the constant */
    uint64_t nblocks = room / per_block;
    if (nblocks < 8) {
        errno = EINVAL;
        return NULL;
    }
    uint64_t nbuckets = 1;
    while (nbuckets * 2 <= nblocks)
        nbuckets <<= 1;
    uint64_t buckets_off = fixed;
    uint64_t next_off = align_up(buckets_off + nbuckets * sizeof(uint32_t), VX_CACHE_LINE);
    uint64_t blocks_off = align_up(next_off + nblocks * sizeof(uint32_t), VX_CACHE_LINE);
    uint64_t map_bytes = blocks_off + nblocks * VX_CACHE_BLOCK;

    /* Anonymous + shared: fork() shares the pages. MAP_NORESERVE: the pool is committed page
     * by page as it is used, so a large cache costs nothing until it fills. */
    void *mem = mmap(NULL, map_bytes, PROT_READ | PROT_WRITE,
                     MAP_SHARED | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (mem == MAP_FAILED)
        return NULL;
    vx_cache *c = mem; /* zero-filled: every list and index is already empty */

    pthread_mutexattr_t attr;
    int rc = pthread_mutexattr_init(&attr);
    if (rc == 0) {
        rc = pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
        if (rc == 0)
            rc = pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
        if (rc == 0)
            rc = pthread_mutex_init(&c->lock, &attr);
        pthread_mutexattr_destroy(&attr);
    }
    if (rc != 0) {
        munmap(mem, map_bytes);
        errno = rc;
        return NULL;
    }
    c->capacity = capacity_bytes;
    c->map_bytes = map_bytes;
    c->nblocks = (uint32_t)nblocks;
    c->nbuckets = (uint32_t)nbuckets;
    c->nmarkers = (uint32_t)nmarkers;
    c->nmbuckets = (uint32_t)nmbuckets;
    c->markers_off = markers_off;
    c->mbuckets_off = mbuckets_off;
    c->buckets_off = buckets_off;
    c->next_off = next_off;
    c->blocks_off = blocks_off;
    /* One value may take at most an eighth of the pool, so a single large answer never
     * flushes more than 1/8 of the cache (64 MiB: values up to ~8 MiB). */
    c->max_value = VX_CACHE_HEAD_DATA + (nblocks / 8 - 1) * VX_CACHE_BLOCK;
    atomic_init(&c->hook_holding, 0);
    /* The mapping reaches other threads/processes only through thread creation, fork or a
     * pointer handover that orders these stores before any use. */
    return c;
}

void vx_cache_destroy(vx_cache *c)
{
    /* Never pthread_mutex_destroy: other processes may still use the lock. */
    if (c != NULL)
        munmap(c, c->map_bytes);
}

/* ---------------------------------------------------------------- locking */

/* Empty every list, index and marker table; keep the counters. Under the lock. */
static void wipe(vx_cache *c)
{
    memset(buckets_of(c), 0, (size_t)c->nbuckets * sizeof(uint32_t));
    memset(mbuckets_of(c), 0, (size_t)c->nmbuckets * sizeof(uint32_t));
    /* Used markers are recognised by `live`, which must be cleared for the sweep. */
    for (uint32_t m = 1; m <= c->marker_fresh && m <= c->nmarkers; m++)
        marker(c, m)->live = 0;
    c->lru_head = c->lru_tail = NONE;
    c->free_head = NONE;
    c->fresh = 0;
    c->free_blocks = 0;
    c->marker_free = NONE;
    c->marker_fresh = 0;
    c->markers_used = 0;
    c->entries = c->blocks_used = c->value_bytes = 0;
    atomic_store_explicit(&c->hook_holding, 0, memory_order_relaxed);
}

static int lock(vx_cache *c)
{
    int rc = pthread_mutex_lock(&c->lock);
    if (rc == 0)
        return 0;
    if (rc == EOWNERDEAD) {
        /* The holder died, possibly in the middle of an update: start empty. */
        wipe(c);
        c->recoveries++;
        rc = pthread_mutex_consistent(&c->lock);
        if (rc == 0)
            return 0;
        pthread_mutex_unlock(&c->lock);
    }
    errno = rc;
    return -1;
}

static inline void unlock(vx_cache *c)
{
    pthread_mutex_unlock(&c->lock);
}

/* ---------------------------------------------------------------- entries (under the lock) */

/* The entry for key, or NONE; *link points at the index link that holds it (for removal). */
static uint32_t find(vx_cache *c, const uint8_t *key, uint32_t **link)
{
    uint32_t *l = &buckets_of(c)[key_hash(key) & (c->nbuckets - 1)];
    for (uint32_t b = *l; b != NONE; b = *l) {
        vx_centry *e = entry(c, b);
        if (memcmp(e->key, key, VX_CACHE_KEY) == 0) {
            *link = l;
            return b;
        }
        l = &e->hnext;
    }
    *link = l;
    return NONE;
}

static void lru_unlink(vx_cache *c, uint32_t b)
{
    vx_centry *e = entry(c, b);
    if (e->prev != NONE)
        entry(c, e->prev)->next = e->next;
    else
        c->lru_head = e->next;
    if (e->next != NONE)
        entry(c, e->next)->prev = e->prev;
    else
        c->lru_tail = e->prev;
    e->prev = e->next = NONE;
}

static void lru_push_front(vx_cache *c, uint32_t b)
{
    vx_centry *e = entry(c, b);
    e->prev = NONE;
    e->next = c->lru_head;
    if (c->lru_head != NONE)
        entry(c, c->lru_head)->prev = b;
    else
        c->lru_tail = b;
    c->lru_head = b;
}

/* Unlink entry b (found through *link) from the index and the LRU list; free its blocks. */
static void remove_at(vx_cache *c, uint32_t b, uint32_t *link)
{
    vx_centry *e = entry(c, b);
    uint32_t *next = next_of(c);
    *link = e->hnext;
    lru_unlink(c, b);
    c->entries--;
    c->blocks_used -= e->nblocks;
    c->value_bytes -= (int64_t)e->len;
    /* Splice the whole chain onto the free list: walk to its last block. */
    uint32_t last = b;
    for (uint32_t i = 1; i < e->nblocks; i++)
        last = next[last - 1];
    next[last - 1] = c->free_head;
    c->free_head = b;
    c->free_blocks += e->nblocks;
}

static void evict_tail(vx_cache *c)
{
    uint32_t b = c->lru_tail;
    uint32_t *link;
    uint32_t found = find(c, entry(c, b)->key, &link);
    (void)found; /* == b: every entry on the LRU list is in the index (vx_cache_check) */
    remove_at(c, b, link);
    c->evictions++;
}

static uint32_t alloc_block(vx_cache *c)
{
    if (c->free_head != NONE) {
        uint32_t b = c->free_head;
        c->free_head = next_of(c)[b - 1];
        c->free_blocks--;
        return b;
    }
    return ++c->fresh; /* the caller made sure there is room */
}

/* Copy the value of entry b into dst (its full length). */
static void copy_out(const vx_cache *c, uint32_t b, unsigned char *dst)
{
    const vx_centry *e = entry(c, b);
    const uint32_t *next = next_of(c);
    uint64_t left = e->len;
    uint64_t n = left < VX_CACHE_HEAD_DATA ? left : VX_CACHE_HEAD_DATA;
    memcpy(dst, block(c, b) + sizeof(vx_centry), (size_t)n);
    dst += n;
    left -= n;
    while (left > 0) {
        b = next[b - 1];
        n = left < VX_CACHE_BLOCK ? left : VX_CACHE_BLOCK;
        memcpy(dst, block(c, b), (size_t)n);
        dst += n;
        left -= n;
    }
}

/* ---------------------------------------------------------------- entries: API */

int vx_cache_get(vx_cache *c, const uint8_t *key, int64_t now_ms, int64_t max_age_ms, void *dst,
                 size_t dst_cap, size_t *len, int64_t *age_ms)
{
    if (lock(c) < 0)
        return VX_CACHE_ERROR;
    uint32_t *link;
    uint32_t b = find(c, key, &link);
    if (b == NONE) {
        c->misses++;
        unlock(c);
        return VX_CACHE_MISS;
    }
    vx_centry *e = entry(c, b);
    if (now_ms >= e->expires_ms) {
        remove_at(c, b, link);
        c->expired++;
        c->misses++;
        unlock(c);
        return VX_CACHE_MISS;
    }
    /* Clocks of different processes are one CLOCK_MONOTONIC, but a caller may have read it
     * just before another process stored the entry: never report a negative age. */
    int64_t age = now_ms > e->created_ms ? now_ms - e->created_ms : 0;
    if (max_age_ms >= 0 && age > max_age_ms) {
        c->stale++;
        c->misses++;
        unlock(c);
        return VX_CACHE_MISS;
    }
    *len = (size_t)e->len;
    if (e->len > dst_cap) {
        unlock(c);
        return VX_CACHE_SHORT;
    }
    copy_out(c, b, dst);
    if (c->lru_head != b) {
        lru_unlink(c, b);
        lru_push_front(c, b);
    }
    c->hits++;
    unlock(c);
    *age_ms = age;
    return VX_CACHE_HIT;
}

int vx_cache_put(vx_cache *c, const uint8_t *key, const void *value, size_t len, int64_t now_ms,
                 int64_t ttl_ms)
{
    if (lock(c) < 0)
        return VX_CACHE_ERROR;
    if ((uint64_t)len > c->max_value) {
        c->rejected++;
        unlock(c);
        return 0;
    }
    uint32_t *link;
    uint32_t old = find(c, key, &link);
    if (old != NONE) {
        remove_at(c, old, link);
        c->replaced++;
    }
    uint32_t need = (uint32_t)blocks_for(len);
    /* need <= nblocks / 8, so the loop ends before the list is empty. */
    while (c->free_blocks + (c->nblocks - c->fresh) < need)
        evict_tail(c);

    uint32_t *next = next_of(c);
    uint32_t head = alloc_block(c);
    vx_centry *e = entry(c, head);
    memcpy(e->key, key, VX_CACHE_KEY);
    e->created_ms = now_ms;
    /* Both are <= VX_CACHE_MAX_MS (the binding checks), so the sum cannot overflow. */
    e->expires_ms = now_ms + ttl_ms;
    e->len = (uint64_t)len;
    e->nblocks = need;
    const unsigned char *src = value;
    size_t n = len < VX_CACHE_HEAD_DATA ? len : VX_CACHE_HEAD_DATA;
    memcpy(block(c, head) + sizeof(vx_centry), src, n);
    src += n;
    size_t left = len - n;
    uint32_t prev = head;
    for (uint32_t i = 1; i < need; i++) {
        uint32_t b = alloc_block(c);
        next[prev - 1] = b;
        n = left < VX_CACHE_BLOCK ? left : VX_CACHE_BLOCK;
        memcpy(block(c, b), src, n);
        src += n;
        left -= n;
        prev = b;
    }
    next[prev - 1] = NONE;
    /* find() above left link at the end of the chain (or where old was): insert at the
     * bucket's head instead, so that a recently stored key is found first. */
    uint32_t *bucket = &buckets_of(c)[key_hash(key) & (c->nbuckets - 1)];
    e->hnext = *bucket;
    *bucket = head;
    lru_push_front(c, head);
    c->entries++;
    c->blocks_used += need;
    c->value_bytes += (int64_t)len;
    c->stores++;
    unlock(c);
    return 1;
}

int vx_cache_delete(vx_cache *c, const uint8_t *key)
{
    if (lock(c) < 0)
        return -1;
    uint32_t *link;
    uint32_t b = find(c, key, &link);
    if (b != NONE)
        remove_at(c, b, link);
    unlock(c);
    return b != NONE;
}

int vx_cache_clear(vx_cache *c)
{
    if (lock(c) < 0)
        return -1;
    wipe(c);
    unlock(c);
    return 0;
}

/* ---------------------------------------------------------------- markers (under the lock) */

static uint32_t mfind(vx_cache *c, const uint8_t *key, uint32_t **link)
{
    uint32_t *l = &mbuckets_of(c)[key_hash(key) & (c->nmbuckets - 1)];
    for (uint32_t m = *l; m != NONE; m = *l) {
        vx_cmarker *mk = marker(c, m);
        if (memcmp(mk->key, key, VX_CACHE_KEY) == 0) {
            *link = l;
            return m;
        }
        l = &mk->hnext;
    }
    *link = l;
    return NONE;
}

static void mremove_at(vx_cache *c, uint32_t m, uint32_t *link)
{
    vx_cmarker *mk = marker(c, m);
    *link = mk->hnext;
    mk->live = 0;
    mk->hnext = c->marker_free;
    c->marker_free = m;
    c->markers_used--;
}

/* Reclaim every expired marker (their waiters, if any, have given up or will claim anew). */
static void msweep(vx_cache *c, int64_t now_ms)
{
    for (uint32_t m = 1; m <= c->marker_fresh; m++) {
        vx_cmarker *mk = marker(c, m);
        if (mk->live && now_ms >= mk->expires_ms) {
            uint32_t *link;
            uint32_t found = mfind(c, mk->key, &link);
            (void)found; /* == m: live markers are in the index */
            mremove_at(c, m, link);
        }
    }
}

static uint32_t malloc_marker(vx_cache *c, int64_t now_ms)
{
    if (c->marker_free == NONE && c->marker_fresh == c->nmarkers)
        msweep(c, now_ms);
    if (c->marker_free != NONE) {
        uint32_t m = c->marker_free;
        c->marker_free = marker(c, m)->hnext;
        return m;
    }
    if (c->marker_fresh < c->nmarkers)
        return ++c->marker_fresh;
    return NONE;
}

/* The owner process still exists. kill(pid, 0) sends nothing: it fails with ESRCH once the
 * process is gone and reaped (a zombie still counts as alive: its lease bounds that window;
 * the supervisor reaps at once). EPERM (another user's process) counts as alive. One syscall,
 * well under a microsecond, made under the lock only by claim/pending of a key whose marker
 * is unexpired. */
static int owner_alive(int32_t owner)
{
    if (owner <= 0)
        return 1;
    return kill((pid_t)owner, 0) == 0 || errno != ESRCH;
}

static int marker_live(const vx_cmarker *mk, int64_t now_ms)
{
    return now_ms < mk->expires_ms && owner_alive(mk->owner);
}

/* ---------------------------------------------------------------- markers: API */

int vx_cache_claim(vx_cache *c, const uint8_t *key, int64_t now_ms, int64_t hold_ms,
                   int32_t owner)
{
    if (lock(c) < 0)
        return -1;
    int rc;
    c->claims++;
    uint32_t *link;
    uint32_t m = mfind(c, key, &link);
    if (m != NONE) {
        vx_cmarker *mk = marker(c, m);
        if (marker_live(mk, now_ms)) {
            if (mk->waiters < INT32_MAX)
                mk->waiters++;
            rc = VX_CLAIM_WAIT;
        } else {
            mk->expires_ms = now_ms + hold_ms;
            mk->owner = owner;
            c->takeovers++;
            rc = VX_CLAIM_TAKEOVER;
        }
    } else if ((m = malloc_marker(c, now_ms)) == NONE) {
        c->markers_full++;
        rc = VX_CLAIM_FULL;
    } else {
        vx_cmarker *mk = marker(c, m);
        memcpy(mk->key, key, VX_CACHE_KEY);
        mk->expires_ms = now_ms + hold_ms;
        mk->waiters = 0;
        mk->live = 1;
        mk->owner = owner;
        /* The sweep may have changed the chain: insert at the bucket's head. */
        uint32_t *bucket = &mbuckets_of(c)[key_hash(key) & (c->nmbuckets - 1)];
        mk->hnext = *bucket;
        *bucket = m;
        c->markers_used++;
        rc = VX_CLAIM_LEAD;
    }
    unlock(c);
    return rc;
}

int vx_cache_renew(vx_cache *c, const uint8_t *key, int64_t now_ms, int64_t hold_ms,
                   int32_t owner)
{
    if (lock(c) < 0)
        return -1;
    uint32_t *link;
    uint32_t m = mfind(c, key, &link);
    int renewed = m != NONE && marker(c, m)->owner == owner;
    if (renewed)
        marker(c, m)->expires_ms = now_ms + hold_ms;
    unlock(c);
    return renewed;
}

int64_t vx_cache_unwait(vx_cache *c, const uint8_t *key)
{
    if (lock(c) < 0)
        return -1;
    uint32_t *link;
    uint32_t m = mfind(c, key, &link);
    int64_t left = 0;
    if (m != NONE) {
        vx_cmarker *mk = marker(c, m);
        if (mk->waiters > 0)
            mk->waiters--;
        left = mk->waiters;
    }
    unlock(c);
    return left;
}

int64_t vx_cache_waiting(vx_cache *c, const uint8_t *key)
{
    if (lock(c) < 0)
        return -1;
    uint32_t *link;
    uint32_t m = mfind(c, key, &link);
    int64_t n = m != NONE ? marker(c, m)->waiters : 0;
    unlock(c);
    return n;
}

int vx_cache_release(vx_cache *c, const uint8_t *key, int32_t owner)
{
    if (lock(c) < 0)
        return -1;
    uint32_t *link;
    uint32_t m = mfind(c, key, &link);
    int dropped = m != NONE && marker(c, m)->owner == owner;
    if (dropped)
        mremove_at(c, m, link);
    unlock(c);
    return dropped;
}

int vx_cache_pending(vx_cache *c, const uint8_t *key, int64_t now_ms)
{
    if (lock(c) < 0)
        return -1;
    uint32_t *link;
    uint32_t m = mfind(c, key, &link);
    int live = m != NONE && marker_live(marker(c, m), now_ms);
    unlock(c);
    return live;
}

/* ---------------------------------------------------------------- stats, checks, hooks */

int vx_cache_read_stats(vx_cache *c, vx_cache_stats *out)
{
    if (lock(c) < 0)
        return -1;
    out->capacity = c->capacity;
    out->mapped = (int64_t)c->map_bytes;
    out->max_value = (int64_t)c->max_value;
    out->blocks = c->nblocks;
    out->block_size = VX_CACHE_BLOCK;
    out->entries = c->entries;
    out->bytes = c->blocks_used * VX_CACHE_BLOCK;
    out->value_bytes = c->value_bytes;
    out->markers = c->markers_used;
    out->marker_slots = c->nmarkers;
    out->hits = c->hits;
    out->misses = c->misses;
    out->stale = c->stale;
    out->stores = c->stores;
    out->replaced = c->replaced;
    out->rejected = c->rejected;
    out->evictions = c->evictions;
    out->expired = c->expired;
    out->claims = c->claims;
    out->takeovers = c->takeovers;
    out->markers_full = c->markers_full;
    out->recoveries = c->recoveries;
    unlock(c);
    return 0;
}

/* Codes of vx_cache_check (the first broken invariant). */
enum {
    CK_OK = 0,
    CK_LRU_LINKS = 1,    /* prev/next disagree, or the list does not end at lru_tail */
    CK_LRU_COUNT = 2,    /* LRU length != entries */
    CK_INDEX = 3,        /* an entry on the LRU list is not found by its key */
    CK_INDEX_COUNT = 4,  /* index chains hold a different number of entries */
    CK_BLOCK_RANGE = 5,  /* a link outside [1, fresh] */
    CK_BLOCK_TWICE = 6,  /* a block in two chains (or twice in one) */
    CK_BLOCK_COUNT = 7,  /* used + free + never used != pool, or blocks_used wrong */
    CK_VALUE_BYTES = 8,  /* value_bytes or an entry's nblocks does not match its length */
    CK_MARKERS = 9,      /* marker index / free list / count disagree */
    CK_SCRATCH = 10,     /* no memory for the check */
};

int vx_cache_check(vx_cache *c)
{
    uint8_t *seen = calloc((size_t)c->nblocks + 1, 1); /* before the lock: never allocate under it */
    uint8_t *mseen = calloc((size_t)c->nmarkers + 1, 1);
    if (seen == NULL || mseen == NULL) {
        free(seen);
        free(mseen);
        return CK_SCRATCH;
    }
    if (lock(c) < 0) {
        free(seen);
        free(mseen);
        return -1;
    }
    int rc = CK_OK;
    const uint32_t *next = next_of(c);
    int64_t count = 0, blocks = 0, bytes = 0;
    uint32_t prev = NONE;
    for (uint32_t b = c->lru_head; b != NONE; b = entry(c, b)->next) {
        if (b > c->fresh) {
            rc = CK_BLOCK_RANGE;
            goto out;
        }
        vx_centry *e = entry(c, b);
        if (e->prev != prev) {
            rc = CK_LRU_LINKS;
            goto out;
        }
        if (++count > c->entries) {
            rc = CK_LRU_COUNT;
            goto out;
        }
        uint32_t *link;
        if (find(c, e->key, &link) != b) {
            rc = CK_INDEX;
            goto out;
        }
        if (e->nblocks != blocks_for(e->len)) {
            rc = CK_VALUE_BYTES;
            goto out;
        }
        uint32_t x = b;
        for (uint32_t i = 0; i < e->nblocks; i++) {
            if (x == NONE || x > c->fresh) {
                rc = CK_BLOCK_RANGE;
                goto out;
            }
            if (seen[x]++) {
                rc = CK_BLOCK_TWICE;
                goto out;
            }
            x = next[x - 1];
        }
        if (x != NONE) {
            rc = CK_BLOCK_RANGE; /* the chain is longer than nblocks says */
            goto out;
        }
        blocks += e->nblocks;
        bytes += (int64_t)e->len;
        prev = b;
    }
    if (prev != c->lru_tail) {
        rc = CK_LRU_LINKS;
        goto out;
    }
    if (count != c->entries) {
        rc = CK_LRU_COUNT;
        goto out;
    }
    if (bytes != c->value_bytes) {
        rc = CK_VALUE_BYTES;
        goto out;
    }
    int64_t indexed = 0;
    for (uint32_t i = 0; i < c->nbuckets; i++)
        for (uint32_t b = buckets_of(c)[i]; b != NONE; b = entry(c, b)->hnext) {
            if (b > c->fresh || ++indexed > c->entries) {
                rc = CK_INDEX_COUNT;
                goto out;
            }
        }
    if (indexed != c->entries) {
        rc = CK_INDEX_COUNT;
        goto out;
    }
    int64_t nfree = 0;
    for (uint32_t b = c->free_head; b != NONE; b = next[b - 1]) {
        if (b > c->fresh) {
            rc = CK_BLOCK_RANGE;
            goto out;
        }
        if (seen[b]++) {
            rc = CK_BLOCK_TWICE;
            goto out;
        }
        nfree++;
    }
    if (blocks != c->blocks_used || nfree != c->free_blocks ||
        blocks + nfree != (int64_t)c->fresh || c->fresh > c->nblocks) {
        rc = CK_BLOCK_COUNT;
        goto out;
    }
    /* Markers: every live one is found by its key, the free list holds the others. */
    int64_t live = 0, mfree = 0;
    for (uint32_t m = 1; m <= c->marker_fresh; m++) {
        vx_cmarker *mk = marker(c, m);
        if (!mk->live)
            continue;
        uint32_t *link;
        if (mfind(c, mk->key, &link) != m || mk->waiters < 0) {
            rc = CK_MARKERS;
            goto out;
        }
        mseen[m] = 1;
        live++;
    }
    for (uint32_t m = c->marker_free; m != NONE; m = marker(c, m)->hnext) {
        if (m > c->marker_fresh || mseen[m]++ || ++mfree > c->nmarkers) {
            rc = CK_MARKERS;
            goto out;
        }
    }
    if (live != c->markers_used || live + mfree != (int64_t)c->marker_fresh)
        rc = CK_MARKERS;
out:
    unlock(c);
    free(seen);
    free(mseen);
    return rc;
}

int vx_cache_hold(vx_cache *c, int64_t hold_ms)
{
    if (lock(c) < 0)
        return -1;
    atomic_store_explicit(&c->hook_holding, 1, memory_order_relaxed);
    struct timespec ts = {.tv_sec = hold_ms / 1000, .tv_nsec = (long)(hold_ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
    atomic_store_explicit(&c->hook_holding, 0, memory_order_relaxed);
    unlock(c);
    return 0;
}

int vx_cache_holding(const vx_cache *c)
{
    /* Relaxed: a report only (see vx_cache.h). The cast drops const for C11's atomic_load,
     * which takes a pointer to non-const on some libcs. */
    return atomic_load_explicit((_Atomic int *)&c->hook_holding, memory_order_relaxed);
}
