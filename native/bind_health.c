#include "bind.h"
#include "vx_health.h"

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

PyDoc_STRVAR(Health_allow_doc,
             "allow($self, upstream, now_ms, /)\n--\n\n"
             "enter() + acquire() + count(UP_REQUESTS) in one call: a probe slot >= 0 (0: the\n"
             "breaker is closed), or -1 (breaker refuses) / -2 (max_in_flight reached), having\n"
             "taken nothing.");

static PyObject *Health_allow(HealthObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t i, now;
    if (check_nargs("allow", nargs, 2, 2) < 0 || health_index(self, args, &i) < 0 ||
        health_now(args, nargs, 1, &now) < 0)
        return NULL;
    int tr;
    int64_t probe_slot = vx_breaker_enter(self->h, i, now, &tr);
    if (probe_slot < 0)
        return PyLong_FromLong(-1);
    health_note(self, i, tr, now);
    if (!vx_inflight_acquire(self->h, i)) {
        vx_breaker_report(self->h, i, probe_slot, VX_OUTCOME_NEUTRAL, now); /* a probe slot back */
        return PyLong_FromLong(-2);
    }
    vx_health_count(self->h, i, VX_UP_REQUESTS, 1);
    return PyLong_FromLongLong(probe_slot);
}

PyDoc_STRVAR(Health_finish_doc,
             "finish($self, upstream, probe_slot, outcome, now_ms, /)\n--\n\n"
             "release() + report() + count the success or failure, in one call (the\n"
             "transition it caused, if any, is kept for transitions()).");

static PyObject *Health_finish(HealthObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t i, probe_slot, outcome, now;
    if (check_nargs("finish", nargs, 4, 4) < 0 || health_index(self, args, &i) < 0 ||
        arg_in_range(args[1], "probe_slot", 0, INT64_MAX, &probe_slot) < 0 ||
        arg_in_range(args[2], "outcome", 0, 2, &outcome) < 0 ||
        health_now(args, nargs, 3, &now) < 0)
        return NULL;
    vx_inflight_release(self->h, i);
    health_note(self, i, vx_breaker_report(self->h, i, probe_slot, (int)outcome, now), now);
    if (outcome == VX_OUTCOME_SUCCESS)
        vx_health_count(self->h, i, VX_UP_SUCCESSES, 1);
    else if (outcome == VX_OUTCOME_FAILURE)
        vx_health_count(self->h, i, VX_UP_FAILURES, 1);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(Health_enter_doc,
             "enter($self, upstream, now_ms=None, /)\n--\n\n"
             "Pass the breaker: -1 refused, 0 admitted (closed), > 0 a probe slot. Every\n"
             "probe slot >= 0 must go back through report(). A call that turns the breaker\n"
             "half-open keeps TR_HALF_OPENED for transitions(); so does allow().");

static PyObject *Health_enter(HealthObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t i, now;
    if (check_nargs("enter", nargs, 1, 2) < 0 || health_index(self, args, &i) < 0 ||
        health_now(args, nargs, 1, &now) < 0)
        return NULL;
    int tr;
    int64_t probe_slot = vx_breaker_enter(self->h, i, now, &tr);
    health_note(self, i, tr, now);
    return PyLong_FromLongLong(probe_slot);
}

PyDoc_STRVAR(Health_report_doc,
             "report($self, upstream, probe_slot, outcome, now_ms=None, /)\n--\n\n"
             "The outcome (OUTCOME_SUCCESS, _FAILURE, _NEUTRAL) of a request admitted with\n"
             "probe_slot; returns the transition it caused (TR_NONE, TR_OPENED, TR_REOPENED,\n"
             "TR_CLOSED), which transitions() also lists.");

static PyObject *Health_report(HealthObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t i, probe_slot, outcome, now;
    if (check_nargs("report", nargs, 3, 4) < 0 || health_index(self, args, &i) < 0 ||
        arg_in_range(args[1], "probe_slot", 0, INT64_MAX, &probe_slot) < 0 ||
        arg_in_range(args[2], "outcome", 0, 2, &outcome) < 0 ||
        health_now(args, nargs, 3, &now) < 0)
        return NULL;
    int tr = vx_breaker_report(self->h, i, probe_slot, (int)outcome, now);
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
    {"allow", FASTCALL(Health_allow), METH_FASTCALL, Health_allow_doc},
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

/* ---------------------------------------------------------------- init */

/* Mirrors of the core's header, so Python code never hard-codes the numbers. */
static const vxb_int_const constants[] = {
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
};

int vxb_health_exec(PyObject *module, module_state *st)
{
    if (vxb_add_type(module, &Health_spec, &st->health_type) < 0 ||
        vxb_add_type(module, &Budget_spec, &st->budget_type) < 0 ||
        vxb_add_ints(module, constants, sizeof constants / sizeof constants[0]) < 0)
        return -1;
    return 0;
}
