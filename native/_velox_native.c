/* velox._native: the CPython extension of the native core, reduced to its module state and
 * init. Each C core has its binding file (bind_<core>.c: ring, stats, health, cache, h2,
 * hash, json, limits, http1, reqhead, relay, books, h1resp; budgets drives limits + stats;
 * sink is the direct path h1resp and h2 share),
 * sharing bind.h; the cores themselves (vx_*.c) are plain C11 with no Python header.
 *
 * Heap types created per module (PyType_FromModuleAndSpec) and multi-phase init, so the
 * module holds no process-global Python state.
 */
#include "bind.h"

PyDoc_STRVAR(module_doc,
             "Private native core of Velox: bounded MPMC ring, shared limits (token buckets\n"
             "and gauges), shared counters and latency histograms, GIL-free JSON request scanner, shared\n"
             "circuit breakers and retry budget, stable hashes, shared response cache store.\n\n"
             "Do not import this module directly: one facade module per core is its public\n"
             "face (velox.state.*, velox.ingress.ring/reqhead/h1write/scan, ...; the list is\n"
             "the import contract in pyproject.toml).");


/* ---------------------------------------------------------------- module */

/* One entry per binding file; the order is only the order of the module's attributes. */
static int (*const binding_exec[])(PyObject *, module_state *) = {
    vxb_ring_exec,  vxb_stats_exec,  vxb_health_exec, vxb_cache_exec,
    vxb_h2_exec,    vxb_hash_exec,   vxb_json_exec,   vxb_limits_exec, vxb_http1_exec,
    vxb_reqhead_exec, vxb_relay_exec, vxb_books_exec,
    vxb_h1resp_exec, vxb_budgets_exec, vxb_sink_exec,
};

static int module_exec(PyObject *module)
{
    module_state *st = PyModule_GetState(module);
    for (size_t i = 0; i < sizeof binding_exec / sizeof binding_exec[0]; i++)
        if (binding_exec[i](module, st) < 0)
            return -1;
    return 0;
}

static int module_traverse(PyObject *module, visitproc visit, void *arg)
{
    module_state *st = PyModule_GetState(module);
    if (st == NULL)
        return 0;
    Py_VISIT(st->ring_type);
    Py_VISIT(st->counters_type);
    Py_VISIT(st->hist_type);
    Py_VISIT(st->health_type);
    Py_VISIT(st->budget_type);
    Py_VISIT(st->hrw_type);
    Py_VISIT(st->cache_type);
    Py_VISIT(st->limits_type);
    Py_VISIT(st->h2_type);
    Py_VISIT(st->gate_type);
    Py_VISIT(st->book_type);
    for (int m = 0; m < VX_RH_METHODS; m++)
        Py_VISIT(st->methods[m]);
    for (size_t i = 0; i < VXB_RH_NAMES; i++)
        Py_VISIT(st->names[i]);
    return 0;
}

static int module_clear(PyObject *module)
{
    module_state *st = PyModule_GetState(module);
    if (st == NULL)
        return 0;
    Py_CLEAR(st->ring_type);
    Py_CLEAR(st->counters_type);
    Py_CLEAR(st->hist_type);
    Py_CLEAR(st->health_type);
    Py_CLEAR(st->budget_type);
    Py_CLEAR(st->hrw_type);
    Py_CLEAR(st->cache_type);
    Py_CLEAR(st->limits_type);
    Py_CLEAR(st->h2_type);
    Py_CLEAR(st->gate_type);
    Py_CLEAR(st->book_type);
    for (int m = 0; m < VX_RH_METHODS; m++)
        Py_CLEAR(st->methods[m]);
    for (size_t i = 0; i < VXB_RH_NAMES; i++)
        Py_CLEAR(st->names[i]);
    return 0;
}

static void module_free(void *module)
{
    module_clear((PyObject *)module);
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "velox._native",
    .m_doc = module_doc,
    .m_size = sizeof(module_state),
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit__native(void)
{
    return PyModuleDef_Init(&native_module);
}
