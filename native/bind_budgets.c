/* bind_budgets.c: a worker's spend budgets, admission and settlement in one call each.
 *
 * Why: a request of a key under a budget (velox.spend.wire) read each budget's level, took
 * its estimate from each, counted it in its worker slot's in-flight row and formatted the
 * x-velox-budget-remaining-usd value, then settled the exact cost per budget the same way:
 * ~10 Python-level calls a request, 4-5 us of the +10 us a budget cost (bench_spend.py). Here
 * each end is one call over the two shared cores it drives (vx_limits buckets, vx_counters
 * in-flight units), with the same arithmetic as its Python twin (velox.spend.gate), which
 * the unit tests run against it step by step.
 *
 * No core of its own: the budgets' state is the Limits buckets (one per budget, units of the
 * budget) and the Counters row of the slot (units reserved by requests in flight), both made
 * by the supervisor before fork. Per worker only the carry: per budget, the nano-USD of this
 * worker's settled costs below one unit, charged with its next settlement.
 */
#include "bind.h"
#include "vx_books.h"
#include "vx_limits.h"
#include "vx_stats.h"

/* At most this many budgets a key is under (its own and its teams'): a stack array. */
#define GATE_MAX_PER_KEY 64

typedef struct {
    PyObject_HEAD
    PyObject *limits;   /* the Limits and Counters objects, kept alive: their cores are used */
    PyObject *counters;
    vx_limits *l;
    vx_counters *c;
    int64_t slot;
    Py_ssize_t n;       /* budgets */
    int64_t *units;     /* nano-USD per bucket token, per budget */
    int64_t *carry;     /* nano-USD below one unit, per budget */
} GateObject;

static void Gate_dealloc(GateObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    Py_XDECREF(self->limits);
    Py_XDECREF(self->counters);
    PyMem_Free(self->units);
    PyMem_Free(self->carry);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyObject *Gate_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"limits", "in_flight", "units", "slot", NULL};
    PyObject *limits, *counters, *units, *slot_obj;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO!O:BudgetGate", kwlist, &limits, &counters,
                                     &PyTuple_Type, &units, &slot_obj))
        return NULL;
    module_state *st = PyType_GetModuleState(type);
    vx_limits *l = vxb_limits_core(limits, st);
    vx_counters *c = l == NULL ? NULL : vxb_counters_core(counters, st);
    if (c == NULL)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(units);
    if (n > l->n || (size_t)n > c->fields) {
        PyErr_Format(PyExc_ValueError, "%zd budgets: more than the Limits' entries or the "
                     "in-flight counters' fields", n);
        return NULL;
    }
    int64_t slot;
    if (arg_in_range(slot_obj, "slot", 0, (int64_t)c->slots - 1, &slot) < 0)
        return NULL;
    GateObject *self = (GateObject *)type->tp_alloc(type, 0); /* new ref, zeroed */
    if (self == NULL)
        return NULL;
    self->units = PyMem_Calloc((size_t)n + 1, sizeof(int64_t));
    self->carry = PyMem_Calloc((size_t)n + 1, sizeof(int64_t));
    if (self->units == NULL || self->carry == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t b = 0; b < n; b++)
        /* <= 10**9: a level (<= 10**9 tokens, a bucket's burst) times its unit then fits
         * int64 (<= 10**18); budgets are at most $10**6, units at most 10**6 nano-USD. */
        if (arg_in_range(PyTuple_GET_ITEM(units, b), "unit", 1, INT64_C(1000000000),
                         &self->units[b]) < 0) {
            Py_DECREF(self);
            return NULL;
        }
    self->limits = Py_NewRef(limits);
    self->counters = Py_NewRef(counters);
    self->l = l;
    self->c = c;
    self->slot = slot;
    self->n = n;
    return (PyObject *)self;
}

/* The budgets of one request: a tuple of indexes, read into b[] (at most GATE_MAX_PER_KEY). */
static Py_ssize_t gate_budgets(GateObject *self, PyObject *o, int64_t *b)
{
    if (!PyTuple_Check(o)) {
        PyErr_SetString(PyExc_TypeError, "budgets must be a tuple of indexes");
        return -1;
    }
    Py_ssize_t k = PyTuple_GET_SIZE(o);
    if (k > GATE_MAX_PER_KEY) {
        PyErr_Format(PyExc_ValueError, "at most %d budgets per request, got %zd",
                     GATE_MAX_PER_KEY, k);
        return -1;
    }
    for (Py_ssize_t i = 0; i < k; i++)
        if (arg_in_range(PyTuple_GET_ITEM(o, i), "budget", 0, self->n - 1, &b[i]) < 0)
            return -1;
    return k;
}

/* ceil(nanos / unit) for nanos >= 0 */
static int64_t units_of(int64_t nanos, int64_t unit)
{
    return nanos > 0 ? (nanos + unit - 1) / unit : 0;
}

/* Nano-USD as a decimal of USD, 9 places at most, trailing zeros cut (velox.spend.gate's
 * usd_text, which the tests compare it with; vx_books writes it). */
static PyObject *usd_bytes(int64_t nanos)
{
    char text[VX_BOOKS_USD_MAX];
    return PyBytes_FromStringAndSize(text, vx_books_usd(text, nanos) - text);
}

