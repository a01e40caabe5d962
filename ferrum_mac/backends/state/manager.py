"""`PooledState`: the state manager of both backends, its sequences' keys and values in one `BlockPool`."""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

from ferrum_mac.backends.state.block_pool import BlockPool
from ferrum_mac.llm import LlmRuntimeConfig, check_token_ids, host_tokens
from ferrum_mac.backends.state.recurrent import RecurrentStates
from ferrum_mac.backends.state.windowed import WindowedKv
from ferrum_mac.sequence_state import (
    MISS_RECURRENT,
    MISS_WINDOW,
    FullAttention,
    PrefixReuse,
    PrefixStats,
    Recurrent,
    SlidingWindow,
    StateManager,
    refuse_negative,
)


class PooledState(StateManager):
    """Every attention layer's keys and values of every sequence, in the blocks of `pool`
    (shared by prefix, cached after a release and spilled to disk by the pool's `prefix` cache),
    the sliding-window layers' in the pool of `windowed` when given (`windowed.py`: each
    sequence keeps its window only), else in `pool` too (read only within the window); the
    recurrent layers' states in `recurrent` (`recurrent.py`), when the model has such layers:
    then nothing is reused from the prefix cache and a cut sequence holds nothing after.

    `computing` is the context the backend's forwards run in (reusing a partly matched block
    copies it on the device, a release may reallocate the buffers); `free_tokens` counts the
    tokens free memory holds, when the backend can tell."""

    holds = (FullAttention, SlidingWindow, Recurrent)

    def __init__(
        self,
        pool: BlockPool,
        config: LlmRuntimeConfig,
        device_types: tuple[type, ...] = (),
        computing: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        free_tokens: Callable[[], int] | None = None,
        windowed: WindowedKv | None = None,
        recurrent: RecurrentStates | None = None,
    ):
        if recurrent is None:  # (without a store for them, recurrent layers are refused)
            self.holds = (FullAttention, SlidingWindow)
        super().__init__(config.layer_kinds)
        self.recurrent = recurrent
        self.cuts_back = recurrent is None
        self.pool, self.vocab, self.device_types = pool, config.vocab_size, device_types
        self.computing, self._free_tokens = computing, free_tokens
        self.windowed = windowed
        windows = sum(isinstance(kind, SlidingWindow) for kind in config.layer_kinds) if windowed else 0
        self.window_share = windows / max(1, len(config.layer_kinds))  # of the layers, the windowed pool's

    def length(self, cache_id: str) -> int:
        return self.pool.length(cache_id)

    def truncate(self, cache_id: str, new_len: int) -> None:
        """As `StateManager.truncate`; but a windowed sequence cut back past the window it kept
        holds nothing after (reuse or prefill it again)."""
        refuse_negative(cache_id, new_len)
        if self.recurrent is not None and new_len < self.length(cache_id):
            self.release(cache_id)  # (a recurrent state cannot go back to a shorter prefix)
            return
        self.pool.truncate(cache_id, new_len)
        if self.windowed is not None:
            self.windowed.pool.truncate(cache_id, new_len)
            if not self.windowed.holds(cache_id, self.length(cache_id)):
                self.release(cache_id)

    def release(self, cache_id: str) -> None:
        with self.computing():
            self.pool.release(cache_id)
            if self.windowed is not None:
                self.windowed.pool.release(cache_id)
            if self.recurrent is not None:
                self.recurrent.release(cache_id)

    def reset(self) -> None:
        self.pool.reset()
        if self.recurrent is not None:
            self.recurrent.reset()
        if self.windowed is not None:
            self.windowed.clear()
            self.windowed.pool.reset()

    def reuse(self, cache_id: str, tokens: Sequence[int]) -> PrefixReuse:
        tokens = self._checked(cache_id, tokens)
        if self.recurrent is not None:  # (the cache keeps keys and values, no recurrent state)
            held = self.length(cache_id)
            return PrefixReuse(held, 0, None if held >= len(tokens) - 1 else MISS_RECURRENT)
        with self.computing():
            held = self.length(cache_id)
            found = self.pool.prefix.reuse(cache_id, tokens)
            if self.windowed is None or found.tokens <= held:
                return found
            seq = self.pool.acquire(cache_id)
            kept = self.windowed.reuse(seq, cache_id, tokens, found.tokens, held)
            return PrefixReuse(kept, kept - held, found.miss if kept == found.tokens else MISS_WINDOW)

    def remember(self, cache_id: str, tokens: Sequence[int]) -> None:
        tokens = self._checked(cache_id, tokens)
        if self.recurrent is not None:
            return
        with self.computing():  # the disk tier may read blocks back
            self.pool.prefix.remember(cache_id, tokens)
            if self.windowed is not None:
                self.windowed.remember(cache_id, tokens)

    def prefix_stats(self) -> PrefixStats | None:
        return self.pool.prefix.read_stats() if self.pool.prefix.budget else None

    def free_tokens(self) -> int | None:
        return self._free_tokens() if self._free_tokens is not None else None

    # With a windowed pool, token positions are counted as the model's: a position of every
    # layer, the two pools' positions weighed by their share of the layers.

    # A recurrent model's sequences each hold their states too, counted as the KV token
    # positions of the same memory (`RecurrentStates.tokens_per_sequence`).

    def allocated_tokens(self) -> int:
        if self.windowed is None:
            return self.pool.allocated_tokens + self._recurrent_tokens(
                len(self.recurrent.sequences) if self.recurrent else 0
            )
        return self._weighed(self.pool.allocated_tokens, self.windowed.pool.allocated_tokens)

    def used_tokens(self) -> int:
        return self.pool.used_tokens

    def tokens_for(self, lengths: Sequence[int]) -> int:
        if self.windowed is None:
            return self.pool.allocation_for(lengths) + self._recurrent_tokens(len(lengths))
        return self._weighed(self.pool.allocation_for(lengths), self.windowed.allocation_for(lengths))

    def _recurrent_tokens(self, sequences: int) -> int:
        return sequences * self.recurrent.tokens_per_sequence if self.recurrent is not None else 0

    def _weighed(self, full: int, windowed: int) -> int:
        return round(full * (1 - self.window_share) + windowed * self.window_share)

    def _checked(self, cache_id: str, tokens: Sequence[int]) -> list:
        tokens = host_tokens(cache_id, tokens)
        check_token_ids(cache_id, tokens, self.vocab, self.device_types)
        return tokens
