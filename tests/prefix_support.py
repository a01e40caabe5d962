"""What the prefix cache's tests on both backends share: greedy runs with and without the
cache, and reference logits from a fresh forward."""

from __future__ import annotations

import numpy as np

from helpers import argmax, to_np

REL = 1e-5


def greedy(model, cache_id: str, prompt: list[int], n: int, reuse: bool) -> tuple[list[int], int]:
    """`n` greedy tokens after `prompt`, starting from the prefix cache when `reuse`; the
    sequence is remembered and released after. Returns (tokens, tokens reused)."""
    found = model.state.reuse(cache_id, prompt).tokens if reuse else 0
    logits = model.prefill(cache_id, prompt[found:])
    out, pos = [], len(prompt)
    for step in range(n):
        out.append(int(argmax(logits)))
        if step + 1 < n:
            logits = model.decode(cache_id, out[-1], pos)
            pos += 1
    if reuse:
        model.state.remember(cache_id, prompt + out)
    model.release(cache_id)
    return out, found


def reference_logits(model, tokens: list[int]) -> np.ndarray:
    """Every position's logits of `tokens` from one forward on a fresh cache (nothing reused)."""
    out = to_np(model.forward_verify("reference", tokens))
    model.release("reference")
    return out
