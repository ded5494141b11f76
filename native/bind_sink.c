#include "bind_sink.h"

#include <limits.h>
#include <string.h>
#include <time.h>

static const char *const sink_names[SN_NAMES] = {
    "_out", "_q", "write_paused", "closed", "_out_head", "pending", "skipping", "events",
    "relayed", "_stream_bytes", "tail", "last_activity", "withheld", "strip"};

int vxb_sink_names_init(vxb_sink_names *names)
{
    if (vxb_intern(names->name, sink_names, SN_NAMES) < 0)
        return -1;
    names->two_lf = PyBytes_FromStringAndSize("\n\n", 2);
    return names->two_lf == NULL ? -1 : 0;
}

void vxb_sink_names_clear(vxb_sink_names *names)
{
    for (int i = 0; i < SN_NAMES; i++)
        Py_CLEAR(names->name[i]);
    Py_CLEAR(names->two_lf);
}

/* Which of the sink's objects each attribute is read or written on. */
static const int sink_owner[SN_NAMES] = {
    [SN_OUT] = VXS_CONN,          [SN_Q] = VXS_CONN,          [SN_WRITE_PAUSED] = VXS_CONN,
    [SN_CLOSED] = VXS_CONN,       [SN_OUT_HEAD] = VXS_CONN,   [SN_PENDING] = VXS_SSE,
    [SN_SKIPPING] = VXS_SSE,      [SN_EVENTS] = VXS_SSE,      [SN_RELAYED] = VXS_SSE,
    [SN_STREAM_BYTES] = VXS_CONN, [SN_TAIL] = VXS_EXCHANGE,   [SN_LAST_ACTIVITY] = VXS_ATTEMPT,
    [SN_WITHHELD] = VXS_ATTEMPT,  [SN_STRIP] = VXS_SSE};

/* The offset of attribute `name` in o when o's class keeps it in a writable object slot
 * (a __slots__ member descriptor) and reads and writes attributes the generic way (no
 * __getattribute__ or __setattr__ of its own), else -1. */
static Py_ssize_t sink_slot(PyObject *o, PyObject *name)
{
    PyTypeObject *tp = Py_TYPE(o);
    if (tp->tp_getattro != PyObject_GenericGetAttr || tp->tp_setattro != PyObject_GenericSetAttr)
        return -1;
    PyObject *d = _PyType_Lookup(tp, name); /* borrowed; sets no error */
    if (d == NULL || !Py_IS_TYPE(d, &PyMemberDescr_Type))
        return -1;
    PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
    if (m->type != T_OBJECT_EX || (m->flags & READONLY))
        return -1;
    return m->offset;
}

/* Attribute `name` of its object (a new reference), or NULL with an error. A slot not set
 * yet takes the generic path, which raises AttributeError as it would. */
static PyObject *sink_get(const vxb_sink *sink, const vxb_sink_names *names, int name)
{
    PyObject *o = sink->o[sink_owner[name]];
    Py_ssize_t off = sink->off[name];
    if (off >= 0) {
        PyObject *v = *(PyObject **)((char *)o + off);
        if (v != NULL)
            return Py_NewRef(v);
    }
    return PyObject_GetAttr(o, names->name[name]);
}

/* Set attribute `name` of its object to v (PyMember_SetOne's work for a slot). 0 or -1. */
static int sink_put(const vxb_sink *sink, const vxb_sink_names *names, int name, PyObject *v)
{
    PyObject *o = sink->o[sink_owner[name]];
    Py_ssize_t off = sink->off[name];
    if (off < 0)
        return PyObject_SetAttr(o, names->name[name], v);
    PyObject **slot = (PyObject **)((char *)o + off);
    PyObject *old = *slot;
    *slot = Py_NewRef(v);
    Py_XDECREF(old); /* last: it may run a finaliser */
    return 0;
}

int vxb_sink_set(vxb_sink *sink, const vxb_sink_names *names, PyObject *const *args)
{
    int chunked = PyObject_IsTrue(args[VXS_N]);
    if (chunked < 0)
        return -1;
    int strip = 0;
    if (args[VXS_SSE] != Py_None) {
        PyObject *v = PyObject_GetAttr(args[VXS_SSE], names->name[SN_STRIP]);
        if (v == NULL)
            return -1;
        strip = PyObject_IsTrue(v);
        Py_DECREF(v);
        if (strip < 0)
            return -1;
    }
    vxb_sink_clear(sink);
    for (int i = 0; i < VXS_N; i++)
        sink->o[i] = Py_NewRef(args[i]);
    for (int i = 0; i < SN_NAMES; i++) {
        PyObject *o = sink->o[sink_owner[i]];
        sink->off[i] = o == Py_None ? -1 : sink_slot(o, names->name[i]);
    }
    sink->chunked = chunked;
    sink->strip = strip;
    return 0;
}

