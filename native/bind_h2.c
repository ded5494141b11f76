#include "bind.h"
#include "bind_sink.h"
#include "vx_h2.h"

/* ---------------------------------------------------------------- H2Client */

/* The native HTTP/2 client codec (vx_h2): velox.egress.codec's Codec, built by
 * velox/egress/nativecodec.py. One receive_data call is one crossing: the C parser leaves a
 * compact event list for the whole read and this binding turns it into the same tuples the
 * Python codecs return. */
/* The merged event kind receive_answers returns (after vx_h2's own kinds, 1 .. 7). */
#define H2_ANSWER 8

/* A directed stream (direct()): where its plain DATA goes, and what this read gathered of it.
 * Its tag in the codec is its index + 1; a free slot has sid 0. */
typedef struct {
    vxb_sink sink;
    uint32_t sid;
    uint32_t next_free; /* tag of the next free slot, 0 ends the list */
    /* this read's leading DATA frames of the stream (see h2_direct) */
    uint64_t read;      /* the read they belong to (H2Object.reads) */
    uint32_t first, last, frames;
    bool open;          /* no frame ending the stream seen in this read yet */
    size_t bytes;
    int64_t flow;
} h2_slot;

/* Per event of one read: the next gathered frame of the same stream, and whether the direct
 * path wrote it (then it is no event for Python). */
typedef struct {
    uint32_t next;
    bool written;
} h2_mark;

