#!/usr/bin/env python3
"""The cost of a speculative verify against a decode step on the torch backend (a CUDA GPU),
random weights of each shape, a 512-token context:

- verify(k): `forward_verify` of k + 1 tokens over one decode step, medians of 30;
- whether each verify row's greedy token equals the decode step's at that position (24
  verifies of 5 tokens: the rows must sum as decode steps do);
- 16 sequences: `verify_batch` with k guesses each beside `decode_batch` of the 16.

From the repository root, on the GPU machine: `python3 scripts/probe-verify-cost.py`.
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ferrum_mac.bench.torch_side import random_pair  # noqa: E402
from ferrum_mac.llm import DecodeItem, ForwardItem  # noqa: E402

PROMPT = [(7 * i + 3) % 1000 for i in range(512)]
STREAMS = 16


def main() -> None:
    for shape in ("qwen3-8b", "qwen3-0.6b"):
        model, reference, _ = random_pair(shape, torch.device("cuda"))
        del reference
        torch.cuda.empty_cache()
        ids = [f"s{j}" for j in range(STREAMS)]
        for cid in ids:
            model.prefill(cid, PROMPT)
        held = model.state.length(ids[0])

        def seconds(step, cut=ids[:1]) -> float:
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = step()
            (out if isinstance(out, torch.Tensor) else out[0]).reshape(-1)[0].item()
            took = time.perf_counter() - start
            for cid in cut:
                model.truncate_kv(cid, held)
            return took

        def median(step, runs: int, cut=ids[:1]) -> float:
            return statistics.median(seconds(step, cut) for _ in range(runs))

        decode = lambda: model.decode(ids[0], PROMPT[-1], held)  # noqa: E731
        verify = {k: (lambda k=k: model.forward_verify(ids[0], PROMPT[-k - 1 :])) for k in (1, 2, 4, 8)}
        for _ in range(5):
            seconds(decode)
            for step in verify.values():
                seconds(step)
        step_s = median(decode, 30)
        row = [f"{shape}: decode {step_s * 1e3:.3f} ms"]
        row += [f"verify({k}) {median(step, 30) / step_s:.2f}x" for k, step in verify.items()]
        print("; ".join(row), flush=True)

        differ = 0
        for j in range(24):
            tokens = PROMPT[j * 7 : j * 7 + 5]
            rows = model.forward_verify(ids[0], tokens).argmax(-1).tolist()
            model.truncate_kv(ids[0], held)
            steps = [model.decode(ids[0], t, held + i).argmax(-1).item() for i, t in enumerate(tokens)]
            model.truncate_kv(ids[0], held)
            differ += sum(a != b for a, b in zip(rows, steps))
        print(f"  greedy verify rows vs decode steps: {differ} of {24 * 5} differ", flush=True)

        batch = lambda: model.decode_batch([DecodeItem(c, PROMPT[-1], held) for c in ids])  # noqa: E731
        for k in (1, 2, 3):
            verify_all = lambda k=k: model.verify_batch([ForwardItem(c, PROMPT[-k - 1 :], held) for c in ids])  # noqa: E731
            for _ in range(3):
                seconds(batch, ids)
                seconds(verify_all, ids)
            plain, guessed = median(batch, 15, ids), median(verify_all, 15, ids)
            print(
                f"  {STREAMS} streams: decode_batch {plain * 1e3:.3f} ms; verify_batch of {k} guesses each "
                f"({STREAMS * (k + 1)} rows) {guessed * 1e3:.3f} ms = {guessed / plain:.2f}x",
                flush=True,
            )
        model.reset()


if __name__ == "__main__":
    main()
