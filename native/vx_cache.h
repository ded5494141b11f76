/* vx_cache: the gateway-wide response cache store, one LRU shared by every worker process.
 * Plain C11 + POSIX threads, no Python.
 *
 * Everything lives in ONE anonymous MAP_SHARED mapping created before fork() (like vx_bucket),
 * so every worker sees one cache: a prompt is missed once per gateway, not once per worker, and
 * is held once. The mapping's size is fixed at creation and bounded by `capacity_bytes` plus a
 * small constant (the header and page rounding, under 8 KiB); nothing is allocated afterwards.
 *
 * Layout (offsets from the start of the mapping, each region 64-byte aligned):
 *
 *     header      vx_cache: the lock, the geometry (read-only), the state and counters
 *     markers     nmarkers x vx_cmarker: in-flight markers (cross-worker coalescing)
 *     mbuckets    nmbuckets x uint32: marker index (chained through vx_cmarker.hnext)
 *     buckets     nbuckets x uint32: entry index, keyed by the 32-byte digest (chained
 *                 through vx_centry.hnext); nbuckets is the largest power of two <= nblocks
 *     next        nblocks x uint32: the block chains (an entry's blocks, and the free list)
 *     blocks      nblocks x VX_CACHE_BLOCK bytes: the pool
 *
 * All links are 1-based block / marker numbers, 0 meaning "none", so the zero-filled fresh
 * mapping is already a valid empty cache: creation touches only the header, and pages are
 * resident only once used.
 *
 * Entries. One entry = a chain of equal blocks. The first block starts with the vx_centry
 * header (key, times, length, links) and holds the first VX_CACHE_HEAD_DATA value bytes; the
 * following blocks are pure data, chained through next[]. Blocks never used yet are handed
 * out by a bump pointer (`fresh`), freed ones through a free list, so untouched blocks stay
 * untouched. One doubly linked LRU list (through vx_centry.prev/next) over ALL entries gives
 * exact LRU: a hit moves its entry to the front, a put that does not fit evicts from the back
 * until it does. Accounting is in blocks: `bytes` = blocks in use x VX_CACHE_BLOCK, i.e. the
 * values plus their overhead (the 72-byte header and the unused tail of the last block).
 *
 * Markers. claim() puts an in-flight marker on a key with its leader (`owner`, the leader's
 * pid) and an expiry (now + hold_ms): a lease the leader extends with renew() while its call
 * runs, so a leader that stopped renewing (killed, stopped, its loop stuck) blocks its key for
 * at most one lease. A marker whose owner process no longer exists (kill(owner, 0) fails with
 * ESRCH: the supervisor has reaped it) is dead at once, whatever its lease. A later claim takes
 * a dead or expired marker over; renew() and release() act only on the caller's own marker, so
 * a leader whose marker was taken over never extends or drops its successor's. Owner 0: no
 * process (only the lease ends it). Waiters are counted on the marker (claim that finds a live
 * marker: +1, unwait: -1). The table is bounded (nmarkers, from capacity / 4096, 16 to 4096);
 * when every marker is live, claim answers "lead" without a marker (no coalescing for that
 * key; counted).
 *
 * Concurrency. One process-shared ROBUST mutex guards every field below `lock` except the
 * read-only geometry and the test flag `hook_holding`. Its lock/unlock are the acquire/release
 * pairs that order all the plain data; there is no other atomic on any data path. A process
 * that dies holding the lock (SIGKILL in the middle of a put) leaves the structures possibly
 * half-updated: the next locker gets EOWNERDEAD, wipes the cache (it is only a cache), marks
 * the mutex consistent and counts a recovery. Nothing ever blocks on a dead holder.
 *
 * Time is passed in as CLOCK_MONOTONIC milliseconds (velox.health.now_ms) so tests drive it.
 * An entry expires when now_ms >= created_ms + ttl_ms.
 */
#ifndef VX_CACHE_H
#define VX_CACHE_H

#include <pthread.h>
#include <stdalign.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define VX_CACHE_KEY 32     /* a SHA-256 digest */
#define VX_CACHE_BLOCK 512  /* pool block; 1 KiB values take 3 blocks, 16 KiB take 33 */
#define VX_CACHE_LINE 64
#define VX_CACHE_MIN_CAPACITY (INT64_C(64) << 10)
#define VX_CACHE_MAX_CAPACITY (INT64_C(1) << 40) /* 2^31 blocks: links fit in uint32 */
#define VX_CACHE_MAX_MS (INT64_C(1) << 50)       /* times, TTLs and holds: 35,000 years */
#define VX_CACHE_MIN_MARKERS 16
#define VX_CACHE_MAX_MARKERS 4096

