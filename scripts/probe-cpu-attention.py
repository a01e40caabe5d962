"""One layer's attention of a long chunk on this machine's CPU: MLX's own against numpy's
(`cpu.attention.numpy_causal_attention`, what MLX on the CPU takes for a long segment), and the
`exp` under each, side by side, best of N. The default shape is SmolLM2-135M's (9 heads, 3 KV
heads of 64) at the agent replay's last step: 300 new tokens over 6,300 keys.

    .venv/bin/python scripts/probe-cpu-attention.py [--queries 300] [--keys 6300] [--runs 3]
"""

import argparse
import time

import numpy as np

from ferrum_mac.backends import route_cpu_blas

route_cpu_blas()  # before MLX is imported, as the product does
from ferrum_mac.backends.mlx.cpu.attention import numpy_causal_attention  # noqa: E402

import mlx.core as mx  # noqa: E402  (after ferrum_mac, as the product imports it)


def best_ms(function, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--keys", type=int, default=6300)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    mx.set_default_device(mx.cpu)
    rng = np.random.default_rng(0)
    q = mx.array(rng.standard_normal((1, args.heads, args.queries, args.dim)).astype(np.float32))
    keys, values = (
        mx.array(rng.standard_normal((1, args.kv_heads, args.keys, args.dim)).astype(np.float32)) for _ in range(2)
    )
    scale = args.dim**-0.5
    scores = args.heads * args.queries * args.keys
    flat_mx = mx.array(rng.standard_normal(scores).astype(np.float32))
    flat_np = np.array(flat_mx)
    mx.eval(q, keys, values, flat_mx)

    mlx_exp = best_ms(lambda: mx.eval(mx.exp(flat_mx)), args.runs)
    numpy_exp = best_ms(lambda: np.exp(flat_np), args.runs)
    mlx_attention = best_ms(
        lambda: mx.eval(mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask="causal")), args.runs
    )
    numpy_attention = best_ms(lambda: mx.eval(numpy_causal_attention(q, keys, values, scale)), args.runs)
    print(f"{args.queries} queries over {args.keys} keys, {args.heads} heads ({args.kv_heads} KV) of {args.dim}: "
          f"{scores / 1e6:.1f}M scores, best of {args.runs}")  # fmt: skip
    print(f"  exp of {scores / 1e6:.1f}M float32: MLX {mlx_exp:.1f} ms, numpy {numpy_exp:.1f} ms "
          f"({mlx_exp / numpy_exp:.1f}x)")  # fmt: skip
    print(f"  attention: MLX {mlx_attention:.1f} ms, numpy {numpy_attention:.1f} ms "
          f"({mlx_attention / numpy_attention:.1f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
