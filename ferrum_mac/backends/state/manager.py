"""`PooledState`: the state manager of both backends, its sequences' keys and values in one `BlockPool`."""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

from ferrum_mac.backends.state.block_pool import BlockPool
from ferrum_mac.llm import LlmRuntimeConfig, check_token_ids, host_tokens
from ferrum_mac.sequence_state import (
    FullAttention,
    PrefixReuse,
    PrefixStats,
    SlidingWindow,
    StateManager,
    refuse_negative,
)


class PooledState(StateManager):
    """Every attention layer's keys and values of every sequence, in the blocks of `pool`
    (shared by prefix, cached after a release and spilled to disk by the pool's `prefix` cache).
    A sliding-window layer's are kept like a full layer's, and its attention reads only the
    last `window` of them: the same keys for the same tokens, so the prefix cache is exact.

    `computing` is the context the backend's forwards run in (reusing a partly matched block
    copies it on the device, a release may reallocate the buffers); `free_tokens` counts the
    tokens free memory holds, when the backend can tell."""

    holds = (FullAttention, SlidingWindow)

    def __init__(
        self,
        pool: BlockPool,
        config: LlmRuntimeConfig,
        device_types: tuple[type, ...] = (),
        computing: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        free_tokens: Callable[[], int] | None = None,
    ):
        super().__init__(config.layer_kinds)
        self.pool, self.vocab, self.device_types = pool, config.vocab_size, device_types
        self.computing, self._free_tokens = computing, free_tokens

    def length(self, cache_id: str) -> int:
        return self.pool.length(cache_id)

    def truncate(self, cache_id: str, new_len: int) -> None:
        refuse_negative(cache_id, new_len)
        self.pool.truncate(cache_id, new_len)

    def release(self, cache_id: str) -> None:
        with self.computing():
            self.pool.release(cache_id)

    def reset(self) -> None:
        self.pool.reset()

    def reuse(self, cache_id: str, tokens: Sequence[int]) -> PrefixReuse:
        tokens = self._checked(cache_id, tokens)
        with self.computing():
            return self.pool.prefix.reuse(cache_id, tokens)

    def remember(self, cache_id: str, tokens: Sequence[int]) -> None:
        tokens = self._checked(cache_id, tokens)
        with self.computing():  # the disk tier may read blocks back
            self.pool.prefix.remember(cache_id, tokens)

    def prefix_stats(self) -> PrefixStats | None:
        return self.pool.prefix.read_stats() if self.pool.prefix.budget else None

    def free_tokens(self) -> int | None:
        return self._free_tokens() if self._free_tokens is not None else None

    def allocated_tokens(self) -> int:
        return self.pool.allocated_tokens

    def used_tokens(self) -> int:
        return self.pool.used_tokens

    def tokens_for(self, lengths: Sequence[int]) -> int:
        return self.pool.allocation_for(lengths)

    def _checked(self, cache_id: str, tokens: Sequence[int]) -> list:
        tokens = host_tokens(cache_id, tokens)
        check_token_ids(cache_id, tokens, self.vocab, self.device_types)
        return tokens
