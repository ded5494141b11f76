/* vx_stats: shared counters and log-linear histograms. See vx_stats.h for the contract. */
#ifndef _GNU_SOURCE
/* MAP_ANONYMOUS is a BSD/Linux extension that -std=c11 hides. */
#define _GNU_SOURCE
#endif

#include "vx_stats.h"
#include "vx_shm.h"

#include <errno.h>
#include <stdbool.h>
#include <sys/mman.h>

static size_t round_up(size_t n, size_t to)
{
    return (n + to - 1) / to * to;
}

/* Anonymous + shared: zero-filled, no file, and fork() shares the pages rather than
 * copying them. The mapping is page aligned, so row offsets that are multiples of the line
 * size start on their own cache line. */
static void *map_shared(size_t len)
{
    void *mem = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    return mem == MAP_FAILED ? NULL : mem;
}

/* ---- counters ---- */

int vx_counters_init(vx_counters *c, size_t slots, size_t fields)
{
    return vx_counters_init_fd(c, slots, fields, NULL);
}

static bool counters_shape(size_t slots, size_t fields, size_t *stride, size_t *len)
{
    if (slots < 1 || slots > VX_STATS_MAX_SLOTS || fields < 1 || fields > VX_COUNTERS_MAX_FIELDS)
        return false;
    *stride = round_up(fields, VX_STATS_LINE / sizeof(int64_t));
    *len = slots * *stride * sizeof(int64_t);
    return true;
}

/* Fill *c with a mapping of the shape counters_shape gave; 0. */
static int counters_view(vx_counters *c, void *mem, size_t slots, size_t fields, size_t stride,
                         size_t len)
{
    c->base = mem;
    c->slots = slots;
    c->fields = fields;
    c->stride = stride;
    c->map_len = len;
    return 0;
}

int vx_counters_init_fd(vx_counters *c, size_t slots, size_t fields, int *fd)
{
    size_t stride, len;
    if (!counters_shape(slots, fields, &stride, &len))
        return EINVAL;
    void *mem = vx_shm_map(len, "velox-counters", fd);
    if (mem == NULL)
        return errno;
    return counters_view(c, mem, slots, fields, stride, len);
}

int vx_counters_attach(vx_counters *c, int fd, size_t slots, size_t fields)
{
    size_t stride, want, len;
    if (!counters_shape(slots, fields, &stride, &want))
        return EINVAL;
    void *mem = vx_shm_attach(fd, &len);
    if (mem == NULL)
        return errno;
    if (len != want) { /* not counters of this shape: refused, not trusted */
        munmap(mem, len);
        return EINVAL;
    }
    return counters_view(c, mem, slots, fields, stride, len);
}

void vx_counters_destroy(vx_counters *c)
{
    if (c->base != NULL)
        munmap((void *)c->base, c->map_len);
    c->base = NULL;
}

void vx_counters_add(vx_counters *c, size_t slot, size_t field, int64_t n)
{
    /* Relaxed: an independent statistic, nothing is published through it. */
    atomic_fetch_add_explicit(&c->base[slot * c->stride + field], n, memory_order_relaxed);
}

void vx_counters_set(vx_counters *c, size_t slot, size_t field, int64_t value)
{
    atomic_store_explicit(&c->base[slot * c->stride + field], value, memory_order_relaxed);
}

int64_t vx_counters_get(const vx_counters *c, size_t slot, size_t field)
{
    return atomic_load_explicit(&c->base[slot * c->stride + field], memory_order_relaxed);
}

int64_t vx_counters_total(const vx_counters *c, size_t field)
{
    int64_t sum = 0;
    for (size_t s = 0; s < c->slots; s++)
        sum += vx_counters_get(c, s, field);
    return sum;
}

/* ---- histogram geometry ---- */

/* Position of the highest set bit of v > 0. */
static int log2_floor(uint64_t v)
{
#if defined(__GNUC__)
    return 63 - __builtin_clzll(v);
#else
    int k = 0;
    while (v >>= 1)
        k++;
    return k;
#endif
}

size_t vx_hist_index(int64_t v)
{
    if (v < 0)
        v = 0;
    if (v > VX_HIST_MAX_US)
        v = VX_HIST_MAX_US;
    if (v < VX_HIST_EXACT)
        return (size_t)v;
    int k = log2_floor((uint64_t)v);                     /* 7 .. 29 */
    size_t sub = (size_t)(v >> (k - VX_HIST_SUB_BITS)) - VX_HIST_SUB; /* 0 .. 63 */
    return VX_HIST_EXACT + (size_t)(k - 7) * VX_HIST_SUB + sub;
}

