"""`PooledLLM`: the half of a runtime both backends share, on top of their `BlockPool`.

Every call is checked (`llm.check_call`) before any cache changes, then runs as
one forward over a list of (cache_id, tokens, offset) segments: `prefill` one segment (in
chunks, so activations stay bounded), `forward_verify` one, `verify_batch` several, `unified_forward` a mix of
decode steps and prefill chunks. This class keeps the slots' bookkeeping around that
forward (acquire a sequence's blocks, make room, record what each sequence now holds) and
the rows of the result each call returns; what the sequences hold between calls (prefix
reuse, truncation, release, the memory counters) is its state manager's (`PooledState`,
over the same pool). A backend adds only what runs on its device:

- `_hidden(token_parts, segments)`: the model over the segments' tokens -> hidden states
  (with `windowed` and `recurrent`, the segments' other states, where the model has them);
- `_token_ids(tokens)`: one segment's tokens as the backend's ids (device tokens clipped);
- `_logits_at(h, rows)`: logits of the token rows `rows` (an index, a slice or a list) of `h`;
- `_decode_batch(items)`: a batched decode step (checked already);
- `_verify(segments)`: may run short verifies faster than `_forward` (torch: as decode rows);
- `_fresh_prompt(cache_id, tokens)`: may run a prompt with nothing before it faster (torch: a CUDA graph);
- `_computing()`: the context the forwards run in (torch's inference mode);
- `prepare`, `reset`, `sampler` and its buffers (`kv`, the pool; `_state`, a `PooledState`
  over it; `segment_type`, its plan's segment).
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

from ferrum_mac.backends.state.block_pool import BLOCK_TOKENS, BlockPool
from ferrum_mac.backends.state.prefix_disk import PrefixDisk, block_shape_of, for_checkpoint
from ferrum_mac.errors import UnsupportedError, UnsupportedModelError
from ferrum_mac.llm import (
    KV_MEMORY_SHARE,
    Capabilities,
    DecodeItem,
    DecoderOnlyLLM,
    ForwardItem,
    LlmRuntimeConfig,
    Logits,
    Token,
    check_call,
    host_tokens,
    token_count,
)
from ferrum_mac.weights.rope import context_variant

CACHE_SHARE = 0.25  # of the memory free after loading, the most the prefix cache keeps unused


def model_family(families: dict, model_type: str, backend: str):
    """The backend's model class for a checkpoint's `model_type`, or a clear error."""
    family = families.get(model_type)
    if family is None:
        raise UnsupportedModelError(
            f"the {backend} backend has no {model_type!r} model (supported: {', '.join(sorted(families))})"
        )
    return family


def pool_limits(
    config: LlmRuntimeConfig, free_bytes: int, bytes_per_element: int, block_tokens: int, cache_mb: int
) -> tuple[int, int]:
    """(max_blocks, cache_blocks) for a pool: the blocks free memory holds (its KV share), and
    those the prefix cache may keep unused (`cache_mb` MiB, at most CACHE_SHARE of it)."""
    block_bytes = config.kv_bytes_per_token(bytes_per_element) * block_tokens
    max_blocks = max(2, int(free_bytes * KV_MEMORY_SHARE) // block_bytes)
    cache_bytes = min(cache_mb << 20, int(free_bytes * CACHE_SHARE))
    return max_blocks, cache_bytes // block_bytes


def named_dtype(name: str, dtypes: dict):
    """The backend's dtype called `name` (float32, float16, bfloat16), or a clear error."""
    if name not in dtypes:
        raise UnsupportedError(f"dtype {name!r} is not supported; choose one of: {', '.join(dtypes)}")
    return dtypes[name]


