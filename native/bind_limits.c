#include "bind.h"
#include "vx_limits.h"

#include <errno.h>
#include <fcntl.h>  /* fcntl(F_DUPFD_CLOEXEC) */
#include <unistd.h> /* close */

/* ---------------------------------------------------------------- Limits */

typedef struct {
    PyObject_HEAD
    vx_limits *l; /* owned view of the shared mapping; NULL only while tp_new fails */
    int fd;       /* the memfd this object made (memfd=True), else -1 */
} LimitsObject;

#define LIMITS_DEFAULT_SLOTS 64

static PyObject *Limits_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"n", "slots", "memfd", NULL};
    PyObject *n_obj, *slots_obj = NULL;
    int64_t n, slots = LIMITS_DEFAULT_SLOTS;
    int memfd = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|O$p:Limits", kwlist, &n_obj, &slots_obj,
                                     &memfd))
        return NULL;
    if (arg_in_range(n_obj, "n", 1, VX_LIMITS_MAX_N, &n) < 0 ||
        (slots_obj != NULL &&
         arg_in_range(slots_obj, "slots", 1, VX_LIMITS_MAX_SLOTS, &slots) < 0))
        return NULL;
    LimitsObject *self = (LimitsObject *)type->tp_alloc(type, 0); /* new reference */
    if (self == NULL)
        return NULL;
    self->fd = -1;
    self->l = vx_limits_create_fd(n, slots, memfd ? &self->fd : NULL);
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
    if (self->fd >= 0)
        close(self->fd);
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

/* admit()'s packed result, stated once here and exported (velox.state.limits decodes it by
 * these names): admitted, ~result = left_req | left_tok << ADMIT_LEFT_SHIFT; refused,
 * result = wait_us << ADMIT_REASON_BITS | reason. Packed because the keys stage calls admit
 * once per request and an int costs less than a tuple or record there. */
#define ADMIT_LEFT_SHIFT 32
#define ADMIT_REASON_BITS 2
_Static_assert(VX_ADMIT_PARALLEL < (1 << ADMIT_REASON_BITS), "reasons fit ADMIT_REASON_BITS");

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
        return PyLong_FromLongLong(~(left_req | (left_tok << ADMIT_LEFT_SHIFT)));
    /* wait <= 2^33 us for any bucket (need <= 6e17 units at rate >= 1): no overflow. */
    return PyLong_FromLongLong((wait > 0 ? wait : 0) * (1 << ADMIT_REASON_BITS) + reason);
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

PyDoc_STRVAR(Limits_fd_doc,
             "fd($self, /)\n--\n\n"
             "A new descriptor of the memfd these limits live on (Limits(..., memfd=True)), for\n"
             "a process that did not inherit the mapping (send it with SCM_RIGHTS; attach()\n"
             "maps it). The caller closes it. ValueError for anonymous limits.");

static PyObject *Limits_fd(LimitsObject *self, PyObject *Py_UNUSED(ignored))
{
    if (self->fd < 0) {
        PyErr_SetString(PyExc_ValueError, "these Limits are anonymous (made without memfd=True)");
        return NULL;
    }
    int fd = fcntl(self->fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    return PyLong_FromLong(fd);
}

PyDoc_STRVAR(Limits_attach_doc,
             "attach(fd, /)\n--\n\n"
             "The Limits another process made with memfd=True, mapped from a descriptor of its\n"
             "memfd (fd stays the caller's): the same buckets, gauges and held places.\n"
             "ValueError when the file is not a whole Limits mapping.");

static PyObject *Limits_attach(PyTypeObject *type, PyObject *arg)
{
    int64_t fd;
    if (arg_in_range(arg, "fd", 0, INT32_MAX, &fd) < 0)
        return NULL;
    LimitsObject *self = (LimitsObject *)type->tp_alloc(type, 0); /* new reference */
    if (self == NULL)
        return NULL;
    self->fd = -1;
    self->l = vx_limits_attach((int)fd);
    if (self->l == NULL) {
        Py_DECREF(self);
        if (errno == EINVAL)
            return PyErr_Format(PyExc_ValueError, "fd %lld is not a Limits mapping",
                                (long long)fd);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return (PyObject *)self;
}

static PyObject *Limits_get_slots(LimitsObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromLongLong(self->l->slots);
}

/* ---------------------------------------------------------------- books: key tickets */

/* What one admitted keyed request holds (velox.core.types.KeyTicket): a place of its
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
    {"fd", (PyCFunction)Limits_fd, METH_NOARGS, Limits_fd_doc},
    {"attach", (PyCFunction)Limits_attach, METH_O | METH_CLASS, Limits_attach_doc},
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

vx_limits *vxb_limits_core(PyObject *o, module_state *st)
{
    if (!PyObject_TypeCheck(o, st->limits_type)) {
        PyErr_Format(PyExc_TypeError, "a Limits is needed, got %s", Py_TYPE(o)->tp_name);
        return NULL;
    }
    return ((LimitsObject *)o)->l;
}

/* ---------------------------------------------------------------- init */

/* Mirrors of the core's header, so Python code never hard-codes the numbers. */
static const vxb_int_const constants[] = {
    {"LIMITS_NEVER", (long)VX_LIMITS_NEVER},
    {"LIMITS_LEASE_WAIT_US", (long)VX_LIMITS_LEASE_WAIT_US},
    {"ADMIT_REQUESTS", VX_ADMIT_REQUESTS},
    {"ADMIT_TOKENS", VX_ADMIT_TOKENS},
    {"ADMIT_PARALLEL", VX_ADMIT_PARALLEL},
    {"ADMIT_LEFT_SHIFT", ADMIT_LEFT_SHIFT},
    {"ADMIT_REASON_BITS", ADMIT_REASON_BITS},
};

int vxb_limits_exec(PyObject *module, module_state *st)
{
    if (vxb_add_type(module, &Limits_spec, &st->limits_type) < 0 ||
        vxb_add_ints(module, constants, sizeof constants / sizeof constants[0]) < 0)
        return -1;
    return 0;
}
