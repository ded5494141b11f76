#include "bind.h"

/* ---------------------------------------------------------------- books: access log, usage */

#include "vx_books.h"

/* The access record's fields by position: the layout velox/relay/records.py states as
 * ACCESS_FIELDS (exported below; tests/unit/test_records.py compares the two). Python gathers
 * the fields, C only reads them, from a record tuple (access_line) or as the arguments of
 * AccessBook.add: no attribute names are looked up here. */
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
#define BOOKS_METHOD_MAX 16

/* One line's fields as C reads them: numbers, and pointers into the field objects (which the
 * caller's references keep alive while the line is written). */
typedef struct {
    int64_t v[R_COUNT];
    const char *path_s, *method_s, *model_s, *key_s, *id_s, *upstream_s;
    Py_ssize_t path_n, method_n, model_n, key_n, id_n, upstream_n;
    int usage, exact, has_cost;
    int64_t cost;
} line_fields;

/* The upstream's x-request-id among the answer's header pairs (names lower-case, as every
 * codec hands them): the first one, or NULL; non-pairs are passed over. */
static PyObject *header_request_id(PyObject *headers)
{
    Py_ssize_t n = PySequence_Fast_GET_SIZE(headers);
    PyObject **items = PySequence_Fast_ITEMS(headers);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = items[i];
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2)
            continue;
        PyObject *name = PyTuple_GET_ITEM(pair, 0);
        if (PyBytes_Check(name) && PyBytes_GET_SIZE(name) == 12 &&
            memcmp(PyBytes_AS_STRING(name), "x-request-id", 12) == 0)
            return PyTuple_GET_ITEM(pair, 1);
    }
    return NULL;
}

/* Read f[0..R_COUNT) (ACCESS_FIELDS' order) into *ln: 0, or -1 with an exception set. */
static int line_read(PyObject *const *f, PyObject *key_names, int priced, line_fields *ln)
{
    int overflow;
    for (size_t i = 0; i < sizeof(record_ints) / sizeof(record_ints[0]); i++) {
        int k = record_ints[i];
        if (to_i64(f[k], &ln->v[k], &overflow) < 0)
            return -1;
    }
    PyObject *path = f[R_PATH], *method = f[R_METHOD], *model = f[R_MODEL];
    PyObject *upstream = f[R_UPSTREAM], *request_id = f[R_REQUEST_ID];
    ln->usage = f[R_USAGE_EXACT] != Py_None;
    ln->exact = f[R_USAGE_EXACT] == Py_True;
    ln->has_cost = priced && f[R_COST] != Py_None;
    ln->cost = 0;
    if (ln->has_cost) {
        if (to_i64(f[R_COST], &ln->cost, &overflow) < 0)
            return -1;
        if (overflow) { /* a wrong figure would be worse than a missing line */
            PyErr_SetString(PyExc_OverflowError, "access_line: a cost must fit in 64 bits");
            return -1;
        }
    }
    if (!PyBytes_Check(path) || !PyBytes_Check(method) || !PyBytes_Check(upstream)) {
        PyErr_SetString(PyExc_TypeError,
                        "access_line: a record's path, method and upstream must be bytes");
        return -1;
    }
    ln->model_s = NULL;
    ln->model_n = 0;
    if (model != Py_None && PyUnicode_Check(model) && PyUnicode_GET_LENGTH(model) > 0) {
        ln->model_s = PyUnicode_AsUTF8AndSize(model, &ln->model_n);
        if (ln->model_s == NULL) { /* lone surrogates: logged as null rather than losing lines */
            PyErr_Clear();
            ln->model_n = 0;
        } else {
            ln->model_n = (Py_ssize_t)vx_books_utf8_prefix(
                (const unsigned char *)ln->model_s, (size_t)ln->model_n, BOOKS_MAX_FIELD);
        }
    }
    ln->key_s = NULL;
    ln->key_n = 0;
    int64_t key = ln->v[R_KEY];
    if (key >= 0 && key < PyTuple_GET_SIZE(key_names)) {
        PyObject *name = PyTuple_GET_ITEM(key_names, key);
        if (PyUnicode_Check(name) &&
            (ln->key_s = PyUnicode_AsUTF8AndSize(name, &ln->key_n)) == NULL)
            return -1;
    }
    if (PyList_Check(request_id) || PyTuple_Check(request_id)) {
        /* the answer's headers: its x-request-id, if any (one pass in C, not a Python loop) */
        request_id = header_request_id(request_id);
        if (request_id == NULL)
            request_id = Py_None;
    }
    ln->id_s = NULL;
    ln->id_n = 0;
    if (PyBytes_Check(request_id)) { /* the upstream's x-request-id */
        ln->id_s = PyBytes_AS_STRING(request_id);
        ln->id_n = PyBytes_GET_SIZE(request_id);
        if (ln->id_n > BOOKS_MAX_FIELD)
            ln->id_n = BOOKS_MAX_FIELD;
    } else if (request_id != Py_None) {
        PyErr_SetString(PyExc_TypeError,
                        "access_line: a record's request_id must be bytes, None or the headers");
        return -1;
    }
    ln->path_s = PyBytes_AS_STRING(path);
    ln->path_n = PyBytes_GET_SIZE(path);
    const char *q = memchr(ln->path_s, '?', (size_t)ln->path_n);
    if (q != NULL)
        ln->path_n = q - ln->path_s;
    if (ln->path_n > BOOKS_MAX_FIELD)
        ln->path_n = BOOKS_MAX_FIELD;
    ln->method_s = PyBytes_AS_STRING(method);
    ln->method_n = PyBytes_GET_SIZE(method);
    if (ln->method_n > BOOKS_METHOD_MAX)
        ln->method_n = BOOKS_METHOD_MAX;
    ln->upstream_s = PyBytes_AS_STRING(upstream);
    ln->upstream_n = PyBytes_GET_SIZE(upstream);
    return 0;
}

