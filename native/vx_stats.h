/* vx_stats: shared counters and log-linear latency histograms.
 *
 * Plain C11, no Python. Both live in anonymous MAP_SHARED mappings, so objects created
 * before fork() are shared by every worker process: workers write their own slot (one per
 * worker, each starting on its own cache line, so writers never share a line), and any
 * process reads totals at any time without stopping the writers.
 *
 * Memory orders: every counter and bucket is an independent statistic; nothing is published
 * through them, so writes are relaxed fetch_adds/stores and reads are relaxed loads. A reader
 * racing writers sees each value atomically but may see a histogram's count, sum and buckets
 * from slightly different instants; the readers below derive totals from the buckets they
 * actually read so that a percentile is computed from one consistent (if slightly stale) view.
 *
 * Handles (vx_counters, vx_hist) are small per-process structs that point at the shared
 * mapping; a forked child inherits a copy and uses the same shared pages. Callers validate
 * slot/field indices (these functions do not check them).
 */
#ifndef VX_STATS_H
#define VX_STATS_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#define VX_STATS_LINE 64
#define VX_STATS_MAX_SLOTS 4096
#define VX_COUNTERS_MAX_FIELDS 4096

/* ---- counters: slots x fields int64 ---- */

typedef struct vx_counters {
    _Atomic int64_t *base; /* shared mapping */
    size_t slots, fields;
    size_t stride;  /* int64s per slot row: fields rounded up to whole cache lines */
    size_t map_len; /* bytes mapped */
} vx_counters;

_Static_assert(ATOMIC_LLONG_LOCK_FREE == 2 && ATOMIC_LONG_LOCK_FREE == 2,
               "shared-memory atomics must be lock-free to work across processes");
_Static_assert(VX_STATS_LINE % sizeof(int64_t) == 0, "rows are whole lines of int64");

/* Map zeroed counters into *c. 0 on success, else an errno value (EINVAL when slots or
 * fields is outside [1, VX_STATS_MAX_SLOTS] / [1, VX_COUNTERS_MAX_FIELDS]); *c is untouched
 * on failure. Release with vx_counters_destroy. */
int vx_counters_init(vx_counters *c, size_t slots, size_t fields);
/* The same on a memfd, its descriptor stored in *fd (the caller closes it; NULL: anonymous). */
int vx_counters_init_fd(vx_counters *c, size_t slots, size_t fields, int *fd);
/* Map counters of this shape that another process made with vx_counters_init_fd, from a
 * descriptor of its memfd (kept the caller's). EINVAL when the file's size is not theirs. */
int vx_counters_attach(vx_counters *c, int fd, size_t slots, size_t fields);
void vx_counters_destroy(vx_counters *c); /* unmaps this process's view; idempotent */

void vx_counters_add(vx_counters *c, size_t slot, size_t field, int64_t n);
void vx_counters_set(vx_counters *c, size_t slot, size_t field, int64_t value);
int64_t vx_counters_get(const vx_counters *c, size_t slot, size_t field);
int64_t vx_counters_total(const vx_counters *c, size_t field); /* sum over slots */

/* ---- histograms: log-linear, microseconds ----
 * Values below VX_HIST_EXACT get a bucket each. Above, every power of two [2^k, 2^(k+1)) is
 * cut into VX_HIST_SUB equal sub-buckets of width 2^(k-6), so a bucket is at most 1/64
 * (1.56%) of its lower bound wide and its midpoint is within 1/128 (0.78%) of any value in
 * it. Values above VX_HIST_MAX_US (10 minutes) are counted in the bucket of VX_HIST_MAX_US. */

#define VX_HIST_SUB_BITS 6
#define VX_HIST_SUB (1 << VX_HIST_SUB_BITS)   /* 64 */
#define VX_HIST_EXACT (2 * VX_HIST_SUB)        /* 128 */
#define VX_HIST_MAX_US INT64_C(600000000)      /* 10 min */
/* Bucket of VX_HIST_MAX_US: 2^29 <= 6e8 < 2^30, sub-bucket (6e8 >> 23) - 64 = 7, so
 * 128 + (29 - 7) * 64 + 7. */
#define VX_HIST_BUCKETS (VX_HIST_EXACT + (29 - 7) * VX_HIST_SUB + 7 + 1)

typedef struct vx_hist_slot {
    _Atomic int64_t buckets[VX_HIST_BUCKETS];
    _Atomic int64_t count;
    _Atomic int64_t sum;
} vx_hist_slot;

typedef struct vx_hist {
    unsigned char *base; /* shared mapping */
    size_t slots;
    size_t stride;  /* bytes per slot: sizeof(vx_hist_slot) rounded up to whole lines */
    size_t map_len;
} vx_hist;

/* 0 or an errno value (EINVAL when slots is outside [1, VX_STATS_MAX_SLOTS]). */
int vx_hist_init(vx_hist *h, size_t slots);
void vx_hist_destroy(vx_hist *h); /* idempotent */

/* Lock-free: relaxed fetch_add on the value's bucket, the count and the sum. Negative values
 * are recorded as 0. */
void vx_hist_record(vx_hist *h, size_t slot, int64_t value_us);

/* Bucket geometry, pure functions. */
size_t vx_hist_index(int64_t value_us);
int64_t vx_hist_lower(size_t index);
int64_t vx_hist_upper(size_t index); /* inclusive */
int64_t vx_hist_mid(size_t index);   /* representative value, exact below VX_HIST_EXACT */

/* Bucket counts of one slot, or of all slots merged when slot < 0, into out[VX_HIST_BUCKETS].
 * Returns the sum of those counts. */
int64_t vx_hist_merge(const vx_hist *h, long slot, int64_t *out);
/* Count / sum fields of one slot or (slot < 0) of all. */
int64_t vx_hist_count(const vx_hist *h, long slot);
int64_t vx_hist_sum(const vx_hist *h, long slot);

/* Representative value of the nearest-rank q-quantile (rank ceil(q * total), at least 1) of
 * merged counts whose sum is total; 0 when total == 0. q must be in (0, 1]. */
int64_t vx_hist_percentile(const int64_t *counts, int64_t total, double q);

#endif /* VX_STATS_H */
