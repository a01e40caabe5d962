"""How long the host takes to build one decode step's graph, ferrum beside mlx-lm.

Builds N greedy decode steps without evaluating them, on a qwen3-0.6b-shaped model
(28 layers; narrow widths so a CPU can hold it), and prints the time per step.

    .venv/bin/python scripts/probe-graph-build.py [bf16|4bit]
"""

import sys
import time

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

import ferrum_mac.bench.shapes as shapes
from ferrum_mac.bench import _ferrum_from_random

STEPS = 50
shapes.SHAPES["probe"] = {
    **shapes.SHAPES["qwen3-0.6b"],
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
}


def per_step(step) -> float:
    start = time.perf_counter()
    for _ in range(STEPS):
        y = step()
    elapsed = (time.perf_counter() - start) / STEPS
    mx.eval(y)
    return elapsed


def main(quant: str) -> None:
    llm, peer, _ = _ferrum_from_random("probe", quant)
    prompt = list(range(10))
    state = {"y": mx.argmax(llm.prefill("p", prompt)), "pos": len(prompt)}

    def ferrum_step():
        state["y"] = mx.argmax(llm.decode("p", state["y"], state["pos"]))
        state["pos"] += 1
        return state["y"]

    cache = make_prompt_cache(peer)
    theirs = {"y": mx.argmax(peer(mx.array([prompt]), cache=cache)[0, -1])}

    def mlx_lm_step():
        theirs["y"] = mx.argmax(peer(theirs["y"].reshape(1, 1), cache=cache)[0, -1])
        return theirs["y"]

    for step in (ferrum_step, mlx_lm_step):  # warm-up: traces the compiled parts
        mx.eval(step())
    ours, peers = per_step(ferrum_step), per_step(mlx_lm_step)
    print(f"graph build per decode step ({quant}): ferrum {ours * 1e3:.2f} ms, mlx-lm {peers * 1e3:.2f} ms")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bf16")
