#include "bind.h"
#include "vx_json.h"

/* ---------------------------------------------------------------- scan_json */

/* Smaller buffers are scanned with the GIL held: they take a few microseconds at most, less
 * than what giving the GIL away can cost when other threads want it (the switch itself, and
 * a wait of up to the switch interval, 5 ms by default, to get it back). */
#define SCAN_JSON_NOGIL_MIN 65536

PyDoc_STRVAR(scan_json_doc,
             "scan_json(buf, /)\n--\n\n"
             "Validate buf (any C-contiguous buffer) as one JSON text, accepting exactly what\n"
             "orjson.loads accepts, and find the top-level \"model\" and \"stream\" keys.\n"
             "Returns (error, error_offset, model_start, model_end, model_kind, stream_kind,\n"
             "top_kind): error is JSON_OK (0) or a JSON_E_* code; kinds are JSON_* constants.\n"
             "Buffers of 64 KiB or more are scanned with the GIL released.");

static PyObject *native_scan_json(PyObject *Py_UNUSED(module), PyObject *arg)
{
    Py_buffer view;
    /* PyBUF_SIMPLE: the bytes as one contiguous block (BufferError for a non-contiguous
     * memoryview, TypeError for non-buffers). The export is what keeps the memory valid
     * while the GIL is released: as long as it is held, the exporter may not free or move
     * its memory (a bytearray refuses to resize with BufferError), even if another thread
     * drops its last reference to the object, because the view owns one (view.obj). */
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const unsigned char *buf = view.buf;
    size_t len = (size_t)view.len;
    vx_json_fields f;
    int rc;
    if (view.len >= SCAN_JSON_NOGIL_MIN) {
        /* No Python object is touched in here: buf and len are plain copies, f is ours. */
        Py_BEGIN_ALLOW_THREADS
        rc = vx_json_scan(buf, len, &f);
        Py_END_ALLOW_THREADS
    } else {
        rc = vx_json_scan(buf, len, &f);
    }
    PyBuffer_Release(&view); /* ends the export; drops view.obj's reference */

    /* Offsets are at most len, which came from a Py_ssize_t, so the casts are exact. */
    Py_ssize_t vals[7] = {rc, (Py_ssize_t)f.error_offset, (Py_ssize_t)f.model_start,
                          (Py_ssize_t)f.model_end, f.model_kind, f.stream_kind, f.top_kind};
    PyObject *result = PyTuple_New(7); /* new reference */
    if (result == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < 7; i++) {
        PyObject *v = PyLong_FromSsize_t(vals[i]);
        if (v == NULL) {
            Py_DECREF(result); /* tuple dealloc skips the NULL slots */
            return NULL;
        }
        PyTuple_SET_ITEM(result, i, v); /* steals v */
    }
    return result;
}

/* ---------------------------------------------------------------- init */

/* Mirrors of the core's header, so Python code never hard-codes the numbers. */
static const vxb_int_const constants[] = {
    {"JSON_ABSENT", VX_JSON_ABSENT},
    {"JSON_NULL", VX_JSON_NULL},
    {"JSON_FALSE", VX_JSON_FALSE},
    {"JSON_TRUE", VX_JSON_TRUE},
    {"JSON_NUMBER", VX_JSON_NUMBER},
    {"JSON_STRING", VX_JSON_STRING},
    {"JSON_ARRAY", VX_JSON_ARRAY},
    {"JSON_OBJECT", VX_JSON_OBJECT},
    {"JSON_OK", VX_JSON_OK},
    {"JSON_E_EMPTY", VX_JSON_E_EMPTY},
    {"JSON_E_TRUNCATED", VX_JSON_E_TRUNCATED},
    {"JSON_E_SYNTAX", VX_JSON_E_SYNTAX},
    {"JSON_E_TRAILING", VX_JSON_E_TRAILING},
    {"JSON_E_DEPTH", VX_JSON_E_DEPTH},
    {"JSON_E_NUMBER", VX_JSON_E_NUMBER},
    {"JSON_E_RANGE", VX_JSON_E_RANGE},
    {"JSON_E_CONTROL", VX_JSON_E_CONTROL},
    {"JSON_E_ESCAPE", VX_JSON_E_ESCAPE},
    {"JSON_E_SURROGATE", VX_JSON_E_SURROGATE},
    {"JSON_E_UTF8", VX_JSON_E_UTF8},
    {"JSON_E_TOO_LARGE", VX_JSON_E_TOO_LARGE},
    {"JSON_MAX_DEPTH", VX_JSON_MAX_DEPTH},
};

static PyMethodDef functions[] = {
    {"scan_json", (PyCFunction)native_scan_json, METH_O, scan_json_doc},
    {NULL, NULL, 0, NULL},
};

int vxb_json_exec(PyObject *module, module_state *st)
{
    (void)st;
    if (vxb_add_ints(module, constants, sizeof constants / sizeof constants[0]) < 0 ||
        PyModule_AddFunctions(module, functions) < 0)
        return -1;
    return 0;
}