/* Results of vx_cache_get. */
enum {
    VX_CACHE_ERROR = -1, /* the lock is unusable (cannot happen unless a holder unlocked an
                          * inconsistent mutex without marking it; errno has the reason) */
    VX_CACHE_MISS = 0,   /* absent, expired (removed), or older than max_age_ms (kept) */
    VX_CACHE_HIT = 1,    /* copied: *len bytes into dst, *age_ms set, entry now most recent */
    VX_CACHE_SHORT = 2,  /* present and fresh, but *len > dst_cap: nothing copied, LRU and
                          * counters untouched; call again with a buffer of *len bytes */
};

/* Results of vx_cache_claim. */
enum {
    VX_CLAIM_WAIT = 0,     /* a live marker exists: the caller is counted as a waiter */
    VX_CLAIM_LEAD = 1,     /* no marker existed: the caller's marker is set */
    VX_CLAIM_TAKEOVER = 2, /* an expired marker, or one whose owner is gone, was taken over
                            * (its waiter count is kept) */
    VX_CLAIM_FULL = 3,     /* every marker is live: lead, but without a marker */
};

typedef struct vx_centry {
    uint8_t key[VX_CACHE_KEY];
    int64_t created_ms;
    int64_t expires_ms;
    uint64_t len;     /* value bytes */
    uint32_t prev;    /* LRU: toward the most recent end; 0 at the front */
    uint32_t next;    /* LRU: toward the least recent end; 0 at the back */
    uint32_t hnext;   /* index chain */
    uint32_t nblocks; /* blocks in the chain, this one included */
} vx_centry;

#define VX_CACHE_HEAD_DATA (VX_CACHE_BLOCK - sizeof(vx_centry))

typedef struct vx_cmarker {
    uint8_t key[VX_CACHE_KEY];
    int64_t expires_ms;
    int32_t waiters;
    uint32_t hnext; /* index chain, or the free list */
    uint32_t live;  /* 1 while in the index */
    int32_t owner;  /* the leader's pid; 0: none (only the expiry ends the marker) */
} vx_cmarker;

typedef struct vx_cache_stats {
    int64_t capacity;   /* capacity_bytes as given */
    int64_t mapped;     /* the mapping's size */
    int64_t max_value;  /* the largest value put() stores */
    int64_t blocks;     /* pool size */
    int64_t block_size; /* VX_CACHE_BLOCK */
    int64_t entries;
    int64_t bytes;      /* blocks in use x block size: values + their overhead */
    int64_t value_bytes;
    int64_t markers;    /* markers in the table (live or expired, not yet reclaimed) */
    int64_t marker_slots;
    /* Counters (only grow, except through a wipe of the mapping they live in: never). */
    int64_t hits, misses, stale, stores, replaced, rejected, evictions, expired;
    int64_t claims, takeovers, markers_full, recoveries;
} vx_cache_stats;

typedef struct vx_cache {
    /* The one lock. PTHREAD_PROCESS_SHARED + PTHREAD_MUTEX_ROBUST. */
    alignas(VX_CACHE_LINE) pthread_mutex_t lock;

    /* Geometry: read-only after creation. */
    alignas(VX_CACHE_LINE) int64_t capacity;
    uint64_t map_bytes;
    uint64_t max_value;
    uint32_t nblocks, nbuckets, nmarkers, nmbuckets; /* nbuckets, nmbuckets: powers of two */
    uint64_t markers_off, mbuckets_off, buckets_off, next_off, blocks_off;

    /* State (under the lock). */
    alignas(VX_CACHE_LINE) uint32_t lru_head; /* most recently used */
    uint32_t lru_tail;                        /* least recently used */
    uint32_t free_head;                       /* free list of blocks, through next[] */
    uint32_t fresh;                           /* blocks 1..fresh have been handed out once */
    uint32_t free_blocks;                     /* on the free list */
    uint32_t marker_free;                     /* free list of markers, through hnext */
    uint32_t marker_fresh;
    uint32_t markers_used;
    int64_t entries, blocks_used, value_bytes;
    int64_t hits, misses, stale, stores, replaced, rejected, evictions, expired;
    int64_t claims, takeovers, markers_full, recoveries;

    /* Test hook flag (vx_cache_hold): 1 while a holder sleeps with the lock. Written under the
     * lock, read without it: relaxed is enough, it only reports, nothing is published. */
    alignas(VX_CACHE_LINE) _Atomic int hook_holding;
} vx_cache;