/* Room line_write may need for *ln. */
static size_t line_bound(const line_fields *ln, Py_ssize_t prefix_n)
{
    return 512 + 12 * VX_BOOKS_I64_MAX + VX_BOOKS_STR_MAX(ln->path_n) +
           VX_BOOKS_STR_MAX(ln->method_n) + VX_BOOKS_STR_MAX(ln->model_n) +
           VX_BOOKS_STR_MAX(ln->upstream_n) + VX_BOOKS_STR_MAX(ln->key_n) +
           VX_BOOKS_STR_MAX(ln->id_n) + (size_t)prefix_n + VX_BOOKS_USD_MAX;
}

/* "YYYY-MM-DDTHH:MM:SS.mmm" of t_end + wall_offset at p; NULL with ValueError when out of
 * range. */
static char *line_time(char *p, int64_t wall_ns)
{
    int64_t ms = floor_div(wall_ns, 1000000);
    int64_t second = floor_div(ms, 1000);
    if (second != books_second) {
        if (vx_books_time(books_stamp, ms) < 0) {
            PyErr_SetString(PyExc_ValueError, "access_line: time out of range");
            return NULL;
        }
        books_second = second;
    }
    memcpy(p, books_stamp, 20); /* "YYYY-MM-DDTHH:MM:SS." */
    p += 20;
    int milli = (int)(ms - second * 1000);
    *p++ = (char)('0' + milli / 100);
    *p++ = (char)('0' + milli / 10 % 10);
    *p++ = (char)('0' + milli % 10);
    return p;
}

/* The line of *ln at p (line_bound bytes of room), newline included: the JSON orjson makes
 * of the line's dict (velox.admin.twins.access_line). The end of what was written, or NULL
 * with an exception set (nothing of the line counts then). */