typedef struct {
    PyObject_HEAD
    vx_h2 *c;
    PyObject *error_class; /* velox.egress.codec.CodecError, given by the constructor */
    vxb_sink_names sink_names;
    h2_slot *slots;
    uint32_t nslots, live, free_tag;
    uint64_t reads;
    h2_mark *marks;
    size_t marks_cap;
    uint32_t *touched; /* tags gathered in this read, in order of their first frame */
    char *scratch;     /* a stream's frames of one read joined, when they are several */
    size_t scratch_cap;
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
    if (vxb_sink_names_init(&self->sink_names) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static int H2_traverse(H2Object *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->error_class);
    for (uint32_t i = 0; i < self->nslots; i++) {
        int rc = vxb_sink_traverse(&self->slots[i].sink, visit, arg);
        if (rc)
            return rc;
    }
    return 0;
}

static int H2_clear(H2Object *self)
{
    for (uint32_t i = 0; i < self->nslots; i++)
        vxb_sink_clear(&self->slots[i].sink);
    Py_CLEAR(self->error_class);
    return 0;
}

static void H2_dealloc(H2Object *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    H2_clear(self);
    vxb_sink_names_clear(&self->sink_names);
    vx_h2_free(self->c);
    PyMem_Free(self->slots);
    PyMem_Free(self->marks);
    PyMem_Free(self->touched);
    PyMem_Free(self->scratch);
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

/* ---------------------------------------------------------------- the direct path
 *
 * A streamed answer's DATA that the relay would pass through untouched goes from here to the
 * client (bind_sink.h), without an event: per read and directed stream, the frames before any
 * frame that ends the stream are joined and offered to the stream's sink in one write. What
 * the sink takes is credited back here as h2conn's DATA path credits it (vx_h2_acknowledge
 * while the client reads; withheld on the attempt when the write paused the client, for
 * Exchange.resume to give back); what it leaves, and every frame after it (the end, a reset),
 * stays an event for Python, which runs after these writes, so the client's bytes keep their
 * order. */

/* Room for n events' marks and tags, and for a joined piece of `bytes`. 0 or -1. */
static int h2_room(H2Object *self, size_t n)
{
    if (n <= self->marks_cap)
        return 0;
    h2_mark *marks = PyMem_Realloc(self->marks, n * sizeof *marks);
    if (marks == NULL)
        goto nomem;
    self->marks = marks;
    uint32_t *touched = PyMem_Realloc(self->touched, n * sizeof *touched);
    if (touched == NULL)
        goto nomem;
    self->touched = touched;
    self->marks_cap = n;
    return 0;
nomem:
    PyErr_NoMemory();
    return -1;
}

/* The gathered frames of slot s joined: their bytes (one frame: in place). NULL on error. */
static const char *h2_joined(H2Object *self, const h2_slot *s, const vx_h2_event *ev)
{
    if (s->frames == 1)
        return (const char *)ev[s->first].data;
    if (s->bytes > self->scratch_cap) {
        char *grown = PyMem_Realloc(self->scratch, s->bytes);
        if (grown == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        self->scratch = grown;
        self->scratch_cap = s->bytes;
    }
    size_t off = 0;
    for (uint32_t i = s->first, k = 0; k < s->frames; k++, i = self->marks[i].next) {
        memcpy(self->scratch + off, ev[i].data, ev[i].len);
        off += ev[i].len;
    }
    return self->scratch;
}

/* Gather this read's leading DATA frames per directed stream; returns how many streams. */
static uint32_t h2_gather(H2Object *self, const vx_h2_event *ev, size_t n)
{
    uint64_t read = ++self->reads;
    uint32_t nt = 0;
    for (size_t i = 0; i < n; i++) {
        const vx_h2_event *e = &ev[i];
        self->marks[i].written = false;
        if (e->kind != VX_EV_DATA || e->tag == 0 || e->tag > self->nslots)
            continue;
        h2_slot *s = &self->slots[e->tag - 1];
        if (s->sid != e->sid)
            continue;
        if (s->read != read) {
            s->read = read;
            s->frames = 0;
            s->bytes = 0;
            s->flow = 0;
            s->open = true;
            self->touched[nt++] = e->tag;
        }
        if (!s->open)
            continue;
        if (e->end_stream) { /* the end and what follows are Python's */
            s->open = false;
            continue;
        }
        if (s->frames)
            self->marks[s->last].next = (uint32_t)i;
        else
            s->first = (uint32_t)i;
        s->last = (uint32_t)i;
        s->frames++;
        s->bytes += e->len;
        s->flow += e->value;
    }
    return nt;
}

/* Offer each directed stream's gathered frames to its sink. 0, or -1 with an exception. */
static int h2_direct(H2Object *self, const vx_h2_event *ev, size_t n)
{
    if (h2_room(self, n) < 0)
        return -1;
    uint32_t nt = h2_gather(self, ev, n);
    for (uint32_t k = 0; k < nt; k++) {
        uint32_t tag = self->touched[k];
        h2_slot *s = &self->slots[tag - 1];
        if (s->frames == 0 || s->bytes > VXB_SINK_MAX)
            continue;
        const char *p = h2_joined(self, s, ev);
        if (p == NULL)
            return -1;
        uint32_t sid = s->sid, first = s->first, frames = s->frames;
        int64_t flow = s->flow;
        PyObject *attempt = Py_NewRef(s->sink.o[VXS_ATTEMPT]);
        int paused;
        int rc = vxb_sink_write(&s->sink, &self->sink_names, p, s->bytes, &paused);
        /* (s is not used past the write: Python ran, and may have moved the table) */
        if (rc == 1) {
            for (uint32_t i = first, j = 0; j < frames; j++, i = self->marks[i].next)
                self->marks[i].written = true;
            if (paused)
                rc = vxb_add(attempt, self->sink_names.name[SN_WITHHELD], (Py_ssize_t)flow);
            else if (vx_h2_acknowledge(self->c, sid, flow) != VX_H2_OK) {
                PyErr_Format(PyExc_ValueError, "stream %u was never opened", sid);
                rc = -1;
            }
        }
        Py_DECREF(attempt);
        if (rc < 0)
            return -1;
    }
    return 0;
}

/* The events of one read p[0 .. n) (see receive_answers when merge); p is only read during
 * the call. */
static PyObject *h2_receive_bytes(H2Object *self, const uint8_t *p, size_t len, bool merge)
{
    if (vx_h2_failed(self->c))
        return h2_raise(self, vx_h2_error_code(self->c), "connection already failed", NULL);
    int rc = vx_h2_receive(self->c, p, len);
    size_t n;
    const vx_h2_event *ev = vx_h2_events(self->c, &n);
    const vx_hfield *fields = vx_h2_fields(self->c);
    const uint8_t *arena = vx_h2_arena(self->c);
    bool direct = self->live > 0;
    PyObject *events = direct && h2_direct(self, ev, n) < 0 ? NULL : PyList_New(0);
    for (size_t i = 0; events != NULL && i < n; i++) {
        PyObject *t;
        if (direct && self->marks[i].written)
            continue;
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
    if (events == NULL)
        return NULL;
    if (rc != VX_H2_OK)
        return h2_raise(self, vx_h2_error_code(self->c), vx_h2_error_message(self->c), events);
    return events;
}

static PyObject *h2_receive(H2Object *self, PyObject *data, bool merge)
{
    Py_buffer view;
    if (PyObject_GetBuffer(data, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *events = h2_receive_bytes(self, view.buf, (size_t)view.len, merge);
    PyBuffer_Release(&view); /* only now: DATA events pointed into it */
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

/* direct(stream_id, conn, write, sse, exchange, attempt, chunked, /) -> bool */
static PyObject *H2_direct(H2Object *self, PyObject *const *args, Py_ssize_t nargs)
{
    uint32_t sid;
    bool valid;
    if (check_nargs("direct", nargs, VXS_N + 2, VXS_N + 2) < 0 ||
        h2_sid(args[0], &sid, &valid) < 0)
        return NULL;
    if (!valid || sid == 0 || vx_h2_tag(self->c, sid) != 0 ||
        vx_h2_set_tag(self->c, sid, 0) != VX_H2_OK)
        Py_RETURN_FALSE; /* no state held for it (over already), or directed already */
    uint32_t tag = self->free_tag;
    if (tag == 0) {
        h2_slot *slots = PyMem_Realloc(self->slots, (self->nslots + 1) * sizeof *slots);
        if (slots == NULL)
            return PyErr_NoMemory();
        self->slots = slots;
        memset(&slots[self->nslots], 0, sizeof *slots);
        tag = ++self->nslots;
    } else {
        self->free_tag = self->slots[tag - 1].next_free;
    }
    h2_slot *s = &self->slots[tag - 1];
    if (vxb_sink_set(&s->sink, &self->sink_names, args + 1) < 0) {
        s->next_free = self->free_tag;
        self->free_tag = tag;
        return NULL;
    }
    s->sid = sid;
    s->read = 0;
    self->live++;
    vx_h2_set_tag(self->c, sid, tag);
    Py_RETURN_TRUE;
}

/* undirect(stream_id, /): the stream's DATA are events again (its attempt ended). */
static PyObject *H2_undirect(H2Object *self, PyObject *arg)
{
    if (self->live == 0)
        Py_RETURN_NONE;
    uint32_t sid;
    bool valid;
    if (h2_sid(arg, &sid, &valid) < 0)
        return NULL;
    if (!valid || sid == 0)
        Py_RETURN_NONE;
    uint32_t tag = vx_h2_tag(self->c, sid);
    if (tag == 0) /* the codec forgot the stream already (it ended both ways): look it up */
        for (uint32_t i = 0; i < self->nslots && tag == 0; i++)
            if (self->slots[i].sid == sid)
                tag = i + 1;
    if (tag == 0)
        Py_RETURN_NONE;
    vx_h2_set_tag(self->c, sid, 0);
    h2_slot *s = &self->slots[tag - 1];
    s->sid = 0;
    s->next_free = self->free_tag;
    self->free_tag = tag;
    self->live--;
    vxb_sink_clear(&s->sink); /* last: it may run a finaliser */
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

static PyObject *H2_get_has_output(H2Object *self, void *Py_UNUSED(c))
{
    return PyBool_FromLong(vx_h2_has_output(self->c));
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
    {"direct", FASTCALL(H2_direct), METH_FASTCALL,
     "direct($self, stream_id, conn, write, sse, exchange, attempt, chunked, /)\n--\n\n"
     "Plain DATA of the stream go to write (the client transport's) from here on; see "
     "bind_sink.h. False when the codec holds no state for the stream."},
    {"undirect", (PyCFunction)H2_undirect, METH_O,
     "undirect($self, stream_id, /)\n--\n\nThe stream's DATA are events again."},
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
    {"has_output", (getter)H2_get_has_output, NULL,
     "data_to_send has something to return (frames queued, or body data waiting).", NULL},
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
    {Py_tp_traverse, H2_traverse},
    {Py_tp_clear, H2_clear},
    {Py_tp_methods, H2_methods},
    {Py_tp_getset, H2_getset},
    {0, NULL},
};

static PyType_Spec H2_spec = {
    .name = "velox._native.H2Client",
    .basicsize = sizeof(H2Object),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_HAVE_GC,
    .slots = H2_slots,
};

/* ---------------------------------------------------------------- H2Reader */

/* The reading half of an HTTP/2 upstream connection (velox/egress/h2conn.py's H2Connection
 * subclasses it with asyncio.BufferedProtocol). uvloop calls get_buffer and buffer_updated,
 * both here: with the native codec a read is parsed in C (receive_answers) and, when it left
 * no event for Python (every DATA frame in it went to its client through the direct path)
 * and nothing to send, Python is not entered at all; else the subclass gets one call:
 *   _h_events(events)   the read's events (dispatched, then the connection flushes)
 *   _h_failed(exc)      the codec's CodecError: the connection is unusable
 * With another codec each read goes to the subclass's data_received as bytes. */

/* Reads land in this buffer: h2conn.READ_BUFFER says why it is ours and this large. */
#define H2R_READ_BUFFER (256 * 1024)

enum { H2R_EVENTS, H2R_FAILED, H2R_DATA_RECEIVED, H2R_NAMES };
static const char *const h2r_names[H2R_NAMES] = {"_h_events", "_h_failed", "data_received"};

typedef struct {
    PyObject_HEAD
    char *buf;
    PyObject *view;   /* a writable memoryview of buf: read_buffer */
    PyObject *codec;  /* the connection's codec (any Codec; C reads only an H2Client) */
    unsigned long long reads; /* reads so far (the pool's liveness check compares them) */
    PyObject *names[H2R_NAMES];
} H2Reader;

static PyObject *H2R_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    (void)args;
    (void)kwds;
    H2Reader *self = (H2Reader *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    if (vxb_reader_buffer(H2R_READ_BUFFER, &self->buf, &self->view) < 0 ||
        vxb_intern(self->names, h2r_names, H2R_NAMES) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static int H2R_traverse(H2Reader *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->view);
    Py_VISIT(self->codec);
    return 0;
}

static int H2R_clear(H2Reader *self)
{
    Py_CLEAR(self->view);
    Py_CLEAR(self->codec);
    return 0;
}

static void H2R_dealloc(H2Reader *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    H2R_clear(self);
    for (int i = 0; i < H2R_NAMES; i++)
        Py_CLEAR(self->names[i]);
    PyMem_Free(self->buf); /* after the view, as H1Reader's (see H1R_dealloc) */
    tp->tp_free(self);
    Py_DECREF(tp);
}

/* Call the subclass's method `which` with one argument (stolen). */
static PyObject *h2r_call(H2Reader *self, int which, PyObject *arg)
{
    if (arg == NULL)
        return NULL;
    PyObject *r = PyObject_CallMethodOneArg((PyObject *)self, self->names[which], arg);
    Py_DECREF(arg);
    return r;
}

static PyObject *H2R_get_buffer(H2Reader *self, PyObject *sizehint)
{
    (void)sizehint;
    return Py_NewRef(self->view);
}

static PyObject *H2R_buffer_updated(H2Reader *self, PyObject *arg)
{
    size_t n;
    if (vxb_reader_nbytes(arg, H2R_READ_BUFFER, &n) < 0)
        return NULL;
    PyObject *codec = self->codec;
    if (codec == NULL || Py_TYPE(codec)->tp_dealloc != (destructor)H2_dealloc)
        return h2r_call(self, H2R_DATA_RECEIVED,
                        PyBytes_FromStringAndSize(self->buf, (Py_ssize_t)n));
    H2Object *h2 = (H2Object *)Py_NewRef(codec); /* Python below may drop the connection's */
    self->reads++;
    PyObject *r, *events = h2_receive_bytes(h2, (const uint8_t *)self->buf, n, true);
    if (events == NULL) {
        if (h2->error_class == NULL || !PyErr_ExceptionMatches(h2->error_class)) {
            r = NULL;
        } else {
            PyObject *type, *exc, *tb;
            PyErr_Fetch(&type, &exc, &tb); /* 3.11's spelling of PyErr_GetRaisedException */
            PyErr_NormalizeException(&type, &exc, &tb);
            Py_XDECREF(type);
            Py_XDECREF(tb);
            r = h2r_call(self, H2R_FAILED, exc);
        }
    } else if (PyList_GET_SIZE(events) == 0 && !vx_h2_has_output(h2->c)) {
        Py_DECREF(events); /* all of it went to clients from C: nothing for Python */
        r = Py_NewRef(Py_None);
    } else {
        r = h2r_call(self, H2R_EVENTS, events);
    }
    Py_DECREF(h2);
    return r;
}

static PyMethodDef H2R_methods[] = {
    {"get_buffer", (PyCFunction)H2R_get_buffer, METH_O,
     "get_buffer(sizehint, /) -> memoryview: the read buffer (BufferedProtocol)."},
    {"buffer_updated", (PyCFunction)H2R_buffer_updated, METH_O,
     "buffer_updated(nbytes, /): the first nbytes of the read buffer through the codec."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef H2R_members[] = {
    {"read_buffer", T_OBJECT_EX, offsetof(H2Reader, view), READONLY,
     "The buffer uvloop reads into (a writable memoryview)."},
    {"codec", T_OBJECT, offsetof(H2Reader, codec), 0, "The connection's codec."},
    {"reads", T_ULONGLONG, offsetof(H2Reader, reads), 0, "Reads so far."},
    {NULL, 0, 0, 0, NULL},
};

PyDoc_STRVAR(H2R_doc, "H2Reader()\n\nThe native reading half of an HTTP/2 upstream connection "
                      "(see velox/egress/h2conn.py).");

static PyType_Slot H2R_slots[] = {
    {Py_tp_doc, (void *)H2R_doc},
    {Py_tp_new, H2R_new},
    {Py_tp_dealloc, H2R_dealloc},
    {Py_tp_traverse, H2R_traverse},
    {Py_tp_clear, H2R_clear},
    {Py_tp_methods, H2R_methods},
    {Py_tp_members, H2R_members},
    {0, NULL},
};

static PyType_Spec H2R_spec = {
    .name = "velox._native.H2Reader",
    .basicsize = sizeof(H2Reader),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .slots = H2R_slots,
};

/* ---------------------------------------------------------------- init */

/* Mirrors of the core's header, so Python code never hard-codes the numbers. */
static const vxb_int_const constants[] = {
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

int vxb_h2_exec(PyObject *module, module_state *st)
{
    PyObject *reader = PyType_FromModuleAndSpec(module, &H2R_spec, NULL);
    if (reader == NULL)
        return -1;
    int rc = PyModule_AddType(module, (PyTypeObject *)reader);
    Py_DECREF(reader);
    if (rc < 0 || vxb_add_type(module, &H2_spec, &st->h2_type) < 0 ||
        vxb_add_ints(module, constants, sizeof constants / sizeof constants[0]) < 0)
        return -1;
    return 0;
}
