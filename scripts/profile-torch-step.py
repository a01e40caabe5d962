#!/usr/bin/env python3
"""Where a torch decode step's time goes: the kernels of one step, by name, with their count
and device time per step (torch.profiler), beside the step's wall time when replayed as a
CUDA graph. Random bf16 weights of a bench shape, a 512-token prompt, then decode steps at
the given batch. On the GPU machine (torch only):

    python3 scripts/profile-torch-step.py --shape qwen3-0.6b [--quant 4bit] [--batch 1] [--steps 20]
        [--time-only] [--set MODULE.NAME=VALUE ...]

It profiles the steps as replayed from their CUDA graph (the GPU's busy time beside the
wall time shows the gaps between kernels), then eagerly (FERRUM_TORCH_CUDA_GRAPHS=0).
`--time-only`: the graph's step time alone (best of 3 rounds of `--steps`), for A/B runs of
two trees (each tree's own copy of this script: it puts its tree first on the path, whatever
PYTHONPATH says) or of a module constant changed with `--set` (a Python literal), e.g.
`--set ferrum_mac.backends.torch.kernels.triton_pdl.PDL_MAX_BYTES=1099511627776`.
"""

import argparse
import ast
import importlib
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def decode_items(batch: int, prompt: list[int], step: int):
    from ferrum_mac.llm import DecodeItem

    return [DecodeItem(f"p{b}", 1 + step, len(prompt) + step) for b in range(batch)]


def run(shape: str, quant: str | None, batch: int, steps: int, prompt_tokens: int, time_only: bool) -> None:
    import torch

    from _kernel_profile import profile_steps
    from ferrum_mac.bench.torch_side import random_pair

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    llm, _, label = random_pair(shape, device, quant)
    prompt = list(range(1, prompt_tokens + 1))
    for b in range(batch):
        llm.prefill(f"p{b}", prompt)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    counter = iter(range(10**6))

    def step() -> None:
        llm.decode_batch(decode_items(batch, prompt, next(counter)))

    def timed_steps() -> float:
        step()  # warm-up: compiles, captures
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        return (time.perf_counter() - start) / steps * 1e3

    if time_only:
        best = min(timed_steps() for _ in range(3))
        print(f"{label}, {device}, batch {batch}: step {best:.4f} ms (best of 3 rounds of {steps})")
        return
    graphed = timed_steps()
    kind = "in a CUDA graph" if device.type == "cuda" else "default"
    print(f"{label}, {device}, batch {batch}: step {graphed:.3f} ms {kind}")
    if batch == 1:
        print(
            f"  as `ferrum bench` streams it (each token read one step behind): {bench_ms(llm, prompt):.3f} ms a token"
        )
    profile_steps(step, steps, sync)
    llm.steps.captured = False  # (FERRUM_TORCH_CUDA_GRAPHS=0)
    llm.steps.clear()
    print(f"  eager: step {timed_steps():.3f} ms")
    profile_steps(step, steps, sync)


def bench_ms(llm, prompt: list[int], tokens: int = 128) -> float:
    from ferrum_mac.bench.torch_side import ferrum_tokens

    stream = ferrum_tokens(llm, prompt, tokens, cache_id="stream")
    next(stream)
    start = time.perf_counter()
    count = sum(1 for _ in stream)
    return (time.perf_counter() - start) / count * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--quant", default=None, help="4bit or 8bit: the bf16 weights quantized as they load")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--time-only", action="store_true", help="the step time alone, no profile")
    parser.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE")
    args = parser.parse_args()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    for item in args.set:
        target, value = item.split("=", 1)
        module, name = target.rsplit(".", 1)
        setattr(importlib.import_module(module), name, ast.literal_eval(value))
    run(args.shape, args.quant, args.batch, args.steps, args.prompt_tokens, args.time_only)


if __name__ == "__main__":
    main()