static char *line_write(char *p, const line_fields *ln, int64_t wall_offset, int64_t worker,
                        PyObject *prefix, int64_t seq, int priced)
{
    const int64_t *v = ln->v;
    p = BOOKS_PUT(p, "{\"time\":\"");
    if ((p = line_time(p, v[R_T_END] + wall_offset)) == NULL)
        return NULL;
    p = BOOKS_PUT(p, "Z\",\"log\":\"access\",\"worker\":");
    p = vx_books_i64(p, worker);
    p = BOOKS_PUT(p, ",\"method\":");
    p = vx_books_latin1(p, (const unsigned char *)ln->method_s, (size_t)ln->method_n);
    p = BOOKS_PUT(p, ",\"path\":");
    p = vx_books_latin1(p, (const unsigned char *)ln->path_s, (size_t)ln->path_n);
    p = BOOKS_PUT(p, ",\"model\":");
    if (ln->model_n > 0)
        p = vx_books_utf8(p, (const unsigned char *)ln->model_s, (size_t)ln->model_n);
    else
        p = BOOKS_PUT(p, "null");
    p = BOOKS_PUT(p, ",\"status\":");
    p = vx_books_i64(p, v[R_STATUS]);
    p = BOOKS_PUT(p, ",\"bytes_in\":");
    p = vx_books_i64(p, v[R_BYTES_IN]);
    p = BOOKS_PUT(p, ",\"bytes_out\":");
    p = vx_books_i64(p, v[R_BYTES_OUT]);
    p = BOOKS_PUT(p, ",\"upstream\":");
    if (ln->upstream_n > 0)
        p = vx_books_utf8(p, (const unsigned char *)ln->upstream_s, (size_t)ln->upstream_n);
    else
        p = BOOKS_PUT(p, "null");
    p = BOOKS_PUT(p, ",\"attempts\":");
    p = vx_books_i64(p, v[R_ATTEMPTS]);
    p = BOOKS_PUT(p, ",\"upstream_us\":");
    if (v[R_T_HEADERS] && v[R_T_SENT])
        p = vx_books_i64(p, floor_div(v[R_T_HEADERS] - v[R_T_SENT], 1000));
    else
        p = BOOKS_PUT(p, "null");
    p = BOOKS_PUT(p, ",\"total_us\":");
    p = vx_books_i64(p, v[R_T_END] > v[R_T_RECEIVED] ? (v[R_T_END] - v[R_T_RECEIVED]) / 1000 : 0);
    p = BOOKS_PUT(p, ",\"request_id\":");
    if (ln->id_s != NULL) {
        p = vx_books_latin1(p, (const unsigned char *)ln->id_s, (size_t)ln->id_n);
    } else { /* prefix (ASCII of the log's own making) and the sequence number in hex */
        *p++ = '"';
        memcpy(p, PyBytes_AS_STRING(prefix), (size_t)PyBytes_GET_SIZE(prefix));
        p += PyBytes_GET_SIZE(prefix);
        char hex[16];
        int n = 0;
        uint64_t s = (uint64_t)seq;
        do {
            hex[n++] = "0123456789abcdef"[s & 15];
            s >>= 4;
        } while (s);
        while (n)
            *p++ = hex[--n];
        *p++ = '"';
    }
    p = BOOKS_PUT(p, ",\"key\":");
    if (ln->key_s != NULL)
        p = vx_books_utf8(p, (const unsigned char *)ln->key_s, (size_t)ln->key_n);
    else
        p = BOOKS_PUT(p, "null");
    p = BOOKS_PUT(p, ",\"usage\":");
    if (ln->usage) {
        p = BOOKS_PUT(p, "{\"input\":");
        p = vx_books_i64(p, v[R_USAGE_INPUT]);
        p = BOOKS_PUT(p, ",\"output\":");
        p = vx_books_i64(p, v[R_USAGE_OUTPUT]);
        if (ln->exact)
            p = BOOKS_PUT(p, ",\"exact\":true}");
        else
            p = BOOKS_PUT(p, ",\"exact\":false}");
    } else {
        p = BOOKS_PUT(p, "null");
    }
    if (priced) { /* velox.spend: what the request cost, null when unknown or not priced */
        p = BOOKS_PUT(p, ",\"cost_usd\":");
        if (ln->has_cost)
            p = vx_books_usd(p, ln->cost);
        else
            p = BOOKS_PUT(p, "null");
    }
    return BOOKS_PUT(p, "}\n");
}

PyDoc_STRVAR(access_line_doc,
             "access_line(record, wall_offset_ns, worker, prefix, seq, key_names, priced=False, /)\n"
             "-> bytes\n--\n\n"
             "One access-log line (velox.admin.accesslog) of a record laid out as\n"
             "ACCESS_FIELDS (velox.relay.records): the JSON orjson makes of the line's dict,\n"
             "newline included. The request id is the record's (the upstream's: bytes, or\n"
             "found as x-request-id in a list of header pairs), else prefix + hex(seq).\n"
             "`priced`: the line ends with cost_usd, the record's cost (nano-USD) in USD, or\n"
             "null.");

