#!/usr/bin/env python3
"""Where a torch decode step's time goes: the kernels of one step, by name, with their count
and device time per step (torch.profiler), beside the step's wall time when replayed as a
CUDA graph. Random bf16 weights of a bench shape, a 512-token prompt, then decode steps at
the given batch. On the GPU machine (torch only):

    python3 scripts/profile-torch-step.py --shape qwen3-0.6b [--batch 1] [--steps 20]

The profiled steps run eagerly (FERRUM_CUDA_GRAPHS=0, set here), so each kernel is seen;
their launch gaps are what the graph removes, so compare the kernels' sum with the graph's
wall time, not the eager one. On a CPU it profiles the CPU ops instead (a smoke test).
"""

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def decode_items(batch: int, prompt: list[int], step: int):
    from ferrum_mac.llm import DecodeItem

    return [DecodeItem(f"p{b}", 1 + step, len(prompt) + step) for b in range(batch)]


def run(shape: str, batch: int, steps: int, prompt_tokens: int) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from ferrum_mac.backends.torch import steps as step_module
    from ferrum_mac.bench.torch_side import random_pair

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    llm, _, label = random_pair(shape, device)
    prompt = list(range(1, prompt_tokens + 1))
    for b in range(batch):
        llm.prefill(f"p{b}", prompt)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed_steps(first: int) -> float:
        llm.decode_batch(decode_items(batch, prompt, first))  # warm-up: compiles, captures
        sync()
        start = time.perf_counter()
        for step in range(first + 1, first + 1 + steps):
            llm.decode_batch(decode_items(batch, prompt, step))
        sync()
        return (time.perf_counter() - start) / steps * 1e3

    graphed = timed_steps(0)
    step_module.USE_GRAPHS = False
    llm.steps.clear()
    eager = timed_steps(steps + 1)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for step in range(2 * steps + 2, 3 * steps + 2):
            llm.decode_batch(decode_items(batch, prompt, step))
        sync()
    kernels = [e for e in prof.key_averages() if (e.device_type.name == "CUDA" if device.type == "cuda" else True)]
    time_of = (lambda e: e.device_time_total) if device.type == "cuda" else (lambda e: e.self_cpu_time_total)
    kernels.sort(key=time_of, reverse=True)
    total = sum(time_of(e) for e in kernels) / steps
    launches = sum(e.count for e in kernels) / steps
    first_kind = "in a CUDA graph" if device.type == "cuda" else "default"
    print(f"{label}, {device}, batch {batch}: step {graphed:.3f} ms {first_kind}, {eager:.3f} ms eager;"
          f" {launches:.0f} {'kernels' if device.type == 'cuda' else 'ops'} a step, {total / 1e3:.3f} ms of their time")
    print(f"{'us/step':>9} {'count/step':>10}  name")
    for e in kernels[:30]:
        print(f"{time_of(e) / steps:9.1f} {e.count / steps:10.1f}  {e.key[:110]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-0.6b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    args = parser.parse_args()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    run(args.shape, args.batch, args.steps, args.prompt_tokens)


if __name__ == "__main__":
    main()
