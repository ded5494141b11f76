/* velox._native: the CPython binding of the native core (vx_ring, vx_bucket, vx_stats,
 * vx_json, vx_health, vx_cache, vx_limits, vx_h2, vx_http1, vx_reqhead).
 *
 * Only argument parsing, reference ownership and exceptions live here; the algorithms are
 * in the plain-C files. Heap types created per module (PyType_FromModuleAndSpec) and
 * multi-phase init, so the module holds no process-global Python state.
 *
 * Errors: ValueError for bad values (including integers too large for int64, never
 * OverflowError), TypeError for wrong types, IndexError for slot/field out of range.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h> /* PyMemberDef, T_PYSSIZET: the 3.11 spelling */

#include "vx_bucket.h"
#include "vx_cache.h"
#include "vx_h2.h"
#include "vx_health.h"
#include "vx_http1.h"
#include "vx_json.h"
#include "vx_limits.h"
#include "vx_reqhead.h"
#include "vx_ring.h"
#include "vx_stats.h"

#include <errno.h>
#include <unistd.h> /* getpid: the cache marker's owner */

PyDoc_STRVAR(module_doc,
             "Private native core of Velox: bounded MPMC ring, shared token bucket, shared\n"
             "counters and latency histograms, GIL-free JSON request scanner, shared\n"
             "circuit breakers and retry budget, stable hashes, shared response cache store.\n\n"
             "Do not import this module directly: the public faces are velox.ring,\n"
             "velox.ratelimit and velox.stats.");

typedef struct {
    PyTypeObject *ring_type;
    PyTypeObject *bucket_type;
    PyTypeObject *counters_type;
    PyTypeObject *hist_type;
    PyTypeObject *health_type;
    PyTypeObject *budget_type;
    PyTypeObject *hrw_type;
    PyTypeObject *cache_type;
    PyTypeObject *limits_type;
    PyTypeObject *h2_type;
    PyObject *methods[VX_RH_METHODS]; /* reqhead: one bytes object per method, shared */
    PyObject *names[19];              /* reqhead: the lower-case RH_NAMES, shared */
} module_state;

/* ---------------------------------------------------------------- integer arguments */

/* Convert o (an int or an object with __index__) to int64 into *out. Returns 0, or -1 with
 * TypeError set for non-integers. *overflow is set to +1/-1 (and *out to INT64_MAX/INT64_MIN)
 * when the value does not fit, so callers can clamp or raise ValueError as their contract
 * says, instead of leaking OverflowError. */
static int to_i64(PyObject *o, int64_t *out, int *overflow)
{
    long long v;
    *overflow = 0;
    if (PyLong_CheckExact(o)) {
        v = PyLong_AsLongLongAndOverflow(o, overflow);
    } else {
        PyObject *idx = PyNumber_Index(o); /* new reference; TypeError for float, str, ... */
        if (idx == NULL)
            return -1;
        v = PyLong_AsLongLongAndOverflow(idx, overflow);
        Py_DECREF(idx);
    }
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (*overflow)
        v = *overflow > 0 ? INT64_MAX : INT64_MIN;
    *out = (int64_t)v;
    return 0;
}

/* to_i64 that also requires lo <= value <= hi; otherwise ValueError naming the argument and
 * quoting the value as given. Returns 0 or -1 with an exception set. */
static int arg_in_range(PyObject *o, const char *name, int64_t lo, int64_t hi, int64_t *out)
{
    int overflow;
    if (to_i64(o, out, &overflow) < 0)
        return -1;
    if (overflow || *out < lo || *out > hi) {
        PyErr_Format(PyExc_ValueError, "%s must be an integer in [%lld, %lld], got %R", name,
                     (long long)lo, (long long)hi, o);
        return -1;
    }
    return 0;
}

/* Slot/field index: 0 <= value < n, or IndexError. */
static int arg_index(PyObject *o, const char *name, size_t n, size_t *out)
{
    int64_t v;
    int overflow;
    if (to_i64(o, &v, &overflow) < 0)
        return -1;
    if (overflow || v < 0 || (uint64_t)v >= n) {
        PyErr_Format(PyExc_IndexError, "%s %R out of range [0, %zu)", name, o, n);
        return -1;
    }
    *out = (size_t)v;
    return 0;
}

/* Histogram slot: -1 (all slots) or a valid index, else IndexError. */
static int arg_hist_slot(PyObject *o, size_t n, long *out)
{
    if (o == NULL) {
        *out = -1;
        return 0;
    }
    int64_t v;
    int overflow;
    if (to_i64(o, &v, &overflow) < 0)
        return -1;
    if (overflow || v < -1 || (v >= 0 && (uint64_t)v >= n)) {
        PyErr_Format(PyExc_IndexError, "slot %R out of range: -1 (all) or [0, %zu)", o, n);
        return -1;
    }
    *out = (long)v;
    return 0;
}

static int check_nargs(const char *fname, Py_ssize_t nargs, Py_ssize_t lo, Py_ssize_t hi)
{
    if (nargs < lo || nargs > hi) {
        if (lo == hi)
            PyErr_Format(PyExc_TypeError, "%s() takes exactly %zd positional argument%s (%zd given)",
                         fname, lo, lo == 1 ? "" : "s", nargs);
        else
            PyErr_Format(PyExc_TypeError, "%s() takes from %zd to %zd positional arguments (%zd given)",
                         fname, lo, hi, nargs);
        return -1;
    }
    return 0;
}

/* ---------------------------------------------------------------- Ring */

/* The ring holds one strong reference per stored item: try_push takes a new reference,
 * try_pop / pop_batch hand that reference to the caller, clear/dealloc release the rest. */
typedef struct {
    PyObject_HEAD
    vx_ring *ring;         /* owned; NULL only while tp_new is failing */
    PyObject *weakreflist; /* so wrappers and tests can hold weak references */
} RingObject;

static PyObject *Ring_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"capacity", NULL};
    PyObject *cap_obj;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:Ring", kwlist, &cap_obj))
        return NULL;
    int64_t cap;
    int overflow;
    if (to_i64(cap_obj, &cap, &overflow) < 0)
        return NULL;
    if (overflow || cap < 2 || !vx_ring_capacity_ok((size_t)cap)) {
        PyErr_Format(PyExc_ValueError,
                     "capacity must be a power of two in [2, %zu], got %R",
                     (size_t)VX_RING_MAX_CAPACITY, cap_obj);
        return NULL;
    }
    RingObject *self = (RingObject *)type->tp_alloc(type, 0); /* new ref, GC-tracked */
    if (self == NULL)
        return NULL;
    int status;
    self->ring = vx_ring_create((size_t)cap, &status);
    if (self->ring == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    return (PyObject *)self;
}

static int visit_item(void *item, void *ctx)
{
    void **pair = ctx; /* {visitproc, arg} */
    visitproc visit = (visitproc)(uintptr_t)pair[0];
    return visit((PyObject *)item, pair[1]);
}

static int Ring_traverse(RingObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self)); /* heap type instances own a reference to their type */
    if (self->ring == NULL)
        return 0;
    /* The GC runs with the GIL held and every ring operation holds it too, so the ring is
     * quiescent here, as vx_ring_visit requires. */
    void *pair[2] = {(void *)(uintptr_t)visit, arg};
    return vx_ring_visit(self->ring, visit_item, pair);
}

/* Release every stored reference. Each item leaves the ring before its DECREF, so a
 * finaliser that touches the ring sees a consistent one. */
static int Ring_clear(RingObject *self)
{
    void *item;
    if (self->ring == NULL)
        return 0;
    while (vx_ring_pop(self->ring, &item) == VX_OK)
        Py_DECREF((PyObject *)item);
    return 0;
}

static void Ring_dealloc(RingObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    Py_TRASHCAN_BEGIN(self, Ring_dealloc)
    if (self->weakreflist != NULL)
        PyObject_ClearWeakRefs((PyObject *)self);
    Ring_clear(self);
    vx_ring_free(self->ring);
    self->ring = NULL;
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp); /* inside the trashcan block: a deferred dealloc must not drop it twice */
    Py_TRASHCAN_END
}

PyDoc_STRVAR(Ring_try_push_doc,
             "try_push($self, obj, /)\n--\n\n"
             "Store obj (the ring takes a new reference). False when full; never blocks.");

static PyObject *Ring_try_push(RingObject *self, PyObject *obj)
{
    /* INCREF first: once pushed, the item may be popped (and its reference handed out)
     * by anyone. */
    Py_INCREF(obj);
    if (vx_ring_push(self->ring, obj) == VX_OK)
        Py_RETURN_TRUE;
    Py_DECREF(obj); /* the caller's reference keeps it alive */
    Py_RETURN_FALSE;
}

PyDoc_STRVAR(Ring_try_pop_doc,
             "try_pop($self, /)\n--\n\n"
             "Oldest item (its reference passes to the caller), or None when empty.");

static PyObject *Ring_try_pop(RingObject *self, PyObject *Py_UNUSED(ignored))
{
    void *item;
    if (vx_ring_pop(self->ring, &item) == VX_OK)
        return (PyObject *)item; /* the ring's reference becomes the caller's */
    Py_RETURN_NONE;
}

PyDoc_STRVAR(Ring_pop_batch_doc,
             "pop_batch($self, max_n=64, /)\n--\n\n"
             "Up to max_n oldest items in FIFO order (a new list owning their references),\n"
             "[] when empty. max_n <= 0 raises ValueError.");

#define POP_CHUNK 256

static PyObject *Ring_pop_batch(RingObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t max_n = 64;
    if (check_nargs("pop_batch", nargs, 0, 1) < 0)
        return NULL;
    if (nargs == 1) {
        int overflow;
        if (to_i64(args[0], &max_n, &overflow) < 0)
            return NULL;
        if (max_n <= 0) {
            PyErr_Format(PyExc_ValueError, "max_n must be >= 1, got %R", args[0]);
            return NULL;
        }
    }
    /* Size the list by what is there: every Python-level user of the ring holds the GIL, so
     * the count is exact here, and a big max_n does not allocate a big list. */
    size_t want = vx_ring_size(self->ring);
    if ((uint64_t)max_n < want)
        want = (size_t)max_n;
    PyObject *list = PyList_New((Py_ssize_t)want); /* new reference, NULL items */
    if (list == NULL || want == 0)
        return list;
    /* The list exists before anything is popped, so a MemoryError never loses items. */
    void *buf[POP_CHUNK];
    size_t got = 0;
    while (got < want) {
        size_t chunk = want - got < POP_CHUNK ? want - got : POP_CHUNK, n;
        if (vx_ring_pop_batch(self->ring, buf, chunk, &n) != VX_OK)
            break;
        for (size_t i = 0; i < n; i++)
            PyList_SET_ITEM(list, (Py_ssize_t)(got + i), (PyObject *)buf[i]); /* steals */
        got += n;
        if (n < chunk)
            break;
    }
    Py_SET_SIZE(list, (Py_ssize_t)got); /* only shrinks; the unused tail slots are NULL */
    return list;
}

static Py_ssize_t Ring_len(RingObject *self)
{
    return (Py_ssize_t)vx_ring_size(self->ring);
}

static PyObject *Ring_get_capacity(RingObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSize_t(vx_ring_capacity(self->ring));
}

