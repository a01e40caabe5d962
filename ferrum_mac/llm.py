"""The model contract: `DecoderOnlyLLM`, the interface the engine drives every backend through.

It keeps every method of Ferrum's `DecoderOnlyLLM` trait, made Pythonic:

- batch items are typed (`DecodeItem`, `ForwardItem`) instead of anonymous tuples;
- nothing panics by default: work a backend cannot do raises `UnsupportedError`, and a
  request that would grow a sequence past `kv_capacity()` raises `KvCapacityError`
  *before* any state changes;
- logits stay on the device (an `mx.array` or `torch.Tensor`); only sampled token ids
  cross to the host. A backend may accept a lazy device scalar as `token` so step n+1
  can be queued before step n is read.

Inputs: host token ids are whole numbers (`int` or numpy's integers, not `bool`) inside the
vocabulary, positions are whole numbers; anything else raises `FerrumError` before any state
changes. A device token (one of the backend's `device_array_types`) is not read, which would
wait for it: the backend clips it into the vocabulary instead, so an id outside it never
reads past the embedding (it reads the last or first row).

Memory: `kv_allocated_tokens()` / `kv_used_tokens()` say what the KV buffers hold against
what the sequences have cached; `kv_tokens_for(lengths)` what they would hold with sequences
of those lengths at once, which is what a scheduler admits against.

Positions: a cache holds `kv_len(cache_id)` tokens; `decode(..., pos)` and
`ForwardItem.pos_offset` must equal that length (the token goes right after what is
cached). To rewrite history, `truncate_kv` first.

Prefix cache: a backend that keeps KV in shared blocks finds what was computed before. A
caller tells it which token ids a sequence holds (`kv_remember`, after a prefill and before
a release), and starts a sequence with `kv_reuse`, which attaches the longest cached prefix
of its prompt and says how many tokens it holds; only the rest is prefilled. The output is
the same as without the cache (the attached keys and values are the ones the same tokens
produce). `kv_prefix_stats` counts hits, misses and their reasons. A backend without a
cache reuses nothing, and callers need not know which kind they drive.
"""

from __future__ import annotations

import abc
import numbers
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Sequence, TypeAlias

from ferrum_mac.errors import (  # noqa: F401  (re-exported: the contract's errors)
    CacheStateError,
    CorruptModelError,
    FerrumError,
    KvCapacityError,
    ModelFileError,
    ModelNotFoundError,
    UnsupportedError,
    UnsupportedModelError,
)

if TYPE_CHECKING:  # the contract imports neither backend at run time
    import mlx.core as mx
    import torch

    Logits: TypeAlias = "mx.array | torch.Tensor"  # on the model's device
    Token: TypeAlias = "int | mx.array | torch.Tensor"  # an id, or a device scalar holding one
else:
    Logits = Token = Any


@dataclass(frozen=True)
class LlmRuntimeConfig:
    """What the engine needs to know about a model: sizes for KV budgeting and sampling."""

    hidden_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_seq_len: int
    model_type: str = ""
    dtype: str = ""
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def of_model(cls, c, dtype: str) -> "LlmRuntimeConfig":
        """From a checkpoint's `ferrum_mac.weights.ModelConfig` and the compute dtype's name."""
        return cls(
            hidden_size=c.hidden_size,
            num_layers=c.num_layers,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            vocab_size=c.vocab_size,
            max_seq_len=c.max_position_embeddings,
            model_type=c.model_type,
            dtype=dtype,
            bos_token_id=c.bos_token_id,
            eos_token_ids=tuple(c.eos_token_ids),
        )

    def kv_bytes_per_token(self, bytes_per_element: int = 2) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_element


# Why `kv_reuse` found nothing (more) to reuse.
MISS_NO_PREFIX = "no prefix"  # no cached sequence starts like this prompt
MISS_EVICTED = "evicted"  # one did, but its blocks were evicted for memory
MISS_CHANGED = "changed earlier tokens"  # a cached sequence continues the match, but the prompt differs from it early
MISS_OTHER_MODEL = "different model"  # cached for another model (or dtype) only
MISS_OFF = "no prefix cache"  # the backend keeps none


@dataclass(frozen=True)
class PrefixReuse:
    """What `kv_reuse` attached: the cache holds `tokens` of the prompt now, `cached` of them
    taken from the prefix cache; `miss` says why no more was found (None: all but the last
    token was found)."""

    tokens: int
    cached: int = 0
    miss: str | None = None


