#include "bind.h"
#include "vx_stats.h"

#include <errno.h>
#include <fcntl.h>  /* fcntl(F_DUPFD_CLOEXEC) */
#include <unistd.h> /* close */

/* ---------------------------------------------------------------- Counters */

typedef struct {
    PyObject_HEAD
    vx_counters c; /* owned view of the shared mapping (c.base NULL until created) */
    int fd;        /* the memfd this object made (memfd=True), else -1 */
} CountersObject;

static PyObject *Counters_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"slots", "fields", "memfd", NULL};
    PyObject *slots_obj, *fields_obj;
    int64_t slots, fields;
    int memfd = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|$p:Counters", kwlist, &slots_obj,
                                     &fields_obj, &memfd))
        return NULL;
    if (arg_in_range(slots_obj, "slots", 1, VX_STATS_MAX_SLOTS, &slots) < 0 ||
        arg_in_range(fields_obj, "fields", 1, VX_COUNTERS_MAX_FIELDS, &fields) < 0)
        return NULL;
    CountersObject *self = (CountersObject *)type->tp_alloc(type, 0); /* new ref, zeroed */
    if (self == NULL)
        return NULL;
    self->fd = -1;
    int err = vx_counters_init_fd(&self->c, (size_t)slots, (size_t)fields,
                                  memfd ? &self->fd : NULL);
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
    if (self->fd >= 0)
        close(self->fd);
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

PyDoc_STRVAR(Counters_fd_doc,
             "fd($self, /)\n--\n\n"
             "A new descriptor of the memfd these counters live on (memfd=True), for a process\n"
             "that did not inherit the mapping; the caller closes it. ValueError if anonymous.");

static PyObject *Counters_fd(CountersObject *self, PyObject *Py_UNUSED(ignored))
{
    if (self->fd < 0) {
        PyErr_SetString(PyExc_ValueError,
                        "these Counters are anonymous (made without memfd=True)");
        return NULL;
    }
    int fd = fcntl(self->fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    return PyLong_FromLong(fd);
}

PyDoc_STRVAR(Counters_attach_doc,
             "attach(fd, slots, fields, /)\n--\n\n"
             "The Counters (of that shape) another process made with memfd=True, mapped from a\n"
             "descriptor of its memfd (fd stays the caller's). ValueError when the file is not\n"
             "counters of that shape.");

static PyObject *Counters_attach(PyTypeObject *type, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t fd, slots, fields;
    if (check_nargs("attach", nargs, 3, 3) < 0 ||
        arg_in_range(args[0], "fd", 0, INT32_MAX, &fd) < 0 ||
        arg_in_range(args[1], "slots", 1, VX_STATS_MAX_SLOTS, &slots) < 0 ||
        arg_in_range(args[2], "fields", 1, VX_COUNTERS_MAX_FIELDS, &fields) < 0)
        return NULL;
    CountersObject *self = (CountersObject *)type->tp_alloc(type, 0); /* new ref, zeroed */
    if (self == NULL)
        return NULL;
    self->fd = -1;
    int err = vx_counters_attach(&self->c, (int)fd, (size_t)slots, (size_t)fields);
    if (err != 0) {
        Py_DECREF(self);
        if (err == EINVAL)
            return PyErr_Format(PyExc_ValueError, "fd %lld is not Counters of %lld x %lld",
                                (long long)fd, (long long)slots, (long long)fields);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return (PyObject *)self;
}

static PyMethodDef Counters_methods[] = {
    {"fd", (PyCFunction)Counters_fd, METH_NOARGS, Counters_fd_doc},
    {"attach", FASTCALL(Counters_attach), METH_FASTCALL | METH_CLASS, Counters_attach_doc},
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

vx_counters *vxb_counters_core(PyObject *o, module_state *st)
{
    if (!PyObject_TypeCheck(o, st->counters_type)) {
        PyErr_Format(PyExc_TypeError, "a Counters is needed, got %s", Py_TYPE(o)->tp_name);
        return NULL;
    }
    return &((CountersObject *)o)->c;
}

/* ---------------------------------------------------------------- init */

int vxb_stats_exec(PyObject *module, module_state *st)
{
    if (vxb_add_type(module, &Counters_spec, &st->counters_type) < 0 ||
        vxb_add_type(module, &Hist_spec, &st->hist_type) < 0)
        return -1;
    return 0;
}
