#include "bind.h"

/* ---------------------------------------------------------------- books: access log, usage */

#include "vx_books.h"

/* The access record's fields by position: the layout velox/relay/records.py states as
 * ACCESS_FIELDS (exported below; tests/unit/test_records.py compares the two). Python builds
 * the record, C only reads it: no attribute names are looked up here. */
enum access_field {
    R_T_END, R_STATUS, R_BYTES_OUT, R_METHOD, R_PATH, R_MODEL, R_BYTES_IN, R_T_RECEIVED, R_KEY,
    R_UPSTREAM, R_ATTEMPTS, R_T_SENT, R_T_HEADERS, R_REQUEST_ID, R_USAGE_INPUT, R_USAGE_OUTPUT,
    R_USAGE_EXACT, R_COST, R_COUNT
};
static const char *const access_field_names[R_COUNT] = {
    "t_end", "status", "bytes_out", "method", "path", "model", "bytes_in", "t_received", "key",
    "upstream", "attempts", "t_sent", "t_headers", "request_id", "usage_input", "usage_output",
    "usage_exact", "cost",
};

/* The record's integer fields, in one pass (-1 with an exception set on failure). */
static const int record_ints[] = {
    R_T_END, R_STATUS, R_BYTES_OUT, R_BYTES_IN, R_T_RECEIVED, R_KEY, R_ATTEMPTS, R_T_SENT,
    R_T_HEADERS, R_USAGE_INPUT, R_USAGE_OUTPUT,
};

static int record_i64(PyObject *record, int64_t out[R_COUNT])
{
    int overflow;
    for (size_t i = 0; i < sizeof(record_ints) / sizeof(record_ints[0]); i++) {
        int f = record_ints[i];
        if (to_i64(PyTuple_GET_ITEM(record, f), &out[f], &overflow) < 0)
            return -1;
    }
    return 0;
}

