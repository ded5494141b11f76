#include "bind.h"
#include "vx_http1.h"

/* ---------------------------------------------------------------- HTTP/1.1 response bytes */

/* Fields on the C stack up to this many (a response has about ten); more are allocated. */
#define H1_STACK_FIELDS 32

/* The (name, value) pairs of a sequence (list or tuple) of 2-tuples of bytes, pointing into
 * the bytes objects (which the sequence keeps alive for the call). Returns the count, or -1
 * with TypeError set. *heap is set when the array had to be allocated (PyMem_Free it). */
static Py_ssize_t h1_fields(PyObject *seq, vx_h1_field *stack, vx_h1_field **out)
{
    *out = stack;
    if (!PyList_Check(seq) && !PyTuple_Check(seq)) {
        PyErr_Format(PyExc_TypeError, "headers must be a list or tuple of (name, value) bytes "
                     "pairs, got %.100s", Py_TYPE(seq)->tp_name);
        return -1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    vx_h1_field *f = stack;
    if (n > H1_STACK_FIELDS) {
        if ((size_t)n > VX_H1_MAX_LEN / 4) {
            PyErr_SetString(PyExc_ValueError, "too many headers");
            return -1;
        }
        f = PyMem_Malloc((size_t)n * sizeof *f);
        if (f == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        *out = f;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = items[i];
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2 ||
            !PyBytes_Check(PyTuple_GET_ITEM(pair, 0)) || !PyBytes_Check(PyTuple_GET_ITEM(pair, 1))) {
            PyErr_Format(PyExc_TypeError, "header %zd must be a (name, value) tuple of bytes, "
                         "got %.100s", i, Py_TYPE(pair)->tp_name);
            if (f != stack)
                PyMem_Free(f);
            *out = stack;
            return -1;
        }
        PyObject *name = PyTuple_GET_ITEM(pair, 0), *value = PyTuple_GET_ITEM(pair, 1);
        f[i].name = PyBytes_AS_STRING(name);
        f[i].name_len = (size_t)PyBytes_GET_SIZE(name);
        f[i].value = PyBytes_AS_STRING(value);
        f[i].value_len = (size_t)PyBytes_GET_SIZE(value);
    }
    return n;
}

/* A body given as one bytes-like object or as a list/tuple of them: the views, their count
 * (at most H1_STACK_FIELDS pieces on the stack, more allocated) and total length. Every view
 * in *views must be released with h1_release_body, also after an error (count says how many
 * were taken). */
typedef struct {
    Py_buffer stack[H1_STACK_FIELDS];
    Py_buffer *views;
    Py_ssize_t count;
    size_t total;
} h1_body;

static void h1_release_body(h1_body *b)
{
    for (Py_ssize_t i = 0; i < b->count; i++)
        PyBuffer_Release(&b->views[i]);
    if (b->views != b->stack)
        PyMem_Free(b->views);
    b->views = b->stack;
    b->count = 0;
}

static int h1_get_body(PyObject *obj, h1_body *b)
{
    b->views = b->stack;
    b->count = 0;
    b->total = 0;
    int seq = PyList_Check(obj) || PyTuple_Check(obj);
    Py_ssize_t n = seq ? PySequence_Fast_GET_SIZE(obj) : 1;
    if (seq) {
        if (n > H1_STACK_FIELDS) {
            b->views = PyMem_Malloc((size_t)n * sizeof(Py_buffer));
            if (b->views == NULL) {
                b->views = b->stack;
                PyErr_NoMemory();
                return -1;
            }
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        /* Re-read on every pass: getting a buffer may run Python code (a __buffer__ method)
         * that shrinks the list under us. */
        if (seq && i >= PySequence_Fast_GET_SIZE(obj)) {
            PyErr_SetString(PyExc_RuntimeError, "body list changed size while being read");
            return -1;
        }
        PyObject *item = seq ? PySequence_Fast_GET_ITEM(obj, i) : obj;
        if (PyObject_GetBuffer(item, &b->views[i], PyBUF_SIMPLE) < 0)
            return -1;
        b->count = i + 1;
        b->total += (size_t)b->views[i].len;
        if (b->total >= VX_H1_MAX_LEN) {
            PyErr_SetString(PyExc_ValueError, "body too large");
            return -1;
        }
    }
    return 0;
}

static int h1_flags(PyObject *o, unsigned *flags)
{
    int overflow;
    int64_t v;
    if (to_i64(o, &v, &overflow) < 0)
        return -1;
    if (overflow || v < 0 || v > (int64_t)(VX_H1_LENGTH | VX_H1_CHUNKED | VX_H1_CLOSE)) {
        PyErr_Format(PyExc_ValueError, "flags must be a combination of H1_LENGTH, H1_CHUNKED "
                     "and H1_CLOSE, got %R", o);
        return -1;
    }
    *flags = (unsigned)v;
    return 0;
}

PyDoc_STRVAR(h1_response_doc,
             "h1_response(status_line, headers, body, flags, /) -> bytes\n\n"
             "One HTTP/1.1 response: status_line (bytes, with its CRLF), then with H1_LENGTH\n"
             "`content-length: <len(body)>`, the headers (a list or tuple of (name, value)\n"
             "bytes pairs, in order), `transfer-encoding: chunked` with H1_CHUNKED,\n"
             "`connection: close` with H1_CLOSE, the blank line, and body: a bytes-like\n"
             "object, a list or tuple of them (joined), or None for a head only (a HEAD\n"
             "answer: pass the body's length with a head-only call via h1_head).");

static PyObject *h1_build(PyObject *status, PyObject *headers, PyObject *body_obj,
                          unsigned flags, int have_length, uint64_t length)
{
    if (!PyBytes_Check(status)) {
        PyErr_Format(PyExc_TypeError, "status_line must be bytes, got %.100s",
                     Py_TYPE(status)->tp_name);
        return NULL;
    }
    /* The body first: getting its buffers may run Python code, and the field pointers taken
     * next must not outlive a change to the headers list. */
    vx_h1_field stack[H1_STACK_FIELDS], *fields = stack;
    PyObject *out = NULL;
    h1_body body;
    body.views = body.stack;
    body.count = 0;
    body.total = 0;
    if (body_obj != Py_None && h1_get_body(body_obj, &body) < 0)
        goto done;
    Py_ssize_t n = h1_fields(headers, stack, &fields);
    if (n < 0)
        goto done;
    if (!have_length)
        length = body.total;
    size_t status_len = (size_t)PyBytes_GET_SIZE(status);
    size_t head = vx_h1_head_size(status_len, fields, (size_t)n, length, flags);
    if (head >= VX_H1_MAX_LEN || body.total >= VX_H1_MAX_LEN - head) {
        PyErr_SetString(PyExc_ValueError, "response too large");
        goto done;
    }
    out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(head + body.total));
    if (out == NULL)
        goto done;
    char *p = vx_h1_write_head(PyBytes_AS_STRING(out), PyBytes_AS_STRING(status), status_len,
                               fields, (size_t)n, length, flags);
    for (Py_ssize_t i = 0; i < body.count; i++) {
        if (body.views[i].len) {
            memcpy(p, body.views[i].buf, (size_t)body.views[i].len);
            p += body.views[i].len;
        }
    }
done:
    h1_release_body(&body);
    if (fields != stack)
        PyMem_Free(fields);
    return out;
}

static PyObject *native_h1_response(PyObject *Py_UNUSED(module), PyObject *const *args,
                                    Py_ssize_t nargs)
{
    unsigned flags;
    if (check_nargs("h1_response", nargs, 4, 4) < 0 || h1_flags(args[3], &flags) < 0)
        return NULL;
    return h1_build(args[0], args[1], args[2], flags, 0, 0);
}

PyDoc_STRVAR(h1_head_doc,
             "h1_head(status_line, headers, content_length, flags, /) -> bytes\n\n"
             "The head alone, as h1_response writes it, with `content-length: content_length`\n"
             "when flags has H1_LENGTH (a HEAD answer states the length of the body it omits).\n"
             "content_length must be in [0, 2**60).");

static PyObject *native_h1_head(PyObject *Py_UNUSED(module), PyObject *const *args,
                                Py_ssize_t nargs)
{
    unsigned flags;
    int64_t length;
    if (check_nargs("h1_head", nargs, 4, 4) < 0 || h1_flags(args[3], &flags) < 0 ||
        arg_in_range(args[2], "content_length", 0, (int64_t)VX_H1_MAX_LEN - 1, &length) < 0)
        return NULL;
    return h1_build(args[0], args[1], Py_None, flags, 1, (uint64_t)length);
}

PyDoc_STRVAR(h1_chunks_doc,
             "h1_chunks(data, last=False, /) -> bytes\n\n"
             "data (a bytes-like object, or a list or tuple of them) framed as chunks of a\n"
             "chunked body, one chunk per non-empty piece (`%x\\r\\n<piece>\\r\\n`), all in one\n"
             "bytes object; with last true the last chunk `0\\r\\n\\r\\n` follows.");

static PyObject *native_h1_chunks(PyObject *Py_UNUSED(module), PyObject *const *args,
                                  Py_ssize_t nargs)
{
    int last = 0;
    if (check_nargs("h1_chunks", nargs, 1, 2) < 0)
        return NULL;
    if (nargs == 2 && (last = PyObject_IsTrue(args[1])) < 0)
        return NULL;
    h1_body body;
    PyObject *out = NULL;
    if (h1_get_body(args[0], &body) < 0)
        goto done;
    size_t size = last ? VX_H1_LAST_CHUNK_LEN : 0;
    for (Py_ssize_t i = 0; i < body.count; i++)
        size += vx_h1_chunk_size((size_t)body.views[i].len); /* each < 2^60, at most 2^60 in all */
    if (size >= VX_H1_MAX_LEN) {
        PyErr_SetString(PyExc_ValueError, "body too large");
        goto done;
    }
    out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)size);
    if (out == NULL)
        goto done;
    char *p = PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < body.count; i++)
        p = vx_h1_write_chunk(p, body.views[i].buf, (size_t)body.views[i].len);
    if (last)
        memcpy(p, VX_H1_LAST_CHUNK, VX_H1_LAST_CHUNK_LEN);
