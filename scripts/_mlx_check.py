"""What the MLX CUDA kernel check scripts share: a relative-error check that prints its verdict,
and the time per call of an MLX function evaluated in chains (MLX's per-op cost included)."""

import time

import mlx.core as mx


def close(name, got, want, tol) -> bool:
    err = (
        mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max() / (mx.abs(want.astype(mx.float32)).max() + 1e-6)
    ).item()
    good = err <= tol
    print(f"check {name:40s} rel err {err:.2e} {'ok' if good else 'MISMATCH'}")
    return good


def chained_us(fn, x, copies, calls=48, reps=10) -> float:
    """Microseconds per call of `fn(x, copy)`, `calls` independent calls evaluated together,
    each on the next of `copies` (distinct weights, so they are read from memory, not L2)."""

    def chain():
        return [fn(x, copies[i % len(copies)]) for i in range(calls)]

    mx.eval(chain())
    start = time.perf_counter()
    for _ in range(reps):
        mx.eval(chain())
    return (time.perf_counter() - start) / reps / calls * 1e6