/* One line of `record`; the caller checked prefix (bytes) and key_names (a tuple). */
static PyObject *books_line(PyObject *record, int64_t wall_offset, int64_t worker,
                            PyObject *prefix, int64_t seq, PyObject *key_names, int priced)
{
    if (!PyTuple_Check(record) || PyTuple_GET_SIZE(record) != R_COUNT) {
        PyErr_Format(PyExc_TypeError, "access_line: a record must be a %d-tuple (ACCESS_FIELDS)",
                     (int)R_COUNT);
        return NULL;
    }
    line_fields ln;
    if (line_read(&PyTuple_GET_ITEM(record, 0), key_names, priced, &ln) < 0)
        return NULL;
    PyObject *result =
        PyBytes_FromStringAndSize(NULL, (Py_ssize_t)line_bound(&ln, PyBytes_GET_SIZE(prefix)));
    if (result == NULL)
        return NULL;
    char *start = PyBytes_AS_STRING(result);
    char *end = line_write(start, &ln, wall_offset, worker, prefix, seq, priced);
    if (end == NULL) {
        Py_DECREF(result);
        return NULL;
    }
    if (_PyBytes_Resize(&result, end - start) < 0)
        return NULL;
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

/* ---------------------------------------------------------------- AccessBook */

/* A worker's access log between two flushes: each line written at its request's end straight
 * into one scratch buffer (no record object, no bytes object per line), taken out as chunks
 * of whole lines by the flush (velox.admin.accesslog). Twin: velox.admin.twins.AccessBook. */
typedef struct {
    PyObject_HEAD
    char *buf;
    size_t size, cap;   /* bytes of lines in buf, and its room */
    Py_ssize_t lines;   /* lines in buf */
    int64_t dropped;    /* lines refused for want of room since the last take */
    int64_t room;       /* bytes buf may hold: what the log's bound leaves (set by the flush) */
    int64_t wall_offset; /* wall ns minus perf_counter ns, set by the flush */
    int64_t worker, seq;
    PyObject *prefix;    /* bytes: the request ids made here */
    PyObject *key_names; /* tuple of str: [[key]] names by index */
    int priced;
} BookObject;

/* 64 KiB: one flush's lines at ~1,000 requests/s per worker, or one regular file's write. */
#define BOOK_FIRST_CAP ((size_t)1 << 16)

static int book_reserve(BookObject *self, size_t need)
{
    if (self->size + need <= self->cap)
        return 0;
    size_t cap = self->cap ? self->cap : BOOK_FIRST_CAP;
    while (cap < self->size + need)
        cap *= 2;
    char *buf = PyMem_Realloc(self->buf, cap);
    if (buf == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    self->buf = buf;
    self->cap = cap;
    return 0;
}

/* A new, empty book (the caller checked prefix is bytes and names a tuple). */
static BookObject *book_make(PyTypeObject *type, int64_t worker, PyObject *prefix,
                             PyObject *names, int priced, int64_t room)
{
    BookObject *self = (BookObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->worker = worker;
    self->room = room;
    self->priced = priced;
    self->prefix = Py_NewRef(prefix);
    self->key_names = Py_NewRef(names);
    return self;
}

static PyObject *Book_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"worker", "prefix", "key_names", "priced", "room", NULL};
    PyObject *worker_o, *prefix, *names, *room_o;
    int priced;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!O!pO:AccessBook", kwlist, &worker_o,
                                     &PyBytes_Type, &prefix, &PyTuple_Type, &names, &priced,
                                     &room_o))
        return NULL;
    int64_t worker, room;
    if (arg_in_range(worker_o, "worker", 0, INT32_MAX, &worker) < 0 ||
        arg_in_range(room_o, "room", 0, INT64_MAX, &room) < 0)
        return NULL;
    return (PyObject *)book_make(type, worker, prefix, names, priced, room);
}