class PooledLLM(DecoderOnlyLLM):
    """A `DecoderOnlyLLM` whose sequences live in the slots of one KV pool (`kv`)."""

    kv: BlockPool
    _config: LlmRuntimeConfig
    _capacity: int
    segment_type: type  # the backend plan's segment: (cache, start, length, offset)
    window_segment_type: type  # the same over the windowed layers' pool (read by MLX's own ops)
    prefill_chunk = 2048  # longer prompts run in chunks of this many tokens, so activations stay bounded

    # -- what a backend provides -------------------------------------------------------

    def _hidden(self, token_parts: list, segments: list) -> Any:
        """Hidden states of every token of `segments` (the backend's `segment_type`), whose
        ids are `token_parts` (one part per segment, from `_token_ids`)."""
        raise NotImplementedError

    def _token_ids(self, tokens) -> Any:
        """One segment's tokens (checked host ids or a device array) as the backend's ids."""
        return tokens

    def _logits_at(self, h, rows: int | slice | list[int]) -> Logits:
        """Logits of the token rows `rows` of `h`, indexed as a 1-d array is: `(vocab,)` for an
        index, `(rows, vocab)` for a slice or a list."""
        raise NotImplementedError

    def _decode_batch(self, items: Sequence[DecodeItem]) -> Logits:
        """`decode_batch` after its checks."""
        raise NotImplementedError

    def _computing(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def _after_chunk(self) -> None:
        """Between two chunks of a long prefill (MLX runs the queued work there)."""

    def _prefix_disk(self, checkpoint, backend: str, options) -> PrefixDisk | None:
        """The disk tier of this model's prefix cache, as `options` (the backend's) size it; None: none.
        Keyed by what the KV capacity picks of the rope schedule too (LongRoPE's factors)."""
        c = self._config
        variant = context_variant(checkpoint.config, self._capacity)
        backend = f"{backend}-{variant}" if variant else backend
        shape = block_shape_of(c.num_layers, c.num_kv_heads, BLOCK_TOKENS, c.head_dim)
        return for_checkpoint(checkpoint, c.dtype, backend, shape, options.prefix_dir, options.prefix_disk_mb)

    # -- the contract ---------------------------------------------------------------

    @property
    def config(self) -> LlmRuntimeConfig:
        return self._config

    def kv_capacity(self) -> int:
        return self._capacity

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(unified_forward=True, batched_decode=True, batched_verify=True)

    def prefill(self, cache_id: str, tokens: Sequence[int]) -> Logits:
        tokens = host_tokens(cache_id, tokens)
        offset = self.kv.length(cache_id)
        check_call(self, [(cache_id, tokens, offset)])
        with self._computing():
            if offset == 0:
                logits = self._fresh_prompt(cache_id, tokens)
                if logits is not None:
                    return logits
            chunk = self.prefill_chunk
            for start in range(0, len(tokens) - chunk, chunk):
                self._forward([(cache_id, tokens[start : start + chunk], offset + start)])
                self._after_chunk()
            last = (len(tokens) - 1) // chunk * chunk
            h = self._forward([(cache_id, tokens[last:], offset + last)])
            return self._logits_at(h, -1)

    def decode(self, cache_id: str, token: Token, pos: int) -> Logits:
        return self.decode_batch([DecodeItem(cache_id, token, pos)])[0]

    def decode_batch(self, items: Sequence[DecodeItem]) -> Logits:
        check_call(self, [(it.cache_id, it.token, it.pos) for it in items])
        with self._computing():
            return self._decode_batch(items)

    def forward_verify(self, cache_id: str, tokens: Sequence[int]) -> Logits:
        return self.verify_batch([ForwardItem(cache_id, tokens, self.kv.length(cache_id))])[0]

    def verify_batch(self, items: Sequence[ForwardItem]) -> list[Logits]:
        segments = [(it.cache_id, host_tokens(it.cache_id, it.tokens), it.pos_offset) for it in items]
        check_call(self, segments)
        with self._computing():
            logits = self._verify(segments)
        parts, start = [], 0
        for _, tokens, _ in segments:
            parts.append(logits[start : start + len(tokens)])
            start += len(tokens)
        return parts

    def _fresh_prompt(self, cache_id: str, tokens: list[int]) -> Logits | None:
        """A prompt with nothing cached before it (checked), the backend's faster way, or None
        when it has none for this prompt (then `prefill` runs it in chunks)."""
        return None

    def _verify(self, segments: Sequence[tuple[str, list[int], int]]) -> Logits:
        """`verify_batch` after its checks: `(tokens, vocab)` logits of every segment's tokens, in order."""
        return self._logits_at(self._forward(segments), slice(None))

    def unified_forward(self, items: Sequence[ForwardItem]) -> list[Logits | None]:
        segments = [(it.cache_id, host_tokens(it.cache_id, it.tokens), it.pos_offset) for it in items]
        check_call(self, segments)
        with self._computing():
            h = self._forward(segments)
            final_rows, row = [], 0
            for _, tokens, _ in segments:
                row += len(tokens)
                final_rows.append(row - 1)
            final_rows = [end for end, it in zip(final_rows, items) if it.is_final]
            if not final_rows:
                return [None] * len(items)
            logits = iter(self._logits_at(h, final_rows))
            return [next(logits) if it.is_final else None for it in items]

    # -- one forward over segments ----------------------------------------------------

    def _forward(self, segments: Sequence[tuple[str, Any, int]]) -> Any:
        """Run `segments` (checked) as one forward: each sequence gets blocks of its own for
        its tokens (`BlockPool.reserve`), and holds them afterwards; in the windowed layers'
        pool too, where the model has one (`windowed`), those behind the window let go."""
        placed, token_parts, start = [], [], 0
        for cache_id, tokens, offset in segments:
            ids = self._token_ids(tokens)
            n = token_count(ids)
            cache = self.kv.acquire(cache_id)
            self.kv.reserve(cache, offset, offset + n)
            placed.append(self.segment_type(cache, start, n, offset))
            token_parts.append(ids)
            start += n
        windowed = self._windowed_segments(placed)
        recurrent = self._recurrent_segments(placed)
        more = {} if recurrent is None else {"recurrent": recurrent}
        if windowed is not None:
            more["windowed"] = windowed
        h = self._hidden(token_parts, placed, **more)
        for seg in placed + (windowed or []):
            seg.cache.length = seg.offset + seg.length
        for seg, state in zip(placed, recurrent or []):
            state.length = seg.offset + seg.length
        return h

    def _recurrent_segments(self, placed: list) -> list | None:
        """Each segment's recurrent states (`RecurrentStates.place`), or None when the model keeps none."""
        recurrent = self._state.recurrent
        if recurrent is None:
            return None
        return [recurrent.place(seg.cache.cache_id, seg.offset) for seg in placed]

    def _windowed_segments(self, placed: list) -> list | None:
        """The segments over the windowed layers' pool, or None when the model has none."""
        windowed = self._state.windowed
        if windowed is None:
            return None
        return [
            self.window_segment_type(
                windowed.place(seg.cache.cache_id, seg.offset, seg.offset + seg.length),
                seg.start,
                seg.length,
                seg.offset,
            )
            for seg in placed
        ]
