"""MLX's CPU matmuls routed to numpy's OpenBLAS (ferrum_mac/backends/mlx/cpu/blas.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from ferrum_mac.backends.mlx.cpu import blas as cpu_blas

linux_cpu = pytest.mark.skipif(
    not sys.platform.startswith("linux") or mx.default_device() != mx.cpu, reason="routes MLX's CPU build on Linux only"
)


def expected_active() -> bool:
    return importlib.util.find_spec(cpu_blas.EXTENSION) is not None and cpu_blas.numpy_openblas() is not None


@linux_cpu
def test_mlx_matmul_goes_through_openblas_and_matches_numpy():
    if not expected_active():
        pytest.skip(f"not routable here: {cpu_blas.status()}")
    assert cpu_blas.status().startswith("openblas"), cpu_blas.status()
    rng = np.random.default_rng(0)
    cases = [
        ((31, 576), (1536, 576), False, True),  # a prefill's projection: x W^T
        ((5, 7), (7, 3), False, False),
        ((1, 64), (320, 64), False, True),  # one row (a decode step), through sgemv
        ((1, 64), (64, 320), False, False),
        ((64, 1), (64, 320), True, False),
        ((48, 64), (64, 1), False, False),  # one column
        ((64, 48), (1, 64), True, True),
        ((1, 64), (64, 1), False, False),  # a dot product
    ]
    for shape_a, shape_b, transpose_a, transpose_b in cases:
        a, b = rng.standard_normal(shape_a, dtype=np.float32), rng.standard_normal(shape_b, dtype=np.float32)
        a, b = (a.T if transpose_a else a), (b.T if transpose_b else b)
        before = cpu_blas.routed_calls()
        got = np.array(mlx_matmul(a, b, transpose_a, transpose_b))
        assert cpu_blas.routed_calls() > before, (shape_a, shape_b)
        np.testing.assert_allclose(
            got, a @ b, rtol=1e-5, atol=1e-4, err_msg=str((shape_a, shape_b, transpose_a, transpose_b))
        )
    batched_a, batched_b = (
        rng.standard_normal((3, 1, 16), dtype=np.float32),
        rng.standard_normal((3, 16, 9), dtype=np.float32),
    )
    np.testing.assert_allclose(
        np.array(mx.array(batched_a) @ mx.array(batched_b)), batched_a @ batched_b, rtol=1e-5, atol=1e-4
    )


def mlx_matmul(a, b, transpose_a, transpose_b):
    """a @ b in MLX, a transposed operand given as a transposed view (so BLAS gets the flag)."""
    x = mx.array(np.ascontiguousarray(a.T)).T if transpose_a else mx.array(a)
    w = mx.array(np.ascontiguousarray(b.T)).T if transpose_b else mx.array(b)
    return x @ w


def run_python(code: str, **env) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


PROBE = """
import json, ferrum_mac.compose; ferrum_mac.compose.choose_backend("mlx"); import mlx.core as mx, numpy as np
from ferrum_mac.backends.mlx.cpu import blas as cpu_blas
a = np.arange(12, dtype=np.float32).reshape(3, 4); b = np.ones((4, 2), dtype=np.float32)
ok = bool(np.allclose(np.array(mx.array(a) @ mx.array(b)), a @ b))
print(json.dumps({"status": cpu_blas.status(), "calls": cpu_blas.routed_calls(), "ok": ok}))
"""


@linux_cpu
def test_routing_first_routes_a_fresh_process_and_the_env_switch_turns_it_off():
    if not expected_active():
        pytest.skip(f"not routable here: {cpu_blas.status()}")
    routed = run_python(PROBE)
    assert routed["status"].startswith("openblas") and routed["calls"] >= 1 and routed["ok"]
    reference = run_python(PROBE, FERRUM_CPU_BLAS="reference")
    assert reference == {"status": "reference: FERRUM_CPU_BLAS=reference", "calls": 0, "ok": True}


def test_mlx_loaded_before_ferrum_is_left_alone():
    late = run_python("import mlx.core\n" + PROBE)
    assert late["calls"] == 0 and late["ok"]
    assert late["status"].startswith("reference")


ROW_MAJOR, COL_MAJOR, NO_TRANS, TRANS = 101, 102, 111, 112


def stored(matrix: np.ndarray, order: int, ld: int) -> np.ndarray:
    """`matrix` laid out as BLAS reads it in `order` with leading dimension `ld` (padding after)."""
    rows, cols = matrix.shape
    if order == ROW_MAJOR:
        buf = np.full((rows, ld), np.nan, dtype=np.float32)
        buf[:, :cols] = matrix
    else:
        buf = np.full((cols, ld), np.nan, dtype=np.float32)
        buf[:, :rows] = matrix.T
    return buf


@linux_cpu
@pytest.mark.parametrize("order", [ROW_MAJOR, COL_MAJOR])
@pytest.mark.parametrize("trans_a", [NO_TRANS, TRANS])
@pytest.mark.parametrize("trans_b", [NO_TRANS, TRANS])
def test_the_shim_computes_sgemm_for_every_layout(order, trans_a, trans_b):
    """cblas_sgemm as libmlx calls it, straight into the extension: general products through
    sgemm, one-row and one-column ones through sgemv, padded leading dimensions, alpha and beta."""
    if not expected_active():
        pytest.skip(f"not routable here: {cpu_blas.status()}")
    import ctypes

    spec = importlib.util.find_spec(cpu_blas.EXTENSION)
    shim = ctypes.CDLL(spec.origin).cblas_sgemm
    c_int, c_float, ptr = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    shim.argtypes = [c_int, c_int, c_int, c_int, c_int, c_int, c_float, ptr, c_int, ptr, c_int, c_float, ptr, c_int]
    rng = np.random.default_rng(1)
    # (9, 6, 19) and (2, 3, 16): a speculative verify's few rows (`few_rows`, row-major A B^T)
    for m, n, k in [(1, 5, 7), (4, 1, 7), (1, 1, 7), (3, 4, 5), (9, 6, 19), (2, 3, 16), (13, 3, 20)]:
        op_a, op_b = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((k, n), dtype=np.float32)
        a = op_a if trans_a == NO_TRANS else op_a.T
        b = op_b if trans_b == NO_TRANS else op_b.T
        c = rng.standard_normal((m, n), dtype=np.float32)
        pad = lambda x: (x.shape[1] if order == ROW_MAJOR else x.shape[0]) + 2  # noqa: E731
        lda, ldb, ldc = pad(a), pad(b), pad(c)
        sa, sb, sc = stored(a, order, lda), stored(b, order, ldb), stored(c, order, ldc)
        before = cpu_blas.routed_calls()
        shim(order, trans_a, trans_b, m, n, k, 1.5, sa.ctypes.data, lda, sb.ctypes.data, ldb, 0.5, sc.ctypes.data, ldc)
        assert cpu_blas.routed_calls() == before + 1
        got = sc[:, :n] if order == ROW_MAJOR else sc[:, :m].T
        np.testing.assert_allclose(got, 1.5 * op_a @ op_b + 0.5 * c, rtol=1e-5, atol=1e-5, err_msg=str((m, n, k)))
        assert np.isnan(sc[:, -2:]).all()  # nothing written past the matrix


def test_importing_ferrum_alone_leaves_mlx_alone_and_opening_a_model_routes_it():
    """No import hook: `import ferrum_mac` changes nothing; the composition root routes the
    BLAS when it opens a model (here: `choose`, which every MLX path goes through)."""
    probe = PROBE.replace('ferrum_mac.compose.choose_backend("mlx")', "import ferrum_mac")
    plain = run_python(probe)
    assert plain["calls"] == 0 and plain["status"].startswith("reference: not activated")
    if expected_active() and sys.platform.startswith("linux") and mx.default_device() == mx.cpu:
        chosen = run_python(
            PROBE.replace('ferrum_mac.compose.choose_backend("mlx")', "ferrum_mac.backends.choose('mlx')")
        )
        assert chosen["status"].startswith("openblas") and chosen["calls"] >= 1