static void Book_dealloc(BookObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyMem_Free(self->buf);
    Py_XDECREF(self->prefix);
    Py_XDECREF(self->key_names);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

PyDoc_STRVAR(Book_add_doc,
             "add($self, t_end, status, ..., cost, /)\n--\n\n"
             "The line of one request, its fields as arguments in ACCESS_FIELDS' order\n"
             "(request_id: bytes, None, or the answer's header pairs), written into the\n"
             "buffer with the next sequence number; refused and counted in `dropped` when\n"
             "the buffer would pass `room`. Raises what a field's type raises (nothing of\n"
             "the line is kept then).");

static PyObject *Book_add(BookObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("add", nargs, R_COUNT, R_COUNT) < 0)
        return NULL;
    line_fields ln;
    if (line_read(args, self->key_names, self->priced, &ln) < 0)
        return NULL;
    /* Written past the buffer's lines, kept only if within room: the buffer never holds more
     * than room plus one line's bound (room: at most VELOX_ACCESS_LOG_BUFFER_BYTES). */
    if (book_reserve(self, line_bound(&ln, PyBytes_GET_SIZE(self->prefix))) < 0)
        return NULL;
    char *start = self->buf + self->size;
    char *end = line_write(start, &ln, self->wall_offset, self->worker, self->prefix,
                           self->seq + 1, self->priced);
    if (end == NULL)
        return NULL;
    self->seq++;
    size_t n = (size_t)(end - start);
    if ((int64_t)(self->size + n) > self->room) { /* stdout blocked: drop, never wait */
        self->dropped++;
        Py_RETURN_NONE;
    }
    self->size += n;
    self->lines++;
    Py_RETURN_NONE;
}

/* Append (buf[0..n), lines) to chunks. */
static int book_chunk(PyObject *chunks, const char *buf, size_t n, Py_ssize_t lines)
{
    PyObject *pair = Py_BuildValue("(y#n)", buf, (Py_ssize_t)n, lines);
    if (pair == NULL)
        return -1;
    int rc = PyList_Append(chunks, pair);
    Py_DECREF(pair);
    return rc;
}

PyDoc_STRVAR(Book_take_doc,
             "take($self, limit, /) -> (list[tuple[bytes, int]], int)\n--\n\n"
             "The buffer's lines as chunks of whole lines of at most `limit` bytes (a longer\n"
             "line is a chunk of its own), each with its line count, and the lines dropped\n"
             "since the last take; the buffer is empty after.");

static PyObject *Book_take(BookObject *self, PyObject *arg)
{
    int64_t limit;
    if (arg_in_range(arg, "limit", 1, 1 << 24, &limit) < 0)
        return NULL;
    PyObject *chunks = PyList_New(0);
    if (chunks == NULL)
        return NULL;
    const char *buf = self->buf;
    size_t at = 0, size = self->size;
    while (at < size) {
        /* Whole lines up to limit: up to the last newline within it, else (one line longer
         * than limit) to the first newline. Every line ends with one. */
        size_t span = size - at < (size_t)limit ? size - at : (size_t)limit;
        size_t end = at, lines = 0;
        const char *nl;
        while (end < at + span && (nl = memchr(buf + end, '\n', at + span - end)) != NULL) {
            end = (size_t)(nl - buf) + 1;
            lines++;
        }
        if (lines == 0) {
            nl = memchr(buf + at, '\n', size - at);
            end = nl != NULL ? (size_t)(nl - buf) + 1 : size;
            lines = 1;
        }
        if (book_chunk(chunks, buf + at, end - at, (Py_ssize_t)lines) < 0) {
            Py_DECREF(chunks);
            return NULL;
        }
        at = end;
    }
    int64_t dropped = self->dropped;
    self->size = 0;
    self->lines = 0;
    self->dropped = 0;
    if (self->cap > 4 * BOOK_FIRST_CAP) { /* a blocked stdout's backlog: give the memory back */
        PyMem_Free(self->buf);
        self->buf = NULL;
        self->cap = 0;
    }
    return Py_BuildValue("(NL)", chunks, (long long)dropped);
}

static Py_ssize_t Book_len(BookObject *self)
{
    return self->lines;
}

static PyObject *Book_get_names(BookObject *self, void *Py_UNUSED(closure))
{
    return Py_NewRef(self->key_names);
}

static int Book_set_names(BookObject *self, PyObject *value, void *Py_UNUSED(closure))
{
    if (value == NULL || !PyTuple_Check(value)) {
        PyErr_SetString(PyExc_TypeError, "key_names must be a tuple");
        return -1;
    }
    Py_SETREF(self->key_names, Py_NewRef(value));
    return 0;
}

