#include "bind.h"
#include "bind_sink.h"
#include "vx_h1resp.h"
#include "vx_reqhead.h" /* vx_reqhead_lower */

#include <stdio.h>
#include <string.h>
#include <time.h>

/* ---------------------------------------------------------------- H1Reader */

/* The reading half of an HTTP/1.1 upstream connection (velox/egress/h1conn.py subclasses it
 * together with asyncio.BufferedProtocol). uvloop calls get_buffer and buffer_updated, both
 * here: a read costs no Python frame until there is something to report, and then exactly one
 * call per read, to one of the subclass's methods:
 *
 *   _h_answer(status, headers, keep_alive, body)  head and end of a response in this read
 *   _h_head(status, headers, keep_alive, body)    a head, the body so far; more to come
 *   _h_body(body)                                 body of a response whose head came earlier
 *   _h_end(body)                                  its last body bytes (maybe b""): it ended
 *   _h_error(message)                             a broken body framing (drop the connection)
 *   _h_fallback(data)                             a head outside vx_h1resp's subset: these
 *                                                 bytes, and every later one, are httptools'
 *
 * headers is a list of (lower-case name, value) bytes tuples, as the httptools path builds. */

/* A response head is at most this long (then httptools reads it); a read is at most this. */
#define HR_MAX_HEAD (64 * 1024)
#define HR_READ_BUFFER (64 * 1024)
#define HR_MAX_FIELDS 128
/* Body spans per decoding pass: a read of many tiny chunks takes several passes. */
#define HR_SPANS 64

enum {
    HR_ANSWER, HR_HEAD, HR_BODY, HR_END, HR_ERROR, HR_FALLBACK, HR_WITHHOLD, HR_NAMES
};
static const char *const hr_names[HR_NAMES] = {
    "_h_answer", "_h_head", "_h_body", "_h_end", "_h_error", "_h_fallback", "_h_withhold"};

typedef struct {
    PyObject_HEAD
    char *buf;             /* the read buffer uvloop fills */
    PyObject *view;        /* a writable memoryview of buf: read_buffer */
    char *hold;            /* an unfinished head, carried to the next read */
    size_t hold_len;
    char *acc;             /* this read's body bytes, when they are not one span */
    size_t acc_len, acc_cap;
    int in_body;           /* between a head and the end of its body */
    int fallback;          /* httptools has the connection */
    int no_body;           /* the request being answered is HEAD */
    int keep_alive;        /* of the last head: without it, nothing may follow its message */
    vx_hr_body body;
    PyObject *names[HR_NAMES];
    vxb_sink sink;         /* the direct path (bind_sink.h), off until direct() */
    vxb_sink_names sink_names;
} H1Reader;

