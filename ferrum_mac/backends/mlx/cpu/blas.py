"""MLX's CPU matmuls on numpy's OpenBLAS instead of the reference BLAS the Linux wheel bundles.

The Linux `mlx[cpu]` wheel ships the reference (netlib) BLAS, and libmlx takes every float32
matmul from its `cblas_sgemm`, many times slower than OpenBLAS at a prompt's products
(a 31-row product of SmolLM2's: 44 ms against OpenBLAS's 1.2). numpy, already a dependency, ships
OpenBLAS. `activate()` loads the small `_cpu_blas` extension (built from `_cpu_blas.c` at
install) with RTLD_GLOBAL before libmlx is loaded, so the dynamic linker binds libmlx's
`cblas_sgemm` to the extension's, which calls OpenBLAS's sgemm (or its sgemv for a product
with one row or column: a decode step's).

It has to run before the process first imports `mlx.core`: `backends.choose` calls it
before anything imports MLX. It does nothing (MLX keeps its own BLAS) on macOS (MLX
uses Accelerate there), once MLX is loaded, with FERRUM_CPU_BLAS=reference, or when the
extension was not built or numpy has no OpenBLAS of its own. It also gives OpenBLAS one
thread less than the machine has cores (`_limit_threads`); numpy in the same process shares
that setting.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys
from typing import NamedTuple

ENV = "FERRUM_CPU_BLAS"  # its setting: "reference" leaves MLX on the BLAS its wheel bundles
EXTENSION = "ferrum_mac.backends.mlx.cpu._cpu_blas"
# Name patterns of the CBLAS entry points of numpy's OpenBLAS builds ({} is sgemm or sgemv),
# with whether they take 64-bit sizes (ILP64)
SYMBOLS = (
    ("scipy_cblas_{}64_", True),  # numpy >= 2 (scipy-openblas64)
    ("cblas_{}64_", True),  # numpy 1.26 (openblas64_)
    ("scipy_cblas_{}", False),  # scipy-openblas32
    ("cblas_{}", False),  # a plain LP64 OpenBLAS
)

_state: str | None = None
_module = None
_libraries: list = []  # keep the loaded libraries referenced


def activate(mode: str = "openblas") -> str:
    """Route MLX's cblas_sgemm to numpy's OpenBLAS if this process can and `mode` (FERRUM_CPU_BLAS's
    value) is "openblas"; idempotent (the first call decides). Returns `status()`."""
    global _state
    if _state is None:
        _state = _activate(mode)
    return _state


def status() -> str:
    """'openblas (PATH, N threads)' when MLX's CPU matmuls go to OpenBLAS, else 'reference: WHY'."""
    return _state or "reference: not activated (ferrum routes the BLAS before MLX is first imported)"


def routed_calls() -> int:
    """How many cblas_sgemm calls went to OpenBLAS so far (0 when not active)."""
    return _module.calls() if _module is not None else 0


def _activate(mode: str) -> str:
    global _module
    if not sys.platform.startswith("linux"):
        return "reference: only Linux MLX builds bundle the reference BLAS"
    if mode != "openblas":
        return f"reference: {ENV}={mode}"
    if "mlx.core" in sys.modules:
        return "reference: MLX was loaded before ferrum could route its BLAS"
    try:
        spec = importlib.util.find_spec(EXTENSION)
        if spec is None or not spec.origin:
            return "reference: the _cpu_blas extension was not built (no C compiler at install?)"
        blas = numpy_openblas()
        if blas is None:
            return "reference: numpy has no OpenBLAS of its own"
        import ctypes

        _libraries.append(ctypes.CDLL(spec.origin, mode=ctypes.RTLD_GLOBAL))
        module = importlib.import_module(EXTENSION)  # the same loaded library, now as a module
        module.route(blas.sgemm, blas.sgemv, blas.ilp64)
        threads = _limit_threads(blas.library, blas.ilp64)
    except (ImportError, OSError, AttributeError, ValueError) as e:
        return f"reference: routing to OpenBLAS failed ({e})"
    _module = module
    return f"openblas ({blas.path}{f', {threads} thread' + 's' * (threads > 1) if threads else ''})"


def _limit_threads(library, ilp64: bool) -> int | None:
    """Leave a core to the rest of the process and the machine: OpenBLAS splits each product
    among its threads and waits for the slowest, so when another process keeps a core busy a
    thread that loses its core stalls every matmul (on 2 shared cores a 31-token prefill took
    6-8 s on 2 threads against 0.4-0.6 s on 1, and 0.27 s against 0.37 s when idle). Left
    alone when OPENBLAS_NUM_THREADS or OMP_NUM_THREADS says otherwise. Returns the count set."""
    if os.environ.get("OPENBLAS_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS"):
        return None
    names = ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_") if ilp64 else ()
    names += ("scipy_openblas_set_num_threads", "openblas_set_num_threads")
    setter = next((getattr(library, name) for name in names if hasattr(library, name)), None)
    if setter is None:
        return None
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    threads = max(1, cores - 1)
    import ctypes

    setter.argtypes = [ctypes.c_int]
    setter.restype = None
    setter(threads)
    return threads


class OpenBlas(NamedTuple):
    path: str
    library: object  # the ctypes.CDLL
    sgemm: int  # function addresses
    sgemv: int  # 0 when missing
    ilp64: bool  # 64-bit sizes


def numpy_openblas() -> OpenBlas | None:
    """The OpenBLAS numpy's wheel bundles, found without importing numpy; None if there is none."""
    import ctypes

    try:
        spec = importlib.util.find_spec("numpy")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    package = os.path.dirname(spec.origin)
    candidates = sorted(glob.glob(os.path.join(os.path.dirname(package), "numpy.libs", "*openblas*.so*")))
    candidates += sorted(glob.glob(os.path.join(package, ".libs", "*openblas*.so*")))
    for path in candidates:
        try:
            library = ctypes.CDLL(path)
        except OSError:
            continue
        for pattern, ilp64 in SYMBOLS:
            sgemm = getattr(library, pattern.format("sgemm"), None)
            if sgemm is not None:
                sgemv = getattr(library, pattern.format("sgemv"), None)
                _libraries.append(library)
                address = lambda f: ctypes.cast(f, ctypes.c_void_p).value if f is not None else 0  # noqa: E731
                return OpenBlas(path, library, address(sgemm), address(sgemv), ilp64)
    return None