static int64_t floor_div(int64_t a, int64_t b)
{
    int64_t q = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

/* Append raw text. */
#define BOOKS_PUT(p, lit) (memcpy((p), (lit), sizeof(lit) - 1), (p) + sizeof(lit) - 1)

/* Per-second cache of the timestamp's first 20 bytes ("YYYY-MM-DDTHH:MM:SS."): every line
 * of a second shares them (under the GIL: one writer at a time). */
static int64_t books_second = -1;
static char books_stamp[VX_BOOKS_TIME_LEN];

#define BOOKS_MAX_FIELD 512 /* accesslog._MAX_FIELD */

PyDoc_STRVAR(access_line_doc,
             "access_line(record, wall_offset_ns, worker, prefix, seq, key_names, priced=False, /)\n"
             "-> bytes\n--\n\n"
             "One access-log line (velox.admin.accesslog) of a record laid out as\n"
             "ACCESS_FIELDS (velox.relay.records): the JSON orjson makes of the line's dict,\n"
             "newline included. The request id is the record's (the upstream's), else\n"
             "prefix + hex(seq). `priced`: the line ends with cost_usd, the record's cost\n"
             "(nano-USD) in USD, or null.");

/* One line of `record`; the caller checked prefix (bytes) and key_names (a tuple). */
static PyObject *books_line(PyObject *record, int64_t wall_offset, int64_t worker,
                            PyObject *prefix, int64_t seq, PyObject *key_names, int priced)
{
    if (!PyTuple_Check(record) || PyTuple_GET_SIZE(record) != R_COUNT) {
        PyErr_Format(PyExc_TypeError, "access_line: a record must be a %d-tuple (ACCESS_FIELDS)",
                     (int)R_COUNT);
        return NULL;
    }
    int64_t v[R_COUNT];
    if (record_i64(record, v) < 0)
        return NULL;
    int64_t t_end = v[R_T_END], status = v[R_STATUS], bytes_out = v[R_BYTES_OUT];
    int64_t t_received = v[R_T_RECEIVED], key = v[R_KEY], attempts = v[R_ATTEMPTS];
    int64_t t_headers = v[R_T_HEADERS], t_sent = v[R_T_SENT], body_n = v[R_BYTES_IN];
    int64_t usage_in = v[R_USAGE_INPUT], usage_out = v[R_USAGE_OUTPUT];
    PyObject *path = PyTuple_GET_ITEM(record, R_PATH), *method = PyTuple_GET_ITEM(record, R_METHOD);
    PyObject *model = PyTuple_GET_ITEM(record, R_MODEL);
    PyObject *upstream = PyTuple_GET_ITEM(record, R_UPSTREAM);
    PyObject *request_id = PyTuple_GET_ITEM(record, R_REQUEST_ID);
    PyObject *usage_exact = PyTuple_GET_ITEM(record, R_USAGE_EXACT);
    int usage = usage_exact != Py_None, exact = usage_exact == Py_True;
    int64_t cost = 0;
    PyObject *cost_o = PyTuple_GET_ITEM(record, R_COST);
    int overflow;
    if (priced && cost_o != Py_None) {
        if (to_i64(cost_o, &cost, &overflow) < 0)
            return NULL;
        if (overflow) { /* a wrong figure would be worse than a missing line */
            PyErr_SetString(PyExc_OverflowError, "access_line: a cost must fit in 64 bits");
            return NULL;
        }
    }

    PyObject *result = NULL; /* released at `done` */
    const char *model_s = NULL, *key_s = NULL, *id_s = NULL;
    Py_ssize_t model_n = 0, key_n = 0, id_n = 0;

    if (!PyBytes_Check(path) || !PyBytes_Check(method) || !PyBytes_Check(upstream)) {
        PyErr_SetString(PyExc_TypeError,
                        "access_line: a record's path, method and upstream must be bytes");
        goto done;
    }
    if (model != Py_None && PyUnicode_Check(model) && PyUnicode_GET_LENGTH(model) > 0) {
        model_s = PyUnicode_AsUTF8AndSize(model, &model_n);
        if (model_s == NULL) { /* lone surrogates: logged as null rather than losing lines */
            PyErr_Clear();
            model_n = 0;
        } else {
            model_n = (Py_ssize_t)vx_books_utf8_prefix((const unsigned char *)model_s,
                                                       (size_t)model_n, BOOKS_MAX_FIELD);
        }
    }
    if (key >= 0 && key < PyTuple_GET_SIZE(key_names)) {
        PyObject *name = PyTuple_GET_ITEM(key_names, key);
        if (PyUnicode_Check(name) && (key_s = PyUnicode_AsUTF8AndSize(name, &key_n)) == NULL)
            goto done;
    }
    if (PyBytes_Check(request_id)) { /* the upstream's x-request-id */
        id_s = PyBytes_AS_STRING(request_id);
        id_n = PyBytes_GET_SIZE(request_id);
        if (id_n > BOOKS_MAX_FIELD)
            id_n = BOOKS_MAX_FIELD;
    } else if (request_id != Py_None) {
        PyErr_SetString(PyExc_TypeError, "access_line: a record's request_id must be bytes or None");
        goto done;
    }

    Py_ssize_t path_n = PyBytes_GET_SIZE(path), method_n = PyBytes_GET_SIZE(method);
    const char *path_s = PyBytes_AS_STRING(path);
    const char *q = memchr(path_s, '?', (size_t)path_n);
    if (q != NULL)
        path_n = q - path_s;
    if (path_n > BOOKS_MAX_FIELD)
        path_n = BOOKS_MAX_FIELD;
    if (method_n > 16)
        method_n = 16;
    Py_ssize_t upstream_n = PyBytes_GET_SIZE(upstream);
    size_t bound = 512 + 12 * VX_BOOKS_I64_MAX + VX_BOOKS_STR_MAX(path_n) +
                   VX_BOOKS_STR_MAX(method_n) + VX_BOOKS_STR_MAX(model_n) +
                   VX_BOOKS_STR_MAX(upstream_n) + VX_BOOKS_STR_MAX(key_n) +
                   VX_BOOKS_STR_MAX(id_n) + (size_t)PyBytes_GET_SIZE(prefix) +
                   VX_BOOKS_USD_MAX;
    result = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)bound);
    if (result == NULL)
        goto done;
    char *start = PyBytes_AS_STRING(result), *p = start;

    int64_t ms = floor_div(t_end + wall_offset, 1000000);
    int64_t second = floor_div(ms, 1000);
    p = BOOKS_PUT(p, "{\"time\":\"");
    if (second != books_second) {
        if (vx_books_time(books_stamp, ms) < 0) {
            PyErr_SetString(PyExc_ValueError, "access_line: time out of range");
            Py_CLEAR(result);
            goto done;
        }
        books_second = second;
    }
    memcpy(p, books_stamp, 20); /* "YYYY-MM-DDTHH:MM:SS." */
    p += 20;
    int milli = (int)(ms - second * 1000);
    *p++ = (char)('0' + milli / 100);
    *p++ = (char)('0' + milli / 10 % 10);
    *p++ = (char)('0' + milli % 10);
    p = BOOKS_PUT(p, "Z\",\"log\":\"access\",\"worker\":");
    p = vx_books_i64(p, worker);
    p = BOOKS_PUT(p, ",\"method\":");
    p = vx_books_latin1(p, (const unsigned char *)PyBytes_AS_STRING(method), (size_t)method_n);
    p = BOOKS_PUT(p, ",\"path\":");
    p = vx_books_latin1(p, (const unsigned char *)path_s, (size_t)path_n);
    p = BOOKS_PUT(p, ",\"model\":");
    if (model_n > 0)
        p = vx_books_utf8(p, (const unsigned char *)model_s, (size_t)model_n);
    else
        p = BOOKS_PUT(p, "null");
    p = BOOKS_PUT(p, ",\"status\":");
    p = vx_books_i64(p, status);
    p = BOOKS_PUT(p, ",\"bytes_in\":");
    p = vx_books_i64(p, (int64_t)body_n);
    p = BOOKS_PUT(p, ",\"bytes_out\":");
    p = vx_books_i64(p, bytes_out);
    p = BOOKS_PUT(p, ",\"upstream\":");
    if (upstream_n > 0)
        p = vx_books_utf8(p, (const unsigned char *)PyBytes_AS_STRING(upstream),
                          (size_t)upstream_n);
    else
        p = BOOKS_PUT(p, "null");
    p = BOOKS_PUT(p, ",\"attempts\":");
    p = vx_books_i64(p, attempts);
    p = BOOKS_PUT(p, ",\"upstream_us\":");
    if (t_headers && t_sent)
        p = vx_books_i64(p, floor_div(t_headers - t_sent, 1000));
    else
        p = BOOKS_PUT(p, "null");
    p = BOOKS_PUT(p, ",\"total_us\":");
    p = vx_books_i64(p, t_end > t_received ? (t_end - t_received) / 1000 : 0);
    p = BOOKS_PUT(p, ",\"request_id\":");
    if (id_s != NULL) {
        p = vx_books_latin1(p, (const unsigned char *)id_s, (size_t)id_n);
    } else { /* prefix (ASCII of the log's own making) and the sequence number in hex */
        *p++ = '"';
        memcpy(p, PyBytes_AS_STRING(prefix), (size_t)PyBytes_GET_SIZE(prefix));
        p += PyBytes_GET_SIZE(prefix);
        char hex[16];
        int n = 0;
        uint64_t v = (uint64_t)seq;
        do {
            hex[n++] = "0123456789abcdef"[v & 15];
            v >>= 4;
        } while (v);
        while (n)
            *p++ = hex[--n];
        *p++ = '"';
    }
    p = BOOKS_PUT(p, ",\"key\":");
    if (key_s != NULL)
        p = vx_books_utf8(p, (const unsigned char *)key_s, (size_t)key_n);
    else
        p = BOOKS_PUT(p, "null");
    p = BOOKS_PUT(p, ",\"usage\":");
    if (usage) {
        p = BOOKS_PUT(p, "{\"input\":");
        p = vx_books_i64(p, usage_in);
        p = BOOKS_PUT(p, ",\"output\":");
        p = vx_books_i64(p, usage_out);
        if (exact)
            p = BOOKS_PUT(p, ",\"exact\":true}");
        else
            p = BOOKS_PUT(p, ",\"exact\":false}");
    } else {
        p = BOOKS_PUT(p, "null");
    }
    if (priced) { /* velox.spend: what the request cost, null when unknown or not priced */
        p = BOOKS_PUT(p, ",\"cost_usd\":");
        if (cost_o != Py_None)
            p = vx_books_usd(p, cost);
        else
            p = BOOKS_PUT(p, "null");
    }
    p = BOOKS_PUT(p, "}\n");
    if (_PyBytes_Resize(&result, p - start) < 0)
        result = NULL;
