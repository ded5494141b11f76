#include "bind.h"
#include "vx_http1.h"
#include "vx_reqhead.h"

/* ---------------------------------------------------------------- relay head */

PyDoc_STRVAR(relay_head_doc,
             "relay_head(headers, drop, t_received, t_popped, t_parsed, t_admitted, t_sent,\n"
             "           t_headers, extra, /) -> (list, bool, bytes | None)\n\n"
             "A client's response headers (velox.relay): the (name, value) tuples of the list\n"
             "`headers` whose name is not in the set `drop` nor named by a `connection` field\n"
             "(other than a plain keep-alive or close), then server-timing (formatted as\n"
             "h1_server_timing does), then the tuples of the tuple `extra`; and whether the\n"
             "first content-type of `headers` starts with text/event-stream; and the value of\n"
             "the first x-request-id field kept (None: none), so that neither the ledger row nor\n"
             "the access record searches the list again. The Python twin is\n"
             "velox.relay.answer_head.");

/* A field named `connection` (names arrive lowercased, as velox.relay compares them). */
static int rh_is_connection(PyObject *name)
{
    return PyBytes_GET_SIZE(name) == 10 && memcmp(PyBytes_AS_STRING(name), "connection", 10) == 0;
}

/* A `connection` field that names other fields (not a plain keep-alive or close). */
static int rh_lists_fields(PyObject *value)
{
    return !vx_reqhead_plain_connection(PyBytes_AS_STRING(value), (size_t)PyBytes_GET_SIZE(value));
}

/* ASCII whitespace as bytes.strip() sees it. */
static int rh_space(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

/* Add the names a Connection value lists to the set `names`, as velox.ingress.headers.connection_tokens
 * does: split at commas, ASCII whitespace stripped, ASCII-lowercased, empty ones skipped. */
static int rh_connection_tokens(PyObject *names, const char *v, Py_ssize_t n)
{
    for (Py_ssize_t at = 0; at <= n;) {
        Py_ssize_t end = at;
        while (end < n && v[end] != ',')
            end++;
        Py_ssize_t a = at, b = end;
        while (a < b && rh_space(v[a]))
            a++;
        while (b > a && rh_space(v[b - 1]))
            b--;
        if (b > a) {
            PyObject *token = PyBytes_FromStringAndSize(NULL, b - a);
            if (token == NULL)
                return -1;
            char *d = PyBytes_AS_STRING(token);
            for (Py_ssize_t k = 0; k < b - a; k++)
                d[k] = (char)(v[a + k] >= 'A' && v[a + k] <= 'Z' ? v[a + k] | 0x20 : v[a + k]);
            int added = PySet_Add(names, token);
            Py_DECREF(token);
            if (added < 0)
                return -1;
        }
        at = end + 1;
    }
    return 0;
}

/* The rare path of relay_head: the upstream sent a Connection field naming other fields. Drop
 * those of the `*kept` fields in `out` (compacted in place; the freed slots are NULL). */
static int rh_drop_listed(PyObject *headers, PyObject *out, Py_ssize_t *kept)
{
    PyObject *names = PySet_New(NULL);
    if (names == NULL)
        return -1;
    Py_ssize_t n = PyList_GET_SIZE(headers);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *field = PyList_GET_ITEM(headers, i);
        PyObject *name = PyTuple_GET_ITEM(field, 0), *value = PyTuple_GET_ITEM(field, 1);
        if (rh_is_connection(name) && rh_lists_fields(value) &&
            rh_connection_tokens(names, PyBytes_AS_STRING(value), PyBytes_GET_SIZE(value)) < 0) {
            Py_DECREF(names);
            return -1;
        }
    }
    Py_ssize_t w = 0;
    for (Py_ssize_t r = 0; r < *kept; r++) {
        PyObject *field = PyList_GET_ITEM(out, r);
        int listed = PySet_Contains(names, PyTuple_GET_ITEM(field, 0));
        if (listed < 0) { /* (bytes always hash) keep the rest as they are */
            for (; r < *kept; r++, w++) {
                PyObject *rest = PyList_GET_ITEM(out, r);
                PyList_SET_ITEM(out, r, NULL);
                PyList_SET_ITEM(out, w, rest);
            }
            *kept = w;
            Py_DECREF(names);
            return -1;
        }
        PyList_SET_ITEM(out, r, NULL);
        if (listed)
            Py_DECREF(field);
        else
            PyList_SET_ITEM(out, w++, field);
    }
    *kept = w;
    Py_DECREF(names);
    return 0;
}

