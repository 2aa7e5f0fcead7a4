/* kvstore._rmsnorm: RMSNorm over float32 rows in one pass, for the batched engine's CPU runs.
 *
 * out[r, i] = w[i] * (x[r, i] * (1 / sqrt(mean(x[r, :]^2) + eps)))
 *
 * the order of HF's LlamaRMSNorm (x times the reciprocal root, then the weight); only the sum
 * of squares is added in another order (vector lanes), so results differ from torch's in the
 * last bits of some rows. Optional: without it the engine runs the model's own RMSNorm.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>

#include "kv_clones.h"

KV_CLONES
static void rms_rows(const float *x, const float *w, float *out, Py_ssize_t rows,
                     Py_ssize_t dim, float eps) {
    for (Py_ssize_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        float *o = out + r * dim;
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (Py_ssize_t i = 0; i < dim; i++)
            acc += xr[i] * xr[i];
        const float inv = 1.0f / sqrtf(acc / (float)dim + eps);
#pragma omp simd
        for (Py_ssize_t i = 0; i < dim; i++)
            o[i] = w[i] * (xr[i] * inv);
    }
}

PyDoc_STRVAR(rms_norm_doc,
"rms_norm(x, w, out, rows, dim, eps) -> None\n\n"
"RMSNorm of ``rows`` contiguous float32 rows of ``dim`` at address ``x`` with weight ``w``\n"
"(``dim`` float32) into ``out`` (may not overlap ``x``); addresses as ints (data_ptr()).");

static PyObject *rms_norm(PyObject *self, PyObject *args) {
    unsigned long long x, w, out;
    Py_ssize_t rows, dim;
    double eps;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKKnnd", &x, &w, &out, &rows, &dim, &eps))
        return NULL;
    if (rows < 0 || dim <= 0 || !x || !w || !out) {
        PyErr_SetString(PyExc_ValueError, "rms_norm: rows >= 0, dim > 0 and non-null addresses");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    rms_rows((const float *)(uintptr_t)x, (const float *)(uintptr_t)w, (float *)(uintptr_t)out,
             rows, dim, (float)eps);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"rms_norm", rms_norm, METH_VARARGS, rms_norm_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvstore._rmsnorm",
    "One-pass float32 RMSNorm for the batched engine (kvstore.integrations.batch.engines.norm).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__rmsnorm(void) { return PyModule_Create(&module); }
