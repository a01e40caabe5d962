#!/usr/bin/env python3
"""Where an MLX decode step's time goes on MLX's CUDA build: the kernels of a step by name,
count and device time, the GPU's busy time beside the wall time, at each batch size given.
Random weights of a bench shape, a 512-token prompt per sequence. On the GPU machine, with
MLX CUDA installed (scripts/bench-gpu) and torch beside it (its profiler reads the kernels):

    python3 scripts/profile-mlx-step.py --shape qwen3-30b-a3b --quant 4bit --batch 1,8

The pipelined rate (each step queued before the last is read, as `ferrum bench` runs it) is
printed first; the profiled steps are evaluated one by one.
"""

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def run(shape: str, quant: str, batches: list[int], steps: int, prompt_tokens: int) -> None:
    import mlx.core as mx

    from _kernel_profile import profile_steps
    from ferrum_mac.bench import _ferrum_from_random
    from ferrum_mac.llm import DecodeItem

    llm, _, label = _ferrum_from_random(shape, quant)
    prompt = list(range(1, prompt_tokens + 1))
    llm.prepare("p0", prompt_tokens + 4 * steps + 16)
    print(f"{label}, {mx.default_device()}")
    for batch in batches:
        ids = [f"p{b}" for b in range(batch)]
        tokens = mx.stack([mx.argmax(llm.prefill(cid, prompt)) for cid in ids])
        mx.eval(tokens)
        pos = [prompt_tokens]

        def step(pipelined: bool = False) -> None:
            nonlocal tokens
            items = [DecodeItem(cid, tokens[i], pos[0]) for i, cid in enumerate(ids)]
            tokens = mx.argmax(llm.decode_batch(items), axis=-1)
            (mx.async_eval if pipelined else mx.eval)(tokens)
            pos[0] += 1

        for _ in range(3):
            step()
        mx.eval(tokens)
        start = time.perf_counter()
        for _ in range(steps):
            step(pipelined=True)
        mx.eval(tokens)
        wall = (time.perf_counter() - start) / steps * 1e3
        print(f"batch {batch}: {wall:.3f} ms/step pipelined = {batch / wall * 1e3:.1f} tok/s")
        profile_steps(step, steps, mx.synchronize)
        for cid in ids:
            llm.release(cid)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b")
    parser.add_argument("--quant", default="4bit")
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    args = parser.parse_args()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    run(args.shape, args.quant, [int(b) for b in args.batch.split(",")], args.steps, args.prompt_tokens)


if __name__ == "__main__":
    main()