static PyObject *native_relay_head(PyObject *Py_UNUSED(module), PyObject *const *args,
                                   Py_ssize_t nargs)
{
    static const char sse[] = "text/event-stream";
    if (check_nargs("relay_head", nargs, 9, 9) < 0)
        return NULL;
    PyObject *headers = args[0], *drop = args[1], *extra = args[8];
    if (!PyList_Check(headers) || !PyAnySet_Check(drop) || !PyTuple_Check(extra)) {
        PyErr_SetString(PyExc_TypeError, "relay_head takes a list, a set, six ints and a tuple");
        return NULL;
    }
    int64_t t[6];
    uint64_t us[4];
    int overflow;
    for (int i = 0; i < 6; i++)
        if (to_i64(args[2 + i], &t[i], &overflow) < 0)
            return NULL;
    static const int pairs[4][2] = {{1, 0}, {2, 1}, {3, 2}, {5, 4}};
    for (int i = 0; i < 4; i++) {
        int64_t a = t[pairs[i][0]], b = t[pairs[i][1]];
        us[i] = a > b ? ((uint64_t)a - (uint64_t)b) / 1000 : 0;
    }
    char buf[VX_H1_TIMING_MAX];
    size_t tn = vx_h1_server_timing(buf, us[0], us[1], us[2], us[3]);
    Py_ssize_t n = PyList_GET_SIZE(headers), n_extra = PyTuple_GET_SIZE(extra);
    PyObject *out = PyList_New(n + 1 + n_extra);
    if (out == NULL)
        return NULL;
    Py_ssize_t kept = 0;
    int is_sse = 0, typed = 0, listing = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *field = PyList_GET_ITEM(headers, i);
        if (!PyTuple_Check(field) || PyTuple_GET_SIZE(field) != 2 ||
            !PyBytes_Check(PyTuple_GET_ITEM(field, 0)) ||
            !PyBytes_Check(PyTuple_GET_ITEM(field, 1))) {
            PyErr_SetString(PyExc_TypeError, "each header must be a (bytes, bytes) tuple");
            goto fail;
        }
        PyObject *name = PyTuple_GET_ITEM(field, 0);
        if (!typed && PyBytes_GET_SIZE(name) == 12 &&
            memcmp(PyBytes_AS_STRING(name), "content-type", 12) == 0) {
            PyObject *value = PyTuple_GET_ITEM(field, 1);
            typed = 1;
            is_sse = PyBytes_GET_SIZE(value) >= (Py_ssize_t)(sizeof sse - 1) &&
                     memcmp(PyBytes_AS_STRING(value), sse, sizeof sse - 1) == 0;
        }
        if (rh_is_connection(name))
            listing |= rh_lists_fields(PyTuple_GET_ITEM(field, 1));
        int dropped = PySet_Contains(drop, name);
        if (dropped < 0)
            goto fail;
        if (!dropped) {
            Py_INCREF(field);
            PyList_SET_ITEM(out, kept++, field);
        }
    }
    if (listing && rh_drop_listed(headers, out, &kept) < 0)
        goto fail;
    /* The request id among the fields kept (a Connection field may name it: then it is
     * dropped, and so not the answer's). */
    PyObject *request_id = Py_None;
    for (Py_ssize_t i = 0; i < kept; i++) {
        PyObject *name = PyTuple_GET_ITEM(PyList_GET_ITEM(out, i), 0);
        if (PyBytes_GET_SIZE(name) == 12 &&
            memcmp(PyBytes_AS_STRING(name), "x-request-id", 12) == 0) {
            request_id = PyTuple_GET_ITEM(PyList_GET_ITEM(out, i), 1);
            break;
        }
    }
    PyObject *timing = Py_BuildValue("(y#y#)", "server-timing", (Py_ssize_t)13, buf, (Py_ssize_t)tn);
    if (timing == NULL)
        goto fail;
    PyList_SET_ITEM(out, kept++, timing);
    for (Py_ssize_t i = 0; i < n_extra; i++) {
        PyObject *field = PyTuple_GET_ITEM(extra, i);
        Py_INCREF(field);
        PyList_SET_ITEM(out, kept++, field);
    }
    Py_SET_SIZE(out, kept); /* the dropped fields' slots (NULL) are past the end */
    PyObject *result = PyTuple_New(3);
    if (result == NULL)
        goto fail;
    PyTuple_SET_ITEM(result, 0, out);
    PyTuple_SET_ITEM(result, 1, PyBool_FromLong(is_sse));
    PyTuple_SET_ITEM(result, 2, Py_NewRef(request_id));
    return result;
fail:
    Py_SET_SIZE(out, kept);
    Py_DECREF(out);
    return NULL;
}

/* ---------------------------------------------------------------- init */

static PyMethodDef functions[] = {
    {"relay_head", FASTCALL(native_relay_head), METH_FASTCALL, relay_head_doc},
    {NULL, NULL, 0, NULL},
};

int vxb_relay_exec(PyObject *module, module_state *st)
{
    (void)st;
    if (PyModule_AddFunctions(module, functions) < 0)
        return -1;
    return 0;
}