void vxb_sink_clear(vxb_sink *sink)
{
    for (int i = 0; i < VXS_N; i++)
        Py_CLEAR(sink->o[i]);
}

int vxb_sink_traverse(const vxb_sink *sink, visitproc visit, void *arg)
{
    for (int i = 0; i < VXS_N; i++)
        Py_VISIT(sink->o[i]);
    return 0;
}

int vxb_add(PyObject *o, PyObject *name, Py_ssize_t n)
{
    PyObject *v = PyObject_GetAttr(o, name);
    if (v == NULL)
        return -1;
    PyObject *d = PyLong_FromSsize_t(n);
    PyObject *sum = d == NULL ? NULL : PyNumber_Add(v, d);
    Py_DECREF(v);
    Py_XDECREF(d);
    if (sum == NULL)
        return -1;
    int rc = PyObject_SetAttr(o, name, sum);
    Py_DECREF(sum);
    return rc;
}

/* 1 when attribute `name` is `want` (an identity test), 0 when not, -1 on error. */
static int sink_is(const vxb_sink *sink, const vxb_sink_names *names, int name, PyObject *want)
{
    PyObject *v = sink_get(sink, names, name);
    if (v == NULL)
        return -1;
    int rc = v == want;
    Py_DECREF(v);
    return rc;
}

/* 1 when attribute `name` is an empty bytes object. */
static int sink_empty(const vxb_sink *sink, const vxb_sink_names *names, int name)
{
    PyObject *v = sink_get(sink, names, name);
    if (v == NULL)
        return -1;
    int rc = PyBytes_Check(v) && PyBytes_GET_SIZE(v) == 0;
    Py_DECREF(v);
    return rc;
}

/* Add n to the int attribute `name` (an exact int in range without PyNumber_Add). 0 or -1. */
static int sink_add(const vxb_sink *sink, const vxb_sink_names *names, int name, Py_ssize_t n)
{
    PyObject *v = sink_get(sink, names, name);
    if (v == NULL)
        return -1;
    PyObject *sum = NULL;
    if (PyLong_CheckExact(v)) {
        int overflow;
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (!overflow && x >= 0 && x < LLONG_MAX - n)
            sum = PyLong_FromLongLong(x + n);
    }
    if (sum == NULL && !PyErr_Occurred()) {
        PyObject *d = PyLong_FromSsize_t(n);
        sum = d == NULL ? NULL : PyNumber_Add(v, d);
        Py_XDECREF(d);
    }
    Py_DECREF(v);
    if (sum == NULL)
        return -1;
    int rc = sink_put(sink, names, name, sum);
    Py_DECREF(sum);
    return rc;
}

/* Events ("\n\n"-separated, counted as bytes.count does) in p[0 .. n): memchr to each LF
 * (an event has one LF pair and few others). */
static Py_ssize_t sink_events(const char *p, size_t n)
{
    Py_ssize_t k = 0;
    const char *end = p + n, *q = p;
    while (end - q >= 2 && (q = memchr(q, '\n', (size_t)(end - q - 1))) != NULL) {
        if (q[1] == '\n') {
            k++;
            q += 2;
        } else {
            q++;
        }
    }
    return k;
}

/* The first occurrence of needle[0 .. m) in p[from .. n), or -1: memchr to each place its
 * byte needle[k] could be (k picked rare in event text: 'u' of "usage", LF), then memcmp. Not
 * on the needle's first byte: '"' is every tenth byte of a JSON event, and the memcmp per
 * quote was 14 % of a socket-free run; nor memmem, whose setup per call (glibc's shift table)
 * made it a third of a run whose every event carries ',"usage":null'. */
static Py_ssize_t sink_find(const char *p, size_t n, size_t from, const char *needle, size_t m,
                            size_t k)
{
    const char *end = p + n, *q = p + from + k;
    while (q < end && (q = memchr(q, needle[k], (size_t)(end - q))) != NULL) {
        const char *at = q - k;
        if ((size_t)(end - at) < m)
            break;
        if (memcmp(at, needle, m) == 0)
            return at - p;
        q++;
    }
    return -1;
}

