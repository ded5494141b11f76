#include "bind.h"
#include "vx_reqhead.h"

/* ---------------------------------------------------------------- HTTP/1.1 request heads */

/* Fields on the C stack; a head with more falls back to httptools, where ingress answers 431:
 * this is ingress's cap on header fields (REQHEAD_FIELDS). The SDK sends 16; a 54 KB head of
 * 5,500 tiny fields cost about 65 times a normal request before the cap. */
#define RH_FIELDS 100
/* An incomplete head this long falls back (see vx_reqhead.h: bounds rescanning). */
#define RH_PARTIAL 4096
/* Field names that clients (the openai SDKs, curl, proxies) send on nearly every request: one
 * shared bytes object each instead of a new one per request and field (all 15 of the SDK's
 * names), so a queued request holds less. The time is within this host's noise either way
 * (about 3.2 us per SDK head for the whole call, of which the C parse is 0.75). */
static const char *const RH_NAMES[] = {
    "host", "accept-encoding", "connection", "accept", "content-type", "user-agent",
    "x-stainless-lang", "x-stainless-package-version", "x-stainless-os", "x-stainless-arch",
    "x-stainless-runtime", "x-stainless-runtime-version", "authorization",
    "x-stainless-retry-count", "x-stainless-read-timeout", "content-length", "expect",
    "x-forwarded-for", "openai-organization",
};
#define RH_NNAMES (sizeof RH_NAMES / sizeof RH_NAMES[0])

/* The name of a field as a lower-case bytes object: a shared one if it is a common name. */
static PyObject *rh_name(module_state *st, const char *name, size_t len)
{
    for (size_t i = 0; i < RH_NNAMES; i++) {
        PyObject *known = st->names[i];
        if ((size_t)PyBytes_GET_SIZE(known) != len)
            continue;
        const char *k = PyBytes_AS_STRING(known);
        size_t j = 0;
        while (j < len && (name[j] | (name[j] >= 'A' && name[j] <= 'Z' ? 0x20 : 0)) == k[j])
            j++;
        if (j == len) {
            Py_INCREF(known);
            return known;
        }
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)len);
    if (out != NULL)
        vx_reqhead_lower(PyBytes_AS_STRING(out), name, len);
    return out;
}

PyDoc_STRVAR(reqhead_doc,
             "reqhead(buf, start, max_header_bytes, /) -> tuple | None | False\n\n"
             "Parse the request head starting at buf[start] (bytes-like) with native/vx_reqhead.c.\n"
             "None: a valid beginning, call again with more bytes. False: not in the subset the\n"
             "parser accepts (or too large): hand the bytes to httptools. Otherwise\n"
             "(method, target, headers, content_length, authorization, expect_continue,\n"
             " keep_alive, http10, end, traceparent): method one shared bytes object per method,\n"
             "headers a list of (lower-cased name, value) bytes tuples in order, content_length -1\n"
             "when absent, authorization the one Authorization value (the same object as in\n"
             "headers) or None (a head with two is False), end the offset just past the blank\n"
             "line, traceparent the one traceparent value (the same object as in headers), None\n"
             "when absent, b'' when given more than once (W3C Trace Context: a new trace).\n"
             "With a fourth argument `drop` (a set of lower-case names), an eleventh item: the\n"
             "headers' tuples whose name is not in `drop` (the upstream's share, auth.Auth's\n"
             "client_headers done in the same pass), or None when a Connection header lists\n"
             "more than keep-alive / close (the caller then filters in Python).");