done:
    return result;
}

static int books_args(PyObject *const *args, int64_t *wall_offset, int64_t *worker,
                      int64_t *seq, PyObject *priced_o, int *priced)
{
    int overflow;
    if (!PyBytes_Check(args[3]) || !PyTuple_Check(args[5])) {
        PyErr_SetString(PyExc_TypeError, "access_line: prefix must be bytes, key_names a tuple");
        return -1;
    }
    if (to_i64(args[1], wall_offset, &overflow) < 0 || to_i64(args[2], worker, &overflow) < 0 ||
        to_i64(args[4], seq, &overflow) < 0)
        return -1;
    *priced = priced_o != NULL ? PyObject_IsTrue(priced_o) : 0;
    return *priced < 0 ? -1 : 0;
}

static PyObject *native_access_line(PyObject *Py_UNUSED(module), PyObject *const *args,
                                    Py_ssize_t nargs)
{
    int64_t wall_offset, worker, seq;
    int priced;
    if (check_nargs("access_line", nargs, 6, 7) < 0 ||
        books_args(args, &wall_offset, &worker, &seq, nargs > 6 ? args[6] : NULL, &priced) < 0)
        return NULL;
    return books_line(args[0], wall_offset, worker, args[3], seq, args[5], priced);
}

PyDoc_STRVAR(access_lines_doc,
             "access_lines(items, wall_offset_ns, worker, prefix, seq, key_names, limit,\n"
             "             priced=False, /)\n"
             "-> (list[bytes], int)\n--\n\n"
             "access_line for every record of the list `items` (item i gets seq + 1 + i), the\n"
             "lines joined into chunks of at most `limit` bytes of whole lines (a longer line\n"
             "is a chunk of its own): one write per chunk keeps lines whole on a shared pipe.\n"
             "An item that cannot be formatted (None: no record) is skipped. Returns the chunks and the number\n"
             "of lines in them.");

