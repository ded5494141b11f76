/* bind.h: what every binding file of velox._native shares.
 *
 * The extension is one module file (_velox_native.c: module state and init) and one
 * bind_<core>.c per C core, as CPython's Modules/_io/ is laid out. Each binding file holds
 * the argument parsing, reference ownership and exceptions for its core, and one
 * vxb_<core>_exec() that adds its types, functions and constants to the module. The cores
 * (vx_*.c) include no Python header.
 *
 * Errors: ValueError for bad values (including integers too large for int64, never
 * OverflowError), TypeError for wrong types, IndexError for slot/field out of range.
 */
#ifndef VX_BIND_H
#define VX_BIND_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h> /* PyMemberDef, T_PYSSIZET: the 3.11 spelling */

#include <stdbool.h>
#include <stdint.h>

#include "vx_reqhead.h" /* VX_RH_METHODS, for the module state */

/* Common field names the request-head parser shares as one bytes object each. */
#define VXB_RH_NAMES 19

/* Per-module state (multi-phase init: no process-global Python objects). */
typedef struct {
    PyTypeObject *ring_type;
    PyTypeObject *counters_type;
    PyTypeObject *hist_type;
    PyTypeObject *health_type;
    PyTypeObject *budget_type;
    PyTypeObject *hrw_type;
    PyTypeObject *cache_type;
    PyTypeObject *limits_type;
    PyTypeObject *h2_type;
    PyTypeObject *gate_type;
    PyTypeObject *book_type; /* books: AccessBook, which access_lines also uses */
    PyObject *methods[VX_RH_METHODS]; /* reqhead: one bytes object per method, shared */
    PyObject *names[VXB_RH_NAMES];    /* reqhead: the lower-case common names, shared */
} module_state;

/* METH_FASTCALL / METH_FASTCALL|METH_KEYWORDS / METH_VARARGS|METH_KEYWORDS functions, cast
 * through void (*)(void) so -Wcast-function-type accepts them. */
#define FASTCALL(f) (PyCFunction)(void (*)(void))(f)
#define KWCALL(f) (PyCFunction)(void (*)(void))(f)
#define FASTCALL_KW(f) (PyCFunction)(void (*)(void))(f)

/* A module-level int constant mirroring a core's header, so Python never hard-codes it. */
typedef struct {
    const char *name;
    long value;
} vxb_int_const;

/* Create a heap type from spec, keep it in *slot, add it to module (inline: the lab's bucket
 * module shares it). */
static inline int vxb_add_type(PyObject *module, PyType_Spec *spec, PyTypeObject **slot)
{
    /* New reference, kept in the module state; PyModule_AddType adds its own. */
    *slot = (PyTypeObject *)PyType_FromModuleAndSpec(module, spec, NULL);
    if (*slot == NULL)
        return -1;
    return PyModule_AddType(module, *slot);
}

/* Add n int constants. */
static inline int vxb_add_ints(PyObject *module, const vxb_int_const *table, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (PyModule_AddIntConstant(module, table[i].name, table[i].value) < 0)
            return -1;
    return 0;
}

/* One per binding file: add its types, functions and constants. 0, or -1 with an exception. */
int vxb_ring_exec(PyObject *module, module_state *st);
int vxb_stats_exec(PyObject *module, module_state *st);
int vxb_health_exec(PyObject *module, module_state *st);
int vxb_cache_exec(PyObject *module, module_state *st);
int vxb_h2_exec(PyObject *module, module_state *st);
int vxb_hash_exec(PyObject *module, module_state *st);
int vxb_json_exec(PyObject *module, module_state *st);
int vxb_limits_exec(PyObject *module, module_state *st);
int vxb_http1_exec(PyObject *module, module_state *st);
int vxb_reqhead_exec(PyObject *module, module_state *st);
int vxb_relay_exec(PyObject *module, module_state *st);
int vxb_books_exec(PyObject *module, module_state *st);
int vxb_h1resp_exec(PyObject *module, module_state *st);
int vxb_budgets_exec(PyObject *module, module_state *st);
int vxb_sink_exec(PyObject *module, module_state *st);