static PyMethodDef Book_methods[] = {
    {"add", FASTCALL(Book_add), METH_FASTCALL, Book_add_doc},
    {"take", (PyCFunction)Book_take, METH_O, Book_take_doc},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Book_members[] = {
    {"room", T_LONGLONG, offsetof(BookObject, room), 0,
     "Bytes the buffer may hold; lines past it are dropped and counted."},
    {"wall_offset", T_LONGLONG, offsetof(BookObject, wall_offset), 0,
     "Wall-clock ns minus perf_counter ns: a line's time is its t_end plus this."},
    {"seq", T_LONGLONG, offsetof(BookObject, seq), READONLY,
     "Lines made so far: the last request id made here ends in its hex."},
    {"size", T_PYSSIZET, offsetof(BookObject, size), READONLY, "Bytes of lines in the buffer."},
    {"dropped", T_LONGLONG, offsetof(BookObject, dropped), READONLY,
     "Lines dropped since the last take."},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef Book_getset[] = {
    {"key_names", (getter)Book_get_names, (setter)Book_set_names,
     "[[key]] names by index (request.key).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(Book_doc,
             "AccessBook(worker, prefix, key_names, priced, room)\n--\n\n"
             "One worker's access-log lines between two flushes, each written at its request's\n"
             "end into one buffer (len: the lines in it). `prefix` + hex(seq) is the request\n"
             "id of a line whose upstream gave none; `priced`: lines end with cost_usd.");

static PyType_Slot Book_slots[] = {
    {Py_tp_doc, (void *)Book_doc},
    {Py_tp_new, Book_new},
    {Py_tp_dealloc, Book_dealloc},
    {Py_tp_methods, Book_methods},
    {Py_tp_members, Book_members},
    {Py_tp_getset, Book_getset},
    {Py_sq_length, Book_len},
    {0, NULL},
};

static PyType_Spec Book_spec = {
    .name = "velox._native.AccessBook",
    .basicsize = sizeof(BookObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Book_slots,
};

PyDoc_STRVAR(access_lines_doc,
             "access_lines(items, wall_offset_ns, worker, prefix, seq, key_names, limit,\n"
             "             priced=False, /)\n"
             "-> (list[bytes], int)\n--\n\n"
             "access_line for every record of the list `items` (item i gets seq + 1 + i), the\n"
             "lines joined into chunks of at most `limit` bytes of whole lines (a longer line\n"
             "is a chunk of its own): one write per chunk keeps lines whole on a shared pipe.\n"
             "An item that cannot be formatted (None: no record) is skipped. Returns the chunks and the number\n"
             "of lines in them.");

static PyObject *native_access_lines(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
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
    /* A book of unbounded room, its lines taken at once: one chunking for both. */
    module_state *st = PyModule_GetState(module);
    BookObject *book = book_make(st->book_type, worker, args[3], args[5], priced, INT64_MAX);
    if (book == NULL)
        return NULL;
    book->wall_offset = wall_offset;
    PyObject *items = args[0], *taken = NULL, *chunks = NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
        PyObject *record = PyList_GET_ITEM(items, i);
        book->seq = seq + i; /* item i's id (seq + 1 + i), whatever became of the others */
        PyObject *rc = NULL;
        if (PyTuple_Check(record) && PyTuple_GET_SIZE(record) == R_COUNT)
            rc = Book_add(book, &PyTuple_GET_ITEM(record, 0), R_COUNT);
        if (rc == NULL) { /* one bad item must not cost the others their lines */
            PyErr_Clear();
            continue;
        }
        Py_DECREF(rc);
    }
    Py_ssize_t count = book->lines;
    PyObject *limit_o = PyLong_FromLongLong((long long)limit);
    if (limit_o == NULL || (taken = Book_take(book, limit_o)) == NULL)
        goto done;
    PyObject *pairs = PyTuple_GET_ITEM(taken, 0);
    if ((chunks = PyList_New(PyList_GET_SIZE(pairs))) == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(pairs); i++)
        PyList_SET_ITEM(chunks, i, Py_NewRef(PyTuple_GET_ITEM(PyList_GET_ITEM(pairs, i), 0)));
done:
    Py_XDECREF(limit_o);
    Py_XDECREF(taken);
    Py_DECREF(book);
    return chunks == NULL ? NULL : Py_BuildValue("(Nn)", chunks, count);
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
    if (vxb_add_type(module, &Book_spec, &st->book_type) < 0 ||
        PyModule_AddFunctions(module, functions) < 0)
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
