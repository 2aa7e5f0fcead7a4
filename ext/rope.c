/* kvstore._rope: rotary position embedding over float32 rows in one pass, for the batched
 * engine's CPU forwards.
 *
 * out[n, h, i] = x[n, h, i] * cos[n, i] + rot[n, h, i] * sin[n, i],
 * rot = (-x[n, h, D/2:], x[n, h, :D/2])
 *
 * HF's apply_rotary_pos_emb, bit for bit: each product rounded, then the sum (built with
 * -ffp-contract=off: a fused multiply-add would round once and part from the model's own
 * results), and -x2 * s is -(x2 * s) exactly. HF runs it as five passes (a negation, a
 * concatenation, two products and a sum) with a temporary for each; here one pass reads the
 * rows where the projection left them (row stride ``xrow``, heads D apart) and writes
 * contiguous [N, H, D].
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "kv_clones.h"

KV_CLONES
static void rope_rows(const float *x, Py_ssize_t xrow, const float *cos, const float *sin,
                      Py_ssize_t csrow, float *out, Py_ssize_t n, Py_ssize_t heads,
                      Py_ssize_t dim) {
    const Py_ssize_t half = dim / 2;
    for (Py_ssize_t r = 0; r < n; r++) {
        const float *c = cos + r * csrow, *s = sin + r * csrow;
        for (Py_ssize_t h = 0; h < heads; h++) {
            const float *xi = x + r * xrow + h * dim;
            float *o = out + (r * heads + h) * dim;
#pragma omp simd
            for (Py_ssize_t i = 0; i < half; i++) {
                float a = xi[i] * c[i], b = xi[i + half] * s[i];
                o[i] = a - b;
            }
#pragma omp simd
            for (Py_ssize_t i = 0; i < half; i++) {
                float a = xi[i + half] * c[i + half], b = xi[i] * s[i + half];
                o[i + half] = a + b;
            }
        }
    }
}

PyDoc_STRVAR(rope_doc,
"rope(x, xrow, cos, sin, csrow, out, n, heads, dim) -> None\n\n"
"Rotary embedding of ``n`` rows of ``heads`` float32 vectors of ``dim`` (even): row ``r``'s\n"
"head ``h`` at ``x + (r * xrow + h * dim)`` floats, rotated by row ``r`` of ``cos`` and\n"
"``sin`` (``dim`` floats, rows ``csrow`` apart), into contiguous ``out [n, heads, dim]`` (may\n"
"not overlap ``x``); addresses as ints (data_ptr()).");

static PyObject *rope(PyObject *self, PyObject *args) {
    unsigned long long x, cos, sin, out;
    Py_ssize_t xrow, csrow, n, heads, dim;
    (void)self;
    if (!PyArg_ParseTuple(args, "KnKKnKnnn", &x, &xrow, &cos, &sin, &csrow, &out, &n, &heads,
                          &dim))
        return NULL;
    if (n < 0 || heads < 1 || dim < 2 || dim % 2 || xrow < heads * dim || csrow < dim || !x
        || !cos || !sin || !out) {
        PyErr_SetString(PyExc_ValueError, "rope: n >= 0, heads >= 1, an even dim, xrow >= "
                                          "heads * dim, csrow >= dim and non-null addresses");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    rope_rows((const float *)(uintptr_t)x, xrow, (const float *)(uintptr_t)cos,
              (const float *)(uintptr_t)sin, csrow, (float *)(uintptr_t)out, n, heads, dim);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"rope", rope, METH_VARARGS, rope_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvstore._rope",
    "One-pass float32 rotary embedding for the batched engine (engines/qkv.py).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__rope(void) { return PyModule_Create(&module); }