/* What the meter's feed (velox.relay.usage.SSEUsage.feed, with nothing pending) makes of the
 * read p[0 .. n) when it is one of its two plain cases: 1 with *cut = -1 (whole events without
 * "usage": passed as is), 1 with *cut the offset of 13 bytes to leave out (one event whose
 * ',"usage":null' the gateway's own include_usage added), 0 for anything else. Without a meter
 * (metered 0) any whole events pass as they are. The twin: velox.relay.usage.plain_piece. */
static int sink_plain(const char *p, size_t n, int metered, int strip, Py_ssize_t *cut)
{
    *cut = -1;
    if (n < 2 || p[n - 2] != '\n' || p[n - 1] != '\n')
        return 0;
    Py_ssize_t usage = metered ? sink_find(p, n, 0, "\"usage\"", 7, 1) : -1;
    if (usage < 0)
        return 1;
    if (!strip || sink_find(p, n, 0, "\n\n", 2, 0) != (Py_ssize_t)n - 2) /* one event only */
        return 0;
    /* ',"usage":null' holds '"usage"' at 1: it cannot start before the first one, less 1. */
    *cut = sink_find(p, n, usage ? (size_t)usage - 1 : 0, ",\"usage\":null", 13, 2);
    return *cut >= 0;
}

/* Whether the client connection writes at once (nothing queued, its head written, reading,
 * open) and the meter holds no unfinished event: 1, 0 or -1. */
static int sink_ready(const vxb_sink *sink, const vxb_sink_names *names)
{
    int ok;
    if ((ok = sink_is(sink, names, SN_OUT, Py_None)) != 1 ||
        (ok = sink_is(sink, names, SN_Q, Py_None)) != 1 ||
        (ok = sink_is(sink, names, SN_WRITE_PAUSED, Py_False)) != 1 ||
        (ok = sink_is(sink, names, SN_CLOSED, Py_False)) != 1 ||
        (ok = sink_empty(sink, names, SN_OUT_HEAD)) != 1)
        return ok;
    if (sink->o[VXS_SSE] != Py_None &&
        ((ok = sink_empty(sink, names, SN_PENDING)) != 1 ||
         (ok = sink_is(sink, names, SN_SKIPPING, Py_False)) != 1))
        return ok;
    return 1;
}

/* m as a chunk-size line ("%zx\r\n", as h1write.chunks writes it) at out: its length. By hand:
 * snprintf's format machinery was 1 % of a streaming worker's samples. */
static int sink_hexline(char *out, size_t m)
{
    char digits[2 * sizeof m];
    int k = 0;
    do {
        digits[k++] = "0123456789abcdef"[m & 15];
        m >>= 4;
    } while (m);
    for (int i = 0; i < k; i++)
        out[i] = digits[k - 1 - i];
    out[k] = '\r';
    out[k + 1] = '\n';
    return k + 2;
}

/* The piece p[0 .. n) without its cut, framed as h1write.chunks frames one when chunked. */
static PyObject *sink_frame(const char *p, size_t n, Py_ssize_t cut, int chunked)
{
    size_t m = cut < 0 ? n : n - 13;
    char line[2 * sizeof m + 2];
    int hl = chunked ? sink_hexline(line, m) : 0;
    PyObject *frame = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)((size_t)hl + m + (chunked ? 2 : 0)));
    if (frame == NULL)
        return NULL;
    char *out = PyBytes_AS_STRING(frame);
    memcpy(out, line, (size_t)hl);
    if (cut < 0) {
        memcpy(out + hl, p, n);
    } else {
        memcpy(out + hl, p, (size_t)cut);
        memcpy(out + hl + cut, p + cut + 13, n - (size_t)cut - 13);
    }
    if (chunked)
        memcpy(out + hl + m, "\r\n", 2);
    return frame;
}

/* After a write: the bookkeeping the Python path keeps (the attempt's activity, the
 * connection's byte count for the access log, the exchange's tail, the meter's counts). */
