/* cblas_sgemm for MLX's CPU build, forwarded to an optimized BLAS (numpy's OpenBLAS).
 *
 * The Linux mlx[cpu] wheel bundles the reference (netlib) BLAS, and libmlx takes every
 * float32 matmul from its cblas_sgemm: a 31-token prefill of a 135M model spends seconds
 * there. `blas.py` loads this module with RTLD_GLOBAL before libmlx is loaded, so the
 * dynamic linker binds libmlx's cblas_sgemm to the one below, which calls the OpenBLAS numpy
 * ships (ILP64 builds: 64-bit sizes, or LP64: int sizes; both take the same CBLAS enum
 * values). A product with one row or one column (every decode step) goes to sgemv, which
 * OpenBLAS runs ~4x faster than its sgemm of that shape. A product of a few rows (2 to
 * SMALL_ROWS) by a transposed weight, a speculative verify's, runs in `few_rows` below: every
 * weight row is read once for all the rows, where OpenBLAS's sgemm first copies (packs) the
 * whole weight and then reads it again, several times a decode step's cost for one more row.
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

/* C (m x n) = alpha A (m x k) B^T + beta C, B (n x k) row-major, for 2 <= m <= SMALL_ROWS: each
 * row of B is loaded once and multiplied into every row of A (which stays in cache), so the
 * product costs about what reading B does, as a one-row product does. */
#define SMALL_ROWS 12

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

__attribute__((target("avx2,fma"))) static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

__attribute__((target("avx2,fma"), always_inline)) static inline void rows_by_columns(
    const int m, int n, int k, float alpha, const float *a, int lda, const float *b, int ldb, float beta, float *c,
    int ldc) {
    for (int j = 0; j < n; j++) {
        const float *w = b + (size_t)j * ldb;
        __m256 acc[SMALL_ROWS];
#pragma GCC unroll 12
        for (int i = 0; i < m; i++) acc[i] = _mm256_setzero_ps();
        int l = 0;
        for (; l + 8 <= k; l += 8) {
            __m256 wv = _mm256_loadu_ps(w + l);
#pragma GCC unroll 12
            for (int i = 0; i < m; i++) acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(a + (size_t)i * lda + l), wv, acc[i]);
        }
        for (int i = 0; i < m; i++) {
            float sum = hsum(acc[i]);
            for (int t = l; t < k; t++) sum += a[(size_t)i * lda + t] * w[t];
            float *out = c + (size_t)i * ldc + j;
            *out = beta == 0.0f ? alpha * sum : alpha * sum + beta * *out;
        }
    }
}

#define ROWS_CASE(M)                                                   \
    case M:                                                            \
        rows_by_columns(M, n, k, alpha, a, lda, b, ldb, beta, c, ldc); \
        return 1;

__attribute__((target("avx2,fma"))) static int few_rows_avx2(int m, int n, int k, float alpha, const float *a,
                                                             int lda, const float *b, int ldb, float beta, float *c,
                                                             int ldc) {
    switch (m) {
        ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7)
        ROWS_CASE(8) ROWS_CASE(9) ROWS_CASE(10) ROWS_CASE(11) ROWS_CASE(12)
    }
    return 0;
}

static int few_rows(int ta, int tb, int m, int n, int k, float alpha, const float *a, int lda, const float *b,
                    int ldb, float beta, float *c, int ldc) {
    static int usable = -1;
    if (usable < 0) usable = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (!usable || ta != NO_TRANS || tb != TRANS || m < 2 || m > SMALL_ROWS || n <= 0 || k <= 0) return 0;
    return few_rows_avx2(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
#else
static int few_rows(int ta, int tb, int m, int n, int k, float alpha, const float *a, int lda, const float *b,
                    int ldb, float beta, float *c, int ldc) {
    return 0;
}
#endif

__attribute__((visibility("default"))) void cblas_sgemm(int order, int ta, int tb, int m, int n, int k,
                                                        float alpha, const float *a, int lda, const float *b,
                                                        int ldb, float beta, float *c, int ldc) {
    if (sgemm_target) {
        __atomic_fetch_add(&routed_calls, 1, __ATOMIC_RELAXED);
        int done = order == ROW_MAJOR
                       ? as_gemv(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc) ||
                             few_rows(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)
                       /* column-major C is row-major C^T = op(B)^T op(A)^T */
                       : order == COL_MAJOR && as_gemv(tb, ta, n, m, k, alpha, b, ldb, a, lda, beta, c, ldc);
        if (done) return;
        if (ilp64)
            ((sgemm64_fn)sgemm_target)(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
        else
            ((sgemm32_fn)sgemm_target)(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
        return;
    }
    /* Not routed (blas.py routes before MLX loads, so this should not happen): the next
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
