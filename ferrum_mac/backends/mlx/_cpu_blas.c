/* cblas_sgemm for MLX's CPU build, forwarded to an optimized BLAS (numpy's OpenBLAS).
 *
 * The Linux mlx[cpu] wheel bundles the reference (netlib) BLAS, and libmlx takes every
 * float32 matmul from its cblas_sgemm: a 31-token prefill of a 135M model spends seconds
 * there. `cpu_blas.py` loads this module with RTLD_GLOBAL before libmlx is loaded, so the
 * dynamic linker binds libmlx's cblas_sgemm to the one below, which calls the OpenBLAS numpy
 * ships (ILP64 builds: 64-bit sizes, or LP64: int sizes; both take the same CBLAS enum
 * values). A product with one row or one column (every decode step) goes to sgemv, which
 * OpenBLAS runs ~4x faster than its sgemm of that shape.
 * Python side: route(sgemm, sgemv, ilp64) with function addresses (sgemv may be 0), calls().
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
typedef void (*sgemv64_fn)(int, int, int64_t, int64_t, float, const float *, int64_t, const float *, int64_t,
                           float, float *, int64_t);
typedef void (*sgemv32_fn)(int, int, int, int, float, const float *, int, const float *, int, float, float *,
                           int);

enum { ROW_MAJOR = 101, COL_MAJOR = 102, NO_TRANS = 111, TRANS = 112 }; /* CBLAS's values */

static void *sgemm_target, *sgemv_target;
static int ilp64;
static unsigned long long routed_calls;

static void gemv(int trans, int rows, int cols, float alpha, const float *a, int lda, const float *x, int incx,
                 float beta, float *y, int incy) {
    if (ilp64)
        ((sgemv64_fn)sgemv_target)(ROW_MAJOR, trans, rows, cols, alpha, a, lda, x, incx, beta, y, incy);
    else
        ((sgemv32_fn)sgemv_target)(ROW_MAJOR, trans, rows, cols, alpha, a, lda, x, incx, beta, y, incy);
}

/* C = alpha op(A) op(B) + beta C as one sgemv when C has one row or one column (row-major). */
static int as_gemv(int ta, int tb, int m, int n, int k, float alpha, const float *a, int lda, const float *b,
                   int ldb, float beta, float *c, int ldc) {
    if (!sgemv_target || m <= 0 || n <= 0 || k <= 0) return 0;
    if (m == 1) { /* c (1 x n) = op(B)^T a: a's elements lie 1 apart (A is 1 x k) or lda apart */
        int incx = ta == NO_TRANS ? 1 : lda;
        if (tb == NO_TRANS)
            gemv(TRANS, k, n, alpha, b, ldb, a, incx, beta, c, 1);
        else
            gemv(NO_TRANS, n, k, alpha, b, ldb, a, incx, beta, c, 1);
        return 1;
    }
    if (n == 1) { /* c (m x 1, rows ldc apart) = op(A) b: b's elements lie ldb apart (B is k x 1) or 1 */
        int incx = tb == NO_TRANS ? ldb : 1;
        if (ta == NO_TRANS)
            gemv(NO_TRANS, m, k, alpha, a, lda, b, incx, beta, c, ldc);
        else
            gemv(TRANS, k, m, alpha, a, lda, b, incx, beta, c, ldc);
        return 1;
    }
    return 0;
}

__attribute__((visibility("default"))) void cblas_sgemm(int order, int ta, int tb, int m, int n, int k,
                                                        float alpha, const float *a, int lda, const float *b,
                                                        int ldb, float beta, float *c, int ldc) {
    if (sgemm_target) {
        __atomic_fetch_add(&routed_calls, 1, __ATOMIC_RELAXED);
        int done = order == ROW_MAJOR
                       ? as_gemv(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)
                       /* column-major C is row-major C^T = op(B)^T op(A)^T */
                       : order == COL_MAJOR && as_gemv(tb, ta, n, m, k, alpha, b, ldb, a, lda, beta, c, ldc);
        if (done) return;
        if (ilp64)
            ((sgemm64_fn)sgemm_target)(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
        else
            ((sgemm32_fn)sgemm_target)(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
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
    next(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

static PyObject *route(PyObject *self, PyObject *args) {
    unsigned long long sgemm, sgemv;
    int wide;
    if (!PyArg_ParseTuple(args, "KKp", &sgemm, &sgemv, &wide)) return NULL;
    if (!sgemm) {
        PyErr_SetString(PyExc_ValueError, "route() needs the address of an sgemm");
        return NULL;
    }
    ilp64 = wide;
    sgemv_target = (void *)(uintptr_t)sgemv;
    sgemm_target = (void *)(uintptr_t)sgemm;
    Py_RETURN_NONE;
}

static PyObject *calls(PyObject *self, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&routed_calls, __ATOMIC_RELAXED));
}

static PyObject *routed(PyObject *self, PyObject *unused) { return PyBool_FromLong(sgemm_target != NULL); }

static PyMethodDef methods[] = {
    {"route", route, METH_VARARGS,
     "route(sgemm, sgemv, ilp64): send cblas_sgemm to the sgemm (and one-row or one-column products to the "
     "sgemv, when not 0) at these addresses."},
    {"calls", calls, METH_NOARGS, "How many cblas_sgemm calls were routed so far."},
    {"routed", routed, METH_NOARGS, "Whether cblas_sgemm is routed."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_blas", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cpu_blas(void) { return PyModule_Create(&module); }
