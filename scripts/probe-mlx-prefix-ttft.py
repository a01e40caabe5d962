"""Where a cached prompt's first token goes, on the MLX backend (a GPU run).

    python scripts/probe-mlx-prefix-ttft.py [--shape qwen3-8b] [--prefix 16000] [--new 200,200,201,237,300]

Random weights of the shape; a prompt of `prefix` tokens is prefilled and remembered, then
prompts sharing it plus each `new` count of tokens in turn are timed (a count not seen before
shows what a new attention shape costs on CUDA): the lookup (`state.reuse`), the prefill of the new
tokens and the first token read; whether the sequence's blocks are consecutive (a slice) or
not (a gather per layer). Then the attention of such a chunk alone over `prefix` keys.
"""

from __future__ import annotations

import argparse
import random
import time

import mlx.core as mx


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-8b")
    parser.add_argument("--quant", default="bf16")
    parser.add_argument("--prefix", type=int, default=16000)
    parser.add_argument("--new", default="200,200,200,200", help="Comma-separated new token counts, one run each.")
    args = parser.parse_args()

    from ferrum_mac.bench.prefix import model_opener

    open_model, label = model_opener(None, args.shape, args.quant, "mlx", None)
    model = open_model()
    vocab = model.config.vocab_size
    rng = random.Random(0)
    prefix = [rng.randrange(vocab) for _ in range(args.prefix)]

    t = time.perf_counter()
    mx.eval(model.prefill("a", prefix))
    print(f"cold prefill {args.prefix}: {time.perf_counter() - t:.3f} s")
    model.state.remember("a", prefix)
    model.release("a")

    counts = [int(n) for n in args.new.split(",")]
    print(f"{label}: prefix {args.prefix}, new {counts}, device {mx.default_device()}")
    for run, count in enumerate(counts):
        new = [rng.randrange(vocab) for _ in range(count)]
        cid = f"b{run}"
        mx.synchronize()
        t0 = time.perf_counter()
        reuse = model.state.reuse(cid, prefix + new)
        t1 = time.perf_counter()
        logits = model.prefill(cid, (prefix + new)[reuse.cached :])
        t2 = time.perf_counter()
        token = mx.argmax(logits).item()
        t3 = time.perf_counter()
        seq = model.kv.caches[cid]
        consecutive = seq.first_row_if_consecutive(0, args.prefix + count) is not None
        print(
            f"run {run}: new {count}, cached {reuse.cached}, lookup {1e3 * (t1 - t0):.1f} ms, build {1e3 * (t2 - t1):.1f} ms, "
            f"compute+read {1e3 * (t3 - t2):.1f} ms, total {1e3 * (t3 - t0):.1f} ms, consecutive {consecutive}, token {token}"
        )
        model.release(cid)

    cfg = model.model_config
    heads, kv_heads, dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    dtype = mx.bfloat16
    q = mx.random.normal((1, heads, counts[0], dim)).astype(dtype)
    k = mx.random.normal((1, kv_heads, args.prefix + counts[0], dim)).astype(dtype)
    v = mx.random.normal((1, kv_heads, args.prefix + counts[0], dim)).astype(dtype)
    rows = mx.arange(args.prefix + counts[0])
    for name, fn in (
        ("sdpa causal (slice)", lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=dim**-0.5, mask="causal")),
        ("gather k+v rows", lambda: (k[:, :, rows, :], v[:, :, rows, :])),
    ):
        mx.eval(fn())
        mx.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            mx.eval(fn())
        mx.synchronize()
        print(f"{name}: {1e3 * (time.perf_counter() - t) / 10:.2f} ms per layer x {cfg.num_layers} layers")


if __name__ == "__main__":
    main()
