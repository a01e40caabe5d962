"""What a sequence holds: the kinds of layer state, and the state manager that keeps them.

A model's layers each keep a kind of state for a sequence: full attention (the keys and
values of every position), a sliding window of the last positions, the keys and values of
another layer, or a recurrent state. The model declares them, a layer each
(`LlmRuntimeConfig.layer_kinds`), and one `StateManager` keeps them for every sequence:
how long each is, what a new prompt reuses from the prefix cache, what is remembered for
later, truncation and release, and what memory they take. The engine and the server ask the
manager (`DecoderOnlyLLM.state`) and never which kinds it holds.

A manager refuses a model with a kind it does not keep (`UnsupportedModelError`), when the
model loads: a new kind is a class here and the manager that learns to keep it, not a
special case in the scheduler or the cache. Full attention, sliding windows and recurrent
states are kept today; a recurrent state cannot be cut back (`StateManager.cuts_back`).

This module imports neither backend: the engine reads it.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import ClassVar, Sequence, TypeAlias

from ferrum_mac.errors import CacheStateError, UnsupportedModelError


# -- the kinds of layer state ------------------------------------------------------------


@dataclass(frozen=True)
class FullAttention:
    """Keys and values of every position (blocks the prefix cache shares)."""

    name: ClassVar[str] = "full attention"

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class SlidingWindow:
    """Keys and values of the last `window` positions only."""

    name: ClassVar[str] = "sliding window"

    window: int

    def __str__(self) -> str:
        return f"a sliding window of {self.window} tokens"


@dataclass(frozen=True)
class SharedKV:
    """No keys and values of its own: it reads those of layer `source`."""

    name: ClassVar[str] = "shared keys and values"

    source: int

    def __str__(self) -> str:
        return f"the keys and values of layer {self.source}"


@dataclass(frozen=True)
class Recurrent:
    """A state of fixed size that each token updates (linear attention, state-space layers)."""

    name: ClassVar[str] = "recurrent state"

    def __str__(self) -> str:
        return "a recurrent state"


LayerKind: TypeAlias = FullAttention | SlidingWindow | SharedKV | Recurrent
KindClass: TypeAlias = type[FullAttention] | type[SlidingWindow] | type[SharedKV] | type[Recurrent]
FULL_ATTENTION = FullAttention()
RECURRENT = Recurrent()


def every_layer_full(num_layers: int) -> tuple[LayerKind, ...]:
    """The kinds of a model whose every layer attends to every position (every family today)."""
    return (FULL_ATTENTION,) * num_layers


# -- what the prefix cache reports -------------------------------------------------------

# Why `StateManager.reuse` found nothing (more) to reuse.
MISS_NO_PREFIX = "no prefix"  # no cached sequence starts like this prompt
MISS_EVICTED = "evicted"  # one did, but its blocks were evicted for memory
MISS_CHANGED = "changed earlier tokens"  # a cached sequence continues the match, but the prompt differs from it early
MISS_OTHER_MODEL = "different model"  # cached for another model (or dtype) only
MISS_OFF = "no prefix cache"  # the backend keeps none
MISS_WINDOW = "window not kept"  # a cached sequence continues the match, but not its sliding-window layers' keys there
MISS_RECURRENT = "recurrent state not kept"  # the model's recurrent layers keep no state to resume a prefix from


@dataclass(frozen=True)
class PrefixReuse:
    """What `StateManager.reuse` attached: the sequence holds `tokens` of the prompt now,
    `cached` of them taken from the prefix cache; `miss` says why no more was found (None:
    all but the last token was found)."""

    tokens: int
    cached: int = 0
    miss: str | None = None


@dataclass
class PrefixStats:
    """The prefix cache's counters since the model was loaded (`StateManager.prefix_stats`)."""

    lookups: int = 0  # reuse calls
    hits: int = 0  # lookups that reused at least one cached token
    reused_tokens: int = 0  # tokens taken from the cache instead of computed
    missed_tokens: int = 0  # prompt tokens the lookups left to compute
    misses: dict = field(default_factory=dict)  # reason (MISS_*) -> lookups that stopped there
    cached_tokens: int = 0  # tokens the cache holds now (blocks found by the index)
    evicted_blocks: int = 0
    disk_bytes_written: int = 0
    disk_bytes_read: int = 0
    disk_tokens_loaded: int = 0


# -- the manager -------------------------------------------------------------------------