PyDoc_STRVAR(Gate_admit_doc,
             "admit($self, budgets, estimate, /)\n--\n\n"
             "Admit one request under `budgets` (a tuple of budget indexes) reserving its\n"
             "`estimate` (nano-USD >= 0): refused while any of them has nothing left (level <= 0),\n"
             "then ceil(estimate / unit) taken from each, into debt when less is left, and counted\n"
             "in this slot's in-flight row. Returns the nano-USD the tightest budget had left\n"
             "before the take, as USD bytes (x-velox-budget-remaining-usd); refused: the int index\n"
             "of the first budget with nothing left (nothing taken).");

static PyObject *Gate_admit(GateObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t b[GATE_MAX_PER_KEY], estimate;
    Py_ssize_t k;
    if (check_nargs("admit", nargs, 2, 2) < 0 || (k = gate_budgets(self, args[0], b)) < 0 ||
        arg_in_range(args[1], "estimate", 0, INT64_MAX / 2, &estimate) < 0)
        return NULL;
    int64_t now = vx_limits_now_us(), lowest = -1;
    for (Py_ssize_t i = 0; i < k; i++) {
        int64_t level = vx_limits_level(self->l, b[i], now);
        if (level <= 0)
            return PyLong_FromLongLong(b[i]);
        int64_t here = level * self->units[b[i]];
        if (lowest < 0 || here < lowest)
            lowest = here;
    }
    for (Py_ssize_t i = 0; estimate > 0 && i < k; i++) {
        int64_t n = units_of(estimate, self->units[b[i]]);
        /* A refused take still tells the bucket's demand (its refused count). */
        if (vx_limits_take(self->l, b[i], n, now) != 0)
            vx_limits_charge(self->l, b[i], n);
        vx_counters_add(self->c, (size_t)self->slot, (size_t)b[i], n);
    }
    return usd_bytes(lowest < 0 ? 0 : lowest);
}

PyDoc_STRVAR(Gate_settle_doc,
             "settle($self, budgets, estimate, cost, /)\n--\n\n"
             "One request admitted with `estimate` ended costing `cost` nano-USD: per budget,\n"
             "what it reserved becomes its cost in units (the part below a unit carried to this\n"
             "gate's next settlement): the difference charged or refunded, the reservation\n"
             "taken off this slot's in-flight row.");

static PyObject *Gate_settle(GateObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t b[GATE_MAX_PER_KEY], estimate, cost;
    Py_ssize_t k;
    if (check_nargs("settle", nargs, 3, 3) < 0 || (k = gate_budgets(self, args[0], b)) < 0 ||
        arg_in_range(args[1], "estimate", 0, INT64_MAX / 2, &estimate) < 0 ||
        arg_in_range(args[2], "cost", 0, INT64_MAX / 2, &cost) < 0)
        return NULL;
    for (Py_ssize_t i = 0; i < k; i++) {
        int64_t unit = self->units[b[i]], reserved = units_of(estimate, unit);
        int64_t total = cost + self->carry[b[i]];
        int64_t used = total / unit;
        self->carry[b[i]] = total % unit;
        if (used > reserved)
            vx_limits_charge(self->l, b[i], used - reserved);
        else if (used < reserved)
            vx_limits_refund(self->l, b[i], reserved - used);
        if (reserved)
            vx_counters_add(self->c, (size_t)self->slot, (size_t)b[i], -reserved);
    }
    Py_RETURN_NONE;
}

static PyObject *Gate_get_carry(GateObject *self, void *Py_UNUSED(closure))
{
    PyObject *out = PyTuple_New(self->n);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < self->n; i++) {
        PyObject *v = PyLong_FromLongLong(self->carry[i]);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, v);
    }
    return out;
}

static PyMethodDef Gate_methods[] = {
    {"admit", FASTCALL(Gate_admit), METH_FASTCALL, Gate_admit_doc},
    {"settle", FASTCALL(Gate_settle), METH_FASTCALL, Gate_settle_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Gate_getset[] = {
    {"carry", (getter)Gate_get_carry, NULL,
     "Per budget, nano-USD of settled costs below one unit, not yet charged.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(Gate_doc,
             "BudgetGate(limits, in_flight, units, slot)\n--\n\n"
             "One worker's admission and settlement of spend budgets: budget b is bucket b of\n"
             "`limits` (a Limits), counting units of units[b] nano-USD, and field b of row `slot`\n"
             "of `in_flight` (a Counters) the units its requests in flight reserve.");

static PyType_Slot Gate_slots[] = {
    {Py_tp_doc, (void *)Gate_doc},
    {Py_tp_new, Gate_new},
    {Py_tp_dealloc, Gate_dealloc},
    {Py_tp_methods, Gate_methods},
    {Py_tp_getset, Gate_getset},
    {0, NULL},
};

static PyType_Spec Gate_spec = {
    .name = "velox._native.BudgetGate",
    .basicsize = sizeof(GateObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Gate_slots,
};

int vxb_budgets_exec(PyObject *module, module_state *st)
{
    return vxb_add_type(module, &Gate_spec, &st->gate_type);
}
