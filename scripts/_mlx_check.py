"""What the MLX CUDA kernel check scripts share: a relative-error check that prints its verdict,
and the time per call of an MLX function evaluated in chains (MLX's per-op cost included)."""

import time

import mlx.core as mx


def close(name, got, want, tol) -> bool:
    err = (mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max() / (mx.abs(want.astype(mx.float32)).max() + 1e-6)).item()
    good = err <= tol
    print(f"check {name:40s} rel err {err:.2e} {'ok' if good else 'MISMATCH'}")
    return good


def chained_us(fn, x, calls=48, reps=20) -> float:
    """Microseconds per call of `fn(x)`, `calls` independent calls evaluated together."""
    mx.eval([fn(x) for _ in range(calls)])
    start = time.perf_counter()
    for _ in range(reps):
        mx.eval([fn(x) for _ in range(calls)])
    return (time.perf_counter() - start) / reps / calls * 1e6
