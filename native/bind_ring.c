#include "bind.h"
#include "vx_ring.h"

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

/* ---------------------------------------------------------------- init */

int vxb_ring_exec(PyObject *module, module_state *st)
{
    if (vxb_add_type(module, &Ring_spec, &st->ring_type) < 0)
        return -1;
    return 0;
}