@dataclass
class PrefixStats:
    """The prefix cache's counters since the model was loaded (`kv_prefix_stats`)."""

    lookups: int = 0  # kv_reuse calls
    hits: int = 0  # lookups that reused at least one cached token
    reused_tokens: int = 0  # tokens taken from the cache instead of computed
    missed_tokens: int = 0  # prompt tokens the lookups left to compute
    misses: dict = field(default_factory=dict)  # reason (MISS_*) -> lookups that stopped there
    cached_tokens: int = 0  # tokens the cache holds now (blocks found by the index)
    evicted_blocks: int = 0
    disk_bytes_written: int = 0
    disk_bytes_read: int = 0
    disk_tokens_loaded: int = 0


@dataclass(frozen=True)
class Capabilities:
    """What a model runs in one forward, so a scheduler plans for it instead of trying:
    `unified_forward` (decode steps and prefill chunks mixed), `batched_decode` (`decode_batch`)
    and `batched_verify` (`verify_batch` over several sequences at once, not per item)."""

    unified_forward: bool
    batched_decode: bool
    batched_verify: bool


@dataclass(frozen=True)
class DecodeItem:
    """One sequence's next token in a batched decode: `token` sits at position `pos`."""

    cache_id: str
    token: Token
    pos: int


@dataclass(frozen=True)
class ForwardItem:
    """One sequence's part of a mixed batch: a decode step or a prefill chunk.

    `pos_offset` is the absolute KV position of `tokens[0]`. Logits come back only for
    items with `is_final=True` (a decode step or the last chunk of a prefill).
    """

    cache_id: str
    tokens: Sequence[int]
    pos_offset: int
    is_final: bool = True


def is_token_id(value) -> bool:
    """A whole number (int or a numpy integer); `True` and `False` are not token ids."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def host_tokens(cache_id: str, tokens) -> list:
    """The ids a prompt-like argument (`prefill`, `forward_verify`, a `ForwardItem`) passes,
    as a list; `check_call` checks each. A string or a single value is refused here, before
    `list()` would split it into characters or fail with a `TypeError`."""
    if isinstance(tokens, list):
        return tokens
    if not isinstance(tokens, (str, bytes)) and isinstance(tokens, Iterable):
        try:
            return list(tokens)
        except TypeError:  # iterable in type only (a 0-d numpy array)
            pass
    raise FerrumError(
        f"the tokens of sequence {cache_id!r} must be a list of token ids, not {type(tokens).__name__}; "
        "encode the text with this model's tokenizer"
    )


def token_count(tokens) -> int:
    """How many tokens a call passes: one id, a sequence of ids, or a device array of them."""
    if isinstance(tokens, numbers.Integral):
        return 1
    size = getattr(tokens, "size", None)  # mx.array / torch.Tensor (a method on torch)
    if size is not None and not isinstance(tokens, Sequence):
        return int(tokens.numel()) if callable(size) else int(size)
    return len(tokens)


KV_CAPACITY_ENV = "FERRUM_KV_CAPACITY"  # named in messages: where a user raises the capacity


def clamp_kv_capacity(wanted: int | None, model_max: int) -> int:
    """The KV capacity a caller asked for (None: no cap) clamped to the model's maximum."""
    if wanted is None:
        return model_max
    if not is_token_id(wanted) or wanted <= 0:
        raise FerrumError(
            f"a KV capacity of {wanted!r} tokens is not positive; set {KV_CAPACITY_ENV} to a token count like 8192"
        )
    return min(int(wanted), model_max)


KV_MEMORY_SHARE = 0.8  # of the memory free after loading that one sequence's cache may plan on


def kv_capacity_within(
    config: LlmRuntimeConfig, free_bytes: int, bytes_per_element: int, wanted: int | None = None
) -> int:
    """`kv_capacity()`: the capacity asked for (`wanted`, None: no cap), the model's maximum and
    what free memory allows."""
    by_memory = int(free_bytes * KV_MEMORY_SHARE) // config.kv_bytes_per_token(bytes_per_element)
    return max(1, min(clamp_kv_capacity(wanted, config.max_seq_len), by_memory))


