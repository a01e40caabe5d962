"""Timed generation on each side, measured the same way.

Time to first token covers the whole prompt (prefill) and the first sampled token;
prefill tok/s is prompt tokens over that time. Decode tok/s counts the tokens after the
first over the time after the first, as mlx-lm reports it. Both sides decode greedily
with the next step queued before the previous token is read.
"""

from __future__ import annotations

import time
from typing import Iterator

import mlx.core as mx

from ferrum_mac.bench.report import Timing


def time_stream(tokens: Iterator[int], prompt_len: int, new_tokens: int) -> Timing:
    mx.synchronize()
    mx.reset_peak_memory()
    start = time.perf_counter()
    first = None
    count = 0
    for _ in tokens:
        count += 1
        if first is None:
            first = time.perf_counter()
        if count == new_tokens:
            break
    end = time.perf_counter()
    if hasattr(tokens, "close"):
        tokens.close()  # lets the generator release its cache now
    ttft = first - start
    return Timing(
        ttft_s=ttft,
        prefill_tps=prompt_len / ttft,
        decode_tps=(count - 1) / (end - first) if count > 1 else 0.0,
        peak_memory_gb=mx.get_peak_memory() / 1e9,
    )


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
