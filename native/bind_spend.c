/* bind_spend.c: one call per priced answer (velox.spend.wire): its cost, the
 * x-velox-cost-usd value, /metrics' spend counter and the ledger row's columns.
 *
 * Why: those were ~15 Python-level steps a request (the price arithmetic, the header's memo,
 * the counter's field, a clock read, the api's lookup, a header scan for the request id, a
 * 16-field tuple, and at every flush a transpose of the rows into columns): ~6 us of a
 * request's CPU end to end with spend on. Here they are one call, and the row goes straight
 * into per-column int64 buffers that the feed's flush ships as they are (`take`).
 *
 * Records are declared, never looked up by attribute: a price is a tuple of ints in
 * vx_spend.h's order (velox.spend.wire.PRICE_FIELDS; SPEND_PRICE_FIELDS below is exported
 * for the test that compares them). The Python twin is velox.spend.book.BookTwin, which the
 * unit tests run beside this one.
 */
#include "bind.h"
#include "vx_books.h"
#include "vx_spend.h"
#include "vx_stats.h"

#include <time.h>

/* The frame's int64 columns (velox.spend.rowframe.INT_COLUMNS, same order). */
enum { C_TS, C_LABEL, C_STATUS, C_INPUT, C_OUTPUT, C_CACHED, C_WRITTEN, C_REASONING, C_COST,
       C_LATENCY, C_COUNT };
#define NO_COST INT64_MIN   /* rowframe.NO_COST: a cost unknown */
#define NOT_BOOKED (-2)     /* velox.relay.usage.NOT_BOOKED: a merged call's key */
#define BLOCK_SHIFT 12      /* the spend counters are blocks of 4096 fields (TOKEN_BLOCK) */
#define BLOCK_MASK ((1 << BLOCK_SHIFT) - 1)
#define MAX_APIS 255        /* an api's number is a label's low byte */
#define MAX_TARGET (1 << 24)
#define MAX_KEY INT64_C(0x7fffffff)

static const char *const price_field_names[VX_PRICE_FIELDS] = {
    "input", "output", "cached_input", "cache_write", "reasoning", "request",
};

typedef struct {
    PyObject_HEAD
    PyObject *books;       /* tuple of Counters (kept alive: their cores are used) */
    vx_counters **cores;   /* books' cores */
    Py_ssize_t blocks;
    int64_t slot, width, keys;
    PyObject *apis;        /* tuple of bytes: the upstream paths of api numbers 0.. */
    Py_ssize_t rows_max;   /* rows kept until `take`; 0: none (no ledger) */
    Py_ssize_t rows, cap;
    int64_t *col[C_COUNT];
    char *ids;             /* the request ids, UTF-8, NUL-separated */
    size_t ids_len, ids_cap;
    int64_t dropped;       /* rows that found the buffers full */
    int64_t last_cost;     /* the last result, returned again for the same cost */
    int last_header;       /* ... and the same header choice (its key is the pair) */
    PyObject *last;
} BookObject;

static void Book_dealloc(BookObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    Py_XDECREF(self->books);
    Py_XDECREF(self->apis);
    Py_XDECREF(self->last);
    PyMem_Free(self->cores);
    for (int c = 0; c < C_COUNT; c++)
        PyMem_Free(self->col[c]);
    PyMem_Free(self->ids);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyObject *Book_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"books", "slot", "width", "keys", "apis", NULL};
    PyObject *books, *apis, *slot_o, *width_o, *keys_o;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!OOOO!:SpendBook", kwlist, &PyTuple_Type,
                                     &books, &slot_o, &width_o, &keys_o, &PyTuple_Type, &apis))
        return NULL;
    int64_t slot, width, keys;
    if (arg_in_range(slot_o, "slot", 0, VX_STATS_MAX_SLOTS - 1, &slot) < 0 ||
        arg_in_range(width_o, "width", 0, MAX_TARGET, &width) < 0 ||
        arg_in_range(keys_o, "keys", 0, MAX_KEY, &keys) < 0)
        return NULL;
    Py_ssize_t n_apis = PyTuple_GET_SIZE(apis);
    if (n_apis > MAX_APIS) {
        PyErr_Format(PyExc_ValueError, "at most %d api paths", MAX_APIS);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n_apis; i++)
        if (!PyBytes_Check(PyTuple_GET_ITEM(apis, i))) {
            PyErr_SetString(PyExc_TypeError, "apis must be a tuple of bytes");
            return NULL;
        }
    module_state *st = PyType_GetModuleState(type);
    BookObject *self = (BookObject *)type->tp_alloc(type, 0); /* new ref, zeroed */
    if (self == NULL)
        return NULL;
    self->blocks = PyTuple_GET_SIZE(books);
    self->cores = PyMem_Calloc((size_t)self->blocks + 1, sizeof(vx_counters *));
    if (self->cores == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t b = 0; b < self->blocks; b++) {
        self->cores[b] = vxb_counters_core(PyTuple_GET_ITEM(books, b), st);
        if (self->cores[b] == NULL || (size_t)slot >= self->cores[b]->slots) {
            if (self->cores[b] != NULL)
                PyErr_SetString(PyExc_ValueError, "slot out of the counters' range");
            Py_DECREF(self);
            return NULL;
        }
    }
    self->books = Py_NewRef(books);
    self->apis = Py_NewRef(apis);
    self->slot = slot;
    self->width = width;
    self->keys = keys;
    return (PyObject *)self;
}