class StateManager(abc.ABC):
    """What every sequence of one model holds, by `cache_id`.

    Positions: a sequence holds `length(cache_id)` tokens; the model's next call places its
    tokens right after them. `truncate` drops positions from a length on, `release` all of
    them (both idempotent; unknown ids hold nothing).

    Prefix cache: a caller says which token ids a sequence holds (`remember`, after a
    prefill and before a release), and starts a sequence with `reuse`, which attaches the
    longest cached prefix of its prompt and says how many tokens it holds; only the rest is
    prefilled. The output is the same as without the cache. A manager without a cache
    reuses nothing, and callers need not know which kind they drive.

    Memory: `allocated_tokens()` / `used_tokens()` say what the buffers hold against what
    the sequences have cached; `tokens_for(lengths)` what they would hold with sequences of
    those lengths at once, which is what a scheduler admits against; `free_tokens()` how many
    more free memory holds.
    """

    holds: tuple[KindClass, ...] = (FullAttention,)  # the layer kinds this manager keeps
    # Whether `truncate` keeps the positions before the new length. When not (a recurrent
    # state cannot go back), a cut sequence holds nothing after, and speculation, which cuts
    # rejected guesses off, stays off for the model.
    cuts_back: bool = True

    def __init__(self, kinds: Sequence[LayerKind]):
        refuse_unheld(kinds, self.holds)
        self.kinds = tuple(kinds)

    @abc.abstractmethod
    def length(self, cache_id: str) -> int:
        """Tokens `cache_id` holds (0 when it holds none)."""

    @abc.abstractmethod
    def truncate(self, cache_id: str, new_len: int) -> None:
        """Drop every position of `cache_id` from `new_len` on."""

    @abc.abstractmethod
    def release(self, cache_id: str) -> None:
        """Free what `cache_id` holds. Idempotent; unknown ids are ignored."""

    def reset(self) -> None:
        """Drop every sequence (and what the prefix cache keeps in memory)."""

    def reuse(self, cache_id: str, tokens: Sequence[int]) -> PrefixReuse:
        """Start `cache_id` on the prompt `tokens` without computing what is cached: it takes
        the longest cached prefix of `tokens` that is longer than what it holds, always leaving
        the last token to compute (its logits are the next step's). The caller then prefills
        `tokens[result.tokens:]`.

        `cache_id` must hold nothing or a prefix of `tokens` (truncate it to the common part
        first). Changes no logits: the same tokens give the same keys and values."""
        held = self.length(cache_id)
        return PrefixReuse(held, 0, None if held >= len(tokens) - 1 else MISS_OFF)

    def remember(self, cache_id: str, tokens: Sequence[int]) -> None:
        """Say that `cache_id`'s first `len(tokens)` positions hold `tokens` (at most
        `length`), so a later `reuse` of any sequence may share them; they stay cached
        after a release until memory is needed. Call it after a prompt is prefilled (two
        requests in flight share it) and before a release (an answer is kept too)."""

    def prefix_stats(self) -> PrefixStats | None:
        """The prefix cache's counters, or None when the manager keeps no prefix cache."""
        return None

    def free_tokens(self) -> int | None:
        """How many more tokens, over all sequences together, free memory holds; None when unknown."""
        return None

    def allocated_tokens(self) -> int | None:
        """Token positions the buffers hold now, used or not; None when unknown."""
        return None

    def used_tokens(self) -> int | None:
        """Tokens the live sequences hold now (every `length` together); None when unknown."""
        return None

    def tokens_for(self, lengths: Sequence[int]) -> int:
        """Token positions the buffers would hold with sequences of `lengths` live at once:
        what admitting them costs. The default is their sum (a buffer per sequence, sized to
        it); a pool that allocates in blocks says more."""
        return sum(lengths)


class CountingState(StateManager):
    """The manager of a model that keeps its own caches: it counts each sequence's tokens
    (the model calls `advance` as it appends them) and reuses nothing."""

    def __init__(self, kinds: Sequence[LayerKind] = ()):
        super().__init__(kinds)
        self.lengths: dict[str, int] = {}

    def advance(self, cache_id: str, tokens: int) -> None:
        """`cache_id` holds `tokens` more."""
        self.lengths[cache_id] = self.lengths.get(cache_id, 0) + tokens

    def length(self, cache_id: str) -> int:
        return self.lengths.get(cache_id, 0)

    def truncate(self, cache_id: str, new_len: int) -> None:
        refuse_negative(cache_id, new_len)
        if new_len < self.length(cache_id):
            self.lengths[cache_id] = new_len

    def release(self, cache_id: str) -> None:
        self.lengths.pop(cache_id, None)

    def reset(self) -> None:
        self.lengths.clear()

    def used_tokens(self) -> int:
        return sum(self.lengths.values())


def refuse_unheld(kinds: Sequence[LayerKind], holds: tuple[KindClass, ...]) -> None:
    """Raise `UnsupportedModelError` naming the first layer whose kind is not one of `holds`."""
    for layer, kind in enumerate(kinds):
        if not isinstance(kind, holds):
            kept = ", ".join(k.name for k in holds)
            raise UnsupportedModelError(
                f"layer {layer} of this model keeps {kind}, which this backend does not hold yet "
                f"(it holds: {kept}); use a model whose layers all use full attention"
            )


def refuse_negative(cache_id: str, new_len: int) -> None:
    if new_len < 0:
        raise CacheStateError(f"cannot truncate {cache_id!r} to a negative length ({new_len})")
