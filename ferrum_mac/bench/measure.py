"""The MLX side of `ferrum bench`: ferrum's and mlx-lm's greedy token streams (each with
the next step queued before the previous token is read), timed by `report.timed`."""

from __future__ import annotations

import time
from typing import Iterator

import mlx.core as mx

from ferrum_mac.bench.report import Timing, timed


def time_stream(tokens: Iterator[int], prompt_len: int, new_tokens: int) -> Timing:
    def settle() -> None:
        mx.synchronize()
        mx.reset_peak_memory()

    return timed(tokens, prompt_len, new_tokens, settle, lambda: mx.get_peak_memory() / 1e9)


def ferrum_stream(model, prompt: list[int], new_tokens: int, cache_id: str = "bench") -> Iterator[int]:
    """Greedy tokens through the DecoderOnlyLLM contract, one step queued ahead."""
    try:
        y = mx.argmax(model.prefill(cache_id, prompt))
        mx.async_eval(y)
        pos = len(prompt)
        for _ in range(new_tokens):
            nxt = mx.argmax(model.decode(cache_id, y, pos))
            mx.async_eval(nxt)
            yield y.item()
            y, pos = nxt, pos + 1
    finally:
        model.release(cache_id)


def batched_decode_tps(model, prompt: list[int], batch: int, new_tokens: int) -> float:
    """Aggregate greedy decode tok/s of `batch` sequences stepped together with `decode_batch`
    (each sequence's prompt is `prompt` shifted by its index, so their lengths differ)."""
    from ferrum_mac.llm import DecodeItem

    ids = [f"batch-{i}" for i in range(batch)]
    try:
        firsts = [mx.argmax(model.prefill(cid, prompt[i:])) for i, cid in enumerate(ids)]
        tokens = mx.stack(firsts)
        positions = [len(prompt) - i for i in range(batch)]
        mx.eval(tokens)
        start = time.perf_counter()
        for step in range(new_tokens):
            items = [DecodeItem(cid, tokens[i], positions[i] + step) for i, cid in enumerate(ids)]
            tokens = mx.argmax(model.decode_batch(items), axis=-1)
            mx.async_eval(tokens)
        mx.eval(tokens)
        return batch * new_tokens / (time.perf_counter() - start)
    finally:
        for cid in ids:
            model.release(cid)


def mlx_lm_stream(model, prompt: list[int], new_tokens: int) -> Iterator[int]:
    from mlx_lm.generate import generate_step

    for token, _ in generate_step(mx.array(prompt), model, max_tokens=new_tokens):
        yield token if isinstance(token, int) else token.item()
