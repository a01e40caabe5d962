"""MLX's CPU matmuls routed to numpy's OpenBLAS (ferrum_mac/backends/mlx/cpu_blas.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from ferrum_mac.backends.mlx import cpu_blas

linux_cpu = pytest.mark.skipif(
    not sys.platform.startswith("linux") or mx.default_device() != mx.cpu, reason="routes MLX's CPU build on Linux only"
)


def expected_active() -> bool:
    return importlib.util.find_spec(cpu_blas.EXTENSION) is not None and cpu_blas._numpy_openblas_sgemm() is not None


@linux_cpu
def test_mlx_matmul_goes_through_openblas_and_matches_numpy():
    if not expected_active():
        pytest.skip(f"not routable here: {cpu_blas.status()}")
    assert cpu_blas.status().startswith("openblas"), cpu_blas.status()
    rng = np.random.default_rng(0)
    for shape_a, shape_b, transpose in [((31, 576), (1536, 576), True), ((1, 64), (64, 320), False), ((5, 7), (7, 3), False)]:
        a, b = rng.standard_normal(shape_a, dtype=np.float32), rng.standard_normal(shape_b, dtype=np.float32)
        before = cpu_blas.routed_calls()
        x, w = mx.array(a), mx.array(b)
        got = np.array(x @ (w.T if transpose else w))
        assert cpu_blas.routed_calls() > before
        np.testing.assert_allclose(got, a @ (b.T if transpose else b), rtol=1e-5, atol=1e-4)


def run_python(code: str, **env) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


PROBE = """
import json, ferrum_mac, mlx.core as mx, numpy as np
from ferrum_mac.backends.mlx import cpu_blas
a = np.arange(12, dtype=np.float32).reshape(3, 4); b = np.ones((4, 2), dtype=np.float32)
ok = bool(np.allclose(np.array(mx.array(a) @ mx.array(b)), a @ b))
print(json.dumps({"status": cpu_blas.status(), "calls": cpu_blas.routed_calls(), "ok": ok}))
"""


@linux_cpu
def test_importing_ferrum_first_routes_a_fresh_process_and_the_env_switch_turns_it_off():
    if not expected_active():
        pytest.skip(f"not routable here: {cpu_blas.status()}")
    routed = run_python(PROBE)
    assert routed["status"].startswith("openblas") and routed["calls"] >= 1 and routed["ok"]
    reference = run_python(PROBE, FERRUM_CPU_BLAS="reference")
    assert reference == {"status": "reference: FERRUM_CPU_BLAS=reference", "calls": 0, "ok": True}


def test_mlx_loaded_before_ferrum_is_left_alone():
    late = run_python(PROBE.replace("import json, ferrum_mac, mlx.core as mx", "import json, mlx.core as mx, ferrum_mac"))
    assert late["calls"] == 0 and late["ok"]
    assert late["status"].startswith("reference")
