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

Sequence state: what a model's sequences hold (each layer's keys and values, or whatever
else its kind of state is) is kept by its state manager, `model.state` (`ferrum_mac.sequence_state`):
lengths, prefix reuse, remembering, truncation and release, and the memory they take. The
model keeps the seed's methods; `truncate_kv` and `release` go to the manager.

Positions: a sequence holds `state.length(cache_id)` tokens; `decode(..., pos)` and
`ForwardItem.pos_offset` must equal that length (the token goes right after what is
cached). To rewrite history, `truncate_kv` first.
"""

from __future__ import annotations

import abc
import numbers
from dataclasses import dataclass
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
from ferrum_mac.sequence_state import (  # noqa: F401  (re-exported: the contract's state types)
    MISS_CHANGED,
    MISS_EVICTED,
    MISS_NO_PREFIX,
    MISS_OFF,
    MISS_OTHER_MODEL,
    MISS_RECURRENT,
    MISS_WINDOW,
    FULL_ATTENTION,
    RECURRENT,
    Recurrent,
    CountingState,
    LayerKind,
    PrefixReuse,
    PrefixStats,
    SlidingWindow,
    StateManager,
    every_layer_full,
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
    layer_kinds: tuple[LayerKind, ...] = ()  # what each layer keeps for a sequence (`sequence_state`)

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
            layer_kinds=layer_kinds_of(c),
        )

    def kv_bytes_per_token(self, bytes_per_element: int = 2) -> int:
        """Keys and values of one token in every layer that keeps them (a recurrent layer keeps none)."""
        layers = self.num_layers - sum(isinstance(kind, Recurrent) for kind in self.layer_kinds)
        return 2 * layers * self.num_kv_heads * self.head_dim * bytes_per_element


def layer_kinds_of(c) -> tuple[LayerKind, ...]:
    """Each layer's kind from a `ModelConfig`: a recurrent state for a linear-attention layer,
    a sliding window where it names one, else full attention."""
    windows = tuple(getattr(c, "layer_windows", ())) or (0,) * c.num_layers
    recurrent: frozenset[int] = getattr(c, "recurrent_layers", frozenset())
    return tuple(
        RECURRENT if i in recurrent else SlidingWindow(w) if w else FULL_ATTENTION for i, w in enumerate(windows)
    )


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


def room_advice(capacity: int, model_max: int) -> str:
    """What can give a sequence more room: raising the capacity only while it is below the
    model's own maximum (the setting is clamped to it); past that, only less text."""
    if capacity >= model_max:
        return (
            f"{model_max} tokens is this model's own maximum: shorten the prompt, truncate the conversation "
            "or use a model with a longer context"
        )
    return (
        f"shorten the prompt, truncate the conversation or raise --kv-capacity / {KV_CAPACITY_ENV} "
        f"(this model takes up to {model_max} tokens, as free memory allows)"
    )


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
    """A decoder-only language model; what its sequences hold is kept by its state manager (`state`)."""

    device_array_types: tuple[type, ...] = ()  # the backend's device arrays, taken as lazy tokens

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

    # -- provided ------------------------------------------------------------------

    @property
    def state(self) -> StateManager:
        """The manager of what this model's sequences hold (`ferrum_mac.sequence_state`). A
        backend sets `_state`; without one, a `CountingState` that the model advances."""
        state = vars(self).get("_state")
        if state is None:
            state = self._state = CountingState(self.config.layer_kinds)
        return state

    def release(self, cache_id: str) -> None:
        """Free the cache of a finished sequence. Idempotent; unknown ids are ignored."""
        self.state.release(cache_id)

    def truncate_kv(self, cache_id: str, new_len: int) -> None:
        """Drop every cached position from `new_len` on."""
        self.state.truncate(cache_id, new_len)

    def prepare(self, cache_id: str, max_tokens: int) -> None:
        """Allocate `cache_id`'s cache for `max_tokens` and warm the kernels up. Changes no logits."""

    def kv_capacity(self) -> int:
        """Most tokens any one cache may hold; callers check it before they extend a sequence."""
        return self.config.max_seq_len

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

    def reset(self) -> None:
        """Drop all cached state."""
        self.state.reset()

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


# -- checks for implementations: every call is checked before any state changes ------------


def check_call(model: DecoderOnlyLLM, segments: Sequence[tuple[str, Any, int]]) -> None:
    """Validate the (cache_id, tokens, offset) parts of one call to `model` before any state
    changes: each one's host token ids (`check_token_ids`), then the segments (`check_segments`)."""
    vocab, device_types = model.config.vocab_size, model.device_array_types
    for cache_id, tokens, _ in segments:
        check_token_ids(cache_id, tokens, vocab, device_types)
    check_segments(model, [(cache_id, token_count(tokens), offset) for cache_id, tokens, offset in segments])


def check_segments(model: DecoderOnlyLLM, segments: Sequence[tuple[str, int, int]]) -> None:
    """Validate the (cache_id, n_tokens, offset) parts of one call before any state changes:
    at least one, tokens given, each sequence once, positions that continue its cache, room in it."""
    if not segments:
        raise FerrumError("the call names no sequence; pass at least one item")
    state, capacity = model.state, model.kv_capacity()
    seen = set()
    for cache_id, n, offset in segments:
        if n < 1:
            raise FerrumError(f"no tokens given for sequence {cache_id!r}; pass at least one token")
        if not is_token_id(offset):
            raise FerrumError(
                f"the position {offset!r} of sequence {cache_id!r} is not a whole number; pass state.length()"
            )
        if cache_id in seen:
            raise CacheStateError(f"sequence {cache_id!r} appears twice in one batch; give each sequence one item")
        seen.add(cache_id)
        held = state.length(cache_id)
        if offset != held:
            raise CacheStateError(
                f"sequence {cache_id!r} holds {held} tokens but the call places its token(s) at position {offset}; "
                "positions must continue the cache (truncate_kv first to rewrite it)"
            )
        check_capacity(cache_id, offset + n, capacity, model.config.max_seq_len)


def check_token_ids(cache_id: str, tokens, vocab: int, device_types: tuple[type, ...] = ()) -> None:
    """Refuse host ids that are not whole numbers or lie outside the vocabulary of `vocab` ids
    (an embedding lookup past its end may crash). A device array (one of `device_types`, a
    sampled token) is not read, which would wait for it: the backend clips it instead."""
    if isinstance(tokens, device_types):
        return
    ids = [tokens] if is_token_id(tokens) else host_tokens(cache_id, tokens)
    if not set(map(type, ids)) <= {int} and not all(map(is_token_id, ids)):  # (plain ints: the fast test)
        wrong = next(t for t in ids if not is_token_id(t))
        raise FerrumError(
            f"token {wrong!r:.40} of sequence {cache_id!r} is not a token id (a whole number); "
            "encode the text with this model's tokenizer"
        )
    if ids and not (0 <= min(ids) and max(ids) < vocab):
        bad = next(int(t) for t in ids if not 0 <= t < vocab)
        raise FerrumError(
            f"token id {bad} of sequence {cache_id!r} is outside the vocabulary (0 to {vocab - 1}); "
            "encode the text with this model's tokenizer"
        )


def check_capacity(cache_id: str, new_len: int, capacity: int, model_max: int) -> None:
    """Raise `KvCapacityError` if `cache_id` would hold more than `capacity` tokens."""
    if new_len > capacity:
        raise KvCapacityError(
            f"sequence {cache_id!r} would hold {new_len} tokens but the KV capacity is {capacity}; "
            + room_advice(capacity, model_max),
            needed=new_len,
            capacity=capacity,
        )
