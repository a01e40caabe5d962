"""The decode loop: sampled token ids, each next step queued on the device before the
current token is read (the overlap mlx-lm gets with async_eval)."""

from __future__ import annotations

from typing import Any, Iterator

from ferrum_mac.engine.sampling import Sampler
from ferrum_mac.llm import DecoderOnlyLLM


def sampled_tokens(
    model: DecoderOnlyLLM, sampler: Sampler, cache_id: str, logits: Any, limit: int | None
) -> Iterator[int]:
    """Token ids of one answer, starting from the prompt's `logits`; at most `limit` of them
    (None: no limit), and no more than the KV capacity leaves room for.

    Each id is in the cache when it is yielded, except the first (given out before the step
    after it is queued: building that step, and on MLX's CPU build running most of it, would
    delay the answer's first text) and the last one the loop can give (the caller tells
    `limit` from a full cache by counting). A caller that stops early leaves at most one
    unread token in the cache, after the last one it was given.
    """
    capacity = model.kv_capacity()
    pos = model.kv_len(cache_id)
    token = sampler.sample(logits)
    count = 0
    while True:
        count += 1
        more = (limit is None or count < limit) and pos + 1 <= capacity
        if count == 1:
            yield sampler.read(token)
            if not more:
                return
            token = sampler.sample(model.decode(cache_id, token, pos))
            pos += 1
            continue
        if more:
            following = sampler.sample(model.decode(cache_id, token, pos))
            pos += 1
        yield sampler.read(token)
        if not more:
            return
        token = following