done:
    h1_release_body(&body);
    return out;
}

PyDoc_STRVAR(h1_server_timing_doc,
             "h1_server_timing(t_received, t_popped, t_parsed, t_admitted, t_sent, t_headers, /)\n"
             "-> bytes\n\n"
             "The server-timing value of a relayed answer from its perf_counter_ns stamps: ring\n"
             "(popped - received), parse (parsed - popped), ratelimit (admitted - parsed) and\n"
             "upstream (headers - sent), each max(0, difference) // 1000 microseconds, shown as\n"
             "milliseconds with three decimals.");

static PyObject *native_h1_server_timing(PyObject *Py_UNUSED(module), PyObject *const *args,
                                         Py_ssize_t nargs)
{
    int64_t t[6];
    uint64_t us[4];
    int overflow;
    if (check_nargs("h1_server_timing", nargs, 6, 6) < 0)
        return NULL;
    for (int i = 0; i < 6; i++)
        if (to_i64(args[i], &t[i], &overflow) < 0)
            return NULL; /* out-of-range stamps clamp to INT64_MIN/MAX (overflow set) */
    static const int pairs[4][2] = {{1, 0}, {2, 1}, {3, 2}, {5, 4}};
    for (int i = 0; i < 4; i++) {
        int64_t a = t[pairs[i][0]], b = t[pairs[i][1]];
        /* a - b in unsigned arithmetic: no signed overflow whatever the stamps are. */
        us[i] = a > b ? ((uint64_t)a - (uint64_t)b) / 1000 : 0;
    }
    char buf[VX_H1_TIMING_MAX];
    size_t n = vx_h1_server_timing(buf, us[0], us[1], us[2], us[3]);
    return PyBytes_FromStringAndSize(buf, (Py_ssize_t)n);
}

/* ---------------------------------------------------------------- init */

/* Mirrors of the core's header, so Python code never hard-codes the numbers. */
static const vxb_int_const constants[] = {
    {"H1_LENGTH", VX_H1_LENGTH},
    {"H1_CHUNKED", VX_H1_CHUNKED},
    {"H1_CLOSE", VX_H1_CLOSE},
};

static PyMethodDef functions[] = {
    {"h1_response", FASTCALL(native_h1_response), METH_FASTCALL, h1_response_doc},
    {"h1_head", FASTCALL(native_h1_head), METH_FASTCALL, h1_head_doc},
    {"h1_chunks", FASTCALL(native_h1_chunks), METH_FASTCALL, h1_chunks_doc},
    {"h1_server_timing", FASTCALL(native_h1_server_timing), METH_FASTCALL, h1_server_timing_doc},
    {NULL, NULL, 0, NULL},
};

int vxb_http1_exec(PyObject *module, module_state *st)
{
    (void)st;
    if (vxb_add_ints(module, constants, sizeof constants / sizeof constants[0]) < 0 ||
        PyModule_AddFunctions(module, functions) < 0)
        return -1;
    return 0;
}
