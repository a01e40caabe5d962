"""Proposers: cheap guesses of the next tokens, behind one interface.

A proposer sees the sequence so far (prompt and answer, host ids) and returns up to k tokens
it expects next, with a `kind` the controller keeps acceptance figures under (a prompt-lookup
match of 3 tokens is a better bet than one of 1). A third kind (the target's own early
layers, an MTP head) plugs in the same way.

Proposals are deterministic given the sequence (prompt lookup copies, the draft model decodes
greedily), so the proposal distribution q is one-hot and the standard rejection rule reduces
to "keep a guess when the target's own sample equals it" (`verify.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from ferrum_mac.engine.context import common_prefix
from ferrum_mac.engine.sampling import SamplingParams
from ferrum_mac.llm import DecoderOnlyLLM

MAX_NGRAM = 3  # prompt lookup matches the last 3, 2, then 1 tokens
LONG_MATCH = 8  # a match this long is a passage being copied (the "copy" kind)
PLACES_KEPT = 4  # latest occurrences of each n-gram the index keeps


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]
    kind: str  # what the controller tracks acceptance under: "ngram3", "ngram1", "draft"


class Proposer(Protocol):
    def peek(self, history: Sequence[int]) -> str | None:
        """The kind of proposal `propose` would make now (None: none), without building it."""
        ...

    def propose(self, history: Sequence[int], k: int) -> Proposal | None:
        """Up to `k` tokens expected to follow `history`; None when there is no guess."""
        ...

    def close(self) -> None:
        """Free what the proposer holds (a draft model's cache)."""
        ...


class PromptLookup:
    """N-gram matching over the sequence itself: find an earlier place where the last n tokens
    (n = 3, then 2, then 1) occurred and propose what followed them there.

    Of the recent places a 3-token match occurred, the one whose match reaches furthest back
    wins (a passage being copied, rather than a common phrase), the latest among equals. A
    match of LONG_MATCH tokens or more is its own kind ("copy"): there the guesses are nearly
    always right, and the controller learns that apart from the short matches.

    The index maps each n-gram to the positions just after its latest occurrences; it grows
    with the sequence, one token at a time, so a lookup costs the same at any length.
    """

    def __init__(self, max_ngram: int = MAX_NGRAM):
        self.max_ngram = max_ngram
        self.index: dict[tuple[int, ...], list[int]] = {}
        self.indexed = 0  # n-grams ending before this position are in the index

    def peek(self, history: Sequence[int]) -> str | None:
        found = self._match(history)
        return found[0] if found else None

    def propose(self, history: Sequence[int], k: int) -> Proposal | None:
        found = self._match(history)
        if found is None or k < 1:
            return None
        kind, follows = found
        tokens = list(history[follows : follows + k])
        return Proposal(tokens, kind) if tokens else None

    def close(self) -> None:
        pass

    def behind(self, history: Sequence[int]) -> int:
        """Positions of `history` the index has yet to take in (a lookup takes them all first)."""
        if len(history) < self.indexed:  # a different sequence: all of it
            return len(history)
        return max(0, len(history) - 1 - self.indexed)

    def index_some(self, history: Sequence[int], most: int) -> None:
        """Take in at most `most` more positions of `history`: a caller serving other streams
        indexes a long prompt a slice at a time rather than in one lookup."""
        if len(history) < self.indexed:
            self.index, self.indexed = {}, 0
        self._index_until(history, min(len(history) - 1, self.indexed + most))

    def _match(self, history: Sequence[int]) -> tuple[str, int] | None:
        """(kind, where the continuation starts) for the longest n-gram ending the sequence
        that occurred before, or None."""
        if len(history) < self.indexed:  # a different sequence: start over
            self.index, self.indexed = {}, 0
        self._index_until(history, len(history) - 1)
        for n in range(min(self.max_ngram, len(history) - 1), 0, -1):
            places = self.index.get(tuple(history[-n:]))
            if not places:
                continue
            if n < self.max_ngram:
                return f"ngram{n}", places[-1]
            length, follows = max((_match_length(history, at), at) for at in places)
            return ("copy" if length >= LONG_MATCH else f"ngram{n}"), follows
        return None

    def _index_until(self, history: Sequence[int], end: int) -> None:
        """Index the n-grams ending before position `end` (not the last token's: a match must
        be an earlier occurrence, with something after it)."""
        for stop in range(self.indexed + 1, end + 1):
            for n in range(1, min(self.max_ngram, stop) + 1):
                places = self.index.setdefault(tuple(history[stop - n : stop]), [])
                places.append(stop)
                if len(places) > PLACES_KEPT:
                    del places[0]
        self.indexed = max(self.indexed, end)


def _match_length(history: Sequence[int], follows: int) -> int:
    """How many tokens before `follows` equal the sequence's last ones (at most LONG_MATCH)."""
    length, end = 0, len(history)
    while length < LONG_MATCH and length < follows and history[follows - 1 - length] == history[end - 1 - length]:
        length += 1
    return length


class DraftModel:
    """A small model with the target's vocabulary guesses by decoding greedily.

    Its cache (`cache_id`) is kept in step with the sequence: before each proposal it is cut
    back to what it shares with the sequence (guesses the target rejected go) and the rest
    (the tokens the target accepted or sampled) is prefilled. The prefix cache lets a new
    answer start from what the draft computed for the last one.
    """

    def __init__(self, model: DecoderOnlyLLM, cache_id: str, vocab_size: int):
        self.model = model
        self.cache_id = cache_id
        self.vocab_size = vocab_size  # the target's: a draft's padded vocabulary may be wider
        self.sampler = model.sampler(SamplingParams(temperature=0.0, repetition_penalty=1.0))
        self.ledger: list[int] = []  # the ids the draft's cache holds

    def peek(self, history: Sequence[int]) -> str | None:
        return "draft" if len(history) + 1 < self.model.kv_capacity() else None

    def propose(self, history: Sequence[int], k: int) -> Proposal | None:
        k = min(k, self.model.kv_capacity() - len(history))
        if k < 1 or not history:
            return None
        logits = self._catch_up(history)
        tokens: list[int] = []
        while True:
            token = self.sampler.read(self.sampler.sample(logits))
            if token >= self.vocab_size:  # no id of the target's
                return Proposal(tokens, "draft") if tokens else None
            tokens.append(token)
            if len(tokens) == k:
                return Proposal(tokens, "draft")
            logits = self.model.decode(self.cache_id, tokens[-1], len(self.ledger))
            self.ledger.append(tokens[-1])

    def close(self) -> None:
        self.model.state.remember(self.cache_id, self.ledger)
        self.model.release(self.cache_id)
        self.ledger = []

    def _catch_up(self, history: Sequence[int]):
        """Bring the draft's cache to `history` and return its logits after the last token."""
        keep = min(common_prefix(self.ledger, history), len(history) - 1)
        if keep < len(self.ledger):
            self.model.truncate_kv(self.cache_id, keep)
        if keep == 0:
            keep = self.model.state.reuse(self.cache_id, list(history)).tokens
        logits = self.model.prefill(self.cache_id, list(history[keep:]))
        self.ledger = list(history)
        return logits
