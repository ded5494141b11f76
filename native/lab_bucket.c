/* velox_lab._bucket: the lone shared token bucket (vx_bucket), outside the product's extension.
 *
 * The gateway's limits, its global rate included, are vx_limits entries (velox._native.Limits);
 * this bucket is kept for what measures and tests it: benches/bench_native.py (against
 * aiolimiter), benches/bench_balance.py (a reference cost) and tests/native/test_bucket.py.
 * Built beside the product's extension (setup.py) into the lab package.
 */
#include "bind.h"
#include "vx_bucket.h"

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
    .name = "velox_lab._bucket.TokenBucket",
    .basicsize = sizeof(BucketObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Bucket_slots,
};

/* ---------------------------------------------------------------- module */

typedef struct {
    PyTypeObject *bucket_type;
} bucket_state;

static int bucket_exec(PyObject *module)
{
    bucket_state *st = PyModule_GetState(module);
    return vxb_add_type(module, &Bucket_spec, &st->bucket_type);
}

static int bucket_traverse(PyObject *module, visitproc visit, void *arg)
{
    bucket_state *st = PyModule_GetState(module);
    if (st != NULL)
        Py_VISIT(st->bucket_type);
    return 0;
}

static int bucket_clear(PyObject *module)
{
    bucket_state *st = PyModule_GetState(module);
    if (st != NULL)
        Py_CLEAR(st->bucket_type);
    return 0;
}

static void bucket_free(void *module)
{
    bucket_clear((PyObject *)module);
}

static PyModuleDef_Slot bucket_slots[] = {
    {Py_mod_exec, bucket_exec},
    {0, NULL},
};

static struct PyModuleDef bucket_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "velox_lab._bucket",
    .m_doc = "The lone shared token bucket (native/vx_bucket.h), for benchmarks and tests.",
    .m_size = sizeof(bucket_state),
    .m_slots = bucket_slots,
    .m_traverse = bucket_traverse,
    .m_clear = bucket_clear,
    .m_free = bucket_free,
};

PyMODINIT_FUNC PyInit__bucket(void)
{
    return PyModuleDef_Init(&bucket_module);
}