/* The core behind a Limits / Counters object, for a binding that drives several cores in one
 * call (bind_budgets.c); NULL with TypeError when o is not of that type. */
struct vx_limits;
struct vx_counters;
struct vx_limits *vxb_limits_core(PyObject *o, module_state *st);
struct vx_counters *vxb_counters_core(PyObject *o, module_state *st);

/* ---------------------------------------------------------------- integer arguments */

/* Convert o (an int or an object with __index__) to int64 into *out. Returns 0, or -1 with
 * TypeError set for non-integers. *overflow is set to +1/-1 (and *out to INT64_MAX/INT64_MIN)
 * when the value does not fit, so callers can clamp or raise ValueError as their contract
 * says, instead of leaking OverflowError. */
static inline int to_i64(PyObject *o, int64_t *out, int *overflow)
{
    long long v;
    *overflow = 0;
    if (PyLong_CheckExact(o)) {
        v = PyLong_AsLongLongAndOverflow(o, overflow);
    } else {
        PyObject *idx = PyNumber_Index(o); /* new reference; TypeError for float, str, ... */
        if (idx == NULL)
            return -1;
        v = PyLong_AsLongLongAndOverflow(idx, overflow);
        Py_DECREF(idx);
    }
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (*overflow)
        v = *overflow > 0 ? INT64_MAX : INT64_MIN;
    *out = (int64_t)v;
    return 0;
}

/* to_i64 that also requires lo <= value <= hi; otherwise ValueError naming the argument and
 * quoting the value as given. Returns 0 or -1 with an exception set. */
static inline int arg_in_range(PyObject *o, const char *name, int64_t lo, int64_t hi, int64_t *out)
{
    int overflow;
    if (to_i64(o, out, &overflow) < 0)
        return -1;
    if (overflow || *out < lo || *out > hi) {
        PyErr_Format(PyExc_ValueError, "%s must be an integer in [%lld, %lld], got %R", name,
                     (long long)lo, (long long)hi, o);
        return -1;
    }
    return 0;
}

/* Slot/field index: 0 <= value < n, or IndexError. */
static inline int arg_index(PyObject *o, const char *name, size_t n, size_t *out)
{
    int64_t v;
    int overflow;
    if (to_i64(o, &v, &overflow) < 0)
        return -1;
    if (overflow || v < 0 || (uint64_t)v >= n) {
        PyErr_Format(PyExc_IndexError, "%s %R out of range [0, %zu)", name, o, n);
        return -1;
    }
    *out = (size_t)v;
    return 0;
}

/* Histogram slot: -1 (all slots) or a valid index, else IndexError. */
static inline int arg_hist_slot(PyObject *o, size_t n, long *out)
{
    if (o == NULL) {
        *out = -1;
        return 0;
    }
    int64_t v;
    int overflow;
    if (to_i64(o, &v, &overflow) < 0)
        return -1;
    if (overflow || v < -1 || (v >= 0 && (uint64_t)v >= n)) {
        PyErr_Format(PyExc_IndexError, "slot %R out of range: -1 (all) or [0, %zu)", o, n);
        return -1;
    }
    *out = (long)v;
    return 0;
}

static inline int check_nargs(const char *fname, Py_ssize_t nargs, Py_ssize_t lo, Py_ssize_t hi)
{
    if (nargs < lo || nargs > hi) {
        if (lo == hi)
            PyErr_Format(PyExc_TypeError, "%s() takes exactly %zd positional argument%s (%zd given)",
                         fname, lo, lo == 1 ? "" : "s", nargs);
        else
            PyErr_Format(PyExc_TypeError, "%s() takes from %zd to %zd positional arguments (%zd given)",
                         fname, lo, hi, nargs);
        return -1;
    }
    return 0;
}

/* A clock reading in microseconds, as the test hooks take it. */
static inline int arg_now(PyObject *o, int64_t *now)
{
    return arg_in_range(o, "now_us", INT64_MIN, INT64_MAX, now);
}

/* Test hooks' busy loops are bounded: a hook should not be able to hang a run. */
#define HAMMER_MAX_US INT64_C(60000000)

#endif