static PyObject *native_reqhead(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t start, limit;
    int overflow;
    if (check_nargs("reqhead", nargs, 3, 4) < 0 || to_i64(args[1], &start, &overflow) < 0 ||
        to_i64(args[2], &limit, &overflow) < 0)
        return NULL;
    PyObject *drop = nargs > 3 ? args[3] : NULL;
    if (drop != NULL && !PyAnySet_Check(drop)) {
        PyErr_SetString(PyExc_TypeError, "reqhead: drop must be a set");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    if (start < 0 || start > (int64_t)view.len) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "reqhead: start outside the buffer");
        return NULL;
    }
    vx_rh_field fields[RH_FIELDS];
    vx_reqhead h;
    const char *base = (const char *)view.buf + start;
    int rc = vx_reqhead_parse(base, (size_t)(view.len - start), fields, RH_FIELDS,
                              limit < 0 ? 0 : (size_t)limit, RH_PARTIAL, &h);
    if (rc != VX_RH_DONE) {
        PyBuffer_Release(&view);
        if (rc == VX_RH_MORE)
            Py_RETURN_NONE;
        Py_RETURN_FALSE;
    }
    module_state *st = PyModule_GetState(module);
    PyObject *headers = PyList_New((Py_ssize_t)h.nfields);
    PyObject *target = NULL, *authorization = Py_None, *result = NULL, *upstream = NULL;
    /* Borrowed like authorization; b"" for a repeated field (rare: owned, `many`). */
    PyObject *traceparent = Py_None, *many = NULL;
    int listed = 0; /* a Connection header names other fields: no upstream list */
    if (headers == NULL)
        goto done;
    if (h.traceparent == VX_RH_MANY) {
        if ((many = PyBytes_FromStringAndSize(NULL, 0)) == NULL)
            goto done;
        traceparent = many;
    }
    if (drop != NULL && (upstream = PyList_New(0)) == NULL)
        goto done;
    for (size_t i = 0; i < h.nfields; i++) {
        const vx_rh_field *f = &fields[i];
        PyObject *name = rh_name(st, base + f->name_off, f->name_len);
        if (name == NULL)
            goto done;
        PyObject *value = PyBytes_FromStringAndSize(base + f->value_off, (Py_ssize_t)f->value_len);
        if (value == NULL) {
            Py_DECREF(name);
            goto done;
        }
        PyObject *pair = PyTuple_New(2);
        if (pair == NULL) {
            Py_DECREF(name);
            Py_DECREF(value);
            goto done;
        }
        PyTuple_SET_ITEM(pair, 0, name);
        PyTuple_SET_ITEM(pair, 1, value); /* both stolen */
        PyList_SET_ITEM(headers, (Py_ssize_t)i, pair);
        if ((int)i == h.authorization)
            authorization = value; /* borrowed: the list holds it */
        else if ((int)i == h.traceparent)
            traceparent = value;
        if (upstream != NULL) {
            int dropped = PySet_Contains(drop, name);
            if (dropped < 0)
                goto done;
            if (!dropped) {
                if (PyList_Append(upstream, pair) < 0)
                    goto done;
            } else if (f->name_len == 10 && memcmp(PyBytes_AS_STRING(name), "connection", 10) == 0 &&
                       !vx_reqhead_plain_connection(base + f->value_off, f->value_len)) {
                listed = 1;
            }
        }
    }
    target = PyBytes_FromStringAndSize(base + h.target_off, (Py_ssize_t)h.target_len);
    if (target == NULL)
        goto done;
    if (upstream == NULL)
        result = Py_BuildValue("(OOOLOOOOnO)", st->methods[h.method], target, headers,
                               (long long)h.content_length, authorization,
                               h.expect_continue ? Py_True : Py_False,
                               h.keep_alive ? Py_True : Py_False, h.http10 ? Py_True : Py_False,
                               (Py_ssize_t)(start + (int64_t)h.head_len), traceparent);
    else
        result = Py_BuildValue("(OOOLOOOOnOO)", st->methods[h.method], target, headers,
                               (long long)h.content_length, authorization,
                               h.expect_continue ? Py_True : Py_False,
                               h.keep_alive ? Py_True : Py_False, h.http10 ? Py_True : Py_False,
                               (Py_ssize_t)(start + (int64_t)h.head_len), traceparent,
                               listed ? Py_None : upstream);
done:
    Py_XDECREF(many);
    Py_XDECREF(upstream);
    Py_XDECREF(target);
    Py_XDECREF(headers); /* a partly filled list holds NULLs: list dealloc skips them */
    PyBuffer_Release(&view);
    return result;
}

/* ---------------------------------------------------------------- init */

static PyMethodDef functions[] = {
    {"reqhead", FASTCALL(native_reqhead), METH_FASTCALL, reqhead_doc},
    {NULL, NULL, 0, NULL},
};

static const vxb_int_const constants[] = {
    {"REQHEAD_PARTIAL", RH_PARTIAL},
    {"REQHEAD_FIELDS", RH_FIELDS},
};

int vxb_reqhead_exec(PyObject *module, module_state *st)
{
    for (int m = 0; m < VX_RH_METHODS; m++) {
        size_t len;
        const char *name = vx_reqhead_method_name(m, &len);
        st->methods[m] = PyBytes_FromStringAndSize(name, (Py_ssize_t)len);
        if (st->methods[m] == NULL)
            return -1;
    }
    _Static_assert(RH_NNAMES == sizeof st->names / sizeof st->names[0], "RH_NAMES");
    for (size_t i = 0; i < RH_NNAMES; i++) {
        st->names[i] = PyBytes_FromString(RH_NAMES[i]);
        if (st->names[i] == NULL)
            return -1;
    }
    if (vxb_add_ints(module, constants, sizeof constants / sizeof constants[0]) < 0 ||
        PyModule_AddFunctions(module, functions) < 0)
        return -1;
    return 0;
}
