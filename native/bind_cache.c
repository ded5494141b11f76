#include "bind.h"
#include "vx_cache.h"

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

/* ---------------------------------------------------------------- init */

int vxb_cache_exec(PyObject *module, module_state *st)
{
    if (vxb_add_type(module, &Cache_spec, &st->cache_type) < 0)
        return -1;
    return 0;
}