static PyObject *H1R_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    (void)args;
    (void)kwds;
    H1Reader *self = (H1Reader *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->keep_alive = 1;
    if ((self->hold = PyMem_Malloc(HR_MAX_HEAD)) == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    if (vxb_reader_buffer(HR_READ_BUFFER, &self->buf, &self->view) < 0 ||
        vxb_sink_names_init(&self->sink_names) < 0 ||
        vxb_intern(self->names, hr_names, HR_NAMES) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static int H1R_traverse(H1Reader *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->view);
    return vxb_sink_traverse(&self->sink, visit, arg);
}

static int H1R_clear(H1Reader *self)
{
    Py_CLEAR(self->view);
    vxb_sink_clear(&self->sink);
    return 0;
}

static void H1R_dealloc(H1Reader *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    H1R_clear(self);
    for (int i = 0; i < HR_NAMES; i++)
        Py_CLEAR(self->names[i]);
    vxb_sink_names_clear(&self->sink_names);
    /* The memoryview is gone above; a view exported from it by a caller (read_buffer[:n])
     * that outlives us would point at freed memory, which is why the buffer is freed after
     * the view and only here, with the object. */
    PyMem_Free(self->buf);
    PyMem_Free(self->hold);
    PyMem_Free(self->acc);
    tp->tp_free(self);
    Py_DECREF(tp);
}

/* Call one of the subclass's report methods with 1 or 4 arguments; 0, or -1 with an error. */
static int hr_call(H1Reader *self, int which, PyObject *const *args, size_t nargs)
{
    PyObject *stack[5] = {(PyObject *)self, NULL, NULL, NULL, NULL};
    for (size_t i = 0; i < nargs; i++)
        stack[i + 1] = args[i];
    PyObject *r = PyObject_VectorcallMethod(self->names[which], stack,
                                            (nargs + 1) | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

static int hr_call1(H1Reader *self, int which, PyObject *arg)
{
    if (arg == NULL)
        return -1;
    int rc = hr_call(self, which, &arg, 1);
    Py_DECREF(arg);
    return rc;
}

/* The head parsed at base: (status, headers, keep_alive) as a 3-tuple, or NULL. */
static PyObject *hr_head(const char *base, const vx_h1resp *h, const vx_hr_field *fields)
{
    PyObject *list = PyList_New((Py_ssize_t)h->nfields);
    if (list == NULL)
        return NULL;
    for (size_t i = 0; i < h->nfields; i++) {
        const vx_hr_field *f = &fields[i];
        PyObject *name = PyBytes_FromStringAndSize(NULL, f->name_len);
        PyObject *value = PyBytes_FromStringAndSize(base + f->value_off, f->value_len);
        PyObject *pair = NULL;
        if (name != NULL && value != NULL) {
            vx_reqhead_lower(PyBytes_AS_STRING(name), base + f->name_off, f->name_len);
            pair = PyTuple_Pack(2, name, value);
        }
        Py_XDECREF(name);
        Py_XDECREF(value);
        if (pair == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, pair);
    }
    return Py_BuildValue("(iNO)", h->status, list, h->keep_alive ? Py_True : Py_False);
}

/* Keep a span of body in acc (this read's body is more than one span). */
static int hr_keep(H1Reader *self, const char *p, size_t n)
{
    if (self->acc_len + n > self->acc_cap) {
        size_t cap = self->acc_cap ? self->acc_cap : 4096;
        while (cap < self->acc_len + n)
            cap *= 2;
        char *grown = PyMem_Realloc(self->acc, cap);
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        self->acc = grown;
        self->acc_cap = cap;
    }
    memcpy(self->acc + self->acc_len, p, n);
    self->acc_len += n;
    return 0;
}

/* This read's body so far as bytes: the one span itself, or what acc holds. */
static PyObject *hr_body(H1Reader *self, const char *p, const vx_hr_span *one, int spans)
{
    if (spans == 1)
        return PyBytes_FromStringAndSize(p + one->off, (Py_ssize_t)one->len);
    return PyBytes_FromStringAndSize(self->acc, (Py_ssize_t)self->acc_len);
}

/* ---------------------------------------------------------------- the direct path
 *
 * A streamed answer's read that the relay would pass through untouched goes from here to the
 * client's transport (bind_sink.h says when); any other read takes the Python path (_h_body). */

/* 1: the read went to the client here; 0: it takes the Python path; -1: error. */
static int hr_direct(H1Reader *self, const char *p, size_t n)
{
    int paused;
    int rc = vxb_sink_write(&self->sink, &self->sink_names, p, n, &paused);
    if (rc == 1 && paused && hr_call1(self, HR_WITHHOLD, PyLong_FromSize_t(n)) < 0)
        return -1;
    return rc;
}

/* Report the head of this read (if any) with the body so far: _h_answer when the message
 * ended, else _h_head; without a head: _h_end or _h_body. */
static int hr_report(H1Reader *self, PyObject **head, PyObject *body, int ended)
{
    if (body == NULL)
        return -1;
    int rc;
    if (*head != NULL) {
        PyObject *args[4] = {PyTuple_GET_ITEM(*head, 0), PyTuple_GET_ITEM(*head, 1),
                             PyTuple_GET_ITEM(*head, 2), body};
        rc = hr_call(self, ended ? HR_ANSWER : HR_HEAD, args, 4);
        Py_CLEAR(*head);
    } else {
        rc = hr_call(self, ended ? HR_END : HR_BODY, &body, 1);
    }
    Py_DECREF(body);
    return rc;
}

/* A body report of a read (no head in it, the message not ended): the direct path when it
 * takes it, else _h_body. */
static int hr_report_body(H1Reader *self, const char *p, const vx_hr_span *one, int spans)
{
    const char *data = spans == 1 ? p + one->off : self->acc;
    size_t n = spans == 1 ? one->len : self->acc_len;
    int rc = hr_direct(self, data, n);
    if (rc != 0)
        return rc < 0 ? -1 : 0;
    PyObject *head = NULL;
    return hr_report(self, &head, hr_body(self, p, one, spans), 0);
}

/* A head from the held bytes plus p[0 .. n): 1 parsed (*head set, *used of p consumed),
 * 0 more needed (p kept), -1 error, 2 fallback (called already). */
static int hr_read_head(H1Reader *self, const char *p, size_t n, PyObject **head, size_t *used)
{
    vx_hr_field fields[HR_MAX_FIELDS];
    vx_h1resp h;
    const char *base = p;
    size_t len = n, held = self->hold_len;
    if (held) { /* the head began in an earlier read: continue it in the hold buffer */
        size_t room = HR_MAX_HEAD - held, take = n < room ? n : room;
        memcpy(self->hold + held, p, take);
        base = self->hold;
        len = held + take;
    }
    int rc = vx_h1resp_parse(base, len, fields, HR_MAX_FIELDS, HR_MAX_HEAD, self->no_body, &h);
    if (rc == VX_HR_MORE) {
        if (!held)
            memcpy(self->hold, p, n); /* n < HR_MAX_HEAD, else the parse says FALLBACK */
        self->hold_len = len;
        return 0;
    }
    if (rc != VX_HR_DONE) { /* everything from this head on goes to httptools */
        self->fallback = 1;
        self->hold_len = 0;
        PyObject *data = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(held + n));
        if (data == NULL)
            return -1;
        memcpy(PyBytes_AS_STRING(data), self->hold, held);
        memcpy(PyBytes_AS_STRING(data) + held, p, n);
        return hr_call1(self, HR_FALLBACK, data) < 0 ? -1 : 2;
    }
    self->keep_alive = h.keep_alive;
    *head = hr_head(base, &h, fields);
    if (*head == NULL)
        return -1;
    self->hold_len = 0;
    *used = h.head_len - held;
    self->in_body = !vx_hr_body_start(&self->body, &h);
    return 1;
}

/* Everything one read brought: p[0 .. n). */
static PyObject *hr_feed(H1Reader *self, const char *p, size_t n)
{
    if (self->fallback)
        return hr_call1(self, HR_FALLBACK, PyBytes_FromStringAndSize(p, (Py_ssize_t)n)) < 0
                   ? NULL
                   : Py_NewRef(Py_None);
    PyObject *head = NULL;
    vx_hr_span spans[HR_SPANS], one = {0, 0};
    int nspans = 0; /* body spans of this read since the last report */
    size_t pos = 0;
    self->acc_len = 0;
    while (pos < n) {
        if (!self->in_body) {
            if (head != NULL) { /* a message ended within this read's head: report it */
                if (hr_report(self, &head, PyBytes_FromStringAndSize("", 0), 1) < 0)
                    goto error;
            }
            if (!self->keep_alive) { /* as llhttp: a byte after a closing answer is an error */
                self->fallback = 1;
                if (hr_call1(self, HR_ERROR,
                             PyUnicode_FromString("data after connection: close")) < 0)
                    goto error;
                goto done;
            }
            size_t used = 0;
            int rc = hr_read_head(self, p + pos, n - pos, &head, &used);
            if (rc < 0)
                goto error;
            if (rc == 2)
                goto done;
            if (rc == 0)
                break;
            pos += used;
            if (!self->in_body) /* no body: the message is complete */
                continue;
        }
        size_t ns = 0, used = 0;
        int rc = vx_hr_body_feed(&self->body, p + pos, n - pos, spans, HR_SPANS, &ns, &used);
        if (rc == VX_HR_ERROR) {
            Py_CLEAR(head);
            self->in_body = 0;
            self->fallback = 1; /* nothing after a broken framing is read natively again */
            if (hr_call1(self, HR_ERROR,
                         PyUnicode_FromString("invalid chunked body framing")) < 0)
                goto error;
            goto done;
        }
        for (size_t i = 0; i < ns; i++) {
            vx_hr_span s = {spans[i].off + pos, spans[i].len};
            if (s.len == 0)
                continue;
            if (nspans == 0) {
                one = s;
            } else {
                if (nspans == 1 && hr_keep(self, p + one.off, one.len) < 0)
                    goto error;
                if (hr_keep(self, p + s.off, s.len) < 0)
                    goto error;
            }
            nspans++;
        }
        pos += used;
        if (rc == 1) { /* the message ended */
            self->in_body = 0;
            if (hr_report(self, &head, hr_body(self, p, &one, nspans), 1) < 0)
                goto error;
            nspans = 0;
            self->acc_len = 0;
        }
    }
    if (head == NULL && nspans && self->in_body) {
        if (hr_report_body(self, p, &one, nspans) < 0)
            goto error;
    } else if (head != NULL || nspans) {
        if (hr_report(self, &head, hr_body(self, p, &one, nspans), !self->in_body) < 0)
            goto error;
    }
done:
    return Py_NewRef(Py_None);
error:
    Py_XDECREF(head);
    return NULL;
}

static PyObject *H1R_get_buffer(H1Reader *self, PyObject *sizehint)
{
    (void)sizehint;
    return Py_NewRef(self->view);
}

static PyObject *H1R_buffer_updated(H1Reader *self, PyObject *arg)
{
    size_t n;
    if (vxb_reader_nbytes(arg, HR_READ_BUFFER, &n) < 0)
        return NULL;
    return hr_feed(self, self->buf, n);
}

static PyObject *H1R_data_received(H1Reader *self, PyObject *arg)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *r = hr_feed(self, view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    return r;
}

static PyObject *H1R_direct(H1Reader *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != VXS_N + 1) {
        PyErr_SetString(PyExc_TypeError,
                        "direct(conn, write, sse, exchange, attempt, chunked) takes 6 arguments");
        return NULL;
    }
    if (vxb_sink_set(&self->sink, &self->sink_names, args) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *H1R_undirect(H1Reader *self, PyObject *unused)
{
    (void)unused;
    vxb_sink_clear(&self->sink);
    Py_RETURN_NONE;
}

static PyMethodDef H1R_methods[] = {
    {"direct", FASTCALL(H1R_direct), METH_FASTCALL,
     "direct(conn, write, sse, exchange, attempt, chunked, /): plain reads of the streamed "
     "answer go to write (the client transport's) from here on; see bind_sink.h."},
    {"undirect", (PyCFunction)H1R_undirect, METH_NOARGS,
     "undirect(): every read through the Python path again (the attempt ended)."},
    {"get_buffer", (PyCFunction)H1R_get_buffer, METH_O,
     "get_buffer(sizehint, /) -> memoryview: the read buffer (BufferedProtocol)."},
    {"buffer_updated", (PyCFunction)H1R_buffer_updated, METH_O,
     "buffer_updated(nbytes, /): parse the first nbytes of the read buffer."},
    {"data_received", (PyCFunction)H1R_data_received, METH_O,
     "data_received(data, /): parse data (as buffer_updated does)."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef H1R_members[] = {
    {"read_buffer", T_OBJECT_EX, offsetof(H1Reader, view), READONLY,
     "The buffer uvloop reads into (a writable memoryview)."},
    {"no_body", T_INT, offsetof(H1Reader, no_body), 0,
     "Nonzero while the request answered was HEAD: its answer has no body."},
    {"native_fallback", T_INT, offsetof(H1Reader, fallback), READONLY,
     "Nonzero once httptools reads this connection."},
    {NULL, 0, 0, 0, NULL},
};

PyDoc_STRVAR(H1R_doc, "H1Reader()\n\nThe native reading half of an HTTP/1.1 upstream "
                      "connection (see velox/egress/h1conn.py).");

static PyType_Slot H1R_slots[] = {
    {Py_tp_doc, (void *)H1R_doc},
    {Py_tp_new, H1R_new},
    {Py_tp_dealloc, H1R_dealloc},
    {Py_tp_traverse, H1R_traverse},
    {Py_tp_clear, H1R_clear},
    {Py_tp_methods, H1R_methods},
    {Py_tp_members, H1R_members},
    {0, NULL},
};

static PyType_Spec H1R_spec = {
    .name = "velox._native.H1Reader",
    .basicsize = sizeof(H1Reader),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .slots = H1R_slots,
};

/* ---------------------------------------------------------------- init */

int vxb_h1resp_exec(PyObject *module, module_state *st)
{
    (void)st;
    PyObject *type = PyType_FromModuleAndSpec(module, &H1R_spec, NULL);
    if (type == NULL)
        return -1;
    int rc = PyModule_AddType(module, (PyTypeObject *)type);
    Py_DECREF(type);
    return rc;
}
