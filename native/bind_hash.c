#include "bind.h"
#include "vx_health.h"

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

/* ---------------------------------------------------------------- init */

static PyMethodDef functions[] = {
    {"hash64", FASTCALL(native_hash64), METH_FASTCALL, hash64_doc},
    {NULL, NULL, 0, NULL},
};

int vxb_hash_exec(PyObject *module, module_state *st)
{
    if (vxb_add_type(module, &Hrw_spec, &st->hrw_type) < 0 ||
        PyModule_AddFunctions(module, functions) < 0)
        return -1;
    return 0;
}