/* The api number of an upstream path: its index in `apis`, compared without the query
 * string; len(apis) for any other. */
static int64_t book_api(BookObject *self, PyObject *path)
{
    const char *s = PyBytes_AS_STRING(path);
    Py_ssize_t n = PyBytes_GET_SIZE(path);
    const char *q = memchr(s, '?', (size_t)n);
    if (q != NULL)
        n = q - s;
    Py_ssize_t k = PyTuple_GET_SIZE(self->apis);
    for (Py_ssize_t i = 0; i < k; i++) {
        PyObject *a = PyTuple_GET_ITEM(self->apis, i);
        if (PyBytes_GET_SIZE(a) == n && memcmp(PyBytes_AS_STRING(a), s, (size_t)n) == 0)
            return i;
    }
    return k;
}

/* Room for one more row; 0, or -1 with MemoryError. */
static int book_grow(BookObject *self, size_t id_bytes)
{
    if (self->rows == self->cap) {
        Py_ssize_t cap = self->cap ? 2 * self->cap : 256;
        if (cap > self->rows_max)
            cap = self->rows_max;
        for (int c = 0; c < C_COUNT; c++) {
            int64_t *p = PyMem_Realloc(self->col[c], (size_t)cap * sizeof(int64_t));
            if (p == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            self->col[c] = p;
        }
        self->cap = cap;
    }
    if (self->ids_len + id_bytes + 1 > self->ids_cap) {
        size_t cap = self->ids_cap ? 2 * self->ids_cap : 4096;
        while (cap < self->ids_len + id_bytes + 1)
            cap *= 2;
        char *p = PyMem_Realloc(self->ids, cap);
        if (p == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        self->ids = p;
        self->ids_cap = cap;
    }
    return 0;
}

static int64_t clock_ns(clockid_t clock)
{
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static int64_t floor_div(int64_t a, int64_t b)
{
    int64_t q = a / b;
    return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

/* Append the row; 0, or -1 with an exception (nothing appended). */
static int book_row(BookObject *self, const int64_t v[C_COUNT], PyObject *request_id)
{
    const unsigned char *id = NULL;
    size_t id_n = 0;
    if (PyBytes_Check(request_id)) {
        id = (const unsigned char *)PyBytes_AS_STRING(request_id);
        id_n = (size_t)PyBytes_GET_SIZE(request_id);
        if (id_n > VX_SPEND_ID_CHARS)
            id_n = VX_SPEND_ID_CHARS;
    } else if (request_id != Py_None) {
        PyErr_SetString(PyExc_TypeError, "answer: request_id must be bytes or None");
        return -1;
    }
    if (book_grow(self, 3 * id_n) < 0)
        return -1;
    Py_ssize_t r = self->rows++;
    for (int c = 0; c < C_COUNT; c++)
        self->col[c][r] = v[c];
    if (r > 0)
        self->ids[self->ids_len++] = '\0';
    self->ids_len += vx_spend_id(self->ids + self->ids_len, id, id_n, VX_SPEND_ID_CHARS);
    return 0;
}

/* (cost or None, (b"x-velox-cost-usd", USD) or None), the last one again for the same. */
static PyObject *book_result(BookObject *self, int64_t cost, int header)
{
    /* The pair, not one folded int: -1 - cost for "no header" made INT64_MAX's tag NO_COST's,
     * so an unknown cost got a cost of INT64_MAX's cached answer back. */
    header = cost != NO_COST && header;
    if (self->last != NULL && self->last_cost == cost && self->last_header == header)
        return Py_NewRef(self->last);
    PyObject *out;
    if (cost == NO_COST) {
        out = PyTuple_Pack(2, Py_None, Py_None);
    } else if (header) {
        char text[VX_BOOKS_USD_MAX];
        out = Py_BuildValue("(L(y#y#))", (long long)cost, "x-velox-cost-usd", (Py_ssize_t)16,
                            text, (Py_ssize_t)(vx_books_usd(text, cost) - text));
    } else {
        out = Py_BuildValue("(LO)", (long long)cost, Py_None);
    }
    if (out == NULL)
        return NULL;
    Py_XSETREF(self->last, Py_NewRef(out));
    self->last_cost = cost;
    self->last_header = header;
    return out;
}

enum { A_PRICE, A_INPUT, A_OUTPUT, A_CACHED, A_WRITTEN, A_REASONING, A_KEY, A_INDEX, A_TARGET,
       A_STATUS, A_RECEIVED, A_PATH, A_ID, A_HEADER, A_COUNT };

PyDoc_STRVAR(Book_answer_doc,
             "answer($self, price, input, output, cached, written, reasoning, key, index,\n"
             "       target, status, t_received, path, request_id, header, /)\n--\n\n"
             "One priced answer, in one call: its cost in nano-USD from the usage at `price` (a\n"
             "tuple in PRICE_FIELDS order; None: the model has no price, cost unknown; an int:\n"
             "that cost as it is), added to /metrics' spend counter of (key, index) when index\n"
             ">= 0, and its ledger row appended (time, label of key, target and the api of\n"
             "`path`, status, usage, cost, latency from t_received, request_id) while rows are\n"
             "kept. A key of -2 (a merged call's) counts and keeps nothing. Returns (cost or\n"
             "None, (b'x-velox-cost-usd', USD) when `header` and the cost is known, else None).\n"
             "ValueError when a number does not fit 64 bits (nothing done).");

static PyObject *Book_answer(BookObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("answer", nargs, A_COUNT, A_COUNT) < 0)
        return NULL;
    int64_t usage[VX_USAGE_FIELDS], key, index, target, status, received, cost = NO_COST;
    for (int u = 0; u < VX_USAGE_FIELDS; u++)
        if (arg_in_range(args[A_INPUT + u], "a token count", INT64_MIN, INT64_MAX, &usage[u]) < 0)
            return NULL;
    if (arg_in_range(args[A_KEY], "key", NOT_BOOKED, MAX_KEY, &key) < 0 ||
        arg_in_range(args[A_INDEX], "index", -1, MAX_TARGET, &index) < 0 ||
        arg_in_range(args[A_TARGET], "target", 0, MAX_TARGET - 1, &target) < 0 ||
        arg_in_range(args[A_STATUS], "status", 0, 999, &status) < 0 ||
        arg_in_range(args[A_RECEIVED], "t_received", INT64_MIN, INT64_MAX, &received) < 0)
        return NULL;
    PyObject *price = args[A_PRICE], *path = args[A_PATH];
    if (!PyBytes_Check(path)) {
        PyErr_SetString(PyExc_TypeError, "answer: path must be bytes");
        return NULL;
    }
    int header = PyObject_IsTrue(args[A_HEADER]);
    if (header < 0)
        return NULL;
    if (PyTuple_Check(price)) {
        int64_t p[VX_PRICE_FIELDS];
        if (PyTuple_GET_SIZE(price) != VX_PRICE_FIELDS) {
            PyErr_Format(PyExc_TypeError, "answer: a price is a %d-tuple (PRICE_FIELDS)",
                         VX_PRICE_FIELDS);
            return NULL;
        }
        for (int f = 0; f < VX_PRICE_FIELDS; f++)
            if (arg_in_range(PyTuple_GET_ITEM(price, f), price_field_names[f], -1, INT64_MAX,
                             &p[f]) < 0)
                return NULL;
        if (vx_spend_cost(p, usage, &cost) < 0) {
            PyErr_SetString(PyExc_ValueError, "answer: the cost does not fit 64 bits");
            return NULL;
        }
    } else if (price != Py_None) {
        if (arg_in_range(price, "cost", INT64_MIN + 1, INT64_MAX, &cost) < 0)
            return NULL;
    }
    if (key == NOT_BOOKED)
        return book_result(self, cost, header);
    if (index >= 0 && self->blocks > 0 && cost != 0) {
        int64_t field = ((key >= self->keys ? 0 : key + 1) * self->width + index) * 2;
        if (cost == NO_COST)
            field += 1;
        int64_t block = field >> BLOCK_SHIFT;
        if (block >= self->blocks ||
            (size_t)(field & BLOCK_MASK) >= self->cores[block]->fields) {
            PyErr_Format(PyExc_IndexError, "answer: spend counter %lld out of range",
                         (long long)field);
            return NULL;
        }
        vx_counters_add(self->cores[block], (size_t)self->slot, (size_t)(field & BLOCK_MASK),
                        cost == NO_COST ? 1 : cost);
    }
    if (self->rows_max > 0) {
        if (self->rows >= self->rows_max) {
            self->dropped++;
        } else {
            int64_t now = clock_ns(CLOCK_MONOTONIC);
            int64_t v[C_COUNT] = {
                [C_TS] = floor_div(clock_ns(CLOCK_REALTIME), 1000000),
                [C_LABEL] = ((key + 1) << 32) | (target << 8) | book_api(self, path),
                [C_STATUS] = status, [C_INPUT] = usage[VX_USAGE_INPUT],
                [C_OUTPUT] = usage[VX_USAGE_OUTPUT], [C_CACHED] = usage[VX_USAGE_CACHED],
                [C_WRITTEN] = usage[VX_USAGE_WRITTEN], [C_REASONING] = usage[VX_USAGE_REASONING],
                [C_COST] = cost, [C_LATENCY] = floor_div(now - received, 1000),
            };
            if (book_row(self, v, args[A_ID]) < 0)
                return NULL;
        }
    }
    return book_result(self, cost, header);
}

/* Slot of `label` in the open-addressed table `slots` (size mask + 1, -1 empty). */
static size_t label_slot(const int64_t *keys, const int64_t *slots, size_t mask, int64_t label)
{
    uint64_t h = (uint64_t)label * UINT64_C(0x9E3779B97F4A7C15);
    size_t i = (size_t)(h >> 32) & mask;
    while (slots[i] >= 0 && keys[slots[i]] != label)
        i = (i + 1) & mask;
    return i;
}

PyDoc_STRVAR(Book_take_doc,
             "take($self, /)\n--\n\n"
             "The rows kept since the last take, and keep none of them: None when there are\n"
             "none, else (rows, the int64 columns in rowframe.INT_COLUMNS order as one bytes,\n"
             "the labels in order of first appearance, the request ids as UTF-8 joined by NUL).\n"
             "In the label column each row holds the row number where its label first appears;\n"
             "a label is (key + 1) << 32 | target << 8 | api.");

static PyObject *Book_take(BookObject *self, PyObject *Py_UNUSED(ignored))
{
    Py_ssize_t rows = self->rows;
    if (rows == 0)
        Py_RETURN_NONE;
    size_t mask = 1;
    while (mask < 2 * (size_t)rows)
        mask <<= 1;
    int64_t *slots = PyMem_Malloc(mask * sizeof(int64_t));
    int64_t *firsts = PyMem_Malloc((size_t)rows * sizeof(int64_t)); /* distinct: their rows */
    PyObject *ints = NULL, *labels = NULL, *ids = NULL, *out = NULL;
    if (slots == NULL || firsts == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    mask -= 1;
    for (size_t i = 0; i <= mask; i++)
        slots[i] = -1;
    int64_t *label = self->col[C_LABEL];
    Py_ssize_t distinct = 0;
    ints = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)C_COUNT * rows * 8);
    if (ints == NULL)
        goto done;
    int64_t *numbers = (int64_t *)(void *)(PyBytes_AS_STRING(ints) + (size_t)C_LABEL * rows * 8);
    for (Py_ssize_t r = 0; r < rows; r++) {
        size_t at = label_slot(label, slots, mask, label[r]);
        if (slots[at] < 0) {
            slots[at] = r;
            firsts[distinct++] = r;
        }
        numbers[r] = slots[at];
    }
    for (int c = 0; c < C_COUNT; c++)
        if (c != C_LABEL)
            memcpy(PyBytes_AS_STRING(ints) + (size_t)c * rows * 8, self->col[c],
                   (size_t)rows * 8);
    labels = PyList_New(distinct);
    if (labels == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < distinct; i++) {
        PyObject *v = PyLong_FromLongLong(label[firsts[i]]);
        if (v == NULL)
            goto done;
        PyList_SET_ITEM(labels, i, v);
    }
    ids = PyBytes_FromStringAndSize(self->ids, (Py_ssize_t)self->ids_len);
    if (ids == NULL)
        goto done;
    out = Py_BuildValue("(nOOO)", rows, ints, labels, ids);
    if (out != NULL) {
        self->rows = 0;
        self->ids_len = 0;
    }
done:
    Py_XDECREF(ints);
    Py_XDECREF(labels);
    Py_XDECREF(ids);
    PyMem_Free(slots);
    PyMem_Free(firsts);
    return out;
}

static PyObject *Book_get_rows_max(BookObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(self->rows_max);
}

static int Book_set_rows_max(BookObject *self, PyObject *value, void *Py_UNUSED(closure))
{
    int64_t v;
    if (value == NULL) {
        PyErr_SetString(PyExc_TypeError, "rows_max cannot be deleted");
        return -1;
    }
    if (arg_in_range(value, "rows_max", 0, INT64_C(1) << 24, &v) < 0)
        return -1;
    self->rows_max = (Py_ssize_t)v;
    return 0;
}

static PyObject *Book_get_rows(BookObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(self->rows);
}

static PyObject *Book_get_dropped(BookObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromLongLong(self->dropped);
}

static PyMethodDef Book_methods[] = {
    {"answer", FASTCALL(Book_answer), METH_FASTCALL, Book_answer_doc},
    {"take", (PyCFunction)Book_take, METH_NOARGS, Book_take_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Book_getset[] = {
    {"rows_max", (getter)Book_get_rows_max, (setter)Book_set_rows_max,
     "Rows kept until `take` at most (0: none, no ledger); a row past it is dropped.", NULL},
    {"rows", (getter)Book_get_rows, NULL, "Rows kept now.", NULL},
    {"dropped", (getter)Book_get_dropped, NULL, "Rows dropped: the buffers were full.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(Book_doc,
             "SpendBook(books, slot, width, keys, apis)\n--\n\n"
             "One worker's priced answers: `books` the spend counters (a tuple of Counters,\n"
             "blocks of 4096 fields: field ((key + 1) * width + target) * 2, + 1 for a request\n"
             "of unknown cost; a key >= `keys` counts as -1), `slot` this worker's row, `apis`\n"
             "the upstream paths whose index is a ledger row's api number (any other path:\n"
             "len(apis)). The ledger rows are kept by column until `take`.");

static PyType_Slot Book_slots[] = {
    {Py_tp_doc, (void *)Book_doc},
    {Py_tp_new, Book_new},
    {Py_tp_dealloc, Book_dealloc},
    {Py_tp_methods, Book_methods},
    {Py_tp_getset, Book_getset},
    {0, NULL},
};

static PyType_Spec Book_spec = {
    .name = "velox._native.SpendBook",
    .basicsize = sizeof(BookObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Book_slots,
};

int vxb_spend_exec(PyObject *module, module_state *st)
{
    PyTypeObject *type;
    (void)st;
    if (vxb_add_type(module, &Book_spec, &type) < 0)
        return -1;
    Py_DECREF(type); /* the module holds it */
    PyObject *names = PyTuple_New(VX_PRICE_FIELDS);
    if (names == NULL)
        return -1;
    for (int f = 0; f < VX_PRICE_FIELDS; f++) {
        PyObject *s = PyUnicode_FromString(price_field_names[f]);
        if (s == NULL) {
            Py_DECREF(names);
            return -1;
        }
        PyTuple_SET_ITEM(names, f, s);
    }
    int rc = PyModule_AddObjectRef(module, "SPEND_PRICE_FIELDS", names);
    Py_DECREF(names);
    return rc;
}