/* Append the chunk held in buf[0..*size) to chunks and empty it. */
static int books_emit(PyObject *chunks, const char *buf, Py_ssize_t *size)
{
    PyObject *chunk = PyBytes_FromStringAndSize(buf, *size);
    if (chunk == NULL)
        return -1;
    int rc = PyList_Append(chunks, chunk);
    Py_DECREF(chunk);
    *size = 0;
    return rc;
}

static PyObject *native_access_lines(PyObject *Py_UNUSED(module), PyObject *const *args,
                                     Py_ssize_t nargs)
{
    int64_t wall_offset, worker, seq, limit;
    int overflow, priced;
    if (check_nargs("access_lines", nargs, 7, 8) < 0 ||
        books_args(args, &wall_offset, &worker, &seq, nargs > 7 ? args[7] : NULL, &priced) < 0 ||
        to_i64(args[6], &limit, &overflow) < 0)
        return NULL;
    if (!PyList_Check(args[0]) || limit < 1 || limit > (1 << 24)) {
        PyErr_SetString(PyExc_ValueError,
                        "access_lines: items must be a list and limit in [1, 16 MiB]");
        return NULL;
    }
    PyObject *items = args[0], *chunks = PyList_New(0);
    char *buf = PyMem_Malloc((size_t)limit);
    Py_ssize_t count = 0, size = 0;
    if (chunks == NULL || buf == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
        PyObject *line = books_line(PyList_GET_ITEM(items, i), wall_offset, worker, args[3],
                                    seq + 1 + i, args[5], priced);
        if (line == NULL) { /* one bad item must not cost the others their lines */
            PyErr_Clear();
            continue;
        }
        Py_ssize_t n = PyBytes_GET_SIZE(line);
        if (size > 0 && size + n > limit && books_emit(chunks, buf, &size) < 0) {
            Py_DECREF(line);
            goto fail;
        }
        if (n > limit) { /* a line longer than a chunk goes alone */
            int rc = PyList_Append(chunks, line);
            Py_DECREF(line);
            if (rc < 0)
                goto fail;
        } else {
            memcpy(buf + size, PyBytes_AS_STRING(line), (size_t)n);
            size += n;
            Py_DECREF(line);
        }
        count++;
    }
    if (size > 0 && books_emit(chunks, buf, &size) < 0)
        goto fail;
    PyMem_Free(buf);
    return Py_BuildValue("(Nn)", chunks, count);
fail:
    PyMem_Free(buf);
    Py_XDECREF(chunks);
    return NULL;
}

/* A usage scan's answer: False (rc 0: no "usage" key), True (rc < 0: another form), else the
 * tuple of its n numbers. */
static PyObject *scan_result(int rc, const int64_t *v, int n)
{
    if (rc == 0)
        Py_RETURN_FALSE;
    if (rc < 0)
        Py_RETURN_TRUE;
    PyObject *out = PyTuple_New(n);
    if (out == NULL)
        return NULL;
    for (int k = 0; k < n; k++) {
        PyObject *number = PyLong_FromLongLong((long long)v[k]);
        if (number == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, k, number);
    }
    return out;
}