_Static_assert(sizeof(vx_centry) == 72, "entry header: 72 bytes at the start of a block");
_Static_assert(VX_CACHE_HEAD_DATA >= 256, "the head block still carries data");
_Static_assert((VX_CACHE_BLOCK & (VX_CACHE_BLOCK - 1)) == 0, "block size: a power of two");
_Static_assert(VX_CACHE_BLOCK % VX_CACHE_LINE == 0, "blocks start on cache lines");
_Static_assert(_Alignof(vx_centry) <= VX_CACHE_LINE, "entry header aligned in its block");
_Static_assert(sizeof(vx_cmarker) == 56, "marker record");
_Static_assert(sizeof(pid_t) == sizeof(int32_t), "an owner pid fits the marker");
_Static_assert(offsetof(vx_cache, lock) == 0, "the lock opens the header");
_Static_assert(offsetof(vx_cache, capacity) % VX_CACHE_LINE == 0, "geometry on its own line");
_Static_assert(offsetof(vx_cache, lru_head) % VX_CACHE_LINE == 0, "state on its own line");
_Static_assert(sizeof(vx_cache) <= 8 * VX_CACHE_LINE, "header: at most 512 bytes");
_Static_assert(ATOMIC_INT_LOCK_FREE == 2, "the hook flag is lock-free across processes");
_Static_assert(VX_CACHE_MAX_CAPACITY / VX_CACHE_BLOCK < UINT32_MAX, "block links fit uint32");

/* Map a cache bounded by capacity_bytes in [VX_CACHE_MIN_CAPACITY, VX_CACHE_MAX_CAPACITY].
 * NULL with errno EINVAL for a bad capacity, or mmap's / pthread's errno. */
vx_cache *vx_cache_create(int64_t capacity_bytes);
/* Unmap this process's view (NULL accepted); other processes keep theirs. */
void vx_cache_destroy(vx_cache *c);

/* Look key up. See VX_CACHE_* above. max_age_ms < 0: no age limit. An entry past its TTL is
 * removed (counted `expired`); one older than max_age_ms is left alone (counted `stale`). */
int vx_cache_get(vx_cache *c, const uint8_t *key, int64_t now_ms, int64_t max_age_ms, void *dst,
                 size_t dst_cap, size_t *len, int64_t *age_ms);
/* Insert or replace; evicts least recently used entries until the value fits. 1 stored, 0
 * not (len > max_value: counted `rejected`; nothing else changes, an old entry stays), -1
 * VX_CACHE_ERROR. ttl_ms >= 1. */
int vx_cache_put(vx_cache *c, const uint8_t *key, const void *value, size_t len, int64_t now_ms,
                 int64_t ttl_ms);
/* Remove key's entry: 1 removed, 0 absent, -1 error. */
int vx_cache_delete(vx_cache *c, const uint8_t *key);
/* Drop every entry and marker (counters are kept). 0, or -1 error. */
int vx_cache_clear(vx_cache *c);

/* One of VX_CLAIM_*, or -1 error. hold_ms >= 1; owner: the caller's pid (or 0, see above). A
 * marker is live while now_ms < its expiry and its owner process exists. */
int vx_cache_claim(vx_cache *c, const uint8_t *key, int64_t now_ms, int64_t hold_ms,
                   int32_t owner);
/* The leader extends its lease: expiry = now_ms + hold_ms when key's marker is owner's. 1
 * renewed, 0 not (no marker, or another owner's: taken over after it lapsed), -1 error. */
int vx_cache_renew(vx_cache *c, const uint8_t *key, int64_t now_ms, int64_t hold_ms,
                   int32_t owner);
/* Waiters -= 1 (not below 0) on key's marker, if any. Returns the count left, or -1 error. */
int64_t vx_cache_unwait(vx_cache *c, const uint8_t *key);
/* Waiters on key's marker (0 when there is none), or -1 error. */
int64_t vx_cache_waiting(vx_cache *c, const uint8_t *key);
/* Drop key's marker if it is owner's: 1 dropped, 0 none (or another owner's), -1 error. */
int vx_cache_release(vx_cache *c, const uint8_t *key, int32_t owner);
/* 1 when a live marker exists (unexpired, its owner alive), 0 not, -1 error. */
int vx_cache_pending(vx_cache *c, const uint8_t *key, int64_t now_ms);

/* A consistent snapshot (taken under the lock). 0, or -1 error. */
int vx_cache_read_stats(vx_cache *c, vx_cache_stats *out);

/* Walk every structure under the lock and check the invariants (tests): every entry is in
 * the index once and on the LRU list once, both lists are consistent both ways, block counts
 * add up (used + free + never used == pool), no block is in two chains, counters match.
 * 0 when all hold, else a positive code naming the first broken one (see vx_cache.c). */
int vx_cache_check(vx_cache *c);

/* Test hook: take the lock, set hook_holding, sleep hold_ms, clear it, unlock. 0 or -1. */
int vx_cache_hold(vx_cache *c, int64_t hold_ms);
/* hook_holding, read without the lock. */
int vx_cache_holding(const vx_cache *c);

#endif /* VX_CACHE_H */
