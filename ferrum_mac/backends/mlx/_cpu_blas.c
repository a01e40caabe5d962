/* cblas_sgemm for MLX's CPU build, forwarded to an optimized BLAS (numpy's OpenBLAS).
 *
 * The Linux mlx[cpu] wheel bundles the reference (netlib) BLAS, and libmlx takes every
 * float32 matmul from its cblas_sgemm: a 31-token prefill of a 135M model spends seconds
 * there. `cpu_blas.py` loads this module with RTLD_GLOBAL before libmlx is loaded, so the
 * dynamic linker binds libmlx's cblas_sgemm to the one below, and routes it to the sgemm
 * of the OpenBLAS numpy ships (ILP64 builds: 64-bit sizes, or LP64: int sizes; both take
 * the same CBLAS enum values). Python side: route(address, ilp64), calls(), routed().
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

typedef void (*sgemm64_fn)(int, int, int, int64_t, int64_t, int64_t, float, const float *, int64_t,
                           const float *, int64_t, float, float *, int64_t);
typedef void (*sgemm32_fn)(int, int, int, int, int, int, float, const float *, int, const float *, int,
                           float, float *, int);

static sgemm64_fn target64;
static sgemm32_fn target32;
static unsigned long long routed_calls;

__attribute__((visibility("default"))) void cblas_sgemm(int order, int trans_a, int trans_b, int m, int n,
                                                        int k, float alpha, const float *a, int lda,
                                                        const float *b, int ldb, float beta, float *c,
                                                        int ldc) {
    if (target64) {
        __atomic_fetch_add(&routed_calls, 1, __ATOMIC_RELAXED);
        target64(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
        return;
    }
    if (target32) {
        __atomic_fetch_add(&routed_calls, 1, __ATOMIC_RELAXED);
        target32(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
        return;
    }
    /* Not routed (cpu_blas.py routes before MLX loads, so this should not happen): the next
     * cblas_sgemm in the lookup order. */
    static sgemm32_fn next;
    if (!next) next = (sgemm32_fn)dlsym(RTLD_NEXT, "cblas_sgemm");
    if (!next) {
        fprintf(stderr, "ferrum: cblas_sgemm called before it was routed to a BLAS; set FERRUM_CPU_BLAS=reference\n");
        abort();
    }
    next(order, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

static PyObject *route(PyObject *self, PyObject *args) {
    unsigned long long address;
    int ilp64;
    if (!PyArg_ParseTuple(args, "Kp", &address, &ilp64)) return NULL;
    if (!address) {
        PyErr_SetString(PyExc_ValueError, "route() needs the address of an sgemm");
        return NULL;
    }
    if (ilp64) {
        target32 = NULL;
        target64 = (sgemm64_fn)(uintptr_t)address;
    } else {
        target64 = NULL;
        target32 = (sgemm32_fn)(uintptr_t)address;
    }
    Py_RETURN_NONE;
}

static PyObject *calls(PyObject *self, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&routed_calls, __ATOMIC_RELAXED));
}

static PyObject *routed(PyObject *self, PyObject *unused) {
    return PyBool_FromLong(target64 != NULL || target32 != NULL);
}

static PyMethodDef methods[] = {
    {"route", route, METH_VARARGS, "route(address, ilp64): send cblas_sgemm to the sgemm at `address`."},
    {"calls", calls, METH_NOARGS, "How many cblas_sgemm calls were routed so far."},
    {"routed", routed, METH_NOARGS, "Whether cblas_sgemm is routed."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_blas", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cpu_blas(void) { return PyModule_Create(&module); }