static int sink_count(const vxb_sink *sink, const vxb_sink_names *names, const char *p, size_t n,
                      Py_ssize_t cut, Py_ssize_t total)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* time.monotonic()'s clock on Linux */
    PyObject *now = PyFloat_FromDouble((double)ts.tv_sec + (double)ts.tv_nsec * 1e-9);
    if (now == NULL)
        return -1;
    int rc = sink_put(sink, names, SN_LAST_ACTIVITY, now);
    Py_DECREF(now);
    if (rc < 0 || sink_add(sink, names, SN_STREAM_BYTES, total) < 0 ||
        sink_put(sink, names, SN_TAIL, names->two_lf) < 0)
        return -1;
    size_t m = cut < 0 ? n : n - 13;
    if (sink->o[VXS_SSE] != Py_None &&
        (sink_add(sink, names, SN_EVENTS, cut < 0 ? sink_events(p, n) : 1) < 0 ||
         sink_add(sink, names, SN_RELAYED, (Py_ssize_t)m) < 0))
        return -1;
    return 0;
}

int vxb_sink_write(const vxb_sink *sink, const vxb_sink_names *names, const char *p, size_t n,
                   int *paused)
{
    *paused = 0;
    Py_ssize_t cut;
    if (sink->o[VXS_CONN] == NULL || n > VXB_SINK_MAX ||
        !sink_plain(p, n, sink->o[VXS_SSE] != Py_None, sink->strip, &cut))
        return 0;
    int ok = sink_ready(sink, names);
    if (ok != 1)
        return ok;
    PyObject *frame = sink_frame(p, n, cut, sink->chunked);
    if (frame == NULL)
        return -1;
    Py_ssize_t total = PyBytes_GET_SIZE(frame);
    PyObject *r = PyObject_CallOneArg(sink->o[VXS_WRITE], frame);
    Py_DECREF(frame);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    if (sink->o[VXS_CONN] == NULL) /* the write's callbacks ended the stream (not uvloop's) */
        return 1;
    if (sink_count(sink, names, p, n, cut, total) < 0)
        return -1;
    /* The write may have filled the client's buffer (pause_writing ran inside it): egress
     * withholds, as after the Python path's send. */
    if ((ok = sink_is(sink, names, SN_WRITE_PAUSED, Py_True)) < 0)
        return -1;
    *paused = ok;
    return 1;
}

int vxb_reader_buffer(size_t n, char **buf, PyObject **view)
{
    if ((*buf = PyMem_Malloc(n)) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *view = PyMemoryView_FromMemory(*buf, (Py_ssize_t)n, PyBUF_WRITE);
    return *view == NULL ? -1 : 0;
}

int vxb_reader_nbytes(PyObject *arg, size_t max, size_t *n)
{
    Py_ssize_t v = PyLong_AsSsize_t(arg);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (v < 0 || (size_t)v > max) {
        PyErr_SetString(PyExc_ValueError, "nbytes out of the read buffer");
        return -1;
    }
    *n = (size_t)v;
    return 0;
}

int vxb_intern(PyObject **out, const char *const *names, int n)
{
    for (int i = 0; i < n; i++)
        if ((out[i] = PyUnicode_InternFromString(names[i])) == NULL)
            return -1;
    return 0;
}

/* sink_piece(data, metered, strip, /) -> bytes | None: the piece the direct path would write
 * for one read (unframed), None when it leaves the read to the Python path; for the
 * differential test against velox.relay.usage.plain_piece. */
static PyObject *sink_piece(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 3 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "sink_piece(data: bytes, metered, strip)");
        return NULL;
    }
    int metered = PyObject_IsTrue(args[1]), strip = PyObject_IsTrue(args[2]);
    if (metered < 0 || strip < 0)
        return NULL;
    const char *p = PyBytes_AS_STRING(args[0]);
    size_t n = (size_t)PyBytes_GET_SIZE(args[0]);
    Py_ssize_t cut;
    if (n > VXB_SINK_MAX || !sink_plain(p, n, metered, strip, &cut))
        Py_RETURN_NONE;
    return sink_frame(p, n, cut, 0);
}

static PyMethodDef sink_functions[] = {
    {"sink_piece", FASTCALL(sink_piece), METH_FASTCALL,
     "sink_piece(data, metered, strip, /) -> bytes | None: what the direct path writes of one "
     "streamed read (unframed), or None when the Python path reads it."},
    {NULL, NULL, 0, NULL},
};

int vxb_sink_exec(PyObject *module, module_state *st)
{
    (void)st;
    return PyModule_AddFunctions(module, sink_functions);
}