int64_t vx_hist_lower(size_t i)
{
    if (i < VX_HIST_EXACT)
        return (int64_t)i;
    size_t g = (i - VX_HIST_EXACT) / VX_HIST_SUB, sub = (i - VX_HIST_EXACT) % VX_HIST_SUB;
    return (int64_t)(VX_HIST_SUB + sub) << (g + 1); /* (64 + sub) * 2^(k-6), k = g + 7 */
}

int64_t vx_hist_upper(size_t i)
{
    if (i < VX_HIST_EXACT)
        return (int64_t)i;
    size_t g = (i - VX_HIST_EXACT) / VX_HIST_SUB;
    return vx_hist_lower(i) + ((int64_t)1 << (g + 1)) - 1; /* width 2^(k-6) */
}

int64_t vx_hist_mid(size_t i)
{
    int64_t lo = vx_hist_lower(i), hi = vx_hist_upper(i);
    return lo + (hi - lo) / 2;
}

/* ---- histograms ---- */

int vx_hist_init(vx_hist *h, size_t slots)
{
    if (slots < 1 || slots > VX_STATS_MAX_SLOTS)
        return EINVAL;
    size_t stride = round_up(sizeof(vx_hist_slot), VX_STATS_LINE);
    size_t len = slots * stride;
    void *mem = map_shared(len);
    if (mem == NULL)
        return errno;
    h->base = mem;
    h->slots = slots;
    h->stride = stride;
    h->map_len = len;
    return 0;
}

void vx_hist_destroy(vx_hist *h)
{
    if (h->base != NULL)
        munmap(h->base, h->map_len);
    h->base = NULL;
}

static vx_hist_slot *slot_at(const vx_hist *h, size_t slot)
{
    return (vx_hist_slot *)(h->base + slot * h->stride);
}

void vx_hist_record(vx_hist *h, size_t slot, int64_t value_us)
{
    if (value_us < 0)
        value_us = 0;
    vx_hist_slot *s = slot_at(h, slot);
    /* Relaxed: independent statistics (see vx_stats.h on what readers may see). */
    atomic_fetch_add_explicit(&s->buckets[vx_hist_index(value_us)], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&s->count, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&s->sum, value_us, memory_order_relaxed);
}

int64_t vx_hist_merge(const vx_hist *h, long slot, int64_t *out)
{
    size_t first = slot < 0 ? 0 : (size_t)slot, end = slot < 0 ? h->slots : (size_t)slot + 1;
    int64_t total = 0;
    for (size_t b = 0; b < VX_HIST_BUCKETS; b++)
        out[b] = 0;
    for (size_t s = first; s < end; s++) {
        vx_hist_slot *hs = slot_at(h, s);
        for (size_t b = 0; b < VX_HIST_BUCKETS; b++) {
            int64_t n = atomic_load_explicit(&hs->buckets[b], memory_order_relaxed);
            out[b] += n;
            total += n;
        }
    }
    return total;
}

static int64_t sum_field(const vx_hist *h, long slot, int want_sum)
{
    size_t first = slot < 0 ? 0 : (size_t)slot, end = slot < 0 ? h->slots : (size_t)slot + 1;
    int64_t total = 0;
    for (size_t s = first; s < end; s++) {
        vx_hist_slot *hs = slot_at(h, s);
        total += atomic_load_explicit(want_sum ? &hs->sum : &hs->count, memory_order_relaxed);
    }
    return total;
}

int64_t vx_hist_count(const vx_hist *h, long slot)
{
    return sum_field(h, slot, 0);
}

int64_t vx_hist_sum(const vx_hist *h, long slot)
{
    return sum_field(h, slot, 1);
}

int64_t vx_hist_percentile(const int64_t *counts, int64_t total, double q)
{
    if (total <= 0)
        return 0;
    /* Nearest rank: the smallest value with at least ceil(q * total) values at or below it. */
    double r = q * (double)total;
    if (!(r > 0.0))
        r = 0.0; /* also catches NaN */
    if (r > (double)total)
        r = (double)total;
    int64_t rank = (int64_t)r; /* truncation, then round up: ceil without libm */
    if ((double)rank < r)
        rank++;
    if (rank < 1)
        rank = 1;
    int64_t seen = 0;
    for (size_t b = 0; b < VX_HIST_BUCKETS; b++) {
        seen += counts[b];
        if (seen >= rank)
            return vx_hist_mid(b);
    }
    return vx_hist_mid(VX_HIST_BUCKETS - 1); /* unreachable when total matches counts */
}