PyDoc_STRVAR(usage_scan_doc,
             "usage_scan(body, /) -> (int, int) | bool\n--\n\n"
             "The usage of an answer in OpenAI's own order: (prompt_tokens, completion_tokens)\n"
             "read at its last \"usage\" key, or in the Messages API's (input_tokens plus its\n"
             "cache writes and reads, output_tokens); False when it has no \"usage\" key; True\n"
             "when its last one is in another form (read it another way).");

/* OpenAI's order, else Anthropic's (a Messages answer). */
static int usage_two_forms(const unsigned char *s, size_t n, int64_t *v)
{
    int rc = vx_books_usage(s, n, &v[0], &v[1]);
    return rc < 0 ? vx_books_usage_messages(s, n, &v[0], &v[1]) : rc;
}

/* `scan` over the buffer of arg, its answer as scan_result makes it. */
static PyObject *scan_buffer(PyObject *arg, int (*scan)(const unsigned char *, size_t, int64_t *),
                             int count)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    int64_t v[VX_BOOKS_PARTS] = {0};
    int rc = scan(view.buf, (size_t)view.len, v);
    PyBuffer_Release(&view);
    return scan_result(rc, v, count);
}

static PyObject *native_usage_scan(PyObject *Py_UNUSED(module), PyObject *arg)
{
    return scan_buffer(arg, usage_two_forms, 2);
}

PyDoc_STRVAR(usage_parts_scan_doc,
             "usage_parts_scan(body, /) -> (int, int, int, int, int) | bool\n--\n\n"
             "The usage of an answer in OpenAI's own order read whole, with its parts:\n"
             "(prompt_tokens, completion_tokens, cached_tokens, cache_write_tokens,\n"
             "reasoning_tokens), 0 for a part not reported; False when it has no \"usage\" key;\n"
             "True when its last one is in another form (parse it). Twin:\n"
             "velox.relay.twins.usage_parts_scan.");

static PyObject *native_usage_parts_scan(PyObject *Py_UNUSED(module), PyObject *arg)
{
    return scan_buffer(arg, vx_books_usage_parts, VX_BOOKS_PARTS);
}

PyDoc_STRVAR(estimate_scan_doc,
             "estimate_scan(body, /) -> (int, int)\n--\n\n"
             "A JSON request body's estimated input tokens (bytes / 4 rounded up, each\n"
             "inline base64 image where the schema puts one counted as 765) and its top-level\n"
             "max_tokens / max_completion_tokens / max_output_tokens (-1 when none), in one\n"
             "pass (velox.usage.estimate; native/vx_books.h).");

static PyObject *native_estimate_scan(PyObject *Py_UNUSED(module), PyObject *arg)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    int64_t input, output;
    vx_books_estimate(view.buf, (size_t)view.len, &input, &output);
    PyBuffer_Release(&view);
    return Py_BuildValue("(LL)", (long long)input, (long long)output);
}

/* ---------------------------------------------------------------- init */

static PyMethodDef functions[] = {
    {"access_line", FASTCALL(native_access_line), METH_FASTCALL, access_line_doc},
    {"access_lines", FASTCALL(native_access_lines), METH_FASTCALL, access_lines_doc},
    {"usage_scan", (PyCFunction)native_usage_scan, METH_O, usage_scan_doc},
    {"usage_parts_scan", (PyCFunction)native_usage_parts_scan, METH_O, usage_parts_scan_doc},
    {"estimate_scan", (PyCFunction)native_estimate_scan, METH_O, estimate_scan_doc},
    {NULL, NULL, 0, NULL},
};

int vxb_books_exec(PyObject *module, module_state *st)
{
    (void)st;
    if (PyModule_AddFunctions(module, functions) < 0)
        return -1;
    PyObject *names = PyTuple_New(R_COUNT); /* the record's layout, for the test that checks it */
    if (names == NULL)
        return -1;
    for (int i = 0; i < R_COUNT; i++) {
        PyObject *name = PyUnicode_FromString(access_field_names[i]);
        if (name == NULL) {
            Py_DECREF(names);
            return -1;
        }
        PyTuple_SET_ITEM(names, i, name);
    }
    int rc = PyModule_AddObjectRef(module, "ACCESS_FIELDS", names);
    Py_DECREF(names);
    return rc;
}