static PyMethodDef Ring_methods[] = {
    {"try_push", (PyCFunction)Ring_try_push, METH_O, Ring_try_push_doc},
    {"try_pop", (PyCFunction)Ring_try_pop, METH_NOARGS, Ring_try_pop_doc},
    {"pop_batch", (PyCFunction)(void (*)(void))Ring_pop_batch, METH_FASTCALL, Ring_pop_batch_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Ring_getset[] = {
    {"capacity", (getter)Ring_get_capacity, NULL, "Number of slots (a power of two).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMemberDef Ring_members[] = {
    {"__weaklistoffset__", T_PYSSIZET, offsetof(RingObject, weakreflist), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

PyDoc_STRVAR(Ring_doc,
             "Ring(capacity)\n--\n\n"
             "Bounded lock-free MPMC FIFO of objects; capacity is a power of two >= 2.\n"
             "try_pop returns None when empty, so None cannot be told apart from 'empty'.");

static PyType_Slot Ring_slots[] = {
    {Py_tp_doc, (void *)Ring_doc},
    {Py_tp_new, Ring_new},
    {Py_tp_dealloc, Ring_dealloc},
    {Py_tp_traverse, Ring_traverse},
    {Py_tp_clear, Ring_clear},
    {Py_tp_methods, Ring_methods},
    {Py_tp_getset, Ring_getset},
    {Py_tp_members, Ring_members},
    {Py_sq_length, Ring_len},
    {0, NULL},
};

static PyType_Spec Ring_spec = {
    .name = "velox._native.Ring",
    .basicsize = sizeof(RingObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Ring_slots,
};

/* ---------------------------------------------------------------- TokenBucket */

typedef struct {
    PyObject_HEAD
    vx_bucket *bucket; /* owned view of the shared mapping; NULL only while tp_new fails */
} BucketObject;

static PyObject *Bucket_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"rate_per_minute", "burst", NULL};
    PyObject *rate_obj, *burst_obj;
    int64_t rate, burst;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO:TokenBucket", kwlist, &rate_obj, &burst_obj))
        return NULL;
    if (arg_in_range(rate_obj, "rate_per_minute", 1, VX_BUCKET_MAX_RATE, &rate) < 0 ||
        arg_in_range(burst_obj, "burst", 1, VX_BUCKET_MAX_BURST, &burst) < 0)
        return NULL;
    BucketObject *self = (BucketObject *)type->tp_alloc(type, 0); /* new reference */
    if (self == NULL)
        return NULL;
    self->bucket = vx_bucket_create(rate, burst, vx_now_us());
    if (self->bucket == NULL) {
        Py_DECREF(self);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return (PyObject *)self;
}

static void Bucket_dealloc(BucketObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    vx_bucket_destroy(self->bucket); /* this process's view; other processes keep theirs */
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

/* Token count argument: n >= 1 else ValueError. Huge n saturates at INT64_MAX, which every
 * caller treats as "more than burst". */
static int arg_tokens(PyObject *o, int64_t *n)
{
    int overflow;
    if (to_i64(o, n, &overflow) < 0)
        return -1;
    if (*n < 1) {
        PyErr_Format(PyExc_ValueError, "n must be >= 1, got %R", o);
        return -1;
    }
    return 0;
}

static int arg_now(PyObject *o, int64_t *now)
{
    return arg_in_range(o, "now_us", INT64_MIN, INT64_MAX, now);
}

PyDoc_STRVAR(Bucket_acquire_doc,
             "acquire($self, n=1, /)\n--\n\n"
             "Take n tokens at once or none. False at once when n > burst.");

static PyObject *Bucket_acquire(BucketObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t n = 1;
    if (nargs != 0) {
        if (check_nargs("acquire", nargs, 0, 1) < 0 || arg_tokens(args[0], &n) < 0)
            return NULL;
    }
    return PyBool_FromLong(vx_bucket_acquire(self->bucket, n));
}

PyDoc_STRVAR(Bucket_acquire_up_to_doc,
             "acquire_up_to($self, n, /)\n--\n\n"
             "Take min(n, whole tokens available); return how many. n < 0: ValueError.");

static PyObject *Bucket_acquire_up_to(BucketObject *self, PyObject *arg)
{
    int64_t n;
    int overflow;
    if (to_i64(arg, &n, &overflow) < 0)
        return NULL;
    if (n < 0) {
        PyErr_Format(PyExc_ValueError, "n must be >= 0, got %R", arg);
        return NULL;
    }
    return PyLong_FromLongLong(vx_bucket_acquire_up_to(self->bucket, n));
}

PyDoc_STRVAR(Bucket_wait_hint_us_doc,
             "wait_hint_us($self, n=1, /)\n--\n\n"
             "Microseconds until n tokens can be available: 0 if now, -1 if n > burst.");

static PyObject *Bucket_wait_hint_us(BucketObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t n = 1;
    if (check_nargs("wait_hint_us", nargs, 0, 1) < 0 || (nargs == 1 && arg_tokens(args[0], &n) < 0))
        return NULL;
    return PyLong_FromLongLong(vx_bucket_wait_hint_us(self->bucket, n, vx_now_us()));
}

PyDoc_STRVAR(Bucket_available_doc,
             "available($self, /)\n--\n\n"
             "Whole tokens available now, pending refill included (approximate; a metric).");

static PyObject *Bucket_available(BucketObject *self, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromLongLong(vx_bucket_available(self->bucket, vx_now_us()));
}

PyDoc_STRVAR(Bucket_acquire_at_doc,
             "_acquire_at($self, n, now_us, /)\n--\n\n"
             "Test hook: acquire(n) with an explicit CLOCK_MONOTONIC time in microseconds.");

static PyObject *Bucket_acquire_at(BucketObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t n, now;
    if (check_nargs("_acquire_at", nargs, 2, 2) < 0 || arg_tokens(args[0], &n) < 0 ||
        arg_now(args[1], &now) < 0)
        return NULL;
    return PyBool_FromLong(vx_bucket_acquire_at(self->bucket, n, now));
}

PyDoc_STRVAR(Bucket_acquire_up_to_at_doc,
             "_acquire_up_to_at($self, n, now_us, /)\n--\n\n"
             "Test hook: acquire_up_to(n) with an explicit clock.");

static PyObject *Bucket_acquire_up_to_at(BucketObject *self, PyObject *const *args,
                                         Py_ssize_t nargs)
{
    int64_t n, now;
    if (check_nargs("_acquire_up_to_at", nargs, 2, 2) < 0 || arg_tokens(args[0], &n) < 0 ||
        arg_now(args[1], &now) < 0)
        return NULL;
    return PyLong_FromLongLong(vx_bucket_acquire_up_to_at(self->bucket, n, now));
}

#define HAMMER_MAX_US INT64_C(60000000) /* a test hook should not be able to hang a run */

PyDoc_STRVAR(Bucket_hammer_doc,
             "_hammer($self, duration_us, n, /)\n--\n\n"
             "Test hook: with the GIL released, call acquire(n) in a tight loop for\n"
             "duration_us (at most 60 s); return the number of tokens admitted.");

static PyObject *Bucket_hammer(BucketObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t duration, n, admitted = 0;
    if (check_nargs("_hammer", nargs, 2, 2) < 0 ||
        arg_in_range(args[0], "duration_us", 0, HAMMER_MAX_US, &duration) < 0 ||
        arg_tokens(args[1], &n) < 0)
        return NULL;
    vx_bucket *b = self->bucket; /* the object outlives the call: the caller holds it */
    Py_BEGIN_ALLOW_THREADS
    int64_t deadline = vx_now_us() + duration;
    while (vx_now_us() < deadline) {
        if (vx_bucket_acquire(b, n))
            admitted += n;
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(admitted);
}

static PyObject *Bucket_get_rate(BucketObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromLongLong(self->bucket->rate);
}

static PyObject *Bucket_get_burst(BucketObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromLongLong(self->bucket->burst);
}

#define FASTCALL(f) (PyCFunction)(void (*)(void))(f)

static PyMethodDef Bucket_methods[] = {
    {"acquire", FASTCALL(Bucket_acquire), METH_FASTCALL, Bucket_acquire_doc},
    {"acquire_up_to", (PyCFunction)Bucket_acquire_up_to, METH_O, Bucket_acquire_up_to_doc},
    {"wait_hint_us", FASTCALL(Bucket_wait_hint_us), METH_FASTCALL, Bucket_wait_hint_us_doc},
    {"available", (PyCFunction)Bucket_available, METH_NOARGS, Bucket_available_doc},
    {"_acquire_at", FASTCALL(Bucket_acquire_at), METH_FASTCALL, Bucket_acquire_at_doc},
    {"_acquire_up_to_at", FASTCALL(Bucket_acquire_up_to_at), METH_FASTCALL,
     Bucket_acquire_up_to_at_doc},
    {"_hammer", FASTCALL(Bucket_hammer), METH_FASTCALL, Bucket_hammer_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Bucket_getset[] = {
    {"rate_per_minute", (getter)Bucket_get_rate, NULL, "Refill rate, tokens per minute.", NULL},
    {"burst", (getter)Bucket_get_burst, NULL, "Capacity in tokens.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(Bucket_doc,
             "TokenBucket(rate_per_minute, burst)\n--\n\n"
             "Lock-free token bucket in shared memory; starts full. A bucket created before\n"
             "fork() is one bucket for the parent and all children.");

static PyType_Slot Bucket_slots[] = {
    {Py_tp_doc, (void *)Bucket_doc},
    {Py_tp_new, Bucket_new},
    {Py_tp_dealloc, Bucket_dealloc},
    {Py_tp_methods, Bucket_methods},
    {Py_tp_getset, Bucket_getset},
    {0, NULL},
};

static PyType_Spec Bucket_spec = {
    .name = "velox._native.TokenBucket",
    .basicsize = sizeof(BucketObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Bucket_slots,
};

/* ---------------------------------------------------------------- Counters */

typedef struct {
    PyObject_HEAD
    vx_counters c; /* owned view of the shared mapping (c.base NULL until created) */
} CountersObject;

static PyObject *Counters_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"slots", "fields", NULL};
    PyObject *slots_obj, *fields_obj;
    int64_t slots, fields;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO:Counters", kwlist, &slots_obj, &fields_obj))
        return NULL;
    if (arg_in_range(slots_obj, "slots", 1, VX_STATS_MAX_SLOTS, &slots) < 0 ||
        arg_in_range(fields_obj, "fields", 1, VX_COUNTERS_MAX_FIELDS, &fields) < 0)
        return NULL;
    CountersObject *self = (CountersObject *)type->tp_alloc(type, 0); /* new ref, zeroed */
    if (self == NULL)
        return NULL;
    int err = vx_counters_init(&self->c, (size_t)slots, (size_t)fields);
    if (err != 0) {
        Py_DECREF(self);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return (PyObject *)self;
}

static void Counters_dealloc(CountersObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    vx_counters_destroy(&self->c);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static int counters_cell(CountersObject *self, PyObject *const *args, size_t *slot, size_t *field)
{
    if (arg_index(args[0], "slot", self->c.slots, slot) < 0 ||
        arg_index(args[1], "field", self->c.fields, field) < 0)
        return -1;
    return 0;
}

PyDoc_STRVAR(Counters_add_doc, "add($self, slot, field, n=1, /)\n--\n\n"
                               "Relaxed atomic fetch_add of n.");

static PyObject *Counters_add(CountersObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    size_t slot, field;
    int64_t n = 1;
    if (check_nargs("add", nargs, 2, 3) < 0 || counters_cell(self, args, &slot, &field) < 0)
        return NULL;
    if (nargs == 3 && arg_in_range(args[2], "n", INT64_MIN, INT64_MAX, &n) < 0)
        return NULL;
    vx_counters_add(&self->c, slot, field, n);
    Py_RETURN_NONE;
}

#define COUNTERS_MANY_MAX 16 /* pairs per add_many call */

PyDoc_STRVAR(Counters_add_many_doc,
             "add_many($self, slot, field, n, field, n, ..., /)\n--\n\n"
             "Relaxed atomic fetch_add of each n to its field of one slot, in one call (up to\n"
             "16 pairs): what a finished request counts costs one call instead of one each.\n"
             "Every argument is checked before anything is added.");

static PyObject *Counters_add_many(CountersObject *self, PyObject *const *args,
                                   Py_ssize_t nargs)
{
    size_t slot, fields[COUNTERS_MANY_MAX];
    int64_t ns[COUNTERS_MANY_MAX];
    if (nargs < 3 || nargs % 2 != 1 || nargs > 1 + 2 * COUNTERS_MANY_MAX) {
        PyErr_Format(PyExc_TypeError,
                     "add_many() takes a slot and 1 to %d (field, n) pairs (%zd arguments given)",
                     COUNTERS_MANY_MAX, nargs);
        return NULL;
    }
    if (arg_index(args[0], "slot", self->c.slots, &slot) < 0)
        return NULL;
    Py_ssize_t pairs = (nargs - 1) / 2;
    for (Py_ssize_t i = 0; i < pairs; i++)
        if (arg_index(args[1 + 2 * i], "field", self->c.fields, &fields[i]) < 0 ||
            arg_in_range(args[2 + 2 * i], "n", INT64_MIN, INT64_MAX, &ns[i]) < 0)
            return NULL;
    for (Py_ssize_t i = 0; i < pairs; i++)
        vx_counters_add(&self->c, slot, fields[i], ns[i]);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(Counters_set_doc, "set($self, slot, field, value, /)\n--\n\n"
                               "Relaxed atomic store (gauges).");

static PyObject *Counters_set(CountersObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    size_t slot, field;
    int64_t v;
    if (check_nargs("set", nargs, 3, 3) < 0 || counters_cell(self, args, &slot, &field) < 0 ||
        arg_in_range(args[2], "value", INT64_MIN, INT64_MAX, &v) < 0)
        return NULL;
    vx_counters_set(&self->c, slot, field, v);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(Counters_get_doc, "get($self, slot, field, /)\n--\n\nCurrent value.");

static PyObject *Counters_get(CountersObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    size_t slot, field;
    if (check_nargs("get", nargs, 2, 2) < 0 || counters_cell(self, args, &slot, &field) < 0)
        return NULL;
    return PyLong_FromLongLong(vx_counters_get(&self->c, slot, field));
}

PyDoc_STRVAR(Counters_totals_doc, "totals($self, /)\n--\n\nPer-field sums over all slots.");

static PyObject *Counters_totals(CountersObject *self, PyObject *Py_UNUSED(ignored))
{
    PyObject *list = PyList_New((Py_ssize_t)self->c.fields); /* new reference */
    if (list == NULL)
        return NULL;
    for (size_t f = 0; f < self->c.fields; f++) {
        PyObject *v = PyLong_FromLongLong(vx_counters_total(&self->c, f));
        if (v == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)f, v); /* steals v */
    }
    return list;
}

PyDoc_STRVAR(Counters_snapshot_doc, "snapshot($self, /)\n--\n\nPer-slot rows of values.");

static PyObject *Counters_snapshot(CountersObject *self, PyObject *Py_UNUSED(ignored))
{
    PyObject *rows = PyList_New((Py_ssize_t)self->c.slots); /* new reference */
    if (rows == NULL)
        return NULL;
    for (size_t s = 0; s < self->c.slots; s++) {
        PyObject *row = PyList_New((Py_ssize_t)self->c.fields);
        if (row == NULL)
            goto fail;
        PyList_SET_ITEM(rows, (Py_ssize_t)s, row); /* steals row; rows owns it now */
        for (size_t f = 0; f < self->c.fields; f++) {
            PyObject *v = PyLong_FromLongLong(vx_counters_get(&self->c, s, f));
            if (v == NULL)
                goto fail;
            PyList_SET_ITEM(row, (Py_ssize_t)f, v);
        }
    }
    return rows;
fail:
    Py_DECREF(rows); /* list dealloc skips the NULL slots */
    return NULL;
}

static PyObject *Counters_get_slots(CountersObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSize_t(self->c.slots);
}

static PyObject *Counters_get_fields(CountersObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSize_t(self->c.fields);
}

static PyMethodDef Counters_methods[] = {
    {"add", FASTCALL(Counters_add), METH_FASTCALL, Counters_add_doc},
    {"add_many", FASTCALL(Counters_add_many), METH_FASTCALL, Counters_add_many_doc},
    {"set", FASTCALL(Counters_set), METH_FASTCALL, Counters_set_doc},
    {"get", FASTCALL(Counters_get), METH_FASTCALL, Counters_get_doc},
    {"totals", (PyCFunction)Counters_totals, METH_NOARGS, Counters_totals_doc},
    {"snapshot", (PyCFunction)Counters_snapshot, METH_NOARGS, Counters_snapshot_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Counters_getset[] = {
    {"slots", (getter)Counters_get_slots, NULL, "Number of slots (rows).", NULL},
    {"fields", (getter)Counters_get_fields, NULL, "Number of fields (columns).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(Counters_doc,
             "Counters(slots, fields)\n--\n\n"
             "slots x fields int64 counters in shared memory, one cache-line-aligned row per\n"
             "slot; shared with processes forked after construction.");

static PyType_Slot Counters_slots[] = {
    {Py_tp_doc, (void *)Counters_doc},
    {Py_tp_new, Counters_new},
    {Py_tp_dealloc, Counters_dealloc},
    {Py_tp_methods, Counters_methods},
    {Py_tp_getset, Counters_getset},
    {0, NULL},
};

static PyType_Spec Counters_spec = {
    .name = "velox._native.Counters",
    .basicsize = sizeof(CountersObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Counters_slots,
};

/* ---------------------------------------------------------------- Histogram */

typedef struct {
    PyObject_HEAD
    vx_hist h; /* owned view of the shared mapping (h.base NULL until created) */
} HistObject;

static PyObject *Hist_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"slots", NULL};
    PyObject *slots_obj;
    int64_t slots;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:Histogram", kwlist, &slots_obj))
        return NULL;
    if (arg_in_range(slots_obj, "slots", 1, VX_STATS_MAX_SLOTS, &slots) < 0)
        return NULL;
    HistObject *self = (HistObject *)type->tp_alloc(type, 0); /* new ref, zeroed */
    if (self == NULL)
        return NULL;
    int err = vx_hist_init(&self->h, (size_t)slots);
    if (err != 0) {
        Py_DECREF(self);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return (PyObject *)self;
}

static void Hist_dealloc(HistObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    vx_hist_destroy(&self->h);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

PyDoc_STRVAR(Hist_record_doc, "record($self, slot, value_us, /)\n--\n\n"
                              "Lock-free record of one value; negative values count as 0.");

static PyObject *Hist_record(HistObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    size_t slot;
    int64_t v;
    int overflow;
    if (check_nargs("record", nargs, 2, 2) < 0 || arg_index(args[0], "slot", self->h.slots, &slot) < 0)
        return NULL;
    if (to_i64(args[1], &v, &overflow) < 0)
        return NULL;
    if (overflow > 0) {
        PyErr_Format(PyExc_ValueError, "value_us %R does not fit in int64", args[1]);
        return NULL;
    }
    vx_hist_record(&self->h, slot, v);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(Hist_percentiles_doc,
             "percentiles($self, /, qs, slot=-1)\n--\n\n"
             "Nearest-rank quantiles (each q in (0, 1]) of one slot or (-1) of all slots;\n"
             "bucket midpoints, exact below 128 us; 0 when empty.");

static PyObject *Hist_percentiles(HistObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"qs", "slot", NULL};
    PyObject *qs_obj, *slot_obj = NULL;
    long slot;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|O:percentiles", kwlist, &qs_obj, &slot_obj) ||
        arg_hist_slot(slot_obj, self->h.slots, &slot) < 0)
        return NULL;
    PyObject *qs = PySequence_Fast(qs_obj, "qs must be a sequence of floats"); /* new ref */
    if (qs == NULL)
        return NULL;
    Py_ssize_t nq = PySequence_Fast_GET_SIZE(qs);
    PyObject *out = PyList_New(nq);
    if (out == NULL)
        goto fail;
    /* Validate every q before reading any bucket. */
    for (Py_ssize_t i = 0; i < nq; i++) {
        double q = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(qs, i)); /* TypeError if not a number */
        if (q == -1.0 && PyErr_Occurred())
            goto fail;
        if (!(q > 0.0 && q <= 1.0)) { /* also rejects NaN */
            PyErr_Format(PyExc_ValueError, "quantile must be in (0, 1], got %R",
                         PySequence_Fast_GET_ITEM(qs, i));
            goto fail;
        }
    }
    int64_t counts[VX_HIST_BUCKETS];
    int64_t total = vx_hist_merge(&self->h, slot, counts);
    for (Py_ssize_t i = 0; i < nq; i++) {
        double q = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(qs, i));
        PyObject *v = PyLong_FromLongLong(vx_hist_percentile(counts, total, q));
        if (v == NULL)
            goto fail;
        PyList_SET_ITEM(out, i, v); /* steals v */
    }
    Py_DECREF(qs);
    return out;
fail:
    Py_XDECREF(out);
    Py_DECREF(qs);
    return NULL;
}

static int parse_slot_only(HistObject *self, const char *fmt, PyObject *args, PyObject *kwds,
                           long *slot)
{
    static char *kwlist[] = {"slot", NULL};
    PyObject *slot_obj = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, fmt, kwlist, &slot_obj))
        return -1;
    return arg_hist_slot(slot_obj, self->h.slots, slot);
}

PyDoc_STRVAR(Hist_count_doc, "count($self, /, slot=-1)\n--\n\nNumber of recorded values.");

static PyObject *Hist_count(HistObject *self, PyObject *args, PyObject *kwds)
{
    long slot;
    if (parse_slot_only(self, "|O:count", args, kwds, &slot) < 0)
        return NULL;
    return PyLong_FromLongLong(vx_hist_count(&self->h, slot));
}

PyDoc_STRVAR(Hist_total_us_doc, "total_us($self, /, slot=-1)\n--\n\nSum of recorded values.");

static PyObject *Hist_total_us(HistObject *self, PyObject *args, PyObject *kwds)
{
    long slot;
    if (parse_slot_only(self, "|O:total_us", args, kwds, &slot) < 0)
        return NULL;
    return PyLong_FromLongLong(vx_hist_sum(&self->h, slot));
}

PyDoc_STRVAR(Hist_buckets_doc,
             "buckets($self, /, slot=-1)\n--\n\n"
             "(upper_bound_us_inclusive, count) of the non-empty buckets, ascending.");

static PyObject *Hist_buckets(HistObject *self, PyObject *args, PyObject *kwds)
{
    long slot;
    if (parse_slot_only(self, "|O:buckets", args, kwds, &slot) < 0)
        return NULL;
    int64_t counts[VX_HIST_BUCKETS];
    vx_hist_merge(&self->h, slot, counts);
    PyObject *out = PyList_New(0); /* new reference */
    if (out == NULL)
        return NULL;
    for (size_t b = 0; b < VX_HIST_BUCKETS; b++) {
        if (counts[b] == 0)
            continue;
        PyObject *pair = Py_BuildValue("(LL)", (long long)vx_hist_upper(b), (long long)counts[b]);
        if (pair == NULL || PyList_Append(out, pair) < 0) { /* Append does not steal */
            Py_XDECREF(pair);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(pair);
    }
    return out;
}

static PyObject *Hist_get_slots(HistObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSize_t(self->h.slots);
}

#define KWCALL(f) (PyCFunction)(void (*)(void))(f)

static PyMethodDef Hist_methods[] = {
    {"record", FASTCALL(Hist_record), METH_FASTCALL, Hist_record_doc},
    {"percentiles", KWCALL(Hist_percentiles), METH_VARARGS | METH_KEYWORDS, Hist_percentiles_doc},
    {"count", KWCALL(Hist_count), METH_VARARGS | METH_KEYWORDS, Hist_count_doc},
    {"total_us", KWCALL(Hist_total_us), METH_VARARGS | METH_KEYWORDS, Hist_total_us_doc},
    {"buckets", KWCALL(Hist_buckets), METH_VARARGS | METH_KEYWORDS, Hist_buckets_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Hist_getset[] = {
    {"slots", (getter)Hist_get_slots, NULL, "Number of per-worker histograms.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(Hist_doc,
             "Histogram(slots)\n--\n\n"
             "Per-slot log-linear latency histograms in shared memory: microseconds, 1 us to\n"
             "10 min, 64 sub-buckets per power of two (values < 128 exact), larger values\n"
             "counted in the top bucket.");

static PyType_Slot Hist_slots[] = {
    {Py_tp_doc, (void *)Hist_doc},
    {Py_tp_new, Hist_new},
    {Py_tp_dealloc, Hist_dealloc},
    {Py_tp_methods, Hist_methods},
    {Py_tp_getset, Hist_getset},
    {0, NULL},
};

static PyType_Spec Hist_spec = {
    .name = "velox._native.Histogram",
    .basicsize = sizeof(HistObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Hist_slots,
};

/* ---------------------------------------------------------------- Health */

/* Breaker transitions this process made, kept for the worker to log (Health.transitions):
 * every transition is made by one CAS, so across processes each is kept exactly once. A
 * worker drains them every tick (250 ms); 64 is far more than a breaker can make in that time
 * (each opening lasts at least open_s >= 1 s), so the overflow count is a safety net. */
#define HEALTH_PENDING 64

typedef struct {
    int64_t upstream;
    int64_t tr;       /* VX_TR_* */
    int64_t at_ms;    /* when */
    int64_t open_ms;  /* OPENED / REOPENED: how long it stays open */
} health_event;

typedef struct {
    PyObject_HEAD
    vx_health *h; /* owned view of the shared mapping; NULL only while tp_new fails */
    /* Per process (the object is copied at fork; the mapping is what is shared). */
    int npending;
    int64_t overflow;
    health_event pending[HEALTH_PENDING];
} HealthObject;

/* Keep a transition this process made (the rare path: nothing happens for VX_TR_NONE). */
static void health_note(HealthObject *self, int64_t i, int tr, int64_t now)
{
    if (tr == VX_TR_NONE)
        return;
    if (self->npending == HEALTH_PENDING) {
        self->overflow++;
        return;
    }
    int64_t open_ms = 0;
    if (tr == VX_TR_OPENED || tr == VX_TR_REOPENED) {
        vx_breaker_view v;
        vx_breaker_read(self->h, i, now, &v);
        open_ms = vx_breaker_open_ms(self->h, v.streak > 0 ? v.streak : 1);
    }
    self->pending[self->npending++] = (health_event){i, tr, now, open_ms};
}

/* A policy field from a keyword-or-positional argument, named in the error. */
static PyObject *Health_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"max_in_flight", "failures", "successes", "open_ms", "max_open_ms",
                             "probes", "probe_lease_ms", NULL};
    PyObject *caps_obj, *o[6];
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOOO:Health", kwlist, &caps_obj, &o[0],
                                     &o[1], &o[2], &o[3], &o[4], &o[5]))
        return NULL;
    vx_health_policy p;
    if (arg_in_range(o[0], "failures", 1, VX_HEALTH_MAX_COUNT, &p.failures) < 0 ||
        arg_in_range(o[1], "successes", 1, VX_HEALTH_MAX_COUNT, &p.successes) < 0 ||
        arg_in_range(o[2], "open_ms", 1, VX_HEALTH_MAX_OPEN_MS, &p.open_ms) < 0 ||
        arg_in_range(o[3], "max_open_ms", p.open_ms, VX_HEALTH_MAX_OPEN_MS, &p.max_open_ms) < 0 ||
        arg_in_range(o[4], "probes", 1, VX_HEALTH_MAX_PROBES, &p.probes) < 0 ||
        arg_in_range(o[5], "probe_lease_ms", 1, VX_HEALTH_MAX_OPEN_MS, &p.probe_lease_ms) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(caps_obj, "max_in_flight must be a sequence of integers");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n < 1 || n > VX_HEALTH_MAX_UPSTREAMS) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "max_in_flight must hold 1 to %d entries (one per "
                     "upstream), got %zd", VX_HEALTH_MAX_UPSTREAMS, n);
        return NULL;
    }
    int64_t *caps = PyMem_Calloc((size_t)n, sizeof(int64_t));
    if (caps == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (arg_in_range(PySequence_Fast_GET_ITEM(seq, i), "max_in_flight[i]", 0, INT64_MAX,
                         &caps[i]) < 0) {
            PyMem_Free(caps);
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    HealthObject *self = (HealthObject *)type->tp_alloc(type, 0); /* new reference */
    if (self == NULL) {
        PyMem_Free(caps);
        return NULL;
    }
    self->h = vx_health_create(n, caps, &p);
    PyMem_Free(caps);
    if (self->h == NULL) {
        Py_DECREF(self);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return (PyObject *)self;
}

static void Health_dealloc(HealthObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    vx_health_destroy(self->h); /* this process's view; other processes keep theirs */
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

/* args[0] is the upstream index; args[pos] (if nargs > pos) is now_ms, else the clock. */
static int health_index(HealthObject *self, PyObject *const *args, int64_t *i)
{
    size_t v;
    if (arg_index(args[0], "upstream", (size_t)self->h->n, &v) < 0)
        return -1;
    *i = (int64_t)v;
    return 0;
}

static int health_now(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t pos, int64_t *now)
{
    if (nargs <= pos || args[pos] == Py_None) {
        *now = vx_now_ms();
        return 0;
    }
    return arg_in_range(args[pos], "now_ms", 0, VX_HEALTH_MAX_NOW_MS, now);
}

PyDoc_STRVAR(Health_peek_doc,
             "peek($self, upstream, now_ms=None, /)\n--\n\n"
             "What a request would get now, taking nothing: PEEK_CLOSED, PEEK_PROBE (admitted\n"
             "as a probe), PEEK_OPEN or PEEK_PROBING (refused).");

static PyObject *Health_peek(HealthObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t i, now;
    if (check_nargs("peek", nargs, 1, 2) < 0 || health_index(self, args, &i) < 0 ||
        health_now(args, nargs, 1, &now) < 0)
        return NULL;
    return PyLong_FromLong(vx_breaker_peek(self->h, i, now));
}

PyDoc_STRVAR(Health_check_doc,
             "check($self, upstream, now_ms=None, /)\n--\n\n"
             "0 when a request could go now; 1 when the breaker refuses it (open, or every\n"
             "probe slot taken); 2 when max_in_flight is reached. Takes nothing.");

static PyObject *Health_check(HealthObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t i, now;
    if (check_nargs("check", nargs, 1, 2) < 0 || health_index(self, args, &i) < 0 ||
        health_now(args, nargs, 1, &now) < 0)
        return NULL;
    long r = 0;
    if (vx_breaker_peek(self->h, i, now) >= VX_PEEK_OPEN)
        r = 1;
    else if (self->h->up[i].max_in_flight > 0 &&
             vx_inflight(self->h, i) >= self->h->up[i].max_in_flight)
        r = 2;
    return PyLong_FromLong(r);
}

PyDoc_STRVAR(Health_usable_mask_doc,
             "usable_mask($self, upstreams, now_ms, /)\n--\n\n"
             "Bit i set when check(upstreams[i], now_ms) == 0; upstreams is a tuple of at most\n"
             "64 indices. One call for a whole group of targets.");

static PyObject *Health_usable_mask(HealthObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t now;
    if (check_nargs("usable_mask", nargs, 2, 2) < 0 || health_now(args, nargs, 1, &now) < 0)
        return NULL;
    if (!PyTuple_Check(args[0]) || PyTuple_GET_SIZE(args[0]) > 64) {
        PyErr_SetString(PyExc_TypeError, "upstreams must be a tuple of at most 64 indices");
        return NULL;
    }
    uint64_t mask = 0;
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(args[0]); k++) {
        int64_t i;
        PyObject *item = PyTuple_GET_ITEM(args[0], k);
        if (health_index(self, &item, &i) < 0)
            return NULL;
        const vx_upstream *u = &self->h->up[i];
        if (vx_breaker_peek(self->h, i, now) >= VX_PEEK_OPEN)
            continue;
        if (u->max_in_flight > 0 && vx_inflight(self->h, i) >= u->max_in_flight)
            continue;
        mask |= (uint64_t)1 << k;
    }
    return PyLong_FromUnsignedLongLong(mask);
}

PyDoc_STRVAR(Health_in_flight_sum_doc,
             "in_flight_sum($self, upstreams, /)\n--\n\n"
             "Sum of in_flight() over a tuple of upstream indices, in one call.");

static PyObject *Health_in_flight_sum(HealthObject *self, PyObject *arg)
{
    if (!PyTuple_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "upstreams must be a tuple of indices");
        return NULL;
    }
    int64_t sum = 0;
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(arg); k++) {
        int64_t i;
        PyObject *item = PyTuple_GET_ITEM(arg, k);
        if (health_index(self, &item, &i) < 0)
            return NULL;
        sum += vx_inflight(self->h, i);
    }
    return PyLong_FromLongLong(sum);
}

PyDoc_STRVAR(Health_admit_doc,
             "admit($self, upstream, now_ms, /)\n--\n\n"
             "enter() + acquire() + count(UP_REQUESTS) in one call: a ticket >= 0, or -1 (breaker\n"
             "refuses) / -2 (max_in_flight reached), having taken nothing.");

static PyObject *Health_admit(HealthObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t i, now;
    if (check_nargs("admit", nargs, 2, 2) < 0 || health_index(self, args, &i) < 0 ||
        health_now(args, nargs, 1, &now) < 0)
        return NULL;
    int tr;
    int64_t ticket = vx_breaker_enter(self->h, i, now, &tr);
    if (ticket < 0)
        return PyLong_FromLong(-1);
    health_note(self, i, tr, now);
    if (!vx_inflight_acquire(self->h, i)) {
        vx_breaker_report(self->h, i, ticket, VX_OUTCOME_NEUTRAL, now); /* a probe slot back */
        return PyLong_FromLong(-2);
    }
    vx_health_count(self->h, i, VX_UP_REQUESTS, 1);
    return PyLong_FromLongLong(ticket);
}

PyDoc_STRVAR(Health_finish_doc,
             "finish($self, upstream, ticket, outcome, now_ms, /)\n--\n\n"
             "release() + report() + count the success or failure, in one call (the\n"
             "transition it caused, if any, is kept for transitions()).");

static PyObject *Health_finish(HealthObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t i, ticket, outcome, now;
    if (check_nargs("finish", nargs, 4, 4) < 0 || health_index(self, args, &i) < 0 ||
        arg_in_range(args[1], "ticket", 0, INT64_MAX, &ticket) < 0 ||
        arg_in_range(args[2], "outcome", 0, 2, &outcome) < 0 ||
        health_now(args, nargs, 3, &now) < 0)
        return NULL;
    vx_inflight_release(self->h, i);
    health_note(self, i, vx_breaker_report(self->h, i, ticket, (int)outcome, now), now);
    if (outcome == VX_OUTCOME_SUCCESS)
        vx_health_count(self->h, i, VX_UP_SUCCESSES, 1);
    else if (outcome == VX_OUTCOME_FAILURE)
        vx_health_count(self->h, i, VX_UP_FAILURES, 1);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(Health_enter_doc,
             "enter($self, upstream, now_ms=None, /)\n--\n\n"
             "Pass the breaker: -1 refused, 0 admitted (closed), > 0 a probe ticket. Every\n"
             "ticket >= 0 must go back through report(). A call that turns the breaker\n"
             "half-open keeps TR_HALF_OPENED for transitions(); so does admit().");

static PyObject *Health_enter(HealthObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t i, now;
    if (check_nargs("enter", nargs, 1, 2) < 0 || health_index(self, args, &i) < 0 ||
        health_now(args, nargs, 1, &now) < 0)
        return NULL;
    int tr;
    int64_t ticket = vx_breaker_enter(self->h, i, now, &tr);
    health_note(self, i, tr, now);
    return PyLong_FromLongLong(ticket);
}

PyDoc_STRVAR(Health_report_doc,
             "report($self, upstream, ticket, outcome, now_ms=None, /)\n--\n\n"
             "The outcome (OUTCOME_SUCCESS, _FAILURE, _NEUTRAL) of a request admitted with\n"
             "ticket; returns the transition it caused (TR_NONE, TR_OPENED, TR_REOPENED,\n"
             "TR_CLOSED), which transitions() also lists.");

static PyObject *Health_report(HealthObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t i, ticket, outcome, now;
    if (check_nargs("report", nargs, 3, 4) < 0 || health_index(self, args, &i) < 0 ||
        arg_in_range(args[1], "ticket", 0, INT64_MAX, &ticket) < 0 ||
        arg_in_range(args[2], "outcome", 0, 2, &outcome) < 0 ||
        health_now(args, nargs, 3, &now) < 0)
        return NULL;
    int tr = vx_breaker_report(self->h, i, ticket, (int)outcome, now);
    health_note(self, i, tr, now);
    return PyLong_FromLong(tr);
}

PyDoc_STRVAR(Health_transitions_doc,
             "transitions($self, /)\n--\n\n"
             "The breaker transitions this process made since the last call, oldest first, and\n"
             "forgets them: ([(upstream, TR_*, at_ms, open_ms), ...], how many did not fit).\n"
             "Each transition is made by one caller in one process, so across every process that\n"
             "drains its own each is listed once. open_ms: how long an opening lasts (else 0).");

static PyObject *Health_transitions(HealthObject *self, PyObject *Py_UNUSED(ignored))
{
    PyObject *list = PyList_New(self->npending);
    if (list == NULL)
        return NULL;
    for (int k = 0; k < self->npending; k++) {
        const health_event *e = &self->pending[k];
        PyObject *item = Py_BuildValue("(LLLL)", (long long)e->upstream, (long long)e->tr,
                                       (long long)e->at_ms, (long long)e->open_ms);
        if (item == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, k, item);
    }
    PyObject *result = Py_BuildValue("(NL)", list, (long long)self->overflow);
    if (result != NULL) {
        self->npending = 0;
        self->overflow = 0;
    }
    return result;
}

PyDoc_STRVAR(Health_breaker_doc,
             "breaker($self, upstream, now_ms=None, /)\n--\n\n"
             "(state, count, probes, streak, stamp_ms, opened_at_ms, open_count,\n"
             "until_half_open_ms) from one read of the breaker word.");

static PyObject *Health_breaker(HealthObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t i, now;
    if (check_nargs("breaker", nargs, 1, 2) < 0 || health_index(self, args, &i) < 0 ||
        health_now(args, nargs, 1, &now) < 0)
        return NULL;
    vx_breaker_view v;
    vx_breaker_read(self->h, i, now, &v);
    return Py_BuildValue("(iLLLLLLL)", v.state, (long long)v.count, (long long)v.probes,
                         (long long)v.streak, (long long)v.stamp_ms, (long long)v.opened_at_ms,
                         (long long)v.open_count, (long long)v.until_half_open_ms);
}

PyDoc_STRVAR(Health_acquire_doc,
             "acquire($self, upstream, /)\n--\n\n"
             "Take one in-flight place; False when max_in_flight is reached (counted as FULL).");

static PyObject *Health_acquire(HealthObject *self, PyObject *arg)
{
    int64_t i;
    if (health_index(self, &arg, &i) < 0)
        return NULL;
    return PyBool_FromLong(vx_inflight_acquire(self->h, i));
}

PyDoc_STRVAR(Health_release_doc, "release($self, upstream, /)\n--\n\n"
                                 "Give back a place taken by acquire().");

static PyObject *Health_release(HealthObject *self, PyObject *arg)
{
    int64_t i;
    if (health_index(self, &arg, &i) < 0)
        return NULL;
    vx_inflight_release(self->h, i);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(Health_in_flight_doc, "in_flight($self, upstream, /)\n--\n\n"
                                   "Requests in flight on the upstream across the gateway.");

static PyObject *Health_in_flight(HealthObject *self, PyObject *arg)
{
    int64_t i;
    if (health_index(self, &arg, &i) < 0)
        return NULL;
    return PyLong_FromLongLong(vx_inflight(self->h, i));
}

PyDoc_STRVAR(Health_max_in_flight_doc, "max_in_flight($self, upstream, /)\n--\n\n"
                                       "The cap given at creation (0: none).");

static PyObject *Health_max_in_flight(HealthObject *self, PyObject *arg)
{
    int64_t i;
    if (health_index(self, &arg, &i) < 0)
        return NULL;
    return PyLong_FromLongLong(self->h->up[i].max_in_flight);
}

PyDoc_STRVAR(Health_count_doc, "count($self, upstream, field, n=1, /)\n--\n\n"
                               "Add n to a counter (UP_REQUESTS ... UP_FULL).");

static PyObject *Health_count(HealthObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t i, n = 1;
    size_t field;
    if (check_nargs("count", nargs, 2, 3) < 0 || health_index(self, args, &i) < 0 ||
        arg_index(args[1], "field", VX_UP_COUNTERS, &field) < 0 ||
        (nargs == 3 && arg_in_range(args[2], "n", 0, INT64_MAX, &n) < 0))
        return NULL;
    vx_health_count(self->h, i, (int)field, n);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(Health_counter_doc, "counter($self, upstream, field, /)\n--\n\nCurrent value.");

static PyObject *Health_counter(HealthObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t i;
    size_t field;
    if (check_nargs("counter", nargs, 2, 2) < 0 || health_index(self, args, &i) < 0 ||
        arg_index(args[1], "field", VX_UP_COUNTERS, &field) < 0)
        return NULL;
    return PyLong_FromLongLong(vx_health_counter(self->h, i, (int)field));
}

static Py_ssize_t Health_len(HealthObject *self)
{
    return (Py_ssize_t)self->h->n;
}

static PyObject *Health_get_policy(HealthObject *self, void *Py_UNUSED(closure))
{
    const vx_health_policy *p = &self->h->policy;
    return Py_BuildValue("{sLsLsLsLsLsL}", "failures", (long long)p->failures, "successes",
                         (long long)p->successes, "open_ms", (long long)p->open_ms,
                         "max_open_ms", (long long)p->max_open_ms, "probes",
                         (long long)p->probes, "probe_lease_ms", (long long)p->probe_lease_ms);
}

static PyMethodDef Health_methods[] = {
    {"peek", FASTCALL(Health_peek), METH_FASTCALL, Health_peek_doc},
    {"check", FASTCALL(Health_check), METH_FASTCALL, Health_check_doc},
    {"usable_mask", FASTCALL(Health_usable_mask), METH_FASTCALL, Health_usable_mask_doc},
    {"in_flight_sum", (PyCFunction)Health_in_flight_sum, METH_O, Health_in_flight_sum_doc},
    {"admit", FASTCALL(Health_admit), METH_FASTCALL, Health_admit_doc},
    {"finish", FASTCALL(Health_finish), METH_FASTCALL, Health_finish_doc},
    {"enter", FASTCALL(Health_enter), METH_FASTCALL, Health_enter_doc},
    {"report", FASTCALL(Health_report), METH_FASTCALL, Health_report_doc},
    {"breaker", FASTCALL(Health_breaker), METH_FASTCALL, Health_breaker_doc},
    {"transitions", (PyCFunction)Health_transitions, METH_NOARGS, Health_transitions_doc},
    {"acquire", (PyCFunction)Health_acquire, METH_O, Health_acquire_doc},
    {"release", (PyCFunction)Health_release, METH_O, Health_release_doc},
    {"in_flight", (PyCFunction)Health_in_flight, METH_O, Health_in_flight_doc},
    {"max_in_flight", (PyCFunction)Health_max_in_flight, METH_O, Health_max_in_flight_doc},
    {"count", FASTCALL(Health_count), METH_FASTCALL, Health_count_doc},
    {"counter", FASTCALL(Health_counter), METH_FASTCALL, Health_counter_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Health_getset[] = {
    {"policy", (getter)Health_get_policy, NULL, "The breaker policy, as a dict.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(Health_doc,
             "Health(max_in_flight, failures, successes, open_ms, max_open_ms, probes,\n"
             "       probe_lease_ms)\n--\n\n"
             "Per-upstream circuit breakers, in-flight gauges and counters in shared memory\n"
             "(one entry per item of max_in_flight). Created before fork(), one state for the\n"
             "parent and every child.");

static PyType_Slot Health_slots[] = {
    {Py_tp_doc, (void *)Health_doc},
    {Py_tp_new, Health_new},
    {Py_tp_dealloc, Health_dealloc},
    {Py_tp_methods, Health_methods},
    {Py_tp_getset, Health_getset},
    {Py_sq_length, Health_len},
    {0, NULL},
};

static PyType_Spec Health_spec = {
    .name = "velox._native.Health",
    .basicsize = sizeof(HealthObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Health_slots,
};

/* ---------------------------------------------------------------- RetryBudget */

typedef struct {
    PyObject_HEAD
    vx_budget *b;
} BudgetObject;

static PyObject *Budget_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"percent", "window_s", "min_per_s", NULL};
    PyObject *o[3];
    int64_t percent, window_s, min_per_s;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO:RetryBudget", kwlist, &o[0], &o[1], &o[2]))
        return NULL;
    if (arg_in_range(o[0], "percent", 0, VX_BUDGET_MAX_PERCENT, &percent) < 0 ||
        arg_in_range(o[1], "window_s", 1, VX_BUDGET_MAX_WINDOW_S, &window_s) < 0 ||
        arg_in_range(o[2], "min_per_s", 0, VX_BUDGET_MAX_MIN_PER_S, &min_per_s) < 0)
        return NULL;
    BudgetObject *self = (BudgetObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->b = vx_budget_create(percent, window_s, min_per_s);
    if (self->b == NULL) {
        Py_DECREF(self);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return (PyObject *)self;
}

static void Budget_dealloc(BudgetObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    vx_budget_destroy(self->b);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static int budget_now(PyObject *const *args, Py_ssize_t nargs, int64_t *now)
{
    if (nargs == 0 || args[0] == Py_None) {
        *now = vx_now_ms();
        return 0;
    }
    return arg_in_range(args[0], "now_ms", 0, INT64_MAX, now);
}

PyDoc_STRVAR(Budget_record_request_doc,
             "record_request($self, now_ms=None, /)\n--\n\n"
             "Count one request; returns the second it was charged to (-1: not counted).");

static PyObject *Budget_record_request(BudgetObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t now;
    if (check_nargs("record_request", nargs, 0, 1) < 0 || budget_now(args, nargs, &now) < 0)
        return NULL;
    return PyLong_FromLongLong(vx_budget_record_request(self->b, now));
}

PyDoc_STRVAR(Budget_try_retry_doc,
             "try_retry($self, now_ms=None, /)\n--\n\n"
             "Take one retry from the budget; False when it would exceed it.");

static PyObject *Budget_try_retry(BudgetObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t now;
    if (check_nargs("try_retry", nargs, 0, 1) < 0 || budget_now(args, nargs, &now) < 0)
        return NULL;
    return PyBool_FromLong(vx_budget_try_retry(self->b, now) >= 0);
}

PyDoc_STRVAR(Budget_try_retry_at_doc,
             "_try_retry_at($self, now_ms, /)\n--\n\n"
             "Test hook: try_retry returning the second charged, or -1.");

static PyObject *Budget_try_retry_at(BudgetObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t now;
    if (check_nargs("_try_retry_at", nargs, 1, 1) < 0 || budget_now(args, nargs, &now) < 0)
        return NULL;
    return PyLong_FromLongLong(vx_budget_try_retry(self->b, now));
}

PyDoc_STRVAR(Budget_window_doc,
             "window($self, now_ms=None, /)\n--\n\n"
             "(requests, retries) over the window ending now (a metric).");

static PyObject *Budget_window(BudgetObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t now, rq, rt;
    if (check_nargs("window", nargs, 0, 1) < 0 || budget_now(args, nargs, &now) < 0)
        return NULL;
    vx_budget_window(self->b, now, &rq, &rt);
    return Py_BuildValue("(LL)", (long long)rq, (long long)rt);
}

static PyObject *Budget_get_percent(BudgetObject *self, void *Py_UNUSED(c))
{
    return PyLong_FromLongLong(self->b->percent);
}

static PyObject *Budget_get_window_s(BudgetObject *self, void *Py_UNUSED(c))
{
    return PyLong_FromLongLong(self->b->window_s);
}

static PyObject *Budget_get_min_per_s(BudgetObject *self, void *Py_UNUSED(c))
{
    return PyLong_FromLongLong(self->b->min_per_s);
}

static PyMethodDef Budget_methods[] = {
    {"record_request", FASTCALL(Budget_record_request), METH_FASTCALL, Budget_record_request_doc},
    {"try_retry", FASTCALL(Budget_try_retry), METH_FASTCALL, Budget_try_retry_doc},
    {"_try_retry_at", FASTCALL(Budget_try_retry_at), METH_FASTCALL, Budget_try_retry_at_doc},
    {"window", FASTCALL(Budget_window), METH_FASTCALL, Budget_window_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Budget_getset[] = {
    {"percent", (getter)Budget_get_percent, NULL, "Share of requests that may be retried.", NULL},
    {"window_s", (getter)Budget_get_window_s, NULL, "Window length in seconds.", NULL},
    {"min_per_s", (getter)Budget_get_min_per_s, NULL, "Retries per second always allowed.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(Budget_doc,
             "RetryBudget(percent, window_s, min_per_s)\n--\n\n"
             "Gateway-wide retry budget in shared memory: a retry at second s is granted only\n"
             "if 100 * retries <= percent * requests + 100 * min_per_s * window_s, both counted\n"
             "over the window_s seconds ending at s, this retry included.");

static PyType_Slot Budget_slots[] = {
    {Py_tp_doc, (void *)Budget_doc},
    {Py_tp_new, Budget_new},
    {Py_tp_dealloc, Budget_dealloc},
    {Py_tp_methods, Budget_methods},
    {Py_tp_getset, Budget_getset},
    {0, NULL},
};

static PyType_Spec Budget_spec = {
    .name = "velox._native.RetryBudget",
    .basicsize = sizeof(BudgetObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Budget_slots,
};

/* ---------------------------------------------------------------- SharedCache */

/* The binding's side of vx_cache's contract: the key is copied out of its object before the
 * call, values are copied in and out of the shared mapping with the lock held but never while
 * a Python object is being allocated (an allocation can run the collector, whose finalizers
 * could call back into the cache and deadlock on the non-recursive lock). From 64 KiB on, the
 * GIL is released around the locked copy, as scan_json does: copying 1 MiB takes ~100 us.
 * Smaller operations wait for the lock with the GIL held: a worker is one thread (its event
 * loop waits either way), and the longest hold by another process is one max_value copy. */
#define CACHE_NOGIL_MIN 65536
/* get() first copies into a stack buffer of this size (one lock round trip for the typical
 * chat answer); a larger value is copied by a second call straight into its bytes object. */
#define CACHE_STACK_BUF 4096
#define CACHE_GET_TRIES 4

typedef struct {
    PyObject_HEAD
    vx_cache *c; /* owned view of the shared mapping; NULL only while tp_new fails */
} CacheObject;

/* Positional-or-keyword arguments for METH_FASTCALL | METH_KEYWORDS without the private
 * argument clinic: out[i] is the i-th parameter (borrowed) or NULL when not given. */
static int parse_fast(const char *fname, PyObject *const *args, Py_ssize_t nargs,
                      PyObject *kwnames, const char *const *names, Py_ssize_t nmin,
                      Py_ssize_t nmax, PyObject **out)
{
    if (nargs > nmax) {
        PyErr_Format(PyExc_TypeError, "%s() takes at most %zd arguments (%zd given)", fname, nmax,
                     nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nmax; i++)
        out[i] = i < nargs ? args[i] : NULL;
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t j = 0; j < nkw; j++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, j);
        Py_ssize_t i = 0;
        while (i < nmax && PyUnicode_CompareWithASCIIString(name, names[i]) != 0)
            i++;
        if (i == nmax) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument %R", fname,
                         name);
            return -1;
        }
        if (out[i] != NULL) {
            PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", fname,
                         names[i]);
            return -1;
        }
        out[i] = args[nargs + j];
    }
    for (Py_ssize_t i = 0; i < nmin; i++)
        if (out[i] == NULL) {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s'", fname, names[i]);
            return -1;
        }
    return 0;
}

/* The 32-byte key, copied (so it stays valid with the GIL released). */
static int cache_key(PyObject *o, uint8_t key[VX_CACHE_KEY])
{
    if (PyBytes_CheckExact(o)) {
        if (PyBytes_GET_SIZE(o) != VX_CACHE_KEY) {
            PyErr_Format(PyExc_ValueError, "key must be %d bytes (a SHA-256 digest), got %zd",
                         VX_CACHE_KEY, PyBytes_GET_SIZE(o));
            return -1;
        }
        memcpy(key, PyBytes_AS_STRING(o), VX_CACHE_KEY);
        return 0;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(o, &view, PyBUF_SIMPLE) < 0) /* TypeError for non-buffers */
        return -1;
    int rc = 0;
    if (view.len != VX_CACHE_KEY) {
        PyErr_Format(PyExc_ValueError, "key must be %d bytes (a SHA-256 digest), got %zd",
                     VX_CACHE_KEY, view.len);
        rc = -1;
    } else {
        memcpy(key, view.buf, VX_CACHE_KEY);
    }
    PyBuffer_Release(&view);
    return rc;
}

static int cache_ms(PyObject *o, const char *name, int64_t lo, int64_t *out)
{
    return arg_in_range(o, name, lo, VX_CACHE_MAX_MS, out);
}

static PyObject *cache_error(void)
{
    return PyErr_SetFromErrno(PyExc_OSError);
}

static PyObject *Cache_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"capacity_bytes", NULL};
    PyObject *cap_obj;
    int64_t cap;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:SharedCache", kwlist, &cap_obj) ||
        arg_in_range(cap_obj, "capacity_bytes", VX_CACHE_MIN_CAPACITY, VX_CACHE_MAX_CAPACITY,
                     &cap) < 0)
        return NULL;
    CacheObject *self = (CacheObject *)type->tp_alloc(type, 0); /* new reference */
    if (self == NULL)
        return NULL;
    self->c = vx_cache_create(cap);
    if (self->c == NULL) {
        Py_DECREF(self);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return (PyObject *)self;
}

static void Cache_dealloc(CacheObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    vx_cache_destroy(self->c); /* this process's view; other processes keep theirs */
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

PyDoc_STRVAR(Cache_get_doc,
             "get($self, key, now_ms, max_age_ms=-1)\n--\n\n"
             "(value, age_ms) for a fresh entry (it becomes the most recently used), else None.\n"
             "An entry past its TTL is removed; one older than max_age_ms (>= 0) is left alone.");

static PyObject *Cache_get(CacheObject *self, PyObject *const *args, Py_ssize_t nargs,
                           PyObject *kwnames)
{
    static const char *const names[] = {"key", "now_ms", "max_age_ms"};
    PyObject *o[3];
    uint8_t key[VX_CACHE_KEY];
    int64_t now, max_age = -1;
    if (parse_fast("get", args, nargs, kwnames, names, 2, 3, o) < 0 || cache_key(o[0], key) < 0 ||
        cache_ms(o[1], "now_ms", 0, &now) < 0)
        return NULL;
    if (o[2] != NULL && o[2] != Py_None && cache_ms(o[2], "max_age_ms", -1, &max_age) < 0)
        return NULL;
    unsigned char stack[CACHE_STACK_BUF];
    size_t len = 0;
    int64_t age = 0;
    PyObject *value = NULL;
    int rc = vx_cache_get(self->c, key, now, max_age, stack, sizeof stack, &len, &age);
    if (rc == VX_CACHE_HIT) {
        value = PyBytes_FromStringAndSize((const char *)stack, (Py_ssize_t)len);
        if (value == NULL)
            return NULL;
    }
    /* Too big for the stack: allocate exactly (no lock held), then copy straight into the
     * bytes object. The entry may have been replaced in between: a shorter value is fine
     * (resize), a longer one means another round, a vanished one a miss. */
    for (int tries = 0; rc == VX_CACHE_SHORT && tries < CACHE_GET_TRIES; tries++) {
        size_t cap = len;
        value = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)cap);
        if (value == NULL)
            return NULL;
        char *dst = PyBytes_AS_STRING(value); /* not shared with anyone yet */
        if (cap >= CACHE_NOGIL_MIN) {
            Py_BEGIN_ALLOW_THREADS
            rc = vx_cache_get(self->c, key, now, max_age, dst, cap, &len, &age);
            Py_END_ALLOW_THREADS
        } else {
            rc = vx_cache_get(self->c, key, now, max_age, dst, cap, &len, &age);
        }
        if (rc != VX_CACHE_HIT)
            Py_CLEAR(value);
        else if (len < cap && _PyBytes_Resize(&value, (Py_ssize_t)len) < 0)
            return NULL; /* value was released by _PyBytes_Resize */
    }
    if (rc == VX_CACHE_ERROR)
        return cache_error();
    if (value == NULL) /* miss, or a value that kept growing under us */
        Py_RETURN_NONE;
    PyObject *age_obj = PyLong_FromLongLong(age);
    if (age_obj == NULL) {
        Py_DECREF(value);
        return NULL;
    }
    PyObject *out = PyTuple_New(2);
    if (out == NULL) {
        Py_DECREF(value);
        Py_DECREF(age_obj);
        return NULL;
    }
    PyTuple_SET_ITEM(out, 0, value); /* steals */
    PyTuple_SET_ITEM(out, 1, age_obj);
    return out;
}

PyDoc_STRVAR(Cache_put_doc,
             "put($self, key, value, now_ms, ttl_ms)\n--\n\n"
             "Insert or replace, evicting least recently used entries until the value fits.\n"
             "False (nothing stored, an old entry kept) when len(value) > max_value.");

static PyObject *Cache_put(CacheObject *self, PyObject *const *args, Py_ssize_t nargs,
                           PyObject *kwnames)
{
    static const char *const names[] = {"key", "value", "now_ms", "ttl_ms"};
    PyObject *o[4];
    uint8_t key[VX_CACHE_KEY];
    int64_t now, ttl;
    if (parse_fast("put", args, nargs, kwnames, names, 4, 4, o) < 0 || cache_key(o[0], key) < 0 ||
        cache_ms(o[2], "now_ms", 0, &now) < 0 || cache_ms(o[3], "ttl_ms", 1, &ttl) < 0)
        return NULL;
    /* The buffer export keeps the memory valid and unmodified-in-size while the GIL is
     * released (see scan_json); bytes are immutable anyway. */
    Py_buffer view;
    if (PyObject_GetBuffer(o[1], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    int rc;
    if (view.len >= CACHE_NOGIL_MIN) {
        Py_BEGIN_ALLOW_THREADS
        rc = vx_cache_put(self->c, key, view.buf, (size_t)view.len, now, ttl);
        Py_END_ALLOW_THREADS
    } else {
        rc = vx_cache_put(self->c, key, view.buf, (size_t)view.len, now, ttl);
    }
    PyBuffer_Release(&view);
    if (rc < 0)
        return cache_error();
    return PyBool_FromLong(rc);
}

PyDoc_STRVAR(Cache_delete_doc,
             "delete($self, key, /)\n--\n\nRemove key's entry; True when there was one.");

static PyObject *Cache_delete(CacheObject *self, PyObject *arg)
{
    uint8_t key[VX_CACHE_KEY];
    if (cache_key(arg, key) < 0)
        return NULL;
    int rc = vx_cache_delete(self->c, key);
    return rc < 0 ? cache_error() : PyBool_FromLong(rc);
}

PyDoc_STRVAR(Cache_claim_doc,
             "claim($self, key, now_ms, hold_ms)\n--\n\n"
             "In-flight marker for cross-worker coalescing, owned by this process (its pid) with\n"
             "a lease of hold_ms. True: the caller leads (no live marker existed; an expired one,\n"
             "or one whose owner process is gone, is taken over, keeping its waiter count; or the\n"
             "marker table is full). False: another leads and the caller is counted as a waiter.");

static PyObject *Cache_claim(CacheObject *self, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames)
{
    static const char *const names[] = {"key", "now_ms", "hold_ms"};
    PyObject *o[3];
    uint8_t key[VX_CACHE_KEY];
    int64_t now, hold;
    if (parse_fast("claim", args, nargs, kwnames, names, 3, 3, o) < 0 ||
        cache_key(o[0], key) < 0 || cache_ms(o[1], "now_ms", 0, &now) < 0 ||
        cache_ms(o[2], "hold_ms", 1, &hold) < 0)
        return NULL;
    int rc = vx_cache_claim(self->c, key, now, hold, (int32_t)getpid());
    if (rc < 0)
        return cache_error();
    return PyBool_FromLong(rc != VX_CLAIM_WAIT);
}

PyDoc_STRVAR(Cache_renew_doc,
             "renew($self, key, now_ms, hold_ms)\n--\n\n"
             "The leader extends its marker's lease to now_ms + hold_ms. True when key's marker\n"
             "is this process's; False when there is none or another process took it over.");

static PyObject *Cache_renew(CacheObject *self, PyObject *const *args, Py_ssize_t nargs,
                             PyObject *kwnames)
{
    static const char *const names[] = {"key", "now_ms", "hold_ms"};
    PyObject *o[3];
    uint8_t key[VX_CACHE_KEY];
    int64_t now, hold;
    if (parse_fast("renew", args, nargs, kwnames, names, 3, 3, o) < 0 ||
        cache_key(o[0], key) < 0 || cache_ms(o[1], "now_ms", 0, &now) < 0 ||
        cache_ms(o[2], "hold_ms", 1, &hold) < 0)
        return NULL;
    int rc = vx_cache_renew(self->c, key, now, hold, (int32_t)getpid());
    return rc < 0 ? cache_error() : PyBool_FromLong(rc);
}

PyDoc_STRVAR(Cache_unwait_doc,
             "unwait($self, key, /)\n--\n\nA waiter stops waiting: waiters -= 1 (never below 0).");

static PyObject *Cache_unwait(CacheObject *self, PyObject *arg)
{
    uint8_t key[VX_CACHE_KEY];
    if (cache_key(arg, key) < 0)
        return NULL;
    if (vx_cache_unwait(self->c, key) < 0)
        return cache_error();
    Py_RETURN_NONE;
}

PyDoc_STRVAR(Cache_waiting_doc,
             "waiting($self, key, /)\n--\n\nWaiters on key's marker now (0 without a marker).");

static PyObject *Cache_waiting(CacheObject *self, PyObject *arg)
{
    uint8_t key[VX_CACHE_KEY];
    if (cache_key(arg, key) < 0)
        return NULL;
    int64_t n = vx_cache_waiting(self->c, key);
    return n < 0 ? cache_error() : PyLong_FromLongLong(n);
}

PyDoc_STRVAR(Cache_release_doc,
             "release($self, key, /)\n--\n\n"
             "The leader drops its marker (after put, or after failing); True when there was one\n"
             "and it was this process's (a marker another process took over is left alone).");

static PyObject *Cache_release(CacheObject *self, PyObject *arg)
{
    uint8_t key[VX_CACHE_KEY];
    if (cache_key(arg, key) < 0)
        return NULL;
    int rc = vx_cache_release(self->c, key, (int32_t)getpid());
    return rc < 0 ? cache_error() : PyBool_FromLong(rc);
}

PyDoc_STRVAR(Cache_pending_doc,
             "pending($self, key, now_ms)\n--\n\nTrue when a live marker exists: unexpired, and "
             "its owner process still exists.");

static PyObject *Cache_pending(CacheObject *self, PyObject *const *args, Py_ssize_t nargs,
                               PyObject *kwnames)
{
    static const char *const names[] = {"key", "now_ms"};
    PyObject *o[2];
    uint8_t key[VX_CACHE_KEY];
    int64_t now;
    if (parse_fast("pending", args, nargs, kwnames, names, 2, 2, o) < 0 ||
        cache_key(o[0], key) < 0 || cache_ms(o[1], "now_ms", 0, &now) < 0)
        return NULL;
    int rc = vx_cache_pending(self->c, key, now);
    return rc < 0 ? cache_error() : PyBool_FromLong(rc);
}

PyDoc_STRVAR(Cache_stats_doc,
             "stats($self)\n--\n\n"
             "A consistent snapshot: entries, bytes (blocks in use x block_size: values plus\n"
             "their overhead), capacity, evictions, expired, max_value, markers, and more.");

static PyObject *Cache_stats(CacheObject *self, PyObject *Py_UNUSED(ignored))
{
    /* Called from the admin server's threads: the wait for the lock (at most one
     * max_value copy by another process, ~1-3 ms for 8 MiB) is made without the GIL. */
    vx_cache_stats s;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = vx_cache_read_stats(self->c, &s);
    Py_END_ALLOW_THREADS
    if (rc < 0)
        return cache_error();
    const struct {
        const char *name;
        int64_t v;
    } items[] = {
        {"entries", s.entries},       {"bytes", s.bytes},
        {"capacity", s.capacity},     {"evictions", s.evictions},
        {"expired", s.expired},       {"max_value", s.max_value},
        {"markers", s.markers},       {"value_bytes", s.value_bytes},
        {"hits", s.hits},             {"misses", s.misses},
        {"stale", s.stale},           {"stores", s.stores},
        {"replaced", s.replaced},     {"rejected", s.rejected},
        {"claims", s.claims},         {"takeovers", s.takeovers},
        {"markers_full", s.markers_full}, {"recoveries", s.recoveries},
        {"marker_slots", s.marker_slots}, {"blocks", s.blocks},
        {"block_size", s.block_size}, {"mapped", s.mapped},
    };
    PyObject *d = PyDict_New();
    if (d == NULL)
        return NULL;
    for (size_t i = 0; i < sizeof items / sizeof items[0]; i++) {
        PyObject *v = PyLong_FromLongLong(items[i].v);
        if (v == NULL || PyDict_SetItemString(d, items[i].name, v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(d);
            return NULL;
        }
        Py_DECREF(v);
    }
    return d;
}

PyDoc_STRVAR(Cache_clear_doc, "clear($self)\n--\n\nDrop every entry and marker (counters stay).");

static PyObject *Cache_clear(CacheObject *self, PyObject *Py_UNUSED(ignored))
{
    int rc;
    Py_BEGIN_ALLOW_THREADS /* the wipe zeroes the index: 512 KiB for a 64 MiB cache */
    rc = vx_cache_clear(self->c);
    Py_END_ALLOW_THREADS
    if (rc < 0)
        return cache_error();
    Py_RETURN_NONE;
}

PyDoc_STRVAR(Cache_check_doc,
             "_check($self)\n--\n\n"
             "Test hook: walk every structure and check the invariants; 0 when all hold, else\n"
             "the code of the first broken one (see vx_cache.c).");

static PyObject *Cache_check(CacheObject *self, PyObject *Py_UNUSED(ignored))
{
    int rc;
    Py_BEGIN_ALLOW_THREADS /* a walk of a large cache takes milliseconds */
    rc = vx_cache_check(self->c);
    Py_END_ALLOW_THREADS
    if (rc < 0)
        return cache_error();
    return PyLong_FromLong(rc);
}

#define CACHE_HOLD_MAX_MS 60000 /* a test hook should not be able to hang a run */

PyDoc_STRVAR(Cache_lock_and_hold_doc,
             "_lock_and_hold($self, hold_ms, /)\n--\n\n"
             "Test hook: with the GIL released, take the cache's lock and keep it hold_ms (at\n"
             "most 60 s), as a worker stuck (or killed) in the middle of an operation would.");

static PyObject *Cache_lock_and_hold(CacheObject *self, PyObject *arg)
{
    int64_t ms;
    if (arg_in_range(arg, "hold_ms", 0, CACHE_HOLD_MAX_MS, &ms) < 0)
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = vx_cache_hold(self->c, ms);
    Py_END_ALLOW_THREADS
    if (rc < 0)
        return cache_error();
    Py_RETURN_NONE;
}

PyDoc_STRVAR(Cache_holding_doc,
             "_holding($self)\n--\n\nTest hook: True while some process is inside _lock_and_hold.");

static PyObject *Cache_holding(CacheObject *self, PyObject *Py_UNUSED(ignored))
{
    return PyBool_FromLong(vx_cache_holding(self->c));
}

static PyObject *Cache_get_capacity(CacheObject *self, void *Py_UNUSED(c))
{
    return PyLong_FromLongLong(self->c->capacity);
}

static PyObject *Cache_get_max_value(CacheObject *self, void *Py_UNUSED(c))
{
    return PyLong_FromUnsignedLongLong(self->c->max_value);
}

#define FASTCALL_KW(f) (PyCFunction)(void (*)(void))(f)

static PyMethodDef Cache_methods[] = {
    {"get", FASTCALL_KW(Cache_get), METH_FASTCALL | METH_KEYWORDS, Cache_get_doc},
    {"put", FASTCALL_KW(Cache_put), METH_FASTCALL | METH_KEYWORDS, Cache_put_doc},
    {"delete", (PyCFunction)Cache_delete, METH_O, Cache_delete_doc},
    {"claim", FASTCALL_KW(Cache_claim), METH_FASTCALL | METH_KEYWORDS, Cache_claim_doc},
    {"renew", FASTCALL_KW(Cache_renew), METH_FASTCALL | METH_KEYWORDS, Cache_renew_doc},
    {"unwait", (PyCFunction)Cache_unwait, METH_O, Cache_unwait_doc},
    {"waiting", (PyCFunction)Cache_waiting, METH_O, Cache_waiting_doc},
    {"release", (PyCFunction)Cache_release, METH_O, Cache_release_doc},
    {"pending", FASTCALL_KW(Cache_pending), METH_FASTCALL | METH_KEYWORDS, Cache_pending_doc},
    {"stats", (PyCFunction)Cache_stats, METH_NOARGS, Cache_stats_doc},
    {"clear", (PyCFunction)Cache_clear, METH_NOARGS, Cache_clear_doc},
    {"_check", (PyCFunction)Cache_check, METH_NOARGS, Cache_check_doc},
    {"_lock_and_hold", (PyCFunction)Cache_lock_and_hold, METH_O, Cache_lock_and_hold_doc},
    {"_holding", (PyCFunction)Cache_holding, METH_NOARGS, Cache_holding_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Cache_getset[] = {
    {"capacity", (getter)Cache_get_capacity, NULL, "capacity_bytes as given.", NULL},
    {"max_value", (getter)Cache_get_max_value, NULL, "The largest value put() stores.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(Cache_doc,
             "SharedCache(capacity_bytes)\n--\n\n"
             "The gateway-wide response cache store: one exact LRU of (32-byte key -> bytes)\n"
             "with per-entry TTLs and in-flight markers, in one anonymous shared mapping\n"
             "created before fork() (one cache for the parent and every child). Its memory,\n"
             "index included, is bounded by capacity_bytes (64 KiB to 1 TiB) + 512 bytes.");

static PyType_Slot Cache_slots[] = {
    {Py_tp_doc, (void *)Cache_doc},
    {Py_tp_new, Cache_new},
    {Py_tp_dealloc, Cache_dealloc},
    {Py_tp_methods, Cache_methods},
    {Py_tp_getset, Cache_getset},
    {0, NULL},
};

static PyType_Spec Cache_spec = {
    .name = "velox._native.SharedCache",
    .basicsize = sizeof(CacheObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Cache_slots,
};

/* ---------------------------------------------------------------- H2Client */

/* The native HTTP/2 client codec (vx_h2): velox.egress.codec's Codec, built by
 * velox/egress/nativecodec.py. One receive_data call is one crossing: the C parser leaves a
 * compact event list for the whole read and this binding turns it into the same tuples the
 * Python codecs return. */
/* The merged event kind receive_answers returns (after vx_h2's own kinds, 1 .. 7). */
#define H2_ANSWER 8

typedef struct {
    PyObject_HEAD
    vx_h2 *c;
    PyObject *error_class; /* velox.egress.codec.CodecError, given by the constructor */
} H2Object;

/* Borrow the bytes of a bytes or bytearray object (the header and method arguments). */
static int h2_bytes(PyObject *o, const char *what, const uint8_t **p, size_t *n)
{
    if (PyBytes_Check(o)) {
        *p = (const uint8_t *)PyBytes_AS_STRING(o);
        *n = (size_t)PyBytes_GET_SIZE(o);
        return 0;
    }
    if (PyByteArray_Check(o)) {
        *p = (const uint8_t *)PyByteArray_AS_STRING(o);
        *n = (size_t)PyByteArray_GET_SIZE(o);
        return 0;
    }
    PyErr_Format(PyExc_TypeError, "%s must be bytes, not %.100s", what, Py_TYPE(o)->tp_name);
    return -1;
}

static PyObject *H2_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"authority", "scheme", "error_class", NULL};
    const char *authority, *scheme;
    Py_ssize_t alen, slen;
    PyObject *error_class;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "y#y#O:H2Client", kwlist, &authority, &alen,
                                     &scheme, &slen, &error_class))
        return NULL;
    H2Object *self = (H2Object *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->c = vx_h2_new((const uint8_t *)authority, (size_t)alen, (const uint8_t *)scheme,
                        (size_t)slen);
    if (self->c == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    Py_INCREF(error_class);
    self->error_class = error_class;
    return (PyObject *)self;
}

static void H2_dealloc(H2Object *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    vx_h2_free(self->c);
    Py_XDECREF(self->error_class);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

/* Raise CodecError(code, message, events); steals `events` (NULL: an empty list). */
static PyObject *h2_raise(H2Object *self, uint32_t code, const char *message, PyObject *events)
{
    if (events == NULL && (events = PyList_New(0)) == NULL)
        return NULL;
    PyObject *exc = PyObject_CallFunction(self->error_class, "IsO", (unsigned int)code, message,
                                          events);
    Py_DECREF(events);
    if (exc != NULL) {
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        Py_DECREF(exc);
    }
    return NULL;
}

static PyObject *H2_initiate(H2Object *self, PyObject *Py_UNUSED(ignored))
{
    if (vx_h2_initiate(self->c) != VX_H2_OK)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

#define H2_STACK_HEADERS 32

static PyObject *H2_send_request(H2Object *self, PyObject *const *args, Py_ssize_t nargs)
{
    const uint8_t *method, *path;
    size_t method_len, path_len;
    if (check_nargs("send_request", nargs, 4, 4) < 0 ||
        h2_bytes(args[0], "method", &method, &method_len) < 0 ||
        h2_bytes(args[1], "path", &path, &path_len) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[2], "headers must be a sequence of (name, value)");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    vx_h2_header stack[H2_STACK_HEADERS];
    vx_h2_header *headers = stack;
    Py_buffer view = {0};
    PyObject *result = NULL;
    if (n > H2_STACK_HEADERS && (headers = PyMem_Malloc((size_t)n * sizeof *headers)) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *field = items[i];
        if (!PyTuple_Check(field) || PyTuple_GET_SIZE(field) != 2) {
            PyErr_SetString(PyExc_TypeError, "each header must be a (name, value) tuple");
            goto done;
        }
        if (h2_bytes(PyTuple_GET_ITEM(field, 0), "a header name", &headers[i].name,
                     &headers[i].name_len) < 0 ||
            h2_bytes(PyTuple_GET_ITEM(field, 1), "a header value", &headers[i].value,
                     &headers[i].value_len) < 0)
            goto done;
    }
    const uint8_t *body = NULL;
    size_t body_len = 0;
    PyObject *b = args[3];
    if (b == Py_None) {
    } else if (PyBytes_Check(b)) {
        body = (const uint8_t *)PyBytes_AS_STRING(b);
        body_len = (size_t)PyBytes_GET_SIZE(b);
    } else if (PyObject_GetBuffer(b, &view, PyBUF_SIMPLE) == 0) {
        body = view.buf;
        body_len = (size_t)view.len;
    } else {
        goto done;
    }
    uint32_t sid;
    int rc = vx_h2_send_request(self->c, method, method_len, path, path_len, headers, (size_t)n,
                                body, body_len, &sid);
    if (rc == VX_H2_REFUSED)
        h2_raise(self, VX_H2_REFUSED_STREAM, vx_h2_refusal(self->c), NULL);
    else if (rc != VX_H2_OK)
        PyErr_NoMemory();
    else
        result = PyLong_FromUnsignedLong(sid);
done:
    if (view.obj != NULL)
        PyBuffer_Release(&view);
    if (headers != stack)
        PyMem_Free(headers);
    Py_DECREF(seq);
    return result;
}

static PyObject *h2_header_list(const vx_hfield *fields, uint32_t first, uint32_t count,
                                const uint8_t *arena)
{
    PyObject *list = PyList_New(count);
    if (list == NULL)
        return NULL;
    for (uint32_t i = 0; i < count; i++) {
        const vx_hfield *f = &fields[first + i];
        PyObject *pair = PyTuple_New(2);
        if (pair == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, pair);
        PyObject *name = PyBytes_FromStringAndSize((const char *)arena + f->name_off, f->name_len);
        if (name == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyTuple_SET_ITEM(pair, 0, name);
        PyObject *value =
            PyBytes_FromStringAndSize((const char *)arena + f->value_off, f->value_len);
        if (value == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyTuple_SET_ITEM(pair, 1, value);
    }
    return list;
}

static PyObject *h2_bool(bool v)
{
    PyObject *o = v ? Py_True : Py_False;
    Py_INCREF(o);
    return o;
}

/* One event as its tuple (see velox.egress.codec for the shapes). */
static PyObject *h2_event(const vx_h2_event *e, const vx_hfield *fields, const uint8_t *arena)
{
    PyObject *t = NULL;
    switch (e->kind) {
    case VX_EV_RESPONSE:
        t = PyTuple_New(5);
        if (t == NULL)
            return NULL;
        PyTuple_SET_ITEM(t, 0, PyLong_FromLong(e->kind));
        PyTuple_SET_ITEM(t, 1, PyLong_FromUnsignedLong(e->sid));
        PyTuple_SET_ITEM(t, 2, PyLong_FromUnsignedLong(e->value));
        PyTuple_SET_ITEM(t, 3, h2_header_list(fields, e->first, e->count, arena));
        PyTuple_SET_ITEM(t, 4, h2_bool(e->end_stream));
        break;
    case VX_EV_DATA:
        t = PyTuple_New(5);
        if (t == NULL)
            return NULL;
        PyTuple_SET_ITEM(t, 0, PyLong_FromLong(e->kind));
        PyTuple_SET_ITEM(t, 1, PyLong_FromUnsignedLong(e->sid));
        PyTuple_SET_ITEM(t, 2, PyBytes_FromStringAndSize((const char *)e->data, (Py_ssize_t)e->len));
        PyTuple_SET_ITEM(t, 3, PyLong_FromUnsignedLong(e->value));
        PyTuple_SET_ITEM(t, 4, h2_bool(e->end_stream));
        break;
    case VX_EV_TRAILERS:
        t = PyTuple_New(3);
        if (t == NULL)
            return NULL;
        PyTuple_SET_ITEM(t, 0, PyLong_FromLong(e->kind));
        PyTuple_SET_ITEM(t, 1, PyLong_FromUnsignedLong(e->sid));
        PyTuple_SET_ITEM(t, 2, h2_header_list(fields, e->first, e->count, arena));
        break;
    case VX_EV_RESET:
        t = PyTuple_New(3);
        if (t == NULL)
            return NULL;
        PyTuple_SET_ITEM(t, 0, PyLong_FromLong(e->kind));
        PyTuple_SET_ITEM(t, 1, PyLong_FromUnsignedLong(e->sid));
        PyTuple_SET_ITEM(t, 2, PyLong_FromUnsignedLong(e->value));
        break;
    case VX_EV_GOAWAY:
        t = PyTuple_New(4);
        if (t == NULL)
            return NULL;
        PyTuple_SET_ITEM(t, 0, PyLong_FromLong(e->kind));
        PyTuple_SET_ITEM(t, 1, PyLong_FromUnsignedLong(e->sid));
        PyTuple_SET_ITEM(t, 2, PyLong_FromUnsignedLong(e->value));
        PyTuple_SET_ITEM(t, 3, PyBytes_FromStringAndSize((const char *)e->data, (Py_ssize_t)e->len));
        break;
    case VX_EV_SETTINGS:
        t = PyTuple_New(2);
        if (t == NULL)
            return NULL;
        PyTuple_SET_ITEM(t, 0, PyLong_FromLong(e->kind));
        PyTuple_SET_ITEM(t, 1, PyLong_FromUnsignedLong(e->sid));
        break;
    default: /* VX_EV_PING_ACK */
        t = PyTuple_New(2);
        if (t == NULL)
            return NULL;
        PyTuple_SET_ITEM(t, 0, PyLong_FromLong(e->kind));
        PyTuple_SET_ITEM(t, 1, PyBytes_FromStringAndSize((const char *)e->data, (Py_ssize_t)e->len));
        break;
    }
    /* Any item that failed to build left a NULL slot (and an exception set). */
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(t); i++) {
        if (PyTuple_GET_ITEM(t, i) == NULL) {
            Py_DECREF(t);
            return NULL;
        }
    }
    return t;
}

/* An ANSWER event, (ANSWER, stream_id, status, headers, body): a response's headers and the
 * DATA frame that ends it, which came next in the same read (a short JSON answer almost always
 * does). One tuple instead of two, and the body's flow-controlled length is credited here, so
 * the caller makes one dispatch and no acknowledge call for the whole answer. */
static PyObject *h2_answer(H2Object *self, const vx_h2_event *head, const vx_h2_event *body,
                           const vx_hfield *fields, const uint8_t *arena)
{
    if (vx_h2_acknowledge(self->c, body->sid, body->value) != VX_H2_OK)
        return PyErr_Format(PyExc_ValueError, "stream %u was never opened", body->sid);
    PyObject *t = PyTuple_New(5);
    if (t == NULL)
        return NULL;
    PyTuple_SET_ITEM(t, 0, PyLong_FromLong(H2_ANSWER));
    PyTuple_SET_ITEM(t, 1, PyLong_FromUnsignedLong(head->sid));
    PyTuple_SET_ITEM(t, 2, PyLong_FromUnsignedLong(head->value));
    PyTuple_SET_ITEM(t, 3, h2_header_list(fields, head->first, head->count, arena));
    PyTuple_SET_ITEM(t, 4,
                     PyBytes_FromStringAndSize((const char *)body->data, (Py_ssize_t)body->len));
    for (Py_ssize_t i = 0; i < 5; i++) {
        if (PyTuple_GET_ITEM(t, i) == NULL) {
            Py_DECREF(t);
            return NULL;
        }
    }
    return t;
}

static PyObject *h2_receive(H2Object *self, PyObject *data, bool merge)
{
    if (vx_h2_failed(self->c))
        return h2_raise(self, vx_h2_error_code(self->c), "connection already failed", NULL);
    Py_buffer view;
    if (PyObject_GetBuffer(data, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    int rc = vx_h2_receive(self->c, view.buf, (size_t)view.len);
    size_t n;
    const vx_h2_event *ev = vx_h2_events(self->c, &n);
    const vx_hfield *fields = vx_h2_fields(self->c);
    const uint8_t *arena = vx_h2_arena(self->c);
    PyObject *events = PyList_New(0);
    for (size_t i = 0; events != NULL && i < n; i++) {
        PyObject *t;
        if (merge && ev[i].kind == VX_EV_RESPONSE && !ev[i].end_stream && i + 1 < n &&
            ev[i + 1].kind == VX_EV_DATA && ev[i + 1].end_stream && ev[i + 1].sid == ev[i].sid) {
            t = h2_answer(self, &ev[i], &ev[i + 1], fields, arena);
            i++;
        } else {
            t = h2_event(&ev[i], fields, arena);
        }
        if (t == NULL || PyList_Append(events, t) < 0)
            Py_CLEAR(events);
        Py_XDECREF(t);
    }
    PyBuffer_Release(&view); /* only now: DATA events pointed into it */
    if (events == NULL)
        return NULL;
    if (rc != VX_H2_OK)
        return h2_raise(self, vx_h2_error_code(self->c), vx_h2_error_message(self->c), events);
    return events;
}

static PyObject *H2_receive_data(H2Object *self, PyObject *data)
{
    return h2_receive(self, data, false);
}

static PyObject *H2_receive_answers(H2Object *self, PyObject *data)
{
    return h2_receive(self, data, true);
}

static PyObject *H2_data_to_send(H2Object *self, PyObject *Py_UNUSED(ignored))
{
    size_t n;
    const uint8_t *p = vx_h2_output(self->c, &n);
    if (vx_h2_nomem(self->c))
        return PyErr_NoMemory();
    PyObject *out = PyBytes_FromStringAndSize((const char *)p, (Py_ssize_t)n);
    if (out != NULL)
        vx_h2_output_done(self->c);
    return out;
}

/* A stream id argument: an int; ids outside 0 .. 2^32-1 are reported as *valid = false. */
static int h2_sid(PyObject *o, uint32_t *sid, bool *valid)
{
    int64_t v;
    int overflow;
    if (to_i64(o, &v, &overflow) < 0)
        return -1;
    *valid = !overflow && v >= 0 && v <= (int64_t)UINT32_MAX;
    *sid = *valid ? (uint32_t)v : 0;
    return 0;
}

static PyObject *H2_acknowledge(H2Object *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint32_t sid;
    bool valid;
    int64_t n;
    if (check_nargs("acknowledge", nargs, 2, 2) < 0 || h2_sid(args[0], &sid, &valid) < 0 ||
        arg_in_range(args[1], "n", INT64_MIN, VX_H2_MAX_WINDOW, &n) < 0)
        return NULL;
    if (!valid || vx_h2_acknowledge(self->c, sid, n) != VX_H2_OK)
        return PyErr_Format(PyExc_ValueError, "stream %R was never opened on this connection",
                            args[0]);
    Py_RETURN_NONE;
}

static PyObject *H2_reset_stream(H2Object *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint32_t sid;
    bool valid;
    int64_t code = VX_H2_CANCEL;
    if (check_nargs("reset_stream", nargs, 1, 2) < 0 || h2_sid(args[0], &sid, &valid) < 0 ||
        (nargs > 1 && arg_in_range(args[1], "error_code", 0, UINT32_MAX, &code) < 0))
        return NULL;
    if (valid)
        vx_h2_reset_stream(self->c, sid, (uint32_t)code);
    Py_RETURN_NONE;
}

static PyObject *H2_send_ping(H2Object *self, PyObject *opaque)
{
    Py_buffer view;
    if (PyObject_GetBuffer(opaque, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    if (view.len != 8) {
        PyBuffer_Release(&view);
        return PyErr_Format(PyExc_ValueError, "a PING payload is exactly 8 bytes");
    }
    vx_h2_send_ping(self->c, view.buf);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyObject *H2_close(H2Object *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t code = VX_H2_NO_ERROR;
    if (check_nargs("close", nargs, 0, 1) < 0 ||
        (nargs > 0 && arg_in_range(args[0], "error_code", 0, UINT32_MAX, &code) < 0))
        return NULL;
    vx_h2_close(self->c, (uint32_t)code);
    Py_RETURN_NONE;
}

static PyObject *H2_get_data_pending(H2Object *self, void *Py_UNUSED(c))
{
    return PyBool_FromLong(vx_h2_data_pending(self->c));
}

static PyObject *H2_get_max_concurrent_streams(H2Object *self, void *Py_UNUSED(c))
{
    return PyLong_FromUnsignedLong(vx_h2_max_concurrent_streams(self->c));
}

static PyObject *H2_get_next_stream_id(H2Object *self, void *Py_UNUSED(c))
{
    return PyLong_FromUnsignedLongLong(vx_h2_next_stream_id(self->c));
}

static PyObject *H2_get_stream_state_count(H2Object *self, void *Py_UNUSED(c))
{
    return PyLong_FromSize_t(vx_h2_stream_count(self->c));
}

static PyMethodDef H2_methods[] = {
    {"initiate", (PyCFunction)H2_initiate, METH_NOARGS, "Queue the connection preface."},
    {"send_request", FASTCALL(H2_send_request), METH_FASTCALL,
     "send_request($self, method, path, headers, body, /)\n--\n\nOpen a stream; return its id."},
    {"receive_data", (PyCFunction)H2_receive_data, METH_O,
     "receive_data($self, data, /)\n--\n\nFeed transport bytes; return the events."},
    {"receive_answers", (PyCFunction)H2_receive_answers, METH_O,
     "receive_answers($self, data, /)\n--\n\nreceive_data, with each response whose ending DATA "
     "frame follows its headers as one ANSWER event (stream_id, status, headers, body); its "
     "flow-controlled length is acknowledged already."},
    {"data_to_send", (PyCFunction)H2_data_to_send, METH_NOARGS,
     "data_to_send($self, /)\n--\n\nEverything queued since the last call, or b''."},
    {"acknowledge", FASTCALL(H2_acknowledge), METH_FASTCALL,
     "acknowledge($self, stream_id, n, /)\n--\n\nReport n flow-controlled bytes consumed."},
    {"reset_stream", FASTCALL(H2_reset_stream), METH_FASTCALL,
     "reset_stream($self, stream_id, error_code=CANCEL, /)\n--\n\nQueue RST_STREAM."},
    {"send_ping", (PyCFunction)H2_send_ping, METH_O,
     "send_ping($self, opaque, /)\n--\n\nQueue a PING with an 8-byte payload."},
    {"close", FASTCALL(H2_close), METH_FASTCALL,
     "close($self, error_code=0, /)\n--\n\nQueue GOAWAY; refuse new streams."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef H2_getset[] = {
    {"data_pending", (getter)H2_get_data_pending, NULL, "Body data waits for data_to_send.", NULL},
    {"max_concurrent_streams", (getter)H2_get_max_concurrent_streams, NULL,
     "The peer's MAX_CONCURRENT_STREAMS, capped.", NULL},
    {"next_stream_id", (getter)H2_get_next_stream_id, NULL, "The id of the next stream.", NULL},
    {"stream_state_count", (getter)H2_get_stream_state_count, NULL,
     "Streams the codec still holds state for.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(H2_doc, "H2Client(authority, scheme, error_class)\n--\n\n"
                     "Native sans-IO HTTP/2 client connection (velox.egress.codec.Codec);\n"
                     "error_class is raised as error_class(code, message, events).");

static PyType_Slot H2_slots[] = {
    {Py_tp_doc, (void *)H2_doc},
    {Py_tp_new, H2_new},
    {Py_tp_dealloc, H2_dealloc},
    {Py_tp_methods, H2_methods},
    {Py_tp_getset, H2_getset},
    {0, NULL},
};

static PyType_Spec H2_spec = {
    .name = "velox._native.H2Client",
    .basicsize = sizeof(H2Object),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = H2_slots,
};

/* ---------------------------------------------------------------- hashing */

PyDoc_STRVAR(hash64_doc,
             "hash64(data, seed=0, /)\n--\n\n"
             "Stable 64-bit hash of a bytes-like object (same value in every process and run).");

static PyObject *native_hash64(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    int64_t seed = 0;
    if (check_nargs("hash64", nargs, 1, 2) < 0)
        return NULL;
    if (nargs == 2) {
        int overflow;
        if (to_i64(args[1], &seed, &overflow) < 0)
            return NULL;
    }
    if (PyBytes_CheckExact(args[0])) /* the common case, without the buffer protocol */
        return PyLong_FromUnsignedLongLong(vx_hash64(PyBytes_AS_STRING(args[0]),
                                                     (size_t)PyBytes_GET_SIZE(args[0]),
                                                     (uint64_t)seed));
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    uint64_t h = vx_hash64(view.buf, (size_t)view.len, (uint64_t)seed);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(h);
}

typedef struct {
    PyObject_HEAD
    Py_ssize_t n;
    uint64_t seeds[64];
    double weights[64];
} HrwObject;

static PyObject *Hrw_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"seeds", "weights", NULL};
    PyObject *seeds_obj, *weights_obj;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO:Rendezvous", kwlist, &seeds_obj, &weights_obj))
        return NULL;
    PyObject *seeds = PySequence_Fast(seeds_obj, "seeds must be a sequence of integers");
    if (seeds == NULL)
        return NULL;
    PyObject *weights = PySequence_Fast(weights_obj, "weights must be a sequence of numbers");
    if (weights == NULL) {
        Py_DECREF(seeds);
        return NULL;
    }
    HrwObject *self = NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seeds);
    if (n < 1 || n > 64 || PySequence_Fast_GET_SIZE(weights) != n) {
        PyErr_Format(PyExc_ValueError, "seeds and weights must have the same length, 1 to 64");
        goto done;
    }
    self = (HrwObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        goto done;
    self->n = n;
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long s = PyLong_AsUnsignedLongLongMask(PySequence_Fast_GET_ITEM(seeds, i));
        double w = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(weights, i));
        if ((s == (unsigned long long)-1 || w == -1.0) && PyErr_Occurred())
            goto fail;
        if (!(w > 0.0) || w > 1e9) {
            PyErr_Format(PyExc_ValueError, "weights must be in (0, 1e9], got %R",
                         PySequence_Fast_GET_ITEM(weights, i));
            goto fail;
        }
        self->seeds[i] = (uint64_t)s;
        self->weights[i] = w;
    }
    goto done;
fail:
    Py_CLEAR(self);
done:
    Py_DECREF(seeds);
    Py_DECREF(weights);
    return (PyObject *)self;
}

static void Hrw_dealloc(HrwObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static int hrw_key(PyObject *o, uint64_t *key)
{
    unsigned long long k = PyLong_AsUnsignedLongLongMask(o);
    if (k == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *key = (uint64_t)k;
    return 0;
}

PyDoc_STRVAR(Hrw_rank_doc,
             "rank($self, key_hash, /)\n--\n\n"
             "Target indices ordered by weighted rendezvous score for key_hash, best first.");

static PyObject *Hrw_rank(HrwObject *self, PyObject *arg)
{
    uint64_t key;
    uint32_t order[64];
    if (hrw_key(arg, &key) < 0)
        return NULL;
    vx_hrw_rank(key, self->seeds, self->weights, (size_t)self->n, order);
    PyObject *out = PyTuple_New(self->n);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < self->n; i++) {
        PyObject *v = PyLong_FromLong((long)order[i]);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, v);
    }
    return out;
}

PyDoc_STRVAR(Hrw_first_doc, "first($self, key_hash, /)\n--\n\nrank(key_hash)[0], cheaper.");

static PyObject *Hrw_first(HrwObject *self, PyObject *arg)
{
    uint64_t key;
    uint32_t order[64];
    if (hrw_key(arg, &key) < 0)
        return NULL;
    vx_hrw_rank(key, self->seeds, self->weights, (size_t)self->n, order);
    return PyLong_FromLong((long)order[0]);
}

static Py_ssize_t Hrw_len(HrwObject *self)
{
    return self->n;
}

static PyMethodDef Hrw_methods[] = {
    {"rank", (PyCFunction)Hrw_rank, METH_O, Hrw_rank_doc},
    {"first", (PyCFunction)Hrw_first, METH_O, Hrw_first_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(Hrw_doc,
             "Rendezvous(seeds, weights)\n--\n\n"
             "Weighted rendezvous (highest random weight) hashing over 1 to 64 targets, each\n"
             "named by a 64-bit seed: target i wins a key with probability weights[i]/sum.");

static PyType_Slot Hrw_slots[] = {
    {Py_tp_doc, (void *)Hrw_doc},
    {Py_tp_new, Hrw_new},
    {Py_tp_dealloc, Hrw_dealloc},
    {Py_tp_methods, Hrw_methods},
    {Py_sq_length, Hrw_len},
    {0, NULL},
};

static PyType_Spec Hrw_spec = {
    .name = "velox._native.Rendezvous",
    .basicsize = sizeof(HrwObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Hrw_slots,
};

/* ---------------------------------------------------------------- scan_json */

/* Smaller buffers are scanned with the GIL held: they take a few microseconds at most, less
 * than what giving the GIL away can cost when other threads want it (the switch itself, and
 * a wait of up to the switch interval, 5 ms by default, to get it back). */
#define SCAN_JSON_NOGIL_MIN 65536

PyDoc_STRVAR(scan_json_doc,
             "scan_json(buf, /)\n--\n\n"
             "Validate buf (any C-contiguous buffer) as one JSON text, accepting exactly what\n"
             "orjson.loads accepts, and find the top-level \"model\" and \"stream\" keys.\n"
             "Returns (error, error_offset, model_start, model_end, model_kind, stream_kind,\n"
             "top_kind): error is JSON_OK (0) or a JSON_E_* code; kinds are JSON_* constants.\n"
             "Buffers of 64 KiB or more are scanned with the GIL released.");

static PyObject *native_scan_json(PyObject *Py_UNUSED(module), PyObject *arg)
{
    Py_buffer view;
    /* PyBUF_SIMPLE: the bytes as one contiguous block (BufferError for a non-contiguous
     * memoryview, TypeError for non-buffers). The export is what keeps the memory valid
     * while the GIL is released: as long as it is held, the exporter may not free or move
     * its memory (a bytearray refuses to resize with BufferError), even if another thread
     * drops its last reference to the object, because the view owns one (view.obj). */
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const unsigned char *buf = view.buf;
    size_t len = (size_t)view.len;
    vx_json_fields f;
    int rc;
    if (view.len >= SCAN_JSON_NOGIL_MIN) {
        /* No Python object is touched in here: buf and len are plain copies, f is ours. */
        Py_BEGIN_ALLOW_THREADS
        rc = vx_json_scan(buf, len, &f);
        Py_END_ALLOW_THREADS
    } else {
        rc = vx_json_scan(buf, len, &f);
    }
    PyBuffer_Release(&view); /* ends the export; drops view.obj's reference */

    /* Offsets are at most len, which came from a Py_ssize_t, so the casts are exact. */
    Py_ssize_t vals[7] = {rc, (Py_ssize_t)f.error_offset, (Py_ssize_t)f.model_start,
                          (Py_ssize_t)f.model_end, f.model_kind, f.stream_kind, f.top_kind};
    PyObject *result = PyTuple_New(7); /* new reference */
    if (result == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < 7; i++) {
        PyObject *v = PyLong_FromSsize_t(vals[i]);
        if (v == NULL) {
            Py_DECREF(result); /* tuple dealloc skips the NULL slots */
            return NULL;
        }
        PyTuple_SET_ITEM(result, i, v); /* steals v */
    }
    return result;
}

/* ---------------------------------------------------------------- Limits */

typedef struct {
    PyObject_HEAD
    vx_limits *l; /* owned view of the shared mapping; NULL only while tp_new fails */
} LimitsObject;

#define LIMITS_DEFAULT_SLOTS 64

static PyObject *Limits_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"n", "slots", NULL};
    PyObject *n_obj, *slots_obj = NULL;
    int64_t n, slots = LIMITS_DEFAULT_SLOTS;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|O:Limits", kwlist, &n_obj, &slots_obj))
        return NULL;
    if (arg_in_range(n_obj, "n", 1, VX_LIMITS_MAX_N, &n) < 0 ||
        (slots_obj != NULL &&
         arg_in_range(slots_obj, "slots", 1, VX_LIMITS_MAX_SLOTS, &slots) < 0))
        return NULL;
    LimitsObject *self = (LimitsObject *)type->tp_alloc(type, 0); /* new reference */
    if (self == NULL)
        return NULL;
    self->l = vx_limits_create(n, slots);
    if (self->l == NULL) {
        Py_DECREF(self);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return (PyObject *)self;
}

static void Limits_dealloc(LimitsObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    vx_limits_destroy(self->l); /* this process's view; other processes keep theirs */
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static int limits_index(LimitsObject *self, PyObject *o, int64_t *i)
{
    size_t v;
    if (arg_index(o, "index", (size_t)self->l->n, &v) < 0)
        return -1;
    *i = (int64_t)v;
    return 0;
}

static int limits_slot(LimitsObject *self, PyObject *o, int64_t *slot)
{
    size_t v;
    if (arg_index(o, "slot", (size_t)self->l->slots, &v) < 0)
        return -1;
    *slot = (int64_t)v;
    return 0;
}

/* args[pos] (if nargs > pos and not None) is now_us, else the clock. */
static int limits_now(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t pos, int64_t *now)
{
    if (nargs > pos && args[pos] != Py_None)
        return arg_now(args[pos], now);
    *now = vx_limits_now_us();
    return 0;
}

/* Token amounts: lo <= n; huge n saturates at INT64_MAX (the C side clamps or answers never). */
static int limits_tokens(PyObject *o, int64_t lo, int64_t *n)
{
    int overflow;
    if (to_i64(o, n, &overflow) < 0)
        return -1;
    if (*n < lo) {
        PyErr_Format(PyExc_ValueError, "n must be >= %lld, got %R", (long long)lo, o);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(Limits_configure_doc,
             "configure($self, i, rate_per_minute, burst, now_us=None, /)\n--\n\n"
             "Set bucket i: rate in [0, 10**9] tokens per minute (0: leased, only give() adds),\n"
             "burst in [1, 10**9]. The first configure starts it full (leased: empty); a later\n"
             "one keeps the level, capped at the new burst.");

static PyObject *Limits_configure(LimitsObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t i, rate, burst, now;
    if (check_nargs("configure", nargs, 3, 4) < 0 || limits_index(self, args[0], &i) < 0 ||
        arg_in_range(args[1], "rate_per_minute", 0, VX_LIMITS_MAX_RATE, &rate) < 0 ||
        arg_in_range(args[2], "burst", 1, VX_LIMITS_MAX_BURST, &burst) < 0 ||
        limits_now(args, nargs, 3, &now) < 0)
        return NULL;
    vx_limits_configure(self->l, i, rate, burst, now); /* arguments checked above */
    Py_RETURN_NONE;
}

PyDoc_STRVAR(Limits_config_doc, "config($self, i, /)\n--\n\n"
                                "(rate_per_minute, burst) of bucket i; (0, 0) if never configured.");

static PyObject *Limits_config(LimitsObject *self, PyObject *arg)
{
    int64_t i, rate, burst;
    if (limits_index(self, arg, &i) < 0)
        return NULL;
    vx_limits_config(self->l, i, &rate, &burst);
    return Py_BuildValue("(LL)", (long long)rate, (long long)burst);
}

PyDoc_STRVAR(Limits_take_doc,
             "take($self, i, n, now_us=None, /)\n--\n\n"
             "Take n >= 1 tokens at once or none: 0 taken; > 0 microseconds until n could be\n"
             "there (nothing taken; a leased bucket answers LIMITS_LEASE_WAIT_US); -1 never\n"
             "(n > burst, or never configured).");

static PyObject *Limits_take(LimitsObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t i, n, now;
    if (check_nargs("take", nargs, 2, 3) < 0 || limits_index(self, args[0], &i) < 0 ||
        limits_tokens(args[1], 1, &n) < 0 || limits_now(args, nargs, 2, &now) < 0)
        return NULL;
    return PyLong_FromLongLong(vx_limits_take(self->l, i, n, now));
}

PyDoc_STRVAR(Limits_give_doc,
             "give($self, i, n, /)\n--\n\n"
             "Deposit n >= 0 tokens (a lease), the level capped at burst; returns how many whole\n"
             "tokens went in. taken() is unchanged.");

static PyObject *Limits_give(LimitsObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t i, n;
    if (check_nargs("give", nargs, 2, 2) < 0 || limits_index(self, args[0], &i) < 0 ||
        limits_tokens(args[1], 0, &n) < 0)
        return NULL;
    return PyLong_FromLongLong(vx_limits_give(self->l, i, n));
}

PyDoc_STRVAR(Limits_refund_doc,
             "refund($self, i, n, /)\n--\n\n"
             "give() back n >= 0 tokens taken earlier and not used: taken() goes down by n.");

static PyObject *Limits_refund(LimitsObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t i, n;
    if (check_nargs("refund", nargs, 2, 2) < 0 || limits_index(self, args[0], &i) < 0 ||
        limits_tokens(args[1], 0, &n) < 0)
        return NULL;
    return PyLong_FromLongLong(vx_limits_refund(self->l, i, n));
}

PyDoc_STRVAR(Limits_charge_doc,
             "charge($self, i, n, /)\n--\n\n"
             "Take n >= 0 tokens unconditionally (settling over-use): the level may go negative\n"
             "(debt, down to -10**10 tokens); takes are refused until it is repaid.");

static PyObject *Limits_charge(LimitsObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t i, n;
    if (check_nargs("charge", nargs, 2, 2) < 0 || limits_index(self, args[0], &i) < 0 ||
        limits_tokens(args[1], 0, &n) < 0)
        return NULL;
    vx_limits_charge(self->l, i, n);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(Limits_level_doc,
             "level($self, i, now_us=None, /)\n--\n\n"
             "Whole tokens in bucket i now, pending refill included (negative: debt).");

static PyObject *Limits_level(LimitsObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t i, now;
    if (check_nargs("level", nargs, 1, 2) < 0 || limits_index(self, args[0], &i) < 0 ||
        limits_now(args, nargs, 1, &now) < 0)
        return NULL;
    return PyLong_FromLongLong(vx_limits_level(self->l, i, now));
}

PyDoc_STRVAR(Limits_taken_doc, "taken($self, i, /)\n--\n\n"
                               "Cumulative tokens taken or charged from bucket i, minus refunds.");

static PyObject *Limits_taken(LimitsObject *self, PyObject *arg)
{
    int64_t i;
    if (limits_index(self, arg, &i) < 0)
        return NULL;
    return PyLong_FromLongLong(vx_limits_taken(self->l, i));
}

PyDoc_STRVAR(Limits_refused_doc,
             "refused($self, i, /)\n--\n\n"
             "Cumulative tokens of the takes bucket i refused for want of tokens (demand\n"
             "that taken() does not show; the Redis refresher counts it).");

static PyObject *Limits_refused(LimitsObject *self, PyObject *arg)
{
    int64_t i;
    if (limits_index(self, arg, &i) < 0)
        return NULL;
    return PyLong_FromLongLong(vx_limits_refused(self->l, i));
}

PyDoc_STRVAR(Limits_pop_largest_doc,
             "pop_largest($self, i, /)\n--\n\n"
             "The largest take asked of bucket i (admitted or refused) since the last call;\n"
             "resets it to 0. One reader: the Redis refresher.");

static PyObject *Limits_pop_largest(LimitsObject *self, PyObject *arg)
{
    int64_t i;
    if (limits_index(self, arg, &i) < 0)
        return NULL;
    return PyLong_FromLongLong(vx_limits_pop_largest(self->l, i));
}

PyDoc_STRVAR(Limits_enter_doc,
             "enter($self, i, limit, slot, /)\n--\n\n"
             "Take a place of gauge i for the worker in `slot`: False (nothing taken) when\n"
             "`limit` places are held across the gateway. limit <= 0: no limit, count only.");

static PyObject *Limits_enter(LimitsObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t i, limit, slot;
    if (check_nargs("enter", nargs, 3, 3) < 0 || limits_index(self, args[0], &i) < 0 ||
        arg_in_range(args[1], "limit", INT64_MIN, INT64_MAX, &limit) < 0 ||
        limits_slot(self, args[2], &slot) < 0)
        return NULL;
    return PyBool_FromLong(vx_limits_enter(self->l, i, limit, slot));
}

PyDoc_STRVAR(Limits_leave_doc,
             "leave($self, i, slot, /)\n--\n\n"
             "Give back a place of gauge i taken by this slot; False (nothing changed) when the\n"
             "slot holds none.");

static PyObject *Limits_leave(LimitsObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t i, slot;
    if (check_nargs("leave", nargs, 2, 2) < 0 || limits_index(self, args[0], &i) < 0 ||
        limits_slot(self, args[1], &slot) < 0)
        return NULL;
    return PyBool_FromLong(vx_limits_leave(self->l, i, slot));
}

PyDoc_STRVAR(Limits_active_doc, "active($self, i, /)\n--\n\n"
                                "Places of gauge i held across the gateway.");

static PyObject *Limits_active(LimitsObject *self, PyObject *arg)
{
    int64_t i;
    if (limits_index(self, arg, &i) < 0)
        return NULL;
    return PyLong_FromLongLong(vx_limits_active(self->l, i));
}

PyDoc_STRVAR(Limits_entered_doc, "entered($self, i, /)\n--\n\n"
                                 "Places of gauge i ever taken (a counter: admitted requests).");

static PyObject *Limits_entered(LimitsObject *self, PyObject *arg)
{
    int64_t i;
    if (limits_index(self, arg, &i) < 0)
        return NULL;
    return PyLong_FromLongLong(vx_limits_entered(self->l, i));
}

PyDoc_STRVAR(Limits_held_doc, "held($self, i, slot, /)\n--\n\n"
                              "Places of gauge i held by the worker in `slot`.");

static PyObject *Limits_held(LimitsObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t i, slot;
    if (check_nargs("held", nargs, 2, 2) < 0 || limits_index(self, args[0], &i) < 0 ||
        limits_slot(self, args[1], &slot) < 0)
        return NULL;
    return PyLong_FromLongLong(vx_limits_held_by(self->l, i, slot));
}

PyDoc_STRVAR(Limits_forget_slot_doc,
             "forget_slot($self, slot, /)\n--\n\n"
             "Give back every place the (dead) worker of `slot` held; returns how many. Only\n"
             "when no process runs in that slot.");

static PyObject *Limits_forget_slot(LimitsObject *self, PyObject *arg)
{
    int64_t slot;
    if (limits_slot(self, arg, &slot) < 0)
        return NULL;
    return PyLong_FromLongLong(vx_limits_forget_slot(self->l, slot));
}

/* An entry index or -1 ("skip this step"), else IndexError. */
static int limits_index_or_skip(LimitsObject *self, PyObject *o, const char *name, int64_t *i)
{
    int overflow;
    if (to_i64(o, i, &overflow) < 0)
        return -1;
    if (overflow || *i < -1 || *i >= self->l->n) {
        PyErr_Format(PyExc_IndexError, "%s %R out of range: -1 (skip) or [0, %lld)", name, o,
                     (long long)self->l->n);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(Limits_admit_doc,
             "admit($self, req_i, tok_i, tokens, gauge_i, limit, slot, now_us=None, /)\n--\n\n"
             "One admission in one call: take 1 from bucket req_i, then `tokens` from bucket\n"
             "tok_i, then a place of gauge gauge_i (limit, slot); an index of -1 skips its step.\n"
             "All or nothing. Admitted: a negative number whose complement (~result) holds the\n"
             "whole tokens left in req_i (low 32 bits) and in tok_i (the bits above). Refused:\n"
             "wait_us * 4 + reason (> 0), where reason is ADMIT_REQUESTS, ADMIT_TOKENS or\n"
             "ADMIT_PARALLEL and wait_us what take() answered (0 for never; 1 s for a full gauge).");

static PyObject *Limits_admit(LimitsObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t req_i, tok_i, tokens, gauge_i, limit, slot, now;
    if (check_nargs("admit", nargs, 6, 7) < 0 ||
        limits_index_or_skip(self, args[0], "req_i", &req_i) < 0 ||
        limits_index_or_skip(self, args[1], "tok_i", &tok_i) < 0 ||
        arg_in_range(args[2], "tokens", 0, VX_LIMITS_MAX_TOKENS, &tokens) < 0 ||
        limits_index_or_skip(self, args[3], "gauge_i", &gauge_i) < 0 ||
        arg_in_range(args[4], "limit", INT64_MIN, INT64_MAX, &limit) < 0 ||
        limits_slot(self, args[5], &slot) < 0 || limits_now(args, nargs, 6, &now) < 0)
        return NULL;
    int reason = VX_ADMIT_OK;
    int64_t left_req, left_tok;
    int64_t wait = vx_limits_admit(self->l, req_i, tok_i, tokens, gauge_i, limit, slot, now,
                                   &reason, &left_req, &left_tok);
    if (reason == VX_ADMIT_OK) /* both < 2^30 (bursts <= 10^9): the packing cannot overflow */
        return PyLong_FromLongLong(~(left_req | (left_tok << 32)));
    /* wait <= 2^33 us for any bucket (need <= 6e17 units at rate >= 1): no overflow. */
    return PyLong_FromLongLong((wait > 0 ? wait : 0) * 4 + reason);
}

PyDoc_STRVAR(Limits_hammer_doc,
             "_hammer($self, i, duration_us, n, /)\n--\n\n"
             "Test hook: with the GIL released, call take(i, n) on the real clock in a tight\n"
             "loop for duration_us (at most 60 s); return the number of tokens admitted.");

static PyObject *Limits_hammer(LimitsObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t i, duration, n, admitted = 0;
    if (check_nargs("_hammer", nargs, 3, 3) < 0 || limits_index(self, args[0], &i) < 0 ||
        arg_in_range(args[1], "duration_us", 0, HAMMER_MAX_US, &duration) < 0 ||
        limits_tokens(args[2], 1, &n) < 0)
        return NULL;
    vx_limits *l = self->l; /* the object outlives the call: the caller holds it */
    Py_BEGIN_ALLOW_THREADS
    int64_t deadline = vx_limits_now_us() + duration;
    for (int64_t now = vx_limits_now_us(); now < deadline; now = vx_limits_now_us()) {
        if (vx_limits_take(l, i, n, now) == 0)
            admitted += n;
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(admitted);
}

static Py_ssize_t Limits_len(LimitsObject *self)
{
    return (Py_ssize_t)self->l->n;
}

static PyObject *Limits_get_slots(LimitsObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromLongLong(self->l->slots);
}

/* ---------------------------------------------------------------- books: key tickets */

/* What one admitted keyed request holds (velox.keys.Ticket's native form): a place of its
 * key's gauge and `reserved` tokens of its token bucket. release() and settle() act once
 * each; made by Limits.ticket. In C because every keyed request makes one and ends it: the
 * Python class cost ~1.3 us a request (construction, release, settle), this ~0.3. */
typedef struct {
    PyObject_HEAD
    PyObject *limits; /* LimitsObject, kept alive while a ticket may release into it */
    PyObject *key;    /* velox.keys._Key, for readers */
    int64_t rpm_i, tok_i, slot, reserved;
    char released, settled;
} TicketObject;

static PyTypeObject *ticket_type; /* made at the first Limits.ticket call (GIL held) */

static void Ticket_dealloc(TicketObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    Py_XDECREF(self->limits);
    Py_XDECREF(self->key);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyObject *Ticket_release(TicketObject *self, PyObject *Py_UNUSED(ignored))
{
    if (!self->released) {
        self->released = 1;
        vx_limits_leave(((LimitsObject *)self->limits)->l, self->rpm_i, self->slot);
    }
    Py_RETURN_NONE;
}

static PyObject *Ticket_settle(TicketObject *self, PyObject *arg)
{
    int64_t used;
    int overflow;
    if (to_i64(arg, &used, &overflow) < 0)
        return NULL;
    if (used < 0) {
        PyErr_Format(PyExc_ValueError, "tokens_used must be >= 0, got %R", arg);
        return NULL;
    }
    if (self->settled)
        Py_RETURN_NONE;
    self->settled = 1;
    vx_limits *l = ((LimitsObject *)self->limits)->l;
    if (used > self->reserved)
        vx_limits_charge(l, self->tok_i, used - self->reserved);
    else if (used < self->reserved)
        vx_limits_refund(l, self->tok_i, self->reserved - used);
    Py_RETURN_NONE;
}

static PyObject *Ticket_get_released(TicketObject *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(self->released);
}

static PyObject *Ticket_get_settled(TicketObject *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(self->settled);
}

static PyObject *Ticket_get_reserved(TicketObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromLongLong(self->reserved);
}

static PyObject *Ticket_get_key(TicketObject *self, void *Py_UNUSED(closure))
{
    return Py_NewRef(self->key);
}

static PyMethodDef Ticket_methods[] = {
    {"release", (PyCFunction)Ticket_release, METH_NOARGS,
     "release($self, /)\n--\n\nGive the gauge's place back (once; later calls do nothing)."},
    {"settle", (PyCFunction)Ticket_settle, METH_O,
     "settle($self, tokens_used, /)\n--\n\nCorrect the reservation once: tokens not used go "
     "back, over-use is charged (debt). Later calls change nothing."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Ticket_getset[] = {
    {"released", (getter)Ticket_get_released, NULL, "release() was called.", NULL},
    {"settled", (getter)Ticket_get_settled, NULL,
     "settle() was called, or the key has no token bucket.", NULL},
    {"reserved", (getter)Ticket_get_reserved, NULL, "Tokens reserved at admission.", NULL},
    {"key", (getter)Ticket_get_key, NULL, "The key (velox.keys._Key).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot Ticket_slots[] = {
    {Py_tp_doc, (void *)"A keyed request's admission (made by Limits.ticket)."},
    {Py_tp_dealloc, Ticket_dealloc},
    {Py_tp_methods, Ticket_methods},
    {Py_tp_getset, Ticket_getset},
    {0, NULL},
};

static PyType_Spec Ticket_spec = {
    .name = "velox._native.KeyTicket",
    .basicsize = sizeof(TicketObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = Ticket_slots,
};

PyDoc_STRVAR(Limits_ticket_doc,
             "ticket($self, key, rpm_i, tok_i, slot, reserved, /)\n--\n\n"
             "The ticket of a request admitted by admit(): release() leaves gauge rpm_i for\n"
             "slot, settle(used) corrects bucket tok_i's reservation of `reserved` tokens (a\n"
             "ticket with tok_i < 0 is settled from the start). `key` is kept for readers.");

static PyObject *Limits_ticket(LimitsObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t rpm_i, tok_i, slot, reserved;
    int overflow;
    if (check_nargs("ticket", nargs, 5, 5) < 0 || limits_index(self, args[1], &rpm_i) < 0 ||
        to_i64(args[2], &tok_i, &overflow) < 0 || limits_slot(self, args[3], &slot) < 0 ||
        limits_tokens(args[4], 0, &reserved) < 0)
        return NULL;
    if (tok_i >= 0 && limits_index(self, args[2], &tok_i) < 0)
        return NULL;
    if (ticket_type == NULL &&
        (ticket_type = (PyTypeObject *)PyType_FromSpec(&Ticket_spec)) == NULL)
        return NULL;
    TicketObject *t = PyObject_New(TicketObject, ticket_type);
    if (t == NULL)
        return NULL;
    Py_INCREF(ticket_type); /* instances of heap types hold their type */
    t->limits = Py_NewRef((PyObject *)self);
    t->key = Py_NewRef(args[0]);
    t->rpm_i = rpm_i;
    t->tok_i = tok_i;
    t->slot = slot;
    t->reserved = reserved;
    t->released = 0;
    t->settled = tok_i < 0;
    return (PyObject *)t;
}

static PyMethodDef Limits_methods[] = {
    {"configure", FASTCALL(Limits_configure), METH_FASTCALL, Limits_configure_doc},
    {"config", (PyCFunction)Limits_config, METH_O, Limits_config_doc},
    {"take", FASTCALL(Limits_take), METH_FASTCALL, Limits_take_doc},
    {"give", FASTCALL(Limits_give), METH_FASTCALL, Limits_give_doc},
    {"refund", FASTCALL(Limits_refund), METH_FASTCALL, Limits_refund_doc},
    {"charge", FASTCALL(Limits_charge), METH_FASTCALL, Limits_charge_doc},
    {"level", FASTCALL(Limits_level), METH_FASTCALL, Limits_level_doc},
    {"taken", (PyCFunction)Limits_taken, METH_O, Limits_taken_doc},
    {"refused", (PyCFunction)Limits_refused, METH_O, Limits_refused_doc},
    {"pop_largest", (PyCFunction)Limits_pop_largest, METH_O, Limits_pop_largest_doc},
    {"enter", FASTCALL(Limits_enter), METH_FASTCALL, Limits_enter_doc},
    {"leave", FASTCALL(Limits_leave), METH_FASTCALL, Limits_leave_doc},
    {"active", (PyCFunction)Limits_active, METH_O, Limits_active_doc},
    {"held", FASTCALL(Limits_held), METH_FASTCALL, Limits_held_doc},
    {"entered", (PyCFunction)Limits_entered, METH_O, Limits_entered_doc},
    {"forget_slot", (PyCFunction)Limits_forget_slot, METH_O, Limits_forget_slot_doc},
    {"admit", FASTCALL(Limits_admit), METH_FASTCALL, Limits_admit_doc},
    {"ticket", FASTCALL(Limits_ticket), METH_FASTCALL, Limits_ticket_doc},
    {"_hammer", FASTCALL(Limits_hammer), METH_FASTCALL, Limits_hammer_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Limits_getset[] = {
    {"slots", (getter)Limits_get_slots, NULL, "Worker slots (rows of held places).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(Limits_doc,
             "Limits(n, slots=64)\n--\n\n"
             "n token buckets and n concurrency gauges in one anonymous shared mapping, for\n"
             "`slots` worker slots; created before fork(), one state for every process.\n"
             "Entries start unconfigured (every take: -1) with gauges at 0.");

static PyType_Slot Limits_slots[] = {
    {Py_tp_doc, (void *)Limits_doc},
    {Py_tp_new, Limits_new},
    {Py_tp_dealloc, Limits_dealloc},
    {Py_tp_methods, Limits_methods},
    {Py_tp_getset, Limits_getset},
    {Py_sq_length, Limits_len},
    {0, NULL},
};

static PyType_Spec Limits_spec = {
    .name = "velox._native.Limits",
    .basicsize = sizeof(LimitsObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Limits_slots,
};

/* Module-level ints mirroring vx_json.h and vx_http1.h, so Python code never hard-codes the numbers. */
static const struct {
    const char *name;
    int value;
} json_constants[] = {
    {"H1_LENGTH", VX_H1_LENGTH},
    {"H1_CHUNKED", VX_H1_CHUNKED},
    {"H1_CLOSE", VX_H1_CLOSE},
    {"JSON_ABSENT", VX_JSON_ABSENT},
    {"JSON_NULL", VX_JSON_NULL},
    {"JSON_FALSE", VX_JSON_FALSE},
    {"JSON_TRUE", VX_JSON_TRUE},
    {"JSON_NUMBER", VX_JSON_NUMBER},
    {"JSON_STRING", VX_JSON_STRING},
    {"JSON_ARRAY", VX_JSON_ARRAY},
    {"JSON_OBJECT", VX_JSON_OBJECT},
    {"JSON_OK", VX_JSON_OK},
    {"JSON_E_EMPTY", VX_JSON_E_EMPTY},
    {"JSON_E_TRUNCATED", VX_JSON_E_TRUNCATED},
    {"JSON_E_SYNTAX", VX_JSON_E_SYNTAX},
    {"JSON_E_TRAILING", VX_JSON_E_TRAILING},
    {"JSON_E_DEPTH", VX_JSON_E_DEPTH},
    {"JSON_E_NUMBER", VX_JSON_E_NUMBER},
    {"JSON_E_RANGE", VX_JSON_E_RANGE},
    {"JSON_E_CONTROL", VX_JSON_E_CONTROL},
    {"JSON_E_ESCAPE", VX_JSON_E_ESCAPE},
    {"JSON_E_SURROGATE", VX_JSON_E_SURROGATE},
    {"JSON_E_UTF8", VX_JSON_E_UTF8},
    {"JSON_E_TOO_LARGE", VX_JSON_E_TOO_LARGE},
    {"JSON_MAX_DEPTH", VX_JSON_MAX_DEPTH},
    {"BREAKER_CLOSED", VX_BREAKER_CLOSED},
    {"BREAKER_OPEN", VX_BREAKER_OPEN},
    {"BREAKER_HALF_OPEN", VX_BREAKER_HALF_OPEN},
    {"PEEK_CLOSED", VX_PEEK_CLOSED},
    {"PEEK_PROBE", VX_PEEK_PROBE},
    {"PEEK_OPEN", VX_PEEK_OPEN},
    {"PEEK_PROBING", VX_PEEK_PROBING},
    {"OUTCOME_SUCCESS", VX_OUTCOME_SUCCESS},
    {"OUTCOME_FAILURE", VX_OUTCOME_FAILURE},
    {"OUTCOME_NEUTRAL", VX_OUTCOME_NEUTRAL},
    {"TR_NONE", VX_TR_NONE},
    {"TR_OPENED", VX_TR_OPENED},
    {"TR_REOPENED", VX_TR_REOPENED},
    {"TR_CLOSED", VX_TR_CLOSED},
    {"TR_HALF_OPENED", VX_TR_HALF_OPENED},
    {"UP_REQUESTS", VX_UP_REQUESTS},
    {"UP_SUCCESSES", VX_UP_SUCCESSES},
    {"UP_FAILURES", VX_UP_FAILURES},
    {"UP_RETRIES", VX_UP_RETRIES},
    {"UP_PANICS", VX_UP_PANICS},
    {"UP_FULL", VX_UP_FULL},
    {"UP_COUNTERS", VX_UP_COUNTERS},
    {"LIMITS_NEVER", (int)VX_LIMITS_NEVER},
    {"LIMITS_LEASE_WAIT_US", (int)VX_LIMITS_LEASE_WAIT_US},
    {"ADMIT_REQUESTS", VX_ADMIT_REQUESTS},
    {"ADMIT_TOKENS", VX_ADMIT_TOKENS},
    {"ADMIT_PARALLEL", VX_ADMIT_PARALLEL},
    /* The native HTTP/2 codec's constants, checked against velox.egress.codec at import. */
    {"H2_RESPONSE", VX_EV_RESPONSE},
    {"H2_DATA", VX_EV_DATA},
    {"H2_TRAILERS", VX_EV_TRAILERS},
    {"H2_RESET", VX_EV_RESET},
    {"H2_GOAWAY", VX_EV_GOAWAY},
    {"H2_SETTINGS", VX_EV_SETTINGS},
    {"H2_PING_ACK", VX_EV_PING_ACK},
    {"H2_ANSWER", H2_ANSWER},
    {"H2_LOCAL_INITIAL_WINDOW_SIZE", VX_H2_LOCAL_INITIAL_WINDOW_SIZE},
    {"H2_LOCAL_CONNECTION_WINDOW", VX_H2_LOCAL_CONNECTION_WINDOW},
    {"H2_LOCAL_MAX_HEADER_LIST_SIZE", VX_H2_LOCAL_MAX_HEADER_LIST_SIZE},
    {"H2_DATA_PER_CALL", VX_H2_DATA_PER_CALL},
    {"H2_DEFAULT_MAX_CONCURRENT_STREAMS", VX_H2_DEFAULT_MAX_CONCURRENT_STREAMS},
    {"H2_MAX_CONCURRENT_STREAMS_CAP", VX_H2_MAX_CONCURRENT_STREAMS_CAP},
};

/* ---------------------------------------------------------------- HTTP/1.1 response bytes */

/* Fields on the C stack up to this many (a response has about ten); more are allocated. */
#define H1_STACK_FIELDS 32

/* The (name, value) pairs of a sequence (list or tuple) of 2-tuples of bytes, pointing into
 * the bytes objects (which the sequence keeps alive for the call). Returns the count, or -1
 * with TypeError set. *heap is set when the array had to be allocated (PyMem_Free it). */
static Py_ssize_t h1_fields(PyObject *seq, vx_h1_field *stack, vx_h1_field **out)
{
    *out = stack;
    if (!PyList_Check(seq) && !PyTuple_Check(seq)) {
        PyErr_Format(PyExc_TypeError, "headers must be a list or tuple of (name, value) bytes "
                     "pairs, got %.100s", Py_TYPE(seq)->tp_name);
        return -1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    vx_h1_field *f = stack;
    if (n > H1_STACK_FIELDS) {
        if ((size_t)n > VX_H1_MAX_LEN / 4) {
            PyErr_SetString(PyExc_ValueError, "too many headers");
            return -1;
        }
        f = PyMem_Malloc((size_t)n * sizeof *f);
        if (f == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        *out = f;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = items[i];
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2 ||
            !PyBytes_Check(PyTuple_GET_ITEM(pair, 0)) || !PyBytes_Check(PyTuple_GET_ITEM(pair, 1))) {
            PyErr_Format(PyExc_TypeError, "header %zd must be a (name, value) tuple of bytes, "
                         "got %.100s", i, Py_TYPE(pair)->tp_name);
            if (f != stack)
                PyMem_Free(f);
            *out = stack;
            return -1;
        }
        PyObject *name = PyTuple_GET_ITEM(pair, 0), *value = PyTuple_GET_ITEM(pair, 1);
        f[i].name = PyBytes_AS_STRING(name);
        f[i].name_len = (size_t)PyBytes_GET_SIZE(name);
        f[i].value = PyBytes_AS_STRING(value);
        f[i].value_len = (size_t)PyBytes_GET_SIZE(value);
    }
    return n;
}

/* A body given as one bytes-like object or as a list/tuple of them: the views, their count
 * (at most H1_STACK_FIELDS pieces on the stack, more allocated) and total length. Every view
 * in *views must be released with h1_release_body, also after an error (count says how many
 * were taken). */
typedef struct {
    Py_buffer stack[H1_STACK_FIELDS];
    Py_buffer *views;
    Py_ssize_t count;
    size_t total;
} h1_body;

static void h1_release_body(h1_body *b)
{
    for (Py_ssize_t i = 0; i < b->count; i++)
        PyBuffer_Release(&b->views[i]);
    if (b->views != b->stack)
        PyMem_Free(b->views);
    b->views = b->stack;
    b->count = 0;
}

static int h1_get_body(PyObject *obj, h1_body *b)
{
    b->views = b->stack;
    b->count = 0;
    b->total = 0;
    int seq = PyList_Check(obj) || PyTuple_Check(obj);
    Py_ssize_t n = seq ? PySequence_Fast_GET_SIZE(obj) : 1;
    if (seq) {
        if (n > H1_STACK_FIELDS) {
            b->views = PyMem_Malloc((size_t)n * sizeof(Py_buffer));
            if (b->views == NULL) {
                b->views = b->stack;
                PyErr_NoMemory();
                return -1;
            }
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        /* Re-read on every pass: getting a buffer may run Python code (a __buffer__ method)
         * that shrinks the list under us. */
        if (seq && i >= PySequence_Fast_GET_SIZE(obj)) {
            PyErr_SetString(PyExc_RuntimeError, "body list changed size while being read");
            return -1;
        }
        PyObject *item = seq ? PySequence_Fast_GET_ITEM(obj, i) : obj;
        if (PyObject_GetBuffer(item, &b->views[i], PyBUF_SIMPLE) < 0)
            return -1;
        b->count = i + 1;
        b->total += (size_t)b->views[i].len;
        if (b->total >= VX_H1_MAX_LEN) {
            PyErr_SetString(PyExc_ValueError, "body too large");
            return -1;
        }
    }
    return 0;
}

static int h1_flags(PyObject *o, unsigned *flags)
{
    int overflow;
    int64_t v;
    if (to_i64(o, &v, &overflow) < 0)
        return -1;
    if (overflow || v < 0 || v > (int64_t)(VX_H1_LENGTH | VX_H1_CHUNKED | VX_H1_CLOSE)) {
        PyErr_Format(PyExc_ValueError, "flags must be a combination of H1_LENGTH, H1_CHUNKED "
                     "and H1_CLOSE, got %R", o);
        return -1;
    }
    *flags = (unsigned)v;
    return 0;
}

PyDoc_STRVAR(h1_response_doc,
             "h1_response(status_line, headers, body, flags, /) -> bytes\n\n"
             "One HTTP/1.1 response: status_line (bytes, with its CRLF), then with H1_LENGTH\n"
             "`content-length: <len(body)>`, the headers (a list or tuple of (name, value)\n"
             "bytes pairs, in order), `transfer-encoding: chunked` with H1_CHUNKED,\n"
             "`connection: close` with H1_CLOSE, the blank line, and body: a bytes-like\n"
             "object, a list or tuple of them (joined), or None for a head only (a HEAD\n"
             "answer: pass the body's length with a head-only call via h1_head).");

static PyObject *h1_build(PyObject *status, PyObject *headers, PyObject *body_obj,
                          unsigned flags, int have_length, uint64_t length)
{
    if (!PyBytes_Check(status)) {
        PyErr_Format(PyExc_TypeError, "status_line must be bytes, got %.100s",
                     Py_TYPE(status)->tp_name);
        return NULL;
    }
    /* The body first: getting its buffers may run Python code, and the field pointers taken
     * next must not outlive a change to the headers list. */
    vx_h1_field stack[H1_STACK_FIELDS], *fields = stack;
    PyObject *out = NULL;
    h1_body body;
    body.views = body.stack;
    body.count = 0;
    body.total = 0;
    if (body_obj != Py_None && h1_get_body(body_obj, &body) < 0)
        goto done;
    Py_ssize_t n = h1_fields(headers, stack, &fields);
    if (n < 0)
        goto done;
    if (!have_length)
        length = body.total;
    size_t status_len = (size_t)PyBytes_GET_SIZE(status);
    size_t head = vx_h1_head_size(status_len, fields, (size_t)n, length, flags);
    if (head >= VX_H1_MAX_LEN || body.total >= VX_H1_MAX_LEN - head) {
        PyErr_SetString(PyExc_ValueError, "response too large");
        goto done;
    }
    out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(head + body.total));
    if (out == NULL)
        goto done;
    char *p = vx_h1_write_head(PyBytes_AS_STRING(out), PyBytes_AS_STRING(status), status_len,
                               fields, (size_t)n, length, flags);
    for (Py_ssize_t i = 0; i < body.count; i++) {
        if (body.views[i].len) {
            memcpy(p, body.views[i].buf, (size_t)body.views[i].len);
            p += body.views[i].len;
        }
    }
done:
    h1_release_body(&body);
    if (fields != stack)
        PyMem_Free(fields);
    return out;
}

static PyObject *native_h1_response(PyObject *Py_UNUSED(module), PyObject *const *args,
                                    Py_ssize_t nargs)
{
    unsigned flags;
    if (check_nargs("h1_response", nargs, 4, 4) < 0 || h1_flags(args[3], &flags) < 0)
        return NULL;
    return h1_build(args[0], args[1], args[2], flags, 0, 0);
}

PyDoc_STRVAR(h1_head_doc,
             "h1_head(status_line, headers, content_length, flags, /) -> bytes\n\n"
             "The head alone, as h1_response writes it, with `content-length: content_length`\n"
             "when flags has H1_LENGTH (a HEAD answer states the length of the body it omits).\n"
             "content_length must be in [0, 2**60).");

static PyObject *native_h1_head(PyObject *Py_UNUSED(module), PyObject *const *args,
                                Py_ssize_t nargs)
{
    unsigned flags;
    int64_t length;
    if (check_nargs("h1_head", nargs, 4, 4) < 0 || h1_flags(args[3], &flags) < 0 ||
        arg_in_range(args[2], "content_length", 0, (int64_t)VX_H1_MAX_LEN - 1, &length) < 0)
        return NULL;
    return h1_build(args[0], args[1], Py_None, flags, 1, (uint64_t)length);
}

PyDoc_STRVAR(h1_chunks_doc,
             "h1_chunks(data, last=False, /) -> bytes\n\n"
             "data (a bytes-like object, or a list or tuple of them) framed as chunks of a\n"
             "chunked body, one chunk per non-empty piece (`%x\\r\\n<piece>\\r\\n`), all in one\n"
             "bytes object; with last true the last chunk `0\\r\\n\\r\\n` follows.");

static PyObject *native_h1_chunks(PyObject *Py_UNUSED(module), PyObject *const *args,
                                  Py_ssize_t nargs)
{
    int last = 0;
    if (check_nargs("h1_chunks", nargs, 1, 2) < 0)
        return NULL;
    if (nargs == 2 && (last = PyObject_IsTrue(args[1])) < 0)
        return NULL;
    h1_body body;
    PyObject *out = NULL;
    if (h1_get_body(args[0], &body) < 0)
        goto done;
    size_t size = last ? VX_H1_LAST_CHUNK_LEN : 0;
    for (Py_ssize_t i = 0; i < body.count; i++)
        size += vx_h1_chunk_size((size_t)body.views[i].len); /* each < 2^60, at most 2^60 in all */
    if (size >= VX_H1_MAX_LEN) {
        PyErr_SetString(PyExc_ValueError, "body too large");
        goto done;
    }
    out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)size);
    if (out == NULL)
        goto done;
    char *p = PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < body.count; i++)
        p = vx_h1_write_chunk(p, body.views[i].buf, (size_t)body.views[i].len);
    if (last)
        memcpy(p, VX_H1_LAST_CHUNK, VX_H1_LAST_CHUNK_LEN);
done:
    h1_release_body(&body);
    return out;
}

PyDoc_STRVAR(h1_server_timing_doc,
             "h1_server_timing(t_received, t_popped, t_parsed, t_admitted, t_sent, t_headers, /)\n"
             "-> bytes\n\n"
             "The server-timing value of a relayed answer from its perf_counter_ns stamps: ring\n"
             "(popped - received), parse (parsed - popped), ratelimit (admitted - parsed) and\n"
             "upstream (headers - sent), each max(0, difference) // 1000 microseconds, shown as\n"
             "milliseconds with three decimals.");

static PyObject *native_h1_server_timing(PyObject *Py_UNUSED(module), PyObject *const *args,
                                         Py_ssize_t nargs)
{
    int64_t t[6];
    uint64_t us[4];
    int overflow;
    if (check_nargs("h1_server_timing", nargs, 6, 6) < 0)
        return NULL;
    for (int i = 0; i < 6; i++)
        if (to_i64(args[i], &t[i], &overflow) < 0)
            return NULL; /* out-of-range stamps clamp to INT64_MIN/MAX (overflow set) */
    static const int pairs[4][2] = {{1, 0}, {2, 1}, {3, 2}, {5, 4}};
    for (int i = 0; i < 4; i++) {
        int64_t a = t[pairs[i][0]], b = t[pairs[i][1]];
        /* a - b in unsigned arithmetic: no signed overflow whatever the stamps are. */
        us[i] = a > b ? ((uint64_t)a - (uint64_t)b) / 1000 : 0;
    }
    char buf[VX_H1_TIMING_MAX];
    size_t n = vx_h1_server_timing(buf, us[0], us[1], us[2], us[3]);
    return PyBytes_FromStringAndSize(buf, (Py_ssize_t)n);
}

/* ---------------------------------------------------------------- HTTP/1.1 request heads */

/* Fields on the C stack; a head with more falls back to httptools, where ingress answers 431:
 * this is ingress's cap on header fields (REQHEAD_FIELDS). The SDK sends 16; a 54 KB head of
 * 5,500 tiny fields cost about 65 times a normal request before the cap. */
#define RH_FIELDS 100
/* An incomplete head this long falls back (see vx_reqhead.h: bounds rescanning). */
#define RH_PARTIAL 4096
/* Field names that clients (the openai SDKs, curl, proxies) send on nearly every request: one
 * shared bytes object each instead of a new one per request and field (all 15 of the SDK's
 * names), so a queued request holds less. The time is within this host's noise either way
 * (about 3.2 us per SDK head for the whole call, of which the C parse is 0.75). */
static const char *const RH_NAMES[] = {
    "host", "accept-encoding", "connection", "accept", "content-type", "user-agent",
    "x-stainless-lang", "x-stainless-package-version", "x-stainless-os", "x-stainless-arch",
    "x-stainless-runtime", "x-stainless-runtime-version", "authorization",
    "x-stainless-retry-count", "x-stainless-read-timeout", "content-length", "expect",
    "x-forwarded-for", "openai-organization",
};
#define RH_NNAMES (sizeof RH_NAMES / sizeof RH_NAMES[0])

/* The name of a field as a lower-case bytes object: a shared one if it is a common name. */
static PyObject *rh_name(module_state *st, const char *name, size_t len)
{
    for (size_t i = 0; i < RH_NNAMES; i++) {
        PyObject *known = st->names[i];
        if ((size_t)PyBytes_GET_SIZE(known) != len)
            continue;
        const char *k = PyBytes_AS_STRING(known);
        size_t j = 0;
        while (j < len && (name[j] | (name[j] >= 'A' && name[j] <= 'Z' ? 0x20 : 0)) == k[j])
            j++;
        if (j == len) {
            Py_INCREF(known);
            return known;
        }
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)len);
    if (out != NULL)
        vx_reqhead_lower(PyBytes_AS_STRING(out), name, len);
    return out;
}

PyDoc_STRVAR(reqhead_doc,
             "reqhead(buf, start, max_header_bytes, /) -> tuple | None | False\n\n"
             "Parse the request head starting at buf[start] (bytes-like) with native/vx_reqhead.c.\n"
             "None: a valid beginning, call again with more bytes. False: not in the subset the\n"
             "parser accepts (or too large): hand the bytes to httptools. Otherwise\n"
             "(method, target, headers, content_length, authorization, expect_continue,\n"
             " keep_alive, http10, end): method one shared bytes object per method, headers a\n"
             "list of (lower-cased name, value) bytes tuples in order, content_length -1 when\n"
             "absent, authorization the one Authorization value (the same object as in headers)\n"
             "or None (a head with two is False), end the offset just past the blank line.\n"
             "With a fourth argument `drop` (a set of lower-case names), a tenth item: the\n"
             "headers' tuples whose name is not in `drop` (the upstream's share, route.Auth's\n"
             "client_headers done in the same pass), or None when a Connection header lists\n"
             "more than keep-alive / close (the caller then filters in Python).");

/* A Connection value naming no other field: "keep-alive" or "close", any case. */
static int rh_plain_connection(const char *v, size_t n)
{
    static const char *const plain[] = {"keep-alive", "close"};
    for (int p = 0; p < 2; p++) {
        size_t len = strlen(plain[p]), j = 0;
        if (len != n)
            continue;
        while (j < n && (v[j] | (v[j] >= 'A' && v[j] <= 'Z' ? 0x20 : 0)) == plain[p][j])
            j++;
        if (j == n)
            return 1;
    }
    return 0;
}

static PyObject *native_reqhead(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t start, limit;
    int overflow;
    if (check_nargs("reqhead", nargs, 3, 4) < 0 || to_i64(args[1], &start, &overflow) < 0 ||
        to_i64(args[2], &limit, &overflow) < 0)
        return NULL;
    PyObject *drop = nargs > 3 ? args[3] : NULL;
    if (drop != NULL && !PyAnySet_Check(drop)) {
        PyErr_SetString(PyExc_TypeError, "reqhead: drop must be a set");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    if (start < 0 || start > (int64_t)view.len) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "reqhead: start outside the buffer");
        return NULL;
    }
    vx_rh_field fields[RH_FIELDS];
    vx_reqhead h;
    const char *base = (const char *)view.buf + start;
    int rc = vx_reqhead_parse(base, (size_t)(view.len - start), fields, RH_FIELDS,
                              limit < 0 ? 0 : (size_t)limit, RH_PARTIAL, &h);
    if (rc != VX_RH_DONE) {
        PyBuffer_Release(&view);
        if (rc == VX_RH_MORE)
            Py_RETURN_NONE;
        Py_RETURN_FALSE;
    }
    module_state *st = PyModule_GetState(module);
    PyObject *headers = PyList_New((Py_ssize_t)h.nfields);
    PyObject *target = NULL, *authorization = Py_None, *result = NULL, *upstream = NULL;
    int listed = 0; /* a Connection header names other fields: no upstream list */
    if (headers == NULL)
        goto done;
    if (drop != NULL && (upstream = PyList_New(0)) == NULL)
        goto done;
    for (size_t i = 0; i < h.nfields; i++) {
        const vx_rh_field *f = &fields[i];
        PyObject *name = rh_name(st, base + f->name_off, f->name_len);
        if (name == NULL)
            goto done;
        PyObject *value = PyBytes_FromStringAndSize(base + f->value_off, (Py_ssize_t)f->value_len);
        if (value == NULL) {
            Py_DECREF(name);
            goto done;
        }
        PyObject *pair = PyTuple_New(2);
        if (pair == NULL) {
            Py_DECREF(name);
            Py_DECREF(value);
            goto done;
        }
        PyTuple_SET_ITEM(pair, 0, name);
        PyTuple_SET_ITEM(pair, 1, value); /* both stolen */
        PyList_SET_ITEM(headers, (Py_ssize_t)i, pair);
        if ((int)i == h.authorization)
            authorization = value; /* borrowed: the list holds it */
        if (upstream != NULL) {
            int dropped = PySet_Contains(drop, name);
            if (dropped < 0)
                goto done;
            if (!dropped) {
                if (PyList_Append(upstream, pair) < 0)
                    goto done;
            } else if (f->name_len == 10 && memcmp(PyBytes_AS_STRING(name), "connection", 10) == 0 &&
                       !rh_plain_connection(base + f->value_off, f->value_len)) {
                listed = 1;
            }
        }
    }
    target = PyBytes_FromStringAndSize(base + h.target_off, (Py_ssize_t)h.target_len);
    if (target == NULL)
        goto done;
    if (upstream == NULL)
        result = Py_BuildValue("(OOOLOOOOn)", st->methods[h.method], target, headers,
                               (long long)h.content_length, authorization,
                               h.expect_continue ? Py_True : Py_False,
                               h.keep_alive ? Py_True : Py_False, h.http10 ? Py_True : Py_False,
                               (Py_ssize_t)(start + (int64_t)h.head_len));
    else
        result = Py_BuildValue("(OOOLOOOOnO)", st->methods[h.method], target, headers,
                               (long long)h.content_length, authorization,
                               h.expect_continue ? Py_True : Py_False,
                               h.keep_alive ? Py_True : Py_False, h.http10 ? Py_True : Py_False,
                               (Py_ssize_t)(start + (int64_t)h.head_len),
                               listed ? Py_None : upstream);
done:
    Py_XDECREF(upstream);
    Py_XDECREF(target);
    Py_XDECREF(headers); /* a partly filled list holds NULLs: list dealloc skips them */
    PyBuffer_Release(&view);
    return result;
}

/* ---------------------------------------------------------------- relay head */

PyDoc_STRVAR(relay_head_doc,
             "relay_head(headers, drop, t_received, t_popped, t_parsed, t_admitted, t_sent,\n"
             "           t_headers, extra, /) -> (list, bool)\n\n"
             "A client's response headers (velox.relay): the (name, value) tuples of the list\n"
             "`headers` whose name is not in the set `drop` nor named by a `connection` field\n"
             "(other than a plain keep-alive or close), then server-timing (formatted as\n"
             "h1_server_timing does), then the tuples of the tuple `extra`; and whether the\n"
             "first content-type of `headers` starts with text/event-stream. The Python twin\n"
             "is velox.relay.answer_head.");

/* A field named `connection` (names arrive lowercased, as velox.relay compares them). */
static int rh_is_connection(PyObject *name)
{
    return PyBytes_GET_SIZE(name) == 10 && memcmp(PyBytes_AS_STRING(name), "connection", 10) == 0;
}

/* A `connection` field that names other fields (not a plain keep-alive or close). */
static int rh_lists_fields(PyObject *value)
{
    return !rh_plain_connection(PyBytes_AS_STRING(value), (size_t)PyBytes_GET_SIZE(value));
}

/* ASCII whitespace as bytes.strip() sees it. */
static int rh_space(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

/* Add the names a Connection value lists to the set `names`, as velox.route.connection_tokens
 * does: split at commas, ASCII whitespace stripped, ASCII-lowercased, empty ones skipped. */
static int rh_connection_tokens(PyObject *names, const char *v, Py_ssize_t n)
{
    for (Py_ssize_t at = 0; at <= n;) {
        Py_ssize_t end = at;
        while (end < n && v[end] != ',')
            end++;
        Py_ssize_t a = at, b = end;
        while (a < b && rh_space(v[a]))
            a++;
        while (b > a && rh_space(v[b - 1]))
            b--;
        if (b > a) {
            PyObject *token = PyBytes_FromStringAndSize(NULL, b - a);
            if (token == NULL)
                return -1;
            char *d = PyBytes_AS_STRING(token);
            for (Py_ssize_t k = 0; k < b - a; k++)
                d[k] = (char)(v[a + k] >= 'A' && v[a + k] <= 'Z' ? v[a + k] | 0x20 : v[a + k]);
            int added = PySet_Add(names, token);
            Py_DECREF(token);
            if (added < 0)
                return -1;
        }
        at = end + 1;
    }
    return 0;
}

/* The rare path of relay_head: the upstream sent a Connection field naming other fields. Drop
 * those of the `*kept` fields in `out` (compacted in place; the freed slots are NULL). */
static int rh_drop_listed(PyObject *headers, PyObject *out, Py_ssize_t *kept)
{
    PyObject *names = PySet_New(NULL);
    if (names == NULL)
        return -1;
    Py_ssize_t n = PyList_GET_SIZE(headers);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *field = PyList_GET_ITEM(headers, i);
        PyObject *name = PyTuple_GET_ITEM(field, 0), *value = PyTuple_GET_ITEM(field, 1);
        if (rh_is_connection(name) && rh_lists_fields(value) &&
            rh_connection_tokens(names, PyBytes_AS_STRING(value), PyBytes_GET_SIZE(value)) < 0) {
            Py_DECREF(names);
            return -1;
        }
    }
    Py_ssize_t w = 0;
    for (Py_ssize_t r = 0; r < *kept; r++) {
        PyObject *field = PyList_GET_ITEM(out, r);
        int listed = PySet_Contains(names, PyTuple_GET_ITEM(field, 0));
        if (listed < 0) { /* (bytes always hash) keep the rest as they are */
            for (; r < *kept; r++, w++) {
                PyObject *rest = PyList_GET_ITEM(out, r);
                PyList_SET_ITEM(out, r, NULL);
                PyList_SET_ITEM(out, w, rest);
            }
            *kept = w;
            Py_DECREF(names);
            return -1;
        }
        PyList_SET_ITEM(out, r, NULL);
        if (listed)
            Py_DECREF(field);
        else
            PyList_SET_ITEM(out, w++, field);
    }
    *kept = w;
    Py_DECREF(names);
    return 0;
}

static PyObject *native_relay_head(PyObject *Py_UNUSED(module), PyObject *const *args,
                                   Py_ssize_t nargs)
{
    static const char sse[] = "text/event-stream";
    if (check_nargs("relay_head", nargs, 9, 9) < 0)
        return NULL;
    PyObject *headers = args[0], *drop = args[1], *extra = args[8];
    if (!PyList_Check(headers) || !PyAnySet_Check(drop) || !PyTuple_Check(extra)) {
        PyErr_SetString(PyExc_TypeError, "relay_head takes a list, a set, six ints and a tuple");
        return NULL;
    }
    int64_t t[6];
    uint64_t us[4];
    int overflow;
    for (int i = 0; i < 6; i++)
        if (to_i64(args[2 + i], &t[i], &overflow) < 0)
            return NULL;
    static const int pairs[4][2] = {{1, 0}, {2, 1}, {3, 2}, {5, 4}};
    for (int i = 0; i < 4; i++) {
        int64_t a = t[pairs[i][0]], b = t[pairs[i][1]];
        us[i] = a > b ? ((uint64_t)a - (uint64_t)b) / 1000 : 0;
    }
    char buf[VX_H1_TIMING_MAX];
    size_t tn = vx_h1_server_timing(buf, us[0], us[1], us[2], us[3]);
    Py_ssize_t n = PyList_GET_SIZE(headers), n_extra = PyTuple_GET_SIZE(extra);
    PyObject *out = PyList_New(n + 1 + n_extra);
    if (out == NULL)
        return NULL;
    Py_ssize_t kept = 0;
    int is_sse = 0, typed = 0, listing = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *field = PyList_GET_ITEM(headers, i);
        if (!PyTuple_Check(field) || PyTuple_GET_SIZE(field) != 2 ||
            !PyBytes_Check(PyTuple_GET_ITEM(field, 0)) ||
            !PyBytes_Check(PyTuple_GET_ITEM(field, 1))) {
            PyErr_SetString(PyExc_TypeError, "each header must be a (bytes, bytes) tuple");
            goto fail;
        }
        PyObject *name = PyTuple_GET_ITEM(field, 0);
        if (!typed && PyBytes_GET_SIZE(name) == 12 &&
            memcmp(PyBytes_AS_STRING(name), "content-type", 12) == 0) {
            PyObject *value = PyTuple_GET_ITEM(field, 1);
            typed = 1;
            is_sse = PyBytes_GET_SIZE(value) >= (Py_ssize_t)(sizeof sse - 1) &&
                     memcmp(PyBytes_AS_STRING(value), sse, sizeof sse - 1) == 0;
        }
        if (rh_is_connection(name))
            listing |= rh_lists_fields(PyTuple_GET_ITEM(field, 1));
        int dropped = PySet_Contains(drop, name);
        if (dropped < 0)
            goto fail;
        if (!dropped) {
            Py_INCREF(field);
            PyList_SET_ITEM(out, kept++, field);
        }
    }
    if (listing && rh_drop_listed(headers, out, &kept) < 0)
        goto fail;
    PyObject *timing = Py_BuildValue("(y#y#)", "server-timing", (Py_ssize_t)13, buf, (Py_ssize_t)tn);
    if (timing == NULL)
        goto fail;
    PyList_SET_ITEM(out, kept++, timing);
    for (Py_ssize_t i = 0; i < n_extra; i++) {
        PyObject *field = PyTuple_GET_ITEM(extra, i);
        Py_INCREF(field);
        PyList_SET_ITEM(out, kept++, field);
    }
    Py_SET_SIZE(out, kept); /* the dropped fields' slots (NULL) are past the end */
    PyObject *result = PyTuple_New(2);
    if (result == NULL)
        goto fail;
    PyTuple_SET_ITEM(result, 0, out);
    PyTuple_SET_ITEM(result, 1, PyBool_FromLong(is_sse));
    return result;
fail:
    Py_SET_SIZE(out, kept);
    Py_DECREF(out);
    return NULL;
}

/* ---------------------------------------------------------------- books: access log, usage */

#include "vx_books.h"

/* Attributes the access line reads, interned once (first call; the GIL is held). */
enum {
    B_PATH, B_METHOD, B_MODEL, B_BODY, B_T_RECEIVED, B_KEY, B_METER, B_DONE, B_INPUT,
    B_OUTPUT, B_EXACT, B_UPSTREAM_NAME, B_ATTEMPTS, B_T_HEADERS, B_T_SENT, B_HEADERS, B_COUNT
};
static const char *const books_attr_names[B_COUNT] = {
    "path", "method", "model", "body", "t_received", "key", "meter", "done", "input",
    "output", "exact", "upstream_name", "attempts", "t_headers", "t_sent", "headers",
};
static PyObject *books_attrs[B_COUNT];

static int books_ready(void)
{
    if (books_attrs[B_COUNT - 1] != NULL)
        return 0;
    for (int i = 0; i < B_COUNT; i++)
        if (books_attrs[i] == NULL &&
            (books_attrs[i] = PyUnicode_InternFromString(books_attr_names[i])) == NULL)
            return -1;
    return 0;
}

/* obj.<attr> as an int64 (-1 with an exception set on failure). */
static int books_i64(PyObject *obj, int attr, int64_t *out)
{
    PyObject *v = PyObject_GetAttr(obj, books_attrs[attr]);
    if (v == NULL)
        return -1;
    int overflow;
    int rc = to_i64(v, out, &overflow);
    Py_DECREF(v);
    return rc;
}

static int64_t floor_div(int64_t a, int64_t b)
{
    int64_t q = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

/* Append raw text. */
#define BOOKS_PUT(p, lit) (memcpy((p), (lit), sizeof(lit) - 1), (p) + sizeof(lit) - 1)

/* Per-second cache of the timestamp's first 20 bytes ("YYYY-MM-DDTHH:MM:SS."): every line
 * of a second shares them (under the GIL: one writer at a time). */
static int64_t books_second = -1;
static char books_stamp[VX_BOOKS_TIME_LEN];

#define BOOKS_MAX_FIELD 512 /* accesslog._MAX_FIELD */

PyDoc_STRVAR(access_line_doc,
             "access_line(item, wall_offset_ns, worker, prefix, seq, key_names, /) -> bytes\n"
             "--\n\n"
             "One access-log line (velox.admin.accesslog) of item = (t_end_ns, request,\n"
             "exchange_or_None, status, bytes_out): the JSON orjson makes of the line's dict,\n"
             "newline included. The request id is the exchange's x-request-id header, else\n"
             "prefix + hex(seq).");

/* One line of `item`; the caller checked prefix (bytes) and key_names (a tuple). */
static PyObject *books_line(PyObject *item, int64_t wall_offset, int64_t worker,
                            PyObject *prefix, int64_t seq, PyObject *key_names)
{
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 5) {
        PyErr_SetString(PyExc_TypeError, "access_line: an item must be a 5-tuple");
        return NULL;
    }
    int overflow;
    int64_t t_end, status, bytes_out;
    if (to_i64(PyTuple_GET_ITEM(item, 0), &t_end, &overflow) < 0 ||
        to_i64(PyTuple_GET_ITEM(item, 3), &status, &overflow) < 0 ||
        to_i64(PyTuple_GET_ITEM(item, 4), &bytes_out, &overflow) < 0)
        return NULL;
    PyObject *request = PyTuple_GET_ITEM(item, 1), *exchange = PyTuple_GET_ITEM(item, 2);

    /* Everything borrowed or owned below is released at `done`. */
    PyObject *path = NULL, *method = NULL, *model = NULL, *body = NULL, *meter = NULL,
             *upstream = NULL, *headers = NULL, *fast = NULL, *result = NULL;
    const char *model_s = NULL, *key_s = NULL, *id_s = NULL;
    Py_ssize_t model_n = 0, key_n = 0, id_n = 0, body_n;
    int64_t t_received, key, attempts = 0, t_headers = 0, t_sent = 0;
    int64_t usage_in = 0, usage_out = 0;
    int usage = 0, exact = 0; /* usage: the meter is done */

    path = PyObject_GetAttr(request, books_attrs[B_PATH]);
    method = path ? PyObject_GetAttr(request, books_attrs[B_METHOD]) : NULL;
    model = method ? PyObject_GetAttr(request, books_attrs[B_MODEL]) : NULL;
    body = model ? PyObject_GetAttr(request, books_attrs[B_BODY]) : NULL;
    if (body == NULL || (body_n = PyObject_Size(body)) < 0 ||
        books_i64(request, B_T_RECEIVED, &t_received) < 0 || books_i64(request, B_KEY, &key) < 0)
        goto done;
    if (!PyBytes_Check(path) || !PyBytes_Check(method)) {
        PyErr_SetString(PyExc_TypeError, "access_line: request.path and .method must be bytes");
        goto done;
    }
    if (model != Py_None && PyUnicode_Check(model) && PyUnicode_GET_LENGTH(model) > 0) {
        model_s = PyUnicode_AsUTF8AndSize(model, &model_n);
        if (model_s == NULL) { /* lone surrogates: logged as null rather than losing lines */
            PyErr_Clear();
            model_n = 0;
        } else {
            model_n = (Py_ssize_t)vx_books_utf8_prefix((const unsigned char *)model_s,
                                                       (size_t)model_n, BOOKS_MAX_FIELD);
        }
    }
    if (key >= 0 && key < PyTuple_GET_SIZE(key_names)) {
        PyObject *name = PyTuple_GET_ITEM(key_names, key);
        if (PyUnicode_Check(name) && (key_s = PyUnicode_AsUTF8AndSize(name, &key_n)) == NULL)
            goto done;
    }
    if (exchange != Py_None) {
        meter = PyObject_GetAttr(exchange, books_attrs[B_METER]);
        if (meter == NULL)
            goto done;
        if (meter != Py_None) {
            PyObject *done_flag = PyObject_GetAttr(meter, books_attrs[B_DONE]);
            if (done_flag == NULL)
                goto done;
            usage = PyObject_IsTrue(done_flag);
            Py_DECREF(done_flag);
            if (usage < 0)
                goto done;
            if (usage) {
                PyObject *exact_flag = PyObject_GetAttr(meter, books_attrs[B_EXACT]);
                if (exact_flag == NULL)
                    goto done;
                exact = PyObject_IsTrue(exact_flag);
                Py_DECREF(exact_flag);
                if (exact < 0 || books_i64(meter, B_INPUT, &usage_in) < 0 ||
                    books_i64(meter, B_OUTPUT, &usage_out) < 0)
                    goto done;
            }
        }
        upstream = PyObject_GetAttr(exchange, books_attrs[B_UPSTREAM_NAME]);
        if (upstream == NULL || books_i64(exchange, B_ATTEMPTS, &attempts) < 0 ||
            books_i64(exchange, B_T_HEADERS, &t_headers) < 0 ||
            books_i64(exchange, B_T_SENT, &t_sent) < 0)
            goto done;
        if (!PyBytes_Check(upstream)) {
            PyErr_SetString(PyExc_TypeError, "access_line: exchange.upstream_name must be bytes");
            goto done;
        }
        headers = PyObject_GetAttr(exchange, books_attrs[B_HEADERS]);
        if (headers == NULL ||
            (fast = PySequence_Fast(headers, "access_line: exchange.headers")) == NULL)
            goto done;
        Py_ssize_t count = PySequence_Fast_GET_SIZE(fast);
        PyObject **pairs = PySequence_Fast_ITEMS(fast);
        for (Py_ssize_t i = 0; i < count; i++) {
            PyObject *pair = pairs[i];
            if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2)
                continue;
            PyObject *name = PyTuple_GET_ITEM(pair, 0), *value = PyTuple_GET_ITEM(pair, 1);
            if (PyBytes_Check(name) && PyBytes_GET_SIZE(name) == 12 &&
                memcmp(PyBytes_AS_STRING(name), "x-request-id", 12) == 0 &&
                PyBytes_Check(value)) {
                id_s = PyBytes_AS_STRING(value);
                id_n = PyBytes_GET_SIZE(value);
                if (id_n > BOOKS_MAX_FIELD)
                    id_n = BOOKS_MAX_FIELD;
                break;
            }
        }
    }

    Py_ssize_t path_n = PyBytes_GET_SIZE(path), method_n = PyBytes_GET_SIZE(method);
    const char *path_s = PyBytes_AS_STRING(path);
    const char *q = memchr(path_s, '?', (size_t)path_n);
    if (q != NULL)
        path_n = q - path_s;
    if (path_n > BOOKS_MAX_FIELD)
        path_n = BOOKS_MAX_FIELD;
    if (method_n > 16)
        method_n = 16;
    Py_ssize_t upstream_n = upstream != NULL ? PyBytes_GET_SIZE(upstream) : 0;
    size_t bound = 512 + 12 * VX_BOOKS_I64_MAX + VX_BOOKS_STR_MAX(path_n) +
                   VX_BOOKS_STR_MAX(method_n) + VX_BOOKS_STR_MAX(model_n) +
                   VX_BOOKS_STR_MAX(upstream_n) + VX_BOOKS_STR_MAX(key_n) +
                   VX_BOOKS_STR_MAX(id_n) + (size_t)PyBytes_GET_SIZE(prefix);
    result = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)bound);
    if (result == NULL)
        goto done;
    char *start = PyBytes_AS_STRING(result), *p = start;

    int64_t ms = floor_div(t_end + wall_offset, 1000000);
    int64_t second = floor_div(ms, 1000);
    p = BOOKS_PUT(p, "{\"time\":\"");
    if (second != books_second) {
        if (vx_books_time(books_stamp, ms) < 0) {
            PyErr_SetString(PyExc_ValueError, "access_line: time out of range");
            Py_CLEAR(result);
            goto done;
        }
        books_second = second;
    }
    memcpy(p, books_stamp, 20); /* "YYYY-MM-DDTHH:MM:SS." */
    p += 20;
    int milli = (int)(ms - second * 1000);
    *p++ = (char)('0' + milli / 100);
    *p++ = (char)('0' + milli / 10 % 10);
    *p++ = (char)('0' + milli % 10);
    p = BOOKS_PUT(p, "Z\",\"log\":\"access\",\"worker\":");
    p = vx_books_i64(p, worker);
    p = BOOKS_PUT(p, ",\"method\":");
    p = vx_books_latin1(p, (const unsigned char *)PyBytes_AS_STRING(method), (size_t)method_n);
    p = BOOKS_PUT(p, ",\"path\":");
    p = vx_books_latin1(p, (const unsigned char *)path_s, (size_t)path_n);
    p = BOOKS_PUT(p, ",\"model\":");
    if (model_n > 0)
        p = vx_books_utf8(p, (const unsigned char *)model_s, (size_t)model_n);
    else
        p = BOOKS_PUT(p, "null");
    p = BOOKS_PUT(p, ",\"status\":");
    p = vx_books_i64(p, status);
    p = BOOKS_PUT(p, ",\"bytes_in\":");
    p = vx_books_i64(p, (int64_t)body_n);
    p = BOOKS_PUT(p, ",\"bytes_out\":");
    p = vx_books_i64(p, bytes_out);
    p = BOOKS_PUT(p, ",\"upstream\":");
    if (upstream_n > 0)
        p = vx_books_utf8(p, (const unsigned char *)PyBytes_AS_STRING(upstream),
                          (size_t)upstream_n);
    else
        p = BOOKS_PUT(p, "null");
    p = BOOKS_PUT(p, ",\"attempts\":");
    p = vx_books_i64(p, attempts);
    p = BOOKS_PUT(p, ",\"upstream_us\":");
    if (t_headers && t_sent)
        p = vx_books_i64(p, floor_div(t_headers - t_sent, 1000));
    else
        p = BOOKS_PUT(p, "null");
    p = BOOKS_PUT(p, ",\"total_us\":");
    p = vx_books_i64(p, t_end > t_received ? (t_end - t_received) / 1000 : 0);
    p = BOOKS_PUT(p, ",\"request_id\":");
    if (id_s != NULL) {
        p = vx_books_latin1(p, (const unsigned char *)id_s, (size_t)id_n);
    } else { /* prefix (ASCII of the log's own making) and the sequence number in hex */
        *p++ = '"';
        memcpy(p, PyBytes_AS_STRING(prefix), (size_t)PyBytes_GET_SIZE(prefix));
        p += PyBytes_GET_SIZE(prefix);
        char hex[16];
        int n = 0;
        uint64_t v = (uint64_t)seq;
        do {
            hex[n++] = "0123456789abcdef"[v & 15];
            v >>= 4;
        } while (v);
        while (n)
            *p++ = hex[--n];
        *p++ = '"';
    }
    p = BOOKS_PUT(p, ",\"key\":");
    if (key_s != NULL)
        p = vx_books_utf8(p, (const unsigned char *)key_s, (size_t)key_n);
    else
        p = BOOKS_PUT(p, "null");
    p = BOOKS_PUT(p, ",\"usage\":");
    if (usage) {
        p = BOOKS_PUT(p, "{\"input\":");
        p = vx_books_i64(p, usage_in);
        p = BOOKS_PUT(p, ",\"output\":");
        p = vx_books_i64(p, usage_out);
        if (exact)
            p = BOOKS_PUT(p, ",\"exact\":true}");
        else
            p = BOOKS_PUT(p, ",\"exact\":false}");
    } else {
        p = BOOKS_PUT(p, "null");
    }
    p = BOOKS_PUT(p, "}\n");
    if (_PyBytes_Resize(&result, p - start) < 0)
        result = NULL;
done:
    Py_XDECREF(path);
    Py_XDECREF(method);
    Py_XDECREF(model);
    Py_XDECREF(body);
    Py_XDECREF(meter);
    Py_XDECREF(upstream);
    Py_XDECREF(headers);
    Py_XDECREF(fast);
    return result;
}

static int books_args(PyObject *const *args, int64_t *wall_offset, int64_t *worker,
                      int64_t *seq)
{
    int overflow;
    if (!PyBytes_Check(args[3]) || !PyTuple_Check(args[5])) {
        PyErr_SetString(PyExc_TypeError, "access_line: prefix must be bytes, key_names a tuple");
        return -1;
    }
    if (to_i64(args[1], wall_offset, &overflow) < 0 || to_i64(args[2], worker, &overflow) < 0 ||
        to_i64(args[4], seq, &overflow) < 0)
        return -1;
    return 0;
}

static PyObject *native_access_line(PyObject *Py_UNUSED(module), PyObject *const *args,
                                    Py_ssize_t nargs)
{
    int64_t wall_offset, worker, seq;
    if (check_nargs("access_line", nargs, 6, 6) < 0 || books_ready() < 0 ||
        books_args(args, &wall_offset, &worker, &seq) < 0)
        return NULL;
    return books_line(args[0], wall_offset, worker, args[3], seq, args[5]);
}

PyDoc_STRVAR(access_lines_doc,
             "access_lines(items, wall_offset_ns, worker, prefix, seq, key_names, limit, /)\n"
             "-> (list[bytes], int)\n--\n\n"
             "access_line for every item of the list `items` (item i gets seq + 1 + i), the\n"
             "lines joined into chunks of at most `limit` bytes of whole lines (a longer line\n"
             "is a chunk of its own): one write per chunk keeps lines whole on a shared pipe.\n"
             "An item that cannot be formatted is skipped. Returns the chunks and the number\n"
             "of lines in them.");

/* Append the chunk held in buf[0..*size) to chunks and empty it. */
static int books_emit(PyObject *chunks, const char *buf, Py_ssize_t *size)
{
    PyObject *chunk = PyBytes_FromStringAndSize(buf, *size);
    if (chunk == NULL)
        return -1;
    int rc = PyList_Append(chunks, chunk);
    Py_DECREF(chunk);
    *size = 0;
    return rc;
}

static PyObject *native_access_lines(PyObject *Py_UNUSED(module), PyObject *const *args,
                                     Py_ssize_t nargs)
{
    int64_t wall_offset, worker, seq, limit;
    int overflow;
    if (check_nargs("access_lines", nargs, 7, 7) < 0 || books_ready() < 0 ||
        books_args(args, &wall_offset, &worker, &seq) < 0 ||
        to_i64(args[6], &limit, &overflow) < 0)
        return NULL;
    if (!PyList_Check(args[0]) || limit < 1 || limit > (1 << 24)) {
        PyErr_SetString(PyExc_ValueError,
                        "access_lines: items must be a list and limit in [1, 16 MiB]");
        return NULL;
    }
    PyObject *items = args[0], *chunks = PyList_New(0);
    char *buf = PyMem_Malloc((size_t)limit);
    Py_ssize_t count = 0, size = 0;
    if (chunks == NULL || buf == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
        PyObject *line = books_line(PyList_GET_ITEM(items, i), wall_offset, worker, args[3],
                                    seq + 1 + i, args[5]);
        if (line == NULL) { /* one bad item must not cost the others their lines */
            PyErr_Clear();
            continue;
        }
        Py_ssize_t n = PyBytes_GET_SIZE(line);
        if (size > 0 && size + n > limit && books_emit(chunks, buf, &size) < 0) {
            Py_DECREF(line);
            goto fail;
        }
        if (n > limit) { /* a line longer than a chunk goes alone */
            int rc = PyList_Append(chunks, line);
            Py_DECREF(line);
            if (rc < 0)
                goto fail;
        } else {
            memcpy(buf + size, PyBytes_AS_STRING(line), (size_t)n);
            size += n;
            Py_DECREF(line);
        }
        count++;
    }
    if (size > 0 && books_emit(chunks, buf, &size) < 0)
        goto fail;
    PyMem_Free(buf);
    return Py_BuildValue("(Nn)", chunks, count);
fail:
    PyMem_Free(buf);
    Py_XDECREF(chunks);
    return NULL;
}

PyDoc_STRVAR(usage_scan_doc,
             "usage_scan(body, /) -> (int, int) | bool\n--\n\n"
             "The usage of an answer in OpenAI's own order: (prompt_tokens, completion_tokens)\n"
             "read at its last \"usage\" key; False when it has no \"usage\" key; True when its\n"
             "last one is in another form (read it another way).");

static PyObject *native_usage_scan(PyObject *Py_UNUSED(module), PyObject *arg)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    int64_t in = 0, out = 0;
    int rc = vx_books_usage(view.buf, (size_t)view.len, &in, &out);
    PyBuffer_Release(&view);
    if (rc == 0)
        Py_RETURN_FALSE;
    if (rc < 0)
        Py_RETURN_TRUE;
    return Py_BuildValue("(LL)", (long long)in, (long long)out);
}

PyDoc_STRVAR(estimate_scan_doc,
             "estimate_scan(body, /) -> (int, int)\n--\n\n"
             "A JSON request body's estimated input tokens (bytes / 4 rounded up, each\n"
             "inline base64 image where the schema puts one counted as 765) and its top-level\n"
             "max_tokens / max_completion_tokens / max_output_tokens (-1 when none), in one\n"
             "pass (velox.usage.estimate; native/vx_books.h).");

static PyObject *native_estimate_scan(PyObject *Py_UNUSED(module), PyObject *arg)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    int64_t input, output;
    vx_books_estimate(view.buf, (size_t)view.len, &input, &output);
    PyBuffer_Release(&view);
    return Py_BuildValue("(LL)", (long long)input, (long long)output);
}

static PyMethodDef module_methods[] = {
    {"scan_json", (PyCFunction)native_scan_json, METH_O, scan_json_doc},
    {"hash64", FASTCALL(native_hash64), METH_FASTCALL, hash64_doc},
    {"h1_response", FASTCALL(native_h1_response), METH_FASTCALL, h1_response_doc},
    {"h1_head", FASTCALL(native_h1_head), METH_FASTCALL, h1_head_doc},
    {"h1_chunks", FASTCALL(native_h1_chunks), METH_FASTCALL, h1_chunks_doc},
    {"h1_server_timing", FASTCALL(native_h1_server_timing), METH_FASTCALL,
     h1_server_timing_doc},
    {"reqhead", FASTCALL(native_reqhead), METH_FASTCALL, reqhead_doc},
    {"relay_head", FASTCALL(native_relay_head), METH_FASTCALL, relay_head_doc},
    {"access_line", FASTCALL(native_access_line), METH_FASTCALL, access_line_doc},
    {"access_lines", FASTCALL(native_access_lines), METH_FASTCALL, access_lines_doc},
    {"usage_scan", (PyCFunction)native_usage_scan, METH_O, usage_scan_doc},
    {"estimate_scan", (PyCFunction)native_estimate_scan, METH_O, estimate_scan_doc},
    {NULL, NULL, 0, NULL},
};

/* ---------------------------------------------------------------- module */

static int add_type(PyObject *module, PyType_Spec *spec, PyTypeObject **slot)
{
    /* New reference, kept in the module state; PyModule_AddType adds its own. */
    *slot = (PyTypeObject *)PyType_FromModuleAndSpec(module, spec, NULL);
    if (*slot == NULL)
        return -1;
    return PyModule_AddType(module, *slot);
}

static int module_exec(PyObject *module)
{
    module_state *st = PyModule_GetState(module);
    if (add_type(module, &Ring_spec, &st->ring_type) < 0 ||
        add_type(module, &Bucket_spec, &st->bucket_type) < 0 ||
        add_type(module, &Counters_spec, &st->counters_type) < 0 ||
        add_type(module, &Hist_spec, &st->hist_type) < 0 ||
        add_type(module, &Health_spec, &st->health_type) < 0 ||
        add_type(module, &Budget_spec, &st->budget_type) < 0 ||
        add_type(module, &Hrw_spec, &st->hrw_type) < 0 ||
        add_type(module, &Cache_spec, &st->cache_type) < 0 ||
        add_type(module, &Limits_spec, &st->limits_type) < 0 ||
        add_type(module, &H2_spec, &st->h2_type) < 0)
        return -1;
    for (size_t i = 0; i < sizeof json_constants / sizeof json_constants[0]; i++)
        if (PyModule_AddIntConstant(module, json_constants[i].name, json_constants[i].value) < 0)
            return -1;
    for (int m = 0; m < VX_RH_METHODS; m++) {
        size_t len;
        const char *name = vx_reqhead_method_name(m, &len);
        st->methods[m] = PyBytes_FromStringAndSize(name, (Py_ssize_t)len);
        if (st->methods[m] == NULL)
            return -1;
    }
    _Static_assert(RH_NNAMES == sizeof st->names / sizeof st->names[0], "RH_NAMES");
    for (size_t i = 0; i < RH_NNAMES; i++) {
        st->names[i] = PyBytes_FromString(RH_NAMES[i]);
        if (st->names[i] == NULL)
            return -1;
    }
    if (PyModule_AddIntConstant(module, "REQHEAD_PARTIAL", RH_PARTIAL) < 0 ||
        PyModule_AddIntConstant(module, "REQHEAD_FIELDS", RH_FIELDS) < 0)
        return -1;
    return 0;
}

static int module_traverse(PyObject *module, visitproc visit, void *arg)
{
    module_state *st = PyModule_GetState(module);
    if (st == NULL)
        return 0;
    Py_VISIT(st->ring_type);
    Py_VISIT(st->bucket_type);
    Py_VISIT(st->counters_type);
    Py_VISIT(st->hist_type);
    Py_VISIT(st->health_type);
    Py_VISIT(st->budget_type);
    Py_VISIT(st->hrw_type);
    Py_VISIT(st->cache_type);
    Py_VISIT(st->limits_type);
    Py_VISIT(st->h2_type);
    for (int m = 0; m < VX_RH_METHODS; m++)
        Py_VISIT(st->methods[m]);
    for (size_t i = 0; i < RH_NNAMES; i++)
        Py_VISIT(st->names[i]);
    return 0;
}

static int module_clear(PyObject *module)
{
    module_state *st = PyModule_GetState(module);
    if (st == NULL)
        return 0;
    Py_CLEAR(st->ring_type);
    Py_CLEAR(st->bucket_type);
    Py_CLEAR(st->counters_type);
    Py_CLEAR(st->hist_type);
    Py_CLEAR(st->health_type);
    Py_CLEAR(st->budget_type);
    Py_CLEAR(st->hrw_type);
    Py_CLEAR(st->cache_type);
    Py_CLEAR(st->limits_type);
    Py_CLEAR(st->h2_type);
    for (int m = 0; m < VX_RH_METHODS; m++)
        Py_CLEAR(st->methods[m]);
    for (size_t i = 0; i < RH_NNAMES; i++)
        Py_CLEAR(st->names[i]);
    return 0;
}

static void module_free(void *module)
{
    module_clear((PyObject *)module);
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "velox._native",
    .m_doc = module_doc,
    .m_size = sizeof(module_state),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit__native(void)
{
    return PyModuleDef_Init(&native_module);
}
