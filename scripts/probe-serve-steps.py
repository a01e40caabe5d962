"""Where a burst of concurrent requests spends its time on the torch backend (a GPU run).

    python scripts/probe-serve-steps.py [--shape qwen3-8b] [--concurrency 16] [--tokens 128]

The scheduler in-process on random weights of the shape (as `ferrum bench prefix` runs it);
rounds of `concurrency` short prompts, each answering `tokens` tokens, as scripts/load-serve.py
sends them. Each round prints its decode rate and mean time to first token, with how often the
KV pool was reallocated and decode steps captured (and the time captures took), first from a
pool at its idle size, then from one already grown by an earlier round (prefix cache off).
"""

from __future__ import annotations

import argparse
import random
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-8b")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    from ferrum_mac.backends.torch import steps
    from ferrum_mac.bench.prefix import Server
    from ferrum_mac.bench.torch_side import random_pair

    captures = {"n": 0, "s": 0.0}
    original = steps.DecodeStep.capture

    def counted(step):
        torch.cuda.synchronize()
        start = time.perf_counter()
        original(step)
        torch.cuda.synchronize()
        captures["n"] += 1
        captures["s"] += time.perf_counter() - start

    steps.DecodeStep.capture = counted
    device = torch.device("cuda")
    llm, reference, _ = random_pair(args.shape, device)
    del reference
    server = Server(lambda: llm, args.shape)
    rng = random.Random(0)
    vocab = llm.config.vocab_size
    try:
        for concurrency in (1, 4, args.concurrency, args.concurrency, 1):
            prompts = [[rng.randrange(vocab) for _ in range(8)] for _ in range(concurrency)]
            version, captures["n"], captures["s"] = llm.kv.version, 0, 0.0
            start = time.perf_counter()
            results = server.send(prompts, args.tokens)
            wall = time.perf_counter() - start
            ttft = sum(done.ttft_s for done, _ in results) / concurrency
            decoded = sum(done.generated_tokens for done, _ in results)
            print(
                f"c={concurrency}: {decoded / wall:.1f} tok/s over {wall:.2f} s, mean TTFT {ttft * 1000:.0f} ms, "
                f"pool reallocated {llm.kv.version - version}x (now {llm.kv.blocks} blocks), "
                f"{captures['n']} captures taking {captures['s'] * 1000:.0f} ms"
            )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