class DecoderOnlyLLM(abc.ABC):
    """A decoder-only language model that owns the KV caches of its sequences."""

    # -- required -------------------------------------------------------------------

    @property
    @abc.abstractmethod
    def config(self) -> LlmRuntimeConfig:
        """Runtime-facing configuration."""

    @abc.abstractmethod
    def prefill(self, cache_id: str, tokens: Sequence[int]) -> Logits:
        """Append `tokens` to the cache (created if new); return `[vocab]` logits of the last one."""

    @abc.abstractmethod
    def decode(self, cache_id: str, token: Token, pos: int) -> Logits:
        """Append one token at position `pos`; return `[vocab]` logits for the next step."""

    @abc.abstractmethod
    def release(self, cache_id: str) -> None:
        """Free the cache of a finished sequence. Idempotent; unknown ids are ignored."""

    @abc.abstractmethod
    def kv_len(self, cache_id: str) -> int:
        """Tokens held in the cache of `cache_id` (0 when it has none)."""

    # -- provided ------------------------------------------------------------------

    def prepare(self, cache_id: str, max_tokens: int) -> None:
        """Allocate `cache_id`'s cache for `max_tokens` and warm the kernels up. Changes no logits."""

    def kv_capacity(self) -> int:
        """Most tokens any one cache may hold; callers check it before they extend a sequence."""
        return self.config.max_seq_len

    def kv_free_tokens(self) -> int | None:
        """How many more KV tokens, over all sequences together, free memory holds; None when unknown."""
        return None

    def kv_allocated_tokens(self) -> int | None:
        """Token positions the KV buffers hold now, used or not; None when unknown."""
        return None

    def kv_used_tokens(self) -> int | None:
        """Tokens the live caches hold now (every `kv_len` together); None when unknown."""
        return None

    def kv_tokens_for(self, lengths: Sequence[int]) -> int:
        """Token positions the KV buffers would hold with sequences of `lengths` live at once:
        what admitting them costs. The default is their sum (a cache per sequence, sized to
        it); a pool whose buffers are shared (every slot as long as the longest) says more."""
        return sum(lengths)

    def kv_reuse(self, cache_id: str, tokens: Sequence[int]) -> PrefixReuse:
        """Start `cache_id` on the prompt `tokens` without computing what is cached: it takes
        the longest cached prefix of `tokens` that is longer than what it holds, always leaving
        the last token to compute (its logits are the next step's). The caller then prefills
        `tokens[result.tokens:]`.

        `cache_id` must hold nothing or a prefix of `tokens` (truncate it to the common part
        first). Changes no logits: the same tokens give the same keys and values."""
        held = self.kv_len(cache_id)
        return PrefixReuse(held, 0, None if held >= len(tokens) - 1 else MISS_OFF)

    def kv_remember(self, cache_id: str, tokens: Sequence[int]) -> None:
        """Say that `cache_id`'s first `len(tokens)` positions hold `tokens` (at most
        `kv_len`), so a later `kv_reuse` of any sequence may share them; they stay cached
        after a release until memory is needed. Call it after a prompt is prefilled (two
        requests in flight share it) and before a release (an answer is kept too)."""

    def kv_prefix_stats(self) -> PrefixStats | None:
        """The prefix cache's counters, or None when the backend keeps no prefix cache."""
        return None

    def decode_batch(self, items: Sequence[DecodeItem]) -> Logits:
        """One decode step for each item; returns `[len(items), vocab]` logits in item order.
        An empty `items` raises `FerrumError` (there is no empty logits array to return)."""
        raise UnsupportedError(f"{type(self).__name__} has no batched decode; call decode() per sequence")

    def forward_verify(self, cache_id: str, tokens: Sequence[int]) -> Logits:
        """Append `tokens` in one forward; return `[len(tokens), vocab]` logits, one row per position."""
        raise UnsupportedError(f"{type(self).__name__} has no multi-token verify; call decode() per token")

    def verify_batch(self, items: Sequence[ForwardItem]) -> list[Logits]:
        """Append each item's tokens (at `pos_offset`, where its cache ends) in one forward;
        return each item's `[len(tokens), vocab]` logits, one row per token. Speculative
        verifies of several sequences, and plain decode steps (items of one token), batched
        together. The default runs `forward_verify` per item."""
        if not items:
            raise FerrumError("verify_batch needs at least one item")
        return [self.forward_verify(it.cache_id, it.tokens) for it in items]

    def unified_forward(self, items: Sequence[ForwardItem]) -> list[Logits | None]:
        """One forward over decode steps and prefill chunks; `[vocab]` logits for final items, else None.
        An empty `items` raises `FerrumError`."""
        raise UnsupportedError(f"{type(self).__name__} has no unified forward; use prefill() and decode_batch()")

    def truncate_kv(self, cache_id: str, new_len: int) -> None:
        """Drop every cached position from `new_len` on."""
        raise UnsupportedError(f"{type(self).__name__} cannot truncate its KV cache")

    def reset(self) -> None:
        """Drop all cached state."""

    @property
    def capabilities(self) -> Capabilities:
        """What this model runs batched: by default, the batched methods its class overrides."""
        cls = type(self)
        return Capabilities(
            unified_forward=cls.unified_forward is not DecoderOnlyLLM.unified_forward,
            batched_decode=cls.decode_batch is not DecoderOnlyLLM.decode_batch,
            batched_verify=cls.verify_batch is not DecoderOnlyLLM.verify_batch,
        )

    def sampler(self, params: Any, context: Sequence[int] = ()) -> Any:
        """A sampler for one answer (see `ferrum_mac.engine.sampling.Sampler`): `sample(logits)`
        picks a token on the device without waiting, `read(token)` brings its id to the host.
        `params` is the engine's SamplingParams, read by field name; `context` holds the ids
        already in the sequence, which the penalties look back over."""
        raise UnsupportedError(f"{type(self).__name__} has no sampler; use a backend that provides one (mlx)")

    # -- helpers for implementations --------------------------------------------------

    device_array_types: tuple[type, ...] = ()  # the backend's device arrays, taken as lazy tokens

    def check_call(self, segments: Sequence[tuple[str, Any, int]]) -> None:
        """Validate the (cache_id, tokens, offset) parts of one call before any state changes:
        each one's host token ids (`check_token_ids`), then the segments (`check_segments`)."""
        for cache_id, tokens, _ in segments:
            self.check_token_ids(cache_id, tokens)
        self.check_segments([(cache_id, token_count(tokens), offset) for cache_id, tokens, offset in segments])

    def check_segments(self, segments: Sequence[tuple[str, int, int]]) -> None:
        """Validate the (cache_id, n_tokens, offset) parts of one call before any state changes:
        at least one, tokens given, each sequence once, positions that continue its cache, room in it."""
        if not segments:
            raise FerrumError("the call names no sequence; pass at least one item")
        seen = set()
        for cache_id, n, offset in segments:
            if n < 1:
                raise FerrumError(f"no tokens given for sequence {cache_id!r}; pass at least one token")
            if not is_token_id(offset):
                raise FerrumError(
                    f"the position {offset!r} of sequence {cache_id!r} is not a whole number; pass kv_len()"
                )
            if cache_id in seen:
                raise CacheStateError(f"sequence {cache_id!r} appears twice in one batch; give each sequence one item")
            seen.add(cache_id)
            held = self.kv_len(cache_id)
            if offset != held:
                raise CacheStateError(
                    f"sequence {cache_id!r} holds {held} tokens but the call places its token(s) at position {offset}; "
                    "positions must continue the cache (truncate_kv first to rewrite it)"
                )
            self.check_capacity(cache_id, offset + n)

    def check_token_ids(self, cache_id: str, tokens) -> None:
        """Refuse host ids that are not whole numbers or lie outside the vocabulary (an
        embedding lookup past its end may crash). A device array (`device_array_types`, a
        sampled token) is not read, which would wait for it: the backend clips it instead."""
        if isinstance(tokens, self.device_array_types):
            return
        ids = [tokens] if is_token_id(tokens) else host_tokens(cache_id, tokens)
        if not set(map(type, ids)) <= {int} and not all(map(is_token_id, ids)):  # (plain ints: the fast test)
            wrong = next(t for t in ids if not is_token_id(t))
            raise FerrumError(
                f"token {wrong!r:.40} of sequence {cache_id!r} is not a token id (a whole number); "
                "encode the text with this model's tokenizer"
            )
        vocab = self.config.vocab_size
        if ids and not (0 <= min(ids) and max(ids) < vocab):
            bad = next(int(t) for t in ids if not 0 <= t < vocab)
            raise FerrumError(
                f"token id {bad} of sequence {cache_id!r} is outside the vocabulary (0 to {vocab - 1}); "
                "encode the text with this model's tokenizer"
            )

    def check_capacity(self, cache_id: str, new_len: int) -> None:
        """Raise `KvCapacityError` if `cache_id` would hold more than `kv_capacity()` tokens."""
        capacity = self.kv_capacity()
        if new_len > capacity:
            raise KvCapacityError(
                f"sequence {cache_id!r} would hold {new_len} tokens but the KV capacity is {capacity}; "
                f"shorten the prompt, truncate the conversation or raise {KV_CAPACITY_ENV}",
                needed=new_len,
                capacity=capacity,
            )
